"""The Prefect event kiln emits when it has computed a step, for automations to react to.

`kiln.step.completed`, about the resource `kiln.step.<stage>.<version>` (labels `kiln.stage`,
`kiln.version`), once per step a run computed (cache hits emit nothing: nothing new was made). Its
payload is the store, the output's place in it and the step's scalar stats, plus whatever the flow
announced for that step: the pipeline adds the whole config of the branch whose final model a
train step (or a soup after it) is, and marks that resource `kiln.model: final`, so that the `evaluate` deployment's
trigger (deployments/serve.py) can start an evaluation of exactly that model.
"""

from __future__ import annotations

from tasks.engine.runner import StepRun

STEP_COMPLETED = "kiln.step.completed"
FINAL_MODEL = {"kiln.model": "final"}  # the resource label of a branch's final model


def step_resource(stage: str, version: str) -> str:
    return f"kiln.step.{stage}.{version}"


def emit_step_completed(run: StepRun, store_root: str, announced: dict | None = None) -> None:
    """Tell Prefect's event system that `run` computed its step; `announced` joins the payload
    (a `config` there marks the step as a final model)."""
    from prefect.events import emit_event

    resource = {"prefect.resource.id": step_resource(run.stage, run.version), "prefect.resource.name": run.name,
                "kiln.stage": run.stage, "kiln.version": run.version}
    if announced and "config" in announced:
        resource.update(FINAL_MODEL)
    stats = {k: v for k, v in run.stats.items() if isinstance(v, (str, int, float, bool)) or v is None}
    emit_event(event=STEP_COMPLETED, resource=resource,
               payload={"stage": run.stage, "name": run.name, "version": run.version, "store": store_root,
                        "path": f"{run.stage}/{run.version}", "stats": stats, **(announced or {})})
