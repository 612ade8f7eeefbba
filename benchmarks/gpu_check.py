"""The one-shot GPU check (run it through benchmarks/gpu_check.sh, which brings what the machine
lacks): for configs/small_gpu.yaml and configs/medium_gpu.yaml, bfloat16 as configured, it prints

  MFU     kiln's tokens/s x training FLOPs per token (training/model.py, PaLM's 6N + attention)
          over the device's data-sheet peak (training/metrics.py: H200 SXM bf16 dense 989 TFLOP/s)
  ratio   kiln (training.loop.train) / the bare jitted JAX loop of benchmarks/train_bench.py,
          same model, optimizer, batches and microbatches
  hash    whether two kiln runs of the same config end with the same parameter sha256 (a failure
          only under XLA's determinism flag, which gpu_check.sh sets unless --fast; under it
          `auto` attention is query blocks, training/step.py attention_form says why)
  variants  kiln with the other attention form (query blocks where the plain run took the fused
          form, as `auto` does on a GPU; fused on a CPU), with full remat and with document masking
          (train.attention, train.remat, train.document_mask): tokens/s against the plain run,
          final loss, the form run
  memory  the capacity planner's predicted bytes per device (flows/capacity.py `planned`, compiled in a
          CPU subprocess for the same model, batch and device count) next to the device's measured peak
          (`memory_stats()["peak_bytes_in_use"]` after the first run; a CPU reports none)

Each config trains one device's share of its step: the configured batch over the devices its
`resources` name (medium_gpu: 256 sequences over 8 GPUs, so 32 in 8 microbatches of 4), which is
what that device computes under fsdp, less the communication. Each config runs in a process of
its own, so that its peak memory is its own and one config's failure (out of memory, say) leaves
the other's numbers; a variant that fails is printed with its error and fails the check.
kiln runs twice per config (the second run reuses the compiled step: no compile counted either
way) and the faster run counts; the bare loop runs once between them. `--device cpu` is a dry run
of the same code on shrunken models (same layer structure, dtype and microbatches, tiny sizes),
with MFU against this host's measured float32 matmul peak, so CI can keep the script working
without a GPU. Imports training/, jax, flax, optax, numpy, pydantic, yaml: no Prefect, no Ray.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from train_bench import make_batches, run_bare, train_config  # noqa: E402

from flows.capacity import default_devices, planned  # noqa: E402
from training.capacity import total_bytes  # noqa: E402
from training.config import ModelConfig, ResourcesConfig, flops_per_token, model_and_train  # noqa: E402
from training.loop import train  # noqa: E402
from training.metrics import DECLARED_PEAK, measured_matmul_peak  # noqa: E402
from training.model import init_params, param_count  # noqa: E402
from training.step import xla_gpu_deterministic  # noqa: E402

CONFIGS = Path(__file__).parents[1] / "configs"
PRESETS = ("small_gpu", "medium_gpu")


def dry_run_model(model: ModelConfig) -> ModelConfig:
    """A model small enough for a CPU in seconds, keeping what the check exercises: tied or not,
    grouped-query attention, the compute dtype."""
    return model.model_copy(update={"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4,
                                    "n_kv_heads": 2, "d_ff": 128, "seq_len": 64})


def run_kiln(model: ModelConfig, cfg, batches) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return train(model, cfg, lambda step: batches[step % len(batches)], [], Path(tmp) / "w", Path(tmp) / "o")


def peak_flops(device: str) -> tuple[float, str]:
    if device == "cpu":
        return measured_matmul_peak(), "this host's measured fp32 matmul peak"
    kind = jax.devices()[0].device_kind
    peak = next((p for name, p in DECLARED_PEAK.items() if name.lower() in kind.lower()), None)
    if peak is None:
        raise SystemExit(f"no data-sheet peak for {kind!r}; add it to training.metrics.DECLARED_PEAK")
    return peak * jax.device_count(), f"{jax.device_count()} x {kind} data sheet, bf16 dense"


def devices_named(preset: str) -> int:
    """How many accelerators the config's `resources` section asks for (`kiln capacity`'s default)."""
    raw = yaml.safe_load((CONFIGS / f"{preset}.yaml").read_text())
    return default_devices(ResourcesConfig.model_validate(raw.get("resources", {})))


def check(preset: str, device: str, steps: int, peak: float) -> bool:
    model, base = model_and_train(str(CONFIGS / f"{preset}.yaml"))
    batch_size = base.batch_size // devices_named(preset)
    if device == "cpu":
        model, batch_size = dry_run_model(model), 2 * base.microbatches
    cfg = train_config(steps, batch_size, base.microbatches)
    batches = make_batches(model, cfg, 4)
    n_params = param_count(jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0))))
    t0 = time.perf_counter()
    # the capacity planner compiles on this host's CPU (its own process) while the device trains
    planner = ThreadPoolExecutor(1).submit(planned, model, cfg, jax.device_count())
    first = run_kiln(model, cfg, batches)
    measured = measured_peak()  # the plain kiln run's, before any other run on this device
    bare = run_bare(model, cfg, batches)
    second = run_kiln(model, cfg, batches)
    kiln = max(first["tokens_per_s"], second["tokens_per_s"])
    same = first["params_sha256"] == second["params_sha256"]
    bitwise = device == "cpu" or xla_gpu_deterministic()  # without the flag the same bits are not promised
    mfu = flops_per_token(model) * kiln / peak
    print(f"{preset}: {n_params / 1e6:.1f}M params, {model.compute_dtype}, batch {cfg.batch_size} x {model.seq_len} "
          f"({cfg.microbatches} microbatches), {steps} steps, {time.perf_counter() - t0:.0f} s\n"
          f"  MFU {mfu:.1%}   kiln {kiln:.0f} tokens/s   bare jax {bare:.0f} tokens/s   kiln / bare = {kiln / bare:.3f}\n"
          f"  same parameter hash in two runs: {'yes' if same else 'NO'} ({first['params_sha256'][:16]})"
          f"{'' if bitwise else ', not asked for: no determinism flag'}", flush=True)
    print(f"  memory per device: planner {total_bytes(planner.result()) / 2**30:.3f} GiB predicted, measured peak {measured}",
          flush=True)
    eos = int(batches[0][0, model.seq_len // 2])  # a token the batches hold: each row is cut into documents there
    other = "fused" if first["attention"] == "query_blocks" else "query_blocks"
    variants_ran = True
    for name, update in ((f"{other} attention", {"attention": other}), ("full remat", {"remat": "full"}),
                         ("document mask", {"document_mask": True, "eos_id": eos})):
        try:
            stats = run_kiln(model, cfg.model_copy(update=update), batches)
        except Exception:  # printed, and the check fails; the next variant still runs
            print(f"  {name}: FAILED\n{traceback.format_exc(limit=-4)[-3000:]}", flush=True)
            variants_ran = False
            continue
        print(f"  {name}: {stats['tokens_per_s']:.0f} tokens/s ({stats['tokens_per_s'] / kiln:.3f} x plain), final "
              f"loss {stats['final_loss']:.4f} (plain {first['final_loss']:.4f}), attention {stats['attention']}, "
              f"remat {stats['remat']}", flush=True)
    return (same or not bitwise) and variants_ran


def measured_peak() -> str:
    """The first device's peak memory so far, as its allocator reports it (GPUs and TPUs)."""
    stats = jax.devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return f"n/a ({jax.devices()[0].platform} reports no memory stats)"
    return f"{stats['peak_bytes_in_use'] / 2**30:.3f} GiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: gpu 8, cpu 3)")
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    args = p.parse_args()
    steps = args.steps or (8 if args.device == "gpu" else 3)
    if len(args.presets) == 1:  # one config in this process: its numbers, or its error and exit status 1
        platform = jax.devices()[0].platform  # the first touch of a device: this process takes the GPU's memory
        if (args.device == "gpu") != (platform == "gpu"):
            raise SystemExit(f"--device {args.device} but JAX's devices are {platform}: {jax.devices()}")
        peak, source = peak_flops(args.device)
        print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}; "
              f"peak {peak / 1e12:.3g} TFLOP/s ({source})", flush=True)
        raise SystemExit(0 if check(args.presets[0], args.device, steps, peak) else 1)
    t0 = time.perf_counter()  # this process never touches a device: each config's process takes the GPU alone
    failed = [preset for preset in args.presets
              if subprocess.run([sys.executable, __file__, "--device", args.device, "--steps", str(steps),
                                 "--presets", preset]).returncode != 0]
    print(f"gpu check {'FAILED (' + ', '.join(failed) + ')' if failed else 'passed'} in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
