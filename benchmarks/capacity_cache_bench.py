"""`kiln capacity` asked twice: what the compilation cache saves a plan asked again.

    uv run python benchmarks/capacity_cache_bench.py [configs/small_gpu.yaml ...] [--devices 8]

For each config, three `kiln capacity --json` processes one after another, timed from outside:
`off` (KILN_COMPILE_CACHE=off: every plan compiles, as before the cache), `cold` (an empty cache
folder: compiles and stores), `warm` (the same folder again: reads the step back). Prints the wall
seconds of each, warm / off, the programs each read back, and whether the three reports agree
(they must: the same executable, the same memory and cost analyses).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def plan_seconds(config: str, devices: int, cache: str) -> tuple[float, dict]:
    env = {**os.environ, "KILN_COMPILE_CACHE": cache}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "capacity", config, "--devices", str(devices), "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="*", default=["configs/small_gpu.yaml", "configs/medium_gpu.yaml"])
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {args.devices} simulated devices")
    print(f"{'config':<30} {'off s':>7} {'cold s':>7} {'warm s':>7} {'warm/off':>8} {'read':>5}  same report")
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            cache = str(Path(tmp) / Path(config).stem)
            runs = {way: plan_seconds(config, args.devices, "off" if way == "off" else cache)
                    for way in ("off", "cold", "warm")}
            reports = [{k: v for k, v in r.items() if k != "compiled_programs_read"} for _, r in runs.values()]
            print(f"{config:<30} {runs['off'][0]:>7.1f} {runs['cold'][0]:>7.1f} {runs['warm'][0]:>7.1f} "
                  f"{runs['warm'][0] / runs['off'][0]:>8.2f} {runs['warm'][1]['compiled_programs_read']:>5}  "
                  f"{all(r == reports[0] for r in reports)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
