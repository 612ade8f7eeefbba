"""Import a Hugging Face checkpoint as kiln's model: the inverse of training/export.py.

`load_hf(folder)` reads a local folder (nothing is downloaded) holding `config.json` and
`model.safetensors`, or shards listed in `model.safetensors.index.json`, of one of the classes
`training.export.HF_CLASSES` lists: a `LlamaForCausalLM`; a `Qwen2ForCausalLM` (Llama with biases
on q, k and v: kiln's `attention_bias`); a dense `Qwen3ForCausalLM` (Llama with an RMSNorm over
each head of q and k: `qk_norm: head`); an `Olmo2ForCausalLM` (norms after attention and the MLP
instead of before, and over the whole q and k projections: `norm_position: post`, `qk_norm:
projection`); an `Olmo3ForCausalLM` (OLMo 2 with sliding-window layers: `sliding_window`,
`layer_types`); a `MistralForCausalLM` (Llama with a sliding window in every layer, left out
where it does not bite: none, as from Mistral 7B v0.2 on, or one at least the context kiln uses,
when it is Llama and exports as `LlamaForCausalLM`); a `GemmaForCausalLM` (Gemma 1 and CodeGemma:
Llama with GeGLU, `activation: gelu_tanh`, embeddings times sqrt(d_model), `scale_embeddings`, and
norm weights stored as kiln's - 1, `training.export.norm_offset`; its releases' `hidden_act: gelu`
read as the tanh GELU, as GemmaConfig reads it); a `Gemma2ForCausalLM` (norms before and
after each sublayer, `norm_position: both`; GeGLU, `activation: gelu_tanh`; embeddings times
sqrt(d_model), `scale_embeddings`; every other layer sliding; soft-capped attention scores and
logits, `attn_logit_softcapping`, `final_logit_softcapping`; its norms' weights stored as kiln's
- 1, `training.export.norm_offset`); a `Gemma3ForCausalLM` (Gemma 3's text model, 270M and 1B:
Gemma 2's features without the caps, with per-head q/k norms, five sliding layers to one full,
and those at a RoPE base of their own, `sliding_rope_theta`); a `SmolLM3ForCausalLM` (Llama with
layers that attend without positions, `rotary_layers`, as its `no_rope_layers` says; Llama where
every layer rotates); a `Phi3ForCausalLM` (Phi-3, Phi-4: Llama with q, k and v fused in one tensor
and gate and up in another, split as they are read, `unfused`; Mistral with its sliding window
where that bites; LongRoPE, `rope_type: longrope`, as Phi-3.5 and the 128k models scale their
context, and part of each head rotated, Phi-4-mini's `partial_rotary_factor`, `rotary_width`;
exported as Llama or Mistral, `READ_AS`, or as Phi3ForCausalLM where it rotates so); a
`GraniteForCausalLM` (IBM's Granite 3: Llama with its embeddings, each sublayer's output, the
attention scores and the logits scaled by constants, `granite_scales`; Llama where none is set).
A config's `head_dim` other than hidden_size / num_attention_heads (Qwen3, Mistral Nemo) is kiln's
`head_width`. Tensors are renamed by the export's own table (`training.export.hf_names`) and
Linear weights [out, in] transposed back to Dense kernels [in, out]; nothing is permuted, since
kiln's RoPE is HF's `rotate_half` layout. Every tensor becomes float32 (bfloat16 exactly), as
kiln's parameters are, unless the caller asks for another dtype (`kiln serve-model` holds weights
in its compute dtype).

Llama 3.1's, YaRN's, linear and (Phi-3's) LongRoPE scaling (`rope_type: llama3`, `yarn`, `linear`,
`longrope`) become `model.rope_scaling`. What kiln's model cannot compute is refused with the
reason, before any weight is read: other RoPE scaling (dynamic, YaRN with DeepSeek's mscale, ...),
LongRoPE and partial rotary outside Phi-3's class, sliding layers with a scaled RoPE, Qwen's
sliding window, biases other than Qwen2's q/k/v, an activation other than the class's (SiLU;
Gemma's tanh GELU), soft caps outside Gemma's classes, quantized weights, and other architectures
(Qwen3's mixture of experts among them). A tensor the config does not account for is refused too.
A vision-language Gemma 3 (4B and up) is read as its language model, a Gemma3ForCausalLM
(`read_config`, `text_tensor`).

Plain numpy and `safetensors`: no JAX device work, no torch, no Prefect.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from safetensors import safe_open

from training.config import LinearScaling, LongRopeScaling, ModelConfig, RopeScaling, YarnScaling
from training.export import (FUSED, GRANITE_SCALES, HF_ACTIVATIONS, HF_CLASSES, ONLY_IN, activation_key,
                             fused_widths, hf_names, leaf_at, norm_offset)
from training.model import init_params

# Gemma 3 4B and up: a language model (Gemma3ForCausalLM's) beside a vision tower, read as the former
VISION_LANGUAGE = "Gemma3ForConditionalGeneration"
# Classes kiln reads as another: Phi-3's (Phi-3's and Phi-4's) is Llama with q, k and v in one tensor and
# gate and up in another (`unfused`), and with its window Mistral; exported as those, unless it rotates
# as only Phi-3's class does (part of each head, LongRoPE: training.export.phi3_rope)
READ_AS = {"Phi3ForCausalLM": ("phi3", "llama")}
# classes whose RoPE may be LongRoPE and rotate part of each head (Phi3's `partial_rotary_factor`)
PHI3_ROPE = {"phi3"}
# Phi3Config's original context where its config.json names none: transformers reads the top level's (this
# default) before rope_scaling's
PHI3_ORIGINAL_CONTEXT = 4096
# the classes kiln exports (training.export.HF_CLASSES), and those it reads as one of them
ARCHITECTURES = {**{arch: model_type for arch, model_type in HF_CLASSES.values()},
                 **{arch: model_type for arch, (model_type, _) in READ_AS.items()}}
# model_type -> kiln's (attention_bias, qk_norm, norm_position, (activation, scale_embeddings)); which
# layers slide, the config says
FEATURES = {model_type: features[:4] for features, (_, model_type) in HF_CLASSES.items()}
FEATURES.update({model_type: FEATURES[like] for model_type, like in READ_AS.values()})
# NoPE layers by default where a SmolLM3 config lists no no_rope_layers: every n-th layer
NOPE_EVERY = {"smollm3": 4}
# sliding layers by default where the config lists no layer_types: every n-th layer attends fully
FULL_LAYER_EVERY = {"olmo3": 4, "gemma2": 2, "gemma3_text": 6}
# classes whose configs may soft-cap attention scores and logits (`model.attn_logit_softcapping`, ...)
SOFT_CAPPED = ONLY_IN["attn_logit_softcapping"]
# classes whose sliding layers rotate at a RoPE base of their own (`model.sliding_rope_theta`)
OWN_SLIDING_THETA = ONLY_IN["sliding_rope_theta"]
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
# Buffers some older checkpoints saved beside the weights; kiln computes them from rope_theta.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def load_hf(folder: Path, seq_len: int | None = None, dtype=np.float32) -> tuple[ModelConfig, dict]:
    """The model in a Hugging Face folder: its ModelConfig and a parameter tree shaped as
    `training.model.init_params` makes it, of numpy arrays in `dtype` (float32, as kiln's
    parameters are; a server may hold them in its compute dtype), in host memory: the caller
    places them on devices, sharded as it likes.

    `seq_len` caps the config's `max_position_embeddings`, which kiln's seq_len would otherwise
    take: it sizes training's buffers and the default generation length."""
    folder = Path(folder)
    hf = read_config(folder)
    cfg = model_config(hf, seq_len, folder)
    model_type = architecture(hf, folder)
    tensors = read_tensors(folder, dtype, text_tensor if hf.get("text_of") else None)
    if model_type == "phi3":
        tensors = unfused(tensors, cfg)
    return cfg, kiln_params(tensors, cfg, folder, norm_offset(model_type))


