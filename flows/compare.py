"""`kiln compare`: one row per variant (or sweep run) with its key results, read from the store.

A row is a train step (or a soup phase: "-" for its training numbers) of the experiment with what
its variant changed, the train step's numbers (final losses, with `train.ema` the average's
validation loss too, parameters, tokens, seconds), every
metric of the evaluate step that scored it, and the seconds of every step in the variant's
branch; a train step several branches share (the stable run of cooldown branches) is one row,
named after the step. The SFT and DPO models of a
post-trained variant follow its row as rows of their own (`<variant>:sft`, `<variant>:dpo`), with
their training numbers and the metrics of their evaluate steps (posttrain.evaluate), so the base
and post-trained models compare on the same tasks. A variant whose steps are not in the store
yet shows `missing`, never zeros.
"""

from __future__ import annotations

import io
import json

from flows.experiment import Experiment
from tasks.engine.step import Step
from tasks.engine.store import Store

TRAIN_KEYS = {"final_loss": "final_loss", "final_val_loss": "final_val_loss",
              "final_ema_val_loss": "final_ema_val_loss", "params": "param_count",
              "tokens": "tokens", "soup_parts": "kept_parts"}  # column -> the train (or soup) step's stat
# columns shown only when some row has them: a run with train.ema, a soup (the parts it averaged)
ONLY_IF_MEASURED = {"final_ema_val_loss", "soup_parts"}
NOT_METRICS = {"seconds", "table", "heldout_tokens", "suite_examples"}
POSTTRAINED = ("sft", "dpo")  # stages whose models get rows of their own after their variant's train rows
TRAINED = ("train", "soup")  # a soup phase (the mean of trained models) is a row among the train steps'
NOT_TRAINED = "-"  # a soup's training numbers: it trained nothing
MISSING = "missing"


def comparison(experiment: Experiment, store: Store) -> list[dict]:
    """The compare table as rows of plain values (None where a variant has no such result)."""
    rows, shown = [], set()
    for variant, branch in experiment.branches.items():
        steps = experiment.branch_steps(variant)
        trains = [s for s in steps if s.stage in TRAINED]
        for train in trains:
            if train.key in shown:  # a train step several branches share (a stable run): one row
                continue
            shown.add(train.key)
            label = variant or experiment.name
            shared = len(experiment.variants_of[train.key]) > 1
            if shared:
                label = train.name
            elif len(trains) > 1:  # a sweep or phases: one row per run, named without the variant label
                run = train.name.removesuffix(f"/{'+'.join(experiment.variants_of[train.key])}").split("/", 1)[-1]
                label = f"{label}:{run}" if variant else run
            rows.append(_row(label, {} if shared else branch.overrides, train, _evaluation_of(train, steps), steps,
                             store))
        for model in (s for s in steps if s.stage in POSTTRAINED and s.key not in shown):
            shown.add(model.key)
            shared = len(experiment.variants_of[model.key]) > 1
            label = model.name if shared else f"{variant or experiment.name}:{model.stage}"
            rows.append(_row(label, {} if shared else branch.overrides, model, _evaluation_of(model, steps), steps,
                             store))
    cols = [c for c in columns(rows)  # every row has every column: None where a variant has no such result yet
            if c not in ONLY_IF_MEASURED or any(_is_metric(c, r.get(c)) for r in rows)]
    return [{c: r.get(c) for c in cols} for r in rows]


def final_model(steps: list[Step]) -> Step | None:
    """A branch's final pretrained model: its last train or soup step, the one post-training and
    the export start from (flows/plan.py `after_training`)."""
    return next((s for s in reversed(steps) if s.stage in TRAINED), None)


def _evaluation_of(train: Step, steps: list[Step]) -> Step | None:
    """The evaluate step of the trained model (not of one of its kept steps)."""
    return next((s for s in _evaluations_of(train, steps) if s.config.step is None), None)


def _evaluations_of(train: Step, steps: list[Step]) -> list[Step]:
    return [s for s in steps if s.stage == "evaluate" and s.inputs["model"].key == train.key]


