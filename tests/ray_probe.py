"""A kiln driver for the Ray tests, run as `python -m tests.ray_probe OUT STEPS`: a data stage's
map over two Ray workers, then training in a Ray host task, both on kiln's own Ray (whatever
RAY_ADDRESS says is honoured as kiln would). At the first training step it writes what the
test checks while the run is live (the Ray address; the process trees of this driver and of the
local Ray's keeper, and every socket they listen on) to OUT/live.json and prints `live`; at the
end `done`."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import numpy as np
import psutil


def square(x: int) -> int:
    return x * x


def random_batches(batch_size: int, seq_len: int, vocab: int):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(64, batch_size, seq_len + 1), dtype=np.int32)
    return (lambda step: tokens[step % len(tokens)]), [tokens[0]]


def listening(pid: int) -> tuple[list[int], list[str]]:
    """The process tree under `pid` and the addresses its processes listen on (TCP and UDP)."""
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    addresses = []
    for proc in tree:
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN or (conn.type == 2 and not conn.raddr):
                    addresses.append(f"{conn.laddr.ip}:{conn.laddr.port} {proc.name()}")
        except psutil.Error:
            continue
    return [p.pid for p in tree], addresses


def main(out: Path, steps: int) -> None:
    import ray

    from tasks.engine.parallel import map_shards
    from tasks.engine import local_ray
    from training.config import ModelConfig, ResourcesConfig, TrainConfig
    from training.launch import launch_training
    from tasks.engine.reaper import watch_this_process

    watch_this_process()  # as kiln's CLI does

    assert map_shards(square, list(range(4)), workers=2) == [0, 1, 4, 9]  # starts kiln's Ray
    model = ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, seq_len=32)
    train = TrainConfig(batch_size=4, steps=steps, warmup=1, log_every=1, eval_every=10_000,
                        checkpoint_every=10_000, peak_flops=1e11)
    seen = []

    def on_metrics(record: dict) -> None:
        if not seen:
            keeper = local_ray.read_head(local_ray.ray_dir())["pid"]
            driver_tree, driver_addresses = listening(os.getpid())
            keeper_tree, keeper_addresses = listening(keeper)
            (out / "live.json").write_text(json.dumps(
                {"gcs": ray.get_runtime_context().gcs_address, "keeper": keeper, "driver_tree": driver_tree,
                 "keeper_tree": keeper_tree, "listening": driver_addresses + keeper_addresses}))
            print("live", flush=True)
        seen.append(record)

    stats = launch_training(model, train, ResourcesConfig(hosts=1, cpus_per_host=1),
                            functools.partial(random_batches, 4, 32, 256), out / "work", out / "out",
                            on_metrics=on_metrics)
    (out / "stats.json").write_text(json.dumps({"ray_cluster": stats["ray_cluster"], "steps": stats["steps"]}))
    local_ray.disconnect()
    print("done", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
