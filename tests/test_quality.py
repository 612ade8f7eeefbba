"""The quality classifier: a real fastText model trained on KJV chapters against their
word-shuffled copies (the `negative_examples` step), its held-out scores, and the filter that
keeps a threshold or an exact top fraction."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from tasks.documents import ShardWriter, list_shards, read_shard
from tasks.judging import ATTRIBUTES, explain
from tasks.quality import (MODEL_FILE, NegativeExamplesConfig, QualityClassifierConfig, QualityFilterConfig,
                           negative_examples_step, quality_filter_step, train_quality_classifier_step)
from tasks.engine.step import Step, StepContext
from tests.conftest import kjv_chapters


def write_docs(folder: Path, docs: list[dict], per_shard: int = 200) -> Path:
    with ShardWriter(folder, docs_per_shard=per_shard) as w:
        for d in docs:
            w.write({"source": "test", "metadata": {}, **d})
    return folder


def source() -> Step:
    return Step(name="acquire", stage="acquire", stage_version=1, config=NegativeExamplesConfig(), run=lambda ctx: {})


def run_body(step: Step, inputs: dict, out: Path) -> dict:
    out.mkdir(parents=True)
    work = out.parent / f"{out.name}-work"
    work.mkdir()
    ctx = StepContext(step=step, out=out, inputs=inputs, input_stats={}, work_dir=work,
                      log=logging.getLogger("test"))
    return step.run(ctx)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """KJV chapters as positives, the negative_examples step's shuffled copies as negatives."""
    tmp = tmp_path_factory.mktemp("quality")
    positives = write_docs(tmp / "kjv", [{"id": f"kjv/{d['id']}", "text": d["text"]} for d in kjv_chapters()])
    negatives_stats = run_body(negative_examples_step(NegativeExamplesConfig(), documents=source()),
                               {"documents": positives}, tmp / "negatives")
    step = train_quality_classifier_step(QualityClassifierConfig(), positive=source(), negative=source())
    stats = run_body(step, {"positive": positives, "negative": tmp / "negatives"}, tmp / "classifier")
    return tmp, stats, negatives_stats


def test_negative_examples_are_shuffled_copies(trained):
    tmp, _, stats = trained
    assert stats["docs_in"] == stats["docs_out"] == len(kjv_chapters())
    original = next(read_shard(list_shards(tmp / "kjv")[0]))
    shuffled = next(read_shard(list_shards(tmp / "negatives")[0]))
    assert shuffled["id"] == original["id"] + "#shuffled"
    assert sorted(shuffled["text"].split()) == sorted(original["text"].split())
    assert shuffled["text"] != original["text"]


def test_classifier_trains_and_reports_held_out_scores(trained):
    tmp, stats, _ = trained
    held = stats["holdout_docs"]
    assert held["positive"] > 50 and held["negative"] > 50
    assert stats["train_docs"]["positive"] + held["positive"] == len(kjv_chapters())
    assert stats["holdout_precision"] > 0.9 and stats["holdout_recall"] > 0.9 and stats["holdout_auc"] > 0.95
    assert (tmp / "classifier" / MODEL_FILE).stat().st_size < 60_000_000  # bucket is set


def test_training_is_deterministic(trained, tmp_path):
    tmp, stats, _ = trained
    step = train_quality_classifier_step(QualityClassifierConfig(), positive=source(), negative=source())
    again = run_body(step, {"positive": tmp / "kjv", "negative": tmp / "negatives"}, tmp_path / "again")
    assert {**again, "train_seconds": 0} == {**stats, "train_seconds": 0}
    assert (tmp_path / "again" / MODEL_FILE).read_bytes() == (tmp / "classifier" / MODEL_FILE).read_bytes()


def mixed_corpus(tmp: Path, folder: Path) -> list[dict]:
    real = [d for s in list_shards(tmp / "kjv") for d in read_shard(s)][::10]
    fake = [d for s in list_shards(tmp / "negatives") for d in read_shard(s)][5::10]
    docs = [d for pair in zip(real, fake) for d in pair]
    write_docs(folder, docs, per_shard=50)
    return docs


def test_quality_filter_keeps_an_exact_top_fraction(trained, tmp_path):
    tmp, _, _ = trained
    docs = mixed_corpus(tmp, tmp_path / "in")
    step = quality_filter_step(QualityFilterConfig(keep_fraction=0.5), documents=source(), classifier=source())
    stats = run_body(step, {"documents": tmp_path / "in", "classifier": tmp / "classifier"}, tmp_path / "out")
    kept = [d["id"] for s in list_shards(tmp_path / "out") for d in read_shard(s)]
    assert len(kept) == stats["docs_out"] == round(0.5 * len(docs))
    real_kept = sum(not k.endswith("#shuffled") for k in kept)
    assert real_kept / len(kept) > 0.9
    assert stats["dropped"] == {"quality": len(docs) - len(kept)}
    record = explain(tmp_path / "out", docs[1]["id"])
    assert record["reason"] == "quality" and 0 <= record["scores"]["quality"] < stats["cutoff"] + 1e-4
    assert sorted(p.name for p in (tmp_path / "out" / ATTRIBUTES).iterdir()) == \
        [p.name for p in list_shards(tmp_path / "in")]


def test_quality_filter_threshold(trained, tmp_path):
    tmp, _, _ = trained
    docs = mixed_corpus(tmp, tmp_path / "in")
    step = quality_filter_step(QualityFilterConfig(threshold=0.5), documents=source(), classifier=source())
    stats = run_body(step, {"documents": tmp_path / "in", "classifier": tmp / "classifier"}, tmp_path / "out")
    records = [json.loads(line) for s in sorted((tmp_path / "out" / ATTRIBUTES).iterdir())
               for line in gzip.open(s, "rt")]
    assert len(records) == len(docs)
    assert all(r["kept"] == (r["scores"]["quality"] >= 0.5) or abs(r["scores"]["quality"] - 0.5) < 1e-4
               for r in records)
    assert stats["docs_out"] >= 0.4 * len(docs)


def test_config_names_files_instead_of_steps(trained, tmp_path):
    tmp, _, _ = trained
    (tmp_path / "good.txt").write_text("\n".join(d["text"] for d in kjv_chapters()[:300]) + "\n")
    cfg = QualityClassifierConfig(positive_paths=(str(tmp_path / "good.txt"),),
                                  negative_paths=(str(list_shards(tmp / "negatives")[0]),))
    step = train_quality_classifier_step(cfg)
    assert step.inputs == {}
    version = step.version
    stats = run_body(step, {}, tmp_path / "out")
    assert stats["train_docs"]["positive"] > 200 and stats["holdout_precision"] > 0.8
    # The version follows the files' content.
    (tmp_path / "good.txt").write_text("\n".join(d["text"] for d in kjv_chapters()[:299]) + "\n")
    assert train_quality_classifier_step(cfg).version != version


def test_config_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="exactly one of threshold or keep_fraction"):
        QualityFilterConfig()
    with pytest.raises(ValueError, match="no negative training documents"):
        write_docs(tmp_path / "pos", [{"id": str(i), "text": "x y z"} for i in range(30)])
        run_body(train_quality_classifier_step(QualityClassifierConfig(), positive=source()),
                 {"positive": tmp_path / "pos"}, tmp_path / "out")
