"""Kill what kiln's private Ray left behind once the process that started it is gone.

Ray's node processes share the driver's fate, but not all of it: after a SIGKILL of the driver
its workers (each in a session of its own, so a kill of the driver's process group misses them)
and its agents (which hang on their way out, trying to tell a dead GCS) were seen alive long
after. This watcher runs in a session of its own, notes every Ray process below the driver each
half second, and when the driver is gone SIGKILLs the ones it saw (same pid and start time).
Run as `python -m training.reaper DRIVER_PID MARK`: MARK is a string in the node processes'
command lines (kiln's Ray session folder); workers are recognised by their `ray::` title.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil


def ray_descendants(driver: psutil.Process, mark: str) -> dict[int, float]:
    seen = {}
    for child in driver.children(recursive=True):
        if child.pid == os.getpid():
            continue
        try:
            cmd = child.cmdline()
            if cmd and (cmd[0].startswith("ray::") or any(mark in part for part in cmd)):
                seen[child.pid] = child.create_time()
        except psutil.Error:
            continue
    return seen


def watch(pid: int, mark: str, poll_s: float = 0.5) -> None:
    driver = psutil.Process(pid)
    seen: dict[int, float] = {}
    while True:
        try:
            if driver.status() == psutil.STATUS_ZOMBIE:
                break
            seen.update(ray_descendants(driver, mark))
        except psutil.NoSuchProcess:
            break
        time.sleep(poll_s)
    for child, started in seen.items():
        try:
            if psutil.Process(child).create_time() == started:
                os.kill(child, signal.SIGKILL)
        except (psutil.Error, ProcessLookupError):
            pass


if __name__ == "__main__":
    try:
        watch(int(sys.argv[1]), sys.argv[2])
    except psutil.NoSuchProcess:
        pass
