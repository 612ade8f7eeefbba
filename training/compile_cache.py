"""JAX's persistent compilation cache, on in every kiln process that trains, evaluates or plans
capacity: a program this machine compiled before (a rerun, a resume after a crash, the next
evaluate step of a series, a test suite's many small runs of one config, `kiln capacity` asked
again) is read back in milliseconds instead
of compiled again (seconds on a CPU, minutes for a large model). What is read back is the
executable XLA made for the same program, options and JAX version, so the results are the same
bits (tests/test_training_loop.py resumes through it).

Where: KILN_COMPILE_CACHE (a folder, or "off"); else JAX_COMPILATION_CACHE_DIR when set (JAX's
own); else `jax/<machine kind>/` in kiln's local cache (tasks/engine/store.py `local_cache`), one
folder per CPU architecture and feature set, since a home folder shared by a cluster's machines
would otherwise hand one CPU's compiled code to another that lacks its instructions. Every program
is kept, not only those that took JAX 1 s or more to compile (its default): a small model's train
process compiles ~20 programs of 0.03-0.5 s each (the eager rotary tables, the initialisation,
the evaluation step), 1.2 s of train() on 2 cores, which the next process reads back instead
(benchmarks/compile_cache_bench.py --before; JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, when
set, wins). The folder holds at most MAX_BYTES, the least recently used going first. Setting a
size also makes JAX lock the folder, so two processes on one machine never read an entry the
other is still writing."""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

import jax
from jax import monitoring

from tasks.engine.store import local_cache

ENV = "KILN_COMPILE_CACHE"
MAX_BYTES = 4 << 30
_HIT = "/jax/compilation_cache/cache_hits"
_SAVED = "/jax/compilation_cache/compile_time_saved_sec"
_read = {"programs": 0, "seconds_saved": 0.0}  # this process's, counted by the listeners below


def _count_hit(event: str, **_) -> None:
    if event == _HIT:
        _read["programs"] += 1


def _count_saved(event: str, duration_secs: float, **_) -> None:
    if event == _SAVED:
        _read["seconds_saved"] += duration_secs


monitoring.register_event_listener(_count_hit)
monitoring.register_event_duration_secs_listener(_count_saved)


def enable() -> None:
    """Turn the cache on for this process, unless KILN_COMPILE_CACHE=off. JAX decides at a
    process's first compile whether it has a cache, so this is called before any
    (training/loop.py `train`, evaluation/scoring.py, training/capacity.py `main`); once
    compiling has begun it changes nothing."""
    setting = os.environ.get(ENV, "").strip()
    if setting == "off":
        return
    if setting or not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", setting or str(local_cache() / "jax" / machine_kind()))
    if jax.config.jax_compilation_cache_max_size == -1:  # unbounded, JAX's default: bound it
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def machine_kind() -> str:
    """The CPU architecture and a digest of its feature flags ("x86_64-3f9a0c1d"): what compiled
    CPU code depends on (the accelerators' kinds are in JAX's own cache key)."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith(("flags", "Features"))), "")
    except OSError:  # not Linux: the processor's name stands in for its features
        flags = platform.processor()
    return f"{platform.machine()}-{hashlib.sha256(' '.join(sorted(flags.split())).encode()).hexdigest()[:8]}"


def programs_read() -> tuple[int, float]:
    """How many compiled programs this process has read from the cache, and the compile seconds
    that saved (as JAX recorded them when it compiled them)."""
    return _read["programs"], _read["seconds_saved"]
