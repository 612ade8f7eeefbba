"""The Llama-style decoder kiln trains: embedding, RMSNorm, rotary positions, grouped-query
causal attention, SwiGLU MLP, optionally tied embeddings. Flax Linen, no device logic.

It follows Hugging Face's `LlamaForCausalLM` exactly, so an export is a renaming:
RMSNorm is `weight * (x * rsqrt(mean(x^2) + eps))`, RoPE uses `rotate_half` on the two halves of
each head (not interleaved pairs), the MLP is `down(silu(gate(x)) * up(x))`, and nothing has a bias
unless `attention_bias` is set: then q, k and v have one, as in `Qwen2ForCausalLM` (o_proj none).
`qk_norm` adds an RMSNorm of q and k before the rotation, over each head (`head`, as
`Qwen3ForCausalLM`) or over the whole projection (`projection`, as `Olmo2ForCausalLM`);
`norm_position: post` moves each block's norms from the inputs of attention and the MLP to their
outputs, before the residual adds (OLMo 2); `head_width` makes heads wider or narrower than
d_model / n_heads (Qwen3, Mistral Nemo); `sliding_window` keeps the layers `layer_types` names
`sliding_attention` (every layer, without it) to the last positions (Mistral, OLMo 3), and those
rotate with plain RoPE where `rope_scaling` scales the full-attention layers' (OLMo 3's), at
`sliding_rope_theta` where it is set (Gemma 3's local base). Gemma 2's and 3's other features:
`norm_position: both` (norms on the inputs and the outputs of attention and the MLP),
`activation: gelu_tanh` (GeGLU), `scale_embeddings` (the input embeddings times sqrt(d_model)) and
`query_pre_attn_scalar` (scores over sqrt of it instead of sqrt(head_dim)); SmolLM3's
`rotary_layers` (the layers it names False attend without rotary positions); Phi-3's
`rotary_width` (the first dimensions of each head rotate, the rest pass through) and LongRoPE
(`longrope_frequencies`: a divisor per frequency, its set picked per row); Granite's constants
`embedding_multiplier`, `residual_multiplier` (each sublayer's output before the residual add),
`attention_multiplier` (scores q.k times it) and `logits_scaling` (`output_scale`); Gemma 2's soft caps
`attn_logit_softcapping` and `final_logit_softcapping` (`soft_cap`); Gemma's norms multiply by
1 + weight, which the export and import convert to and from kiln's weight (training/export.py).

Parameter tree (`params` of `init_params`), HF names in brackets; a Dense `kernel` is stored
[in, out], the transpose of a torch `Linear.weight`:

    embed_tokens/embedding            [V, D]        (model.embed_tokens.weight)
    layers_{i}/input_layernorm/weight [D]           (model.layers.{i}.input_layernorm.weight)
    layers_{i}/self_attn/q_proj/kernel [D, H*Q]     (...self_attn.q_proj.weight, transposed)
    layers_{i}/self_attn/k_proj/kernel [D, K*Q]     (k_proj)
    layers_{i}/self_attn/v_proj/kernel [D, K*Q]     (v_proj)
    layers_{i}/self_attn/o_proj/kernel [H*Q, D]     (o_proj)
    layers_{i}/self_attn/{q,k,v}_proj/bias [H*Q], [K*Q], [K*Q]   (...q_proj.bias; attention_bias only)
    layers_{i}/self_attn/{q,k}_norm/weight [Q]     (...self_attn.q_norm.weight; qk_norm head;
                                            [H*Q] and [K*Q] with qk_norm projection)
    layers_{i}/post_attention_layernorm/weight [D]   (norm_position post: after attention, and no
    layers_{i}/post_feedforward_layernorm/weight [D]  input_layernorm; this one after the MLP)
    layers_{i}/pre_feedforward_layernorm/weight [D]  (norm_position both: before the MLP, beside
                                            input_layernorm and the two above)
    layers_{i}/mlp/gate_proj/kernel    [D, F]       (mlp.gate_proj)
    layers_{i}/mlp/up_proj/kernel      [D, F]       (mlp.up_proj)
    layers_{i}/mlp/down_proj/kernel    [F, D]       (mlp.down_proj)
    norm/weight                        [D]          (model.norm.weight)
    lm_head/kernel                     [D, V]       (lm_head.weight; absent when tied)

V vocab, D d_model, H query heads, K key/value heads, Q head_dim (D / H unless head_width), F d_ff.

How it is computed (the parameters above are stored and initialised exactly as `nn.Dense` would;
only the matmuls XLA is asked for differ, to suit its CPU backend, see benchmarks/RESULTS.md):
q, k and v come from one matmul with the three kernels side by side (and their biases, if any,
side by side too), and so do gate and up;
every projection is `project`, whose backward hands XLA the weight gradient as x^T @ dy with x
on the left, so the gradient dy is never written out transposed. Training's causal attention
runs in query blocks, each against only the keys at or before it (`causal_attention`, fastest on
a CPU), or as `jax.nn.dot_product_attention` (`fused_attention`: cuDNN's flash attention on a
GPU); decoding attends over the key/value cache with a mask (`cached_attention`).

How a forward runs, none of which changes the math (training/config.py TrainConfig: `attention`,
`remat`, `document_mask`): `attention` picks the form above; `remat` recomputes each decoder
block's activations in the backward pass instead of keeping them (`jax.checkpoint` with a policy);
`segments` [B, T] (document ids of packed sequences, `segment_ids`) keep attention inside each
document and restart the rotary positions at each document's first token.

Inference: `forward` gives float32 logits for a batch; `init_cache` and `decode_step` run
prefill and token-by-token decoding with a key/value cache, all usable under `jax.jit`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from training.config import LinearScaling, LongRopeScaling, ModelConfig, YarnScaling

_MASKED = -1e30  # finite, so a row with nothing visible (padding) gives no NaN
SCORE_BYTES = 1 << 28  # a prefill's attention scores in one layer at most (`cached_attention`'s chunks)


def _dtype(cfg: ModelConfig):
    return jnp.dtype(cfg.compute_dtype)


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)  # the statistics in float32, as HF does
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return weight.astype(self.dtype) * x32.astype(self.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling=None):
    """theta^(-2i/Q) for i < Q/2, float32; with `scaling` a RopeScaling, Llama 3.1's: low
    frequencies divided by `factor`, high ones kept, the band between blended by where its
    wavelength lies, as transformers' `llama3` rope type computes them; a YarnScaling, YaRN's
    (`yarn_frequencies`); a LinearScaling, every frequency divided by `factor`."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim // 2, dtype=jnp.float32) * 2 / head_dim))
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearScaling):
        return inv_freq / scaling.factor
    if isinstance(scaling, YarnScaling):
        return yarn_frequencies(inv_freq, head_dim, theta, scaling)
    wavelength = 2 * math.pi / inv_freq
    context = scaling.original_max_position_embeddings
    slowed = jnp.where(wavelength > context / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    blend = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    between = (wavelength >= context / scaling.high_freq_factor) & (wavelength <= context / scaling.low_freq_factor)
    return jnp.where(between, (1 - blend) * slowed / scaling.factor + blend * slowed, slowed)


def yarn_frequencies(inv_freq, head_dim: int, theta: float, scaling: YarnScaling):
    """YaRN's frequencies, as transformers' `yarn` rope type computes them: dimension d (of Q/2)
    turns original_max_position_embeddings * inv_freq[d] / 2pi times over the original context;
    the dimensions at which that count is beta_fast and beta_slow bound a band (rounded outwards
    with `truncate`) across which the frequency goes linearly from kept to divided by `factor`."""
    def dimension(rotations):  # the (fractional) dimension index at which a frequency turns `rotations` times
        return head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does: no zero-width band
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def longrope_frequencies(positions, rotary_dim: int, theta: float, scaling: LongRopeScaling):
    """LongRoPE's frequencies for positions [B, T]: theta^(-2i/R) divided by `short_factor[i]`, or by
    `long_factor[i]` in a row whose largest position lies past the original context ([B, 1, R/2]).
    transformers picks one set per call, by the largest position of the whole batch; kiln picks per
    row, so that a request is computed alike whatever else shares its batch (the same for one row)."""
    plain = rope_frequencies(rotary_dim, theta)
    short = plain / jnp.asarray(scaling.short_factor, jnp.float32)
    long = plain / jnp.asarray(scaling.long_factor, jnp.float32)
    beyond = jnp.max(positions, axis=-1) >= scaling.original_max_position_embeddings  # [B]
    return jnp.where(beyond[:, None, None], long, short)


def rope_tables(positions, rotary_dim: int, theta: float, dtype, scaling=None):
    """HF's RoPE angles position * theta^(-2i/R) (`rope_frequencies`, scaled with `scaling`; R the
    rotated width, `ModelConfig.rotary_dim`) as (cos [B, T, 1, 1, R/2], signed_sin [B, T, 1, 2, R/2]:
    [-sin, sin]) for positions [B, T] (B may be 1, for rows that share their positions); YaRN's and
    LongRoPE's multiplied by their attention scale.

    Computed once per forward, for every layer. Positions known while tracing (training's 0..T-1,
    a numpy array: `forward`) give constant tables, computed eagerly by the same XLA cos and sin
    and embedded in the program; inside the step they were recomputed by every fusion that reads
    them, in each layer's rotary forward and backward (3-6% of nanoGPT's CPU step,
    benchmarks/RESULTS.md). Traced positions (documents, decoding) are computed in the program."""
    with jax.ensure_compile_time_eval():
        positions = jnp.asarray(positions)
        if isinstance(scaling, LongRopeScaling):
            frequencies = longrope_frequencies(positions, rotary_dim, theta, scaling)
        else:
            frequencies = rope_frequencies(rotary_dim, theta, scaling)
        angles = positions.astype(jnp.float32)[..., None] * frequencies
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        if isinstance(scaling, (YarnScaling, LongRopeScaling)):
            cos, sin = cos * scaling.attention_scale, sin * scaling.attention_scale
        cos, sin = cos[:, :, None, None, :].astype(dtype), sin[:, :, None, None, :].astype(dtype)
        return cos, jnp.concatenate([-sin, sin], axis=3)


def rotary(x, rope):
    """HF's RoPE: x [B, T, heads, Q] rotated by `rope_tables`' angles, halves layout; where the
    tables rotate fewer than Q dimensions (`rotary_width`, Phi-4-mini's partial rotary), the first
    ones, the rest passed through as Phi3's `apply_rotary_pos_emb` does.

    x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), with rotate_half(x) = cat(-x2, x1), is
    computed on x seen as two halves [..., 2, Q/2]: the halves swapped (a reversal of that axis
    of two) times [-sin, sin], so XLA fuses it into one elementwise pass over x instead of
    writing both halves and concatenating them (3-6% of a CPU step, benchmarks/RESULTS.md)."""
    cos, signed_sin = rope
    width = 2 * cos.shape[-1]
    if width < x.shape[-1]:
        return jnp.concatenate([rotary(x[..., :width], rope), x[..., width:]], axis=-1)
    halves = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)  # [x1, x2]
    return (halves * cos + jnp.flip(halves, axis=-2) * signed_sin).reshape(x.shape)


