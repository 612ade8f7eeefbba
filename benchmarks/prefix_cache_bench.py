"""What `kiln serve-model`'s prefix cache saves on a few-shot workload: the same requests with the
cache (its default size) and without it (`--prefix-cache-tokens 0`, the server as it was before
the cache), in one process, one after the other.

A random model at benchmarks/serve_load_bench.py's `large` shape (d_model 512, 8 layers) with a
context of `--context` tokens; `--questions` prompts that share a `--shared`-token context (an
lm-eval task's few-shot examples) and end in a question of `--question` tokens of their own, each
answered with `--answer` greedy tokens. The requests go to `evaluation.server.Scheduler` (the
server's engine) one at a time (lm-eval's `local-completions` at batch size 1: seconds to each
answer, median), then as many other questions after the same context all at once (eight slots:
seconds to the last answer). Both schedulers first answer the same kind of workload over
another shared context, so that every program is compiled and the measured context is not
cached yet: the first measured request prefills it whole.

Prints the seconds each way and their ratio (with / without), the prompt tokens the cache
held, and whether the answers are the same tokens (with their largest log-probability gap).

    uv run python benchmarks/prefix_cache_bench.py [--shared 1024 --question 40 --answer 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def workload(rng, args) -> tuple[list[list[int]], list[list[int]]]:
    """Two sets of prompts that start with the same shared context, each question its own."""
    shared = rng.integers(3, 50000, args.shared).tolist()
    return tuple([shared + rng.integers(3, 50000, args.question).tolist() for _ in range(args.questions)]
                 for _ in range(2))


def measure(model, prefix_tokens: int | None, warm: tuple, prompts: tuple, answer: int) -> dict:
    from evaluation.generate import Request
    from evaluation.server import Job, Scheduler

    held = []
    scheduler = Scheduler(model, max_batch=8, prefix_tokens=prefix_tokens, on_prefix=lambda n, c: held.append(c))

    def ask(group):
        jobs = [Job(Request(p, answer, 0.0, stop_ids=()), top_logprobs=0) for p in group]
        return [f.result(3600) for f in [scheduler.submit(job) for job in jobs]]

    try:
        for p in warm[0]:  # compile every program, alone and at once
            ask([p])
        ask(warm[1])
        held.clear()
        alone, answers = [], []
        for p in prompts[0]:
            start = time.perf_counter()
            answers += ask([p])
            alone.append(time.perf_counter() - start)
        start = time.perf_counter()
        together = ask(prompts[1])
        burst = time.perf_counter() - start
    finally:
        scheduler.close()
    return {"alone_s": statistics.median(alone), "first_s": alone[0], "burst_s": burst, "held": sum(held),
            "answers": answers + together}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--shared", type=int, default=1024, help="tokens every prompt starts with")
    p.add_argument("--question", type=int, default=40, help="tokens of each prompt's own")
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--answer", type=int, default=16, help="tokens drawn per answer")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    import jax
    import numpy as np

    from benchmarks.serve_load_bench import large_model

    model = large_model(args.context)
    rng = np.random.default_rng(0)
    warm, prompts = workload(rng, args), workload(rng, args)
    got = {name: measure(model, tokens, warm, prompts, args.answer)
           for name, tokens in (("without", 0), ("with", None))}
    print(f"{jax.devices()[0].device_kind}; the `large` shape, context {args.context}; {args.questions} prompts of "
          f"{args.shared} shared + {args.question} own tokens, {args.answer} greedy tokens each")
    for name, m in got.items():
        print(f"{name:>7} the prefix cache: one at a time {m['alone_s']:6.3f} s median "
              f"(the first {m['first_s']:.3f} s), all at once {m['burst_s']:6.2f} s; prompt tokens from the cache {m['held']}")
    base, this = got["without"], got["with"]
    print(f"with / without: one at a time {this['alone_s'] / base['alone_s']:.3f}, the first "
          f"{this['first_s'] / base['first_s']:.3f}, all at once {this['burst_s'] / base['burst_s']:.3f}")
    same = all(a.sampled.ids == b.sampled.ids for a, b in zip(base["answers"], this["answers"]))
    gap = max(float(np.max(np.abs(np.subtract(a.sampled.logprobs, b.sampled.logprobs))))
              for a, b in zip(base["answers"], this["answers"]))
    print(f"the same greedy tokens: {same}; the largest log-probability gap {gap:.2e}")


if __name__ == "__main__":
    main()
