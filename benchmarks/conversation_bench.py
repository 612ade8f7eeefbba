"""What keeping answers' blocks in `kiln serve-model`'s prefix cache saves a conversation: each
turn sends the whole conversation back (the earlier answers inside it), as chat clients do.

A random model at benchmarks/serve_load_bench.py's `large` shape (d_model 512, 8 layers) with a
context of `--context` tokens; a conversation of `--turns` turns, each a `--message`-token
message answered with `--answer` greedy tokens, the next prompt being the last prompt, its
answer and a new message; each turn's time to its first token is measured (the prefill of what
the cache does not hold: the rest is decoding, the same every way). Three ways in one process, one after the other, each after the same
conversation over other tokens (so that every program is compiled): answers' blocks kept
(the server now), prompts' blocks only (`Scheduler.keeps_answers` off: the server before), and
no prefix cache. Prints each turn's seconds to its first token and prompt tokens from the cache
each way, the totals, their ratios, and whether the answers are the same tokens.

    uv run python benchmarks/conversation_bench.py [--turns 6 --message 50 --answer 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def converse(model, messages: list[list[int]], answer: int, prefix_tokens: int | None, keep: bool) -> dict:
    from evaluation.generate import Request
    from evaluation.server import Job, Scheduler

    held = []
    scheduler = Scheduler(model, max_batch=8, prefix_tokens=prefix_tokens, on_prefix=lambda n, c: held.append(c))
    scheduler.keeps_answers &= keep
    seconds, answers, prompt = [], [], []
    try:
        for message in messages:
            prompt = prompt + message
            first = []
            start = time.perf_counter()
            row = Request(prompt, answer, 0.0, stop_ids=(), stream=lambda i, *_: i or first.append(time.perf_counter()))
            ids = scheduler.submit(Job(row)).result(3600).sampled.ids
            seconds.append(first[0] - start)
            answers.append(ids)
            prompt = prompt + ids
    finally:
        scheduler.close()
    return {"seconds": seconds, "held": held or ["-"] * len(messages), "answers": answers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--message", type=int, default=50, help="tokens of each new message")
    p.add_argument("--answer", type=int, default=200, help="tokens drawn per answer")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    import jax
    import numpy as np

    from benchmarks.serve_load_bench import large_model

    model = large_model(args.context)
    rng = np.random.default_rng(0)
    warm, messages = ([rng.integers(3, 50000, args.message).tolist() for _ in range(args.turns)] for _ in range(2))
    ways = {"answers kept": (None, True), "prompts only": (None, False), "no cache": (0, False)}
    got = {}
    for name, (tokens, keep) in ways.items():
        converse(model, warm, args.answer, tokens, keep)
        got[name] = converse(model, messages, args.answer, tokens, keep)
    print(f"{jax.devices()[0].device_kind}; the `large` shape, context {args.context}; {args.turns} turns of "
          f"{args.message}-token messages and {args.answer}-token greedy answers")
    for name, m in got.items():
        turns = ", ".join(f"{s:.2f} s ({c})" for s, c in zip(m["seconds"], m["held"]))
        print(f"{name:>12}: {sum(m['seconds']):6.2f} s to first tokens in all; each turn's (prompt tokens from the "
              f"cache): {turns}")
    kept, before, none = (sum(got[name]["seconds"]) for name in ways)
    last = [got[name]["seconds"][-1] for name in ways]
    print(f"answers kept / prompts only: {kept / before:.3f} in all, {last[0] / last[1]:.3f} the last turn; "
          f"prompts only / no cache: {before / none:.3f} in all, {last[1] / last[2]:.3f} the last turn")
    same = all(got[name]["answers"] == got["no cache"]["answers"] for name in ways)
    print(f"the same greedy tokens every way: {same}")


if __name__ == "__main__":
    main()
