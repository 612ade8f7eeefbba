"""The SFT step: a pretrained model fine-tuned on chat conversations, loss on the assistant's
words only.

Inputs: `model` (a train step output: model.json + params.safetensors), `tokenizer` (with the
chat tokens, training.chat_template.CHAT_SPECIAL_TOKENS, or a Hugging Face checkpoint's tokenizer
that carries its chat template: tasks.tokenizer.chat_template), `chat` (a chat_data step output).
The conversations are encoded with the chat template and packed into rows of seq_len + 1 tokens
(training/posttrain.py); training is `training.launch.launch_training` with the SFT objective
and the pretrained parameters as the start: the same jitted step, sharding, checkpoints (in
`ctx.work_dir`, so a killed run resumes), Ray launch and output layout as the train step, with
this step's own learning-rate schedule. The output adds `chat_template.jinja` (export copies it
into tokenizer_config.json) and `chat_eval/` (the evaluation tasks).

Stats: the train stats, the chat evaluation (evaluation/chat.py) of the base model and of the
SFT model, and `table`: the comparison, one row per (model, metric).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from evaluation.chat import ChatEvalConfig
from tasks.chat_data import read_records
from tasks.tokenizer import chat_template, load_tokenizer, read_tokenizer_meta
from tasks.engine.config import ConfigModel, setting
from training.config import ModelConfig, ResourcesConfig, TrainConfig
from training.tracking import TrackingConfig, tracked

if TYPE_CHECKING:  # JAX, orbax and Ray load when the step runs, not for `kiln plan`
    from tasks.engine.step import Step, StepContext

# 2: the shared training step's attention in query blocks changes the last bits of the parameters;
# 3: so does its rotary in one fused pass; 4: and its rotary tables computed once per forward, and SwiGLU's
# hand-written backward; 5: and a sliding-window layer's query blocks skipping the keys outside the window
STAGE_VERSION = 5
EVAL_DIR = "chat_eval"


class SFTConfig(ConfigModel):
    """The fine-tuning recipe (its own schedule: short, a lower peak, no weight decay)."""

    train: TrainConfig = Field(TrainConfig(batch_size=8, steps=60, lr=1e-3, warmup=6, weight_decay=0.0,
                                           checkpoint_every=20, eval_every=20, eval_batches=2),
                               description="SFT's own training recipe (not the top-level `train`), on packed rows "
                               "of conversations; the model's shape comes from the model it starts from.")
    evaluation: ChatEvalConfig = Field(ChatEvalConfig(), description="The chat evaluation of the model before and "
                                       "after SFT on the chat data's evaluation part.")
    resources: ResourcesConfig = setting(ResourcesConfig(), description="Where SFT trains: its own section, not "
                                         "the top-level `resources`.")
    tracking: TrackingConfig = setting(TrackingConfig(), description="Set from the experiment's `tracking`.")


def read_model_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "model.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: post-training starts from a train (or sft) step output")
    return ModelConfig.model_validate_json(path.read_text())


def evaluate_model(model_dir: Path, tokenizer_dir: Path, chat_dir: Path, out_dir: Path, cfg: ChatEvalConfig) -> dict:
    """The chat evaluation of one model folder on the chat data's held-out part."""
    from evaluation.chat import chat_evaluate
    from training.loop import load_model

    model_cfg, params = load_model(model_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    return chat_evaluate(model_cfg, params, tokenizer, read_tokenizer_meta(tokenizer_dir)["eos_id"],
                         chat_template(tokenizer_dir, tokenizer), read_records(Path(chat_dir) / "sft_eval.jsonl"),
                         read_records(Path(chat_dir) / "pairs_eval.jsonl"), out_dir, cfg)


def comparison(evaluations: dict[str, dict]) -> list[dict]:
    """{model name: chat scores} -> rows {"model", "metric", "value"} (the artifact's table)."""
    return [{"model": name, "metric": metric, "value": value}
            for name, scores in evaluations.items() for metric, value in scores.items() if isinstance(value, float)]


def relay_to(ctx: StepContext, steps: int):
    def relay(record: dict) -> None:
        extra = "".join(f" {k} {record[k]:.4f}" for k in ("val_loss", "margin", "accuracy") if k in record)
        ctx.log.info("step %d/%d loss %.4f%s lr %.2e %.0f tok/s", record["step"], steps, record["loss"], extra,
                     record["lr"], record["tokens_per_s"])
        ctx.progress(record["step"], steps)
    return relay


def run_sft(ctx: StepContext) -> dict:
    from training.launch import launch_training
    from training.chat_template import TEMPLATE_FILE
    from training.posttrain import SFTObjective, open_rows, pack, save_rows

    cfg: SFTConfig = ctx.config
    model_dir, tokenizer_dir, chat_dir = ctx.inputs["model"], ctx.inputs["tokenizer"], ctx.inputs["chat"]
    model_cfg = read_model_config(model_dir)
    template = chat_template(tokenizer_dir)
    # ends a reply in evaluation, serving and the export: found (or refused) before any training
    ctx.log.info("conversations in %s, each turn ending at %r (token %d)", template.name, template.end_text,
                 template.end_id)
    eos_id = read_tokenizer_meta(tokenizer_dir)["eos_id"]
    packed, dropped = {}, {}
    for split in ("train", "eval"):
        convs = read_records(Path(chat_dir) / f"sft_{split}.jsonl")
        packed[split], dropped[split] = pack([template.encode(c["messages"]) for c in convs], model_cfg.seq_len, eos_id)
        save_rows(ctx.work_dir / f"sft_{split}.npz", packed[split])
    if len(packed["train"]["inputs"]) < cfg.train.batch_size:
        ctx.log.warning("only %d packed rows for batch_size %d: rows repeat within a step",
                        len(packed["train"]["inputs"]), cfg.train.batch_size)
    ctx.log.info("SFT on %d packed rows (%d conversations too long, left out)", len(packed["train"]["inputs"]),
                 dropped["train"])

    base = evaluate_model(model_dir, tokenizer_dir, chat_dir, ctx.out / EVAL_DIR / "base", cfg.evaluation)
    data = functools.partial(open_rows, ctx.workspace, "sft_train.npz", "sft_eval.npz", cfg.train)
    with tracked(relay_to(ctx, cfg.train.steps), cfg.tracking, f"sft-{ctx.step.version}",
                 cfg.model_dump(mode="json")) as on_metrics:
        stats = launch_training(model_cfg, cfg.train, cfg.resources, data, ctx.workspace, ctx.out,
                                on_metrics=on_metrics, objective=SFTObjective(), init_model=ctx.located("model"))
    (ctx.out / TEMPLATE_FILE).write_text(template.source, encoding="utf-8")
    tuned = evaluate_model(ctx.out, tokenizer_dir, chat_dir, ctx.out / EVAL_DIR / "sft", cfg.evaluation)
    for name, scores in (("base", base), ("sft", tuned)):
        ctx.log.info("%s: %s", name, scores)
    table = comparison({"base": base, "sft": tuned})
    ctx.show("table", "chat-eval", table, f"kiln sft {ctx.step.version}: chat generation and preference accuracy by model")
    return {**stats, "packed_rows": len(packed["train"]["inputs"]), "left_out": dropped,
            "eval_base": base, "eval_sft": tuned, "table": table}


def sft_step(config: SFTConfig, *, model: Step, tokenizer: Step, chat: Step,
             tracking: TrackingConfig | None = None) -> Step:
    from tasks.engine.step import Step

    if tracking is not None:
        config = config.model_copy(update={"tracking": tracking})

    return Step(name="sft", stage="sft", stage_version=STAGE_VERSION, config=config, run=run_sft,
                inputs={"model": model, "tokenizer": tokenizer, "chat": chat})
