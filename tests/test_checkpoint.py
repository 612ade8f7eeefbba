"""Asynchronous checkpoints: a write killed midway leaves nothing `latest_step` would pick, the
caller only ever hears of checkpoints complete on disk, the time cadence saves at steps the
step cadence never would, which a run then resumes from to the same bits, a write that fails on
one of two processes fails both within the timeout instead of leaving them waiting, and one
process slow to create its folders still writes every checkpoint."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tests.conftest import REPO, free_port
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


# Two processes in one JAX runtime (as two training hosts of a remote store), each saving the whole
# state into its own folder, in one of two scenarios (argv[4]):
# - "failing": process 0's second write fails in orbax's background (its JSON record cannot be
#   serialised: a stand-in for any failed write); it then skips the barrier process 1 waits at,
#   and each waits for the other.
# - "slow-folders": process 0's folders take a while to create (a slow filesystem, a busy host).
#   Orbax's signal that a step's folders exist is shared by the processes, so with its default
#   (folders created in the background) process 1's signal released process 0's writers into
#   folders not yet there: the race that twice hung the two-node test.
TWO_HOSTS = """
import asyncio, os, sys, time
from pathlib import Path
import jax.numpy as jnp
from orbax.checkpoint._src.path import async_path
from training.launch import _join_jax_runtime

host, port, folder, scenario = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
_join_jax_runtime(host, 2, f"127.0.0.1:{port}", "127.0.0.1", 60)
from training.checkpoint import Checkpoints

if scenario == "slow-folders" and host == 0:
    mkdir = async_path.mkdir

    async def slow_mkdir(*args, **kwargs):
        await asyncio.sleep(0.5)
        return await mkdir(*args, **kwargs)
    async_path.mkdir = slow_mkdir

checkpoints = Checkpoints(folder / f"host{host}", gathered=True, timeout_s=10)
state = {"w": jnp.arange(8, dtype=jnp.float32)}
try:
    for step in (1, 2, 3):
        bad = scenario == "failing" and host == 0 and step == 2
        checkpoints.save(step, state, {"step": step, "unwritable": object()} if bad else {"step": step})
        print("kept", checkpoints.wait())
except RuntimeError as e:
    chain = []
    while e is not None:
        chain.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    print(" <- ".join(chain).replace("\\n", " "))  # one line, the last of the output
sys.stdout.flush()
# Process 0 holds the runtime's coordinator, whose end would abort process 1: it waits for 1 to be done
(folder / f"done{host}").touch()
deadline = time.monotonic() + 60
while host == 0 and not (folder / "done1").exists() and time.monotonic() < deadline:
    time.sleep(0.1)
os._exit(0)  # skips JAX's shutdown barrier, which would wait for a peer that may be gone
"""


def _two_hosts(tmp: Path, scenario: str) -> list[str]:
    """Each process's last line of output (gloo prints to stdout too)."""
    port = free_port()
    hosts = [subprocess.Popen([sys.executable, "-c", TWO_HOSTS, str(host), str(port), str(tmp), scenario], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for host in (0, 1)]
    try:
        # orbax's own bound is 20 minutes: without the timeout a waiting process would still wait here
        said = [host.communicate(timeout=240) for host in hosts]
    finally:
        for host in hosts:
            host.kill()
    for host, (out, err) in zip(hosts, said):
        assert host.returncode == 0, err[-3000:]
    return [out.splitlines()[-1] for out, _ in said]


def test_a_write_failing_on_one_of_two_processes_fails_both_within_the_timeout(tmp_path):
    said = _two_hosts(tmp_path, "failing")
    for host, last in enumerate(said):
        assert last.startswith(f"RuntimeError: process {host}: the checkpoint write of step 2 in "
                               f"{tmp_path / f'host{host}'} failed, or with several processes another's did and "
                               "this one waited 10 s for it"), last
        assert sorted(p.name for p in (tmp_path / f"host{host}").iterdir() if p.name.isdigit()) == ["1"]  # kept
    assert said[0].endswith("<- TypeError: Object of type object is not JSON serializable")  # the cause, on host 0


def test_one_process_slow_to_create_its_folders_still_writes_every_checkpoint(tmp_path):
    assert _two_hosts(tmp_path, "slow-folders") == ["kept [2, 3]", "kept [2, 3]"]
    for host in (0, 1):
        assert sorted(p.name for p in (tmp_path / f"host{host}").iterdir() if p.name.isdigit()) == ["2", "3"]
