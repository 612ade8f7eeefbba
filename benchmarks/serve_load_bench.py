"""Short requests' latency while long answers decode: `kiln serve-model` here and at a baseline commit.

The load a shared server meets: `--long-clients` clients each asking for long answers back to
back (`--long-tokens` new tokens, `ignore_eos`), while short requests (`--short-tokens`) arrive
every `--every-ms` milliseconds, each on a connection of its own. A server that runs requests
in whole batches makes a short request that comes while a long answer decodes wait for that
batch to end; one that batches continuously (evaluation/slots.py) starts it at the next chunk.

For the working tree and a git worktree at `--baseline`, in turn, `--rounds` times: start
`python -m flows.cli serve-model` (that tree's code) on a random-weights export (the tiny_cpu
shape, or `--shape large`; benchmarks/generate_bench.py's `random_model`, context 256), run the
load untimed for `--warmup` seconds (the compiles), then timed for `--seconds`, and stop the
server. Prints per run the short requests' median and 90th-percentile latency, the long
answers' median, and new tokens per second of all answers; then the medians' ratios against
the baseline. Greedy, so
both trees give the same texts (checked for the short prompts). With `--stream` the long
answers stream (server-sent events, as a chat front-end asks), and it also prints the median
and 90th percentile of the gaps between a stream's text events (a token each).

    uv run python benchmarks/serve_load_bench.py --baseline <commit> [--rounds 2] [--stream]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.generate_bench import TINY_CPU_SHAPE, kjv_prompts, random_model  # noqa: E402
from benchmarks.ray_stop_bench import free_port  # noqa: E402


# `large`: a decoding step of eight rows takes ~20-25 ms here (tiny_cpu's: ~3.5 ms), as steps on an
# accelerator of a model worth serving do: what a stream's pace is about
SHAPES = {"tiny_cpu": TINY_CPU_SHAPE, "large": {"d_model": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4,
                                                "d_ff": 1408}}


def large_model(context: int):
    """An in-memory random model at the `large` shape, GPT-2's vocabulary and a context of `context`
    tokens (evaluation.generate.Model; its tokenizer a stand-in: the benchmarks' prompts are ids)."""
    import jax
    from tokenizers import Tokenizer, models

    from evaluation.generate import Model
    from training.config import ModelConfig
    from training.model import init_params

    cfg = ModelConfig(**SHAPES["large"], vocab_size=50257, seq_len=context, tie_embeddings=True, init_std=0.1)
    return Model(cfg, jax.jit(init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0)),
                 Tokenizer(models.WordLevel({"a": 0}, unk_token="a")), eos_id=0)


