"""A fastText quality classifier in two steps, as DCLM and Marin do it: train, then filter.

`train_quality_classifier` learns `__label__hq` (positive documents) against `__label__lq`
(negative documents), each from an upstream step's document folder or from files named in the
config, holds out a deterministic slice of both (by a hash of the document id) and reports
precision, recall, accuracy and ROC AUC on it. `quality_filter` scores every document with
P(hq) and keeps those at or above a threshold, or exactly the top fraction of the corpus.

The third step, `negative_examples`, makes a negative set for corpora that have none: each
document with its words shuffled (deterministic per id). A classifier of real against shuffled
text learns what word order real prose has, which is what a tiny default corpus can teach.

fastText trains single-threaded with a fixed seed in a fresh process (see `train_fasttext`), so
the same documents give the same model bytes and the same scores. `bucket` is set (200k buckets
of dim 32: about 27 MB, where fastText's default 2M buckets make an 800 MB model).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np
from pydantic import Field, model_validator

from tasks.documents import list_shards, read_documents, read_shard, write_shard
from tasks.judging import (DEFAULT_MAX_DOC_BYTES, MAX_DOC_BYTES_DESCRIPTION, STRICT_DESCRIPTION, WORKERS_DESCRIPTION,
                           Judge, ShardJob, Verdict, bad_document, check_sources, judge_shard, merge_stats, run_map)
from tasks.filter import load_fasttext
from tasks.engine.config import (ConfigModel, Count, Fraction, HalfOpenFraction, NonNegative, OpenFraction, Positive,
                                 Seed, files, setting)
from tasks.engine.versioning import files_under

if TYPE_CHECKING:  # tasks.engine.step loads Prefect (seconds), which Ray workers running this module never need
    from tasks.engine.step import Step, StepContext

STAGE_VERSION = 1
MODEL_FILE = "quality_classifier.bin"
META_FILE = "quality_classifier.json"
POSITIVE, NEGATIVE = "__label__hq", "__label__lq"
TOKEN = re.compile(r"\w+|[^\w\s]")


def classifier_text(text: str, max_words: int) -> str:
    """What fastText sees: the first `max_words` lowercased tokens, punctuation split off, on one line."""
    return " ".join(m.group() for m in itertools.islice(TOKEN.finditer(text.lower()), max_words))


def in_holdout(doc_id: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(str(doc_id).encode(), digest_size=8).digest(), "little")
    return h / 2**64 < fraction


# --- documents named by path ------------------------------------------------------------------


def read_path(path: Path, bad: Counter) -> Iterator[dict]:
    """Documents from a shard folder, one `.jsonl.gz` shard, or a `.txt` file (a document a line)."""
    if path.is_dir():
        yield from read_documents(path, bad=bad)
    elif path.name.endswith(".jsonl.gz"):
        yield from read_shard(path, bad=bad)
    elif path.suffix == ".txt":
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if line.strip():
                    yield {"id": f"{path.name}:{i + 1}", "text": line.rstrip("\n"), "metadata": {}}
    else:
        raise ValueError(f"{path}: a classifier example set must be a folder of document shards, "
                         "a .jsonl.gz shard or a .txt file with one document per line")


def fingerprint_paths(paths: list[str]) -> str:
    """A content hash of the files behind `paths`, so an edited example file retrains."""
    h = hashlib.sha256()
    for p in sorted(paths):
        for f in files_under(Path(p)) if Path(p).is_dir() else [Path(p)]:
            h.update(str(f.relative_to(p) if Path(p).is_dir() else f.name).encode())
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


# --- training ---------------------------------------------------------------------------------


class QualityClassifierConfig(ConfigModel):
    """Positive and negative documents come from the step's inputs and/or these paths."""

    positive_paths: tuple[str, ...] = files((), description="More positive (high-quality) documents besides the "
                                            "step's positive input (the documents `filter` kept): shard folders, "
                                            "`.jsonl.gz` shards or `.txt` files of one document a line. Versioned "
                                            "by content, not by path.")
    negative_paths: tuple[str, ...] = files((), description="More negative documents besides the step's negative "
                                            "input (those documents with their words shuffled: `negatives`), in the "
                                            "same forms.")
    max_docs_per_class: Count = Field(20_000, description="Documents read per class, held-out ones included: the "
                                      "first ones, in input order.")
    max_words: Count = Field(500, description="fastText sees each document's first this many lowercased tokens "
                             "(punctuation split off), in training and when `quality_filter` scores.")
    holdout_fraction: HalfOpenFraction = Field(0.1, description="Share of each class held out of training (by a hash "
                                               "of the document id) for the reported precision, recall, accuracy "
                                               "and ROC AUC.")
    dim: Count = Field(32, description="fastText's dim: the size of its word and n-gram vectors.")
    bucket: NonNegative = Field(200_000, description="fastText's hash buckets for word n-grams: 200k at dim 32 make "
                                "a model of about 27 MB, where fastText's defaults (2M buckets) make 800 MB.")
    word_ngrams: Count = Field(2, description="fastText's wordNgrams: the longest word n-gram used as a feature.")
    epoch: Count = Field(5, description="fastText's passes over the training documents.")
    lr: Positive = Field(0.5, description="fastText's learning rate (at 0.1 the classifier of KJV against shuffled "
                         "KJV, where only the bigrams differ, stayed at chance).")
    min_count: Count = Field(1, description="fastText's minCount: words seen fewer times are left out.")
    seed: Seed = Field(0, description="fastText's seed, and the shuffle of the training documents.")


