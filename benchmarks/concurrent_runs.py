"""Several `kiln run`s started at once on one machine, one store: do they all complete, is every
step computed once, and how many Ray instances served them?

Each run is the quickstart (configs/tiny_cpu.yaml) with its own number of train steps (`--steps`,
`--steps + 1`, ...), so the data steps are shared and each train step is its own. With `--server`
every run talks to one Prefect server started here (flows.server.start_sqlite: 127.0.0.1, SQLite);
without, each uses Prefect's ephemeral API, as a laptop does. kiln's local Ray lives in a folder
of this benchmark's (KILN_RAY_DIR), so the keepers that started are counted from its log.

    uv run python benchmarks/concurrent_runs.py --runs 6            # ephemeral Prefect per run
    uv run python benchmarks/concurrent_runs.py --runs 6 --server   # one Prefect server

Prints one row per run (exit code, wall seconds, its train step's status) and the totals: runs
completed, steps that ran more than once (should be none), keepers started (should be one).
Exits 1 if any run failed or any step ran twice.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from flows import server  # noqa: E402
KILN = [sys.executable, "-m", "flows.cli"]


def summary(stdout: str) -> list[tuple[str, str, str]]:
    """(step name, version, status) rows of the table `kiln run` prints at the end."""
    lines = stdout.strip().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("stage") and "ran/cached" in line), None)
    if start is None:
        return []
    rows = []
    for line in lines[start + 2:]:
        parts = line.split()
        if len(parts) >= 3:
            rows.append((parts[0], parts[1], parts[2]))
    return rows


def write_configs(folder: Path, runs: int, steps: int) -> list[Path]:
    base = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    base.pop("canary", None)
    paths = []
    for i in range(runs):
        config = {**base, "name": f"concurrent-{i}",
                  "train": {**base["train"], "steps": steps + i, "warmup": 2, "checkpoint_every": steps + i,
                            "eval_every": steps + i},
                  "eval": {**base["eval"], "limit": 16}}
        path = folder / f"run{i}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        paths.append(path)
    return paths


@contextlib.contextmanager
def prefect_server(folder: Path):
    """kiln's team server on SQLite (flows/server.py) on free ports of 127.0.0.1; yields its API URL."""
    state = server.start_sqlite(folder / "server", "127.0.0.1", server.free_ports(), timeout_s=180)
    try:
        yield state["api_url"]
    finally:
        server.stop(folder / "server")


def run_all(folder: Path, runs: int, steps: int, api_url: str | None) -> dict:
    """Start the runs at once, wait for all; returns what the report prints."""
    store, ray_dir = folder / "store", folder / "ray"
    env = {**os.environ, "KILN_RAY_DIR": str(ray_dir), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    else:
        env.pop("PREFECT_API_URL", None)
    started = time.perf_counter()
    procs = []
    for path in write_configs(folder, runs, steps):
        out = open(folder / f"{path.stem}.out", "wb")
        procs.append((path, time.perf_counter(), subprocess.Popen(
            [*KILN, "run", str(path), "--store", str(store)], cwd=REPO, env=env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)))
        out.close()
    rows = []
    for path, t0, proc in procs:
        rc = proc.wait()
        text = (folder / f"{path.stem}.out").read_text(errors="replace")
        rows.append({"run": path.stem, "rc": rc, "seconds": round(time.perf_counter() - t0),
                     "steps": summary(text), "tail": text[-1500:]})
    ran = collections.Counter((name.split("/")[0], version) for r in rows for name, version, status in r["steps"]
                              if status == "ran")
    log = ray_dir / "keeper.log"
    return {"rows": rows, "wall_s": round(time.perf_counter() - started), "twice": {k: n for k, n in ran.items() if n > 1},
            "keepers": log.read_text().count("kiln local Ray up") if log.exists() else 0,
            "ray_failures": sum("timed out during startup" in r["tail"] for r in rows)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--steps", type=int, default=20, help="train steps of the first run (each next one: +1)")
    p.add_argument("--server", action="store_true", help="one Prefect server for all runs (else ephemeral)")
    p.add_argument("--keep", action="store_true", help="keep the folder (store, logs) and print where")
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="kcr-", dir="/tmp"))  # short: Ray's socket paths
    try:
        with (prefect_server(folder) if args.server else contextlib.nullcontext()) as url:
            report = run_all(folder, args.runs, args.steps, url)
        for row in report["rows"]:
            train = next((s for n, _, s in row["steps"] if n == "train"), "?")
            print(f"{row['run']}: exit {row['rc']}, {row['seconds']} s, train {train}")
            if row["rc"] != 0:
                print("  " + row["tail"].replace("\n", "\n  ")[-1200:])
        done = sum(r["rc"] == 0 for r in report["rows"])
        print(f"{done}/{args.runs} runs completed in {report['wall_s']} s "
              f"({'one Prefect server' if args.server else 'ephemeral Prefect per run'}); "
              f"steps computed more than once: {report['twice'] or 'none'}; kiln local Ray keepers started: "
              f"{report['keepers']}; runs failed starting Ray: {report['ray_failures']}")
        if args.keep:
            print(f"kept: {folder}")
        return 0 if done == args.runs and not report["twice"] else 1
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
