"""One step's parts as separate programs (`train.split_parts`) against one program: which is faster at a shape?

`train.batch_parts: 2` computes a batch's two halves in one program, and XLA's CPU runtime runs
their ops on its two threads; a profile of nanoGPT's CPU recipe shape showed the threads idle a
fifth of the step, both halves' ops running on one thread for stretches (benchmarks/RESULTS.md,
session 18). With `train.split_parts` the loop runs each half's loss and gradient as its own
dispatch (one compiled program, called once per half), then one program that averages them and
applies AdamW (state donated: training/loop.py `_split_step`). JAX dispatches asynchronously, so
the two halves' programs are in flight at once. Paired windows (10 steps each, in turn, states
kept): the one-program step, the split step (both as the loop compiles them, `bare_step`), and
the torch twin; medians of the neighbouring windows' ratios, and how far the two kiln states are
apart after 10 steps (the same math; the sums' order may differ).

    uv run --dev python benchmarks/split_step_bench.py            # nanoGPT's shape, 20 windows
    uv run --dev python benchmarks/split_step_bench.py --shape tiny_cpu --windows 10

torch: README, "The PyTorch checks".
"""

from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np

from small_step_bench import shapes, step_window, torch_window
from train_bench import bare_step, machine, make_batches, torch_twin


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="nanogpt", choices=["nanogpt", "tiny_cpu"])
    p.add_argument("--windows", type=int, default=20)
    args = p.parse_args()
    print(f"machine: {machine()}; jax {jax.__version__}", flush=True)
    model, cfg = shapes(150)[args.shape]
    batches = make_batches(model, cfg, 8)
    init, fused = bare_step(model, cfg.model_copy(update={"batch_parts": 2, "split_parts": False}), batches)
    split_init, split = bare_step(model, cfg.model_copy(update={"batch_parts": 2, "split_parts": True}), batches)
    device_batches = [jax.device_put(b) for b in batches]
    fused_state, split_state = init(jax.random.PRNGKey(cfg.seed)), split_init(jax.random.PRNGKey(cfg.seed))
    for i in range(10):
        fused_state, _ = fused(fused_state, device_batches[i % len(batches)])
        split_state, _ = split(split_state, device_batches[i % len(batches)])
    apart = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
                zip(jax.tree_util.tree_leaves(fused_state["params"]), jax.tree_util.tree_leaves(split_state["params"])))
    print(f"{args.shape}: batch {cfg.batch_size} x {model.seq_len} in {cfg.batch_parts} parts; after 10 steps the two "
          f"kiln states' parameters differ by at most {apart:.2e}")

    import torch
    torch_step, torch_batches = torch_twin(model, cfg, False), [torch.from_numpy(b.astype(np.int64)) for b in batches]
    times: dict[str, list[float]] = {"one program": [], "split": [], "torch": []}
    for w in range(args.windows):
        fused_state, seconds = step_window(fused, fused_state, device_batches)
        times["one program"].append(seconds)
        split_state, seconds = step_window(split, split_state, device_batches)
        times["split"].append(seconds)
        times["torch"].append(torch_window(torch_step, torch_batches, w * 10, cfg.steps))
    for name, t in times.items():
        ratio = "" if name == "torch" else \
            f"  kiln / torch eager = {statistics.median(a / b for a, b in zip(times['torch'], t)):.3f} in steps/s"
        print(f"  {name:12s} {statistics.median(t) * 1e3:8.2f} ms/step (median){ratio}")
    print(f"  split / one program = {statistics.median(a / b for a, b in zip(times['one program'], times['split'])):.3f} "
          "in steps/s (median of the windows' ratios)")


if __name__ == "__main__":
    main()
