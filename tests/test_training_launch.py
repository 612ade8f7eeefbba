"""Training inside Ray: a local Ray started in-process, two hosts joined in one JAX distributed
runtime, and a Ray cluster started with `ray start` and reached through RAY_ADDRESS."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ray

from tests.test_training_kjv_data import WindowBatches, kjv_tokens
from training.config import ModelConfig, ResourcesConfig, TrainConfig
from training.launch import launch_training
from training.loop import train
from training.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent


def kjv_data(batch_size: int, seq_len: int):
    """The data source: runs on each host (Ray pickles this function by reference)."""
    data = WindowBatches(kjv_tokens()[0], batch_size, seq_len)
    return data.batch_at, data.val_batches(16)


def configs(steps: int = 12) -> tuple[ModelConfig, TrainConfig]:
    model = ModelConfig(vocab_size=kjv_tokens()[1], d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=192, seq_len=64)
    return model, TrainConfig(batch_size=16, steps=steps, lr=1e-2, warmup=3, log_every=1, eval_every=6,
                              checkpoint_every=6, peak_flops=1e11)


def launch(tmp: Path, hosts: int, steps: int = 12) -> tuple[dict, list[dict]]:
    model, cfg = configs(steps)
    seen: list[dict] = []
    stats = launch_training(model, cfg, ResourcesConfig(hosts=hosts, cpus_per_host=1),
                            functools.partial(kjv_data, cfg.batch_size, model.seq_len),
                            tmp / "work", tmp / "out", on_metrics=seen.append)
    return stats, seen


@pytest.fixture(scope="module")
def one_host(tmp_path_factory) -> tuple[dict, list[dict], Path]:
    assert not ray.is_initialized()
    tmp = tmp_path_factory.mktemp("one_host")
    stats, seen = launch(tmp, hosts=1)
    return stats, seen, tmp


def test_local_ray_task_trains_same_bits_as_in_process(one_host, tmp_path):
    stats, seen, tmp = one_host
    assert not ray.is_initialized()  # the local Ray launch started was shut down again
    assert [r["step"] for r in seen] == list(range(1, 13))  # relayed while training ran
    assert read_metrics(tmp / "out" / "metrics.jsonl") == seen
    assert (tmp / "out" / "params.safetensors").exists() and (tmp / "out" / "loss.png").exists()
    assert stats["processes"] == 1 and stats["steps"] == 12
    model, cfg = configs()
    batch_at, val = kjv_data(cfg.batch_size, model.seq_len)
    local = train(model, cfg, batch_at, val, tmp_path / "work", tmp_path / "out")
    assert local["params_sha256"] == stats["params_sha256"]


@pytest.mark.slow  # two JAX processes in Ray tasks: a minute on 2 quiet cores
def test_two_hosts_join_one_jax_runtime_and_match_one_host(one_host, tmp_path):
    single, single_seen, _ = one_host
    stats, seen = launch(tmp_path, hosts=2)
    assert stats["processes"] == 2 and stats["devices"] == 2
    np.testing.assert_allclose([r["loss"] for r in seen], [r["loss"] for r in single_seen], rtol=2e-4)
    np.testing.assert_allclose(stats["final_val_loss"], single["final_val_loss"], rtol=2e-4)
    # only host 0 writes: one record per step (two writers would interleave duplicates) and one
    # set of outputs; orbax wrote each checkpoint once, complete
    assert [r["step"] for r in read_metrics(tmp_path / "work" / "metrics.jsonl")] == list(range(1, 13))
    assert sorted(p.name for p in (tmp_path / "work" / "checkpoints").iterdir()) == ["12", "6"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "loss.png", "metrics.jsonl", "model.json", "params.safetensors"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, head: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited {head.returncode}: {head.stdout.read()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"Ray head on port {port} not up after {timeout_s} s")


@pytest.mark.slow  # starts a Ray cluster with `ray start`: ~10 s before any training
def test_training_on_a_started_ray_head_via_ray_address(tmp_path, monkeypatch):
    port = _free_port()
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    temp_dir = f"/tmp/kiln-ray-{port}"  # our own session folder: other Rays on this machine untouched
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--port", str(port), "--node-ip-address", "127.0.0.1", "--num-cpus", "2",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}", "--block"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for_port(port, head)
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        stats, seen = launch(tmp_path, hosts=1, steps=6)
        assert ray.is_initialized()  # connected to the cluster, not a Ray of our own
        assert ray.cluster_resources().get("CPU") == 2
        assert [r["step"] for r in seen] == list(range(1, 7))
        assert stats["steps"] == 6 and np.isfinite(stats["final_loss"])
        assert (tmp_path / "out" / "params.safetensors").exists()
    finally:
        ray.shutdown()
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # anything of this session still alive
        except ProcessLookupError:
            pass
        shutil.rmtree(temp_dir, ignore_errors=True)
