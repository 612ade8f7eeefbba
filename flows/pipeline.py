"""The flows: the end-to-end pipeline of a config (all its variants), a Python experiment file,
the scheduled data refresh, and evaluation alone. Each runs its steps on the one scheduler
(tasks/engine/scheduler.py), so the flow-run page shows every step as a task with arrows to its
inputs, and shared steps run once."""

from __future__ import annotations

import base64

from prefect import flow

from flows.compare import comparison, final_model, metric_plot, over_steps, steps_plot
from flows.config import ExperimentConfig
from flows.experiment import Experiment, from_config, load_experiment
from flows.notify import notify_failure
from flows.plan import check_starting_points, select, with_followups
from tasks.engine.runner import StepRun
from tasks.engine.scheduler import execute, failures
from tasks.engine.store import Store


class StepsFailed(RuntimeError):
    """Some steps failed (and their dependents did not run); `runs` has how every step went."""

    def __init__(self, runs: list[StepRun]):
        self.runs = runs
        bad = failures(runs)
        super().__init__(f"{len(bad)} step(s) failed or did not run: "
                         + "; ".join(f"{r.name} {r.status}: {r.error}" for r in bad))


def run_experiment(experiment: Experiment, store: Store, until: str | None = None,
                   force: list[str] = ()) -> list[StepRun]:
    """Every step up to `until`, then the steps that can only be built from their outputs (the
    scaling forecast), then the comparison of the variants; raises StepsFailed if any step failed."""
    settings = experiment.run
    how = dict(max_concurrent=settings.max_concurrent, workers=settings.workers, force=frozenset(force),
               lock_url=settings.lock_url, lease_s=settings.lock_lease_s, verify=settings.verify,
               slot_limits=settings.slot_limits)
    steps = select(experiment.steps, until)
    check_starting_points(steps, store)  # before any step runs, not when a train step starts
    runs = execute(steps, store, announce=final_models(experiment), **how)
    if until is None and not failures(runs):
        seen = {(r.stage, r.version) for r in runs}
        more = [s for s in with_followups(experiment, store).steps if (s.stage, s.version) not in seen]
        runs += execute(more, store, **how)
    if len(experiment.branches) > 1:
        publish_comparison(experiment, store)
    if failures(runs):
        raise StepsFailed(runs)
    if runs and "://" not in runs[-1].path:
        publish_lineage(runs[-1])
    return runs


@flow(name="pipeline", log_prints=True, on_failure=[notify_failure])
def pipeline(config: ExperimentConfig, store: str | None = None, until: str | None = None,
             force: list[str] = []) -> list[StepRun]:
    """Raw text to an evaluated, exported model (or, with `scaling`, to a fitted scaling law), for
    every variant of the config. Steps whose version exists are cache hits."""
    return run_experiment(from_config(config), Store(store), until, force)


@flow(name="experiment", log_prints=True, on_failure=[notify_failure])
def experiment_flow(path: str, store: str | None = None, until: str | None = None,
                    force: list[str] = []) -> list[StepRun]:
    """The steps a Python experiment file builds (its `experiment()` function)."""
    return run_experiment(load_experiment(path), Store(store), until, force)


@flow(name="data-refresh", log_prints=True, on_failure=[notify_failure])
def data_refresh(config: ExperimentConfig, store: str | None = None, until: str = "tokenize") -> list[StepRun]:
    """Re-read the sources and rerun whatever changed downstream, up to `until`.

    Acquire's version includes a fingerprint of its sources, so when nothing changed every step
    is a cache hit, and when a source changed exactly the steps downstream of it run.
    """
    return pipeline(config=config, store=store, until=until)


@flow(name="evaluate", log_prints=True, on_failure=[notify_failure])
def evaluate_flow(config: ExperimentConfig, store: str | None = None, force: list[str] = []) -> list[StepRun]:
    """Evaluate the config's trained model(s): only the evaluate steps run, and a model that is not
    in the store yet is an error that names it. The SFT and DPO models (posttrain.evaluate) are
    evaluated where they are in the store already: this flow's trigger is a train step's end,
    before the pipeline post-trains it (the pipeline evaluates them itself)."""
    experiment, store = from_config(config), Store(store)
    steps = [s for s in experiment.steps if s.stage == "evaluate" and (
        s.inputs["model"].stage == "train" or store.is_done(s.inputs["model"].stage, s.inputs["model"].version))]
    settings = experiment.run
    runs = execute(steps, store, max_concurrent=settings.max_concurrent, workers=settings.workers,
                   force=frozenset(force), lock_url=settings.lock_url, lease_s=settings.lock_lease_s,
                   verify=settings.verify)
    if failures(runs):
        raise StepsFailed(runs)
    return runs


def final_models(experiment: Experiment) -> dict[str, dict]:
    """Step key -> what its `kiln.step.completed` event adds (tasks/engine/events.py), for the final
    model of each branch of a YAML experiment (its last train step, or the soup after it): that
    branch's whole config, so the `evaluate` deployment's trigger evaluates exactly that model. A
    scaling sweep's many runs are left out (its evaluation belongs to its own steps)."""
    out = {}
    for variant, branch in experiment.branches.items():
        if branch.config is None or branch.config.scaling is not None:
            continue
        final = final_model(experiment.branch_steps(variant))
        if final is not None:
            config = branch.config.model_copy(update={"variants": {}, "grid": {}})
            out[final.key] = {"config": config.model_dump(mode="json"), "variant": variant}
    return out


def publish_lineage(final: StepRun) -> None:
    """A markdown artifact for the pipeline's final artefact: its tree back to the raw sources."""
    from pathlib import Path

    from prefect.artifacts import create_markdown_artifact

    from tasks.engine.lineage import lineage_tree, tree_markdown

    tree = lineage_tree(Path(final.path))
    create_markdown_artifact(
        key=f"lineage-{final.stage.replace('_', '-')}-{final.version}",
        markdown=f"# Lineage of {final.name} `{final.version}`\n\n{tree_markdown(tree)}\n",
        description=f"kiln {final.name} {final.version} back to its raw sources")


def publish_comparison(experiment: Experiment, store: Store) -> None:
    """The `kiln compare` table, and a bar chart of `run.compare_metric` per variant, as artifacts;
    with eval.checkpoints also the `--over steps` table and that metric against the step."""
    from prefect.artifacts import create_table_artifact

    rows = comparison(experiment, store)
    key = "".join(c if c.isalnum() else "-" for c in experiment.name.lower())
    create_table_artifact(key=f"compare-{key}", table=rows,
                          description=f"kiln compare {experiment.name}: one row per variant ('None': not run yet)")
    metric = experiment.run.compare_metric
    _image(metric_plot(rows, metric), f"compare-{key}-{metric.replace('_', '-')}",
           f"kiln compare {experiment.name}: {metric} per variant")
    series = over_steps(experiment, store)
    if series:
        create_table_artifact(key=f"compare-{key}-steps", table=series,
                              description=f"kiln compare {experiment.name} --over steps: one row per evaluated step")
        _image(steps_plot(series, metric), f"compare-{key}-steps-{metric.replace('_', '-')}",
               f"kiln compare {experiment.name}: {metric} against the training step")


def _image(png: bytes | None, key: str, description: str) -> None:
    from prefect.artifacts import create_image_artifact

    if png is not None:
        create_image_artifact(image_url=f"data:image/png;base64,{base64.b64encode(png).decode('ascii')}",
                              key=key, description=description)
