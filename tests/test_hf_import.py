"""Hugging Face import (training/hf_import.py) and the `hf` tokenizer kind.

Checkpoints that transformers writes (random LlamaForCausalLM, tied and untied, and Qwen2ForCausalLM
with its q/k/v biases; norms and biases randomised too, so a dropped or swapped one shows) come
back as kiln's model with transformers' logits, also through the key/value cache, and export back
to folders that transformers loads with the same logits. Configs kiln cannot compute are refused,
saying why. Those tests need torch (`needs`); the refusals, the inverse of kiln's own export and
the tokenizer kind do not.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tasks.engine.versioning import identity_fields
from tasks.tokenizer import TokenizerConfig, load_tokenizer, read_tokenizer_meta, tokenizer_step
from tests.conftest import needs
from tests.test_loader import run_body
from tests.test_posttrain import CONVERSATION
from training.config import LongRopeScaling, ModelConfig
from evaluation.generate import load
from training.export import export_hf, hf_state_dict, phi3_rope
from training.hf_import import load_hf
from training.model import decode_step, forward, init_cache, init_params
from training.step import init_state

VOCAB = 320  # the model's; the test tokenizer has fewer tokens, as a padded HF vocabulary does
TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
        "and darkness was upon the face of the deep. And God said, Let there be light: and there was light.")
SPECIAL = ["<unk>", "<s>", "</s>"]

forward = jax.jit(forward, static_argnums=2)


# --- folders -------------------------------------------------------------------------------------


def tokenizer_folder(folder: Path, tokenizer_config: dict | None = None) -> Path:
    """A byte-level BPE saved as tokenizer.json, with `tokenizer_config` beside it (None: none)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                            show_progress=False))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


LLAMA_TOKENS = {"eos_token": "</s>", "bos_token": {"content": "<s>", "special": True}}  # an AddedToken, as HF writes


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The tokenizer step's output for a Hugging Face tokenizer folder."""
    root = tmp_path_factory.mktemp("hf-tokenizer")
    step = tokenizer_step(TokenizerConfig(kind="hf", path=str(tokenizer_folder(root / "hf", LLAMA_TOKENS))))
    run_body(step, root / "out", {})
    return root / "out"


def kiln_export(folder: Path, cfg: ModelConfig, tokenizer_dir: Path, seed: int = 0) -> dict:
    """kiln's own export of random parameters (norms and biases randomised): a Hugging Face folder
    made without torch. Returns the parameters."""
    params = init_params(cfg, jax.random.PRNGKey(seed))
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map_with_path(
        lambda path, p: np.asarray(p + (0.2 * rng.standard_normal(p.shape) if path[-1].key in ("weight", "bias")
                                        else 0), np.float32), params)
    folder.mkdir(parents=True)
    export_hf(cfg, params, (tokenizer_dir / "tokenizer.json").read_text(), read_tokenizer_meta(tokenizer_dir), folder)
    return params


@pytest.fixture(scope="module")
def hf():
    """torch and transformers, or these tests skipped with the install hint."""
    return needs("torch"), needs("transformers")


def transformers_model(hf, arch: str, **config):
    """A random transformers model of `arch` (llama, qwen2, qwen3, olmo2, olmo3, mistral, gemma2, gemma3, smollm3):
    matrices N(0, 0.1), norms (q/k norms too) 1 + N(0, 0.2) (Gemma's multiply by 1 + that), biases N(0, 0.2).
    Heads are 48 / 6 = 8 wide unless `head_dim`."""
    torch, transformers = hf
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config, "olmo2": transformers.Olmo2Config,
                    "olmo3": transformers.Olmo3Config, "mistral": transformers.MistralConfig,
                    "gemma": transformers.GemmaConfig, "gemma2": transformers.Gemma2Config,
                    "gemma3": transformers.Gemma3TextConfig,
                    "smollm3": transformers.SmolLM3Config, "phi3": transformers.Phi3Config,
                    "granite": transformers.GraniteConfig}[arch]
    cfg = config_class(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                       bos_token_id=1, eos_token_id=2, **config)
    torch.manual_seed(len(arch))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2 if name.endswith("bias") else 0.1)
    return model.eval()


def torch_logits(hf, model, tokens: np.ndarray) -> np.ndarray:
    torch, _ = hf
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def assert_close(got: np.ndarray, expected: np.ndarray) -> None:
    rel = np.abs(got - expected).max() / np.abs(expected).max()
    assert rel < 1e-4, f"max relative difference {rel:.2e}"
    assert np.abs(expected).max() > 1.0  # the logits are not trivially small


def tokens_for(cfg: ModelConfig, T: int = 24) -> np.ndarray:
    return np.random.default_rng(0).integers(0, cfg.vocab_size, size=(3, T)).astype(np.int32)


# --- transformers checkpoints --------------------------------------------------------------------

