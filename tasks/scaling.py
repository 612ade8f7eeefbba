"""The scaling-law steps: fit a sweep's held-out losses, and check the law's forecast.

Both are ordinary kiln steps. Their inputs are the sweep's evaluate steps, whose stats carry each
run's held-out bits per byte; what each run was (budget, N, D) comes from the recipe and sits in
the step's config, so a fit is a pure function of its config and its inputs' versions. Which runs
exist and in what order they train is the flow's business (flows/scaling.py).

    scaling_fit       law.json: the isoFLOP fit (approach 2) of the budgets whose runs bracket their
                      optimum, every parameter with its standard error, the budgets left out and
                      why; the parametric law L(N, D) = E + A/N^alpha + B/D^beta (approach 3) over
                      every run, with its bootstrap refits and its backtest (the same law without
                      the largest budget, scored on it); the state to predict from.
                      isoflops.png, optimal.png, frontier.png
    scaling_forecast  forecast.json: at the held-out budget, the parametric law's loss for the run
                      trained there with its interval, that run's loss, whether it lies inside, the
                      relative error; the same corrected by the held-out law's backtest; both for
                      every size the sweep trained at that budget; the isoFLOP law's forecast
                      beside it. forecast.png

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
from tasks.engine.config import ConfigModel
from training.scaling import (
    FitError,
    RunResult,
    ScalingLaw,
    budget_label,
    fit_scaling_law,
    law_from_json,
    plot_frontier,
    plot_isoflops,
    plot_optimal,
)

# 2: budgets that do not bracket are left out, not fatal; the parametric law and its bootstrap;
#    the forecast compares the trained run, and every run the sweep has at that budget, with the
#    parametric law's interval
# 3: the parametric law's backtest, and the forecast corrected by it
STAGE_VERSION = 3
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
    bootstrap: int = Field(200, ge=20, description="Refits of the parametric law for its intervals.")
    interval: float = Field(0.9, gt=0.5, lt=1, description="Probability the intervals hold.")
    bootstrap_seed: int = Field(0, ge=0, description="Seed of the resampling: the same runs give the same intervals.")

    @model_validator(mode="after")
    def _check(self) -> ScalingFitConfig:
        names = [r.input for r in self.runs]
        if len(set(names)) != len(names):
            raise ValueError(f"run input names repeat: {names}")
        return self


class ForecastConfig(ConfigModel):
    """The run trained at the held-out budget: the ladder size nearest the predicted N_opt; and the
    sweep's own runs at that budget (`heldout`), each checked against the law's interval too."""

    budget: float
    size: int
    params: int
    tokens: int
    flops: float
    goal: float = 0.03  # the relative error the issue asks for; reported as met or not
    heldout: list[FitRun] = Field(default_factory=list)


def run_loss(ctx: StepContext, name: str) -> float:
    stats = ctx.input_stats[name]
    if stats.get(LOSS_STAT) is None:
        raise ValueError(f"input {name!r} ({ctx.step.inputs[name].stage} {ctx.step.inputs[name].version}) reported "
                         f"no {LOSS_STAT}: evaluate the sweep's runs with bits_per_byte: true")
    return float(stats[LOSS_STAT])


def run_fit(ctx: StepContext) -> dict:
    cfg: ScalingFitConfig = ctx.config
    results = [RunResult(r.budget, r.params, r.tokens, run_loss(ctx, r.input), r.input, r.flops) for r in cfg.runs]
    law = fit_scaling_law(results, cfg.min_points, cfg.bootstrap, cfg.interval, cfg.bootstrap_seed)
    data = law.to_json()
    if cfg.forecast_budget is not None:
        data["forecast"] = law.predict(cfg.forecast_budget)
    (ctx.out / LAW_FILE).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    plot_isoflops(law, ctx.out / "isoflops.png")
    plot_optimal(law, ctx.out / "optimal.png", extra=[cfg.forecast_budget] if cfg.forecast_budget else [])
    plot_frontier(law, ctx.out / "frontier.png")

    f, p = law.frontier, law.parametric
    stats = {
        "budgets": len(law.budgets), "runs": len(results),
        "budgets_used": budgets_used(law), "budgets_left_out": budgets_left_out(law),
        "n_opt_exponent": law.n_opt.exponent, "n_opt_exponent_err": law.n_opt.exponent_err,
        "d_opt_exponent": law.d_opt.exponent, "d_opt_exponent_err": law.d_opt.exponent_err,
        "frontier_a": f.a, "frontier_b": f.b, "frontier_b_err": f.b_err, "frontier_e": f.e, "frontier_e_err": f.e_err,
        "parametric_E": math.exp(p.ln_e), "parametric_A": math.exp(p.ln_a), "parametric_B": math.exp(p.ln_b),
        "parametric_alpha": p.alpha, "parametric_beta": p.beta, "parametric_residual_rms": p.residual_rms,
    }
    for b in law.budgets:
        ctx.log.info("C=%s: N_opt %.3g (x/÷ %.2f), D_opt %.3g, L_opt %.4f ± %.4f from %d runs",
                     budget_label(b.budget), b.n_opt, math.exp(b.ln_n_opt_err), b.d_opt, b.loss_opt,
                     b.loss_opt_err, b.points)
    for d in law.dropped:
        ctx.log.warning("C=%s left out of the isoFLOP fit (its %d runs count in the parametric one): %s",
                        budget_label(d.budget), d.points, d.reason)
    ctx.log.info("parametric: L(N, D) = %.4g + %.4g / N^%.3f + %.4g / D^%.3f (rms of ln L %.4f over %d runs)",
                 math.exp(p.ln_e), math.exp(p.ln_a), p.alpha, math.exp(p.ln_b), p.beta, p.residual_rms, len(results))
    if law.backtest is not None:
        bt = law.backtest
        stats.update({"backtest_budget": bt.budget, "backtest_bias": bt.bias})
        ctx.log.info("backtest: the parametric law fitted without C=%s, on its %d runs: relative error %+.2f%% on "
                     "average (%+.2f%% to %+.2f%%)", budget_label(bt.budget), len(bt.ln_errors),
                     100 * math.expm1(bt.bias), 100 * math.expm1(min(bt.ln_errors)), 100 * math.expm1(max(bt.ln_errors)))
    if "forecast" in data:
        fc = data["forecast"]
        stats.update({f"forecast_isoflop_{k}": v for k, v in fc["isoflop"].items()})
        stats.update({f"forecast_{k}": v for k, v in fc["parametric"].items() if not k.endswith("interval")})
        stats.update({f"forecast_{k}_{end}": v for k, pair in fc["parametric"].items() if k.endswith("interval")
                      for end, v in zip(("lo", "hi"), pair)})
    show(ctx, fit_markdown(data), ["isoflops.png", "optimal.png", "frontier.png"])
    return stats


def budgets_used(law: ScalingLaw) -> str:
    return ", ".join(budget_label(b.budget) for b in law.budgets)


def budgets_left_out(law: ScalingLaw) -> str:
    """'none', or each budget left out of the isoFLOP fit with its reason."""
    return "; ".join(f"{budget_label(d.budget)}: {d.reason}" for d in law.dropped) or "none"


def run_forecast(ctx: StepContext) -> dict:
    """Compare the held-out law's prediction with the run trained at its predicted optimum: the
    parametric law's value at that run's (N, D), with the interval one run's loss should fall in."""
    cfg: ForecastConfig = ctx.config
    held_out = json.loads((ctx.inputs["law"] / LAW_FILE).read_text())
    pred = held_out.get("forecast")
    if pred is None or pred["budget"] != cfg.budget:
        raise ValueError(f"{ctx.inputs['law'] / LAW_FILE} holds no forecast for budget {cfg.budget:.3g}: the law input "
                         "must be the sweep's fit without its largest budget")
    law = law_from_json(held_out)
    if law.bootstrap is None:
        raise FitError(f"{ctx.inputs['law'] / LAW_FILE} has no bootstrap refits, so no interval to check against: "
                       "fit it with bootstrap > 0")
    actual = run_loss(ctx, "run")
    at_run = law.bootstrap.at(law.parametric, cfg.params, cfg.tokens, law.backtest)
    lo, hi = at_run["run_interval"]
    error = actual / at_run["loss"] - 1
    iso = pred["isoflop"]
    # Every size the sweep trained at this budget, against the same law: one run inside its
    # interval can be luck, the share of them inside says whether the interval is honest.
    sizes = []
    for r in cfg.heldout:
        at = law.bootstrap.at(law.parametric, r.params, r.tokens, law.backtest)
        loss = run_loss(ctx, r.input)
        sizes.append({"input": r.input, "size": r.size, "params": r.params, "tokens": r.tokens, "loss": loss,
                      "predicted": at["loss"], "run_interval": at["run_interval"],
                      "inside": at["run_interval"][0] <= loss <= at["run_interval"][1]})
        if law.backtest is not None:
            bt_lo, bt_hi = at["backtest_run_interval"]
            sizes[-1].update({"backtest_predicted": at["backtest_loss"], "backtest_run_interval": (bt_lo, bt_hi),
                              "inside_backtest": bt_lo <= loss <= bt_hi})
    full = law_from_json(json.loads((ctx.inputs["full"] / LAW_FILE).read_text()))
    at_budget = next((b for b in full.budgets if b.budget == cfg.budget), None)
    result = {
        "budget": cfg.budget, "goal": cfg.goal, "level": at_run["level"],
        "budgets_used": budgets_used(law), "budgets_left_out": budgets_left_out(law),
        "predicted": {"optimum": pred["parametric"], "at_trained_run": at_run, "isoflop": iso},
        "trained": {"size": cfg.size, "params": cfg.params, "tokens": cfg.tokens, "flops": cfg.flops, "loss": actual},
        "relative_error": error, "within_goal": abs(error) <= cfg.goal, "inside_interval": lo <= actual <= hi,
        "isoflop_relative_error": actual / iso["loss"] - 1,
        "heldout_runs": sizes,
        # The full sweep's own isoFLOP minimum at this budget, for comparison (None if left out there).
        "full_sweep_minimum": dataclasses.asdict(at_budget) if at_budget else None,
        "backtest": held_out.get("backtest"),
    }
    backtested = law.backtest is not None
    if backtested:
        bt_lo, bt_hi = at_run["backtest_run_interval"]
        result.update({"backtest_relative_error": actual / at_run["backtest_loss"] - 1,
                       "inside_backtest_interval": bt_lo <= actual <= bt_hi})
    (ctx.out / FORECAST_FILE).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    shown = dataclasses.replace(law, runs=full.runs)  # show every run, the held-out ones too
    plot_frontier(shown, ctx.out / "forecast.png",
                  forecast={"budget": cfg.budget, "loss": at_run["loss"], "interval": (lo, hi), "actual": actual,
                            "relative_error": error,
                            "backtest": {"loss": at_run["backtest_loss"], "interval": at_run["backtest_run_interval"]}
                            if backtested else None})
    ctx.log.info("forecast at C=%s: predicted %.4f bits/byte for N=%d, %.0f%% interval [%.4f, %.4f]; trained %.4f "
                 "(%s the interval): error %+.2f%% (goal %.0f%%)", budget_label(cfg.budget), at_run["loss"], cfg.params,
                 100 * at_run["level"], lo, hi, actual, "inside" if result["inside_interval"] else "OUTSIDE",
                 100 * error, 100 * cfg.goal)
    stats = {"budget": cfg.budget, "predicted_loss": at_run["loss"], "interval_lo": lo, "interval_hi": hi,
             "level": at_run["level"], "predicted_n_opt": pred["parametric"]["n_opt"], "trained_params": cfg.params,
             "trained_loss": actual, "relative_error": error, "within_goal": result["within_goal"],
             "inside_interval": result["inside_interval"], "isoflop_predicted_loss": iso["loss"],
             "isoflop_predicted_loss_err": iso["loss_err"], "isoflop_relative_error": result["isoflop_relative_error"],
             "budgets_used": result["budgets_used"], "budgets_left_out": result["budgets_left_out"],
             "heldout_runs": len(sizes), "heldout_inside": sum(r["inside"] for r in sizes)}
    if at_budget:
        stats.update({"full_sweep_loss_opt": at_budget.loss_opt, "full_sweep_n_opt": at_budget.n_opt})
    if backtested:
        bt = law.backtest
        stats.update({"backtest_budget": bt.budget, "backtest_bias": bt.bias,
                      "backtest_predicted_loss": at_run["backtest_loss"], "backtest_interval_lo": bt_lo,
                      "backtest_interval_hi": bt_hi, "backtest_relative_error": result["backtest_relative_error"],
                      "inside_backtest_interval": result["inside_backtest_interval"],
                      "heldout_inside_backtest": sum(r["inside_backtest"] for r in sizes)})
        ctx.log.info("backtest (the law fitted without C=%s: relative error %+.2f%% there on average): predicted %.4f, "
                     "%.0f%% interval [%.4f, %.4f]; trained %.4f (%s): error %+.2f%%", budget_label(bt.budget),
                     100 * math.expm1(bt.bias), at_run["backtest_loss"], 100 * at_run["level"], bt_lo, bt_hi, actual,
                     "inside" if result["inside_backtest_interval"] else "OUTSIDE",
                     100 * result["backtest_relative_error"])
    md = (f"# Forecast at C = {budget_label(cfg.budget)}\n\n"
          f"Fitted without this budget, on budgets {result['budgets_used']} (isoFLOP fit); left out of it: "
          f"{result['budgets_left_out']}.\n\n"
          f"- parametric law at the trained run (N = {cfg.params:,}, size {cfg.size}, D = {cfg.tokens:,}): "
          f"**{at_run['loss']:.4f}** bits/byte, {at_run['level']:.0%} interval for one run "
          f"[{lo:.4f}, {hi:.4f}] (for the law's own value [{at_run['loss_interval'][0]:.4f}, "
          f"{at_run['loss_interval'][1]:.4f}])\n"
          f"- trained: **{actual:.4f}**, {'inside' if result['inside_interval'] else 'OUTSIDE'} the interval; "
          f"relative error {error:+.2%} (goal {cfg.goal:.0%})\n"
          f"- isoFLOP law's L_opt: {iso['loss']:.4f} ± {iso['loss_err']:.4f} ({result['isoflop_relative_error']:+.2%})\n")
    if backtested:
        md += (f"- corrected by the backtest (the law fitted without C = {budget_label(bt.budget)}: relative error "
               f"{math.expm1(bt.bias):+.2%} there on average): **{at_run['backtest_loss']:.4f}**, one run "
               f"[{bt_lo:.4f}, {bt_hi:.4f}]; trained {'inside' if result['inside_backtest_interval'] else 'OUTSIDE'}, "
               f"error {result['backtest_relative_error']:+.2%}\n")
    if sizes:
        md += (f"\nEvery size the sweep trained at C = {budget_label(cfg.budget)}: "
               f"{stats['heldout_inside']} of {len(sizes)} inside the interval for one run"
               + (f", {stats['heldout_inside_backtest']} inside the backtest's" if backtested else "") + "\n\n"
               "| size | N | D | trained | predicted | interval | inside | backtest | its interval | inside |\n"
               "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
        md += "".join(f"| {r['size']} | {r['params']:,} | {r['tokens']:,} | {r['loss']:.4f} | {r['predicted']:.4f} | "
                      f"[{r['run_interval'][0]:.4f}, {r['run_interval'][1]:.4f}] | {'yes' if r['inside'] else 'no'} | "
                      + (f"{r['backtest_predicted']:.4f} | [{r['backtest_run_interval'][0]:.4f}, "
                         f"{r['backtest_run_interval'][1]:.4f}] | {'yes' if r['inside_backtest'] else 'no'} |\n"
                         if backtested else "- | - | - |\n")
                      for r in sizes)
    show(ctx, md, ["forecast.png"])
    return stats


def fit_markdown(data: dict) -> str:
    """The fit step's report: both laws, the budgets used and those left out with why, the forecast."""
    n, d, f = data["n_opt"], data["d_opt"], data["frontier"]
    lines = ["# Scaling law", "", "## IsoFLOP fit (approach 2)", "",
             f"- N_opt = {n['coefficient']:.4g} · C^({n['exponent']:.4f} ± {n['exponent_err']:.4f})",
             f"- D_opt = {d['coefficient']:.4g} · C^({d['exponent']:.4f} ± {d['exponent_err']:.4f})",
             f"- L(C) = {f['a']:.4g} · C^-({f['b']:.4f} ± {f['b_err']:.4f}) + ({f['e']:.4f} ± {f['e_err']:.4f})",
             "", "| budget | runs | N_opt | D_opt | L_opt (bits/byte) |", "| --- | --- | --- | --- | --- |"]
    for b in data["budgets"]:
        lines.append(f"| {budget_label(b['budget'])} | {b['points']} | {b['n_opt']:,.0f} | {b['d_opt']:,.0f} | "
                     f"{b['loss_opt']:.4f} ± {b['loss_opt_err']:.4f} |")
    for b in data["dropped"]:
        lines.append(f"| {budget_label(b['budget'])} | {b['points']} | left out | | {b['reason']} |")
    p = data.get("parametric")
    if p:
        boot = data.get("bootstrap", {})
        lines += ["", "## Parametric fit over every run (approach 3)", "",
                  f"- L(N, D) = {p['E']:.4g} + {p['A']:.4g} / N^{p['alpha']:.4f} + {p['B']:.4g} / D^{p['beta']:.4f} "
                  f"(rms of ln L {p['residual_rms_ln_loss']:.4f}; N_opt ~ C^{p['n_opt_exponent_6nd']:.3f} where "
                  "attention is negligible)",
                  f"- intervals: {boot.get('replicates', 0)} bootstrap refits over {boot.get('resample', '-')}, "
                  f"seed {boot.get('seed', '-')}"]
        bt = data.get("backtest")
        if bt:
            lines.append(f"- backtest: fitted without C = {budget_label(bt['budget'])}, on that budget's "
                         f"{len(bt['ln_errors'])} runs: relative error {math.expm1(bt['bias']):+.2%} on average")
    if "forecast" in data:
        c, iso = data["forecast"]["budget"], data["forecast"]["isoflop"]
        lines += ["", f"## Forecast at C = {budget_label(c)}", "",
                  f"- isoFLOP law: N_opt {iso['n_opt']:,.0f}, D_opt {iso['d_opt']:,.0f}, "
                  f"L {iso['loss']:.4f} ± {iso['loss_err']:.4f}"]
        par = data["forecast"].get("parametric")
        if par and "loss_interval" in par:
            q = f"{par['level']:.0%}"
            lines.append(f"- parametric law: N_opt {par['n_opt']:,.0f} ({q}: {par['n_opt_interval'][0]:,.0f} to "
                         f"{par['n_opt_interval'][1]:,.0f}), D_opt {par['d_opt']:,.0f}, L_opt {par['loss']:.4f} "
                         f"({q}: {par['loss_interval'][0]:.4f} to {par['loss_interval'][1]:.4f}; one run: "
                         f"{par['run_interval'][0]:.4f} to {par['run_interval'][1]:.4f})")
            if "backtest_loss" in par:
                lines.append(f"- corrected by the backtest: L_opt {par['backtest_loss']:.4f} (one run: "
                             f"{par['backtest_run_interval'][0]:.4f} to {par['backtest_run_interval'][1]:.4f})")
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
                  heldout: Mapping[str, Step] | None = None, name: str = "scaling_forecast") -> Step:
    """Check `law` (fitted without config.budget) against `run` (an evaluate step of the run trained at
    the predicted optimum) and the `heldout` runs (input name -> evaluate step, one per
    `config.heldout` entry); `full` is the fit with every budget, shown beside it."""
    heldout = dict(heldout or {})
    missing = sorted({r.input for r in config.heldout} ^ set(heldout))
    if missing:
        raise ValueError(f"forecast config and inputs disagree on held-out runs {missing}")
    return Step(name=name, stage="scaling_forecast", stage_version=STAGE_VERSION, config=config, run=run_forecast,
                inputs={"law": law, "full": full, "run": run, **heldout})
