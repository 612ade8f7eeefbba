"""A capacity plan before any GPU: the real train step compiled for a config's mesh on simulated
devices, and what each device would hold.

`plan` builds the step exactly as training/loop.py does (`make_train_step`, the state's shardings
from training/sharding.py, the batch split on `data`), but from `jax.eval_shape`: no parameter is
ever allocated, so an 8B config costs no memory. It lowers and compiles the step for the devices
JAX has, and reads, per device:

    parameters, optimizer state   the bytes of each leaf's shard under its sharding
    gradients                     the parameters' shard bytes again (float32; they live inside the
                                  step, so they are part of the compiler's temporaries)
    temporaries                   `compiled.memory_analysis().temp_size_in_bytes`: activations,
                                  gradients and everything else the step holds while it runs
    FLOPs                         kiln's 6N + attention per token (training/model.py) for the
                                  global batch, per device; and the compiler's own count
                                  (`cost_analysis()`), which includes remat's recomputation
                                  (and counts the microbatch loop's body once: times microbatches)

Run as a program (`python -m training.capacity`), it plans on N simulated CPU devices: XLA's
`--xla_force_host_platform_device_count=N` must be set before JAX starts, so `kiln capacity`
(flows/capacity.py) runs it in a subprocess. What a CPU compile cannot show: a GPU's attention
kernel (cuDNN's flash attention keeps no [T, T] scores; the CPU compiles kiln's query blocks or
XLA's softmax(QK^T)V, which keep them, so attention's temporaries are an upper bound there) and a
GPU compiler's own scheduling and fusion. No Prefect, no Ray: benchmarks/gpu_check.py uses it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

# Device memory as the devices report it (GiB: nvidia-smi's MiB / 1024, TPU HBM), and the dense
# bfloat16 peak of the data sheets (training/metrics.py DECLARED_PEAK; SXM parts for NVIDIA).
DEVICES = {
    "h100-80gb": (79.6, "H100"),
    "h200-141gb": (140.4, "H200"),
    "a100-40gb": (40.0, "A100"),
    "a100-80gb": (80.0, "A100"),
    "tpu-v4": (32.0, "TPU v4"),
    "tpu-v5e": (16.0, "TPU v5e"),
}
# JAX preallocates this share of a GPU's memory and cannot go beyond it
# (XLA_PYTHON_CLIENT_MEM_FRACTION; TPUs use all of theirs).
DEFAULT_MEMORY_FRACTION = 0.75


def plan(model_cfg, train_cfg, devices=None, objective=None) -> dict:
    """The per-device numbers of one config's train step on `devices` (default: all of JAX's);
    `objective` (training/posttrain.py: SFT's, DPO's) as the post-training steps train, or None:
    pretraining's."""
    import jax

    from training.config import flops_per_token
    from training.model import param_count
    from training.optim import make_optimizer
    from training.sharding import abstract_batch, make_mesh, state_shardings
    from training.step import (compiler_options, how_it_runs, init_state, make_train_step, tokens_per_step,
                               trained_key)

    mesh = make_mesh(train_cfg.mesh, devices)
    n = mesh.size
    if train_cfg.batch_size % (mesh.shape["data"] * train_cfg.microbatches):
        raise ValueError(f"batch_size={train_cfg.batch_size} does not split into {train_cfg.microbatches} "
                         f"microbatches over {mesh.shape['data']} data-parallel devices: make it a multiple of "
                         f"{mesh.shape['data'] * train_cfg.microbatches}")
    optimizer = make_optimizer(train_cfg)
    ema = train_cfg.ema is not None
    abstract = jax.eval_shape(lambda key: init_state(model_cfg, optimizer, key, train_cfg.lora, ema),
                              jax.random.PRNGKey(0))
    shardings = state_shardings(abstract, mesh, train_cfg.mesh.strategy)
    placed = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    batch, data = abstract_batch(train_cfg.batch_size, model_cfg.seq_len, mesh, objective)
    step = jax.jit(make_train_step(model_cfg, train_cfg, optimizer, objective), donate_argnums=0,
                   in_shardings=(shardings, data), out_shardings=(shardings, None))
    # The plan never runs the program, so LLVM's optimisations are skipped: the same buffers, a
    # faster compile (the HLO passes, which decide the buffers, still run)
    options = {**(compiler_options(train_cfg) or {}), "xla_backend_optimization_level": 0,
               "xla_llvm_disable_expensive_passes": True}
    compiled = step.lower(placed, batch).compile(compiler_options=options)
    memory = compiled.memory_analysis()
    flops = _flops(compiled)
    trained = trained_key(train_cfg.lora)
    if flops is not None and train_cfg.microbatches > 1:
        # XLA counts the microbatch loop's body once: the step's count is the loop's times its trip
        # count plus the optimizer's update once (not few FLOPs with Muon: its Newton-Schulz steps)
        held = {k: placed[k] for k in (trained, "opt_state")}
        update = jax.jit(lambda s: optimizer.update(s[trained], s["opt_state"], s[trained]))
        outside = _flops(update.lower(held).compile(compiler_options=options)) or 0.0
        flops = (flops - outside) * train_cfg.microbatches + outside

    def shard_bytes(tree, tree_shardings) -> int:
        sizes = jax.tree_util.tree_map(lambda a, s: math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize,
                                       tree, tree_shardings)
        return int(sum(jax.tree_util.tree_leaves(sizes)))

    params = shard_bytes(abstract["params"], shardings["params"])
    dpo = getattr(objective, "name", None) == "dpo"
    reference = _reference_bytes(model_cfg, train_cfg, mesh, options) if dpo else 0
    tokens = tokens_per_step(model_cfg, train_cfg, objective)
    step_flops = flops_per_token(model_cfg) * tokens
    return {
        "objective": objective.name if objective else "next_token",
        "devices": n, "mesh": dict(mesh.shape), "strategy": train_cfg.mesh.strategy,
        "param_count": param_count(abstract["params"]), **how_it_runs(model_cfg, train_cfg),
        "optimizer": train_cfg.optimizer, "compute_dtype": model_cfg.compute_dtype,
        "batch_size": train_cfg.batch_size,
        "microbatches": train_cfg.microbatches, "seq_len": model_cfg.seq_len, "tokens_per_step": tokens,
        "param_bytes": params,
        "optimizer_bytes": shard_bytes(abstract["opt_state"], shardings["opt_state"]),
        "gradient_bytes": shard_bytes(abstract[trained], shardings[trained]),
        "ema_bytes": shard_bytes(abstract["ema"], shardings["ema"]) if ema else 0,  # train.ema's average
        "argument_bytes": int(memory.argument_size_in_bytes),  # the state and the batch, donated
        "temp_bytes": int(memory.temp_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes - memory.alias_size_in_bytes),  # beyond the donated state
        "reference_bytes": reference,  # DPO's reference pass, before the first step (`_reference_bytes`)
        "flops_per_step": step_flops / n,  # per device, kiln's count (PaLM's 6N + attention)
        "compiler_flops": flops,  # per device, the compiled program's count (`_flops`, the loop's trip count)
    }


