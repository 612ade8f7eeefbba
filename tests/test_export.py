"""The export step's Hugging Face folder: transformers loads it and gives kiln's logits.

Random-init models (norm weights randomised too, so a swapped or missing norm shows), tied and
untied, grouped-query attention, a non-default RoPE theta; GPT-2's tokenizer from the real
tokenizer step.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from tasks.export import ExportConfig, export_step
from tasks.engine.step import Step, StepContext
from tasks.tokenizer import TokenizerConfig, load_tokenizer, tokenizer_step
from training.config import ModelConfig
from training.model import forward, init_params
from tests.conftest import needs

torch = needs("torch")
transformers = needs("transformers")

TEXT = "In the beginning God created the heaven and the earth. And the earth was without form, and void."


def run_body(step: Step, out: Path, inputs: dict) -> dict:
    out.mkdir(parents=True)
    ctx = StepContext(step=step, out=out, inputs=inputs, input_stats={}, work_dir=out.parent / "work",
                      log=logging.getLogger("test"))
    return step.run(ctx)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    run_body(tokenizer_step(TokenizerConfig()), out, {})
    return out


def random_model(folder: Path, cfg: ModelConfig, seed: int) -> dict:
    """A training-output folder (model.json, params.safetensors) of random parameters: matrices
    N(0, init_std), norm weights 1 + N(0, 0.2). Drawn with numpy (the shapes from `init_params`)."""
    shapes = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.PRNGKey(0))
    rng = np.random.default_rng(seed)
    flat = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        name = "/".join(str(k.key) for k in path)
        std, mean = (0.2, 1.0) if name.endswith("norm/weight") else (cfg.init_std, 0.0)
        flat[name] = (mean + std * rng.standard_normal(leaf.shape)).astype(np.float32)
    folder.mkdir(parents=True)
    (folder / "model.json").write_text(cfg.model_dump_json())
    save_file(flat, str(folder / "params.safetensors"))
    from training.loop import load_model

    return load_model(folder)[1]


CASES = {
    "tied-gqa": ModelConfig(vocab_size=50257, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                            seq_len=64, init_std=0.1),
    "untied-gqa-theta": ModelConfig(vocab_size=50304, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2, d_ff=80,
                                    seq_len=48, tie_embeddings=False, rope_theta=500.0, norm_eps=1e-6,
                                    init_std=0.1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_loads_export_with_kiln_logits(case, gpt2_dir, tmp_path):
    cfg = CASES[case]
    params = random_model(tmp_path / "model", cfg, seed=len(case))
    model_step = Step(name="train", stage="train", stage_version=1, config=cfg, run=lambda ctx: {})
    step = export_step(ExportConfig(name="tiny-test", license="mit"), model=model_step,
                       tokenizer=tokenizer_step(TokenizerConfig()))
    stats = run_body(step, tmp_path / "export", {"model": tmp_path / "model", "tokenizer": gpt2_dir})
    out = tmp_path / "export"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "README.md"):
        assert (out / name).is_file(), name
    assert stats["param_count"] == sum(np.prod(p.shape) for p in jax.tree_util.tree_leaves(params))

    model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings == cfg.tie_embeddings
    assert model.config.num_key_value_heads == cfg.n_kv_heads
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(3, cfg.seq_len)).astype(np.int32)
    expected = np.asarray(jax.jit(forward, static_argnums=2)(params, tokens, cfg))
    with torch.no_grad():
        got = model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    rel = np.abs(got - expected).max() / np.abs(expected).max()
    assert rel < 1e-4, f"max relative difference {rel:.2e}"
    assert np.abs(expected).max() > 1.0  # the logits are not trivially small

    tok = transformers.AutoTokenizer.from_pretrained(out)
    kiln_tok = load_tokenizer(gpt2_dir)
    assert tok(TEXT)["input_ids"] == kiln_tok.encode(TEXT).ids
    assert tok.eos_token_id == 50256 == model.generation_config.eos_token_id
    assert tok.decode(tok(TEXT)["input_ids"]) == TEXT

    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers") and "license: mit" in card
    assert f"| key/value heads (GQA) | {cfg.n_kv_heads} |" in card
    assert "not exported from a kiln store" in card  # no lineage.json beside this hand-made model
    assert json.loads((out / "config.json").read_text())["rope_theta"] == cfg.rope_theta


def test_export_refuses_a_tokenizer_larger_than_the_model(gpt2_dir, tmp_path):
    cfg = ModelConfig(vocab_size=1000, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, seq_len=16)
    random_model(tmp_path / "model", cfg, seed=0)
    step = export_step(ExportConfig(), model=Step(name="train", stage="train", stage_version=1, config=cfg,
                                                  run=lambda ctx: {}), tokenizer=tokenizer_step(TokenizerConfig()))
    with pytest.raises(ValueError, match="50257 tokens but the model only 1000"):
        run_body(step, tmp_path / "export", {"model": tmp_path / "model", "tokenizer": gpt2_dir})
