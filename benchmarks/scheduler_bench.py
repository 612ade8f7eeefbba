"""The scheduler's own cost per step, against a plain loop of Prefect tasks.

A graph of `--steps` steps whose bodies do nothing (each depends on up to two earlier ones, from a
fixed seed) runs three ways in one process against one Prefect test server:

- plain task:  a flow that calls a do-nothing `@task` once per step, one after another: the floor
               any Prefect-based executor pays per task;
- step loop:   the same steps through kiln's step task (cache policy, lock, atomic publish,
               lineage.json, markdown artifact and asset event per step), called in a plain loop in
               upstream order: what running a step costs without the scheduler;
- scheduler:   `tasks.engine.scheduler.execute` on an empty store, at max_concurrent 1 and 4; the
               difference to the step loop is the scheduler's own cost;
- cached:      each again on the store it filled: every step a cache hit.

Prints milliseconds per step of each and its ratio to the step loop.

    uv run python benchmarks/scheduler_bench.py --steps 300
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.testing.utilities import prefect_test_harness  # noqa: E402
from prefect.utilities.annotations import quote  # noqa: E402

from tasks.engine.runner import configured_task, prepare  # noqa: E402

from tasks.engine.scheduler import execute  # noqa: E402
from tasks.engine.step import Step  # noqa: E402
from tasks.engine.store import Store  # noqa: E402
from tasks.engine.config import ConfigModel  # noqa: E402


class Noop(ConfigModel):
    index: int


def nothing(ctx) -> dict:
    return {}


def graph(n: int, seed: int = 0) -> list[Step]:
    rng = random.Random(seed)
    steps: list[Step] = []
    for i in range(n):
        parents = rng.sample(steps, k=min(len(steps), rng.randint(0, 2)))
        steps.append(Step(f"noop/{i}", "noop", 1, Noop(index=i), nothing,
                          inputs={f"in{j}": p for j, p in enumerate(parents)}))
    return steps


@task
def noop_task(i: int) -> int:
    return i


@flow
def plain_loop(n: int) -> None:
    for i in range(n):
        noop_task(i)


@flow
def kiln_graph(steps: list, store: str, max_concurrent: int) -> list:
    return execute(steps, Store(store), max_concurrent=max_concurrent)


@flow
def step_loop(steps: list, store: str) -> None:
    """Each step's task called in order, as an executor without a scheduler would."""
    store_ = Store(store)
    for step in steps:
        prepare(step, store_, False, get_run_logger())
        configured_task(step, store_, False)(step.key, quote(step), store_.root, 1)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    n = args.steps
    with prefect_test_harness(server_startup_timeout=120), tempfile.TemporaryDirectory() as tmp:
        plain_loop(3)  # warm the server and the engine
        kiln_graph(graph(3, seed=99), f"{tmp}/warm", 1)
        results = {"plain do-nothing Prefect task": timed(plain_loop, n)}
        steps = graph(n)
        results["step loop (no scheduler)"] = timed(step_loop, steps, f"{tmp}/loop")
        results["step loop, all cached"] = timed(step_loop, steps, f"{tmp}/loop")
        for concurrent in (1, 4):
            steps = graph(n)  # fresh objects; same versions, so a fresh store per setting
            store = f"{tmp}/store-{concurrent}"
            results[f"scheduler, max_concurrent {concurrent}"] = timed(kiln_graph, steps, store, concurrent)
            results[f"scheduler, all cached, max_concurrent {concurrent}"] = timed(kiln_graph, steps, store, concurrent)
    base = results["step loop (no scheduler)"]
    print(f"{n} do-nothing steps: milliseconds per step (ratio to the step loop)")
    for name, seconds in results.items():
        print(f"  {name:40s} {seconds / n * 1000:8.1f} ms  ({seconds / base:.2f}x)")


if __name__ == "__main__":
    main()
