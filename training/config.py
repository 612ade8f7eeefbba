"""Frozen, typed configs of the model, training and resources, and the names of what a train
output keeps. Every config derives from the engine's `ConfigModel` (tasks/engine/config.py),
whose marks say which fields are identity.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from tasks.engine.config import (Beta, ConfigModel, Count, Fraction, NonNegative, NonNegativeFloat, OpenFraction,
                                 Positive, Seed, files, identity_when_set, setting)

# Where a train output keeps the steps `TrainConfig.kept_steps` names (the loop writes them, plans
# and evaluations read them): <work folder and output>/steps/<step>/, and in it checkpoint/, that
# step's whole train state (an orbax folder of that one step).
KEPT_DIR = "steps"
KEPT_STATE = "checkpoint"
# XLA's determinism flag: deterministic scatter, reductions and autotuning on a GPU, so the same
# config on the same GPU type gives the same bits (training/launch.py sets it when
# resources.deterministic_gpu; training/step.py's attention_form reads it)
DETERMINISTIC_GPU_FLAG = "--xla_gpu_deterministic_ops=true"
# What a training host says before its first step that its user should see (DPO's reference pass
# as it goes): host 0's records of this logger at INFO go to the driver (training/launch.py), which
# passes them to its caller (the step's log)
NOTES_LOGGER = "kiln.training.notes"


# --- model, training and resources -------------------------------------------------------------
#
# Which fields are identity: everything that changes the numbers the model learns. Where and how
# fast it runs (mesh layout, hosts, addresses, log and checkpoint intervals) is a `setting`. The
# mesh and host count do change the order of float reductions, so the last bits of the parameters
# can differ between layouts, exactly as they differ between two kinds of hardware; kiln treats
# both as "where", not "what", and records the device layout in lineage instead.

class RopeScaling(ConfigModel):
    """Llama 3.1's RoPE scaling (`rope_type: llama3` in a Hugging Face config): the frequencies
    whose wavelength exceeds `original_max_position_embeddings / low_freq_factor` are divided by
    `factor`, those under `.../ high_freq_factor` kept, and those between blended smoothly."""

    factor: Positive = Field(8.0, description="How much the lowest frequencies are slowed.")
    low_freq_factor: Positive = Field(1.0, description="Wavelengths above original context / this are scaled.")
    high_freq_factor: Positive = Field(4.0, description="Wavelengths below original context / this are kept.")
    original_max_position_embeddings: Count = Field(8192, description="The context the model was first trained "
                                                    "for.")


class YarnScaling(ConfigModel):
    """YaRN's RoPE scaling (`rope_type: yarn` in a Hugging Face config, as Qwen2.5 and Qwen3 extend
    their context with): frequencies that turn fewer than `beta_slow` times over the original
    context are divided by `factor`, those that turn more than `beta_fast` times kept, those
    between blended linearly by dimension; cos and sin are multiplied by `attention_factor`
    (default 0.1 ln(factor) + 1), as transformers' `yarn` rope type computes them."""

    rope_type: Literal["yarn"] = Field(description="Which scaling: `yarn` (without it, `rope_scaling` is Llama "
                                       "3.1's).")
    factor: Positive = Field(description="How much the context is extended: low frequencies are divided by it.")
    original_max_position_embeddings: Count = Field(description="The context the model was first trained for.")
    beta_fast: Positive = Field(32.0, description="Rotations over the original context above which a frequency "
                                "is kept.")
    beta_slow: Positive = Field(1.0, description="Rotations over the original context below which a frequency "
                                "is divided by factor.")
    attention_factor: Positive | None = Field(None, description="What cos and sin are multiplied by; None: "
                                              "0.1 ln(factor) + 1 (1 for a factor of 1 or less).")
    truncate: bool = Field(True, description="Round the blended band's bounds out to whole dimensions.")

    @property
    def attention_scale(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


class LinearScaling(ConfigModel):
    """Linear RoPE scaling (`rope_type: linear` in a Hugging Face config, as Gemma 3 4B and up
    extend their full-attention layers' context): every frequency divided by `factor`, so each
    position turns as position / factor would unscaled."""

    rope_type: Literal["linear"] = Field(description="Which scaling: `linear`.")
    factor: Positive = Field(description="What positions are divided by.")


class LongRopeScaling(ConfigModel):
    """LongRoPE (`rope_type: longrope` in a Hugging Face config, Phi-3.5's, Phi-4-mini's and Phi-3's
    128k models): each rotary frequency i divided by a factor of its own, `short_factor[i]` for a
    sequence whose positions stay within `original_max_position_embeddings`, `long_factor[i]` for
    one that goes beyond, as transformers picks per call by the largest position (kiln by each
    row's); cos and sin are multiplied by `attention_factor` (default sqrt(1 + ln(factor) / ln(original
    context)), 1 for a factor of 1 or less) either way."""

    rope_type: Literal["longrope"] = Field(description="Which scaling: `longrope`.")
    short_factor: tuple[Positive, ...] = Field(description="Each frequency's divisor within the original context "
                                               "(one per pair of rotated dimensions).")
    long_factor: tuple[Positive, ...] = Field(description="Each frequency's divisor beyond the original context.")
    original_max_position_embeddings: Count = Field(description="The context the model was first trained for: "
                                                    "positions past it switch a sequence to long_factor.")
    factor: Positive = Field(description="How much the context was extended (max_position_embeddings over the "
                             "original): sets the default attention_factor.")
    attention_factor: Positive | None = Field(None, description="What cos and sin are multiplied by; None: "
                                              "sqrt(1 + ln(factor) / ln(original_max_position_embeddings)).")

    @property
    def attention_scale(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        if self.factor <= 1:
            return 1.0
        return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))


