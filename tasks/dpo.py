"""The DPO step: the SFT model tuned on preference pairs against itself, frozen, as reference.

Inputs: `model` (an sft step output: it is both the starting point and the frozen reference),
`tokenizer`, `pairs` (a chat_data step output). Each pair becomes two rows, prompt + chosen and
prompt + rejected, with the loss mask on the answer; the reference's log-probabilities are
computed once, before the first step, on the training's hosts and mesh a microbatch at a time
(training.posttrain.open_rows). Training is the pretraining loop with the DPO objective (beta
from the config): same step, checkpoints, resume, Ray launch and output layout. Its metrics add
the reward margin (beta times the chosen-minus-rejected log ratio) and the accuracy (margin > 0)
per log interval.

Rejected answers: `rejected: pairs` takes the chat data's pairs as they are (the default run's:
a continuation from another held-out document). `rejected: generated` keeps their prompts and
chosen answers but makes each rejected answer the SFT model's own greedy answer to the prompt
(as SPIN, Chen et al. 2024, does): the pairs then teach what the SFT model gets wrong, and the
held-out pairs are made the same way, once, by the same frozen model. They are written to
`pairs/` in the output; drawn answers equal to the chosen one are left out and counted.

Stats: the train stats, the final margin and accuracy, the chat evaluation of the DPO model, and
`table`: base, SFT (from the sft step's stats, or measured here on generated pairs) and DPO side
by side.
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from evaluation.chat import ChatEvalConfig
from tasks.chat_data import read_records
from tasks.sft import EVAL_DIR, comparison, evaluate_model, read_model_config, relay_to
from tasks.tokenizer import chat_template, load_tokenizer, read_tokenizer_meta
from tasks.engine.config import ConfigModel, setting
from training.config import ResourcesConfig, TrainConfig
from training.metrics import read_metrics
from training.tracking import TrackingConfig, tracked

if TYPE_CHECKING:  # JAX, orbax and Ray load when the step runs, not for `kiln plan`
    from tasks.engine.step import Step, StepContext
    from training.chat_jinja import CheckpointTemplate
    from training.chat_template import ChatTemplate

# 2: rejected answers may be generated; 3: the shared training step's attention in query blocks changes the
# last bits of the parameters; 4: so does its rotary in one fused pass; 5: and its rotary tables computed once
# per forward, and SwiGLU's hand-written backward; 6: and a sliding-window layer's query blocks skipping the keys
# outside the window; 7: the reference's log-probs computed on the training's mesh, a microbatch's pairs at a time
# (the same bits on one CPU device; on several devices the last bits may differ)
STAGE_VERSION = 7


class DPOConfig(ConfigModel):
    beta: float = Field(0.1, gt=0.0, description="DPO's beta, the weight of its KL penalty: the loss is -log "
                        "sigmoid(beta * (chosen minus rejected log-ratio to the reference, the SFT model)); larger "
                        "keeps the model nearer the reference.")
    rejected: Literal["pairs", "generated"] = Field(
        "pairs", description="pairs: the chat data's rejected answers; generated: the SFT model's own "
        "greedy answers (SPIN), for the training and the held-out pairs alike.")
    max_gen_toks: int = Field(32, ge=1, description="Length limit of generated rejected answers.")
    sft_weight: float = Field(0.0, ge=0.0, description="Adds this times the chosen answers' token NLL to the "
                              "DPO loss (RPO), so that they stay likely.")
    train: TrainConfig = Field(TrainConfig(batch_size=8, steps=40, lr=3e-4, warmup=4, weight_decay=0.0,
                                           checkpoint_every=20, eval_every=20, eval_batches=2),
                               description="DPO's own training recipe (not the top-level `train`), on the "
                               "preference pairs.")
    evaluation: ChatEvalConfig = Field(ChatEvalConfig(), description="The chat evaluation of the SFT and the DPO "
                                       "model on the chat data's evaluation part.")
    resources: ResourcesConfig = setting(ResourcesConfig(), description="Where DPO trains: its own section, not "
                                         "the top-level `resources`.")
    tracking: TrackingConfig = setting(TrackingConfig(), description="Set from the experiment's `tracking`.")

    def objective(self):
        """The DPO objective this section trains with (training/posttrain.py): the step's and
        `kiln capacity`'s."""
        from training.posttrain import DPOObjective

        return DPOObjective(self.beta, self.sft_weight)


def encode_pairs(pairs: list[dict], template: ChatTemplate | CheckpointTemplate) -> list:
    def side(p, answer):
        return template.encode(p["prompt"] + [{"role": "assistant", "content": answer}])
    return [(side(p, p["chosen"]), side(p, p["rejected"])) for p in pairs]


