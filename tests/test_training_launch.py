"""Training inside Ray: a local Ray started in-process, two hosts joined in one JAX distributed
runtime, and a Ray cluster started with `ray start` and reached through RAY_ADDRESS."""

from __future__ import annotations

import functools
import re
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import ray

from tasks.engine import local_ray
from flows.config import load_config
from tests.conftest import REPO, ray_head, ray_lock
from tests.test_training_kjv_data import WindowBatches, kjv_tokens
from training.config import MeshConfig, ModelConfig, ResourcesConfig, TrainConfig, check_cpu_devices
from training.hooks import Hook, LoopContext, StepInfo
from training.launch import launch_training
from training.loop import train
from training.metrics import read_metrics

pytestmark = pytest.mark.ray  # each launch starts a local Ray (or, below, a head): tests/conftest.py ray_lock


def kjv_data(batch_size: int, seq_len: int):
    """The data source: runs on each host (Ray pickles this function by reference)."""
    data = WindowBatches(kjv_tokens()[0], batch_size, seq_len)
    return data.batch_at, data.val_batches(16)


def configs(steps: int = 12) -> tuple[ModelConfig, TrainConfig]:
    model = ModelConfig(vocab_size=kjv_tokens()[1], d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=192, seq_len=64)
    return model, TrainConfig(batch_size=16, steps=steps, lr=1e-2, warmup=3, log_every=1, eval_every=6,
                              checkpoint_every=6, peak_flops=1e11)


def launch(tmp: Path, hosts: int, steps: int = 12, cpu_devices: int = 1, hooks=(),
           **train_fields) -> tuple[dict, list[dict]]:
    model, cfg = configs(steps)
    cfg = cfg.model_copy(update=train_fields)
    seen: list[dict] = []
    stats = launch_training(model, cfg, ResourcesConfig(hosts=hosts, cpus_per_host=1, cpu_devices=cpu_devices),
                            functools.partial(kjv_data, cfg.batch_size, model.seq_len),
                            tmp / "work", tmp / "out", on_metrics=seen.append, hooks=hooks)
    return stats, seen


def failing_on(host: int, step: int, ctx: LoopContext) -> list[Hook]:
    """A hook factory (runs on every host): host `host` raises after `step`, while its peer goes on
    into the next step, whose collectives wait for the failed host."""
    def fail(info: StepInfo) -> None:
        if jax.process_index() == host and info.step == step:
            raise RuntimeError(f"planted failure on host {host} after step {step}")
    return [Hook(fail, 1)]


@pytest.fixture(scope="module")
def one_host(tmp_path_factory) -> tuple[dict, list[dict], Path]:
    assert not ray.is_initialized()
    tmp = tmp_path_factory.mktemp("one_host")
    with ray_lock(exclusive=False):  # a module fixture: set up before the test's own hold
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


def test_two_cpu_devices_split_each_batch_and_learn_what_one_device_does(one_host, tmp_path):
    """resources.cpu_devices 2: the Ray task's JAX has two CPU devices (the flag reached the worker
    before its JAX started), the step runs data parallel over them, and the run is the one-device
    run up to the order of the gradient's sums."""
    single, single_seen, _ = one_host
    stats, seen = launch(tmp_path, hosts=1, cpu_devices=2, mesh=MeshConfig(strategy="dp"))
    assert stats["processes"] == 1 and stats["devices"] == 2 and stats["platform"] == "cpu"
    assert [r["step"] for r in seen] == list(range(1, 13))
    np.testing.assert_allclose([r["loss"] for r in seen], [r["loss"] for r in single_seen], rtol=1e-4)
    np.testing.assert_allclose(stats["final_val_loss"], single["final_val_loss"], rtol=1e-4)


def test_cpu_devices_need_dp_and_a_batch_they_divide(tmp_path):
    """Refused when the config is read, naming the field to change, before any step runs."""
    _, cfg = configs()
    two = ResourcesConfig(cpu_devices=2)
    with pytest.raises(ValueError, match="set train.mesh.strategy: dp"):
        check_cpu_devices(cfg, two)  # fsdp, the default
    dp = cfg.model_copy(update={"mesh": MeshConfig(strategy="dp")})
    check_cpu_devices(dp, two)
    with pytest.raises(ValueError, match="batch_size=16 .* does not split over 3 data-parallel devices"):
        check_cpu_devices(dp, ResourcesConfig(cpu_devices=3))
    with pytest.raises(ValueError, match="in 16 microbatch"):
        check_cpu_devices(dp.model_copy(update={"microbatches": 16}), two)
    check_cpu_devices(cfg, ResourcesConfig(cpu_devices=2, gpus_per_host=1))  # a GPU host's devices are its GPUs
    text = (REPO / "configs" / "tiny_cpu.yaml").read_text().replace("gpus_per_host: 0}", "gpus_per_host: 0, cpu_devices: 2}")
    (tmp_path / "two.yaml").write_text(text)
    with pytest.raises(ValueError, match="cpu_devices=2 splits"):
        load_config(tmp_path / "two.yaml")


