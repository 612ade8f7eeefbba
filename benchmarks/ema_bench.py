"""A moving average of the parameters (train.ema) against none, through kiln as a user runs it:
configs/tiny_cpu.yaml as variants, none and each decay given (with `--warmup`, each also with
train.ema_warmup), on one clean store, one train step at a time so that none shares the cores;
then `kiln compare`.

Prints per run: the train step's tokens/s (median of its log steps after the first) and its
ratio to the run without an average (the cost of the update), the trained parameters' and the
average's last validation loss, and the evaluate step's bits per byte and task accuracy, which
score the published model (the average, where there is one). `--set` passes fields to every run
(another schedule, say). Run it with nothing else on the machine:

    uv run python benchmarks/ema_bench.py                                  # decays 0.9 and 0.98
    uv run python benchmarks/ema_bench.py --decays 0.95 --set train.schedule=wsd
    uv run python benchmarks/ema_bench.py --decays 0.99 0.999 --warmup
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from kiln_runs import REPO, run_and_compare, scratch, tokens_per_s  # noqa: E402
from train_bench import machine  # noqa: E402

from flows.config import with_sets  # noqa: E402
from tasks.engine.lineage import read_lineage  # noqa: E402


def experiment(decays: list[float], sets: list[str], warmup: bool = False) -> dict:
    config = with_sets(yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text()), sets)
    config.pop("canary", None)
    config["variants"] = {"none": {}}
    for decay in decays:
        config["variants"][f"ema={decay}"] = {"train.ema": decay}
        if warmup:
            config["variants"][f"ema={decay}+warmup"] = {"train.ema": decay, "train.ema_warmup": True}
    config["run"] = {**config.get("run", {}), "max_concurrent": 1}  # one train step at a time: its own cores
    return config


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decays", type=float, nargs="+", default=[0.9, 0.98], help="train.ema decays to run")
    p.add_argument("--warmup", action="store_true", help="each decay also with train.ema_warmup")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="PATH=VALUE",
                   help="a field of every run, as kiln's --set")
    p.add_argument("--keep", action="store_true", help="keep the store")
    args = p.parse_args()
    print(f"machine: {machine()}", flush=True)
    with scratch("kiln-ema-", args.keep) as root:
        store, rows = run_and_compare(experiment(args.decays, args.sets, args.warmup), root)
        print(f"machine at the end: {machine()}\n")
        compared(store, list(rows.values()))
    return 0


def compared(store: Path, rows: list[dict]) -> None:
    """Each run's speed against the first's (no average), losses and evaluate metrics."""
    base = tokens_per_s(store, rows[0]["train_version"])
    print(f"{'train.ema':15s} {'tokens/s':>9s} {'/ none':>7s} {'val_loss':>9s} {'ema_val':>8s} {'bits/byte':>10s} "
          f"{'next_passage':>13s} {'last_word':>10s}")
    for row in rows:
        stats = read_lineage(store / "train" / row["train_version"])["stats"]
        speed = tokens_per_s(store, row["train_version"])
        ema = stats.get("final_ema_val_loss")
        ema = f"{ema:8.4f}" if ema is not None else f"{'-':>8s}"
        print(f"{row['variant'].removeprefix('ema='):15s} {speed:9.0f} {speed / base:7.3f} "
              f"{stats['final_val_loss']:9.4f} {ema} {row['bits_per_byte']:10.4f} "
              f"{row['next_passage_acc']:13.3f} {row['last_word_acc']:10.3f}")

if __name__ == "__main__":
    sys.exit(main())
