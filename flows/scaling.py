"""The scaling-law sweep as steps.

Every (budget, size) of the recipe (training/scaling.py) is an ordinary train step and an
ordinary evaluate step (bits per byte on the tokenize step's held-out split), so a rerun is all
cache hits, and a sweep with one more budget trains only that budget's runs: a run's config, hence
its version, depends on its own (budget, size) alone.

    scaling_steps    the runs, `scaling_fit` over all budgets and, for the forecast check, over all
                     but the largest (`scaling_fit/holdout`)
    forecast_steps   once the held-out fit exists: the run at the largest budget whose size is
                     nearest its predicted N_opt (a cache hit when the sweep already trained that
                     size there), and `scaling_forecast`, which reports the relative error;
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
from pathlib import Path

from tasks.evaluate import EvalConfig, evaluate_step
from tasks.engine.runner import StepRun
from tasks.scaling import LAW_FILE, FitRun, ForecastConfig, ScalingFitConfig, forecast_step, scaling_fit_step
from tasks.engine.step import Step
from tasks.engine.store import Store
from tasks.tokenizer import TokenizerConfig
from tasks.train import train_step
from training.config import ResourcesConfig
from training.scaling import RunPlan, ScalingConfig, budget_label, isoflop_grid, nearest_size


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
                            min_points=scaling.min_points, forecast_budget=forecast_budget)


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
    """The run at the held-out budget nearest the predicted N_opt, its evaluation, and the check.

    `holdout_law` is the held-out fit's law.json; `sweep` is `scaling_steps`' output.
    """
    prediction = holdout_law["forecast"]
    plan = nearest_size(prediction["n_opt"], prediction["budget"], config.scaling, planned_vocab_size(config.tokenizer))
    train, evaluate = run_steps(plan, config, tokens=tokens, tokenizer=tokenizer, documents=documents,
                                prefix="forecast/")
    fits = {s.name: s for s in sweep if s.stage == "scaling_fit"}
    check = forecast_step(ForecastConfig(budget=plan.budget, size=plan.size, params=plan.params, tokens=plan.tokens,
                                         flops=plan.flops, goal=config.scaling.forecast_goal),
                          law=fits["scaling_fit/holdout"], full=fits["scaling_fit"], run=evaluate)
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
    """One line for the summary: the held-out budget's predicted against trained loss."""
    forecast = [r for r in runs if r.stage == "scaling_forecast"]
    if not forecast:
        return None
    s = forecast[0].stats
    return (f"forecast at C={budget_label(s['budget'])}: predicted {s['predicted_loss']:.4f} bits/byte, trained "
            f"{s['trained_loss']:.4f}: relative error {s['relative_error']:+.2%} (goal met: {s['within_goal']})")