def read_config(folder: Path) -> dict:
    """config.json's dict; a vision-language Gemma 3's (`Gemma3ForConditionalGeneration`, 4B and up)
    as its text model's, a `Gemma3ForCausalLM` config (`text_config`, with the ids and tying the
    top level gives and it does not): kiln imports the language model and leaves the vision tower
    out (`text_tensor`)."""
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {folder} is not a Hugging Face model folder "
                                "(kiln imports local folders only; download one with `hf download` first)")
    hf = json.loads(path.read_text())
    if hf.get("architectures") != [VISION_LANGUAGE]:
        return hf
    shared = {key: hf[key] for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if key in hf}
    return {**shared, **hf.get("text_config", {}), "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "text_of": VISION_LANGUAGE}


def text_tensor(name: str) -> str | None:
    """A vision-language Gemma 3's tensor under its text model's name (`language_model.model.x`, as the
    Hub's checkpoints and transformers write it, or `model.language_model.x`, transformers 5's own
    module path, -> `model.x`; its lm_head -> `lm_head.weight`), or None for the vision tower's and the
    projector's, which kiln does not read."""
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name.removeprefix(prefix)
    if name in ("language_model.lm_head.weight", "lm_head.weight"):
        return "lm_head.weight"
    return None


# --- config.json -> ModelConfig ------------------------------------------------------------------


def architecture(hf: dict, folder: Path) -> str:
    archs = hf.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES]
    if len(archs) > 1 or (archs and not known):
        raise ValueError(f"{folder}: architectures {archs}: kiln imports one of {sorted(ARCHITECTURES)}")
    model_type = ARCHITECTURES[known[0]] if known else hf.get("model_type")
    if model_type not in ARCHITECTURES.values() or hf.get("model_type", model_type) != model_type:
        raise ValueError(f"{folder}: model_type {hf.get('model_type')!r}: kiln imports Llama, Qwen2, Qwen3, "
                         "OLMo 2, OLMo 3, Mistral, Gemma, Gemma 2, Gemma 3, SmolLM3, Phi-3 and Granite decoders "
                         f"({', '.join(sorted(ARCHITECTURES))})")
    return model_type


