"""How long a `ray start --head --block` node takes to stop: SIGTERM to its whole process group at
once (how the tests stopped their Ray nodes before session 30) against SIGTERM to the `ray start`
process alone, which then stops each process it started (tests/conftest.py `stop_group(...,
leader_first=True)`). `--rounds` of each, in turn, a fresh node on a free port of 127.0.0.1 each
time; prints each stop's seconds, the medians and their ratio.

    uv run --dev python benchmarks/ray_stop_bench.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = Path(sys.executable).parent / "ray"
UP = b"Ray runtime started"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(folder: Path) -> subprocess.Popen:
    log = folder / "ray.log"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(RAY), "start", "--head", "--port", str(free_port()), "--node-ip-address",
                                 "127.0.0.1", "--num-cpus", "1", "--include-dashboard=false", "--disable-usage-stats",
                                 f"--temp-dir={folder / 'ray'}", "--block"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while UP not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the Ray head did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc


def stop_s(proc: subprocess.Popen, leader_first: bool) -> float:
    """Seconds from SIGTERM until the node's last process is gone (SIGKILL to what is left after 120 s)."""
    t0 = time.perf_counter()
    if leader_first:
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    finally:
        while True:  # the group's other processes, if any outlived the leader
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            if time.perf_counter() - t0 > 120:
                os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.1)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    times = {"the group at once": [], "the leader first": []}
    for r in range(args.rounds):
        for name in times:
            with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
                proc = start_node(Path(tmp))
                times[name].append(stop_s(proc, leader_first=name == "the leader first"))
            print(f"  round {r + 1} SIGTERM to {name:17s} stopped in {times[name][-1]:5.1f} s", flush=True)
    group, leader = (statistics.median(v) for v in times.values())
    print(f"median: the group at once {group:.1f} s, the leader first {leader:.1f} s; leader first / group = "
          f"{leader / group:.3f}")


if __name__ == "__main__":
    main()
