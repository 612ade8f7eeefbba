"""The canary (flows/canary.py): a small config run into the day's fresh store passes its bounds, and
the same finished store fails, naming the metric, once a bound is tightened below what it reached."""

from __future__ import annotations

import json

import pytest
import yaml

from flows.canary import violations
from flows.config import CanaryConfig
from tests.conftest import kiln
from tests.test_scheduler import SMALL_ABLATION

CANARY = {**{k: v for k, v in SMALL_ABLATION.items() if k not in ("variants", "run")}, "name": "small-canary",
          "canary": {"max_final_loss": 9.0, "min_steps": 12, "max_wall_s": 3600,
                     "min": {"next_passage_acc": 0.0}, "max": {"bits_per_byte": 20.0}}}


def test_bounds_name_what_left_them_and_what_was_not_reported():
    bounds = CanaryConfig(max_final_loss=4.0, min_steps=10, max_wall_s=60, min={"next_passage_acc": 0.3},
                          max={"bits_per_byte": 2.0})
    ok = {"base": {"final_loss": 3.9, "steps": 10, "next_passage_acc": 0.31, "bits_per_byte": 1.9}}
    assert violations(ok, bounds, 59.0) == []
    bad = {"base": {"final_loss": 4.2, "steps": 8, "bits_per_byte": 2.5}}
    problems = violations(bad, bounds, 61.0)
    assert problems == ["wall time 61 s > max_wall_s 60", "base: final_loss 4.2 > max_final_loss 4",
                        "base: steps 8 < min_steps 10",
                        "base: next_passage_acc was not reported (bound min.next_passage_acc 0.3)",
                        "base: bits_per_byte 2.5 > max.bits_per_byte 2"]


def finished(root, day: str, config: dict, train: dict, evaluate: dict) -> None:
    """The day's store as a canary run leaves it, for the checks: the final train step and its
    evaluate step published with these stats (the other steps play no part in the bounds)."""
    from flows.config import ExperimentConfig
    from flows.experiment import from_config
    from tasks.engine.store import Store

    store = Store(str(root / day))
    for step in from_config(ExperimentConfig.model_validate(config)).steps:
        if step.stage in ("train", "evaluate"):
            tmp = store.begin(step.stage, step.version)
            store.publish(tmp, step.stage, step.version, {"stage": step.stage, "version": step.version,
                                                          "stats": train if step.stage == "train" else evaluate})


def test_the_check_of_a_finished_store_names_the_metric_a_tightened_bound_catches(tmp_path):
    config, root = tmp_path / "canary.yaml", tmp_path / "canary"
    finished(root, "2026-01-01", CANARY, {"final_loss": 5.1, "steps": 12}, {"next_passage_acc": 0.4,
                                                                           "bits_per_byte": 3.0})
    config.write_text(yaml.safe_dump(CANARY, sort_keys=False))
    passed = kiln("canary", str(config), "--store-root", str(root), "--day", "2026-01-01", "--check-only")
    assert json.loads(passed.stdout)["small-canary"]["final_loss"] == 5.1

    tight = {**CANARY, "canary": {**CANARY["canary"], "max_final_loss": 5.0}}
    config.write_text(yaml.safe_dump(tight, sort_keys=False))
    failed = kiln("canary", str(config), "--store-root", str(root), "--day", "2026-01-01", "--check-only", check=False)
    assert failed.returncode == 1 and "small-canary: final_loss 5.1 > max_final_loss 5" in failed.stderr
    config.write_text(yaml.safe_dump(CANARY, sort_keys=False))  # the same bound from the command line
    tightened = kiln("canary", str(config), "--store-root", str(root), "--day", "2026-01-01", "--check-only",
                     "--set", "canary.max_final_loss=5.0", check=False)
    assert tightened.returncode == 1 and "small-canary: final_loss 5.1 > max_final_loss 5" in tightened.stderr
    missing = kiln("canary", str(config), "--store-root", str(root), "--day", "2026-01-03", "--check-only",
                   check=False)
    assert missing.returncode == 1 and "final_loss was not reported" in missing.stderr  # a day that never ran


@pytest.mark.slow  # the whole small pipeline (~2 min idle, ~5 loaded on 2 cores)
@pytest.mark.ray  # its training starts a local Ray: tests/conftest.py ray_lock
def test_the_canary_passes_then_fails_naming_a_tightened_metric(tmp_path):
    config, root = tmp_path / "canary.yaml", tmp_path / "canary"
    config.write_text(yaml.safe_dump(CANARY, sort_keys=False))
    passed = kiln("canary", str(config), "--store-root", str(root), "--day", "2026-01-02")
    found = json.loads(passed.stdout[passed.stdout.index("{"):])["small-canary"]
    assert found["steps"] == 12 and 0 < found["final_loss"] < 9 and "next_passage_acc" in found
    assert (root / "2026-01-02" / "train").is_dir()  # the day's own store

    tight = {**CANARY, "canary": {**CANARY["canary"], "max_final_loss": found["final_loss"] - 0.01,
                                  "min": {"next_passage_acc": found["next_passage_acc"] + 0.01}}}
    config.write_text(yaml.safe_dump(tight, sort_keys=False))
    failed = kiln("canary", str(config), "--store-root", str(root), "--day", "2026-01-02", "--check-only", check=False)
    assert failed.returncode == 1
    assert f"final_loss {found['final_loss']:.4g} > max_final_loss" in failed.stderr
    assert "next_passage_acc" in failed.stderr and "min.next_passage_acc" in failed.stderr
