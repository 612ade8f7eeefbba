"""Test setup: nothing downloads, Prefect runs against one in-process test harness per session."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"
# Ray rewrites a 127.0.0.1 cluster address to the machine's own IP before connecting; off, it keeps
# every node and connection on the loopback address (tests start single-node clusters only).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("HF_HOME", str(Path(os.environ.get("TMPDIR", "/tmp")) / "kiln-test-hf"))

REPO = Path(__file__).resolve().parent.parent

# The tests that run models in PyTorch (the benchmarks' twin, exports loaded in transformers,
# lm-eval's `hf` model) need torch, which `uv run --dev` does not install. .ci/run installs it on
# the machines that ship its CPU wheel and sets KILN_TESTS_NEED_TORCH=1 there, so that a missing
# torch fails those tests instead of skipping them unseen.
TORCH_MISSING = ("needs {name}, which `uv run --dev` does not install: add torch and accelerate with "
                 "`uv pip install torch accelerate` (on Linux pick the CPU build: README, \"The PyTorch checks\")")


def needs(name: str):
    """The module `name` (torch, accelerate, transformers), or this test module skipped, saying how
    to install it; a failure instead where KILN_TESTS_NEED_TORCH=1 says it must be there."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        if os.environ.get("KILN_TESTS_NEED_TORCH") == "1":
            raise ImportError(f"KILN_TESTS_NEED_TORCH=1 but {name} does not import: {e}") from e
        pytest.skip(TORCH_MISSING.format(name=name), allow_module_level=True)


def pytest_configure(config):
    """Whatever a test starts (servers, Ray nodes, kiln runs) ends when this pytest process does,
    even when it is killed or a timeout ends it without running fixture finalizers."""
    from training.reaper import watch_this_process

    watch_this_process()


def stop_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """Stop a process started with start_new_session=True and everything in its group: SIGTERM,
    then SIGKILL after `grace_s` (a Prefect server or `kiln serve` can hang on SIGTERM)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):  # the leader is gone; anything left in its group
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (starting one costs ~10 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kiln(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600,
         check: bool = True) -> subprocess.CompletedProcess:
    """Run the `kiln` CLI in a fresh process, as a user would."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd or REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"kiln {' '.join(args)} exited {proc.returncode}\n"
                             f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}")
    return proc


def _wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited {proc.returncode}: {proc.stdout.read()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"Ray head on port {port} not up after {timeout_s} s")


@contextlib.contextmanager
def ray_head(num_cpus: int = 2):
    """A Ray cluster as an operator starts one (`ray start --head`), on a free port of 127.0.0.1;
    yields its address and stops every process it started.

    Without token authentication (RAY_AUTH_MODE=disabled): `ray start` turns it on whenever
    ~/.ray/auth_token exists, which any earlier local Ray on the machine creates; clients must then
    set RAY_AUTH_MODE=token. Tests connect with RAY_AUTH_MODE=disabled, so both sides agree."""
    port = free_port()
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_AUTH_MODE": "disabled"}
    temp_dir = f"/tmp/kiln-ray-{port}"  # its own session folder: other Rays on this machine untouched
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--port", str(port), "--node-ip-address", "127.0.0.1",
         "--num-cpus", str(num_cpus), "--include-dashboard=false", "--disable-usage-stats",
         f"--temp-dir={temp_dir}", "--block"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for_port(port, head)
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()  # did not stop in time; its process group goes next
            head.wait()
        with contextlib.suppress(ProcessLookupError):  # the group is usually gone already
            os.killpg(head.pid, signal.SIGKILL)  # anything of this session still alive
        shutil.rmtree(temp_dir, ignore_errors=True)