def _examples(ctx: StepContext, which: str, paths: tuple[str, ...], bad: Counter) -> Iterator[dict]:
    if which in ctx.inputs:
        yield from read_documents(ctx.inputs[which], bad=bad)
    for p in paths:
        yield from read_path(Path(p), bad)


def _split(docs: Iterator[dict], label: str, cfg: QualityClassifierConfig) -> tuple[list[str], list[str]]:
    """fastText lines for training and held-out texts, from at most max_docs_per_class documents."""
    train, held = [], []
    for doc in itertools.islice((d for d in docs if bad_document(d) is None), cfg.max_docs_per_class):
        text = classifier_text(doc["text"], cfg.max_words)
        if in_holdout(doc["id"], cfg.holdout_fraction):
            held.append(text)
        else:
            train.append(f"{label} {text}")
    return train, held


def positive_probability(model, texts: list[str]) -> np.ndarray:
    """P(hq) for each text (a list: fastText predicts a batch in one call)."""
    if not texts:
        return np.zeros(0)
    labels, probs = model.predict(texts, k=2)
    return np.array([dict(zip(ls, ps)).get(POSITIVE, 0.0) for ls, ps in zip(labels, probs)], dtype=np.float64)


def binary_metrics(pos: np.ndarray, neg: np.ndarray, threshold: float = 0.5) -> dict:
    """Precision, recall, accuracy at `threshold`, and ROC AUC (ties count one half)."""
    tp, fn = int((pos >= threshold).sum()), int((pos < threshold).sum())
    fp, tn = int((neg >= threshold).sum()), int((neg < threshold).sum())
    neg_sorted = np.sort(neg)
    below = np.searchsorted(neg_sorted, pos, side="left")
    ties = np.searchsorted(neg_sorted, pos, side="right") - below
    auc = float((below + 0.5 * ties).sum() / (len(pos) * len(neg))) if len(pos) and len(neg) else 0.0
    return {"precision": tp / (tp + fp) if tp + fp else 0.0, "recall": tp / (tp + fn) if tp + fn else 0.0,
            "accuracy": (tp + tn) / max(tp + tn + fp + fn, 1), "auc": auc}


def train_fasttext(train_file: Path, model_file: Path, cfg: QualityClassifierConfig) -> None:
    """Train and save a fastText classifier in a fresh Python process.

    Why a process: fastText 0.9.2 with thread=1 initialises only the first tenth of its input
    matrix (`DenseMatrix::uniform` fills one of ten blocks per thread) and leaves the rest as the
    allocator hands it over. Fresh pages are zero, but reused heap memory is not: the third model
    trained in one process diverged ("Encountered NaN"). A new process whose malloc maps every
    large block fresh (fixed mmap threshold) always starts from zeros, so the same input gives
    the same model bytes.
    """
    params = dict(input=str(train_file), dim=cfg.dim, bucket=cfg.bucket, wordNgrams=cfg.word_ngrams,
                  epoch=cfg.epoch, lr=cfg.lr, minCount=cfg.min_count, seed=cfg.seed, thread=1, verbose=0)
    code = ("import json, sys, fasttext; p = json.loads(sys.argv[1]); "
            "fasttext.train_supervised(**p).save_model(sys.argv[2])")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(params), str(model_file)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fastText training failed ({params}):\n{proc.stderr.strip()[-3000:]}")


