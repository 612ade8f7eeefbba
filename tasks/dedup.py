"""Deduplicate documents: exact (normalised text hash), fuzzy (MinHash LSH), and optionally lines.

Three phases, so that memory follows the shard size plus a few numbers per document:

1. Per shard, in parallel: a 128-bit hash of each document's normalised text, its MinHash
   signature over word n-grams, and the LSH band keys cut from the signature (all written to the
   work folder as arrays).
2. In the driver: documents with equal text hashes are joined; documents sharing a band key are
   candidates, joined only if their signatures agree on at least `threshold` of the
   permutations (banding alone would merge about one in five pairs at Jaccard 0.6 with 14 bands
   of 8 rows). Clusters are kept in a union-find whose root is always the earliest document,
   and that document is the one kept, so the choice is the same with any worker count.
3. Per shard, in parallel: write the kept documents and an attribute record for every document
   (`reason` exact_duplicate / near_duplicate, and the cluster it joined).

MinHash here is numpy only: each word gets a 64-bit hash (blake2b, cached), an n-gram's hash
combines its words' hashes with fixed random multipliers and a splitmix64 finaliser, and each
of the `num_perm` permutations is a multiply-shift hash `(a * x + b) >> 32` with random odd `a`,
computed for all n-grams of a shard at once.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import Field, model_validator

from tasks.documents import list_shards, read_shard
from tasks.judging import (DEFAULT_MAX_DOC_BYTES, MAX_DOC_BYTES_DESCRIPTION, STRICT_DESCRIPTION, WORKERS_DESCRIPTION,
                           Judge, ShardJob, Verdict, bad_document, check_sources, judge_shard, merge_stats, run_map)
from tasks.engine.config import ConfigModel, Count, Fraction, OpenFraction, Seed, setting

if TYPE_CHECKING:  # tasks.engine.step loads Prefect (seconds), which Ray workers running this module never need
    from tasks.engine.step import Step, StepContext

STAGE_VERSION = 1
WORD = re.compile(r"\w+")
U64 = np.uint64


class MinHashConfig(ConfigModel):
    """Word n-gram MinHash with LSH banding. `bands * rows` of the `num_perm` values form the
    bands; all `num_perm` estimate the Jaccard similarity that a candidate pair must reach."""

    ngram: Count = Field(5, description="Words per shingle (a document of fewer words is one shingle of all of "
                         "them); words are runs of letters, digits or underscores, lowercased.")
    num_perm: Count = Field(128, description="Hash permutations in each document's MinHash signature.")
    bands: Count = Field(14, description="LSH bands: documents sharing any band's values are candidate "
                         "duplicates.")
    rows: Count = Field(8, description="Signature values per band.")
    threshold: OpenFraction = Field(0.8, description="The share of all `num_perm` signature values two candidates "
                                    "must agree on (their estimated Jaccard similarity) to be near duplicates.")
    seed: Seed = Field(0, description="Seeds the permutations and the multipliers that combine word hashes into "
                       "shingles and signature values into band keys.")

    @model_validator(mode="after")
    def _fits(self) -> "MinHashConfig":
        if self.bands * self.rows > self.num_perm:
            raise ValueError(f"bands * rows ({self.bands} * {self.rows}) exceeds num_perm ({self.num_perm})")
        return self


class DedupConfig(ConfigModel):
    exact: bool = Field(True, description="Drop documents whose normalised text (NFKC, lowercase, white space "
                        "collapsed) equals an earlier one's, as `exact_duplicate`.")
    minhash: MinHashConfig | None = Field(MinHashConfig(), description="Fuzzy dedup: of each cluster of near "
                                          "duplicates the earliest document is kept, the others dropped as "
                                          "`near_duplicate`. None: no fuzzy dedup.")
    paragraphs: bool = Field(False, description="Also remove from each kept document every non-blank line "
                             "(compared stripped) already seen in an earlier kept document or earlier in the same "
                             "one; a document left empty is dropped as `duplicate_paragraphs`.")
    max_doc_bytes: Count = Field(DEFAULT_MAX_DOC_BYTES, description=MAX_DOC_BYTES_DESCRIPTION)
    strict: bool = Field(False, description=STRICT_DESCRIPTION)
    workers: Count | None = setting(None, description=WORKERS_DESCRIPTION)
    max_source_drop: Fraction = setting(0.9, description="Warn (and record under `warnings`) when more than this "
                                        "share of one source is removed; set from `data.max_source_drop`.")


# --- hashing ----------------------------------------------------------------------------------


def normalise(text: str) -> str:
    """What 'the same text' means for exact dedup: NFKC, lowercase, white space collapsed."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def hash128(text: str) -> tuple[int, int]:
    d = hashlib.blake2b(text.encode(), digest_size=16).digest()
    return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")


def hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective mixer: makes every output bit depend on every input bit."""
    x = x ^ (x >> U64(30))
    x *= U64(0xBF58476D1CE4E5B9)
    x ^= x >> U64(27)
    x *= U64(0x94D049BB133111EB)
    return x ^ (x >> U64(31))


class _WordHashes(dict):
    """word -> 64-bit blake2b hash, computed once per word (a worker's cache)."""

    def __missing__(self, word: str) -> int:
        h = self[word] = hash64(word)
        return h


class MinHasher:
    """MinHash signatures and LSH band keys for a `MinHashConfig`; same seed, same values."""

    def __init__(self, cfg: MinHashConfig):
        self.cfg = cfg
        rng = np.random.default_rng(cfg.seed)
        self.a = rng.integers(1, 2**64 - 1, size=cfg.num_perm, dtype=U64, endpoint=True) | U64(1)
        self.b = rng.integers(0, 2**64 - 1, size=cfg.num_perm, dtype=U64, endpoint=True)
        self.ngram_mult = rng.integers(1, 2**64 - 1, size=cfg.ngram, dtype=U64, endpoint=True) | U64(1)
        self.row_mult = rng.integers(1, 2**64 - 1, size=cfg.rows, dtype=U64, endpoint=True) | U64(1)
        self.words = _WordHashes()

    def shingles(self, text: str) -> np.ndarray:
        """One 64-bit hash per word n-gram (one for the whole text if it has fewer words)."""
        words = WORD.findall(text.lower())
        if not words:
            return np.zeros(0, dtype=U64)
        h = np.fromiter(map(self.words.__getitem__, words), dtype=U64, count=len(words))
        n = min(self.cfg.ngram, len(words))
        m = len(words) - n + 1
        keys = h[:m] * self.ngram_mult[0]
        for k in range(1, n):
            keys += h[k:k + m] * self.ngram_mult[k]
        return splitmix64(keys)

    def signatures(self, shingles: list[np.ndarray], chunk: int = 8192) -> np.ndarray:
        """(docs, num_perm) uint32 minimum of each permutation over each document's n-grams.

        All n-grams of all documents go through the permutations in chunks; `reduceat` takes
        the minimum per document segment, and documents cut by a chunk edge are combined.
        """
        sig = np.full((len(shingles), self.cfg.num_perm), 2**32 - 1, dtype=np.uint64)
        if not shingles:
            return sig.astype(np.uint32)
        flat = np.concatenate(shingles)
        owner = np.repeat(np.arange(len(shingles)), [len(s) for s in shingles])
        buf = np.empty((self.cfg.num_perm, chunk), dtype=U64)
        for start in range(0, len(flat), chunk):
            x, docs = flat[start:start + chunk], owner[start:start + chunk]
            vals = buf[:, :len(x)]
            np.multiply(self.a[:, None], x[None, :], out=vals)
            vals += self.b[:, None]
            vals >>= U64(32)
            starts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
            mins = np.minimum.reduceat(vals, starts, axis=1).T  # (docs in chunk, num_perm)
            d = docs[starts]
            sig[d] = np.minimum(sig[d], mins)
        return sig.astype(np.uint32)

    def band_keys(self, sig: np.ndarray) -> np.ndarray:
        """(docs, bands) uint64: each band's `rows` signature values hashed into one key."""
        r = self.cfg.rows
        keys = np.zeros((len(sig), self.cfg.bands), dtype=U64)
        for j in range(self.cfg.bands):
            band = sig[:, j * r:(j + 1) * r].astype(U64)
            keys[:, j] = splitmix64((band * self.row_mult).sum(axis=1, dtype=U64))
        return keys


# --- phase 1: per-shard hashes ----------------------------------------------------------------


def _arrays_path(work: Path, shard: Path) -> Path:
    return work / shard.name.removesuffix(".jsonl.gz")


def hash_shard(job: ShardJob) -> dict:
    """Hashes of each valid document of a shard, saved under the work folder; returns counts."""
    cfg: DedupConfig
    cfg, work = job.config
    hasher = MinHasher(cfg.minhash) if cfg.minhash else None
    ids, exact, shingles, para_hashes, para_counts = [], [], [], [], []
    for doc in read_shard(job.shard, strict=job.strict, max_doc_bytes=job.max_doc_bytes):
        if bad_document(doc) is not None:
            continue  # counted, or raised in strict mode, by the writing pass
        ids.append(doc["id"])
        exact.append(hash128(normalise(doc["text"])) if cfg.exact else (0, 0))
        if hasher:
            shingles.append(hasher.shingles(doc["text"]))
        if cfg.paragraphs:
            lines = paragraph_lines(doc["text"])
            para_hashes.extend(hash64(line.strip()) for line in lines)
            para_counts.append(len(lines))
    base = _arrays_path(work, job.shard)
    base.mkdir(parents=True, exist_ok=True)
    np.save(base / "exact.npy", np.array(exact, dtype=U64).reshape(-1, 2))
    if hasher:
        sig = hasher.signatures(shingles)
        np.save(base / "signatures.npy", sig)
        np.save(base / "bands.npy", hasher.band_keys(sig))
        np.save(base / "has_words.npy", np.array([len(s) > 0 for s in shingles], dtype=bool))
    if cfg.paragraphs:
        np.save(base / "paragraphs.npy", np.array(para_hashes, dtype=U64))
        np.save(base / "paragraph_counts.npy", np.array(para_counts, dtype=np.int64))
    (base / "ids.json").write_text(json.dumps(ids, ensure_ascii=False))
    return {"docs_in": len(ids)}


def paragraph_lines(text: str) -> list[str]:
    """The lines paragraph dedup looks at: every line with some non-space character."""
    return [line for line in text.split("\n") if line.strip()]


# --- phase 2: clusters ------------------------------------------------------------------------


class UnionFind:
    """Disjoint sets over 0..n-1 whose root is always the smallest member (the earliest document)."""

    def __init__(self, n: int):
        self.parent = np.arange(n)

    def find(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]  # path halving
            i = parent[i]
        return int(i)

    def union(self, i: int, j: int) -> None:
        ri, rj = self.find(i), self.find(j)
        if ri != rj:
            self.parent[max(ri, rj)] = min(ri, rj)

    def roots(self) -> np.ndarray:
        parent = self.parent.copy()
        while True:
            nxt = parent[parent]
            if np.array_equal(nxt, parent):
                return parent
            parent = nxt


class Signatures:
    """Signature rows by global document index, read from each shard's memory-mapped array."""

    def __init__(self, bases: list[Path], offsets: np.ndarray):
        self.maps = [np.load(b / "signatures.npy", mmap_mode="r") for b in bases]
        self.offsets = offsets

    def rows(self, index: np.ndarray) -> np.ndarray:
        shard = np.searchsorted(self.offsets, index, side="right") - 1
        return np.stack([self.maps[s][i - self.offsets[s]] for s, i in zip(shard, index)]) \
            if len(index) else np.zeros((0, 0), dtype=np.uint32)


def join_band_candidates(uf: UnionFind, bands: np.ndarray, has_words: np.ndarray, sigs: Signatures,
                         threshold: float) -> int:
    """Join documents that share a band key and whose signatures agree on >= threshold of the
    permutations. Returns how many signature comparisons were made."""
    compared = 0
    candidates = np.flatnonzero(has_words)
    for j in range(bands.shape[1]):
        keys = bands[candidates, j]
        order = np.argsort(keys, kind="stable")  # equal keys stay in document order
        keys, members = keys[order], candidates[order]
        edges = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1], True])
        for a, b in zip(edges[:-1], edges[1:]):
            if b - a < 2:
                continue
            group = members[a:b]
            rows = sigs.rows(group)
            leaders: list[int] = []  # one member per sub-cluster found so far in this bucket
            for k, doc in enumerate(group):
                root = uf.find(doc)
                for leader in leaders:
                    if uf.find(group[leader]) == root:
                        break
                    compared += 1
                    if np.mean(rows[k] == rows[leader]) >= threshold:
                        uf.union(doc, group[leader])
                        break
                else:
                    leaders.append(k)
    return compared


