"""LoRA (Hu et al. 2021): train a low-rank update of some projections and leave the model as it was.

For each targeted projection kernel W [in, out] of every layer the train state holds two adapter
matrices, A [in, rank] and B [rank, out], and the model the loss sees is W + (alpha / rank) A B.
A starts random and B at zero, so training starts from the base model exactly. Only the adapters
have gradients and optimizer state (`train.lora`, training/step.py): the base parameters are
the state's `params`, never updated, and the adapters its `adapters`. The published model is
the merged one (a plain model folder, which evaluation, generation and export read as any); the
adapters alone go beside it (`lora/`) and export as a `peft` adapter folder (training/export.py).

DPO's reference model is the base: its log-probabilities are computed once before training from
the starting model (training/posttrain.py), so no second copy of the parameters is held.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from training.config import LoraConfig, ModelConfig
from training.export import ATTENTION  # the projections under layers_<i>/self_attn; the others are under mlp


def target_paths(model_cfg: ModelConfig, cfg: LoraConfig) -> list[tuple[str, str, str]]:
    """(layer, block, projection) of every kernel the adapters change, in a fixed order."""
    return [(f"layers_{i}", "self_attn" if t in ATTENTION else "mlp", t)
            for i in range(model_cfg.n_layers) for t in cfg.targets]


def init_adapters(params: dict, model_cfg: ModelConfig, cfg: LoraConfig, key: jax.Array) -> dict:
    """A ~ N(0, 1/in) and B = 0 for each target: {layer: {block: {proj: {"a", "b"}}}}, float32."""
    adapters: dict = {}
    for i, (layer, block, proj) in enumerate(target_paths(model_cfg, cfg)):
        d_in, d_out = params[layer][block][proj]["kernel"].shape
        a = jax.random.normal(jax.random.fold_in(key, i), (d_in, cfg.rank), jnp.float32) / jnp.sqrt(d_in)
        adapters.setdefault(layer, {}).setdefault(block, {})[proj] = {
            "a": a, "b": jnp.zeros((cfg.rank, d_out), jnp.float32)}
    return adapters


def merged(params: dict, adapters: dict, cfg: LoraConfig) -> dict:
    """The base parameters with every adapter's update added to its kernel: W + (alpha/rank) A B."""
    scale = cfg.alpha / cfg.rank
    out = dict(params)
    for layer, blocks in adapters.items():
        out[layer] = dict(out[layer])
        for block, projs in blocks.items():
            out[layer][block] = dict(out[layer][block])
            for proj, ab in projs.items():
                kernel = params[layer][block][proj]["kernel"]
                out[layer][block][proj] = {**params[layer][block][proj],
                                           "kernel": kernel + scale * (ab["a"] @ ab["b"]).astype(kernel.dtype)}
    return out
