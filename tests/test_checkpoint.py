"""Asynchronous checkpoints: a write killed midway leaves nothing `latest_step` would pick, the
caller only ever hears of checkpoints complete on disk, and the time cadence saves at steps the
step cadence never would, which a run then resumes from to the same bits."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tests.conftest import REPO
from tests.test_training_loop import tiny
from tests.test_training_kjv_data import WindowBatches, kjv_tokens
from training.checkpoint import Checkpoints
from training.hooks import _minutes_passed
from training.loop import train

# Saves step 1 and waits for it, then starts step 2 (200 MB: its write takes a while) and dies as
# soon as the write has begun (its temporary folder exists; on a busy machine that can be a moment
# after `save` returns), as a process killed mid-write would.
KILLED = """
import os, sys, time
from pathlib import Path
import jax.numpy as jnp
from training.checkpoint import Checkpoints

checkpoints = Checkpoints(Path(sys.argv[1]))
checkpoints.save(1, {"w": jnp.arange(10, dtype=jnp.float32)}, {"step": 1})
assert checkpoints.wait() == [1]
checkpoints.save(2, {"w": jnp.arange(50_000_000, dtype=jnp.float32)}, {"step": 2})
deadline = time.monotonic() + 120
while not (Path(sys.argv[1]) / "2.orbax-checkpoint-tmp").exists() and time.monotonic() < deadline:
    time.sleep(0.001)
os._exit(0)
"""


def test_a_process_killed_mid_write_leaves_the_previous_checkpoint_latest(tmp_path):
    done = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["1", "2.orbax-checkpoint-tmp"], left  # step 2 was cut short, under its temporary name

    checkpoints = Checkpoints(tmp_path)
    assert checkpoints.latest_step() == 1 and checkpoints.all_steps() == [1]
    abstract = {"w": jnp.zeros(10, jnp.float32)}
    state, meta = checkpoints.restore(1, abstract, {"w": jax.sharding.SingleDeviceSharding(jax.devices()[0])})
    assert meta == {"step": 1} and np.array_equal(np.asarray(state["w"]), np.arange(10, dtype=np.float32))
    checkpoints.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]  # the leftover was removed


def test_time_cadence_saves_only_complete_checkpoints_and_resumes_bitwise(tmp_path):
    # checkpoint_every never fires within 20 steps; a cadence this short fires at every log step
    model, cfg = tiny(kjv_tokens()[1], steps=20, checkpoint_every=1000, checkpoint_every_minutes=1e-9)
    folder = tmp_path / "work" / "checkpoints"
    reported: list[list[int]] = []

    def on_checkpoint(steps: list[int]) -> None:
        on_disk = sorted(p.name for p in folder.iterdir())
        assert all(str(s) in on_disk for s in steps), (steps, on_disk)  # every one written and renamed
        reported.append(steps)

    first = _train(tmp_path, model, cfg, on_checkpoint)
    assert reported[-1] == [15, 20] and sorted(int(p.name) for p in folder.iterdir()) == [15, 20]
    assert [max(steps) for steps in reported] == [5, 10, 15, 20]  # each write reported once

    shutil.rmtree(folder / "20")  # as if the run had died before its last save was written
    again = _train(tmp_path, model, cfg)
    assert again["resumed_from_step"] == 15  # a checkpoint the time cadence made
    assert again["params_sha256"] == first["params_sha256"] and again["final_loss"] == first["final_loss"]


def _train(tmp: Path, model, cfg, on_checkpoint=None) -> dict:
    tokens, _ = kjv_tokens()
    data = WindowBatches(tokens, cfg.batch_size, model.seq_len, seed=cfg.seed)
    return train(model, cfg, data.batch_at, [], tmp / "work", tmp / "out", on_checkpoint=on_checkpoint)


def test_minutes_passed_counts_minutes_of_wall_time():
    now = time.monotonic()
    assert _minutes_passed(now - 90, 1) and not _minutes_passed(now, 1) and not _minutes_passed(now - 3600, None)
