"""The scaling-law recipe and fitters: known laws in, the same parameters out; budgets that cannot
be fitted left out and reported; the forecast's interval holds the truth.

Pure numpy/scipy on synthetic losses (no training), so this file runs in seconds.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from pydantic import ValidationError

from training.config import flops_per_token, matmul_params
from training.scaling import (BudgetError, FitError, ParametricLaw, RunResult, ScalingConfig, backtest_parametric,
                              bootstrap_parametric, fit_isoflop, fit_parametric, fit_scaling_law, isoflop_grid,
                              law_from_json, nearest_size, plan_run, plot_frontier, plot_isoflops, plot_optimal,
                              shape)

BUDGETS = [1e11, 2e11, 4e11, 8e11, 1.6e12]


def isoflop_runs(budget, n_opt, loss_opt, curvature, rng, noise, spread=1.2, points=7):
    """Runs of one budget on the fitter's own model: a parabola in ln N around a known minimum."""
    runs = []
    for u in np.linspace(-spread, spread, points):
        n = n_opt * math.exp(u)
        runs.append(RunResult(budget, n, budget / (6 * n), loss_opt + curvature * u * u + rng.normal(0, noise)))
    return runs


def within(estimate, truth, err, sigmas=3.0):
    return abs(estimate - truth) <= sigmas * err


def test_fit_recovers_a_known_law_within_its_uncertainties():
    # N_opt = 0.08 C^0.5 (so D_opt = C / 6N = 2.08 C^0.5), L_opt = 300 C^-0.25 + 0.9, noise 0.003 bits
    rng = np.random.default_rng(0)
    n0, alpha, a, b, e = 0.08, 0.5, 300.0, 0.25, 0.9
    runs = []
    for c in BUDGETS:
        runs += isoflop_runs(c, n0 * c ** alpha, a * c ** -b + e, curvature=0.05, rng=rng, noise=0.003)
    law = fit_scaling_law(runs, bootstrap=0)

    assert [f.points for f in law.budgets] == [7] * 5 and law.dropped == []
    assert within(law.n_opt.exponent, alpha, law.n_opt.exponent_err)
    assert 0 < law.n_opt.exponent_err < 0.05  # informative, not inflated until anything passes
    assert within(math.log(law.n_opt.coefficient), math.log(n0), law.n_opt.ln_coefficient_err)
    assert within(law.d_opt.exponent, 1 - alpha, law.d_opt.exponent_err)
    assert within(math.log(law.d_opt.coefficient), math.log(1 / (6 * n0)), law.d_opt.ln_coefficient_err)
    f = law.frontier
    assert within(f.b, b, f.b_err) and f.b_err < 0.1
    assert within(f.e, e, f.e_err) and f.e_err < 0.1
    assert within(math.log(f.a), math.log(a), f.a_rel_err)
    for fit in law.budgets:  # each minimum where the generating law put it
        assert within(math.log(fit.n_opt), math.log(n0 * fit.budget ** alpha), fit.ln_n_opt_err, 4)
        assert within(fit.loss_opt, a * fit.budget ** -b + e, fit.loss_opt_err, 4)
    # A prediction one budget beyond the fitted ones lands on the true law.
    pred = law.predict(3.2e12)["isoflop"]
    assert abs(pred["loss"] / (a * 3.2e12 ** -b + e) - 1) < 0.01
    assert abs(math.log(pred["n_opt"] / (n0 * 3.2e12 ** alpha))) < 3 * pred["ln_n_opt_err"]


def test_fit_recovers_chinchilla_exponents_from_its_parametric_loss():
    # Hoffmann et al. (2022) approach 3's fitted law, sampled on isoFLOP grids like theirs: the
    # isoFLOP minima follow N_opt ~ C^(beta/(alpha+beta)) and L_opt = E + k C^(-alpha beta/(alpha+beta)).
    E, A, B, al, be = 1.69, 406.4, 410.7, 0.34, 0.28
    rng = np.random.default_rng(1)
    runs = []
    for c in [1e18, 3e18, 1e19, 3e19, 1e20, 3e20]:
        g = (al * A / (be * B)) ** (1 / (al + be))  # N_opt = g (C/6)^(be/(al+be))
        n_opt = g * (c / 6) ** (be / (al + be))
        for u in np.linspace(-1.5, 1.5, 9):
            n = n_opt * math.exp(u)
            d = c / (6 * n)
            runs.append(RunResult(c, n, d, E + A / n ** al + B / d ** be + rng.normal(0, 0.002)))
    law = fit_scaling_law(runs, bootstrap=0)
    assert abs(law.n_opt.exponent - be / (al + be)) < 0.02
    assert abs(law.d_opt.exponent - al / (al + be)) < 0.02
    assert abs(law.frontier.b - al * be / (al + be)) < 0.03
    assert abs(law.frontier.e - E) < 0.05