def over_steps(experiment: Experiment, store: Store) -> list[dict]:
    """`kiln compare --over steps`: one row per evaluated training step (eval.checkpoints) of each
    variant, with every metric of its evaluate step; `missing` where it has not run yet. The
    final model's evaluation ends each variant's rows, at the train step's last step, unless the
    series has that step already (a kept step holds the model as published: the same scores)."""
    rows = []
    for variant in experiment.branches:
        steps = experiment.branch_steps(variant)
        for train in (s for s in steps if s.stage == "train"):
            evaluations = _evaluations_of(train, steps)
            series = sorted(((s.config.step, s) for s in evaluations if s.config.step is not None),
                            key=lambda pair: pair[0])
            last = train.config.train.steps
            if series and series[-1][0] != last:
                series += [(last, s) for s in evaluations if s.config.step is None]
            for at, evaluation in series:
                scored = store.is_done(evaluation.stage, evaluation.version)
                row = {"variant": variant or experiment.name, "step": at,
                       "status": "done" if scored else MISSING}
                if scored:
                    scores = store.read_lineage(evaluation.stage, evaluation.version)["stats"]
                    row.update({k: v for k, v in scores.items() if _is_metric(k, v)})
                row["evaluate_version"] = evaluation.version
                rows.append(row)
    cols = columns(rows)
    return [{c: r.get(c) for c in cols} for r in rows]


def _row(label: str, overrides: dict, train: Step, evaluation: Step | None, steps: list[Step], store: Store) -> dict:
    done = store.is_done(train.stage, train.version)
    scored = evaluation is not None and store.is_done(evaluation.stage, evaluation.version)
    row: dict = {"variant": label, "status": "done" if done and (evaluation is None or scored) else MISSING,
                 "overrides": ", ".join(f"{k}={json.dumps(v)}" for k, v in overrides.items())}
    stats = store.read_lineage(train.stage, train.version)["stats"] if done else {}
    absent = NOT_TRAINED if done and train.stage == "soup" else None  # a soup trained nothing
    absent_only = NOT_TRAINED if done else None  # a finished run without the stat: it does not apply
    row.update({column: stats.get(key, absent_only if column in ONLY_IF_MEASURED else absent)
                for column, key in TRAIN_KEYS.items()})
    row["train_seconds"] = stats.get("seconds")
    if scored:
        scores = store.read_lineage(evaluation.stage, evaluation.version)["stats"]
        row.update({k: v for k, v in scores.items() if _is_metric(k, v)})
    seconds = [store.read_lineage(s.stage, s.version)["stats"].get("seconds", 0.0)
               for s in steps if store.is_done(s.stage, s.version)]
    row["branch_seconds"] = round(sum(seconds), 1) if len(seconds) == len(steps) else None
    row["train_version"] = train.version
    return row


def _is_metric(key: str, value) -> bool:
    return (key not in NOT_METRICS and not key.endswith("_examples") and isinstance(value, (int, float))
            and not isinstance(value, bool))


def columns(rows: list[dict]) -> list[str]:
    """Every key any row has, in first-seen order."""
    return list(dict.fromkeys(k for r in rows for k in r))


def cells(rows: list[dict]) -> list[list[str]]:
    return [[_cell(v) for v in r.values()] for r in rows]


def _cell(value) -> str:
    if value is None:
        return MISSING
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def steps_plot(rows: list[dict], metric: str) -> bytes | None:
    """One line per variant of `metric` against the training step (rows of `over_steps`); None
    when no step has it yet."""
    lines: dict[str, list] = {}
    for r in rows:
        if isinstance(r.get(metric), (int, float)):
            lines.setdefault(r["variant"], []).append((r["step"], r[metric]))
    if not lines:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for variant, points in lines.items():
        ax.plot(*zip(*points), "o-", label=variant)
    ax.set_xlabel("training step")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} over training")
    ax.grid(alpha=0.3)
    ax.legend()
    return _png(fig)


def metric_plot(rows: list[dict], metric: str) -> bytes | None:
    """A bar chart (PNG) of one metric per variant; None when no variant has it yet."""
    points = [(r["variant"], r[metric]) for r in rows if isinstance(r.get(metric), (int, float))]
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(points)), 3.2))
    ax.bar([p[0] for p in points], [p[1] for p in points], color="#4a7ab0")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per variant")
    ax.tick_params(axis="x", labelrotation=30)
    return _png(fig)


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
