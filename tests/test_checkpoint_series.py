"""A checkpoint series (`eval.checkpoints`): one cached evaluate step per kept training step, each
scoring that step's parameters, shown against the step by `kiln compare --over steps`; and the
version rules that make it safe to add to a store full of outputs."""

from __future__ import annotations

import json

import pytest
import yaml

from flows.cli import main
from flows.config import ExperimentConfig
from flows.plan import recipe
from tests.conftest import kiln
from tests.test_scheduler import SMALL_ABLATION, run_names
from training.loop import flatten_params, load_model, params_sha256

SERIES = {**{k: v for k, v in SMALL_ABLATION.items() if k != "variants"}, "name": "series",
          "train": {"batch_size": 4, "steps": 300, "warmup": 10, "lr": 3.0e-3, "checkpoint_every": 100,
                    "log_every": 50, "eval_every": 100, "eval_batches": 1},
          "eval": {**SMALL_ABLATION["eval"], "checkpoints": [100, 200, 300]}}


def test_the_series_adds_evaluate_steps_and_leaves_the_other_versions_alone():
    plain = ExperimentConfig.model_validate({**SERIES, "eval": SMALL_ABLATION["eval"]})
    series = ExperimentConfig.model_validate(SERIES)
    steps, before = {s.name: s for s in recipe(series)}, {s.name: s for s in recipe(plain)}
    assert [n for n in steps if n.startswith("evaluate/")] == ["evaluate/step-100", "evaluate/step-200",
                                                               "evaluate/step-300"]
    assert steps["train"].config.train.keep_checkpoints == (100, 200, 300)
    # what is kept is a setting: the train step is the same version (a cached one is reused; kiln
    # plan warns when it lacks a kept step), and so is the plain evaluate step
    assert steps["train"].version == before["train"].version
    assert steps["evaluate"].version == before["evaluate"].version
    assert before["train"].config.train.keep_checkpoints == () and before["evaluate"].config.step is None
    assert len({steps[f"evaluate/step-{s}"].version for s in (100, 200, 300)}) == 3
    every = ExperimentConfig.model_validate({**SERIES, "eval": {**SERIES["eval"], "checkpoints": "every"}})
    assert every.phase_trains()["train"][0].keep_checkpoints == (100, 200, 300)
    with pytest.raises(ValueError, match="outside the run"):
        ExperimentConfig.model_validate({**SERIES, "eval": {**SERIES["eval"], "checkpoints": [400]}}).phase_trains()


def test_a_step_before_a_continue_phase_is_evaluated_where_it_was_trained():
    """The series follows the last train phase's training back: in mode continue a phase trains
    only the steps after its start, so a step up to it is its parent's (kept and evaluated there,
    under the series' name); a phase in mode reset counts its own steps from 1."""
    phased = {**SERIES, "train": {**SERIES["train"], "steps": 200},
              "phases": {"cool": {"from": "train", "step": 100, "steps": 200, "train": {"seed": 1}},
                         "again": {"steps": 100}},  # continues cool: steps 301-400
              "eval": {**SERIES["eval"], "checkpoints": "every"}}
    config = ExperimentConfig.model_validate(phased)
    trains = config.phase_trains()
    assert [trains[n][0].keep_checkpoints for n in ("train", "train/cool", "train/again")] == [
        (100,), (200, 300), (400,)]
    steps = {s.name: s for s in recipe(config)}
    assert [(n, steps[n].inputs["model"].name) for n in steps if "/step-" in n] == [
        ("evaluate/again/step-100", "train"), ("evaluate/again/step-200", "train/cool"),
        ("evaluate/again/step-300", "train/cool"), ("evaluate/again/step-400", "train/again")]
    assert all(steps[f"evaluate/again/step-{s}"].config.step == s for s in (100, 200, 300, 400))

    reset = {**phased, "phases": {"cool": {**phased["phases"]["cool"], "mode": "reset"}}}
    steps = {s.name: s for s in recipe(ExperimentConfig.model_validate(reset))}
    assert {steps[n].inputs["model"].name for n in steps if "/step-" in n} == {"train/cool"}


