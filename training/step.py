"""The training state and the two jitted steps: `train_step(state, batch) -> (state, metrics)` and
`eval_step(params, batch) -> loss`.

The state is a plain dict of arrays, {"step", "params", "opt_state", "rng"}, so orbax saves and
restores it without custom types. A batch is int32 [B, T + 1]: inputs are [:, :-1], targets
[:, 1:]. Sharding is decided by the caller (`training.sharding`) through jit's shardings; nothing
here knows about devices.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from training.config import LoraConfig, ModelConfig, TrainConfig
from training.lora import init_adapters, merged
from training.model import forward, init_params
from training.optim import lr_schedule, scaled


def init_state(model_cfg: ModelConfig, optimizer: optax.GradientTransformation, key: jax.Array,
               lora: LoraConfig | None = None) -> dict:
    """Parameters and optimizer state from one key: split once for initialisation and once for
    the key the state carries (split again every step, for anything stochastic in training).
    With `lora` the state also holds the adapters, and the optimizer state is theirs alone."""
    init_key, train_key = jax.random.split(key)
    params = init_params(model_cfg, init_key)
    if lora is None:
        return {"step": jnp.zeros((), jnp.int32), "params": params,
                "opt_state": optimizer.init(params), "rng": train_key}
    adapters = init_adapters(params, model_cfg, lora, jax.random.fold_in(init_key, 1))
    return {"step": jnp.zeros((), jnp.int32), "params": params, "adapters": adapters,
            "opt_state": optimizer.init(adapters), "rng": train_key}


def model_params(state: dict, lora: LoraConfig | None) -> dict:
    """The parameters the model computes with: the state's, or with LoRA the merged ones."""
    return state["params"] if lora is None else merged(state["params"], state["adapters"], lora)


@jax.custom_vjp
def cross_entropy(logits, targets):
    """Mean over positions of logsumexp(logits) - logits[target], for float32 logits [..., V] and
    int targets [...]: the number optax's `softmax_cross_entropy_with_integer_labels(...).mean()`
    gives, to float rounding. Its gradient is one fused pass over the logits, (softmax - onehot)
    / n, from the saved logits and logsumexp; autodiff of a log-softmax makes several."""
    return _cross_entropy_fwd(logits, targets)[0]


def _cross_entropy_fwd(logits, targets):
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - picked), (logits, targets, lse)


def _cross_entropy_bwd(saved, g):
    logits, targets, lse = saved
    onehot = targets[..., None] == jnp.arange(logits.shape[-1], dtype=targets.dtype)
    return (jnp.exp(logits - lse[..., None]) - onehot) * (g / targets.size), None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def loss_fn(params, batch, model_cfg: ModelConfig):
    """Mean next-token cross-entropy (nats) over every position of the batch, in float32."""
    return cross_entropy(forward(params, batch[:, :-1], model_cfg), batch[:, 1:])


class NextToken:
    """Pretraining's objective: next-token cross-entropy on an int32 [B, T + 1] batch, no metrics
    of its own. Post-training's objectives (training/posttrain.py) have the same two methods'
    shape: `loss(params, batch, model_cfg) -> (loss, metrics)` on their dict batches."""

    name = "next_token"

    def loss(self, params, batch, model_cfg: ModelConfig):
        return loss_fn(params, batch, model_cfg), {}


NEXT_TOKEN = NextToken()


def make_train_step(model_cfg: ModelConfig, train_cfg: TrainConfig,
                    optimizer: optax.GradientTransformation, objective=None) -> Callable:
    """The step body, to be wrapped by `jax.jit` with shardings and `donate_argnums=0`: one for
    pretraining, SFT and DPO, with or without LoRA. `objective` (None: next-token pretraining)
    gives the loss and its metrics, averaged like the loss and returned beside it. What trains is
    the state's `params`, or with `train.lora` its `adapters` (the loss is then the merged
    model's, and `params` stay as they are). The learning rate is the schedule at the state's
    own step counter (training/optim.py), the one counter a new phase resets."""
    objective = objective or NEXT_TOKEN
    lora = train_cfg.lora
    trained = "params" if lora is None else "adapters"  # what has gradients and optimizer state

    def loss(trainable, frozen, batch):
        params = trainable if lora is None else merged(frozen, trainable, lora)
        return objective.loss(params, batch, model_cfg)

    grad_fn = jax.value_and_grad(loss, has_aux=True)
    schedule = lr_schedule(train_cfg)
    M = train_cfg.microbatches

    def gradients(trainable, frozen, batch):
        if M == 1:
            return grad_fn(trainable, frozen, batch)
        # Microbatch m is rows m, m+M, m+2M, ... of every array of the batch: each device's
        # contiguous slice of a batch sharded on `data` then holds part of every microbatch, so
        # nothing moves between devices.
        micro = jax.tree_util.tree_map(
            lambda x: jnp.swapaxes(x.reshape(x.shape[0] // M, M, *x.shape[1:]), 0, 1), batch)  # [M, B/M, ...]

        def accumulate(carry, mb):
            return jax.tree_util.tree_map(jnp.add, carry, grad_fn(trainable, frozen, mb)), None

        shapes = jax.eval_shape(grad_fn, trainable, frozen, jax.tree_util.tree_map(lambda x: x[0], micro))
        zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        total, _ = jax.lax.scan(accumulate, zeros, micro)
        return jax.tree_util.tree_map(lambda x: x / M, total)

    def train_step(state: dict, batch):
        rng, _step_key = jax.random.split(state["rng"])  # no dropout yet: the key only advances
        frozen = None if lora is None else state["params"]
        (loss_value, aux), grads = gradients(state[trained], frozen, batch)
        lr = schedule(state["step"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state[trained])
        new = optax.apply_updates(state[trained], scaled(updates, lr))
        metrics = {"loss": loss_value, "grad_norm": optax.tree.norm(grads), "lr": lr, **aux}
        return {**state, "step": state["step"] + 1, trained: new, "opt_state": opt_state, "rng": rng}, metrics

    return train_step


def make_eval_step(model_cfg: ModelConfig, objective=None) -> Callable:
    """params, batch -> mean validation loss (the objective's, when given); wrap in `jax.jit`."""
    objective = objective or NEXT_TOKEN
    return lambda params, batch: objective.loss(params, batch, model_cfg)[0]
