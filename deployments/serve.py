"""`kiln serve`: register kiln's deployments on a Prefect server and run them when triggered.

Three deployments, all taking the experiment config as their typed parameter (so the UI shows
a form filled with the served config's values):
- `pipeline`: the whole lifecycle, each step cached by version;
- `data-refresh`: on a cron schedule (daily by default), re-reads the sources and reruns what
  changed, up to tokenization;
- `evaluate`: the evaluation flow for the config's checkpoint (upstream steps are cache hits).
"""

from __future__ import annotations

import os

from flows.config import ExperimentConfig

DEFAULT_CRON = "0 3 * * *"  # daily at 03:00


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


def deployments(config: ExperimentConfig, store: str, cron: str, refresh_until: str):
    from prefect.deployments.runner import EntrypointType

    from flows.pipeline import data_refresh, evaluate_flow, pipeline

    common = dict(entrypoint_type=EntrypointType.MODULE_PATH, tags=["kiln", config.name])
    params = {"config": config.model_dump(mode="json"), "store": store}
    return [
        pipeline.to_deployment(name="pipeline", parameters=params, **common,
                               description="Raw text to an evaluated, exported model."),
        data_refresh.to_deployment(name="data-refresh", cron=cron,
                                   parameters={**params, "until": refresh_until}, **common,
                                   description=f"Re-read sources, rerun what changed up to {refresh_until}."),
        evaluate_flow.to_deployment(name="evaluate", parameters=params, **common,
                                    description="Evaluate the config's checkpoint (cache hit if done)."),
    ]


def serve(config: ExperimentConfig, store: str, cron: str = DEFAULT_CRON, refresh_until: str = "tokenize",
          limit: int | None = None) -> None:
    """Blocks, running triggered and scheduled runs, until interrupted."""
    import prefect

    check_server()
    os.environ.setdefault("KILN_STORE", store)
    prefect.serve(*deployments(config, store, cron, refresh_until), limit=limit)
