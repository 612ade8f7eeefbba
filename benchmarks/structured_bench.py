"""What a structured output costs `kiln serve-model`: the same free answers decoded beside one
more free answer and beside one answer held to a format, in one process.

A random model at benchmarks/serve_load_bench.py's `large` shape with GPT-2's tokenizer (50257
ids: llguidance reads its tokenizer.json); `--free` prompts of `--prompt` tokens, each answered
with `--answer` tokens drawn at temperature 1, go to `evaluation.server.Scheduler` (the server's
engine) at once, twice: beside one more prompt answered freely, and beside the same prompt
whose answer is held to a regex of lower-case words (it stays live as long as they do). While a formatted answer decodes, the slots
decode one token per chunk (each token's mask depends on the one before), so the free answers'
pace falls to that of one-token chunks; this measures by how much, and what the formatted answer
itself takes per token, with the mask computed on the host each step.

Prints seconds each way, their ratio (formatted / free), whether the free answers are the same
tokens both ways, and the host's mask time per token.

    uv run python benchmarks/structured_bench.py [--free 4 --prompt 64 --answer 64]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FORMAT = "[a-z]+( [a-z]+)*"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--free", type=int, default=4, help="free answers decoding together")
    p.add_argument("--prompt", type=int, default=64, help="tokens per prompt")
    p.add_argument("--answer", type=int, default=64, help="tokens drawn per answer")
    p.add_argument("--context", type=int, default=512)
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    import jax
    import numpy as np

    from benchmarks.serve_load_bench import SHAPES
    from evaluation.generate import Model, Request
    from evaluation.server import Job, Scheduler
    from evaluation.structured import compile_grammar, vocabulary
    from tasks.tokenizer import build_gpt2
    from training.config import ModelConfig
    from training.model import init_params

    tokenizer = build_gpt2(("<|endoftext|>",))
    cfg = ModelConfig(**SHAPES["large"], vocab_size=50257, seq_len=args.context, tie_embeddings=True, init_std=0.1)
    model = Model(cfg, jax.jit(init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0)), tokenizer, eos_id=50256)
    import llguidance

    grammar = compile_grammar(llguidance.LLMatcher.grammar_from_regex(FORMAT),
                              vocabulary(tokenizer.to_str(), cfg.vocab_size, (50256,)))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 50000, args.prompt).tolist() for _ in range(args.free + 1)]
    free = [Job(Request(p, args.answer, 1.0, seed=i, stop_ids=())) for i, p in enumerate(prompts[:-1])]
    held = Job(Request(prompts[-1], args.answer, 1.0, seed=99, stop_ids=(50256,)), grammar=grammar)
    other = Job(Request(prompts[-1], args.answer, 1.0, seed=99, stop_ids=()))  # the same row, free

    scheduler = Scheduler(model, max_batch=8, window_s=0.5)  # the jobs of a round are admitted together

    def run(jobs):
        start = time.perf_counter()
        results = [f.result(3600) for f in [scheduler.submit(job) for job in jobs]]
        return time.perf_counter() - start, results

    try:
        run(free + [held])  # compile every program
        run(free + [other])
        alone, beside = [], []
        for _ in range(3):
            alone.append(run(free + [other]))
            beside.append(run(free + [held]))
    finally:
        scheduler.close()
    alone_s = statistics.median(s for s, _ in alone)
    beside_s = statistics.median(s for s, _ in beside)
    same = all(a.sampled.ids == b.sampled.ids for (_, x), (_, y) in zip(alone, beside) for a, b in zip(x[:-1], y))
    text = tokenizer.decode(beside[0][1][-1].sampled.ids)
    guide = grammar.guide()
    masks = []
    for token in beside[0][1][-1].sampled.ids:
        start = time.perf_counter()
        guide.mask()
        masks.append(time.perf_counter() - start)
        guide.advance(token)
    print(f"{jax.devices()[0].device_kind}; the `large` shape, GPT-2's vocabulary; {args.free} free answers of "
          f"{args.answer} tokens (prompts of {args.prompt}), at temperature 1")
    print(f"beside a free answer {alone_s:.3f} s, beside a formatted one {beside_s:.3f} s (median of 3): formatted / "
          f"free {beside_s / alone_s:.3f}")
    print(f"the free answers the same tokens both ways: {same}; the formatted answer follows {FORMAT!r}: "
          f"{bool(re.fullmatch(FORMAT, text))} ({len(beside[0][1][-1].sampled.ids)} tokens: {text[:40]!r}...)")
    print(f"the host's mask per token: {statistics.median(masks) * 1e3:.2f} ms median, {max(masks) * 1e3:.2f} ms max")


if __name__ == "__main__":
    main()