def rope_parameters(hf: dict) -> tuple[dict, dict | None]:
    """The RoPE of the full-attention layers as one dict (`rope_type`, `rope_theta`, the scaling's
    fields), from transformers 4's flat `rope_theta` and `rope_scaling` or 5's `rope_parameters`;
    and the sliding layers' own, where the config nests one per layer type (OLMo 3, Gemma 3) or
    names their base (Gemma 3's `rope_local_base_freq`), else None."""
    nested = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    sliding = None
    if "full_attention" in nested or "sliding_attention" in nested:
        nested, sliding = nested.get("full_attention") or {}, dict(nested.get("sliding_attention") or {})
    elif hf.get("rope_local_base_freq") is not None:
        sliding = {"rope_type": "default", "rope_theta": hf["rope_local_base_freq"]}
    scaling = hf.get("rope_scaling") if isinstance(hf.get("rope_scaling"), dict) else {}
    full = {"rope_theta": hf.get("rope_theta", 10000.0), **nested, **scaling}
    full["rope_type"] = full.get("rope_type", full.get("type", "default"))
    if hf.get("model_type") == "phi3" and full["rope_type"] in ("su", "yarn"):  # Phi3Config's old names for it
        full["rope_type"] = "longrope"
    if sliding is not None:
        sliding["rope_type"] = sliding.get("rope_type", sliding.get("type", "default"))
    return full, sliding