class Kernel(nn.Module):
    """A projection's [in, out] weight under `<name>/kernel`, drawn as `nn.Dense` draws it (same
    key, N(0, std)), but returned rather than applied, so kernels can be concatenated. With
    `bias`, also its [out] bias under `<name>/bias`, zeros as `nn.Dense`'s: (kernel, bias)."""

    shape: tuple[int, int]
    std: float
    bias: bool = False

    @nn.compact
    def __call__(self):
        kernel = self.param("kernel", nn.initializers.normal(self.std), self.shape, jnp.float32)
        if not self.bias:
            return kernel
        return kernel, self.param("bias", nn.initializers.zeros, self.shape[1:], jnp.float32)


@jax.custom_vjp
def project(x, kernel):
    """x [..., D] @ kernel [D, F]: the same sums as autodiff's matmul, with its gradients written
    so XLA's CPU backend reads every operand as it lies in memory. Autodiff's weight gradient is
    dy^T @ x, for which XLA writes dy (the larger array, the output of an elementwise backward
    such as SwiGLU's or the softmax's) transposed, in strided order; x^T @ dy with x on the left
    reads x transposed inside the matmul and dy as it is."""
    return x @ kernel


def _project_fwd(x, kernel):
    return x @ kernel, (x, kernel)


def _project_bwd(saved, dy):
    x, kernel = saved
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])  # [B*T, D], [B*T, F]
    return dy @ kernel.T, x2.T @ dy2


