"""Continuous batching for `kiln serve-model`: the device side. A fixed number of slots, each one
request's row of a key/value cache as long as the model's context; the rows decode together a
few steps at a time (`decode_chunk`; fewer while an answer streams, so that its text goes out
every STREAM_INTERVAL_S), and between those chunks a finished row's slot takes the next waiting
prompt (`admit`). So a short request that comes while a long answer is decoding joins it at the
next chunk, instead of waiting for the whole batch to end (Orca's iteration-level scheduling,
which vLLM calls continuous batching). The host side, the thread that picks what runs, is
`evaluation.server.Scheduler`.

A row's tokens are drawn as `evaluation.generate.sample_batch` draws them: the same PRNG key
per row and token index, the same `pick`, the same logit adjustments (`penalised`, min_tokens'
held stop ids), the same log-probabilities; what differs is where its keys and values sit in
the cache. Row b's prompt is written from column 0 (right padding), so its column is its
position and each row writes its new token at a column of its own (training.model.write_cache).
New prompts take the lowest free slots, and a chunk decodes the slots up to the highest busy
one (rounded up to a power of two), so a lone request costs one row, not `slots`.

The state is a dict of arrays, slot first; per-token settings that can name any token (stop
ids, logit bias, which tokens the prompt holds, the counts of those drawn) are [slots, vocab],
so a row may have any number of them. No Prefect, no threads here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from evaluation.generate import MAX_LOGPROBS, Request, penalised, pick, seed_key
from evaluation.scoring import output_logits, trunk
from training.config import ModelConfig
from training.model import decode_step, init_cache, ring_columns

STEPS = 8  # decoding steps per chunk: how long a waiting prompt waits for a slot to open, at most
# While an answer streams, a chunk is as many steps as take this long at the last chunk's pace (one
# at least), so its text goes out that often: smooth to a reader, where a chunk of STEPS on a large
# model would come in bursts of a quarter second; a small model's fast steps keep whole chunks.
STREAM_INTERVAL_S = 0.05

_SETTINGS = {"keys": np.uint32, "temperature": np.float32, "top_p": np.float32, "top_k": np.int32,
             "min_p": np.float32, "max_new": np.int32, "min_new": np.int32, "presence": np.float32,
             "frequency": np.float32, "repetition": np.float32, "adjusts": bool, "stop": bool, "bias": np.float32}


def empty(cfg: ModelConfig, slots: int) -> dict:
    """The state of `slots` free slots (done, so no chunk decodes them)."""
    cache = init_cache(cfg, slots, cfg.seq_len)
    state = {"pos": cache["pos"], "layers": cache["layers"], "at": jnp.zeros(slots, jnp.int32),
             "token": jnp.zeros(slots, jnp.int32), "drawn": jnp.zeros(slots, jnp.int32),
             "done": jnp.ones(slots, bool), "counts": jnp.zeros((slots, cfg.vocab_size), jnp.int32),
             "in_prompt": jnp.zeros((slots, cfg.vocab_size), bool)}
    settings = settings_of([], cfg.vocab_size, slots)
    return {**state, **{name: jnp.asarray(value) for name, value in settings.items()}}


def state_bytes(cfg: ModelConfig, slots: int) -> int:
    """The bytes `empty(cfg, slots)` holds on the device (the key/value cache, most of it), allocating nothing."""
    shapes = jax.eval_shape(lambda: empty(cfg, slots))
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(shapes))


def free_bytes() -> int | None:
    """The memory left for the slots on the first device: an accelerator's limit less what is in use
    (the weights already placed), or on a CPU the machine's available memory; None if unknown."""
    stats = jax.devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    if jax.devices()[0].platform == "cpu":
        import psutil

        return psutil.virtual_memory().available
    return None


