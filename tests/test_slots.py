"""Accelerator slots (tasks/engine/slots.py): two steps that each want the only slot of a limit
never run at the same moment, and the one that waits shows it in its Prefect state; with room for
both they run side by side; a holder killed with SIGKILL frees its slot (files: at once; Redis:
within its lease); and a limit without a size, a step larger than its limit, or two sizes for one
limit are errors that say what to change."""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterState, TaskRunFilterStateName

from tasks.engine.runner import WAITING_FOR_SLOTS
from tasks.engine.scheduler import execute
from tasks.engine.slots import FileSlots, RedisSlots, held
from tasks.engine.step import Step
from tasks.engine.store import Store
from tests.conftest import REPO, log_tail, wait_until
from tasks.engine.config import ConfigModel

LOG = logging.getLogger("test_slots")


class Resources(ConfigModel):
    """What slots.wanted reads of a ResourcesConfig; no CPUs, so the scheduler starts no Ray."""

    hosts: int = 1
    gpus_per_host: int = 1
    cpus_per_host: int = 0
    slots: str = "gpu"


class Trains(ConfigModel):
    name: str
    resources: Resources = Resources()


@flow
def run_graph(steps: list, store: str, limits: dict):
    return execute(steps, Store(store), max_concurrent=2, slot_limits=limits)


@pytest.fixture(autouse=True)
def slot_files(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_SLOTS_DIR", str(tmp_path / "slots"))


SEEN = {"inside": None, "order": [], "saw_waiting": False}
GUARD = threading.Lock()


def waiting_task_runs() -> list[str]:
    """The names of the task runs whose state is `Waiting for slots` now."""
    waiting = TaskRunFilter(state=TaskRunFilterState(name=TaskRunFilterStateName(any_=[WAITING_FOR_SLOTS])))
    with get_client(sync_client=True) as client:
        return [t.name for t in client.read_task_runs(task_run_filter=waiting)]


def _one_at_a_time(ctx):
    """The first in holds the slot until the other step is seen waiting for it (through Prefect's
    API: its task run in state `Waiting for slots`); the second must find nobody inside."""
    me = ctx.config.name
    with GUARD:
        assert SEEN["inside"] is None, f"{me} started while {SEEN['inside']} held the only slot"
        SEEN["inside"] = me
        SEEN["order"].append(me)
    if len(SEEN["order"]) == 1:
        names = wait_until(waiting_task_runs, 120, "the other step to wait for the slot")
        SEEN["saw_waiting"] = any(not n.startswith(f"{me}-") for n in names)
    with GUARD:
        SEEN["inside"] = None
    return {"name": me}


def test_two_steps_wanting_the_only_slot_run_one_after_the_other(tmp_path, prefect_harness):
    steps = [Step(n, "toy_slots", 1, Trains(name=n), _one_at_a_time) for n in "ab"]
    runs = run_graph(steps, str(tmp_path / "store"), {"gpu": 1})
    assert {r.status for r in runs} == {"ran"}, [(r.name, r.error) for r in runs]
    assert sorted(SEEN["order"]) == ["a", "b"] and SEEN["saw_waiting"]
    assert not waiting_task_runs()  # the waiter went back to Running, then Completed


MET = {"a": threading.Event(), "b": threading.Event()}


def _meet(ctx):
    me = ctx.config.name
    MET[me].set()
    if not MET["b" if me == "a" else "a"].wait(timeout=120):
        raise RuntimeError(f"{me} ran alone: two slots should have let both run")
    return {"name": me}


def test_with_two_slots_both_run_side_by_side(tmp_path, prefect_harness):
    steps = [Step(n, "toy_slots_two", 1, Trains(name=n), _meet) for n in "ab"]
    runs = run_graph(steps, str(tmp_path / "store"), {"gpu": 2})
    assert {r.status for r in runs} == {"ran"}, [(r.name, r.error) for r in runs]


HOLDER = """
import logging, sys, time
from pathlib import Path
from tasks.engine.slots import held
url = sys.argv[2] or None
with held("gpu", 1, {"gpu": 1}, url, 2.0, logging.getLogger("holder")):
    Path(sys.argv[1]).write_text("held")
    time.sleep(3600)
"""


def hold_in_a_process(tmp_path: Path, url: str | None) -> subprocess.Popen:
    flag = tmp_path / "held"
    log = open(tmp_path / "holder.log", "wb")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(flag), url or ""], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    log.close()

    def up() -> bool:
        assert proc.poll() is None, log_tail(tmp_path / "holder.log")
        return flag.exists()
    wait_until(up, 120, "the holder to take its slot", detail=lambda: log_tail(tmp_path / "holder.log"))
    return proc


