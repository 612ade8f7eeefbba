"""Run one step as a Prefect task: cached by version, published atomically, traced.

`step_task` is the one Prefect task every step runs as; `run_step_body` computes and publishes an
output; `prepare` decides, before submission, whether what the store holds may be a cache hit;
`publish_shown` turns what a body asked to show (tables, markdown, images, progress) into Prefect
artifacts; `watching` lets something else in the process (kiln run's progress bars) follow the
steps as they run. The scheduler (tasks/engine/scheduler.py) decides when each step runs.
"""

from __future__ import annotations

import base64
import contextlib
import json
import sys
import logging
import shutil
import time
import traceback
from dataclasses import dataclass, field
from typing import Protocol

from prefect import get_run_logger, task
from prefect.context import get_run_context

from tasks.engine import local_ray
from tasks.engine.caching import result_storage, step_cache_policy
from tasks.engine.lineage import build_lineage, now, publish_to_prefect
from tasks.engine.step import Shown, Step, StepContext
from tasks.engine.store import Store, check_output, verify_output


class StepFailed(RuntimeError):
    """A stage body raised; the message names the stage, its version and the cause."""


class _StopsSaidBriefly(logging.Filter):
    """Prefect logs a task that raised at ERROR with its tracebacks: for a step that stopped because
    the run is stopping (`local_ray.Stopped`, its message starting with STOPPING) that was 33 lines
    for one Ctrl-C, read as a crash. The user asked for the stop: its lines are warnings, without
    the traceback (the step's failure record in the store keeps it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if local_ray.STOPPING in record.getMessage():
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


logging.getLogger("prefect.task_runs").addFilter(_StopsSaidBriefly())  # the logger of every task run's lines


@dataclass(frozen=True)
class StepRun:
    """How one step went in this run: what the summary table prints."""

    name: str
    stage: str
    version: str
    status: str  # "ran", "cached", "failed" or "not run" (an input failed)
    seconds: float
    path: str
    stats: dict = field(default_factory=dict)
    error: str | None = None  # why it failed or did not run


def _run_ids() -> dict:
    ctx = get_run_context()
    return {"flow_run_id": str(ctx.task_run.flow_run_id) if ctx.task_run.flow_run_id else None,
            "task_run_id": str(ctx.task_run.id)}


def run_step_body(step: Step, store: Store, workers: int, log: logging.Logger, replace: bool = False,
                  slots: dict | None = None) -> dict:
    """Compute a step's output and publish it; returns the small record Prefect persists.

    `slots` ({limits, lock_url, lease_s}: the run's settings): a step whose config names a slot
    limit (`resources.slots`) computes holding its slots (tasks/engine/slots.py).

    `replace` (`--force`): compute it even though it is published, and swap the new output in at
    publish; until then the old one stays whole and readable for any run that reads it. This runs
    under the step's lock, so two runners never compute or swap the same version at once."""
    if not replace and store.is_done(step.stage, step.version):
        # Published by another runner (or a store copied without its Prefect records).
        lineage = store.read_lineage(step.stage, step.version)
        log.info("%s %s already in the store; not recomputed", step.name, step.version)
        return _record(step, lineage)
    upstream = {name: store.read_lineage(s.stage, s.version) for name, s in step.inputs.items()}
    inputs = {name: store.local_input(s.stage, s.version) for name, s in step.inputs.items()}
    _remove_leftovers(store, step)
    tmp = store.begin(step.stage, step.version)
    work = store.work_dir(step.stage, step.version)
    work.mkdir(parents=True, exist_ok=True)
    progress = ProgressArtifact(step)
    ctx = StepContext(step=step, out=tmp, inputs=inputs,
                      input_stats={n: lin["stats"] for n, lin in upstream.items()},
                      work_dir=work, log=log, workers=workers, on_progress=progress, store_root=store.root)
    started, t0 = now(), time.perf_counter()
    try:
        with _slots_held(step, slots, log):
            stats = step.run(ctx)
    except BaseException as e:
        store.discard(tmp)
        record = store.failure_record(step.stage, step.version)
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"stage": step.stage, "name": step.name, "version": step.version,
                                      "error": f"{type(e).__name__}: {e}", "at": now(),
                                      "traceback": traceback.format_exc()}, indent=2))
        if isinstance(e, Exception):
            raise StepFailed(f"stage {step.name!r} (version {step.version}) failed: "
                             f"{type(e).__name__}: {e}") from e
        raise
    lost = _lease_lost(step.key)
    if lost is not None:
        store.discard(tmp)
        raise StepFailed(f"stage {step.name!r} (version {step.version}) computed its output but did not publish it: "
                         f"{lost}; another runner may be computing it. Rerun (it resumes from its checkpoints); "
                         "if the lock server was unreachable, raise run.lock_lease_s")
    stats = {**(stats or {}), "seconds": round(time.perf_counter() - t0, 3)}
    lineage = build_lineage(step, store, stats, started, now(), _run_ids(), upstream)
    store.publish(tmp, step.stage, step.version, lineage)
    store.failure_record(step.stage, step.version).unlink(missing_ok=True)
    store.workspace(step.stage, step.version).remove()
    publish_to_prefect(lineage, store)
    publish_shown(step, ctx.shown)
    progress.finish()
    return _record(step, lineage)