# two JAX processes in Ray tasks: a minute on 2 quiet cores. Slow: tests/test_two_nodes.py runs two
# hosts (on two nodes, through the store) in CI.
@pytest.mark.slow
def test_two_hosts_join_one_jax_runtime_and_match_one_host(one_host, tmp_path):
    single, single_seen, _ = one_host
    # with a time cadence short enough to save at every step: host 0 decides and tells host 1
    stats, seen = launch(tmp_path, hosts=2, checkpoint_every_minutes=1e-9)
    assert stats["processes"] == 2 and stats["devices"] == 2
    np.testing.assert_allclose([r["loss"] for r in seen], [r["loss"] for r in single_seen], rtol=2e-4)
    np.testing.assert_allclose(stats["final_val_loss"], single["final_val_loss"], rtol=2e-4)
    # only host 0 writes: one record per step (two writers would interleave duplicates) and one
    # set of outputs; orbax wrote each checkpoint once, complete (the last two kept)
    assert [r["step"] for r in read_metrics(tmp_path / "work" / "metrics.jsonl")] == list(range(1, 13))
    assert sorted(p.name for p in (tmp_path / "work" / "checkpoints").iterdir()) == ["11", "12"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "loss.png", "metrics.jsonl", "model.json", "params.safetensors", "tensorboard"]


def dpo_pairs(model: ModelConfig, train_cfg: TrainConfig, out: str):
    """A DPO data source (runs on each host): random pairs scored by the frozen reference (the
    start's parameters) on the training's mesh, every host's log-probs saved to `out`/<host>.npy."""
    from training.model import init_params
    from training.posttrain import RowBatches, fixed_batches, reference_logprobs, reference_pairs_per_call
    from training.sharding import make_mesh

    inputs = np.random.default_rng(0).integers(0, model.vocab_size, size=(10, 2, model.seq_len)).astype(np.int32)
    rows = {"inputs": inputs, "targets": np.roll(inputs, -1, 2), "loss_mask": np.ones(inputs.shape, np.int32)}
    mesh = make_mesh(train_cfg.mesh)
    rows["ref_logp"] = reference_logprobs(init_params(model, jax.random.PRNGKey(3)), rows, model,
                                          reference_pairs_per_call(train_cfg, mesh), mesh, train_cfg.mesh.strategy)
    np.save(Path(out) / f"{jax.process_index()}.npy", rows["ref_logp"])
    return RowBatches(rows, train_cfg.batch_size, 0).batch_at, fixed_batches(rows, train_cfg.batch_size, 1)


# Two JAX processes (~30 s here): CI runs it after the fast suite.
@pytest.mark.slow
@pytest.mark.ci
def test_dpo_reference_pass_spans_the_hosts_and_matches_one_process(tmp_path):
    """DPO's reference pass runs on the training's mesh, its parameters under FSDP over both hosts'
    devices (a collective: both hosts score every pair): each host gets every pair's log-probs,
    those of a one-process pass, and the first step against them is DPO's log 2. What host 0 says
    of the pass reaches the driver (`on_note`; the DPO step's log)."""
    from training.loop import flatten_params, save_model
    from training.model import init_params
    from training.posttrain import DPOObjective, reference_logprobs

    model, cfg = configs()
    cfg = cfg.model_copy(update={"batch_size": 4, "microbatches": 2, "steps": 2, "warmup": 1, "eval_every": 2,
                                 "checkpoint_every": 2, "mesh": MeshConfig(strategy="fsdp")})
    (tmp_path / "ref").mkdir()
    save_model(tmp_path / "work" / "start", model, flatten_params(init_params(model, jax.random.PRNGKey(3))))
    seen, notes = [], []
    launch_training(model, cfg, ResourcesConfig(hosts=2, cpus_per_host=1),
                    functools.partial(dpo_pairs, model, cfg, str(tmp_path / "ref")), tmp_path / "work",
                    tmp_path / "out", on_metrics=seen.append, objective=DPOObjective(0.1), init_model="start",
                    on_note=notes.append)
    inputs = np.random.default_rng(0).integers(0, model.vocab_size, size=(10, 2, model.seq_len)).astype(np.int32)
    rows = {"inputs": inputs, "targets": np.roll(inputs, -1, 2), "loss_mask": np.ones(inputs.shape, np.int32)}
    alone = reference_logprobs(init_params(model, jax.random.PRNGKey(3)), rows, model, 4)
    for host in (0, 1):
        np.testing.assert_allclose(np.load(tmp_path / "ref" / f"{host}.npy"), alone, rtol=1e-6)
    assert [r["step"] for r in seen] == [1, 2] and seen[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)
    assert len(notes) == 1, notes  # host 0's
    assert re.fullmatch(r"the reference model scored 10 pairs in [\d.]+ s", notes[0]), notes


