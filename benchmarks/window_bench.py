"""What a sliding-window layer's attention costs in training beside a full-attention layer's, at
the same shapes: the forward and backward of `training.model.causal_attention` (query blocks),
jitted. Before its query blocks skipped the keys no row of theirs can see, a sliding layer cost
what a full layer costs (the window was a mask over every key), so the full layer measured in the
same run is the baseline. Also prints the windowed output's largest difference from the dense
masked form (the decoding path's `cached_attention` over the sequence's own keys).

    uv run python benchmarks/window_bench.py                    # T 1024 and 2048, windows 128 and 512
    uv run python benchmarks/window_bench.py --seq-lens 4096 --windows 1024 --rounds 3

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

from training.model import cached_attention, causal_attention, query_blocks  # noqa: E402


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
    args = p.parse_args()
    print(machine())
    print(f"batch {args.batch}, heads {args.heads} (kv {args.kv_heads}) of {args.head_dim}, float32; "
          f"best of {args.rounds} rounds of {args.calls} calls")
    print("| T | window | keys multiplied / full's | ms, full layer | ms, sliding layer | sliding / full | "
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
