"""What every filter-type stage (extract, filter, quality_filter, dedup, decontaminate) shares.

`judge_shard` streams one shard through a per-document judge and writes two shards: the kept
documents, and `attributes/<shard>` with one record per input document (`{"id", "kept",
"reason", "scores"}`), which `explain` (the `kiln why` command) reads. `run_judged` spreads that
over the shards with Ray and sums the stats. Bad input (a malformed line, invalid UTF-8, an
empty or oversized document, a truncated shard) is counted under its reason like any other
drop, or with `strict: true` is an error naming the file.

Stats are also kept per source (the documents' `source` field): documents and bytes in and out
and drop reasons, under `per_source`. `check_sources` warns when a stage removes more than
`max_source_drop` of any one source, and records it under `warnings`.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tasks.documents import SHARD_GLOB, BadRecord, dumps, list_shards, read_shard, write_shard

if TYPE_CHECKING:  # tasks.engine.step loads Prefect (seconds), which Ray workers never need
    from tasks.engine.step import StepContext

ATTRIBUTES = "attributes"
UNREAD = "(unread)"  # the source of records that never parsed into a document
DEFAULT_MAX_DOC_BYTES = 5_000_000  # larger lines are counted as `too_large`, never parsed
# The descriptions of the fields every data stage's config declares alike (docs/configuration.md).
MAX_DOC_BYTES_DESCRIPTION = ("An input line (one document as JSON) longer than this many bytes is counted as "
                             "`too_large` and dropped unparsed.")
STRICT_DESCRIPTION = ("Make bad input (a malformed line, invalid UTF-8, an empty or oversized document, a truncated "
                      "shard) an error naming the file, instead of a drop counted under its reason.")
WORKERS_DESCRIPTION = "Shards processed at once, by Ray workers when more than 1; None: `run.workers`."

# A judge decides one document: (document to keep, possibly rewritten, or None; the reason it
# was dropped, or None; scores for the attribute record).
Verdict = tuple[dict | None, str | None, dict]
Judge = Callable[[dict], Verdict]



def bad_document(doc: dict) -> tuple[str, str] | None:
    """(reason, detail) when a parsed document still cannot be processed, else None."""
    text = doc["text"]
    if not text.strip():
        return "empty_text", "the text is empty or only white space"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates from a JSON "\ud800" escape
        return "invalid_utf8", f"the text cannot be encoded as UTF-8: {e}"
    return None


@dataclass(frozen=True)
class ShardJob:
    """One shard for a worker. For `judge_shard`, `make_judge(config)` builds the judge inside
    the worker (a module-level function: Ray pickles it by reference)."""

    shard: Path
    out: Path
    config: Any
    make_judge: Callable[[Any], Judge] | None = None
    strict: bool = False
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES


def judge_shard(job: ShardJob) -> dict:
    """Stream one shard through its judge: kept documents to `out/<shard>`, one attribute
    record per document to `out/attributes/<shard>`. Returns the shard's stats."""
    judge = job.make_judge(job.config)
    bad: Counter = Counter()
    dropped: Counter = Counter()
    repaired: Counter = Counter()  # kept after a fix, e.g. extract's charset repair
    seen = {"docs": 0, "bytes": 0}
    per_source: dict[str, dict] = {}
    (job.out / ATTRIBUTES).mkdir(parents=True, exist_ok=True)

    with open(job.out / ATTRIBUTES / job.shard.name, "wb") as raw, \
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=6) as attributes:

        def kept():
            for doc in read_shard(job.shard, bad=bad, strict=job.strict, max_doc_bytes=job.max_doc_bytes):
                seen["docs"] += 1
                mine = per_source.setdefault(str(doc["source"]), _empty_counts())
                mine["docs_in"] += 1
                problem = bad_document(doc)
                if problem is not None:
                    if job.strict:
                        raise BadRecord(f"{job.shard}: document {doc['id']!r}: {problem[0]}: {problem[1]} "
                                        "(set strict: false to skip and count)")
                    out, reason, scores = None, problem[0], {}
                else:
                    size = len(doc["text"].encode())
                    seen["bytes"] += size
                    mine["bytes_in"] += size
                    out, reason, scores = judge(doc)
                record = {"id": doc["id"], "kept": reason is None, "reason": reason, "scores": scores}
                attributes.write((dumps(record) + "\n").encode())
                if "repaired" in scores:
                    repaired[scores["repaired"]] += 1
                if reason is None:
                    mine["docs_out"] += 1
                    mine["bytes_out"] += len(out["text"].encode())
                    yield out
                else:
                    dropped[reason] += 1
                    mine["dropped"][reason] = mine["dropped"].get(reason, 0) + 1

        written = write_shard(job.out / job.shard.name, kept())
    dropped.update(bad)
    if bad:
        per_source[UNREAD] = {**_empty_counts(), "docs_in": sum(bad.values()), "dropped": dict(bad)}
    stats = {"docs_in": seen["docs"] + sum(bad.values()), "docs_out": written["docs"],
             "bytes_in": seen["bytes"], "bytes_out": written["bytes"], "dropped": dict(dropped),
             "per_source": per_source}
    if repaired:
        stats["repaired"] = dict(repaired)
    return stats