def test_compare_over_steps_ends_with_the_final_models_evaluation_where_the_series_does_not(tmp_path):
    """A series that stops before the last step ([100, 200] of 300) gets the plain evaluate step's
    row at step 300, so the table runs to the model the run published; one that names the last
    step already does not repeat it. Nothing has run: every row is missing, its evaluate step named.
    Before, the final model's scores were left out of the table."""
    from flows.compare import over_steps
    from flows.experiment import from_config
    from tasks.engine.store import Store

    short = ExperimentConfig.model_validate({**SERIES, "eval": {**SERIES["eval"], "checkpoints": [100, 200]}})
    steps = {s.name: s for s in recipe(short)}
    rows = over_steps(from_config(short), Store(tmp_path))
    assert [(r["step"], r["evaluate_version"]) for r in rows] == [
        (100, steps["evaluate/step-100"].version), (200, steps["evaluate/step-200"].version),
        (300, steps["evaluate"].version)]
    assert {r["status"] for r in rows} == {"missing"}
    whole = ExperimentConfig.model_validate(SERIES)
    steps = {s.name: s for s in recipe(whole)}
    assert [(r["step"], r["evaluate_version"]) for r in over_steps(from_config(whole), Store(tmp_path))] == [
        (s, steps[f"evaluate/step-{s}"].version) for s in (100, 200, 300)]
    assert over_steps(from_config(ExperimentConfig.model_validate({**SERIES, "eval": SMALL_ABLATION["eval"]})),
                      Store(tmp_path)) == []  # no series: no rows (the CLI says to set eval.checkpoints)


@pytest.mark.slow  # out of the fast suite (27 s alone, 61-75 s in it); CI runs it after it
@pytest.mark.ci
@pytest.mark.ray  # its training (or data workers) starts a local Ray: tests/conftest.py ray_lock
def test_three_cached_evaluate_steps_and_compare_over_steps(tmp_path, capsys):
    config, store = tmp_path / "series.yaml", tmp_path / "store"
    config.write_text(yaml.safe_dump(SERIES, sort_keys=False))
    ran = run_names(kiln("run", str(config), "--store", str(store), "--until", "evaluate").stdout)
    assert all(ran[f"evaluate/step-{s}"] == "ran" for s in (100, 200, 300)) and ran["evaluate"] == "ran"
    again = run_names(kiln("run", str(config), "--store", str(store), "--until", "evaluate").stdout)
    assert all(status == "cached" for status in again.values()), again

    steps = {s.name: s for s in recipe(ExperimentConfig.model_validate(SERIES))}
    train_out = store / "train" / steps["train"].version
    final_cfg, final = load_model(train_out)
    kept = {s: load_model(train_out / "steps" / str(s)) for s in (100, 200, 300)}
    assert all(cfg == final_cfg for cfg, _ in kept.values())
    shas = {s: params_sha256(flatten_params(p)) for s, (_, p) in kept.items()}
    assert len(set(shas.values())) == 3 and shas[300] == params_sha256(flatten_params(final))

    assert main(["compare", str(config), "--store", str(store), "--over", "steps", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows] == [100, 200, 300] and all(r["status"] == "done" for r in rows)
    for row in rows:
        lineage = json.loads((store / "evaluate" / row["evaluate_version"] / "lineage.json").read_text())
        assert row["bits_per_byte"] == lineage["stats"]["bits_per_byte"]
    assert rows[0]["bits_per_byte"] > rows[2]["bits_per_byte"]  # it learns over the run
    # the last kept step is the trained model: its scores are the plain evaluate step's
    final_eval = json.loads((store / "evaluate" / steps["evaluate"].version / "lineage.json").read_text())
    assert rows[2]["bits_per_byte"] == final_eval["stats"]["bits_per_byte"]

    assert main(["compare", str(config), "--store", str(store), "--over", "steps"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["variant", "step", "status"]
    assert [line.split()[1] for line in lines[2:]] == ["100", "200", "300"]