CASES = {
    "llama-untied": ("llama", {"tie_word_embeddings": False, "rope_theta": 500.0}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True, "rope_theta": 1e6}),
    # Mistral 7B v0.2 on: no sliding window; v0.1's (4096) does not bite at contexts up to it
    "mistral-no-window": ("mistral", {"tie_word_embeddings": False, "sliding_window": None, "rope_theta": 1e6}),
    "mistral-window-the-context": ("mistral", {"tie_word_embeddings": False, "sliding_window": 64}),
    # Qwen3: q/k norms, heads wider than hidden / heads (Qwen3-0.6B: 16 heads of 128 over 1024)
    "qwen3-tied-wide-heads": ("qwen3", {"tie_word_embeddings": True, "rope_theta": 1e6, "head_dim": 16}),
    # head_dim written out equal to hidden / heads (Qwen3Config's default is 128): kiln's default width
    "qwen3-untied": ("qwen3", {"tie_word_embeddings": False, "head_dim": 8}),
    # OLMo 2: norms after attention and the MLP, q/k norms over the whole projections
    "olmo2-untied": ("olmo2", {"tie_word_embeddings": False, "rope_theta": 500000.0}),
    "olmo2-tied": ("olmo2", {"tie_word_embeddings": True}),
    # sliding windows shorter than the 24 tokens run: Mistral v0.1's in every layer, OLMo 3's in the
    # layers layer_types names, with YaRN on the full-attention layers only (as OLMo 3's long context)
    "mistral-window-in-the-context": ("mistral", {"tie_word_embeddings": False, "sliding_window": 8}),
    # (Olmo3Config gives a rope_theta argument to the full layers only: left at its default, 500000)
    "olmo3": ("olmo3", {"tie_word_embeddings": False, "sliding_window": 8,
                        "layer_types": ["sliding_attention", "full_attention"]}),
    "olmo3-yarn-on-full-layers": ("olmo3", {"tie_word_embeddings": True, "sliding_window": 6,
                                            "layer_types": ["full_attention", "sliding_attention"],
                                            "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 16}}),
    # Mistral Nemo's shape: heads narrower than hidden / heads (32 of 128 over 5120)
    "mistral-narrow-heads": ("mistral", {"tie_word_embeddings": False, "sliding_window": None, "head_dim": 4}),
    # Llama 3.1's RoPE scaling, its original context short enough that positions 0..23 feel it:
    # with head_dim 8 and theta 500 one frequency is blended, two are slowed, one is kept
    "llama-rope-llama3": ("llama", {"tie_word_embeddings": False, "rope_theta": 500.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    # YaRN (Qwen's long-context setting): heads of 16 and an original context of 64 blend dimensions
    # 1 and 2 of 8, and the attention factor is 0.1 ln 4 + 1
    "qwen3-yarn": ("qwen3", {"tie_word_embeddings": True, "head_dim": 16, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
    # Phi-3 and Phi-4: Llama with q, k, v fused in one tensor and gate, up in another; Phi-3 mini's
    # window (2047 of 4096) where it bites, as Mistral's
    "phi3": ("phi3", {"tie_word_embeddings": False, "pad_token_id": 0, "rope_theta": 250000.0}),
    "phi3-window": ("phi3", {"tie_word_embeddings": False, "pad_token_id": 0, "sliding_window": 7}),
    # Phi-3.5 mini's LongRoPE within its original context (32: short_factor), the attention factor
    # sqrt(1 + ln 2 / ln 32) from max_position_embeddings / original
    "phi3-longrope-short": ("phi3", {"tie_word_embeddings": False, "pad_token_id": 0,
                                     "original_max_position_embeddings": 32, "rope_scaling": {
                                         "rope_type": "longrope", "short_factor": [1.0, 1.5, 3.0, 7.0],
                                         "long_factor": [2.0, 5.0, 11.0, 30.0]}}),
    # Phi-4-mini's: 3/4 of each head rotated (6 of 8), LongRoPE past an original context of 8 (long_factor,
    # in the prefill and each decoding step alike), tied embeddings
    "phi4-mini-partial-longrope": ("phi3", {"tie_word_embeddings": True, "pad_token_id": 0,
                                            "partial_rotary_factor": 0.75, "original_max_position_embeddings": 8,
                                            "rope_scaling": {
                                                "rope_type": "longrope", "short_factor": [1.0, 1.5, 3.0],
                                                "long_factor": [1.2, 4.0, 9.0]}}),
    # SmolLM3: Llama with layers that attend without positions (NoPE; every 4th by default, the first here)
    "smollm3": ("smollm3", {"tie_word_embeddings": True, "no_rope_layers": [0, 1], "pad_token_id": 0}),
    # Granite 3: Llama with its embeddings, residual branches, scores and logits scaled by constants (Granite
    # 3's are 12, 0.22, 1/128 and 8 or 16; these keep this small model's logits above 1)
    "granite": ("granite", {"tie_word_embeddings": True, "embedding_multiplier": 4.0, "residual_multiplier": 0.5,
                            "attention_multiplier": 0.2, "logits_scaling": 2.0}),
    # Gemma (1) and CodeGemma: Llama with GeGLU, scaled embeddings and 1 + weight norms (Gemma 7B's heads of
    # 256 over 3072 / 16: wider than hidden / heads)
    "gemma": ("gemma", {"tie_word_embeddings": True, "head_dim": 16}),
    # Gemma 2: Gemma 3's norms, GeGLU and scaled embeddings without q/k norms, every other layer sliding
    # at one RoPE base, and soft caps on the attention scores and the logits (2 and 3: they bite here)
    "gemma2": ("gemma2", {"tie_word_embeddings": True, "head_dim": 16, "query_pre_attn_scalar": 12,
                          "sliding_window": 6, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    # Gemma 3 (text): norms before and after each sublayer, GeGLU, embeddings times sqrt(48), heads of
    # 16 over 48 / 6, sliding layers at RoPE base 10000 beside the full layers' 1000000 (Gemma3TextConfig's)
    "gemma3": ("gemma3", {"tie_word_embeddings": True, "head_dim": 16, "query_pre_attn_scalar": 16,
                          "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]}),
    # Gemma 3 4B's linear RoPE scaling on the full layers, 27B's scores over sqrt(query_pre_attn_scalar)
    # rather than sqrt(head_dim), the flat keys of transformers 4's configs, and a window of 5
    "gemma3-linear-rope-score-scalar": ("gemma3", {"tie_word_embeddings": False, "query_pre_attn_scalar": 12,
                                                   "sliding_window": 5, "rope_theta": 100.0, "rope_local_base_freq":
                                                   30.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
                                                   "layer_types": ["full_attention", "sliding_attention"]}),
    "qwen2-yarn-every-field": ("qwen2", {"tie_word_embeddings": True, "rope_theta": 500.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 48, "attention_factor": 1.3,
        "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_imported_checkpoint_gives_transformers_logits_and_round_trips(case, hf, tokenizer_dir, tmp_path):
    arch, config = CASES[case]
    model = transformers_model(hf, arch, **config)
    model.save_pretrained(tmp_path / "hf")
    cfg, params = load_hf(tmp_path / "hf")

    assert (cfg.attention_bias, cfg.tie_embeddings, cfg.seq_len) == (arch == "qwen2", config["tie_word_embeddings"], 64)
    width = config.get("head_dim", 256 if arch.startswith("gemma") else 8)  # (Gemma's default head_dim)
    assert (cfg.head_dim, cfg.head_width) == (width, None if width == 8 else width)
    assert (cfg.qk_norm, cfg.norm_position) == {"qwen3": ("head", "pre"), "olmo2": ("projection", "post"),
                                                "olmo3": ("projection", "post"),
                                                "gemma2": ("none", "both"),
                                                "gemma3": ("head", "both")}.get(arch, ("none", "pre"))
    gemma = arch.startswith("gemma")
    assert (cfg.activation, cfg.scale_embeddings) == (("gelu_tanh", True) if gemma else ("silu", False))
    scalar = config.get("query_pre_attn_scalar")  # kept only where it is not the head width
    assert cfg.query_pre_attn_scalar == (scalar if scalar not in (None, width) else None)
    window = config.get("sliding_window")  # Mistral's and Phi-3's are left out where they do not bite (64)
    assert cfg.sliding_window == (window if arch in ("olmo3", "gemma2", "gemma3")
                                  or (arch in ("mistral", "phi3") and (window or 64) < 64) else None)
    types = ("sliding_attention", "full_attention") if arch == "gemma2" else config.get("layer_types")  # its default
    assert cfg.layer_types == (tuple(types) if arch in ("olmo3", "gemma2", "gemma3") else None)
    caps = (config.get("attn_logit_softcapping"), config.get("final_logit_softcapping"))
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == caps
    theta = config.get("rope_theta", {"olmo3": 5e5, "gemma3": 1e6, "smollm3": 2e6}.get(arch, 1e4))
    assert cfg.rope_theta == theta and cfg.norm_eps == 1e-6
    assert cfg.sliding_rope_theta == (config.get("rope_local_base_freq", 1e4) if arch == "gemma3" else None)
    assert (cfg.rope_scaling is not None) == ("rope_scaling" in config)
    assert cfg.rotary_layers == (tuple(map(bool, config["no_rope_layers"])) if arch == "smollm3" else None)
    assert cfg.rotary_width == (6 if "partial_rotary_factor" in config else None)
    scales = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    assert [getattr(cfg, name) for name in scales] == [config.get(name) for name in scales]
    fresh = init_state(cfg, optax.sgd(0.1), jax.random.PRNGKey(0))["params"]  # what training starts from
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(fresh)
    assert jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), params) == \
        jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), fresh)

    tokens = tokens_for(cfg)
    expected = torch_logits(hf, model, tokens)
    assert_close(np.asarray(forward(params, tokens, cfg)), expected)

    # the key/value cache path: a prefill of 16 tokens, then one token at a time
    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1])
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    decoded, cache = decode_step(params, cfg, tokens[:, :16], cache, positions[:, :16])
    steps = [decoded]
    for t in range(16, tokens.shape[1]):
        logits, cache = decode_step(params, cfg, tokens[:, t:t + 1], cache, positions[:, t:t + 1])
        steps.append(logits)
    assert_close(np.asarray(jnp.concatenate(steps, axis=1)), expected)

    # kiln -> Hugging Face again: transformers loads it as the same class (Mistral's as Llama, which it
    # then is; Phi-3's, unfused, as Llama or Mistral, unless it rotates as only Phi3's class does), with the
    # same logits
    (tmp_path / "export").mkdir()
    export_hf(cfg, params, (tokenizer_dir / "tokenizer.json").read_text(), read_tokenizer_meta(tokenizer_dir),
              tmp_path / "export")
    _, transformers = hf
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    written_as = ("Phi3ForCausalLM" if phi3_rope(cfg) else "MistralForCausalLM" if arch == "phi3" and cfg.sliding_window
                  else "LlamaForCausalLM")
    assert type(again).__name__ == (written_as if arch == "phi3" or (arch == "mistral" and cfg.sliding_window is None)
                                    else type(model).__name__)
    assert_close(torch_logits(hf, again, tokens), expected)
    assert again.generation_config.eos_token_id == read_tokenizer_meta(tokenizer_dir)["eos_id"]


def test_a_gemma3_config_in_transformers_4_keys_imports_as_the_nested_one(hf, tmp_path):
    """Gemma 3's checkpoints on the Hub were written by transformers 4: flat `rope_theta` and
    `rope_local_base_freq`, `sliding_window_pattern` instead of `layer_types`. They import as the
    same model as transformers 5's nested `rope_parameters`, and compute what transformers does."""
    _, transformers = hf
    model = transformers_model(hf, "gemma3", tie_word_embeddings=True, head_dim=8, query_pre_attn_scalar=8,
                               sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                               rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})
    model.save_pretrained(tmp_path / "nested")
    model.save_pretrained(tmp_path / "flat")
    config = json.loads((tmp_path / "flat" / "config.json").read_text())
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 50.0
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        config.pop(key, None)
    config.update(rope_theta=5e5, rope_local_base_freq=50.0, rope_scaling=None, sliding_window_pattern=2)
    (tmp_path / "flat" / "config.json").write_text(json.dumps(config))

    cfg, params = load_hf(tmp_path / "flat")
    assert cfg == load_hf(tmp_path / "nested")[0]
    assert (cfg.layer_types, cfg.rope_theta, cfg.sliding_rope_theta) == (("sliding_attention", "full_attention"),
                                                                         5e5, 50.0)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "flat").eval()
    tokens = tokens_for(cfg)
    assert_close(np.asarray(forward(params, tokens, cfg)), torch_logits(hf, again, tokens))


def test_a_vision_language_gemma3_imports_as_its_language_model(hf, tokenizer_dir, tmp_path):
    """Gemma 3 4B and up are `Gemma3ForConditionalGeneration`: a Gemma 3 language model (its config
    under `text_config`, its tensors under `language_model.`) beside a vision tower. kiln reads the
    language model, leaves the vision tower and projector unread, computes transformers' text-only
    logits, and exports a `Gemma3ForCausalLM` that transformers loads with them."""
    torch, transformers = hf
    text = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=64,
                sliding_window=6, layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-6,
                rope_scaling={"rope_type": "linear", "factor": 4.0})  # 4B's scaling on the full layers
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=VOCAB - 3, boi_token_index=VOCAB - 2,
                                       eoi_token_index=VOCAB - 1)
    torch.manual_seed(3)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    model.eval().save_pretrained(tmp_path / "hf")

    cfg, params = load_hf(tmp_path / "hf")
    assert (cfg.qk_norm, cfg.norm_position, cfg.head_width, cfg.sliding_rope_theta) == ("head", "both", 16, 1e4)
    assert type(cfg.rope_scaling).__name__ == "LinearScaling" and cfg.rope_scaling.factor == 4.0
    tokens = tokens_for(cfg)
    tokens[tokens >= VOCAB - 3] = 5  # text only: no image tokens
    expected = torch_logits(hf, model, tokens)
    assert_close(np.asarray(forward(params, tokens, cfg)), expected)

    (tmp_path / "export").mkdir()
    export_hf(cfg, params, (tokenizer_dir / "tokenizer.json").read_text(), read_tokenizer_meta(tokenizer_dir),
              tmp_path / "export")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(again).__name__ == "Gemma3ForCausalLM"
    assert_close(torch_logits(hf, again, tokens), expected)


def test_bfloat16_and_sharded_checkpoints_import_exactly(hf, tmp_path):
    torch, _ = hf
    model = transformers_model(hf, "qwen2", tie_word_embeddings=False).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf", max_shard_size="50KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1

    cfg, params = load_hf(tmp_path / "hf", seq_len=16)
    assert cfg.seq_len == 16  # capped; max_position_embeddings is 64
    ours = hf_state_dict(params, cfg)  # back under HF names, the export's own inverse
    theirs = {k: v.float().numpy() for k, v in model.state_dict().items()}
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == np.float32 and np.array_equal(ours[name], tensor), name
    # held as they are, for a server computing in bfloat16 (`kiln serve-model --dtype bfloat16`)
    _, held = load_hf(tmp_path / "hf", seq_len=16, dtype=jnp.bfloat16)
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(held)} == {jnp.dtype(jnp.bfloat16)}
    for name, tensor in hf_state_dict(held, cfg).items():  # back in float32: exactly the checkpoint's values
        assert np.array_equal(tensor, theirs[name]), name


# --- kiln's own exports, and what is refused (no torch) -------------------------------------------

SMALL = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, seq_len=32,
                    tie_embeddings=False, rope_theta=2000.0, norm_eps=1e-6, init_std=0.05)