def _empty_counts() -> dict:
    return {"docs_in": 0, "docs_out": 0, "bytes_in": 0, "bytes_out": 0, "dropped": {}}


COUNTS = ("docs_in", "docs_out", "bytes_in", "bytes_out")


def merge_stats(parts: list[dict]) -> dict:
    """Sum shard stats; `dropped` (and `repaired`, when any) are summed per reason, and
    `per_source` per source the same way."""
    total: dict = {k: sum(p[k] for p in parts) for k in COUNTS}
    for key in ("dropped", "repaired"):
        counts: Counter = Counter()
        for p in parts:
            counts.update(p.get(key, {}))
        if counts or key == "dropped":
            total[key] = dict(sorted(counts.items()))
    sources: dict[str, dict] = {}
    for p in parts:
        for name, c in p.get("per_source", {}).items():
            mine = sources.setdefault(name, _empty_counts())
            for k in COUNTS:
                mine[k] += c[k]
            mine["dropped"] = dict(sorted((Counter(mine["dropped"]) + Counter(c["dropped"])).items()))
    total["per_source"] = dict(sorted(sources.items()))
    return total


def check_sources(ctx: StepContext, stats: dict) -> dict:
    """Warn (and record under `warnings`) when the stage removed more than the config's
    `max_source_drop` of any one source's documents; returns `stats`."""
    limit = getattr(ctx.config, "max_source_drop", None)
    if limit is None:
        return stats
    warnings = list(stats.get("warnings", []))
    for name, c in stats.get("per_source", {}).items():
        if name == UNREAD or not c["docs_in"]:
            continue
        share = 1 - c["docs_out"] / c["docs_in"]
        if share > limit:
            reasons = ", ".join(f"{r}={n}" for r, n in sorted(c["dropped"].items(), key=lambda x: -x[1])[:3])
            message = (f"{ctx.step.name} removed {share:.0%} of source {name!r} ({c['docs_in'] - c['docs_out']} "
                       f"of {c['docs_in']} documents: {reasons}), more than max_source_drop {limit:g}")
            ctx.log.warning("%s", message)
            warnings.append({"source": name, "dropped_share": round(share, 4), "message": message})
    if warnings:
        stats["warnings"] = warnings
    return stats


def stage_workers(config: Any, ctx: StepContext) -> int:
    """The config's `workers` when set, else the runner's."""
    return getattr(config, "workers", None) or ctx.workers


def run_map(ctx: StepContext, fn: Callable[[ShardJob], Any], items: list[ShardJob], what: str) -> list:
    """`map_shards` with a progress line per finished shard."""
    from tasks.engine.parallel import Places, map_shards  # Ray: imported when shards are mapped, not for plans

    done = [0]

    def progress(i: int, result: Any) -> None:
        done[0] += 1
        docs = f", {result['docs_in']} documents" if isinstance(result, dict) and "docs_in" in result else ""
        ctx.log.info("%s: %d/%d shards done (%s%s)", what, done[0], len(items), items[i].shard.name, docs)
        ctx.progress(done[0], len(items))

    return map_shards(fn, items, stage_workers(ctx.config, ctx), on_result=progress, places=Places.of(ctx))


def run_judged(ctx: StepContext, make_judge: Callable[[Any], Judge], judge_config: Any) -> dict:
    """Run a judge over every input shard, same shard names out; returns the summed stats."""
    config = ctx.config
    jobs = [ShardJob(shard, ctx.out, judge_config, make_judge, config.strict, config.max_doc_bytes)
            for shard in list_shards(ctx.inputs["documents"])]
    stats = merge_stats(run_map(ctx, judge_shard, jobs, ctx.step.name))
    ctx.log.info("%s: kept %d of %d documents; dropped %s", ctx.step.name, stats["docs_out"],
                 stats["docs_in"], stats["dropped"])
    return check_sources(ctx, stats)


def explain(folder: Path, doc_id: str) -> dict | None:
    """The attribute record of `doc_id` in the output of a filter-type step, or None.

    `folder` is the step's output folder (the one holding `attributes/`).
    """
    shards = sorted((Path(folder) / ATTRIBUTES).glob(SHARD_GLOB))
    if not shards:
        raise FileNotFoundError(f"no {ATTRIBUTES}/ shards in {folder}: give the output folder of a "
                                "filter-type step (extract, filter, quality_filter, dedup, decontaminate)")
    needle = json.dumps(doc_id, ensure_ascii=False)
    for shard in shards:
        with gzip.open(shard, "rt", encoding="utf-8") as f:
            for line in f:
                if needle in line:  # cheap test before parsing
                    record = json.loads(line)
                    if record["id"] == doc_id:
                        return record
    return None
