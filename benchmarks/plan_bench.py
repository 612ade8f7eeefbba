"""`kiln plan` start-up CPU against `import prefect`, measured in the same run.

Each round starts two fresh processes one after the other: `python -c "import prefect"` (the floor
any Prefect-based command pays) and `kiln plan CONFIG` on an empty store. Their CPU time (user +
system, from `os.wait4`, so the child's own and nothing else's) is compared round by round; the
rounds alternate so that a load change on a shared machine hits both alike. Prints each round, the
medians and their ratio (the issue's goal: at most 2), with the load average before and after,
since a loaded machine inflates both.

    uv run python benchmarks/plan_bench.py --rounds 3 [--config configs/tiny_cpu.yaml]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cpu_seconds(args: list[str], env: dict) -> float:
    """User + system CPU of one child process run to its end (it must succeed)."""
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}:\n{err[-2000:]}")
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--config", default="configs/tiny_cpu.yaml")
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    prefect_s, plan_s = [], []
    with tempfile.TemporaryDirectory() as store:
        env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "KILN_STORE": store}
        for i in range(args.rounds):
            prefect_s.append(cpu_seconds([sys.executable, "-c", "import prefect"], env))
            plan_s.append(cpu_seconds([sys.executable, "-m", "flows.cli", "plan", args.config], env))
            print(f"round {i + 1}: import prefect {prefect_s[-1]:.2f} s CPU, kiln plan {plan_s[-1]:.2f} s CPU")
    base, plan = statistics.median(prefect_s), statistics.median(plan_s)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"median CPU: import prefect {base:.2f} s, kiln plan {plan:.2f} s; ratio {plan / base:.2f} (goal <= 2)")


if __name__ == "__main__":
    main()
