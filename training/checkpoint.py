"""Checkpoints with orbax: the whole train state (params, optimizer state, step, RNG key) plus a
small JSON record (step, data position), every N steps and at the end.

Saves are synchronous: when `save` returns the checkpoint is complete on disk. Orbax writes each
one under a temporary name and renames it when done, so a process killed mid-save leaves no
checkpoint that `latest_step` would pick. With several processes every one calls `save` and
`restore` (they are collective); orbax writes replicated arrays and the JSON from process 0 only,
and each process its own shards of sharded arrays (so `work_dir` must be shared storage).
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


class Checkpoints:
    def __init__(self, directory: Path, keep: int = 2):
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False,
                                                 cleanup_tmp_directories=True),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, step: int, abstract_state: dict, shardings: dict) -> tuple[dict, dict]:
        """The state at `step`, placed with `shardings` (the same layout a fresh state gets)."""
        target = jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        return restored["state"], restored["meta"]

    def close(self) -> None:
        self.manager.close()
