"""A flow that computes one toy step of a stage that makes models (`train`, or `soup`) whose
`kiln.step.completed` event announces a config, as the pipeline announces a branch's final model
(tests/test_team_server.py runs it in a process of its own: Prefect's events client keeps the
first server it was given for the life of a process).

Run as `python -m tests.team_steps STORE CONFIG_JSON SEED [STAGE]`.
"""

from __future__ import annotations

import json
import sys

from prefect import flow

from tasks.engine.scheduler import execute
from tasks.engine.step import Step
from tasks.engine.store import Store
from tasks.engine.config import ConfigModel


class ToyTrainConfig(ConfigModel):
    seed: int = 0


def toy_train(ctx) -> dict:
    (ctx.out / "model.txt").write_text("a toy model\n")
    return {"final_loss": 1.25, "steps": 3}


@flow(name="toy-train")
def toy(store: str, config: dict, seed: int, stage: str = "train") -> str:
    step = Step(stage, stage, 1, ToyTrainConfig(seed=seed), toy_train)
    runs = execute([step], Store(store), announce={step.key: {"config": config}})
    assert runs[0].status == "ran", runs
    return step.version


if __name__ == "__main__":
    print(toy(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5]))
