"""The scaling-law steps: fit a sweep's held-out losses, and check the law's forecast.

Both are ordinary kiln steps. Their inputs are the sweep's evaluate steps, whose stats carry each
run's held-out bits per byte; what each run was (budget, N, D) comes from the recipe and sits in
the step's config, so a fit is a pure function of its config and its inputs' versions. Which runs
exist and in what order they train is the flow's business (flows/scaling.py).

    scaling_fit       law.json (every fitted parameter with its standard error, and the state to
                      predict from), isoflops.png, optimal.png, frontier.png
    scaling_forecast  forecast.json (predicted and trained loss at the held-out budget, relative
                      error), forecast.png

Inside a Prefect run both also publish a markdown summary and the plots as image artifacts
(embedded as data URLs, so they show whatever the store is); outside one (tests, notebooks) they
only write files.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path

from pydantic import Field, model_validator

from tasks.engine.step import Step, StepContext
from training.config import ConfigModel
from training.scaling import (
    RunResult,
    budget_label,
    fit_scaling_law,
    law_from_json,
    plot_frontier,
    plot_isoflops,
    plot_optimal,
)

STAGE_VERSION = 1
LAW_FILE = "law.json"
FORECAST_FILE = "forecast.json"
LOSS_STAT = "bits_per_byte"  # what the evaluate step reports for the held-out split


class FitRun(ConfigModel):
    """One run of the sweep as the fit sees it; `input` names its evaluate step among the inputs."""

    input: str
    budget: float
    size: int
    params: int
    tokens: int
    flops: float


class ScalingFitConfig(ConfigModel):
    runs: list[FitRun] = Field(min_length=1)
    min_points: int = Field(4, ge=3)
    # Where to extrapolate (the held-out budget): law.json then carries N_opt, D_opt and L there.
    forecast_budget: float | None = None

    @model_validator(mode="after")
    def _check(self) -> ScalingFitConfig:
        names = [r.input for r in self.runs]
        if len(set(names)) != len(names):
            raise ValueError(f"run input names repeat: {names}")
        return self


class ForecastConfig(ConfigModel):
    """The run trained at the held-out budget: the ladder size nearest the predicted N_opt."""

    budget: float
    size: int
    params: int
    tokens: int
    flops: float
    goal: float = 0.03  # the relative error the issue asks for; reported as met or not


def run_loss(ctx: StepContext, name: str) -> float:
    stats = ctx.input_stats[name]
    if stats.get(LOSS_STAT) is None:
        raise ValueError(f"input {name!r} ({ctx.step.inputs[name].stage} {ctx.step.inputs[name].version}) reported "
                         f"no {LOSS_STAT}: evaluate the sweep's runs with bits_per_byte: true")
    return float(stats[LOSS_STAT])


def run_fit(ctx: StepContext) -> dict:
    cfg: ScalingFitConfig = ctx.config
    results = [RunResult(r.budget, r.params, r.tokens, run_loss(ctx, r.input), r.input) for r in cfg.runs]
    law = fit_scaling_law(results, cfg.min_points)
    data = law.to_json()
    if cfg.forecast_budget is not None:
        data["forecast"] = law.predict(cfg.forecast_budget)
    (ctx.out / LAW_FILE).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    plot_isoflops(law, ctx.out / "isoflops.png")
    plot_optimal(law, ctx.out / "optimal.png", extra=[cfg.forecast_budget] if cfg.forecast_budget else [])
    plot_frontier(law, ctx.out / "frontier.png")

    f = law.frontier
    stats = {
        "budgets": len(law.budgets), "runs": len(results),
        "n_opt_exponent": law.n_opt.exponent, "n_opt_exponent_err": law.n_opt.exponent_err,
        "d_opt_exponent": law.d_opt.exponent, "d_opt_exponent_err": law.d_opt.exponent_err,
        "frontier_a": f.a, "frontier_b": f.b, "frontier_b_err": f.b_err, "frontier_e": f.e, "frontier_e_err": f.e_err,
    }
    for b in law.budgets:
        ctx.log.info("C=%s: N_opt %.3g (x/÷ %.2f), D_opt %.3g, L_opt %.4f ± %.4f from %d runs",
                     budget_label(b.budget), b.n_opt, math.exp(b.ln_n_opt_err), b.d_opt, b.loss_opt,
                     b.loss_opt_err, b.points)
    if "forecast" in data:
        stats.update({f"forecast_{k}": v for k, v in data["forecast"].items()})
    show(ctx, _fit_markdown(data), ["isoflops.png", "optimal.png", "frontier.png"])
    return stats


def run_forecast(ctx: StepContext) -> dict:
    """Compare the held-out law's prediction with the run trained at its predicted optimum."""
    cfg: ForecastConfig = ctx.config
    held_out = json.loads((ctx.inputs["law"] / LAW_FILE).read_text())
    pred = held_out.get("forecast")
    if pred is None or pred["budget"] != cfg.budget:
        raise ValueError(f"{ctx.inputs['law'] / LAW_FILE} holds no forecast for budget {cfg.budget:.3g}: the law input "
                         "must be the sweep's fit without its largest budget")
    actual = run_loss(ctx, "run")
    error = actual / pred["loss"] - 1
    full = law_from_json(json.loads((ctx.inputs["full"] / LAW_FILE).read_text()))
    at_budget = next((b for b in full.budgets if b.budget == cfg.budget), None)
    result = {
        "budget": cfg.budget, "goal": cfg.goal,
        "predicted": pred, "trained": {"size": cfg.size, "params": cfg.params, "tokens": cfg.tokens,
                                       "flops": cfg.flops, "loss": actual},
        "relative_error": error, "within_goal": abs(error) <= cfg.goal,
        # The full sweep's own isoFLOP minimum at this budget, for comparison.
        "full_sweep_minimum": dataclasses.asdict(at_budget) if at_budget else None,
    }
    (ctx.out / FORECAST_FILE).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    law = dataclasses.replace(law_from_json(held_out), runs=full.runs)  # show every run, the held-out ones too
    plot_frontier(law, ctx.out / "forecast.png",
                  forecast={**pred, "actual": actual, "relative_error": error})
    ctx.log.info("forecast at C=%s: predicted %.4f ± %.4f bits/byte, trained %.4f: error %+.2f%% (goal %.0f%%)",
                 budget_label(cfg.budget), pred["loss"], pred["loss_err"], actual, 100 * error, 100 * cfg.goal)
    stats = {"budget": cfg.budget, "predicted_loss": pred["loss"], "predicted_loss_err": pred["loss_err"],
             "predicted_n_opt": pred["n_opt"], "trained_params": cfg.params, "trained_loss": actual,
             "relative_error": error, "within_goal": abs(error) <= cfg.goal}
    if at_budget:
        stats.update({"full_sweep_loss_opt": at_budget.loss_opt, "full_sweep_n_opt": at_budget.n_opt})
    md = (f"# Forecast at C = {budget_label(cfg.budget)}\n\npredicted {pred['loss']:.4f} ± {pred['loss_err']:.4f} "
          f"bits/byte at N_opt = {pred['n_opt']:,.0f}; trained N = {cfg.params:,} (size {cfg.size}): "
          f"{actual:.4f}\n\n**relative error {error:+.2%}** (goal {cfg.goal:.0%})\n")
    show(ctx, md, ["forecast.png"])
    return stats


