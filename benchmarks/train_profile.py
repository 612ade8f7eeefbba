"""Where a training step's time goes: XLA's per-op times for kiln's jitted step beside
torch.profiler's for the PyTorch twin of benchmarks/train_bench.py, same model and batches.

The JAX side runs `--steps` steps under `jax.profiler.trace`, reads the Perfetto trace it writes
(one event per executed HLO op: XLA's CPU runtime marks each thunk) and sums the time per op,
labelled with the op's kind (a dot, a fusion and what its root computes, a copy or transpose)
and the model code it came from (the HLO `op_name` metadata). Times are wall time of each op as
the runtime saw it, so ops that ran at once on the two cores both count: shares are of the sum.

    uv run python benchmarks/train_profile.py            # top 15 of each, CPU_MODEL, batch 8
    uv run python benchmarks/train_profile.py --top 25 --steps 5 --fastest
    uv run python benchmarks/train_profile.py --attention-ab --rounds 4

--fastest counts each op at its fastest run over the steps (times its runs per step), which
other jobs' load inflates far less than the mean. --attention-ab times the whole step with
training's attention (query blocks, `causal_attention`) against the dense masked [T, T] form it
replaced (the decoding path's `cached_attention` over the sequence's own keys), compiled in the
same process and interleaved: wall and CPU seconds per step, first losses, transposed copies.

Imports only training/, jax, numpy and torch (for the twin): no Prefect, no Ray.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from train_bench import CPU_MODEL, make_batches, torch_twin, train_config  # noqa: E402

from training import model as kiln_model  # noqa: E402
from training.optim import make_optimizer  # noqa: E402
from training.step import init_state, make_train_step  # noqa: E402


def hlo_index(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> 'kind shape  source' for every instruction of the compiled module:
    kind is the opcode (for a fusion: its kind, the opcode of its root, and `+transpose` when it
    writes a transposed copy), source the tail of its op_name (the JAX code that produced it)."""
    bodies: dict[str, list[str]] = {}  # computation name -> its lines
    current = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            current = bodies.setdefault(head.group(1), [])
        elif current is not None:
            current.append(line)
    index = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+(?: \S+)*?) ([\w\-]+)\(", line)
        if not m:
            continue
        name, shape, kind = m.groups()
        if kind == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", line)
            body = bodies.get(called.group(1), []) if called else []
            root = next((re.search(r"= \S+ ([\w\-]+)\(", b) for b in body if "ROOT" in b), None)
            fkind = re.search(r"kind=k(\w+)", line)
            transposes = "+transpose" if fkind and fkind.group(1) == "Loop" and any(" transpose(" in b for b in body) else ""
            kind = f"fusion[{fkind.group(1) if fkind else '?'}:{root.group(1) if root else '?'}{transposes}]"
        op_name = re.search(r'op_name="([^"]*)"', line)
        index[name] = f"{kind} {shape.split('{')[0][:40]}  {_short(op_name.group(1)) if op_name else ''}"
    return index


def category(label: str) -> str:
    """What an op is, for the summary: a matmul (by library), a transposing copy, other work."""
    kind = label.split(" ")[0]
    if kind.startswith("fusion[Custom:dot"):
        return "matmul (YNNPACK fusion)"
    if kind == "dot":
        return "matmul (XLA dot, Eigen)"
    if "+transpose" in kind:
        return "loop fusion writing a transposed copy"
    if kind.startswith("fusion[Custom"):
        return "other YNNPACK fusion (reductions)"
    if kind.startswith("fusion[Loop"):
        return "elementwise loop fusion"
    return "other (" + kind.split("[")[0] + ")"


def _short(op_name: str) -> str:
    """'jit(train_step)/transpose(jvp(Llama))/layers_0/mlp/up_proj/dot_general' -> 'bwd mlp/up_proj/dot_general'"""
    direction = "bwd " if "transpose(" in op_name else ""
    parts = [p for p in op_name.split("/") if not p.startswith(("jit(", "jvp(", "transpose(")) and not re.match(r"layers_\d+$", p)]
    return direction + "/".join(parts[-3:])


def jax_profile(steps: int, batches: np.ndarray, fastest: bool = False) -> list[tuple[str, float]]:
    model, cfg = CPU_MODEL, train_config(steps + 10, batches.shape[1])
    opt = make_optimizer(cfg)
    state = init_state(model, opt, jax.random.PRNGKey(cfg.seed))
    compiled = jax.jit(make_train_step(model, cfg, opt), donate_argnums=0).lower(state, batches[0]).compile()
    index = hlo_index(compiled.as_text())
    for i in range(2):  # warm
        state, metrics = compiled(state, batches[i])
    jax.block_until_ready(metrics)
    with tempfile.TemporaryDirectory() as tmp:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # XLA's ops only: Python tracing slowed the step 3x
        with jax.profiler.trace(tmp, create_perfetto_trace=True, profiler_options=options):
            for i in range(steps):
                state, metrics = compiled(state, batches[i % len(batches)])
            jax.block_until_ready(metrics)
        trace = next(Path(tmp).rglob("*.trace.json.gz"))
        events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    runs: dict[str, list[float]] = collections.defaultdict(list)  # HLO op -> its times, ms
    for e in events:
        if e.get("ph") == "X" and e.get("name") in index:
            runs[e["name"]].append(e["dur"] / 1e3)
    totals: dict[str, float] = collections.Counter()
    for name, ms in runs.items():  # ms per step, summed over layers
        totals[index[name]] += (min(ms) * len(ms) if fastest else sum(ms)) / steps
    return sorted(totals.items(), key=lambda kv: -kv[1])


def dense_attention(q, k, v, segments=None, window=None, score_width=None, cap=None):
    """The attention training ran before query blocks: one masked [T, T] softmax per head, which
    is the decoding path's form over the sequence's own keys at positions 0..T-1. Called as
    `causal_attention` is (the model here has no documents, windows, score scale or caps)."""
    if segments is not None:
        raise ValueError("dense_attention keeps no documents apart: profile without train.document_mask")
    B, T = q.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return kiln_model.cached_attention(q, k, v, positions, positions, window, score_width, cap)


def transposed_copies(compiled) -> tuple[int, float]:
    """(count, MB written) of the loop fusions that write a transposed copy, in one step."""
    labels = [label for label in hlo_index(compiled.as_text()).values() if "+transpose" in label.split(" ")[0]]
    sizes = [re.search(r"\[([\d,]*)\]", label.split(" ")[1]) for label in labels]
    return len(labels), sum(4 * np.prod([int(d) for d in m.group(1).split(",") if d]) for m in sizes if m) / 1e6


def attention_ab(rounds: int, steps: int, batches: np.ndarray) -> None:
    """The whole jitted step with each attention, same process, same batches, rounds interleaved."""
    model, cfg = CPU_MODEL, train_config(10**6, batches.shape[1])
    opt = make_optimizer(cfg)
    blocked = kiln_model.causal_attention
    runs = {}
    for name, attention in (("dense [T, T]", dense_attention), ("query blocks", blocked)):
        kiln_model.causal_attention = attention  # read when the step is traced, here
        try:
            state = init_state(model, opt, jax.random.PRNGKey(cfg.seed))
            compiled = jax.jit(make_train_step(model, cfg, opt), donate_argnums=0).lower(state, batches[0]).compile()
        finally:
            kiln_model.causal_attention = blocked
        losses = []
        for i in range(3):
            state, metrics = compiled(state, batches[i])
            losses.append(float(metrics["loss"]))
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        count, mb = transposed_copies(compiled)
        print(f"{name}: first losses {', '.join(f'{x:.7f}' for x in losses)}; {count} transposed copies "
              f"({mb:.0f} MB), bytes accessed {cost['bytes accessed'] / 1e9:.2f} GB, {cost['flops'] / 1e9:.1f} GFLOP per step")
        runs[name] = {"compiled": compiled, "state": state, "losses": losses, "wall": [], "cpu": []}
    a, b = runs.values()
    print(f"max |loss difference| over 3 steps: {max(abs(x - y) for x, y in zip(a['losses'], b['losses'])):.2e}")
    for r in range(rounds):
        for name, run in runs.items():
            jax.block_until_ready(run["state"])
            wall, cpu = time.perf_counter(), time.process_time()
            for i in range(steps):
                run["state"], metrics = run["compiled"](run["state"], batches[i % len(batches)])
            jax.block_until_ready(metrics)
            run["wall"].append((time.perf_counter() - wall) / steps)
            run["cpu"].append((time.process_time() - cpu) / steps)
            print(f"  round {r + 1} {name}: {run['wall'][-1]:.3f} s/step wall, {run['cpu'][-1]:.3f} s/step CPU", flush=True)
    for name, run in runs.items():
        print(f"{name}: best {min(run['wall']):.3f} s/step wall, {min(run['cpu']):.3f} s/step CPU")
    print(f"query blocks / dense, best round: wall {min(b['wall']) / min(a['wall']):.3f}, CPU {min(b['cpu']) / min(a['cpu']):.3f}")


def torch_profile(steps: int, batches: np.ndarray) -> list[tuple[str, float]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    model, cfg = CPU_MODEL, train_config(steps + 10, batches.shape[1])
    step = torch_twin(model, cfg, compile_model=False)
    tb = [torch.from_numpy(b.astype(np.int64)) for b in batches]
    step(0, tb[0])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            step(i + 1, tb[(i + 1) % len(tb)])
    rows = [(e.key, e.self_cpu_time_total / 1e3 / steps) for e in prof.key_averages()]
    return sorted(rows, key=lambda kv: -kv[1])


def table(title: str, rows: list[tuple[str, float]], top: int, categories: bool = False) -> None:
    total = sum(ms for _, ms in rows)
    print(f"\n{title}: {total:.0f} ms of op time per step")
    if categories:
        by = collections.Counter()
        for name, ms in rows:
            by[category(name)] += ms
        print("| what | ms / step | share |\n| --- | ---: | ---: |")
        for name, ms in by.most_common():
            print(f"| {name} | {ms:.1f} | {ms / total:.1%} |")
        print()
    print(f"| # | op | ms / step | share |\n| ---: | --- | ---: | ---: |")
    for i, (name, ms) in enumerate(rows[:top], 1):
        print(f"| {i} | `{name}` | {ms:.1f} | {ms / total:.1%} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--fastest", action="store_true", help="each op at its fastest run (robust to load)")
    p.add_argument("--attention-ab", action="store_true", help="time the step with dense vs blocked attention")
    p.add_argument("--rounds", type=int, default=4, help="--attention-ab rounds of --steps steps each")
    args = p.parse_args()
    batches = make_batches(CPU_MODEL, train_config(10, args.batch_size), 4)
    if args.attention_ab:
        return attention_ab(args.rounds, args.steps, batches)
    table("kiln jitted step (XLA ops)", jax_profile(args.steps, batches, args.fastest), args.top, categories=True)
    if not args.no_torch:
        table("PyTorch eager twin (torch.profiler, self CPU time)", torch_profile(args.steps, batches), args.top)


if __name__ == "__main__":
    main()
