"""train.ema: a moving average of the parameters beside training. Training is bit for bit what it
is without one; the published model (output, kept steps) is the average, each step's
decay * ema + (1 - decay) * params from the parameters it started at; `ema_val_loss` is logged
beside `val_loss`; the average is in the checkpoint, so a resume gives the same bits."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.test_training_kjv_data import WindowBatches, kjv_tokens
from tests.test_training_loop import tiny
from training.config import KEPT_DIR, LoraConfig, TrainConfig
from training.hooks import Hook
from training.loop import StartFrom, flatten_params, read_model, train
from training.metrics import read_metrics
from tasks.engine.versioning import step_version
from tasks.train import TrainStepConfig

DECAY = 0.8  # short runs: an average that lags the parameters by a few steps


def trained(tmp, model, cfg, start: dict | None = None, start_from: StartFrom | None = None) -> tuple[dict, list]:
    """Stats and the trained parameters after every step (host copies, flattened)."""
    tokens, _ = kjv_tokens()
    data = WindowBatches(tokens, cfg.batch_size, model.seq_len, seed=cfg.seed)
    seen = []
    record = Hook(lambda info: seen.append(flatten_params(jax.device_get(info.params))), 1)
    stats = train(model, cfg, data.batch_at, data.val_batches(16), tmp / "work", tmp / "out", init_params=start,
                  hooks=[record], start_from=start_from)
    return stats, seen


def test_training_is_unchanged_and_the_published_model_is_the_average(tmp_path):
    _, vocab = kjv_tokens()
    model, plain = tiny(vocab, steps=12, eval_every=5, log_every=5, keep_checkpoints=(5,))
    start = read_model_params(tmp_path, model, vocab)
    base, base_steps = trained(tmp_path / "plain", model, plain, start)
    stats, steps = trained(tmp_path / "ema", model, plain.model_copy(update={"ema": DECAY}), start)

    # training itself: the same parameters at every step, the same losses
    assert all(a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a) for a, b in zip(base_steps, steps))
    records, base_records = (read_metrics(tmp_path / run / "out" / "metrics.jsonl") for run in ("ema", "plain"))
    assert [r["loss"] for r in records] == [r["loss"] for r in base_records]
    assert stats["final_val_loss"] == base["final_val_loss"] and stats["final_loss"] == base["final_loss"]

    # the published model: the average from the starting parameters, step by step
    ema = {k: v.astype(np.float64) for k, v in flatten_params(start).items()}
    averages = []
    for params in steps:
        ema = {k: DECAY * ema[k] + (1 - DECAY) * params[k] for k in ema}
        averages.append(ema)
    published = load_file(str(tmp_path / "ema" / "out" / "params.safetensors"))
    kept = load_file(str(tmp_path / "ema" / "out" / KEPT_DIR / "5" / "params.safetensors"))
    for key in published:
        np.testing.assert_allclose(published[key], averages[-1][key], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(kept[key], averages[4][key], rtol=1e-5, atol=1e-6)
    assert not np.array_equal(published[key], steps[-1][key])  # the average, not the last parameters

    # ema_val_loss beside val_loss: the average's, a number of its own
    evaluated = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [5, 10, 12] and all("ema_val_loss" in r for r in evaluated)
    assert stats["final_ema_val_loss"] == evaluated[-1]["ema_val_loss"] != evaluated[-1]["val_loss"]
    assert "ema_val_loss" not in base_records[-1] and "final_ema_val_loss" not in base


def test_with_a_warmup_the_decay_ramps_up_and_the_start_is_forgotten(tmp_path):
    """train.ema_warmup: step t's decay is min(ema, (1 + t) / (10 + t)); the average then holds
    almost none of the starting parameters, where a fixed decay keeps ema^steps of them."""
    _, vocab = kjv_tokens()
    model, cfg = tiny(vocab, steps=12, eval_every=12, log_every=6)
    start = read_model_params(tmp_path, model, vocab)
    _, steps = trained(tmp_path / "plain", model, cfg, start)  # the same steps with or without an average
    published = {}
    for warmup in (True, False):
        run = tmp_path / f"warmup-{warmup}"
        trained(run, model, cfg.model_copy(update={"ema": 0.99, "ema_warmup": warmup}), start)
        published[warmup] = load_file(str(run / "out" / "params.safetensors"))
        ema = {k: v.astype(np.float64) for k, v in flatten_params(start).items()}
        for t, params in enumerate(steps, start=1):
            decay = min(0.99, (1 + t) / (10 + t)) if warmup else 0.99
            ema = {k: decay * ema[k] + (1 - decay) * params[k] for k in ema}
        for key in published[warmup]:
            np.testing.assert_allclose(published[warmup][key], ema[key], rtol=1e-5, atol=1e-6)
    key = "embed_tokens.embedding" if "embed_tokens.embedding" in steps[-1] else next(iter(steps[-1]))
    distance = {w: np.abs(published[w][key] - steps[-1][key]).mean() for w in (True, False)}
    assert distance[True] < distance[False] / 2  # the warmed-up average is near training, not the start

    with pytest.raises(ValueError, match="ema_warmup ramps up the decay of train.ema"):
        TrainConfig(ema_warmup=True)


def read_model_params(tmp_path, model, vocab) -> dict:
    """A starting point of the model's shape (train.init mode weights, post-training): a run of 2 steps."""
    _, cfg = tiny(vocab, steps=2, warmup=1, seed=7)
    trained(tmp_path / "start", model, cfg)
    return read_model(tmp_path / "start" / "out")[1]


