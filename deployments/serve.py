"""`kiln serve`: register kiln's deployments on a Prefect server and run them when triggered.

Three deployments (four with a canary), all taking the experiment config as their typed
parameter (so the UI shows a form filled with the served config's values):
- `pipeline`: the whole lifecycle, each step cached by version;
- `data-refresh`: on a cron schedule (daily by default), re-reads the sources and reruns what
  changed, up to tokenization;
- `evaluate`: only the evaluate steps of the config (every variant's); a model not yet trained is an error naming it.
  A trigger also runs it whenever a pipeline run has computed a branch's final model (its last train step, or
  the soup after it), on that branch's config;
- `canary` (with `--canary CONFIG`): that config daily into a fresh store, checked against its `canary:` bounds
  (flows/canary.py).

Stopping (SIGTERM or SIGINT): Prefect stops serving, then kiln pauses the deployments' schedules
itself, giving up after `pause_timeout_s` when the server no longer answers (Prefect's own pause
on shutdown retries against a dead server without end, so `kiln serve` would never exit). Prefect's
graceful stop after SIGTERM can itself hang with the server gone (seen on a loaded machine: its
log said "initiating graceful shutdown" and the process was still up 30 s later), so kiln gives it
`STOP_GRACE_S`, then pauses what it can and exits anyway. A SIGTERM that comes while kiln pauses
is said and otherwise waits for the pause (at most `pause_timeout_s`): Prefect's handler, still
installed, would `sys.exit(0)` in the middle of it, ending the process with nothing said (seen once
in CI, with the server gone and the schedules left as they were).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading

from flows.config import ExperimentConfig
from tasks.engine import local_ray

DEFAULT_CRON = "0 3 * * *"  # daily at 03:00
CANARY_CRON = "0 5 * * *"  # daily at 05:00, after the data refresh
STOP_GRACE_S = 10.0  # for Prefect's runner to stop after SIGTERM, before kiln exits without it


class NoServer(RuntimeError):
    pass


def check_server() -> str:
    """The server URL, after checking it answers; a clear error otherwise."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    how = ("start one with `uv run prefect server start --host 127.0.0.1 --port 4200` and set "
           "PREFECT_API_URL=http://127.0.0.1:4200/api")
    if not url:
        raise NoServer(f"PREFECT_API_URL is not set, so there is no server to serve on; {how}")
    with get_client(sync_client=True) as client:
        error = client.api_healthcheck()
    if error is not None:
        raise NoServer(f"no Prefect server answers at {url} ({type(error).__name__}); {how}")
    return url


def deployments(config: ExperimentConfig, store: str, cron: str, refresh_until: str,
                canary: ExperimentConfig | None = None, canary_cron: str = CANARY_CRON,
                canary_root: str | None = None, **where) -> list:
    """The deployments `kiln serve` runs and `kiln deploy` registers to a work pool (`where`:
    `work_pool_name`, `job_variables`). `evaluate` also runs on its own whenever a pipeline run
    computes a branch's final model (`evaluate_trigger`); `canary` is there when a canary config
    is given, on its daily schedule."""
    from prefect.deployments.runner import EntrypointType

    from flows.canary import canary as canary_flow
    from flows.pipeline import data_refresh, evaluate_flow, pipeline

    common = dict(entrypoint_type=EntrypointType.MODULE_PATH, tags=["kiln", config.name], **where)
    params = {"config": config.model_dump(mode="json"), "store": store}
    served = [
        pipeline.to_deployment(name="pipeline", parameters=params, **common,
                               description="Raw text to an evaluated, exported model."),
        data_refresh.to_deployment(name="data-refresh", cron=cron,
                                   parameters={**params, "until": refresh_until}, **common,
                                   description=f"Re-read sources, rerun what changed up to {refresh_until}."),
        evaluate_flow.to_deployment(name="evaluate", parameters=params, triggers=[evaluate_trigger()], **common,
                                    description="Evaluate the config's checkpoint (cache hit if done); runs "
                                    "by itself on each model a pipeline run trains."),
    ]
    if canary is not None:
        served.append(canary_flow.to_deployment(
            name="canary", cron=canary_cron, **{**common, "tags": ["kiln", "canary", canary.name]},
            parameters={"config": canary.model_dump(mode="json"), "store_root": canary_root or f"{store}-canary"},
            description="The canary config into a fresh store of the day; fails naming any result out of bounds."))
    return served


def evaluate_trigger():
    """Run `evaluate` on the model a pipeline run has just made: on each `kiln.step.completed` of
    a branch's final model (its last train step, or the soup after it), with that branch's config
    and store from the event's payload (tasks/engine/events.py)."""
    from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger

    from tasks.engine.events import FINAL_MODEL, STEP_COMPLETED

    return DeploymentEventTrigger(
        name="kiln: evaluate each trained model", expect={STEP_COMPLETED},
        match={"prefect.resource.id": ["kiln.step.train.*", "kiln.step.soup.*"], **FINAL_MODEL},
        parameters={"config": "{{ event.payload.config }}", "store": "{{ event.payload.store }}"})


