"""Run `training.loop.train` inside Ray: one task per host, the whole loop in each.

Never a Ray (or Prefect) task per step: a training loop keeps its compiled step, its device
buffers and its data position in one long-lived process. With `hosts > 1` the tasks form one JAX
distributed runtime (as the hosts of a TPU pod do): host 0 runs the coordinator, every host
computes on its share of each global batch, and only host 0 writes metrics and the output.

Ray: kiln's local Ray by default (tasks/engine/local_ray.py: one per machine, shared by its runs,
on loopback only); a cluster when the config or RAY_ADDRESS names one. The caller waits here
while progress comes back through a `ray.util.queue.Queue` to `on_metrics`. Nothing on the Ray side imports Prefect (a Ray worker
that did would start its own Prefect server).

Determinism on GPU: the tasks run with XLA_FLAGS=--xla_gpu_deterministic_ops=true (unless
resources.deterministic_gpu is off), which makes XLA pick deterministic implementations of
scatter and reductions and deterministic autotuning, so the same config on the same GPU type
gives the same bits, at some cost in speed. CPU is deterministic without flags.

CPU devices: with resources.cpu_devices = N > 1 the tasks run with
XLA_FLAGS=--xla_force_host_platform_device_count=N, so each host's JAX has N CPU devices and the
step splits its batch over them (train.mesh.strategy dp). XLA runs most ops of a small model's
step on one thread; N devices run N at once (benchmarks/RESULTS.md, "CPU devices").
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.queue import Empty, Queue
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from training.config import (DETERMINISTIC_GPU_FLAG, NOTES_LOGGER, ModelConfig, ResourcesConfig, TrainConfig,
                             check_cpu_devices, model_mismatch)
from training.data import MixtureData, MixtureInput, open_mixture, read_meta
from tasks.engine import local_ray
from tasks.engine.daemons import process_start
from tasks.engine.store import Located, Workspace

if TYPE_CHECKING:  # JAX: imported by the hosts, not by a driver that only plans
    from training.hooks import HookFactory

# A picklable, zero-argument callable run on each host: returns (batch_at, val_batches). The
# data is opened where it is used (a memory map does not travel well through pickle). What it
# says to training.config.NOTES_LOGGER on host 0 reaches the driver's `on_note`.
DataSource = Callable[[], tuple[Callable[[int], np.ndarray], list[np.ndarray]]]

CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count"  # N CPU devices in one process


def launch_training(model_cfg: ModelConfig, train_cfg: TrainConfig, resources: ResourcesConfig,
                    data: DataSource, work: Workspace | Path, out_dir: Path,
                    on_metrics: Callable[[dict], None] | None = None, poll_s: float = 0.5,
                    objective=None, init_model: Located | Path | str | None = None,
                    hooks: Sequence[HookFactory] = (), init_step: int | None = None, init_mode: str = "weights",
                    on_note: Callable[[str], None] | None = None) -> dict:
    """Train in Ray task(s) with the resources asked for; relay metrics; return host 0's stats,
    with `hosts`: where each host ran (Ray node id, node IP, device kind).

    Hosts never see driver paths: `data` opens store locations (`Located`) on the host, `work`
    is the step's work folder in the store (checkpoints: a rerun anywhere resumes from them),
    and with a remote store host 0 writes the model into the work folder and pushes it, and
    it is fetched into `out_dir` here. A plain `Path` for `work` or `init_model` (tests, tools)
    means a folder every host can open as it is.

    Post-training passes `objective` (training/posttrain.py) and `init_model`, a training output
    whose parameters each host loads as its starting point (a `str`: a folder inside the work
    folder, which the hosts pull: an imported Hugging Face model); with `init_step`, the state that
    output kept at that step (`steps/<step>/`), taken as `init_mode` says (train.init: weights,
    continue or reset; training/config.py InitConfig). `hooks` are hook factories
    (training/hooks.py): pickled to every host, each builds its hooks there (in-loop evals).
    `on_note` takes what host 0 says before its first step (training.config.NOTES_LOGGER: DPO's
    reference pass as it goes); by default it is printed to stderr."""
    check_cpu_devices(train_cfg, resources)
    if not isinstance(work, Workspace):
        work = Workspace(None, "", "", str(work))
    if isinstance(init_model, Path):
        init_model = Located(None, "", "", str(init_model))
    work.push()  # what the driver prepared for the hosts (post-training's rows), before they pull
    started_ray, address = _connect(resources)
    bundle = _bundle(resources)
    group = placement_group([bundle] * resources.hosts, strategy="SPREAD")
    queue = stop_requests = None
    try:
        _wait_placed(group, bundle, resources.hosts)
        # On the driver's own node: the relay must outlive any host's node (a node that dies
        # is reported as its host's failure, not as the queue's). Metrics come back through
        # `queue`; a stop (Ctrl-C, SIGTERM) goes to host 0 through `stop_requests`.
        here = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)}
        queue, stop_requests = Queue(actor_options=here), Queue(maxsize=1, actor_options=here)
        coordinator = None
        if resources.hosts > 1:  # a free port on host 0's node, for JAX's coordinator
            probe = ray.remote(_free_address).options(num_cpus=0, scheduling_strategy=_in(group, 0))
            coordinator = ray.get(probe.remote())
        env = _worker_env(resources)
        driver = (ray.get_runtime_context().get_node_id(), os.getpid())
        # With several hosts each worker process exits after its task (max_calls=1): a host that
        # failed leaves its JAX distributed runtime up (_host_main), and no later task may inherit it.
        host_main = ray.remote(max_calls=1 if resources.hosts > 1 else 0)(_host_main)
        refs = [
            host_main.options(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                              resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                              scheduling_strategy=_in(group, host), runtime_env=env, max_retries=0)
            .remote(host, resources.hosts, coordinator, model_cfg, train_cfg, data, work,
                    None if work.remote else str(out_dir), queue if host == 0 else None, objective,
                    init_model, driver, resources.connect_timeout_s, tuple(hooks), init_step, init_mode,
                    stop_requests if host == 0 else None)
            for host in range(resources.hosts)
        ]
        with local_ray.stop_takes(resources.stop_grace_s):  # the scheduler's wait at a stop is at least as long
            results = _wait_relaying(refs, queue, on_metrics, poll_s, functools.partial(_bundle_node, group),
                                     stop_requests, resources.stop_grace_s, on_note or _print_note)
        if work.remote:
            work.fetch_output(out_dir)
        # Where it ran (never identity), for the lineage: the cluster's address as given, or the
        # Ray running in this process, and each host's node.
        return {**{k: v for k, v in results[0].items() if k != "host"}, "hosts": [r["host"] for r in results],
                "ray_cluster": address or _local_cluster()}
    finally:
        for actor in (queue, stop_requests):
            if actor is not None:
                actor.shutdown(force=True)
        remove_placement_group(group)
        if started_ray:
            local_ray.disconnect()


class TokenSource(NamedTuple):
    """One source of a train step's tokens as the driver hands it to the hosts: a tokenize output
    by its place in the store, with its weight and repetition cap in the mixture."""

    name: str
    tokens: Located | Path
    weight: float = 1.0
    max_epochs: float | None = None


def token_data(tokens: Located | Path | list[TokenSource], model_cfg: ModelConfig,
               train_cfg: TrainConfig) -> tuple[DataSource, dict[str, dict]]:
    """The DataSource of a tokenize output, or of a mixture of several (training/data.py
    `open_mixture`): batches in the loader's seeded order, and up to `eval_batches` validation
    batches of the same size; and what the run draws from each source (tokens, share, epochs).
    Each host opens the tokens on its own machine (a plain `Path`: a folder every host can
    open). They are opened here too, so that data the run cannot use (a vocabulary larger than
    the model's, a mixture whose caps cannot fill the run, too few validation windows) fails on
    the caller's side, not in a Ray worker."""
    sources = tokens if isinstance(tokens, list) else [TokenSource("tokens", tokens)]
    sources = [s._replace(tokens=s.tokens if isinstance(s.tokens, Located) else Located(None, "", "", str(s.tokens)))
               for s in sources]
    for s in sources:
        meta = read_meta(s.tokens.local())
        if meta["vocab_size"] > model_cfg.vocab_size:
            raise ValueError(f"{s.tokens.stage}/{s.tokens.version or s.tokens.path} uses a vocabulary of "
                             f"{meta['vocab_size']} tokens but the model has vocab_size={model_cfg.vocab_size}: "
                             f"set model.vocab_size to at least {meta['vocab_size']}")
    args = (sources, train_cfg.batch_size, model_cfg.seq_len, train_cfg.seed, train_cfg.steps, train_cfg.eval_batches)
    return functools.partial(_open_tokens, *args), _open_mixture(*args).drawn


def _open_mixture(sources: list[TokenSource], batch_size: int, seq_len: int, seed: int, steps: int,
                  eval_batches: int) -> MixtureData:
    inputs = [MixtureInput(s.name, s.tokens.local(), s.weight, s.max_epochs) for s in sources]
    return open_mixture(inputs, batch_size, seq_len, seed, steps, eval_batches)


def _open_tokens(*args):
    data = _open_mixture(*args)
    return data.batch_at, data.val_batches


def _host_main(host: int, hosts: int, coordinator: str | None, model_cfg: ModelConfig,
               train_cfg: TrainConfig, data: DataSource, work: Workspace, out_dir: str | None, queue,
               objective=None, init_model: Located | str | None = None, driver: tuple[str, int] | None = None,
               connect_timeout_s: float = 120, hooks: tuple = (), init_step: int | None = None,
               init_mode: str = "weights", stop_requests: Queue | None = None) -> dict:
    """The body of one host's Ray task: join the JAX runtime, open the data, run the loop.

    Everything it reads or writes it reaches through the store: the work folder is pulled into
    this node's cache (checkpoints included, so every host resumes from the same step), host 0
    pushes each checkpoint as it is saved, and with `out_dir` None (a remote store) writes the
    model into the work folder's `output/` and pushes it for the driver to fetch. Host 0 hears
    of a stop through `stop_requests` (the loop then checkpoints and raises TrainingStopped)."""
    if driver is not None:
        _exit_with_driver(*driver)
    # every host asks, as the loop's stop is collective; only host 0's answer counts (hooks.StopAgreement)
    stop_requested = _listening(stop_requests).is_set if stop_requests is not None else lambda: False
    import jax

    node = {"host": host, "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address()}
    if hosts > 1:
        _join_jax_runtime(host, hosts, coordinator, node["node_ip"], connect_timeout_s)
    from training.config import KEPT_DIR
    from training.loop import StartFrom, load_model, train

    local = work.pull(host)
    out = Path(out_dir) if out_dir is not None else local / "output"
    notes, to_driver = logging.getLogger(NOTES_LOGGER), _NotesToDriver(queue) if queue is not None else None
    if to_driver is not None:
        notes.setLevel(logging.INFO)
        notes.addHandler(to_driver)
    try:
        batch_at, val_batches = data()
    finally:
        if to_driver is not None:
            notes.removeHandler(to_driver)
    init_params, start_from = None, None
    if init_model is not None:
        named = init_model if isinstance(init_model, str) else f"{init_model.stage}/{init_model.version or init_model.path}"
        base = local / init_model if isinstance(init_model, str) else init_model.local()
        folder = base if init_step is None else base / KEPT_DIR / str(init_step)
        if not (folder / "model.json").is_file():
            raise FileNotFoundError(f"{named} kept no state of step {init_step} ({folder} is missing): train it "
                                    "again with that step in train.keep_checkpoints (the pipeline adds the steps "
                                    "train.init names)")
        if init_mode == "weights":
            init_cfg, init_params = load_model(folder)
            if init_cfg != model_cfg:
                raise ValueError(model_mismatch(named, init_cfg, model_cfg))
        else:
            start_from = StartFrom(folder, init_step, init_mode)
    pushing = host == 0 and work.remote
    stats = train(model_cfg, train_cfg, batch_at, val_batches, local, out,
                  on_metrics=queue.put if queue is not None else None, objective=objective,
                  init_params=init_params, shared_work=not work.remote, hooks=hooks, start_from=start_from,
                  stop_requested=stop_requested,
                  on_checkpoint=(lambda steps: work.push(checkpoint_steps=steps, host=0)) if pushing else None)
    if pushing:
        work.push(output=True, host=0)
    # Only a host that finished leaves the runtime: JAX's shutdown waits at a barrier for every
    # host, and a failed host's peers are blocked in the step's collectives waiting for it, so
    # its error would reach the driver only after the barrier's timeout (300 s). A failed host
    # raises at once; the driver cancels its peers (_wait_relaying) and the worker exits (max_calls).
    if hosts > 1:
        jax.distributed.shutdown()
    return {**stats, "host": {**node, "device_kind": jax.devices()[0].device_kind}}


def _listening(stop_requests: Queue) -> threading.Event:
    """An event set once the driver puts a stop request in `stop_requests`: a thread waits for it
    (an actor call that returns when the request comes), so the loop pays nothing per step."""
    requested = threading.Event()

    def listen():
        try:
            stop_requests.get(block=True)
        except ray.exceptions.RayActorError:  # the driver shut the queue down: the training is over
            return
        requested.set()

    threading.Thread(target=listen, name="kiln-stop-listener", daemon=True).start()
    return requested


def _join_jax_runtime(host: int, hosts: int, coordinator: str, node_ip: str, timeout_s: float) -> None:
    """Join the hosts' JAX distributed runtime, or fail within `timeout_s` naming what was tried.

    CPU hosts talk through gloo, which by default advertises whatever this machine's hostname
    resolves to: often a loopback address (/etc/hosts), which a peer on another node cannot
    reach, and gloo then retries for minutes. The node's IP, which Ray knows, is advertised
    instead (through jaxlib's gloo factory: jax has no public option for it)."""
    import jax
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    def failed(why: str) -> RuntimeError:
        return RuntimeError(f"host {host} on node {node_ip} could not join the JAX runtime of {hosts} hosts at "
                            f"coordinator {coordinator} within {timeout_s:.0f} s ({why}); check that every node "
                            "can reach host 0's node on that address, or raise resources.connect_timeout_s")

    deadline = time.monotonic() + timeout_s
    if host > 0:
        # JAX's client aborts the whole process (a C++ fatal error, no exception) when it cannot
        # register in time, so the coordinator is first reached here, where a failure can be said.
        address, port = coordinator.rsplit(":", 1)
        while True:
            try:
                socket.create_connection((address, int(port)), timeout=2).close()
                break
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise failed(f"{type(e).__name__}: {e}") from e
                time.sleep(0.5)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts only; GPUs use NCCL
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=hosts, process_id=host,
                                   initialization_timeout=max(int(deadline - time.monotonic()), 10))
    except Exception as e:
        raise failed(f"{type(e).__name__}: {e}") from e

    def cpu_client():
        collectives = _jax.make_gloo_tcp_collectives(distributed_client=distributed.global_state.client,
                                                     hostname=node_ip)
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", cpu_client, priority=0, fail_quietly=False)


def _exit_with_driver(node_id: str, pid: int, poll_s: float = 0.5) -> None:
    """End this host process as soon as the driver that launched it is gone.

    Ray would end it too, but only once it notices the job died, and a host busy in XLA was seen
    still running seconds after its driver was SIGKILLed. A host on the driver's own node can see
    the driver's pid; one on another node is left to Ray's job cleanup."""
    if ray.get_runtime_context().get_node_id() != node_id:
        return

    started = process_start(pid)

    def watch() -> None:
        while started is not None and process_start(pid) == started:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="kiln-driver-watch", daemon=True).start()


