"""Muon against AdamW on the quickstart, through kiln as a user runs it: configs/tiny_cpu.yaml as
an experiment of two variants, `adamw` (the config) and `muon` (`train.optimizer: muon`, the same
lr and weight decay), on one clean store, one train step at a time so that neither shares the
cores; then `kiln compare`.

Prints, muon against adamw: the train step's tokens/s (median of its log steps after the first,
which includes compiling) and their ratio, and the losses, bits per byte and task accuracies at
the same number of steps. Run it with nothing else on the machine:

    uv run python benchmarks/optimizer_bench.py                        # the quickstart's 300 steps
    uv run python benchmarks/optimizer_bench.py --lrs 1e-3 3e-3 1e-2   # each at three learning rates
    uv run python benchmarks/optimizer_bench.py --keep                 # keep the store (printed at the end)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from kiln_runs import REPO, run_and_compare, scratch, tokens_per_s  # noqa: E402
from train_bench import machine  # noqa: E402

SHOWN = ("final_loss", "final_val_loss", "bits_per_byte", "next_passage_acc", "last_word_acc", "train_seconds")


def experiment(steps: int | None, lrs: list[float] | None) -> dict:
    config = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    config.pop("canary", None)
    if steps:
        config["train"]["steps"] = steps
    config["variants"] = {"adamw": {}, "muon": {"train.optimizer": "muon"}}
    if lrs:  # each optimizer at each learning rate: variants "adamw,lr=0.001", ...
        config["grid"] = {"train.lr": lrs}
    config["run"] = {**config.get("run", {}), "max_concurrent": 1}  # one train step at a time: its own cores
    return config


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="train steps (default: the quickstart's)")
    p.add_argument("--lrs", type=float, nargs="+", help="learning rates to train each optimizer at (default: the "
                   "quickstart's one); the best of each is printed")
    p.add_argument("--keep", action="store_true", help="keep the store")
    args = p.parse_args()
    print(f"machine: {machine()}", flush=True)
    with scratch("kiln-optimizers-", args.keep) as root:
        store, rows = run_and_compare(experiment(args.steps, args.lrs), root)
        print(f"\nmachine at the end: {machine()}")
        compared(store, rows, args.lrs)
    return 0


def compared(store: Path, rows: dict[str, dict], lrs: list[float] | None) -> None:
    """Muon against AdamW at each learning rate, and each one's best."""
    for point in [f",lr={lr}" for lr in lrs] if lrs else [""]:  # the grid names a point so
        adamw, muon = rows["adamw" + point], rows["muon" + point]
        speed = [tokens_per_s(store, row["train_version"]) for row in (adamw, muon)]
        print(f"\n{'lr ' + point[4:] if point else '':18s} {'adamw':>10s} {'muon':>10s} {'muon/adamw':>11s}")
        print(f"{'tokens/s':18s} {speed[0]:10.0f} {speed[1]:10.0f} {speed[1] / speed[0]:11.3f}")
        for key in SHOWN:
            if isinstance(adamw.get(key), (int, float)) and isinstance(muon.get(key), (int, float)):
                ratio = f"{muon[key] / adamw[key]:11.3f}" if adamw[key] else f"{'n/a':>11s}"  # an accuracy of 0
                print(f"{key:18s} {adamw[key]:10.4f} {muon[key]:10.4f} {ratio}")
    if lrs:  # each optimizer at its own best learning rate, as a fair comparison takes them
        for name in ("adamw", "muon"):
            best = min((r for v, r in rows.items() if v.startswith(name + ",")), key=lambda r: r["bits_per_byte"])
            print(f"best {name}: {best['variant']} bits_per_byte {best['bits_per_byte']:.4f}")


if __name__ == "__main__":
    sys.exit(main())
