"""The tokenize step: document shards to flat token shards that the training loader memory-maps.

Output folder (read only through `training.data.TokenDataset`):

    meta.json                       dtype, vocab_size, eos_id, tokenizer version, counts per shard
    train/shard-00000.bin           flat tokens of input shard 0's training documents
    train/shard-00000.idx.npy       int64 start offset of each of those documents
    validation/shard-00000.bin      ... and of its held-out documents
    validation/shard-00000.idx.npy

Each document is `[bos] tokens eos` (bos only if the tokenizer has one), so EOS separates
documents. Which split a document lands in depends only on a hash of its id, so adding or
removing other documents never moves it. Input shard i always becomes output shard i (possibly
empty), and shards are tokenized independently, so the bytes are the same for any worker count.
Special-token strings inside document text are encoded as ordinary text (like tiktoken's
`encode_ordinary`): only this step inserts EOS.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np
from pydantic import Field
from tokenizers import Tokenizer

from tasks.documents import list_shards, read_shard
from tasks.tokenizer import load_tokenizer, read_tokenizer_meta
from tasks.engine.config import ConfigModel, Count, setting
from training.data import unigram_entropy

if TYPE_CHECKING:  # tasks.engine.step imports Prefect (seconds); Ray workers that import this module skip it
    from tasks.engine.step import Step, StepContext

STAGE_VERSION = 1
SPLITS = ("train", "validation")
FORMAT = "kiln-tokens"
FORMAT_VERSION = 1
# Text per encode_batch call: large enough to keep every core busy, small enough that memory
# stays far below a shard (`tokenizers` Encodings cost ~100 bytes per token).
CHUNK_CHARS = 2_000_000


class TokenizeConfig(ConfigModel):
    validation_fraction: float = Field(0.01, ge=0.0, le=1.0, description="Share of documents held out as the "
                                       "validation split, chosen by a hash of each id (adding documents never moves "
                                       "another); evaluation, decontamination and chat data use the same ones.")
    workers: Count | None = setting(None, description="Shards tokenized at once, by Ray workers when more than 1; "
                                    "None: `run.workers`. The output is the same for any count.")


def is_validation(doc_id: str, fraction: float) -> bool:
    """A document's split from its id alone: the first 8 bytes of blake2b as a fraction of 2**64."""
    h = int.from_bytes(hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest(), "little")
    return h < fraction * 2**64


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def shard_files(folder: Path, split: str, index: int) -> tuple[Path, Path]:
    """The `.bin` (tokens) and `.idx.npy` (document starts) of one output shard."""
    stem = Path(folder) / split / f"shard-{index:05d}"
    return stem.with_name(stem.name + ".bin"), stem.with_name(stem.name + ".idx.npy")


@dataclass(frozen=True)
class ShardJob:
    """Everything one worker needs for one input shard (small and picklable, for Ray)."""

    index: int
    shard: Path
    out: Path
    tokenizer: Path
    tokenizer_sha256: str
    dtype: str
    eos_id: int
    bos_id: int | None
    validation_fraction: float


@functools.lru_cache(maxsize=2)
def _ordinary_tokenizer(folder: Path, sha256: str) -> Tokenizer:
    """The tokenizer, loaded once per process (keyed by content too), special tokens read as text."""
    tok = load_tokenizer(folder)
    tok.encode_special_tokens = True
    return tok


def _chunks(docs: Iterator[dict], max_chars: int) -> Iterator[list[dict]]:
    chunk, chars = [], 0
    for doc in docs:
        chunk.append(doc)
        chars += len(doc["text"])
        if chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


class _SplitWriter:
    """Appends documents' tokens to one split's `.bin` and remembers where each one starts."""

    def __init__(self, job: ShardJob, split: str):
        self.bin_path, self.idx_path = shard_files(job.out, split, job.index)
        self.file = open(self.bin_path, "wb")
        self.dtype = np.dtype(job.dtype)
        self.prefix = [] if job.bos_id is None else [job.bos_id]
        self.suffix = [job.eos_id]
        self.starts: list[int] = []
        self.tokens = 0
        self.bytes = 0
        self.counts = np.zeros(0, dtype=np.int64)  # occurrences of each token id

    def write(self, texts: list[str], ids: list[list[int]]) -> None:
        before = self.tokens
        for text, doc_ids in zip(texts, ids):
            self.starts.append(self.tokens)
            self.tokens += len(self.prefix) + len(doc_ids) + len(self.suffix)
            self.bytes += len(text.encode("utf-8"))
        flat = itertools.chain.from_iterable(part for doc_ids in ids for part in (self.prefix, doc_ids, self.suffix))
        written = np.fromiter(flat, self.dtype, count=self.tokens - before)
        written.tofile(self.file)
        self.counts = sum_counts([self.counts, np.bincount(written)])

    def close(self) -> dict:
        self.file.close()
        np.save(self.idx_path, np.asarray(self.starts, dtype=np.int64))
        return {"documents": len(self.starts), "tokens": self.tokens, "bytes": self.bytes, "counts": self.counts}