def _connect(resources: ResourcesConfig) -> tuple[bool, str | None]:
    """Join the configured or RAY_ADDRESS cluster, reuse the Ray this process is connected to,
    or join kiln's local Ray (tasks/engine/local_ray.py: shared by the machine's runs, started by the
    first). Returns (whether this call connected, so must disconnect; the cluster address joined,
    if any)."""
    address = resources.ray_address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized() or address:  # the caller's Ray (a cluster if an address is set, else in-process)
        local_ray.ensure_ray(address)
        return False, address
    local_ray.connect()
    return True, None


def _local_cluster() -> str:
    gcs = ray.get_runtime_context().gcs_address
    return f"kiln local Ray ({gcs})" if local_ray.connected() else f"in-process ({gcs})"


def _bundle(resources: ResourcesConfig) -> dict:
    bundle = {"CPU": resources.cpus_per_host}
    if resources.gpus_per_host:
        bundle["GPU"] = resources.gpus_per_host
    if resources.tpu_hosts:
        bundle["TPU"] = resources.tpus_per_host
    return bundle


def _in(group, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)


def _wait_placed(group, bundle: dict, hosts: int, unplaceable_s: float = 120, report_s: float = 30) -> None:
    """Wait until Ray has placed the hosts' bundles. What the cluster can hold is waited for as
    long as it takes, said after 5 s and then every `report_s`: other steps hold it (kiln's local
    Ray is shared by the machine's runs, so a train step waits for another run's to end). What
    exceeds the whole cluster fails: at once on kiln's local Ray, after `unplaceable_s` on a
    cluster (which may be adding nodes). The cluster is asked again every round, since a node may
    leave while the step waits (and a step that waited for it would wait forever). A stop of the
    run (Ctrl-C, SIGTERM) ends the wait within a second."""
    total, fits = _cluster_holds(bundle, hosts)
    if not fits and local_ray.connected():
        raise RuntimeError(
            f"this step asks Ray for {hosts} host task(s) of {bundle}, more than kiln's local Ray on this machine "
            f"has ({ {k: v for k, v in total.items() if k in bundle} }): lower resources.cpus_per_host (or hosts), "
            f"or give the local Ray more logical CPUs than cores with {local_ray.CPUS_ENV} (it takes effect when "
            "the local Ray next starts: `python -m tasks.engine.local_ray stop` once no run uses it)")
    ready, start = group.ready(), time.monotonic()
    report_at, too_small_since = start + min(5.0, report_s), None if fits else start
    while not ray.wait([ready], timeout=1.0)[0]:
        local_ray.raise_if_stopping(f"Ray to place {hosts} host task(s)")  # nothing started yet to cancel
        now = time.monotonic()
        if now < report_at:
            continue
        report_at = now + report_s
        total, fits = _cluster_holds(bundle, hosts)
        too_small_since = None if fits else (too_small_since or now)
        if too_small_since is not None and now - too_small_since >= unplaceable_s:
            raise RuntimeError(f"Ray cannot place {hosts} host task(s) of {bundle}: the cluster has had only "
                               f"{total} for {now - too_small_since:.0f} s; lower resources.* or add nodes")
        free = ray.available_resources()
        held = "other steps hold them" if fits else "the cluster is too small for them now"
        print(f"kiln: waited {now - start:.0f} s for Ray to place {hosts} host task(s) of {bundle}: {held} "
              f"(free now: { {name: free.get(name, 0) for name in bundle} })", file=sys.stderr, flush=True)


