"""The train step body on a real tokenize output: documents -> GPT-2 tokenizer -> tokens -> a
model, through training/data.py's loader and a local Ray task; metrics relayed to the step log."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tasks.documents import ShardWriter
from tasks.engine.step import Step, StepContext
from tasks.tokenize import TokenizeConfig, tokenize_step
from tasks.tokenizer import TokenizerConfig, tokenizer_step
from tasks.engine.store import Located
from tasks.train import TrainStepConfig, train_step, with_eos
from tests.test_training_kjv_data import kjv_text
from training.config import ModelConfig, ResourcesConfig, TrainConfig
from training.data import read_meta
from training.launch import token_data
from training.loop import load_model, train
from training.metrics import curve_points, read_metrics

MODEL = ModelConfig(vocab_size=50257, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192, seq_len=64)
TRAIN = TrainConfig(batch_size=8, steps=8, lr=1e-2, warmup=2, log_every=2, eval_every=4, checkpoint_every=4,
                    eval_batches=2, peak_flops=1e11)


def context(step: Step, out: Path, inputs: dict, work_dir: Path, name: str = "test") -> StepContext:
    out.mkdir(parents=True)
    return StepContext(step=step, out=out, inputs=inputs, input_stats={}, work_dir=work_dir,
                       log=logging.getLogger(name))


@pytest.fixture(scope="module")
def tokens_dir(tmp_path_factory) -> tuple[Path, Step]:
    """The first 300k characters of the KJV as 5-paragraph documents, tokenized by the real steps."""
    tmp = tmp_path_factory.mktemp("tokens")
    lines = kjv_text(300_000).strip().splitlines()
    with ShardWriter(tmp / "docs", docs_per_shard=50) as w:
        for i in range(0, len(lines), 5):
            w.write({"id": f"kjv-{i}", "text": "\n".join(lines[i:i + 5]), "source": "kjv", "metadata": {}})
    docs = Step(name="docs", stage="docs", stage_version=1, config=TokenizeConfig(), run=lambda ctx: {})
    tok = tokenizer_step(TokenizerConfig())
    tok.run(context(tok, tmp / "tokenizer", {}, tmp / "w1"))
    step = tokenize_step(TokenizeConfig(validation_fraction=0.1), tokenizer=tok, documents=docs)
    step.run(context(step, tmp / "tokens", {"tokenizer": tmp / "tokenizer", "documents": tmp / "docs"}, tmp / "w2"))
    return tmp / "tokens", step


@pytest.mark.ray  # its training (or data workers) starts a local Ray: tests/conftest.py ray_lock
def test_run_train_on_a_tokenize_output(tokens_dir, tmp_path, caplog):
    folder, tokens = tokens_dir
    step = train_step(MODEL, TRAIN, ResourcesConfig(hosts=1, cpus_per_host=1), tokens=tokens)
    ctx = context(step, tmp_path / "out", {"tokens": folder}, tmp_path / "work", "step-log")
    with caplog.at_level(logging.INFO, logger="step-log"):
        stats = step.run(ctx)
    json.dumps(stats)  # lineage stores it
    assert stats["steps"] == 8 and stats["tokens"] == 8 * 8 * 64 and stats["resumed_from_step"] == 0
    assert stats["final_val_loss"] < stats["final_loss"] + 2 and stats["param_count"] > 50257 * 64
    relayed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [m.split()[1] for m in relayed] == ["2/8", "4/8", "6/8", "8/8"]
    assert "val_loss" in relayed[1] and "tok/s" in relayed[0]
    cfg, params = load_model(tmp_path / "out")
    assert cfg == MODEL and params["embed_tokens"]["embedding"].shape == (50257, 64)
    shown = {s.name: s for s in ctx.shown}  # what the runner publishes beside the step in the Prefect UI
    assert shown["curves"].kind == "image" and shown["curves"].content.startswith(b"\x89PNG")
    assert shown["metrics"].content == curve_points(read_metrics(tmp_path / "out" / "metrics.jsonl"))

    # The step again with the same work_dir (as after a crash before publishing), in-process this
    # time: it resumes from the final checkpoint and publishes the same parameters without training.
    batch_at, val = token_data(folder, MODEL, TRAIN)[0]()
    again = train(MODEL, TRAIN, batch_at, val, tmp_path / "work", tmp_path / "out2")
    assert again["resumed_from_step"] == 8 and again["params_sha256"] == stats["params_sha256"]
    assert again["final_loss"] == stats["final_loss"] and again["final_val_loss"] == stats["final_val_loss"]


def test_version_hashes_what_is_learned_not_where():
    tokens = Step(name="tokens", stage="tokenize", stage_version=1, config=TokenizeConfig(), run=lambda ctx: {})
    base = train_step(MODEL, TRAIN, ResourcesConfig(), tokens=tokens)
    elsewhere = train_step(MODEL, TRAIN.model_copy(update={"log_every": 1, "checkpoint_every": 2}),
                           ResourcesConfig(hosts=2, ray_address="127.0.0.1:1"), tokens=tokens)
    assert base.version == elsewhere.version
    assert train_step(MODEL, TRAIN.model_copy(update={"lr": 2e-2}), ResourcesConfig(), tokens=tokens).version != base.version
    assert train_step(MODEL.model_copy(update={"compute_dtype": "bfloat16"}), TRAIN, ResourcesConfig(),
                      tokens=tokens).version != base.version


def test_vocabulary_larger_than_the_model_is_refused(tokens_dir, tmp_path):
    folder, tokens = tokens_dir
    small = MODEL.model_copy(update={"vocab_size": 1000})
    step = train_step(small, TRAIN, ResourcesConfig(), tokens=tokens)
    with pytest.raises(ValueError, match="vocab_size"):
        step.run(context(step, tmp_path / "out", {"tokens": folder}, tmp_path / "work"))


def test_document_mask_takes_its_eos_id_from_the_tokens(tokens_dir):
    """train.document_mask cuts documents at the tokens' EOS: the train step fills `eos_id` in from
    the tokenize output's meta, and refuses one that disagrees with it."""
    folder, _ = tokens_dir
    tokens = Located(None, "", "", str(folder))
    eos = read_meta(folder)["eos_id"]
    assert eos == 50256  # GPT-2's <|endoftext|>
    assert with_eos(TRAIN, tokens) == TRAIN and TRAIN.eos_id is None  # no masking: nothing filled in
    masked = TRAIN.model_copy(update={"document_mask": True})
    assert with_eos(masked, tokens).eos_id == eos
    assert with_eos(masked.model_copy(update={"eos_id": eos}), tokens).eos_id == eos
    with pytest.raises(ValueError, match=r"train.eos_id=7, but the tokens' EOS id is 50256"):
        with_eos(masked.model_copy(update={"eos_id": 7}), tokens)
