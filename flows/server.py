"""`kiln server start|stop|status`: a team's Prefect server on PostgreSQL, and Redis for step locks.

SQLite, Prefect's default, is its "lightweight, single-server" set-up: under concurrent runs it gives
"database is locked". A team's server runs on PostgreSQL (Prefect needs >= 14.9 with `pg_trgm`).
`start` makes that one command: in a folder it creates and owns (DIR) it initialises a PostgreSQL
cluster (`initdb`, once), starts it, creates the `prefect` database with `pg_trgm`, starts
`prefect server start` against it and a `redis-server` for `run.lock_url`. Each runs as a daemon in
a session of its own, logs to a file in DIR, and is recorded in DIR/server.json (pid, start time,
port), so `stop` ends exactly those processes (SIGTERM, then SIGKILL; PostgreSQL by `pg_ctl stop`)
and `status` says which answer.

PostgreSQL listens on 127.0.0.1 only (only the Prefect server talks to it) with a password kept in
DIR/pg-password (mode 0600); Prefect and Redis listen on `--host`, 127.0.0.1 unless told otherwise.
PostgreSQL refuses to run as root: as root, initdb and postgres run as the unprivileged `postgres`
user (Debian's package creates it) through `runuser`, and DIR is owned by that user.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from tasks.engine.daemons import log_tail

STATE = "server.json"
DATABASE = "prefect"
PG_USER = "kiln"  # the cluster's superuser, reached with the password in DIR/pg-password
RUN_AS = "postgres"  # who runs PostgreSQL when kiln runs as root
PG_MIN = (14, 9)


class ServerError(RuntimeError):
    """Something about the team server the user can fix; the message says what."""


@dataclass(frozen=True)
class Ports:
    prefect: int = 4200
    postgres: int = 5433  # not 5432: a machine's own PostgreSQL (Debian's `main` cluster) may hold it
    redis: int = 6380  # not 6379, for the same reason


def free_ports() -> Ports:
    """Three ports free on 127.0.0.1 now, for a server of its own (benchmarks, tests)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(3)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return Ports(*(s.getsockname()[1] for s in socks))


def _reached_at(host: str) -> str:
    """The address a client on this machine uses for a server bound to `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "::") else host


def api_url(host: str, port: int) -> str:
    return f"http://{_reached_at(host)}:{port}/api"


def lock_url(host: str, port: int) -> str:
    return f"redis://{_reached_at(host)}:{port}/0"


# --- start -----------------------------------------------------------------------------------------

def start(folder: Path, host: str = "127.0.0.1", ports: Ports = Ports(), timeout_s: float = 300) -> dict:
    """Start PostgreSQL, the Prefect server and Redis in `folder`; returns what server.json records.
    Whatever this call started is stopped again if a later part fails to come up."""
    folder = Path(folder).resolve()
    if running(folder):
        raise ServerError(f"a kiln server already runs in {folder} (`kiln server status --dir {folder}`); "
                          f"stop it first with `kiln server stop --dir {folder}`")
    bin_dir = postgres_bin()
    redis_exe = shutil.which("redis-server")
    if redis_exe is None:
        raise ServerError("redis-server is not installed: `apt-get install -y redis-server` (Debian/Ubuntu)")
    for name, port in (("the Prefect server", ports.prefect), ("PostgreSQL", ports.postgres), ("Redis", ports.redis)):
        if _port_taken(host if name != "PostgreSQL" else "127.0.0.1", port):
            raise ServerError(f"port {port} for {name} is taken on this machine: pass another "
                              f"(kiln server start --help) or stop what listens there")
    folder.mkdir(parents=True, exist_ok=True)
    state: dict = {"folder": str(folder), "host": host, "ports": vars(ports), "started_at": time.time()}
    deadline = time.monotonic() + timeout_s
    try:
        state["postgres"] = start_postgres(folder, bin_dir, ports.postgres, deadline)
        _save(folder, state)
        password = (folder / "pg-password").read_text().strip()
        database_url = f"postgresql+asyncpg://{PG_USER}:{password}@127.0.0.1:{ports.postgres}/{DATABASE}"
        state["redis"] = start_redis(folder, redis_exe, host, ports.redis, deadline)
        _save(folder, state)
        state["prefect"] = start_prefect(folder, database_url, host, ports.prefect, deadline)
        _save(folder, state)
    except BaseException:
        stop(folder)
        raise
    state["api_url"] = api_url(host, ports.prefect)
    state["lock_url"] = lock_url(host, ports.redis)
    _save(folder, state)
    return state


def start_sqlite(folder: Path, host: str = "127.0.0.1", ports: Ports = Ports(), timeout_s: float = 300) -> dict:
    """The same server on SQLite (`folder`/prefect.db) instead of PostgreSQL, with Redis: what
    the benchmarks compare against (benchmarks/team_load.py, concurrent_runs.py); `stop` ends it."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    state: dict = {"folder": str(folder), "host": host, "ports": vars(ports), "started_at": time.time()}
    deadline = time.monotonic() + timeout_s
    try:
        state["redis"] = start_redis(folder, shutil.which("redis-server"), host, ports.redis, deadline)
        _save(folder, state)
        state["prefect"] = start_prefect(folder, f"sqlite+aiosqlite:///{folder}/prefect.db", host, ports.prefect,
                                         deadline)
        _save(folder, state)
    except BaseException:
        stop(folder)
        raise
    return {**state, "api_url": api_url(host, ports.prefect), "lock_url": lock_url(host, ports.redis)}


