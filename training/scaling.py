"""Scaling laws on a FLOP budget: the recipe that plans a sweep, the fits that read it, the plots.

Recipe. A budget C (training FLOPs) and a size index k = 1, 2, ... give exactly one run:

    shape    d_model = width_step * k, n_layers = max(min_layers, floor(d_model / aspect + 1/2)),
             heads of head_dim (n_heads = d_model / head_dim, no GQA), d_ff = 8/3 d_model rounded up
             to a multiple of head_dim (Llama's ratio), weights drawn with std init_scale /
             sqrt(d_model), untied input and output embeddings. One
             ladder of shapes that every budget shares; at least two layers, since one layer cannot
             form induction heads and would put a kink in the curve that is about architecture, not
             scale. Untied, because with tied embeddings the direct path E E^T is symmetric and
             cannot learn bigrams: these tiny models then sat on the unigram plateau for a number
             of steps that varied from run to run, and the isoFLOP curves had outliers of +0.3
             bits per byte (measured on KJV; untied, the same runs fell in line).
    tokens   D = C / flops_per_token(shape), with `training.config.flops_per_token`: PaLM's
             6N + 12*L*H*Q*T, attention included, in whole steps of batch_size * seq_len tokens.
    batch    batch_size = batch_ref * (C / budget_ref) ** batch_exponent, rounded to a multiple of
             batch_multiple (DeepSeek LLM, 2024, fits the optimal batch as ~C^0.33). Not to a power
             of two: a batch that jumps 2x between neighbouring budgets moved their optima apart.
    lr       min(lr_max, lr_ref * width_ref / d_model): Adam's best rate falls as 1/width in the
             standard parameterisation (Yang et al., 2021); warmup_fraction of the steps, then cosine.

N is the parameter count of that FLOP formula: every matmul weight, the output projection
included, the input embedding (a lookup) and the norms not. A run whose whole steps miss C by
more than `tolerance` is refused (`BudgetError`), never trained off-budget.

Sizes start at k = 2 (k = 1 would be a single head of head_dim).
Each budget trains the `shapes_per_budget` consecutive sizes whose geometric-mean N is nearest
N_prior(C) = sqrt(C_ref / (6 r)) * (C / C_ref)^prior_exponent, r = tokens_per_param at C_ref =
budget_ref (Chinchilla's shape when the exponent is 1/2): the prior only says where to look, the fit
finds the optimum. A run depends on (C, k) and the rules alone, never on the other budgets, so its
version is the same in every sweep that contains it.

Fits (Hoffmann et al., 2022), all in natural logs. Approach 2, isoFLOP minima:

    per budget   L = c2 x^2 + c1 x + c0, x = ln N. Minimum x* = -c1 / (2 c2): N_opt(C), L_opt(C),
                 and D_opt(C) from ln D interpolated linearly in ln N among that budget's runs (so
                 attention FLOPs count as the runs counted them). Errors by the delta method. A
                 budget whose parabola opens downward, or whose minimum lies outside the sizes
                 trained, does not bracket its optimum: it is left out (`DroppedBudget`, with the
                 reason) and the rest are fitted; FitError only when fewer than 3 are left.
    across       N_opt = n0 * C^alpha and D_opt = d0 * C^beta: weighted least squares in log-log.
    frontier     L_opt(C) = a * C^(-b) + e: weighted nonlinear least squares (scipy).

Uncertainties are one standard error. Where the fit has degrees of freedom left, the covariance is
scaled up by the reduced chi-square when that exceeds 1 (the points scatter more than their own
errors say); with none left it is the errors of the inputs propagated.

Approach 3, a parametric law through every run, bracketing or not:

    L(N, D) = E + A / N^alpha + B / D^beta, fitted as ln L = LSE(a - alpha ln N, b - beta ln D, e)
    with a Huber loss (delta 1e-3) on the residuals of ln L and L-BFGS-B from the best starts of a
    grid, as Hoffmann et al. Its optimum at C minimises L(N, C / flops_per_token(N)) over N, with
    flops_per_token = 6N + attention(N) as the runs spent it, so it is consistent with the recipe.
    Intervals: percentiles of `bootstrap` refits on resampled runs (a fixed seed). Backtest: the
    law refitted without the largest budget and scored on it, whose errors correct a forecast one
    budget up and give its interval for one run (`Backtest`).

No Prefect, no Ray: numpy, scipy and matplotlib.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from tasks.engine.config import (Beta, ConfigModel, Count, Fraction, HalfOpenFraction, NonNegativeFloat, Positive, Seed,
                                 identity_when_set, setting)
from training.config import ModelConfig, TrainConfig, flops_per_token, matmul_params


class BudgetError(ValueError):
    """A (budget, shape) whose run cannot spend the budget within the tolerance."""


class FitError(ValueError):
    """Runs that cannot support the fit asked for (too few, or no minimum among them)."""


# --- recipe -------------------------------------------------------------------------------------


class ScalingConfig(ConfigModel):
    """The sweep: budgets, and the rules that turn a (budget, size) into a model and a recipe."""

    budgets: list[Positive] = Field(min_length=1, description="Training FLOP budgets C, e.g. [1e11, 2e11].")
    shapes_per_budget: int = Field(5, ge=3, description="Sizes trained per budget (the isoFLOP curve).")
    # Where to look, not what to find: Hoffmann et al. had D/N ~ 20 and N_opt ~ C^0.5 at 1e18+ FLOPs.
    # The defaults centre the CPU sweep (pilot runs on KJV put N_opt near 2e4 at 3.5e10-1.4e11 FLOPs).
    tokens_per_param: float = Field(86.0, gt=0, description="Prior D/N at budget_ref.")
    prior_exponent: float = Field(0.28, gt=0, lt=1, description="Prior N_opt ~ C^prior_exponent.")
    tolerance: float = Field(0.03, gt=0, lt=0.5, description="Largest relative miss of a run's FLOPs.")
    min_steps: int = Field(20, ge=2, description="Fewest steps a run may train: a (budget, size) whose budget buys "
                           "fewer is an error (BudgetError) naming it.")
    max_size: int = Field(24, ge=2, description="Largest size index k on the ladder.")
    # shape rule
    width_step: Count = Field(4, description="d_model of size index k: width_step * k (a multiple of head_dim).")
    aspect: Positive = Field(48.0, description="d_model / n_layers, once past min_layers: n_layers = "
                             "max(min_layers, floor(d_model / aspect + 1/2)).")
    min_layers: Count = Field(2, description="Fewest layers of any size (one layer cannot form induction heads).")
    head_dim: Count = Field(4, description="Width of every attention head: n_heads = d_model / head_dim, with as "
                            "many key/value heads (no GQA).")
    tie_embeddings: bool = Field(False, description="Tie the output projection to the input embedding. Off by "
                                 "default: tied, these tiny models sat on the unigram plateau for a number of steps "
                                 "that varied from run to run.")
    # ModelConfig's 0.02 suits d_model ~ 1000; at d_model 8-40 it is ~10x below 1/sqrt(fan_in), and
    # runs of few steps then lost a varying part of them near the unigram loss before learning
    # (measured: +0.18 bits/byte on one run of 325 steps).
    init_scale: Positive | None = Field(0.5, description="Each run's init_std is init_scale / sqrt(d_model); None: "
                                        "ModelConfig's init_std (0.02).")
    seq_len: Count = Field(64, description="Tokens per training sequence of every run (model.seq_len).")
    # batch rule
    batch_ref: Count = Field(32, description="The batch size at budget_ref: batch_size = batch_ref * (C / "
                             "budget_ref) ^ batch_exponent, rounded to a multiple of batch_multiple.")
    budget_ref: Positive = Field(1e12, description="The reference budget (FLOPs) of the batch rule and of the size "
                                 "prior (tokens_per_param is D/N there).")
    batch_exponent: Fraction = Field(0.33, description="How the batch grows with the budget (DeepSeek LLM fits the "
                                     "optimal batch as about C^0.33).")
    batch_multiple: int = Field(1, ge=1, description="e.g. the number of data-parallel devices")
    # learning-rate rule
    lr_ref: Positive = Field(5e-3, description="The learning rate at width width_ref: lr = min(lr_max, lr_ref * "
                             "width_ref / d_model), Adam's best rate falling as 1 / width.")
    width_ref: Count = Field(128, description="The d_model at which the learning rate is lr_ref.")
    lr_max: Positive = Field(2e-2, description="The highest learning rate of any run.")
    warmup_fraction: HalfOpenFraction = Field(0.05, description="Warmup as a share of each run's steps (at least "
                                              "one step), then a cosine decay.")
    weight_decay: NonNegativeFloat = Field(0.1, description="Every run's train.weight_decay.")
    beta2: Beta = Field(0.95, description="Every run's train.beta2.")
    optimizer: Literal["adamw", "muon"] = identity_when_set(
        "adamw", description="Every run's train.optimizer: a sweep of Muon runs gives Muon's law, to set beside "
        "AdamW's (the learning-rate rule above is AdamW's; Muon's update is scaled to AdamW's size).")
    seed: Seed = Field(0, description="Every run's train.seed; with `seeds` > 1 the further runs of a (budget, "
                       "size) take seed + 1, seed + 2, ...")
    # More than one seed trains every (budget, size) `seeds` times, with seeds seed, seed + 1, ...: the
    # first keeps the run (and the version) a one-seed sweep has, the others are runs of their own
    # (`train/<C>/k<size>/seed<s>`). The fits take every seed as a point and the bootstrap then
    # resamples seeds within each (budget, size) instead of whole runs.
    seeds: int = Field(1, ge=1, le=16, description="Runs per (budget, size), each with its own seed.")
    # fit
    min_points: int = Field(4, ge=3, description="Runs a budget needs to be fitted (3 fit a parabola "
                                                  "exactly; the 4th gives its uncertainty).")
    forecast: bool = Field(True, description="Fit without the largest budget, train its predicted "
                                             "optimum, and report the error.")
    forecast_goal: float = Field(0.03, gt=0, description="Relative error of the forecast reported as met.")
    bootstrap: int = Field(200, ge=20, le=5000, description="Refits of the parametric law on resampled runs, "
                                                          "for its intervals.")
    interval: float = Field(0.9, gt=0.5, lt=1, description="Probability the forecast's intervals hold.")
    heldout_tokens: int | None = Field(32768, ge=2, description="Held-out tokens each run is scored on "
                                                                 "(None: the whole validation split).")
    cpus_per_run: int = setting(2, ge=1, description="Ray CPUs each run asks for (with `run.max_concurrent` runs at once).")

    @model_validator(mode="after")
    def _check(self) -> ScalingConfig:
        if len(set(self.budgets)) != len(self.budgets) or any(c <= 0 for c in self.budgets):
            raise ValueError(f"budgets must be distinct and positive, got {self.budgets}")
        if self.width_step % self.head_dim:
            raise ValueError(f"width_step={self.width_step} must be a multiple of head_dim={self.head_dim}")
        if self.forecast and len(self.budgets) < 4:
            raise ValueError(f"the forecast check fits the law without the largest budget, and the frontier "
                             f"L = a*C^-b + e needs 3 budgets for that: give at least 4 budgets (got "
                             f"{len(self.budgets)}) or set forecast: false")
        if self.shapes_per_budget < self.min_points:
            raise ValueError(f"shapes_per_budget={self.shapes_per_budget} is below min_points={self.min_points}: "
                             "no budget could be fitted")
        return self


def shape(k: int, cfg: ScalingConfig, vocab_size: int) -> ModelConfig:
    """The model of size index k under the shape rule (module docstring)."""
    if not 2 <= k <= cfg.max_size:
        raise ValueError(f"size index {k} is outside 2..{cfg.max_size} (scaling.max_size)")
    d = cfg.width_step * k
    layers = max(cfg.min_layers, math.floor(d / cfg.aspect + 0.5))
    d_ff = -(-8 * d // (3 * cfg.head_dim)) * cfg.head_dim  # ceil(8d/3) to a multiple of head_dim
    heads = d // cfg.head_dim
    return ModelConfig(vocab_size=vocab_size, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                       d_ff=d_ff, seq_len=cfg.seq_len, tie_embeddings=cfg.tie_embeddings,
                       **({"init_std": cfg.init_scale / math.sqrt(d)} if cfg.init_scale else {}))


def batch_size(budget: float, cfg: ScalingConfig) -> int:
    raw = cfg.batch_ref * (budget / cfg.budget_ref) ** cfg.batch_exponent
    return cfg.batch_multiple * max(1, round(raw / cfg.batch_multiple))


def learning_rate(model: ModelConfig, cfg: ScalingConfig) -> float:
    return min(cfg.lr_max, cfg.lr_ref * cfg.width_ref / model.d_model)


@dataclass(frozen=True)
class RunPlan:
    """One (budget, size) run: what to train and what it costs."""

    budget: float
    size: int
    model: ModelConfig
    train: TrainConfig
    params: int  # N (matmul parameters)
    tokens: int  # D, whole steps
    flops: float  # flops_per_token * D: within `tolerance` of the budget
    seed: int = 0
    first_seed: bool = True  # the sweep's `scaling.seed`: its name carries no seed

    @property
    def name(self) -> str:
        suffix = "" if self.first_seed else f"/seed{self.seed}"
        return f"{budget_label(self.budget)}/k{self.size}{suffix}"


def budget_label(budget: float) -> str:
    """1e11 -> "1e11", 2.5e11 -> "2.5e11": for step names and plot legends."""
    return f"{budget:.3g}".replace("e+", "e")


def plan_run(budget: float, k: int, cfg: ScalingConfig, vocab_size: int, seed: int | None = None) -> RunPlan:
    """The run of size k that spends `budget` (with `seed`, default `cfg.seed`); BudgetError if whole
    steps cannot come close enough."""
    seed = cfg.seed if seed is None else seed
    model = shape(k, cfg, vocab_size)
    per_token = flops_per_token(model)
    batch = batch_size(budget, cfg)
    tokens_per_step = batch * model.seq_len
    steps = round(budget / per_token / tokens_per_step)
    if steps < cfg.min_steps:
        raise BudgetError(f"budget {budget:.3g} buys {budget / per_token / tokens_per_step:.1f} steps of size k={k} "
                          f"({matmul_params(model):,} params, batch {batch}x{model.seq_len}); fewer than "
                          f"min_steps={cfg.min_steps}: use a larger budget or smaller sizes")
    flops = per_token * steps * tokens_per_step
    miss = flops / budget - 1
    if abs(miss) > cfg.tolerance:
        raise BudgetError(f"size k={k} at budget {budget:.3g}: {steps} whole steps spend {flops:.4g} FLOPs, "
                          f"{miss:+.1%} off (tolerance {cfg.tolerance:.0%}); raise the budget or lower batch_ref")
    train = TrainConfig(batch_size=batch, steps=steps, lr=learning_rate(model, cfg),
                        warmup=max(1, round(cfg.warmup_fraction * steps)), schedule="cosine",
                        weight_decay=cfg.weight_decay, beta2=cfg.beta2, optimizer=cfg.optimizer, seed=seed,
                        eval_batches=1,
                        # settings, not identity: runs last a minute or two, so one checkpoint at
                        # the end and ~20 log lines (each one waits for the device) are plenty
                        checkpoint_every=steps, log_every=max(1, steps // 20), eval_every=steps)
    return RunPlan(budget, k, model, train, matmul_params(model), steps * tokens_per_step, flops, seed,
                   seed == cfg.seed)


def ladder(cfg: ScalingConfig, vocab_size: int) -> list[tuple[int, int]]:
    """(k, N) for every size on the ladder."""
    return [(k, matmul_params(shape(k, cfg, vocab_size))) for k in range(2, cfg.max_size + 1)]


def prior_params(budget: float, cfg: ScalingConfig) -> float:
    """N_prior(C): the size each budget's window of sizes is centred on."""
    return math.sqrt(cfg.budget_ref / (6 * cfg.tokens_per_param)) * (budget / cfg.budget_ref) ** cfg.prior_exponent


