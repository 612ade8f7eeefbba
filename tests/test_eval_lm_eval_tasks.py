"""lm-eval task names in the eval config: one this machine cannot load fails at once, with a
message that names the task and says why (tests run with the hub switched off)."""

from __future__ import annotations

import jax
import pytest

from evaluation.adapter import KilnLM
from evaluation.harness import TaskUnavailable, evaluate
from tasks.tokenizer import build_gpt2
from training.config import ModelConfig
from training.model import init_params


@pytest.fixture(scope="module")
def lm() -> KilnLM:
    cfg = ModelConfig(vocab_size=50257, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, seq_len=32)
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
    return KilnLM(cfg, params, build_gpt2(("<|endoftext|>",)), eos_id=50256)


def test_uncached_lm_eval_task_names_the_task_and_the_reason(lm, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(TaskUnavailable) as info:
        evaluate(lm, [], ["lambada_openai"], limit=5)
    message = str(info.value)
    assert "'lambada_openai' cannot be loaded on this machine" in message
    assert "'EleutherAI/lambada_openai'" in message and "not in the local datasets cache" in message
    assert "HF_HUB_OFFLINE" in message and "remove 'lambada_openai'" in message
    # One clear error, not a chain of network tracebacks.
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_unknown_lm_eval_task_is_named(lm):
    with pytest.raises(TaskUnavailable, match="'lambada_opnai' is not a task, group or tag known to lm-eval"):
        evaluate(lm, [], ["lambada_opnai"], limit=5)
