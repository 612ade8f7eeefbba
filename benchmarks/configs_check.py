"""Every shipped config, run end to end: `kiln run CONFIG` on a clean store for each file in
configs/ that fits this machine, and whether it exited 0.

No test runs the shipped configs, so a change to training numerics can break one unseen (the
scaling sweep's fit did). Run this before a change to training numerics is called done, e.g. a
STAGE_VERSION bump of train, and put its output in the note:

    uv run python benchmarks/configs_check.py                       # every config that fits here
    uv run python benchmarks/configs_check.py configs/tiny_cpu.yaml  # some of them

A config fits this machine when its `resources` ask for no GPU and at most this machine's cores
(the *_gpu.yaml presets are listed as skipped, with why). Each run gets its own store under a
temporary folder and its own log file there; a failed run prints the log's last lines. Exits 1 if
any run failed. A run's time is wall time on whatever else the machine was doing: compare runs
made in one go, and the machine line printed first says the load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from train_bench import machine  # noqa: E402


def why_not_here(config: Path) -> str | None:
    """None if the config can run on this machine, else the reason it cannot."""
    resources = (yaml.safe_load(config.read_text()) or {}).get("resources") or {}
    gpus, cpus = resources.get("gpus_per_host", 0), resources.get("cpus_per_host", 1)
    hosts = resources.get("hosts", 1)
    if gpus:
        return f"asks for {gpus} GPU(s) per host"
    if cpus * hosts > (os.cpu_count() or 1):
        return f"asks for {hosts} host(s) x {cpus} CPUs, this machine has {os.cpu_count()}"
    return None


def run_config(config: Path, root: Path, timeout_s: float) -> tuple[int, float, Path]:
    """`kiln run` on a fresh store: (exit status, seconds, log file). 124 when it ran out of time."""
    store, log = root / config.stem / "store", root / config.stem / "kiln-run.log"
    store.parent.mkdir(parents=True)
    t0 = time.perf_counter()
    with log.open("w") as out:
        try:
            status = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(config), "--store", str(store)],
                                    cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            status = 124
    return status, time.perf_counter() - t0, log


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", nargs="*", type=Path, help="config files (default: every file in configs/)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    p.add_argument("--keep", action="store_true", help="keep the stores and logs (printed at the end)")
    args = p.parse_args()
    configs = args.configs or sorted((REPO / "configs").glob("*.yaml"))
    print(f"machine: {machine()}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="kiln-configs-"))
    failed, rows = [], []
    for config in configs:
        reason = why_not_here(config)
        if reason:
            rows.append((config.name, "skipped", "", reason))
            print(f"{config.name}: skipped ({reason})", flush=True)
            continue
        print(f"{config.name}: running ...", flush=True)
        status, seconds, log = run_config(config, root, args.timeout)
        outcome = "passed" if status == 0 else f"FAILED (exit {status})"
        rows.append((config.name, outcome, f"{seconds:.0f} s", ""))
        print(f"{config.name}: {outcome} in {seconds:.0f} s", flush=True)
        if status != 0:
            failed.append(config.name)
            print("".join(log.read_text().splitlines(keepends=True)[-40:]), flush=True)
    print(f"\nmachine at the end: {machine()}")
    print(f"{'config':22s} {'outcome':18s} {'wall':>7s}  note")
    for name, outcome, wall, note in rows:
        print(f"{name:22s} {outcome:18s} {wall:>7s}  {note}")
    ran = sum(1 for r in rows if r[1] != "skipped")
    print(f"{ran - len(failed)} passed, {len(failed)} failed, {len(rows) - ran} skipped")
    if args.keep:
        print(f"stores and logs: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