project.defvjp(_project_fwd, _project_bwd)


def query_blocks(T: int, window: int | None = None) -> list[tuple[int, int]]:
    """Causal attention's query blocks [t0, t1): at most 4, of at least 64 positions each. Block
    [t0, t1) attends to keys 0..t1-1 only, so 4 blocks skip 3/8 of the masked half; on this CPU
    the smaller score blocks also stay in cache (benchmarks/RESULTS.md: 4 blocks at T = 256 ran
    attention's forward and backward ~3-4x faster than one [T, T] block). With a sliding `window`
    under a quarter of T: blocks about the window's width (at most 16, of at least 64 positions),
    since each multiplies only the keys its rows' windows reach, about two windows' worth
    (`causal_attention`; RESULTS.md: 0.22 of a full layer's time at T = 2048, window 128)."""
    n = max(1, min(4, T // 64))
    if window is not None:
        n = max(n, min(16, T // max(window, 64)))
    edges = [round(i * T / n) for i in range(n + 1)]
    return list(zip(edges[:-1], edges[1:]))


def causal_attention(q, k, v, segments=None, window: int | None = None, score_width: float | None = None,
                     cap: float | None = None):
    """Grouped-query causal attention of one sequence per row, position i seeing keys 0..i:
    q [B, T, H, Q], k and v [B, T, K, Q] -> [B, T, H*Q]. With `segments` [B, T] (each position's
    document, `segment_ids`) only the keys 0..i of its own document; with `window`, only the keys
    after i - window (a sliding-window layer's), and a query block multiplies only the keys its
    rows' windows reach (`query_blocks`), so a window shorter than the sequence saves work. Scores
    are q.k / sqrt(score_width or Q), soft-capped at `cap` where it is set (`soft_cap`).

    Laid out for XLA's batched matmuls: heads first, and the H/K query heads that share a key
    head stacked as rows in (position, head) order, [B, K, T*H/K, Q], so each query block is a
    contiguous slice of rows and every matmul reads its operands as they lie; keys transposed
    once, [B, K, Q, T]. Each block's softmax is exact over its own keys (no online softmax)."""
    B, T, H, Q = q.shape
    K = k.shape[2]
    G = H // K  # query head h uses kv head h // G, as HF's repeat_kv
    rows = q.reshape(B, T, K, G * Q).transpose(0, 2, 1, 3).reshape(B, K, T * G, Q)
    keys_t, values = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)  # [B, K, Q, T], [B, K, T, Q]
    outs = []
    for t0, t1 in query_blocks(T, window):
        k0 = 0 if window is None else max(0, t0 - window + 1)  # keys before the block's first window: skipped
        scores = soft_cap((rows[:, :, t0 * G:t1 * G] @ keys_t[..., k0:t1]).astype(jnp.float32)
                          / math.sqrt(score_width or Q), cap)
        row_pos = t0 + jnp.arange((t1 - t0) * G) // G  # [(t1 - t0) G]
        key_pos = jnp.arange(k0, t1)
        visible = key_pos <= row_pos[:, None]  # [(t1 - t0) G, t1 - k0]
        if window is not None:
            visible = visible & (key_pos > row_pos[:, None] - window)
        if segments is not None:
            visible = visible & (segments[:, row_pos, None] == segments[:, None, k0:t1])[:, None]  # [B, 1, rows, keys]
        scores = jnp.where(visible, scores, _MASKED)
        outs.append(jax.nn.softmax(scores, axis=-1).astype(q.dtype) @ values[:, :, k0:t1])
    out = jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]  # [B, K, T*G, Q]
    return out.reshape(B, K, T, G * Q).transpose(0, 2, 1, 3).reshape(B, T, H * Q)


def fused_attention(q, k, v, segments=None, implementation: str | None = None, window: int | None = None,
                    score_width: float | None = None):
    """Grouped-query causal attention as one `jax.nn.dot_product_attention` call: q [B, T, H, Q],
    k and v [B, T, K, Q] -> [B, T, H*Q]. `implementation` "cudnn" is cuDNN's fused flash attention
    (GPU, bfloat16 or float16 only), "xla" (or None) the plain softmax(QK^T)V that XLA fuses as
    it can. With `segments`, a [B, 1, T, T] mask keeps each query inside its document; with
    `window`, its local window keeps it to the last `window` positions. Scores are q.k / sqrt(score_width
    or Q)."""
    B, T, H, Q = q.shape
    mask = None if segments is None else (segments[:, :, None] == segments[:, None, :])[:, None]
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation,
                                       scale=None if score_width is None else 1 / math.sqrt(score_width),
                                       local_window_size=None if window is None else (window - 1, 0))
    return out.reshape(B, T, H * Q)


def output_scale(logits, cfg: ModelConfig):
    """The output logits (float32) as the model gives them: divided by Granite's `logits_scaling`,
    soft-capped at Gemma 2's `final_logit_softcapping`, where the model has them."""
    if cfg.logits_scaling is not None:
        logits = logits / cfg.logits_scaling
    return soft_cap(logits, cfg.final_logit_softcapping)


def soft_cap(x, cap: float | None):
    """Gemma 2's soft cap: cap * tanh(x / cap), which keeps x inside (-cap, cap) and is ~x near 0;
    x itself where `cap` is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def segment_ids(tokens, eos_id: int):
    """Each position's document in a packed row: tokens [B, T] -> int32 [B, T], counting the EOS
    tokens before it. An EOS belongs to the document it ends (the tokenize step writes each
    document as `[bos] tokens eos`), so the token after it starts the next one."""
    is_eos = (tokens == eos_id).astype(jnp.int32)
    return jnp.cumsum(is_eos, axis=1) - is_eos


def document_positions(segments):
    """Rotary positions that restart at 0 at each document's first token: [B, T] -> int32 [B, T]."""
    t = jnp.broadcast_to(jnp.arange(segments.shape[1], dtype=jnp.int32), segments.shape)
    starts = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1)


