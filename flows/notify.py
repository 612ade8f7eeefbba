"""A failed kiln flow run says so through a Prefect notification block (`run.notify_webhook`).

A flow-level `on_failure` hook rather than a server-side Automation: it runs wherever the flow
runs (`kiln run` on Prefect's ephemeral API, `kiln serve`, a work pool's worker), needs nothing
registered on a server, and reads the webhook from the failed run's own config. A subflow's failure
is left to its parent (data-refresh runs the pipeline as a subflow), so one failed run sends one
notification. A notification that cannot be sent is logged, never raised: the run has failed
already and its state must stay what it was.
"""

from __future__ import annotations

import logging

log = logging.getLogger("kiln.notify")


def notify_failure(flow, flow_run, state) -> None:
    """Prefect's on_failure hook for kiln's flows."""
    if flow_run.parent_task_run_id is not None:  # a subflow: its parent reports
        return
    target = webhook_of(flow_run.parameters)
    if not target:
        return
    message = (state.message or "").strip() or "no message"
    subject = f"kiln: {flow.name} run {flow_run.name} {state.name}"
    body = f"{subject}\nflow run {flow_run.id}\n{message[:2000]}"
    try:
        block = notification_block(target, flow_run, flow.name, state.name)
        block.notify(body=body, subject=subject)
    except Exception as e:  # reported, not raised (see the module docstring)
        log.error("kiln: could not send the failure notification of flow run %s to %s: %s: %s",
                  flow_run.id, _shown(target), type(e).__name__, e)


def webhook_of(parameters: dict) -> str | None:
    """`run.notify_webhook` of the run's config parameter (or of its Python experiment file)."""
    config = parameters.get("config")
    if config is not None:
        run = (config.get("run") if isinstance(config, dict) else getattr(config, "run", None)) or {}
        return run.get("notify_webhook") if isinstance(run, dict) else run.notify_webhook
    if parameters.get("path"):  # the experiment flow: settings come from the file
        from flows.experiment import load_experiment

        try:
            return load_experiment(parameters["path"]).run.notify_webhook
        except Exception:  # the file may be why the run failed; nothing to notify through then
            return None
    return None


def notification_block(target: str, flow_run, flow_name: str, state_name: str):
    """A saved block for `block:<type>/<name>`; for a URL, a CustomWebhookNotificationBlock whose
    JSON carries the flow run's id, name and state besides the text (`{{subject}}`, `{{body}}`)."""
    if target.startswith("block:"):
        from prefect.blocks.core import Block

        return Block.load(target.removeprefix("block:"))
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    return CustomWebhookNotificationBlock(
        name="kiln", url=target,
        json_data={"text": "{{body}}", "subject": "{{subject}}", "flow": flow_name, "flow_run_id": str(flow_run.id),
                   "flow_run_name": flow_run.name, "state": state_name})


def _shown(target: str) -> str:
    """The target without what may be secret in it (a URL's path and query often carry the token)."""
    if target.startswith("block:"):
        return target
    scheme, _, rest = target.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}/..."
