"""kiln's local Ray is its own: beside a Ray someone else started on the machine (or only the
ray_current_cluster file a killed one left), kiln starts its own instance on 127.0.0.1 and
leaves the other alone; nothing it starts listens outside loopback; and when a kiln driver is
SIGKILLed, no process of its run outlives it by 10 s, and the local Ray it was the only user of
ends within its idle time. Both tests hold the Ray lock exclusively (tests/conftest.py): they
count processes and sockets, and start Ray nodes."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, free_port, ray_head_node, log_tail, wait_until

# Ray nodes of their own beside kiln's: out of the fast suite, run by CI after it (pyproject.toml `ci`)
pytestmark = [pytest.mark.ray_heavy, pytest.mark.slow, pytest.mark.ci]


@pytest.fixture
def ray_tmp():
    """A short RAY_TMPDIR (Ray's unix sockets live under it): where `ray start` and a bare
    `ray.init()` look for ray_current_cluster, so the machine's /tmp/ray stays out of it."""
    folder = tempfile.mkdtemp(prefix="kr-", dir="/tmp")
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


def probe_env(ray_tmp: Path) -> dict:
    # kiln's own Ray in a folder of this test's, ended 2 s after its last run
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "PYTHONPATH": str(REPO), "KILN_RAY_DIR": str(ray_tmp / "kiln"),
           "KILN_RAY_IDLE_S": "2"}
    # kiln must keep its Ray on loopback by itself (conftest sets this for the other tests)
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    env.pop("RAY_ADDRESS", None)
    return env


def start_probe(out: Path, steps: int, env: dict) -> subprocess.Popen:
    """The probe, its output in OUT/probe.log (read by wait_for_line)."""
    with open(out / "probe.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "tests.ray_probe", str(out), str(steps)], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_line(proc: subprocess.Popen, out: Path, word: str, timeout_s: float = 420) -> None:
    """Until the probe prints `word` on a line of its own; it starts a local Ray (which retries a
    start that a loaded machine made miss Ray's 30 s) and compiles a JAX step: minutes when busy."""
    log = out / "probe.log"

    def said() -> bool:
        if word in (line.strip() for line in log_tail(log, 10**6).splitlines()):
            return True
        assert proc.poll() is None, f"the probe exited {proc.returncode} before {word!r}; its output ends:\n{log_tail(log, 4000)}"
        return False
    wait_until(said, timeout_s, f"{word!r} from the probe", interval_s=0.2,
               detail=lambda: f"its output ends:\n{log_tail(log, 4000)}")


def assert_loopback_only(live: dict) -> None:
    outside = []
    for entry in live["listening"]:
        ip = ipaddress.ip_address(entry.split()[0].rsplit(":", 1)[0])  # "ADDRESS:PORT NAME"
        ip = getattr(ip, "ipv4_mapped", None) or ip
        if not ip.is_loopback:
            outside.append(entry)
    assert live["listening"] and not outside, f"listening outside 127.0.0.0/8: {outside}"
    assert live["gcs"].startswith("127.0.0.1:")


@contextlib.contextmanager
def stopped_on_exit(proc: subprocess.Popen):
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def test_beside_a_foreign_ray_head_kiln_starts_its_own_on_loopback(ray_tmp, tmp_path):
    env = probe_env(ray_tmp)
    # the foreign head's session folder is where a bare ray.init() under RAY_TMPDIR looks
    with ray_head_node(num_cpus=1, env=env, temp_dir=ray_tmp / "ray") as foreign_head:
        head, address = foreign_head.proc, foreign_head.address
        address_file = ray_tmp / "ray" / "ray_current_cluster"  # written before the node says it is up
        assert address_file.exists(), f"ray start wrote no {address_file}:\n{foreign_head.said()}"
        recorded = address_file.read_text()
        assert recorded.strip() == address  # what a bare ray.init() would attach to
        foreign = {p.pid: p.create_time() for p in [psutil.Process(head.pid), *psutil.Process(head.pid).children(recursive=True)]}

        with stopped_on_exit(start_probe(tmp_path, 3, env)) as probe:
            wait_for_line(probe, tmp_path, "done")
            assert probe.wait(timeout=120) == 0, log_tail(tmp_path / "probe.log")
        live = json.loads((tmp_path / "live.json").read_text())
        assert_loopback_only(live)
        assert live["gcs"] != address
        assert json.loads((tmp_path / "stats.json").read_text()) == {
            "ray_cluster": f"kiln local Ray ({live['gcs']})", "steps": 3}
        # the foreign instance: every process alive, its address file as it was
        assert all(psutil.pid_exists(pid) and psutil.Process(pid).create_time() == t for pid, t in foreign.items())
        assert address_file.read_text() == recorded
        assert head.poll() is None, foreign_head.said()


def test_beside_a_stale_ray_address_file_and_nothing_outlives_a_sigkill(ray_tmp, tmp_path):
    """A Ray head killed without `ray stop` leaves ray_current_cluster behind. kiln ignores it;
    then the kiln driver's process group is SIGKILLed mid-training (as a user's Ctrl-\\ or the
    OOM killer would), and within 10 s none of the processes of its run is alive (the driver's
    own and its host task on the local Ray); the local Ray, used by no other run, ends after its
    idle time (2 s here), every process of it."""
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")
    with stopped_on_exit(start_probe(tmp_path, 100_000, probe_env(ray_tmp))) as probe:
        wait_for_line(probe, tmp_path, "live")
        live = json.loads((tmp_path / "live.json").read_text())
        started = {pid: psutil.Process(pid).create_time() for pid in live["driver_tree"] + live["keeper_tree"]
                   if psutil.pid_exists(pid)}
        names = {pid: psutil.Process(pid).name() for pid in started}
        assert "ray::_host_main" in names.values(), names
        run = {pid for pid in started if pid in live["driver_tree"] or names[pid] == "ray::_host_main"}
        os.killpg(probe.pid, signal.SIGKILL)
        probe.wait(timeout=30)
    killed = time.monotonic()
    assert_loopback_only(live)

    def alive(pid: int, t: float) -> bool:
        try:
            proc = psutil.Process(pid)
            return proc.create_time() == t and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def survivors(pids) -> dict[int, str]:
        return {pid: names[pid] for pid in pids if alive(pid, started[pid])}

    with contextlib.suppress(TimeoutError):  # polled: done as soon as the last one is gone
        wait_until(lambda: not survivors(run), 10 - (time.monotonic() - killed), "the run's processes to end")
    assert not survivors(run), f"alive 10 s after the kill: {survivors(run)}"
    wait_until(lambda: not survivors(started), 90, "the local Ray's processes to end once unused",
               detail=lambda: f"alive: {survivors(started)}; keeper log:\n{log_tail(ray_tmp / 'kiln' / 'keeper.log')}")
