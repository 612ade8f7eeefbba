"""Post-training: packing with loss masks, and the SFT and DPO objectives, over conversations
encoded by a chat template (kiln's, training.chat_template, or a checkpoint's own,
training.chat_jinja).

SFT learns only the assistant's words: every token carries a loss mask, 1 on the assistant's
content and its end-of-turn token, 0 on everything else (role tokens, system and user turns,
padding). Conversations are packed whole into rows of `seq_len + 1` tokens, EOS between them as
between pretraining documents; attention is not cut at conversation boundaries (as in
pretraining, where documents share a window too).

DPO (Rafailov et al. 2023) compares a chosen and a rejected answer to the same prompt:

    loss = -log sigmoid(beta * ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r))))

The reference model is frozen, so its log-probabilities are a property of the data: they are
computed once, before training (`reference_logprobs`, on the training's mesh a microbatch at a
time, so an 8B reference fits where its policy does), and travel in the batch. The jitted step
therefore stays `train_step(state, batch)`, the same one pretraining uses.

The objectives are small frozen dataclasses that `training.loop.train` takes as `objective`:
the loop asks them for the batch layout and the loss; everything else (sharding, checkpoints,
resume, Ray) is the pretraining machinery unchanged. No Prefect, no Ray here.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax.sharding import NamedSharding, PartitionSpec as P

from training.config import NOTES_LOGGER, MeshConfig, ModelConfig, TrainConfig
from training.model import forward, init_params
from training.sharding import make_mesh, put_batch, state_shardings

ROW_KEYS = ("inputs", "targets", "loss_mask")  # the arrays of a row (SFT) or of a pair's two rows (DPO)
notes = logging.getLogger(NOTES_LOGGER)  # the user sees these (training/config.py)


# --- packing ---------------------------------------------------------------------------------


def pack(examples: list[tuple[list[int], list[int]]], seq_len: int, eos_id: int) -> tuple[dict, int]:
    """Pack (ids, mask) conversations whole, in order, into rows of seq_len + 1 tokens.

    Each conversation is followed by EOS (mask 0). A conversation that does not fit in what is
    left of a row starts the next one; the rest of the row is EOS padding with mask 0. A
    conversation longer than a whole row is left out. Returns ({"inputs", "targets",
    "loss_mask"}: [N, seq_len] arrays; the mask is over targets) and the number left out.
    """
    width = seq_len + 1
    rows: list[tuple[list[int], list[int]]] = []
    ids_row: list[int] = []
    mask_row: list[int] = []
    dropped = 0
    for ids, mask in examples:
        ids, mask = list(ids) + [eos_id], list(mask) + [0]
        if len(ids) > width:
            dropped += 1
            continue
        if len(ids_row) + len(ids) > width:
            rows.append((ids_row, mask_row))
            ids_row, mask_row = [], []
        ids_row += ids
        mask_row += mask
    if ids_row:
        rows.append((ids_row, mask_row))
    if not rows:
        raise ValueError(f"no conversation fits in seq_len + 1 = {width} tokens ({dropped} left out): "
                         "shorten the conversations or use a model with a longer context")
    tokens = np.full((len(rows), width), eos_id, np.int32)
    masks = np.zeros((len(rows), width), np.int32)
    for r, (ids, mask) in enumerate(rows):
        tokens[r, :len(ids)], masks[r, :len(mask)] = ids, mask
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": masks[:, 1:]}, dropped


def pad_pairs(pairs: list[tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]], seq_len: int,
              eos_id: int) -> tuple[dict, int]:
    """(chosen, rejected) encoded conversations to {"inputs", "targets", "loss_mask"} [N, 2, seq_len],
    one row per side, EOS-padded. Pairs where either side exceeds seq_len + 1 tokens are left out."""
    width = seq_len + 1
    kept = [p for p in pairs if all(len(ids) + 1 <= width for ids, _ in p)]
    tokens = np.full((len(kept), 2, width), eos_id, np.int32)
    masks = np.zeros((len(kept), 2, width), np.int32)
    for i, pair in enumerate(kept):
        for side, (ids, mask) in enumerate(pair):
            tokens[i, side, :len(ids)], masks[i, side, :len(mask)] = ids, mask
    return {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "loss_mask": masks[..., 1:]}, len(pairs) - len(kept)


class RowBatches:
    """Batches of rows of a dict of arrays, in an order fixed by (seed, step), like the pretraining
    loader: batch `step` holds global rows step*B .. step*B + B - 1; global row g is row
    perm_e[g % N] of epoch e = g // N, perm_e seeded with (seed, e). `batch_at` is pure, so
    resuming at step k sees exactly the batches an uninterrupted run would."""

    def __init__(self, arrays: dict[str, np.ndarray], batch_size: int, seed: int):
        self.arrays, self.batch_size, self.seed = arrays, batch_size, seed
        self.n = len(next(iter(arrays.values())))
        if self.n == 0:
            raise ValueError("no rows to train on")
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)}
        return self._perms[epoch]

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        g = np.arange(step * self.batch_size, (step + 1) * self.batch_size)
        rows = np.array([self._perm(int(e))[int(i)] for e, i in zip(*np.divmod(g, self.n))])
        return {k: v[rows] for k, v in self.arrays.items()}


def fixed_batches(arrays: dict[str, np.ndarray], batch_size: int, max_batches: int) -> list[dict]:
    """The first `max_batches` full batches of rows in order (validation); a partial batch is left out."""
    n = len(next(iter(arrays.values())))
    return [{k: v[b * batch_size:(b + 1) * batch_size] for k, v in arrays.items()}
            for b in range(min(max_batches, n // batch_size))]


# --- losses ----------------------------------------------------------------------------------


def token_logprobs(params, inputs, targets, cfg: ModelConfig, *, attention: str = "query_blocks",
                   remat: str = "none"):
    """log p(target) at every position: inputs, targets [..., T] -> float32 [..., T]. `attention`
    and `remat` are the forward's (training/model.py): how it runs, not what it computes."""
    lead = inputs.shape[:-1]
    logits = forward(params, inputs.reshape(-1, inputs.shape[-1]), cfg, attention=attention, remat=remat)
    logp = -optax.softmax_cross_entropy_with_integer_labels(logits, targets.reshape(-1, targets.shape[-1]))
    return logp.reshape(*lead, -1)


