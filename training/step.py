"""The training state and the two jitted steps: `train_step(state, batch) -> (state, metrics)` and
`eval_step(params, batch) -> loss`.

The state is a plain dict of arrays, {"step", "params", "opt_state", "rng"}, so orbax saves and
restores it without custom types. A batch is int32 [B, T + 1]: inputs are [:, :-1], targets
[:, 1:]. Sharding is decided by the caller (`training.sharding`) through jit's shardings; nothing
here knows about devices beyond their platform, which picks the attention form (`attention_form`)
and the compiler options (`compiler_options`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from training.config import DETERMINISTIC_GPU_FLAG, LoraConfig, ModelConfig, TrainConfig
from training.lora import init_adapters, merged
from training.model import forward, init_params, segment_ids
from training.optim import lr_schedule, scaled


def init_state(model_cfg: ModelConfig, optimizer: optax.GradientTransformation, key: jax.Array,
               lora: LoraConfig | None = None, ema: bool = False) -> dict:
    """Parameters and optimizer state from one key: split once for initialisation and once for
    the key the state carries (split again every step, for anything stochastic in training).
    With `lora` the state also holds the adapters, and the optimizer state is theirs alone; with
    `ema` (train.ema) the moving average of the parameters, starting at them."""
    init_key, train_key = jax.random.split(key)
    params = init_params(model_cfg, init_key)
    if lora is None:
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params),
                "rng": train_key, **({"ema": params} if ema else {})}
    adapters = init_adapters(params, model_cfg, lora, jax.random.fold_in(init_key, 1))
    return {"step": jnp.zeros((), jnp.int32), "params": params, "adapters": adapters,
            "opt_state": optimizer.init(adapters), "rng": train_key}


def trained_key(lora: LoraConfig | None) -> str:
    """The state's entry that has gradients and optimizer state: the parameters, or with LoRA the adapters."""
    return "params" if lora is None else "adapters"


def model_params(state: dict, lora: LoraConfig | None) -> dict:
    """The parameters the model computes with: the state's, or with LoRA the merged ones."""
    return state["params"] if lora is None else merged(state["params"], state["adapters"], lora)


def published_params(state: dict, lora: LoraConfig | None) -> dict:
    """The model a run publishes (its output, its kept steps, its in-loop evals): the moving
    average of the parameters where train.ema keeps one, else `model_params`."""
    return state["ema"] if "ema" in state else model_params(state, lora)


def ema_update(ema: dict, params: dict, decay) -> dict:
    """One step of the moving average: decay * ema + (1 - decay) * params, leaf by leaf, in the
    average's dtype (`decay`: a float, or a float32 scalar under train.ema_warmup)."""
    return jax.tree_util.tree_map(lambda e, p: (decay * e + (1 - decay) * p).astype(e.dtype), ema, params)


def ema_decay(train_cfg: TrainConfig, step):
    """The moving average's decay at `step` (the steps trained, this one included): train.ema, or
    with train.ema_warmup min(ema, (1 + step) / (10 + step))."""
    if not train_cfg.ema_warmup:
        return train_cfg.ema
    t = step.astype(jnp.float32)
    return jnp.minimum(jnp.float32(train_cfg.ema), (1 + t) / (10 + t))


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def cross_entropy_and_z(logits, targets, coef: float):
    """(`cross_entropy`, coef * mean(logsumexp(logits)^2)): the cross-entropy and PaLM's z-loss
    (Chowdhery et al. 2022, section 5), which pulls the softmax normaliser towards 1 so the
    logits cannot drift. Both come from one logsumexp, and the gradient of any weighting of the
    two is one fused pass: d ce = (softmax - onehot) / n, d z = 2 coef lse softmax / n."""
    return _cross_entropy_and_z_fwd(logits, targets, coef)[0]


def _cross_entropy_and_z_fwd(logits, targets, coef):
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return (jnp.mean(lse - picked), coef * jnp.mean(lse * lse)), (logits, targets, lse)


def _cross_entropy_and_z_bwd(coef, saved, g):
    logits, targets, lse = saved
    g_ce, g_z = g
    onehot = targets[..., None] == jnp.arange(logits.shape[-1], dtype=targets.dtype)
    softmax = jnp.exp(logits - lse[..., None])
    weight = (g_ce + 2 * coef * g_z * lse[..., None]) / targets.size  # softmax's factor, per position
    return softmax * weight - onehot * (g_ce / targets.size), None


cross_entropy_and_z.defvjp(_cross_entropy_and_z_fwd, _cross_entropy_and_z_bwd)