def cached_attention(q, k, v, positions, kv_pos, window: int | None = None, score_width: float | None = None,
                     cap: float | None = None):
    """Attention over a key/value cache while decoding: q [B, T, H, Q] at `positions` [B, T],
    k and v [B, S, K, Q] at `kv_pos` [B, S]. A key is visible to a query if it is not later
    (causal) and not padding or an empty slot (position -1), and, with `window`, not `window` or
    more positions earlier. Scores are q.k / sqrt(score_width or Q), soft-capped at `cap` where it
    is set.

    A long prefill's queries go through in chunks (a power of two of them, one after another)
    whose float32 scores take SCORE_BYTES at most: all T at once would hold B x H x T x S of
    them, 8 GiB for one 8192-token prompt of 32 heads, in every layer's temporaries."""
    B, T, H, Q = q.shape
    K, S = k.shape[2], k.shape[1]
    rows = max(1, SCORE_BYTES // (B * H * S * 4))
    if T > rows:
        chunk = 1 << (rows.bit_length() - 1)
        n = -(-T // chunk)
        pad = n * chunk - T  # padding queries at position -1 see nothing, and are dropped
        chunks = (jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, n, chunk, H, Q).swapaxes(0, 1),
                  jnp.pad(positions, ((0, 0), (0, pad)), constant_values=-1).reshape(B, n, chunk).swapaxes(0, 1))
        out = jax.lax.map(lambda c: cached_attention(c[0], k, v, c[1], kv_pos, window, score_width, cap), chunks)
        return out.swapaxes(0, 1).reshape(B, n * chunk, H * Q)[:, :T]
    visible = (kv_pos[:, None, :] <= positions[:, :, None]) & (kv_pos[:, None, :] >= 0)  # [B, T, S]
    if window is not None:
        visible = visible & (kv_pos[:, None, :] > positions[:, :, None] - window)
    q = q.reshape(B, T, K, H // K, Q)  # query head h uses kv head h // (H/K), as HF's repeat_kv
    scores = soft_cap(jnp.einsum("btkgq,bskq->bkgts", q, k).astype(jnp.float32) / math.sqrt(score_width or Q), cap)
    scores = jnp.where(visible[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bskq->btkgq", probs, v).reshape(B, T, H * Q)


class Attention(nn.Module):
    """Training and full forwards project q, k and v with one matmul of their kernels side by
    side; decoding (a layer cache given) with a matmul each. The side-by-side kernel is a copy
    made at every call of the compiled function, hoisted out of a decoding loop but not out of
    the call: it cost `kiln serve-model` 2/3 of the layers' weights copied per chunk of decoding
    steps (benchmarks/RESULTS.md). The MLP does the same with gate and up."""

    cfg: ModelConfig
    attention: str = "query_blocks"  # training's form: query_blocks, or fused_xla / fused_cudnn (`fused_attention`)
    window: int | None = None  # a sliding-window layer's (ModelConfig.layer_window)

    @nn.compact
    def __call__(self, x, positions, rope, layer_cache=None, cache_pos=None, index=None, segments=None):
        cfg, dt = self.cfg, _dtype(self.cfg)
        B, T, D = x.shape
        H, K, Q = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)  # residual projections scaled by depth
        qkv = [Kernel((D, width), cfg.init_std, cfg.attention_bias, name=name)()
               for name, width in (("q_proj", H * Q), ("k_proj", K * Q), ("v_proj", K * Q))]
        kernels, biases = zip(*qkv) if cfg.attention_bias else (qkv, ())
        if layer_cache is not None:  # decoding: a matmul each (the docstring says why)
            q, k, v = (project(x, kernel.astype(dt)) for kernel in kernels)
        else:  # training, a full forward: one matmul
            q, k, v = jnp.split(project(x, jnp.concatenate(kernels, axis=1).astype(dt)), [H * Q, (H + K) * Q], axis=-1)
        if biases:  # Qwen2's q, k and v biases, added before the rotation as HF does
            q, k, v = (part + bias.astype(dt) for part, bias in zip((q, k, v), biases))
        if cfg.qk_norm == "projection":  # OLMo 2's: q and k normalised whole, before the heads are split
            q, k = RMSNorm(cfg.norm_eps, dt, name="q_norm")(q), RMSNorm(cfg.norm_eps, dt, name="k_norm")(k)
        q, k, v = q.reshape(B, T, H, Q), k.reshape(B, T, K, Q), v.reshape(B, T, K, Q)
        if cfg.qk_norm == "head":  # Qwen3's: each head of q and k normalised, before the rotation as HF does
            q, k = RMSNorm(cfg.norm_eps, dt, name="q_norm")(q), RMSNorm(cfg.norm_eps, dt, name="k_norm")(k)
        if rope is not None:  # None: a layer without positions (NoPE, `rotary_layers`)
            q, k = rotary(q, rope), rotary(k, rope)

        if layer_cache is None and self.attention != "query_blocks" and cfg.attn_logit_softcapping is not None:
            raise ValueError(f"attention {self.attention!r} has no soft cap: a model with attn_logit_softcapping "
                             "attends in query blocks (train.attention auto or query_blocks)")
        if layer_cache is None and self.attention != "query_blocks":  # training / full forward, fused
            out = fused_attention(q, k, v, segments, self.attention.removeprefix("fused_"), self.window,
                                  cfg.score_width)
        elif layer_cache is None:  # training / full forward: one causal run, position i sees 0..i
            out = causal_attention(q, k, v, segments, self.window, cfg.score_width,
                                   cfg.attn_logit_softcapping)
        elif layer_cache["k"].shape[1] < cache_pos.shape[1]:  # decoding, a sliding layer's ring (`init_cache`)
            width = layer_cache["k"].shape[1]  # attend over the ring's columns before this chunk and the chunk,
            held = jnp.broadcast_to(ring_columns(index, width), (B, width))  # then keep the chunk's last in it
            held_pos = jnp.where(held >= 0, jnp.take_along_axis(cache_pos, jnp.maximum(held, 0), axis=1), -1)
            keys, values = (jnp.concatenate([layer_cache[n], new.astype(layer_cache[n].dtype)], axis=1)
                            for n, new in (("k", k), ("v", v)))
            out = cached_attention(q, keys, values, positions, jnp.concatenate([held_pos, positions], axis=1),
                                   self.window, cfg.score_width, cfg.attn_logit_softcapping)
            layer_cache = {"k": write_cache(layer_cache["k"], k, index, ring=True),
                           "v": write_cache(layer_cache["v"], v, index, ring=True)}
        else:  # decoding: write this chunk at slot `index` (row b's at index[b]), attend over the whole cache
            layer_cache = {"k": write_cache(layer_cache["k"], k, index), "v": write_cache(layer_cache["v"], v, index)}
            k, v = layer_cache["k"], layer_cache["v"]
            out = cached_attention(q, k, v, positions, cache_pos, self.window, cfg.score_width,
                                   cfg.attn_logit_softcapping)
        return project(out, Kernel((H * Q, D), out_std, name="o_proj")().astype(dt)), layer_cache


@jax.custom_vjp
def swiglu(gate_up):
    """silu(gate) * up for gate_up [..., 2F], gate and up side by side (the MLP's one matmul).

    Autodiff kept the sigmoid and silu(gate) [..., F] of every layer for the backward, each
    written by a forward pass of its own; this backward recomputes the sigmoid from gate_up, which
    the up projection keeps anyway, so the forward keeps only its product (8% less step memory at a
    4-layer model, 1.03x steps/s at nanoGPT's CPU shape: benchmarks/RESULTS.md)."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return gate * jax.nn.sigmoid(gate) * up


def _swiglu_fwd(gate_up):
    return swiglu(gate_up), gate_up


def _swiglu_bwd(gate_up, dy):
    gate, up = jnp.split(gate_up, 2, axis=-1)
    sig = jax.nn.sigmoid(gate)
    d_gate = dy * up * sig * (1 + gate * (1 - sig))
    return (jnp.concatenate([d_gate, dy * gate * sig], axis=-1),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def geglu(gate_up):
    """gelu(gate) * up with GELU's tanh approximation (Gemma's `gelu_pytorch_tanh`), gate and up
    side by side as `swiglu` takes them; autodiff's backward."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.gelu(gate, approximate=True) * up


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, decoding: bool = False):
        cfg, dt = self.cfg, _dtype(self.cfg)
        D, F = x.shape[-1], cfg.d_ff
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        gate, up = Kernel((D, F), cfg.init_std, name="gate_proj")(), Kernel((D, F), cfg.init_std, name="up_proj")()
        if decoding:  # a matmul each, as Attention decodes
            gate_up = jnp.concatenate([project(x, gate.astype(dt)), project(x, up.astype(dt))], axis=-1)
        else:  # one matmul
            gate_up = project(x, jnp.concatenate([gate, up], axis=1).astype(dt))
        hidden = swiglu(gate_up) if cfg.activation == "silu" else geglu(gate_up)
        return project(hidden, Kernel((F, D), out_std, name="down_proj")().astype(dt))


class Block(nn.Module):
    cfg: ModelConfig
    attention: str = "query_blocks"
    window: int | None = None

    @nn.compact
    def __call__(self, x, positions, rope, layer_cache=None, cache_pos=None, index=None, segments=None):
        cfg, dt = self.cfg, _dtype(self.cfg)
        attention, mlp = Attention(cfg, self.attention, self.window, name="self_attn"), MLP(cfg, name="mlp")
        decoding = layer_cache is not None
        if cfg.norm_position == "post":  # OLMo 2: each sublayer's output normalised, then added
            h, layer_cache = attention(x, positions, rope, layer_cache, cache_pos, index, segments)
            x = x + RMSNorm(cfg.norm_eps, dt, name="post_attention_layernorm")(h)
            return x + RMSNorm(cfg.norm_eps, dt, name="post_feedforward_layernorm")(mlp(x, decoding)), layer_cache
        if cfg.norm_position == "both":  # Gemma 2 and 3: each sublayer's input and output normalised
            h, layer_cache = attention(RMSNorm(cfg.norm_eps, dt, name="input_layernorm")(x), positions, rope,
                                       layer_cache, cache_pos, index, segments)
            x = x + RMSNorm(cfg.norm_eps, dt, name="post_attention_layernorm")(h)
            h = mlp(RMSNorm(cfg.norm_eps, dt, name="pre_feedforward_layernorm")(x), decoding)
            return x + RMSNorm(cfg.norm_eps, dt, name="post_feedforward_layernorm")(h), layer_cache
        h, layer_cache = attention(RMSNorm(cfg.norm_eps, dt, name="input_layernorm")(x), positions, rope, layer_cache,
                                   cache_pos, index, segments)
        if cfg.residual_multiplier is not None:  # Granite's: each sublayer's output scaled before it is added
            scale = jnp.asarray(cfg.residual_multiplier, dt)
            x = x + h * scale
            return x + mlp(RMSNorm(cfg.norm_eps, dt, name="post_attention_layernorm")(x), decoding) * scale, layer_cache
        x = x + h
        x = x + mlp(RMSNorm(cfg.norm_eps, dt, name="post_attention_layernorm")(x), decoding)
        return x, layer_cache


def remat_policy(remat: str):
    """The `jax.checkpoint` policy of `train.remat`: what each block's backward may keep from its
    forward instead of recomputing it. full: nothing but the block's input; dots_saveable: the
    matmul outputs (the elementwise work between them is recomputed); offload: the matmul
    outputs without a batch dimension, moved to host memory (pinned_host) and back."""
    if remat == "full":
        return jax.checkpoint_policies.nothing_saveable
    if remat == "dots_saveable":
        return jax.checkpoint_policies.dots_saveable
    if remat == "offload":
        return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    raise ValueError(f"train.remat={remat!r}: choose none, full, dots_saveable or offload")


class Llama(nn.Module):
    """tokens [B, T] int32, positions [B, T] int32 (or [1, T], shared by every row) -> float32 logits
    [B, T, V] (and the cache).

    `attention` and `remat` say how training's forward runs (module docstring); `segments` [B, T]
    the documents of packed rows, attention kept inside each (training only, not with a cache)."""

    cfg: ModelConfig
    attention: str = "query_blocks"
    remat: str = "none"

    @nn.compact
    def __call__(self, tokens, positions, cache=None, segments=None):
        cfg, dt = self.cfg, _dtype(self.cfg)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=jnp.float32,
                         embedding_init=nn.initializers.normal(cfg.init_std), name="embed_tokens")
        x = embed(tokens)
        if cfg.scale_embeddings:  # Gemma's, in the compute dtype as transformers casts it
            x = x * jnp.asarray(math.sqrt(cfg.d_model), jnp.float32).astype(dt)
        if cfg.embedding_multiplier is not None:  # Granite's
            x = x * jnp.asarray(cfg.embedding_multiplier, dt)
        rope = rope_tables(positions, cfg.rotary_dim, cfg.rope_theta, dt, cfg.rope_scaling)
        windows = [cfg.layer_window(i) for i in range(cfg.n_layers)]
        sliding_rope = rope  # sliding layers rotate plainly (OLMo 3's), at their own base if they have one (Gemma 3's)
        if any(windows) and (cfg.rope_scaling is not None or cfg.sliding_rope_theta is not None):
            sliding_rope = rope_tables(positions, cfg.rotary_dim, cfg.sliding_rope_theta or cfg.rope_theta, dt)
        # Remat wraps the block, so the parameter tree keeps its names (layers_{i}/...).
        block = Block if self.remat == "none" else nn.remat(Block, policy=remat_policy(self.remat))
        new_layers = []
        for i, window in enumerate(windows):
            layer_cache = None if cache is None else cache["layers"][i]
            x, layer_cache = block(cfg, self.attention, window, name=f"layers_{i}")(
                x, positions, None if not cfg.layer_rotates(i) else sliding_rope if window else rope, layer_cache,
                None if cache is None else cache["pos"], None if cache is None else cache["index"], segments)
            new_layers.append(layer_cache)
        x = RMSNorm(cfg.norm_eps, dt, name="norm")(x)
        if cfg.tie_embeddings:
            head = embed.embedding.T  # [D, V]
        else:
            head = Kernel((cfg.d_model, cfg.vocab_size), cfg.init_std, name="lm_head")()
        logits = project(x, head.astype(dt))
        return output_scale(logits.astype(jnp.float32), cfg), new_layers


