"""Per-token log-probabilities of a padded batch, jitted: the one numerical kernel that the
harness adapter and the held-out perplexity share.

Batches are padded on the right to one of a few bucket lengths (and to a fixed number of rows),
so `jax.jit` compiles once per bucket instead of once per request length. Right padding is safe
in a causal model: no real position attends to a later (padded) one.

Most requests score a short continuation at the end of a long context, so the output layer (with
a GPT-2 vocabulary, most of a small model's FLOPs and all of its memory traffic: B*T*V logits)
runs only on a window of `window` positions per row. The trunk's final hidden states are read
with Flax's `capture_intermediates` (the final norm's output); the model's own full logits are
then unused and XLA drops them. The head is the model's: the tied embedding or `lm_head`, in the
compute dtype, float32 logits; the tests check the result against `training.model.forward`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from training.config import ModelConfig
from training.model import Llama

MIN_BUCKET = 16
WINDOW = 32  # positions scored per row when every continuation in the batch fits


def buckets(max_len: int, smallest: int = MIN_BUCKET) -> list[int]:
    """Padded lengths: powers of two from `smallest` up to, and always including, `max_len`."""
    out, n = [], smallest
    while n < max_len:
        out.append(n)
        n *= 2
    return out + [max_len]


def bucket_for(length: int, sizes: list[int]) -> int:
    for size in sizes:
        if length <= size:
            return size
    raise ValueError(f"a sequence of {length} tokens is longer than the largest bucket {sizes[-1]}")


def final_hidden(params, tokens, cfg: ModelConfig):
    """The final norm's output [B, T, D] for tokens [B, T] at positions 0..T-1."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    _, state = Llama(cfg).apply({"params": params}, tokens, positions, mutable=["intermediates"],
                                capture_intermediates=lambda mdl, method: mdl.name == "norm" and method == "__call__")
    return state["intermediates"]["norm"]["__call__"][0]


def output_logits(params, hidden, cfg: ModelConfig):
    """The model's output layer on hidden states [..., D] -> float32 logits [..., V]."""
    dt = jnp.dtype(cfg.compute_dtype)
    weight = params["embed_tokens"]["embedding"].T if cfg.tie_embeddings else params["lm_head"]["kernel"]
    return jnp.dot(hidden.astype(dt), weight.astype(dt)).astype(jnp.float32)


def make_token_scorer(cfg: ModelConfig) -> Callable:
    """jit(params, inputs [B, L], targets [B, L], starts [B], window) -> (logprob, greedy), each [B, window].

    Row b is scored at positions starts[b] .. starts[b] + window - 1 (window <= L, a static
    argument): `logprob[b, j]` is log p(target | inputs up to that position), `greedy[b, j]`
    whether the target is the argmax there. Only these B*window numbers come back to the host.
    """

    def score(params, inputs, targets, starts, window: int):
        hidden = final_hidden(params, inputs, cfg)  # [B, L, D]
        index = starts[:, None] + jnp.arange(window)[None, :]  # [B, window]
        hidden = jnp.take_along_axis(hidden, index[..., None], axis=1)
        targets = jnp.take_along_axis(targets, index, axis=1)
        logits = output_logits(params, hidden, cfg)  # [B, window, V]
        target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        logprob = target_logit - jax.nn.logsumexp(logits, axis=-1)
        greedy = jnp.argmax(logits, axis=-1) == targets
        return logprob, greedy

    return jax.jit(score, static_argnums=4)


def pad_rows(rows: list[np.ndarray], length: int, n_rows: int, fill: int = 0) -> np.ndarray:
    """int32 [n_rows, length]: each row left-aligned, the rest (and missing rows) `fill`."""
    out = np.full((n_rows, length), fill, dtype=np.int32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out