def rope_scaling(hf: dict) -> RopeScaling | YarnScaling | LinearScaling | LongRopeScaling | None:
    """Llama 3.1's, YaRN's, linear or LongRoPE scaling of the full-attention layers (`rope_parameters`),
    or None. As transformers reads them, a missing original context is the config's
    `original_max_position_embeddings` or else its `max_position_embeddings` (LongRoPE's: Phi3Config's
    top-level one first), and YaRN's and LongRoPE's missing factor their ratio."""
    rope, _ = rope_parameters(hf)
    if rope["rope_type"] == "linear":
        return LinearScaling(rope_type="linear", factor=rope["factor"])
    if rope["rope_type"] == "longrope":
        original = hf.get("original_max_position_embeddings", PHI3_ORIGINAL_CONTEXT)
        return LongRopeScaling(rope_type="longrope", short_factor=rope["short_factor"], long_factor=rope["long_factor"],
                               original_max_position_embeddings=original,
                               factor=rope.get("factor") or hf["max_position_embeddings"] / original,
                               attention_factor=rope.get("attention_factor"))
    if rope["rope_type"] not in ("llama3", "yarn"):
        return None
    rope.setdefault("original_max_position_embeddings",
                    hf.get("original_max_position_embeddings", hf.get("max_position_embeddings")))
    if rope["rope_type"] == "llama3":
        return RopeScaling(**{name: rope[name] for name in RopeScaling.model_fields if name in rope})
    if rope.get("factor") is None:
        rope["factor"] = hf["max_position_embeddings"] / rope["original_max_position_embeddings"]
    return YarnScaling(**{name: rope[name] for name in YarnScaling.model_fields if rope.get(name) is not None})


def rope_theta(hf: dict) -> float:
    return float(rope_parameters(hf)[0]["rope_theta"])


def sliding_rope_theta(hf: dict, layer_types) -> float | None:
    """The sliding layers' RoPE base where some layer slides and it differs from the full layers'
    (Gemma 3's 10000 beside 1000000), else None."""
    full, sliding = rope_parameters(hf)
    theta = (sliding or {}).get("rope_theta", full["rope_theta"])
    return float(theta) if layer_types and "sliding_attention" in layer_types and theta != full["rope_theta"] \
        else None


