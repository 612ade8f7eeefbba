"""The one executor: run a graph of steps, each as soon as its inputs are done.

Every step whose inputs have finished is submitted, up to `max_concurrent` at once, as the same
cached Prefect task (tasks/engine/runner.py), with its inputs' futures as `wait_for`, so the
flow-run page draws each step with arrows to its inputs. Heavy work runs in Ray (training) or in
Ray workers (data stages with workers > 1), so the flow's threads only wait. A failed step fails
the steps that depend on it (reported `not run`, with the reason) and independent branches go on;
the caller decides what a failure means for the run.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import time

from prefect import get_run_logger
from prefect.exceptions import ExternalSignal, TerminationSignal
from prefect.utilities.annotations import quote

from tasks.engine import local_ray
from tasks.engine.ast_guard import serialize_ast_parse
from tasks.engine.events import emit_step_completed
from tasks.engine.runner import StepRun, configured_task, prepare
from tasks.engine.step import Step
from tasks.engine.store import Store


class MissingInput(RuntimeError):
    """A step needs an output that is neither in this run nor in the store."""


def execute(steps: list[Step], store: Store, *, max_concurrent: int = 1, workers: int = 1,
            force: frozenset[str] = frozenset(), lock_url: str | None = None, lease_s: float = 30.0,
            verify: str = "sizes", slot_limits: dict[str, int] | None = None,
            announce: dict[str, dict] | None = None) -> list[StepRun]:
    """Run `steps` (upstream first; a step's inputs outside the list must already be in the store),
    each once per version. Returns how each went, in the order given.

    `force` names stages (or step names) to recompute even if their version exists. `lock_url`
    (redis://...) puts the step locks in Redis, shared by runners on other machines. `verify`:
    how a done step is checked before it counts as cached (runner.py `prepare`). `slot_limits`: the
    size of each slot limit a step's `resources.slots` may name (tasks/engine/slots.py), held in
    Redis at `lock_url` or in files on this machine. Each step computed (not cached) emits
    `kiln.step.completed` as it finishes, with `announce[key]` in its payload (tasks/engine/events.py).
    """
    serialize_ast_parse()  # steps run in threads; CPython 3.11's ast.parse is not thread-safe
    local_ray.stopping.clear()  # a new run in this process: an earlier one's Ctrl-C is not this one's
    local_ray.stopping_now.clear()
    local_ray.warnings_as_sigterm()  # a flow run's process of `kiln serve`: a scheduler's warning stops it as SIGTERM
    locks = {"lock_url": lock_url, "lease_s": lease_s}
    slots = {"limits": dict(slot_limits or {}), "lock_url": lock_url, "lease_s": lease_s}
    graph = {s.key: s for s in steps}  # one step per version, whichever variant named it first
    order = list(graph.values())
    needs = {k: [u.key for u in s.inputs.values() if u.key in graph] for k, s in graph.items()}
    for step in order:
        for name, upstream in step.inputs.items():
            if upstream.key not in graph and not store.is_done(upstream.stage, upstream.version):
                raise MissingInput(f"{step.name} needs its input {name!r} ({upstream.stage}/{upstream.version}), "
                                   f"which is neither in this run nor in the store {store.root}: run it first")

    finished: dict[str, StepRun] = {}
    futures: dict[str, object] = {}  # key -> future, for wait_for edges
    running: dict[object, tuple[Step, float]] = {}
    done: queue.Queue = queue.Queue()  # each future as it finishes (its done callback)
    waiting = list(order)
    with _shared_ray(order, store, max_concurrent, workers), _stopping_waits_for(running):
        while waiting or running:
            for step in list(waiting):
                failed = next((k for k in needs[step.key] if finished.get(k) and finished[k].status in
                               ("failed", "not run")), None)
                if failed is not None:
                    waiting.remove(step)
                    finished[step.key] = StepRun(step.name, step.stage, step.version, "not run", 0.0,
                                                 store.output(step.stage, step.version),
                                                 error=f"its input {graph[failed].name} {finished[failed].status}")
            for step in list(waiting):
                if len(running) >= max_concurrent:
                    break
                if all(k in finished for k in needs[step.key]):
                    waiting.remove(step)
                    future = _submit(step, store, workers, [futures[k] for k in needs[step.key]], force, locks,
                                     verify, slots)
                    futures[step.key] = future
                    running[future] = (step, time.perf_counter())
                    future.add_done_callback(done.put)
            if not running:
                break
            future = _next_done(done)
            step, t0 = running.pop(future)
            finished[step.key] = _outcome(step, future, store, round(time.perf_counter() - t0, 2))
            if finished[step.key].status == "ran":
                emit_step_completed(finished[step.key], store.root, (announce or {}).get(step.key))
    return [finished[s.key] for s in order]


def _next_done(done: queue.Queue):
    """The next future to finish, waited for a second at a time: a signal handler (Ctrl-C,
    SIGTERM: local_ray.stop_on_signals) runs only when the main thread runs Python, and a wait
    without a timeout sleeps through a signal the OS handed to another thread (Ray's, a step's)."""
    while True:
        try:
            return done.get(timeout=1.0)
        except queue.Empty:
            continue


@contextlib.contextmanager
def _stopping_waits_for(running: dict, grace_s: float = 120.0):
    """On Ctrl-C or another stop signal (KeyboardInterrupt, `local_ray.Terminated`, or the
    TerminationSignal that Prefect's own SIGTERM handler raises while a flow runs), tell the running
    steps to stop (local_ray.stopping: they cancel their Ray work, a training first checkpoints
    where it is) and wait for them, up to `grace_s` (or longer where a training's
    resources.stop_grace_s asks: local_ray.stop_wait_s), before Ray is left and the interrupt goes on:
    Prefect would otherwise wait for a training to finish before it let the process end. A Ctrl-C
    meanwhile sets local_ray.stopping_now: nothing more is checkpointed. A SIGTERM (or SIGUSR1,
    SIGUSR2) meanwhile does not: a supervisor and the job's scheduler often both send one (systemd
    or Slurm, and a Prefect runner cancelling its flow runs as it shuts down), and the stop goes
    on as it was."""
    try:
        yield
    except (KeyboardInterrupt, ExternalSignal):
        local_ray.stopping.set()
        grace_s = local_ray.stop_wait_s(grace_s)  # a training's resources.stop_grace_s may ask for longer
        deadline, waiting, said = time.monotonic() + grace_s, list(running), False
        while waiting:  # another signal may come at any moment: all that follows is under the try
            try:
                if not said:
                    said = True
                    get_run_logger().warning("stopping: waiting up to %.0f s for the running steps (%s) to end",
                                             grace_s, ", ".join(step.name for step, _ in running.values()))
                waiting[0].wait(timeout=max(0.0, deadline - time.monotonic()))
                waiting.pop(0)
            except (local_ray.Terminated, TerminationSignal) as again:
                get_run_logger().warning("%s again: still waiting for the running steps (Ctrl-C stops them "
                                         "at once)", signal.Signals(again.signal).name)
            except (KeyboardInterrupt, ExternalSignal):  # no checkpoint first
                local_ray.stopping_now.set()
                raise
        raise


def _submit(step: Step, store: Store, workers: int, wait_for: list, force: frozenset[str], locks: dict,
            verify: str = "sizes", slots: dict | None = None):
    forced = step.stage in force or step.name in force
    prepare(step, store, forced, get_run_logger(), verify)
    return configured_task(step, store, forced, **locks).submit(step.key, quote(step), store.root, workers, forced,
                                                                slots, wait_for=wait_for)


def _outcome(step: Step, future, store: Store, seconds: float) -> StepRun:
    path = store.output(step.stage, step.version)
    try:
        record = future.result()  # raises the step's error if it failed
    except Exception as e:
        return StepRun(step.name, step.stage, step.version, "failed", seconds, path, error=str(e))
    status = "cached" if future.state.name == "Cached" else "ran"  # after result(): the final state
    return StepRun(step.name, step.stage, step.version, status, seconds, path, record["stats"])


def failures(runs: list[StepRun]) -> list[StepRun]:
    return [r for r in runs if r.status in ("failed", "not run")]


@contextlib.contextmanager
def _shared_ray(steps: list[Step], store: Store, max_concurrent: int, workers: int):
    """One connection to Ray for every step of the run that needs one, made before any: with
    several steps at once, a step that connected itself would disconnect under the others when it
    finishes. The local Ray is the machine's (tasks/engine/local_ray.py), with its logical CPUs: steps
    that ask for more than are free wait for them. A run with a single Ray step leaves it to
    connect itself."""
    to_run = [s for s in steps if not store.is_done(s.stage, s.version)]
    cpus = [c for c in (_ray_cpus(s) for s in to_run) if c]
    if workers > 1:
        cpus += [workers] * len(to_run)  # data stages spread their shards over Ray workers
    if len(cpus) < 2 and not (max_concurrent > 1 and cpus):
        yield
        return
    import ray

    started = not ray.is_initialized()
    local_ray.ensure_ray()
    try:
        yield
    finally:
        if started:
            local_ray.disconnect()


def _ray_cpus(step: Step) -> int:
    """The CPUs a step asks Ray for: its hosts x CPUs per host, if it trains (0 if it does not)."""
    resources = getattr(step.config, "resources", None)
    return resources.hosts * resources.cpus_per_host if resources is not None else 0
