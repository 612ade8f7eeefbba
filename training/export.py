"""Export a kiln model to the Hugging Face Llama layout, and write its model card.

kiln's model is `LlamaForCausalLM` with other names (see training/model.py), so the export is a
renaming (`hf_names`): Dense kernels [in, out] become Linear weights [out, in]; everything stays
float32. Which class the folder names follows the model's features (`HF_CLASSES`): q/k/v biases
(`attention_bias`, an imported Qwen2) make it `Qwen2ForCausalLM`, Llama's layout plus those
biases; per-head q/k norms (`qk_norm: head`, Qwen3) `Qwen3ForCausalLM`; norms after each sublayer
and over whole q/k projections (`norm_position: post`, `qk_norm: projection`, OLMo 2)
`Olmo2ForCausalLM`, or `Olmo3ForCausalLM` with sliding-window layers; Llama with a sliding window
in every layer `MistralForCausalLM`; Gemma's norms, GeGLU and scaled embeddings `GemmaForCausalLM`
(before each sublayer), `Gemma2ForCausalLM` (before and after, with soft caps) or
`Gemma3ForCausalLM` (before and after, with per-head q/k norms); Llama with NoPE layers
`SmolLM3ForCausalLM`; Llama or Mistral rotating part of each head or with LongRoPE
`Phi3ForCausalLM` (q, k and v fused in one Linear, gate and up in another: `fused`); Llama with
Granite's multipliers (embeddings, residual branches, scores, logits) `GraniteForCausalLM`.
training/hf_import.py is the inverse. The folder holds what `AutoModelForCausalLM.from_pretrained`
and `AutoTokenizer.from_pretrained` read:

    config.json              the class's config: LlamaConfig, Qwen2Config, ..., Phi3Config
                             (rope_theta written flat, as transformers 4 and 5 read it)
    model.safetensors        the weights under HF names; lm_head.weight only when untied (Gemma's
                             norms as weight - 1: `norm_offset`)
    generation_config.json   greedy by default, EOS from the tokenizer (for a post-trained model a list:
                             EOS and the end-of-turn token, so generation stops where a reply ends)
    tokenizer.json           the tokenizer step's file, unchanged
    tokenizer_config.json    PreTrainedTokenizerFast and its special tokens
    special_tokens_map.json
    README.md                the model card (`model_card`)

No JAX or torch is needed to read the files back, and nothing here imports Prefect.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from training.config import LinearScaling, LongRopeScaling, ModelConfig, RopeScaling, YarnScaling
from training.model import param_count

WEIGHTS_FILE = "model.safetensors"


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
BIASED = ("q_proj", "k_proj", "v_proj")  # with attention_bias: Qwen2's layout, o_proj has none
BLOCK_NORMS = {"pre": ("input_layernorm", "post_attention_layernorm"),  # Llama's: before attention, before the MLP
               "post": ("post_attention_layernorm", "post_feedforward_layernorm"),  # OLMo 2's: after each
               "both": ("input_layernorm", "post_attention_layernorm",  # Gemma's: before and after each
                        "pre_feedforward_layernorm", "post_feedforward_layernorm")}
LLAMA_MLP = ("silu", False)  # (activation, scale_embeddings) of every class but Gemma's
GEMMA = ("gelu_tanh", True)
# (attention_bias, qk_norm, norm_position, (activation, scale_embeddings), whether some layers have no
# positions: `nope`, which layers slide: `sliding`, what only one class computes: `one_class_only`) -> the
# transformers class and model_type that computes it (training/hf_import.py reads checkpoints of these
# classes by the same table)
HF_CLASSES = {(False, "none", "pre", LLAMA_MLP, False, "none", "none"): ("LlamaForCausalLM", "llama"),
              (True, "none", "pre", LLAMA_MLP, False, "none", "none"): ("Qwen2ForCausalLM", "qwen2"),  # q, k, v biases
              (False, "head", "pre", LLAMA_MLP, False, "none", "none"): ("Qwen3ForCausalLM", "qwen3"),  # q/k norms
              (False, "projection", "post", LLAMA_MLP, False, "none", "none"): ("Olmo2ForCausalLM", "olmo2"),  # post
              (False, "none", "pre", LLAMA_MLP, False, "every layer", "none"): ("MistralForCausalLM", "mistral"),
              **{(False, "projection", "post", LLAMA_MLP, False, slide, "none"): ("Olmo3ForCausalLM", "olmo3")
                 for slide in ("every layer", "some layers")},  # OLMo 2 with sliding layers
              (False, "none", "pre", LLAMA_MLP, True, "none", "none"): ("SmolLM3ForCausalLM", "smollm3"),  # NoPE
              **{(False, "none", "pre", LLAMA_MLP, False, slide, "phi3"): ("Phi3ForCausalLM", "phi3")  # LongRoPE...
                 for slide in ("none", "every layer")},
              (False, "none", "pre", LLAMA_MLP, False, "none", "granite"): ("GraniteForCausalLM", "granite"),  # scales
              (False, "none", "pre", GEMMA, False, "none", "none"): ("GemmaForCausalLM", "gemma"),  # Gemma (1)
              **{(False, "none", "both", GEMMA, False, slide, "none"): ("Gemma2ForCausalLM", "gemma2")  # Gemma 2
                 for slide in ("none", "every layer", "some layers")},
              **{(False, "head", "both", GEMMA, False, slide, "none"): ("Gemma3ForCausalLM", "gemma3_text")  # Gemma 3
                 for slide in ("none", "every layer", "some layers")}}
# Classes whose RMSNorm multiplies by 1 + weight (Gemma's): their checkpoints store kiln's weight - 1
OFFSET_NORMS = {"gemma", "gemma2", "gemma3_text"}
# Gemma 2's and 3's classes: sandwich norms, and the config keys only they have
GEMMA_2_3 = {"gemma2", "gemma3_text"}
# kiln's `activation` as transformers names it, under the key each class's config reads it from
HF_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


def activation_key(model_type: str) -> str:
    """config.json's key for the MLP's activation: Gemma 2's and 3's `hidden_activation`, the others'
    (Gemma 1's too) `hidden_act`."""
    return "hidden_activation" if model_type in GEMMA_2_3 else "hidden_act"


# model fields only some classes' configs carry (set, the export is refused for the others)
ONLY_IN = {"query_pre_attn_scalar": GEMMA_2_3, "attn_logit_softcapping": GEMMA_2_3,
           "final_logit_softcapping": GEMMA_2_3, "sliding_rope_theta": {"gemma3_text"}}


def nope(cfg: ModelConfig) -> bool:
    """Whether some layer of the model attends without rotary positions (`rotary_layers`)."""
    return not all(cfg.layer_rotates(i) for i in range(cfg.n_layers))


def phi3_rope(cfg: ModelConfig) -> bool:
    """Whether the model rotates as only Phi-3's class does among the exported ones: part of each head
    (`rotary_width`, Phi-4-mini's) or with LongRoPE's frequencies."""
    return cfg.rotary_width is not None or isinstance(cfg.rope_scaling, LongRopeScaling)


# Granite's multipliers, as its config names them (kiln's fields of the same names)
GRANITE_SCALES = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def one_class_only(cfg: ModelConfig) -> str:
    """What of the model only one class computes among the exported ones: Phi-3's rotation (`phi3_rope`:
    `phi3`), Granite's multipliers (`granite`), neither (`none`), or both (`phi3+granite`: no class)."""
    marks = [name for name, has in (("phi3", phi3_rope(cfg)),
                                    ("granite", any(getattr(cfg, f) is not None for f in GRANITE_SCALES))) if has]
    return "+".join(marks) or "none"


# Phi-3's fused projections: the tensor -> the kiln projections side by side in it, in that order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused_widths(cfg: ModelConfig) -> dict[str, int]:
    """Each part's rows in its fused Linear (`FUSED`): q's H Q, k's and v's K Q, gate's and up's F."""
    kv = cfg.n_kv_heads * cfg.head_dim
    return {"q_proj": cfg.n_heads * cfg.head_dim, "k_proj": kv, "v_proj": kv, "gate_proj": cfg.d_ff,
            "up_proj": cfg.d_ff}


def fused(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A state dict under Llama's names with each layer's q, k and v weights stacked as Phi-3's
    `qkv_proj` and gate and up as its `gate_up_proj` (gate first, as Phi3MLP chunks it); the inverse
    of training/hf_import.py's `unfused`."""
    for tensor, parts in FUSED.items():
        for name in [n for n in state if n.endswith(f".{parts[0]}.weight")]:
            prefix = name.rsplit(".", 2)[0]
            state[f"{prefix}.{tensor}.weight"] = np.concatenate([state.pop(f"{prefix}.{p}.weight") for p in parts])
    return state


def sliding(cfg: ModelConfig) -> str:
    """Which layers of the model attend through a sliding window: none, every layer, or some layers."""
    windows = [cfg.layer_window(i) is not None for i in range(cfg.n_layers)]
    return "every layer" if all(windows) else "some layers" if any(windows) else "none"


def hf_names(cfg: ModelConfig) -> dict[tuple[str, ...], str]:
    """Each kiln parameter's path in the tree -> its Hugging Face tensor name. A path that ends in
    `kernel` is a Dense kernel [in, out], stored transposed as a Linear weight [out, in]; everything
    else is stored as it is. training/hf_import.py reads a checkpoint back by this same table."""
    names = {("embed_tokens", "embedding"): "model.embed_tokens.weight", ("norm", "weight"): "model.norm.weight"}
    for i in range(cfg.n_layers):
        layer, prefix = f"layers_{i}", f"model.layers.{i}"
        for norm in BLOCK_NORMS[cfg.norm_position]:
            names[(layer, norm, "weight")] = f"{prefix}.{norm}.weight"
        for block, projections in (("self_attn", ATTENTION), ("mlp", MLP)):
            for name in projections:
                names[(layer, block, name, "kernel")] = f"{prefix}.{block}.{name}.weight"
        for name in BIASED if cfg.attention_bias else ():
            names[(layer, "self_attn", name, "bias")] = f"{prefix}.self_attn.{name}.bias"
        for name in ("q_norm", "k_norm") if cfg.qk_norm != "none" else ():
            names[(layer, "self_attn", name, "weight")] = f"{prefix}.self_attn.{name}.weight"
    if not cfg.tie_embeddings:
        names[("lm_head", "kernel")] = "lm_head.weight"
    return names


def hf_state_dict(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """kiln's parameter tree as a flat {HF name: float32 array} dict in the export class's layout
    (Linear weights are [out, in]; a Gemma norm's weight as its class stores it, kiln's weight - 1:
    `norm_offset`; Phi-3's projections fused: `fused`)."""
    model_type = architecture(cfg)[1]
    offset = norm_offset(model_type)
    out = {}
    for path, name in hf_names(cfg).items():
        leaf = np.asarray(leaf_at(params, path), dtype=np.float32)
        out[name] = np.ascontiguousarray(leaf.T if path[-1] == "kernel" else leaf - offset if path[-1] == "weight"
                                         else leaf)
    return fused(out) if model_type == "phi3" else out


def norm_offset(model_type: str) -> float:
    """What a checkpoint of `model_type` stores less than kiln's RMSNorm weight: 1 for Gemma's
    norms, which compute x * (1 + weight) in float32 where kiln computes x * weight; else 0.
    (Only norms have a leaf named `weight` in kiln's tree.)"""
    return 1.0 if model_type in OFFSET_NORMS else 0.0


def export_adapter(cfg: ModelConfig, adapters: list[tuple[object, dict[str, np.ndarray]]], out_dir: Path) -> dict:
    """LoRA train outputs' adapters (training/lora.py; flat "layers_0/self_attn/q_proj/a" names, each
    with its LoraConfig) as a `peft` adapter folder: adapter_config.json and
    adapter_model.safetensors, which `peft.PeftModel.from_pretrained(base, folder)` loads onto the
    export of the base model. kiln's update W + (alpha/rank) A B of a kernel [in, out] is peft's
    W + (lora_alpha/r) B' A' of the Linear weight [out, in], with lora_A' = A.T [r, in] and
    lora_B' = B.T [out, r]. `adapters` lists the LoRA steps a model went through, each trained on
    the one before's merged model (SFT, then DPO): their updates add up, so one adapter holds them,
    a projection's A's stacked and its B's each times its step's alpha / rank (its rank the sum of
    theirs, peft's scale 1). For a model exported as Phi3ForCausalLM, the adapters of a fused
    Linear's parts as one (`fused_adapters`)."""
    if len(adapters) == 1:
        scale, weights = adapters[0][0].alpha / adapters[0][0].rank, [1.0]  # kiln's own scale, B as it is
    else:
        scale, weights = 1.0, [lora.alpha / lora.rank for lora, _ in adapters]
    pairs, found = {}, 0  # the Linear's HF name -> (lora_A', lora_B')
    for path, name in hf_names(cfg).items():
        key = "/".join(path[:-1])
        parts = [(arrays[f"{key}/a"], w * arrays[f"{key}/b"]) for (_, arrays), w in zip(adapters, weights)
                 if path[-1] == "kernel" and f"{key}/a" in arrays]
        if parts:
            pairs[name.removesuffix(".weight")] = (np.concatenate([a for a, _ in parts], axis=1).T,
                                                   np.concatenate([b for _, b in parts], axis=0).T)
            found += 2 * len(parts)
    if found != sum(len(arrays) for _, arrays in adapters):
        raise ValueError(f"{sum(len(arrays) for _, arrays in adapters)} adapter arrays but {found} found a projection "
                         "of this model: the adapters belong to another model config")
    if architecture(cfg)[1] == "phi3":
        pairs = fused_adapters(pairs, cfg)
    tensors = {}
    for name, (a, b) in pairs.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = np.ascontiguousarray(a, np.float32)
        tensors[f"base_model.model.{name}.lora_B.weight"] = np.ascontiguousarray(b, np.float32)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    ranks = {name.rsplit(".", 1)[1]: a.shape[0] for name, (a, _) in pairs.items()}  # a module's rank, every layer
    rank = min(ranks.values())
    patterns = {module: r for module, r in sorted(ranks.items()) if r != rank}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scale * rank,
              "target_modules": sorted(ranks), "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
              "base_model_name_or_path": None, "rank_pattern": patterns,
              "alpha_pattern": {module: scale * r for module, r in patterns.items()}}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"adapter_tensors": len(tensors), "adapter_params": int(sum(t.size for t in tensors.values()))}


def fused_adapters(pairs: dict[str, tuple[np.ndarray, np.ndarray]],
                   cfg: ModelConfig) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-projection peft adapters (lora_A' [r, in], lora_B' [out, r] by Linear name) as Phi-3's fused
    Linears take them: the targeted parts of a `qkv_proj` or `gate_up_proj` become one adapter whose
    rank is the sum of theirs, their A's stacked and their B's on the block diagonal [out of all
    parts, that rank] (an untargeted part's rows zero), so that B' A' holds each part's update in its
    rows. peft scales by lora_alpha / r, the same for every module here (export_adapter), so the
    fused module's alpha follows from its rank."""
    widths = fused_widths(cfg)
    out = {}
    for name, pair in pairs.items():
        prefix, proj = name.rsplit(".", 1)
        tensor = next((t for t, parts in FUSED.items() if proj in parts), None)
        if tensor is None:  # o_proj, down_proj: as they are
            out[name] = pair
            continue
        if f"{prefix}.{tensor}" in out:
            continue  # made from its first targeted part
        parts = FUSED[tensor]
        targeted = [pairs[f"{prefix}.{part}"] if f"{prefix}.{part}" in pairs else None for part in parts]
        a = np.concatenate([p[0] for p in targeted if p is not None])
        b = np.zeros((sum(widths[part] for part in parts), a.shape[0]), np.float32)
        row = column = 0
        for part, pair in zip(parts, targeted):
            if pair is not None:
                b[row:row + widths[part], column:column + pair[0].shape[0]] = pair[1]
                column += pair[0].shape[0]
            row += widths[part]
        out[f"{prefix}.{tensor}"] = (a, b)
    return out


def leaf_at(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def architecture(cfg: ModelConfig) -> tuple[str, str]:
    """The transformers class and model_type of the export (`HF_CLASSES`). Another combination
    of attention_bias, qk_norm, norm_position, activation, scale_embeddings, NoPE, sliding layers,
    Phi-3's rotation (partial, LongRoPE) and Granite's multipliers (`one_class_only`) (say
    Qwen3's norms with Qwen2's biases: Qwen3's own attention_bias also biases o_proj), or a field
    `ONLY_IN` keeps to Gemma's classes (a sliding layers' RoPE base, query_pre_attn_scalar, soft
    caps) set in another, is a model kiln trains and serves but no class computes."""
    key = (cfg.attention_bias, cfg.qk_norm, cfg.norm_position, (cfg.activation, cfg.scale_embeddings), nope(cfg),
           sliding(cfg), one_class_only(cfg))
    model_type = HF_CLASSES.get(key, (None, None))[1]
    misplaced = [f"{name} {getattr(cfg, name)}" for name, classes in ONLY_IN.items()
                 if getattr(cfg, name) is not None and model_type not in classes]
    if model_type is None or misplaced:
        known = "; ".join(f"{arch}: attention_bias {b}, qk_norm {q}, norm_position {n}, activation {a}, "
                          f"scale_embeddings {e}, NoPE layers {p}, sliding {w}, one class's features {r}"
                          for (b, q, n, (a, e), p, w, r), (arch, _) in HF_CLASSES.items())
        raise ValueError(f"no Hugging Face class computes attention_bias {key[0]}, qk_norm {key[1]}, norm_position "
                         f"{key[2]}, activation {key[3][0]}, scale_embeddings {key[3][1]}, NoPE layers {key[4]}, "
                         f"sliding {key[5]}, one class's features {key[6]} (phi3: partial rotary or LongRoPE; "
                         "granite: its multipliers)"
                         + "".join(f", {item}" for item in misplaced) + ": kiln can train and serve this model, "
                         f"but not export it ({known}; sliding_rope_theta: Gemma3ForCausalLM only; "
                         "query_pre_attn_scalar and the soft caps: Gemma2ForCausalLM and Gemma3ForCausalLM only)")
    return HF_CLASSES[key]


def rope_scaling(cfg: ModelConfig) -> dict | None:
    """config.json's `rope_scaling`: Llama 3.1's (`rope_type: llama3`), YaRN's, linear or LongRoPE's, as
    transformers reads them."""
    if cfg.rope_scaling is None:
        return None
    if isinstance(cfg.rope_scaling, (YarnScaling, LinearScaling, LongRopeScaling)):
        return cfg.rope_scaling.model_dump(exclude_none=True)
    return {"rope_type": "llama3", **cfg.rope_scaling.model_dump()}


def hf_config(cfg: ModelConfig, bos_id: int, eos_id: int) -> dict:
    """config.json for the export's class (`architecture`): Llama's keys, less what the other classes
    do not have, plus each one's own: the sliding windows (Mistral's; OLMo 3's and Gemma's with each
    layer's type) or the Qwens' switches for them (off), Gemma's score scale, soft caps and local
    RoPE base, SmolLM3's layers without positions, Phi-3's partial rotary and original context."""
    arch, model_type = architecture(cfg)
    layer_types = ["full_attention" if cfg.layer_window(i) is None else "sliding_attention"
                   for i in range(cfg.n_layers)]
    config = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        activation_key(model_type): HF_ACTIVATIONS[cfg.activation],
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling(cfg),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,  # kiln's models have no padding row (SmolLM3's and Gemma's classes default to one)
        "torch_dtype": "float32",  # the weights; a bfloat16-trained model computed its matmuls in bfloat16
        "use_cache": True,
    }
    if model_type not in ("llama", "mistral"):  # the others' configs have none (SmolLM3's defaults it to false)
        del config["mlp_bias"]
    if model_type == "mistral":
        config["sliding_window"] = cfg.sliding_window
    if model_type == "olmo3":  # its sliding window, and each layer's attention (its rope_scaling: the full ones')
        config.update(sliding_window=cfg.sliding_window, layer_types=layer_types)
    if model_type in ("qwen2", "qwen3"):  # and the Qwens a sliding window to turn off
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    if model_type == "qwen2":  # nor Qwen2's an attention_bias: its q, k, v always have biases
        del config["attention_bias"]
    if model_type in GEMMA_2_3:  # Gemma 2's and 3's names, flat as transformers 4 and 5 read them
        config.update(query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim,
                      sliding_window=cfg.sliding_window or cfg.seq_len,
                      final_logit_softcapping=cfg.final_logit_softcapping,
                      attn_logit_softcapping=cfg.attn_logit_softcapping, use_bidirectional_attention=False,
                      layer_types=layer_types)
    if model_type == "gemma3_text":
        config["rope_local_base_freq"] = cfg.sliding_rope_theta or cfg.rope_theta
    if model_type == "phi3":  # its rotated fraction of each head, and (where LongRoPE) the original context at the
        # top level, which Phi3Config reads before the one in rope_scaling; no attention_bias key
        factor = cfg.rotary_dim / cfg.head_dim
        if int(cfg.head_dim * factor) != cfg.rotary_dim:
            raise ValueError(f"rotary_width {cfg.rotary_width} of head_dim {cfg.head_dim}: no partial_rotary_factor "
                             "gives it back in Phi3's int(head_dim * factor)")
        config.update(partial_rotary_factor=factor, sliding_window=cfg.sliding_window)
        if isinstance(cfg.rope_scaling, LongRopeScaling):
            config["original_max_position_embeddings"] = cfg.rope_scaling.original_max_position_embeddings
        del config["attention_bias"]
    if model_type == "granite":  # its multipliers, each 1 where kiln's is unset (attention's: 1 / sqrt(head_dim))
        config.update({name: getattr(cfg, name) or 1.0 for name in GRANITE_SCALES},
                      attention_multiplier=cfg.attention_multiplier or cfg.head_dim ** -0.5)
    if model_type == "smollm3":  # which layers rotate (1) and which have no positions (0); no sliding window
        config.update(no_rope_layers=[int(cfg.layer_rotates(i)) for i in range(cfg.n_layers)],
                      use_sliding_window=False, sliding_window=None, layer_types=["full_attention"] * cfg.n_layers)
    return config


def tokenizer_files(tokenizer_json: str, eos_token: str, bos_token: str | None, seq_len: int,
                    chat_template: str | None = None) -> dict[str, str]:
    """The tokenizer as `PreTrainedTokenizerFast` reads it. Without a BOS token, EOS stands in (as
    in GPT-2): it is what precedes every document in kiln's training stream. Encoding adds nothing,
    exactly like kiln's own tokenizer. A chat model's Jinja template goes in as `chat_template`,
    where `apply_chat_template` finds it."""
    special = {"bos_token": bos_token or eos_token, "eos_token": eos_token, "unk_token": eos_token}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len,
              "clean_up_tokenization_spaces": False, **special}
    if chat_template is not None:
        config["chat_template"] = chat_template
    return {"tokenizer.json": tokenizer_json,
            "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
            "special_tokens_map.json": json.dumps(special, indent=2) + "\n"}


def generation_eos(eos_id: int, turn_end_id: int | None) -> int | list[int]:
    """generation_config.json's `eos_token_id`: EOS; for a post-trained model also the token that
    ends its chat turns (`<|end|>`, or its checkpoint template's), as Llama 3 Instruct lists
    `<|eot_id|>`, so that `transformers` and vLLM end a reply, even one asked for through plain
    completions, where kiln does (evaluation.generate.Model.stop_ids)."""
    if turn_end_id is None or turn_end_id == eos_id:
        return eos_id
    return [eos_id, turn_end_id]


def export_hf(cfg: ModelConfig, params: dict, tokenizer_json: str, tokenizer_meta: dict, out_dir: Path,
              chat_template: str | None = None, turn_end_id: int | None = None) -> dict:
    """Write the Hugging Face folder (everything but the model card) into `out_dir`; return stats.

    `tokenizer_meta` is the tokenizer step's meta: eos_token, eos_id, bos_token, bos_id, vocab_size,
    special_tokens. `chat_template` goes into tokenizer_config.json; `turn_end_id` (a post-trained
    model's end of turn) into generation_config.json's EOS list.
    """
    out_dir = Path(out_dir)
    if tokenizer_meta["vocab_size"] > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer_meta['vocab_size']} tokens but the model only "
                         f"{cfg.vocab_size} embeddings: export the model with the tokenizer it was trained with")
    eos_id = tokenizer_meta["eos_id"]
    bos_id = tokenizer_meta["bos_id"] if tokenizer_meta.get("bos_id") is not None else eos_id
    config = hf_config(cfg, bos_id, eos_id)  # first: it refuses a model no transformers class computes
    weights = hf_state_dict(params, cfg)
    save_file(weights, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": bos_id, "eos_token_id": generation_eos(eos_id, turn_end_id),
                  "pad_token_id": eos_id, "do_sample": False, "max_length": cfg.seq_len}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    files = tokenizer_files(tokenizer_json, tokenizer_meta["eos_token"], tokenizer_meta.get("bos_token"), cfg.seq_len,
                            chat_template)
    for name, text in files.items():
        (out_dir / name).write_text(text, encoding="utf-8")
    return {"param_count": param_count(params), "tensors": len(weights),
            "weights_bytes": (out_dir / WEIGHTS_FILE).stat().st_size}


