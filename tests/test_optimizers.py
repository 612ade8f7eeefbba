"""Muon (train.optimizer: muon): the decoder blocks' matrices step by their orthogonalised momentum
at AdamW's update size, everything else by AdamW exactly as an AdamW run would; a Muon run learns,
resumes from its checkpoint to the same bits, shards its moments like the parameters, and holds one
moment per block matrix where AdamW holds two."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from tests.test_training_kjv_data import WindowBatches, kjv_tokens, unigram_entropy
from tests.test_training_loop import REPO, run, tiny
from flows.capacity import capacity
from flows.experiment import load_experiment
from flows.config import load_config
from flows.plan import model_of
from training.capacity import plan, table
from training.config import KEPT_DIR, LoraConfig, MeshConfig, ModelConfig, TrainConfig
from training.loop import StartFrom, train
from training.optim import MUON_RMS, make_optimizer, muon_matrices
from training.scaling import plan_run
from training.step import init_state, loss_fn, make_train_step

CFG = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192, seq_len=32,
                  tie_embeddings=False)  # an output layer of its own: a matrix, but AdamW's
BLOCK = ("layers_1", "mlp", "up_proj", "kernel")  # a block matrix [64, 192]: Muon's
HEAD = ("lm_head", "kernel")  # AdamW's in both runs, as the embedding
BATCH = jax.random.randint(jax.random.PRNGKey(1), (4, CFG.seq_len + 1), 0, CFG.vocab_size)


def one_step(optimizer: str, **train) -> tuple[dict, dict]:
    """The parameters before and after one step from the same initial state (warmup 1: the first
    step's learning rate is `lr`)."""
    cfg = TrainConfig(batch_size=4, steps=10, warmup=1, grad_clip=0.0, optimizer=optimizer, **train)
    optimizer_ = make_optimizer(cfg)
    state = init_state(CFG, optimizer_, jax.random.PRNGKey(0))
    before = jax.tree_util.tree_map(np.asarray, state["params"])
    new, _ = jax.jit(make_train_step(CFG, cfg, optimizer_))(state, BATCH)
    return before, jax.tree_util.tree_map(np.asarray, new["params"])


def leaf(tree: dict, path: tuple[str, ...]) -> np.ndarray:
    for name in path:
        tree = tree[name]
    return tree


def test_muon_steps_block_matrices_by_their_orthogonalised_gradient_and_the_rest_by_adamw():
    lr = TrainConfig().lr
    before, adamw = one_step("adamw", weight_decay=0.0)
    _, muon = one_step("muon", weight_decay=0.0)
    labels = muon_matrices(before)
    assert leaf(labels, BLOCK) == "muon"
    assert leaf(labels, HEAD) == leaf(labels, ("embed_tokens", "embedding")) == "adamw"
    assert sorted(set(jax.tree_util.tree_leaves(labels))) == ["adamw", "muon"]
    assert sum(label == "muon" for label in jax.tree_util.tree_leaves(labels)) == 7 * CFG.n_layers  # q k v o, MLP's 3

    # embedding, norms: AdamW's step, to the bit
    for path, label in jax.tree_util.tree_leaves_with_path(labels):
        names = tuple(k.key for k in path)
        if label == "adamw":
            assert np.array_equal(leaf(muon, names), leaf(adamw, names)), names

    # a block matrix: its update is the gradient's polar factor (singular values ~1 after five
    # Newton-Schulz steps, where the gradient's spread far apart) times 0.2 sqrt(max(fan_in, fan_out)),
    # an RMS near AdamW's 0.2: so AdamW's lr carries over
    grad = np.asarray(leaf(jax.grad(loss_fn)(before, BATCH, CFG), BLOCK))
    update = (leaf(before, BLOCK) - leaf(muon, BLOCK)) / lr
    scale = MUON_RMS * np.sqrt(max(update.shape))
    singular = np.linalg.svd(update / scale, compute_uv=False)
    assert 0.5 < singular.min() and singular.max() < 1.5, singular
    grad_singular = np.linalg.svd(grad, compute_uv=False)
    assert grad_singular.max() / grad_singular.min() > 4 * singular.max() / singular.min()  # 13.5 against 1.66
    assert 0.1 < np.sqrt(np.mean(update**2)) < 0.3
    direct = scale * newton_schulz(grad)
    np.testing.assert_allclose(update, direct, atol=2e-3 * np.abs(direct).max())
    # and it is not AdamW's step
    assert not np.allclose(leaf(muon, BLOCK), leaf(adamw, BLOCK), atol=1e-6)


def newton_schulz(g: np.ndarray, steps: int = 5) -> np.ndarray:
    """Keller Jordan's quintic iteration towards g's polar factor, in float64: the step Muon's paper
    and modded-nanogpt take (the first step's Nesterov momentum is the gradient times a scalar,
    which the Frobenius normalisation drops)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.astype(np.float64) / np.linalg.norm(g)
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.T


def test_muons_weight_decay_is_decoupled_and_times_the_learning_rate():
    lr, decay = TrainConfig().lr, 0.1
    before, plain = one_step("muon", weight_decay=0.0)
    _, decayed = one_step("muon", weight_decay=decay)
    np.testing.assert_allclose(leaf(plain, BLOCK) - leaf(decayed, BLOCK), lr * decay * leaf(before, BLOCK),
                               rtol=1e-4, atol=1e-8)  # a few float32 steps of a weight near 0.02
    norm = ("layers_0", "input_layernorm", "weight")  # AdamW's part decays matrices only, as before
    assert np.array_equal(leaf(plain, norm), leaf(decayed, norm))


def test_muon_is_refused_with_lora():
    with pytest.raises(ValueError, match="LoRA's low-rank adapters train with adamw"):
        TrainConfig(optimizer="muon", lora=LoraConfig())
    # (test_model_features checks that the default version is unchanged and that muon's fields move it)


def test_a_muon_run_learns_and_resumes_from_its_checkpoint_to_the_same_bits(tmp_path):
    tokens, vocab = kjv_tokens()
    model, cfg = tiny(vocab, optimizer="muon", steps=40, checkpoint_every=20)
    first = run(tmp_path, model, cfg)
    assert first["final_loss"] < unigram_entropy(tokens) - 0.5

    folder = tmp_path / "work" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["20", "40"]
    shutil.rmtree(folder / "40")  # as if the run had died before its last save was written
    again = run(tmp_path, model, cfg)
    assert again["resumed_from_step"] == 20
    assert again["params_sha256"] == first["params_sha256"] and again["final_loss"] == first["final_loss"]


@pytest.mark.slow  # 12 s of two small trainings: CI runs it after the fast suite, as test_posttrain_steps'
@pytest.mark.ci
def test_sft_and_dpo_train_with_muon_too(tmp_path):
    """The optimizer is the loop's, whatever the objective: post-training with Muon learns."""
    from tests.test_posttrain_steps import setup
    for kind in ("sft", "dpo"):
        model, cfg, objective, start, batch_at, val = setup(kind)
        cfg = cfg.model_copy(update={"optimizer": "muon"})
        loss = jax.jit(objective.loss, static_argnums=2)
        start_val_loss = float(np.mean([loss(start, b, model)[0] for b in val]))
        stats = train(model, cfg, batch_at, val, tmp_path / kind / "work", tmp_path / kind / "out",
                      objective=objective, init_params=start)
        assert stats["final_val_loss"] < start_val_loss, kind


def test_an_adamw_checkpoint_does_not_continue_as_a_muon_run(tmp_path):
    """train.init continue/reset restore the optimizer state: Muon's is another tree, so the run
    says what to do instead of failing inside orbax."""
    tokens, vocab = kjv_tokens()
    model, cfg = tiny(vocab, steps=10, checkpoint_every=10, keep_checkpoints=(10,))
    run(tmp_path / "parent", model, cfg)
    _, muon = tiny(vocab, optimizer="muon", steps=20)
    data = WindowBatches(tokens, muon.batch_size, model.seq_len, seed=muon.seed)
    start = StartFrom(tmp_path / "parent" / "out" / KEPT_DIR / "10", 10, "continue")
    with pytest.raises(ValueError, match="same model and optimizer"):
        train(model, muon, data.batch_at, [], tmp_path / "work", tmp_path / "out", start_from=start)


def test_muon_holds_one_moment_per_block_matrix_where_adamw_holds_two():
    train = TrainConfig(batch_size=8, steps=10, warmup=1)
    adamw = plan(CFG, train, jax.devices()[:1])
    muon = plan(CFG, train.model_copy(update={"optimizer": "muon"}), jax.devices()[:1])
    block = sum(4 * leaf.size for leaf, label in zip(
        jax.tree_util.tree_leaves(jax.eval_shape(lambda: init_state(CFG, optax.identity(), jax.random.PRNGKey(0)))
                                  ["params"]),
        jax.tree_util.tree_leaves(muon_matrices(init_state(CFG, optax.identity(), jax.random.PRNGKey(0))["params"])))
        if label == "muon")
    # one float32 moment less per block matrix; Muon's own step count and its three Newton-Schulz coefficients more
    assert muon["optimizer_bytes"] == adamw["optimizer_bytes"] - block + 4 + 3 * 4
    assert muon["param_bytes"] == adamw["param_bytes"]


def test_the_planners_flop_count_takes_muons_update_once_however_many_microbatches():
    """XLA counts the microbatch loop's body once; the update after it (Newton-Schulz steps as
    many FLOPs as this small model's forward and backward) is counted once, not per microbatch."""
    train = TrainConfig(batch_size=8, steps=10, warmup=1, optimizer="muon")
    whole = plan(CFG, train, jax.devices()[:1])
    parts = plan(CFG, train.model_copy(update={"microbatches": 4}), jax.devices()[:1])
    assert parts["flops_per_step"] == whole["flops_per_step"]
    assert parts["compiler_flops"] == pytest.approx(whole["compiler_flops"], rel=0.05)


def test_kiln_capacity_plans_a_config_with_the_optimizer_set():
    r = capacity(str(REPO / "configs" / "tiny_cpu.yaml"), devices=1, targets=["h100-80gb"],
                 sets=["train.optimizer=muon"])
    assert r["optimizer"] == "muon" and "remat none, optimizer muon" in table(r)
    model = model_of(load_config(REPO / "configs" / "tiny_cpu.yaml"))
    params = jax.eval_shape(lambda: init_state(model, optax.identity(), jax.random.PRNGKey(0)))["params"]
    # one device: every moment whole; AdamW's two of the rest, Muon's one of each block matrix
    moments = sum(4 * p.size * (1 if label == "muon" else 2) for p, label in
                  zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(muon_matrices(params))))
    assert r["optimizer_bytes"] == moments + 4 + 4 + 3 * 4  # two step counts, the Newton-Schulz coefficients


