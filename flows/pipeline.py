"""The end-to-end flow: each lifecycle stage as a subflow, each step cached by its version."""

from __future__ import annotations

from prefect import flow

from flows.config import ExperimentConfig
from flows.plan import flows_needed
from flows.stages import stage_flows
from tasks.engine.runner import StepRun


@flow(name="pipeline", log_prints=True)
def pipeline(config: ExperimentConfig, store: str | None = None, until: str | None = None,
             force: list[str] = []) -> list[StepRun]:
    """Raw text to an evaluated, exported model (or, with `scaling`, to a fitted scaling law).
    Stages whose version exists are cache hits."""
    flows = stage_flows()
    runs: list[StepRun] = []
    for name in flows_needed(config, until):
        runs += flows[name](config=config, store=store, until=until, force=force)
    if runs and runs[-1].path and "://" not in runs[-1].path:
        publish_lineage(runs[-1])
    return runs


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


@flow(name="data-refresh", log_prints=True)
def data_refresh(config: ExperimentConfig, store: str | None = None, until: str = "tokenize") -> list[StepRun]:
    """Re-read the sources and rerun whatever changed downstream, up to `until`.

    Acquire's version includes a fingerprint of its sources, so when nothing changed every step
    is a cache hit, and when a source changed exactly the steps downstream of it run.
    """
    return pipeline(config=config, store=store, until=until)