def isoflop_sizes(budget: float, cfg: ScalingConfig, vocab_size: int) -> list[int]:
    """The consecutive sizes trained at `budget`: the window whose mean ln N is nearest ln N_prior."""
    n_prior = prior_params(budget, cfg)
    sizes = ladder(cfg, vocab_size)
    s = cfg.shapes_per_budget
    if len(sizes) < s:
        raise ValueError(f"the ladder has {len(sizes)} sizes, fewer than shapes_per_budget={s}: raise max_size")
    windows = [sizes[i:i + s] for i in range(len(sizes) - s + 1)]
    best = min(windows, key=lambda w: abs(np.mean([math.log(n) for _, n in w]) - math.log(n_prior)))
    return [k for k, _ in best]


def isoflop_grid(budget: float, cfg: ScalingConfig, vocab_size: int) -> list[RunPlan]:
    """Every run of one budget, each size once per seed; BudgetError names the first run that would
    miss it."""
    return [plan_run(budget, k, cfg, vocab_size, cfg.seed + i)
            for i in range(cfg.seeds) for k in isoflop_sizes(budget, cfg, vocab_size)]


def nearest_size(n: float, budget: float, cfg: ScalingConfig, vocab_size: int) -> RunPlan:
    """The run at `budget` of the ladder size nearest N = n in log (e.g. a predicted N_opt)."""
    k = min(ladder(cfg, vocab_size), key=lambda kn: abs(math.log(kn[1]) - math.log(n)))[0]
    return plan_run(budget, k, cfg, vocab_size)