def test_a_scaling_sweep_trains_every_run_with_the_optimizer_it_names():
    """`scaling.optimizer`: Muon's law beside AdamW's. Left out, the sweep's versions stay."""
    def plan_versions(*sets: str) -> dict[str, str]:
        return {s.name: s.version for s in load_experiment(REPO / "configs" / "scaling_cpu.yaml", sets).steps}

    adamw, muon = plan_versions(), plan_versions("scaling.optimizer=muon")
    assert plan_versions("scaling.optimizer=adamw") == adamw
    moved = {name.split("/")[0] for name in adamw if muon[name] != adamw[name]}
    kept = {name.split("/")[0] for name in adamw if muon[name] == adamw[name]}
    assert moved == {"train", "evaluate", "scaling_fit"} and "train" not in kept and "tokenize" in kept
    config = load_config(REPO / "configs" / "scaling_cpu.yaml", ["scaling.optimizer=muon"])
    run = plan_run(config.scaling.budgets[0], 4, config.scaling, 512)
    assert run.train.optimizer == "muon"


# Runs in a process with 4 CPU devices (XLA_FLAGS must be set before JAX starts).
CHILD = """
import json, sys
from pathlib import Path
import jax
from tests.test_training_sharding import configs, curve
from training.config import MeshConfig
from training.optim import make_optimizer
from training.sharding import make_mesh, state_shardings
from training.step import init_state

mesh = MeshConfig(strategy="fsdp")
out = {"n_devices": jax.device_count(), "fsdp": curve(Path(sys.argv[1]), mesh, optimizer="muon")}
model, cfg = configs(mesh, optimizer="muon")
abstract = jax.eval_shape(lambda k: init_state(model, make_optimizer(cfg), k), jax.random.PRNGKey(0))
sh = state_shardings(abstract, make_mesh(mesh), mesh.strategy)
moment = sh["opt_state"][1].inner_states["muon"].inner_state[0].mu["layers_0"]["mlp"]["up_proj"]["kernel"]
out["up_proj"] = list(sh["params"]["layers_0"]["mlp"]["up_proj"]["kernel"].spec)
out["up_proj_muon_mu"] = list(moment.spec)
print(json.dumps(out))
"""


# Out of the fast suite, as test_training_sharding's test: a fresh process of 4 devices; CI runs it
@pytest.mark.slow
@pytest.mark.ci
def test_a_muon_run_with_fsdp_on_4_devices_follows_one_device(tmp_path):
    from tests.test_training_sharding import curve
    reference = curve(tmp_path / "one", MeshConfig(), optimizer="muon")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "four")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["n_devices"] == 4 and out["fsdp"]["devices"] == 4
    np.testing.assert_allclose(out["fsdp"]["loss"], reference["loss"], rtol=2e-4)
    np.testing.assert_allclose(out["fsdp"]["val"], reference["val"], rtol=2e-4)
    assert reference["loss"][-1] < reference["loss"][0] - 1.0
    assert out["up_proj"] == [None, "data"] and out["up_proj_muon_mu"] == out["up_proj"]  # the moment follows
