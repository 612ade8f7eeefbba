"""`train.init`'s three modes as the loop implements them (training/loop.py StartFrom, launch's
init_step/init_mode): continue is the same run carried on, bit for bit; reset keeps the moments
and starts the schedule again; weights keeps the parameters only."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from tests.test_training_kjv_data import WindowBatches, kjv_tokens
from tests.test_training_loop import tiny
from training.config import KEPT_DIR
from training.hooks import Hook
from training.loop import StartFrom, load_model, train
from training.metrics import read_metrics
from training.optim import lr_schedule


def adam_state(opt_state) -> optax.ScaleByAdamState:
    return next(s for s in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
                if isinstance(s, optax.ScaleByAdamState))


@pytest.fixture(scope="module")
def data():
    tokens, vocab = kjv_tokens()
    return tokens, vocab


def run(tmp, name, model, cfg, tokens, **kw):
    batches = WindowBatches(tokens, cfg.batch_size, model.seq_len, seed=cfg.seed)
    out = tmp / name / "out"
    stats = train(model, cfg, batches.batch_at, batches.val_batches(16), tmp / name / "work", out, **kw)
    return stats, out


@pytest.mark.slow  # out of the fast suite (26 s alone, 61-77 s in it); CI runs it after it
@pytest.mark.ci
def test_continue_from_a_kept_step_is_the_uninterrupted_run_bit_for_bit(tmp_path, data):
    tokens, vocab = data
    model, whole = tiny(vocab, steps=200, warmup=10, log_every=20, eval_every=100, checkpoint_every=100)
    one, _ = run(tmp_path, "whole", model, whole, tokens)
    first_cfg = whole.model_copy(update={"steps": 100, "schedule_steps": 200, "keep_checkpoints": (100,)})
    first, first_out = run(tmp_path, "first", model, first_cfg, tokens)
    kept = first_out / KEPT_DIR / "100"
    assert (kept / "params.safetensors").is_file() and (kept / "checkpoint" / "100").is_dir()
    assert load_model(kept)[0] == model
    second, _ = run(tmp_path, "second", model, whole, tokens, start_from=StartFrom(kept, 100, "continue"))
    assert second["resumed_from_step"] == 100
    assert second["params_sha256"] == one["params_sha256"] != first["params_sha256"]

    with pytest.raises(ValueError, match="make it larger"):  # a continue phase counts the whole run's steps
        run(tmp_path, "short", model, whole.model_copy(update={"steps": 100}), tokens,
            start_from=StartFrom(kept, 100, "continue"))


def test_reset_and_weights_start_the_new_schedule_at_its_first_value(tmp_path, data):
    tokens, vocab = data
    model, parent_cfg = tiny(vocab, steps=20, warmup=4, log_every=5, eval_every=20, checkpoint_every=20,
                             keep_checkpoints=(20,))
    _, parent_out = run(tmp_path, "parent", model, parent_cfg, tokens)
    kept = parent_out / KEPT_DIR / "20"
    child_cfg = parent_cfg.model_copy(update={"steps": 10, "warmup": 2, "lr": 1e-3, "log_every": 1,
                                              "keep_checkpoints": (), "schedule": "wsd"})
    first_lr = float(lr_schedule(child_cfg)(0))
    assert first_lr != float(lr_schedule(parent_cfg)(20))  # the value a carried-on counter would give

    for mode in ("reset", "weights"):
        seen = {}

        def at_step_1(info, seen=seen):
            if info.step == 1:
                seen["count"] = int(adam_state(info.state["opt_state"]).count)
                seen["step"] = int(info.state["step"])

        kw = {"start_from": StartFrom(kept, 20, "reset")} if mode == "reset" else \
            {"init_params": load_model(kept)[1]}
        _, out = run(tmp_path, mode, model, child_cfg, tokens, hooks=[Hook(at_step_1, every=1)], **kw)
        records = read_metrics(out / "metrics.jsonl")
        assert records[0]["step"] == 1 and records[0]["lr"] == pytest.approx(first_lr, rel=1e-6), mode
        assert seen["step"] == 1, mode  # the step counter starts again
        # reset keeps the parent's moments (20 updates, one more now); weights starts them afresh
        assert seen["count"] == (21 if mode == "reset" else 1), mode
        assert np.isfinite(records[-1]["loss"])


def test_a_padded_vocabulary_is_kept_and_a_model_of_another_config_is_named_field_by_field():
    """`model.vocab_size` given (more rows than the tokenizer's tokens, as a model that began at a
    padded Hugging Face checkpoint has) is the model's, so another experiment can start from it
    (train.init.from); left at its default it is the tokenizer's, and the versions stay; fewer rows
    than tokens are refused. A step whose model differs from the one it starts from names each
    field with both values."""
    import yaml

    from flows.config import ExperimentConfig
    from flows.experiment import from_config
    from flows.plan import model_of
    from tests.conftest import REPO
    from training.config import ModelConfig, model_mismatch

    raw = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())  # a BPE of 4096 tokens
    plain = ExperimentConfig.model_validate(raw)
    padded = ExperimentConfig.model_validate({**raw, "model": {**raw["model"], "vocab_size": 4224}})
    assert model_of(plain).vocab_size == 4096 and model_of(padded).vocab_size == 4224
    assert model_of(padded) == model_of(plain).model_copy(update={"vocab_size": 4224})
    versions = {name: {s.name: s.version for s in from_config(c).steps} for name, c in (("plain", plain),
                                                                                          ("padded", padded))}
    assert versions["plain"]["tokenize"] == versions["padded"]["tokenize"]  # the data is the same
    assert versions["plain"]["train"] != versions["padded"]["train"]
    # dumped and read again (a variant's or a deployment's config) the default stays the tokenizer's
    again = ExperimentConfig.model_validate(plain.model_dump(mode="json"))
    assert {s.name: s.version for s in from_config(again).steps} == versions["plain"]
    with pytest.raises(ValueError, match="model.vocab_size is 1000 but the tokenizer has 4096 tokens"):
        model_of(ExperimentConfig.model_validate({**raw, "model": {**raw["model"], "vocab_size": 1000}}))

    ours = ModelConfig(vocab_size=302, d_model=48, n_heads=6, attention_bias=True)
    said = model_mismatch("soup/0123456789ab", ours.model_copy(update={"vocab_size": 320}), ours)
    assert "(vocab_size: 302 here, 320 there)" in said and "d_model" not in said


def test_a_model_field_beside_train_init_hf_is_refused_naming_it(tmp_path):
    """From a Hugging Face checkpoint the architecture is its config.json's: a `model` field that
    would not be read (a width, a padded vocabulary) is refused; seq_len and compute_dtype are read."""
    import yaml
    from pydantic import ValidationError

    from flows.config import ExperimentConfig
    from tests.conftest import REPO

    raw = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    raw["train"]["init"] = {"hf": str(tmp_path / "checkpoint"), "mode": "weights"}
    for field, value in (("d_model", 64), ("vocab_size", 4224)):
        with pytest.raises(ValidationError, match=f"model.{field} would never be read"):
            ExperimentConfig.model_validate({**raw, "model": {"seq_len": 64, field: value}})
    ExperimentConfig.model_validate({**raw, "model": {"seq_len": 64, "compute_dtype": "bfloat16"}})
