"""One Prefect flow per lifecycle stage; each runs the experiment's steps that belong to it.

They are the subflows of `pipeline`. Run alone (the `evaluate` deployment does), a stage flow
runs only its own steps, and a missing upstream output is an error that names it.
"""

from __future__ import annotations

from prefect import flow

from flows.config import ExperimentConfig
from flows.plan import steps_of_flow
from tasks.engine.runner import StepRun, execute
from tasks.engine.store import Store


def run_stage_steps(flow_name: str, config: ExperimentConfig, store: str | None,
                    until: str | None, force: list[str]) -> list[StepRun]:
    steps = steps_of_flow(flow_name, config, until)
    return execute(steps, Store(store), workers=config.run.workers, force=frozenset(force))


@flow(name="data", log_prints=True)
def data_flow(config: ExperimentConfig, store: str | None = None, until: str | None = None,
              force: list[str] = []) -> list[StepRun]:
    """Acquire, extract, filter, score quality and deduplicate documents."""
    return run_stage_steps("data", config, store, until, force)


@flow(name="tokenize", log_prints=True)
def tokenize_flow(config: ExperimentConfig, store: str | None = None, until: str | None = None,
                  force: list[str] = []) -> list[StepRun]:
    """Build or load the tokenizer, then write token shards with a held-out split."""
    return run_stage_steps("tokenize", config, store, until, force)


@flow(name="train", log_prints=True)
def train_flow(config: ExperimentConfig, store: str | None = None, until: str | None = None,
               force: list[str] = []) -> list[StepRun]:
    """Pretrain the model on Ray; an unfinished version resumes from its last checkpoint."""
    return run_stage_steps("train", config, store, until, force)


@flow(name="evaluate", log_prints=True)
def evaluate_flow(config: ExperimentConfig, store: str | None = None, until: str | None = None,
                  force: list[str] = []) -> list[StepRun]:
    """lm-eval on kiln's offline suite (and named lm-eval tasks), bits per byte on held-out text."""
    return run_stage_steps("evaluate", config, store, until, force)


@flow(name="export", log_prints=True)
def export_flow(config: ExperimentConfig, store: str | None = None, until: str | None = None,
                force: list[str] = []) -> list[StepRun]:
    """The Hugging Face Llama layout with tokenizer files and a model card."""
    return run_stage_steps("export", config, store, until, force)


@flow(name="posttrain", log_prints=True)
def posttrain_flow(config: ExperimentConfig, store: str | None = None, until: str | None = None,
                   force: list[str] = []) -> list[StepRun]:
    """Chat data from held-out text, SFT with loss masking, then DPO; each evaluated before and after."""
    return run_stage_steps("posttrain", config, store, until, force)


def stage_flows() -> dict:
    """Each lifecycle flow by name (the scaling flow lives in flows/scaling.py, which needs these)."""
    from flows.scaling import scaling_flow

    return {"data": data_flow, "tokenize": tokenize_flow, "train": train_flow, "evaluate": evaluate_flow,
            "posttrain": posttrain_flow, "export": export_flow, "scaling": scaling_flow}
