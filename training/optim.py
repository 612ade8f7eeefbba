"""The optimizer: AdamW, or Muon for the decoder blocks' matrices, behind global-norm clipping,
with warmup then cosine or WSD decay.

Weight decay applies to matrices only (ndim >= 2: projections and embeddings); decaying norm
gains towards zero would fight the normalisation they exist to undo.

Muon (Jordan et al. 2024; at scale, Liu et al. 2025, "Muon is Scalable for LLM Training") updates a
matrix by its momentum orthogonalised (five Newton-Schulz iterations: every singular value
near 1), scaled by 0.2 * sqrt(max(fan_in, fan_out)) so that the update's RMS is AdamW's typical
one and AdamW's learning rate and weight decay carry over (the paper's "consistent RMS"). It is
for the hidden matrices only: the embedding, the output layer, norms and biases keep AdamW, as
in every Muon recipe.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from training.config import TrainConfig
from training.sharding import path_names


def lr_schedule(cfg: TrainConfig):
    """step -> learning rate: linear warmup over `warmup` steps, then

    cosine: half a cosine from lr down to lr * min_lr_ratio at the last step;
    wsd (warmup-stable-decay): constant lr, then a decay to lr * min_lr_ratio over the last
    `decay_fraction` of the steps, or the last `decay_steps` (so a run can be extended, or
    cooled down, from a stable-phase checkpoint): linear, or with `decay_shape` sqrt falling
    as 1 - sqrt of its progress.
    The steps are `schedule_steps` when set (a phase of a longer run), else `steps`.
    """
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    steps = cfg.schedule_steps or cfg.steps  # a first phase of a longer run spans the whole run
    decay = cfg.decay_steps or max(1, round(cfg.decay_fraction * steps))
    decay_start = cfg.warmup if cfg.schedule == "cosine" else steps - decay
    decay_start = max(decay_start, cfg.warmup)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * (step + 1) / max(cfg.warmup, 1)  # the first update already moves
        progress = jnp.clip((step - decay_start) / max(steps - 1 - decay_start, 1), 0.0, 1.0)
        if cfg.schedule == "cosine":
            decayed = floor + (peak - floor) * 0.5 * (1 + jnp.cos(math.pi * progress))
        else:
            decayed = peak - (peak - floor) * (jnp.sqrt(progress) if cfg.decay_shape == "sqrt" else progress)
        return jnp.where(step < cfg.warmup, warm, decayed)

    return schedule


def matrices_only(params):
    """The weight-decay mask: True for every parameter with two or more dimensions."""
    return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


MUON_RMS = 0.2  # the update RMS Muon is scaled to: AdamW's, as Liu et al. measured it


def muon_matrices(params):
    """Muon's labels: "muon" for each decoder block's projection matrix (attention's q, k, v, o
    and the MLP's), "adamw" for the rest (embedding, output layer, norms, biases)."""
    def label(path, p):
        names = path_names(path)
        block = any(n.startswith("layers_") for n in names)
        return "muon" if block and names[-1] == "kernel" and p.ndim == 2 else "adamw"
    return jax.tree_util.tree_map_with_path(label, params)


def adamw_sized(updates, params=None):
    """Orthogonalised updates times MUON_RMS * sqrt(max(fan_in, fan_out)): an orthogonal matrix's
    RMS is 1 / sqrt(max(fan_in, fan_out)), so each update's RMS becomes MUON_RMS."""
    del params
    return jax.tree_util.tree_map(lambda u: u * (MUON_RMS * math.sqrt(max(u.shape))), updates)


def as_matrices(updates):
    """Muon's view of each of its leaves: a plain [fan_in, fan_out] matrix (kiln's kernels are)."""
    return jax.tree_util.tree_map(lambda _: optax.contrib.MuonDimensionNumbers(), updates)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Clipping, then AdamW (or Muon for the block matrices and AdamW for the rest) with a unit
    learning rate: the train step multiplies the updates by the schedule at the state's step
    counter (`scaled`). optax would evaluate the schedule at a count of its own inside the
    optimizer state, a second counter that a phase restoring the optimizer state would carry on
    with: a new schedule would then start where the old one was (Marin met exactly this: a
    cooldown flat at the minimum learning rate). With one counter, `reset` sets it to 0 and the
    new schedule starts at its first value."""
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    adamw = optax.adamw(1.0, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=matrices_only)
    if cfg.optimizer == "adamw":
        parts.append(adamw)
    else:  # the same sign and unit learning rate as adamw's updates, so `scaled` applies to both
        muon = optax.chain(
            optax.contrib.scale_by_muon(beta=cfg.muon_momentum, eps=cfg.eps, nesterov=True,
                                        weight_dimension_numbers=as_matrices),
            optax.stateless(adamw_sized),
            optax.add_decayed_weights(cfg.weight_decay),
            optax.scale(-1.0))
        parts.append(optax.partition({"muon": muon, "adamw": adamw}, muon_matrices))
    return optax.chain(*parts)


def scaled(updates, lr):
    """AdamW's updates at learning rate 1 (-(adam + decay)) times `lr`: the same float32 products
    as optax's own scaling by -lr, so the parameters are bit for bit what they were."""
    return jax.tree_util.tree_map(lambda u: u * lr.astype(u.dtype), updates)