class ModelConfig(ConfigModel):
    """A Llama-style decoder. `vocab_size` is filled from the tokenizer by the pipeline, unless set."""

    vocab_size: Count = Field(50257, description="Token ids the embedding and output projection cover; the "
                              "pipeline sets it from the tokenizer where it is left at this default. Another value "
                              "pads the vocabulary (at least the tokenizer's size; the extra rows are never produced "
                              "from text): a multiple of 128 for accelerators' matmuls, or the rows of a model "
                              "started from (train.init.from a run that began at a padded Hugging Face checkpoint).")
    d_model: Count = Field(128, description="Width of the residual stream (the embedding size).")
    n_layers: Count = Field(4, description="Decoder blocks.")
    n_heads: Count = Field(4, description="Query heads per attention layer; each head is d_model / n_heads wide "
                           "unless `head_width` says otherwise, and must be even (rotary positions).")
    n_kv_heads: Count = Field(2, description="Key/value heads (grouped-query attention): n_heads / n_kv_heads query "
                              "heads share one; equal to n_heads for plain multi-head attention.")
    d_ff: Count = Field(352, description="SwiGLU hidden width (Llama uses about 8/3 d_model, rounded).")
    seq_len: Count = Field(256, description="Tokens per training sequence: the context length.")
    rope_theta: Positive = Field(10000.0, description="Base of the rotary position embedding's frequencies.")
    tie_embeddings: bool = Field(True, description="The output projection is the input embedding matrix "
                                 "(transposed) instead of a matrix of its own.")
    norm_eps: Positive = Field(1e-5, description="Epsilon added inside RMSNorm's square root.")
    init_std: Positive = Field(0.02, description="Standard deviation of the normal initial weights; the residual "
                               "output projections (o_proj, down_proj) get init_std / sqrt(2 * n_layers).")
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Activations and matmuls run in this dtype; parameters and optimizer state stay "
        "float32. Identity: bfloat16 changes the bytes of the result.")
    attention_bias: bool = identity_when_set(False, description="Biases on the q, k and v projections, as in "
                                             "Qwen2 (training/hf_import.py sets it for a Qwen2 checkpoint).")
    rope_scaling: RopeScaling | YarnScaling | LinearScaling | LongRopeScaling | None = identity_when_set(
        None, description="Scaled RoPE frequencies: Llama 3.1's, YaRN's (`rope_type: yarn`), linear "
        "(`rope_type: linear`) or LongRoPE (`rope_type: longrope`); training/hf_import.py sets it from a "
        "checkpoint's `rope_type: llama3`, `yarn`, `linear` or (Phi-3's) `longrope`. None: plain RoPE.")
    head_width: Count | None = identity_when_set(None, description="Width of each attention head (Hugging Face's "
                                                 "`head_dim`) where it is not d_model / n_heads, as in Qwen3 and "
                                                 "Mistral Nemo: q, k and v are n_heads (n_kv_heads) times it wide "
                                                 "and o_proj maps them back to d_model. None: d_model / n_heads.")
    qk_norm: Literal["none", "head", "projection"] = identity_when_set(
        "none", description="RMSNorm of q and k before the rotation: `head` over each head, with a weight of "
        "head_dim per projection, as in Qwen3; `projection` over the whole q and k projections (after their "
        "biases), as in OLMo 2. training/hf_import.py sets it for those checkpoints.")
    norm_position: Literal["pre", "post", "both"] = identity_when_set(
        "pre", description="Where each block's RMSNorms sit: `pre`, on the inputs of attention and the MLP "
        "(Llama); `post`, on their outputs before the residual adds (OLMo 2: post_attention_layernorm, "
        "post_feedforward_layernorm, no input_layernorm); `both`, on inputs and outputs (Gemma 2 and 3: "
        "input_layernorm, post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm).")
    activation: Literal["silu", "gelu_tanh"] = identity_when_set(
        "silu", description="The MLP's gate activation: `silu` (SwiGLU, Llama) or `gelu_tanh`, GELU's tanh "
        "approximation (GeGLU, Gemma's `gelu_pytorch_tanh`).")
    scale_embeddings: bool = identity_when_set(False, description="Multiply the input embeddings by "
                                               "sqrt(d_model) (Gemma); the tied output projection is not scaled.")
    query_pre_attn_scalar: Count | None = identity_when_set(
        None, description="Attention scores are q.k / sqrt(this) where it is set (Gemma's `query_pre_attn_scalar`, "
        "where Gemma's 27B models set one other than the head width), else q.k / sqrt(head_dim).")
    sliding_window: Count | None = identity_when_set(
        None, description="Positions a sliding-window layer's query sees, itself included (the keys after "
        "i - sliding_window), as in Mistral and OLMo 3; which layers slide, `layer_types` says (all of them "
        "without it). None: every layer attends to every earlier position.")
    layer_types: tuple[Literal["full_attention", "sliding_attention"], ...] | None = identity_when_set(
        None, description="Each layer's attention, one entry per layer, as a Hugging Face config's `layer_types` "
        "(OLMo 3: three sliding layers, then a full one). `rope_scaling` applies to the full-attention layers; "
        "the sliding ones rotate with plain RoPE, as OLMo 3's do.")
    attn_logit_softcapping: Positive | None = identity_when_set(
        None, description="Attention scores (after their scale) soft-capped to (-c, c) as c * tanh(score / c), as in "
        "Gemma 2 (50). Training then attends in kiln's query blocks: jax.nn.dot_product_attention has no cap.")
    final_logit_softcapping: Positive | None = identity_when_set(
        None, description="The output logits soft-capped to (-c, c) as c * tanh(logit / c), as in Gemma 2 (30).")
    rotary_layers: tuple[bool, ...] | None = identity_when_set(
        None, description="Which layers rotate q and k, one entry per layer: the others attend without positions "
        "(NoPE, as SmolLM3's every fourth layer: its `no_rope_layers`). None: every layer rotates.")
    rotary_width: Count | None = identity_when_set(
        None, description="How many of each head's first dimensions rotate, where not all of them do (Phi-4-mini's "
        "`partial_rotary_factor` 0.75: 96 of 128); the rest pass through unrotated. None: the whole head.")
    embedding_multiplier: Positive | None = identity_when_set(
        None, description="The input embeddings times this (Granite's `embedding_multiplier`, 12 in Granite 3); "
        "the tied output projection is not scaled. None: 1.")
    residual_multiplier: Positive | None = identity_when_set(
        None, description="Each sublayer's output (attention's, the MLP's) times this before the residual add "
        "(Granite's `residual_multiplier`). None: 1.")
    attention_multiplier: Positive | None = identity_when_set(
        None, description="Attention scores are q.k times this (Granite's `attention_multiplier`) instead of "
        "q.k / sqrt(head_dim).")
    logits_scaling: Positive | None = identity_when_set(
        None, description="The output logits divided by this (Granite's `logits_scaling`). None: 1.")
    sliding_rope_theta: Positive | None = identity_when_set(
        None, description="The sliding-window layers' RoPE base where it is not rope_theta (Gemma 3's "
        "`rope_local_base_freq`, 10000 beside its full layers' 1000000). None: rope_theta.")

    def layer_rotates(self, layer: int) -> bool:
        """Whether layer `layer` rotates q and k (False: a NoPE layer, `rotary_layers`)."""
        return self.rotary_layers is None or self.rotary_layers[layer]

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, or None for a full-attention layer."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] == "full_attention"):
            return None
        return self.sliding_window

    def layer_reach(self, layer: int, length: int) -> int:
        """How many positions a query of layer `layer` sees at most in a sequence of `length`: its
        sliding window where that is shorter, else `length` (the keys per query `flops_per_token`
        counts; the columns a decoding cache keeps for the layer, `training.model.init_cache`)."""
        return min(self.layer_window(layer) or length, length)

    @property
    def head_dim(self) -> int:
        """Each attention head's width: `head_width`, or d_model / n_heads."""
        return self.head_width or self.d_model // self.n_heads

    @property
    def score_width(self) -> float | None:
        """What attention scores are divided by the square root of, where it is not head_dim:
        `query_pre_attn_scalar`, or 1 / attention_multiplier^2."""
        if self.attention_multiplier is not None:
            return 1.0 / self.attention_multiplier ** 2
        return self.query_pre_attn_scalar

    @property
    def rotary_dim(self) -> int:
        """How many of each head's first dimensions rotate: `rotary_width`, or the whole head."""
        return self.rotary_width or self.head_dim

    def differences(self, other: "ModelConfig") -> dict[str, tuple]:
        """Each field whose value differs from `other`'s: its name -> (this one's, the other's), in
        field order (what a message says of two models that should be one)."""
        return {name: (value, getattr(other, name)) for name, value in self.model_dump().items()
                if value != getattr(other, name)}

    @model_validator(mode="after")
    def _check_shapes(self) -> "ModelConfig":
        if self.head_width is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
                             "(or set head_width)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        scaling = self.rope_scaling
        if isinstance(scaling, RopeScaling) and scaling.high_freq_factor <= scaling.low_freq_factor:
            raise ValueError(f"rope_scaling: high_freq_factor={scaling.high_freq_factor} must exceed "
                             f"low_freq_factor={scaling.low_freq_factor}")
        if self.layer_types is not None and len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types names {len(self.layer_types)} layers, but the model has "
                             f"n_layers={self.n_layers}")
        if self.rotary_layers is not None and len(self.rotary_layers) != self.n_layers:
            raise ValueError(f"rotary_layers names {len(self.rotary_layers)} layers, but the model has "
                             f"n_layers={self.n_layers}")
        if self.layer_types and "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.rope_scaling is not None and all(self.layer_window(i) for i in range(self.n_layers)):
            raise ValueError("rope_scaling applies to full-attention layers, and every layer slides "
                             "(sliding_window without layer_types naming a full_attention layer)")
        if self.sliding_rope_theta is not None and not any(self.layer_window(i) for i in range(self.n_layers)):
            raise ValueError("sliding_rope_theta is the sliding layers' RoPE base, and no layer slides "
                             "(set sliding_window, and layer_types if some layers attend fully)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary positions; change d_model, n_heads or "
                             "head_width")
        if self.attention_multiplier is not None and self.query_pre_attn_scalar is not None:
            raise ValueError("attention_multiplier and query_pre_attn_scalar both scale the scores: set one")
        if self.residual_multiplier is not None and self.norm_position != "pre":
            raise ValueError("residual_multiplier scales the sublayers of pre-norm blocks (Granite's); "
                             f"norm_position is {self.norm_position!r}")
        if self.embedding_multiplier is not None and self.scale_embeddings:
            raise ValueError("embedding_multiplier and scale_embeddings both scale the embeddings: set one")
        if self.rotary_width is not None and (self.rotary_width % 2 or self.rotary_width >= self.head_dim):
            raise ValueError(f"rotary_width={self.rotary_width} must be even and below head_dim={self.head_dim} (None "
                             "rotates the whole head)")
        if isinstance(scaling, LongRopeScaling) and not (len(scaling.short_factor) == len(scaling.long_factor)
                                                         == self.rotary_dim // 2):
            raise ValueError(f"rope_scaling: longrope needs one short and one long factor per rotated pair of "
                             f"dimensions, {self.rotary_dim // 2}; got {len(scaling.short_factor)} and "
                             f"{len(scaling.long_factor)}")
        return self


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token (forward + backward), PaLM's convention (Chowdhery et al. 2022,
    appendix B):

        6 * N  +  12 * L * H * Q * T

    N is `matmul_params`. The second term is attention's QK^T and AV (2 * 2 * T * H * Q per token
    per layer forward, x3 for forward + backward), with L layers, H query heads, Q head dim and
    T = seq_len; it is not halved for the causal mask. A sliding-window layer counts the keys its
    window reaches, min(window, T), in place of T: the work a windowed kernel must do (query blocks
    skip the keys before their rows' windows, `training.model.causal_attention`; cuDNN's local
    window skips them too).
    """
    keys = sum(cfg.layer_reach(i, cfg.seq_len) for i in range(cfg.n_layers))
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_heads * cfg.head_dim * keys


def matmul_params(cfg: ModelConfig) -> int:
    """The N of C = 6ND (+ attention): the parameters that multiply activations in matmuls, every
    projection in every layer plus the output projection V*D (also when tied to the embedding);
    the input embedding lookup and the norm weights do no matmul and are left out."""
    D, F, Q = cfg.d_model, cfg.d_ff, cfg.head_dim
    per_layer = D * cfg.n_heads * Q * 2 + D * cfg.n_kv_heads * Q * 2 + 3 * D * F
    return cfg.n_layers * per_layer + D * cfg.vocab_size


class MeshConfig(ConfigModel):
    """How parameters and batches are laid out over the devices present.

    The mesh has two axes, `data` and `model`; `data` gets every device not used by `model`.
    strategy "dp" replicates parameters and optimizer state on every device; "fsdp" shards each
    of them along the `data` axis (ZeRO-3 style), so memory per device falls with device count.
    `model` > 1 adds Megatron-style tensor parallelism on the `model` axis.
    """

    strategy: Literal["dp", "fsdp"] = Field("fsdp", description="`dp`: parameters and optimizer state replicated "
                                            "on every device; `fsdp`: each matrix also split along the `data` axis "
                                            "(ZeRO-3 style), so memory per device falls with device count.")
    model: Count = Field(1, description="Devices on the `model` axis (Megatron-style tensor parallelism); it must "
                         "divide the device count. 1: none.")


class InLoopEvalConfig(ConfigModel):
    """Evaluations inside training, on the parameters the run has at that step (no reload, no
    second process; evaluation/in_loop.py). A setting as a whole: it changes what is logged,
    never what is learned. Each evaluation's wall time is logged and left out of tokens/s."""

    every: Count = Field(100, description="Run them every this many steps (a multiple of train.log_every) "
                         "and at the last step.")
    heldout_tokens: Count | None = Field(
        16384, description="Bits per byte and loss on the first this many held-out tokens of each source "
        "(`eval/<source>/bpb`; one source, `heldout`, for a run on one stream); None: none.")
    # tuples, not lists: a TrainConfig is hashed (training/loop.py keeps one compiled program per config)
    tasks: tuple[str, ...] = Field((), description="kiln suite tasks (next_passage, last_word), cut "
                             "from the held-out documents exactly as the evaluate step cuts them (eval.suite).")
    lm_eval_tasks: tuple[str, ...] = Field((), description="lm-eval task names this machine can load "
                                     "(task YAML files are for the evaluate step).")
    limit: Count | None = Field(100, description="Examples per task (the same seeded sample as eval.limit).")
    num_fewshot: NonNegative = Field(0, description="Few-shot examples lm-eval puts before each question.")
    apply_chat_template: bool = Field(False, description="As eval.apply_chat_template: each task's prompt in the "
                                      "chat template the tokenizer carries.")
    batch_size: Count = Field(16, description="Sequences per forward pass, for the held-out tokens and the tasks.")

    @model_validator(mode="after")
    def _check(self) -> "InLoopEvalConfig":
        from evaluation.suite import SUITE_TASKS  # here: evaluation.suite builds on this module

        unknown = [t for t in self.tasks if t not in SUITE_TASKS]
        if unknown:
            raise ValueError(f"unknown kiln suite tasks {unknown} in train.evals.tasks; kiln builds "
                             f"{list(SUITE_TASKS)}. lm-eval's own tasks go under train.evals.lm_eval_tasks")
        if self.heldout_tokens is None and not (self.tasks or self.lm_eval_tasks):
            raise ValueError("train.evals evaluates nothing: set heldout_tokens, tasks or lm_eval_tasks, "
                             "or leave train.evals out")
        if any(t.endswith((".yaml", ".yml")) for t in self.lm_eval_tasks):
            raise ValueError(f"train.evals.lm_eval_tasks {self.lm_eval_tasks} names task files: in-loop evals "
                             "take lm-eval task names; score YAML tasks with the evaluate step (eval.lm_eval_tasks)")
        return self


