"""Sampling text from a kiln model (`kiln generate`): prefill the prompt, then decode token by
token with the model's key/value cache (training.model.init_cache / decode_step), in one
compiled loop.

Each new token is drawn from softmax(logits / temperature), restricted to the smallest set of
most likely tokens whose probabilities add up to at least `top_p` (nucleus sampling, Holtzman
et al. 2020). Randomness comes from one PRNG key made from the seed, folded with the token's
index, so the same seed, prompt and settings give the same text. Temperature 0 is greedy: the
argmax at every step, no randomness.

Models: a train, SFT or DPO output folder (`model.json`, `params.safetensors`; the tokenizer is
found through its lineage, or given), or an export folder (Hugging Face layout: `config.json`,
`model.safetensors`, `tokenizer.json`). No Prefect here.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from training.config import ModelConfig
from training.model import decode_step, init_cache


@dataclass(frozen=True)
class Model:
    """What generation needs: the config and parameters, the tokenizer and its EOS/BOS ids."""

    cfg: ModelConfig
    params: dict
    tokenizer: Tokenizer
    eos_id: int
    bos_id: int | None = None


def sample(model: Model, prompt: list[int], max_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
           seed: int = 0, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """Up to `max_tokens` new token ids after `prompt`, ending before EOS or any of `stop_ids`.

    The prompt is cut from the left to leave room for `max_tokens` in the model's context."""
    T = model.cfg.seq_len
    if not 0 < max_tokens < T:
        raise ValueError(f"max_tokens={max_tokens} must be between 1 and the model's context of {T} tokens "
                         "minus one (the prompt needs at least one)")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature={temperature} must be >= 0 and top_p={top_p} in (0, 1]")
    prompt = (list(prompt) or [model.eos_id if model.bos_id is None else model.bos_id])[-(T - max_tokens):]
    ids = _sample_ids(model.params, jnp.asarray([prompt], jnp.int32), jax.random.PRNGKey(seed),
                      jnp.float32(temperature), jnp.float32(top_p), cfg=model.cfg, max_tokens=max_tokens)
    out = np.asarray(ids).tolist()
    stops = {model.eos_id, *stop_ids}
    return out[:next((i for i, t in enumerate(out) if t in stops), len(out))]


@functools.partial(jax.jit, static_argnames=("cfg", "max_tokens"))
def _sample_ids(params, prompt, key, temperature, top_p, *, cfg: ModelConfig, max_tokens: int):
    """prompt [1, P] -> [max_tokens] sampled ids: one prefill, then a scan of single-token steps."""
    P = prompt.shape[1]
    cache = init_cache(cfg, 1, P + max_tokens)
    logits, cache = decode_step(params, cfg, prompt, cache, jnp.arange(P, dtype=jnp.int32)[None])

    def step(carry, i):
        logits, pos, cache = carry  # logits [1, V]: the distribution of the token at `pos`
        token = pick(logits, jax.random.fold_in(key, i), temperature, top_p)
        logits, cache = decode_step(params, cfg, token[:, None], cache, pos[:, None])
        return (logits[:, 0], pos + 1, cache), token[0]

    _, ids = jax.lax.scan(step, (logits[:, -1], jnp.full((1,), P, jnp.int32), cache), jnp.arange(max_tokens))
    return ids