def test_a_budget_with_too_few_points_is_left_out_and_fatal_only_when_too_few_budgets_remain():
    rng = np.random.default_rng(2)
    good = isoflop_runs(1e11, 3e4, 2.0, 0.05, rng, 0.0, points=5)
    few = isoflop_runs(2e11, 4e4, 1.9, 0.05, rng, 0.0, points=3)
    with pytest.raises(FitError, match=r"budget 2e\+11 has 3 finished runs.*at least 4"):
        fit_isoflop(few)
    more = isoflop_runs(4e11, 5e4, 1.8, 0.05, rng, 0.0) + isoflop_runs(8e11, 6e4, 1.7, 0.05, rng, 0.0)
    law = fit_scaling_law(good + few + more, bootstrap=0)  # 3 budgets left: fitted, 2e11 reported
    assert [f.budget for f in law.budgets] == [1e11, 4e11, 8e11]
    assert [(d.budget, d.points) for d in law.dropped] == [(2e11, 3)] and "at least 4" in law.dropped[0].reason
    # With 2 budgets left the frontier cannot be fitted: the error says which were left out and why.
    with pytest.raises(FitError, match=r"needs at least 3 budgets .* got 2 \(1e11, 4e11\); 2e11 left out: budget "
                                       r"2e\+11 has 3 finished runs"):
        fit_scaling_law(good + few + more[:7], bootstrap=0)
    assert fit_isoflop(few, min_points=3).n_opt == pytest.approx(4e4, rel=1e-6)  # exact with 3, if asked
    with pytest.raises(FitError, match="needs at least 3 budgets"):
        fit_scaling_law(good + isoflop_runs(4e11, 5e4, 1.8, 0.05, rng, 0.0), bootstrap=0)


def test_a_budget_without_a_bracketed_minimum_is_refused():
    rng = np.random.default_rng(3)
    off_grid = isoflop_runs(1e11, 3e4, 2.0, 0.05, rng, 0.0, spread=1.0)
    shifted = [RunResult(r.budget, r.params * 10, r.tokens / 10, r.loss - 0.2 * math.log(r.params / 3e4))
               for r in off_grid]  # loss still falling at the largest size
    with pytest.raises(FitError, match="does not bracket the optimum|curves downward"):
        fit_isoflop(shifted)
    hump = [RunResult(r.budget, r.params, r.tokens, 3 - r.loss) for r in off_grid]
    with pytest.raises(FitError, match="curves downward"):
        fit_isoflop(hump)


def test_recipe_spends_each_budget_and_refuses_runs_that_cannot():
    cfg = ScalingConfig(budgets=[1e11, 2e11, 4e11, 8e11], shapes_per_budget=4)
    for c in cfg.budgets:
        grid = isoflop_grid(c, cfg, vocab_size=1024)
        assert len(grid) == 4 and len({p.size for p in grid}) == 4
        for p in grid:
            assert p.flops == flops_per_token(p.model) * p.tokens
            assert abs(p.flops / c - 1) <= cfg.tolerance
            assert p.tokens == p.train.steps * p.train.batch_size * p.model.seq_len
            assert p.params == matmul_params(p.model) and p.train.warmup < p.train.steps
    # a shape too large for the budget: fewer than min_steps whole steps
    with pytest.raises(BudgetError, match="fewer than min_steps"):
        plan_run(1e11, 100, cfg.model_copy(update={"max_size": 100}), 1024)
    # whole steps that miss the budget by more than the tolerance
    strict = cfg.model_copy(update={"tolerance": 1e-5})
    with pytest.raises(BudgetError, match="off .tolerance"):
        plan_run(1e11, 4, strict, 1024)


