"""Training throughput, side by side, measured in one run:

  kiln   training.loop.train: sharded state, donated buffers, metrics every 10 steps
  bare   the same model, loss and optimizer in a minimal jitted JAX loop (no logging, no sharding)
  torch  the same architecture in PyTorch (eager; --torch-compile adds torch.compile), starting
         from the same weights on the same batches; its first losses are checked against JAX's

and MFU: model FLOPs per token (training/config.py's `flops_per_token`) times tokens/s, over the
float32 matmul peak measured here (CPU) or the device's data-sheet peak (--device gpu, bfloat16
compute, configs/small_gpu.yaml and configs/medium_gpu.yaml). Each contender runs `--rounds` times, interleaved
so that a change in machine load hits all of them; the best round counts.

    uv run python benchmarks/train_bench.py                 # CPU, ~10M parameters
    uv run python benchmarks/train_bench.py --device gpu    # configs/small_gpu.yaml and medium_gpu.yaml, bf16
    uv run python benchmarks/train_bench.py --pipelines     # the tiny pipeline's and the sweep's trainings

Imports only training/, jax, flax, optax, numpy (and torch for the twin): no Prefect, no Ray.
torch is not one of kiln's dependencies: README, "The PyTorch checks", says how to add it.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from training.config import ModelConfig, TrainConfig, flops_per_token, model_and_train
from training.loop import compiled_program, train
from training.metrics import DECLARED_PEAK, measured_matmul_peak
from training.model import init_params, param_count
from training.sharding import make_mesh
from training.optim import lr_schedule, make_optimizer
from training.step import init_state, make_train_step

# ~10M parameters with a small (8k) vocabulary, as a tokenizer trained on the corpus would give.
CPU_MODEL = ModelConfig(vocab_size=8192, d_model=384, n_layers=5, n_heads=6, n_kv_heads=2, d_ff=1024, seq_len=256)


def train_config(steps: int, batch_size: int, microbatches: int = 1, batch_parts: int = 1) -> TrainConfig:
    return TrainConfig(batch_size=batch_size, microbatches=microbatches, batch_parts=batch_parts, steps=steps,
                       lr=1e-3, warmup=2, log_every=10, eval_every=10**9, checkpoint_every=10**9, peak_flops=1.0)


def make_batches(model: ModelConfig, cfg: TrainConfig, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, model.vocab_size, (n, cfg.batch_size, model.seq_len + 1), dtype=np.int32)


# --- contenders -------------------------------------------------------------------------------


def run_kiln(model: ModelConfig, cfg: TrainConfig, batches: np.ndarray) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        stats = train(model, cfg, lambda step: batches[step % len(batches)], [], Path(tmp) / "w", Path(tmp) / "o")
    return stats["tokens_per_s"]


_BARE: dict = {}


def bare_step(model: ModelConfig, cfg: TrainConfig, batches: np.ndarray):
    """(init, step): the jitted state initialisation and the compiled step (state donated), each
    compiled once per model and config in this process. With `train.split_parts`, the loop's own
    programs (one per part and one that applies them: training/loop.py `_split_step`)."""
    key = (model, cfg)
    if key not in _BARE and cfg.split_parts:
        program = compiled_program(model, cfg, make_mesh(cfg.mesh))
        _BARE[key] = (program.init, program.train_step)
    if key not in _BARE:
        opt = make_optimizer(cfg)
        step = jax.jit(make_train_step(model, cfg, opt), donate_argnums=0)
        init = jax.jit(lambda k: init_state(model, opt, k))
        state = init(jax.random.PRNGKey(cfg.seed))
        _BARE[key] = (init, step.lower(state, batches[0]).compile())
    return _BARE[key]


def run_bare(model: ModelConfig, cfg: TrainConfig, batches: np.ndarray) -> float:
    """The minimal loop: jit(step, donate state), N steps, one wait at the end."""
    init, step = bare_step(model, cfg, batches)
    state = init(jax.random.PRNGKey(cfg.seed))
    device_batches = [jax.device_put(b) for b in batches]
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for i in range(cfg.steps):
        state, metrics = step(state, device_batches[i % len(batches)])
    jax.block_until_ready(metrics["loss"])
    return cfg.steps * cfg.batch_size * model.seq_len / (time.perf_counter() - t0)


def torch_twin(model: ModelConfig, cfg: TrainConfig, compile_model: bool):
    """The same Llama in PyTorch (SDPA attention with GQA, HF RoPE), its weights copied from the
    JAX initialisation, AdamW with the same schedule, decay mask and clipping."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    D, H, K, Q = model.d_model, model.n_heads, model.n_kv_heads, model.head_dim

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(D))

        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.norm_eps))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm, self.post_attention_layernorm = RMSNorm(), RMSNorm()
            self.q_proj, self.o_proj = nn.Linear(D, H * Q, bias=False), nn.Linear(H * Q, D, bias=False)
            self.k_proj, self.v_proj = nn.Linear(D, K * Q, bias=False), nn.Linear(D, K * Q, bias=False)
            self.gate_proj, self.up_proj = nn.Linear(D, model.d_ff, bias=False), nn.Linear(D, model.d_ff, bias=False)
            self.down_proj = nn.Linear(model.d_ff, D, bias=False)

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            h = self.input_layernorm(x)
            q = self.q_proj(h).view(B, T, H, Q).transpose(1, 2)
            k = self.k_proj(h).view(B, T, K, Q).transpose(1, 2)
            v = self.v_proj(h).view(B, T, K, Q).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.o_proj(a.transpose(1, 2).reshape(B, T, H * Q))
            h = self.post_attention_layernorm(x)
            return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def rope(x, cos, sin):
        x1, x2 = x[..., : Q // 2], x[..., Q // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(model.vocab_size, D)
            self.layers = nn.ModuleList([Block() for _ in range(model.n_layers)])
            self.norm = RMSNorm()
            inv = 1.0 / model.rope_theta ** (torch.arange(0, Q, 2, dtype=torch.float32) / Q)
            ang = torch.arange(model.seq_len, dtype=torch.float32)[:, None] * inv[None]
            self.register_buffer("cos", torch.cat([ang, ang], -1).cos(), persistent=False)
            self.register_buffer("sin", torch.cat([ang, ang], -1).sin(), persistent=False)

        def forward(self, tokens):
            x = self.embed_tokens(tokens)
            T = tokens.shape[1]
            for layer in self.layers:
                x = layer(x, self.cos[:T], self.sin[:T])
            return self.norm(x) @ self.embed_tokens.weight.T  # tied

    net = Llama()
    params = jax.tree_util.tree_map(np.array, init_params(model, jax.random.split(jax.random.PRNGKey(cfg.seed))[0]))
    with torch.no_grad():
        net.embed_tokens.weight.copy_(torch.from_numpy(np.asarray(params["embed_tokens"]["embedding"])))
        net.norm.weight.copy_(torch.from_numpy(np.asarray(params["norm"]["weight"])))
        for i, layer in enumerate(net.layers):
            p = params[f"layers_{i}"]
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer, name).weight.copy_(torch.from_numpy(np.asarray(p["self_attn"][name]["kernel"]).T))
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer, name).weight.copy_(torch.from_numpy(np.asarray(p["mlp"][name]["kernel"]).T))
            for name in ("input_layernorm", "post_attention_layernorm"):
                getattr(layer, name).weight.copy_(torch.from_numpy(np.asarray(p[name]["weight"])))
    decay = [p for p in net.parameters() if p.ndim >= 2]
    no_decay = [p for p in net.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    schedule = lr_schedule(cfg)
    lrs = [float(schedule(s)) for s in range(cfg.steps)]
    forward = torch.compile(net) if compile_model else net

    def step(i: int, batch) -> float:
        for group in opt.param_groups:
            group["lr"] = lrs[i]
        logits = forward(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, model.vocab_size), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.grad_clip)
        opt.step()
        return loss.detach()

    return step


