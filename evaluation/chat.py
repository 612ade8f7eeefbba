"""Chat evaluation on held-out conversations and preference pairs, as two lm-eval tasks run
through kiln's adapter (`KilnLM`, greedy decoding with a KV cache):

    kiln_chat_generation  generate_until. The prompt is the conversation up to its last assistant
                          turn, rendered with the chat template and ending in its generation
                          prompt (`<|assistant|>`); the model answers greedily until the end of
                          turn (`<|end|>`, a checkpoint template's own) or EOS. Metrics, lm-eval
                          built-ins: exact_match (the answer word for word) and chrf (character
                          n-gram F-score against the true answer, a token-level score that moves
                          before exact matches do).
    kiln_chat_preference  multiple_choice between the chosen and the rejected answer (each as the
                          template renders it, to its end of turn, as DPO scores them). acc: the
                          chosen answer has the higher log-likelihood; acc_norm: per byte. This
                          is preference accuracy.

The prompts carry the chat special tokens on purpose, so the adapter parses special-token
strings (`parse_special_tokens=True`). No Prefect here; lm-eval and JAX are imported when an
evaluation runs, so the config is cheap to import (`kiln plan` reads it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from pydantic import Field

from tasks.engine.config import ConfigModel, identity_when_set

if TYPE_CHECKING:
    from training.chat_jinja import CheckpointTemplate
    from training.chat_template import ChatTemplate

GENERATION, PREFERENCE = "kiln_chat_generation", "kiln_chat_preference"


class ChatEvalConfig(ConfigModel):
    limit: int | None = Field(64, ge=1, description="Examples per task: the first ones of the chat data's "
                              "evaluation part. None: all.")
    max_gen_toks: int = Field(32, ge=1, description="kiln_chat_generation: the most tokens generated per answer "
                              "(greedy, until the end of turn or EOS).")
    batch_size: int = identity_when_set(16, ge=1, description="Sequences per forward pass. Identity: batch "
                                        "shape changes the last bits of the scores, and so which token greedy "
                                        "decoding picks at a near tie (DPO's generated rejections come from it); 16 "
                                        "keeps the versions made when it was a setting.")


def write_tasks(conversations: list[dict], pairs: list[dict], template: ChatTemplate | CheckpointTemplate,
                out_dir: Path, cfg: ChatEvalConfig) -> list[dict]:
    """The two tasks' JSON lines and YAML in `out_dir`; returns the lm-eval configs (absolute paths)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    generation = []
    for c in conversations:
        last = max(i for i, m in enumerate(c["messages"]) if m["role"] == "assistant")
        prompt = c["messages"][:last]
        answer = template.answer_text(prompt, c["messages"][last]["content"])  # the target: without its end
        generation.append({"id": c["id"], "context": template.render(prompt, add_generation_prompt=True),
                           "target": answer[:len(answer) - len(template.end_text)]})
    preference = [{"id": p["id"], "context": template.render(p["prompt"], add_generation_prompt=True),
                   "choices": [template.answer_text(p["prompt"], p["chosen"]),
                               template.answer_text(p["prompt"], p["rejected"])], "label": 0} for p in pairs]
    configs = []
    tasks = ((GENERATION, generation, _generation_task(cfg, template.end_text)),
             (PREFERENCE, preference, _preference_task()))
    for name, rows, task in tasks:
        if not rows:
            continue
        data = out_dir / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows), encoding="utf-8")
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data.name}},
                "test_split": "test", "doc_to_text": "context", "metadata": {"version": 1}, **task}
        (out_dir / f"{name}.yaml").write_text(yaml.safe_dump(task, sort_keys=False))
        configs.append({**task, "dataset_kwargs": {"data_files": {"test": str(data.resolve())}}})
    if not configs:
        raise ValueError("no held-out conversations or pairs to evaluate on: lower eval_fraction's floor or add data")
    return configs


def _generation_task(cfg: ChatEvalConfig, end_text: str) -> dict:
    return {"output_type": "generate_until", "doc_to_target": "target",
            "generation_kwargs": {"until": [end_text], "do_sample": False, "max_gen_toks": cfg.max_gen_toks},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True},
                            {"metric": "chrf", "aggregation": "chrf", "higher_is_better": True}]}


def _preference_task() -> dict:
    return {"output_type": "multiple_choice", "doc_to_choice": "choices", "doc_to_target": "label",
            "target_delimiter": "",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]}


def chat_evaluate(cfg_model, params, tokenizer, eos_id: int, template: ChatTemplate | CheckpointTemplate,
                  conversations: list[dict], pairs: list[dict], out_dir: Path, cfg: ChatEvalConfig) -> dict:
    """{"generation_exact_match", "generation_chrf", "preference_acc", "preference_acc_norm", ...} for one
    model (config, parameters) with the tokenizer and chat template it was trained with."""
    from evaluation.adapter import KilnLM
    from evaluation.harness import evaluate, metric_table

    configs = write_tasks(conversations, pairs, template, out_dir, cfg)
    lm = KilnLM(cfg_model, params, tokenizer, eos_id, batch_size=cfg.batch_size, max_gen_toks=cfg.max_gen_toks,
                parse_special_tokens=True)
    results = evaluate(lm, configs, [], cfg.limit)
    short = {GENERATION: "generation", PREFERENCE: "preference"}
    scores = {f"{short[r['task']]}_{r['metric']}": r["value"] for r in metric_table(results)}
    scores["examples"] = {short[t]: v.get("effective") for t, v in results.get("n-samples", {}).items()}
    return scores
