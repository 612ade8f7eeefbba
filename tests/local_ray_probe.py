"""A kiln driver for tests/test_local_ray.py, run as `python -m tests.local_ray_probe OUT NAME
CPUS [hold]`: one train step of `CPUS` CPUs on kiln's local Ray, as `kiln run` would launch it
(with the reaper kiln's CLI starts). Its host writes OUT/NAME.started when it opens its data and,
with `hold`, waits for OUT/NAME.release first; the driver writes OUT/NAME.json at the end."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import numpy as np


def held_batches(out: str, name: str, hold: bool):
    """The host's data: says it started, waits for the test's release if asked, then batches."""
    Path(out, f"{name}.started").write_text(str(time.time()))
    while hold and not Path(out, f"{name}.release").exists():
        time.sleep(0.1)
    tokens = np.random.default_rng(0).integers(0, 64, size=(8, 2, 17), dtype=np.int32)
    return (lambda step: tokens[step % len(tokens)]), [tokens[0]]


def main(out: Path, name: str, cpus: int, hold: bool) -> None:
    import ray

    from tasks.engine import local_ray
    from training.config import ModelConfig, ResourcesConfig, TrainConfig
    from training.launch import launch_training
    from tasks.engine.reaper import watch_this_process

    watch_this_process()  # as kiln's CLI does: what this run started ends with it, not the shared Ray
    model = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, seq_len=16)
    train = TrainConfig(batch_size=2, steps=2, warmup=1, log_every=1, eval_every=10_000, checkpoint_every=10_000,
                        peak_flops=1e11)
    live = []  # while training: the Ray this driver is connected to, and its keeper

    def on_metrics(record: dict) -> None:
        live.append({"gcs": ray.get_runtime_context().gcs_address,
                     "keeper": local_ray.read_head(local_ray.ray_dir())["pid"]})

    stats = launch_training(model, train, ResourcesConfig(hosts=1, cpus_per_host=cpus),
                            functools.partial(held_batches, str(out), name, hold), out / f"{name}-work",
                            out / f"{name}-out", on_metrics=on_metrics)
    (out / f"{name}.json").write_text(json.dumps({"ray_cluster": stats["ray_cluster"], **live[0]}))
    print("done", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:] == ["hold"])