# --- fits ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunResult:
    """A finished run: its budget, N, D and held-out loss (and the FLOPs it spent, if known)."""

    budget: float
    params: float
    tokens: float
    loss: float
    name: str = ""
    flops: float | None = None  # flops_per_token * D as the recipe counted it; None: the budget

    @property
    def flops_per_token(self) -> float:
        return (self.budget if self.flops is None else self.flops) / self.tokens


@dataclass(frozen=True)
class IsoFlopFit:
    budget: float
    points: int
    coeffs: tuple[float, float, float]  # c2, c1, c0 of L = c2 x^2 + c1 x + c0, x = ln N
    n_opt: float
    ln_n_opt_err: float  # standard error of ln N_opt (a relative error of N_opt)
    d_opt: float
    ln_d_opt_err: float
    loss_opt: float
    loss_opt_err: float
    residual_rms: float

    def curve(self, n: np.ndarray) -> np.ndarray:
        x = np.log(n)
        c2, c1, c0 = self.coeffs
        return c2 * x * x + c1 * x + c0


@dataclass(frozen=True)
class PowerLaw:
    """y = coefficient * C^exponent; `ln_coefficient_at_ref` is ln y at C = ref (better conditioned)."""

    coefficient: float
    exponent: float
    exponent_err: float
    ln_coefficient_err: float  # of ln(coefficient)
    ref: float
    ln_y_at_ref: float
    ln_y_at_ref_err: float
    cov: tuple[tuple[float, float], tuple[float, float]]  # of (ln y at ref, exponent)

    def __call__(self, c) -> np.ndarray:
        return np.exp(self.ln_y_at_ref + self.exponent * np.log(np.asarray(c, float) / self.ref))

    def ln_err(self, c) -> np.ndarray:
        """Standard error of ln y at C (the relative error of y)."""
        g = np.log(np.asarray(c, float) / self.ref)
        (v00, v01), (_, v11) = self.cov
        return np.sqrt(v00 + 2 * g * v01 + g * g * v11)


@dataclass(frozen=True)
class Frontier:
    """L(C) = a * C^(-b) + e, fitted as L = exp(ln_a_ref - b ln(C/ref)) + e."""

    a: float
    a_rel_err: float  # standard error of ln a
    b: float
    b_err: float
    e: float
    e_err: float
    ref: float
    cov: tuple  # 3x3 of (ln L-part at ref, b, e)
    params_ref: tuple[float, float, float]

    def __call__(self, c) -> np.ndarray:
        ln_a_ref, b, e = self.params_ref
        return np.exp(ln_a_ref - b * np.log(np.asarray(c, float) / self.ref)) + e

    def err(self, c) -> np.ndarray:
        """Standard error of the predicted loss at C (delta method)."""
        ln_a_ref, b, _ = self.params_ref
        c = np.asarray(c, float)
        g = np.log(c / self.ref)
        term = np.exp(ln_a_ref - b * g)
        grad = np.stack([term, -g * term, np.ones_like(term)])
        cov = np.asarray(self.cov)
        return np.sqrt(np.einsum("i...,ij,j...->...", grad, cov, grad))


@dataclass(frozen=True)
class DroppedBudget:
    """A budget left out of the isoFLOP fit, and why; its runs still count in the parametric fit."""

    budget: float
    points: int
    reason: str


# Hoffmann et al.'s choices for approach 3: Huber loss with delta 1e-3 on residuals of ln L, and
# L-BFGS from a grid of starts (theirs: alpha, beta in 0..2, e in -1..1, a, b in 0..25).
HUBER_DELTA = 1e-3
START_GRID = np.array(list(itertools.product(
    [0.0, 5.0, 10.0, 15.0, 20.0, 25.0],  # ln A
    [0.0, 5.0, 10.0, 15.0, 20.0, 25.0],  # ln B
    [-1.0, -0.5, 0.0, 0.5, 1.0],         # ln E
    [0.25, 0.5, 1.0, 1.5],               # alpha
    [0.25, 0.5, 1.0, 1.5])))             # beta
STARTS_KEPT = 8  # L-BFGS runs from the starts with the lowest objective, not from all 3,600
BOUNDS = [(None, None), (None, None), (None, None), (0.01, 3.0), (0.01, 3.0)]
MIN_RUNS_PARAMETRIC = 8  # 5 parameters, and room left to see the noise