def _fit_markdown(data: dict) -> str:
    n, d, f = data["n_opt"], data["d_opt"], data["frontier"]
    lines = ["# Scaling law", "",
             f"- N_opt = {n['coefficient']:.4g} · C^({n['exponent']:.4f} ± {n['exponent_err']:.4f})",
             f"- D_opt = {d['coefficient']:.4g} · C^({d['exponent']:.4f} ± {d['exponent_err']:.4f})",
             f"- L(C) = {f['a']:.4g} · C^-({f['b']:.4f} ± {f['b_err']:.4f}) + ({f['e']:.4f} ± {f['e_err']:.4f})",
             "", "| budget | runs | N_opt | D_opt | L_opt (bits/byte) |", "| --- | --- | --- | --- | --- |"]
    for b in data["budgets"]:
        lines.append(f"| {budget_label(b['budget'])} | {b['points']} | {b['n_opt']:,.0f} | {b['d_opt']:,.0f} | "
                     f"{b['loss_opt']:.4f} ± {b['loss_opt_err']:.4f} |")
    if "forecast" in data:
        p = data["forecast"]
        lines += ["", (f"Forecast at C = {budget_label(p['budget'])}: N_opt {p['n_opt']:,.0f}, "
                       f"D_opt {p['d_opt']:,.0f}, L {p['loss']:.4f} ± {p['loss_err']:.4f}")]
    return "\n".join(lines)


def show(ctx: StepContext, markdown: str, images: list[str]) -> None:
    """A markdown summary and the plots beside the step in the Prefect UI."""
    ctx.show("markdown", "summary", markdown)
    for name in images:
        ctx.show("image", Path(name).stem, (ctx.out / name).read_bytes())


# --- steps --------------------------------------------------------------------------------------


def scaling_fit_step(config: ScalingFitConfig, *, runs: Mapping[str, Step], name: str = "scaling_fit") -> Step:
    """Fit the law from `runs` (input name -> the run's evaluate step), one per `config.runs` entry."""
    missing = sorted({r.input for r in config.runs} ^ set(runs))
    if missing:
        raise ValueError(f"fit config and inputs disagree on runs {missing}")
    return Step(name=name, stage="scaling_fit", stage_version=STAGE_VERSION, config=config, run=run_fit,
                inputs={r.input: runs[r.input] for r in config.runs})


def forecast_step(config: ForecastConfig, *, law: Step, full: Step, run: Step,
                  name: str = "scaling_forecast") -> Step:
    """Check `law` (fitted without config.budget) against `run` (an evaluate step of the run trained at
    the predicted optimum); `full` is the fit with every budget, shown beside it."""
    return Step(name=name, stage="scaling_forecast", stage_version=STAGE_VERSION, config=config, run=run_forecast,
                inputs={"law": law, "full": full, "run": run})
