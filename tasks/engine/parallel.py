"""Run a function over shards, on a local Ray (or the cluster at RAY_ADDRESS) when workers > 1.

Results come back in input order and each call sees only its own item, so a stage's output is
the same bytes whatever the worker count.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import ray

from training.launch import join_ray, start_local_ray


def ensure_ray(num_cpus: int | None = None) -> None:
    """Start kiln's private local Ray in-process (loopback only, beside any other Ray on the
    machine), or join the cluster named by RAY_ADDRESS; once."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        join_ray(address)
    else:
        start_local_ray(num_cpus=num_cpus or os.cpu_count())


def map_shards(fn: Callable[[Any], Any], items: Sequence[Any], workers: int = 1,
               on_result: Callable[[int, Any], None] | None = None) -> list[Any]:
    """`[fn(item) for item in items]`, spread over `workers` Ray workers when workers > 1.

    `fn` must be a module-level function (Ray pickles it by reference). `on_result(i, result)` is
    called as each result arrives, for progress reporting.
    """
    if workers <= 1 or len(items) <= 1:
        results = []
        for i, item in enumerate(items):
            results.append(fn(item))
            if on_result:
                on_result(i, results[-1])
        return results
    ensure_ray(workers)
    remote = ray.remote(num_cpus=1)(fn)
    refs = [remote.remote(item) for item in items]
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(items)
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        i = index[done[0]]
        results[i] = ray.get(done[0])
        if on_result:
            on_result(i, results[i])
    return results