EXPORTED_AS = {  # kiln's model -> the transformers class it exports as
    "llama": ({}, "LlamaForCausalLM"),
    "qwen2": ({"attention_bias": True}, "Qwen2ForCausalLM"),
    "qwen3-wide-heads": ({"qk_norm": "head", "head_width": 12}, "Qwen3ForCausalLM"),
    "olmo2": ({"qk_norm": "projection", "norm_position": "post"}, "Olmo2ForCausalLM"),
    "olmo3": ({"qk_norm": "projection", "norm_position": "post", "sliding_window": 8,
               "layer_types": ("sliding_attention", "full_attention")}, "Olmo3ForCausalLM"),
    "mistral-window": ({"sliding_window": 8}, "MistralForCausalLM"),
    "llama-narrow-heads": ({"head_width": 4}, "LlamaForCausalLM"),
    "gemma3": ({"qk_norm": "head", "norm_position": "both", "activation": "gelu_tanh", "scale_embeddings": True,
                "head_width": 12, "sliding_window": 8, "layer_types": ("sliding_attention", "full_attention"),
                "sliding_rope_theta": 1e4, "query_pre_attn_scalar": 10}, "Gemma3ForCausalLM"),
    "gemma3-no-window": ({"qk_norm": "head", "norm_position": "both", "activation": "gelu_tanh",
                          "scale_embeddings": True}, "Gemma3ForCausalLM"),
    "gemma": ({"activation": "gelu_tanh", "scale_embeddings": True, "head_width": 12}, "GemmaForCausalLM"),
    "smollm3": ({"rotary_layers": (False, True)}, "SmolLM3ForCausalLM"),
    "gemma2": ({"norm_position": "both", "activation": "gelu_tanh", "scale_embeddings": True, "sliding_window": 8,
                "layer_types": ("sliding_attention", "full_attention"), "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0}, "Gemma2ForCausalLM"),
    "phi4-mini": ({"rotary_width": 6, "rope_scaling": LongRopeScaling(
        rope_type="longrope", short_factor=(1.0, 2.0, 3.0), long_factor=(4.0, 5.0, 6.0),
        original_max_position_embeddings=16, factor=2.0)}, "Phi3ForCausalLM"),
    "phi3-window-partial-rotary": ({"rotary_width": 4, "sliding_window": 8}, "Phi3ForCausalLM"),
    "granite": ({"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
                 "logits_scaling": 8.0}, "GraniteForCausalLM"),
    "granite-residual-only": ({"residual_multiplier": 0.5}, "GraniteForCausalLM"),
}


@pytest.mark.parametrize("case", sorted(EXPORTED_AS))
def test_import_is_the_inverse_of_export(case, tokenizer_dir, tmp_path):
    update, arch = EXPORTED_AS[case]
    cfg = SMALL.model_copy(update=update)
    params = kiln_export(tmp_path / "hf", cfg, tokenizer_dir)
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["architectures"] == [arch]
    assert hf_config["head_dim"] == update.get("head_width", 8)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    assert ("model.layers.1.self_attn.k_proj.bias" in tensors) == cfg.attention_bias
    assert ("model.layers.1.self_attn.k_norm.weight" in tensors) == (cfg.qk_norm != "none")
    assert ("model.layers.1.input_layernorm.weight" in tensors) == (cfg.norm_position in ("pre", "both"))
    assert ("model.layers.1.pre_feedforward_layernorm.weight" in tensors) == (cfg.norm_position == "both")
    fused = ("model.layers.1.self_attn.qkv_proj.weight" in tensors, "model.layers.1.mlp.gate_up_proj.weight" in tensors,
             "model.layers.1.self_attn.q_proj.weight" not in tensors)  # Phi-3's fused projections
    assert fused == (arch == "Phi3ForCausalLM",) * 3
    # Gemma's norms multiply by 1 + weight: stored as kiln's weight - 1
    offset = 1.0 if arch.startswith("Gemma") else 0.0
    assert np.array_equal(tensors["model.norm.weight"], params["norm"]["weight"] - np.float32(offset))
    assert tensors["model.layers.1.self_attn.o_proj.weight"].shape == (32, 4 * cfg.head_dim)

    got_cfg, got = load_hf(tmp_path / "hf")
    assert got_cfg == cfg
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(params)
    assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(np.array_equal, got, params)))

    # and the export is what `kiln generate` and `kiln serve-model` load (evaluation.generate.load):
    # the same model, q/k/v biases included (they were once left out there, silently)
    model = load(tmp_path / "hf")
    assert model.cfg == cfg
    assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(np.array_equal, model.params, params)))
    eos = read_tokenizer_meta(tokenizer_dir)["eos_id"]
    assert model.stop_ids == (eos,)