def sft_loss(params, batch: dict, cfg: ModelConfig, **how):
    """Mean cross-entropy over the target tokens with loss_mask 1 (the assistant's), and their count
    (`how`: the forward's attention and remat, `token_logprobs`).

    `where`, not a product: a masked position contributes an exact zero and no gradient whatever
    its label, even if its log-probability were -inf."""
    mask = batch["loss_mask"] > 0
    logp = token_logprobs(params, batch["inputs"], batch["targets"], cfg, **how)
    n = jnp.maximum(mask.sum(), 1)
    return -jnp.where(mask, logp, 0.0).sum() / n, {"loss_tokens": mask.sum().astype(jnp.float32)}


def sequence_logprobs(params, batch: dict, cfg: ModelConfig, **how):
    """Sum of log p over the masked (answer) tokens of each sequence: [..., T] -> [...]."""
    logp = token_logprobs(params, batch["inputs"], batch["targets"], cfg, **how)
    return jnp.where(batch["loss_mask"] > 0, logp, 0.0).sum(-1)


def dpo_loss(params, batch: dict, cfg: ModelConfig, beta: float, sft_weight: float = 0.0, **how):
    """The DPO loss over [B, 2] (chosen, rejected) sequences against the reference log-probs in
    the batch; metrics: the reward margin beta * (chosen - rejected log-ratio) and accuracy.

    `sft_weight` > 0 adds that times the chosen answers' mean token NLL (RPO, Pang et al. 2024):
    DPO alone may lower the chosen answers' likelihood too, as long as the rejected fall faster."""
    logp = sequence_logprobs(params, batch, cfg, **how)  # [B, 2]
    ratio = logp - batch["ref_logp"]
    margin = beta * (ratio[:, 0] - ratio[:, 1])
    chosen_nll = -logp[:, 0].sum() / jnp.maximum((batch["loss_mask"][:, 0] > 0).sum(), 1)
    loss = -jax.nn.log_sigmoid(margin).mean() + sft_weight * chosen_nll
    return loss, {"margin": margin.mean(), "accuracy": (margin > 0).mean().astype(jnp.float32),
                  "chosen_reward": beta * ratio[:, 0].mean(), "rejected_reward": beta * ratio[:, 1].mean(),
                  "chosen_nll": chosen_nll}