# --- the model card ----------------------------------------------------------------------------


def _stats_brief(stats: dict) -> str:
    keys = ("documents", "docs_out", "tokens", "vocab_size", "final_loss", "final_val_loss", "steps")
    return ", ".join(f"{k} {stats[k]:.4g}" if isinstance(stats[k], float) else f"{k} {stats[k]}"
                     for k in keys if stats.get(k) is not None)


def lineage_lines(node: dict, indent: str = "", shown: set | None = None) -> list[str]:
    """A lineage tree (tasks.engine.lineage.lineage_tree's nodes) as markdown bullets. An artefact
    met again lists its inputs once: a post-trained model's steps share the data steps, which the
    card of a DPO model listed 14 times over (170 lines for 15 artefacts)."""
    shown = set() if shown is None else shown
    if node.get("missing"):
        return [f"{indent}- {node['stage']} `{node['version']}` (not in this store)"]
    brief = _stats_brief(node.get("stats", {}))
    line = f"{indent}- **{node['name']}** `{node['version']}`" + (f": {brief}" if brief else "")
    if (node["stage"], node["version"]) in shown:
        return [line + (" (its inputs as above)" if node["inputs"] or node.get("sources") else "")]
    shown.add((node["stage"], node["version"]))
    lines = [line]
    for src in node.get("sources", []):
        lines.append(f"{indent}  - source **{src.get('name')}** ({src.get('kind')}): `{src.get('origin', '')}`")
    for child in node["inputs"]:
        lines += lineage_lines(child, indent + "  ", shown)
    return lines