@pytest.mark.parametrize("backend", ["files", "redis"])
def test_a_holder_killed_with_sigkill_frees_its_slot(backend, tmp_path, request):
    url = request.getfixturevalue("redis_url") if backend == "redis" else None
    proc = hold_in_a_process(tmp_path, url)
    pool = RedisSlots(url, "gpu", 1, 2.0) if url else FileSlots("gpu", 1)
    try:
        assert not pool.take(1)  # the holder has the only one
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # files: the kernel let go with the holder; Redis: once the 2 s lease runs out
        wait_until(lambda: pool.take(1), 30, "the killed holder's slot to be free")
    finally:
        if proc.poll() is None:
            proc.kill()
        pool.release()


def test_limits_say_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match=r"run.slot_limits gives no size for it"):
        with held("gpu", 1, {}, None, 2.0, LOG):
            pass
    with pytest.raises(ValueError, match=r"needs 4 slot\(s\) of 'gpu'.*the limit has 2"):
        with held("gpu", 4, {"gpu": 2}, None, 2.0, LOG):
            pass
    with held("gpu", 1, {"gpu": 2}, None, 2.0, LOG):
        with pytest.raises(ValueError, match=r"has 2 slots here.*run.slot_limits says 3"):
            with held("gpu", 1, {"gpu": 3}, None, 2.0, LOG):
                pass


def test_redis_limits_hold_their_size(redis_url):
    a = RedisSlots(redis_url, "tpu", 2, 2.0)
    assert a.take(2)
    with pytest.raises(ValueError, match=r"has 2 slots in .*run.slot_limits says 4"):
        RedisSlots(redis_url, "tpu", 4, 2.0)
    b = RedisSlots(redis_url, "tpu", 2, 2.0)
    assert not b.take(1)  # all or nothing: none left
    assert a.release() == 0
    assert b.take(2)
    b.release()


@pytest.mark.parametrize("backend", ["files", "redis"])
@pytest.mark.parametrize("what", ["step lock", "slot"])
def test_a_stop_ends_a_wait_for_what_another_run_holds(backend, what, tmp_path, request):
    """A step waiting for another run (its lock on the same step version, or a slot limit it
    holds) when this run is stopped (Ctrl-C, SIGTERM: local_ray.stopping): the wait ends within a
    second with Stopped. Before, it waited on until the other run let go, and the stopped run sat
    out the scheduler's grace (120 s) before it exited."""
    from tasks.engine import local_ray
    from tasks.engine.caching import StaleAwareLockManager
    from tasks.engine.redis_lock import RedisLockManager

    url = request.getfixturevalue("redis_url") if backend == "redis" else None
    if what == "step lock":
        locks = RedisLockManager(url) if url else StaleAwareLockManager(tmp_path / "locks")
        assert locks.acquire_lock("step-x", holder="the other run")
        wait = functools.partial(locks.acquire_lock, "step-x", holder="this run")
        let_go = functools.partial(locks.release_lock, "step-x", "the other run")
    else:
        others = held("gpu", 1, {"gpu": 1}, url, 30.0, LOG)
        others.__enter__()
        wait = held("gpu", 1, {"gpu": 1}, url, 30.0, LOG).__enter__
        let_go = functools.partial(others.__exit__, None, None, None)
    outcome: list = []

    def waiting() -> None:
        try:
            outcome.append(wait())
        except BaseException as e:
            outcome.append(e)

    waiter = threading.Thread(target=waiting, daemon=True)
    try:
        waiter.start()
        time.sleep(1.5)
        assert waiter.is_alive() and not outcome  # it waits: the other run holds it
        local_ray.stopping.set()
        waiter.join(timeout=5)
        assert not waiter.is_alive(), "the wait went on after the stop"
    finally:
        local_ray.stopping.clear()
        let_go()
        waiter.join(timeout=10)
    assert isinstance(outcome[0], local_ray.Stopped) and "waits no longer for" in str(outcome[0]), outcome
