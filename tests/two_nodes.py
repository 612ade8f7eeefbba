"""A real two-node Ray cluster on this one machine, for the multi-node tests.

Two network namespaces joined by a veth pair (a 10.x.y.0/24 the fixture picks and removes), node
A with the Ray head and an S3-compatible server (moto: the store), node B with a Ray worker node
in its own mount namespace whose /tmp is a private tmpfs, so it cannot see the driver's working
folders. Needs root and `ip` (iproute2) and `unshare` (util-linux); a test that uses it is
skipped, saying so, where they are missing. Everything it made is removed on exit, also when the
test fails: the processes in both namespaces, the namespaces (the veth pair goes with them).
Every server logs to a file in the test's tmp_path; a node that does not come up is started again
(Ray gives a raylet a fixed 30 s to register, which a loaded machine can miss), and an error says
what the nodes' logs ended with. The cluster holds the Ray lock exclusively (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import (REPO, ephemeral_env, free_port, log_tail, ray_lock, ray_said, run_captured, start_ray_node,
                            stop_group)

BIN = Path(sys.executable).parent


@dataclass
class Cluster:
    ns_a: str
    ns_b: str
    ip_a: str
    ip_b: str
    ray_address: str
    store: str  # an s3:// URL on node A's S3 server
    env: dict = field(default_factory=dict)  # what a driver in A needs (Ray address, S3 endpoint)
    log_dirs: list[str] = field(default_factory=list)
    restart_b: Callable[[], None] | None = None  # a fresh worker node in B (after kill_b)
    stop_b: Callable[[], None] | None = None  # node B leaves the cluster, as a drained node does

    def kill_b(self) -> None:
        """Node B dies: SIGKILL to every process in its namespace (its Ray node and workers)."""
        _kill_everything_in(self.ns_b)

    def popen_in_a(self, args: list[str]) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns_a, *args], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**ephemeral_env(), **self.env})

    def run_in_a_and_when(self, args: list[str], said: str, then: Callable[[], None],
                          timeout: int = 600) -> tuple[int, str]:
        """A command in namespace A; as soon as a line it prints contains `said`, `then()` (node B
        leaves or dies, say). Its exit status and all it printed, once it has ended."""
        proc = self.popen_in_a(args)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if said in line:
                then()
                break
        rest, _ = proc.communicate(timeout=timeout)
        return proc.returncode, "".join(lines) + rest

    def ray_errors(self) -> str:
        """The ends of both nodes' raylet.err and worker .err logs, for a failed test's message."""
        parts = []
        for folder in self.log_dirs:
            for path in sorted(Path(folder).glob("session_latest/logs/*.err")):
                text = path.read_text(errors="replace").strip()
                if text and (path.name == "raylet.err" or path.name.startswith("worker")):
                    parts.append(f"--- {path}\n{text[-1500:]}")
        return "\n".join(parts[-8:])

    def run_in_a(self, args: list[str], env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
        """A command in namespace A (a driver beside the head), as a user would run it there: on
        Prefect's ephemeral API (the session's Prefect server is on the machine's loopback, which
        namespace A does not share). One that outlasts `timeout` fails the test with what it and
        the Ray nodes had said."""
        try:
            return run_captured(["ip", "netns", "exec", self.ns_a, *args], timeout, cwd=REPO,
                                env={**ephemeral_env(), **self.env, **(env or {})})
        except AssertionError as e:
            raise AssertionError(f"{e}\nRay:\n{self.ray_errors()}") from None


def require_namespaces() -> None:
    missing = [tool for tool in ("ip", "unshare", "mount") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        pytest.skip(f"the two-node cluster needs root and {', '.join(missing) or 'ip/unshare'} "
                    "(apt-get install iproute2 util-linux); not available here")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _wait_tcp(ns: str, host: str, port: int, proc: subprocess.Popen, what: str, log: Path,
              timeout_s: float = 300) -> None:
    probe = (f"import socket,sys; s=socket.socket(); s.settimeout(1); "
             f"sys.exit(s.connect_ex(({host!r}, {port})))")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}; {log} ends:\n{log_tail(log)}")
        if subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", probe], timeout=30).returncode == 0:
            return
        time.sleep(1)
    raise TimeoutError(f"{what} not listening on {host}:{port} after {timeout_s} s; {log} ends:\n{log_tail(log)}")


def _wait_nodes(cluster_env: dict, ns: str, count: int, timeout_s: float = 300, said: Callable[[], str] = str) -> None:
    """Until a driver in `ns` sees `count` alive nodes (asked in a fresh process each time, as a user's
    driver would); the nodes said they were up already, so this is normally one question."""
    check = ("import os, ray; ray.init(address=os.environ['RAY_ADDRESS'], log_to_driver=False, logging_level='ERROR'); "
             "print(sum(n['Alive'] for n in ray.nodes()))")
    deadline, seen = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        try:  # a probe that joins while the head is still coming up can hang: ask again
            proc = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", check], capture_output=True,
                                  text=True, timeout=60, env={**os.environ, **cluster_env}, cwd=REPO)
        except subprocess.TimeoutExpired:
            seen = "a probe that did not answer in 60 s"
            continue
        seen = proc.stdout.strip().splitlines()[-1:] or proc.stderr[-500:]
        if proc.returncode == 0 and proc.stdout.strip().endswith(str(count)):
            return
        time.sleep(2)
    raise TimeoutError(f"the Ray cluster did not reach {count} alive nodes in {timeout_s} s (last: {seen}); "
                       f"the nodes said:\n{said()}")


@contextlib.contextmanager
def two_node_cluster(tmp_path: Path):
    require_namespaces()
    with ray_lock(exclusive=True), _two_node_cluster(tmp_path) as cluster:
        yield cluster


@contextlib.contextmanager
def _two_node_cluster(tmp_path: Path):
    remove_leftovers()
    # The creating pid in every name, so that leftovers of a killed test run can be told apart;
    # short enough for the veth names (15 characters at most).
    tag = f"k{os.getpid()}r{random.randrange(100):02d}"
    ns_a, ns_b, veth_a, veth_b = f"{tag}a", f"{tag}b", f"{tag}va", f"{tag}vb"
    subnet = f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}"
    ip_a, ip_b = f"{subnet}.1", f"{subnet}.2"
    procs: list[subprocess.Popen] = []
    node_b: list[subprocess.Popen] = []  # B's current `ray start`
    made: list[str] = []
    # Ray's session folders (socket paths must stay under 108 bytes: not in tmp_path); node B's
    # is outside its private /tmp so that its logs outlive it, for the error of a failed test.
    ray_dir = f"/var/tmp/kiln-ray-{tag}"
    try:
        for ns in (ns_a, ns_b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _ip("link", "set", veth_a, "netns", ns_a)
        _ip("link", "set", veth_b, "netns", ns_b)
        for ns, dev, ip in ((ns_a, veth_a, ip_a), (ns_b, veth_b, ip_b)):
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")

        s3_port, ray_port = free_port(), free_port()  # free here is free in a fresh namespace too
        endpoint = f"http://{ip_a}:{s3_port}"
        aws = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": endpoint}
        # Multi-node Ray wants this on (tests/conftest.py turns it off for single-node Rays), and
        # token authentication off on both sides (see conftest.ray_head).
        ray_env = {**ephemeral_env(), **aws, "PYTHONPATH": str(REPO), "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
                   "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}

        moto = subprocess.Popen(["ip", "netns", "exec", ns_a, str(BIN / "moto_server"), "-H", ip_a, "-p", str(s3_port)],
                                stdout=_log(tmp_path, "moto"), stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(moto)
        _wait_tcp(ns_a, ip_a, s3_port, moto, "moto_server", tmp_path / "moto.log")
        subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c",
                        f"import s3fs; s3fs.S3FileSystem(endpoint_url={endpoint!r}).mkdir('kiln')"],
                       check=True, timeout=120, env={**os.environ, **aws})

        def start_head() -> subprocess.Popen:
            return subprocess.Popen(
                ["ip", "netns", "exec", ns_a, str(BIN / "ray"), "start", "--head", "--port", str(ray_port),
                 "--node-ip-address", ip_a, "--num-cpus", "1", "--include-dashboard=false", "--disable-usage-stats",
                 f"--temp-dir={ray_dir}", "--block"],
                cwd=REPO, env={**ray_env, "KILN_CACHE": str(tmp_path / "node-a-cache")},
                stdout=_log(tmp_path, "ray-head"), stderr=subprocess.STDOUT, start_new_session=True)

        procs.append(start_ray_node(start_head, tmp_path / "ray-head.log", ray_dir, f"the Ray head on {ip_a}:{ray_port}"))

        # A repository checked out under /tmp (a CI clone) would vanish under B's tmpfs with the
        # interpreter and code its Ray node needs: it is bound back in, alone.
        keep_repo = ""
        if REPO.is_relative_to("/tmp"):
            held = f"/run/kiln-repo-{tag}"
            keep_repo = (f"mkdir -p {held} && mount --bind {REPO} {held} && mount -t tmpfs none /tmp && "
                         f"mkdir -p {REPO} && mount --bind {held} {REPO} && ")
        mount_tmp = keep_repo or "mount -t tmpfs none /tmp && "

        def start_b() -> None:
            """Node B: its own /tmp (a tmpfs only it sees), its own kiln cache in it."""
            def start() -> subprocess.Popen:
                return subprocess.Popen(
                    ["ip", "netns", "exec", ns_b, "unshare", "-m", "--propagation", "private", "bash", "-c",
                     f"{mount_tmp}exec {BIN / 'ray'} start --address={ip_a}:{ray_port} "
                     f"--temp-dir={ray_dir}-b --node-ip-address={ip_b} --num-cpus=1 --disable-usage-stats --block"],
                    cwd=REPO, env={**ray_env, "KILN_CACHE": "/tmp/kiln-cache"},
                    stdout=_log(tmp_path, "ray-worker"), stderr=subprocess.STDOUT, start_new_session=True)

            procs.append(start_ray_node(start, tmp_path / "ray-worker.log", f"{ray_dir}-b",
                                        f"the Ray worker node on {ip_b}"))
            node_b[:] = [procs[-1]]

        def stop_b() -> None:
            """SIGTERM to B's `ray start --block`, which stops its node: it leaves the cluster at
            once (a killed node is noticed only when its health checks have failed)."""
            stop_group(node_b[0], grace_s=60, leader_first=True)

        def said() -> str:
            return "\n".join([ray_said(tmp_path / "ray-head.log", ray_dir),
                              ray_said(tmp_path / "ray-worker.log", f"{ray_dir}-b")])

        start_b()
        # RAY_ENABLE_UV_RUN_RUNTIME_ENV=0: a driver under `uv run` (as pytest is here) would
        # otherwise have Ray start every worker through `uv run`, which needs the package index,
        # unreachable from the namespaces.
        driver_env = {**aws, "RAY_ADDRESS": f"{ip_a}:{ray_port}", "RAY_AUTH_MODE": "disabled",
                      "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
                      "KILN_CACHE": str(tmp_path / "driver-cache")}
        _wait_nodes(driver_env, ns_a, 2, said=said)

        def restart_b() -> None:
            start_b()
            _wait_nodes(driver_env, ns_a, 2, said=said)

        yield Cluster(ns_a, ns_b, ip_a, ip_b, f"{ip_a}:{ray_port}", "s3://kiln/store", driver_env,
                      log_dirs=[ray_dir, f"{ray_dir}-b"], restart_b=restart_b, stop_b=stop_b)
    finally:
        for proc in reversed(procs):  # B's node, the head, moto: each its own leader first
            stop_group(proc, grace_s=30, leader_first=True)
        for ns in made:  # anything still running in the namespaces, then the namespaces
            _kill_everything_in(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(ray_dir, ignore_errors=True)
        shutil.rmtree(f"{ray_dir}-b", ignore_errors=True)
        subprocess.run(["rmdir", f"/run/kiln-repo-{tag}"], capture_output=True)  # B's mounts went with B


def _log(tmp_path: Path, name: str):
    """A file for a server's output. Never a pipe nobody reads: moto logs every request, and once
    the pipe's buffer was full it blocked in mid-request and the S3 store hung."""
    return open(tmp_path / f"{name}.log", "ab")


def remove_leftovers() -> None:
    """Namespaces (and what runs in them) of an earlier test process that was killed before its
    clean-up ran (a SIGTERMed pytest runs no finalizers)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    for name in (line.split()[0] for line in listed if line.strip()):
        match = re.fullmatch(r"k(\d+)r\d\d[ab]", name)
        if match is None or Path(f"/proc/{match.group(1)}").exists():
            continue
        _kill_everything_in(name)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _kill_everything_in(ns: str) -> None:
    """SIGKILL to every process in the network namespace `ns`."""
    for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
