"""The end-to-end flow: each lifecycle stage as a subflow, each step cached by its version."""

from __future__ import annotations

from prefect import flow

from flows.config import ExperimentConfig
from flows.plan import FLOW_OF_STAGE, FLOWS, experiment_steps, select
from flows.stages import STAGE_FLOWS
from tasks.runner import StepRun


@flow(name="pipeline", log_prints=True)
def pipeline(config: ExperimentConfig, store: str | None = None, until: str | None = None,
             force: list[str] = []) -> list[StepRun]:
    """Raw text to an evaluated, exported model. Stages whose version exists are cache hits."""
    needed = {FLOW_OF_STAGE[s.stage] for s in select(experiment_steps(config), until)}
    runs: list[StepRun] = []
    for name in FLOWS:
        if name in needed:
            runs += STAGE_FLOWS[name](config=config, store=store, until=until, force=force)
    return runs
