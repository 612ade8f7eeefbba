"""How long `kiln serve-model` takes to answer `n` choices of one long prompt: this tree and a baseline commit.

RL rollouts and best-of-n sampling ask for several answers to one prompt (`n`). A model folder at
the `large` shape of benchmarks/serve_load_bench.py (d_model 512, 8 layers, GPT-2 vocabulary,
context 256; random weights) is written once; then, for the working tree and a git worktree at
`--baseline`, each in a process of its own with that tree's code, the model is served in process
(`evaluation.server.Service`, eight slots, through its HTTP app) and asked, `--repeats` times
after a first call that compiles:

- a completion of a `--prompt-tokens` token prompt with `n` 8 and `max_tokens` 1 (the time to
  every choice's first token: the prompt's prefill and one draw per choice);
- the same with `n` 1 (the floor: one prefill, one draw).

Best of the repeats, in seconds, and this tree's numbers against the baseline's.

    uv run python benchmarks/shared_prefill_bench.py --baseline <commit>
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def probe(model_dir: str, tokenizer_dir: str, prompt_tokens: int, repeats: int) -> dict:
    """In the tree this process imports from: seconds for n=8 and n=1 completions of one prompt."""
    import time

    from fastapi.testclient import TestClient

    from evaluation.generate import load
    from evaluation.server import Service, create_app

    model = load(Path(model_dir), Path(tokenizer_dir))
    prompt = [50256, *range(1000, 1000 + prompt_tokens - 1)]
    out = {}
    with TestClient(create_app(Service(model, "bench", max_batch=8))) as client:
        for n in (8, 1):
            ask = {"prompt": prompt, "n": n, "max_tokens": 1, "temperature": 1.0, "seed": 0}
            best = float("inf")
            for i in range(repeats + 1):  # the first compiles
                start = time.perf_counter()
                r = client.post("/v1/completions", json=ask)
                took = time.perf_counter() - start
                if r.status_code != 200 or len(r.json()["choices"]) != n:
                    raise SystemExit(f"the request failed: {r.status_code} {r.text[:500]}")
                best = best if i == 0 else min(best, took)
            out[f"n{n}_s"] = best
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="the commit to compare with (a git worktree of it is made)")
    p.add_argument("--prompt-tokens", type=int, default=240, help="the prompt's length (the context is 256)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    sys.path.insert(0, str(REPO))  # here only: the probe's process imports the tree it measures
    from benchmarks.decode_chunk_bench import write_model
    from benchmarks.serve_load_bench import SHAPES
    from benchmarks.trees import probe_in, worktree

    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = map(str, write_model(Path(tmp), SHAPES["large"], "float32"))
        with worktree(args.baseline, Path(tmp) / "baseline") as baseline:
            got = {name: probe_in(tree, __file__, "probe", model, tokenizer, args.prompt_tokens, args.repeats)
                   for name, tree in (("baseline", baseline), ("this tree", REPO))}
    for name, m in got.items():
        print(f"{name:>9}: a {args.prompt_tokens}-token prompt, first tokens of n=8 choices {m['n8_s'] * 1000:7.1f} ms, "
              f"of n=1 {m['n1_s'] * 1000:7.1f} ms")
    base, this = got["baseline"], got["this tree"]
    for key, label in (("n8_s", "n=8"), ("n1_s", "n=1")):
        print(f"{label}: this tree / baseline = {this[key] / base[key]:.3f}")


if __name__ == "__main__":
    main()