# --- functions the rest of kiln calls ------------------------------------------------------------


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Fresh float32 parameters from `key`: matrices N(0, init_std), the residual output
    projections (o_proj, down_proj) N(0, init_std / sqrt(2 * n_layers)) as in GPT-2, norms 1."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    return Llama(cfg).init(key, tokens, tokens)["params"]


def param_count(params) -> int:
    return int(sum(np.prod(p.shape) for p in jax.tree_util.tree_leaves(params)))


def forward(params, tokens, cfg: ModelConfig, *, attention: str = "query_blocks", remat: str = "none",
            segments=None):
    """tokens [B, T] int32 -> float32 logits [B, T, V], positions 0..T-1; with `segments` [B, T]
    (`segment_ids`) each document of a packed row attends only to itself, at positions from 0.
    `attention` (query_blocks, fused_xla, fused_cudnn) and `remat` (none, full, dots_saveable,
    offload) change how it runs, not what it computes (TrainConfig says each one's bits)."""
    if segments is None:
        positions = np.arange(tokens.shape[1], dtype=np.int32)[None]  # known while tracing: `rope_tables`
    else:
        positions = document_positions(segments)
    logits, _ = Llama(cfg, attention, remat).apply({"params": params}, tokens, positions, None, segments)
    return logits


def init_cache(cfg: ModelConfig, batch: int, max_len: int, rings: bool = True) -> dict:
    """An empty key/value cache for `batch` sequences of up to `max_len` tokens.

    `index` is the next column to write; `pos` holds each column's position, -1 while empty, so
    the mask needs no other state. Keys and values are stored in the compute dtype. A sliding
    layer whose window is shorter than `max_len` keeps only its window's last columns, a ring of
    that width (column c at slot c mod window, `ring_columns`), so its keys and values take
    window / max_len of a full layer's memory; `rings` False keeps every column in every layer
    (a prompt's prefill that evaluation/slots.py then moves into its slots' rings).
    """
    dt = _dtype(cfg)
    widths = [cfg.layer_reach(i, max_len) if rings else max_len for i in range(cfg.n_layers)]
    return {
        "index": jnp.zeros((), jnp.int32),
        "pos": jnp.full((batch, max_len), -1, jnp.int32),
        "layers": [{name: jnp.zeros((batch, width, cfg.n_kv_heads, cfg.head_dim), dt) for name in ("k", "v")}
                   for width in widths],
    }