class LoraConfig(ConfigModel):
    """LoRA adapters (training/lora.py): only they train; the model stays as it started."""

    rank: Count = Field(8, description="Inner dimension of each adapter: A is [in, rank], B [rank, out].")
    alpha: Positive = Field(16.0, description="The update is scaled by alpha / rank (peft's lora_alpha).")
    targets: tuple[Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], ...] = Field(
        ("q_proj", "v_proj"), min_length=1, description="The projections of every layer that get an adapter.")


class InitConfig(ConfigModel):
    """Where a train step starts (identity: the parent's version enters as an input's, with the
    step and the mode). docs/starting_points.md.

    mode continue: parameters, optimizer state, step counter and data position: a new phase of the
        same run; the learning rate is this step's schedule at the restored step.
    mode reset: parameters and optimizer moments; the step counter, the schedule and the data
        position start again at 0.
    mode weights: parameters only; a fresh optimizer and schedule."""

    model_config = ConfigDict(populate_by_name=True)

    from_: str | None = setting(None, alias="from", description="A train step of this experiment by name "
                                "(`train`, `train/stable`), or an output already in the store by its place "
                                "(`train/<version>`, `sft/<version>`, `dpo/<version>`, or `soup/<version>` in "
                                "mode weights); its version enters this step's version.")
    hf: str | None = files(None, description="A Hugging Face model folder (Llama, Qwen2, Qwen3, OLMo 2, OLMo 3 "
                           "or Mistral; local files), entering the version by its content. Mode `weights` only.")
    step: Count | Literal["latest"] = Field("latest", description="Which checkpoint of `from`: a step it keeps "
                                            "(the pipeline makes it keep the steps named here), or its last.")
    mode: Literal["continue", "reset", "weights"] = Field(
        "continue", description="What it takes from `from`: `continue`, parameters, optimizer state, step counter "
        "and data position (a new phase of the same run); `reset`, parameters and optimizer moments, with the step "
        "counter, schedule and data position starting at 0; `weights`, parameters only.")

    def kept_step(self, parent_steps: int | None) -> int | None:
        """The step of the parent whose kept state this start reads (`parent_steps`: the steps the
        parent trains, for `latest`; None when not known yet); None also for mode weights from
        the last step, which reads the parent's published model instead."""
        if self.step != "latest":
            return self.step
        return None if self.mode == "weights" else parent_steps

    @model_validator(mode="after")
    def _check(self) -> "InitConfig":
        if (self.from_ is None) == (self.hf is None):
            raise ValueError("train.init names where to start: give exactly one of `from` (a step of this "
                             "experiment) and `hf` (a Hugging Face model folder)")
        if self.hf is not None and (self.mode != "weights" or self.step != "latest"):
            raise ValueError("train.init.hf: a Hugging Face model has parameters only, so mode must be `weights` "
                             "(and no step)")
        return self


