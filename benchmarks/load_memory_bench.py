"""The memory `kiln serve-model` / `kiln generate` take to load a model: this tree and a baseline commit.

Two folders are written once, at a 0.8B Llama shape (d_model 2048, 16 layers, 16 heads, 8 kv
heads, d_ff 5632, vocabulary 32000; random weights): a Hugging Face checkpoint in bfloat16 (the
dtype open checkpoints ship in) and a kiln training output (float32, as kiln publishes them)
whose compute dtype is bfloat16. Then, for the working tree and a git worktree at `--baseline`,
each load runs in a fresh process with that tree's code (`evaluation.generate.load`, as the
commands call it), which prints its peak anonymous memory (the process's high-water mark: on a
CPU the device arrays live in host memory too, so the weights' host copies and device copies
both count), what it holds once the load is done, and the bytes its weights hold:

- the checkpoint as it computes by default (float32), and, where the tree offers `--dtype`, in
  bfloat16;
- the training output (bfloat16 compute).

    uv run python benchmarks/load_memory_bench.py --baseline <commit>
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPE = dict(vocab_size=32000, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8, d_ff=5632, seq_len=2048,
             tie_embeddings=False, init_std=0.02)


def write_folders(root: Path) -> dict[str, tuple[Path, Path | None]]:
    """The checkpoint and the training output (each with the tokenizer `load` needs for it)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from safetensors.numpy import save_file

    from benchmarks.generate_bench import gpt2_tokenizer_folder
    from tasks.tokenizer import build_gpt2
    from training.config import ModelConfig
    from training.export import hf_config, hf_state_dict, tokenizer_files
    from training.loop import flatten_params, save_model
    from training.model import init_params

    cfg = ModelConfig(**SHAPE, compute_dtype="bfloat16")
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(lambda s: 0.02 * rng.standard_normal(s.shape, dtype=np.float32), shapes)
    text = build_gpt2(("<|endoftext|>",)).to_str()

    hf = root / "checkpoint"
    hf.mkdir()
    save_file({k: v.astype(jnp.bfloat16) for k, v in hf_state_dict(params, cfg).items()}, str(hf / "model.safetensors"),
              metadata={"format": "pt"})
    (hf / "config.json").write_text(json.dumps({**hf_config(cfg, 0, 1), "torch_dtype": "bfloat16"}))
    for name, content in tokenizer_files(text, "<|endoftext|>", None, cfg.seq_len).items():
        (hf / name).write_text(content)

    save_model(root / "train", cfg, flatten_params(params))
    return {"checkpoint": (hf, None), "training output": (root / "train", gpt2_tokenizer_folder(root / "tokenizer"))}


def probe(model_dir: str, tokenizer_dir: str | None, dtype: str | None) -> dict:
    """In the tree this process imports from: load the model, and report the peak memory: the
    process's anonymous resident memory (RssAnon), sampled every 2 ms while it loads. Not the
    whole resident set's high-water mark: the safetensors files are memory-mapped, and their
    pages, clean and the kernel's to drop, would count there as they are read."""
    import threading
    import time

    import jax

    from evaluation.generate import load

    def anon_bytes() -> int:
        status = Path("/proc/self/status").read_text()
        return 1024 * next(int(line.split()[1]) for line in status.splitlines() if line.startswith("RssAnon:"))

    before = anon_bytes()  # kiln's modules imported, JAX not yet started
    peak, done = [before], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anon_bytes())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if dtype is None:
        model = load(Path(model_dir), None if tokenizer_dir is None else Path(tokenizer_dir))
    else:
        model = load(Path(model_dir), None if tokenizer_dir is None else Path(tokenizer_dir), dtype)
    leaves = jax.block_until_ready(jax.tree_util.tree_leaves(model.params))
    done.set()
    sampler.join()
    return {"peak_rss_bytes": max(peak[0], anon_bytes()), "before_bytes": before, "after_bytes": anon_bytes(),
            "held_bytes": sum(leaf.nbytes for leaf in leaves), "compute": model.cfg.compute_dtype}


def offers_dtype() -> dict:
    """In the tree this process imports from: whether its `load` takes a dtype."""
    import inspect

    from evaluation.generate import load

    return {"offers": "dtype" in inspect.signature(load).parameters}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="the commit to compare with (a git worktree of it is made)")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))  # here only: each probe's process imports the tree it measures
    from benchmarks.trees import probe_in, worktree

    with tempfile.TemporaryDirectory() as tmp:
        folders = write_folders(Path(tmp))
        with worktree(args.baseline, Path(tmp) / "baseline") as baseline:
            for label, (model, tokenizer) in folders.items():
                for dtype in ([None, "bfloat16"] if label == "checkpoint" else [None]):
                    got = {}
                    for name, tree in (("baseline", baseline), ("this tree", REPO)):
                        offered = dtype is not None and probe_in(tree, __file__, "offers_dtype")["offers"]
                        asked = dtype if offered else None
                        got[name] = m = probe_in(tree, __file__, "probe", str(model),
                                                 None if tokenizer is None else str(tokenizer), asked)
                        print(f"{label}, {'--dtype ' + dtype if dtype else 'its own dtype'}, {name}: computes in "
                              f"{m['compute']}, weights {m['held_bytes'] / 1e9:.2f} GB, anonymous memory "
                              f"{m['before_bytes'] / 1e9:.2f} GB before, {m['peak_rss_bytes'] / 1e9:.2f} GB at the "
                              f"peak, {m['after_bytes'] / 1e9:.2f} GB after", flush=True)
                    ratio = got["this tree"]["peak_rss_bytes"] / got["baseline"]["peak_rss_bytes"]
                    print(f"  peak anonymous memory: this tree / baseline = {ratio:.3f}", flush=True)
                    ratio = got["this tree"]["after_bytes"] / got["baseline"]["after_bytes"]
                    print(f"  after the load: this tree / baseline = {ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
