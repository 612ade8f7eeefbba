"""Execute steps as Prefect tasks: cached by version, published atomically, traced.

This is the whole executor: one task function that runs any step, and `execute`, which runs a
list of steps in order and reports for each whether it ran or was a cache hit.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger, task
from prefect.context import get_run_context
from prefect.utilities.annotations import quote

from tasks.engine.lineage import build_lineage, now, publish_to_prefect
from tasks.engine.step import Step, StepContext
from tasks.engine.store import Store
from tasks.engine.caching import result_storage, step_cache_policy


class StepFailed(RuntimeError):
    """A stage body raised; the message names the stage, its version and the cause."""


@dataclass(frozen=True)
class StepRun:
    """How one step went in this run: what the summary table prints."""

    name: str
    stage: str
    version: str
    status: str  # "ran" or "cached"
    seconds: float
    path: str
    stats: dict


def _run_ids() -> dict:
    ctx = get_run_context()
    return {"flow_run_id": str(ctx.task_run.flow_run_id) if ctx.task_run.flow_run_id else None,
            "task_run_id": str(ctx.task_run.id)}


def run_step_body(step: Step, store: Store, workers: int, log: logging.Logger) -> dict:
    """Compute a step's output and publish it; returns the small record Prefect persists."""
    if store.is_done(step.stage, step.version):
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
    ctx = StepContext(step=step, out=tmp, inputs=inputs,
                      input_stats={n: lin["stats"] for n, lin in upstream.items()},
                      work_dir=work, log=log, workers=workers)
    started, t0 = now(), time.perf_counter()
    try:
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
    stats = {**(stats or {}), "seconds": round(time.perf_counter() - t0, 3)}
    lineage = build_lineage(step, store, stats, started, now(), _run_ids(), upstream)
    store.publish(tmp, step.stage, step.version, lineage)
    store.failure_record(step.stage, step.version).unlink(missing_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    publish_to_prefect(lineage, store)
    return _record(step, lineage)


def _remove_leftovers(store: Store, step: Step) -> None:
    """Temporary folders of this version left by a killed runner (we hold the step's lock)."""
    if store.is_local:
        for old in (store.local_root / step.stage).glob(f".tmp-{step.version}-*"):
            shutil.rmtree(old, ignore_errors=True)


def _record(step: Step, lineage: dict) -> dict:
    return {"stage": step.stage, "name": step.name, "version": step.version,
            "path": f"{step.stage}/{step.version}", "stats": lineage["stats"]}


@task(persist_result=True, result_serializer="json")
def step_task(cache_key: str, step: Step, store_root: str, workers: int) -> dict:
    """The Prefect task every step runs as; `cache_key` is `<stage>-<version>`."""
    return run_step_body(step, Store(store_root), workers, get_run_logger())


def execute(steps: list[Step], store: Store, workers: int = 1,
            force: frozenset[str] = frozenset()) -> list[StepRun]:
    """Run `steps` in order (upstream first). A step whose version is cached is not run.

    `force` names stages (or step names) to recompute even if their version exists.
    """
    runs = []
    for step in steps:
        forced = step.stage in force or step.name in force
        if forced:
            store.unpublish(step.stage, step.version)
        elif not store.is_done(step.stage, step.version):
            _drop_stale_record(store, step)
        t0 = time.perf_counter()
        state = step_task.with_options(
            name=step.stage,
            task_run_name=f"{step.name}-{step.version}",
            cache_policy=step_cache_policy(store),
            result_storage=result_storage(store),
            refresh_cache=forced or None,
        )(step.key, quote(step), store.root, workers, return_state=True)
        record = state.result()  # raises the step's error if it failed
        runs.append(StepRun(step.name, step.stage, step.version,
                            "cached" if state.name == "Cached" else "ran",
                            round(time.perf_counter() - t0, 2),
                            store.output(step.stage, step.version), record["stats"]))
    return runs


def _drop_stale_record(store: Store, step: Step) -> None:
    """A Prefect result record whose output folder was deleted must not count as a cache hit."""
    if store.is_local:
        (store.local_root / ".prefect-results" / step.key).unlink(missing_ok=True)
    else:
        path = f"{store.root}/.prefect-results/{step.key}"
        if store.fs.exists(path):
            store.fs.rm(path)