@dataclass(frozen=True)
class ParametricLaw:
    """L(N, D) = E + A / N^alpha + B / D^beta (Hoffmann et al., 2022, approach 3), fitted to every
    run, and the FLOPs per token those runs spent, so that its optimum at a budget spends the budget
    the way the sweep counts it: C = (6N + attention(N)) D, attention(N) = attn_coef * N^attn_exp
    (a power law through the runs' own attention FLOPs; attn_coef 0 where they spent C = 6ND)."""

    ln_a: float
    ln_b: float
    ln_e: float
    alpha: float
    beta: float
    attn_coef: float = 0.0
    attn_exp: float = 1.0
    residual_rms: float = 0.0  # of ln L over the runs fitted

    @property
    def theta(self) -> np.ndarray:
        return np.array([self.ln_a, self.ln_b, self.ln_e, self.alpha, self.beta])

    def loss(self, n, d) -> np.ndarray:
        return _loss(self.theta, np.log(np.asarray(n, float)).reshape(-1), np.log(np.asarray(d, float))
                     .reshape(-1))[0].reshape(np.shape(n))

    def flops_per_token(self, n) -> np.ndarray:
        n = np.asarray(n, float)
        return 6 * n + self.attn_coef * n ** self.attn_exp

    def optimum(self, budget: float) -> tuple[float, float, float]:
        """(N_opt, D_opt, L_opt) at C: the N minimising L(N, C / flops_per_token(N))."""
        n, d, loss = _optima(self.theta[None], budget, self)
        return float(n[0]), float(d[0]), float(loss[0])


def _loss(thetas: np.ndarray, ln_n: np.ndarray, ln_d: np.ndarray) -> np.ndarray:
    """L for parameter rows `thetas` (R, 5) (or columns (5, 1)) at points (N, D): shape (R, points)."""
    a, b, e, alpha, beta = (np.asarray(v, float).reshape(-1, 1) for v in np.asarray(thetas).reshape(-1, 5).T)
    return np.exp(e) + np.exp(a - alpha * ln_n) + np.exp(b - beta * ln_d)


def _optima(thetas: np.ndarray, budget: float, law: ParametricLaw) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """N_opt, D_opt, L_opt at `budget` for each parameter row: a grid over ln N, then a finer one
    around each row's best point (ln N to ~1e-3), vectorised over rows (one bootstrap is 200)."""
    def at(ln_n):  # (R, points) -> losses, ln D
        n = np.exp(ln_n)
        ln_d = np.log(budget / law.flops_per_token(n))
        a, b, e, alpha, beta = (t[:, None] for t in np.asarray(thetas).T)
        return np.exp(e) + np.exp(a - alpha * ln_n) + np.exp(b - beta * ln_d), ln_d

    lo, hi = 0.0, math.log(budget / 60)  # N from 1 to C / 60 (there D >= 10 tokens)
    coarse = np.linspace(lo, hi, 600)
    step = coarse[1] - coarse[0]
    losses, _ = at(np.broadcast_to(coarse, (len(thetas), len(coarse))))
    best = coarse[np.argmin(losses, axis=1)]
    fine = best[:, None] + np.linspace(-step, step, 401)[None, :]
    losses, ln_d = at(fine)
    i = np.argmin(losses, axis=1)
    rows = np.arange(len(thetas))
    return np.exp(fine[rows, i]), np.exp(ln_d[rows, i]), losses[rows, i]


def _huber_objective(theta: np.ndarray, ln_n: np.ndarray, ln_d: np.ndarray, ln_l: np.ndarray):
    """Sum of Huber(ln L_pred - ln L) / delta and its gradient, with ln L_pred = LSE(a - alpha ln N,
    b - beta ln D, e) (computed stably, as Hoffmann et al. write it)."""
    a, b, e, alpha, beta = theta
    t = np.stack([a - alpha * ln_n, b - beta * ln_d, np.full_like(ln_n, e)])
    top = t.max(axis=0)
    w = np.exp(t - top)
    total = w.sum(axis=0)
    r = top + np.log(total) - ln_l
    value = np.where(np.abs(r) <= HUBER_DELTA, 0.5 * r * r, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA))
    dr = np.clip(r, -HUBER_DELTA, HUBER_DELTA) / HUBER_DELTA
    p = w / total
    grad = np.array([dr @ p[0], dr @ p[1], dr @ p[2], -(dr * p[0]) @ ln_n, -(dr * p[1]) @ ln_d])
    return float(value.sum()) / HUBER_DELTA, grad


def _grid_objective(starts: np.ndarray, ln_n, ln_d, ln_l) -> np.ndarray:
    """The objective at every start at once (R starts), to choose where L-BFGS begins."""
    r = np.log(_loss(starts, ln_n, ln_d)) - ln_l
    return np.where(np.abs(r) <= HUBER_DELTA, 0.5 * r * r, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA)).sum(1)


def _minimise(starts: np.ndarray, ln_n, ln_d, ln_l) -> np.ndarray:
    """The best L-BFGS-B minimum over `starts`. It runs on ln N and ln D less their means (then
    a - alpha ln N is a' - alpha (ln N - mean): a' and alpha no longer move together), which took
    40% fewer evaluations to the same minima."""
    from scipy.optimize import minimize

    mn, md = float(ln_n.mean()), float(ln_d.mean())
    shift = np.array([mn, md])
    best = None
    for x0 in starts:
        x0 = np.array(x0, float)
        x0[:2] -= x0[3:] * shift
        res = minimize(_huber_objective, x0, args=(ln_n - mn, ln_d - md, ln_l), jac=True, method="L-BFGS-B",
                       bounds=BOUNDS, options={"maxiter": 1000, "ftol": 1e-12, "gtol": 1e-8})
        if best is None or res.fun < best.fun:
            best = res
    x = best.x.copy()
    x[:2] += x[3:] * shift
    return x


def attention_flops(runs: list[RunResult]) -> tuple[float, float]:
    """(coef, exponent) of the attention FLOPs per token the runs spent, flops_per_token - 6N, as a
    power law in N (least squares in log-log); (0, 1) where they spent 6N per token."""
    n = np.array([r.params for r in runs], float)
    excess = np.array([r.flops_per_token for r in runs]) - 6 * n
    if np.all(excess <= 1e-6 * 6 * n):
        return 0.0, 1.0
    if np.any(excess <= 0) or len(np.unique(n)) < 2:
        raise FitError(f"the runs' FLOPs per token less 6N ({excess.min():.4g} to {excess.max():.4g}) are not an "
                       "attention term a power law in N can describe: pass each run's flops as the recipe counted them")
    exponent, ln_coef = np.polyfit(np.log(n), np.log(excess), 1)
    return float(math.exp(ln_coef)), float(exponent)


def fit_parametric(runs: list[RunResult]) -> ParametricLaw:
    """L(N, D) = E + A/N^alpha + B/D^beta through every run (module docstring, approach 3)."""
    budgets = {r.budget for r in runs}
    if len(runs) < MIN_RUNS_PARAMETRIC or len(budgets) < 2:
        raise FitError(f"the parametric law has 5 parameters; it needs at least {MIN_RUNS_PARAMETRIC} runs over 2 or "
                       f"more budgets (at one budget D is a function of N), got {len(runs)} over {len(budgets)}")
    theta = _fit_theta(runs, START_GRID, STARTS_KEPT)
    coef, exponent = attention_flops(runs)
    ln_n, ln_d, ln_l = _logs(runs)
    resid = ln_l - np.log(_loss(theta, ln_n, ln_d)[0])
    return ParametricLaw(*(float(v) for v in theta), attn_coef=coef, attn_exp=exponent,
                         residual_rms=float(np.sqrt(np.mean(resid ** 2))))