def _cluster_holds(bundle: dict, hosts: int) -> tuple[dict, bool]:
    """The cluster's resources now, and whether they could hold `hosts` bundles at all."""
    total = ray.cluster_resources()
    return total, all(total.get(name, 0) >= amount * hosts for name, amount in bundle.items())


def _worker_env(resources: ResourcesConfig) -> dict:
    env = local_ray.run_env()
    flags = os.environ.get("XLA_FLAGS", "")
    if resources.gpus_per_host and resources.deterministic_gpu and DETERMINISTIC_GPU_FLAG not in flags:
        flags = f"{flags} {DETERMINISTIC_GPU_FLAG}".strip()
    if flags:
        env["XLA_FLAGS"] = flags
    if not resources.gpus_per_host and not resources.tpu_hosts:
        env["JAX_PLATFORMS"] = "cpu"  # no probing for accelerators that were not asked for
        if resources.cpu_devices > 1 and CPU_DEVICES_FLAG not in flags:
            # Read when the worker's JAX starts its CPU client, so set before the task imports JAX.
            env["XLA_FLAGS"] = f"{flags} {CPU_DEVICES_FLAG}={resources.cpu_devices}".strip()
    return {"env_vars": env}


def _bundle_node(group, index: int) -> str:
    """"<node IP> (<node id>)" of the node that holds bundle `index` of a placement group."""
    try:
        node_id = ray.util.placement_group_table(group)["bundles_to_node_id"][index]
        ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "unknown address")
    except Exception as e:  # the cluster itself may be what failed: say so instead of the node
        return f"unknown (the cluster did not answer: {type(e).__name__}: {e})"
    return f"{ip} ({node_id})"