def generated_pairs(model_dir: Path, tokenizer_dir: Path, chat_dir: Path, out: Path, max_gen_toks: int,
                    batch_size: int, log, report_s: float = 30.0) -> tuple[Path, dict]:
    """A copy of the chat data's pairs whose rejected answers are the model's greedy answers;
    how far it is goes to `log` every `report_s` seconds and at the end of each split."""
    from evaluation.adapter import KilnLM
    from training.loop import load_model

    model_cfg, params = load_model(Path(model_dir))
    tokenizer = load_tokenizer(tokenizer_dir)
    template = chat_template(tokenizer_dir, tokenizer)
    lm = KilnLM(model_cfg, params, tokenizer, read_tokenizer_meta(tokenizer_dir)["eos_id"], batch_size=batch_size,
                max_gen_toks=max_gen_toks, parse_special_tokens=True)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(chat_dir) / "sft_eval.jsonl", out / "sft_eval.jsonl")  # the generation task's data
    counts = {}
    for split in ("train", "eval"):
        pairs = read_records(Path(chat_dir) / f"pairs_{split}.jsonl")
        prompts = [lm.tok_encode(template.render(p["prompt"], add_generation_prompt=True)) for p in pairs]
        answers = []
        began = said = time.monotonic()
        for start in range(0, len(prompts), batch_size):
            answers += lm.generate(prompts[start:start + batch_size], max_gen_toks, [template.end_text])
            now = time.monotonic()
            if now - said >= report_s or len(answers) == len(prompts):  # not a line per batch: 60k pairs
                said = now
                log.info("generating rejected answers (%s): %d/%d in %.0f s", split, len(answers), len(prompts),
                         now - began)
        kept = [{**p, "rejected": a.strip()} for p, a in zip(pairs, answers) if a.strip() != p["chosen"].strip()]
        with open(out / f"pairs_{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in kept)
        counts[split] = {"pairs": len(kept), "rejected_equal_to_chosen": len(pairs) - len(kept)}
    return out, counts


def run_dpo(ctx: StepContext) -> dict:
    from training.launch import launch_training
    from training.chat_template import TEMPLATE_FILE
    from training.posttrain import open_rows, pad_pairs, save_rows

    cfg: DPOConfig = ctx.config
    model_dir, tokenizer_dir, pairs_dir = ctx.inputs["model"], ctx.inputs["tokenizer"], ctx.inputs["pairs"]
    model_cfg = read_model_config(model_dir)
    template = chat_template(tokenizer_dir)
    eos_id = read_tokenizer_meta(tokenizer_dir)["eos_id"]
    generated = None
    if cfg.rejected == "generated":
        pairs_dir, generated = generated_pairs(model_dir, tokenizer_dir, pairs_dir, ctx.out / "pairs", cfg.max_gen_toks,
                                               cfg.evaluation.batch_size, ctx.log)
    dropped = {}
    for split in ("train", "eval"):
        pairs = read_records(Path(pairs_dir) / f"pairs_{split}.jsonl")
        rows, dropped[split] = pad_pairs(encode_pairs(pairs, template), model_cfg.seq_len, eos_id)
        if split == "train" and not len(rows["inputs"]):
            raise ValueError(f"no training pair of {pairs_dir} fits in seq_len {model_cfg.seq_len}")
        save_rows(ctx.work_dir / f"pairs_{split}.npz", rows)
    data = functools.partial(open_rows, ctx.workspace, "pairs_train.npz", "pairs_eval.npz", cfg.train,
                             ctx.located("model"))
    with tracked(relay_to(ctx, cfg.train.steps), cfg.tracking, f"dpo-{ctx.step.version}",
                 cfg.model_dump(mode="json")) as on_metrics:
        stats = launch_training(model_cfg, cfg.train, cfg.resources, data, ctx.workspace, ctx.out,
                                on_metrics=on_metrics, objective=cfg.objective(),
                                init_model=ctx.located("model"), on_note=ctx.log.info)
    (ctx.out / TEMPLATE_FILE).write_text(template.source, encoding="utf-8")
    last = read_metrics(ctx.out / "metrics.jsonl")[-1]

    evaluations = {}
    upstream = ctx.input_stats.get("model", {}) if generated is None else {}  # other pairs: not comparable
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
    ctx.show("table", "chat-eval", table, f"kiln dpo {ctx.step.version}: chat generation and preference accuracy by model")
    return {**stats, "final_margin": last.get("margin"), "final_accuracy": last.get("accuracy"), "left_out": dropped,
            **({"generated_rejected": generated} if generated is not None else {}),
            "eval_sft": evaluations["sft"], "eval_dpo": evaluations["dpo"], "table": table}


def dpo_step(config: DPOConfig, *, model: Step, tokenizer: Step, pairs: Step,
             tracking: TrackingConfig | None = None) -> Step:
    from tasks.engine.step import Step

    if tracking is not None:
        config = config.model_copy(update={"tracking": tracking})

    return Step(name="dpo", stage="dpo", stage_version=STAGE_VERSION, config=config, run=run_dpo,
                inputs={"model": model, "tokenizer": tokenizer, "pairs": pairs})
