"""The scheduler's own cost per step, against a plain loop of Prefect tasks.

A graph of `--steps` steps whose bodies do nothing (each depends on up to two earlier ones, from a
fixed seed) runs three ways in one process against one Prefect test server:

- plain:   a flow that calls a do-nothing `@task` once per step, one after another: the floor
           any Prefect-based executor pays per task;
- kiln:    `tasks.engine.scheduler.execute` on an empty store (cache policy, lock, atomic publish,
           lineage.json, markdown artifact and asset event per step), at max_concurrent 1 and 4;
- cached:  the same graph again: every step a cache hit.

Prints seconds per step of each and the ratio kiln / plain.

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

from prefect import flow, task  # noqa: E402
from prefect.testing.utilities import prefect_test_harness  # noqa: E402

from tasks.engine.scheduler import execute  # noqa: E402
from tasks.engine.step import Step  # noqa: E402
from tasks.engine.store import Store  # noqa: E402
from training.config import ConfigModel  # noqa: E402


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
        plain = timed(plain_loop, n)
        results = {"plain Prefect tasks": plain}
        for concurrent in (1, 4):
            steps = graph(n)
            store = f"{tmp}/store-{concurrent}"
            results[f"kiln scheduler, max_concurrent {concurrent}"] = timed(kiln_graph, steps, store, concurrent)
            results[f"kiln, all cached, max_concurrent {concurrent}"] = timed(kiln_graph, steps, store, concurrent)
    print(f"{n} do-nothing steps; seconds per step (ratio to plain Prefect tasks)")
    for name, seconds in results.items():
        print(f"  {name:40s} {seconds / n * 1000:8.1f} ms  ({seconds / plain:.2f}x)")


if __name__ == "__main__":
    main()