def _reference_bytes(model_cfg, train_cfg, mesh, options: dict) -> int:
    """What one device holds while DPO's frozen reference scores the pairs, before the first step
    and before the train state exists (training/posttrain.py `reference_program`, compiled as the
    step runs it): its parameters' shard, a call's pairs, the compiler's temporaries, the output."""
    import jax

    from training.posttrain import reference_pairs_per_call, reference_program
    from training.step import attention_form

    attention = attention_form(train_cfg.attention, model_cfg, jax.default_backend())
    score, params, pairs = reference_program(model_cfg, reference_pairs_per_call(train_cfg, mesh), mesh,
                                             train_cfg.mesh.strategy, attention)
    memory = score.lower(params, pairs).compile(compiler_options=options).memory_analysis()
    return int(memory.argument_size_in_bytes + memory.temp_size_in_bytes + memory.output_size_in_bytes)


def total_bytes(p: dict) -> int:
    """What one device holds at the peak: the step's arguments (state and batch), the compiler's
    temporaries and outputs that do not reuse a donated buffer, or DPO's reference pass before the
    first step where that holds more."""
    return max(p["argument_bytes"] + p["temp_bytes"] + p["output_bytes"], p.get("reference_bytes", 0))


def fits(p: dict, device: str, memory_fraction: float = DEFAULT_MEMORY_FRACTION) -> dict:
    """Whether the plan fits one `device`, and the step time its peak FLOP/s gives at `mfu`."""
    from training.metrics import DECLARED_PEAK

    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}: choose from {', '.join(DEVICES)}")
    gib, peak_name = DEVICES[device]
    fraction = 1.0 if device.startswith("tpu") else memory_fraction
    usable = gib * 2**30 * fraction
    return {"device": device, "memory_gib": gib, "usable_gib": round(usable / 2**30, 2),
            "fits": total_bytes(p) <= usable, "peak_flops": DECLARED_PEAK[peak_name]}


def report(p: dict, devices: list[str], mfu: float, memory_fraction: float = DEFAULT_MEMORY_FRACTION) -> dict:
    """The plan with each named device's fit and estimated step time at `mfu`."""
    rows = []
    for device in devices:
        f = fits(p, device, memory_fraction)
        rows.append({**f, "step_seconds": p["flops_per_step"] / (f["peak_flops"] * mfu)})
    return {**p, "total_bytes": total_bytes(p), "mfu": mfu, "memory_fraction": memory_fraction, "fit": rows}


