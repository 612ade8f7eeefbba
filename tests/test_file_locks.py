"""File step locks (the default, one machine): several processes taking the same lock at once
never see a half-written lock file and never hold it together; a holder that died frees it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
