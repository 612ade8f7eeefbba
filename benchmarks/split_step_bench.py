"""One step's parts as separate programs: does dispatching them one by one use both cores better?

`train.batch_parts: 2` computes a batch's two halves in one program, and XLA's CPU runtime runs
their ops on its two threads; a profile of nanoGPT's CPU recipe shape showed the threads idle a
fifth of the step, both halves' ops running on one thread for stretches (benchmarks/RESULTS.md,
session 18). Here the same step is split into programs: each half's loss and gradient its own
dispatch (one compiled program, called once per half), then one program that averages them and
applies AdamW (state donated), as `training.step.make_train_step` does in one. JAX dispatches
asynchronously, so the two halves' programs are in flight at once. Paired windows (10 steps
each, in turn, states kept): the one-program step (kiln's, `bare_step`), the split step, and the
torch twin; medians of the neighbouring windows' ratios, and how far the two kiln states are
apart after 10 steps (the same math; the sums' order may differ).

    uv run --dev python benchmarks/split_step_bench.py            # nanoGPT's shape, 20 windows
    uv run --dev python benchmarks/split_step_bench.py --shape tiny_cpu --windows 10

An experiment for the loop (not what `kiln run` does today). torch: README, "The PyTorch checks".
"""

from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np
import optax

from small_step_bench import shapes, step_window, torch_window
from train_bench import bare_step, machine, make_batches, torch_twin
from training.optim import lr_schedule, make_optimizer, scaled
from training.step import next_token


def split_step(model, cfg, batches: np.ndarray):
    """step(state, i) -> (state, loss) on batch i's halves (put on the device here): one compiled
    half-batch loss-and-gradient program, dispatched once per half, and one apply program."""
    optimizer, schedule, objective = make_optimizer(cfg), lr_schedule(cfg), next_token(model, cfg)
    P = cfg.batch_parts
    half_grads = jax.jit(jax.value_and_grad(lambda params, part: objective.loss(params, part, model)[0]))

    def apply_body(state, losses, grads):
        mean = jax.tree_util.tree_map(lambda *xs: sum(xs) / P, *grads)
        updates, opt_state = optimizer.update(mean, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], scaled(updates, schedule(state["step"])))
        return {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state}, sum(losses) / P

    apply = jax.jit(apply_body, donate_argnums=0)
    parts = [[jax.device_put(b[p::P]) for p in range(P)] for b in batches]  # part p: rows p, p+P, ... as `interleaved`

    def step(state, i):
        outs = [half_grads(state["params"], part) for part in parts[i % len(parts)]]
        return apply(state, [loss for loss, _ in outs], [g for _, g in outs])

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="nanogpt", choices=["nanogpt", "tiny_cpu"])
    p.add_argument("--windows", type=int, default=20)
    args = p.parse_args()
    print(f"machine: {machine()}; jax {jax.__version__}", flush=True)
    model, cfg = shapes(150)[args.shape]
    batches = make_batches(model, cfg, 8)
    init, fused = bare_step(model, cfg, batches)
    split = split_step(model, cfg, batches)
    device_batches = [jax.device_put(b) for b in batches]
    fused_state, split_state = init(jax.random.PRNGKey(cfg.seed)), init(jax.random.PRNGKey(cfg.seed))
    for i in range(10):
        fused_state, _ = fused(fused_state, device_batches[i % len(batches)])
        split_state, _ = split(split_state, i)
    apart = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
                zip(jax.tree_util.tree_leaves(fused_state["params"]), jax.tree_util.tree_leaves(split_state["params"])))
    print(f"{args.shape}: batch {cfg.batch_size} x {model.seq_len} in {cfg.batch_parts} parts; after 10 steps the two "
          f"kiln states' parameters differ by at most {apart:.2e}")

    import torch
    torch_step, torch_batches = torch_twin(model, cfg, False), [torch.from_numpy(b.astype(np.int64)) for b in batches]
    times: dict[str, list[float]] = {"one program": [], "split": [], "torch": []}
    batch_indices = list(range(len(batches)))  # what `split` takes in place of a batch
    for w in range(args.windows):
        fused_state, seconds = step_window(fused, fused_state, device_batches)
        times["one program"].append(seconds)
        split_state, seconds = step_window(split, split_state, batch_indices)
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
