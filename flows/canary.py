"""The canary: a small config run daily into a fresh store, failing when its results leave bounds.

The day a change stops the pipeline from reproducing (training diverges, an evaluation breaks, a
step gets slow), the canary fails and names what moved: Marin's daily "ferry" with a metrics gate.
Its store is `<root>/<YYYY-MM-DD>` (UTC; the root defaults to the store's own with `-canary` after it), so each day computes everything from the raw
sources; a rerun the same day reuses that day's finished steps, and its wall time is then the
rerun's. The bounds are the config's `canary:` section (flows/config.py `CanaryConfig`); each is
checked on every branch's final model (its last train step's stats, and the evaluate step of that
model or of the soup after it). The
failure is the flow run's: it sends the `run.notify_webhook` notification like any failed run.
"""

from __future__ import annotations

import datetime as dt
import time

from prefect import flow

from flows.compare import _evaluation_of, final_model
from flows.config import CanaryConfig, ExperimentConfig
from flows.experiment import Experiment, from_config
from flows.notify import notify_failure
from flows.pipeline import run_experiment
from tasks.engine.store import Store


class CanaryFailed(RuntimeError):
    """The canary's run finished, and results left their bounds; the message names each."""


def canary_store(root: str, day: str) -> str:
    """The day's store under `root` (a path or fsspec URL)."""
    return f"{root.rstrip('/')}/{day}"


def today() -> str:
    return dt.datetime.now(dt.timezone.utc).date().isoformat()


def results(experiment: Experiment, store: Store) -> dict[str, dict]:
    """Branch label -> the numbers the bounds are checked against: the final train step's stats
    (final_loss, steps, ...) with the metrics of the evaluate step that scored the final model
    (that train step's, or the soup's after it: what post-training and the export start from)."""
    out = {}
    for variant in experiment.branches:
        steps = experiment.branch_steps(variant)
        trains = [s for s in steps if s.stage == "train"]
        if not trains:
            continue
        final = trains[-1]
        values = dict(store.read_lineage(final.stage, final.version)["stats"]) if store.is_done(
            final.stage, final.version) else {}
        evaluation = _evaluation_of(final_model(steps), steps)
        if evaluation is not None and store.is_done(evaluation.stage, evaluation.version):
            values.update(store.read_lineage(evaluation.stage, evaluation.version)["stats"])
        out[variant or experiment.name] = values
    return out


def violations(found: dict[str, dict], bounds: CanaryConfig, wall_s: float | None) -> list[str]:
    """One line per bound a branch's result breaks (a missing result breaks it too)."""
    problems = []
    if bounds.max_wall_s is not None and wall_s is not None and wall_s > bounds.max_wall_s:
        problems.append(f"wall time {wall_s:.0f} s > max_wall_s {bounds.max_wall_s:g}")
    for label, values in found.items():
        checks = [("final_loss", bounds.max_final_loss, "max_final_loss", False),
                  ("steps", bounds.min_steps, "min_steps", True)]
        checks += [(m, v, f"min.{m}", True) for m, v in bounds.min.items()]
        checks += [(m, v, f"max.{m}", False) for m, v in bounds.max.items()]
        for metric, bound, name, at_least in checks:
            if bound is None:
                continue
            value = values.get(metric)
            if not isinstance(value, (int, float)):
                problems.append(f"{label}: {metric} was not reported (bound {name} {bound:g})")
            elif (value < bound) if at_least else (value > bound):
                problems.append(f"{label}: {metric} {value:.4g} {'<' if at_least else '>'} {name} {bound:g}")
    return problems


def check(config: ExperimentConfig, store: Store, wall_s: float | None = None) -> dict[str, dict]:
    """The results of a finished store, or CanaryFailed naming every bound they break."""
    bounds = config.canary or CanaryConfig()
    found = results(from_config(config), store)
    problems = violations(found, bounds, wall_s)
    if problems:
        raise CanaryFailed(f"canary {config.name} in {store.root} left its bounds: " + "; ".join(problems))
    return found


@flow(name="canary", log_prints=True, on_failure=[notify_failure])
def canary(config: ExperimentConfig, store_root: str, day: str | None = None) -> dict[str, dict]:
    """Run `config` into `<store_root>/<day>` (default today, UTC) and check its `canary:`
    bounds; fails naming each result that left them."""
    store = Store(canary_store(store_root, day or today()))
    t0 = time.perf_counter()
    run_experiment(from_config(config), store)
    wall_s = time.perf_counter() - t0
    found = check(config, store, wall_s)
    print(f"canary {config.name}: passed in {wall_s:.0f} s ({store.root}): "
          + "; ".join(f"{label}: final_loss={v.get('final_loss')}" for label, v in found.items()))
    return found
