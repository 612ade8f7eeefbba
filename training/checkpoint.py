"""Checkpoints with orbax: the whole train state (params, optimizer state, step, RNG key) plus a
small JSON record (step, data position), every N steps and at the end.

Saves are synchronous: when `save` returns the checkpoint is complete on disk. Orbax writes each
one under a temporary name and renames it when done, so a process killed mid-save leaves no
checkpoint that `latest_step` would pick. With several processes every one calls `save` and
`restore` (they are collective); orbax writes replicated arrays and the JSON from process 0 only,
and each process its own shards of sharded arrays, when `work_dir` is one folder they share. When
it is not (the hosts of a remote store: training/launch.py moves their checkpoints through the
store), `gathered` makes each process write the whole state into its own folder.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils


class Checkpoints:
    """`gathered`: every process has a folder of its own (hosts of a remote store, which share
    no filesystem): each one gathers the whole state into host memory and writes a complete
    checkpoint of plain arrays alone (orbax with no primary host); restoring places the arrays
    with the shardings asked for. The state must then fit in one host's memory."""

    def __init__(self, directory: Path, keep: int = 2, gathered: bool = False):
        self.gathered = gathered
        multiprocessing = ocp.options.MultiprocessingOptions(primary_host=None if gathered else 0)
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False,
                                                 cleanup_tmp_directories=True,
                                                 multiprocessing_options=multiprocessing),
            item_handlers={"state": ocp.StandardCheckpointHandler(multiprocessing_options=multiprocessing),
                           "meta": ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing)},
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: dict, meta: dict) -> None:
        if self.gathered:  # a collective: every process calls save at the same step
            state = multihost_utils.process_allgather(state, tiled=True)
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

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
        self.manager.close()
