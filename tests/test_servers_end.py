"""No server a test starts outlives the test: not when the test fails (its fixture stops the
server's whole process group, with SIGKILL if SIGTERM is not enough), and not when a timeout
ends pytest without finalizers (conftest's watcher, tasks/engine/reaper.py, ends what pytest
started). A command a test runs that outlasts its timeout says what it had printed."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from tests.conftest import REPO, ephemeral_env, run_captured


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