def settings_of(rows: list[Request], vocab: int, n: int) -> dict[str, np.ndarray]:
    """The per-row settings of `rows`, as `n` rows (the rest neutral and done at once, max_new 0)."""
    out = {name: np.zeros((n, 2) if name == "keys" else (n, vocab) if name in ("stop", "bias") else n, dtype)
           for name, dtype in _SETTINGS.items()}
    out["top_p"][:], out["repetition"][:] = 1, 1
    for b, r in enumerate(rows):
        out["keys"][b] = seed_key(r.seed)
        out["stop"][b, list(r.stop_ids)] = True
        for token, value in r.logit_bias:
            out["bias"][b, token] = value
        for name, value in (("temperature", r.temperature), ("top_p", r.top_p), ("top_k", r.top_k),
                            ("min_p", r.min_p), ("max_new", r.max_tokens), ("min_new", r.min_tokens),
                            ("presence", r.presence_penalty), ("frequency", r.frequency_penalty),
                            ("repetition", r.repetition_penalty)):
            out[name][b] = value
        out["adjusts"][b] = bool(r.logit_bias or r.presence_penalty or r.frequency_penalty
                                 or r.repetition_penalty != 1)
    return out


def emit(logits, s: dict, alternatives: int | None):
    """Draw each row's next token from logits [B, V] under its settings in `s`, as
    sample_batch's loop does; -> the rows' state after it, and (token, its log-probability, the
    `alternatives` most likely ids and log-probabilities); the log-probabilities are zeros for
    `alternatives` None."""
    B = logits.shape[0]
    i, rows = s["drawn"], jnp.arange(B)
    live = ~s["done"]
    drawn_from = jax.lax.cond(
        jnp.any(s["adjusts"] & live),
        lambda: penalised(logits, s["bias"], s["presence"], s["frequency"], s["repetition"], s["in_prompt"],
                          s["counts"]),
        lambda: logits)
    held = (i < s["min_new"])[:, None] & s["stop"]  # stop ids not drawn before min_new tokens
    drawn_from = jax.lax.cond(jnp.any(held), lambda: jnp.where(held, -jnp.inf, drawn_from), lambda: drawn_from)
    token = pick(drawn_from, jax.vmap(jax.random.fold_in)(s["keys"], i), s["temperature"], s["top_p"],
                 s["top_k"], s["min_p"])
    lp = jnp.zeros((B,), jnp.float32)
    best, best_ids = jnp.zeros((B, alternatives or 0), jnp.float32), jnp.zeros((B, alternatives or 0), jnp.int32)
    if alternatives is not None:
        logp = jax.nn.log_softmax(logits, axis=-1)
        lp = jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
        if alternatives:
            best, best_ids = jax.lax.top_k(logp, alternatives)
    done = s["done"] | s["stop"][rows, token] | (i + 1 >= s["max_new"])
    s = {**s, "token": token, "drawn": i + 1, "done": done, "counts": s["counts"].at[rows, token].add(1)}
    return s, (token, lp, best_ids, best)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnums=(1, 7))