def run_torch(model: ModelConfig, cfg: TrainConfig, batches: np.ndarray, compile_model: bool = False) -> float:
    import torch

    step = torch_twin(model, cfg, compile_model)
    tb = [torch.from_numpy(b.astype(np.int64)) for b in batches]
    step(0, tb[0])  # warm-up (and, with torch.compile, compilation) outside the clock
    t0 = time.perf_counter()
    for i in range(cfg.steps):
        loss = step(i, tb[i % len(tb)])
    float(loss)
    return cfg.steps * cfg.batch_size * model.seq_len / (time.perf_counter() - t0)


def check_twins_agree(model: ModelConfig, cfg: TrainConfig, batches: np.ndarray, steps: int = 3) -> float:
    """Largest |loss_jax - loss_torch| over the first steps: the two compute the same thing."""
    opt = make_optimizer(cfg)
    state = init_state(model, opt, jax.random.PRNGKey(cfg.seed))
    jstep = jax.jit(make_train_step(model, cfg, opt))
    tstep = torch_twin(model, cfg, compile_model=False)
    import torch

    worst = 0.0
    for i in range(steps):
        state, metrics = jstep(state, batches[i])
        worst = max(worst, abs(float(metrics["loss"]) - float(tstep(i, torch.from_numpy(batches[i].astype(np.int64))))))
    return worst


