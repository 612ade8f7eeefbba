"""Dedup: exact and MinHash LSH on planted near-duplicates of known Jaccard similarity, the
deterministic choice of the kept document, paragraph dedup, and worker-count independence."""

from __future__ import annotations

import functools
import gzip
import json
import logging
import random
import re
from pathlib import Path

import numpy as np
import pytest

from tasks.documents import ShardWriter, list_shards, read_shard
from tasks.dedup import DedupConfig, MinHashConfig, MinHasher, dedup_step, normalise
from tasks.judging import ATTRIBUTES, explain
from tasks.engine.step import Step, StepContext
from tests.conftest import kjv_chapters


@functools.cache
def kjv_words() -> list[str]:
    """Every word of the KJV in order: drawing from it draws by KJV word frequencies."""
    return [w for d in kjv_chapters() for w in d["text"].split()]


def shingle_set(text: str, n: int = 5) -> set:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: str, b: str) -> float:
    sa, sb = shingle_set(a), shingle_set(b)
    return len(sa & sb) / len(sa | sb)


def planted_pairs(n: int, seed: int = 0) -> list[tuple[str, str, float]]:
    """(base, copy, true Jaccard of their 5-gram sets): 150-word documents drawn from KJV word
    frequencies, each copy with a random fraction of its words replaced. Replacement rates come
    from three ranges, so that about a third of pairs fall above 0.85 and a third below 0.6."""
    rng, vocab = random.Random(seed), kjv_words()
    pairs = []
    for i in range(n):
        base = [rng.choice(vocab) for _ in range(150)]
        rate = rng.uniform(*[(0.0, 0.015), (0.015, 0.06), (0.06, 0.12)][i % 3])
        copy = [rng.choice(vocab) if rng.random() < rate else w for w in base]
        a, b = " ".join(base), " ".join(copy)
        pairs.append((a, b, jaccard(a, b)))
    return pairs


def write_docs(folder: Path, docs: list[dict], per_shard: int = 100) -> Path:
    with ShardWriter(folder, docs_per_shard=per_shard) as w:
        for d in docs:
            w.write({"source": "test", "metadata": {}, **d})
    return folder


def upstream() -> Step:
    return Step(name="acquire", stage="acquire", stage_version=1, config=DedupConfig(), run=lambda ctx: {})


def run_dedup_body(config: DedupConfig, docs_folder: Path, out: Path, workers: int = 1) -> dict:
    out.mkdir(parents=True)
    step = dedup_step(config, documents=upstream())
    work = out.parent / f"{out.name}-work"
    work.mkdir()
    ctx = StepContext(step=step, out=out, inputs={"documents": docs_folder}, input_stats={},
                      work_dir=work, log=logging.getLogger("test"), workers=workers)
    return step.run(ctx)


def attributes(out: Path) -> dict[str, dict]:
    records = {}
    for shard in sorted((out / ATTRIBUTES).glob("shard-*.jsonl.gz")):
        with gzip.open(shard, "rt") as f:
            for line in f:
                r = json.loads(line)
                records[r["id"]] = r
    return records


def kept_ids(out: Path) -> list[str]:
    return [d["id"] for s in list_shards(out) for d in read_shard(s)]


def test_minhash_estimates_jaccard_without_bias():
    pairs = planted_pairs(300, seed=1)
    hasher = MinHasher(MinHashConfig())
    sig = hasher.signatures([hasher.shingles(t) for a, b, _ in pairs for t in (a, b)])
    estimate = (sig[0::2] == sig[1::2]).mean(axis=1)
    truth = np.array([j for _, _, j in pairs])
    error = estimate - truth
    assert abs(error.mean()) < 0.01  # unbiased
    assert error.std() < 1.3 * np.sqrt(truth * (1 - truth) / 128).mean()  # as good as ideal permutations
    unrelated = (sig[0::2][:-1] == sig[0::2][1:]).mean(axis=1)
    assert unrelated.max() < 0.2


def test_fuzzy_dedup_finds_close_pairs_and_leaves_far_pairs(tmp_path):
    pairs = planted_pairs(450)
    docs = []
    for i, (a, b, _) in enumerate(pairs):
        docs += [{"id": f"base-{i}", "text": a}, {"id": f"copy-{i}", "text": b}]
    stats = run_dedup_body(DedupConfig(minhash=MinHashConfig(threshold=0.8)),
                           write_docs(tmp_path / "in", docs), tmp_path / "out")
    records = attributes(tmp_path / "out")
    merged = np.array([records[f"copy-{i}"]["scores"].get("cluster") == f"base-{i}" for i in range(len(pairs))])
    truth = np.array([j for _, _, j in pairs])
    close, far = truth > 0.85, truth < 0.6
    assert close.sum() >= 100 and far.sum() >= 100
    recall = merged[close].mean()
    false_merge = merged[far].mean()
    print(f"planted pairs: {close.sum()} above 0.85, recall {recall:.3f}; "
          f"{far.sum()} below 0.6, merged {false_merge:.3f}")
    assert recall >= 0.95
    assert false_merge <= 0.05
    # Every removal is a copy whose base was kept, and the numbers add up.
    assert all(not records[f"base-{i}"]["reason"] for i in range(len(pairs)))
    removed = stats["dropped"]["near_duplicate"] + stats["dropped"].get("exact_duplicate", 0)
    assert stats["near_duplicates"] + stats["exact_duplicates"] == int(merged.sum()) == removed
    assert stats["docs_out"] == len(docs) - int(merged.sum())
    assert stats["clusters"] == int(merged.sum())
    assert all(0 < records[f"copy-{i}"]["scores"]["similarity"] <= 1 for i in np.flatnonzero(merged))


