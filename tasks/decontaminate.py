"""Decontaminate: drop training documents that share a long n-gram with an evaluation example.

GPT-3 (Brown et al. 2020, appendix C) and DCLM (Li et al. 2024) flag a training document that
shares a 13-gram of words (lowercased, punctuation stripped) with any evaluation example. Here
the document is dropped (`mode: drop`, reason `contaminated`) or the overlapping word spans are
cut out of it (`mode: spans`; dropped only when nothing is left). Each document's attribute
record names the eval tasks it overlaps, so `kiln why` explains it, and the stats count
documents per task.

What the evaluation examples are:

- kiln's offline suite (evaluation/suite.py) is cut from the documents that tokenize holds out
  (tokenize.is_validation on the id), and bits per byte is measured on the same documents. So
  the held-out documents of this stage's input *are* the evaluation text: contamination is a
  training document (one tokenize will train on) that repeats a passage of a held-out one, which
  is what dedup leaves behind when two documents share a passage but are not near-duplicates
  as a whole. The held-out documents themselves pass through untouched (task name `kiln_suite`).
  Using the whole held-out documents, not the examples evaluate cuts from them, keeps this
  stage's version free of `eval.suite` and `eval.limit` (editing them must not retrain): every
  suite example (context, continuation, distractors, target) is a span of a held-out document,
  so anything sharing an n-gram with an example shares it with a held-out document.
- lm-eval tasks given as local task YAMLs (`eval.lm_eval_tasks`; the pipeline copies them
  here): every string field of every record of their JSON-lines data files. A task named only
  by its lm-eval registry name has no data files kiln can read; it is listed under
  `unchecked_tasks` in the stats and logged.

Memory: the eval n-grams as a sorted array of 64-bit keys (with a bit per task); documents
stream shard by shard.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import Field

from tasks.documents import read_documents
from tasks.judging import (ATTRIBUTES, DEFAULT_MAX_DOC_BYTES, MAX_DOC_BYTES_DESCRIPTION, STRICT_DESCRIPTION,
                           WORKERS_DESCRIPTION, Judge, Verdict, run_judged)
from tasks.tokenize import is_validation
from tasks.engine.config import ConfigModel, Count, Fraction, files, setting

if TYPE_CHECKING:  # tasks.engine.step loads Prefect (seconds), which Ray workers running this module never need
    from tasks.engine.step import Step, StepContext

STAGE_VERSION = 1
SUITE_TASK = "kiln_suite"
WORD = re.compile(r"\w+")  # lowercased first: words without punctuation
U64 = np.uint64
MAX_TASKS = 64  # one bit per task in the index
_MULT = np.random.default_rng(13).integers(1, 2**63, size=256, dtype=U64) | U64(1)


class DecontaminateConfig(ConfigModel):
    """Which overlaps count and what happens to a contaminated training document."""

    ngram: Count = Field(13, description="Words in the n-grams compared (13: GPT-3, DCLM).")
    mode: Literal["drop", "spans"] = Field("drop", description="`drop` a contaminated document, or cut the "
                                           "overlapping `spans` out of it (dropped only when nothing is left).")
    heldout: bool = Field(True, description="Check against the held-out documents (kiln's suite and bits per "
                          "byte are cut from them); they themselves pass untouched.")
    validation_fraction: Fraction = Field(0.01, description="Which documents are held out; the pipeline sets "
                                          "it from `tokenize.validation_fraction`.")
    lm_eval_tasks: list[str] = files(default_factory=list, description="lm-eval task YAMLs whose data files' "
                                     "strings are checked; the pipeline sets it from `eval.lm_eval_tasks`.")
    max_doc_bytes: Count = Field(DEFAULT_MAX_DOC_BYTES, description=MAX_DOC_BYTES_DESCRIPTION)
    strict: bool = Field(False, description=STRICT_DESCRIPTION)
    workers: Count | None = setting(None, description=WORKERS_DESCRIPTION)
    max_source_drop: Fraction = setting(0.9, description="Warn (and record under `warnings`) when more than this "
                                        "share of one source is removed; set from `data.max_source_drop`.")


# --- n-grams ----------------------------------------------------------------------------------

def words_of(text: str) -> list[re.Match]:
    return list(WORD.finditer(text.lower()))


def ngram_keys(words: list[str], n: int, cache: dict[str, int]) -> np.ndarray:
    """One 64-bit key per word n-gram (empty when there are fewer than n words)."""
    if len(words) < n:
        return np.zeros(0, dtype=U64)
    from tasks.dedup import hash64, splitmix64

    h = np.fromiter((cache[w] if w in cache else cache.setdefault(w, hash64(w)) for w in words),
                    dtype=U64, count=len(words))
    m = len(words) - n + 1
    keys = h[:m] * _MULT[0]
    for k in range(1, n):
        keys += h[k:k + m] * _MULT[k % len(_MULT)]
    return splitmix64(keys)


class EvalIndex:
    """The n-grams of every eval text, each with the set of tasks it comes from (as bits)."""

    def __init__(self, tasks: list[str], keys: np.ndarray, bits: np.ndarray):
        self.tasks, self.keys, self.bits = tasks, keys, bits

    @classmethod
    def build(cls, texts_by_task: dict[str, list[str]], n: int) -> "EvalIndex":
        tasks = sorted(texts_by_task)
        if len(tasks) > MAX_TASKS:
            raise ValueError(f"decontaminate checks at most {MAX_TASKS} eval tasks, got {len(tasks)}")
        cache: dict[str, int] = {}
        all_keys, all_bits = [np.zeros(0, U64)], [np.zeros(0, U64)]
        for t, task in enumerate(tasks):
            for text in texts_by_task[task]:
                k = ngram_keys([m.group() for m in words_of(text)], n, cache)
                all_keys.append(k)
                all_bits.append(np.full(len(k), U64(1) << U64(t), dtype=U64))
        keys, bits = np.concatenate(all_keys), np.concatenate(all_bits)
        order = np.argsort(keys, kind="stable")
        keys, bits = keys[order], bits[order]
        if len(keys) == 0:
            return cls(tasks, keys, bits)
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        return cls(tasks, keys[starts], np.bitwise_or.reduceat(bits, starts))

    def hits(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        """(positions of `keys` found in the index, OR of their task bits)."""
        if len(self.keys) == 0 or len(keys) == 0:
            return np.zeros(0, dtype=np.int64), 0
        at = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        found = np.flatnonzero(self.keys[at] == keys)
        return found, int(np.bitwise_or.reduce(self.bits[at[found]])) if len(found) else 0

    def names(self, bits: int) -> list[str]:
        return [t for i, t in enumerate(self.tasks) if bits >> i & 1]


# --- eval texts -------------------------------------------------------------------------------

def lm_eval_texts(task_yaml: Path) -> tuple[str, list[str]]:
    """(task name, every string field of every record of its JSON-lines data files)."""
    import yaml

    class Loader(yaml.SafeLoader):  # lm-eval's `!function module.name` tags, kept as text
        pass

    Loader.add_multi_constructor("", lambda loader, tag, node: str(getattr(node, "value", "")))
    spec = yaml.load(task_yaml.read_text(), Loader=Loader) or {}
    name = str(spec.get("task") or task_yaml.stem)
    data_files = (spec.get("dataset_kwargs") or {}).get("data_files") or {}
    paths = data_files.values() if isinstance(data_files, dict) else \
        [data_files] if isinstance(data_files, str) else data_files
    texts: list[str] = []
    for entry in paths:
        for rel in [entry] if isinstance(entry, str) else entry:
            path = next((p for p in (Path(rel), task_yaml.parent / rel) if p.is_file()), None)
            if path is None:
                raise FileNotFoundError(f"{task_yaml}: data file {rel!r} not found (relative to the working "
                                        "directory or the YAML's folder)")
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        texts += _strings(json.loads(line))
    return name, texts


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def eval_texts(cfg: DecontaminateConfig, documents: Path, log) -> tuple[dict[str, list[str]], list[str]]:
    """The eval texts by task, and the lm-eval tasks that could not be read (registry names)."""
    texts: dict[str, list[str]] = {}
    unchecked = []
    if cfg.heldout and cfg.validation_fraction > 0:
        texts[SUITE_TASK] = [d["text"] for d in read_documents(documents)
                             if is_validation(str(d["id"]), cfg.validation_fraction)]
    for task in cfg.lm_eval_tasks:
        path = Path(task)
        if not path.is_file():
            log.warning("decontaminate: lm-eval task %r is not a task YAML on disk; its examples are not checked",
                        task)
            unchecked.append(task)
            continue
        name, task_texts = lm_eval_texts(path)
        texts.setdefault(name, []).extend(task_texts)
    return texts, unchecked


# --- the stage --------------------------------------------------------------------------------

def remove_spans(text: str, words: list[re.Match], starts: np.ndarray, n: int) -> tuple[str, int]:
    """`text` without the words covered by the n-grams starting at `starts`; (text, runs cut)."""
    covered = np.zeros(len(words) + 1, dtype=np.int64)
    np.add.at(covered, starts, 1)
    np.add.at(covered, starts + n, -1)
    covered = np.cumsum(covered)[:-1] > 0
    pieces, cut, prev, i = [], 0, 0, 0
    while i < len(words):
        if not covered[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(words) and covered[j + 1]:
            j += 1
        pieces.append(text[prev:words[i].start()])
        prev, cut, i = words[j].end(), cut + 1, j + 1
    pieces.append(text[prev:])
    return "".join(pieces), cut


def make_decontaminate_judge(job_config: tuple[DecontaminateConfig, EvalIndex]) -> Judge:
    cfg, index = job_config
    cache: dict[str, int] = {}

    def judge(doc: dict) -> Verdict:
        if cfg.heldout and is_validation(str(doc["id"]), cfg.validation_fraction):
            return doc, None, {"held_out": True}
        words = words_of(doc["text"])
        found, bits = index.hits(ngram_keys([m.group() for m in words], cfg.ngram, cache))
        if not len(found):
            return doc, None, {}
        scores = {"tasks": index.names(bits), "ngrams": int(len(found))}
        if cfg.mode == "drop":
            return None, "contaminated", scores
        text, cut = remove_spans(doc["text"], words, found, cfg.ngram)
        scores.update(spans_removed=cut, chars_removed=len(doc["text"]) - len(text))
        if not WORD.search(text):
            return None, "contaminated", scores
        return {**doc, "text": text}, None, scores

    return judge


def count_by_task(out: Path) -> tuple[dict[str, int], dict[str, int]]:
    """(documents dropped, documents cut) per eval task, from the attribute records."""
    import gzip

    dropped: dict[str, int] = {}
    cut: dict[str, int] = {}
    for shard in sorted((out / ATTRIBUTES).glob("shard-*.jsonl.gz")):
        with gzip.open(shard, "rt", encoding="utf-8") as f:
            for line in f:
                if '"tasks"' not in line:
                    continue
                record = json.loads(line)
                into = cut if record["kept"] else dropped
                for task in record["scores"]["tasks"]:
                    into[task] = into.get(task, 0) + 1
    return dict(sorted(dropped.items())), dict(sorted(cut.items()))


def run_decontaminate(ctx: StepContext) -> dict:
    cfg: DecontaminateConfig = ctx.config
    texts, unchecked = eval_texts(cfg, ctx.inputs["documents"], ctx.log)
    index = EvalIndex.build(texts, cfg.ngram)
    ctx.log.info("decontaminate: %d distinct %d-grams from %s", len(index.keys), cfg.ngram,
                 {t: len(v) for t, v in texts.items()})
    stats = run_judged(ctx, make_decontaminate_judge, (cfg, index))
    dropped, cut = count_by_task(ctx.out)
    stats.update(contaminated=dropped, eval_texts={t: len(v) for t, v in sorted(texts.items())},
                 eval_ngrams=int(len(index.keys)))
    if cfg.mode == "spans":
        stats["spans_cut"] = cut
    if unchecked:
        stats["unchecked_tasks"] = unchecked
    ctx.log.info("decontaminate: dropped per task %s%s", dropped, f", cut per task {cut}" if cut else "")
    return stats


def decontaminate_step(config: DecontaminateConfig, *, documents: Step) -> Step:
    from tasks.engine.step import Step

    return Step(name="decontaminate", stage="decontaminate", stage_version=STAGE_VERSION, config=config,
                run=run_decontaminate, inputs={"documents": documents})
