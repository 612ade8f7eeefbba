"""WSD's decay shape, linear against sqrt (train.decay_shape), through kiln as a user runs it:
configs/cooldown_cpu.yaml (a 240-step stable run decaying over its last 40 steps, and cooldown
branches of 40 steps from its steps 80, 120 and 160) as two variants, `linear` (the config) and
`sqrt`, on one clean store; then `kiln compare`.

Prints each run's bits per byte and next_passage accuracy in both shapes, and sqrt / linear.
Every run decays over its last 40 steps, so each pair trains the same tokens:

    uv run python benchmarks/decay_shape_bench.py
    uv run python benchmarks/decay_shape_bench.py --set train.min_lr_ratio=0   # decays to zero
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from kiln_runs import REPO, run_and_compare, scratch  # noqa: E402
from train_bench import machine  # noqa: E402

from flows.config import with_sets  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="PATH=VALUE",
                   help="a field of every run, as kiln's --set (train.min_lr_ratio=0, say)")
    p.add_argument("--keep", action="store_true", help="keep the store")
    args = p.parse_args()
    print(f"machine: {machine()}", flush=True)
    config = with_sets(yaml.safe_load((REPO / "configs" / "cooldown_cpu.yaml").read_text()), args.sets)
    config["variants"] = {"linear": {}, "sqrt": {"train.decay_shape": "sqrt"}}
    with scratch("kiln-decay-shape-", args.keep) as root:
        _, rows = run_and_compare(config, root)
        print(f"machine at the end: {machine()}\n")
        compared(rows)
    return 0


def compared(rows: dict[str, dict]) -> None:
    """Each run's bits per byte and next_passage accuracy in both shapes."""
    print(f"{'run':34s} {'linear':>8s} {'sqrt':>8s} {'sqrt/linear':>12s} {'next_passage lin, sqrt':>24s}")
    for name, linear in rows.items():
        if "linear" not in name:
            continue
        root_row = rows[name.replace("linear", "sqrt")]
        run = "stable run (train)" if name.startswith("train/") else name.replace("linear,", "")
        print(f"{run:34s} {linear['bits_per_byte']:8.4f} {root_row['bits_per_byte']:8.4f} "
              f"{root_row['bits_per_byte'] / linear['bits_per_byte']:12.4f} "
              f"{linear['next_passage_acc']:12.3f}, {root_row['next_passage_acc']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