def test_exact_dedup_is_exact(tmp_path):
    text = " ".join(random.Random(3).choice(kjv_words()) for _ in range(200))
    docs = [{"id": "first", "text": text},
            {"id": "same-after-normalising", "text": "  " + text.upper().replace(" ", " \n\t ") + "\n"},
            {"id": "one-character-different", "text": text + "s"},
            {"id": "other", "text": " ".join(random.Random(4).choice(kjv_words()) for _ in range(200))},
            {"id": "first-again", "text": text}]
    stats = run_dedup_body(DedupConfig(minhash=None), write_docs(tmp_path / "in", docs), tmp_path / "out")
    assert kept_ids(tmp_path / "out") == ["first", "one-character-different", "other"]
    assert stats["dropped"] == {"exact_duplicate": 2}
    assert stats["clusters"] == 1
    assert explain(tmp_path / "out", "first-again") == {
        "id": "first-again", "kept": False, "reason": "exact_duplicate",
        "scores": {"cluster": "first", "cluster_size": 3}}
    assert normalise("A  b\nC") == normalise("a b c")


def test_with_both_exact_copies_are_named_exact_and_edited_copies_near(tmp_path):
    words = planted_pairs(1, seed=5)[0][0].split()
    a, b = " ".join(words), " ".join(words[:75] + ["zebra"] + words[76:])
    assert 0.9 < jaccard(a, b) < 1
    docs = [{"id": "a", "text": a}, {"id": "a-copy", "text": a.lower()}, {"id": "b", "text": b}]
    stats = run_dedup_body(DedupConfig(), write_docs(tmp_path / "in", docs), tmp_path / "out")
    assert stats["dropped"] == {"exact_duplicate": 1, "near_duplicate": 1}
    assert kept_ids(tmp_path / "out") == ["a"]


def test_kept_document_is_the_earliest_whatever_the_order(tmp_path):
    a, b, _ = planted_pairs(1, seed=7)[0]
    for order, expected in ((["x", "y"], "x"), (["y", "x"], "y")):
        texts = {"x": a, "y": b}
        folder = write_docs(tmp_path / f"in-{expected}", [{"id": k, "text": texts[k]} for k in order])
        run_dedup_body(DedupConfig(), folder, tmp_path / f"out-{expected}")
        assert kept_ids(tmp_path / f"out-{expected}") == [expected]


def test_paragraph_dedup_removes_lines_seen_in_earlier_kept_documents(tmp_path):
    line = [" ".join(random.Random(i).choice(kjv_words()) for _ in range(12)) for i in range(5)]
    docs = [{"id": "a", "text": f"{line[0]}\n{line[1]}\n{line[2]}"},
            {"id": "b", "text": f"{line[0]}\n\n{line[3]}"},
            {"id": "c", "text": f"{line[1]}\n{line[2]}\n{line[1]}"},
            {"id": "d", "text": f"{line[4]}\n{line[4]}"}]
    stats = run_dedup_body(DedupConfig(minhash=None, paragraphs=True), write_docs(tmp_path / "in", docs),
                           tmp_path / "out")
    out = {d["id"]: d["text"] for s in list_shards(tmp_path / "out") for d in read_shard(s)}
    assert out == {"a": docs[0]["text"], "b": f"\n{line[3]}", "d": line[4]}
    assert stats["dropped"] == {"duplicate_paragraphs": 1}
    assert stats["paragraphs_removed"] == 5
    assert explain(tmp_path / "out", "b")["scores"] == {"paragraphs_removed": 1}


def test_bad_records_are_counted_not_fatal(tmp_path):
    folder = write_docs(tmp_path / "in", [{"id": "a", "text": "some words here " * 20}])
    with gzip.open(folder / "shard-00001.jsonl.gz", "wb") as f:
        f.write(b'{"id": "x", "text": ""}\n{not json}\n')
    stats = run_dedup_body(DedupConfig(), folder, tmp_path / "out")
    assert stats["dropped"] == {"empty_text": 1, "malformed_json": 1}
    assert stats["docs_in"] == 3 and stats["docs_out"] == 1


@pytest.mark.ray  # its training (or data workers) starts a local Ray: tests/conftest.py ray_lock
def test_output_bytes_are_the_same_with_one_and_two_workers(tmp_path):
    import ray

    pairs = planted_pairs(120, seed=2)
    docs = [{"id": f"{k}-{i}", "text": t} for i, p in enumerate(pairs) for k, t in zip("ab", p[:2])]
    docs += [{"id": "dup", "text": pairs[0][0]}]
    write_docs(tmp_path / "in", docs, per_shard=60)
    cfg = DedupConfig(paragraphs=True)
    ray.shutdown()  # so that what follows shows which run used Ray
    one = run_dedup_body(cfg, tmp_path / "in", tmp_path / "w1", workers=1)
    assert not ray.is_initialized()
    two = run_dedup_body(cfg, tmp_path / "in", tmp_path / "w2", workers=2)
    assert ray.is_initialized()  # the shards went to Ray workers, not the serial path
    ray.shutdown()
    assert one == two and one["near_duplicates"] > 20 and one["exact_duplicates"] >= 1
    files = sorted(p.relative_to(tmp_path / "w1") for p in (tmp_path / "w1").rglob("*.gz"))
    assert len(files) == 2 * len(list_shards(tmp_path / "in")) == 10
    for f in files:
        assert (tmp_path / "w1" / f).read_bytes() == (tmp_path / "w2" / f).read_bytes(), f


def test_band_layout_must_fit_the_permutations():
    with pytest.raises(ValueError, match="exceeds num_perm"):
        MinHashConfig(num_perm=64, bands=14, rows=8)