def postgres_bin() -> Path:
    """The folder of PostgreSQL's server programs: $KILN_PG_BIN, else Debian's newest
    /usr/lib/postgresql/<version>/bin, else `pg_config --bindir`."""
    candidates = [Path(os.environ["KILN_PG_BIN"])] if os.environ.get("KILN_PG_BIN") else []
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: _version_key(p.parent.name),
                         reverse=True)
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True)
        candidates.append(Path(out.stdout.strip()))
    for folder in candidates:
        if (folder / "initdb").exists() and (folder / "pg_ctl").exists():
            return folder
    raise ServerError("PostgreSQL's server programs (initdb, pg_ctl) were not found: install them with "
                      "`apt-get install -y postgresql` (Debian/Ubuntu), or set KILN_PG_BIN to their folder")


def _version_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in name.split("."))


def _as_postgres_user(args: list[str]) -> list[str]:
    """PostgreSQL will not run as root: as root, run `args` as the `postgres` user."""
    if os.geteuid() != 0:
        return args
    try:
        import pwd

        pwd.getpwnam(RUN_AS)
    except KeyError:
        raise ServerError(f"running as root, PostgreSQL needs an unprivileged user to run as, and there is no "
                          f"{RUN_AS!r} user: install Debian's `postgresql` package (it creates one) or run "
                          "`kiln server start` as an ordinary user") from None
    return ["runuser", "-u", RUN_AS, "--", *args]


def _owned_by_postgres_user(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, RUN_AS, RUN_AS)