def loss_fn(params, batch, model_cfg: ModelConfig):
    """Mean next-token cross-entropy (nats) over every position of the batch, in float32."""
    return cross_entropy(forward(params, batch[:, :-1], model_cfg), batch[:, 1:])


@dataclasses.dataclass(frozen=True)
class NextToken:
    """Pretraining's objective: next-token cross-entropy on an int32 [B, T + 1] batch.
    Post-training's objectives (training/posttrain.py) have the same two methods' shape:
    `loss(params, batch, model_cfg) -> (loss, metrics)` on their dict batches.

    How the forward runs (`attention`: a form `attention_form` resolved; `remat`) changes no
    math. `eos_id` set: document masking (segments from the EOS tokens of the inputs). `z_loss`
    > 0: the loss trained on is the cross-entropy plus the z term, and the metrics report both,
    `loss` the cross-entropy alone (comparable with runs without it, and with the validation
    loss) and `z_loss` the weighted term. The defaults are `loss_fn`, bit for bit."""

    attention: str = "query_blocks"
    remat: str = "none"
    eos_id: int | None = None
    z_loss: float = 0.0

    name = "next_token"

    def loss(self, params, batch, model_cfg: ModelConfig):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        segments = None if self.eos_id is None else segment_ids(inputs, self.eos_id)
        logits = forward(params, inputs, model_cfg, attention=self.attention, remat=self.remat, segments=segments)
        if self.z_loss == 0:
            return cross_entropy(logits, targets), {}
        ce, z = cross_entropy_and_z(logits, targets, self.z_loss)
        return ce + z, {"loss": ce, "z_loss": z}


NEXT_TOKEN = NextToken()


_DETERMINISM_FLAGS = (DETERMINISTIC_GPU_FLAG, "--xla_gpu_exclude_nondeterministic_ops=true")


def xla_gpu_deterministic() -> bool:
    """Whether this process's XLA_FLAGS ask XLA for deterministic GPU programs."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return any(flag in flags for flag in _DETERMINISM_FLAGS)


def attention_form(choice: str, model_cfg: ModelConfig, platform: str) -> str:
    """`train.attention` resolved for a platform (jax.devices()[0].platform): query_blocks,
    fused_xla or fused_cudnn. auto is kiln's query blocks on a CPU, where they are fastest
    (benchmarks/RESULTS.md), and the fused form elsewhere: cuDNN's flash attention on a GPU where
    cuDNN takes the shapes (bfloat16, head_dim a multiple of 8 up to 128), XLA's otherwise.

    Not cuDNN's under XLA's determinism flag: on an H200 with JAX 0.11.2, a step holding cuDNN's
    flash attention compiled with the flag and then stopped at its first run with
    `IndexError: absl::container_internal::raw_hash_map<>::at`, a bare JAX loop too; query blocks
    ran (benchmarks/RESULTS.md, the first GPU check). There auto is query blocks (bitwise
    reproducible, 0.68x cuDNN's tokens/s on small_gpu) and fused is XLA's.

    A model with `attn_logit_softcapping` (Gemma 2) attends in query blocks: neither fused form
    caps its scores."""
    if model_cfg.attn_logit_softcapping is not None:
        if choice == "fused":
            raise ValueError("train.attention fused: jax.nn.dot_product_attention has no soft cap, and "
                             "model.attn_logit_softcapping is set; use auto or query_blocks")
        return "query_blocks"
    if choice == "query_blocks" or (choice == "auto" and platform == "cpu"):
        return "query_blocks"
    if platform == "gpu" and xla_gpu_deterministic():
        return "query_blocks" if choice == "auto" else "fused_xla"
    cudnn = (platform == "gpu" and model_cfg.compute_dtype == "bfloat16"
             and model_cfg.head_dim % 8 == 0 and model_cfg.head_dim <= 128)
    return "fused_cudnn" if cudnn else "fused_xla"


def next_token(model_cfg: ModelConfig, train_cfg: TrainConfig, platform: str | None = None) -> NextToken:
    """Pretraining's objective as `train` configures it, on `platform` (None: JAX's default)."""
    if train_cfg.document_mask and train_cfg.eos_id is None:
        raise ValueError("train.document_mask needs the EOS id that separates the documents: train.eos_id (the "
                         "train step fills it in from its tokens; a caller of training.loop.train sets it)")
    return NextToken(attention_form(train_cfg.attention, model_cfg, platform or jax.default_backend()),
                     train_cfg.remat, train_cfg.eos_id if train_cfg.document_mask else None, train_cfg.z_loss)


def compiler_options(train_cfg: TrainConfig, platform: str | None = None) -> dict | None:
    """XLA options the train step compiles with: `lowered.compile(compiler_options=...)`.

    With remat on a CPU, XLA's CPU pipeline drops the optimisation barriers that jax.checkpoint
    places (its pass cse_barrier_expander) before it schedules, and then runs the recomputation
    during the forward pass, where it saves nothing: an 8-layer test model's step kept 57.5 MB of
    temporaries with full remat against 60.5 MB without, and 9.8 MB with that pass left out, the
    same gradients bit for bit. GPU and TPU pipelines keep the barriers; nothing to set there."""
    if train_cfg.remat != "none" and (platform or jax.default_backend()) == "cpu":
        return {"xla_disable_hlo_passes": "cse_barrier_expander"}
    return None


def how_it_runs(model_cfg: ModelConfig, train_cfg: TrainConfig) -> dict:
    """The attention form and remat a run used, for its stats and lineage (never its version):
    pretraining's and post-training's alike (`step_objective`)."""
    return {"attention": attention_form(train_cfg.attention, model_cfg, jax.default_backend()),
            "remat": train_cfg.remat}


def check_objective_options(train_cfg: TrainConfig, objective) -> None:
    """Refuse for post-training's objectives (their rows packed conversations, or padded pairs)
    the options only pretraining's next-token objective has."""
    if objective is None or isinstance(objective, NextToken):
        return
    set_here = train_cfg.pretraining_only()
    if set_here:
        raise ValueError(f"train: {', '.join(set_here)}: only pretraining's next-token objective takes that, not "
                         f"the {objective.name} objective: leave it out")


