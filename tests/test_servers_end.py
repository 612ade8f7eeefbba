"""No server a test starts outlives the test: not when the test fails (its fixture stops the
server's whole process group, with SIGKILL if SIGTERM is not enough), and not when a timeout
ends pytest without finalizers (conftest's watcher, tasks/engine/reaper.py, ends what pytest
started)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from tests.conftest import REPO, ephemeral_env


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