def pick(logits, key, temperature, top_p):
    """One token per row of logits [B, V]: the argmax at temperature 0, else a draw from the
    temperature-scaled distribution cut to its top-p nucleus."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    probs = jax.nn.softmax(scaled, axis=-1)
    order = jnp.argsort(-probs, axis=-1)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass of the more likely tokens
    keep_sorted = before < top_p  # the most likely token is always kept
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    drawn = jax.random.categorical(key, jnp.where(keep, scaled, -jnp.inf), axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


def generate(model: Model, prompt: str, max_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
             seed: int = 0, chat: bool = False) -> str:
    """The text sampled after `prompt`. With `chat`, the prompt is one user message in the chat
    template (training/posttrain.py), the answer starts after the assistant token and ends at
    the end-of-turn token. Without, the prompt continues a document (EOS/BOS before it, as
    between training documents)."""
    start = model.eos_id if model.bos_id is None else model.bos_id
    stop_ids: tuple[int, ...] = ()
    if chat:
        from training.posttrain import END_OF_TURN, ChatTemplate

        ids, _ = ChatTemplate(model.tokenizer).encode([{"role": "user", "content": prompt}], add_generation_prompt=True)
        stop_ids = (model.tokenizer.token_to_id(END_OF_TURN),)
    else:
        tok = Tokenizer.from_str(model.tokenizer.to_str())
        tok.encode_special_tokens = True  # special-token strings in the prompt stay text, as in training
        ids = tok.encode(prompt, add_special_tokens=False).ids
    out = sample(model, [start, *ids], max_tokens, temperature, top_p, seed, stop_ids)
    return model.tokenizer.decode(out, skip_special_tokens=False)


# --- loading a model folder ------------------------------------------------------------------


def load(path: Path, tokenizer_dir: Path | None = None) -> Model:
    """A train/SFT/DPO output folder or an export folder, with its tokenizer."""
    path = Path(path)
    if (path / "model.json").is_file():
        from training.loop import load_model

        cfg, params = load_model(path)
        folder = Path(tokenizer_dir) if tokenizer_dir is not None else tokenizer_of(path)
        from tasks.tokenizer import load_tokenizer, read_tokenizer_meta

        meta = read_tokenizer_meta(folder)
        return Model(cfg, params, load_tokenizer(folder), meta["eos_id"], meta.get("bos_id"))
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return load_export(path)
    raise FileNotFoundError(f"{path} is neither a training output (model.json, params.safetensors) nor an "
                            "export (config.json, model.safetensors): point at <store>/train|sft|dpo|export/<version>")


def tokenizer_of(model_dir: Path) -> Path:
    """The tokenizer step output a training output was made with, found through lineage.json:
    an input named `tokenizer` (SFT, DPO), or the tokenizer upstream of its tokens (train)."""
    store_root = Path(model_dir).resolve().parent.parent
    pending, seen = [Path(model_dir).resolve()], set()
    while pending:
        folder = pending.pop(0)
        lineage = folder / "lineage.json"
        if folder in seen or not lineage.is_file():
            continue
        seen.add(folder)
        for inp in json.loads(lineage.read_text())["inputs"]:
            child = store_root / inp["stage"] / inp["version"]
            if inp["stage"] == "tokenizer" and child.is_dir():
                return child
            pending.append(child)
    raise FileNotFoundError(f"no tokenizer step output found upstream of {model_dir} (through lineage.json in "
                            f"{store_root}): pass the tokenizer folder with --tokenizer")


def load_export(folder: Path) -> Model:
    """An export folder (training/export.py's Hugging Face layout) back as kiln's model."""
    from safetensors.numpy import load_file

    hf = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig(vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
                      n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_key_value_heads"],
                      d_ff=hf["intermediate_size"], seq_len=hf["max_position_embeddings"],
                      rope_theta=hf["rope_theta"], tie_embeddings=hf["tie_word_embeddings"],
                      norm_eps=hf["rms_norm_eps"], init_std=hf.get("initializer_range", 0.02))
    w = load_file(str(folder / "model.safetensors"))
    params: dict = {"embed_tokens": {"embedding": w["model.embed_tokens.weight"]},
                    "norm": {"weight": w["model.norm.weight"]}}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}"
        params[f"layers_{i}"] = {
            "input_layernorm": {"weight": w[f"{p}.input_layernorm.weight"]},
            "post_attention_layernorm": {"weight": w[f"{p}.post_attention_layernorm.weight"]},
            "self_attn": {n: {"kernel": w[f"{p}.self_attn.{n}.weight"].T} for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
            "mlp": {n: {"kernel": w[f"{p}.mlp.{n}.weight"].T} for n in ("gate_proj", "up_proj", "down_proj")},
        }
    if not cfg.tie_embeddings:
        params["lm_head"] = {"kernel": w["lm_head.weight"].T}
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(np.ascontiguousarray(a)), params)
    return Model(cfg, params, Tokenizer.from_file(str(folder / "tokenizer.json")), hf["eos_token_id"],
                 hf.get("bos_token_id"))