def reference_pairs_per_call(train_cfg: TrainConfig, mesh) -> int:
    """The pairs the reference scores at once: a microbatch's, as the policy's forward takes them
    (so the two hold the same activations and logits), rounded up to split over `data`."""
    data = mesh.shape["data"]
    return -(-(train_cfg.batch_size // train_cfg.microbatches) // data) * data


def reference_program(cfg: ModelConfig, pairs_per_call: int, mesh, strategy: str, attention: str):
    """The frozen reference's scoring, jitted for the training's mesh: its parameters laid out as
    the policy's (train.mesh.strategy: FSDP spreads an 8B model over the devices), `pairs_per_call`
    pairs split on `data`, their [pairs, 2] log-probs replicated on every device (every host reads
    them whole). Returns the jitted function and its arguments, the parameters and the pairs, as
    abstract arrays with their shardings: `reference_logprobs` runs it, `kiln capacity` compiles
    it (training/capacity.py)."""
    abstract = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.PRNGKey(0))
    param_shardings = state_shardings({"params": abstract}, mesh, strategy)["params"]
    params = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                                    param_shardings)
    rows = NamedSharding(mesh, P("data", None, None))
    pairs = {k: jax.ShapeDtypeStruct((pairs_per_call, 2, cfg.seq_len), np.int32, sharding=rows) for k in ROW_KEYS}
    score = jax.jit(functools.partial(sequence_logprobs, cfg=cfg, attention=attention),
                    in_shardings=(param_shardings, rows), out_shardings=NamedSharding(mesh, P()))
    return score, params, pairs


def reference_logprobs(params, pairs: dict, cfg: ModelConfig, pairs_per_call: int, mesh=None, strategy: str = "dp",
                       attention: str = "query_blocks", what: str = "pairs", report_s: float = 30.0) -> np.ndarray:
    """[N, 2] float32 sequence log-probs of every pair under the frozen reference `params`, on
    `mesh` (default: every device, parameters replicated), `pairs_per_call` at a time, in the
    attention form the policy trains with: at the first step the two are the same model, and
    their log-ratio exactly 0 (on a deterministic platform). With several processes, every one
    calls it with the same pairs. An 8B reference over a preference set takes a good part of an
    hour: how far it is goes to `notes` every `report_s` seconds, and how long it took at the end
    (`what`: the pairs' name there)."""
    mesh = make_mesh(MeshConfig()) if mesh is None else mesh
    score, abstract, spec = reference_program(cfg, pairs_per_call, mesh, strategy, attention)
    placed = jax.tree_util.tree_map(lambda a, s: jax.device_put(np.asarray(a), s.sharding), params, abstract)
    n = len(pairs["inputs"])
    out = []
    began = said = time.monotonic()
    for start in range(0, n, pairs_per_call):
        chunk = {k: pairs[k][start:start + pairs_per_call] for k in ROW_KEYS}
        short = pairs_per_call - len(chunk["inputs"])
        if short:  # pad the last chunk so one compiled shape serves every call
            chunk = {k: np.concatenate([v, np.repeat(v[-1:], short, 0)]) for k, v in chunk.items()}
        chunk = {k: put_batch(v, spec[k].sharding) for k, v in chunk.items()}
        out.append(np.asarray(score(placed, chunk))[:pairs_per_call - short])
        done, now = start + len(out[-1]), time.monotonic()
        if now - said >= report_s and done < n:
            said = now
            notes.info("the reference model scored %d of %d %s in %.0f s (about %.0f s left)", done, n, what,
                       now - began, (now - began) / done * (n - done))
    notes.info("the reference model scored %d %s in %.1f s", n, what, time.monotonic() - began)
    return np.concatenate(out).astype(np.float32)


