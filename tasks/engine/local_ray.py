"""kiln's local Ray: one per machine, shared by every kiln run on it, on 127.0.0.1 only.

Six `kiln run`s started at once on a 2-core machine, each starting a Ray of its own (a GCS, a
raylet, agents and workers apiece), overloaded it: five never registered their node and failed.
So a run that needs a local Ray joins the one kiln already keeps on this machine, and only the
first starts it. It is kept by a *keeper*, `python -m tasks.engine.local_ray`, a process of its own
session that starts Ray's node in itself (`start_local_ray`), writes its address to `head.json`
and ends it once no run has used it for `KILN_RAY_IDLE_S` seconds (default 10), so that runs one
after another, or a resumed run after a crash, find it up.

Who uses it is kept by the kernel, not by a count a crash could leave wrong: every run that
joined holds a shared `flock` on `users.lock` for as long as it is connected, and the keeper
stops only when it can take that lock exclusively. A run killed with SIGKILL lets go of its lock
with its last file descriptor; Ray ends that driver's workers (and kiln's host tasks watch their
driver too). The keeper holds `start.lock` while it starts, so runs that arrive meanwhile wait
for its node instead of starting more. Everything lives in `ray_dir()`: one per user and Python
environment (the raylet starts every run's workers with the keeper's interpreter, so a run from
another virtual environment must not share it), never /tmp/ray, so a Ray the user started is
neither joined nor touched.

The keeper's Ray has as many logical CPUs as the machine has cores (or `KILN_RAY_CPUS`): a train
step that asks for them waits for another run's to finish rather than both fighting over the
cores. A step that asks for more than there are fails at once, saying so.

`python -m tasks.engine.local_ray status` prints the keeper's record, `... stop` stops it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

from tasks.engine.daemons import log_tail, process_start
from tasks.engine.reaper import KEEPER_MARK, watch_this_process  # the keeper's mark: reapers leave it alone

IDLE_ENV = "KILN_RAY_IDLE_S"  # how long the keeper keeps an unused Ray, seconds
CPUS_ENV = "KILN_RAY_CPUS"  # its logical CPUs, when not the machine's core count
DIR_ENV = "KILN_RAY_DIR"  # its folder, when not the one per user and environment
START_TIMEOUT_S = 600  # for a keeper's start: its own retries on a loaded machine take minutes
# Where a run's store and cache are, as the run sees them. The keeper's workers have the
# environment of the run that started the keeper; a task of a later run with another store
# endpoint or KILN_CACHE must see that run's. Never credentials: Ray's runtime-env agent writes
# what it is given into its log.
RUN_ENV = ("KILN_CACHE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION")

_users_fd: int | None = None  # this process's shared hold on users.lock, while it is connected
_auth_mode_before: str | None = None  # RAY_AUTH_MODE before `connect` (Ray sets it to turn tokens on)


def ray_dir() -> Path:
    """The keeper's folder: one per user and interpreter prefix, and per Slurm job, or
    `KILN_RAY_DIR` (tests give each their own). Short, for Ray's unix sockets under it (paths under
    108 bytes). Slurm ends every process of a job when it ends, a keeper the job started included:
    another job's runs on that node must not be using it."""
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    job = os.environ.get("SLURM_JOB_ID")
    key = os.path.realpath(sys.prefix) + (f"\0slurm job {job}" if job else "")
    return Path(tempfile.gettempdir()) / f"kiln-ray-{os.getuid()}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def logical_cpus() -> int:
    value = os.environ.get(CPUS_ENV)
    if value is None:
        return os.cpu_count() or 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{CPUS_ENV}={value!r}: give a whole number of CPUs, at least 1")
    return int(value)


def idle_seconds() -> float:
    value = os.environ.get(IDLE_ENV, "10")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"{IDLE_ENV}={value!r}: give the seconds the local Ray stays up unused, 0 or more")
    return seconds