# Two JAX processes again, as above (~15 s each here). Before, a failed host first waited in JAX's
# shutdown barrier (its timeout: 300 s) for a peer that was itself waiting in the step's collectives
# for it: host 0's case was still waiting when this test's 240 s timeout failed it.
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("host", [0, 1])
def test_a_host_that_fails_mid_run_fails_the_launch_naming_it(tmp_path, host):
    with pytest.raises(RuntimeError, match=rf"(?s)training host {host} of 2 failed, on node .*planted failure on "
                                           rf"host {host} after step 3"):
        launch(tmp_path, hosts=2, hooks=(functools.partial(failing_on, host, 3),))
    # host 0 writes the metrics: it failed before logging step 3, or its peer failed and it stopped
    # in step 4's collectives (cancelled while waiting there)
    logged = [r["step"] for r in read_metrics(tmp_path / "work" / "metrics.jsonl")]
    assert (logged == [1, 2]) if host == 0 else (logged in ([1, 2], [1, 2, 3]))


def test_a_stop_while_waiting_for_ray_to_place_the_hosts_ends_the_wait_at_once():
    """A train step waiting for the local Ray's CPUs (another run's training holds them: here a
    placement group of all of them) when the run is stopped: the wait ends within a second or
    two with Stopped. Before, it checked for a stop never, and the run waited out the
    scheduler's grace (120 s) before it could exit."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from training.launch import _wait_placed

    outcome: list[BaseException | None] = []

    def wait(group) -> None:
        try:
            _wait_placed(group, {"CPU": 1}, 1)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    with ray_lock():  # every CPU of the local Ray held for a few seconds: no other test's training beside it
        local_ray.connect()
        held = waiting = None
        try:
            held = placement_group([{"CPU": ray.cluster_resources()["CPU"]}])
            ray.get(held.ready(), timeout=120)
            waiting = placement_group([{"CPU": 1}])
            waiter = threading.Thread(target=wait, args=(waiting,), daemon=True)
            waiter.start()
            time.sleep(3)
            assert waiter.is_alive() and not outcome  # it waits: the CPUs are held
            local_ray.stopping.set()
            waiter.join(timeout=10)
            assert not waiter.is_alive(), "the wait went on after the stop"
        finally:
            local_ray.stopping.clear()
            for group in (waiting, held):
                if group is not None:
                    remove_placement_group(group)
            local_ray.disconnect()
    assert isinstance(outcome[0], local_ray.Stopped), outcome


def slowed(seconds: float, ctx: LoopContext) -> list[Hook]:
    """A hook factory (with `seconds` bound): each step takes that much more, so a stop lands
    mid-run (the bits are the same), or a step takes as long as a large model's."""
    return [Hook(lambda info: time.sleep(seconds), 1)]


def stopped_at(tmp: Path, model: ModelConfig, cfg: TrainConfig, resources: ResourcesConfig, data, step: int,
               seconds: float) -> int:
    """Launch with each step `seconds` slower, stop the run (local_ray.stopping: Ctrl-C, SIGTERM)
    once step `step` is logged, and return the step the hosts stopped at."""
    def stop(record: dict) -> None:
        if record["step"] == step:
            local_ray.stopping.set()

    try:
        with pytest.raises(local_ray.Stopped, match=r"stopped at step \d+, its checkpoint saved there") as stopped:
            launch_training(model, cfg, resources, data, tmp / "work", tmp / "out", on_metrics=stop,
                            hooks=(functools.partial(slowed, seconds),))
    finally:
        local_ray.stopping.clear()
    return int(re.search(r"stopped at step (\d+)", str(stopped.value)).group(1))