def _free_address() -> str:
    """host:port of a free TCP port on this node (runs on host 0's node)."""
    ip = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((ip, 0))
        return f"{ip}:{s.getsockname()[1]}"


def _print_note(note: str) -> None:
    print(f"kiln: {note}", file=sys.stderr, flush=True)


class _NotesToDriver(logging.Handler):
    """Host 0's notes (training.config.NOTES_LOGGER) into the relay's queue, for the driver."""

    def __init__(self, queue):
        super().__init__(logging.INFO)
        self.queue = queue

    def emit(self, record: logging.LogRecord) -> None:
        self.queue.put({"note": record.getMessage()})


def _wait_relaying(refs: list, queue, on_metrics, poll_s: float, where: Callable[[int], str],
                   stop_requests: Queue, stop_grace_s: float, on_note: Callable[[str], None]) -> list[dict]:
    """Wait for every host task, passing queued metrics and notes on as they come. If one host fails, the
    others would wait forever in a collective: cancel them and raise the failure, naming the
    host and its node (`where(host)`).

    If the run is stopping (Ctrl-C, SIGTERM: local_ray.stopping), the hosts are asked to stop
    where they are, their checkpoint saved there (the loop's TrainingStopped), and `Stopped` is
    raised once they have; hosts that take longer than `stop_grace_s` are cancelled, and the
    rerun resumes from their last periodic checkpoint instead."""
    from training.hooks import TrainingStopped

    pending, results, stopped_at = list(refs), {}, set()
    asked_at = None

    def drain():
        while True:
            try:
                record = queue.get(block=False)
            except Empty:
                return
            if "note" in record:
                on_note(record["note"])
            elif on_metrics is not None:
                on_metrics(record)

    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=poll_s)
        drain()
        if local_ray.stopping.is_set() and asked_at is None:
            stop_requests.put(True)
            asked_at = time.monotonic()
            print(f"stopping: the training checkpoints the step it is at and stops (cancelled after {stop_grace_s:.0f} "
                  "s: resources.stop_grace_s; Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
        if asked_at is None or local_ray.stopping_now.is_set() or time.monotonic() - asked_at > stop_grace_s:
            local_ray.cancel_if_stopping(pending)  # the hosts stop, the checkpoints they finished stay
        for ref in done:
            try:
                results[ref] = ray.get(ref)
            except TrainingStopped as e:
                stopped_at.add(e.step)
            except Exception as e:
                for other in pending:
                    ray.cancel(other, force=True)
                host = refs.index(ref)
                raise RuntimeError(f"training host {host} of {len(refs)} failed, on node {where(host)}: "
                                   f"{type(e).__name__}: {e}") from e
    drain()
    if stopped_at:
        raise local_ray.Stopped(f"{local_ray.STOPPING}: the training stopped at step "
                                f"{max(stopped_at)}, its checkpoint saved there, where the rerun resumes")
    return [results[r] for r in refs]
