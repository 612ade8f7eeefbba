"""What the compilation cache (training/compile_cache.py) saves a rerun of a train step.

configs/tiny_cpu.yaml's model (its BPE's 4,096 tokens) and train sections, for `--steps` steps on
random tokens, each run in a fresh process as `kiln run` starts a training host, three ways in
every round:

  off      KILN_COMPILE_CACHE=off: every program compiled, as before the cache
  cold     an empty cache folder: compiled, and written to the folder
  warm     the same folder again: read back (a rerun, a resume, the next run of a suite)

and, against what kiln did before 2026-12-04, when two more ways ran too:

  cold_1s  a folder of its own, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1: only the programs
           that took 1 s or more to compile are written (JAX's default)
  warm_1s  that folder again, the same threshold: the small programs compiled again
  torch    the warm folder, with torch imported before training, as every training process
           imported it (through tensorboardX) where torch is installed (skipped where it is not)

Printed per way: the median over rounds of the whole process's wall time and of `train()`'s own
(its stats' `seconds`: compiling, steps, validation, checkpoints, the model written), how many
programs it read from the cache, warm / off, warm / warm_1s and warm / torch for both; and
whether all runs gave the same parameters (they must: the executable read back is the one XLA
compiled).

    uv run --dev python benchmarks/compile_cache_bench.py --rounds 3 --before
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys
from pathlib import Path
import numpy as np
from training.config import model_and_train
from training.loop import train

if sys.argv[5] == "torch":
    import torch  # noqa: F401
model, cfg = model_and_train(sys.argv[1])
model = model.model_copy(update={"vocab_size": int(sys.argv[4])})
steps = int(sys.argv[3])
cfg = cfg.model_copy(update={"steps": steps, "warmup": 1, "log_every": steps, "eval_every": steps,
                             "checkpoint_every": steps})
rng = np.random.default_rng(0)
batches = rng.integers(0, model.vocab_size, (steps, cfg.batch_size, model.seq_len + 1), dtype=np.int32)
val = [rng.integers(0, model.vocab_size, (cfg.batch_size, model.seq_len + 1), dtype=np.int32)]
out = Path(sys.argv[2])
stats = train(model, cfg, lambda step: batches[step], val, out / "work", out / "out")
print(json.dumps({k: stats[k] for k in ("seconds", "compiled_programs_read", "params_sha256")}))
"""


def run_once(config: str, steps: int, vocab: int, scratch: Path, cache: str, way: str) -> dict:
    out = Path(tempfile.mkdtemp(dir=scratch))
    env = {**os.environ, "KILN_COMPILE_CACHE": cache, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
    if way.endswith("_1s"):
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "1"
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, config, str(out), str(steps), str(vocab), way], cwd=REPO,
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"the {way} run failed:\n{proc.stderr[-3000:]}")
    return {"wall": wall, **json.loads(proc.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny_cpu.yaml"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096, help="the tiny config's BPE vocabulary")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", action="store_true",
                        help="also the ways of kiln before 2026-12-04: cold_1s, warm_1s and torch")
    args = parser.parse_args()
    ways = ["off", "cold", "warm"]
    if args.before:
        ways += ["cold_1s", "warm_1s"] + (["torch"] if importlib.util.find_spec("torch") else [])
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            # empty each round: cold, then warm (and torch); cold_1s, then warm_1s, in one of their own
            folders = {"cold": f"{scratch}/compiled-{r}", "cold_1s": f"{scratch}/compiled-1s-{r}"}
            folders.update(warm=folders["cold"], torch=folders["cold"], warm_1s=folders["cold_1s"], off="off")
            for way in ways:
                runs[way].append(run_once(args.config, args.steps, args.vocab, Path(scratch), folders[way], way))
                print(f"round {r + 1} {way}: {runs[way][-1]['wall']:.1f} s", file=sys.stderr, flush=True)
    print(f"{args.config}, {args.steps} steps, {args.rounds} rounds, fresh process each")
    print(f"{'way':<8} {'process s':>10} {'train() s':>10} {'programs read':>14}")
    med = {}
    for way, rs in runs.items():
        med[way] = (statistics.median(r["wall"] for r in rs), statistics.median(r["seconds"] for r in rs))
        print(f"{way:<8} {med[way][0]:>10.1f} {med[way][1]:>10.1f} {max(r['compiled_programs_read'] for r in rs):>14}")
    for base in ("off", "warm_1s", "torch"):
        if base in med:
            print(f"warm / {base}: process {med['warm'][0] / med[base][0]:.2f}, "
                  f"train() {med['warm'][1] / med[base][1]:.2f}")
    shas = {r["params_sha256"] for rs in runs.values() for r in rs}
    print(f"same parameters in every run: {'yes' if len(shas) == 1 else f'NO ({len(shas)} different)'}")


if __name__ == "__main__":
    main()