def serve(config: ExperimentConfig, store: str, cron: str = DEFAULT_CRON, refresh_until: str = "tokenize",
          limit: int | None = None, pause_timeout_s: float = 10.0, canary: ExperimentConfig | None = None) -> None:
    """Blocks, running triggered and scheduled runs, until SIGTERM or SIGINT; then pauses the
    deployments' schedules (see the module docstring)."""
    from prefect.exceptions import TerminationSignal
    from prefect.runner import Runner

    url = check_server()
    os.environ.setdefault("KILN_STORE", store)
    served = deployments(config, store, cron, refresh_until, canary=canary)
    _unwinding.clear()
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:
        # SIGTERM before Prefect's runner has put in its own handler (it does once it starts) must
        # stop serving the same way, not kill the process before the schedules are paused; and a
        # batch scheduler's warning (SIGUSR1, SIGUSR2) does what SIGTERM does
        previous_handler = signal.signal(signal.SIGTERM, _interrupt)
        previous_warnings = {sig: signal.getsignal(sig) for sig in local_ray.WARNING_SIGNALS}
        local_ray.warnings_as_sigterm()
    names = [d.full_name for d in served]
    try:  # from the first registration on: a signal from here on ends in the pause below
        runner = Runner(limit=limit, pause_on_shutdown=False)
        for deployment in served:
            runner.add_deployment(deployment)  # registers it on the server
        _stop_within(runner, names, url, pause_timeout_s)
        asyncio.run(_start_saying_so(runner, f"kiln serve: serving {', '.join(names)} from {url} (trigger them "
                                     "in the UI or with `prefect deployment run NAME`; SIGTERM or Ctrl-C stops)"))
    except (KeyboardInterrupt, TerminationSignal):
        pass
    finally:
        _unwinding.set()
        print(f"kiln serve: stopped serving; pausing the schedules (giving up after {pause_timeout_s:.0f} s)",
              file=sys.stderr, flush=True)
        pause(names, url, pause_timeout_s)
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_handler)
            for sig, handler in previous_warnings.items():
                signal.signal(sig, handler)


async def _start_saying_so(runner, serving: str) -> None:
    """Run Prefect's runner; print `serving` once it has started (it polls for runs, and its own
    SIGTERM handler is in place), not before."""
    started = asyncio.ensure_future(runner.start())
    while not (runner.started or started.done()):
        await asyncio.sleep(0.05)
    if runner.started:
        print(serving, file=sys.stderr, flush=True)
    await started


def _stop_within(runner, names: list[str], url: str, pause_timeout_s: float) -> None:
    """Give Prefect's SIGTERM handler (installed by `runner.start`) a deadline: the first SIGTERM
    starts Prefect's graceful stop and a watchdog; if serving has not ended STOP_GRACE_S later,
    the watchdog pauses the schedules itself (bounded by `pause_timeout_s`) and ends the process."""
    graceful = runner.handle_sigterm

    def handle_sigterm(*args):
        if _unwinding.is_set():  # Prefect's handler would sys.exit(0) in the middle of the pause
            _still_pausing()
            return
        if not runner.stopping:
            threading.Thread(target=_exit_unless_stopped, args=(names, url, pause_timeout_s),
                             name="kiln-serve-stop-deadline", daemon=True).start()
        graceful(*args)

    runner.handle_sigterm = handle_sigterm  # `start` installs the instance's attribute as the handler


def _exit_unless_stopped(names: list[str], url: str, pause_timeout_s: float) -> None:
    if _unwinding.wait(STOP_GRACE_S):
        return  # serving ended: the main thread pauses the schedules and exits
    print(f"kiln serve: Prefect's runner did not stop within {STOP_GRACE_S:.0f} s of SIGTERM; exiting without it",
          file=sys.stderr, flush=True)
    pause(names, url, pause_timeout_s)
    sys.stderr.flush()
    os._exit(1)  # the main thread is stuck in Prefect's shutdown: nothing else would end the process


_unwinding = threading.Event()  # serve has stopped serving: a signal now must not interrupt the pause


def _still_pausing() -> None:
    print("kiln serve: SIGTERM while pausing the schedules: the pause ends first (SIGKILL ends the process now)",
          file=sys.stderr, flush=True)


def _interrupt(signum, frame) -> None:
    """SIGTERM as Ctrl-C. Python prints and drops an exception raised while a gc callback or a
    `__del__` runs (seen under load: inside jax's gc callback, and serving went on), so until
    serving has stopped the signal is sent again a second later."""
    if _unwinding.is_set():
        return
    again = threading.Timer(1.0, os.kill, (os.getpid(), signum))
    again.daemon = True
    again.start()
    raise KeyboardInterrupt


def pause(names: list[str], url: str, timeout_s: float) -> bool:
    """Pause the schedules of the deployments `names` ("flow/deployment"); say so on stderr.

    The calls run in a daemon thread that is abandoned after `timeout_s`, so a server that is gone
    (or hangs) costs at most that long."""
    outcome: dict = {}

    def work() -> None:
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                for name in names:
                    client.pause_deployment(client.read_deployment_by_name(name).id)
            outcome["paused"] = True
        except Exception as e:  # reported below, whatever it was: the process is exiting
            outcome["error"] = e

    worker = threading.Thread(target=work, name="kiln-pause-deployments", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if outcome.get("paused"):
        print(f"kiln serve: paused the schedules of {', '.join(names)}", file=sys.stderr)
        return True
    error = outcome.get("error")
    why = f"{type(error).__name__}: {error}" if error is not None else f"no answer within {timeout_s:.0f} s"
    print(f"kiln serve: could not pause the deployments ({why}; server {url}): their schedules stay active; "
          "pause them in the UI or with `prefect deployment pause` once the server is back", file=sys.stderr)
    return False