def _logs(runs: list[RunResult]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (np.log([r.params for r in runs]), np.log([r.tokens for r in runs]), np.log([r.loss for r in runs]))


def _fit_theta(runs: list[RunResult], starts: np.ndarray, kept: int) -> np.ndarray:
    ln_n, ln_d, ln_l = _logs(runs)
    order = np.argsort(_grid_objective(starts, ln_n, ln_d, ln_l))[:kept]
    return _minimise(starts[order], ln_n, ln_d, ln_l)


@dataclass(frozen=True)
class Bootstrap:
    """The parametric law refitted on resampled runs; its intervals are percentiles of the refits'.

    `resample` is "runs" (draw len(runs) runs with replacement) or, where every (budget, N) has
    more than one seed, "seeds" (draw within each (budget, N), so every size stays in and only the
    seed noise is resampled). `noise` holds one draw per refit of a run's own scatter about the law
    (a residual of ln L of the full fit, scaled by sqrt(n / (n - 5)) for the 5 fitted parameters):
    a new run's loss is the law's value times exp(noise), so `run_interval` is where one run's
    measured loss should fall, and `interval` where the law's value (the mean over seeds) should."""

    level: float
    seed: int
    resample: str
    thetas: tuple  # R rows of (ln A, ln B, ln E, alpha, beta)
    noise: tuple  # R draws of a run's log residual

    def interval(self, values) -> tuple[float, float]:
        tail = 50 * (1 - self.level)
        lo, hi = np.percentile(np.asarray(values, float), [tail, 100 - tail])
        return float(lo), float(hi)

    def at(self, law: ParametricLaw, n: float, d: float, backtest: Backtest | None = None) -> dict:
        """The law at one (N, D) with the interval of its value and of one run's loss; with a
        backtest, also the loss and one run's interval corrected by it (`Backtest`)."""
        values = _loss(np.asarray(self.thetas), np.log([n]), np.log([d]))[:, 0]
        loss = float(law.loss(n, d))
        return {"loss": loss, "loss_interval": self.interval(values),
                "run_interval": self.interval(values * np.exp(np.asarray(self.noise))), "level": self.level,
                **self._backtested(loss, values, backtest)}

    def optimum(self, law: ParametricLaw, budget: float, backtest: Backtest | None = None) -> dict:
        """N_opt, D_opt and L_opt at `budget` with their intervals (and one run's loss there); with a
        backtest, also L_opt and one run's interval corrected by it."""
        n, d, loss = law.optimum(budget)
        ns, ds, losses = _optima(np.asarray(self.thetas), budget, law)
        return {"n_opt": n, "n_opt_interval": self.interval(ns), "d_opt": d, "d_opt_interval": self.interval(ds),
                "loss": loss, "loss_interval": self.interval(losses),
                "run_interval": self.interval(losses * np.exp(np.asarray(self.noise))), "level": self.level,
                **self._backtested(loss, losses, backtest)}

    def _backtested(self, loss: float, values: np.ndarray, backtest: Backtest | None) -> dict:
        """The backtest's correction: the law's value times exp(its mean error), and one run's
        interval from each refit's value times one of its errors (each error in turn, so the
        interval carries the backtest's own bias and scatter: a run's noise is in them already)."""
        if backtest is None:
            return {}
        errors = np.resize(np.asarray(backtest.ln_errors), len(values))
        return {"backtest_loss": loss * math.exp(backtest.bias),
                "backtest_run_interval": self.interval(values * np.exp(errors))}


def bootstrap_parametric(runs: list[RunResult], law: ParametricLaw, replicates: int, level: float = 0.9,
                         seed: int = 0) -> Bootstrap:
    """`replicates` refits of `law` on resampled runs (a fixed seed: the same runs give the same
    intervals). Each refit starts from the full fit's optimum only, not from the grid again. On 30
    resamples of configs/scaling_cpu.yaml's 35 runs, adding the 8 best grid starts found the same
    minimum 26 times and a lower one 4 times (L_opt at 2.4e11 moving by up to 0.05 bits/byte), at
    40x the time (375 s against 9 s on a loaded 2-core machine): the intervals can be a little
    narrow where the law fits badly."""
    rng = np.random.default_rng(seed)
    groups: dict[tuple[float, float], list[int]] = {}
    for i, r in enumerate(runs):
        groups.setdefault((r.budget, r.params), []).append(i)
    by_seed = all(len(g) > 1 for g in groups.values())
    thetas = []
    while len(thetas) < replicates:
        if by_seed:
            idx = np.concatenate([rng.choice(g, len(g)) for g in groups.values()])
        else:
            idx = rng.integers(0, len(runs), len(runs))
        sample = [runs[i] for i in idx]
        if len({r.budget for r in sample}) < 2 or len({(r.budget, r.params) for r in sample}) < 6:
            continue  # a draw that could not identify the law (rare with more than a dozen runs)
        thetas.append(_minimise(law.theta[None], *_logs(sample)))
    ln_n, ln_d, ln_l = _logs(runs)
    resid = (ln_l - np.log(_loss(law.theta, ln_n, ln_d)[0])) * math.sqrt(len(runs) / (len(runs) - 5))
    noise = resid[rng.integers(0, len(runs), replicates)]
    return Bootstrap(level=level, seed=seed, resample="seeds" if by_seed else "runs",
                     thetas=tuple(tuple(float(v) for v in t) for t in thetas), noise=tuple(float(v) for v in noise))


@dataclass(frozen=True)
class Backtest:
    """The forecast one budget earlier: the parametric law fitted on every budget but the largest,
    scored on the largest budget's runs. The bootstrap sees how the fitted runs scatter, not how a
    law that fits them extrapolates: on configs/scaling_cpu.yaml's runs (2026-12-05) each next
    budget's runs came out 1.6%, 4.1% and 4.8% below the law fitted under it, on average (tiny
    models' loss falls faster at the top of the sweep than a law that flattens can follow).
    `ln_errors` (ln of trained / predicted loss, one per run) are that cost of extrapolating one
    step of the sweep's budget ladder; two steps out it was larger there (the 2.4e11 runs 5-12%
    below the law fitted on 1.5e10-6e10, all 7 outside even the corrected interval)."""

    fitted: tuple  # the budgets the law was fitted on
    budget: float  # the budget it was scored on
    ln_errors: tuple  # ln(trained / predicted loss) of each run at `budget`

    @property
    def bias(self) -> float:
        return float(np.mean(self.ln_errors))


def backtest_parametric(runs: list[RunResult]) -> Backtest | None:
    """The parametric law without the largest budget, scored on it; None with fewer than 3 budgets,
    or fewer than 6 (budget, N) points below the largest (too few for the law's 5 parameters)."""
    budgets = sorted({r.budget for r in runs})
    fitted = [r for r in runs if r.budget != budgets[-1]]
    if len(budgets) < 3 or len({(r.budget, r.params) for r in fitted}) < 6:
        return None
    law = fit_parametric(fitted)
    errors = [math.log(r.loss / float(law.loss(r.params, r.tokens))) for r in runs if r.budget == budgets[-1]]
    return Backtest(fitted=tuple(budgets[:-1]), budget=budgets[-1], ln_errors=tuple(errors))


@dataclass(frozen=True)
class ScalingLaw:
    """Both fits of one sweep: the isoFLOP minima (approach 2) of the budgets that bracket theirs,
    with the budgets left out and why, and the parametric law (approach 3) over every run."""

    budgets: list[IsoFlopFit]
    n_opt: PowerLaw
    d_opt: PowerLaw
    frontier: Frontier
    runs: list[RunResult] = field(default_factory=list)
    dropped: list[DroppedBudget] = field(default_factory=list)
    parametric: ParametricLaw | None = None
    bootstrap: Bootstrap | None = None
    backtest: Backtest | None = None

    def predict(self, budget: float) -> dict:
        """Both fits' N_opt, D_opt and loss at `budget`: the isoFLOP law's with standard errors, the
        parametric law's with bootstrap intervals, and beyond the runs' largest budget also corrected
        by the backtest (at a budget the sweep trained, the law was fitted to those runs)."""
        out = {"budget": budget,
               "isoflop": {"n_opt": float(self.n_opt(budget)), "ln_n_opt_err": float(self.n_opt.ln_err(budget)),
                           "d_opt": float(self.d_opt(budget)), "ln_d_opt_err": float(self.d_opt.ln_err(budget)),
                           "loss": float(self.frontier(budget)), "loss_err": float(self.frontier.err(budget))}}
        if self.parametric is not None:
            if self.bootstrap is not None:
                beyond = budget > max((r.budget for r in self.runs), default=math.inf)
                out["parametric"] = self.bootstrap.optimum(self.parametric, budget, self.backtest if beyond else None)
            else:
                n, d, loss = self.parametric.optimum(budget)
                out["parametric"] = {"n_opt": n, "d_opt": d, "loss": loss}
        return out

    def to_json(self) -> dict:
        """Everything fitted, as JSON: a readable summary, and the full state for `law_from_json`."""
        f = self.frontier
        data = {
            "convention": "C in FLOPs (6N + attention per token, PaLM); N matmul parameters; D tokens; "
                          "loss held-out bits per byte; isoFLOP errors are one standard error; ln_*_err and "
                          "a_rel_err are errors of the natural log (relative errors); parametric intervals are "
                          "bootstrap percentile intervals at `bootstrap.level`",
            "n_opt": _law_json(self.n_opt, "N_opt = coefficient * C^exponent"),
            "d_opt": _law_json(self.d_opt, "D_opt = coefficient * C^exponent"),
            "frontier": {"formula": "L(C) = a * C^(-b) + e", "a": f.a, "a_rel_err": f.a_rel_err, "b": f.b,
                         "b_err": f.b_err, "e": f.e, "e_err": f.e_err},
            "budgets": [asdict(b) for b in self.budgets],
            "dropped": [asdict(d) for d in self.dropped],
            "runs": [asdict(r) for r in self.runs],
            "state": {"n_opt": asdict(self.n_opt), "d_opt": asdict(self.d_opt), "frontier": asdict(f)},
        }
        if self.parametric is not None:
            p = self.parametric
            data["parametric"] = {
                "formula": "L(N, D) = E + A / N^alpha + B / D^beta; C = (6N + attn_coef N^attn_exp) D",
                "E": math.exp(p.ln_e), "A": math.exp(p.ln_a), "B": math.exp(p.ln_b), "alpha": p.alpha, "beta": p.beta,
                # where attention is negligible, N_opt ~ C^(beta / (alpha + beta)) (Hoffmann et al.)
                "n_opt_exponent_6nd": p.beta / (p.alpha + p.beta), "residual_rms_ln_loss": p.residual_rms}
            data["state"]["parametric"] = asdict(p)
        if self.bootstrap is not None:
            data["bootstrap"] = {"replicates": len(self.bootstrap.thetas), "level": self.bootstrap.level,
                                 "seed": self.bootstrap.seed, "resample": self.bootstrap.resample}
            data["state"]["bootstrap"] = asdict(self.bootstrap)
        if self.backtest is not None:
            b = self.backtest
            data["backtest"] = {"fitted": list(b.fitted), "budget": b.budget, "ln_errors": list(b.ln_errors),
                                "bias": b.bias}
            data["state"]["backtest"] = asdict(b)
        return data


def law_from_json(data: dict) -> ScalingLaw:
    """The ScalingLaw that `to_json` wrote (to predict or plot from a fit step's output)."""
    def nested(value):
        return tuple(nested(v) for v in value) if isinstance(value, list) else value

    def load(cls, fields: dict):
        return cls(**{k: nested(v) for k, v in fields.items()})

    state = data["state"]
    return ScalingLaw(
        budgets=[load(IsoFlopFit, b) for b in data["budgets"]],
        n_opt=load(PowerLaw, state["n_opt"]), d_opt=load(PowerLaw, state["d_opt"]),
        frontier=load(Frontier, state["frontier"]),
        runs=[RunResult(**r) for r in data["runs"]],
        dropped=[DroppedBudget(**d) for d in data.get("dropped", [])],
        parametric=load(ParametricLaw, state["parametric"]) if "parametric" in state else None,
        bootstrap=load(Bootstrap, state["bootstrap"]) if "bootstrap" in state else None,
        backtest=load(Backtest, state["backtest"]) if "backtest" in state else None)


def _law_json(law: PowerLaw, formula: str) -> dict:
    return {"formula": formula, "coefficient": law.coefficient, "ln_coefficient_err": law.ln_coefficient_err,
            "exponent": law.exponent, "exponent_err": law.exponent_err}


def fit_isoflop(runs: list[RunResult], min_points: int = 4) -> IsoFlopFit:
    """The parabola in ln N through one budget's runs, and its minimum with standard errors."""
    budgets = {r.budget for r in runs}
    if len(budgets) != 1:
        raise ValueError(f"fit_isoflop takes the runs of one budget, got budgets {sorted(budgets)}")
    budget = budgets.pop()
    if len(runs) < min_points:
        raise FitError(f"budget {budget:.3g} has {len(runs)} finished runs; fitting its isoFLOP parabola with an "
                       f"uncertainty needs at least {min_points}: train more sizes there (shapes_per_budget) "
                       "or drop the budget")
    x = np.log([r.params for r in runs])
    y = np.array([r.loss for r in runs])
    if len(np.unique(x)) < 3:
        raise FitError(f"budget {budget:.3g}: its runs have {len(np.unique(x))} distinct sizes; a parabola needs 3")
    x0 = x.mean()  # centred, so the normal equations are well conditioned
    X = np.stack([(x - x0) ** 2, x - x0, np.ones_like(x)], axis=1)
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ beta
    dof = len(x) - 3
    s2 = float(resid @ resid) / dof if dof > 0 else 0.0
    cov = s2 * np.linalg.inv(X.T @ X)
    q2, q1, q0 = beta
    if q2 <= 0:
        raise FitError(f"budget {budget:.3g}: loss against ln N curves downward (c2={q2:.3g}), so its runs show no "
                       f"minimum: add sizes on both sides of the best one ({_best(runs)})")
    u = -q1 / (2 * q2)  # minimum, in centred coordinates
    if not x.min() <= u + x0 <= x.max():
        side = "below the smallest" if u + x0 < x.min() else "above the largest"
        raise FitError(f"budget {budget:.3g}: the parabola's minimum N={math.exp(u + x0):,.0f} lies {side} size "
                       f"trained ({_best(runs)} is best); the grid does not bracket the optimum: shift it "
                       "with tokens_per_param")
    g_u = np.array([q1 / (2 * q2 ** 2), -1 / (2 * q2), 0.0])
    loss_opt = q0 - q1 ** 2 / (4 * q2)
    g_l = np.array([q1 ** 2 / (4 * q2 ** 2), -q1 / (2 * q2), 1.0])
    ln_n_err = math.sqrt(max(float(g_u @ cov @ g_u), 0.0))
    # D at N_opt: ln D is (very nearly) linear in ln N along one budget, since D = C / flops_per_token(N)
    ln_d = np.log([r.tokens for r in runs])
    slope, icpt = np.polyfit(x - x0, ln_d, 1)
    c2 = q2
    c1 = q1 - 2 * q2 * x0
    c0 = q0 - q1 * x0 + q2 * x0 * x0
    return IsoFlopFit(budget=budget, points=len(runs), coeffs=(float(c2), float(c1), float(c0)),
                      n_opt=math.exp(u + x0), ln_n_opt_err=ln_n_err,
                      d_opt=math.exp(icpt + slope * u), ln_d_opt_err=abs(slope) * ln_n_err,
                      loss_opt=float(loss_opt), loss_opt_err=math.sqrt(max(float(g_l @ cov @ g_l), 0.0)),
                      residual_rms=float(np.sqrt(np.mean(resid ** 2))))


def _best(runs: list[RunResult]) -> str:
    r = min(runs, key=lambda r: r.loss)
    return f"N={r.params:,.0f} at loss {r.loss:.4f}"


def _weighted_line(x: np.ndarray, y: np.ndarray, err: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """y = p0 + p1 x by weighted least squares; covariance scaled by reduced chi-square if > 1."""
    w = 1 / np.maximum(err, 1e-12) ** 2
    X = np.stack([np.ones_like(x), x], axis=1)
    A = X.T @ (w[:, None] * X)
    p = np.linalg.solve(A, X.T @ (w * y))
    cov = np.linalg.inv(A)
    dof = len(x) - 2
    if dof > 0:
        chi2 = float(np.sum(w * (y - X @ p) ** 2)) / dof
        cov = cov * max(1.0, chi2)
    return p, cov


def fit_power_law(budgets: np.ndarray, values: np.ndarray, ln_errs: np.ndarray) -> PowerLaw:
    """value = coefficient * C^exponent, from ln value with standard errors `ln_errs`."""
    if len(budgets) < 2:
        raise FitError(f"a power law in C needs at least 2 budgets, got {len(budgets)}")
    ref = float(np.exp(np.mean(np.log(budgets))))
    g = np.log(budgets / ref)
    p, cov = _weighted_line(g, np.log(values), ln_errs)
    ln_coef = p[0] - p[1] * math.log(ref)
    ln_coef_var = cov[0, 0] - 2 * math.log(ref) * cov[0, 1] + math.log(ref) ** 2 * cov[1, 1]
    return PowerLaw(coefficient=math.exp(ln_coef), exponent=float(p[1]), exponent_err=math.sqrt(cov[1, 1]),
                    ln_coefficient_err=math.sqrt(max(ln_coef_var, 0.0)), ref=ref, ln_y_at_ref=float(p[0]),
                    ln_y_at_ref_err=math.sqrt(cov[0, 0]),
                    cov=((float(cov[0, 0]), float(cov[0, 1])), (float(cov[1, 0]), float(cov[1, 1]))))


def fit_frontier(budgets: np.ndarray, losses: np.ndarray, errs: np.ndarray) -> Frontier:
    """L = a * C^-b + e through the per-budget minima (3 parameters: at least 3 budgets)."""
    from scipy.optimize import curve_fit

    if len(budgets) < 3:
        raise FitError(f"the frontier L = a*C^-b + e has 3 parameters and needs at least 3 budgets, got "
                       f"{len(budgets)}: add budgets")
    ref = float(np.exp(np.mean(np.log(budgets))))
    g = np.log(budgets / ref)
    errs = np.maximum(errs, 1e-4 * np.abs(losses))

    def model(g, ln_a_ref, b, e):
        return np.exp(ln_a_ref - b * g) + e

    # Start from a straight line in log-log through L - e0 with e0 a little below the best loss.
    e0 = 0.8 * float(losses.min())
    slope, icpt = np.polyfit(g, np.log(losses - e0), 1)
    p0 = [icpt, max(-slope, 1e-3), e0]
    bounds = ([-np.inf, 0.0, 0.0], [np.inf, 5.0, float(losses.min())])
    p, cov = curve_fit(model, g, losses, p0=p0, sigma=errs, absolute_sigma=True, bounds=bounds, maxfev=20000)
    dof = len(g) - 3
    if dof > 0:
        chi2 = float(np.sum(((losses - model(g, *p)) / errs) ** 2)) / dof
        cov = cov * max(1.0, chi2)
    ln_a_ref, b, e = (float(v) for v in p)
    # a in the original units: ln a = ln_a_ref + b ln ref
    lr = math.log(ref)
    ln_a_var = cov[0, 0] + 2 * lr * cov[0, 1] + lr * lr * cov[1, 1]
    return Frontier(a=math.exp(ln_a_ref + b * lr), a_rel_err=math.sqrt(max(ln_a_var, 0.0)), b=b,
                    b_err=math.sqrt(max(cov[1, 1], 0.0)), e=e, e_err=math.sqrt(max(cov[2, 2], 0.0)), ref=ref,
                    cov=tuple(tuple(float(v) for v in row) for row in cov), params_ref=(ln_a_ref, b, e))


def fit_isoflops(runs: list[RunResult], min_points: int = 4) -> tuple[list[IsoFlopFit], list[DroppedBudget]]:
    """Each budget's parabola where its runs bracket the optimum; the others left out, with why
    (too few runs, loss curving downward, or a minimum outside the sizes trained)."""
    by_budget: dict[float, list[RunResult]] = {}
    for r in runs:
        by_budget.setdefault(r.budget, []).append(r)
    fits, dropped = [], []
    for budget, rs in sorted(by_budget.items()):
        try:
            fits.append(fit_isoflop(rs, min_points))
        except FitError as e:
            dropped.append(DroppedBudget(budget, len(rs), str(e)))
    return fits, dropped


def fit_scaling_law(runs: list[RunResult], min_points: int = 4, bootstrap: int = 200, level: float = 0.9,
                    seed: int = 0) -> ScalingLaw:
    """The isoFLOP law from the budgets that bracket their optimum (the rest reported in `dropped`),
    and the parametric law over every run with `bootstrap` refits for its intervals (0: none) and
    its backtest (`Backtest`, with 3 budgets or more). FitError only when fewer than 3 budgets are
    left for the frontier, naming those dropped."""
    fits, dropped = fit_isoflops(runs, min_points)
    if len(fits) < 3:
        why = "; ".join(f"{budget_label(d.budget)} left out: {d.reason}" for d in dropped) or "none left out"
        raise FitError(f"the frontier L = a*C^-b + e has 3 parameters and needs at least 3 budgets whose runs bracket "
                       f"their optimum, got {len(fits)} ({', '.join(budget_label(f.budget) for f in fits) or 'none'}); "
                       f"{why}. Add budgets, or sizes on the side where a left-out budget's optimum lies")
    c = np.array([f.budget for f in fits])
    n_opt = fit_power_law(c, np.array([f.n_opt for f in fits]), np.array([f.ln_n_opt_err for f in fits]))
    d_opt = fit_power_law(c, np.array([f.d_opt for f in fits]), np.array([f.ln_d_opt_err for f in fits]))
    frontier = fit_frontier(c, np.array([f.loss_opt for f in fits]), np.array([f.loss_opt_err for f in fits]))
    parametric = fit_parametric(runs)
    boot = bootstrap_parametric(runs, parametric, bootstrap, level, seed) if bootstrap else None
    return ScalingLaw(fits, n_opt, d_opt, frontier, sorted(runs, key=lambda r: (r.budget, r.params, r.name)), dropped,
                      parametric, boot, backtest_parametric(runs))


# --- plots --------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _budget_axis(ax, budgets) -> None:
    """A log x axis of budgets, labelled at the budgets (matplotlib's own minor labels collide
    when the axis spans about one decade)."""
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(sorted(budgets), [budget_label(c) for c in sorted(budgets)])


def plot_isoflops(law: ScalingLaw, path: Path) -> None:
    """Loss against N for each budget: the runs, the fitted parabola and its minimum (with error),
    the parametric law along the budget (dashed); a budget left out of the isoFLOP fit in hollow
    markers, without a parabola."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    budgets = sorted({r.budget for r in law.runs})
    colors = dict(zip(budgets, plt.cm.viridis(np.linspace(0, 0.9, len(budgets)))))
    fitted = {f.budget: f for f in law.budgets}
    for budget in budgets:
        pts = [r for r in law.runs if r.budget == budget]
        n = np.array([r.params for r in pts])
        grid = np.exp(np.linspace(np.log(n.min()) - 0.15, np.log(n.max()) + 0.15, 100))
        color = colors[budget]
        if law.parametric is not None:
            p = law.parametric
            ax.plot(grid, p.loss(grid, budget / p.flops_per_token(grid)), "--", color=color, alpha=0.6, lw=1)
        if budget not in fitted:
            ax.plot(n, [r.loss for r in pts], "o", mfc="none", color=color,
                    label=f"C = {budget_label(budget)} (left out of the isoFLOP fit)")
            continue
        fit = fitted[budget]
        ax.plot(n, [r.loss for r in pts], "o", color=color, label=f"C = {budget_label(fit.budget)}")
        ax.plot(grid, fit.curve(grid), "-", color=color, alpha=0.7)
        lo, hi = fit.n_opt * math.exp(-fit.ln_n_opt_err), fit.n_opt * math.exp(fit.ln_n_opt_err)
        ax.errorbar([fit.n_opt], [fit.loss_opt], xerr=[[fit.n_opt - lo], [hi - fit.n_opt]],
                    yerr=[fit.loss_opt_err], fmt="*", ms=13, color=color, mec="k", capsize=3)
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel("held-out bits per byte")
    ax.set_title("IsoFLOP curves (stars: fitted minima, 1 s.e.; dashed: parametric L(N, D))")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_optimal(law: ScalingLaw, path: Path, extra: list[float] = ()) -> None:
    """N_opt and D_opt against C on log-log axes, with the fitted power laws."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    c = np.array([f.budget for f in law.budgets])
    span = np.exp(np.linspace(np.log(min([*c, *extra])) - 0.2, np.log(max([*c, *extra])) + 0.2, 50))
    for ax, key, law_fit, label in ((axes[0], "n_opt", law.n_opt, "N_opt (parameters)"),
                                    (axes[1], "d_opt", law.d_opt, "D_opt (tokens)")):
        y = np.array([getattr(f, key) for f in law.budgets])
        err = np.array([getattr(f, f"ln_{key}_err") for f in law.budgets])
        ax.errorbar(c, y, yerr=[y - y * np.exp(-err), y * np.exp(err) - y], fmt="o", capsize=3, label="isoFLOP minima")
        ax.plot(span, law_fit(span), "-",
                label=f"{law_fit.coefficient:.3g} C^({law_fit.exponent:.3f} ± {law_fit.exponent_err:.3f})")
        _budget_axis(ax, [*c, *extra])
        ax.set_yscale("log")
        ax.set_xlabel("budget C (FLOPs)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("Compute-optimal size and data")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_frontier(law: ScalingLaw, path: Path, forecast: dict | None = None) -> None:
    """Every run's loss against its budget, the isoFLOP minima and L(C) = a C^-b + e, the
    parametric law's L_opt(C) with its bootstrap band; with `forecast` ({budget, loss, interval,
    actual, relative_error} and optionally backtest: {loss, interval}), the held-out budget's
    predicted loss (and the backtest's correction of it, just right of it) and the one trained there."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    ax.plot([r.budget for r in law.runs], [r.loss for r in law.runs], "o", color="0.6", ms=4, label="runs")
    c = np.array([f.budget for f in law.budgets])
    ax.errorbar(c, [f.loss_opt for f in law.budgets], yerr=[f.loss_opt_err for f in law.budgets], fmt="*",
                ms=11, color="C0", capsize=3, label="isoFLOP minima")
    hi = max(c.max(), forecast["budget"]) if forecast else c.max()
    span = np.exp(np.linspace(np.log(c.min()) - 0.2, np.log(hi) + 0.2, 100))
    f = law.frontier
    ax.plot(span, f(span), "-", color="C0",
            label=f"L = {f.a:.3g} C^-{f.b:.3f} + {f.e:.3f}")
    band = f.err(span)
    ax.fill_between(span, f(span) - band, f(span) + band, color="C0", alpha=0.15)
    if law.parametric is not None:
        p, boot = law.parametric, law.bootstrap
        some = span[np.linspace(0, len(span) - 1, 15).round().astype(int)]  # ends included; 200 refits each
        ax.plot(some, [p.optimum(c)[2] for c in some], "-", color="C2",
                label=f"parametric L_opt(C) (alpha {p.alpha:.2f}, beta {p.beta:.2f})")
        if boot is not None:
            band = np.array([boot.interval(_optima(np.asarray(boot.thetas), c, p)[2]) for c in some])
            ax.fill_between(some, band[:, 0], band[:, 1], color="C2", alpha=0.15)
    if forecast:
        lo, hi = forecast["interval"]
        ax.errorbar([forecast["budget"]], [forecast["loss"]], yerr=[[forecast["loss"] - lo], [hi - forecast["loss"]]],
                    fmt="D", color="C3", capsize=3, label=f"forecast at {budget_label(forecast['budget'])}")
        if forecast.get("backtest"):
            bt = forecast["backtest"]
            lo, hi = bt["interval"]
            ax.errorbar([forecast["budget"] * 1.08], [bt["loss"]], yerr=[[bt["loss"] - lo], [hi - bt["loss"]]],
                        fmt="D", color="C1", capsize=3, label="corrected by the backtest")
        ax.plot([forecast["budget"]], [forecast["actual"]], "X", color="k", ms=10,
                label=f"trained: {forecast['actual']:.4f} ({forecast['relative_error']:+.2%})")
    _budget_axis(ax, [*c, forecast["budget"]] if forecast else c)
    ax.set_xlabel("budget C (FLOPs)")
    ax.set_ylabel("held-out bits per byte")
    ax.set_title("Loss frontier")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
