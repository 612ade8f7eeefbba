"""kiln's local Ray is the machine's: runs that start side by side join one, started by the first
(tasks/engine/local_ray.py); a train step that wants CPUs another run's step holds waits for them
instead of failing; one that asks for more than the machine's Ray has fails at once, saying how
to change that; and once no run uses it, its keeper ends it, every process of it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from tasks.engine.reaper import kept_apart
from tests.conftest import REPO, scratch, stop_group, log_tail, wait_until

# starts Ray nodes of its own (tests/conftest.py ray_lock): out of the fast suite, run by CI after it (pyproject.toml `ci`)
pytestmark = [pytest.mark.ray_heavy, pytest.mark.slow, pytest.mark.ci]


def start(out: Path, name: str, cpus: int, env: dict, hold: bool = False) -> subprocess.Popen:
    with open(out / f"{name}.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "tests.local_ray_probe", str(out), name, str(cpus),
                                 *(["hold"] if hold else [])], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def finished(proc: subprocess.Popen, out: Path, name: str, timeout_s: float = 600) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{name} did not finish in {timeout_s} s; its log ends:\n{log_tail(out / f'{name}.log')}")


def said(out: Path, name: str, text: str, proc: subprocess.Popen) -> bool:
    if text in log_tail(out / f"{name}.log", 10**6):
        return True
    assert proc.poll() is None, f"{name} exited {proc.returncode} before saying {text!r}:\n{log_tail(out / f'{name}.log')}"
    return False


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def node_logs(ray_dir: Path) -> str:
    """The keeper's log and the ends of its node's raylet and GCS logs: why a node died (CI saw
    b's node "marked dead because the detector has missed too many heartbeats" once, 2026-12-04,
    and the folder was gone with the test's scratch)."""
    logs = [ray_dir / "keeper.log", *sorted(ray_dir.glob("session_latest/logs/raylet.*")),
            *sorted(ray_dir.glob("session_latest/logs/gcs_server.*"))]
    return "\n".join(f"--- {p.name}:\n{log_tail(p, 1500)}" for p in logs)


def test_runs_share_one_local_ray_queue_for_its_cpus_and_it_ends_when_unused(tmp_path):
    with scratch("lr") as folder, contextlib.ExitStack() as stack:
        ray_dir = folder / "ray"
        env = {**os.environ, "PYTHONPATH": str(REPO), "KILN_RAY_DIR": str(ray_dir), "KILN_RAY_CPUS": "2",
               "KILN_RAY_IDLE_S": "2"}
        env.pop("RAY_ADDRESS", None)
        out = folder
        procs = {}

        def launch(name: str, cpus: int, hold: bool = False) -> subprocess.Popen:
            procs[name] = start(out, name, cpus, env, hold)
            stack.callback(stop_group, procs[name], 5)
            return procs[name]

        # A's step holds both CPUs of the machine's Ray until the test releases it
        a = launch("a", 2, hold=True)
        wait_until(lambda: (out / "a.started").exists() or said(out, "a", "never", a), 600, "a's host to start",
                   detail=lambda: log_tail(out / "a.log"))
        b = launch("b", 2)
        wait_until(lambda: said(out, "b", "for Ray to place 1 host task(s)", b), 300, "b to wait for the CPUs",
                   detail=lambda: log_tail(out / "b.log"))
        assert not (out / "b.started").exists()  # b waits: its host has not started beside a's
        # a step that can never fit says so at once, while the others run
        c = launch("c", 3)
        assert finished(c, out, "c", 300) != 0
        c_said = log_tail(out / "c.log", 10**6)
        assert "more than kiln's local Ray on this machine has" in c_said and "KILN_RAY_CPUS" in c_said, c_said

        head = json.loads((ray_dir / "head.json").read_text())
        keeper = psutil.Process(head["pid"])
        tree = [keeper, *keeper.children(recursive=True)]
        assert any("raylet" in p.name() for p in tree), [p.name() for p in tree]

        (out / "a.release").touch()
        assert finished(a, out, "a") == 0, log_tail(out / "a.log") + node_logs(ray_dir)
        # a's exit (and its reaper) left b's Ray alone
        assert finished(b, out, "b") == 0, log_tail(out / "b.log") + node_logs(ray_dir)
        ran = {name: json.loads((out / f"{name}.json").read_text()) for name in ("a", "b")}
        assert ran["a"]["gcs"] == ran["b"]["gcs"] == head["address"]
        assert ran["a"]["keeper"] == ran["b"]["keeper"] == head["pid"]
        assert ran["a"]["ray_cluster"] == f"kiln local Ray ({ran['a']['gcs']})"
        assert ran["a"]["gcs"].startswith("127.0.0.1:")
        assert float((out / "b.started").read_text()) > float((out / "a.started").read_text())
        log = (ray_dir / "keeper.log").read_text()
        assert log.count("kiln local Ray up") == 1, log  # one keeper served the three runs

        # nobody uses it now: the keeper ends its Ray within the idle time (2 s) and its shutdown
        wait_until(lambda: not any(alive(p) for p in tree), 90, "the keeper and its Ray to end", detail=lambda: log_tail(ray_dir / "keeper.log"))
        assert not (ray_dir / "head.json").exists()
        assert "unused for 2 s" in (ray_dir / "keeper.log").read_text()


STARTER = """
import sys, time
import psutil
from tasks.engine import local_ray, reaper
reaper.watch_this_process()  # as kiln's CLI does
head = local_ray.connect()
keeper = psutil.Process(head["pid"])
deadline = time.monotonic() + 120
while not sum("Agent" in p.name() for p in keeper.children(recursive=True)) >= 2 and time.monotonic() < deadline:
    time.sleep(0.2)
time.sleep(2)  # the watcher, which looks every 0.5 s, has seen the node's agents by now
print(head["pid"], reaper._watcher.pid, flush=True)
sys.stdin.readline()
"""

PROBE = """
import ray
from tasks.engine import local_ray
local_ray.connect()
print(ray.get(ray.remote(lambda: 42).remote()))
local_ray.disconnect()
"""


def test_the_run_that_started_the_local_ray_leaves_its_node_whole_when_it_exits(tmp_path):
    """The keeper is a child of the run that started it, so that run's watcher (tasks/engine/reaper.py)
    sees the whole node; at the run's exit it must end none of it. Ray's dashboard and runtime-env
    agents read as having no environment (they rename themselves), so the keeper's mark is looked
    for in their ancestors too: CI saw them killed and the node die under the next run."""
    with scratch("lr") as folder, open(folder / "starter.log", "wb") as starter_log:
        env = {**os.environ, "PYTHONPATH": str(REPO), "KILN_RAY_DIR": str(folder / "ray"), "KILN_RAY_IDLE_S": "120"}
        env.pop("RAY_ADDRESS", None)
        starter = subprocess.Popen([sys.executable, "-c", STARTER], cwd=REPO, env=env, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=starter_log, text=True, start_new_session=True)
        keeper = None
        try:
            line = starter.stdout.readline()
            assert line, log_tail(folder / "starter.log")
            keeper_pid, watcher_pid = map(int, line.split())
            keeper, watcher = psutil.Process(keeper_pid), psutil.Process(watcher_pid)
            node = keeper.children(recursive=True)
            assert sum("Agent" in p.name() for p in node) >= 2 and any("raylet" in p.name() for p in node)
            # whenever a watcher first lists them (here after the agents renamed themselves), all are the keeper's
            assert [p.name() for p in node if not kept_apart(p)] == []
            starter.stdin.write("\n")
            starter.stdin.flush()
            assert starter.wait(timeout=60) == 0
            watcher.wait(timeout=60)  # it has done what it would do at the starter's exit
            assert [p.name() for p in node if not alive(p)] == [], node_logs(folder / "ray")
            probe = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                                   timeout=300)
            assert probe.returncode == 0 and probe.stdout.split()[-1] == "42", probe.stderr[-3000:]
            # `stop` ends it at once (asked through a file: any signal may come from a batch scheduler)
            subprocess.run([sys.executable, "-m", "tasks.engine.local_ray", "stop"], cwd=REPO, env=env, timeout=60)
            assert not alive(keeper), log_tail(folder / "ray" / "keeper.log")
        finally:
            stop_group(starter, 5)
            starter.stdin.close()
            starter.stdout.close()
            subprocess.run([sys.executable, "-m", "tasks.engine.local_ray", "stop"], cwd=REPO, env=env, timeout=120)
            if keeper is not None and alive(keeper):
                keeper.kill()


def test_a_stopping_run_waits_as_long_as_its_trainings_stop_grace_asks():
    """The scheduler's wait for its running steps at a stop (120 s) is extended while a training
    of this process has a longer resources.stop_grace_s (its hosts' checkpoint), and is itself
    again once that training is done: before, a grace beyond it would be cut short by the wait."""
    from tasks.engine import local_ray

    assert local_ray.stop_wait_s(120.0) == 120.0
    with local_ray.stop_takes(30):
        assert local_ray.stop_wait_s(120.0) == 120.0  # 30 s and a minute to end: within the 120
    started, done = threading.Event(), threading.Event()

    def long_training():
        with local_ray.stop_takes(600):
            started.set()
            done.wait(timeout=30)

    beside = threading.Thread(target=long_training)
    beside.start()
    try:
        started.wait(timeout=30)
        assert local_ray.stop_wait_s(120.0) == 660.0  # a training in another thread: its 600 s and a minute
    finally:
        done.set()
        beside.join()
    assert local_ray.stop_wait_s(120.0) == 120.0
