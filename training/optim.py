"""The optimizer: AdamW behind global-norm clipping, with warmup then cosine or WSD decay.

Weight decay applies to matrices only (ndim >= 2: projections and embeddings); decaying norm
gains towards zero would fight the normalisation they exist to undo.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from training.config import TrainConfig


def lr_schedule(cfg: TrainConfig):
    """step -> learning rate: linear warmup over `warmup` steps, then

    cosine: half a cosine from lr down to lr * min_lr_ratio at the last step;
    wsd (warmup-stable-decay): constant lr, then a linear decay to lr * min_lr_ratio over the
    last `decay_fraction` of the steps (so a run can be extended from a stable-phase checkpoint).
    """
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    decay_start = cfg.warmup if cfg.schedule == "cosine" else cfg.steps - max(1, round(cfg.decay_fraction * cfg.steps))
    decay_start = max(decay_start, cfg.warmup)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * (step + 1) / max(cfg.warmup, 1)  # the first update already moves
        progress = jnp.clip((step - decay_start) / max(cfg.steps - 1 - decay_start, 1), 0.0, 1.0)
        if cfg.schedule == "cosine":
            decayed = floor + (peak - floor) * 0.5 * (1 + jnp.cos(math.pi * progress))
        else:
            decayed = peak - (peak - floor) * progress
        return jnp.where(step < cfg.warmup, warm, decayed)

    return schedule


def matrices_only(params):
    """The weight-decay mask: True for every parameter with two or more dimensions."""
    return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    parts.append(optax.adamw(lr_schedule(cfg), b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=matrices_only))
    return optax.chain(*parts)