def _slots_held(step: Step, slots: dict | None, log: logging.Logger):
    from tasks.engine import slots as slot_pools

    want = slot_pools.wanted(step.config)
    if want is None:
        return contextlib.nullcontext()
    settings = slots or {}
    return slot_pools.held(*want, settings.get("limits", {}), settings.get("lock_url"), settings.get("lease_s", 30.0),
                           log, on_wait=_show_waiting)


def _show_waiting(waiting: bool) -> None:
    """The task run's state while it waits for slots: `Waiting for slots`, a Running state of that
    name, which the UI shows; `Running` again once it has them. Prefect 3 records a task run's
    states from the events its engine emits (the API has no such task run to set a state on until
    the recorder wrote it), so this emits the same state-change event the engine would."""
    from prefect.states import Running
    from prefect.utilities.engine import emit_task_run_state_change_event

    task_run = get_run_context().task_run
    emit_task_run_state_change_event(task_run=task_run, initial_state=task_run.state,
                                     validated_state=Running(name=WAITING_FOR_SLOTS if waiting else "Running"))


WAITING_FOR_SLOTS = "Waiting for slots"


def _lease_lost(key: str) -> str | None:
    """Why this process lost the Redis lock of `key` (run.lock_url), or None; file locks are never lost."""
    redis_lock = sys.modules.get("tasks.engine.redis_lock")  # imported only where Redis locks are used
    return None if redis_lock is None else redis_lock.lease_lost(key)


def _remove_leftovers(store: Store, step: Step) -> None:
    """Temporary folders of this version left by a killed runner (we hold the step's lock)."""
    if store.is_local:
        for old in (store.local_root / step.stage).glob(f".tmp-{step.version}-*"):
            shutil.rmtree(old, ignore_errors=True)


def _record(step: Step, lineage: dict) -> dict:
    return {"stage": step.stage, "name": step.name, "version": step.version,
            "path": f"{step.stage}/{step.version}", "stats": lineage["stats"]}


