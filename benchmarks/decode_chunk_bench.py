"""What one call of `kiln serve-model`'s decoding costs beside its steps: this tree and a baseline commit.

A model folder at the `large` shape of benchmarks/serve_load_bench.py (d_model 512, 8 layers,
GPT-2 vocabulary, context 256; random weights) computing in `--dtype` is written once; then, for
the working tree and a git worktree at `--baseline`, each in a process of its own with that
tree's code, loaded as `kiln serve-model` loads it (`evaluation.generate.load`), and
`evaluation/slots.py`'s `decode_chunk` run on eight busy slots:

- the bytes the loaded weights hold on the device, and their dtype;
- seconds per call of a chunk of 1 step and of 8 steps, best of `--repeats` rounds of `--calls`
  calls: the steady cost of a step is the difference of the two over 7, and what a call costs
  beside its steps is the rest;
- at the shape of configs/llama3_8b_gpu.yaml, computing in `--dtype`, with the weights in the
  dtype the tree's `load` held them in, the compiled chunk's argument bytes (weights and slots)
  and temporary bytes (XLA's `memory_analysis`, nothing allocated). This CPU computes bfloat16
  matmuls in float32, converting the weights at each call whatever they are held in, so with
  `--dtype bfloat16` the temporaries here say nothing of an accelerator's; float32 shows the rest.

Then this tree's numbers against the baseline's.

    uv run python benchmarks/decode_chunk_bench.py --baseline <commit> [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def write_model(folder: Path, shape: dict, dtype: str) -> tuple[Path, Path]:
    """A training output at `shape` (random weights) computing in `dtype`, and a GPT-2 tokenizer
    folder beside it: (model folder, tokenizer folder)."""
    import jax

    from benchmarks.generate_bench import gpt2_tokenizer_folder
    from training.config import ModelConfig
    from training.loop import flatten_params, save_model
    from training.model import init_params

    cfg = ModelConfig(**shape, seq_len=256, tie_embeddings=True, init_std=0.1, compute_dtype=dtype)
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
    save_model(folder / "model", cfg, flatten_params(params))
    return folder / "model", gpt2_tokenizer_folder(folder / "tokenizer")


def probe(model_dir: str, tokenizer_dir: str, calls: int, repeats: int) -> dict:
    """In the tree this process imports from (its working folder): the numbers above, for the
    model folder that `write_model` wrote, as a dict."""
    import inspect
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import yaml

    from evaluation import slots
    from evaluation.generate import Request, load
    from training.config import ModelConfig
    from training.model import init_params

    traced_limit = "limit" in inspect.signature(slots.decode_chunk).parameters  # older trees: steps only

    def chunk(params, state, cfg, steps):
        if traced_limit:
            return slots.decode_chunk(params, state, np.int32(steps), cfg=cfg, steps=8, alternatives=None, width=8)
        return slots.decode_chunk(params, state, cfg=cfg, steps=steps, alternatives=None, width=8)

    model = load(Path(model_dir), Path(tokenizer_dir))
    cfg, params = model.cfg, model.params
    held = {leaf.dtype for leaf in jax.tree_util.tree_leaves(params)}
    out = {"held_bytes": sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params)),
           "held": " ".join(sorted(map(str, held)))}
    rows = [Request([50256, *range(100 + b, 130 + b)], 100_000, 0.0) for b in range(8)]
    tokens = np.array([r.prompt for r in rows], np.int32)
    state, _ = slots.admit(params, slots.empty(cfg, 8), np.arange(8, dtype=np.int32), tokens,
                           np.full(8, tokens.shape[1], np.int32), slots.settings_of(rows, cfg.vocab_size, 8), cfg=cfg)
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
    big_cfg = ModelConfig(**{**big, "compute_dtype": cfg.compute_dtype})
    (held,) = held  # the dtype this tree's `load` held the weights in
    shapes = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, held),
                                    jax.eval_shape(lambda: init_params(big_cfg, jax.random.PRNGKey(0))))
    big_state = jax.eval_shape(lambda: slots.empty(big_cfg, 8))
    args = (shapes, big_state, jax.ShapeDtypeStruct((), jnp.int32)) if traced_limit else (shapes, big_state)
    lowered = slots.decode_chunk.lower(*args, cfg=big_cfg, steps=8, alternatives=None, width=8)
    memory = lowered.compile().memory_analysis()
    out["temp_8b_bytes"], out["argument_8b_bytes"] = memory.temp_size_in_bytes, memory.argument_size_in_bytes
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="the commit to compare with (a git worktree of it is made)")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the model's compute dtype (default float32)")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))  # here only: the probe's process imports the tree it measures
    from benchmarks.serve_load_bench import SHAPES
    from benchmarks.trees import probe_in, worktree

    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = map(str, write_model(Path(tmp), SHAPES["large"], args.dtype))
        with worktree(args.baseline, Path(tmp) / "baseline") as baseline:
            got = {name: probe_in(tree, __file__, "probe", model, tokenizer, args.calls, args.repeats)
                   for name, tree in (("baseline", baseline), ("this tree", REPO))}
    for name, m in got.items():
        step = (m["call_8_s"] - m["call_1_s"]) / 7
        m["step_s"], m["beside_s"] = step, m["call_1_s"] - step
        print(f"{name:>9}: weights held in {m['held']}, {m['held_bytes'] / 1e6:.1f} MB; a chunk of 1 step "
              f"{m['call_1_s'] * 1000:6.1f} ms, of 8 steps {m['call_8_s'] * 1000:6.1f} ms; a step "
              f"{step * 1000:5.1f} ms, a call beside its steps {m['beside_s'] * 1000:5.1f} ms; at the 8B shape "
              f"({args.dtype}) the chunk's arguments {m['argument_8b_bytes'] / 1e9:.2f} GB, temporaries "
              f"{m['temp_8b_bytes'] / 1e9:.2f} GB")
    base, this = got["baseline"], got["this tree"]
    for key, label in (("held_bytes", "weights held"), ("call_1_s", "a chunk of 1 step"),
                       ("call_8_s", "a chunk of 8 steps"), ("argument_8b_bytes", "arguments at the 8B shape"),
                       ("temp_8b_bytes", "temporaries at the 8B shape")):
        print(f"{label}: this tree / baseline = {this[key] / base[key]:.3f}")


if __name__ == "__main__":
    main()
