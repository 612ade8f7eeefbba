"""No server a test starts outlives the test: not when the test fails (its fixture stops the
server's whole process group, with SIGKILL if SIGTERM is not enough), and not when a timeout
ends pytest without finalizers (conftest's watcher, tasks/engine/reaper.py, ends what pytest
started). A command a test runs that outlasts its timeout says what it had printed."""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import REPO, ephemeral_env, run_captured, wait_until


def test_servers_end_with_a_failing_test_and_with_a_killed_pytest(tmp_path):
    pids = tmp_path / "pids"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "tests/server_cases.py"],
                          cwd=REPO, env={**ephemeral_env(), "KILN_SERVER_PIDS": str(pids),
                                                     "KILN_TESTS_PREFECT_SERVER": "0"},
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    # the first failed ("F"; pytest never prints its summary), the second timed out
    assert out.startswith("F") and "+ Timeout +" in out, out[-3000:]
    assert proc.returncode != 0
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) == 2, out[-3000:]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in started):
        time.sleep(0.5)
    alive = [p for p in started if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"still running after the test run: {alive}"


def test_a_command_past_its_timeout_fails_with_what_it_had_printed():
    """A slow kiln run under test fails at its own timeout (below pytest's) saying how far it got,
    instead of pytest-timeout's stack of the wait."""
    script = "import sys, time; print('got to step 3', flush=True); print('a warning', file=sys.stderr, flush=True); time.sleep(60)"
    started = time.monotonic()
    try:
        run_captured([sys.executable, "-c", script], timeout=3)
    except AssertionError as e:
        said = str(e)
    else:
        raise AssertionError("a command that sleeps 60 s ended within its 3 s timeout")
    assert time.monotonic() - started < 30  # killed at its timeout, not waited for
    assert "did not end within 3 s" in said and "got to step 3" in said and "a warning" in said, said


def _waiters_on(path) -> int:
    """How many processes wait for an flock on `path` (the "->" lines of /proc/locks for its inode)."""
    inode = f":{os.stat(path).st_ino} "
    return sum(1 for line in Path("/proc/locks").read_text().splitlines() if "->" in line and inode in line)


def test_waiting_for_the_ray_lock_does_not_count_against_a_tests_timeout(tmp_path):
    """The two-node test holds the Ray lock for longer than the suite's timeout: a test of the
    other worker waiting for it must not time out in its setup."""
    lock = tmp_path / "ray.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        case = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                                 "--durations=0", "--durations-min=0", "tests/lock_cases.py"], cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**ephemeral_env(), "KILN_TESTS_LOCK": str(lock), "KILN_TESTS_PREFECT_SERVER": "0"})
        wait_until(lambda: case.poll() is not None or _waiters_on(lock), 120, "the case to wait for the lock")
        time.sleep(7)  # longer than the case's 5 s timeout
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    out, _ = case.communicate(timeout=120)
    assert case.returncode == 0, out[-3000:]
    # it did wait, longer than its own timeout, in the setup that takes the lock
    setup = re.search(r"([0-9.]+)s setup +tests/lock_cases.py::test_runs_once_the_lock_is_free", out)
    assert setup and float(setup.group(1)) > 5, out[-3000:]
