"""`kiln deploy`: register kiln's deployments to a Prefect `process` work pool, for workers to run.

`kiln serve` runs every triggered run in its own process, on its machine. With a work pool, the
runs go to whichever `prefect worker start --pool NAME` picks them up, on any machine that has the
repo (kiln installed in its environment) and reaches the store. So nothing in a run may name what
only the deploying machine has: the entrypoints are module paths (`flows.pipeline.pipeline`, found
in the worker's environment, no pull step or local folder), the store is a parameter that must be a
URL or an absolute path every worker mounts, the lock server is the config's `run.lock_url`, and the
Ray cluster (if any) is an address in the runs' environment (job variable `env.RAY_ADDRESS`).
"""

from __future__ import annotations

from flows.config import ExperimentConfig

from deployments.serve import CANARY_CRON, DEFAULT_CRON, NoServer, check_server, deployments


class DeployError(ValueError):
    """Something in `kiln deploy`'s arguments that the user can fix."""


def shared_store(store: str | None) -> str:
    """The store as every worker reaches it: a URL, or an absolute local path (a shared mount)."""
    import os

    store = store or os.environ.get("KILN_STORE")
    if not store:
        raise DeployError("kiln deploy needs the store the workers write to: --store URL (s3://bucket/kiln, "
                          "gs://...) or an absolute path every worker mounts (/shared/kiln_store), or KILN_STORE")
    if "://" not in store and not os.path.isabs(store):
        raise DeployError(f"--store {store!r} is a relative path, which each worker would read against its own "
                          "working folder: give an absolute path every worker mounts, or a URL")
    return store


def ensure_pool(name: str) -> str:
    """The `process` work pool `name`, created (with Prefect's default job template) if missing."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process",
                                                   base_job_template=ProcessWorker.get_default_base_job_template()))
            return "created"
    if pool.type != "process":
        raise DeployError(f"work pool {name!r} exists with type {pool.type!r}; kiln deploys to a `process` pool: "
                          "name another pool (it is created)")
    return "exists"


def run_environment(ray_address: str | None) -> dict[str, str]:
    """The environment of every flow run the workers start (job variable `env`)."""
    env = {"PREFECT_LOGGING_LOG_PRINTS": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    return env


def deploy(config: ExperimentConfig, store: str | None, pool: str, *, cron: str = DEFAULT_CRON,
           refresh_until: str = "tokenize", lock_url: str | None = None, ray_address: str | None = None,
           canary: ExperimentConfig | None = None, canary_cron: str = CANARY_CRON,
           canary_root: str | None = None) -> list[str]:
    """Register the deployments to `pool`; returns their names. `lock_url` replaces the config's
    `run.lock_url` (and the canary's)."""
    store = shared_store(store)
    url = check_server()
    if lock_url is not None:
        config = with_lock_url(config, lock_url)
        canary = with_lock_url(canary, lock_url) if canary is not None else None
    if config.run.lock_url is None:
        print("kiln deploy: warning: run.lock_url is not set, so step locks are files on each worker's disk: two "
              "workers on different machines could compute the same step at once; pass --lock-url "
              "redis://HOST:PORT/0 (`kiln server start` prints one)")
    made = ensure_pool(pool)
    where = {"work_pool_name": pool, "job_variables": {"env": run_environment(ray_address)}}
    served = deployments(config, store, cron, refresh_until, canary=canary, canary_cron=canary_cron,
                         canary_root=canary_root, **where)
    for d in served:
        d.apply()
    names = [d.full_name for d in served]
    print(f"kiln deploy: {', '.join(names)} on {url}, work pool {pool!r} ({made}), store {store}\n"
          f"Run them with `prefect worker start --pool {pool}` on each machine that computes (with the repo, "
          f"PREFECT_API_URL={url} and the store).")
    return names


def with_lock_url(config: ExperimentConfig, lock_url: str) -> ExperimentConfig:
    from flows.config import RunSettings

    run = RunSettings.model_validate({**config.run.model_dump(), "lock_url": lock_url})  # checks the URL
    return config.model_copy(update={"run": run})


__all__ = ["DeployError", "NoServer", "deploy", "ensure_pool", "shared_store"]
