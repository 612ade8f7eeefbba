"""Checkpoints with orbax: the whole train state (params, optimizer state, step, RNG key) plus a
small JSON record (step, data position), every N steps, every M minutes and at the end.

Saves are asynchronous by default: `save` returns once orbax holds the arrays in host memory
(on CPU a view of the buffers, which XLA then leaves alone: a buffer with a host view is never
donated), the write goes on in a background thread, and training goes on with it. A checkpoint
counts only once its write has finished: `finished()` says when (without waiting), `wait()` waits,
and `save` itself first waits for the write before it. Orbax writes each checkpoint under a
temporary name (`<step>.orbax-checkpoint-tmp`) and renames it when done, so a process killed
mid-write leaves no checkpoint that `latest_step` would pick (the next manager on that folder
removes the leftover). `asynchronous=False`: `save` returns with the checkpoint complete.

With several processes every one calls `save` and `restore` (they are collective); orbax writes
replicated arrays and the JSON from process 0 only, and each process its own shards of sharded
arrays, when `work_dir` is one folder they share. When it is not (the hosts of a remote store:
training/launch.py moves their checkpoints through the store), `gathered` makes each process
save the whole state into its own folder.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils


class Checkpoints:
    """`gathered`: every process has a folder of its own (hosts of a remote store, which share
    no filesystem): the whole state is gathered into host memory and saved as plain arrays by
    orbax with no primary host. Orbax writes plain arrays from process 0 only, so only host 0's
    folder holds them (the others get the metadata): the one host 0 pushes to the store, which
    every host pulls before it restores (training/launch.py). Restoring places the arrays with
    the shardings asked for. The state must then fit in one host's memory."""

    def __init__(self, directory: Path, keep: int = 2, gathered: bool = False, asynchronous: bool = True,
                 timeout_s: int = 1200):
        """`timeout_s` bounds a write and, with several processes, how long each waits for the others
        to finish theirs (orbax's barriers): a process whose write fails skips the barrier its peers
        wait at, and each would otherwise wait out the whole bound before the run fails."""
        self.gathered = gathered
        self.directory = Path(directory).absolute()
        self.timeout_s = timeout_s
        self._writing: int | None = None  # the step whose write `finished`/`wait` has not yet reported
        multiprocessing = ocp.options.MultiprocessingOptions(primary_host=None if gathered else 0)
        # Gathered, each process creates its own folders before writing into them. Orbax's default
        # creates them in the background and tells the writers through a signal keyed by the save
        # alone, not the process, so another host's folders being ready released this host's
        # writers early: twice in two-node runs host 0's JSON write found no `<step>.orbax-
        # checkpoint-tmp/meta...` folder, and the hosts then waited on each other in orbax's
        # barriers for `timeout_s` (tests/test_checkpoint.py makes one host's folders slow).
        async_options = ocp.AsyncOptions(timeout_secs=timeout_s, create_directories_asynchronously=not gathered)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=asynchronous,
                                                 cleanup_tmp_directories=True, async_options=async_options,
                                                 multiprocessing_options=multiprocessing),
            item_handlers={"state": ocp.StandardCheckpointHandler(multiprocessing_options=multiprocessing),
                           "meta": ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing)},
        )

    def folder(self, step: int) -> Path:
        """The folder orbax wrote for `step` (a complete one, once `finished` reported it)."""
        return self.directory / str(step)

    def latest_step(self) -> int | None:
        """The newest checkpoint, complete on disk when called before any save (as at the start of
        a run); during a run orbax counts the one being written too."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Start writing the checkpoint of `step` (collective: every process calls it at the same
        step). Waits for the previous write first; call `finished` before it to learn of that one."""
        if self.gathered:
            state = multihost_utils.process_allgather(state, tiled=True)
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)
        self._writing = step

    def finished(self) -> list[int] | None:
        """The steps kept on disk, all complete, if a write finished since the last report (a
        synchronous save finishes inside `save`); None while one is in flight or none was
        started. Never waits; raises the error of a write that failed."""
        if self._writing is None or self.manager.is_saving_in_progress():
            return None
        return self.wait()

    def wait(self) -> list[int] | None:
        """Wait for the write in flight; then as `finished`."""
        try:
            self.manager.wait_until_finished()  # raises what the background write raised
        except Exception as e:
            raise RuntimeError(
                f"process {jax.process_index()}: the checkpoint write of step {self._writing} in {self.directory} "
                f"failed, or with several processes another's did and this one waited {self.timeout_s} s for it "
                "(train.checkpoint_timeout_minutes); the first error, on the failed process, says why") from e
        if self._writing is None:
            return None
        self._writing = None
        return self.all_steps()

    def restore(self, step: int, abstract_state: dict, shardings: dict) -> tuple[dict, dict]:
        """The state at `step`, placed with `shardings` (the same layout a fresh state gets)."""
        if self.gathered:
            target = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype), abstract_state)
        else:
            target = jax.tree_util.tree_map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        state = restored["state"]
        if self.gathered:
            state = jax.tree_util.tree_map(
                lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]), state, shardings)
        return state, restored["meta"]

    def close(self) -> None:
        """Wait for the write in flight (call `wait` first to learn of it) and release orbax."""
        self.manager.close()