def test_the_average_is_checkpointed_and_a_resume_gives_the_same_bits(tmp_path):
    _, vocab = kjv_tokens()
    model, cfg = tiny(vocab, steps=20, checkpoint_every=10, ema=DECAY, keep_checkpoints=(20,))
    first, _ = trained(tmp_path, model, cfg)
    shutil.rmtree(tmp_path / "work" / "checkpoints" / "20")  # as if the run had died before its last save
    again, _ = trained(tmp_path, model, cfg)
    assert again["resumed_from_step"] == 10
    assert again["params_sha256"] == first["params_sha256"]
    assert again["final_ema_val_loss"] == first["final_ema_val_loss"]

    # a continue phase without an average cannot take this state, and says what to do
    _, plain = tiny(vocab, steps=30)
    with pytest.raises(ValueError, match="train.ema set or unset alike"):
        train(model, plain, WindowBatches(kjv_tokens()[0], 16, model.seq_len, seed=0).batch_at, [],
              tmp_path / "child" / "work", tmp_path / "child" / "out",
              start_from=StartFrom(tmp_path / "out" / KEPT_DIR / "20", 20, "continue"))


def test_ema_is_refused_with_lora_and_moves_the_version_only_when_set():
    from tests.test_phases import PHASED
    from flows.config import ExperimentConfig

    phases = {"second": {"steps": 20, "train": {"ema": 0.99}}}  # continues a run without an average
    with pytest.raises(ValueError, match="phases.second.train.ema: mode continue carries on train's train state"):
        ExperimentConfig.model_validate({**PHASED, "phases": phases}).phase_trains()
    fresh = {"second": {"steps": 20, "mode": "weights", "train": {"ema": 0.99}}}  # parameters only: its own average
    assert ExperimentConfig.model_validate({**PHASED, "phases": fresh}).phase_trains()["train/second"][0].ema == 0.99
    with pytest.raises(ValueError, match="leave ema out with lora"):
        TrainConfig(ema=0.999, lora=LoraConfig(rank=4, alpha=8))
    with pytest.raises(ValueError):
        TrainConfig(ema=1.0)

    def version(train):
        return step_version("train", 6, TrainStepConfig(train=train), [])

    assert version(TrainConfig()) == version(TrainConfig(ema=None))
    assert version(TrainConfig(ema=0.999)) != version(TrainConfig())
    assert version(TrainConfig(ema=0.999, ema_warmup=False)) == version(TrainConfig(ema=0.999))
    assert version(TrainConfig(ema=0.999, ema_warmup=True)) != version(TrainConfig(ema=0.999))