# Two hosts: two JAX processes again (slow, as above); the pipeline's one-host version is in
# tests/test_faults.py (Ctrl-C and SIGTERM to kiln run)
@pytest.mark.parametrize("hosts", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_stopping_run_checkpoints_its_hosts_where_they_are_and_the_relaunch_resumes_there(tmp_path, hosts):
    """Ctrl-C or SIGTERM (local_ray.stopping) while the hosts train: host 0 is told, every host stops
    at the same step (with two, host 0 decides and tells host 1: hooks.StopAgreement) once its
    checkpoint is whole, and the launch raises Stopped naming that step; launched again, it
    resumes there, to the bits of a run never stopped. Before, the hosts were cancelled where
    they were."""
    model, cfg = configs(steps=200)
    cfg = cfg.model_copy(update={"checkpoint_every": 100, "log_every": 2})
    resources = ResourcesConfig(hosts=hosts, cpus_per_host=1)
    data = functools.partial(kjv_data, cfg.batch_size, model.seq_len)
    at = stopped_at(tmp_path, model, cfg, resources, data, 10, 0.02)
    assert 10 <= at < 100, at  # before the first periodic checkpoint
    assert sorted(p.name for p in (tmp_path / "work" / "checkpoints").iterdir()) == [str(at)]
    assert not (tmp_path / "out" / "params.safetensors").exists()
    stats = launch_training(model, cfg, resources, data, tmp_path / "work", tmp_path / "out")
    assert stats["resumed_from_step"] == at and stats["processes"] == hosts
    if hosts == 1:  # two processes sum the gradient in another order: not the same bits
        assert stats["params_sha256"] == train(model, cfg, *data(), tmp_path / "again", tmp_path / "again-out")[
            "params_sha256"]


# Two JAX processes, ~50 s here: CI runs it after the fast suite.
@pytest.mark.slow
@pytest.mark.ci
def test_two_hosts_agree_on_a_stop_within_seconds_not_at_the_next_log_step(tmp_path):
    """With several hosts a stop is agreed within about 10 s of their steps (hooks.StopAgreement):
    with 0.4 s steps, within about 25 steps, not at the next log step 50 steps on. Before, it
    waited for the next log step: an 8B run's 20 s steps at log_every 10 outlasted the stop's
    grace (60 s), and the hosts were cancelled without their checkpoint."""
    model, cfg = configs(steps=200)
    cfg = cfg.model_copy(update={"checkpoint_every": 150, "log_every": 50, "eval_every": 200})
    resources = ResourcesConfig(hosts=2, cpus_per_host=1)
    at = stopped_at(tmp_path, model, cfg, resources, functools.partial(kjv_data, cfg.batch_size, model.seq_len),
                    50, 0.4)
    assert 50 < at < 100, at  # agreed between log steps
    assert sorted(p.name for p in (tmp_path / "work" / "checkpoints").iterdir()) == [str(at)]


@pytest.mark.slow  # the pipeline's version of this runs in CI: tests/test_pipeline_ray.py
def test_training_on_a_started_ray_head_via_ray_address(tmp_path, monkeypatch):
    # First kiln's local Ray, as a process that ran a step on it would: joining it turns Ray's token
    # authentication on in this process, and leaving it must turn that off again, or this driver,
    # still expecting tokens, refuses the token-less head's calls ("Missing authorization header").
    local_ray.connect()
    local_ray.disconnect()
    with ray_head(num_cpus=2) as address:
        monkeypatch.setenv("RAY_ADDRESS", address)
        monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # as the head (see conftest.ray_head)
        try:
            stats, seen = launch(tmp_path, hosts=1, steps=6)
            assert ray.is_initialized()  # connected to the cluster, not a Ray of our own
            assert ray.cluster_resources().get("CPU") == 2
        finally:
            ray.shutdown()
    assert stats["ray_cluster"] == address
    assert [r["step"] for r in seen] == list(range(1, 7))
    assert stats["steps"] == 6 and np.isfinite(stats["final_loss"])
    assert (tmp_path / "out" / "params.safetensors").exists()
