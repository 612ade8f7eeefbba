"""What collecting the test suite costs one pytest process, here and at a baseline commit.

Every pytest process collects every test module (the fast suite's three workers, and each stage of
.ci/run again), so work done at a module's import is paid in each of them, and, with Python's
bytecode cache off (these machines set PYTHONDONTWRITEBYTECODE=1), kiln's modules and pytest's
rewritten test modules are compiled from source in each of them too. For the working tree and a
git worktree at `--baseline`, it times `pytest --collect-only -n 0` `--rounds` times in turn:
cold (every __pycache__/ of the tree removed, bytecode writing off: CI before this change) and
cached (bytecode written by one untimed collection first, as .ci/run now lets it). Prints the
median of each and the ratios against the baseline's cold collection.

    uv run --dev python benchmarks/collect_bench.py --baseline ceddc05 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def clear_bytecode(tree: Path) -> None:
    """Every __pycache__/ of the tree's own code (not its .venv's, compiled at install)."""
    for folder, subfolders, _ in os.walk(tree):
        if "__pycache__" in subfolders:
            shutil.rmtree(Path(folder) / "__pycache__")
        subfolders[:] = [d for d in subfolders if d not in (".venv", ".git", "__pycache__")]


def collect_s(tree: Path, write_bytecode: bool) -> float:
    """Seconds of one `pytest --collect-only` in `tree` (its own tests, conftest and kiln modules:
    pytest puts the tree's root first on sys.path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if not write_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(KILN_TESTS_NEED_TORCH=os.environ.get("KILN_TESTS_NEED_TORCH", "0"), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"collecting in {tree} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="the commit to compare with (a git worktree of it is made)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.baseline], cwd=REPO, check=True)
        try:
            trees = {f"baseline {args.baseline}": base, "this tree": REPO}
            times = {(name, mode): [] for name in trees for mode in ("cold", "cached")}
            for r in range(args.rounds):
                for name, tree in trees.items():
                    clear_bytecode(tree)
                    times[name, "cold"].append(collect_s(tree, write_bytecode=False))
                    collect_s(tree, write_bytecode=True)  # writes the cache, untimed
                    times[name, "cached"].append(collect_s(tree, write_bytecode=True))
                    print(f"  round {r + 1} {name:20s} cold {times[name, 'cold'][-1]:5.1f} s   "
                          f"cached {times[name, 'cached'][-1]:5.1f} s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, check=True)
    reference = statistics.median(times[f"baseline {args.baseline}", "cold"])
    for (name, mode), values in times.items():
        median = statistics.median(values)
        print(f"{name:20s} {mode:6s} median {median:5.1f} s  ({median / reference:.2f} x the baseline cold)")
    clear_bytecode(REPO)


if __name__ == "__main__":
    main()
