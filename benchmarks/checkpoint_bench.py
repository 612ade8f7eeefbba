"""What a checkpoint costs the training loop: synchronous saves against asynchronous ones.

The same jitted step (benchmarks/train_bench.py's CPU model, ~11M parameters: params and AdamW's
two moments are ~130 MB of float32 to write) runs N steps three ways, interleaved in rounds so a
change in machine load hits all of them:

  none   no saves
  sync   a save every k steps that returns with the checkpoint on disk (orbax, synchronous)
  async  the same saves through training/checkpoint.py's default: the write runs in the
         background while the next steps run; its end is waited for before the clock stops

Saves come as in training/loop.py: at a save step the loop waits for the step, then saves. The last
save is k steps before the end, so its write overlaps steps as every other one does. A save's cost is
(mode's time - none's time) / saves; the blocking part is how long `save` itself held the loop.

    uv run python benchmarks/checkpoint_bench.py                 # 40 steps, a save every 10
    uv run python benchmarks/checkpoint_bench.py --steps 60 --every 10 --rounds 3

Imports only training/, jax, orbax, numpy: no Prefect, no Ray.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from training.checkpoint import Checkpoints
from training.config import ModelConfig, TrainConfig
from training.model import param_count
from training.optim import make_optimizer
from training.step import init_state, make_train_step

MODEL = ModelConfig(vocab_size=8192, d_model=384, n_layers=5, n_heads=6, n_kv_heads=2, d_ff=1024, seq_len=256)
MODES = ("none", "sync", "async")


def timed_run(mode: str, steps: int, every: int, step, init, batches, folder: Path) -> tuple[float, float, int]:
    """Seconds for `steps` steps (saves and the last write's wait included), seconds `save` blocked, saves."""
    state = init(jax.random.PRNGKey(0))
    state, metrics = step(state, batches[0])  # warm: the first call after init is not a steady step
    jax.block_until_ready(metrics["loss"])
    checkpoints = None if mode == "none" else Checkpoints(folder, asynchronous=mode == "async")
    blocked, saves = 0.0, 0
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        state, metrics = step(state, batches[i % len(batches)])
        if checkpoints is not None and i % every == 0 and i < steps:
            loss = float(metrics["loss"])  # the loop waits for the step before saving
            t = time.perf_counter()
            checkpoints.save(i, state, {"step": i, "loss": loss})
            blocked += time.perf_counter() - t
            saves += 1
    jax.block_until_ready(metrics["loss"])
    if checkpoints is not None:
        checkpoints.wait()  # the last write finishes inside the measured time
    seconds = time.perf_counter() - t0
    if checkpoints is not None:
        checkpoints.close()
    return seconds, blocked, saves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="a save every this many steps")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="each mode this many times, interleaved; the best counts")
    args = parser.parse_args()

    cfg = TrainConfig(batch_size=args.batch_size, steps=args.steps + 1, lr=1e-3, warmup=2, peak_flops=1.0)
    optimizer = make_optimizer(cfg)
    step = jax.jit(make_train_step(MODEL, cfg, optimizer), donate_argnums=0)
    init = jax.jit(lambda key: init_state(MODEL, optimizer, key))
    rng = np.random.default_rng(0)
    batches = [jax.device_put(rng.integers(0, MODEL.vocab_size, (cfg.batch_size, MODEL.seq_len + 1), dtype=np.int32))
               for _ in range(8)]
    abstract = jax.eval_shape(init, jax.random.PRNGKey(0))
    state_mb = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(abstract)) / 1e6
    n_params = param_count(abstract["params"])
    print(f"model {n_params / 1e6:.1f}M parameters, train state {state_mb:.0f} MB; {args.steps} steps, "
          f"batch {cfg.batch_size} x {MODEL.seq_len}, a save every {args.every} steps; {jax.devices()[0].device_kind}")

    best: dict[str, tuple[float, float, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in MODES:
                result = timed_run(mode, args.steps, args.every, step, init, batches, Path(tmp) / f"{mode}-{r}")
                print(f"round {r + 1} {mode:5s} {result[0]:7.2f} s  save blocked {result[1]:6.2f} s  "
                      f"({result[2]} saves)", flush=True)
                if mode not in best or result[0] < best[mode][0]:
                    best[mode] = result

    base = best["none"][0]
    print("\n| saves | mean step (s) | cost per save (s) | `save` blocked per save (s) |")
    print("| --- | ---: | ---: | ---: |")
    cost = {}
    for mode in MODES:
        seconds, blocked, saves = best[mode]
        cost[mode] = (seconds - base) / saves if saves else 0.0
        per_save = f"{cost[mode]:.3f}" if saves else "-"
        print(f"| {mode} | {seconds / args.steps:.3f} | {per_save} | "
              f"{f'{blocked / saves:.3f}' if saves else '-'} |")
    print(f"\nasync save cost / sync save cost: {cost['async'] / cost['sync']:.2f}" if cost["sync"] > 0 else
          "\nthe synchronous saves cost nothing measurable at this load: raise --steps or --rounds")


if __name__ == "__main__":
    main()
