"""Where arrays live: a (data, model) device mesh and a sharding for every leaf of the state.

Batches are split on `data`. Parameters follow two rules, both by name, so the model needs no
annotations:
- tensor parallel on `model` (Megatron): the projections that fan out (q/k/v, gate/up, lm_head)
  split their output features, the ones that fan in (o, down) their input features, the
  embedding its vocabulary;
- FSDP on `data` (strategy "fsdp"): each matrix is also split along its largest remaining
  dimension that divides evenly, so parameters and optimizer state are spread over data-parallel
  devices; XLA gathers them for the matmuls. Strategy "dp" keeps them replicated.
A dimension that does not divide by the axis size stays whole.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from training.config import MeshConfig

_FAN_OUT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")  # split dim 1
_FAN_IN = ("o_proj", "down_proj", "embed_tokens")  # split dim 0


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """A mesh over all devices (of every process): `model` as configured, `data` the rest."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) % cfg.model:
        raise ValueError(f"mesh.model={cfg.model} does not divide the {len(devices)} devices present")
    return Mesh(np.array(devices).reshape(len(devices) // cfg.model, cfg.model), ("data", "model"))


def _param_spec(path: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh, strategy: str) -> P:
    spec: list[str | None] = [None] * len(shape)
    if len(shape) == 2:
        owner = next((name for name in path if name in _FAN_OUT + _FAN_IN), None)
        if owner is not None and mesh.shape["model"] > 1:
            dim = 1 if owner in _FAN_OUT else 0
            if shape[dim] % mesh.shape["model"] == 0:
                spec[dim] = "model"
    if strategy == "fsdp" and len(shape) >= 2 and mesh.shape["data"] > 1:
        free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % mesh.shape["data"] == 0]
        if free:
            spec[max(free, key=lambda d: shape[d])] = "data"
    return P(*spec)


def path_names(path) -> tuple[str, ...]:
    """A tree path's keys as strings (("layers_0", "mlp", "up_proj", "kernel")): how parameters are named."""
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def state_shardings(abstract_state: dict, mesh: Mesh, strategy: str) -> dict:
    """A NamedSharding for each leaf of the train state (as from `jax.eval_shape`).

    Optimizer moments mirror the parameters: a leaf of `opt_state` whose path ends with a
    parameter's path and has its shape gets that parameter's sharding; counts are replicated.
    """
    param_specs = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_state["params"]):
        param_specs[path_names(path)] = (leaf.shape, _param_spec(path_names(path), leaf.shape, mesh, strategy))

    def for_leaf(path, leaf):
        names = path_names(path)
        for start in range(len(names)):
            shape_spec = param_specs.get(names[start:])
            if shape_spec is not None and shape_spec[0] == leaf.shape:
                return NamedSharding(mesh, shape_spec[1])
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(for_leaf, abstract_state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P("data", None))


def abstract_batch(batch_size: int, seq_len: int, mesh: Mesh, objective=None):
    """The train step's batch as shapes with their shardings, and the shardings: pretraining's
    int32 [B, T+1] tokens, or an objective's dict (training/posttrain.py `batch_spec`: SFT's rows,
    DPO's pairs), every array split on `data` along its first (batch) axis."""
    if objective is None:
        sharding = batch_sharding(mesh)
        return jax.ShapeDtypeStruct((batch_size, seq_len + 1), np.int32, sharding=sharding), sharding
    spec = objective.batch_spec(batch_size, seq_len)
    sharding = {k: NamedSharding(mesh, P("data", *[None] * (len(shape) - 1))) for k, (shape, _) in spec.items()}
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding[k]) for k, (shape, dtype) in spec.items()}, sharding


def put_batch(batch: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The global batch [B, T+1] as one array sharded on `data`. Every process passes the same
    global batch and contributes the rows its own devices hold (for one process: all of them)."""
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])
