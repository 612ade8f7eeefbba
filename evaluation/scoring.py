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

from training import compile_cache
from training.config import ModelConfig
from training.model import Llama, output_scale

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
    return trunk(params, tokens, positions, cfg)[0]


def trunk(params, tokens, positions, cfg: ModelConfig, cache: dict | None = None):
    """The final norm's output [B, T, D], and the new cache layers when run over a key/value
    `cache` (training.model.decode_step's), without the output layer: the model's own logits are
    unused, and XLA drops them."""
    (_, layers), state = Llama(cfg).apply(
        {"params": params}, tokens, positions, cache, mutable=["intermediates"],
        capture_intermediates=lambda mdl, method: mdl.name == "norm" and method == "__call__")
    return state["intermediates"]["norm"]["__call__"][0], layers


def output_logits(params, hidden, cfg: ModelConfig):
    """The model's output layer on hidden states [..., D] -> float32 logits [..., V] (scaled and
    soft-capped where the model does, as its forward does: `output_scale`)."""
    dt = jnp.dtype(cfg.compute_dtype)
    weight = params["embed_tokens"]["embedding"].T if cfg.tie_embeddings else params["lm_head"]["kernel"]
    return output_scale(jnp.dot(hidden.astype(dt), weight.astype(dt)).astype(jnp.float32), cfg)


def window_logprobs(params, inputs, targets, starts, window: int, cfg: ModelConfig):
    """The log-softmax [B, window, V] at positions starts[b] .. starts[b] + window - 1 of each row
    of inputs [B, L] (positions 0..L-1), and the targets there [B, window]."""
    hidden = final_hidden(params, inputs, cfg)  # [B, L, D]
    index = starts[:, None] + jnp.arange(window)[None, :]  # [B, window]
    hidden = jnp.take_along_axis(hidden, index[..., None], axis=1)
    logits = output_logits(params, hidden, cfg)  # [B, window, V]
    return logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True), jnp.take_along_axis(targets, index, axis=1)


def make_token_scorer(cfg: ModelConfig) -> Callable:
    """jit(params, inputs [B, L], targets [B, L], starts [B], window) -> (logprob, greedy), each [B, window].

    Row b is scored at positions starts[b] .. starts[b] + window - 1 (window <= L, a static
    argument): `logprob[b, j]` is log p(target | inputs up to that position), `greedy[b, j]`
    whether the target is the argmax there. Only these B*window numbers come back to the host.
    """
    compile_cache.enable()

    def score(params, inputs, targets, starts, window: int):
        logp, targets = window_logprobs(params, inputs, targets, starts, window, cfg)
        return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], jnp.argmax(logp, axis=-1) == targets

    return jax.jit(score, static_argnums=4)


def make_prompt_scorer(cfg: ModelConfig) -> Callable:
    """jit(params, inputs [B, L], targets [B, L], top_k) -> (logprob [B, L], top ids and log-probabilities
    [B, L, top_k]): every position of every row, by the token scorer's computation (an echoed
    prompt's log-probabilities in `kiln serve-model` agree with the lm-eval adapter's)."""
    compile_cache.enable()

    def score(params, inputs, targets, top_k: int):
        logp, targets = window_logprobs(params, inputs, targets, jnp.zeros(inputs.shape[0], jnp.int32),
                                        inputs.shape[1], cfg)
        chosen = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        if not top_k:
            return chosen, jnp.zeros(logp.shape[:-1] + (0,), jnp.int32), logp[..., :0]
        best, ids = jax.lax.top_k(logp, top_k)
        return chosen, ids, best

    return jax.jit(score, static_argnums=3)


def pad_rows(rows: list[np.ndarray], length: int, n_rows: int, fill: int = 0) -> np.ndarray:
    """int32 [n_rows, length]: each row left-aligned, the rest (and missing rows) `fill`."""
    out = np.full((n_rows, length), fill, dtype=np.int32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out