# What stops a run, its Prefect API server and kiln's local Ray: Ctrl-C, SIGTERM (a scheduler's
# or supervisor's stop), and SIGUSR1 or SIGUSR2, which batch schedulers send as the warning that a
# job's time is nearly up (Slurm's `--signal=USR1@120`, the usual way to checkpoint before it).
# Their default action ends a process at once: kiln, the server and the node went with them, and
# the training lost the steps since its last checkpoint.
WARNING_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, *WARNING_SIGNALS)


class Terminated(KeyboardInterrupt):
    """SIGTERM, SIGUSR1 or SIGUSR2, ending a run as Ctrl-C does (`stop_on_signals`)."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signal = signum  # as Prefect's TerminationSignal names it


STOPPING = "the run is stopping (Ctrl-C or a stop signal)"  # what every Stopped says first


class Stopped(RuntimeError):
    """A step's Ray work stopped because the run is stopping (Ctrl-C, SIGTERM): cancelled, or a
    training stopped at a checkpoint (training/launch.py). Its message starts with STOPPING."""


stopping = threading.Event()  # set by Ctrl-C or SIGTERM in a run: its steps' Ray work stops (a training checkpoints)
stopping_now = threading.Event()  # set by a Ctrl-C after either: all of it is cancelled where it is


def _stop(signum, frame) -> None:
    if stopping.is_set() and signum == signal.SIGINT:
        stopping_now.set()
    stopping.set()
    if signum != signal.SIGINT:
        raise Terminated(signum)
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """Ctrl-C and SIGTERM (a scheduler's stop, `docker stop`, systemd, `kill`), and SIGUSR1 and
    SIGUSR2 as SIGTERM (a batch scheduler's warning that the job's time is nearly up), end this run
    promptly: `stopping` is set, so the steps waiting on Ray cancel their work (`cancel_if_stopping`;
    a train step's hosts first checkpoint the step they are at, training/launch.py; a Ctrl-C
    after the first signal sets `stopping_now`, and they too are cancelled where they are; a
    SIGTERM after it changes nothing: supervisors send it more than once), and a
    KeyboardInterrupt (`Terminated` for the others) unwinds the flow in the main thread, so Prefect
    and Ray shut down as after Ctrl-C. Call it from the main thread. While a flow runs, Prefect's
    own SIGTERM handler raises its TerminationSignal instead, which the scheduler takes as the
    same (tasks/engine/scheduler.py `_stopping_waits_for`)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop)