def run_train_quality_classifier(ctx: StepContext) -> dict:
    cfg: QualityClassifierConfig = ctx.config
    bad: Counter = Counter()
    pos_train, pos_held = _split(_examples(ctx, "positive", cfg.positive_paths, bad), POSITIVE, cfg)
    neg_train, neg_held = _split(_examples(ctx, "negative", cfg.negative_paths, bad), NEGATIVE, cfg)
    for name, train in (("positive", pos_train), ("negative", neg_train)):
        if not train:
            raise ValueError(f"no {name} training documents: give a {name} step or {name}_paths "
                             "with documents (held-out ones are not used for training)")
    lines = pos_train + neg_train
    random.Random(cfg.seed).shuffle(lines)  # fastText learns in file order with one thread
    train_file = ctx.work_dir / "train.txt"
    train_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ctx.log.info("training the quality classifier on %d positive and %d negative documents",
                 len(pos_train), len(neg_train))
    started = time.perf_counter()
    train_fasttext(train_file, ctx.out / MODEL_FILE, cfg)
    train_seconds = time.perf_counter() - started
    model = load_fasttext(str(ctx.out / MODEL_FILE))
    (ctx.out / META_FILE).write_text(json.dumps(
        {"positive_label": POSITIVE, "negative_label": NEGATIVE, "max_words": cfg.max_words}, indent=2))
    metrics = binary_metrics(positive_probability(model, pos_held), positive_probability(model, neg_held))
    return {"train_docs": {"positive": len(pos_train), "negative": len(neg_train)},
            "holdout_docs": {"positive": len(pos_held), "negative": len(neg_held)},
            **{f"holdout_{k}": round(v, 4) for k, v in metrics.items()},
            "train_seconds": round(train_seconds, 2), "bad_records": dict(sorted(bad.items()))}


def train_quality_classifier_step(config: QualityClassifierConfig, *, positive: Step | None = None,
                                  negative: Step | None = None) -> Step:
    from tasks.engine.step import Step

    inputs = {name: s for name, s in (("positive", positive), ("negative", negative)) if s is not None}
    paths = list(config.positive_paths) + list(config.negative_paths)
    return Step(name="train_quality_classifier", stage="quality_classifier", stage_version=STAGE_VERSION,
                config=config, run=run_train_quality_classifier, inputs=inputs,
                fingerprint=partial(fingerprint_paths, paths) if paths else None)


# --- filtering --------------------------------------------------------------------------------


class QualityFilterConfig(ConfigModel):
    """Keep documents with P(hq) >= `threshold`, or the top `keep_fraction` of them (ties by order)."""

    threshold: Fraction | None = Field(None, description="Keep the documents with P(hq) at or above this. Give "
                                       "exactly one of threshold and keep_fraction.")
    keep_fraction: OpenFraction | None = Field(None, description="Keep this share of all documents (rounded), those "
                                               "of the highest P(hq), ties broken by input order.")
    batch_size: Count = setting(512, description="Documents per fastText predict call.")
    max_doc_bytes: Count = Field(DEFAULT_MAX_DOC_BYTES, description=MAX_DOC_BYTES_DESCRIPTION)
    strict: bool = Field(False, description=STRICT_DESCRIPTION)
    workers: Count | None = setting(None, description=WORKERS_DESCRIPTION)
    max_source_drop: Fraction = setting(0.9, description="Warn (and record under `warnings`) when more than this "
                                        "share of one source is removed; set from `data.max_source_drop`.")

    @model_validator(mode="after")
    def _one_rule(self) -> "QualityFilterConfig":
        if (self.threshold is None) == (self.keep_fraction is None):
            raise ValueError("set exactly one of threshold or keep_fraction for quality_filter")
        return self


def score_shard(job: ShardJob) -> np.ndarray:
    """P(hq) of each valid document of a shard, in order (bad records are skipped here and
    counted in the second pass, which sees the same documents)."""
    model_path, max_words, batch_size = job.config
    model = load_fasttext(model_path)
    texts = (classifier_text(d["text"], max_words)
             for d in read_shard(job.shard, strict=job.strict, max_doc_bytes=job.max_doc_bytes)
             if bad_document(d) is None)
    scores = [positive_probability(model, list(batch))
              for batch in iter(lambda: list(itertools.islice(texts, batch_size)), [])]
    return np.concatenate(scores) if scores else np.zeros(0)


def make_quality_judge(decisions: tuple[np.ndarray, np.ndarray]) -> Judge:
    """Replays the first pass's scores and keep decisions, document by document."""
    scores, keep = decisions
    position = itertools.count()

    def judge(doc: dict) -> Verdict:
        i = next(position)
        verdict = {"quality": round(float(scores[i]), 4)}
        return (doc, None, verdict) if keep[i] else (None, "quality", verdict)

    return judge