@dataclass
class Clusters:
    roots: np.ndarray  # root (kept document) of each document's cluster
    sizes: np.ndarray  # size of each document's cluster
    exact_hashes: np.ndarray
    compared: int


def find_clusters(cfg: DedupConfig, bases: list[Path], offsets: np.ndarray, log) -> Clusters:
    n = int(offsets[-1])
    exact = np.concatenate([np.load(b / "exact.npy") for b in bases]) if bases else np.zeros((0, 2), U64)
    uf = UnionFind(n)
    if cfg.exact and n:
        _, first, inverse = np.unique(exact, axis=0, return_index=True, return_inverse=True)
        uf.parent = first[inverse.reshape(-1)]  # each text's earliest copy; all of those are roots
    compared = 0
    if cfg.minhash and n:
        bands = np.concatenate([np.load(b / "bands.npy") for b in bases])
        has_words = np.concatenate([np.load(b / "has_words.npy") for b in bases])
        compared = join_band_candidates(uf, bands, has_words, Signatures(bases, offsets), cfg.minhash.threshold)
        log.info("dedup: %d signature comparisons over %d bands", compared, cfg.minhash.bands)
    roots = uf.roots()
    sizes = np.bincount(roots, minlength=n)[roots]
    return Clusters(roots, sizes, exact, compared)