WINDOWED = {  # a sliding layer, then a full one, with a window of 5
    "olmo3": {"qk_norm": "projection", "norm_position": "post"},
    # Gemma 2's soft caps (low enough to bite) and Gemma 3's sliding layers at a RoPE base of their own
    "gemma2": {"norm_position": "both", "activation": "gelu_tanh", "scale_embeddings": True,
               "attn_logit_softcapping": 0.5, "final_logit_softcapping": 4.0},
    "gemma3": {"qk_norm": "head", "norm_position": "both", "activation": "gelu_tanh", "scale_embeddings": True,
               "sliding_rope_theta": 50.0},
}


@pytest.mark.parametrize("shape", sorted(WINDOWED))
def test_a_windowed_model_decodes_in_the_servers_slots_as_its_forward_computes(shape, tokenizer_dir, tmp_path):
    """OLMo 3's and Gemma's shapes with a window of 5 over prompts and answers of up to 29 tokens:
    greedy answers equal the argmax of the full forward at each position (the cache masks the
    window, rotates and caps as the forward does; the server's separate output layer caps as it
    does), and answers decoded beside others in the server's continuous batching (each row at
    positions of its own) equal those decoded alone."""
    from evaluation.generate import Request, sample
    from evaluation.server import Job, Service

    cfg = SMALL.model_copy(update={**WINDOWED[shape], "sliding_window": 5,
                                   "layer_types": ("sliding_attention", "full_attention")})
    kiln_export(tmp_path / "hf", cfg, tokenizer_dir)
    model = load(tmp_path / "hf")
    assert model.cfg == cfg
    prompts = [list(range(3, 3 + n)) for n in (4, 9, 14)]
    answers = [sample(model, p, 15, temperature=0.0) for p in prompts]
    logprobs = []  # the forward's log-probability of each answer token
    for prompt, answer in zip(prompts, answers):
        assert len(answer) == 15  # no EOS drawn: every position below is checked
        logits = np.asarray(forward(model.params, np.array([prompt + answer[:-1]], np.int32), cfg))[0]
        assert [int(t) for t in logits[len(prompt) - 1:].argmax(-1)] == answer
        logp = np.asarray(jax.nn.log_softmax(logits[len(prompt) - 1:], axis=-1))
        logprobs.append(logp[np.arange(len(answer)), answer])
    scheduler = Service(model, "windowed", max_batch=4).scheduler
    try:
        jobs = [Job(Request(p, 15, 0.0), top_logprobs=0) for p in prompts]  # with log-probabilities
        together = [f.result(120) for f in [scheduler.submit(j) for j in jobs]]
        assert [r.sampled.ids for r in together] == answers
        for r, expected in zip(together, logprobs):  # greedy hides a logit cap; log-probabilities do not
            np.testing.assert_allclose(r.sampled.logprobs, expected, rtol=1e-4, atol=1e-5)
    finally:
        scheduler.close()


