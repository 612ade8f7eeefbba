"""The training loop: restore or initialise, step, log, evaluate, checkpoint, publish.

`train` is a plain function of two configs, a batch source and two folders; it neither knows nor
cares whether it runs in a Ray task, a subprocess or a notebook. Data comes through a small
interface so the loop does not depend on the loader's internals:

    batch_at(step) -> int32 [batch_size, seq_len + 1]   a pure function of the step
    val_batches    -> list of int32 [b, seq_len + 1]    the first `eval_batches` are used

Resuming is "restore the state and start the loader at step k": the checkpoint records the data
position (the next step's batch), and because `batch_at` is pure, the resumed run sees exactly
the batches the uninterrupted one would have. On CPU the same config therefore gives bitwise
identical parameters, killed or not.

Outputs. `work_dir` (stable per step version, survives a crash): `checkpoints/`,
`metrics.jsonl`, `loss.png`, `tensorboard/`. `out_dir` (published when complete): `model.json` (ModelConfig),
`params.safetensors` (flat "layers_0/mlp/up_proj/kernel" names, float32), `metrics.jsonl`,
`loss.png`, `tensorboard/` (training/tracking.py), and `steps/<step>/` at each step of
`train.keep_checkpoints`: model.json and params.safetensors (a model folder like the output
itself) and `checkpoint/`, the whole train state there (what `train.init` restores). With several processes all of them compute;
only process 0 writes files.

Everything periodic is a hook (training/hooks.py): validation, the caller's hooks (in-loop
evals), metrics.jsonl, TensorBoard, `on_metrics` (the caller's relay: a step's log, W&B) and
checkpoints. Every `log_every` steps the loop measures one metrics record; each `Hook(fn, every)`
then gets the step, the train state and that record at the steps that are multiples of its
`every` and at the last step. The loop itself is: step, measure, run the hooks that are due.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import save_file

from training import compile_cache
from training.checkpoint import Checkpoints
from tasks.engine.config import is_identity, left_out_at_default
from training.config import DETERMINISTIC_GPU_FLAG, KEPT_DIR, KEPT_STATE, ModelConfig, TrainConfig, flops_per_token
from training.hooks import (Checkpointing, Hook, HookFactory, LoopContext, StepInfo, StopAgreement, TrainingStopped,
                            Validation, writers)
from training.metrics import MetricsLog, device_peak_flops, plot_loss
from training.model import param_count
from training.optim import make_optimizer
from training.sharding import abstract_batch, make_mesh, put_batch, state_shardings
from training.step import (compiler_options, how_it_runs, init_state, make_eval_step, make_split_step,
                           make_train_step, published_params, tokens_per_step, xla_gpu_deterministic)
from training.tracking import TENSORBOARD_DIR, TensorBoardLog

log = logging.getLogger("kiln.training")


def train(model_cfg: ModelConfig, train_cfg: TrainConfig, batch_at: Callable[[int], np.ndarray],
          val_batches: list[np.ndarray], work_dir: Path, out_dir: Path,
          on_metrics: Callable[[dict], None] | None = None, objective=None, init_params: dict | None = None,
          hooks: Sequence[Hook | HookFactory] = (), on_checkpoint: Callable[[list[int]], None] | None = None,
          shared_work: bool = True, start_from: StartFrom | None = None,
          stop_requested: Callable[[], bool] | None = None) -> dict:
    """Train to `train_cfg.steps`, resuming from the latest checkpoint in `work_dir`; write the
    model to `out_dir` and return stats (losses, params_sha256, tokens, seconds, MFU, ...).

    Post-training (training/posttrain.py) passes an `objective` (its loss and batch layout: batches
    are then dicts of arrays) and `init_params` (the pretrained model to start from instead of a
    fresh initialisation; `train.init` mode weights); `start_from` another run's kept state
    (modes continue and reset). Everything else is this same loop. `hooks`: the caller's, as `Hook`s
    or as factories that build them here (training/hooks.py); they run after validation and
    before the writers, so metrics they add are logged. `on_checkpoint(steps)` is called on
    process 0 once a checkpoint's write has finished, with the steps kept, every one complete
    on disk (training/launch.py pushes them to the store).
    `shared_work` False: each process has its own `work_dir` (a remote store's hosts), so every
    process writes whole checkpoints there (training/checkpoint.py, "gathered").
    `stop_requested()` True (process 0's: the run was told Ctrl-C or SIGTERM) ends the loop at
    the step it is at (with several processes, within about 10 s: hooks.StopAgreement), once
    that step's checkpoint is whole: it raises `TrainingStopped`, and a rerun resumes there,
    nothing trained lost."""
    t_start = time.perf_counter()
    compile_cache.enable()
    read_before, saved_before = compile_cache.programs_read()
    work_dir, out_dir = Path(work_dir), Path(out_dir)
    primary = jax.process_index() == 0
    if primary or not shared_work:
        work_dir.mkdir(parents=True, exist_ok=True)
    if primary:
        out_dir.mkdir(parents=True, exist_ok=True)
    _warn_if_nondeterministic_gpu()

    # State: restored from the last checkpoint, or made fresh from the seed.
    program = compiled_program(model_cfg, train_cfg, make_mesh(train_cfg.mesh), objective)
    read, saved = compile_cache.programs_read()
    if read > read_before:
        log.info("read %d compiled program(s) from the compilation cache instead of compiling them (%.1f s saved)",
                 read - read_before, saved - saved_before)
    checkpoints = Checkpoints(work_dir / "checkpoints", gathered=not shared_work and jax.process_count() > 1,
                              timeout_s=max(1, round(train_cfg.checkpoint_timeout_minutes * 60)))
    identity = _identity(model_cfg, train_cfg)
    if objective is not None:
        identity["objective"] = {"class": type(objective).__name__, **dataclasses.asdict(objective)}
    start = checkpoints.latest_step()
    if start is None:
        start, resumed_loss = 0, None
        state = program.init(jax.random.PRNGKey(train_cfg.seed))
        if init_params is not None:  # the optimizer state starts at zero either way
            state = {**state, "params": _placed(init_params, program)}
            if "ema" in state:  # the average starts at the parameters it starts from
                state["ema"] = _placed(init_params, program)
        elif start_from is not None:
            state, start = _restored(start_from, program, identity, train_cfg)
    else:
        state, meta = checkpoints.restore(start, program.abstract, program.shardings)
        if meta["identity"] != identity:
            raise ValueError(f"{work_dir} holds checkpoints of another config ({meta['identity']}); "
                             "point work_dir at this config's own folder or delete it")
        start, resumed_loss = meta["data_position"], meta["loss"]
        log.info("resumed from the checkpoint at step %d", start)

    # Hooks, in the order they run at a step: validation and the caller's (which add metrics),
    # the writers (which log them), the checkpoint.
    ctx = LoopContext(model_cfg, train_cfg, work_dir, primary, program.eval_step,
                      functools.partial(_put, sharding=program.data_sharding))
    metrics_log = MetricsLog(work_dir / "metrics.jsonl", start) if primary else None
    tensorboard = TensorBoardLog(work_dir / TENSORBOARD_DIR, history=metrics_log.records) if primary else None
    checkpointing = Checkpointing(ctx, checkpoints, identity, lambda: metrics_log.records, on_checkpoint)
    caller = [h for hook in hooks for h in ([hook] if isinstance(hook, Hook) else hook(ctx))]
    validating = Validation(ctx, val_batches)
    hooks = [*validating.hooks, *caller, *writers(ctx, metrics_log, tensorboard, on_metrics),
             *_kept_params(ctx), checkpointing.hook]
    clock = _Clock(model_cfg, train_cfg, objective, resumed_loss)
    stop_agreement = StopAgreement(stop_requested, start, train_cfg.log_every) if stop_requested is not None else None

    try:
        for step in range(start, train_cfg.steps):
            batch = _put(_checked(batch_at(step), model_cfg, train_cfg, objective), program.data_sharding)
            state, metrics = program.train_step(state, batch)  # dispatched; runs while Python fetches the next batch
            clock.stepped(metrics)
            done = step + 1
            last = done == train_cfg.steps
            stop = stop_agreement is not None and not last and stop_agreement(done)
            due = [h for h in hooks if h.due(done, last)]
            if not due and not stop:
                continue
            record = clock.record(done) if done % train_cfg.log_every == 0 or last else clock.wait(metrics)
            info = StepInfo(done, last, state, metrics, record, train_cfg.lora)
            for hook in due:  # hook time is not train time
                with clock.paused():
                    hook.fn(info)
            if record is not None:
                log.info("step %d loss %.4f lr %.2e %.0f tok/s", done, record["loss"], record["lr"],
                         record["tokens_per_s"])
            if stop:
                checkpointing.save(info)  # finished (and pushed) on the way out, below
                raise TrainingStopped(done)
    except BaseException as failure:
        # A checkpoint begun before the failure is finished first, so that it is whole on disk for the
        # rerun and no writer thread outlives this call (a rerun in the same process, as a Ray worker
        # or a Python caller makes, would race it for the checkpoint folder).
        try:
            checkpointing.close()
        except Exception as closing:  # the failure is the error to report; the write's is noted on it
            failure.add_note(f"the checkpoint write in flight failed too: {closing!r}")
        raise
    checkpointing.close()

    # Publish: parameters gathered to host memory (a collective with several processes).
    model = published_params(state, train_cfg.lora)  # with LoRA: the merged model; with ema: the average
    params = on_host(model)
    if validating.batches and start == train_cfg.steps:  # resumed at the end: the last evaluation died
        validating.measure(StepInfo(start, True, state, {}, None, train_cfg.lora))
    val_loss = validating.last
    flat = flatten_params(params)
    trained = train_cfg.steps - start
    stats = {
        "final_loss": clock.last_loss,
        "final_val_loss": val_loss,
        **({"final_ema_val_loss": validating.last_ema} if train_cfg.ema is not None else {}),
        "params_sha256": params_sha256(flat),
        "param_count": param_count(params),
        "steps": train_cfg.steps,
        "resumed_from_step": start,
        "tokens": train_cfg.steps * clock.tokens_per_step,
        "seconds": time.perf_counter() - t_start,
        # programs read from the compilation cache in this call (training/compile_cache.py)
        "compiled_programs_read": compile_cache.programs_read()[0] - read_before,
        **clock.totals(trained),
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "platform": jax.devices()[0].platform,
        **how_it_runs(model_cfg, train_cfg),  # attention form, remat: where and how, not what
    }
    if primary:
        save_model(out_dir, model_cfg, flat)
        if train_cfg.lora is not None:  # the adapters alone, for a peft export (training/export.py)
            save_adapters(out_dir / LORA_DIR, train_cfg.lora, flatten_params(on_host(state["adapters"])))
        for step in _kept(train_cfg, start_from):
            shutil.copytree(work_dir / KEPT_DIR / str(step), out_dir / KEPT_DIR / str(step), dirs_exist_ok=True)
        shutil.copyfile(work_dir / "metrics.jsonl", out_dir / "metrics.jsonl")
        tensorboard.close()
        shutil.copytree(work_dir / TENSORBOARD_DIR, out_dir / TENSORBOARD_DIR, dirs_exist_ok=True)
        plot_loss(metrics_log.records, out_dir / "loss.png", title=f"{param_count(params) / 1e6:.1f}M params")
        shutil.copyfile(out_dir / "loss.png", work_dir / "loss.png")
    return stats


class StartFrom(NamedTuple):
    """Another run's state at one of the steps it kept (`<output>/steps/<step>/`), to start from."""

    folder: Path  # the kept step's folder: model.json, params.safetensors, checkpoint/
    step: int
    mode: str  # "continue": carry on at its step and data position; "reset": step counter back to 0


def _restored(start_from: StartFrom, program: CompiledProgram, identity: dict,
              train_cfg: TrainConfig) -> tuple[dict, int]:
    """The kept state placed on this run's mesh, and the step this run starts at."""
    parent = Checkpoints(start_from.folder / KEPT_STATE, asynchronous=False)
    try:
        if parent.latest_step() != start_from.step:
            raise FileNotFoundError(f"{start_from.folder} holds no complete checkpoint of step {start_from.step}: "
                                    "the run it was kept from did not finish writing it; train that run again")
        try:
            state, meta = parent.restore(start_from.step, program.abstract, program.shardings)
        except Exception as e:
            raise ValueError(f"the checkpoint in {start_from.folder} does not fit this run's train state ({e}); "
                             "train.init modes continue and reset need the same model and optimizer (grad_clip on "
                             "or off alike, train.ema set or unset alike): use mode weights to take its parameters "
                             "only") from e
    finally:
        parent.close()
    if meta["identity"]["model"] != identity["model"]:
        raise ValueError(f"{start_from.folder} is a checkpoint of another model ({meta['identity']['model']}); "
                         "train.init needs this step's model config to be its parent's")
    if start_from.mode == "reset":  # moments kept; the schedule and the data order start again
        return {**state, "step": jax.device_put(np.zeros((), np.int32), program.shardings["step"])}, 0
    if meta["data_position"] >= train_cfg.steps:
        raise ValueError(f"train.init continues from step {meta['data_position']}, but train.steps={train_cfg.steps}: "
                         "a continue phase's steps count from the start of the whole run, so make it larger")
    return state, meta["data_position"]


def _kept(train_cfg: TrainConfig, start_from: StartFrom | None) -> tuple[int, ...]:
    """The kept steps this run passes: a continue phase starts after its parent's step."""
    origin = start_from.step if start_from is not None and start_from.mode == "continue" else 0
    return tuple(s for s in train_cfg.kept_steps if s > origin)


def _kept_params(ctx: LoopContext) -> list[Hook]:
    """At each step of `keep_checkpoints`, that step's model (model.json, params.safetensors) into
    `<work folder>/steps/<step>/`, which survives a crash and goes to the store with the
    checkpoints (Checkpointing puts the step's whole state beside it); published with the model."""
    keep = set(ctx.train_cfg.kept_steps)
    if not keep:
        return []

    def save(info: StepInfo) -> None:
        if info.step in keep:
            params = on_host(info.published)
            if ctx.primary:
                save_model(ctx.work_dir / KEPT_DIR / str(info.step), ctx.model_cfg, flatten_params(params))

    return [Hook(save, math.gcd(*keep))]


LORA_DIR = "lora"  # <out_dir>/lora/: lora.json (the LoraConfig) and adapters.safetensors (a/b per target)


def on_host(tree):
    """A tree of (possibly sharded) device arrays whole in this host's memory (a collective with
    several processes: every one calls it)."""
    return jax.device_get(multihost_utils.process_allgather(tree, tiled=True) if jax.process_count() > 1 else tree)


def save_adapters(folder: Path, cfg, flat: dict[str, np.ndarray]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "lora.json").write_text(cfg.model_dump_json(indent=2) + "\n")
    save_file(flat, str(folder / "adapters.safetensors"))


def save_model(folder: Path, model_cfg: ModelConfig, flat: dict[str, np.ndarray]) -> None:
    """A model folder as `load_model` reads it. The parameters are written under a temporary name
    and renamed, so a process killed mid-write leaves no half file behind that name. model.json
    leaves out the fields added after versions were in use while they hold their defaults
    (`identity_when_set`: attention_bias, rope_scaling), as versions do, so that a kiln from
    before such a field still reads the models that do not use it."""
    folder.mkdir(parents=True, exist_ok=True)
    unset = {name for name in type(model_cfg).model_fields
             if left_out_at_default(type(model_cfg), name, getattr(model_cfg, name))}
    (folder / "model.json").write_text(model_cfg.model_dump_json(indent=2, exclude=unset) + "\n")
    save_file(flat, str(folder / "params.safetensors.tmp"))
    os.replace(folder / "params.safetensors.tmp", folder / "params.safetensors")


class _Clock:
    """Train time and the metrics record of a log interval. Train time is the wall time of the
    steps: what hooks take (evaluation, saving, pushing, logging) is left out, and each
    evaluating hook logs its own seconds (training/evals.py)."""

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, objective, last_loss: float | None):
        self.tokens_per_step = tokens_per_step(model_cfg, train_cfg, objective)
        self.step_flops = flops_per_token(model_cfg) * self.tokens_per_step
        self.peak, self.peak_source = device_peak_flops(train_cfg.peak_flops)
        self.pending, self.interval_steps, self.train_seconds = [], 0, 0.0
        self.t_interval = time.perf_counter()
        self.last_loss = last_loss  # the checkpoint's, on a resume that trains no further step

    def stepped(self, metrics: dict) -> None:
        self.pending.append(metrics)
        self.interval_steps += 1

    def wait(self, metrics: dict) -> None:
        """Wait for the step in flight before a hook runs: its time is train time."""
        jax.block_until_ready(metrics)

    def record(self, done: int) -> dict:
        """The interval's metrics record (waits for the steps in flight) and a new interval."""
        fetched = jax.device_get(self.pending)
        seconds = time.perf_counter() - self.t_interval
        self.train_seconds += seconds
        record = {
            "step": done,
            "loss": float(np.mean([m["loss"] for m in fetched])),  # mean over the interval
            "lr": float(fetched[-1]["lr"]),
            "grad_norm": float(fetched[-1]["grad_norm"]),
            "tokens": done * self.tokens_per_step,
            "tokens_per_s": self.interval_steps * self.tokens_per_step / seconds,
            "mfu": self.interval_steps * self.step_flops / seconds / self.peak if self.peak else None,
        }
        for name in fetched[-1]:  # an objective's own metrics (DPO's margin, accuracy), interval means
            if name not in ("loss", "lr", "grad_norm"):
                record[name] = float(np.mean([m[name] for m in fetched]))
        self.last_loss = float(fetched[-1]["loss"])  # the last step's: the run's final loss
        self.pending, self.interval_steps = [], 0
        self.t_interval = time.perf_counter()
        return record

    @contextlib.contextmanager
    def paused(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.t_interval += time.perf_counter() - t0

    def totals(self, trained: int) -> dict:
        seconds, peak = self.train_seconds, self.peak
        return {"tokens_per_s": trained * self.tokens_per_step / seconds if seconds else None,
                "mfu": trained * self.step_flops / seconds / peak if peak and seconds else None,
                "peak_flops": peak, "peak_source": self.peak_source}


class CompiledProgram(NamedTuple):
    abstract: dict  # the state's shapes and dtypes
    shardings: dict  # the state's layout on the mesh
    data_sharding: jax.sharding.NamedSharding
    init: Callable  # key -> state, placed on the mesh
    train_step: Callable  # (state, batch) -> (state, metrics); compiled, state donated
    eval_step: Callable  # (params, batch) -> loss


@functools.lru_cache(maxsize=2)
def compiled_program(model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: jax.sharding.Mesh,
                     objective=None) -> CompiledProgram:
    """Everything compiled for one config on one mesh, compiled before the clock starts and
    kept, so a second run of the same config in this process (a test, a sweep) compiles nothing."""
    if train_cfg.batch_size % mesh.shape["data"]:
        raise ValueError(f"batch_size={train_cfg.batch_size} does not split over the mesh's {mesh.shape['data']} "
                         "data-parallel devices: make it a multiple of that")
    optimizer = make_optimizer(train_cfg)
    ema = train_cfg.ema is not None
    make_state = lambda key: init_state(model_cfg, optimizer, key, train_cfg.lora, ema)  # noqa: E731
    abstract = jax.eval_shape(make_state, jax.random.PRNGKey(0))
    shardings = state_shardings(abstract, mesh, train_cfg.mesh.strategy)
    batch, data_sharding = abstract_batch(train_cfg.batch_size, model_cfg.seq_len, mesh, objective)
    if train_cfg.split_parts:
        train_step = _split_step(model_cfg, train_cfg, optimizer, objective, mesh, abstract, shardings, batch)
    else:
        train_step = jax.jit(make_train_step(model_cfg, train_cfg, optimizer, objective), donate_argnums=0,
                             in_shardings=(shardings, data_sharding), out_shardings=(shardings, None)
                             ).lower(abstract, batch).compile(compiler_options=compiler_options(train_cfg))
    return CompiledProgram(
        abstract, shardings, data_sharding,
        init=jax.jit(make_state, out_shardings=shardings),
        train_step=train_step,
        eval_step=jax.jit(make_eval_step(model_cfg, objective, train_cfg),
                          in_shardings=(shardings["params"], data_sharding)),
    )


def _split_step(model_cfg: ModelConfig, train_cfg: TrainConfig, optimizer, objective, mesh: jax.sharding.Mesh,
                abstract: dict, shardings: dict, batch: jax.ShapeDtypeStruct) -> Callable:
    """`train.split_parts`: (state, batch) -> (state, metrics) as one compiled program per part
    (the same program, called with each part's index) and one that applies them (state donated),
    all compiled here (training/step.py `make_split_step`)."""
    if mesh.size != 1:
        raise ValueError(f"train.split_parts runs on one device, this run has {mesh.size}: leave it out")
    part_grads, apply = make_split_step(model_cfg, train_cfg, optimizer, objective)
    index = NamedSharding(mesh, P())
    part_program = jax.jit(part_grads, in_shardings=(shardings["params"], batch.sharding, index)).lower(
        abstract["params"], batch, jax.ShapeDtypeStruct((), np.int32, sharding=index)).compile()
    outs = [part_program.out_info] * train_cfg.batch_parts
    apply_program = jax.jit(apply, donate_argnums=0, in_shardings=(shardings, None), out_shardings=(shardings, None)
                            ).lower(abstract, outs).compile()
    indices = [jax.device_put(np.int32(p), index) for p in range(train_cfg.batch_parts)]

    def train_step(state: dict, batch):
        return apply_program(state, [part_program(state["params"], batch, p) for p in indices])

    return train_step


def load_model(out_dir: Path) -> tuple[ModelConfig, dict]:
    """The ModelConfig and float32 parameter tree (device arrays) of a published training output."""
    cfg, params = read_model(out_dir)
    return cfg, placed(params)


def read_model(out_dir: Path, dtype=np.float32) -> tuple[ModelConfig, dict]:
    """The ModelConfig and parameter tree, in host memory (numpy), of a published training output:
    float32 as stored, or each parameter converted to `dtype` as it is read (None: the model's
    compute dtype)."""
    out_dir = Path(out_dir)
    cfg = ModelConfig.model_validate_json((out_dir / "model.json").read_text())
    dtype = np.dtype(jax.numpy.dtype(cfg.compute_dtype)) if dtype is None else dtype
    with safe_open(str(out_dir / "params.safetensors"), framework="numpy") as f:
        return cfg, unflatten({name: f.get_tensor(name).astype(dtype, copy=False) for name in f.keys()})


def placed(tree: dict) -> dict:
    """A tree of host (numpy) arrays on the device, one leaf at a time, each host copy let go as its
    device copy is made: the tree is changed in place, so the peak is the weights once and a leaf,
    not twice (measured: benchmarks/RESULTS.md). Then the memory the host copies (and a load's
    conversions) took goes back to the system (`give_back_freed_memory`)."""
    def place(node: dict) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                place(value)
            else:
                node[key] = jax.numpy.asarray(value)

    place(tree)
    give_back_freed_memory()
    return tree


def give_back_freed_memory() -> None:
    """glibc's malloc_trim(0): the C allocator keeps memory that was freed for later allocations,
    which after a load are few (a server's are its slots, made once), so a process would hold
    about the weights' size again for nothing (benchmarks/RESULTS.md). Other C libraries (macOS)
    have no such call, and need none here: nothing is done there."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name is not None else None
    if trim is not None:
        trim(0)


def unflatten(flat: dict[str, np.ndarray]) -> dict:
    """A tree of the arrays of flat "layers_0/mlp/up_proj/kernel" names (`flatten_params`'s inverse)."""
    tree: dict = {}
    for name, array in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = array
    return tree


def params_sha256(flat: dict[str, np.ndarray]) -> str:
    """sha256 over every parameter's name, shape, dtype and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(flat):
        a = np.ascontiguousarray(flat[name])
        h.update(f"{name}:{a.shape}:{a.dtype}\n".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def flatten_params(params) -> dict[str, np.ndarray]:
    """Host arrays by flat "layers_0/mlp/up_proj/kernel" names: safetensors' layout and params_sha256's input."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        out["/".join(str(k.key) for k in path)] = np.asarray(leaf)
    return out


def _identity(model_cfg: ModelConfig, train_cfg: TrainConfig) -> dict:
    """What a checkpoint must agree with to be resumed: the identity fields of both configs."""
    train = {k: v for k, v in train_cfg.model_dump(mode="json").items()
             if is_identity(TrainConfig, k) and not left_out_at_default(TrainConfig, k, getattr(train_cfg, k))}
    return {"model": model_cfg.model_dump(mode="json"), "train": train}


def _put(batch, sharding):
    """A batch (an array, or a dict of arrays for an objective) placed on the mesh."""
    if isinstance(batch, dict):
        return {k: put_batch(v, sharding[k]) for k, v in batch.items()}
    return put_batch(batch, sharding)


def _placed(init_params: dict, program: CompiledProgram) -> dict:
    """Pretrained parameters laid out like a fresh state's; their shapes must be the model's."""
    want = jax.tree_util.tree_map(lambda a: (a.shape, str(a.dtype)), program.abstract["params"])
    got = jax.tree_util.tree_map(lambda a: (tuple(a.shape), str(a.dtype)), init_params)
    if want != got:
        raise ValueError("init_params do not match the model config's parameter shapes: start from a model "
                         "trained with the same ModelConfig (its model.json)")
    return jax.tree_util.tree_map(lambda a, s: jax.device_put(np.asarray(a), s), init_params,
                                  program.shardings["params"])


def _checked(batch, model_cfg: ModelConfig, train_cfg: TrainConfig, objective=None):
    if objective is not None:
        spec = objective.batch_spec(train_cfg.batch_size, model_cfg.seq_len)
        got = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in batch.items()} if isinstance(batch, dict) else batch
        if got != {k: (shape, np.dtype(dtype)) for k, (shape, dtype) in spec.items()}:
            raise ValueError(f"batch_at returned {got}; the {objective.name} objective expects {spec}")
        return batch
    expected = (train_cfg.batch_size, model_cfg.seq_len + 1)
    if batch.shape != expected or batch.dtype != np.int32:
        raise ValueError(f"batch_at returned {batch.dtype} {batch.shape}; expected int32 {expected} "
                         "(batch_size sequences of seq_len + 1 tokens)")
    return batch


def _warn_if_nondeterministic_gpu() -> None:
    if jax.devices()[0].platform == "gpu" and not xla_gpu_deterministic():
        log.warning(f"GPU training without XLA_FLAGS={DETERMINISTIC_GPU_FLAG}: runs of the same "
                    "config may differ in the last bits (launch_training sets it unless told not to)")
