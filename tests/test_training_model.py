"""The model, optimizer and step: HF Llama conventions, KV-cache decoding, FLOPs, schedules,
weight-decay mask, gradient accumulation, bf16 compute."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from training.config import LongRopeScaling, ModelConfig, TrainConfig, flops_per_token, model_and_train
from training.model import (cached_attention, causal_attention, decode_step, forward, init_cache,
                            init_params, param_count, project, query_blocks, ring_columns, swiglu, write_cache)
from training.optim import lr_schedule, make_optimizer, matrices_only
from training.posttrain import SFTObjective
from training.step import cross_entropy, init_state, loss_fn, make_train_step

CONFIGS = Path(__file__).parents[1] / "configs"

# jitted (configs are hashable, so static): op-by-op dispatch of a Flax model is slow
forward = jax.jit(forward, static_argnums=2)
loss_fn = jax.jit(loss_fn, static_argnums=2)

CFG = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, seq_len=16)


def reference_llama(p: dict, tokens: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """HF LlamaForCausalLM's forward written out in numpy, float64, from the param tree (with
    Qwen3's or OLMo 2's q/k norms, OLMo 2's norms after each sublayer, Gemma's norms before and after
    them, GeGLU, scaled embeddings, score scale and soft caps, sliding layers at their own RoPE base,
    SmolLM3's layers without positions, and Phi-3's partial rotary and LongRoPE (one row: its factors
    by the sequence's length), where the config has them)."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), p)
    B, T = tokens.shape
    H, K, Q = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def rms(x, w):
        return w * (x / np.sqrt((x**2).mean(-1, keepdims=True) + cfg.norm_eps))

    def cap(x, c):
        return x if c is None else c * np.tanh(x / c)

    def rope(x, theta):  # x [B, heads, T, Q]: Phi3's apply_rotary_pos_emb, the first R of Q rotated
        R, scaling, scale = cfg.rotary_dim, cfg.rope_scaling, 1.0
        inv_freq = 1.0 / theta ** (np.arange(0, R, 2) / R)
        if scaling is not None:  # LongRoPE (the only scaling these shapes use)
            inv_freq = inv_freq / np.array(scaling.long_factor if T > scaling.original_max_position_embeddings
                                           else scaling.short_factor)
            scale = np.sqrt(1 + np.log(scaling.factor) / np.log(scaling.original_max_position_embeddings))
        ang = np.arange(T)[:, None] * inv_freq[None]
        cos, sin = np.cos(np.concatenate([ang, ang], -1)) * scale, np.sin(np.concatenate([ang, ang], -1)) * scale
        part, rest = x[..., :R], x[..., R:]
        rotated = np.concatenate([-part[..., R // 2:], part[..., :R // 2]], -1)  # rotate_half
        return np.concatenate([part * cos + rotated * sin, rest], -1)

    x = p["embed_tokens"]["embedding"][tokens] * (np.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0)
    x = x * (cfg.embedding_multiplier or 1.0)  # Granite's
    residual = cfg.residual_multiplier or 1.0
    for i in range(cfg.n_layers):
        lp = p[f"layers_{i}"]
        a = lp["self_attn"]
        before = cfg.norm_position in ("pre", "both")  # Llama's norms on the sublayers' inputs (and Gemma's)
        after = cfg.norm_position in ("post", "both")  # OLMo 2's on their outputs (and Gemma's)
        h = rms(x, lp["input_layernorm"]["weight"]) if before else x
        q, k = h @ a["q_proj"]["kernel"], h @ a["k_proj"]["kernel"]
        if cfg.qk_norm == "projection":  # OLMo 2: q and k normalised whole
            q, k = rms(q, a["q_norm"]["weight"]), rms(k, a["k_norm"]["weight"])
        q, k = q.reshape(B, T, H, Q).transpose(0, 2, 1, 3), k.reshape(B, T, K, Q).transpose(0, 2, 1, 3)
        v = (h @ a["v_proj"]["kernel"]).reshape(B, T, K, Q).transpose(0, 2, 1, 3)
        if cfg.qk_norm == "head":  # Qwen3: each head of q and k normalised before the rotation
            q, k = rms(q, a["q_norm"]["weight"]), rms(k, a["k_norm"]["weight"])
        window = cfg.layer_window(i)
        if cfg.layer_rotates(i):
            theta = cfg.sliding_rope_theta if window and cfg.sliding_rope_theta else cfg.rope_theta
            q, k = rope(q, theta), rope(k, theta)
        k, v = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)  # HF repeat_kv
        visible = np.tril(np.ones((T, T), bool)) & (np.arange(T)[None] > np.arange(T)[:, None] - (window or T + 1))
        scale = cfg.attention_multiplier or 1 / np.sqrt(cfg.query_pre_attn_scalar or Q)  # Granite's, Gemma's, 1/sqrt(Q)
        s = cap(q @ k.transpose(0, 1, 3, 2) * scale, cfg.attn_logit_softcapping)
        s = np.where(visible, s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        o = (w / w.sum(-1, keepdims=True)) @ v
        o = o.transpose(0, 2, 1, 3).reshape(B, T, H * Q) @ a["o_proj"]["kernel"]
        x = x + (rms(o, lp["post_attention_layernorm"]["weight"]) if after else o * residual)
        m = lp["mlp"]
        mlp_norm = {"pre": "post_attention_layernorm", "both": "pre_feedforward_layernorm"}.get(cfg.norm_position)
        h = rms(x, lp[mlp_norm]["weight"]) if mlp_norm else x
        g = h @ m["gate_proj"]["kernel"]
        if cfg.activation == "silu":
            g = g / (1 + np.exp(-g))
        else:  # GELU's tanh approximation
            g = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
        f = (g * (h @ m["up_proj"]["kernel"])) @ m["down_proj"]["kernel"]
        x = x + (rms(f, lp["post_feedforward_layernorm"]["weight"]) if after else f * residual)
    x = rms(x, p["norm"]["weight"])
    head = p["embed_tokens"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]["kernel"]
    return cap(x @ head / (cfg.logits_scaling or 1.0), cfg.final_logit_softcapping)


@pytest.mark.parametrize("tie,T,shape", [(True, 11, {}), (False, 11, {}), (True, 150, {}),
                                         (False, 150, {"qk_norm": "head", "head_width": 24}),  # heads 4 x 24 != 64
                                         (True, 150, {"qk_norm": "projection", "norm_position": "post"}),
                                         (True, 150, {"norm_position": "both", "activation": "gelu_tanh",  # Gemma 2
                                                      "scale_embeddings": True, "query_pre_attn_scalar": 20,
                                                      "attn_logit_softcapping": 0.01, "final_logit_softcapping": 0.1,
                                                      "sliding_window": 70,
                                                      "layer_types": ("sliding_attention", "full_attention")}),
                                         (False, 150, {"qk_norm": "head", "norm_position": "both",  # Gemma 3
                                                       "activation": "gelu_tanh", "scale_embeddings": True,
                                                       "sliding_window": 40, "sliding_rope_theta": 30.0,
                                                       "layer_types": ("full_attention", "sliding_attention")}),
                                         (True, 150, {"rotary_layers": (False, True)}),  # SmolLM3's NoPE
                                         (False, 150, {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                                       "attention_multiplier": 0.03, "logits_scaling": 8.0}),  # Granite
                                         *[(True, T, {"rotary_width": 12, "rope_scaling": LongRopeScaling(  # Phi-4-mini
                                             rope_type="longrope", short_factor=(1.0, 1.5, 3.0, 6.0, 10.0, 20.0),
                                             long_factor=(1.3, 4.0, 9.0, 20.0, 40.0, 90.0), factor=8.0,
                                             original_max_position_embeddings=100)}) for T in (11, 150)]])
def test_forward_matches_hf_llama_reference(tie, T, shape):
    cfg = CFG.model_copy(update={"tie_embeddings": tie, "seq_len": max(T, CFG.seq_len), **shape})
    params = init_params(cfg, jax.random.PRNGKey(0))
    # Norm weights are 1 at init; perturb them so a wrong norm formula cannot hide.
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: a + 0.1 * jnp.arange(a.size).reshape(a.shape) / a.size if a.ndim == 1 else a, params)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, T))  # T = 150: two query blocks
    ours = np.asarray(forward(params, jnp.asarray(tokens, jnp.int32), cfg))
    assert ours.dtype == np.float32 and ours.shape == (2, T, cfg.vocab_size)
    np.testing.assert_allclose(ours, reference_llama(params, tokens, cfg), atol=2e-5, rtol=1e-4)
    assert ("lm_head" in params) != tie


def test_project_swiglu_and_cross_entropy_give_autodiffs_numbers():
    """The hand-written backward passes (training/model.py `project` and `swiglu`, training/step.py
    `cross_entropy`) compute what autodiff of the plain formulas computes."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    x, kernel = jax.random.normal(k1, (3, 5, 8)), jax.random.normal(k2, (8, 6))
    cot = jax.random.normal(k3, (3, 5, 6))
    ours = jax.vjp(project, x, kernel)
    plain = jax.vjp(jnp.matmul, x, kernel)
    np.testing.assert_allclose(ours[0], plain[0], rtol=1e-6)
    for a, b in zip(ours[1](cot), plain[1](cot)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    gate_up, cot = 3 * jax.random.normal(k1, (3, 5, 12)), jax.random.normal(k3, (3, 5, 6))
    ours = jax.vjp(swiglu, gate_up)
    plain = jax.vjp(lambda z: jax.nn.silu(z[..., :6]) * z[..., 6:], gate_up)
    np.testing.assert_allclose(ours[0], plain[0], rtol=1e-6)
    np.testing.assert_allclose(ours[1](cot)[0], plain[1](cot)[0], rtol=1e-5, atol=1e-6)

    logits = 3 * jax.random.normal(k1, (4, 7, 50))
    targets = jax.random.randint(k2, (4, 7), 0, 50)
    reference = lambda z: optax.softmax_cross_entropy_with_integer_labels(z, targets).mean()  # noqa: E731
    loss, grad = jax.value_and_grad(cross_entropy)(logits, targets)
    ref_loss, ref_grad = jax.value_and_grad(reference)(logits)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    np.testing.assert_allclose(grad, ref_grad, atol=1e-7)


@pytest.mark.parametrize("T,window", [(150, None), (256, None), (512, 70)])
def test_blocked_causal_attention_gives_the_dense_masked_numbers(T, window):
    """Training's causal attention (query blocks, each against its key prefix, or with a sliding
    window the keys its rows' windows reach) against the decoding path's dense masked form over
    the same keys: outputs and all three gradients."""
    blocks = query_blocks(T, window)
    assert blocks[0][0] == 0 and blocks[-1][1] == T and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    assert len(blocks) == {150: 2, 256: 4, 512: 7}[T]  # a window of 70 in 512: blocks of 73
    assert query_blocks(150, 70) == query_blocks(150) and len(query_blocks(8192, 128)) == 16
    kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(T), 4)
    B, H, K, Q = 2, 6, 2, 8
    q, k, v = (jax.random.normal(key, (B, T, n, Q)) for key, n in ((kq, H), (kk, K), (kv, K)))
    cot = jax.random.normal(kc, (B, T, H * Q))
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    attention = jax.jit(lambda q, k, v: causal_attention(q, k, v, window=window))
    ours, ours_vjp = jax.vjp(attention, q, k, v)
    dense, dense_vjp = jax.vjp(jax.jit(lambda q, k, v: cached_attention(q, k, v, pos, pos, window)), q, k, v)
    np.testing.assert_allclose(ours, dense, atol=2e-6)
    for a, b in zip(ours_vjp(cot), dense_vjp(cot)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)
    # causality: changing the last position's key and value moves only the last output
    moved = attention(q, k.at[:, -1].add(1.0), v.at[:, -1].add(1.0))
    np.testing.assert_array_equal(moved[:, :-1], ours[:, :-1])
    assert not np.allclose(moved[:, -1], ours[:, -1])


def test_a_long_prefill_attends_in_chunks_of_bounded_scores(monkeypatch):
    """`cached_attention`'s queries in chunks (SCORE_BYTES made small here: 5 chunks of 64 for 300
    queries over 340 keys, a window, a soft cap, empty columns) give what all at once gives, and
    the compiled call holds under half the temporaries."""
    import training.model as model_module

    B, T, S, H, K, Q = 2, 300, 340, 4, 2, 16
    q, k, v = (jax.random.normal(key, (B, n, h, Q)) for key, n, h in zip(jax.random.split(jax.random.PRNGKey(3), 3),
                                                                         (T, S, S), (H, K, K)))
    kv_pos = jnp.broadcast_to(jnp.where(jnp.arange(S) < 330, jnp.arange(S), -1), (B, S)).astype(jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + 30, (B, T))

    def attend(q):
        return cached_attention(q, k, v, pos, kv_pos, 50, None, 20.0)

    def compiled():  # traced afresh, under the SCORE_BYTES of now
        return jax.jit(lambda q: attend(q)).lower(q).compile()

    whole, whole_bytes = compiled()(q), compiled().memory_analysis().temp_size_in_bytes
    monkeypatch.setattr(model_module, "SCORE_BYTES", B * H * S * 4 * 100)  # 100 rows of scores: chunks of 64
    chunked, chunked_bytes = compiled()(q), compiled().memory_analysis().temp_size_in_bytes
    np.testing.assert_allclose(chunked, whole, atol=2e-6)
    assert chunked_bytes < 0.5 * whole_bytes, (chunked_bytes, whole_bytes)


def test_param_tree_count_and_init():
    params = init_params(CFG, jax.random.PRNGKey(0))
    D, F, V, KQ = 64, 96, 97, 2 * 16
    per_layer = 2 * D + D * D * 2 + D * KQ * 2 + 3 * D * F
    assert param_count(params) == V * D + 2 * per_layer + D
    assert params["layers_1"]["self_attn"]["k_proj"]["kernel"].shape == (D, KQ)
    assert params["layers_0"]["mlp"]["down_proj"]["kernel"].shape == (F, D)
    # residual output projections start smaller (std / sqrt(2 L)); norms start at one
    q_std = float(params["layers_0"]["self_attn"]["q_proj"]["kernel"].std())
    o_std = float(params["layers_0"]["self_attn"]["o_proj"]["kernel"].std())
    assert abs(q_std - 0.02) < 0.003 and abs(o_std - 0.01) < 0.002
    assert np.all(np.asarray(params["norm"]["weight"]) == 1)
    # the same key gives the same bits; another key does not
    again = init_params(CFG, jax.random.PRNGKey(0))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(again)))
    other = init_params(CFG, jax.random.PRNGKey(1))
    assert not np.array_equal(params["embed_tokens"]["embedding"], other["embed_tokens"]["embedding"])


def test_flops_per_token_formula_and_preset_sizes():
    D, L, H, Q, T, F, V = 64, 2, 4, 16, 16, 96, 97
    n_matmul = L * (D * H * Q * 2 + D * 2 * Q * 2 + 3 * D * F) + D * V
    assert flops_per_token(CFG) == 6 * n_matmul + 12 * L * H * Q * T
    # a sliding layer counts the keys its window reaches: Gemma 3's one full and one window of 40 at T = 150
    gemma3 = CFG.model_copy(update={"seq_len": 150, "sliding_window": 40,
                                    "layer_types": ("full_attention", "sliding_attention")})
    assert flops_per_token(gemma3) == 6 * n_matmul + 12 * H * Q * (150 + 40)
    wide = CFG.model_copy(update={"sliding_window": 64})  # a window past seq_len is no window: Mistral's at T = 16
    assert flops_per_token(wide) == flops_per_token(CFG)
    gpu = {name: model_and_train(str(CONFIGS / f"{name}.yaml"))[0] for name in ("small_gpu", "medium_gpu")}
    sizes = {name: param_count(jax.eval_shape(lambda m=m: init_params(m, jax.random.PRNGKey(0))))
             for name, m in gpu.items()}
    assert 100e6 < sizes["small_gpu"] < 150e6
    assert 320e6 < sizes["medium_gpu"] < 380e6
    assert {m.compute_dtype for m in gpu.values()} == {"bfloat16"}


@pytest.mark.parametrize("update", [{}, {"attention_bias": True},
                                    {"sliding_window": 5, "layer_types": ("sliding_attention", "full_attention")}],
                         ids=["llama", "qwen2-biases", "window-ring"])
def test_kv_cache_decoding_matches_forward_with_left_padding(update):
    """Decoding (a matmul per projection) gives the logits of the forward (one matmul of the kernels
    side by side), with Qwen2's q, k and v biases too: drawn at random, so each must reach its own
    projection; and with a sliding layer whose cache is a ring of its window (5 of 16 columns),
    written by a prefill longer than the ring and then a token at a time."""
    cfg = CFG.model_copy(update=update)
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.random.normal(jax.random.PRNGKey(zlib.crc32(str(path).encode())), a.shape)
        if path[-1].key == "bias" else a, init_params(cfg, jax.random.PRNGKey(0)))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, cfg.vocab_size)
    full = forward(params, tokens, cfg)
    step = jax.jit(decode_step, static_argnums=1)
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    logits, cache = step(params, cfg, tokens[:, :7], init_cache(cfg, 2, 16), positions[:, :7])  # prefill
    outs = [logits]
    for i in range(7, 12):  # then one token at a time
        logits, cache = step(params, cfg, tokens[:, i:i + 1], cache, positions[:, i:i + 1])
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-5)
    assert int(cache["index"]) == 12

    # Row 1 is a shorter prompt left-padded by 3 (position -1): it decodes as it would alone.
    padded = tokens.at[1, :3].set(0)
    pad_pos = positions.at[1].set(jnp.concatenate([jnp.full(3, -1), jnp.arange(9)]).astype(jnp.int32))
    logits, _ = step(params, cfg, padded, init_cache(cfg, 2, 16), pad_pos)
    np.testing.assert_allclose(logits[1, 3:], forward(params, tokens[1:, 3:], cfg)[0], atol=1e-5)
    np.testing.assert_allclose(logits[0], full[0], atol=1e-5)


def test_a_sliding_layers_cache_keeps_its_window_only():
    """A sliding layer's keys and values are a ring of its window's columns (column c at slot c mod
    window): its memory falls to window / context, a chunk longer than the ring keeps its last
    columns, rows decoding at columns of their own each write theirs, and what a slot holds
    (`ring_columns`) is the last column written there."""
    from evaluation.slots import state_bytes

    cfg = CFG.model_copy(update={"seq_len": 64, "sliding_window": 8,
                                 "layer_types": ("sliding_attention", "full_attention")})
    cache = init_cache(cfg, 3, 64)
    assert [layer["k"].shape[1] for layer in cache["layers"]] == [8, 64] and cache["pos"].shape == (3, 64)
    assert [layer["v"].shape[1] for layer in init_cache(cfg, 3, 64, rings=False)["layers"]] == [64, 64]
    assert [layer["k"].shape[1] for layer in init_cache(cfg, 3, 8)["layers"]] == [8, 8]  # no shorter: no ring
    kv = 2 * cfg.n_kv_heads * cfg.head_dim * 4  # a column's key and value bytes, float32, per layer
    assert state_bytes(CFG.model_copy(update={"seq_len": 64}), 3) - state_bytes(cfg, 3) == 3 * (64 - 8) * kv

    np.testing.assert_array_equal(ring_columns(11, 4), [8, 9, 10, 7])
    np.testing.assert_array_equal(ring_columns(jnp.array([0, 2]), 3), [[-3, -2, -1], [0, 1, -1]])
    chunk = jnp.arange(2 * 11, dtype=jnp.float32).reshape(2, 11, 1)  # columns 0..10 of two rows
    ring = write_cache(jnp.zeros((2, 4, 1)), chunk, jnp.int32(0), ring=True)
    np.testing.assert_array_equal(ring[:, :, 0], chunk[:, ring_columns(11, 4), 0])  # the last 4, by slot
    ring = write_cache(ring, jnp.full((2, 1, 1), -1.0), jnp.array([11, 13]), ring=True)  # a column per row
    np.testing.assert_array_equal(ring[:, :, 0], [[8, 9, 10, -1], [19, -1, 21, 18]])


def test_schedules():
    cos = lr_schedule(TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1, schedule="cosine"))
    assert float(cos(0)) == pytest.approx(0.1) and float(cos(9)) == pytest.approx(1.0)
    assert float(cos(10)) == pytest.approx(1.0) and float(cos(99)) == pytest.approx(0.1)
    assert float(cos(30)) > float(cos(60)) > float(cos(90))
    wsd = lr_schedule(TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.0, schedule="wsd",
                                  decay_fraction=0.2))
    assert [float(wsd(s)) for s in (10, 50, 80)] == pytest.approx([1.0, 1.0, 1.0])
    assert float(wsd(90)) == pytest.approx(0.5, abs=0.03) and float(wsd(99)) == pytest.approx(0.0)
    # decay_shape sqrt: the same ends, 1 - sqrt(progress) between them (a quarter of the way: half down)
    root = lr_schedule(TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.0, schedule="wsd",
                                   decay_fraction=0.2, decay_shape="sqrt"))
    assert [float(root(s)) for s in (50, 80)] == pytest.approx([1.0, 1.0]) and float(root(99)) == pytest.approx(0.0)
    for step in (83, 90, 95):
        progress = (step - 80) / 19
        assert float(root(step)) == pytest.approx(1 - progress ** 0.5, abs=1e-6)
        assert float(root(step)) < float(wsd(step))  # steeper early than linear
    with pytest.raises(ValueError, match="decay_shape=sqrt shapes WSD's decay"):
        TrainConfig(steps=100, decay_shape="sqrt")


def test_weight_decay_only_on_matrices():
    params = init_params(CFG, jax.random.PRNGKey(0))
    mask = matrices_only(params)
    assert mask["layers_0"]["mlp"]["up_proj"]["kernel"] and mask["embed_tokens"]["embedding"]
    assert not mask["norm"]["weight"] and not mask["layers_0"]["input_layernorm"]["weight"]
    # With zero gradients only decay moves a parameter: matrices shrink, norm weights stay.
    opt = make_optimizer(TrainConfig(lr=0.1, weight_decay=0.5, warmup=1, steps=10, grad_clip=0))
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    updates, _ = opt.update(zeros, opt.init(params), params)
    new = optax.apply_updates(params, updates)
    assert np.array_equal(new["norm"]["weight"], params["norm"]["weight"])
    assert float(jnp.abs(new["layers_0"]["mlp"]["up_proj"]["kernel"]).sum()) < float(
        jnp.abs(params["layers_0"]["mlp"]["up_proj"]["kernel"]).sum())


def test_gradient_accumulation_matches_full_batch():
    batch = jax.random.randint(jax.random.PRNGKey(2), (8, CFG.seq_len + 1), 0, CFG.vocab_size)
    results = []
    for micro in (1, 4):
        tcfg = TrainConfig(batch_size=8, microbatches=micro, steps=10, warmup=2)
        opt = make_optimizer(tcfg)
        state = init_state(CFG, opt, jax.random.PRNGKey(0))
        step = jax.jit(make_train_step(CFG, tcfg, opt), donate_argnums=0)
        state, metrics = step(state, batch)
        results.append((state, metrics))
    (s1, m1), (s4, m4) = results
    assert float(m1["loss"]) == pytest.approx(float(m4["loss"]), rel=1e-6)
    assert float(m1["grad_norm"]) == pytest.approx(float(m4["grad_norm"]), rel=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(s1["params"]), jax.tree_util.tree_leaves(s4["params"])):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert int(s4["step"]) == 1 and not np.array_equal(s4["rng"], init_state(CFG, make_optimizer(tcfg),
                                                                             jax.random.PRNGKey(0))["rng"])


def test_batch_parts_train_as_the_whole_batch_does():
    """train.batch_parts computes the batch as independent parts and averages them: the loss,
    gradient norm and parameters of one step agree with the whole batch's to float rounding,
    also with microbatches, and a part count that does not divide the rows is refused."""
    batch = jax.random.randint(jax.random.PRNGKey(2), (8, CFG.seq_len + 1), 0, CFG.vocab_size)
    results = {}
    for micro, parts in ((1, 1), (1, 2), (1, 4), (2, 2)):
        tcfg = TrainConfig(batch_size=8, microbatches=micro, batch_parts=parts, steps=10, warmup=2)
        opt = make_optimizer(tcfg)
        step = jax.jit(make_train_step(CFG, tcfg, opt), donate_argnums=0)
        results[micro, parts] = step(init_state(CFG, opt, jax.random.PRNGKey(0)), batch)
    whole_state, whole = results[1, 1]
    for key, (state, metrics) in results.items():
        assert float(metrics["loss"]) == pytest.approx(float(whole["loss"]), rel=1e-6), key
        assert float(metrics["grad_norm"]) == pytest.approx(float(whole["grad_norm"]), rel=1e-5), key
        for a, b in zip(jax.tree_util.tree_leaves(state["params"]), jax.tree_util.tree_leaves(whole_state["params"])):
            np.testing.assert_allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="batch_parts=3"):
        TrainConfig(batch_size=8, batch_parts=3)
    with pytest.raises(ValueError, match="batch_parts=4"):
        TrainConfig(batch_size=8, microbatches=4, batch_parts=4)
    with pytest.raises(ValueError, match="batch_parts=2"):  # SFT's mean over masked tokens: parts weigh unevenly
        make_train_step(CFG, TrainConfig(batch_size=8, batch_parts=2), make_optimizer(TrainConfig()), SFTObjective())


def test_split_parts_train_as_one_program_does(tmp_path):
    """train.split_parts runs each part as its own program and applies their mean in another: the
    loop's metrics and parameters agree with one program's to float rounding, a run resumed from
    its checkpoint ends with the uninterrupted run's bits, and what it cannot do is refused."""
    import shutil

    from training.loop import load_model, train

    batches = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (4, 8, CFG.seq_len + 1), 0, CFG.vocab_size),
                         np.int32)
    base = TrainConfig(batch_size=8, batch_parts=2, steps=8, warmup=2, log_every=2, eval_every=1000,
                       checkpoint_every=4, z_loss=1e-4)

    def run(tcfg, name):
        work = tmp_path / name
        stats = train(CFG, tcfg, lambda step: batches[step % 4], [], work / "w", work / "o")
        records = [json.loads(line) for line in (work / "o" / "metrics.jsonl").read_text().splitlines()]
        return stats, records, load_model(work / "o")[1]

    one, one_records, one_params = run(base, "one")
    split_cfg = base.model_copy(update={"split_parts": True})
    split, split_records, split_params = run(split_cfg, "split")
    assert [r["step"] for r in split_records] == [r["step"] for r in one_records] == [2, 4, 6, 8]
    for a, b in zip(one_records, split_records):
        for key in ("loss", "z_loss", "grad_norm", "lr"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a, b)
    for a, b in zip(jax.tree_util.tree_leaves(one_params), jax.tree_util.tree_leaves(split_params)):
        np.testing.assert_allclose(a, b, atol=1e-5)

    shutil.rmtree(tmp_path / "split" / "w" / "checkpoints" / "8")  # as if killed after step 4's checkpoint
    shutil.rmtree(tmp_path / "split" / "o")
    resumed, _, _ = run(split_cfg, "split")
    assert resumed["resumed_from_step"] == 4 and resumed["params_sha256"] == split["params_sha256"]

    for refused in ({"batch_parts": 1}, {"microbatches": 2}, {"lora": {"rank": 2}}):
        with pytest.raises(ValueError, match="split_parts"):
            TrainConfig(**{**base.model_dump(), "split_parts": True, **refused})


def test_bfloat16_compute_keeps_float32_params_and_learns():
    cfg = CFG.model_copy(update={"compute_dtype": "bfloat16"})
    tcfg = TrainConfig(batch_size=8, steps=30, warmup=3, lr=1e-2)
    opt = make_optimizer(tcfg)
    state = init_state(cfg, opt, jax.random.PRNGKey(0))
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(state["params"]))
    batch = jax.random.randint(jax.random.PRNGKey(3), (8, cfg.seq_len + 1), 0, cfg.vocab_size)
    first = float(loss_fn(state["params"], batch, cfg))
    step = jax.jit(make_train_step(cfg, tcfg, opt), donate_argnums=0)
    for _ in range(20):
        state, metrics = step(state, batch)
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(state["params"]))
    assert forward(state["params"], batch[:, :-1], cfg).dtype == jnp.float32
    assert float(metrics["loss"]) < first - 1.0  # memorises the one batch
    f32 = float(loss_fn(state["params"], batch, CFG))
    assert float(loss_fn(state["params"], batch, cfg)) == pytest.approx(f32, abs=0.1)