@pytest.mark.parametrize("update", [{"attention_bias": True, "qk_norm": "head"}, {"qk_norm": "projection"},
                                    {"norm_position": "post"},
                                    {"sliding_window": 8, "layer_types": ("sliding_attention", "full_attention")},
                                    {"final_logit_softcapping": 30.0}, {"activation": "gelu_tanh"},
                                    {"rotary_layers": (False, True), "qk_norm": "head"},
                                    {"rotary_width": 4, "qk_norm": "head"}, {"rotary_width": 4, "attention_bias": True},
                                    {"residual_multiplier": 0.5, "qk_norm": "head"},
                                    {"attention_multiplier": 0.1, "rotary_width": 4},  # Granite's and Phi-3's
                                    {"norm_position": "both", "activation": "gelu_tanh", "scale_embeddings": True,
                                     "sliding_window": 8, "layer_types": ("sliding_attention", "full_attention"),
                                     "sliding_rope_theta": 100.0}])  # Gemma 2's shape, with Gemma 3's local base
def test_a_model_no_transformers_class_computes_is_not_exported(update, tokenizer_dir, tmp_path):
    cfg = SMALL.model_copy(update=update)
    with pytest.raises(ValueError, match="no Hugging Face class computes .*kiln can train and serve this model"):
        kiln_export(tmp_path / "hf", cfg, tokenizer_dir)
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_a_checkpoint_folder_stops_at_every_eos_it_lists(tokenizer_dir, tmp_path):
    """Llama 3 Instruct's config.json lists several EOS ids and its generation_config.json others:
    generation stops at each."""
    folder = tmp_path / "hf"
    kiln_export(folder, SMALL, tokenizer_dir)
    for name, ids in (("config.json", [2, 7]), ("generation_config.json", [7, 9])):
        config = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**config, "eos_token_id": ids}))
    assert load(folder).stop_ids == (2, 7, 9)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load(folder)


# A ChatML template of the kind Qwen2 Instruct ships, with what transformers' rendering must get
# right: the BOS variable, an exception for a role it does not know, a content trimmed of spaces.
CHATML = ("{{ bos_token }}{% for m in messages %}"
          "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('no role ' + m['role']) }}"
          "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_checkpoints_own_chat_template_prompts_as_transformers_renders_it(hf, tokenizer_dir, tmp_path):
    """A Hugging Face checkpoint with a chat template: `kiln serve-model` and `kiln generate --chat`
    prompt it with that template, to the same ids as transformers' `apply_chat_template` (also
    continuing a final assistant message whose spaces the template trims), and stop at its
    end-of-turn token, which generation_config.json lists."""
    from fastapi.testclient import TestClient

    from evaluation.chat_prompt import chat_for
    from evaluation.generate import generate, sample
    from evaluation.server import Service, create_app

    _, transformers = hf
    folder = tmp_path / "hf"
    kiln_export(folder, SMALL.model_copy(update={"seq_len": 64}), tokenizer_dir)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    end = tokenizer.token_to_id("<|im_end|>")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [end]}))

    model = load(folder)
    assert model.chat_template == CHATML and end in model.stop_ids
    chat, theirs = chat_for(model), transformers.AutoTokenizer.from_pretrained(folder)
    conversations = [
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And God said <|im_end|> light"}],
         {"add_generation_prompt": True}),
        ([{"role": "user", "content": "Who divided the waters?"}, {"role": "assistant", "content": "It was  "}],
         {"add_generation_prompt": False, "continue_final_message": True}),
    ]
    for messages, options in conversations:
        expected = theirs.apply_chat_template(messages, tokenize=False, **options)
        assert chat.render(messages, **options) == expected
        ids = theirs.apply_chat_template(messages, tokenize=True, **options)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert chat.prompt(messages, **options) == list(ids)
    assert expected.endswith("It was") and expected.startswith("<s>")  # trimmed, cut after it; BOS from its variable
    with pytest.raises(ValueError, match="no role narrator"):
        chat.prompt([{"role": "narrator", "content": "x"}])

    question = [{"role": "user", "content": "Who divided the waters?"}]
    answer = sample(model, chat.prompt(question), 6, temperature=0.0)
    with TestClient(create_app(Service(model, "chatml", max_batch=2))) as client:
        r = client.post("/v1/chat/completions", json={"messages": question, "max_tokens": 6, "temperature": 0,
                                                      "skip_special_tokens": False})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(chat.prompt(question))
        assert r.json()["choices"][0]["message"]["content"] == model.tokenizer.decode(answer, skip_special_tokens=False)
        assert client.get("/tokenizer_info").json()["chat_template"] == CHATML
        # vLLM's /tokenize of chat messages: the prompt chat completions send
        r = client.post("/tokenize", json={"messages": question})
        assert r.status_code == 200 and r.json()["tokens"] == chat.prompt(question), r.text
        r = client.post("/tokenize", json={"messages": question, "prompt": "x"})
        assert r.status_code == 400 and "one of the two" in r.text
    broken = dataclasses.replace(model, chat_template="{% for m in messages %}")  # no endfor: the server still starts
    with TestClient(create_app(Service(broken, "broken", max_batch=2))) as client:
        for endpoint in ("/v1/chat/completions", "/tokenize"):
            r = client.post(endpoint, json={"messages": question})
            assert r.status_code == 400 and "does not parse as Jinja" in r.json()["error"]["message"], r.text
    # `kiln generate --chat`: the same prompt
    text = generate(model, question[0]["content"], max_tokens=6, temperature=0.0, chat=True)
    assert text == model.tokenizer.decode(answer, skip_special_tokens=False)