def run_quality_filter(ctx: StepContext) -> dict:
    cfg: QualityFilterConfig = ctx.config
    classifier = ctx.inputs["classifier"]
    meta = json.loads((classifier / META_FILE).read_text())
    shards = list_shards(ctx.inputs["documents"])
    scorer = (str(classifier / MODEL_FILE), meta["max_words"], cfg.batch_size)
    scoring = [ShardJob(s, ctx.out, scorer, strict=cfg.strict, max_doc_bytes=cfg.max_doc_bytes) for s in shards]
    per_shard = run_map(ctx, score_shard, scoring, "quality_filter: scoring")
    scores = np.concatenate(per_shard) if per_shard else np.zeros(0)
    if cfg.threshold is not None:
        keep = scores >= cfg.threshold
    else:  # exactly the top fraction; a stable sort breaks ties by input order
        keep = np.zeros(len(scores), dtype=bool)
        keep[np.argsort(-scores, kind="stable")[:round(cfg.keep_fraction * len(scores))]] = True
    bounds = np.cumsum([0] + [len(s) for s in per_shard])
    jobs = [ShardJob(s, ctx.out, (scores[a:b], keep[a:b]), make_quality_judge, cfg.strict, cfg.max_doc_bytes)
            for s, a, b in zip(shards, bounds[:-1], bounds[1:])]
    stats = merge_stats(run_map(ctx, judge_shard, jobs, "quality_filter: writing"))
    stats["cutoff"] = round(float(scores[keep].min()), 4) if keep.any() else None
    ctx.log.info("quality_filter: kept %d of %d documents (score >= %s)", stats["docs_out"],
                 stats["docs_in"], stats["cutoff"])
    return check_sources(ctx, stats)


def quality_filter_step(config: QualityFilterConfig, *, documents: Step, classifier: Step) -> Step:
    from tasks.engine.step import Step

    return Step(name="quality_filter", stage="quality_filter", stage_version=STAGE_VERSION, config=config,
                run=run_quality_filter, inputs={"documents": documents, "classifier": classifier})


# --- negative examples ------------------------------------------------------------------------


class NegativeExamplesConfig(ConfigModel):
    """Negatives for the classifier: each document with its words shuffled."""

    seed: Seed = Field(0, description="Seeds each document's shuffle, together with its id.")
    max_doc_bytes: Count = Field(DEFAULT_MAX_DOC_BYTES, description=MAX_DOC_BYTES_DESCRIPTION)
    workers: Count | None = setting(None, description=WORKERS_DESCRIPTION)


def shuffle_words(doc: dict, seed: int) -> dict:
    words = doc["text"].split()
    random.Random(f"{seed}:{doc['id']}").shuffle(words)  # str seeds hash with sha512: same in every process
    return {"id": f"{doc['id']}#shuffled", "text": " ".join(words), "source": doc.get("source", ""),
            "metadata": {**doc["metadata"], "negative_example": "shuffled_words"}}


def shuffle_shard(job: ShardJob) -> dict:
    bad: Counter = Counter()
    bytes_in = [0]

    def shuffled():
        for doc in read_shard(job.shard, bad=bad, max_doc_bytes=job.max_doc_bytes):
            problem = bad_document(doc)
            if problem is not None:
                bad[problem[0]] += 1
                continue
            bytes_in[0] += len(doc["text"].encode())
            yield shuffle_words(doc, job.config)

    written = write_shard(job.out / job.shard.name, shuffled())
    return {"docs_in": written["docs"] + sum(bad.values()), "docs_out": written["docs"],
            "bytes_in": bytes_in[0], "bytes_out": written["bytes"], "dropped": dict(bad)}


def run_negative_examples(ctx: StepContext) -> dict:
    cfg: NegativeExamplesConfig = ctx.config
    jobs = [ShardJob(s, ctx.out, cfg.seed, max_doc_bytes=cfg.max_doc_bytes)
            for s in list_shards(ctx.inputs["documents"])]
    return merge_stats(run_map(ctx, shuffle_shard, jobs, "negative_examples"))


def negative_examples_step(config: NegativeExamplesConfig, *, documents: Step) -> Step:
    from tasks.engine.step import Step

    return Step(name="negative_examples", stage="negative_examples", stage_version=STAGE_VERSION,
                config=config, run=run_negative_examples, inputs={"documents": documents})
