"""Small models' steps, side by side in one run: where a step goes beyond the jitted computation.

At a newcomer's first shapes (nanoGPT's own CPU recipe, "I only have a macbook": 4 layers, 4
heads, 128 wide, context 64, batch 12; and configs/tiny_cpu.yaml's model at batch 16 x 128) a
step is tens of milliseconds, so whatever the loop does around it shows. Contenders, each on the
same random batches:

  step    the compiled train step alone: batches already on the device, one wait at the end
  kiln    training.loop.train as the train step runs it: batches from a `batch_at` function, put
          on the device each step, metrics every log_every steps, validation and checkpoints at
          the config's cadence (their time is not train time; the whole call's time is shown too)
  kiln1   the same with train.batch_parts 1: each batch as one computation, whose ops XLA's CPU
          runtime runs one at a time (both shapes here train with batch_parts 2, two independent
          halves that it runs on the two cores side by side; configs/tiny_cpu.yaml sets it; at
          nanoGPT's shape as two programs, train.split_parts)
  ray     the same loop inside a Ray task, as `kiln run` launches it (training.launch), with the
          metrics relayed to this process
  ray2    the same with resources.cpu_devices 2 (and train.mesh.strategy dp): the task's JAX has two
          CPU devices and the step splits each batch over them, one per core
  torch   the same architecture in PyTorch eager, from the same weights, with the same AdamW
          (benchmarks/train_bench.py's twin; its first losses are checked against JAX's)

Printed per shape: ms per step and steps/s of each (best round), the loop's own cost per step
(kiln - step; goal < 5 ms), kiln / torch in steps/s (goal >= 1.0) on one CPU device and on two
(ray2: what a config with `resources.cpu_devices: 2` runs), both as best round against best
round and as the median of each round's ratio (a round's contenders run minutes apart at most,
so the load that moves every number moves both sides of a round's ratio alike), and how steady
the tokens/s of kiln's log steps are (the lowest against the median, goal >= 0.5). Before the
rounds, with torch, `--windows` paired windows: the compiled step (batch_parts 1 and the shape's)
and torch's step, 10 steps each in turn, states kept, so each ratio is of neighbouring windows
(`paired_windows`); on a shared 2-core VM whose speed wanders by 20% over minutes, the steadier
number. Then, with torch, `--loop-steps` steps of kiln's loop itself paired the same way
(`paired_loop`: a hook at each log step runs torch's steps, then the compiled step's, outside
train time), whose medians are the verdict on the loop: kiln / torch and the loop's own cost.

    uv run --dev python benchmarks/small_step_bench.py                # both shapes, 3 rounds
    uv run --dev python benchmarks/small_step_bench.py --no-ray --rounds 2
    uv run --dev python benchmarks/small_step_bench.py --rounds 0 --no-ray     # the paired measures only

torch is not one of kiln's dependencies: README, "The PyTorch checks" (without it, --no-torch).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from train_bench import bare_step, check_twins_agree, machine, make_batches, run_bare, run_torch, torch_twin
from training.config import ModelConfig, ResourcesConfig, TrainConfig, model_and_train
from training.loop import train
from training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]


def shapes(steps: int) -> dict[str, tuple[ModelConfig, TrainConfig]]:
    """nanoGPT's CPU recipe (its character vocabulary of 65, multi-head attention, lr 1e-3 to 1e-4,
    warmup 100, beta2 0.99; batch_parts 2 as docs/configuration.md advises on a 2-core CPU, as
    separate programs: split_parts, 1.08-1.14x one program's steps/s at this shape) and the
    tiny config's model and train sections (its BPE's 4,096 tokens), each for `steps` steps with
    validation and checkpoints every steps // 3."""
    cadence = {"log_every": 10, "eval_every": steps // 3, "checkpoint_every": steps // 3, "eval_batches": 4}
    nanogpt = ModelConfig(vocab_size=65, d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=512, seq_len=64)
    nanogpt_train = TrainConfig(batch_size=12, steps=steps, lr=1e-3, min_lr_ratio=0.1, warmup=min(100, steps // 4),
                                beta2=0.99, batch_parts=2, split_parts=True, **cadence)
    tiny_model, tiny_train = model_and_train(str(REPO / "configs" / "tiny_cpu.yaml"))
    tiny_train = tiny_train.model_copy(update={"steps": steps, "warmup": min(tiny_train.warmup, steps // 4), **cadence})
    return {"nanogpt": (nanogpt, nanogpt_train), "tiny_cpu": (tiny_model.model_copy(update={"vocab_size": 4096}), tiny_train)}


def _random_data(model: ModelConfig, cfg: TrainConfig):
    """batch_at and validation batches of random tokens, as train_bench's `make_batches` draws them.
    Self-contained (numpy only), so that Ray pickles it whole for its worker."""
    def draw(n: int, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        return rng.integers(0, model.vocab_size, (n, cfg.batch_size, model.seq_len + 1), dtype=np.int32)

    batches = draw(8, 0)
    return (lambda step: batches[step % len(batches)]), list(draw(cfg.eval_batches, 1))


def run_kiln(model: ModelConfig, cfg: TrainConfig) -> tuple[float, float, list[float]]:
    """(train seconds per step, whole call's seconds per step, tokens/s of each log step)."""
    batch_at, val = _random_data(model, cfg)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        stats = train(model, cfg, batch_at, val, Path(tmp) / "w", Path(tmp) / "o")
        whole = time.perf_counter() - t0
        speeds = [r["tokens_per_s"] for r in read_metrics(Path(tmp) / "o" / "metrics.jsonl")]
    tokens = cfg.batch_size * model.seq_len
    return tokens / stats["tokens_per_s"], whole / cfg.steps, speeds


def run_ray(model: ModelConfig, cfg: TrainConfig, cpu_devices: int = 1) -> float:
    """Train seconds per step of the loop inside a Ray task (a private local Ray, as kiln run),
    its JAX with `cpu_devices` CPU devices (data parallel, parameters replicated)."""
    from training.launch import launch_training

    if cpu_devices > 1:
        # split_parts runs on one device: on two, the batch splits over them instead
        cfg = cfg.model_copy(update={"mesh": cfg.mesh.model_copy(update={"strategy": "dp"}), "split_parts": False})
    with tempfile.TemporaryDirectory() as tmp:
        stats = launch_training(model, cfg, ResourcesConfig(cpus_per_host=2, cpu_devices=cpu_devices),
                                functools.partial(_random_data, model, cfg),
                                Path(tmp) / "w", Path(tmp) / "o", on_metrics=lambda record: None)
    if stats["devices"] != cpu_devices:
        raise RuntimeError(f"the Ray task's JAX had {stats['devices']} devices, not the {cpu_devices} asked for")
    return cfg.batch_size * model.seq_len / stats["tokens_per_s"]


def per_step(tokens_per_s: float, model: ModelConfig, cfg: TrainConfig) -> float:
    return cfg.batch_size * model.seq_len / tokens_per_s


def step_window(step, state, device_batches: list, n: int = 10):
    """(state, seconds per step) of `n` steps of a compiled kiln step `step(state, batch) -> (state,
    metrics)`, after one untimed step, so that nothing is in flight when the clock starts."""
    state, metrics = step(state, device_batches[0])
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for i in range(n):
        state, metrics = step(state, device_batches[i % len(device_batches)])
    jax.block_until_ready(metrics)
    return state, (time.perf_counter() - t0) / n


def torch_window(torch_step, torch_batches: list, done: int, steps: int, n: int = 10) -> float:
    """Seconds per step of `n` steps of the torch twin, its schedule at step `done` (mod `steps`)."""
    t0 = time.perf_counter()
    for i in range(n):
        loss = torch_step((done + i) % steps, torch_batches[i % len(torch_batches)])
    float(loss)
    return (time.perf_counter() - t0) / n


def paired_windows(model: ModelConfig, cfg: TrainConfig, batches: np.ndarray, windows: int, window: int = 10) -> None:
    """The compiled step with batch_parts 1 and with the shape's, and the torch twin's step, each
    `window` steps at a time, in turn, `windows` times, every state kept from one window to the
    next: neighbouring windows are seconds apart, so a ratio of two of them is measured under one
    load, where best rounds minutes apart are not. Prints each one's median ms/step and the median
    of the windows' ratios."""
    import torch

    variants = {"step, batch_parts 1": {"batch_parts": 1, "split_parts": False}}
    if cfg.batch_parts > 1:
        variants[f"step, batch_parts {cfg.batch_parts}"] = {"split_parts": False}
    if cfg.split_parts:
        variants[f"step, {cfg.batch_parts} parts split"] = {}
    configs = {name: cfg.model_copy(update=update) for name, update in variants.items()}
    steps, states = {}, {}
    for name, c in configs.items():
        init, steps[name] = bare_step(model, c, batches)
        states[name] = init(jax.random.PRNGKey(c.seed))
    device_batches = [jax.device_put(b) for b in batches]
    torch_step, torch_batches = torch_twin(model, cfg, False), [torch.from_numpy(b.astype(np.int64)) for b in batches]
    times: dict[str, list[float]] = {name: [] for name in [*configs, "torch"]}
    for w in range(windows):
        for name, step in steps.items():
            states[name], seconds = step_window(step, states[name], device_batches, window)
            times[name].append(seconds)
        times["torch"].append(torch_window(torch_step, torch_batches, w * window, cfg.steps, window))
    print(f"  paired windows ({windows} x {window} steps each, in turn):")
    for name, t in times.items():
        ratio = "" if name == "torch" else \
            f"  / torch eager = {statistics.median(a / b for a, b in zip(times['torch'], t)):.3f} in steps/s"
        print(f"    {name:18s} {statistics.median(t) * 1e3:8.2f} ms/step (median){ratio}")


def paired_loop(model: ModelConfig, cfg: TrainConfig, batches: np.ndarray, steps: int) -> None:
    """kiln's loop against the torch twin and the compiled step, paired: `training.loop.train`
    runs `steps` steps at the shape's cadence (metrics every log_every steps, validation and
    checkpoints every steps // 3) with one hook of the caller's at each log step, which runs
    log_every steps of the torch twin, then of the compiled step alone (its own state). Hook time
    is not train time, so each log interval's tokens/s (metrics.jsonl) is the loop's alone, with
    everything it does per step, and the two windows after it were measured seconds later under
    the same load. Prints medians of each and of the intervals' ratios: kiln / torch in steps/s
    and the loop's own cost, interval - step window."""
    import torch

    from training.hooks import Hook

    cfg = cfg.model_copy(update={"steps": steps, "eval_every": steps // 3, "checkpoint_every": steps // 3})
    window = cfg.log_every
    torch_step, torch_batches = torch_twin(model, cfg, False), [torch.from_numpy(b.astype(np.int64)) for b in batches]
    init, step = bare_step(model, cfg, batches)
    bare = {"state": init(jax.random.PRNGKey(cfg.seed))}
    device_batches = [jax.device_put(b) for b in batches]
    torch_s, step_s = [], []

    def windows(info) -> None:
        if info.metrics is None:  # the last step, when it is not a log step
            return
        torch_s.append(torch_window(torch_step, torch_batches, len(torch_s) * window, steps, window))
        bare["state"], seconds = step_window(step, bare["state"], device_batches, window)
        step_s.append(seconds)

    batch_at, val = _random_data(model, cfg)
    with tempfile.TemporaryDirectory() as tmp:
        train(model, cfg, batch_at, val, Path(tmp) / "w", Path(tmp) / "o", hooks=[Hook(windows, window)])
        kiln_s = [per_step(r["tokens_per_s"], model, cfg) for r in read_metrics(Path(tmp) / "o" / "metrics.jsonl")]
    kiln_s = kiln_s[1:len(torch_s)]  # the first interval holds the program's first runs
    torch_s, step_s = torch_s[1:], step_s[1:]
    print(f"  kiln's loop, paired ({len(kiln_s)} log intervals of {window} steps, each followed by {window} steps of "
          f"torch, then of the compiled step):")
    for what, t in (("kiln loop", kiln_s), ("compiled step", step_s), ("torch", torch_s)):
        print(f"    {what:18s} {statistics.median(t) * 1e3:8.2f} ms/step (median)")
    print(f"    kiln loop / torch eager = {statistics.median(t / k for t, k in zip(torch_s, kiln_s)):.3f} in steps/s, "
          "median of the intervals' ratios  (goal >= 1.0)")
    print(f"    loop's own cost per step, interval - step window: "
          f"{statistics.median(k - b for k, b in zip(kiln_s, step_s)) * 1e3:+.2f} ms, median  (goal < 5 ms)")


def bench(name: str, model: ModelConfig, cfg: TrainConfig, args) -> None:
    print(f"\n{name}: d_model {model.d_model}, {model.n_layers} layers, {model.n_heads} heads "
          f"({model.n_kv_heads} kv), vocab {model.vocab_size}, batch {cfg.batch_size} x {model.seq_len}, "
          f"{cfg.steps} steps x {args.rounds} rounds", flush=True)
    batches = make_batches(model, cfg, 8)
    if not args.no_torch:
        print(f"  twins agree: max |loss_jax - loss_torch| over 3 steps = {check_twins_agree(model, cfg, batches):.2e}")
        if args.windows:
            paired_windows(model, cfg, batches, args.windows)
        if args.loop_steps:
            paired_loop(model, cfg, batches, args.loop_steps)
    results: dict[str, list[float]] = {}
    whole, speeds = [], []

    def kiln():
        step_s, whole_s, log_speeds = run_kiln(model, cfg)
        whole.append(whole_s)
        speeds.append(log_speeds)
        return step_s

    contenders = {"step": lambda: per_step(run_bare(model, cfg, batches), model, cfg), "kiln": kiln}
    if cfg.batch_parts > 1:  # with 1 part, kiln is already the whole-batch loop
        contenders["kiln1"] = lambda: run_kiln(model, cfg.model_copy(update={"batch_parts": 1, "split_parts": False}))[0]
    if not args.no_ray:
        contenders["ray"] = lambda: run_ray(model, cfg)
        contenders["ray2"] = lambda: run_ray(model, cfg, cpu_devices=2)
    if not args.no_torch:
        contenders["torch"] = lambda: per_step(run_torch(model, cfg, batches), model, cfg)
    if not args.rounds:  # --rounds 0: the paired windows only
        return
    for r in range(args.rounds):  # interleaved, so a change in load hits every contender
        for contender, fn in contenders.items():
            results.setdefault(contender, []).append(fn())
            print(f"  round {r + 1} {contender:6s} {results[contender][-1] * 1e3:8.2f} ms/step", flush=True)
    best = {k: min(v) for k, v in results.items()}
    for contender, s in best.items():
        print(f"  {contender:6s} {s * 1e3:8.2f} ms/step  {1 / s:7.1f} steps/s")
    print(f"  kiln's whole train call (compilation, validation, checkpoints included): {min(whole) * 1e3:.2f} ms/step")
    print(f"  loop's own cost per step, kiln - step: {(best['kiln'] - best['step']) * 1e3:+.2f} ms  (goal < 5 ms)")
    if "ray" in best:
        print(f"  in a Ray task, ray - step: {(best['ray'] - best['step']) * 1e3:+.2f} ms")
    if "torch" in best:
        for contender, what in (("kiln", f"kiln (batch_parts {cfg.batch_parts})"), ("kiln1", "kiln (batch_parts 1)"),
                                ("ray2", "kiln on 2 CPU devices (ray2)")):
            if contender in best:
                per_round = statistics.median(t / k for t, k in zip(results["torch"], results[contender]))
                print(f"  {what} / torch eager = {best['torch'] / best[contender]:.3f} in steps/s, best rounds; "
                      f"{per_round:.3f}, median of the rounds' ratios  (goal >= 1.0)")
    steady = min(min(s[1:]) / statistics.median(s[1:]) for s in speeds if len(s) > 2)
    print(f"  tokens/s of kiln's log steps after the first, lowest / median over every round: {steady:.2f}  "
          "(goal >= 0.5)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shapes", nargs="*", default=["nanogpt", "tiny_cpu"])
    p.add_argument("--no-ray", action="store_true", help="leave out the loop inside a Ray task")
    p.add_argument("--no-torch", action="store_true", help="leave out the PyTorch twin")
    p.add_argument("--windows", type=int, default=20, help="paired 10-step windows of the compiled step and "
                   "torch's, before the rounds (0: none)")
    p.add_argument("--loop-steps", type=int, default=300, help="steps of kiln's loop paired with torch and the "
                   "compiled step at each log step, before the rounds (0: none)")
    args = p.parse_args()
    print(f"machine: {machine()}; jax {jax.__version__}", flush=True)
    for name, (model, cfg) in shapes(args.steps).items():
        if name in args.shapes:
            bench(name, model, cfg, args)
    print(f"\nmachine at the end: {machine()}")


if __name__ == "__main__":
    main()