CHATML_TOKENS = {"eos_token": "</s>", "bos_token": "<s>", "chat_template": CHATML,
                 "tokenizer_class": "PreTrainedTokenizerFast"}


# Llama 3's layout: a header around each role, no newline after a turn's end
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# ChatML with transformers' `{% generation %}` marks around each answer and its end of turn
CHATML_MARKED = CHATML.replace("<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n",
                               "<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
                               "{{ m['content'] | trim }}<|im_end|>{% endgeneration %}{% else %}"
                               "{{ m['content'] | trim }}<|im_end|>{% endif %}\n")
# In the manner of Gemma 3's (written here, not Gemma's own): the system message folded into the
# first user turn, the assistant's turns named `model`
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
         "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
         "{% for m in turns %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
         "{{ prefix if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TEMPLATES = {"chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
             "gemma": (GEMMA, ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
             "chatml-generation-marks": (CHATML_MARKED, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
             "llama3": (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>")}


def chatml_folder(folder: Path, config: dict = CHATML_TOKENS, tokens=TEMPLATES["chatml"][1]) -> Path:
    """A Hugging Face tokenizer folder with a chat template's tokens (ChatML's by default) and, in
    `config`, the template: its EOS (</s>) is not the token that ends a turn (<|im_end|>), as in
    Qwen2.5's base models."""
    tokenizer_folder(folder, config)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens(list(tokens))
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_post_training_encodes_a_checkpoints_chat_template_with_a_mask_on_the_answers(name, hf, tmp_path):
    """The tokenizer step carries an hf folder's chat template (its version follows it; a folder
    without one keeps its version); post-training encodes conversations in it: the ids are
    transformers' `apply_chat_template` ids, the ids before an answer are the prompt a server sends
    for it, and only the answers with their end of turn are learned."""
    from tasks.tokenizer import CHAT_TEMPLATE_FILE, chat_template

    _, transformers = hf
    source, tokens, end_text = TEMPLATES[name]
    folder = chatml_folder(tmp_path / "hf", {**CHATML_TOKENS, "chat_template": source}, tokens)
    out = tmp_path / "out"
    run_body(tokenizer_step(TokenizerConfig(kind="hf", path=str(folder))), out, {})
    assert (out / CHAT_TEMPLATE_FILE).read_text() == source
    assert read_tokenizer_meta(out)["chat_template"]["tokens"] == {"eos_token": "</s>", "bos_token": "<s>"}
    plain = chatml_folder(tmp_path / "plain", {k: v for k, v in CHATML_TOKENS.items() if k != "chat_template"}, tokens)
    assert hf_version(plain) != hf_version(folder)

    template = chat_template(out)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    end = theirs.convert_tokens_to_ids(end_text)
    assert (template.end_text, template.end_id) == (end_text, end) and end != theirs.eos_token_id
    ids, mask = template.encode(CONVERSATION)
    expected = theirs.apply_chat_template(CONVERSATION, tokenize=True)
    assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    if name == "chatml-generation-marks":  # transformers' own assistant-token mask, from the marks, is kiln's
        assert CHATML_MARKED != CHATML
        marked = theirs.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        assert list(marked["assistant_masks"]) == mask
    spans, run = [], []  # the learned runs of tokens, as text
    for i, m in zip([*ids, None], [*mask, 0]):
        if m:
            run.append(i)
        elif run:
            spans.append(theirs.decode(run))
            run = []
    # the template trims each message, and a newline after the turn's end (ChatML's) is not the answer's
    assert spans == [f"the heaven and the earth.{end_text}", f"And the earth was without form, and void.{end_text}"]
    first = mask.index(1)
    prompt = theirs.apply_chat_template(CONVERSATION[:2], tokenize=True, add_generation_prompt=True)
    assert ids[:first] == list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert template.answer_text(CONVERSATION[:2], " the heaven and the earth.") == spans[0]
    # a template that rewrites earlier turns once an answer follows them is refused, saying why
    rewriting = source.replace("{{ m['content'] | trim }}", "{{ m['content'] | trim }}{{ loop.length }}")
    assert rewriting != source
    bad = chatml_folder(tmp_path / "rewrites", {**CHATML_TOKENS, "chat_template": rewriting}, tokens)
    run_body(tokenizer_step(TokenizerConfig(kind="hf", path=str(bad))), tmp_path / "bad-out", {})
    with pytest.raises(ValueError, match="cannot tell which tokens are the answer"):
        chat_template(tmp_path / "bad-out").encode(CONVERSATION)


# A template in the manner of Qwen3's (written here, not Qwen3's own): an empty think block before
# the answers after the last user turn only, so earlier answers render differently once one follows
THINKING = ("{% set last = namespace(user=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
            "{% set last.user = loop.index0 %}{% endif %}{% endfor %}"
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' and loop.index0 > last.user %}<think>\n\n</think>\n\n{% endif %}"
            "{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_thinks_before_the_last_answer_trains_single_turns_and_refuses_more(hf, tmp_path):
    """What docs/starting_points.md says of Qwen3's template: a single-turn conversation is learned
    with the empty think block in front of its answer (transformers' ids), one with two answers is
    refused (the first answer renders without the block once the second follows)."""
    from tasks.tokenizer import chat_template

    _, transformers = hf
    folder = chatml_folder(tmp_path / "hf", {**CHATML_TOKENS, "chat_template": THINKING})
    run_body(tokenizer_step(TokenizerConfig(kind="hf", path=str(folder))), tmp_path / "out", {})
    template, theirs = chat_template(tmp_path / "out"), transformers.AutoTokenizer.from_pretrained(folder)
    single = CONVERSATION[1:3]
    ids, mask = template.encode(single)
    expected = theirs.apply_chat_template(single, tokenize=True)
    assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    learned = [i for i, m in zip(ids, mask) if m]  # one run, up to the turn's end (its newline is not learned)
    first = mask.index(1)
    assert mask[first:first + len(learned)] == [1] * len(learned)  # contiguous
    assert theirs.decode(learned) == "<think>\n\n</think>\n\nthe heaven and the earth.<|im_end|>"
    with pytest.raises(ValueError, match="cannot tell which tokens are the answer"):
        template.encode(CONVERSATION)


def test_a_model_trained_on_from_a_checkpoint_keeps_its_chat_template_unless_it_does_not_parse(hf, tmp_path):
    """A train output (not post-trained) whose tokenizer carries a checkpoint's chat template chats
    in it when served and exports it, as the checkpoint did, stopping at EOS only; a carried
    template that does not parse leaves loading, completions and the export unharmed, and chat
    says why it cannot answer."""
    from safetensors.numpy import save_file as save_numpy

    from evaluation.chat_prompt import chat_for
    from tasks.export import ExportConfig, export_step
    from training.loop import flatten_params

    _, transformers = hf
    for name, source in (("chatml", CHATML), ("broken", "{% for m in messages %}")):
        folder = chatml_folder(tmp_path / name / "hf", {**CHATML_TOKENS, "chat_template": source})
        tokenizer = tokenizer_step(TokenizerConfig(kind="hf", path=str(folder)))
        run_body(tokenizer, tmp_path / name / "tokenizer", {})
        model_dir = tmp_path / name / "train"  # a train step's output layout
        model_dir.mkdir()
        (model_dir / "model.json").write_text(SMALL.model_dump_json())
        save_numpy(flatten_params(init_params(SMALL, jax.random.PRNGKey(0))), str(model_dir / "params.safetensors"))
        model = load(model_dir, tmp_path / name / "tokenizer")
        assert model.chat_template == source and model.stop_ids == (model.eos_id,)
        export = tmp_path / name / "export"
        run_body(export_step(ExportConfig(), model=tokenizer, tokenizer=tokenizer), export,
                 {"model": model_dir, "tokenizer": tmp_path / name / "tokenizer"})
        assert json.loads((export / "tokenizer_config.json").read_text())["chat_template"] == source
        assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == model.eos_id
        question = [{"role": "user", "content": "Who divided the waters?"}]
        if name == "broken":
            with pytest.raises(ValueError, match="does not parse as Jinja"):
                chat_for(model)
            continue
        theirs = transformers.AutoTokenizer.from_pretrained(export)
        ids = theirs.apply_chat_template(question, tokenize=True, add_generation_prompt=True)
        assert chat_for(model).prompt(question) == list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def edited(tokenizer_dir: Path, tmp_path: Path, config: dict | None = None, weights=None, cfg=SMALL) -> Path:
    """A kiln export with config.json's keys updated by `config` and its tensors by `weights`."""
    kiln_export(tmp_path / "hf", cfg, tokenizer_dir)
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **(config or {})}))
    if weights is not None:
        tensors = load_file(tmp_path / "hf" / "model.safetensors")
        save_file(weights(tensors), tmp_path / "hf" / "model.safetensors")
    return tmp_path / "hf"


REFUSED = {
    "dynamic-rope": ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
                     "RoPE .*dynamic.*plain, Llama 3.1's, YaRN's or linear"),
    "llama-soft-capping": ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0 .*Gemma 2's"),
    "llama-partial-rotary": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 .*as Phi-3's class does"),
    "phi3-odd-partial-rotary": ({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                                 "partial_rotary_factor": 0.375}, "partial_rotary_factor 0.375 of head_dim 8 .*even"),
    "llama-longrope": ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                                         "original_max_position_embeddings": 16}}, "RoPE .*longrope.*Phi-3's LongRoPE"),
    "gemma3-exact-gelu": ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                           "hidden_activation": "gelu"}, "hidden_activation 'gelu' .*gelu_pytorch_tanh"),
    "gemma3-bidirectional": ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                              "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    "yarn-deepseek-mscale-v5": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                     "mscale": 1.0, "mscale_all_dim": 0.5}},
                                "RoPE .*mscale_all_dim"),
    "heads-undivided": ({"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": None},
                        "hidden_size 32 does not divide by its 3 heads"),
    "qwen3-moe": ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}, "architectures .*Qwen3Moe"),
    "qwen3-attention-bias": ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": True},
                             "qwen3's puts biases on q, k, v and o_proj"),
    "olmo2-attention-bias": ({"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "attention_bias": True},
                             "olmo2's puts biases on q, k, v and o_proj"),
    "gemma-relu": ({"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_act": "relu"},
                   "hidden_act 'relu' .*gelu_pytorch_tanh"),
    "recurrent-gemma": ({"architectures": ["RecurrentGemmaForCausalLM"], "model_type": "recurrent_gemma"},
                        "architectures .*RecurrentGemma"),
    "olmo3-sliding-layers-own-rope": ({"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3",
                                       "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                                       "rope_parameters": {"sliding_attention": {"rope_type": "default",
                                                                                 "rope_theta": 1e4},
                                                           "full_attention": {"rope_type": "default",
                                                                              "rope_theta": 5e5}}},
                                      "the sliding layers' RoPE .*rope_theta 500000"),
    "mistral-attention-bias": ({"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                                "sliding_window": None, "attention_bias": True}, "o_proj"),
    "mlp-bias": ({"mlp_bias": True}, "mlp_bias true"),
    "llama-attention-bias": ({"attention_bias": True}, "o_proj"),
    "sliding-window": ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True,
                        "sliding_window": 16}, "use_sliding_window true, window 16"),
    "sliding-layers": ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention"),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    "quantized": ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_configs_kiln_cannot_compute_are_refused_saying_why(case, tokenizer_dir, tmp_path):
    config, reason = REFUSED[case]
    with pytest.raises(ValueError, match="kiln's model cannot represent|kiln imports") as e:
        load_hf(edited(tokenizer_dir, tmp_path, config))
    assert e.match(reason)


