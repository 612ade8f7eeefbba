"""What sliding-window layers cost beside full-attention ones.

Training: the forward and backward of `training.model.causal_attention` (query blocks), jitted,
for a sliding layer and a full layer at the same shapes. Before its query blocks skipped the keys
no row of theirs can see, a sliding layer cost what a full layer costs (the window was a mask over
every key), so the full layer measured in the same run is the baseline. Also prints the windowed
output's largest difference from the dense masked form (the decoding path's `cached_attention`
over the sequence's own keys).

Decoding (`--decode`): a Gemma-3-shaped model (five sliding layers to one full) prefills a prompt
and then decodes a token at a time with `training.model.decode_step`, its cache made with the
sliding layers' rings (`init_cache`) and without them (`rings=False`: every layer keeps every
column, as before the rings), in the same run: the cache's bytes, ms per token, and whether the
two give the same greedy tokens.

    uv run python benchmarks/window_bench.py                    # T 1024 and 2048, windows 128 and 512
    uv run python benchmarks/window_bench.py --seq-lens 4096 --windows 1024 --rounds 3
    uv run python benchmarks/window_bench.py --decode --context 4096 --prompt 2048 --decode-window 256

Imports only training/ and jax.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from train_bench import machine  # noqa: E402

from training.config import ModelConfig  # noqa: E402
from training.model import (cached_attention, causal_attention, decode_step, init_cache, init_params,  # noqa: E402
                            query_blocks)


def keys_multiplied(T: int, window: int | None) -> int:
    """Query rows x keys the query blocks multiply (per head and row of the batch)."""
    blocks = query_blocks(T, window)
    return sum((t1 - t0) * (t1 - (0 if window is None else max(0, t0 - window + 1))) for t0, t1 in blocks)


def fwd_bwd(window: int | None):
    def run(q, k, v, cot):
        out, vjp = jax.vjp(lambda q, k, v: causal_attention(q, k, v, window=window), q, k, v)
        return out, vjp(cot)
    return jax.jit(run)


def best_seconds(fn, args, rounds: int, calls: int) -> float:
    jax.block_until_ready(fn(*args))  # compiled and warm
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def decode(args) -> None:
    """Prefill and greedy token-at-a-time decoding, the cache with rings and without, interleaved rounds."""
    layer_types = tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(6))
    cfg = ModelConfig(vocab_size=512, d_model=256, n_layers=6, n_heads=4, n_kv_heads=2, d_ff=768,
                      seq_len=args.context, sliding_window=args.decode_window, layer_types=layer_types)
    params = init_params(cfg, jax.random.PRNGKey(0))
    B, P, N = args.batch, args.prompt, args.tokens
    prompt = jax.random.randint(jax.random.PRNGKey(1), (B, P), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(args.context, dtype=jnp.int32), (B, args.context))
    step = jax.jit(decode_step, static_argnums=1, donate_argnums=3)

    def generate(rings: bool):
        cache = init_cache(cfg, B, args.context, rings=rings)
        logits, cache = step(params, cfg, prompt, cache, positions[:, :P])
        token, tokens = logits[:, -1].argmax(-1)[:, None], []
        jax.block_until_ready(token)
        start = time.perf_counter()
        for i in range(N):
            logits, cache = step(params, cfg, token, cache, positions[:, P + i:P + i + 1])
            token = logits[:, -1].argmax(-1)[:, None]
            tokens.append(token)
        jax.block_until_ready(token)
        return (time.perf_counter() - start) / N, jnp.concatenate(tokens, 1)

    print(f"decoding: 6 layers (5 sliding of {args.decode_window}, 1 full), d_model 256, context {args.context}, "
          f"batch {B}, a {P}-token prompt, then {N} tokens one at a time; best of {args.rounds} rounds")
    runs = {rings: [] for rings in (False, True)}
    for _ in range(args.rounds + 1):  # the first round compiles
        for rings in runs:
            runs[rings].append(generate(rings))
    size = {rings: sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(init_cache(cfg, B, args.context, rings)))
            for rings in runs}
    same = bool(jnp.array_equal(runs[False][-1][1], runs[True][-1][1]))
    print("| cache | MB | ms / token | same greedy tokens |\n| --- | ---: | ---: | --- |")
    for rings, label in ((False, "every column (rings=False)"), (True, "sliding layers' rings")):
        print(f"| {label} | {size[rings] / 1e6:.1f} | {min(t for t, _ in runs[rings][1:]) * 1e3:.2f} | {same} |")
    full, ring = (min(t for t, _ in runs[r][1:]) for r in (False, True))
    print(f"rings / every column: bytes {size[True] / size[False]:.3f}, ms per token {ring / full:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--windows", type=int, nargs="+", default=[128, 512])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--decode", action="store_true", help="time decoding with the sliding layers' rings and without")
    p.add_argument("--context", type=int, default=4096, help="--decode: the cache's columns")
    p.add_argument("--prompt", type=int, default=2048, help="--decode: prompt tokens, prefilled at once")
    p.add_argument("--tokens", type=int, default=32, help="--decode: tokens decoded one at a time")
    p.add_argument("--decode-window", type=int, default=256, help="--decode: the sliding layers' window")
    args = p.parse_args()
    print(machine())
    if args.decode:
        return decode(args)
    print(f"batch {args.batch}, heads {args.heads} (kv {args.kv_heads}) of {args.head_dim}, float32; "
          f"best of {args.rounds} rounds of {args.calls} calls")
    print("| T | window | row-keys multiplied / full's | ms, full layer | ms, sliding layer | sliding / full | "
          "max abs diff vs dense |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for T in args.seq_lens:
        kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(T), 4)
        B, H, K, Q = args.batch, args.heads, args.kv_heads, args.head_dim
        q, k, v = (jax.random.normal(key, (B, T, n, Q)) for key, n in ((kq, H), (kk, K), (kv, K)))
        cot = jax.random.normal(kc, (B, T, H * Q))
        full = best_seconds(fwd_bwd(None), (q, k, v, cot), args.rounds, args.calls)
        for window in args.windows:
            sliding = best_seconds(fwd_bwd(window), (q, k, v, cot), args.rounds, args.calls)
            pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
            dense = jax.jit(lambda q, k, v: cached_attention(q, k, v, pos, pos, window))(q, k, v)
            diff = float(jnp.abs(fwd_bwd(window)(q, k, v, cot)[0] - dense).max())
            share = keys_multiplied(T, window) / keys_multiplied(T, None)
            print(f"| {T} | {window} | {share:.3f} | {full * 1e3:.1f} | {sliding * 1e3:.1f} | "
                  f"{sliding / full:.3f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
