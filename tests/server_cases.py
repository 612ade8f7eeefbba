"""Not collected by the suite: tests/test_servers_end.py runs these in a pytest of their own to
check that a server a test starts ends with the test when it fails, and with the pytest process
when a timeout kills it without running any finalizer."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port

PIDS = Path(os.environ.get("KILN_SERVER_PIDS", "/dev/null"))


def note(pid: int) -> None:
    with open(PIDS, "a") as f:
        f.write(f"{pid}\n")


def test_fails_with_a_prefect_server_up(prefect_server):  # tests/conftest.py
    import httpx

    port = prefect_server["PREFECT_API_URL"].rsplit(":", 1)[1].split("/")[0]
    pid = next(c.pid for c in __import__("psutil").net_connections("tcp")
               if c.status == "LISTEN" and c.laddr.port == int(port))
    note(pid)
    assert httpx.get(prefect_server["PREFECT_API_URL"] + "/health").status_code == 200
    pytest.fail("fails on purpose, server up")


@pytest.mark.timeout(3, method="thread")  # thread mode: pytest os._exit()s, no finalizer runs
def test_times_out_with_a_server_up(tmp_path):
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(free_port())],
                              cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        note(server.pid)
        time.sleep(60)
    finally:
        server.kill()
