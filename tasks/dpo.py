"""The DPO step: the SFT model tuned on preference pairs against itself, frozen, as reference.

Inputs: `model` (an sft step output: it is both the starting point and the frozen reference),
`tokenizer`, `pairs` (a chat_data step output). Each pair becomes two rows, prompt + chosen and
prompt + rejected, with the loss mask on the answer; the reference's log-probabilities are
computed once on the training host (training.posttrain.open_rows). Training is the pretraining
loop with the DPO objective (beta from the config): same step, checkpoints, resume, Ray launch
and output layout. Its metrics add the reward margin (beta times the chosen-minus-rejected log
ratio) and the accuracy (margin > 0) per log interval.

Stats: the train stats, the final margin and accuracy, the chat evaluation of the DPO model, and
`table`: base, SFT (from the sft step's stats) and DPO side by side.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from evaluation.chat import ChatEvalConfig
from tasks.chat_data import read_records
from tasks.sft import (EVAL_DIR, TEMPLATE_FILE, comparison, evaluate_model, publish_table, read_model_config,
                       relay_to)
from tasks.tokenizer import load_tokenizer, read_tokenizer_meta
from training.config import ConfigModel, ResourcesConfig, TrainConfig, setting
from training.launch import launch_training
from training.metrics import read_metrics
from training.posttrain import CHAT_TEMPLATE, ChatTemplate, DPOObjective, open_rows, pad_pairs, save_rows

if TYPE_CHECKING:
    from tasks.step import Step, StepContext

STAGE_VERSION = 1


class DPOConfig(ConfigModel):
    beta: float = Field(0.1, gt=0.0)
    train: TrainConfig = TrainConfig(batch_size=8, steps=40, lr=3e-4, warmup=4, weight_decay=0.0,
                                     checkpoint_every=20, eval_every=20, eval_batches=2)
    evaluation: ChatEvalConfig = ChatEvalConfig()
    resources: ResourcesConfig = setting(ResourcesConfig())


def encode_pairs(pairs: list[dict], template: ChatTemplate) -> list:
    def side(p, answer):
        return template.encode(p["prompt"] + [{"role": "assistant", "content": answer}])
    return [(side(p, p["chosen"]), side(p, p["rejected"])) for p in pairs]


def run_dpo(ctx: StepContext) -> dict:
    cfg: DPOConfig = ctx.config
    model_dir, tokenizer_dir, pairs_dir = ctx.inputs["model"], ctx.inputs["tokenizer"], ctx.inputs["pairs"]
    model_cfg = read_model_config(model_dir)
    template = ChatTemplate(load_tokenizer(tokenizer_dir))
    eos_id = read_tokenizer_meta(tokenizer_dir)["eos_id"]
    dropped = {}
    for split in ("train", "eval"):
        pairs = read_records(Path(pairs_dir) / f"pairs_{split}.jsonl")
        rows, dropped[split] = pad_pairs(encode_pairs(pairs, template), model_cfg.seq_len, eos_id)
        if split == "train" and not len(rows["inputs"]):
            raise ValueError(f"no training pair of {pairs_dir} fits in seq_len {model_cfg.seq_len}")
        save_rows(ctx.work_dir / f"pairs_{split}.npz", rows)
    data = functools.partial(open_rows, str(ctx.work_dir / "pairs_train.npz"), str(ctx.work_dir / "pairs_eval.npz"),
                             cfg.train.batch_size, cfg.train.seed, cfg.train.eval_batches, str(model_dir))
    stats = launch_training(model_cfg, cfg.train, cfg.resources, data, ctx.work_dir, ctx.out,
                            on_metrics=relay_to(ctx, cfg.train.steps), objective=DPOObjective(cfg.beta),
                            init_model=model_dir)
    (ctx.out / TEMPLATE_FILE).write_text(CHAT_TEMPLATE, encoding="utf-8")
    last = read_metrics(ctx.out / "metrics.jsonl")[-1]

    evaluations = {}
    upstream = ctx.input_stats.get("model", {})
    for name in ("base", "sft"):  # the sft step evaluated both on the same held-out data
        if f"eval_{name}" in upstream:
            evaluations[name] = upstream[f"eval_{name}"]
    if "sft" not in evaluations:
        evaluations["sft"] = evaluate_model(model_dir, tokenizer_dir, pairs_dir, ctx.out / EVAL_DIR / "sft",
                                            cfg.evaluation)
    evaluations["dpo"] = evaluate_model(ctx.out, tokenizer_dir, pairs_dir, ctx.out / EVAL_DIR / "dpo", cfg.evaluation)
    for name, scores in evaluations.items():
        ctx.log.info("%s: %s", name, scores)
    table = comparison(evaluations)
    publish_table(table, ctx.step.version, "dpo")
    return {**stats, "final_margin": last.get("margin"), "final_accuracy": last.get("accuracy"), "left_out": dropped,
            "eval_sft": evaluations["sft"], "eval_dpo": evaluations["dpo"], "table": table}


def dpo_step(config: DPOConfig, *, model: Step, tokenizer: Step, pairs: Step) -> Step:
    from tasks.step import Step

    return Step(name="dpo", stage="dpo", stage_version=STAGE_VERSION, config=config, run=run_dpo,
                inputs={"model": model, "tokenizer": tokenizer, "pairs": pairs})