def tokenize_shard(job: ShardJob) -> dict:
    """Tokenize one document shard into its train and validation token shards; return counts.

    Streams in chunks of CHUNK_CHARS characters, so memory is bounded by a chunk, not the shard.
    """
    tok = _ordinary_tokenizer(job.tokenizer, job.tokenizer_sha256)
    writers = {s: _SplitWriter(job, s) for s in SPLITS}
    for chunk in _chunks(read_shard(job.shard, strict=True), CHUNK_CHARS):
        texts = [d["text"] for d in chunk]
        encodings = tok.encode_batch_fast(texts, add_special_tokens=False)
        routed: dict[str, tuple[list, list]] = {s: ([], []) for s in SPLITS}
        for doc, text, enc in zip(chunk, texts, encodings):
            split = "validation" if is_validation(str(doc["id"]), job.validation_fraction) else "train"
            routed[split][0].append(text)
            routed[split][1].append(enc.ids)
        for split, (split_texts, split_ids) in routed.items():
            writers[split].write(split_texts, split_ids)
    return {s: w.close() for s, w in writers.items()}


def run_tokenize(ctx: StepContext) -> dict:
    config: TokenizeConfig = ctx.config
    tokenizer_dir, documents_dir = ctx.inputs["tokenizer"], ctx.inputs["documents"]
    tok_meta = read_tokenizer_meta(tokenizer_dir)
    _ordinary_tokenizer(Path(tokenizer_dir), tok_meta["sha256"])  # fail here, not inside a worker
    dtype = token_dtype(tok_meta["vocab_size"])
    shards = list_shards(documents_dir)
    for split in SPLITS:
        (ctx.out / split).mkdir(parents=True, exist_ok=True)

    jobs = [ShardJob(i, shard, ctx.out, Path(tokenizer_dir), tok_meta["sha256"], dtype.name, tok_meta["eos_id"],
                     tok_meta["bos_id"], config.validation_fraction) for i, shard in enumerate(shards)]
    workers = config.workers or ctx.workers
    ctx.log.info("tokenizing %d shards with %d workers (%s)", len(jobs), workers, dtype.name)
    from tasks.engine.parallel import Places, map_shards  # here: it imports Ray, which planning never needs

    train_counts = np.zeros(0, dtype=np.int64)

    def arrived(i: int, r: dict) -> None:
        nonlocal train_counts
        # Each shard's token histogram is added in as it arrives and dropped: kept per shard they
        # cost 8 bytes per vocabulary entry per shard and split (0.8 MB with GPT-2's), which made
        # this step's memory grow with the corpus (benchmarks/data_bench.py --sizes).
        train_counts = sum_counts([train_counts, r["train"].pop("counts")])
        r["validation"].pop("counts")
        ctx.log.info("shard %d/%d: %d train tokens", i + 1, len(jobs), r["train"]["tokens"])

    places = Places.of(ctx)
    results = map_shards(tokenize_shard, jobs, workers=workers, on_result=arrived, places=places)

    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "version": ctx.step.version,
        "dtype": dtype.name,
        "vocab_size": tok_meta["vocab_size"],
        "eos_id": tok_meta["eos_id"],
        "bos_id": tok_meta["bos_id"],
        "tokenizer_version": tok_meta["version"],
        "tokenizer_sha256": tok_meta["sha256"],
        "validation_fraction": config.validation_fraction,
        "splits": {s: _split_meta([r[s] for r in results]) for s in SPLITS},
    }
    (ctx.out / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    stats: dict = {"shards": len(shards), "dtype": dtype.name, "tokenizer_version": tok_meta["version"]}
    for s in SPLITS:
        m = meta["splits"][s]
        stats.update({f"{s}_documents": m["documents"], f"{s}_tokens": m["tokens"], f"{s}_bytes": m["bytes"],
                      f"{s}_bytes_per_token": round(m["bytes"] / m["tokens"], 4) if m["tokens"] else None})
    # The loss of the best model that ignores context: training should end well below it.
    stats["unigram_entropy"] = round(unigram_entropy(train_counts), 4)
    stats["documents"] = stats["train_documents"] + stats["validation_documents"]
    stats["tokens"] = stats["train_tokens"] + stats["validation_tokens"]
    if places.nodes:  # where the shards ran, with workers > 1 (never part of the output)
        stats["ray_nodes"] = sorted(places.nodes)
    return stats


def _split_meta(shards: list[dict]) -> dict:
    return {
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
        "shards": [{"name": f"shard-{i:05d}", **s} for i, s in enumerate(shards)],
    }


def sum_counts(counts: list[np.ndarray]) -> np.ndarray:
    """Token-count histograms of any lengths (ids beyond a histogram's end count 0), added."""
    total = np.zeros(max((len(c) for c in counts), default=0), dtype=np.int64)
    for c in counts:
        total[:len(c)] += c
    return total


def tokenize_step(config: TokenizeConfig, *, tokenizer: Step, documents: Step) -> Step:
    from tasks.engine.step import Step  # here, not at the top: see the TYPE_CHECKING import

    return Step(name="tokenize", stage="tokenize", stage_version=STAGE_VERSION, config=config,
                run=run_tokenize, inputs={"tokenizer": tokenizer, "documents": documents})