def test_a_run_is_the_same_whichever_other_budgets_the_sweep_has():
    small = ScalingConfig(budgets=[1e11, 2e11, 4e11, 8e11], shapes_per_budget=4)
    large = ScalingConfig(budgets=[8e11, 4e11, 1.6e12, 2e11, 3.2e12], shapes_per_budget=4)
    for c in [2e11, 4e11, 8e11]:
        a, b = isoflop_grid(c, small, 1024), isoflop_grid(c, large, 1024)
        assert [(p.model, p.train) for p in a] == [(p.model, p.train) for p in b]


def test_shape_rule_and_config_checks():
    cfg = ScalingConfig(budgets=[1e11, 2e11, 4e11, 8e11])
    m = shape(16, cfg, 1024)  # d_model 4k, 2 layers until d_model / 48 rounds to more, heads of 4
    assert (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff) == (64, 2, 16, 16, 172)
    assert shape(30, cfg.model_copy(update={"max_size": 30}), 1024).n_layers == 3
    sizes = [matmul_params(shape(k, cfg, 1024)) for k in range(2, 20)]
    assert sizes == sorted(sizes)  # the ladder grows
    assert nearest_size(sizes[6] * 1.05, 8e11, cfg, 1024).size == 8  # sizes[6] is k = 8
    with pytest.raises(ValueError, match="outside 2"):
        shape(1, cfg, 1024)
    with pytest.raises(ValidationError, match="at least 4 budgets"):
        ScalingConfig(budgets=[1e11, 2e11, 4e11])
    with pytest.raises(ValidationError, match="distinct"):
        ScalingConfig(budgets=[1e11, 1e11, 2e11, 4e11])