def admit(params, state: dict, slots, tokens, lengths, settings: dict, source=None, pool=None, plan: dict | None = None,
          *, cfg: ModelConfig):
    """Prefill prompts tokens [m, P] (prompt i's first lengths[i] tokens, the rest padding) into
    `state` and draw each row's first token: row b (of n, as many as `slots` and `settings` have)
    takes prompt source[b] (None: prompt b) into slot slots[b] (a slot number past the last: a
    padding row, written nowhere). A prompt that several rows share (the `n` choices of one
    request) is prefilled once and its keys and values copied to each.

    With a prefix cache's `pool` and `plan` (evaluation/prefix_cache.py: a `Plan`'s done, read,
    tokens and write), prompt i's first done[i] tokens are the pool's blocks read[i] and `tokens`
    holds the rest of it (from position done[i] on); its whole blocks are written to the pool's
    rows write[i]. -> the new state, the first tokens [n] with their log-probabilities [n] and
    MAX_LOGPROBS alternatives [n, MAX_LOGPROBS] (once per prompt, so always computed: one
    admission program per prompt length, cached length and row counts), and the new pool (None
    without one)."""
    m, P = tokens.shape
    source = jnp.arange(m, dtype=jnp.int32) if source is None else source
    n = source.shape[0]
    done = jnp.zeros(m, jnp.int32) if plan is None else plan["done"]
    read = None if plan is None else plan.get("read")
    columns = jnp.arange(P, dtype=jnp.int32)[None]
    positions = jnp.where(columns < lengths[:, None], done[:, None] + columns, -1)
    cache = init_cache(cfg, m, P, rings=False)  # the prompts over their own P columns, then moved into slots
    every, pos, layers, at = tokens, positions, cache["layers"], 0
    if read is not None:  # the cached blocks' columns first, then the rest's
        at = read.shape[1] * pool.shape[3]  # the cached blocks' columns, the rest written after them
        held = pool[read]  # [m, blocks, layers, 2, block, kv heads, head width]
        held = jnp.moveaxis(held, (2, 3), (0, 1)).reshape(cfg.n_layers, 2, m, at, *held.shape[-2:])
        every = jnp.concatenate([plan["tokens"], tokens], axis=1)
        cached = jnp.arange(at, dtype=jnp.int32)[None]
        pos = jnp.concatenate([jnp.where(cached < done[:, None], cached, -1), positions], axis=1)
        layers = [{name: jnp.concatenate([held[i, j], layer[name]], axis=1) for j, name in enumerate(("k", "v"))}
                  for i, layer in enumerate(layers)]
    hidden, layers = trunk(params, tokens, positions, cfg, {"index": at, "pos": pos, "layers": layers})
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0][source]
    in_prompt = jnp.zeros((n, cfg.vocab_size), bool).at[jnp.arange(n)[:, None], every[source]].max(pos[source] >= 0)
    lengths = done + lengths
    if read is not None:  # each prompt's columns in position order, up to the context's length
        C = min(at + P, cfg.seq_len)
        c = jnp.arange(C, dtype=jnp.int32)[None]
        order = jnp.minimum(jnp.where(c < done[:, None], c, at + c - done[:, None]), at + P - 1)
        layers = [{name: jnp.take_along_axis(a, order[:, :, None, None], axis=1) for name, a in layer.items()}
                  for layer in layers]
        P = C
    pool = None if pool is None else write_blocks(pool, layers, plan["write"])
    positions = jnp.where(jnp.arange(P, dtype=jnp.int32)[None] < lengths[:, None], jnp.arange(P, dtype=jnp.int32), -1)
    lengths, positions = lengths[source], positions[source]
    rest = cfg.seq_len - P
    pos = jnp.pad(positions, ((0, 0), (0, rest)), constant_values=-1)
    layers = [{name: into_slot(a[source], lengths, cfg.layer_reach(i, cfg.seq_len)) for name, a in layer.items()}
              for i, layer in enumerate(layers)]
    fresh = {"pos": pos, "layers": layers, "at": lengths, "token": jnp.zeros(n, jnp.int32),
             "drawn": jnp.zeros(n, jnp.int32), "done": jnp.zeros(n, bool),
             "counts": jnp.zeros((n, cfg.vocab_size), jnp.int32), "in_prompt": in_prompt, **settings}
    fresh, first = emit(output_logits(params, last, cfg), fresh, MAX_LOGPROBS)
    state = jax.tree_util.tree_map(lambda whole, part: whole.at[slots].set(part, mode="drop"), state, fresh)
    return state, first, pool


@functools.partial(jax.jit, donate_argnums=(0,))
def keep_blocks(pool, layers: list[dict], slot, blocks, rows):
    """`pool` with blocks `blocks` [n] of slot `slot`'s keys and values (block b: columns b*B ..
    b*B + B - 1 of every layer, full layers' columns being positions) written to pool rows `rows`
    [n] (a row past the pool's last: written nowhere)."""
    B = pool.shape[3]
    columns = jnp.minimum(blocks[:, None] * B + jnp.arange(B), layers[0]["k"].shape[1] - 1)  # [n, B]
    kept = jnp.stack([jnp.stack([layer["k"][slot][columns], layer["v"][slot][columns]]) for layer in layers])
    return pool.at[rows].set(jnp.moveaxis(kept, 2, 0).astype(pool.dtype), mode="drop")  # [n, L, 2, B, K, Q]


@functools.partial(jax.jit, donate_argnums=(0,))
def set_rows(whole, where, rows):
    """`whole` [slots, ...] with rows[i] at slot where[i] (a slot past the last: written nowhere)."""
    return whole.at[where].set(rows, mode="drop")


