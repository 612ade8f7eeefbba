"""The post-training steps end to end on a small scale: chat data from held-out KJV documents,
SFT from a saved model, DPO from the SFT output, each through its step body (Ray launch, chat
evaluation with lm-eval), and an export of the DPO model that carries the chat template."""

from __future__ import annotations

import pytest

import json
import logging

import jax
from safetensors.numpy import save_file

from tasks.chat_data import ChatDataConfig, chat_data_step, run_chat_data
from tasks.documents import ShardWriter
from tasks.dpo import DPOConfig, dpo_step, run_dpo
from tasks.export import ExportConfig, export_step, run_export
from tasks.sft import SFTConfig, run_sft, sft_step
from tasks.engine.step import Step, StepContext
from tasks.tokenizer import GPT2_EOS, TokenizerConfig, run_tokenizer, tokenizer_step
from evaluation.chat import ChatEvalConfig
from training.config import ModelConfig, TrainConfig
from training.loop import flatten_params
from training.model import init_params
from training.chat_template import CHAT_SPECIAL_TOKENS, CHAT_TEMPLATE
from tests.conftest import kjv_chapters

pytestmark = pytest.mark.slow  # minutes of training; run with `uv run --dev pytest -m slow`


def _ctx(step: Step, root, inputs: dict, input_stats: dict | None = None) -> StepContext:
    out, work = root / step.stage, root / "work" / step.stage
    out.mkdir(parents=True)
    work.mkdir(parents=True)
    return StepContext(step=step, out=out, inputs={k: root / s.stage for k, s in inputs.items()},
                       input_stats=input_stats or {}, work_dir=work, log=logging.getLogger(step.stage))


@pytest.mark.ray  # its training (or data workers) starts a local Ray: tests/conftest.py ray_lock
def test_chat_data_sft_dpo_export(tmp_path, caplog):
    documents = Step(name="documents", stage="documents", stage_version=1, config=ChatDataConfig(), run=None)
    with ShardWriter(tmp_path / "documents", 100) as writer:
        for doc in kjv_chapters()[:40]:
            writer.write({"id": f"kjv/{doc['id']}", "text": doc["text"], "source": "kjv", "metadata": {}})
    chat = chat_data_step(ChatDataConfig(validation_fraction=0.5, prompt_words=12, answer_words=6), documents=documents)
    counts = run_chat_data(_ctx(chat, tmp_path, {"documents": documents}))
    assert counts["sft_train"] > 20 and counts["sft_eval"] > 3 and counts["pairs_eval"] > 3
    pair = json.loads((tmp_path / "chat_data" / "pairs_train.jsonl").read_text().splitlines()[0])
    assert pair["chosen"] != pair["rejected"] and pair["prompt"][0]["role"] == "user"

    tokenizer = tokenizer_step(TokenizerConfig(special_tokens=(GPT2_EOS, *CHAT_SPECIAL_TOKENS)))
    run_tokenizer(_ctx(tokenizer, tmp_path, {}))
    model_cfg = ModelConfig(vocab_size=50261, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, seq_len=64)
    base = tmp_path / "train"  # stands in for a train step output
    base.mkdir()
    (base / "model.json").write_text(model_cfg.model_dump_json())
    save_file(flatten_params(init_params(model_cfg, jax.random.PRNGKey(0))), str(base / "params.safetensors"))
    base_step = Step(name="train", stage="train", stage_version=1, config=model_cfg, run=None)

    evaluation = ChatEvalConfig(limit=4, max_gen_toks=8)
    small = dict(batch_size=4, warmup=1, weight_decay=0.0, checkpoint_every=4, eval_every=4, eval_batches=1,
                 log_every=2, peak_flops=1e11)
    sft = sft_step(SFTConfig(train=TrainConfig(steps=4, lr=1e-3, **small), evaluation=evaluation),
                   model=base_step, tokenizer=tokenizer, chat=chat)
    sft_stats = run_sft(_ctx(sft, tmp_path, {"model": base_step, "tokenizer": tokenizer, "chat": chat}))
    assert sft_stats["steps"] == 4 and (tmp_path / "sft" / "params.safetensors").is_file()
    assert (tmp_path / "sft" / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    for name in ("base", "sft"):
        scores = sft_stats[f"eval_{name}"]
        assert 0 <= scores["preference_acc"] <= 1 and 0 <= scores["generation_chrf"] <= 100
    assert {r["model"] for r in sft_stats["table"]} == {"base", "sft"}

    dpo = dpo_step(DPOConfig(beta=0.1, train=TrainConfig(steps=4, lr=1e-3, **small), evaluation=evaluation),
                   model=sft, tokenizer=tokenizer, pairs=chat)
    dpo_stats = run_dpo(_ctx(dpo, tmp_path, {"model": sft, "tokenizer": tokenizer, "pairs": chat},
                             {"model": sft_stats}))
    assert dpo_stats["final_margin"] is not None and 0 <= dpo_stats["final_accuracy"] <= 1
    assert {r["model"] for r in dpo_stats["table"]} == {"base", "sft", "dpo"}

    # SPIN-style pairs: the rejected answers are the SFT model's own greedy answers, made here
    spin = dpo_step(DPOConfig(beta=0.1, rejected="generated", max_gen_toks=8,
                              train=TrainConfig(steps=4, lr=1e-3, **small), evaluation=evaluation),
                    model=sft, tokenizer=tokenizer, pairs=chat)
    assert spin.version != dpo.version
    root = tmp_path / "spin"
    root.mkdir()
    for name in ("sft", "tokenizer", "chat_data"):
        (root / name).symlink_to(tmp_path / name)
    with caplog.at_level(logging.INFO, logger="dpo"):
        spin_stats = run_dpo(_ctx(spin, root, {"model": sft, "tokenizer": tokenizer, "pairs": chat},
                                  {"model": sft_stats}))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("generating rejected answers")]
    made = [json.loads(line) for line in (root / "dpo" / "pairs" / "pairs_train.jsonl").read_text().splitlines()]
    given = [json.loads(line) for line in (tmp_path / "chat_data" / "pairs_train.jsonl").read_text().splitlines()]
    assert made and {p["id"] for p in made} <= {p["id"] for p in given}
    # how far the generation is, every 30 s and at each split's end: not a line per batch of 16
    assert len(said) < 6 and said[-2].startswith(f"generating rejected answers (train): {len(given)}/{len(given)} in ")
    assert said[-1].startswith("generating rejected answers (eval): ")
    by_id = {p["id"]: p for p in given}
    assert all(p["chosen"] == by_id[p["id"]]["chosen"] and p["rejected"] != p["chosen"] for p in made)
    counts = spin_stats["generated_rejected"]
    assert counts["train"]["pairs"] + counts["train"]["rejected_equal_to_chosen"] == len(given)
    assert {r["model"] for r in spin_stats["table"]} == {"sft", "dpo"}  # base was scored on other pairs

    exported = export_step(ExportConfig(), model=dpo, tokenizer=tokenizer)
    run_export(_ctx(exported, tmp_path, {"model": dpo, "tokenizer": tokenizer}))
    config = json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    generation = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [50256, 50260]  # EOS, then <|end|> (the 4th of the chat tokens after it)