def kept_paragraphs(bases: list[Path], keep_doc: np.ndarray) -> tuple[np.ndarray, int]:
    """For every line of every document: True unless an earlier kept document (or an earlier
    line of the same one) has the same stripped line. Also: how many lines of kept documents go."""
    hashes = np.concatenate([np.load(b / "paragraphs.npy") for b in bases])
    counts = np.concatenate([np.load(b / "paragraph_counts.npy") for b in bases])
    live = np.flatnonzero(np.repeat(keep_doc, counts))  # lines of kept documents
    keep = np.zeros(len(hashes), dtype=bool)
    _, first, inverse = np.unique(hashes[live], return_index=True, return_inverse=True)
    keep[live] = first[inverse.reshape(-1)] == np.arange(len(live))
    return keep, int(len(live) - np.count_nonzero(keep))


# --- phase 3: writing -------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardDecisions:
    """What phase 2 decided for one shard. Only documents in a cluster have an entry, so this
    stays small when duplicates are few."""

    ids: list[str]  # every valid document in order, to check the shard reads the same again
    clustered: dict[int, tuple[str | None, dict]]  # position -> (reason or None if kept, scores)
    paragraph_keep: np.ndarray | None  # per non-blank line of the shard's documents, in order


def make_dedup_judge(decisions: ShardDecisions) -> Judge:
    position = itertools.count()
    line = itertools.count()

    def judge(doc: dict) -> Verdict:
        i = next(position)
        if doc["id"] != decisions.ids[i]:
            raise RuntimeError(f"dedup: document {i} of a shard is {doc['id']!r} now but was "
                               f"{decisions.ids[i]!r} when hashed: did the input change during the run?")
        reason, scores = decisions.clustered.get(i, (None, {}))
        scores = dict(scores)
        if decisions.paragraph_keep is None:
            return (doc, None, scores) if reason is None else (None, reason, scores)
        kept_lines, removed = [], 0
        for text_line in doc["text"].split("\n"):
            if text_line.strip() and not decisions.paragraph_keep[next(line)]:
                removed += 1
            else:
                kept_lines.append(text_line)
        if reason is not None:
            return None, reason, scores
        if removed:
            scores["paragraphs_removed"] = removed
            text = "\n".join(kept_lines)
            if not text.strip():
                return None, "duplicate_paragraphs", scores
            doc = {**doc, "text": text}
        return doc, None, scores

    return judge