def artifact_key(step: Step, name: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes."""
    return f"{step.stage}-{name}-{step.version}".replace("_", "-").lower()


def publish_shown(step: Step, shown: list[Shown]) -> None:
    """The tables, markdown and images a step body asked for, as Prefect artifacts.

    An image becomes a markdown artifact holding the PNG inline (a `data:` URL): both of the
    open-source UIs draw that on the artifact's page, while an image artifact also prints its
    whole URL, tens to hundreds of KB of base64, under the picture (seen in headless Chromium,
    Prefect 3.9; tests/test_prefect_ui.py)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    for item in shown:
        key = artifact_key(step, item.name)
        description = item.description or f"kiln {step.name} {step.version}: {item.name}"
        if item.kind == "table":
            create_table_artifact(key=key, table=item.content, description=description)
        elif item.kind == "markdown":
            create_markdown_artifact(key=key, markdown=item.content, description=description)
        else:
            create_markdown_artifact(key=key, markdown=inline_png(item.content, description),
                                     description=description)


def inline_png(png: bytes, alt: str) -> str:
    """Markdown that shows `png` without a file to link to."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})\n"


class StepWatcher(Protocol):
    """Something in this process that follows the steps it runs (flows/terminal.py's progress
    bars). Called from the threads the steps run in, so it must be thread-safe."""

    def started(self, step: Step) -> None: ...

    def progress(self, step: Step, done: int, total: int) -> None: ...

    def ended(self, step: Step) -> None: ...


WATCHERS: list[StepWatcher] = []


@contextlib.contextmanager
def watching(watcher: StepWatcher):
    """`watcher` hears of every step this process computes while the block runs (cache hits never
    start, so they are never heard of)."""
    WATCHERS.append(watcher)
    try:
        yield watcher
    finally:
        WATCHERS.remove(watcher)


@contextlib.contextmanager
def _watched(step: Step):
    for w in list(WATCHERS):
        w.started(step)
    try:
        yield
    finally:
        for w in list(WATCHERS):
            w.ended(step)


class ProgressArtifact:
    """`StepContext.progress` inside a Prefect task: one progress artifact per step, updated at
    most every couple of seconds (and always at the end) so a long step does not flood the API;
    the process's watchers hear of every report."""

    def __init__(self, step: Step, every_s: float = 2.0):
        self.step, self.every_s = step, every_s
        self.artifact_id = None
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        for w in list(WATCHERS):
            w.progress(self.step, done, total)
        percent = 100.0 * done / max(total, 1)
        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(
                progress=percent, key=artifact_key(self.step, "progress"),
                description=f"kiln {self.step.name} {self.step.version}: progress")
        elif done >= total or time.monotonic() - self.last >= self.every_s:
            update_progress_artifact(self.artifact_id, progress=percent)
        else:
            return
        self.last = time.monotonic()

    def finish(self) -> None:
        """100% once the output is published (a step that reported progress at all)."""
        if self.artifact_id is not None:
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(self.artifact_id, progress=100.0)


@task(persist_result=True, result_serializer="json")
def step_task(cache_key: str, step: Step, store_root: str, workers: int, replace: bool = False,
              slots: dict | None = None) -> dict:
    """The Prefect task every step runs as; `cache_key` is `<stage>-<version>`; `replace`: forced,
    `slots`: the run's slot settings (`run_step_body`)."""
    with _watched(step):
        return run_step_body(step, Store(store_root), workers, get_run_logger(), replace, slots)


def configured_task(step: Step, store: Store, forced: bool, lock_url: str | None = None, lease_s: float = 30.0):
    """`step_task` with the step's name, its cache policy (key, lock, isolation) and result storage."""
    return step_task.with_options(
        name=step.stage,
        task_run_name=f"{step.name}-{step.version}",
        cache_policy=step_cache_policy(store, lock_url, lease_s),
        result_storage=result_storage(store),
        refresh_cache=forced or None,
    )


def prepare(step: Step, store: Store, forced: bool, log: logging.Logger, verify: str = "sizes") -> None:
    """Before a step is submitted: what the store holds for it may only be a hit if it is whole.

    A step whose files are gone or no longer the size its lineage recorded (`verify` "sizes": one
    listing, nothing read), or with `verify` "full" no longer match the recorded sha256s (every
    byte read: `kiln verify`'s check), loses its output; a warning names them. A Prefect record
    whose output folder is gone is dropped, so it cannot count as a hit. A forced step keeps both:
    its task skips the cache (`refresh_cache`) and replaces the output once it has the step's lock
    and a new one (`run_step_body`), so a run reading the old output meanwhile loses nothing."""
    if forced:
        return
    check = verify_output if verify == "full" else check_output
    damaged = check(store, step.stage, step.version) if store.is_done(step.stage, step.version) else []
    if damaged:
        log.warning("%s %s: %s no longer match(es) what was published; recomputing it", step.name,
                    step.version, ", ".join(damaged))
        store.unpublish(step.stage, step.version)
    if damaged or not store.is_done(step.stage, step.version):
        drop_result_record(store, step)


def drop_result_record(store: Store, step: Step) -> None:
    if store.is_local:
        (store.local_root / ".prefect-results" / step.key).unlink(missing_ok=True)
    else:
        path = f"{store.root}/.prefect-results/{step.key}"
        if store.fs.exists(path):
            store.fs.rm(path)
