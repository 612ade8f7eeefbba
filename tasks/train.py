"""The train step: a tokenize output in, a trained model out.

The body hands everything to `training.launch.launch_training`, which runs the loop in Ray
task(s) and relays metrics here, to the step's log. Output folder (training/loop.py):
`model.json`, `params.safetensors`, `metrics.jsonl`, `loss.png`. Checkpoints live in the
step's work folder in the store (`ctx.workspace`), stable per version: a rerun of an unfinished
version resumes from the last one, on this machine or another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from training.config import ConfigModel, ModelConfig, ResourcesConfig, TrainConfig, setting
from training.launch import launch_training, token_data
from training.tracking import TrackingConfig, tracked

if TYPE_CHECKING:  # tasks.engine.step imports Prefect; Ray workers that import this module skip it
    from tasks.engine.step import Step, StepContext

# 2: fused projections, `project`'s weight gradients and the hand-written cross-entropy change the
# last bits of every trained parameter (training/model.py, training/step.py); 3: attention in query blocks, the same
# again (training/model.py `causal_attention`)
STAGE_VERSION = 3


class TrainStepConfig(ConfigModel):
    """What to train (identity) and where (resources: never part of the version)."""

    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    resources: ResourcesConfig = setting(ResourcesConfig())
    tracking: TrackingConfig = setting(TrackingConfig())  # W&B and the like: watched, not learned


def run_train(ctx: StepContext) -> dict:
    cfg: TrainStepConfig = ctx.config
    data = token_data(ctx.located("tokens"), cfg.model, cfg.train)
    ctx.log.info("training %d steps of %d x %d tokens on %d host(s)", cfg.train.steps, cfg.train.batch_size,
                 cfg.model.seq_len, cfg.resources.hosts)

    def relay(record: dict) -> None:
        val = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
        mfu = f" mfu {record['mfu']:.1%}" if record.get("mfu") is not None else ""
        ctx.log.info("step %d/%d loss %.4f%s lr %.2e grad_norm %.3f %.0f tok/s%s", record["step"],
                     cfg.train.steps, record["loss"], val, record["lr"], record["grad_norm"],
                     record["tokens_per_s"], mfu)
        ctx.progress(record["step"], cfg.train.steps)

    with tracked(relay, cfg.tracking, f"train-{ctx.step.version}", cfg.model_dump(mode="json")) as on_metrics:
        return launch_training(cfg.model, cfg.train, cfg.resources, data, ctx.workspace, ctx.out,
                               on_metrics=on_metrics)


def train_step(model_cfg: ModelConfig, train_cfg: TrainConfig, resources: ResourcesConfig, *,
               tokens: Step, tracking: TrackingConfig = TrackingConfig()) -> Step:
    from tasks.engine.step import Step  # here, not at the top: see the TYPE_CHECKING import

    config = TrainStepConfig(model=model_cfg, train=train_cfg, resources=resources, tracking=tracking)
    return Step(name="train", stage="train", stage_version=STAGE_VERSION, config=config, run=run_train,
                inputs={"tokens": tokens})
