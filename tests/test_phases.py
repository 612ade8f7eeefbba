"""Phases and cooldown branches as plans (flows/config.py phase_trains, flows/plan.py): what each
phase's train step is, what its parent keeps, and which versions a change moves; then the
shipped cooldown config run end to end: one stable run, one row per branch in `kiln compare`, a
branch killed mid-way resumes bit for bit, and changing one branch reruns only it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

from flows.cli import main
from flows.config import ExperimentConfig
from flows.experiment import from_config
from flows.plan import recipe
from tests.conftest import REPO, kiln, stop_group
from tests.test_scheduler import SMALL_ABLATION, run_names

BASE = {k: v for k, v in SMALL_ABLATION.items() if k not in ("variants", "run")}
PHASED = {**BASE, "name": "phased",
          "train": {"batch_size": 4, "steps": 20, "schedule_steps": 40, "warmup": 2, "checkpoint_every": 10,
                    "eval_every": 10, "eval_batches": 1},
          "phases": {"second": {"steps": 20}, "fresh": {"from": "train", "steps": 10, "mode": "weights",
                                                     "train": {"lr": 1.0e-3}}}}


def steps_of(raw: dict) -> dict:
    return {s.name: s for s in recipe(ExperimentConfig.model_validate(raw))}


def test_each_phase_is_a_train_step_started_from_the_one_it_names():
    steps = steps_of(PHASED)
    first, second, fresh = steps["train"], steps["train/second"], steps["train/fresh"]
    assert second.inputs["init"] is first and fresh.inputs["init"] is first
    assert (second.config.train.steps, second.config.train.init.mode, second.config.train.init.step) == \
        (40, "continue", "latest")  # continue counts the whole run's steps: 20 + 20
    assert fresh.config.train.steps == 10 and fresh.config.train.lr == 1.0e-3 and fresh.config.train.init.mode == "weights"
    assert first.config.train.keep_checkpoints == (20,)  # the continue phase needs its last state; weights does not
    assert {"evaluate", "evaluate/second", "evaluate/fresh"} <= set(steps)
    assert steps["export"].inputs["model"] is fresh  # post-training and export take the last phase

    # a phase's own change moves its version and its children's only; the first phase is untouched
    changed = steps_of({**PHASED, "phases": {**PHASED["phases"], "second": {"steps": 20, "train": {"lr": 2e-3}}}})
    assert changed["train"].version == first.version and changed["train/fresh"].version == fresh.version
    assert changed["train/second"].version != second.version
    # the parent's version is part of the child's: a changed first phase reruns every phase
    moved = steps_of({**PHASED, "train": {**PHASED["train"], "lr": 2e-3}})
    assert all(moved[n].version != steps[n].version for n in ("train", "train/second", "train/fresh"))
    # and without phases the train step is the version it always was
    assert steps_of({**PHASED, "phases": {}})["train"].version == first.version

    with pytest.raises(ValueError, match="not `train` or a phase before"):
        ExperimentConfig.model_validate({**PHASED, "phases": {"x": {"from": "later", "steps": 5}}}).phase_trains()
    with pytest.raises(ValueError, match="past the end"):
        ExperimentConfig.model_validate({**PHASED, "phases": {"x": {"step": 30, "steps": 5}}}).phase_trains()


COOLDOWN = {**BASE, "name": "cool",
            "train": {"batch_size": 4, "steps": 60, "warmup": 4, "schedule": "wsd", "decay_steps": 20,
                      "keep_every": 20, "checkpoint_every": 5, "log_every": 5, "eval_every": 20, "eval_batches": 1},
            "phases": {"cooldown": {"from": "train", "step": 20, "steps": 20, "mode": "continue"}},
            "grid": {"phases.cooldown.step": [20, 40]}}


def test_the_shipped_cooldown_config_plans_one_stable_run_and_three_branches():
    experiment = from_config(ExperimentConfig.model_validate(yaml.safe_load((REPO / "configs" / "cooldown_cpu.yaml")
                                                                            .read_text())))
    trains = [s for s in experiment.steps if s.stage == "train"]
    assert [s.name for s in trains] == ["train", "train/cooldown/step=80", "train/cooldown/step=120",
                                        "train/cooldown/step=160"]
    assert trains[0].config.train.kept_steps == (40, 80, 120, 160, 200, 240)
    assert [s.config.train.init.step for s in trains[1:]] == [80, 120, 160]
    assert all(s.inputs["init"].key == trains[0].key for s in trains[1:])


# ~7 min of one CI worker (four kiln runs): slow; test_starting_from_a_published_version_... runs a
# phase end to end in CI, and benchmarks/configs_check.py runs configs/cooldown_cpu.yaml
@pytest.mark.slow
@pytest.mark.ray  # its training starts a local Ray: tests/conftest.py ray_lock
def test_cooldown_branches_share_the_stable_run_resume_bitwise_and_rerun_alone(tmp_path, capsys):
    config, store = tmp_path / "cool.yaml", tmp_path / "store"
    config.write_text(yaml.safe_dump(COOLDOWN, sort_keys=False))
    ran = run_names(kiln("run", str(config), "--store", str(store), "--until", "evaluate").stdout)
    assert ran["train"] == "ran" and ran["train/cooldown/step=20"] == "ran" and ran["train/cooldown/step=40"] == "ran"
    # the stable run trained once for both branches: three train outputs, it and one per cooldown
    assert len([p for p in (store / "train").iterdir() if not p.name.startswith(".")]) == 3

    assert main(["compare", str(config), "--store", str(store), "--json"]) == 0
    rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows) == ["train", "step=20:cooldown", "step=40:cooldown"]
    assert all(r["status"] == "done" and r["bits_per_byte"] > 0 for r in rows.values())
    assert rows["step=20:cooldown"]["tokens"] == 40 * 4 * 128 and rows["step=40:cooldown"]["tokens"] == 60 * 4 * 128

    # kill the step=40 branch mid-way: the rerun resumes from its own checkpoint to the same bits
    branch = {s.name: s for s in from_config(ExperimentConfig.model_validate(COOLDOWN)).steps}["train/cooldown/step=40"]
    done = json.loads((store / "train" / branch.version / "lineage.json").read_text())["stats"]
    for stage in ("train", "evaluate"):
        for s in from_config(ExperimentConfig.model_validate(COOLDOWN)).steps:
            if s.stage == stage and s.name.endswith("step=40"):
                shutil.rmtree(store / stage / s.version)
    work = store / ".work" / f"train-{branch.version}" / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(config), "--store", str(store), "--until",
                             "evaluate"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline and not any(
                p.name.isdigit() and int(p.name) >= 50 for p in (work.iterdir() if work.is_dir() else [])):
            time.sleep(0.005)
        assert proc.poll() is None, "the run ended before the branch could be killed mid-way"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        stop_group(proc, grace_s=0)
    assert not (store / "train" / branch.version).exists()
    again = run_names(kiln("run", str(config), "--store", str(store), "--until", "evaluate").stdout)
    assert again["train/cooldown/step=40"] == "ran" and again["train"] == "cached"
    resumed = json.loads((store / "train" / branch.version / "lineage.json").read_text())["stats"]
    assert resumed["resumed_from_step"] >= 50 and resumed["params_sha256"] == done["params_sha256"]

    # one branch changed (it starts at 60, which the stable run kept): only it runs
    moved = {**COOLDOWN, "grid": {"phases.cooldown.step": [20, 60]}}
    config.write_text(yaml.safe_dump(moved, sort_keys=False))
    third = run_names(kiln("run", str(config), "--store", str(store), "--until", "evaluate").stdout)
    assert third["train"] == "cached" and third["train/cooldown/step=20"] == "cached"
    assert third["train/cooldown/step=60"] == "ran"


@pytest.mark.slow  # out of the fast suite (three kiln runs: 38 s alone, 74-80 s in it); CI runs it after it
@pytest.mark.ci
@pytest.mark.ray  # its training starts a local Ray: tests/conftest.py ray_lock
def test_starting_from_a_published_version_and_a_step_it_did_not_keep(tmp_path, capsys):
    """`train.init.from: train/<version>` names an output already in the store (made by another
    experiment): weights from its last step work; a step it did not keep is a plan warning and a
    failed step, both naming what to do."""
    store = tmp_path / "store"
    first = {**BASE, "name": "first", "train": {**BASE["train"], "steps": 8}}
    first_path = tmp_path / "first.yaml"
    first_path.write_text(yaml.safe_dump(first, sort_keys=False))
    kiln("run", str(first_path), "--store", str(store), "--until", "train")
    parent = steps_of(first)["train"].version

    child = {**BASE, "name": "child", "train": {**BASE["train"], "steps": 6, "lr": 1.0e-3,
                                                "init": {"from": f"train/{parent}", "mode": "weights"}}}
    child_path = tmp_path / "child.yaml"
    child_path.write_text(yaml.safe_dump(child, sort_keys=False))
    ran = run_names(kiln("run", str(child_path), "--store", str(store), "--until", "train").stdout)
    assert ran[f"init/train-{parent}"] == "cached" and ran["train"] == "ran"
    (lineage,) = [p for p in store.glob("train/*/lineage.json") if p.parent.name != parent]
    started = {i["name"]: i for i in json.loads(lineage.read_text())["inputs"]}["init"]
    assert (started["stage"], started["version"]) == ("train", parent)

    kept = {**child, "train": {**child["train"], "init": {"from": f"train/{parent}", "step": 4, "mode": "continue"},
                               "steps": 10}}
    child_path.write_text(yaml.safe_dump(kept, sort_keys=False))
    assert main(["plan", str(child_path), "--store", str(store)]) == 0
    assert f"needs step 4 of init/train-{parent}" in capsys.readouterr().err
    failed = kiln("run", str(child_path), "--store", str(store), "--until", "train", check=False)
    assert failed.returncode == 1 and "kept no state of step 4" in failed.stderr

    # a model section other than the parent's: said by the plan, and the run refused before any
    # step runs (before, when the train step started, after the data stages)
    wider = {**child, "model": {**child["model"], "n_layers": child["model"]["n_layers"] + 1}}
    child_path.write_text(yaml.safe_dump(wider, sort_keys=False))
    assert main(["plan", str(child_path), "--store", str(store)]) == 0
    n_layers = child["model"]["n_layers"]
    said = (f"train: train/{parent} holds a model of another config than this step's "
            f"(n_layers: {n_layers + 1} here, {n_layers} there)")
    assert said in capsys.readouterr().err
    refused = kiln("run", str(child_path), "--store", str(store), check=False)
    assert refused.returncode == 2 and said in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert "ran/cached" not in refused.stdout  # no step, not even a cache check: before, exit 1 at the train step