def model_mismatch(named: str, theirs: ModelConfig, ours: ModelConfig) -> str:
    """Why a step cannot start from `named`'s parameters: the model fields that differ, each with
    both values, so that the `model` section to write is in the message (only they differ)."""
    fields = ", ".join(f"{name}: {mine!r} here, {its!r} there"
                       for name, (its, mine) in theirs.differences(ours).items())
    return (f"{named} holds a model of another config than this step's ({fields}): give `model` its values to start "
            "from it (model.vocab_size may be more than the tokenizer's tokens: a padded vocabulary's rows)")


class TrainConfig(ConfigModel):
    """The optimisation recipe. `batch_size` is global (sequences per step, over all hosts)."""

    batch_size: Count = Field(16, description="Sequences (of model.seq_len tokens) per optimizer step, over all "
                              "hosts: the global batch.")
    microbatches: Count = Field(1, description="Gradient accumulation: each batch is split into this many parts, "
                                "run one after another, and their gradients averaged into one step.")
    steps: Count = Field(300, description="Optimizer steps the run trains.")
    lr: Positive = Field(3e-3, description="Peak learning rate, reached at the end of warmup.")
    min_lr_ratio: Fraction = Field(0.1, description="The schedule ends at lr * min_lr_ratio.")
    warmup: NonNegative = Field(30, description="Steps of linear warmup up to `lr`; 0: none.")
    schedule: Literal["cosine", "wsd"] = Field(
        "cosine", description="After warmup: `cosine`, half a cosine down to lr * min_lr_ratio at the last step; "
        "`wsd` (warmup-stable-decay), `lr` held, then a linear decay to lr * min_lr_ratio over the last "
        "`decay_fraction` (or `decay_steps`) of the steps.")
    decay_fraction: OpenFraction = Field(0.2, description="WSD: the last fraction of the steps decays linearly to "
                                         "lr * min_lr_ratio.")
    decay_steps: Count | None = identity_when_set(
        None, description="WSD: decay over exactly this many last steps instead of `decay_fraction` of them (a "
        "cooldown branch of a fixed length, whichever step it starts from).")
    decay_shape: Literal["linear", "sqrt"] = identity_when_set(
        "linear", description="WSD: how the decay falls: `linear`, or `sqrt`, lr = floor + (lr - floor) * (1 - "
        "sqrt(progress)) over the decay, steep at its start and flat at its end (Hägele et al., 2024, found it "
        "better than linear at the same length; on configs/cooldown_cpu.yaml it was 0.4-1.2% worse: "
        "benchmarks/RESULTS.md).")
    optimizer: Literal["adamw", "muon"] = identity_when_set(
        "adamw", description="`adamw`; or `muon`: Muon (momentum orthogonalised by Newton-Schulz) for the decoder "
        "blocks' projection matrices, scaled to AdamW's update size so that `lr` and `weight_decay` carry over, and "
        "AdamW for the embedding, output layer, norms and biases (training/optim.py). Not with `lora`.")
    muon_momentum: Beta = identity_when_set(0.95, description="Muon's (Nesterov) momentum; the AdamW part of a "
                                            "muon run uses beta1 and beta2.")
    weight_decay: NonNegativeFloat = Field(0.1, description="Decoupled weight decay (times the learning rate), "
                                           "applied to matrices only, never to norms: AdamW's, and Muon's.")
    grad_clip: NonNegativeFloat = Field(1.0, description="Clip the gradient's global norm to this; 0 turns "
                                        "clipping off.")
    beta1: Beta = Field(0.9, description="Adam's decay rate of the first moment (the gradient's running mean).")
    beta2: Beta = Field(0.95, description="Adam's decay rate of the second moment (the squared gradient's).")
    eps: Positive = Field(1e-8, description="Adam's epsilon, added to the denominator of each update.")
    seed: Seed = Field(0, description="Seeds the initial parameters and the order the loader draws training "
                       "sequences in.")
    eval_batches: Count = Field(4, description="Held-out batches each validation loss is measured on (so it "
                                "changes the reported val_loss); a mixture needs one per source.")
    checkpoint_every: Count = setting(100, description="Save a checkpoint (the whole train state, to resume from) "
                                      "every this many steps, and at the last step.")
    checkpoint_every_minutes: Positive | None = setting(
        None, description="Also save a checkpoint once this many minutes of wall time have passed since "
        "the last one (checked at log steps, as host 0's clock sees it). None: by steps only.")
    checkpoint_timeout_minutes: Positive = setting(
        20, description="The longest a checkpoint write may take and, with several hosts, how long each "
        "waits for the others to finish theirs: a host whose write fails leaves itself and its peers waiting "
        "this long before the run fails (the failed host's error says why). Raise it for states that take "
        "longer to write.")
    log_every: Count = setting(10, description="Measure and log a metrics record (loss, lr, grad_norm, tokens/s, "
                               "MFU) every this many steps, and at the last step.")
    eval_every: Count = setting(50, description="Measure val_loss every this many steps (at those that are also "
                                "log steps) and at the last step, when there is held-out data; never changes the "
                                "parameters.")
    mesh: MeshConfig = setting(MeshConfig(), description="How parameters and batches are laid out over the "
                               "devices.")
    peak_flops: Positive | None = setting(None, description="Peak FLOP/s of one device, for MFU; None: the declared "
                                          "peak of a known accelerator, or the measured float32 matmul peak on CPU.")
    evals: InLoopEvalConfig | None = setting(None, description="Evaluations during training (held-out bits per "
                                             "byte per source, suite tasks) every N steps; leave out for none.")
    keep_checkpoints: tuple[int, ...] = setting((), description="Steps whose whole state (parameters, optimizer "
                                                "state, step, data position) the train output keeps, under "
                                                "`steps/<step>/`: what `eval.checkpoints` and the `train.init` of "
                                                "other steps name (the pipeline fills it in from them). A setting: "
                                                "what is kept, not what is learned; `kiln plan` warns when a cached "
                                                "output lacks a step that a step after it needs.")
    keep_every: Count | None = setting(None, description="Also keep every this many steps (a stable run that "
                                       "cooldown branches may start from at any of them).")
    schedule_steps: Count | None = identity_when_set(
        None, description="The steps the learning-rate schedule spans; None: `steps`. A first phase that a "
        "`continue` phase extends sets the whole run's, so that the two phases train as one run would.")
    ema: Annotated[float, Field(gt=0, lt=1)] | None = identity_when_set(  # a decay in (0, 1)
        None, description="Keep an exponential moving average of the parameters, updated after every step "
        "(ema = decay * ema + (1 - decay) * params, from the initial parameters), e.g. 0.999 (Levanter's "
        "model averaging, Marin's ema_beta). The published model and its kept steps are then the average: what "
        "evaluation, the export and later phases read; training itself is unchanged. `val_loss` stays the "
        "trained parameters', and `ema_val_loss` is logged beside it. One more copy of the parameters in the "
        "train state (checkpointed: a resume is bit for bit). Not with `lora`.")
    ema_warmup: bool = identity_when_set(
        False, description="With `ema`: the decay at step t is min(ema, (1 + t) / (10 + t)) (TensorFlow's "
        "ExponentialMovingAverage with num_updates), so the average forgets the starting parameters within "
        "the first steps and spans about the last t / 9 steps until it reaches `ema` (t near 9000 for 0.999); "
        "without it the starting parameters keep weight ema^steps.")
    init: InitConfig | None = identity_when_set(None, description="Start from another step's checkpoint or a "
                                                "Hugging Face model instead of a random initialisation.")
    lora: LoraConfig | None = identity_when_set(None, description="Train LoRA adapters only, the parameters "
                                                "frozen (docs/starting_points.md); the output is the merged model "
                                                "and the adapters beside it.")
    # How the step runs on a device, and what it trains on beyond the plain cross-entropy
    # (training/step.py `next_token`, training/model.py); pretraining's next-token objective only.
    attention: Literal["auto", "query_blocks", "fused"] = setting(
        "auto", description="Training's attention: `query_blocks` (kiln's, fastest on a CPU), `fused` "
        "(jax.nn.dot_product_attention: cuDNN's flash attention on a GPU with bfloat16, XLA's elsewhere), `auto`: "
        "query_blocks on a CPU, fused on a GPU or TPU. Under XLA's GPU determinism flag (resources.deterministic_gpu) "
        "cuDNN's is not used (it stopped the first step on JAX 0.11.2): auto is query_blocks there, fused XLA's. A setting, like the mesh: the forms agree to float rounding "
        "(tests/test_model_features.py), not bit for bit, and the form a run used is in its stats (`attention`).")
    batch_parts: Count = identity_when_set(
        1, description="Each (micro)batch computed as this many independent parts side by side in one program, "
        "their losses and gradients averaged (part p holds rows p, p+n, p+2n, ...). XLA's CPU runtime runs the "
        "parts' independent ops on separate threads, where one small model's ops run one at a time and leave a "
        "core idle: 2 on a 2-core CPU took a small model's step 0.87-0.96x the time (benchmarks/RESULTS.md). The same "
        "math in another summation order, so identity; the batch per microbatch (and per data-parallel device) "
        "must divide by it. Pretraining's next-token objective only.")
    split_parts: bool = identity_when_set(
        False, description="The batch_parts as separate programs, one dispatched per part and one that averages "
        "their gradients and takes the optimizer's step, in flight at once, instead of one program: XLA's CPU "
        "runtime then gives each part a thread of its own. A narrow win: at nanoGPT's CPU recipe shape (batch 12 x 64) "
        "1.08-1.21x the steps/s of one program, at batch 24 x 64 0.86x, at the tiny config's 0.84-0.89x "
        "(benchmarks/RESULTS.md): measure before setting it. The same "
        "math, not the same bits, so identity. One device, one microbatch, batch_parts > 1, no LoRA.")
    remat: Literal["none", "full", "dots_saveable", "offload"] = identity_when_set(
        "none", description="Rematerialisation of each decoder block (jax.checkpoint): `full` keeps only each "
        "block's input and recomputes the rest in the backward pass, `dots_saveable` keeps the matmul outputs, "
        "`offload` moves those to host memory and back. Less activation memory for more compute (`kiln capacity` "
        "shows how much). The same math, but identity: on CPU the loss and gradients were bit for bit those "
        "without remat in float32 and differed in the last bits (up to 2.4e-4) with bfloat16 compute.")
    document_mask: bool = identity_when_set(
        False, description="Attention stays inside each document of a packed row, and rotary positions restart "
        "at each document's first token (the documents are cut after each EOS, as Llama 3 trains). Decoding is "
        "unchanged (one document per row).")
    z_loss: NonNegativeFloat = identity_when_set(
        0.0, description="Adds this times mean(logsumexp(logits)^2) to the loss trained on (PaLM's z-loss, "
        "e.g. 1e-4), logged as `z_loss`; the logged `loss` stays the cross-entropy.")
    eos_id: NonNegative | None = setting(
        None, description="The EOS id `document_mask` cuts documents at. The train step fills it in from its "
        "tokens' tokenizer (whose version is already in this step's), so leave it out; a value that differs "
        "from the tokens' is an error.")

    def pretraining_only(self) -> list[str]:
        """The options set here that only pretraining's next-token objective has, as `name=value`:
        post-training's rows are packed conversations or padded pairs (training/step.py
        `check_objective_options`, and the posttrain section when it is read)."""
        return [f"{name}={getattr(self, name)!r}" for name, plain in
                (("document_mask", False), ("z_loss", 0.0), ("batch_parts", 1), ("split_parts", False))
                if getattr(self, name) != plain]

    @property
    def kept_steps(self) -> tuple[int, ...]:
        """Every step the output keeps: `keep_checkpoints` and the multiples of `keep_every`."""
        every = range(self.keep_every, self.steps + 1, self.keep_every) if self.keep_every else ()
        return tuple(sorted({*self.keep_checkpoints, *every}))

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        outside = [s for s in self.keep_checkpoints if not 1 <= s <= self.steps]
        if outside or list(self.keep_checkpoints) != sorted(set(self.keep_checkpoints)):
            raise ValueError(f"keep_checkpoints={list(self.keep_checkpoints)} must be distinct increasing steps between "
                             f"1 and steps={self.steps}" + (f" ({outside} are not)" if outside else ""))
        if self.schedule_steps is not None and self.schedule_steps < self.steps:
            raise ValueError(f"schedule_steps={self.schedule_steps} is shorter than steps={self.steps}: the schedule "
                             "spans at least the steps trained")
        if self.evals is not None and self.evals.every % self.log_every:
            raise ValueError(f"train.evals.every={self.evals.every} is not a multiple of log_every={self.log_every}: "
                             "evaluations are logged with the metrics of a log step")
        if self.batch_size % self.microbatches:
            raise ValueError(f"batch_size={self.batch_size} must be divisible by microbatches={self.microbatches}")
        if (self.batch_size // self.microbatches) % self.batch_parts:
            raise ValueError(f"batch_size={self.batch_size} in {self.microbatches} microbatch(es) of "
                             f"{self.batch_size // self.microbatches} rows does not split into batch_parts="
                             f"{self.batch_parts} equal parts: pick a batch_parts that divides the rows per microbatch")
        if self.optimizer == "muon" and self.lora is not None:
            raise ValueError("optimizer muon orthogonalises a model's own matrices; LoRA's low-rank adapters train "
                             "with adamw: leave optimizer out with lora")
        if self.decay_shape != "linear" and self.schedule != "wsd":
            raise ValueError(f"decay_shape={self.decay_shape} shapes WSD's decay; schedule is {self.schedule}: "
                             "set schedule wsd or leave decay_shape out")
        if self.ema_warmup and self.ema is None:
            raise ValueError("train.ema_warmup ramps up the decay of train.ema's average: set ema too, or leave "
                             "ema_warmup out")
        if self.ema is not None and self.lora is not None:
            raise ValueError("train.ema averages a model's own parameters; LoRA trains adapters on frozen ones: "
                             "leave ema out with lora")
        if self.warmup >= self.steps:
            raise ValueError(f"warmup={self.warmup} must be shorter than steps={self.steps}")
        if self.split_parts and (self.batch_parts == 1 or self.microbatches > 1 or self.lora is not None):
            raise ValueError(f"split_parts runs each of batch_parts' parts as its own program: it needs "
                             f"batch_parts > 1 (is {self.batch_parts}), microbatches 1 (is {self.microbatches}) "
                             f"and no lora (is {'set' if self.lora else 'unset'}); leave it out otherwise")
        return self


class MixtureSourceConfig(ConfigModel):
    """One source's part in a mixture: its weight, and how often its tokens may be repeated."""

    weight: NonNegativeFloat = Field(description="Its share of the training tokens, relative to the "
                                     "other weights; 0: validation only (its tokens are never trained on).")
    max_epochs: Positive | None = Field(None, description="At most this many passes over its training "
                                        "tokens; where the weight would repeat it more, its share is lowered "
                                        "to the cap and the other sources' shares grow to fill the run. "
                                        "None: no cap.")


class MixtureConfig(ConfigModel):
    """Several sources, each tokenized on its own, mixed by the training loader by weight
    (training/data.py). Every entry of `data.sources` is named here, by its `name`."""

    # `sources` comes last: with the section half written, an error names the field that is wrong
    # (pydantic reports fields in order) rather than a missing `sources`.
    tokens: Count | None = Field(None, description="The training budget in tokens: it sets `train.steps` "
                                 "(tokens // (batch_size * seq_len)), replacing any `train.steps`.")
    tokenizer_source: str | None = Field(None, description="With `tokenizer.kind: bpe`, the one source whose "
                                         "documents the BPE is trained on (required), so that changing another "
                                         "source retrains no tokenizer and re-tokenizes nothing else.")
    sources: dict[str, MixtureSourceConfig] = Field(min_length=1, description="Source name -> its weight and "
                                                    "repetition cap, in the order the loader mixes them.")

    @model_validator(mode="after")
    def _check(self) -> "MixtureConfig":
        if not any(s.weight > 0 for s in self.sources.values()):
            raise ValueError(f"every weight is 0 ({', '.join(self.sources)}): give at least one source a "
                             "positive weight to train on (weight 0 makes a source validation only)")
        return self


class ResourcesConfig(ConfigModel):
    """Where training runs. None of it changes what is learned, so none of it is identity."""

    hosts: Count = setting(1, description="Hosts the step trains on: one Ray task per host, all joined in one JAX "
                           "distributed runtime; batch_size is split over them.")
    cpus_per_host: Count = setting(2, description="Ray CPUs each host's task asks for.")
    cpu_devices: Count = setting(1, description=(
        "On a CPU host: XLA CPU devices its step is split over, data parallel (one per core of cpus_per_host). "
        "XLA runs most of a small model's ops on one thread, so 2 devices on 2 cores take a small step faster "
        "(benchmarks/RESULTS.md: 0.55-0.75x the time for the bare step, 0.7-0.96x through the loop). "
        "The batch must divide by hosts x cpu_devices, and train.mesh.strategy be dp "
        "(the devices share one memory: fsdp would save none and gather every step). The gradient's sums then "
        "run in another order: the same bits for the same setting, rounding-level differences across settings. "
        "Experimental: once, a process with two CPU devices aborted in XLA's all-reduce rendezvous ('only 1 of 2 "
        "threads arrived', after 40 s) when a second program ran right after the step; no shipped config sets it."))
    gpus_per_host: NonNegative = setting(0, description="Ray GPUs each host's task asks for; 0 (and no TPUs): "
                                         "training runs on CPU.")
    tpu_hosts: bool = setting(False, description="Ask Ray for each host's TPU chips (its `TPU` resource).")
    tpus_per_host: Count = setting(4, description="With tpu_hosts: the TPU chips each host's task asks for.")
    ray_address: str | None = setting(None, description="The Ray cluster to train on; None: RAY_ADDRESS, else a Ray "
                                      "this process is connected to, else kiln's local Ray on this machine "
                                      "(tasks/engine/local_ray.py).")
    deterministic_gpu: bool = setting(True, description="On GPU hosts, set XLA's deterministic GPU ops "
                                      "(--xla_gpu_deterministic_ops=true): slower scatters, bitwise-reproducible "
                                      "runs on the same GPU type.")
    stop_grace_s: Count = setting(60, description="Seconds the hosts get, once the run is told to stop (Ctrl-C, "
                                  "SIGTERM, a batch scheduler's warning), to checkpoint the step they are at (with "
                                  "several hosts, agreed within about 10 s: give at least one step's time and 10 s "
                                  "more) before they are cancelled where they are and the rerun resumes from the last "
                                  "periodic checkpoint. Raise it for a large model's checkpoint; keep it below what "
                                  "the job is given after its stop signal (Slurm's KillWait or the seconds of "
                                  "--signal=USR1@N, systemd's TimeoutStopSec).")
    connect_timeout_s: Count = setting(120, description="Seconds a host waits to join the others (JAX's "
                                       "coordinator on host 0's node) before the step fails with an error naming the "
                                       "host and the address it tried.")
    slots: str | None = setting(None, pattern=r"^[A-Za-z0-9_.-]+$", description="A slot limit this step holds "
                                "hosts x gpus_per_host slots of (one per host without GPUs) while it trains, so "
                                "that runs never double-book the accelerators; its size is run.slot_limits' "
                                "(tasks/engine/slots.py: Redis at run.lock_url, else files on this machine).")


def check_cpu_devices(train_cfg: TrainConfig, resources: ResourcesConfig) -> None:
    """Refuse a CPU device split the step cannot use, before anything starts."""
    if resources.cpu_devices == 1 or resources.gpus_per_host or resources.tpu_hosts:
        return
    if train_cfg.mesh.strategy != "dp":
        raise ValueError(f"resources.cpu_devices={resources.cpu_devices} splits each host's batch over CPU devices that "
                         f"share one memory, so train.mesh.strategy {train_cfg.mesh.strategy!r} would gather the "
                         "parameters every step and save no memory: set train.mesh.strategy: dp")
    data = resources.hosts * resources.cpu_devices // train_cfg.mesh.model
    per_micro = train_cfg.batch_size // train_cfg.microbatches
    if train_cfg.batch_size % data or per_micro % (data * train_cfg.batch_parts):
        raise ValueError(f"train.batch_size={train_cfg.batch_size} (in {train_cfg.microbatches} microbatch(es), each "
                         f"in batch_parts={train_cfg.batch_parts} part(s)) does not split over {data} data-parallel "
                         "devices (resources.hosts x cpu_devices / train.mesh.model): pick a batch (per microbatch "
                         "and part) that they divide, or fewer cpu_devices")


def model_and_train(path: str) -> tuple[ModelConfig, TrainConfig]:
    """The `model` and `train` sections of an experiment YAML (e.g. configs/small_gpu.yaml).

    For benchmarks and tests that run the training engine alone, without Prefect or the rest of
    the experiment config; `vocab_size` stays at its default (GPT-2's) unless the file sets it.
    """
    import yaml

    with open(path) as f:
        raw = yaml.safe_load(f)
    return ModelConfig.model_validate(raw.get("model", {})), TrainConfig.model_validate(raw.get("train", {}))