def ring_columns(written, width: int):
    """The column each slot of a ring of `width` holds once columns 0..written-1 are written
    (slot = column mod width): written a scalar -> [width], an int32 [B] -> [B, width]; negative
    for a slot nothing was written to yet."""
    last = jnp.asarray(written, jnp.int32)[..., None] - 1
    return last - jnp.mod(last - jnp.arange(width, dtype=jnp.int32), width)


def write_cache(cache, new, index, ring: bool = False):
    """`new` [B, t, ...] written into `cache` [B, S, ...] from column `index` on: the same column
    for every row (a scalar), or row b's at index[b] (an int32 [B], with t = 1: rows that decode
    at positions of their own, evaluation/slots.py's continuous batching). With `ring` (a sliding
    layer's, `init_cache`) column c goes to slot c mod S, and of a chunk longer than S only its
    last S columns are kept."""
    new = new.astype(cache.dtype)
    S, t = cache.shape[1], new.shape[1]
    if jnp.ndim(index) != 0 and t != 1:
        raise ValueError(f"a cache index per row writes one token per row, not {t}")
    if ring and jnp.ndim(index) == 0:
        kept = min(t, S)
        return cache.at[:, jnp.mod(index + t - kept + jnp.arange(kept), S)].set(new[:, t - kept:])
    if jnp.ndim(index) == 0:
        return jax.lax.dynamic_update_slice(cache, new, (0, index) + (0,) * (cache.ndim - 2))
    return cache.at[jnp.arange(cache.shape[0]), jnp.mod(index, S) if ring else index].set(new[:, 0])


def decode_step(params, cfg: ModelConfig, tokens, cache: dict, positions):
    """Run tokens [B, t] through the model, appending them to the cache; returns float32 logits
    [B, t, V] and the new cache. Prefill with t > 1, then call with t = 1.

    `positions` [B, t] are the tokens' positions within their own sequence (for RoPE and the
    causal mask). Left-padded prompts pass position -1 for padding: padded columns are never
    attended to, so a batch of prompts of different lengths decodes as each would alone.
    `cache["index"]` is the column every row writes at, or an int32 [B] of each row's (t = 1); a
    sliding layer's ring (`init_cache`) takes the column's slot in it.
    """
    t = tokens.shape[1]
    index = cache["index"]
    pos = write_cache(cache["pos"], positions.astype(jnp.int32), index)
    run_cache = {"index": index, "pos": pos, "layers": cache["layers"]}
    logits, layers = Llama(cfg).apply({"params": params}, tokens, positions.astype(jnp.int32), run_cache)
    return logits, {"index": index + t, "pos": pos, "layers": layers}
