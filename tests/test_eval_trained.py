"""The evaluate stage body on a model trained here, for a short while, on the KJV's training
chapters: it must score clearly above chance on held-out chapters it never saw."""

from __future__ import annotations

import json

import pytest
import yaml

from evaluation.suite import SuiteConfig
from tasks.evaluate import EvalConfig, evaluate_step
from tasks.engine.step import Step
from tests.test_eval_data import VALIDATION_FRACTION, kjv_data, run_body  # noqa: F401  (a fixture)
from tasks.engine.config import ConfigModel
from training.config import ModelConfig, TrainConfig
from training.data import BatchLoader, TokenDataset, validation_batches
from training.loop import train

MODEL = ModelConfig(vocab_size=1024, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=176, seq_len=64)
TRAIN = TrainConfig(batch_size=16, steps=300, lr=3e-3, warmup=30, checkpoint_every=1000, log_every=50,
                    eval_every=1000, eval_batches=2)


class TinyTrain(ConfigModel):
    model: ModelConfig
    train: TrainConfig


@pytest.fixture(scope="module")
def trained(kjv_data, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("trained")
    train_set, val = TokenDataset(kjv_data.tokens, "train"), TokenDataset(kjv_data.tokens, "validation")
    loader = BatchLoader([(train_set, 1.0)], TRAIN.batch_size, MODEL.seq_len, seed=TRAIN.seed)
    stats = train(MODEL, TRAIN, loader.batch, validation_batches(val, TRAIN.batch_size, MODEL.seq_len, 2),
                  root / "work", root / "model")
    step = Step(name="train", stage="train", stage_version=1, config=TinyTrain(model=MODEL, train=TRAIN),
                run=lambda ctx: {}, inputs={"tokens": kjv_data.tokens_step})
    return root / "model", step, stats


def test_trained_model_scores_above_chance_on_held_out_text(kjv_data, trained, tmp_path):  # noqa: F811
    model_dir, model_step, _ = trained
    config = EvalConfig(validation_fraction=VALIDATION_FRACTION, limit=300,
                        suite=SuiteConfig(context_words=48, choice_words=12))
    step = evaluate_step(config, model=model_step, tokenizer=kjv_data.tokenizer_step, tokens=kjv_data.tokens_step,
                         documents=kjv_data.documents_step)
    out = tmp_path / "evaluate"
    stats = run_body(step, out, {"model": model_dir, "tokenizer": kjv_data.tokenizer, "tokens": kjv_data.tokens,
                                 "documents": kjv_data.documents})
    print({k: v for k, v in stats.items() if k != "table"})  # the numbers, for the report (pytest -s)

    # Multiple choice, chance 1/4: the context must make the true next passage more likely than
    # it is on its own (mutual information), and the plain likelihood must beat chance too.
    assert stats["next_passage_chance"] == 0.25
    assert stats["next_passage_acc_mutual_info"] > 0.40
    assert stats["next_passage_acc"] > 0.28
    assert stats["last_word_acc"] > 0.02
    # Held-out loss is far below uniform over the vocabulary (ln 1024 = 6.9 nats).
    assert stats["heldout_loss"] < 5.0 and 1.0 < stats["bits_per_byte"] < 2.5

    results = json.loads((out / "results.json").read_text())
    assert results["table"] == stats["table"]
    assert results["suite_examples"]["next_passage"] == stats["next_passage_examples"] > 300
    assert results["n-samples"]["kiln_next_passage"]["effective"] == 300
    suite_yaml = yaml.safe_load((out / "tasks" / "next_passage.yaml").read_text())
    assert suite_yaml["dataset_kwargs"]["data_files"] == {"test": "next_passage.jsonl"}  # relative: the folder moves
    rows = {(r["task"], r["metric"]) for r in stats["table"]}
    assert {("next_passage", "acc"), ("next_passage", "chance"), ("last_word", "perplexity"),
            ("heldout", "bits_per_byte")} <= rows


def test_evaluate_refuses_a_different_validation_fraction(kjv_data, trained, tmp_path):  # noqa: F811
    model_dir, model_step, _ = trained
    step = evaluate_step(EvalConfig(validation_fraction=0.01), model=model_step, tokenizer=kjv_data.tokenizer_step,
                         tokens=kjv_data.tokens_step, documents=kjv_data.documents_step)
    with pytest.raises(ValueError, match="validation_fraction is 0.01 but .* held out 0.05"):
        run_body(step, tmp_path / "evaluate", {"model": model_dir, "tokenizer": kjv_data.tokenizer,
                                               "tokens": kjv_data.tokens, "documents": kjv_data.documents})


def test_bits_per_byte_only(kjv_data, trained, tmp_path):  # noqa: F811
    """What a scaling sweep asks for: no tasks, the held-out split's bits per byte only. On the
    training run's validation windows it gives exactly the training run's validation loss."""
    model_dir, model_step, train_stats = trained
    config = EvalConfig(tasks=[], bits_per_byte=True,
                        heldout_tokens=TRAIN.eval_batches * TRAIN.batch_size * MODEL.seq_len + 1,
                        validation_fraction=VALIDATION_FRACTION)
    step = evaluate_step(config, model=model_step, tokenizer=kjv_data.tokenizer_step, tokens=kjv_data.tokens_step,
                         documents=kjv_data.documents_step)
    stats = run_body(step, tmp_path / "evaluate", {"model": model_dir, "tokenizer": kjv_data.tokenizer,
                                                   "tokens": kjv_data.tokens, "documents": kjv_data.documents})
    assert stats["heldout_loss"] == pytest.approx(train_stats["final_val_loss"], abs=1e-5)
    assert {r["task"] for r in stats["table"]} == {"heldout"} and not any(k.endswith("_acc") for k in stats)
    with pytest.raises(ValueError, match="nothing to evaluate"):
        EvalConfig(tasks=[], bits_per_byte=False)