def test_plots_are_written_and_the_law_round_trips_through_json(tmp_path):
    rng = np.random.default_rng(4)
    runs = [r for c in BUDGETS[:4] for r in isoflop_runs(c, 0.08 * c ** 0.5, 300 * c ** -0.25 + 0.9, 0.05, rng, 0.003)]
    law = fit_scaling_law(runs, bootstrap=40)
    again = law_from_json(json.loads(json.dumps(law.to_json())))
    assert again.predict(1.6e12) == law.predict(1.6e12) and again.runs == law.runs
    plot_isoflops(law, tmp_path / "isoflops.png")
    plot_optimal(law, tmp_path / "optimal.png", extra=[1.6e12])
    pred = law.predict(1.6e12)["parametric"]
    plot_frontier(law, tmp_path / "frontier.png",
                  forecast={"budget": 1.6e12, "loss": pred["loss"], "interval": pred["run_interval"],
                            "actual": pred["loss"] * 1.01, "relative_error": 0.01})
    for name in ("isoflops", "optimal", "frontier"):
        data = (tmp_path / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# --- the parametric law (approach 3), budgets left out, the bootstrap interval ------------------

# Hoffmann et al.'s fitted law (2022, approach 3), in their units; the runs below spend
# C = (6N + ATTN N^0.6) D (attention 10-50% of 6N here), so the law's optimum must use the same
# FLOPs per token to land on the truth.
TRUTH = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
ATTN = 3000.0


def true_law() -> ParametricLaw:
    t = TRUTH
    return ParametricLaw(math.log(t["A"]), math.log(t["B"]), math.log(t["E"]), t["alpha"], t["beta"], ATTN, 0.6)


def parametric_runs(budgets, rng=None, noise=0.0, points=7, spread=1.2, shift=0.0):
    """Runs of a known L(N, D) around each budget's true optimum (by ln N), `shift` moving the grid,
    each loss times exp(normal(0, noise))."""
    truth, runs = true_law(), []
    for c in budgets:
        n_opt, _, _ = truth.optimum(c)
        for u in np.linspace(-spread, spread, points) + shift:
            n = n_opt * math.exp(u)
            per_token = float(truth.flops_per_token(n))
            d = c / per_token
            loss = float(truth.loss(n, d)) * (math.exp(rng.normal(0, noise)) if noise else 1.0)
            runs.append(RunResult(c, n, d, loss, f"{c:.3g}/{u:+.2f}", flops=per_token * d))
    return runs


def test_the_parametric_fit_recovers_a_known_law_from_noiseless_runs():
    law = fit_parametric(parametric_runs([1e18, 3e18, 1e19, 3e19, 1e20]))
    fitted = {"E": math.exp(law.ln_e), "A": math.exp(law.ln_a), "B": math.exp(law.ln_b), "alpha": law.alpha,
              "beta": law.beta}
    for k, v in TRUTH.items():
        assert fitted[k] == pytest.approx(v, rel=1e-3), k
    # The FLOPs per token the runs spent, recovered: C = (6N + 3000 N^0.6) D
    assert (law.attn_coef, law.attn_exp) == (pytest.approx(ATTN, rel=1e-6), pytest.approx(0.6, rel=1e-6))
    # Its optimum at a budget beyond the runs is the true one: a brute-force search over N of the
    # true L(N, C / flops_per_token(N)).
    c, truth = 1e21, true_law()
    n = np.exp(np.linspace(math.log(1e8), math.log(1e11), 200_001))
    losses = truth.loss(n, c / truth.flops_per_token(n))
    n_opt, d_opt, l_opt = law.optimum(c)
    assert n_opt == pytest.approx(n[np.argmin(losses)], rel=2e-3)
    assert d_opt * float(law.flops_per_token(n_opt)) == pytest.approx(c, rel=1e-9)  # spends exactly C
    assert l_opt == pytest.approx(losses.min(), rel=1e-5)
    # Where attention is left out (C = 6ND), the optimum moves: the FLOPs relation matters.
    plain = ParametricLaw(law.ln_a, law.ln_b, law.ln_e, law.alpha, law.beta)
    assert abs(math.log(plain.optimum(c)[0] / n_opt)) > 0.01


def test_a_budget_that_does_not_bracket_and_a_noisy_one_are_reported_not_fatal():
    budgets = [1e18, 3e18, 1e19, 3e19, 1e20]
    runs = [r for r in parametric_runs(budgets) if r.budget not in (3e18, 1e19)]
    runs += parametric_runs([3e18], shift=2.0)  # every size well above the optimum: loss rises throughout
    hump = 0.3 * (1 - np.linspace(-1, 1, 7) ** 2)  # "noise" that bends the curve downward
    runs += [RunResult(r.budget, r.params, r.tokens, r.loss + h, r.name, r.flops)
             for r, h in zip(parametric_runs([1e19]), hump)]
    law = fit_scaling_law(runs, bootstrap=0)

    assert [f.budget for f in law.budgets] == [1e18, 3e19, 1e20]
    dropped = {d.budget: d for d in law.dropped}
    assert set(dropped) == {3e18, 1e19} and all(d.points == 7 for d in dropped.values())
    assert "does not bracket the optimum" in dropped[3e18].reason and "below the smallest" in dropped[3e18].reason
    assert "curves downward" in dropped[1e19].reason
    # Both are in the report, and their runs still count in the parametric fit.
    data = json.loads(json.dumps(law.to_json()))
    assert {d["budget"] for d in data["dropped"]} == {3e18, 1e19} and len(data["runs"]) == 35
    assert law.parametric.alpha == pytest.approx(TRUTH["alpha"], abs=0.05)


def test_the_bootstrap_interval_holds_the_truth_for_mildly_noisy_runs():
    rng = np.random.default_rng(7)
    runs = parametric_runs([1e18, 3e18, 1e19, 3e19], rng, noise=0.01)
    law = fit_scaling_law(runs, bootstrap=40, level=0.9, seed=0)
    assert law.bootstrap.resample == "runs" and len(law.bootstrap.thetas) == 40
    c, truth = 1e20, true_law()
    n_true, _, l_true = truth.optimum(c)
    pred = law.predict(c)["parametric"]
    lo, hi = pred["loss_interval"]
    assert lo <= l_true <= hi and (hi - lo) / l_true < 0.05  # holds the truth, and says something
    assert pred["n_opt_interval"][0] <= n_true <= pred["n_opt_interval"][1]
    run_lo, run_hi = pred["run_interval"]
    assert run_hi - run_lo > hi - lo  # one run scatters about the law, too
    # The same runs and seed give the same interval; another seed another one.
    again = bootstrap_parametric(runs, law.parametric, 40, 0.9, seed=0).optimum(law.parametric, c)
    assert again["loss_interval"] == pred["loss_interval"]
    other = bootstrap_parametric(runs, law.parametric, 40, 0.9, seed=1).optimum(law.parametric, c)
    assert other["loss_interval"] != pred["loss_interval"]


def test_the_backtest_scores_the_law_without_its_largest_budget_and_corrects_a_biased_forecast():
    budgets = [1e18, 3e18, 1e19, 3e19, 1e20]
    # Runs of the law itself: fitted without 1e20, the law forecasts 1e20 exactly, and says so.
    clean = fit_scaling_law(parametric_runs(budgets), bootstrap=0).backtest
    assert clean.fitted == (1e18, 3e18, 1e19, 3e19) and clean.budget == 1e20 and len(clean.ln_errors) == 7
    assert max(abs(e) for e in clean.ln_errors) < 1e-6
    assert backtest_parametric(parametric_runs(budgets[:2])) is None  # nothing left to score a law on

    # Loss that falls faster with compute than the law's form can follow (as tiny models' does):
    # budget j's losses exp(-0.004 j^2) times the law's (-6.2% at the largest), and 0.3% noise.
    rng = np.random.default_rng(3)
    runs = [RunResult(r.budget, r.params, r.tokens,
                      r.loss * math.exp(-0.004 * budgets.index(r.budget) ** 2 + rng.normal(0, 0.003)), r.name, r.flops)
            for r in parametric_runs(budgets)]
    law = fit_scaling_law([r for r in runs if r.budget < 1e20], bootstrap=40)
    bt = law.backtest
    assert bt.fitted == (1e18, 3e18, 1e19) and bt.budget == 3e19
    below = fit_parametric([r for r in runs if r.budget < 3e19])
    assert bt.ln_errors == pytest.approx([math.log(r.loss / float(below.loss(r.params, r.tokens)))
                                          for r in runs if r.budget == 3e19])
    assert bt.bias < -0.004  # one budget up, the law was too high
    # At 1e20, which none of the fits saw: the law's own interval misses most runs, the backtest's holds them.
    inside = {"run_interval": 0, "backtest_run_interval": 0}
    for r in (r for r in runs if r.budget == 1e20):
        at = law.bootstrap.at(law.parametric, r.params, r.tokens, bt)
        assert at["backtest_loss"] == pytest.approx(at["loss"] * math.exp(bt.bias))
        for key in inside:
            inside[key] += at[key][0] <= r.loss <= at[key][1]
    assert inside["run_interval"] <= 4 and inside["backtest_run_interval"] >= 6, inside
    # The backtest travels with the law's JSON, and the forecast at a budget carries its correction.
    again = law_from_json(json.loads(json.dumps(law.to_json())))
    assert again.backtest == bt
    assert again.predict(1e20)["parametric"]["backtest_run_interval"] == law.predict(1e20)["parametric"][
        "backtest_run_interval"]


def test_with_several_seeds_the_bootstrap_resamples_seeds_within_each_size():
    rng = np.random.default_rng(8)
    one = parametric_runs([1e18, 3e18, 1e19], points=5)
    runs = [RunResult(r.budget, r.params, r.tokens, r.loss * math.exp(rng.normal(0, 0.01)), f"{r.name}/s{s}", r.flops)
            for s in range(2) for r in one]
    law = fit_parametric(runs)
    boot = bootstrap_parametric(runs, law, 5, seed=0)
    assert boot.resample == "seeds" and len(boot.thetas) == 5
    # a size with one seed only: back to resampling whole runs
    assert bootstrap_parametric(runs[:-1], law, 5, seed=0).resample == "runs"


def test_seeds_add_runs_and_keep_the_first_seeds_runs():
    one = ScalingConfig(budgets=[1e11, 2e11, 4e11, 8e11], shapes_per_budget=4)
    two = one.model_copy(update={"seeds": 2})
    a, b = isoflop_grid(2e11, one, 1024), isoflop_grid(2e11, two, 1024)
    assert len(b) == 8 and [(p.model, p.train, p.name) for p in b[:4]] == [(p.model, p.train, p.name) for p in a]
    assert {p.train.seed for p in b[4:]} == {1} and all(p.name.endswith("/seed1") for p in b[4:])
    assert [p.model for p in b[4:]] == [p.model for p in a]
