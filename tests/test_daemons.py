"""Who a process is: `process_start` names a live process by its start time, on Linux from /proc
and elsewhere (macOS, where there is no /proc) from psutil; both ways are checked here on a real
child process, alive, a zombie, and reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tasks.engine.daemons import _start_from_psutil, process_start
from tests.conftest import wait_until


@pytest.mark.parametrize("start_of", [process_start, _start_from_psutil], ids=["proc", "psutil"])
def test_a_process_is_named_while_it_runs_and_not_once_it_is_a_zombie_or_gone(start_of):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = start_of(child.pid)
        assert started is not None and start_of(child.pid) == started  # the same answer each time
        assert start_of(os.getpid()) not in (None, started)  # another process, another start
        os.kill(child.pid, signal.SIGKILL)  # not reaped yet: a zombie, which is no holder
        wait_until(lambda: start_of(child.pid) is None, 30, "the killed child to stop counting as alive")
    finally:
        child.kill()
        child.wait()
    assert start_of(child.pid) is None  # reaped: gone