def gib(n_bytes: float) -> str:
    """Bytes as people read them: GiB from a quarter of one, else MiB."""
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**28 else f"{n_bytes / 2**20:.1f} MiB"


def _flops(compiled) -> float | None:
    """The compiled program's FLOPs per device (None where the backend does not count them)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # a list of one dict in some JAX versions
    return float(cost["flops"]) if cost and "flops" in cost else None


def how_many(count: int) -> str:
    """A parameter count as people write it: 1.24B, 124M, 51.1K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return str(count)


def table(r: dict) -> str:
    """The report as the lines `kiln capacity` prints."""
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
    batch = {"next_token": f"batch {r['batch_size']} x {r['seq_len']}",
             "sft": f"SFT, batch {r['batch_size']} packed rows x {r['seq_len']}",
             "dpo": f"DPO, batch {r['batch_size']} pairs x 2 x {r['seq_len']} (chosen, rejected)"}[r["objective"]]
    lines = [
        f"{how_many(r['param_count'])} parameters, {r['compute_dtype']}, {batch} "
        f"({r['microbatches']} microbatches), {r['strategy']} over {r['devices']} devices (mesh {mesh}), "
        f"attention {r['attention']}, remat {r['remat']}, optimizer {r['optimizer']}",
        "per device:",
        f"  parameters      {gib(r['param_bytes'])}",
        f"  optimizer       {gib(r['optimizer_bytes'])}",
        *([f"  moving average  {gib(r['ema_bytes'])}  (train.ema)"] if r.get("ema_bytes") else []),
        f"  gradients       {gib(r['gradient_bytes'])}  (inside the temporaries)",
        f"  temporaries     {gib(r['temp_bytes'])}  (activations, gradients: the compiler's)",
        *([f"  reference pass  {gib(r['reference_bytes'])}  (DPO's frozen model scoring the pairs, before the "
           "first step)"] if r.get("reference_bytes") else []),
        f"  total           {gib(r['total_bytes'])}  (arguments {gib(r['argument_bytes'])} + temporaries"
        f" + outputs {gib(r['output_bytes'])}" + (", or the reference pass" if r.get("reference_bytes") else "") + ")",
        f"  FLOPs per step  {r['flops_per_step']:.3e} (kiln's 6N + attention); compiler's count "
        + (f"{r['compiler_flops']:.3e}" if r["compiler_flops"] else "n/a"),
        f"fit (usable memory: JAX preallocates {r['memory_fraction']:.0%} of a GPU's; TPUs all), step time at "
        f"{r['mfu']:.0%} MFU:",
    ]
    for f in r["fit"]:
        lines.append(f"  {f['device']:11s} {f['memory_gib']:6.1f} GiB (usable {f['usable_gib']:6.1f})  "
                     f"{'fits' if f['fits'] else 'does NOT fit':12s}  {f['step_seconds']:.3g} s/step")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """`python -m training.capacity --model JSON --train JSON --devices N`: one plan as JSON on
    stdout. Sets the simulated device count itself, so it must start JAX (a fresh process)."""
    p = argparse.ArgumentParser(description="Plan one train step on N simulated CPU devices (JSON out).")
    p.add_argument("--model", required=True, help="ModelConfig as JSON")
    p.add_argument("--train", required=True, help="TrainConfig as JSON")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--objective", help="a post-training objective as JSON, its name and fields "
                   '(training/posttrain.py: {"name": "sft"}, {"name": "dpo", "beta": 0.1, "sft_weight": 0.0}); '
                   "default pretraining's")
    args = p.parse_args(argv)
    if "jax" in sys.modules:
        raise RuntimeError("training.capacity.main must run before JAX starts (it sets the device count)")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    from training.config import ModelConfig, TrainConfig

    model_cfg = ModelConfig.model_validate_json(args.model)
    train_cfg = TrainConfig.model_validate_json(args.train)
    objective = None
    if args.objective:
        from training.posttrain import OBJECTIVES

        fields = json.loads(args.objective)
        objective = OBJECTIVES[fields.pop("name")](**fields)
    import jax

    from training import compile_cache

    if jax.device_count() != args.devices:
        raise RuntimeError(f"asked for {args.devices} simulated devices, JAX has {jax.device_count()}")
    compile_cache.enable()  # a plan asked again (another --device, --mfu or --json) reads its step back
    print(json.dumps({**plan(model_cfg, train_cfg, objective=objective),
                      "compiled_programs_read": compile_cache.programs_read()[0]}))


if __name__ == "__main__":
    main()
