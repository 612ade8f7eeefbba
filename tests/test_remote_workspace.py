"""A step's work folder in a remote store (an S3 API on 127.0.0.1, moto): only checkpoints whose
upload finished count, and a training run whose host died resumes on a machine with an empty
cache from the store's last checkpoint, to the same bits as a run that never stopped."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys

import numpy as np
import pytest

from tasks.engine import local_ray
from tasks.engine.store import PUSHED, Store
from tests.conftest import REPO, free_port, moto_server, run_captured, scratch

ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def s3_root(monkeypatch):
    import s3fs

    with moto_server() as endpoint:
        for key, value in {**ENV, "AWS_ENDPOINT_URL": endpoint}.items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem(endpoint_url=endpoint, key="test", secret="test").mkdir("kiln")
        # fsspec caches filesystems by their arguments, and the endpoint comes from the environment:
        # without this a Store in this process would reach an earlier test's (stopped) server
        s3fs.S3FileSystem.clear_instance_cache()
        yield "s3://kiln/store"
        s3fs.S3FileSystem.clear_instance_cache()


def test_only_checkpoints_whose_upload_finished_are_pulled(s3_root, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "machine-a"))
    store = Store(s3_root)
    work = store.workspace("train", "v1")
    local = work.pull()
    for step in (4, 8):
        (local / "checkpoints" / str(step) / "state").mkdir(parents=True)
        (local / "checkpoints" / str(step) / "state" / "data").write_bytes(bytes([step]) * 100)
    (local / "metrics.jsonl").write_text('{"step": 8}\n')
    work.push(checkpoint_steps=[4, 8])
    # an upload cut short: files of step 12 in the store, but no marker
    store.fs.pipe_file(f"{store._remote_path}/.work/train-v1/checkpoints/12/state/data", b"partial")
    (local / "checkpoints" / "4").rename(local / "gone")  # orbax dropped step 4 (max_to_keep)
    work.push(checkpoint_steps=[8])
    assert sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(f"{store._remote_path}/.work/train-v1/{PUSHED}")) == ["8"]
    assert not store.fs.exists(f"{store._remote_path}/.work/train-v1/checkpoints/4")

    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "machine-b"))  # another machine, empty cache
    other = Store(s3_root).workspace("train", "v1").pull()
    assert other != local and other.is_relative_to(tmp_path / "machine-b")
    assert sorted(p.name for p in (other / "checkpoints").iterdir()) == ["8"]
    assert (other / "checkpoints" / "8" / "state" / "data").read_bytes() == bytes([8]) * 100
    assert (other / "metrics.jsonl").read_text() == '{"step": 8}\n'

    Store(s3_root).workspace("train", "v1").remove()
    assert not store.fs.exists(f"{store._remote_path}/.work/train-v1")
    assert not other.exists()


def _configs():
    from training.config import ModelConfig, TrainConfig

    model = ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, seq_len=32)
    train = TrainConfig(batch_size=4, steps=12, warmup=1, log_every=1, eval_every=10_000, checkpoint_every=4,
                        peak_flops=1e11)
    return model, train


MODEL, TRAIN = _configs()


def batches(die_at: int = -1):
    """Random token batches; the host process dies (as a node would) when it asks for `die_at`."""
    tokens = np.random.default_rng(0).integers(0, 256, size=(16, 4, 33), dtype=np.int32)

    def batch_at(step: int):
        if step == die_at:
            os._exit(1)
        return tokens[step % len(tokens)]

    return batch_at, [tokens[0]]


@contextlib.contextmanager
def keeper_of_another_run(monkeypatch):
    """kiln's local Ray in a folder of its own, its keeper started by a run whose store endpoint
    and cache are elsewhere (as a machine's keeper outlives the run that started it); this process
    joins it. Yields the other run's cache folder."""
    with scratch("ray") as folder:
        env = {**os.environ, "PYTHONPATH": str(REPO), "KILN_RAY_DIR": str(folder), "KILN_RAY_IDLE_S": "600",
               "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "KILN_CACHE": str(folder / "other-cache")}
        started = run_captured([sys.executable, "-c", "from tasks.engine import local_ray; local_ray.connect()"],
                               timeout=600, env=env, cwd=REPO)
        assert started.returncode == 0, started.stderr[-3000:]
        monkeypatch.setenv("KILN_RAY_DIR", str(folder))
        try:
            yield folder / "other-cache"
        finally:
            local_ray.main(["stop"])


@pytest.mark.ray
def test_training_resumes_from_the_store_on_another_machine(s3_root, tmp_path, monkeypatch):
    """Two launches in this process on kiln's local Ray, whose keeper another run started with
    another store endpoint and cache: each host task gets this run's endpoint and the KILN_CACHE
    set here (two machines' caches)."""
    import ray
    import s3fs

    from training.config import ResourcesConfig
    from training.launch import launch_training
    from training.loop import train

    assert not ray.is_initialized(), "a Ray left running by an earlier test would keep its host's KILN_CACHE"

    def run(machine: str, die_at: int) -> dict:
        (tmp_path / f"out-{machine}").mkdir()
        monkeypatch.setenv("KILN_CACHE", str(tmp_path / machine))
        return launch_training(MODEL, TRAIN, ResourcesConfig(hosts=1, cpus_per_host=1),
                               functools.partial(batches, die_at), Store(s3_root).workspace("train", "v1"),
                               tmp_path / f"out-{machine}")

    with keeper_of_another_run(monkeypatch) as other_cache:
        with pytest.raises(RuntimeError, match="training host 0 of 1 failed"):
            run("machine-a", die_at=10)  # after the checkpoints of steps 4 and 8 were saved
        assert not (tmp_path / "out-machine-a" / "params.safetensors").exists()
        # a checkpoint is pushed once its write (in the background) has finished: 8's may not have been
        fs = s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"], key="test", secret="test",
                               skip_instance_cache=True)  # fsspec's cache may hold an earlier test's server
        marked = fs.ls(f"{s3_root.removeprefix('s3://')}/.work/train-v1/{PUSHED}", detail=False)
        pushed = sorted(int(p.rstrip("/").rsplit("/", 1)[-1]) for p in marked)
        assert pushed in ([4], [4, 8]), pushed
        stats = run("machine-b", die_at=-1)
        assert stats["resumed_from_step"] == pushed[-1]  # the store's last checkpoint
        assert [h["node_ip"] for h in stats["hosts"]] == ["127.0.0.1"] and stats["hosts"][0]["node_id"]
        # the model came back through the store into the driver's output folder
        assert {p.name for p in (tmp_path / "out-machine-b").iterdir()} >= {"model.json", "params.safetensors",
                                                                             "metrics.jsonl"}
        assert not other_cache.exists()  # no host used the keeper's cache
    batch_at, val = batches()
    uninterrupted = train(MODEL, TRAIN, batch_at, val, tmp_path / "work", tmp_path / "out")
    assert stats["params_sha256"] == uninterrupted["params_sha256"]
    steps = [r["step"] for r in map(json.loads, (tmp_path / "out-machine-b" / "metrics.jsonl").read_text().splitlines())]
    assert steps == list(range(1, 13))  # the history from before the death came back from the store