@dataclasses.dataclass(frozen=True)
class PostTraining:
    """A post-training objective (training/posttrain.py: SFT's, DPO's) computed with the forward
    `train` configures (its attention form and remat), which changes how it runs, not what: so
    an 8B SFT or DPO can rematerialise its activations as pretraining does. The objective alone
    is what a checkpoint's identity records."""

    objective: object
    attention: str
    remat: str

    @property
    def name(self) -> str:
        return self.objective.name

    def loss(self, params, batch, model_cfg: ModelConfig):
        return self.objective.loss(params, batch, model_cfg, attention=self.attention, remat=self.remat)


def tokens_per_step(model_cfg: ModelConfig, train_cfg: TrainConfig, objective=None) -> int:
    """The tokens one optimizer step computes on: batch_size rows of seq_len, each holding the
    objective's sequences (DPO's two: chosen and rejected)."""
    return train_cfg.batch_size * model_cfg.seq_len * (objective.sequences_per_row() if objective is not None else 1)


def step_objective(model_cfg: ModelConfig, train_cfg: TrainConfig, objective=None, platform: str | None = None):
    """What a train step computes: pretraining's objective as `train` configures it (None), one
    given as it is (a NextToken), or a post-training objective with train's forward options."""
    check_objective_options(train_cfg, objective)
    if objective is None:
        return next_token(model_cfg, train_cfg, platform)
    if isinstance(objective, NextToken):
        return objective
    return PostTraining(objective, attention_form(train_cfg.attention, model_cfg, platform or jax.default_backend()),
                        train_cfg.remat)


def interleaved(batch, n: int):
    """Every array of a batch [B, ...] as n parts [n, B/n, ...], part i holding rows i, i+n, i+2n, ...:
    each device's contiguous slice of a batch sharded on `data` then holds rows of every part, so
    taking a part moves nothing between devices. Microbatches and `train.batch_parts` split so."""
    return jax.tree_util.tree_map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1), batch)