ROPE_NAMES = {type(None): "", RopeScaling: ", Llama 3.1 scaling", YarnScaling: ", YaRN scaling",
              LinearScaling: ", linear scaling", LongRopeScaling: ", LongRoPE scaling"}
NORM_PLACES = {"post": "after each sublayer (post-norm)", "both": "before and after each sublayer"}
MLP_NAMES = {"silu": "SwiGLU", "gelu_tanh": "GeGLU, tanh GELU"}
MADE_BY = {"sft": "trained, then fine-tuned on conversations (SFT),", "dpo": "trained, then post-trained (SFT, DPO),",
           "soup": "trained as several models and averaged (a model soup),"}


def model_card(cfg: ModelConfig, n_params: int, name: str, license_id: str | None, lineage: dict | None,
               eval_table: list[dict] | None) -> str:
    """README.md for the export: architecture, data lineage to the raw sources, training config,
    evaluation results and the kiln commit. `lineage` is the model's lineage tree with its step's
    `config` and `code` (tasks.export.model_lineage; None when the model did not come from a kiln
    store)."""
    arch, model_type = architecture(cfg)
    slide = sliding(cfg)
    header = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:", "- kiln",
              f"- {model_type}"]
    if license_id:
        header.append(f"license: {license_id}")
    made = MADE_BY.get((lineage or {}).get("stage"), "trained")
    lines = header + ["---", "", f"# {name}", "",
                      f"A {n_params / 1e6:.2f}M-parameter Llama-style decoder {made} with kiln "
                      "(reproducible LM training: every stage a cached, versioned step with lineage).", "",
                      "## Architecture", "", "| | |", "| --- | --- |"]
    rows = [("parameters", f"{n_params:,}"), ("layers", cfg.n_layers), ("d_model", cfg.d_model),
            ("attention heads", cfg.n_heads), ("key/value heads (GQA)", cfg.n_kv_heads),
            ("head dim", cfg.head_dim), (f"MLP ({MLP_NAMES[cfg.activation]}) width", cfg.d_ff),
            ("vocabulary", cfg.vocab_size),
            ("context", cfg.seq_len), ("positions", f"RoPE, theta {cfg.rope_theta:g}"
                                                          + ROPE_NAMES[type(cfg.rope_scaling)]),
            ("norm", f"RMSNorm, eps {cfg.norm_eps:g}"), ("tied embeddings", cfg.tie_embeddings),
            ("training compute dtype", cfg.compute_dtype)] + [("q/k/v biases", True)] * cfg.attention_bias \
        + [("q/k norms", f"RMSNorm over each {cfg.qk_norm}")] * (cfg.qk_norm != "none") \
        + [("norm position", NORM_PLACES.get(cfg.norm_position))] * (cfg.norm_position != "pre") \
        + [("embeddings", "scaled by sqrt(d_model)")] * cfg.scale_embeddings \
        + [("rotated dimensions", f"{cfg.rotary_dim} of {cfg.head_dim} per head")] * (cfg.rotary_width is not None) \
        + [(f"Granite's {name}", getattr(cfg, name)) for name in GRANITE_SCALES if getattr(cfg, name) is not None] \
        + [("layers without positions (NoPE)", ", ".join(str(i) for i in range(cfg.n_layers)
                                                          if not cfg.layer_rotates(i)))] * nope(cfg) \
        + [("attention scores", f"q.k / sqrt({cfg.query_pre_attn_scalar})")] * bool(cfg.query_pre_attn_scalar) \
        + [("soft caps", f"scores {cfg.attn_logit_softcapping}, logits {cfg.final_logit_softcapping}")] * bool(
            cfg.attn_logit_softcapping or cfg.final_logit_softcapping) \
        + [("sliding window", f"{cfg.sliding_window} tokens, {slide}" + (
            f", RoPE theta {cfg.sliding_rope_theta:g}" if cfg.sliding_rope_theta else ""))] * (slide != "none")
    lines += [f"| {k} | {v} |" for k, v in rows]

    lines += ["", "## Data lineage", ""]
    if lineage is None:
        lines.append("Unknown: this model was not exported from a kiln store (no lineage.json beside it).")
    else:
        lines += ["Each step's output is named by its version (a hash of its config and its inputs' "
                  "versions), back to the raw sources:", ""] + lineage_lines(lineage)
        lines += ["", "## Training", "", f"The {lineage['stage']} step's config (every field that changes the "
                  "weights):", "",
                  "```json", json.dumps(lineage.get("config", {}), indent=2, sort_keys=True), "```"]
        code = lineage.get("code", {})
        commit = code.get("commit") or "unknown (not run from a git checkout)"
        dirty = " with uncommitted changes" if code.get("dirty") else ""
        lines += ["", f"kiln commit: `{commit}`{dirty}; {lineage['stage']} step version `{lineage['version']}`."]

    lines += ["", "## Evaluation", ""]
    if not eval_table:
        lines.append("Not evaluated in this export (no evaluate step given).")
    else:
        lines += ["This model, scored by kiln's evaluate step (lm-eval in-process; `next_passage` and `last_word` "
                  "are built from held-out documents never trained on; `heldout` is the validation token split).",
                  "", "| task | metric | value | examples |", "| --- | --- | --- | --- |"]
        for r in eval_table:
            lines.append(f"| {r['task']} | {r['metric']} | {r['value']:.4f} | {r.get('samples') or ''} |")

    lines += ["", "## Usage", "", "```python", f"from transformers import AutoTokenizer, {arch}", "",
              'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")',
              f'model = {arch}.from_pretrained("path/to/this/folder")',
              'ids = tokenizer("In the beginning", return_tensors="pt").input_ids',
              "print(tokenizer.decode(model.generate(ids, max_new_tokens=20)[0]))", "```", ""]
    return "\n".join(lines)