# --- main ---------------------------------------------------------------------------------------


def best_of(rounds: int, contenders: dict) -> dict:
    results = {name: [] for name in contenders}
    for r in range(rounds):
        for name, fn in contenders.items():
            results[name].append(fn())
            print(f"  round {r + 1} {name:14s} {results[name][-1]:10.0f} tokens/s", flush=True)
    return {name: max(v) for name, v in results.items()}


def machine() -> str:
    """The CPU, its widest vector unit and the load average now: other jobs on the cores move every
    number here, and machines of one name differ (AVX2 only, or AVX-512)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    fields = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in lines if ":" in line}
    flags = fields.get("flags", "").split()
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{fields.get('model name', platform.processor())} ({vector}) x {os.cpu_count()} cores; "
            f"load average {load}")


def cpu(args) -> None:
    print(f"machine: {machine()}", flush=True)
    model, cfg = CPU_MODEL, train_config(args.steps, args.batch_size, batch_parts=args.batch_parts)
    n_params = param_count(jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0))))
    print(f"model: {n_params / 1e6:.1f}M params, {model.n_layers} layers, d_model {model.d_model}, "
          f"vocab {model.vocab_size}, batch {cfg.batch_size} x {model.seq_len} in {cfg.batch_parts} part(s), "
          f"{cfg.steps} steps x {args.rounds} rounds")
    batches = make_batches(model, cfg, 8)
    print(f"twins agree: max |loss_jax - loss_torch| over 3 steps = {check_twins_agree(model, cfg, batches):.2e}")
    contenders = {"kiln": lambda: run_kiln(model, cfg, batches), "bare jax": lambda: run_bare(model, cfg, batches),
                  "torch eager": lambda: run_torch(model, cfg, batches)}
    if args.torch_compile:
        contenders["torch.compile"] = lambda: run_torch(model, cfg, batches, compile_model=True)
    best = best_of(args.rounds, contenders)
    measured_matmul_peak.cache_clear()
    peak = measured_matmul_peak(2048, 20)
    fpt = flops_per_token(model)
    print(f"\nfp32 matmul peak (jitted 2048^2, best of 20): {peak / 1e9:.0f} GFLOP/s; "
          f"model FLOPs/token {fpt / 1e6:.1f}M")
    for name, tps in best.items():
        print(f"{name:14s} {tps:8.0f} tokens/s   MFU {fpt * tps / peak:6.1%}")
    print(f"\nkiln / bare jax    = {best['kiln'] / best['bare jax']:.3f}  (goal >= 0.97)")
    print(f"kiln / torch eager = {best['kiln'] / best['torch eager']:.3f}  (goal >= 1.0)")
    if "torch.compile" in best:
        print(f"kiln / torch.compile = {best['kiln'] / best['torch.compile']:.3f}")
    print(f"kiln MFU           = {fpt * best['kiln'] / peak:.1%}  (goal >= 60%)")
    print(f"machine at the end: {machine()}")


def pipelines(args) -> None:
    """The trainings the CPU pipelines run, through `training.loop.train` as their train steps do,
    on random tokens: configs/tiny_cpu.yaml's model and train sections (vocabulary 4,096, as its
    BPE tokenizer step makes) and the five runs of one budget of configs/scaling_cpu.yaml's sweep
    (vocabulary 384). Whole `train` calls, compilation and checkpoints included."""
    import yaml

    from training.scaling import ScalingConfig, isoflop_grid

    root = Path(__file__).parents[1] / "configs"
    tiny_model, tiny_train = model_and_train(str(root / "tiny_cpu.yaml"))
    runs = [("tiny_cpu", tiny_model.model_copy(update={"vocab_size": 4096}), tiny_train)]
    sweep = ScalingConfig.model_validate(yaml.safe_load((root / "scaling_cpu.yaml").read_text())["scaling"])
    for plan in isoflop_grid(args.budget, sweep, 384):
        runs.append((f"sweep {args.budget:.3g} d_model {plan.model.d_model}", plan.model, plan.train))
    total = 0.0
    for name, model, cfg in runs:
        batches = make_batches(model, cfg, 8)
        with tempfile.TemporaryDirectory() as tmp:
            stats = train(model, cfg, lambda step: batches[step % len(batches)], list(batches[:cfg.eval_batches]),
                          Path(tmp) / "w", Path(tmp) / "o")
        total += stats["seconds"]
        print(f"{name:28s} {cfg.steps:5d} steps of {cfg.batch_size} x {model.seq_len}: {stats['seconds']:6.1f} s, "
              f"{stats['tokens_per_s']:8.0f} tokens/s, final loss {stats['final_loss']:.6f}", flush=True)
    print(f"total {total:.1f} s")


def gpu(args) -> None:
    kind = jax.devices()[0].device_kind
    peak = next((p for name, p in DECLARED_PEAK.items() if name.lower() in kind.lower()), None)
    if peak is None:
        raise SystemExit(f"no declared peak for {kind!r}; add it to training.metrics.DECLARED_PEAK")
    print(f"device: {jax.device_count()} x {kind}, bf16 peak {peak / 1e12:.0f} TFLOP/s each")
    for preset in ("small_gpu", "medium_gpu"):
        model, base = model_and_train(str(Path(__file__).parents[1] / "configs" / f"{preset}.yaml"))
        cfg = train_config(args.steps, base.batch_size, base.microbatches)
        batches = make_batches(model, cfg, 4)
        n_params = param_count(jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0))))
        best = best_of(args.rounds, {"kiln": lambda: run_kiln(model, cfg, batches),
                                     "bare jax": lambda: run_bare(model, cfg, batches)})
        fpt = flops_per_token(model)
        mfu = fpt * best["kiln"] / (peak * jax.device_count())
        print(f"{preset}: {n_params / 1e6:.0f}M params, batch {cfg.batch_size} x {model.seq_len} "
              f"({cfg.microbatches} microbatches): kiln {best['kiln']:.0f} tokens/s, MFU {mfu:.1%}; "
              f"kiln / bare = {best['kiln'] / best['bare jax']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-parts", type=int, default=1, help="kiln's train.batch_parts (2: two independent halves, "
                   "what docs/configuration.md advises on a 2-core CPU)")
    p.add_argument("--torch-compile", action="store_true", help="also time torch.compile (CPU)")
    p.add_argument("--pipelines", action="store_true", help="time the tiny pipeline's and the sweep's trainings")
    p.add_argument("--budget", type=float, default=6e10, help="the sweep budget --pipelines times")
    args = p.parse_args()
    (pipelines if args.pipelines else gpu if args.device == "gpu" else cpu)(args)


if __name__ == "__main__":
    main()