def write_blocks(pool, layers: list[dict], write):
    """`pool` with whole blocks of prompts' keys and values (each layer's [m, P, K, Q], in position
    order) written to rows write [m, blocks] (block j of prompt i, its columns j*B .. j*B + B - 1,
    to row write[i, j]; a row past the pool's last: written nowhere)."""
    m, P = layers[0]["k"].shape[:2]
    B, W = pool.shape[3], write.shape[1]
    blocks = jnp.stack([jnp.stack([layer["k"], layer["v"]], axis=1) for layer in layers], axis=1)  # [m, L, 2, P, K, Q]
    blocks = jnp.pad(blocks, ((0, 0),) * 3 + ((0, W * B - P),) + ((0, 0),) * 2)
    blocks = blocks.reshape(*blocks.shape[:3], W, B, *blocks.shape[-2:])
    blocks = jnp.moveaxis(blocks, 3, 1).reshape(m * W, *pool.shape[1:])
    return pool.at[write.reshape(-1)].set(blocks.astype(pool.dtype), mode="drop")


def into_slot(prefilled, lengths, width: int):
    """A layer's keys or values of prefilled right-padded prompts [n, P, K, Q] (prompt b in its
    first lengths[b] columns) laid out as a slot's row holds them, as decoding would have left
    them: a full layer's padded to the context's `width` columns; a sliding layer's ring of `width`
    (`training.model.init_cache`) holding each prompt's last `width` columns, column c at slot
    c mod width (`ring_columns`; a slot no column reached yet holds column 0's, which decoding
    masks as empty). Where width >= P, padding lays out the same (column c at slot c)."""
    n, P = prefilled.shape[:2]
    if width >= P:  # a full layer, or a ring no shorter than the prompts: column c at slot c (mod width)
        return jnp.pad(prefilled, ((0, 0), (0, width - P), (0, 0), (0, 0)))
    held = jnp.maximum(ring_columns(lengths, width), 0)  # [n, width]
    return jnp.take_along_axis(prefilled, held[:, :, None, None], axis=1)


@functools.partial(jax.jit, static_argnames=("cfg", "steps", "alternatives", "width"), donate_argnums=(1,))
def decode_chunk(params, state: dict, limit, *, cfg: ModelConfig, steps: int, alternatives: int | None, width: int):
    """Up to `limit` (at most `steps`) decoding steps of the first `width` slots (those past it
    are free: a lone request decodes as one row, not as many as there are slots), ending early
    once all are done. `limit` is traced, so a shorter chunk (while a row streams) runs the same
    compiled program. -> the new state, and per slot (of the first `width`) and step: the token
    drawn, its log-probability and alternatives (as `emit`), and whether the slot was live (not
    done) at that step; a slot's tokens after it was done, and steps past `limit`, are never
    read."""
    C = cfg.seq_len
    A = alternatives or 0
    out = (jnp.zeros((width, steps), jnp.int32), jnp.zeros((width, steps), jnp.float32),
           jnp.zeros((width, steps, A), jnp.int32), jnp.zeros((width, steps, A), jnp.float32),
           jnp.zeros((width, steps), bool))

    def step(carry):
        k, s, out = carry
        live = ~s["done"]
        # a done slot's column may run past the cache: it writes its own last column, never read
        cache = {"index": jnp.minimum(s["at"], C - 1), "pos": s["pos"], "layers": s["layers"]}
        logits, cache = decode_step(params, cfg, s["token"][:, None], cache, s["at"][:, None])
        s = {**s, "pos": cache["pos"], "layers": cache["layers"], "at": s["at"] + 1}
        s, (token, lp, best_ids, best) = emit(logits[:, 0], s, alternatives)
        ids, lps, top_ids, top_lps, valid = out
        out = (ids.at[:, k].set(token), lps.at[:, k].set(lp), top_ids.at[:, k].set(best_ids),
               top_lps.at[:, k].set(best), valid.at[:, k].set(live))
        return k + 1, s, out

    part = jax.tree_util.tree_map(lambda a: a[:width], state)
    _, part, out = jax.lax.while_loop(lambda c: (c[0] < jnp.minimum(limit, steps)) & ~c[1]["done"].all(), step,
                                      (jnp.int32(0), part, out))
    state = jax.tree_util.tree_map(lambda whole, new: jax.lax.dynamic_update_slice_in_dim(whole, new, 0, 0),
                                   state, part)
    return state, out
