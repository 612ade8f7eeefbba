"""The scaling-law sweep as steps.

Every (budget, size) of the recipe (training/scaling.py) is an ordinary train step and an
ordinary evaluate step (bits per byte on the tokenize step's held-out split), so a rerun is all
cache hits, and a sweep with one more budget trains only that budget's runs: a run's config, hence
its version, depends on its own (budget, size) alone.

    scaling_steps    the runs, `scaling_fit` over all budgets and, for the forecast check, over all
                     but the largest (`scaling_fit/holdout`)
    forecast_steps   once the held-out fit exists: the run at the largest budget whose size is
                     nearest the parametric law's predicted N_opt (a cache hit when the sweep already
                     trained that size there), and `scaling_forecast`, which says whether its loss
                     lies inside the law's interval, and the relative error;
                     `ready_forecast_steps` returns them only when that fit is in the store

The scheduler (tasks/engine/scheduler.py) runs them like any other steps: each run as soon as the
tokens exist, `run.max_concurrent` at a time on one shared Ray, each fit once its runs are
evaluated, and the forecast steps once the held-out fit is in the store (flows/plan.py
`with_followups`). On 2 cores one run's XLA step already uses both, so two runs side by side mostly
trade places; with more cores or hosts, raise `run.max_concurrent` with `scaling.cpus_per_run`
(settings: neither changes a version).

`kiln run CONFIG` runs it when the config has a `scaling:` section (a `training.scaling.ScalingConfig`)
beside the usual data and tokenizer sections; `kiln plan CONFIG` lists every run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from tasks.evaluate import EvalConfig, evaluate_step
from tasks.engine.runner import StepRun
from tasks.scaling import LAW_FILE, FitRun, ForecastConfig, ScalingFitConfig, forecast_step, scaling_fit_step
from tasks.engine.step import Step
from tasks.engine.store import Store
from tasks.tokenizer import TokenizerConfig
from tasks.train import train_step
from training.config import ResourcesConfig
from training.scaling import RunPlan, ScalingConfig, ScalingLaw, budget_label, isoflop_grid, nearest_size


def planned_vocab_size(tokenizer: TokenizerConfig) -> int:
    """The vocabulary the runs are planned with, known before the tokenizer exists (N and the
    FLOPs per token depend on it, and they fix each run's version): the pipeline's own rule."""
    from flows.plan import vocab_size  # here: flows.plan may import this module to build a sweep

    return vocab_size(tokenizer)


def sweep_plans(config) -> dict[float, list[RunPlan]]:
    """budget -> its runs, smallest budget first."""
    vocab = planned_vocab_size(config.tokenizer)
    return {c: isoflop_grid(c, config.scaling, vocab) for c in sorted(config.scaling.budgets)}


def sweep_eval_config(config) -> EvalConfig:
    """Bits per byte on the held-out split only: the loss every run is compared on."""
    return EvalConfig(tasks=[], bits_per_byte=True, heldout_tokens=config.scaling.heldout_tokens,
                      validation_fraction=config.tokenize.validation_fraction)


def run_steps(plan: RunPlan, config, *, tokens: Step, tokenizer: Step, documents: Step,
              prefix: str = "") -> tuple[Step, Step]:
    """The train step and the evaluate step of one run (named `train/1e11/k4`, `evaluate/1e11/k4`)."""
    resources = ResourcesConfig(cpus_per_host=config.scaling.cpus_per_run)
    train = dataclasses.replace(train_step(plan.model, plan.train, resources, tokens=tokens,
                                           tracking=config.tracking),
                                name=f"train/{prefix}{plan.name}")
    evaluate = dataclasses.replace(
        evaluate_step(sweep_eval_config(config), model=train, tokenizer=tokenizer, tokens=tokens, documents=documents),
        name=f"evaluate/{prefix}{plan.name}")
    return train, evaluate


def fit_config(plans: list[RunPlan], scaling: ScalingConfig, forecast_budget: float | None = None) -> ScalingFitConfig:
    return ScalingFitConfig(runs=[FitRun(input=p.name, budget=p.budget, size=p.size, params=p.params, tokens=p.tokens,
                                         flops=p.flops) for p in plans],
                            min_points=scaling.min_points, forecast_budget=forecast_budget,
                            bootstrap=scaling.bootstrap, interval=scaling.interval)


def scaling_steps(config, *, tokens: Step, tokenizer: Step, documents: Step) -> list[Step]:
    """The sweep's runs and fits, upstream first (the forecast's steps come from `forecast_steps`)."""
    plans = sweep_plans(config)
    evals: dict[str, Step] = {}
    steps: list[Step] = []
    for budget_plans in plans.values():
        for plan in budget_plans:
            train, evaluate = run_steps(plan, config, tokens=tokens, tokenizer=tokenizer, documents=documents)
            steps += [train, evaluate]
            evals[plan.name] = evaluate
    everything = [p for ps in plans.values() for p in ps]
    steps.append(scaling_fit_step(fit_config(everything, config.scaling), runs=evals))
    if config.scaling.forecast:
        largest = max(plans)
        held = [p for p in everything if p.budget != largest]
        steps.append(scaling_fit_step(fit_config(held, config.scaling, forecast_budget=largest),
                                      runs={p.name: evals[p.name] for p in held}, name="scaling_fit/holdout"))
    return steps


def forecast_steps(config, holdout_law: dict, *, sweep: list[Step], tokens: Step, tokenizer: Step,
                   documents: Step) -> list[Step]:
    """The run at the held-out budget nearest the parametric law's N_opt (with the sweep's first
    seed), its evaluation, and the check.

    `holdout_law` is the held-out fit's law.json; `sweep` is `scaling_steps`' output.
    """
    prediction = holdout_law["forecast"]
    plan = nearest_size(prediction["parametric"]["n_opt"], prediction["budget"], config.scaling,
                        planned_vocab_size(config.tokenizer))
    train, evaluate = run_steps(plan, config, tokens=tokens, tokenizer=tokenizer, documents=documents,
                                prefix="forecast/")
    fits = {s.name: s for s in sweep if s.stage == "scaling_fit"}
    evals = {s.name: s for s in sweep if s.stage == "evaluate"}
    heldout = [FitRun(input=f"heldout/{p.name}", budget=p.budget, size=p.size, params=p.params, tokens=p.tokens,
                      flops=p.flops) for p in sweep_plans(config)[plan.budget]]
    check = forecast_step(ForecastConfig(budget=plan.budget, size=plan.size, params=plan.params, tokens=plan.tokens,
                                         flops=plan.flops, goal=config.scaling.forecast_goal, heldout=heldout),
                          law=fits["scaling_fit/holdout"], full=fits["scaling_fit"], run=evaluate,
                          heldout={r.input: evals[f"evaluate/{r.input.removeprefix('heldout/')}"] for r in heldout})
    return [train, evaluate, check]


def ready_forecast_steps(config, store: Store, sweep: list[Step]) -> list[Step]:
    """`forecast_steps` if the held-out fit is already in the store, else [] (for `kiln plan`).
    The runs' inputs (tokens, tokenizer, documents) are those of the sweep's train steps."""
    holdout = next((s for s in sweep if s.name == "scaling_fit/holdout"), None)
    if holdout is None or not store.is_done(holdout.stage, holdout.version):
        return []
    law = json.loads(Path(store.local_input(holdout.stage, holdout.version), LAW_FILE).read_text())
    tokens = next(s.inputs["tokens"] for s in sweep if s.stage == "train")
    return forecast_steps(config, law, sweep=sweep, tokens=tokens, tokenizer=tokens.inputs["tokenizer"],
                          documents=tokens.inputs["documents"])


def forecast_line(runs: list[StepRun]) -> str | None:
    """The summary's last lines: the held-out budget's forecast with its interval, the trained loss,
    whether it lies inside, the same corrected by the law's backtest, and which budgets each fit used
    (and why others were left out)."""
    forecast = [r for r in runs if r.stage == "scaling_forecast"]
    if not forecast:
        return None
    s = forecast[0].stats
    c = budget_label(s["budget"])
    inside = "inside" if s["inside_interval"] else "OUTSIDE"
    lines = [f"forecast at C={c}: predicted {s['predicted_loss']:.4f} bits/byte for N={s['trained_params']:,}, "
             f"{s['level']:.0%} interval [{s['interval_lo']:.4f}, {s['interval_hi']:.4f}]; trained "
             f"{s['trained_loss']:.4f}: {inside} the interval, relative error {s['relative_error']:+.2%} (goal met: "
             f"{s['within_goal']}); isoFLOP law {s['isoflop_predicted_loss']:.4f} ({s['isoflop_relative_error']:+.2%})",
             f"the sweep's {s['heldout_runs']} runs at C={c}: {s['heldout_inside']} inside their intervals"]
    if "backtest_predicted_loss" in s:
        inside = "inside" if s["inside_backtest_interval"] else "OUTSIDE"
        lines += [f"corrected by the backtest (the law fitted without C={budget_label(s['backtest_budget'])}: relative "
                  f"error {math.expm1(s['backtest_bias']):+.2%} there on average): predicted "
                  f"{s['backtest_predicted_loss']:.4f}, "
                  f"interval [{s['backtest_interval_lo']:.4f}, {s['backtest_interval_hi']:.4f}]; trained {inside}, "
                  f"relative error {s['backtest_relative_error']:+.2%}; the sweep's runs at C={c}: "
                  f"{s['heldout_inside_backtest']} of {s['heldout_runs']} inside theirs"]
    lines += [f"fitted without C={c}: parametric law on every run below it; isoFLOP law on budgets "
              f"{s['budgets_used']}; left out of it: {s['budgets_left_out']}"]
    full = next((r for r in runs if r.stage == "scaling_fit" and r.name == "scaling_fit" and r.stats), None)
    if full is not None and "budgets_used" in full.stats:
        lines.append(f"full sweep's isoFLOP law on budgets {full.stats['budgets_used']}; left out of it: "
                     f"{full.stats['budgets_left_out']}")
    return "\n".join(lines)


def forecast_rows(law: ScalingLaw, budgets: list[float]) -> list[dict]:
    """`kiln forecast`: at each budget, N_opt, D_opt and the loss from both fits (the parametric
    law's with its intervals and its backtest's correction), and how far the budget lies beyond the
    largest one fitted, in steps of the sweep's budget ladder (the backtest measured one such step;
    None without a backtest)."""
    largest = max(r.budget for r in law.runs)
    bt = law.backtest
    ladder = bt.budget / max(bt.fitted) if bt is not None else None
    rows = []
    for c in budgets:
        predicted = law.predict(c)
        iso, par = predicted["isoflop"], predicted.get("parametric", {})
        rows.append({"budget": c, "steps_beyond": math.log(c / largest) / math.log(ladder) if ladder else None,
                     **{k: par.get(k) for k in ("n_opt", "n_opt_interval", "d_opt", "d_opt_interval", "loss",
                                                "loss_interval", "run_interval", "backtest_loss",
                                                "backtest_run_interval")},
                     "isoflop_n_opt": iso["n_opt"], "isoflop_d_opt": iso["d_opt"], "isoflop_loss": iso["loss"],
                     "isoflop_loss_err": iso["loss_err"]})
    return rows
