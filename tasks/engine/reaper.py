"""End what a kiln process started once that process is gone, however it went.

Ray's node processes share their driver's fate, but not all of them: after a SIGKILL of the
driver, its Ray workers (each in a session of its own, so a kill of the driver's process group
misses them) and Ray's agents (which hang on their way out, trying to tell a dead GCS) were seen
alive long after, and so was the Prefect API server a run had started. `watch_this_process()`
starts a watcher, in a session of its own, that notes every descendant of this process each
half second and, once this process has exited (or is a zombie), SIGKILLs the ones it saw that
are still the same processes (pid and start time). A process that exits normally has shut its
children down already, so the watcher then finds nothing to do.

One descendant is not this process's to end: the keeper of kiln's shared local Ray
(tasks/engine/local_ray.py), which other runs may be using, ends its node itself once none is. It
carries KILN_RAY_KEEPER=1 in its environment, and it and every process under it are left alone,
except by the keeper's own watcher.

Run as `python -m tasks.engine.reaper PID`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

KEEPER_MARK = "KILN_RAY_KEEPER"  # tasks/engine/local_ray.py sets it in its keeper's environment

_watcher: subprocess.Popen | None = None


def watch_this_process() -> None:
    """Start this process's watcher, once."""
    global _watcher
    if _watcher is not None and _watcher.poll() is None:
        return
    _watcher = subprocess.Popen([sys.executable, "-m", "tasks.engine.reaper", str(os.getpid())],
                                cwd=Path(__file__).resolve().parents[2], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def kept_apart(proc: psutil.Process) -> bool:
    """Whether `proc` belongs to the shared local Ray's keeper (tasks/engine/local_ray.py): it or
    a process it descends from carries the keeper's mark. Its ancestors count because some of the
    node's processes read as having no environment at all: Ray's dashboard and runtime-env agents
    rename themselves (setproctitle), and /proc/PID/environ of either is then empty; a run's
    watcher that took them for the run's own killed them, and the raylet went with them (its node
    "marked dead because the detector has missed too many heartbeats", a later run "Failed to
    connect to Ray cluster")."""
    try:
        lineage = [proc, *proc.parents()]
    except psutil.Error:  # it ended meanwhile
        return False
    for p in lineage:
        try:
            if p.environ().get(KEEPER_MARK) == "1":
                return True
        except psutil.Error:  # gone, or not ours to read (init's, for a user who is not root)
            continue
    return False


def watch(pid: int, poll_s: float = 0.5) -> None:
    driver = psutil.Process(pid)
    spare_keepers = not kept_apart(driver)  # a keeper's own watcher ends the keeper's node
    seen: dict[int, float] = {}
    apart: set[int] = set()
    while True:
        try:
            if driver.status() == psutil.STATUS_ZOMBIE:
                break
            for child in driver.children(recursive=True):
                if child.pid == os.getpid() or child.pid in seen or child.pid in apart:
                    continue
                if spare_keepers and kept_apart(child):
                    apart.add(child.pid)
                    continue
                try:
                    seen[child.pid] = child.create_time()
                except psutil.Error:  # it ended (or hid) between listing and asking: nothing to end
                    continue
        except psutil.NoSuchProcess:
            break
        time.sleep(poll_s)
    for child, started in seen.items():
        try:
            proc = psutil.Process(child)
            # asked again: one seen between fork and exec did not carry the keeper's mark yet
            if proc.create_time() == started and not (spare_keepers and kept_apart(proc)):
                os.kill(child, signal.SIGKILL)
        except (psutil.Error, ProcessLookupError):  # already gone: what the reaper wanted
            continue


if __name__ == "__main__":
    from tasks.engine.local_ray import STOP_SIGNALS

    for sig in STOP_SIGNALS:  # a stop sent to every process of a job: this one ends when its process has
        signal.signal(sig, signal.SIG_IGN)
    try:
        watch(int(sys.argv[1]))
    except psutil.NoSuchProcess:  # the watched process was gone before the watch began
        sys.exit(0)