# --- the objectives the loop takes -----------------------------------------------------------


@dataclass(frozen=True)
class SFTObjective:
    """Masked next-token loss on packed conversations; batches {"inputs", "targets", "loss_mask"}."""

    name: str = "sft"

    def batch_spec(self, batch_size: int, seq_len: int) -> dict:
        return {k: ((batch_size, seq_len), np.int32) for k in ROW_KEYS}

    def loss(self, params, batch, cfg: ModelConfig, **how):
        return sft_loss(params, batch, cfg, **how)

    def sequences_per_row(self) -> int:
        return 1


@dataclass(frozen=True)
class DPOObjective:
    """DPO on (chosen, rejected) rows; batches {"inputs", "targets", "loss_mask"} [B, 2, T] and
    "ref_logp" [B, 2] (the frozen reference model's, from `reference_logprobs`)."""

    beta: float = 0.1
    sft_weight: float = 0.0
    name: str = "dpo"

    def batch_spec(self, batch_size: int, seq_len: int) -> dict:
        spec = {k: ((batch_size, 2, seq_len), np.int32) for k in ROW_KEYS}
        return {**spec, "ref_logp": ((batch_size, 2), np.float32)}

    def loss(self, params, batch, cfg: ModelConfig, **how):
        return dpo_loss(params, batch, cfg, self.beta, self.sft_weight, **how)

    def sequences_per_row(self) -> int:
        return 2


OBJECTIVES = {"sft": SFTObjective, "dpo": DPOObjective}  # by name: what `kiln capacity` plans


# --- data sources for training.launch (picklable; opened on each host) -----------------------


def save_rows(path, arrays: dict[str, np.ndarray]) -> None:
    """Rows for training, as an uncompressed .npz (the same arrays give the same file)."""
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def open_rows(work, train_name: str, eval_name: str, train_cfg: TrainConfig, reference_model=None):
    """A `training.launch.DataSource` body: (batch_at, val_batches) over rows the step saved in
    its work folder (`work`, a tasks.engine.store.Workspace, already pulled on this host), in
    batches of train.batch_size. With `reference_model` (a `Located` training output; DPO), the
    frozen model's log-probs of every pair are computed here, once, and added to the rows as
    "ref_logp": on the training's mesh, a microbatch's pairs at a time, in the attention form
    train.attention resolves to on this host, as the policy's (`reference_logprobs`)."""
    from training.loop import load_model  # here: training.loop imports this module's users
    from training.step import attention_form

    train, held = (dict(np.load(work.local() / name)) for name in (train_name, eval_name))
    if reference_model is not None:
        cfg, params = load_model(reference_model.local())
        mesh = make_mesh(train_cfg.mesh)
        attention = attention_form(train_cfg.attention, cfg, jax.default_backend())
        for rows, what in ((train, "training pairs"), (held, "held-out pairs")):
            if len(rows["inputs"]):
                rows["ref_logp"] = reference_logprobs(params, rows, cfg, reference_pairs_per_call(train_cfg, mesh),
                                                      mesh, train_cfg.mesh.strategy, attention, what)
            else:
                rows["ref_logp"] = np.zeros((0, 2), np.float32)
    return (RowBatches(train, train_cfg.batch_size, train_cfg.seed).batch_at,
            fixed_batches(held, train_cfg.batch_size, train_cfg.eval_batches))
