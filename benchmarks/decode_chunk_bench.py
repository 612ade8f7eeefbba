"""What one call of `kiln serve-model`'s decoding costs beside its steps: this tree and a baseline commit.

For the working tree and a git worktree at `--baseline`, each in a process of its own with that
tree's code (`evaluation/slots.py`'s `decode_chunk` on eight busy slots):

- seconds per call of a chunk of 1 step and of 8 steps, at the `large` shape of
  benchmarks/serve_load_bench.py (d_model 512, 8 layers, GPT-2 vocabulary, context 256; random
  weights), best of `--repeats` rounds of `--calls` calls: the steady cost of a step is the
  difference of the two over 7, and what a call costs beside its steps is the rest;
- the compiled chunk's temporary bytes (XLA's `memory_analysis`, no parameters allocated) at the
  shape of configs/llama3_8b_gpu.yaml with float32 compute (this CPU computes bfloat16 matmuls in
  float32, which would hide the rest).

Then this tree's numbers against the baseline's.

    uv run python benchmarks/decode_chunk_bench.py --baseline <commit>
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def probe(shape: dict, calls: int, repeats: int) -> dict:
    """In the tree this process imports from (its working folder): the numbers above, at `shape`
    for the timings, as a dict."""
    import inspect
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import yaml

    from evaluation import slots
    from evaluation.generate import Request
    from training.config import ModelConfig
    from training.model import init_params

    traced_limit = "limit" in inspect.signature(slots.decode_chunk).parameters  # older trees: steps only

    def chunk(params, state, cfg, steps):
        if traced_limit:
            return slots.decode_chunk(params, state, np.int32(steps), cfg=cfg, steps=8, alternatives=None, width=8)
        return slots.decode_chunk(params, state, cfg=cfg, steps=steps, alternatives=None, width=8)

    cfg = ModelConfig(**shape, seq_len=256, tie_embeddings=True, init_std=0.1)
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
    rows = [Request([50256, *range(100 + b, 130 + b)], 100_000, 0.0) for b in range(8)]
    tokens = np.array([r.prompt for r in rows], np.int32)
    state, _ = slots.admit(params, slots.empty(cfg, 8), np.arange(8, dtype=np.int32), tokens,
                           np.full(8, tokens.shape[1], np.int32), slots.settings_of(rows, cfg.vocab_size, 8), cfg=cfg)
    out = {}
    for steps in (1, 8):
        state, got = chunk(params, state, cfg, steps)  # compiles
        jax.device_get(got)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                state, got = chunk(params, state, cfg, steps)
                jax.device_get(got)
            best = min(best, (time.perf_counter() - start) / calls)
        out[f"call_{steps}_s"] = best

    big = yaml.safe_load((Path("configs") / "llama3_8b_gpu.yaml").read_text())["model"]
    big_cfg = ModelConfig(**{**big, "compute_dtype": "float32"})
    shapes = jax.eval_shape(lambda: init_params(big_cfg, jax.random.PRNGKey(0)))
    big_state = jax.eval_shape(lambda: slots.empty(big_cfg, 8))
    args = (shapes, big_state, jax.ShapeDtypeStruct((), jnp.int32)) if traced_limit else (shapes, big_state)
    lowered = slots.decode_chunk.lower(*args, cfg=big_cfg, steps=8, alternatives=None, width=8)
    out["temp_8b_bytes"] = lowered.compile().memory_analysis().temp_size_in_bytes
    return out


def measure(tree: Path, shape: dict, calls: int, repeats: int) -> dict:
    """`probe` in a process that imports `tree`'s code (this file from here: the baseline may not have it)."""
    code = (f"import json, runpy, sys; sys.path.insert(0, {str(tree)!r}); "
            f"probe = runpy.run_path({__file__!r})['probe']; "
            f"print(json.dumps(probe({shape!r}, {calls}, {repeats})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the probe in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="the commit to compare with (a git worktree of it is made)")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    sys.path.insert(0, str(REPO))  # here only: the probe's process imports the tree it measures
    from benchmarks.serve_load_bench import SHAPES

    with tempfile.TemporaryDirectory() as tmp:
        baseline = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(baseline), args.baseline], cwd=REPO, check=True,
                       capture_output=True)
        try:
            got = {"baseline": measure(baseline, SHAPES["large"], args.calls, args.repeats),
                   "this tree": measure(REPO, SHAPES["large"], args.calls, args.repeats)}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=REPO, check=False)
    for name, m in got.items():
        step = (m["call_8_s"] - m["call_1_s"]) / 7
        m["step_s"], m["beside_s"] = step, m["call_1_s"] - step
        print(f"{name:>9}: a chunk of 1 step {m['call_1_s'] * 1000:6.1f} ms, of 8 steps {m['call_8_s'] * 1000:6.1f} ms;"
              f" a step {step * 1000:5.1f} ms, a call beside its steps {m['beside_s'] * 1000:5.1f} ms; at the 8B shape"
              f" (float32) the chunk's temporaries {m['temp_8b_bytes'] / 1e9:.2f} GB")
    base, this = got["baseline"], got["this tree"]
    for key, label in (("call_1_s", "a chunk of 1 step"), ("call_8_s", "a chunk of 8 steps"),
                       ("temp_8b_bytes", "temporaries at the 8B shape")):
        print(f"{label}: this tree / baseline = {this[key] / base[key]:.3f}")


if __name__ == "__main__":
    main()
