"""What `kiln serve-model`'s prefix cache saves a burst of questions after one new context (lm-eval's
`local-completions` with a batch size: a task's few-shot examples before each of a batch of
questions, sent at once): with the cache and without it (`prefix_tokens=0`), in one process.

A random model at benchmarks/serve_load_bench.py's `large` shape (d_model 512, 8 layers) with a
context of `--context` tokens; `--questions` prompts of one `--shared`-token context and a
`--question`-token question of their own go to `evaluation.server.Scheduler` (the server's
engine) at once, each answered with `--answer` greedy tokens. Each scheduler first answers a
burst over another context (so that every program is compiled), then the measured one, whose
context it has not seen. Run from another tree (`--tree`) to measure that tree's code.

Prints the seconds to the last answer each way, their ratio (with / without), the prompt tokens
the cache held, and whether the answers are the same tokens.

    uv run python benchmarks/burst_prefix_bench.py [--questions 8 --shared 1024 --question 40] [--tree DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def burst(model, prefix_tokens: int | None, warm: list, prompts: list, answer: int) -> dict:
    from evaluation.generate import Request
    from evaluation.server import Job, Scheduler

    held = []
    scheduler = Scheduler(model, max_batch=8, window_s=0.5, prefix_tokens=prefix_tokens,
                          on_prefix=lambda n, c: held.append(c))

    def ask(group):
        jobs = [Job(Request(p, answer, 0.0, stop_ids=())) for p in group]
        return [f.result(3600).sampled.ids for f in [scheduler.submit(job) for job in jobs]]

    try:
        ask(warm)
        held.clear()
        start = time.perf_counter()
        answers = ask(prompts)
        seconds = time.perf_counter() - start
    finally:
        scheduler.close()
    return {"seconds": seconds, "held": sum(held), "answers": answers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--shared", type=int, default=1024, help="tokens every prompt starts with")
    p.add_argument("--question", type=int, default=40, help="tokens of each prompt's own")
    p.add_argument("--questions", type=int, default=8, help="prompts sent at once (eight slots)")
    p.add_argument("--answer", type=int, default=16, help="tokens drawn per answer")
    p.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent,
                   help="the kiln tree whose code runs (default: this one)")
    args = p.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    import jax
    import numpy as np
    from tokenizers import Tokenizer, models

    from evaluation.generate import Model
    from training.config import ModelConfig
    from training.model import init_params

    large = {"d_model": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "d_ff": 1408}  # serve_load_bench's
    cfg = ModelConfig(**large, vocab_size=50257, seq_len=args.context, tie_embeddings=True, init_std=0.1)
    model = Model(cfg, jax.jit(init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0)),
                  Tokenizer(models.WordLevel({"a": 0}, unk_token="a")), eos_id=0)
    rng = np.random.default_rng(0)

    def questions():
        shared = rng.integers(3, 50000, args.shared).tolist()
        return [shared + rng.integers(3, 50000, args.question).tolist() for _ in range(args.questions)]

    warm, prompts = questions(), questions()
    got = {name: burst(model, tokens, warm, prompts, args.answer) for name, tokens in (("without", 0), ("with", None))}
    print(f"{jax.devices()[0].device_kind}; {args.tree.resolve()}; the `large` shape, context {args.context}; "
          f"{args.questions} prompts of {args.shared} shared + {args.question} own tokens at once, {args.answer} "
          "greedy tokens each")
    for name, m in got.items():
        print(f"{name:>7} the prefix cache: {m['seconds']:6.2f} s to the last answer; prompt tokens from the cache "
              f"{m['held']}")
    print(f"with / without: {got['with']['seconds'] / got['without']['seconds']:.3f}; the same greedy tokens: "
          f"{got['with']['answers'] == got['without']['answers']}")


if __name__ == "__main__":
    main()