def warnings_as_sigterm() -> None:
    """SIGUSR1 and SIGUSR2 (a batch scheduler's warning that the job's time is nearly up) do in
    this process what SIGTERM does when they arrive: in `kiln serve` and its flow runs' processes,
    whose SIGTERM handlers are Prefect's (its runner's stop; a flow run's TerminationSignal, on
    which the training checkpoints), their default action ended the process at once. Where this
    process already takes them (`stop_on_signals`: kiln run), or off the main thread, nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in WARNING_SIGNALS:
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, lambda signum, frame: signal.raise_signal(signal.SIGTERM))


_stop_graces: dict[int, float] = {}  # what each running training's hosts get to checkpoint at a stop, by thread


@contextlib.contextmanager
def stop_takes(seconds: float):
    """While a step of this process trains, a stop may take it `seconds` to checkpoint
    (resources.stop_grace_s): the scheduler's wait for its running steps is at least that, and
    some more (`stop_wait_s`)."""
    _stop_graces[threading.get_ident()] = seconds
    try:
        yield
    finally:
        _stop_graces.pop(threading.get_ident(), None)


def stop_wait_s(least: float) -> float:
    """How long a stopping run waits for its running steps: `least`, or a minute more than the
    longest grace a training of this process asked for (its checkpoint, then its Ray work's end)."""
    return max([least, *(grace + 60.0 for grace in list(_stop_graces.values()))])


def cancel_if_stopping(refs: list) -> None:
    """Cancel `refs` (Ray tasks, their workers killed) and raise `Stopped` if the run is
    stopping; called by the loops that wait on Ray, between their waits."""
    import ray

    if stopping.is_set():
        for ref in refs:
            ray.cancel(ref, force=True)
        raise Stopped(f"{STOPPING}: its Ray work was cancelled")


def raise_if_stopping(waiting_for: str) -> None:
    """Raise `Stopped` if the run is stopping; called between their waits by the loops that wait
    for another run (its step lock, a slot limit or Ray's CPUs it holds), which would otherwise wait on."""
    if stopping.is_set():
        raise Stopped(f"{STOPPING}: it waits no longer for {waiting_for}")


@contextlib.contextmanager
def _keeping_our_handlers():
    """Around ray.init in a driver: Ray's driver would install a failure handler over the
    process's SIGTERM handler (the one `stop_on_signals` sets, or Prefect's while a flow runs,
    which a worker's cancellation sends), from whichever thread joins, and abort the process with
    a stack dump (exit 134) while its training went on. Ray reads whether to install it
    (RAY_DISABLE_FAILURE_SIGNAL_HANDLER, as ray_constants holds it) when a driver joins: set for
    this process's joins only; the keeper and its workers keep theirs."""
    from ray._private import ray_constants

    before = ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    try:
        yield
    finally:
        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = before


# --- a run's side ------------------------------------------------------------------------------

def connect() -> dict:
    """Join kiln's local Ray, starting its keeper if none is up; returns the keeper's record
    ({address, pid, started, cpus}). Call `disconnect()` when done (or exit)."""
    global _users_fd, _auth_mode_before
    import ray

    if _users_fd is not None and ray.is_initialized():
        return read_head(ray_dir())
    folder = ray_dir()
    folder.mkdir(mode=0o700, exist_ok=True)
    users = os.open(folder / "users.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(users, fcntl.LOCK_SH)  # waits only while a keeper is ending its Ray
        with _flocked(folder / "start.lock"):
            head = read_head(folder) or _start_keeper(folder)
        # The keeper's Ray turns Ray's token authentication on (unless RAY_AUTH_MODE says
        # otherwise), its token in ~/.ray/auth_token: loopback is open to every user of the
        # machine, the token to this one. A driver that joins must turn it on too.
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available)

        _auth_mode_before = os.environ.get("RAY_AUTH_MODE")
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        with _loopback_only(), _keeping_our_handlers():
            ray.init(address=head["address"], log_to_driver=False, logging_level="ERROR",
                     _node_ip_address="127.0.0.1")
    except BaseException:
        os.close(users)
        raise
    _users_fd = users
    print(f"kiln: joined kiln's local Ray at {head['address']} ({head['cpus']} CPUs; keeper pid {head['pid']})",
          file=sys.stderr, flush=True)
    return head


def disconnect() -> None:
    """Leave the local Ray (the driver's connection and the hold on it); the keeper ends it once
    no run holds it."""
    global _users_fd
    import ray

    ray.shutdown()
    if _users_fd is not None:
        os.close(_users_fd)
        _users_fd = None
        _restore_auth_mode()


def _restore_auth_mode() -> None:
    """Put RAY_AUTH_MODE back as it was before `connect` turned token authentication on for the
    keeper's Ray: Ray sets it in the process's environment, so a cluster this process joins later
    without a token (`ray start` with RAY_AUTH_MODE=disabled) would otherwise see this process's
    workers refused. Ray's cached config is read again from the environment."""
    from ray._raylet import AuthenticationTokenLoader, Config

    if os.environ.get("RAY_AUTH_MODE") == _auth_mode_before:
        return
    if _auth_mode_before is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = _auth_mode_before
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def connected() -> bool:
    return _users_fd is not None


def run_env() -> dict[str, str]:
    """The env_vars a task of this run needs on kiln's local Ray (RUN_ENV, as this process has
    them); none on another cluster, whose nodes keep their own."""
    return {name: os.environ[name] for name in RUN_ENV if name in os.environ} if connected() else {}


def ensure_ray(address: str | None = None) -> None:
    """Connect this process to Ray once: the cluster at `address` (or RAY_ADDRESS), else kiln's
    local Ray. A Ray this process is already connected to is kept."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        join_ray(address)
    else:
        connect()


def join_ray(address: str) -> None:
    """Connect to the Ray cluster at `address` (from the config or RAY_ADDRESS) and say so."""
    import ray

    try:
        with _keeping_our_handlers():
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except ConnectionError as e:
        if "InvalidAuthToken" in "".join(traceback.format_exception(e)):
            raise ConnectionError(
                f"the Ray cluster at {address} requires token authentication (`ray start` turns it on when "
                "~/.ray/auth_token exists): set RAY_AUTH_MODE=token where kiln runs, with the cluster's "
                "token in ~/.ray/auth_token") from e
        raise
    print(f"kiln: joined the Ray cluster at {address} (GCS {ray.get_runtime_context().gcs_address})",
          file=sys.stderr, flush=True)


def read_head(folder: Path) -> dict | None:
    """The keeper's record, if that keeper is alive (the same process: pid and start time)."""
    try:
        head = json.loads((folder / "head.json").read_text())
    except (OSError, ValueError):
        return None
    return head if process_start(head["pid"]) == head["started"] else None


def _start_keeper(folder: Path) -> dict:
    """Start a keeper (in a session of its own, so it outlives this run) and wait for its node;
    called holding start.lock."""
    log = folder / "keeper.log"
    (folder / "head.json").unlink(missing_ok=True)
    with open(log, "ab") as out:
        keeper = subprocess.Popen([sys.executable, "-m", "tasks.engine.local_ray", "keep"],
                                  cwd=Path(__file__).resolve().parents[2], env={**os.environ, KEEPER_MARK: "1"},
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    print(f"kiln: starting kiln's local Ray (keeper pid {keeper.pid}, log {log})", file=sys.stderr, flush=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        head = read_head(folder)
        if head is not None and head["pid"] == keeper.pid:
            return head
        if keeper.poll() is not None:
            raise RuntimeError(f"kiln's local Ray did not start: its keeper exited {keeper.returncode}; "
                               f"{log} ends:\n{log_tail(log)}")
        time.sleep(0.2)
    keeper.kill()
    raise RuntimeError(f"kiln's local Ray did not start within {START_TIMEOUT_S} s; {log} ends:\n{log_tail(log)}")


# --- the keeper --------------------------------------------------------------------------------

def stop_request(folder: Path, keeper_pid: int) -> Path:
    """The file `stop` writes to have that keeper end its node at once, runs using it or not: a
    file, not a signal, since a batch scheduler may send any signal to every process of a job."""
    return folder / f"stop-{keeper_pid}"


def keep() -> None:
    """Start the node, say where it is, and end it once nobody has held users.lock for the idle
    time; on a stop signal once nobody holds it, on `stop` (its `stop_request`) at once.

    A stop meant for a whole job (systemd's `systemctl stop`, Slurm's `scancel`, time limit or its
    warning before: a signal to every process of it) reaches the keeper and its node too, while the
    runs on it are checkpointing their trainings to stop: the node's processes start with the
    STOP_SIGNALS blocked (Ray ends them with SIGKILL a second after its SIGTERM), and the keeper
    waits for the runs to let go. Before, the node stopped at once, the hosts with it, and a run
    lost the steps since its last checkpoint, then exited 1 a minute later, Ray saying its GCS had
    gone."""
    import ray

    folder, idle_s, cpus = ray_dir(), idle_seconds(), logical_cpus()
    signalled: list[str] = []
    stop_now = stop_request(folder, os.getpid())
    stop_now.unlink(missing_ok=True)  # left by an earlier keeper of this pid that was killed

    def stop(signum, frame):
        signalled.append(signal.Signals(signum).name)
        print(f"kiln local Ray: {signalled[-1]}, stopping once no run uses it", flush=True)

    unblock = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # for the node's processes
    try:
        start_local_ray(num_cpus=cpus, attempts=8)  # once per machine: worth a few more on a loaded one
        for sig in STOP_SIGNALS:
            signal.signal(sig, stop)  # after ray.init, which puts Ray's failure handler (an abort) on SIGTERM
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblock)
    head = {"address": ray.get_runtime_context().gcs_address, "pid": os.getpid(),
            "started": process_start(os.getpid()), "cpus": cpus}
    tmp = folder / f"head.json.{os.getpid()}"
    tmp.write_text(json.dumps(head))
    tmp.replace(folder / "head.json")
    print(f"kiln local Ray up: {head}", flush=True)
    users = os.open(folder / "users.lock", os.O_RDWR | os.O_CREAT, 0o600)
    idle_since = None
    while not stop_now.exists():
        time.sleep(0.5)
        try:
            fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a run holds it
            idle_since = None
            continue
        idle_since = idle_since or time.monotonic()
        if signalled or time.monotonic() - idle_since >= idle_s:
            break  # ends holding the lock: a run that comes now waits, then starts a new keeper
        fcntl.flock(users, fcntl.LOCK_UN)
    (folder / "head.json").unlink(missing_ok=True)
    ray.shutdown()
    asked = "`stop`" if stop_now.exists() else signalled[0] if signalled else f"unused for {idle_s:g} s"
    stop_now.unlink(missing_ok=True)
    print(f"kiln local Ray stopped: {asked}", flush=True)


@contextlib.contextmanager
def _loopback_only():
    """Ray settings for a node and drivers on 127.0.0.1 alone.

    Ray rewrites 127.0.0.1 to the machine's address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    (read at import into ray_constants, and by the node processes Ray spawns), so both are set.
    When this process runs under `uv run`, Ray's uv hook would copy the repository for every job
    and start workers through `uv run` in the copy; a local Ray's workers simply run the keeper's
    interpreter (RAY_ENABLE_UV_RUN_RUNTIME_ENV, read when ray is imported, which may have happened
    before this module was; ray.init reads the constant)."""
    from ray._private import ray_constants

    saved = ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV, ray_constants.ENABLE_RAY_CLUSTER
    saved_env = os.environ.get(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR)
    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    try:
        yield
    finally:
        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV, ray_constants.ENABLE_RAY_CLUSTER = saved
        if saved_env is None:
            os.environ.pop(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, None)
        else:
            os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = saved_env


def start_local_ray(num_cpus: int, num_gpus: int | None = None, attempts: int = 5) -> None:
    """Start a Ray node in this process: every service on 127.0.0.1, quiet, no dashboard, its
    session in `ray_dir()`. The keeper's way to start; a run joins it with `connect`.

    `address="local"` always starts a new instance: without it Ray attaches to any other Ray on
    the machine (a `ray start --head`, or only the ray_current_cluster file a killed one left),
    and then refuses num_cpus. If this process dies without shutting Ray down, tasks/engine/reaper.py's
    watcher ends the node's processes."""
    import ray

    watch_this_process()  # the node and workers Ray starts end with this process
    with _loopback_only():
        for attempt in range(attempts):
            try:
                with warnings.catch_warnings():
                    # Ray starts its node processes with fork + exec, which is safe next to JAX's
                    # threads; Python warns about every such fork once JAX is imported.
                    warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
                    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                             log_to_driver=False, logging_level="ERROR", _node_ip_address="127.0.0.1",
                             _temp_dir=str(ray_dir()))
                return
            except Exception:
                # Ray gives its node a fixed 30 s to register; an overloaded machine can miss
                # that (seen at a load of 10 on 2 cores). Start again after a pause that grows;
                # the last failure propagates.
                ray.shutdown()
                if attempt == attempts - 1:
                    raise
                time.sleep(5 * (attempt + 1))


@contextlib.contextmanager
def _flocked(path: Path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "status"
    folder = ray_dir()
    if command == "keep":
        keep()
        return 0
    head = read_head(folder)
    if command == "status":
        print(json.dumps(head) if head else f"no kiln local Ray is up ({folder})")
        return 0
    if command == "stop":
        if head:
            stop_request(folder, head["pid"]).touch()  # at once, with the runs using it
            while process_start(head["pid"]) == head["started"]:
                time.sleep(0.2)
        return 0
    print(f"usage: python -m tasks.engine.local_ray [status | stop | keep] (got {command!r})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
