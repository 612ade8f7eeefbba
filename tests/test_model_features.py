"""The training features for 1B-8B runs: rematerialisation, fused attention, document masking and
z-loss. Each changes how the step runs or what it trains on only when set; by default the step,
its loss and its version are what they were."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tasks.train
from tasks.engine.step import Step
from tasks.tokenize import TokenizeConfig
from tasks.train import train_step
from training.config import LongRopeScaling, ModelConfig, ResourcesConfig, TrainConfig
from training.model import causal_attention, document_positions, forward, fused_attention, init_params, segment_ids
from training.optim import make_optimizer
from training.step import (NextToken, attention_form, compiler_options, cross_entropy_and_z, init_state, loss_fn, make_train_step,
                           next_token)

CFG = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, seq_len=32)


@functools.cache
def shared_params() -> dict:
    """CFG's parameters, made on first use, not at collection (an eager flax init: ~4 s)."""
    return init_params(CFG, jax.random.PRNGKey(0))


@functools.cache
def shared_batch() -> jax.Array:
    return jax.random.randint(jax.random.PRNGKey(1), (4, CFG.seq_len + 1), 0, CFG.vocab_size)


def loss_and_grads(objective: NextToken, tokens=None, cfg=CFG):
    """The loss and gradients of `objective` at shared_params(), on `tokens` (default shared_batch())."""
    tokens = shared_batch() if tokens is None else tokens
    return jax.jit(jax.value_and_grad(lambda p, b: objective.loss(p, b, cfg)[0]))(shared_params(), tokens)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# --- rematerialisation -----------------------------------------------------------------------


@pytest.mark.parametrize("remat", ["full", "dots_saveable", "offload"])
def test_remat_gives_the_gradients_of_no_remat(remat):
    loss, grads = loss_and_grads(NextToken())
    remat_loss, remat_grads = loss_and_grads(NextToken(remat=remat))
    assert float(remat_loss) == pytest.approx(float(loss), rel=1e-6)
    assert_trees_close(remat_grads, grads)
    # the parameter tree keeps its names: the same params apply to a rematerialised model
    assert jax.tree_util.tree_structure(remat_grads) == jax.tree_util.tree_structure(shared_params())


def compiled_temp_bytes(model_cfg: ModelConfig, train_cfg: TrainConfig) -> int:
    optimizer = make_optimizer(train_cfg)
    state = jax.eval_shape(lambda: init_state(model_cfg, optimizer, jax.random.PRNGKey(0)))
    batch = jax.ShapeDtypeStruct((train_cfg.batch_size, model_cfg.seq_len + 1), jnp.int32)
    step = jax.jit(make_train_step(model_cfg, train_cfg, optimizer), donate_argnums=0)
    compiled = step.lower(state, batch).compile(compiler_options=compiler_options(train_cfg))
    return compiled.memory_analysis().temp_size_in_bytes


def test_full_remat_lowers_the_compiled_steps_temporary_bytes():
    model = CFG.model_copy(update={"n_layers": 4, "seq_len": 128})
    train = TrainConfig(batch_size=8, steps=10, warmup=1)
    none = compiled_temp_bytes(model, train)
    full = compiled_temp_bytes(model, train.model_copy(update={"remat": "full"}))
    assert full < 0.5 * none, (none, full)


# --- attention by platform -------------------------------------------------------------------