def make_train_step(model_cfg: ModelConfig, train_cfg: TrainConfig,
                    optimizer: optax.GradientTransformation, objective=None) -> Callable:
    """The step body, to be wrapped by `jax.jit` with shardings and `donate_argnums=0`: one for
    pretraining, SFT and DPO, with or without LoRA. `objective` (None: next-token pretraining)
    gives the loss and its metrics, averaged like the loss and returned beside it. What trains is
    the state's `params`, or with `train.lora` its `adapters` (the loss is then the merged
    model's, and `params` stay as they are). The learning rate is the schedule at the state's
    own step counter (training/optim.py), the one counter a new phase resets. Without an
    objective, pretraining's is built from `train_cfg` (`next_token`: attention form, remat,
    document masking, z-loss) for JAX's default platform. The gradient is the mean over
    `train.microbatches` accumulated one after another, each the mean over `train.batch_parts`
    computed side by side."""
    objective = step_objective(model_cfg, train_cfg, objective)
    lora = train_cfg.lora
    trained = trained_key(lora)

    def loss(trainable, frozen, batch):
        params = trainable if lora is None else merged(frozen, trainable, lora)
        return objective.loss(params, batch, model_cfg)

    value_and_grad = jax.value_and_grad(loss, has_aux=True)
    update = make_update(train_cfg, optimizer)
    M, P = train_cfg.microbatches, train_cfg.batch_parts

    def grad_fn(trainable, frozen, batch):
        if P == 1:
            return value_and_grad(trainable, frozen, batch)
        # P independent computations in one program: nothing orders one part's ops before
        # another's, so XLA's CPU runtime runs them on separate threads (`train.batch_parts`).
        parts = interleaved(batch, P)
        outs = [value_and_grad(trainable, frozen, jax.tree_util.tree_map(lambda x: x[p], parts)) for p in range(P)]
        return jax.tree_util.tree_map(lambda *xs: functools.reduce(jnp.add, xs) / P, *outs)

    def gradients(trainable, frozen, batch):
        if M == 1:
            return grad_fn(trainable, frozen, batch)
        micro = interleaved(batch, M)

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
        return update(state, rng, loss_value, aux, grads)

    return train_step


def make_update(train_cfg: TrainConfig, optimizer: optax.GradientTransformation) -> Callable:
    """(state, next rng, loss, aux, gradients) -> (state, metrics): the optimizer's step at the
    schedule's learning rate, the tail of every train step (one program or split)."""
    schedule = lr_schedule(train_cfg)
    trained = trained_key(train_cfg.lora)

    def update(state: dict, rng, loss_value, aux: dict, grads):
        lr = schedule(state["step"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state[trained])
        new = optax.apply_updates(state[trained], scaled(updates, lr))
        # An objective may report its own `loss` in aux, overriding the one trained on (next-token with
        # z-loss: the cross-entropy without the z term).
        metrics = {"loss": loss_value, "grad_norm": optax.tree.norm(grads), "lr": lr, **aux}
        state = {**state, "step": state["step"] + 1, trained: new, "opt_state": opt_state, "rng": rng}
        if train_cfg.ema is not None:
            state["ema"] = ema_update(state["ema"], new, ema_decay(train_cfg, state["step"]))
        return state, metrics

    return update


def make_split_step(model_cfg: ModelConfig, train_cfg: TrainConfig, optimizer: optax.GradientTransformation,
                    objective=None) -> tuple[Callable, Callable]:
    """`train.split_parts`: the step as separate programs, (part_grads, apply), each to be jitted.
    part_grads(params, batch, p) -> ((loss, aux), gradients) of part p of the batch (rows p, p+P,
    ..., as `interleaved`); apply(state, [part_grads' output for p in 0..P-1]) -> (state, metrics)
    averages them as the one-program step does and takes the optimizer's step (state donated).
    JAX dispatches asynchronously, so the parts' programs are in flight at once and XLA's CPU
    runtime runs each on its own thread, where one program's ops ran on one thread for stretches
    (benchmarks/RESULTS.md, session 18's profile). Pretraining, no LoRA, one microbatch: another
    objective is refused as make_train_step refuses it (`check_objective_options`)."""
    objective = step_objective(model_cfg, train_cfg, objective)
    value_and_grad = jax.value_and_grad(lambda params, batch: objective.loss(params, batch, model_cfg), has_aux=True)
    update = make_update(train_cfg, optimizer)
    P = train_cfg.batch_parts

    def part_grads(params, batch, p):
        return value_and_grad(params, jax.tree_util.tree_map(lambda x: x[p], interleaved(batch, P)))

    def apply(state: dict, outs: list):
        rng, _step_key = jax.random.split(state["rng"])
        (loss_value, aux), grads = jax.tree_util.tree_map(lambda *xs: functools.reduce(jnp.add, xs) / P, *outs)
        return update(state, rng, loss_value, aux, grads)

    return part_grads, apply


def make_eval_step(model_cfg: ModelConfig, objective=None, train_cfg: TrainConfig | None = None) -> Callable:
    """params, batch -> mean validation loss (the objective's, when given); wrap in `jax.jit`.
    With `train_cfg` and no objective, pretraining's as `next_token` configures it, the z term
    left out: the validation loss is the cross-entropy, with or without z-loss."""
    if train_cfg is None:
        objective = objective or NEXT_TOKEN
    elif objective is None:
        objective = dataclasses.replace(next_token(model_cfg, train_cfg), z_loss=0.0)
    else:
        objective = step_objective(model_cfg, train_cfg, objective)
    return lambda params, batch: objective.loss(params, batch, model_cfg)[0]