def windows(hf: dict, model_type: str, context: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) of the model: Mistral's (and Phi-3's) window slides in every layer, and is
    left out where it does not bite (at least the context: the model is then Llama, with the
    version it had before kiln had windows); OLMo 3's and Gemma's in the layers `layer_types`
    names (by default every 4th layer attends fully in Olmo3Config, every 2nd in Gemma2Config, every
    `sliding_window_pattern`th, 6, in Gemma3TextConfig), kept where they do not bite (Gemma 3's
    sliding layers rotate at a base of their own), none where no layer slides."""
    window = hf.get("sliding_window")
    if model_type in ("mistral", "phi3") and window is not None and window < context:
        return window, None
    if model_type in FULL_LAYER_EVERY and window is not None:
        every = hf.get("sliding_window_pattern", FULL_LAYER_EVERY[model_type])
        types = tuple(hf.get("layer_types") or ("full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                                for i in range(hf["num_hidden_layers"])))
        if "sliding_attention" in types:
            return window, types
    return None, None


def rotary_layers(hf: dict, model_type: str) -> tuple[bool, ...] | None:
    """Which layers rotate q and k: SmolLM3's `no_rope_layers` (1 rotates, 0 has no positions; by
    default every `no_rope_layer_interval`th layer, 4, has none); None where every layer rotates (a
    SmolLM3 without NoPE layers is Llama, with the version a Llama of its shape has)."""
    if model_type not in NOPE_EVERY:
        return None
    every = hf.get("no_rope_layer_interval", NOPE_EVERY[model_type])
    flags = hf.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(hf["num_hidden_layers"])]
    return None if all(flags) else tuple(bool(flag) for flag in flags)


def head_width(hf: dict) -> int | None:
    """`head_dim` where it is not hidden_size / num_attention_heads (else None: kiln's default, so that
    a config that merely writes it out, as kiln's own exports do, keeps the version it had)."""
    head_dim, hidden, heads = hf.get("head_dim"), hf["hidden_size"], hf["num_attention_heads"]
    return None if head_dim in (None, hidden // heads) and hidden % heads == 0 else head_dim


def unsupported(hf: dict, model_type: str) -> list[str]:
    """Why kiln's model cannot compute this config, one reason each (empty: it can)."""
    reasons = []
    key, expected = activation_key(model_type), HF_ACTIVATIONS[FEATURES[model_type][3][0]]
    act = hf.get(key, expected)
    if model_type == "gemma" and act == "gelu":  # Gemma 1's releases: meant as the tanh GELU, as GemmaConfig reads it
        act = expected
    if act != expected:
        reasons.append(f"{key} {act!r} (kiln computes {model_type}'s MLP with {expected})")
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(cap) is not None and model_type not in SOFT_CAPPED:
            reasons.append(f"{cap} {hf[cap]} (kiln soft-caps Gemma 2's and Gemma 3's scores and logits only)")
    if hf.get("use_bidirectional_attention"):
        reasons.append("use_bidirectional_attention true (kiln's attention is causal)")
    rope, sliding_rope = rope_parameters(hf)
    if rope["rope_type"] not in ("default", "llama3", "yarn", "linear", *(("longrope",) * (model_type in PHI3_ROPE))):
        reasons.append(f"RoPE {rope} (kiln's RoPE is plain, Llama 3.1's, YaRN's or linear: rope_type default, "
                       "llama3, yarn or linear; and Phi-3's LongRoPE)")
    elif rope["rope_type"] == "yarn" and rope.get("mscale") and rope.get("mscale_all_dim") \
            and not rope.get("attention_factor"):
        reasons.append(f"RoPE {rope} (YaRN's mscale and mscale_all_dim, DeepSeek's attention factor: kiln's "
                       "YaRN takes attention_factor, or 0.1 ln(factor) + 1)")
    own_theta = sliding_rope is not None and sliding_rope.get("rope_theta", rope["rope_theta"]) != rope["rope_theta"]
    if sliding_rope is not None and (sliding_rope["rope_type"] != "default"
                                     or (own_theta and model_type not in OWN_SLIDING_THETA)):
        reasons.append(f"the sliding layers' RoPE {sliding_rope} (kiln's sliding layers rotate with plain RoPE, at the "
                       f"full layers' rope_theta {rope['rope_theta']}, or at a base of their own in Gemma 3)")
    partial = hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    width = hf.get("head_dim") or (hf.get("hidden_size") or 0) // (hf.get("num_attention_heads") or 1)
    if partial != 1.0 and model_type not in PHI3_ROPE:
        reasons.append(f"partial_rotary_factor {partial} ({model_type}'s; kiln rotates part of each head as Phi-3's "
                       "class does, and no other)")
    elif partial != 1.0 and (int(width * partial) % 2 or not 0 < partial < 1):
        reasons.append(f"partial_rotary_factor {partial} of head_dim {width} (kiln rotates an even number of each "
                       "head's dimensions, fewer than all)")
    hidden, heads = hf.get("hidden_size") or 0, hf.get("num_attention_heads") or 1
    if hidden % heads and not hf.get("head_dim"):
        reasons.append(f"hidden_size {hidden} does not divide by its {heads} heads, and no head_dim says how "
                       "wide they are")
    if model_type != "qwen2" and hf.get("attention_bias"):
        reasons.append(f"attention_bias true ({model_type}'s puts biases on q, k, v and o_proj; kiln's "
                       "attention_bias is Qwen2's, on q, k and v only)")
    if hf.get("mlp_bias"):
        reasons.append("mlp_bias true (kiln's MLP has no biases)")
    if hf.get("use_sliding_window"):
        reasons.append(f"use_sliding_window true, window {hf.get('sliding_window')} ({model_type}'s window, in some "
                       "layers only: kiln's sliding layers are Mistral's, OLMo 3's and Gemma's)")
    other_layers = sorted(set(hf.get("layer_types") or ["full_attention"]) - {"full_attention"})
    if other_layers and model_type not in FULL_LAYER_EVERY:
        reasons.append(f"layer_types {other_layers} (kiln's sliding layers are Mistral's, OLMo 3's and Gemma's)")
    if set(hf.get("layer_types") or []) - {"full_attention", "sliding_attention"}:
        reasons.append(f"layer_types {sorted(set(hf['layer_types']))} (kiln has full_attention and "
                       "sliding_attention layers)")
    if hf.get("quantization_config"):
        reasons.append("quantization_config (kiln imports float weights: float32, float16 or bfloat16)")
    return reasons


def rotary_width(hf: dict) -> int | None:
    """How many of each head's first dimensions rotate, as Phi3's int(head_dim * partial_rotary_factor),
    where it is not all of them (else None)."""
    rope, _ = rope_parameters(hf)
    partial = hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    width = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return None if partial == 1.0 else int(width * partial)


def granite_scales(hf: dict, model_type: str) -> dict:
    """A Granite's multipliers (`training.export.GRANITE_SCALES`), each left unset where it changes
    nothing (1; the attention's 1 / sqrt(head_dim)): a Granite with none is Llama, with a Llama's
    version. Other classes have none (transformers ignores such keys there, and so does kiln)."""
    if model_type != "granite":
        return {}
    width = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    plain = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0,
             "attention_multiplier": width ** -0.5}
    values = {name: float(hf.get(name, 1.0)) for name in GRANITE_SCALES}  # GraniteConfig's defaults: 1
    return {name: value for name, value in values.items() if value != plain[name]}


def query_pre_attn_scalar(hf: dict) -> int | None:
    """Gemma's `query_pre_attn_scalar` where it is not the head width (else None: kiln's default
    scale, 1 / sqrt(head_dim), the same number)."""
    scalar = hf.get("query_pre_attn_scalar")
    width = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return None if scalar in (None, width) else int(scalar)


def features(model_type: str) -> dict:
    """ModelConfig's fields that the class fixes (`FEATURES`), by name."""
    bias, qk_norm, norm_position, (activation, scale_embeddings) = FEATURES[model_type]
    return {"attention_bias": bias, "qk_norm": qk_norm, "norm_position": norm_position, "activation": activation,
            "scale_embeddings": scale_embeddings}


def model_config(hf: dict, seq_len: int | None, folder: Path) -> ModelConfig:
    """ModelConfig from a config.json's dict: `training.export.hf_config`'s inverse."""
    model_type = architecture(hf, folder)
    reasons = unsupported(hf, model_type)
    if reasons:
        raise ValueError(f"{folder}: kiln's model cannot represent this {model_type} checkpoint: " + "; ".join(reasons))
    max_positions = hf.get("max_position_embeddings") or seq_len
    if max_positions is None:
        raise ValueError(f"{folder}: config.json has no max_position_embeddings: pass seq_len")
    context = min(max_positions, seq_len or max_positions)
    try:
        sliding_window, layer_types = windows(hf, model_type, context)
        return ModelConfig(vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
                           n_heads=hf["num_attention_heads"],
                           n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                           d_ff=hf["intermediate_size"], seq_len=context,
                           rope_theta=rope_theta(hf), rope_scaling=rope_scaling(hf),
                           tie_embeddings=hf.get("tie_word_embeddings", False), norm_eps=hf.get("rms_norm_eps", 1e-6),
                           init_std=hf.get("initializer_range", 0.02), head_width=head_width(hf),
                           sliding_window=sliding_window, layer_types=layer_types,
                           sliding_rope_theta=sliding_rope_theta(hf, layer_types),
                           rotary_layers=rotary_layers(hf, model_type), rotary_width=rotary_width(hf),
                           query_pre_attn_scalar=query_pre_attn_scalar(hf),
                           attn_logit_softcapping=hf.get("attn_logit_softcapping"),
                           final_logit_softcapping=hf.get("final_logit_softcapping"), **granite_scales(hf, model_type),
                           **features(model_type))
    except KeyError as e:
        raise ValueError(f"{folder}: config.json has no {e.args[0]}") from None


# --- safetensors -> kiln's parameter tree ---------------------------------------------------------


def read_tensors(folder: Path, dtype=np.float32, rename=None) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint, by HF name, in `dtype` (float32: exact for float16 and
    bfloat16 weights), each converted as it is read, so that no more than one tensor at a time is
    held in another dtype (a bfloat16 8B checkpoint read as bfloat16: 16 GB, not 32 and more).
    `rename(name)` gives the name to keep a tensor under, or None to leave it unread."""
    index = folder / INDEX_FILE
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / WEIGHTS_FILE).is_file():
        files = [WEIGHTS_FILE]
    else:
        raise FileNotFoundError(f"{folder} has neither {WEIGHTS_FILE} nor {INDEX_FILE}: kiln reads safetensors "
                                "checkpoints only (load a pytorch_model.bin one in transformers and "
                                "`save_pretrained` it again to convert it)")
    tensors = {}
    for name in files:
        with safe_open(str(folder / name), framework="numpy") as f:  # bfloat16 as ml_dtypes' numpy bfloat16
            for key in f.keys():
                kept = key if rename is None else rename(key)
                if kept is not None:
                    tensors[kept] = f.get_tensor(key).astype(dtype, copy=False)
    return tensors


def unfused(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Phi-3's fused projections under Llama's names (`training.export.FUSED`, whose `fused` is the
    inverse): each layer's `qkv_proj` [(H + 2K) Q, D] as q_proj, k_proj and v_proj, its
    `gate_up_proj` [2F, D] as gate_proj and up_proj (gate first, as Phi3MLP chunks it). A tensor of
    another width is split anyway; `kiln_params` then refuses the parts, naming the shapes the
    config gives them."""
    widths = fused_widths(cfg)
    for name in [n for n in tensors if n.endswith(".weight") and n.rsplit(".", 2)[1] in FUSED]:
        prefix, tensor, _ = name.rsplit(".", 2)
        parts = np.split(tensors.pop(name), np.cumsum([widths[part] for part in FUSED[tensor][:-1]]))
        tensors.update({f"{prefix}.{part}.weight": weight for part, weight in zip(FUSED[tensor], parts)})
    return tensors


def kiln_params(tensors: dict[str, np.ndarray], cfg: ModelConfig, folder: Path, offset: float = 0.0) -> dict:
    """The HF tensors as kiln's parameter tree, each checked against the shape kiln's model gives it;
    `offset` added to the norms' weights (1 for Gemma's: `training.export.norm_offset`). Consumes
    `tensors`: each is taken out as it is placed, so a transposed kernel's original goes as its copy
    is made (the weights held once, not twice)."""
    shapes = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.PRNGKey(0))
    missing, params = [], {}
    for path, name in hf_names(cfg).items():
        expected = leaf_at(shapes, path).shape
        if path[-1] == "kernel":
            expected = expected[::-1]  # a Linear weight, [out, in]
        if name not in tensors:
            missing.append(name)
            continue
        tensor = tensors.pop(name)
        if tensor.shape != expected:
            raise ValueError(f"{folder}: {name} has shape {list(tensor.shape)}, but config.json makes it "
                             f"{list(expected)}")
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        if path[-1] == "weight" and offset:  # in float32, as Gemma computes 1 + weight, then in the caller's dtype
            tensor = (tensor.astype(np.float32) + offset).astype(tensor.dtype)
        node[path[-1]] = np.ascontiguousarray(tensor.T if path[-1] == "kernel" else tensor)
    if missing:
        raise ValueError(f"{folder}: the checkpoint lacks {len(missing)} tensors its config.json needs: "
                         f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # some checkpoints save the tied copy too
    extra = sorted(k for k in tensors if not k.endswith(IGNORED_SUFFIXES))
    if extra:
        raise ValueError(f"{folder}: kiln's model has no place for {len(extra)} tensors of the checkpoint: "
                         f"{', '.join(extra[:6])}{' ...' if len(extra) > 6 else ''}")
    return params
