"""kiln run as a user runs it, for the benchmarks that compare runs (optimizer, EMA, decay shape,
soup): the CLI in a fresh process, an experiment on a clean store and its `kiln compare` rows,
the train step's tokens/s, and a scratch folder for the stores."""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from training.metrics import read_metrics  # noqa: E402


def kiln(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a fresh process; exits with its output if it failed."""
    done = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, text=True, capture_output=True)
    if done.returncode:
        raise SystemExit(f"kiln {' '.join(args)} exited {done.returncode}:\n{done.stdout[-4000:]}\n"
                         f"{done.stderr[-4000:]}")
    return done


def run_and_compare(config: dict, root: Path) -> tuple[Path, dict[str, dict]]:
    """`config` (its YAML written under `root`) run on a clean store there, then `kiln compare`'s
    rows by variant."""
    path, store = root / "experiment.yaml", root / "store"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    kiln("run", str(path), "--store", str(store))
    rows = json.loads(kiln("compare", str(path), "--store", str(store), "--json").stdout)
    return store, {r["variant"]: r for r in rows}


def tokens_per_s(store: Path, train_version: str) -> float:
    """A train step's median tokens/s over its log steps after the first (which includes compiling)."""
    records = read_metrics(store / "train" / train_version / "metrics.jsonl")
    return statistics.median(r["tokens_per_s"] for r in records[1:])


@contextlib.contextmanager
def scratch(prefix: str, keep: bool) -> Iterator[Path]:
    """A temporary folder for a benchmark's stores: removed at the end, or with `keep` kept and named."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        if keep:
            print(f"stores kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
