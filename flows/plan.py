"""The experiment as a list of steps (Marin's `experiments/defaults.py`, on Prefect).

`experiment_steps` reads like the recipe it is: each line makes one step from its config
section and the steps it consumes. Nothing here runs anything: `kiln plan` prints these steps
with their versions and statuses, and the stage flows execute them.
"""

from __future__ import annotations

from dataclasses import dataclass

from flows.config import ExperimentConfig
from tasks.acquire import acquire_step
from tasks.step import Step, upstream_order
from tasks.store import Store
from tasks.versioning import StaleAwareLockManager

# Which lifecycle flow runs each stage, in pipeline order.
FLOW_OF_STAGE = {
    "acquire": "data",
}
FLOWS = ["data", "tokenize", "train", "evaluate", "export"]


def experiment_steps(config: ExperimentConfig) -> list[Step]:
    """Every step of the experiment, upstream before downstream."""
    documents = acquire_step(config.data.acquire())
    return upstream_order([documents])


def select(steps: list[Step], until: str | None = None) -> list[Step]:
    """The steps needed to produce stage `until` (all of them when None)."""
    if until is None:
        return steps
    targets = [s for s in steps if s.stage == until or s.name == until]
    if not targets:
        known = ", ".join(dict.fromkeys(s.stage for s in steps))
        raise ValueError(f"--until {until!r} names no stage of this experiment (stages: {known})")
    return upstream_order(targets)


@dataclass(frozen=True)
class PlannedStep:
    stage: str
    name: str
    version: str
    path: str
    status: str  # done, missing, running, failed


def step_status(step: Step, store: Store) -> str:
    if store.is_done(step.stage, step.version):
        return "done"
    if StaleAwareLockManager(store.local_root / ".prefect-locks").is_locked(step.key):
        return "running"
    if store.failure_record(step.stage, step.version).exists():
        return "failed"
    return "missing"


def plan(config: ExperimentConfig, store: Store, until: str | None = None) -> list[PlannedStep]:
    return [PlannedStep(s.stage, s.name, s.version, store.output(s.stage, s.version), step_status(s, store))
            for s in select(experiment_steps(config), until)]
