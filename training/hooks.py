"""What runs beside the training step, every N steps: validation, in-loop evals, metrics.jsonl,
TensorBoard, the caller's relay, checkpoints. Each is a `Hook(fn, every)` (Levanter's
`trainer.add_hook(fn, every=N)` is the model): the loop calls `fn(info)` after the steps that are
multiples of `every`, and after the last step, with a `StepInfo`: the step, the host's train
state (parameters and optimizer state, on its devices) and, at a log step, the metrics record
being measured, to which a hook may add its own metrics (the writers, which come after the
evaluating hooks, then write them).

Hooks run on every process: one that computes on the parameters (validation, evals, a
checkpoint) must, since a sharded computation is collective; one that writes files runs on
process 0 only (`primary`). Their time is not train time: the loop leaves it out of tokens/s.
"""

from __future__ import annotations

import functools
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils

from training.checkpoint import Checkpoints
from training.config import KEPT_DIR, KEPT_STATE, LoraConfig, ModelConfig, TrainConfig
from training.metrics import MetricsLog, plot_loss
from training.step import model_params, published_params




@dataclass
class StepInfo:
    """What a hook sees after a step."""

    step: int  # steps done
    last: bool  # the run's last step
    state: dict  # {"params", "opt_state", ...}: this host's train state, on its devices
    step_metrics: dict  # the step's own metrics (loss, lr, grad_norm), on device: fetching one waits for the step
    metrics: dict | None  # the record measured at a log step (else None); hooks may add entries
    lora: LoraConfig | None = None  # train.lora: the state's params are then the frozen base

    @functools.cached_property
    def params(self) -> dict:
        """The parameters the model computes with at this step (with LoRA: merged with the
        adapters, once for every hook of the step)."""
        return model_params(self.state, self.lora)

    @functools.cached_property
    def published(self) -> dict:
        """The model the run publishes at this step: `params`, or with train.ema their moving average."""
        return published_params(self.state, self.lora)


class Hook(NamedTuple):
    """`fn(info)` after every step that is a multiple of `every`, and after the last step."""

    fn: Callable[[StepInfo], None]
    every: int

    def due(self, step: int, last: bool) -> bool:
        return step % self.every == 0 or last


@dataclass(frozen=True)
class LoopContext:
    """What a hook factory gets on its host to build its hook: the configs, this host's work folder
    (what the driver prepared for the hosts is there), whether this is process 0, and the
    compiled evaluation step of the program (params, batch) -> mean loss."""

    model_cfg: ModelConfig
    train_cfg: TrainConfig
    work_dir: Path
    primary: bool
    eval_step: Callable
    put_batch: Callable[[Any], Any]  # a host batch placed on the mesh like a training batch


class HookFactory(Protocol):
    """A picklable callable that a step hands to training (through Ray to every host), which
    builds its hook there: hooks hold device arrays and compiled functions, which travel badly."""

    def __call__(self, ctx: LoopContext) -> list[Hook]: ...


class Validation:
    """val_loss (of the trained parameters) and, with train.ema, ema_val_loss (of their moving
    average) into the record every `eval_every` steps (at log steps) and at the last step; `last`
    and `last_ema` are the latest values (on every process: each computes them)."""

    def __init__(self, ctx: LoopContext, val_batches: list):
        self.ctx, self.last, self.last_ema = ctx, None, None
        self.batches = [ctx.put_batch(b) for b in val_batches[:ctx.train_cfg.eval_batches]]
        self.hooks = [Hook(self, ctx.train_cfg.eval_every)] if self.batches else []

    def __call__(self, info: StepInfo) -> None:
        if info.metrics is not None:
            info.metrics.update(self.measure(info))

    def measure(self, info: StepInfo) -> dict:
        """The validation losses of the state in `info`, kept as `last` and `last_ema`."""
        measured = {"val_loss": self.loss(info.params)}
        if "ema" in info.state:
            measured["ema_val_loss"] = self.loss(info.state["ema"])
        self.last, self.last_ema = measured["val_loss"], measured.get("ema_val_loss")
        return measured

    def loss(self, params) -> float:
        """Mean validation loss over the batches (all the same size, so the mean of means)."""
        return float(np.mean([jax.device_get(self.ctx.eval_step(params, b)) for b in self.batches]))


def writers(ctx: LoopContext, metrics_log: MetricsLog | None, tensorboard, on_metrics) -> list[Hook]:
    """metrics.jsonl, TensorBoard and the caller's relay (a step's log, W&B), on process 0."""
    if not ctx.primary:
        return []
    every = ctx.train_cfg.log_every
    fns = [metrics_log.write, tensorboard.write, *([on_metrics] if on_metrics is not None else [])]
    return [Hook(lambda info, fn=fn: fn(info.metrics), every) for fn in fns]


