"""Which budgets make the forecast trustworthy: refit a finished sweep's runs on subsets of its
budgets and score each fit on the largest budget, left out of all of them.

    uv run kiln run configs/scaling_cpu.yaml --store S          # the sweep (or a variant of it)
    uv run python benchmarks/scaling_holdout.py S [--fit 1.5e10,3e10,6e10,1.2e11 --fit 3e10,6e10,1.2e11 ...]

It reads the runs from the store's full fit (the `scaling_fit` output holding the most runs) and
needs no training. For each subset of budgets (default: every budget below the held-out one, and
every subset with one of them left out) it prints the parametric law's held-out errors (at each
size trained there, and how many lie inside the 90% interval for one run: the share that says
whether the interval is honest), the same for the forecast corrected by the fit's backtest, and
the isoFLOP frontier's forecast of the held-out budget's best loss against the best trained. The
same fits and intervals as the scaling steps (training/scaling.py `fit_scaling_law`, 200 bootstrap
refits, seed 0, its backtest).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.scaling import FitError, RunResult, budget_label, fit_scaling_law, law_from_json  # noqa: E402


def sweep_runs(store: Path) -> list[RunResult]:
    """The runs of the store's fullest fit: every `scaling_fit/<version>/law.json`, the one with most runs."""
    laws = sorted(store.glob("scaling_fit/*/law.json"))
    if not laws:
        raise SystemExit(f"no scaling_fit/<version>/law.json under {store}: run the sweep into it first "
                         "(uv run kiln run configs/scaling_cpu.yaml --store STORE)")
    return max((law_from_json(json.loads(p.read_text())).runs for p in laws), key=len)


def score(runs: list[RunResult], budgets: tuple[float, ...], heldout: float, bootstrap: int) -> dict:
    """Fit on `budgets`' runs; the held-out budget's runs against the parametric law's interval
    for one run, and against it corrected by the law's backtest (where it has one), and its best
    run against the isoFLOP frontier."""
    fit_runs = [r for r in runs if r.budget in budgets]
    test = sorted((r for r in runs if r.budget == heldout), key=lambda r: r.params)
    law = fit_scaling_law(fit_runs, bootstrap=bootstrap)
    rows = []
    for r in test:
        at = law.bootstrap.at(law.parametric, r.params, r.tokens, law.backtest)
        lo, hi = at["run_interval"]
        rows.append({"params": r.params, "trained": r.loss, "predicted": at["loss"],
                     "error": at["loss"] / r.loss - 1, "inside": lo <= r.loss <= hi, "width": hi - lo})
        if law.backtest is not None:
            lo, hi = at["backtest_run_interval"]
            rows[-1].update({"backtest": at["backtest_loss"], "backtest_error": at["backtest_loss"] / r.loss - 1,
                             "backtest_inside": lo <= r.loss <= hi, "backtest_width": hi - lo})
    best = min(test, key=lambda r: r.loss)
    frontier = float(law.frontier(heldout))
    return {"budgets": budgets, "rows": rows,
            "dropped": [budget_label(d.budget) for d in law.dropped],
            "parametric_rms_error": float(np.sqrt(np.mean([x["error"] ** 2 for x in rows]))),
            "inside": sum(x["inside"] for x in rows), "mean_width": float(np.mean([x["width"] for x in rows])),
            "backtest_inside": sum(x.get("backtest_inside", False) for x in rows) if law.backtest else None,
            "frontier": frontier, "frontier_err": float(law.frontier.err(heldout)), "best": best.loss,
            "frontier_error": frontier / best.loss - 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", type=Path)
    parser.add_argument("--fit", action="append", default=[], metavar="C1,C2,...",
                        help="budgets to fit on (repeatable); default: all below the held-out one, and each "
                             "subset with one of them left out")
    parser.add_argument("--heldout", type=float, help="the budget to score on (default: the largest)")
    parser.add_argument("--bootstrap", type=int, default=200)
    args = parser.parse_args()

    runs = sweep_runs(args.store)
    budgets = sorted({r.budget for r in runs})
    heldout = args.heldout or budgets[-1]
    below = tuple(b for b in budgets if b != heldout)
    subsets = [tuple(float(c) for c in f.split(",")) for f in args.fit] or \
        [below] + [s for s in itertools.combinations(below, len(below) - 1)]
    print(f"{len(runs)} runs, budgets {', '.join(budget_label(b) for b in budgets)}; held out: {budget_label(heldout)} "
          f"({sum(r.budget == heldout for r in runs)} runs)")
    print(f"{'fitted on':<36} {'param rms err':>13} {'inside 90%':>10} {'mean width':>10} "
          f"{'frontier':>16} {'best':>7} {'err':>7}  dropped")
    for subset in subsets:
        try:
            s = score(runs, subset, heldout, args.bootstrap)
        except FitError as e:
            print(f"{', '.join(budget_label(b) for b in subset):<36} fit failed: {e}")
            continue
        print(f"{', '.join(budget_label(b) for b in subset):<36} {100 * s['parametric_rms_error']:>12.2f}% "
              f"{s['inside']:>4} of {len(s['rows']):<3} {s['mean_width']:>10.4f} "
              f"{s['frontier']:>8.4f} ± {s['frontier_err']:.4f} {s['best']:>7.4f} {100 * s['frontier_error']:>+6.2f}%"
              f"  {', '.join(s['dropped']) or '-'}")
        if s["backtest_inside"] is not None:
            print(f"    corrected by the backtest: {s['backtest_inside']} of {len(s['rows'])} inside")
        for x in s["rows"]:
            print(f"    N {x['params']:>9,.0f}: trained {x['trained']:.4f}, predicted {x['predicted']:.4f} "
                  f"({100 * x['error']:+.2f}%), {'inside' if x['inside'] else 'outside'} (width {x['width']:.4f})"
                  + (f"; backtest {x['backtest']:.4f} ({100 * x['backtest_error']:+.2f}%), "
                     f"{'inside' if x['backtest_inside'] else 'outside'} (width {x['backtest_width']:.4f})"
                     if "backtest" in x else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
