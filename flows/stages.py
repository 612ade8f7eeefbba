"""One Prefect flow per lifecycle stage. Each runs the experiment's steps that belong to it.

They are subflows of `pipeline`, and each can also be run alone (a deployment can trigger
`evaluate` on an existing checkpoint): the steps it needs upstream are then cache hits.
"""

from __future__ import annotations

from prefect import flow

from flows.config import ExperimentConfig
from flows.plan import FLOW_OF_STAGE, experiment_steps, select
from tasks.runner import StepRun, execute
from tasks.store import Store


def run_flow_steps(flow_name: str, config: ExperimentConfig, store: str | None,
                   until: str | None, force: list[str]) -> list[StepRun]:
    steps = [s for s in select(experiment_steps(config), until) if FLOW_OF_STAGE[s.stage] == flow_name]
    return execute(steps, Store(store), workers=config.run.workers, force=frozenset(force))


@flow(name="data", log_prints=True)
def data_flow(config: ExperimentConfig, store: str | None = None, until: str | None = None,
              force: list[str] = []) -> list[StepRun]:
    """Acquire, extract, filter and deduplicate documents."""
    return run_flow_steps("data", config, store, until, force)


STAGE_FLOWS = {"data": data_flow}