class Checkpointing:
    """Saves every `checkpoint_every` steps, at the last step, and at a log step once
    `checkpoint_every_minutes` have passed (the same decision on every process: a save is
    collective). The write runs in the background; a finished one is reported at a later call
    (or by `close`), so `on_checkpoint(steps)` only ever sees complete checkpoints, and
    loss.png is redrawn then."""

    def __init__(self, ctx: LoopContext, checkpoints: Checkpoints, identity: dict, records: Callable[[], list],
                 on_checkpoint: Callable[[list[int]], None] | None):
        self.ctx, self.checkpoints, self.identity = ctx, checkpoints, identity
        self.records, self.on_checkpoint = records, on_checkpoint
        self.saved_at = time.monotonic()  # the time cadence counts from the last save (or the start)
        self.saved_step: int | None = None
        self.closed = False
        cfg = ctx.train_cfg
        self.keep = set(cfg.kept_steps)
        self.hook = Hook(self, math.gcd(cfg.checkpoint_every, cfg.log_every, *self.keep))

    def __call__(self, info: StepInfo) -> None:
        cfg = self.ctx.train_cfg
        if (info.step % cfg.checkpoint_every == 0 or info.last or info.step in self.keep
                or (info.step % cfg.log_every == 0 and _minutes_passed(self.saved_at, cfg.checkpoint_every_minutes))):
            self.save(info)
        self._finished(self.checkpoints.finished())

    def save(self, info: StepInfo) -> None:
        """Begin a checkpoint of `info.step` (once: a second call for the same step does nothing)."""
        if self.saved_step == info.step:
            return
        self._finished(self.checkpoints.wait())  # pushed before the next save starts to drop old steps
        self.checkpoints.save(info.step, info.state, {
            "step": info.step, "data_position": info.step, "loss": float(info.step_metrics["loss"]),
            "identity": self.identity})
        self.saved_at, self.saved_step = time.monotonic(), info.step

    def close(self) -> None:
        """The last save is complete (and reported) before the model is published."""
        if self.closed:
            return
        self.closed = True
        self._finished(self.checkpoints.wait())
        self.checkpoints.close()

    def _finished(self, steps: list[int] | None) -> None:
        if steps is not None:
            # complete on disk: a copy beside the step's model, by process 0, whose folder holds the
            # arrays (all of them in a shared folder; the gathered state when each has its own)
            for step in self.keep.intersection(steps):
                kept = self.ctx.work_dir / KEPT_DIR / str(step) / KEPT_STATE
                if self.ctx.primary and not (kept / str(step)).exists():
                    shutil.copytree(self.checkpoints.folder(step), kept / str(step))
        if steps is not None and self.ctx.primary:
            plot_loss(self.records(), self.ctx.work_dir / "loss.png", title=f"step {max(steps)}")
            if self.on_checkpoint is not None:
                self.on_checkpoint(steps)


class TrainingStopped(Exception):
    """The loop stopped on request (Ctrl-C or SIGTERM to the run) at `step`, its checkpoint saved
    there: the rerun resumes from that step."""

    def __init__(self, step: int):
        super().__init__(f"training stopped on request at step {step}, its checkpoint saved there")
        self.step = step

    def __reduce__(self):  # through Ray's pickling, with its step
        return TrainingStopped, (self.step,)


class StopAgreement:
    """Whether the loop stops after a step: `agreement(step)`. One process asks at every step.
    Several stop together (a checkpoint is collective), so process 0, the only one told of the
    stop, tells the others at agreed steps, and at each names the next: `within_s` seconds of its
    steps ahead, at least the next step and at most `log_every` steps. A stop is then agreed
    within about `within_s` however long the steps are; at the next log step before, which at 8B
    (20 s steps, log_every 10) outlasted the stop's grace, so the hosts were cancelled without
    their checkpoint. Each agreement waits for the step's devices (a collective), so fast steps
    are not asked every time: that would cost them the overlap of host and devices."""

    def __init__(self, stop_requested: Callable[[], bool], start: int, log_every: int, within_s: float = 10.0):
        self.stop_requested, self.log_every, self.within_s = stop_requested, log_every, within_s
        self.next = start + 1  # the first step's time holds the compile: the next is then asked too
        self.asked = (start, time.monotonic())

    def __call__(self, step: int) -> bool:
        if jax.process_count() == 1:
            return self.stop_requested()
        if step < self.next:
            return False
        now = time.monotonic()
        per_step = max(now - self.asked[1], 1e-6) / max(step - self.asked[0], 1)  # process 0's is the one that counts
        ahead = int(min(self.log_every, max(1, self.within_s // per_step)))
        stop, ahead = multihost_utils.broadcast_one_to_all(np.array([self.stop_requested(), ahead], np.int32))
        self.next, self.asked = step + int(ahead), (step, now)
        return bool(stop)


def _minutes_passed(since: float, minutes: float | None) -> bool:
    """Whether `minutes` of wall time have passed since `since`, by process 0's clock: with several
    processes it decides and tells the others, so all of them save at the same step."""
    if minutes is None:
        return False
    due = time.monotonic() - since >= minutes * 60
    if jax.process_count() > 1:
        due = bool(multihost_utils.broadcast_one_to_all(np.int32(due)))
    return due