def test_attention_form_by_platform(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    bf16 = CFG.model_copy(update={"compute_dtype": "bfloat16"})
    assert attention_form("auto", CFG, "cpu") == "query_blocks"
    assert attention_form("auto", bf16, "gpu") == "fused_cudnn"
    assert attention_form("auto", CFG, "gpu") == "fused_xla"  # cuDNN's flash attention takes no float32
    assert attention_form("auto", bf16, "tpu") == "fused_xla"
    assert attention_form("fused", CFG, "cpu") == "fused_xla"
    assert attention_form("query_blocks", bf16, "gpu") == "query_blocks"
    assert next_token(CFG, TrainConfig()).attention == "query_blocks"  # auto, on this CPU


@pytest.mark.parametrize("flag", ["--xla_gpu_deterministic_ops=true", "--xla_gpu_exclude_nondeterministic_ops=true"])
def test_no_cudnn_attention_under_xla_determinism(monkeypatch, flag):
    """cuDNN's flash attention stopped a deterministic step at its first run on an H200 (JAX 0.11.2),
    so under either determinism flag a GPU gets query blocks (auto) or XLA's fused form (fused)."""
    bf16 = CFG.model_copy(update={"compute_dtype": "bfloat16"})
    monkeypatch.setenv("XLA_FLAGS", f"--xla_gpu_autotune_level=2 {flag}")
    assert attention_form("auto", bf16, "gpu") == "query_blocks"
    assert attention_form("fused", bf16, "gpu") == "fused_xla"
    assert attention_form("auto", bf16, "tpu") == "fused_xla"
    assert attention_form("auto", CFG, "cpu") == "query_blocks"
    monkeypatch.setenv("XLA_FLAGS", flag.replace("=true", "=false"))
    assert attention_form("auto", bf16, "gpu") == "fused_cudnn"


@pytest.mark.parametrize("T", [32, 200])  # one query block, and four uneven ones
def test_fused_and_query_block_attention_agree(T):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(2), 3)
    q = jax.random.normal(kq, (2, T, 4, 16))
    k, v = jax.random.normal(kk, (2, T, 2, 16)), jax.random.normal(kv, (2, T, 2, 16))
    segments = jnp.asarray(np.repeat([[0, 1, 2], [0, 0, 1]], [T // 3, T // 3, T - 2 * (T // 3)], axis=1))
    fused = jax.jit(lambda q, k, v, seg, window: fused_attention(q, k, v, seg, "xla", window), static_argnums=4)
    blocks = jax.jit(causal_attention, static_argnums=4)
    w = T // 3 + 1  # a sliding window, across the query blocks' edges at T = 200
    for seg in (None, segments):
        for window in (None, w):
            np.testing.assert_allclose(fused(q, k, v, seg, window), blocks(q, k, v, seg, window), rtol=1e-5, atol=1e-5)
    # the window is a window: the last query's output moves with the key at its far end, not with the one before
    last = lambda k: blocks(q, k, v, None, w)[:, -1]  # noqa: E731
    assert not np.allclose(last(k.at[:, T - w].add(1.0)), last(k))
    np.testing.assert_array_equal(last(k.at[:, T - w - 1].add(1.0)), last(k))
    if T == 200:  # and the query blocks skip the keys before their rows' windows: 19100 of 25000 row-keys multiplied
        flops = lambda window: blocks.lower(q, k, v, None, window).compile().cost_analysis()["flops"]  # noqa: E731
        assert flops(w) < 0.9 * flops(None)  # 0.84 here: the matmuls at 0.76, the rest as a full layer


def test_fused_attention_gives_the_loss_and_gradients_of_query_blocks():
    loss, grads = loss_and_grads(NextToken())
    fused_loss, fused_grads = loss_and_grads(NextToken(attention="fused_xla"))
    assert float(fused_loss) == pytest.approx(float(loss), rel=1e-6)
    assert_trees_close(fused_grads, grads)
    eos = 5
    loss, grads = loss_and_grads(NextToken(eos_id=eos), packed_batch(eos))
    fused_loss, fused_grads = loss_and_grads(NextToken(attention="fused_xla", eos_id=eos), packed_batch(eos))
    assert float(fused_loss) == pytest.approx(float(loss), rel=1e-6)
    assert_trees_close(fused_grads, grads)


# --- document masking ------------------------------------------------------------------------


def packed_batch(eos: int) -> jax.Array:
    """shared_batch() with an EOS in each row, so that every row holds two or three documents."""
    b = np.asarray(shared_batch()).copy()
    b[b == eos] = eos + 1
    b[0, 10], b[1, 3], b[1, 20], b[2, 31], b[3, 0] = eos, eos, eos, eos, eos
    return jnp.asarray(b)


def test_segment_ids_and_positions_restart_after_each_eos():
    tokens = jnp.asarray([[7, 8, 2, 9, 9, 2, 2, 4]])
    segments = segment_ids(tokens, eos_id=2)
    assert segments.tolist() == [[0, 0, 0, 1, 1, 1, 2, 3]]  # an EOS ends its own document
    assert document_positions(segments).tolist() == [[0, 1, 2, 0, 1, 2, 0, 0]]


@pytest.mark.parametrize("attention", ["query_blocks", "fused_xla"])
def test_two_packed_documents_give_the_losses_of_each_alone(attention):
    eos = 3
    rng = np.random.default_rng(0)
    first = np.concatenate([rng.integers(4, 97, 11), [eos]])  # a document as tokenized: tokens then EOS
    second = rng.integers(4, 97, CFG.seq_len + 1 - len(first))
    packed = np.concatenate([first, second])[None].astype(np.int32)

    params = shared_params()  # made here, not first inside the trace below (the cache would keep a tracer)

    @jax.jit
    def losses(tokens, segments):
        logits = forward(params, tokens[:, :-1], CFG, attention=attention, segments=segments)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]

    def per_token(tokens, segments=None):
        return losses(jnp.asarray(tokens), segments)

    together = per_token(packed, segment_ids(jnp.asarray(packed[:, :-1]), eos))[0]
    # the first document's positions predict up to the second's first token (its EOS predicts it)
    alone_first = per_token(packed[:, :len(first) + 1])[0]
    alone_second = per_token(second[None].astype(np.int32))[0]
    np.testing.assert_allclose(together[:len(first)], alone_first, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(together[len(first):], alone_second, rtol=1e-5, atol=1e-5)
    unmasked = per_token(packed)[0]  # without the mask the second document sees the first
    assert not np.allclose(unmasked[len(first):], alone_second, atol=1e-3)


def test_document_mask_needs_an_eos_id():
    with pytest.raises(ValueError, match="train.eos_id"):
        next_token(CFG, TrainConfig(document_mask=True))
    assert next_token(CFG, TrainConfig(document_mask=True, eos_id=3)).eos_id == 3
    assert next_token(CFG, TrainConfig(eos_id=3)).eos_id is None  # off by default, whatever eos_id says


def test_new_fields_leave_default_versions_as_they_were(monkeypatch):
    tokens = Step(name="tokens", stage="tokenize", stage_version=1, config=TokenizeConfig(), run=lambda ctx: {})

    def version(model=ModelConfig(), **train):
        return train_step(model, TrainConfig(**train), ResourcesConfig(), tokens=tokens).version

    current = version()
    monkeypatch.setattr(tasks.train, "STAGE_VERSION", 4)  # the train stage's version when this hash was taken
    assert version() == "e2567bc643e2"  # the version of this config before these fields existed (git d298e09)
    monkeypatch.undo()
    assert version() == current != "e2567bc643e2"  # a later stage version moves it
    assert version(attention="fused", eos_id=50256) == version()  # settings
    for identity in ({"remat": "full"}, {"document_mask": True}, {"z_loss": 1e-4}, {"optimizer": "muon"},
                     {"muon_momentum": 0.9}, {"ema": 0.99}):
        assert version(**identity) != version(), identity
    assert version(schedule="wsd", decay_shape="sqrt") != version(schedule="wsd") == version(
        schedule="wsd", decay_shape="linear")
    for shape in ({"qk_norm": "head"}, {"norm_position": "post"}, {"head_width": 64}, {"sliding_window": 64},
                  {"norm_position": "both"}, {"activation": "gelu_tanh"}, {"scale_embeddings": True},
                  {"query_pre_attn_scalar": 64}, {"rotary_layers": (True, True, True, False)},
                  {"sliding_window": 64, "sliding_rope_theta": 1e3}, {"attn_logit_softcapping": 50.0},
                  {"final_logit_softcapping": 30.0}, {"rotary_width": 16}, {"embedding_multiplier": 12.0},
                  {"residual_multiplier": 0.22}, {"attention_multiplier": 0.01}, {"logits_scaling": 8.0}):
        assert version(ModelConfig(**shape)) != version(), shape
    assert version(ModelConfig(sliding_window=64, sliding_rope_theta=1e3)) != version(ModelConfig(sliding_window=64))
    # rope_scaling: a dict with rope_type yarn is YaRN's, one without Llama 3.1's (whose versions stay)
    yarn = ModelConfig(rope_scaling={"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 64})
    llama3 = ModelConfig(rope_scaling={"factor": 4, "original_max_position_embeddings": 64})
    assert type(yarn.rope_scaling).__name__ == "YarnScaling" and type(llama3.rope_scaling).__name__ == "RopeScaling"
    linear = ModelConfig(rope_scaling={"rope_type": "linear", "factor": 4})
    assert type(linear.rope_scaling).__name__ == "LinearScaling"
    longrope = ModelConfig(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
                                         "original_max_position_embeddings": 64, "factor": 4})
    assert type(longrope.rope_scaling).__name__ == "LongRopeScaling"
    assert len({version(yarn), version(llama3), version(linear), version(longrope), version()}) == 5


# --- z-loss ----------------------------------------------------------------------------------


def test_cross_entropy_and_z_gives_autodiffs_numbers():
    logits = 3 * jax.random.normal(jax.random.PRNGKey(3), (2, 5, 11))
    targets = jax.random.randint(jax.random.PRNGKey(4), (2, 5), 0, 11)
    coef, w = 1e-2, 0.7  # any weighting of the two outputs

    def direct(x):
        lse = jax.nn.logsumexp(x, axis=-1)
        ce = optax.softmax_cross_entropy_with_integer_labels(x, targets).mean()
        return ce, coef * jnp.mean(lse**2)

    ce, z = cross_entropy_and_z(logits, targets, coef)
    want_ce, want_z = direct(logits)
    assert float(ce) == pytest.approx(float(want_ce), rel=1e-6) and float(z) == pytest.approx(float(want_z), rel=1e-6)
    got = jax.grad(lambda x: (lambda c, z: c + w * z)(*cross_entropy_and_z(x, targets, coef)))(logits)
    want = jax.grad(lambda x: (lambda c, z: c + w * z)(*direct(x)))(logits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_z_loss_is_logged_beside_the_cross_entropy_and_zero_changes_no_bit():
    train = TrainConfig(batch_size=4, steps=10, warmup=1)
    optimizer = make_optimizer(train)
    state = init_state(CFG, optimizer, jax.random.PRNGKey(0))

    def step(cfg):
        return jax.jit(make_train_step(CFG, cfg, optimizer))(state, shared_batch())

    plain_state, plain = step(train)
    assert "z_loss" not in plain
    direct = jax.jit(loss_fn, static_argnums=2)(state["params"], shared_batch(), CFG)
    assert float(plain["loss"]) == float(direct)  # bitwise

    coef = 1e-2
    z_state, zed = step(train.model_copy(update={"z_loss": coef}))
    lse = jax.nn.logsumexp(forward(state["params"], shared_batch()[:, :-1], CFG), axis=-1)
    assert float(zed["z_loss"]) == pytest.approx(coef * float(jnp.mean(lse**2)), rel=1e-5)
    assert float(zed["loss"]) == float(plain["loss"])  # the logged loss stays the cross-entropy
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(z_state["params"]),
                                                        jax.tree_util.tree_leaves(plain_state["params"]))]
    assert any(moved)  # and the z term is trained on


def test_sliding_window_layers_are_checked():
    olmo3 = ModelConfig(n_layers=4, sliding_window=8, layer_types=("sliding_attention",) * 3 + ("full_attention",))
    assert [olmo3.layer_window(i) for i in range(4)] == [8, 8, 8, None]
    assert [ModelConfig(n_layers=2, sliding_window=8).layer_window(i) for i in range(2)] == [8, 8]  # Mistral's
    assert ModelConfig(n_layers=2).layer_window(1) is None
    with pytest.raises(ValueError, match="layer_types names 3 layers, but the model has n_layers=4"):
        ModelConfig(n_layers=4, sliding_window=8, layer_types=("full_attention",) * 3)
    with pytest.raises(ValueError, match="sliding_attention layers but sliding_window is not set"):
        ModelConfig(n_layers=1, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="rope_scaling applies to full-attention layers, and every layer slides"):
        ModelConfig(sliding_window=8, rope_scaling={"factor": 8})
    with pytest.raises(ValueError, match="rotary_layers names 2 layers, but the model has n_layers=4"):
        ModelConfig(n_layers=4, rotary_layers=(True, False))
    with pytest.raises(ValueError, match="sliding_rope_theta is the sliding layers' RoPE base, and no layer slides"):
        ModelConfig(n_layers=2, sliding_rope_theta=1e4)
    with pytest.raises(ValueError, match="attention_multiplier and query_pre_attn_scalar both scale the scores"):
        ModelConfig(attention_multiplier=0.1, query_pre_attn_scalar=64)
    with pytest.raises(ValueError, match="embedding_multiplier and scale_embeddings both scale the embeddings"):
        ModelConfig(embedding_multiplier=12.0, scale_embeddings=True)
    with pytest.raises(ValueError, match="residual_multiplier scales the sublayers of pre-norm blocks .*'post'"):
        ModelConfig(residual_multiplier=0.5, norm_position="post")
    assert ModelConfig(attention_multiplier=0.125).score_width == 64.0  # q.k / sqrt(64) = q.k * 0.125


# --- Phi-3's rotation: part of each head, LongRoPE ----------------------------------------------

LONGROPE = {"rope_type": "longrope", "short_factor": (1.0, 1.5, 3.0, 6.0, 10.0, 20.0),
            "long_factor": (1.3, 4.0, 9.0, 20.0, 40.0, 90.0), "original_max_position_embeddings": 8, "factor": 4.0}


def test_partial_rotary_and_longrope_are_checked():
    assert ModelConfig(rotary_width=12).rotary_dim == 12 and ModelConfig().rotary_dim == 32  # the head's width
    for width in (7, 32, 40):
        with pytest.raises(ValueError, match=f"rotary_width={width} must be even and below head_dim=32"):
            ModelConfig(rotary_width=width)
    with pytest.raises(ValueError, match="one short and one long factor per rotated pair of dimensions, 16; got 6"):
        ModelConfig(rope_scaling=LONGROPE)
    scaling = ModelConfig(rotary_width=12, rope_scaling=LONGROPE).rope_scaling
    assert scaling.attention_scale == pytest.approx(np.sqrt(1 + np.log(4) / np.log(8)))  # Phi-3's default
    assert scaling.model_copy(update={"attention_factor": 1.1}).attention_scale == 1.1


def test_longrope_picks_each_rows_factors_by_its_own_positions():
    """A row whose positions pass the original context (8) rotates with long_factor, one within it with
    short_factor, in the same batch: a prompt of 12 tokens and one of 5 (left-padded) prefilled
    together give, at their last tokens, the logits each gives alone (transformers would pick one
    set for the whole batch, by its largest position, and change the short prompt's answer)."""
    from training.model import decode_step, init_cache
    from training.model import forward as model_forward

    cfg = CFG.model_copy(update={"rotary_width": 12, "rope_scaling": LongRopeScaling(**LONGROPE)})
    params = shared_params()
    forward, decode = jax.jit(model_forward, static_argnums=2), jax.jit(decode_step, static_argnums=1)  # compiled once
    rows = np.asarray(shared_batch()[:2, :12], np.int32)
    long_alone = np.asarray(forward(params, rows[:1], cfg))[0, -1]
    short_alone = np.asarray(forward(params, rows[1:, :5], cfg))[0, -1]
    tokens = rows.copy()
    tokens[1, :7], tokens[1, 7:] = 0, rows[1, :5]  # left-padded to 12
    positions = np.stack([np.arange(12), np.r_[[-1] * 7, np.arange(5)]]).astype(np.int32)
    logits, _ = decode(params, cfg, jnp.asarray(tokens), init_cache(cfg, 2, 12), jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(logits[0, -1]), long_alone, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits[1, -1]), short_alone, rtol=1e-5, atol=1e-5)
    # and the tolerance above tells the two sets apart: the short prompt read with long_factor fails it
    as_long = np.asarray(forward(params, rows[1:, :5], cfg.model_copy(update={"rope_scaling": LongRopeScaling(
        **{**LONGROPE, "short_factor": LONGROPE["long_factor"]})})))[0, -1]
    assert not np.allclose(as_long, short_alone, rtol=1e-5, atol=1e-5)


# --- Gemma 2's soft caps -------------------------------------------------------------------------


def test_soft_capped_models_attend_in_query_blocks_and_every_logit_path_caps():
    """attn_logit_softcapping has no fused form: auto resolves to query blocks on every platform and
    an explicit fused choice is refused, as is a fused forward; the scorers' separate output layer
    (evaluation.scoring, behind lm-eval and the server) caps the logits as the forward does."""
    from evaluation.scoring import final_hidden, output_logits

    capped = CFG.model_copy(update={"attn_logit_softcapping": 0.5, "final_logit_softcapping": 0.7})
    for platform in ("cpu", "gpu", "tpu"):
        assert attention_form("auto", capped, platform) == "query_blocks"
    with pytest.raises(ValueError, match="dot_product_attention has no soft cap"):
        attention_form("fused", capped, "gpu")
    params, tokens = shared_params(), shared_batch()[:, :-1]
    with pytest.raises(ValueError, match="has no soft cap"):
        forward(params, tokens, capped, attention="fused_xla")
    logits = np.asarray(forward(params, tokens, capped))
    assert np.abs(logits).max() < 0.7  # capped, where the uncapped logits reach further
    assert np.abs(np.asarray(forward(params, tokens, CFG))).max() > 0.7
    np.testing.assert_allclose(np.asarray(output_logits(params, final_hidden(params, tokens, capped), capped)),
                               logits, rtol=1e-6, atol=1e-6)
    granite = CFG.model_copy(update={"logits_scaling": 8.0, "residual_multiplier": 0.5})  # and scales as it does
    scaled = np.asarray(forward(params, tokens, granite))
    np.testing.assert_allclose(np.asarray(output_logits(params, final_hidden(params, tokens, granite), granite)),
                               scaled, rtol=1e-6, atol=1e-6)
    unscaled = np.asarray(forward(params, tokens, granite.model_copy(update={"logits_scaling": None})))
    assert not np.allclose(scaled, unscaled, rtol=1e-3)