def serve(tree: Path, model: Path, port: int, max_batch: int, log: Path) -> subprocess.Popen:
    """`kiln serve-model` from `tree`'s code (its output to `log`), once it answers /health."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve-model", str(model), "--port", str(port),
                                 "--max-batch", str(max_batch)], cwd=tree, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not answers(f"http://127.0.0.1:{port}/health"):
        if proc.poll() is not None:
            raise SystemExit(f"serve-model in {tree} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"serve-model in {tree} did not answer /health in 120 s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:  # not listening yet
        return False


def load(url: str, prompts: list[list[int]], args, seconds: float) -> dict:
    """The load for `seconds` (requests in flight at the end are waited for, and counted)."""
    end = time.monotonic() + seconds
    longs: list[float] = []
    shorts: list[tuple[float, str]] = []
    tokens = [0]
    gaps: list[float] = []  # seconds between a streamed answer's consecutive text events
    lock = threading.Lock()

    def ask(prompt: list[int], max_tokens: int) -> tuple[float, str]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        start = time.monotonic()
        with httpx.Client(timeout=600) as client:
            answer = client.post(f"{url}/v1/completions", json=body)
        answer.raise_for_status()
        answer = answer.json()
        with lock:
            tokens[0] += answer["usage"]["completion_tokens"]
        return time.monotonic() - start, answer["choices"][0]["text"]

    def ask_streamed(prompt: list[int], max_tokens: int) -> float:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        start, seen, used = time.monotonic(), [], 0
        with httpx.Client(timeout=600) as client, client.stream("POST", f"{url}/v1/completions", json=body) as answer:
            answer.raise_for_status()
            for line in answer.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: "):])
                if event.get("usage"):
                    used = event["usage"]["completion_tokens"]
                if any(choice["text"] for choice in event.get("choices", [])):
                    seen.append(time.monotonic())
        with lock:
            tokens[0] += used
            gaps.extend(np.diff(seen).tolist())
        return time.monotonic() - start

    def long_client(k: int) -> None:
        while time.monotonic() < end:
            prompt = prompts[k % len(prompts)]
            longs.append(ask_streamed(prompt, args.long_tokens) if args.stream else ask(prompt, args.long_tokens)[0])

    started = time.monotonic()
    clients = [threading.Thread(target=long_client, args=(k,)) for k in range(args.long_clients)]
    for c in clients:
        c.start()
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        futures, n = [], 0
        while time.monotonic() < end:
            prompt = prompts[(n + args.long_clients) % len(prompts)]
            futures.append(pool.submit(ask, prompt, args.short_tokens))
            n += 1
            time.sleep(min(args.every_ms / 1000, max(0.0, end - time.monotonic())))
        shorts = [f.result() for f in futures]
    for c in clients:
        c.join()
    elapsed = time.monotonic() - started
    latencies = sorted(s for s, _ in shorts)
    return {"short_median_s": statistics.median(latencies), "short_p90_s": latencies[int(0.9 * (len(latencies) - 1))],
            "long_median_s": statistics.median(longs) if longs else float("nan"), "shorts": len(shorts),
            "longs": len(longs), "tokens_per_s": tokens[0] / elapsed,
            "gap_median_s": statistics.median(gaps) if gaps else float("nan"),
            "gap_p90_s": float(np.percentile(gaps, 90)) if gaps else float("nan"),
            "texts": {tuple(prompts[(i + args.long_clients) % len(prompts)]): t for i, (_, t) in enumerate(shorts)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="the commit to compare with (a git worktree of it is made)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--long-clients", type=int, default=2)
    p.add_argument("--long-tokens", type=int, default=200)
    p.add_argument("--short-tokens", type=int, default=8)
    p.add_argument("--every-ms", type=float, default=150)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--warmup", type=float, default=20)
    p.add_argument("--stream", action="store_true", help="the long answers stream (server-sent events)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny_cpu", help="the random model's shape")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        random_model(model, SHAPES[args.shape])
        from tokenizers import Tokenizer

        prompts = kjv_prompts(Tokenizer.from_file(str(model / "tokenizer.json")), 16, 16)
        baseline = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(baseline), args.baseline], cwd=REPO, check=True,
                       capture_output=True)
        try:
            runs: dict[str, list[dict]] = {"baseline": [], "this tree": []}
            for _ in range(args.rounds):
                for name, tree in (("baseline", baseline), ("this tree", REPO)):
                    port = free_port()
                    proc = serve(tree, model, port, args.max_batch, Path(tmp) / f"{name.replace(' ', '_')}.log")
                    try:
                        url = f"http://127.0.0.1:{port}"
                        load(url, prompts, args, args.warmup)
                        got = load(url, prompts, args, args.seconds)
                    finally:
                        proc.send_signal(signal.SIGTERM)
                        proc.wait(60)
                    runs[name].append(got)
                    print(f"{name:>9}: short requests median {got['short_median_s'] * 1000:7.0f} ms, p90 "
                          f"{got['short_p90_s'] * 1000:7.0f} ms ({got['shorts']}); long answers median "
                          f"{got['long_median_s']:5.2f} s ({got['longs']}); {got['tokens_per_s']:6.0f} tokens/s"
                          + (f"; gaps between a stream's events: median {got['gap_median_s'] * 1000:.1f} ms, "
                             f"p90 {got['gap_p90_s'] * 1000:.1f} ms"
                             if args.stream else ""), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=REPO, check=False)
    texts = {}
    for got in runs["baseline"] + runs["this tree"]:
        for prompt, text in got["texts"].items():
            if texts.setdefault(prompt, text) != text:
                raise SystemExit(f"the two trees answered the prompt {list(prompt)} differently: "
                                 f"{texts[prompt]!r} and {text!r}")
    print(f"the short prompts' greedy answers are the same on both trees ({len(texts)} prompts)")
    for key, label in (("short_median_s", "short requests' median latency"), ("short_p90_s", "short p90 latency"),
                       ("long_median_s", "long answers' median latency"), ("tokens_per_s", "tokens per second"),
                       *((("gap_median_s", "median gap between a stream's events"),
                          ("gap_p90_s", "p90 gap between a stream's events")) if args.stream else ())):
        base = statistics.median(r[key] for r in runs["baseline"])
        this = statistics.median(r[key] for r in runs["this tree"])
        print(f"{label}: this tree / baseline = {this / base:.3f} ({this:.3g} against {base:.3g})")


if __name__ == "__main__":
    main()
