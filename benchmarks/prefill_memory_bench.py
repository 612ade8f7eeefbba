"""What one admission of `kiln serve-model` (a burst of long prompts prefilled into the slots)
holds and takes: this tree and a baseline commit, each in a process of its own.

A random model at benchmarks/serve_load_bench.py's `large` shape (d_model 512, 8 layers, 8
heads) with a context of `--context` tokens; `evaluation.slots.admit` of eight prompts of
`--context` - 8 tokens into eight empty slots, without the prefix cache (`--prefix-cache-tokens
0`'s path). Prints the compiled program's temporary bytes (`memory_analysis`: the attention
scores of a prefill are most of them) and the best of `--repeats` timed calls after one that
compiles, and this tree's against the baseline's.

    uv run python benchmarks/prefill_memory_bench.py --baseline <commit>
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def probe(context: int, repeats: int) -> dict:
    """In the tree this process imports from: the admission's temporary bytes and seconds."""
    import time

    import jax
    import numpy as np

    from benchmarks.serve_load_bench import SHAPES
    from evaluation import slots
    from training.config import ModelConfig
    from training.model import init_params

    cfg = ModelConfig(**SHAPES["large"], vocab_size=50257, seq_len=context, tie_embeddings=True, init_std=0.1)
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
    rows = 8
    tokens = np.random.default_rng(0).integers(3, 50000, (rows, context)).astype(np.int32)
    lengths = np.full(rows, context - 8, np.int32)
    settings = slots.settings_of([], cfg.vocab_size, rows)
    where = np.arange(rows, dtype=np.int32)
    state = slots.empty(cfg, rows)
    compiled = slots.admit.lower(params, state, where, tokens, lengths, settings, cfg=cfg).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    best = float("inf")
    for i in range(repeats + 1):  # the first compiles
        start = time.perf_counter()
        state, first, _ = jax.block_until_ready(slots.admit(params, state, where, tokens, lengths, settings, cfg=cfg))
        best = best if i == 0 else min(best, time.perf_counter() - start)
    return {"temp_bytes": temp, "seconds": best}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="the commit to compare with (a git worktree of it is made)")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    sys.path.insert(0, str(REPO))  # here only: the probe's process imports the tree it measures
    from benchmarks.trees import probe_in, worktree

    with tempfile.TemporaryDirectory() as tmp, worktree(args.baseline, Path(tmp) / "baseline") as baseline:
        got = {name: probe_in(tree, __file__, "probe", args.context, args.repeats)
               for name, tree in (("baseline", baseline), ("this tree", REPO))}
    for name, m in got.items():
        print(f"{name:>9}: eight {args.context - 8}-token prompts admitted, temporaries "
              f"{m['temp_bytes'] / 2**20:8.1f} MiB, {m['seconds']:.3f} s")
    base, this = got["baseline"], got["this tree"]
    print(f"this tree / baseline: temporaries {this['temp_bytes'] / base['temp_bytes']:.3f}, "
          f"seconds {this['seconds'] / base['seconds']:.3f}")


if __name__ == "__main__":
    main()