def start_postgres(folder: Path, bin_dir: Path, port: int, deadline: float) -> dict:
    """initdb (the first time), then `pg_ctl start`; waits until the `prefect` database with
    `pg_trgm` is there."""
    data, log, pw_file = folder / "pgdata", folder / "postgres.log", folder / "pg-password"
    _owned_by_postgres_user(folder)
    if not (data / "PG_VERSION").exists():
        if data.exists():
            shutil.rmtree(data)  # an initdb that did not finish
        pw_file.write_text(secrets.token_urlsafe(24) + "\n")
        pw_file.chmod(0o600)
        _owned_by_postgres_user(pw_file)
        init_log = folder / "initdb.log"
        with open(init_log, "wb") as out:
            done = subprocess.run(_as_postgres_user([str(bin_dir / "initdb"), "-D", str(data), "-U", PG_USER,
                                                     f"--pwfile={pw_file}", "--auth=scram-sha-256", "-E", "UTF8",
                                                     "--locale=C.UTF-8"]),
                                  stdout=out, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            hint = (f" (as root it runs as {RUN_AS!r}, which must be able to reach {folder}: pick a folder "
                    "outside /root, e.g. /srv/kiln-server)" if os.geteuid() == 0 else "")
            raise ServerError(f"initdb failed with status {done.returncode}{hint}; {init_log} ends:\n{log_tail(init_log)}")
    log.touch()
    _owned_by_postgres_user(log)
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {data}"  # its socket in its own folder, not /var/run
    with open(folder / "pg_ctl.log", "ab") as out:
        done = subprocess.run(_as_postgres_user([str(bin_dir / "pg_ctl"), "start", "-D", str(data), "-l", str(log),
                                                 "-o", options, "-w", "-t", str(max(int(deadline - time.monotonic()), 5))]),
                              stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    if done.returncode != 0:
        raise ServerError(f"PostgreSQL did not start (pg_ctl status {done.returncode}); {log} ends:\n{log_tail(log)}")
    pid = int((data / "postmaster.pid").read_text().split()[0])
    record = {"pid": pid, "created": psutil.Process(pid).create_time(), "port": port, "bin": str(bin_dir),
              "data": str(data), "log": str(log)}
    password = pw_file.read_text().strip()
    try:
        _wait(lambda: _setup_database(port, password), deadline, "PostgreSQL to accept connections", log)
    except BaseException:  # not yet in server.json, so `stop` would not find it
        _stop_postgres(folder, record, 30)
        raise
    return record


def _setup_database(port: int, password: str) -> bool:
    """The `prefect` database with `pg_trgm`, created if missing; False while PostgreSQL refuses."""
    import asyncpg

    async def work() -> None:
        conn = await asyncpg.connect(host="127.0.0.1", port=port, user=PG_USER, password=password,
                                     database="postgres", timeout=5)
        try:
            version = conn.get_server_version()
            if (version.major, version.minor) < PG_MIN:
                raise ServerError(f"PostgreSQL {version.major}.{version.minor} is older than the "
                                  f"{PG_MIN[0]}.{PG_MIN[1]} Prefect needs")
            if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", DATABASE):
                await conn.execute(f"CREATE DATABASE {DATABASE}")
        finally:
            await conn.close()
        conn = await asyncpg.connect(host="127.0.0.1", port=port, user=PG_USER, password=password,
                                     database=DATABASE, timeout=5)
        try:
            await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
        finally:
            await conn.close()

    try:
        asyncio.run(work())
        return True
    except (OSError, asyncpg.CannotConnectNowError, asyncpg.PostgresConnectionError, asyncio.TimeoutError):
        return False


def start_redis(folder: Path, exe: str, host: str, port: int, deadline: float) -> dict:
    """redis-server for the step locks: nothing persisted (a lock outlives no restart it needs)."""
    log = folder / "redis.log"
    args = [exe, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no", "--dir", str(folder),
            "--logfile", str(log), "--daemonize", "no"]
    if not _loopback(host):
        args += ["--protected-mode", "no"]  # reachable from other machines: keep the port inside your network
    proc = _daemon(args, folder / "redis.out")
    _wait(lambda: _redis_answers(port, proc), deadline, "Redis to answer", log, proc)
    return _record(proc, port, log)


def _redis_answers(port: int, proc: subprocess.Popen) -> bool:
    import redis

    _exited(proc)
    with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
        return bool(redis.Redis(host="127.0.0.1", port=port, socket_timeout=2).ping())
    return False


def start_prefect(folder: Path, database_url: str, host: str, port: int, deadline: float) -> dict:
    """`prefect server start` on the PostgreSQL database; its home (settings, UI build) in DIR."""
    log = folder / "prefect.log"
    api = api_url(host, port)
    env = {**os.environ, "PREFECT_HOME": str(folder / "prefect-home"), "PREFECT_API_DATABASE_CONNECTION_URL": database_url,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_API_URL": api}
    env.pop("PREFECT_API_URL", None)  # the server's own client settings must not point elsewhere
    proc = _daemon([sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)],
                   log, env=env)
    _wait(lambda: _prefect_answers(api, proc), deadline, f"the Prefect server at {api}", log, proc)
    return _record(proc, port, log)


def _prefect_answers(api: str, proc: subprocess.Popen) -> bool:
    import httpx

    _exited(proc)
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{api}/health", timeout=2).status_code == 200
    return False


def _daemon(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """`args` in a session of its own (a Ctrl-C or the end of this process does not reach it), its
    output appended to `log`, its input nothing."""
    with open(log, "ab") as out:
        return subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=log.parent)


class _Exited(Exception):
    pass


def _exited(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        raise _Exited(proc.returncode)


def _wait(ready, deadline: float, what: str, log: Path, proc: subprocess.Popen | None = None) -> None:
    """Poll `ready()` until it is true; past `deadline`, or if `proc` exits, an error with the log's end."""
    while True:
        try:
            if ready():
                return
        except _Exited as e:
            raise ServerError(f"gave up waiting for {what}: it exited with status {e.args[0]}; "
                              f"{log} ends:\n{log_tail(log)}") from None
        if time.monotonic() > deadline:
            raise ServerError(f"gave up waiting for {what} (deadline passed; raise --timeout on a loaded "
                              f"machine); {log} ends:\n{log_tail(log)}")
        time.sleep(0.5)


def _record(proc: subprocess.Popen, port: int, log: Path) -> dict:
    return {"pid": proc.pid, "created": psutil.Process(proc.pid).create_time(), "port": port, "log": str(log)}


def _loopback(host: str) -> bool:
    return host == "localhost" or host == "::1" or host.startswith("127.")


def _port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _save(folder: Path, state: dict) -> None:
    tmp = folder / f".{STATE}.tmp"
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(folder / STATE)


def read_state(folder: Path) -> dict | None:
    try:
        return json.loads((Path(folder) / STATE).read_text())
    except FileNotFoundError:
        return None


# --- stop and status ---------------------------------------------------------------------------------

SERVICES = ("prefect", "redis", "postgres")  # the order they stop in: the server before its database


def alive(record: dict | None) -> psutil.Process | None:
    """The recorded process, if it still runs and is the same one (pid and start time)."""
    if not record:
        return None
    try:
        proc = psutil.Process(record["pid"])
        if abs(proc.create_time() - record["created"]) < 1 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except psutil.Error:  # gone (or never ours to see): not running
        return None
    return None


def running(folder: Path) -> list[str]:
    state = read_state(folder) or {}
    return [name for name in SERVICES if alive(state.get(name))]


def stop(folder: Path, grace_s: float = 30) -> list[str]:
    """End every process server.json records that still runs; returns what was stopped."""
    folder = Path(folder).resolve()
    state = read_state(folder)
    if state is None:
        return []
    stopped = []
    for name in SERVICES:
        record = state.get(name)
        proc = alive(record)
        if proc is None:
            continue
        if name == "postgres":
            _stop_postgres(folder, record, grace_s)
        _end(proc, grace_s)
        stopped.append(name)
    return stopped


def _stop_postgres(folder: Path, record: dict, grace_s: float) -> None:
    """`pg_ctl stop -m fast`: PostgreSQL's own clean shutdown (the caller kills what is left)."""
    with open(folder / "pg_ctl.log", "ab") as out:
        subprocess.run(_as_postgres_user([str(Path(record["bin"]) / "pg_ctl"), "stop", "-D", record["data"],
                                          "-m", "fast", "-w", "-t", str(int(grace_s))]),
                       stdout=out, stderr=subprocess.STDOUT)


def _end(proc: psutil.Process, grace_s: float) -> None:
    """SIGTERM to its process group (each daemon was started in a session of its own), SIGKILL
    what is left after `grace_s`; a process that shares this process's group gets the signal alone."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(proc.pid)
            if group == os.getpgrp():
                os.kill(proc.pid, sig)
            else:
                os.killpg(group, sig)
        try:
            proc.wait(wait_s)
            return
        except psutil.TimeoutExpired:
            continue
        except psutil.NoSuchProcess:
            return


def status(folder: Path) -> list[tuple[str, str, str]]:
    """(service, state, where) for each service server.json records."""
    state = read_state(folder) or {}
    host = state.get("host", "127.0.0.1")
    rows = []
    for name in SERVICES:
        record = state.get(name)
        if record is None:
            rows.append((name, "not started", "-"))
            continue
        up = alive(record) is not None
        where = {"prefect": api_url(host, record["port"]), "redis": lock_url(host, record["port"]),
                 "postgres": f"127.0.0.1:{record['port']}/{DATABASE}"}[name]
        rows.append((name, f"running (pid {record['pid']})" if up else "stopped", where))
    return rows


def how_to_use(state: dict) -> str:
    """What `kiln server start` prints: the URLs, and how to point kiln's runs and workers at them."""
    folder, host = state["folder"], state["host"]
    lines = [f"kiln server: running in {folder}",
             f"  Prefect UI      http://{_reached_at(host)}:{state['prefect']['port']}"
             f"  (PostgreSQL on 127.0.0.1:{state['postgres']['port']}, database {DATABASE})",
             f"  Prefect API     {state['api_url']}",
             f"  step locks      {state['lock_url']}",
             "", "Point kiln at it (on every machine that runs or deploys kiln flows):",
             f"  export PREFECT_API_URL={state['api_url']}",
             f"  run: {{lock_url: \"{state['lock_url']}\"}}     # in the experiment config, or `kiln deploy --lock-url`",
             "  --store /shared/kiln_store                     # a folder every worker mounts, or s3://bucket/kiln",
             "", "Then: kiln deploy CONFIG --pool NAME --store STORE, and `prefect worker start --pool NAME` on each "
             "compute machine.", f"Logs: {folder}/{{postgres,prefect,redis}}.log   Stop: kiln server stop --dir {folder}"]
    if not _loopback(host):
        lines.append(f"Warning: the Prefect API and Redis listen on {host} without authentication: keep these ports "
                     "inside your network, and use this machine's address in the URLs on other machines.")
    return "\n".join(lines)
