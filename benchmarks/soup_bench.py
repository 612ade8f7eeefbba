"""A model soup against its parts, through kiln as a user runs it: configs/soup_cpu.yaml (a stable
run whose own decay is one anneal, two more anneals on other data orders, `soup` their mean and
`lawa` the mean of three stable-phase steps) on a clean store, then `kiln compare`.

Prints each row's bits per byte and next_passage accuracy, and the ratios: the soup's bits per
byte over its best part's and over its parts' mean, and lawa's over the decayed run's. With
`--seeds`, the whole config again per stable-run seed (`--set train.seed=S`; the anneals keep
their own data orders), each on its own store, so one seed's luck is not read as the soup's.
With `--greedy`, two more soups of all six models (lawa's three steps, the decayed run and the
two anneals): `all` the uniform mean, `greedy` phases.<name>.greedy's choice, and the ratio of
the two and of greedy to the soup of the anneals. Every row is then scored on 8192 held-out
tokens (eval.heldout_tokens; the greedy soup chooses on the 8192 after them: the config's
validation split holds about 22,500):

    uv run python benchmarks/soup_bench.py                  # the config as shipped (seed 0)
    uv run python benchmarks/soup_bench.py --seeds 0 1 4    # three stable runs
    uv run python benchmarks/soup_bench.py --greedy
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from kiln_runs import REPO, kiln, scratch  # noqa: E402
from train_bench import machine  # noqa: E402

CONFIG = REPO / "configs" / "soup_cpu.yaml"
PARTS = ("train", "anneal_2", "anneal_3")  # the soup's, as the config names them
EVERY_MODEL = "[train@160, train@180, train@200, train, anneal_2, anneal_3]"
GREEDY_SETS = ["--set", "eval.heldout_tokens=8192", "--set", f"phases.all={{average: {EVERY_MODEL}}}",
               "--set", f"phases.greedy={{average: {EVERY_MODEL}, greedy: true}}"]


def run(seed: int, store: Path, greedy: bool = False) -> dict[str, dict]:
    sets = ["--set", f"train.seed={seed}", *(GREEDY_SETS if greedy else [])]
    started = time.perf_counter()
    kiln("run", str(CONFIG), "--store", str(store), *sets)
    wall = time.perf_counter() - started
    compare = kiln("compare", str(CONFIG), "--store", str(store), "--json", *sets).stdout
    rows = {r["variant"]: r for r in json.loads(compare)}
    print(f"\nseed {seed}: kiln run {wall:.0f} s on a clean store")
    print(f"  {'row':<10} {'bits/byte':>10} {'next_passage':>13}")
    for name, r in rows.items():
        print(f"  {name:<10} {r['bits_per_byte']:>10.4f} {r['next_passage_acc']:>13.4f}")
    parts = [rows[p]["bits_per_byte"] for p in PARTS]
    soup, lawa = rows["soup"]["bits_per_byte"], rows["lawa"]["bits_per_byte"]
    print(f"  soup / best part {soup / min(parts):.4f}, soup / parts' mean {soup / (sum(parts) / len(parts)):.4f}, "
          f"lawa / train {lawa / rows['train']['bits_per_byte']:.4f}")
    if greedy:
        chosen = rows["greedy"]["bits_per_byte"]
        print(f"  greedy kept {rows['greedy']['soup_parts']} of 6: "
              f"greedy / all {chosen / rows['all']['bits_per_byte']:.4f}, greedy / soup {chosen / soup:.4f}")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="the stable run's train.seed, one run each")
    p.add_argument("--greedy", action="store_true", help="also a uniform and a greedy soup of all six models")
    p.add_argument("--keep", action="store_true", help="keep the stores (their folder is printed)")
    args = p.parse_args()
    print(f"machine: {machine()}")
    with scratch("kiln-soup-bench-", args.keep) as root:
        ratios = []
        for seed in args.seeds:
            rows = run(seed, root / f"seed{seed}", args.greedy)
            ratios.append(rows["soup"]["bits_per_byte"] / min(rows[p]["bits_per_byte"] for p in PARTS))
        if len(ratios) > 1:
            print(f"\nsoup / best part over {len(ratios)} seeds: {', '.join(f'{r:.4f}' for r in ratios)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