def test_gemma_releases_hidden_act_gelu_is_the_tanh_gelu(tokenizer_dir, tmp_path):
    """Gemma 1's config.json files say `hidden_act: gelu`, meant as (and read by GemmaConfig as) the tanh
    approximation: kiln reads them so (another class's `gelu` is refused: REFUSED["gelu"])."""
    cfg = SMALL.model_copy(update=EXPORTED_AS["gemma"][0])
    assert load_hf(edited(tokenizer_dir, tmp_path, {"hidden_act": "gelu"}, cfg=cfg))[0] == cfg


def test_tensors_that_do_not_fit_are_refused(tokenizer_dir, tmp_path):
    # Qwen2's config over Llama's weights: the q/k/v biases it needs are not there
    folder = edited(tokenizer_dir, tmp_path / "a", {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    with pytest.raises(ValueError, match="lacks 6 tensors its config.json needs: model.layers.0.self_attn.q_proj.bias"):
        load_hf(folder)
    extra = edited(tokenizer_dir, tmp_path / "b", weights=lambda w: {
        **w, "model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32),
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(4, np.float32)})  # the buffer is ignored
    with pytest.raises(ValueError, match=r"no place for 1 tensors of the checkpoint: model.layers.0.self_attn.o_proj.bias$"):
        load_hf(extra)
    wrong = edited(tokenizer_dir, tmp_path / "c", {"intermediate_size": 64})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight has shape \[48, 32\], but config.json "
                                         r"makes it \[64, 32\]"):
        load_hf(wrong)
    (wrong / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_hf(wrong)
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_hf(tmp_path / "nothing")


# --- the hf tokenizer kind -----------------------------------------------------------------------


def test_hf_tokenizer_is_the_folders_own(tokenizer_dir, tmp_path):
    source = tokenizer_folder(tmp_path / "hf", LLAMA_TOKENS)
    assert (tokenizer_dir / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    meta = read_tokenizer_meta(tokenizer_dir)
    hf_tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    assert (meta["kind"], meta["eos_token"], meta["bos_token"]) == ("hf", "</s>", "<s>")
    assert (meta["eos_id"], meta["bos_id"]) == (hf_tok.token_to_id("</s>"), hf_tok.token_to_id("<s>"))
    assert meta["special_tokens"] == {t: hf_tok.token_to_id(t) for t in SPECIAL}
    assert meta["vocab_size"] == hf_tok.get_vocab_size()
    assert load_tokenizer(tokenizer_dir).encode(TEXT).ids == hf_tok.encode(TEXT).ids


def hf_version(folder: Path) -> str:
    return tokenizer_step(TokenizerConfig(kind="hf", path=str(folder))).version


def test_hf_tokenizer_version_follows_content_not_path(tmp_path):
    base = hf_version(tokenizer_folder(tmp_path / "a", LLAMA_TOKENS))
    assert base == "25180889e786"  # its version before chat templates were carried (git 88bf4f1): kept
    assert hf_version(tokenizer_folder(tmp_path / "elsewhere", LLAMA_TOKENS)) == base
    other = tokenizer_folder(tmp_path / "weights-beside", LLAMA_TOKENS)
    (other / "model.safetensors").write_bytes(b"new weights beside the same tokenizer")
    assert hf_version(other) == base
    assert hf_version(tokenizer_folder(tmp_path / "b", {**LLAMA_TOKENS, "eos_token": "<unk>"})) != base
    changed = tokenizer_folder(tmp_path / "c", LLAMA_TOKENS)
    (changed / "tokenizer.json").write_text((changed / "tokenizer.json").read_text().replace('"<unk>"', '"<pad>"'))
    assert hf_version(changed) != base
    # the kinds that were there before have no path in their versions
    assert "path" not in identity_fields(TokenizerConfig()) and "path" not in identity_fields(
        TokenizerConfig(kind="bpe", vocab_size=1000))
    assert "attention_bias" not in identity_fields(ModelConfig())
    assert identity_fields(ModelConfig(attention_bias=True))["attention_bias"] is True


def test_hf_tokenizer_special_tokens_from_the_folder(tmp_path):
    # Qwen2's way: no BOS (null in tokenizer_config.json), though config.json names a bos_token_id
    qwen = tokenizer_folder(tmp_path / "qwen", {"eos_token": "</s>", "bos_token": None})
    (qwen / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 0}))
    run_body(tokenizer_step(TokenizerConfig(kind="hf", path=str(qwen))), tmp_path / "qwen-out", {})
    meta = read_tokenizer_meta(tmp_path / "qwen-out")
    assert (meta["eos_token"], meta["bos_token"], meta["bos_id"]) == ("</s>", None, None)
    # no tokenizer_config.json: the ids in config.json (a list's first), then generation_config.json
    ids = tokenizer_folder(tmp_path / "ids")
    (ids / "config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (ids / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    run_body(tokenizer_step(TokenizerConfig(kind="hf", path=str(ids))), tmp_path / "ids-out", {})
    meta = read_tokenizer_meta(tmp_path / "ids-out")
    assert (meta["eos_token"], meta["eos_id"], meta["bos_token"], meta["bos_id"]) == ("</s>", 2, "<s>", 1)


def test_hf_tokenizer_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "tokenizer.model").write_bytes(b"sentencepiece")
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found: tokenizer kind 'hf' reads a fast"):
        hf_version(tmp_path / "empty")
    with pytest.raises(ValueError, match="names no EOS token"):
        hf_version(tokenizer_folder(tmp_path / "no-eos"))
    with pytest.raises(ValueError, match="eos token '<eot>' is not in its tokenizer.json"):
        hf_version(tokenizer_folder(tmp_path / "bad-eos", {"eos_token": "<eot>"}))
    with pytest.raises(ValueError, match="kind 'hf' needs path"):
        TokenizerConfig(kind="hf")
    with pytest.raises(ValueError, match="path applies to kind 'hf' only"):
        TokenizerConfig(path=str(tmp_path))
    with pytest.raises(ValueError, match="leave special_tokens, eos_token, bos_token out"):
        TokenizerConfig(kind="hf", path=str(tmp_path), special_tokens=("<s>", "</s>"), eos_token="</s>",
                        bos_token="<s>")


def test_the_model_card_names_the_architecture_an_export_has():
    """The card's architecture table says what makes the model the class it exports as."""
    from training.export import model_card

    gemma2 = SMALL.model_copy(update=EXPORTED_AS["gemma2"][0])
    card = model_card(gemma2, 1000, "g", None, None, None)
    assert "- gemma2" in card and "Gemma2ForCausalLM.from_pretrained" in card
    for row in ("| MLP (GeGLU, tanh GELU) width | 48 |", "| norm position | before and after each sublayer |",
                "| embeddings | scaled by sqrt(d_model) |", "| soft caps | scores 50.0, logits 30.0 |",
                "| sliding window | 8 tokens, some layers |"):
        assert row in card, row
    gemma3 = SMALL.model_copy(update=EXPORTED_AS["gemma3"][0])
    card = model_card(gemma3, 1000, "g", None, None, None)
    assert "| sliding window | 8 tokens, some layers, RoPE theta 10000 |" in card
    assert "| attention scores | q.k / sqrt(10) |" in card and "soft caps" not in card
    smol = model_card(SMALL.model_copy(update=EXPORTED_AS["smollm3"][0]), 1000, "s", None, None, None)
    assert "| layers without positions (NoPE) | 0 |" in smol and "| MLP (SwiGLU) width | 48 |" in smol
    granite = model_card(SMALL.model_copy(update=EXPORTED_AS["granite"][0]), 1000, "g", None, None, None)
    assert "| Granite's residual_multiplier | 0.22 |" in granite and "| Granite's logits_scaling | 8.0 |" in granite
    phi = model_card(SMALL.model_copy(update=EXPORTED_AS["phi4-mini"][0]), 1000, "p", None, None, None)
    assert "| rotated dimensions | 6 of 8 per head |" in phi
    assert "| positions | RoPE, theta 2000, LongRoPE scaling |" in phi
    assert "Phi3ForCausalLM.from_pretrained" in phi
    plain = model_card(SMALL, 1000, "l", None, None, None)
    assert not any(word in plain for word in ("NoPE", "soft caps", "| embeddings |", "norm position", "rotated"))