def shard_decisions(ids: list[str], lo: int, clusters: Clusters, all_ids: list[str], cfg: DedupConfig,
                    sig_rows, para_keep: np.ndarray | None) -> ShardDecisions:
    """The reason and scores of each clustered document of the shard starting at global index `lo`."""
    clustered = {}
    for k in np.flatnonzero(clusters.sizes[lo:lo + len(ids)] > 1):
        i = lo + int(k)
        root = int(clusters.roots[i])
        scores = {"cluster": all_ids[root], "cluster_size": int(clusters.sizes[i])}
        reason = None
        if root != i:
            exact = cfg.exact and np.array_equal(clusters.exact_hashes[i], clusters.exact_hashes[root])
            reason = "exact_duplicate" if exact else "near_duplicate"
            if sig_rows is not None:  # estimated Jaccard with the kept document
                a, b = sig_rows(np.array([i, root]))
                scores["similarity"] = round(float(np.mean(a == b)), 4)
        clustered[int(k)] = (reason, scores)
    return ShardDecisions(ids, clustered, para_keep)


def run_dedup(ctx: StepContext) -> dict:
    cfg: DedupConfig = ctx.config
    shards = list_shards(ctx.inputs["documents"])
    work = ctx.work_dir / "hashes"
    jobs = [ShardJob(s, ctx.out, (cfg, work), strict=cfg.strict, max_doc_bytes=cfg.max_doc_bytes) for s in shards]
    run_map(ctx, hash_shard, jobs, "dedup: hashing")
    bases = [_arrays_path(work, s) for s in shards]
    shard_ids = [json.loads((b / "ids.json").read_text()) for b in bases]
    offsets = np.cumsum([0] + [len(ids) for ids in shard_ids])
    all_ids = [doc_id for ids in shard_ids for doc_id in ids]
    clusters = find_clusters(cfg, bases, offsets, ctx.log)
    keep_doc = clusters.roots == np.arange(len(all_ids))
    para_keep, paras_removed = kept_paragraphs(bases, keep_doc) if cfg.paragraphs else (None, 0)
    para_bounds = np.cumsum([0] + [int(np.load(b / "paragraph_counts.npy").sum()) for b in bases]) \
        if cfg.paragraphs else None
    sig_rows = Signatures(bases, offsets).rows if cfg.minhash else None

    write_jobs = []
    for k, (shard, ids) in enumerate(zip(shards, shard_ids)):
        paras = para_keep[para_bounds[k]:para_bounds[k + 1]] if para_keep is not None else None
        decisions = shard_decisions(ids, int(offsets[k]), clusters, all_ids, cfg, sig_rows, paras)
        write_jobs.append(ShardJob(shard, ctx.out, decisions, make_dedup_judge, cfg.strict, cfg.max_doc_bytes))
    stats = merge_stats(run_map(ctx, judge_shard, write_jobs, "dedup: writing"))
    in_clusters = clusters.sizes > 1
    stats.update(
        clusters=int(np.count_nonzero(in_clusters & keep_doc)),
        documents_in_clusters=int(np.count_nonzero(in_clusters)),
        exact_duplicates=stats["dropped"].get("exact_duplicate", 0),
        near_duplicates=stats["dropped"].get("near_duplicate", 0),
        signature_comparisons=clusters.compared,
    )
    if cfg.paragraphs:
        stats["paragraphs_removed"] = paras_removed
    ctx.log.info("dedup: %d clusters; removed %d exact and %d near duplicates of %d documents",
                 stats["clusters"], stats["exact_duplicates"], stats["near_duplicates"], stats["docs_in"])
    return check_sources(ctx, stats)


def dedup_step(config: DedupConfig, *, documents: Step) -> Step:
    from tasks.engine.step import Step

    return Step(name="dedup", stage="dedup", stage_version=STAGE_VERSION, config=config,
                run=run_dedup, inputs={"documents": documents})
