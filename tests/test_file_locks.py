"""File step locks (the default, one machine): several processes taking the same lock at once
never see a half-written lock file and never hold it together; a holder that died frees it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading

from tasks.engine.caching import StaleAwareLockManager
from tests.conftest import REPO

CONTEND_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from tasks.engine.caching import StaleAwareLockManager
    locks, log = StaleAwareLockManager(Path(sys.argv[1])), sys.argv[2]
    me = f"p{os.getpid()}"
    for i in range(int(sys.argv[3])):
        holder = f"{me}-{i}"
        assert locks.acquire_lock("step-x", holder, acquire_timeout=120)
        with open(log, "a") as f:
            f.write(f"take {holder}\\n")
        time.sleep(0.002)
        with open(log, "a") as f:
            f.write(f"give {holder}\\n")
        locks.release_lock("step-x", holder)
""")


def test_processes_contending_for_one_lock_hold_it_one_at_a_time(tmp_path):
    log = tmp_path / "log"
    procs = [subprocess.Popen([sys.executable, "-c", CONTEND_SCRIPT, str(tmp_path / "locks"), str(log), "40"],
                              cwd=REPO, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    lines = log.read_text().splitlines()
    assert len(lines) == 4 * 40 * 2
    for take, give in zip(lines[::2], lines[1::2]):  # every take is followed by its own give
        assert take.startswith("take ") and give == "give " + take.removeprefix("take ")
    assert not list((tmp_path / "locks").iterdir())  # no lock and no private file left behind


def test_a_lock_whose_holder_died_is_free(tmp_path):
    hold = "from pathlib import Path; import sys, os; from tasks.engine.caching import StaleAwareLockManager as M; " \
           "assert M(Path(sys.argv[1])).acquire_lock('step-x', 'dying'); os._exit(0)"
    subprocess.run([sys.executable, "-c", hold, str(tmp_path)], cwd=REPO, check=True, timeout=120)
    locks = StaleAwareLockManager(tmp_path)
    assert (tmp_path / "step-x.lock").exists()
    assert locks.acquire_lock("step-x", "next", acquire_timeout=5)
    assert locks.is_lock_holder("step-x", "next")
    locks.release_lock("step-x", "next")
    assert not locks.is_locked("step-x")


def test_a_lock_whose_holders_pid_now_belongs_to_another_process_is_free(tmp_path):
    """A lock file left by a process whose pid a newer process has since been given (pids are
    reused; a restarted container hands out the same low ones): that holder is dead, the lock free.
    The same pid with the holder's own start time is alive, and its lock is held."""
    from tasks.engine.daemons import process_start

    def left_by(pid: int, started: str | None) -> None:
        (tmp_path / "step-x.lock").write_text(json.dumps(
            {"holder": "old", "expiration": None, "host": socket.gethostname(), "pid": pid, "started": started}))

    locks = StaleAwareLockManager(tmp_path)
    left_by(os.getpid(), process_start(os.getpid()))  # the holder itself, still running
    assert locks.is_locked("step-x")
    assert not locks.acquire_lock("step-x", "next", acquire_timeout=0)
    left_by(os.getpid(), "1")  # this pid, but a process that started at another time
    assert not locks.is_locked("step-x")
    assert locks.acquire_lock("step-x", "next", acquire_timeout=5)
    assert json.loads((tmp_path / "step-x.lock").read_text())["started"] == process_start(os.getpid())
    locks.release_lock("step-x", "next")


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_two_runners_taking_over_one_stale_lock_never_both_hold_it(tmp_path, monkeypatch):
    """The race: both contenders read the same stale record (its holder died); the first takes
    it over; only then does the second act on what it read. Removing by path (the old code) threw
    away the first one's fresh lock and both held the step. A barrier in the liveness check (the
    point between reading the record and acting on it) forces that interleaving every time."""
    from tasks.engine import caching

    (tmp_path / "step-x.lock").write_text(json.dumps(
        {"holder": "dead", "expiration": None, "host": socket.gethostname(), "pid": dead_pid()}))
    both_read_it, first_holds = threading.Barrier(2, timeout=60), threading.Event()
    paused: set[str] = set()
    real_alive = caching._alive

    def alive_at_the_dangerous_point(pid, started=None):
        me = threading.current_thread().name
        if pid != os.getpid() and me not in paused:  # each contender's first look at the stale record
            paused.add(me)
            both_read_it.wait()
            if me == "second":
                assert first_holds.wait(60)
        return real_alive(pid, started)

    monkeypatch.setattr(caching, "_alive", alive_at_the_dangerous_point)
    got: dict[str, bool] = {}

    def contend(name: str, timeout: float) -> None:
        got[name] = StaleAwareLockManager(tmp_path).acquire_lock("step-x", name, acquire_timeout=timeout)
        if name == "first":
            first_holds.set()

    threads = [threading.Thread(target=contend, args=(name, t), name=name) for name, t in (("first", 60), ("second", 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert paused == {"first", "second"}  # both really read the stale record before either acted
    assert got == {"first": True, "second": False}  # the second waited on the first's lock instead
    locks = StaleAwareLockManager(tmp_path)
    assert locks.is_lock_holder("step-x", "first")
    locks.release_lock("step-x", "first")
    assert locks.acquire_lock("step-x", "second", acquire_timeout=5)  # free once the first let go
    locks.release_lock("step-x", "second")
    assert not list(tmp_path.iterdir())


def test_only_the_holder_releases_a_lock(tmp_path):
    locks = StaleAwareLockManager(tmp_path)
    assert locks.acquire_lock("step-x", "me")
    try:
        locks.release_lock("step-x", "someone-else")
    except ValueError as e:
        assert "No lock held by someone-else" in str(e)
    else:
        raise AssertionError("a release by someone who does not hold the lock went through")
    assert StaleAwareLockManager(tmp_path).is_lock_holder("step-x", "me")
    locks.release_lock("step-x", "me")
    assert not StaleAwareLockManager(tmp_path).is_locked("step-x")
