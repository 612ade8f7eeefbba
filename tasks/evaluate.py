"""The evaluate step: a trained checkpoint scored on kiln's offline suite, any lm-eval tasks the
config names, and perplexity / bits per byte on the held-out token shards.

Inputs: `model` (a training output: model.json, params.safetensors), `tokenizer`, `tokens` (the
tokenize output whose validation split is scored) and `documents` (the documents that were
tokenized; the suite is cut from the ones in the validation split). Output folder:

    results.json      every metric, the held-out numbers, the suite's size, lm-eval's task versions
                      (and the chat template of the prompts, with eval.apply_chat_template)
    tasks/            the suite as lm-eval YAML + JSON lines (run `lm_eval --include_path tasks`
                      from inside this folder to score another model on the same examples)

Stats (into lineage): `<task>_<metric>` for every task and metric (`next_passage_acc`,
`next_passage_acc_norm`, `next_passage_acc_mutual_info`, `last_word_acc`, ...), `<task>_chance`
for multiple-choice tasks, `bits_per_byte`, `perplexity`, `heldout_loss`, and `table`: the rows
of the results table, which is also published as a Prefect table artifact when run in a flow.
Evaluating the same checkpoint on the same tasks again is a cache hit: same config and inputs,
same version.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from evaluation.suite import SUITE_TASKS, SuiteConfig, build_suite, short_name, task_configs
from tasks.documents import read_documents
from tasks.engine.step import Step, StepContext
from tasks.tokenize import is_validation
from tasks.tokenizer import chat_template, load_tokenizer, read_tokenizer_meta
from tasks.engine.config import ConfigModel, files, identity_when_set, setting
from training.config import KEPT_DIR
from training.data import TokenDataset, read_meta

if TYPE_CHECKING:  # lm-eval (with datasets and pandas) and JAX load when a model is evaluated, not for plans
    from evaluation.adapter import KilnLM

# 2: a post-trained model's generated answers end at <|end|> (lm-eval tasks that generate)
# 3: generated special tokens are dropped from an lm-eval answer, as lm-eval's hf model drops them
STAGE_VERSION = 3
SUITE_DIR = "tasks"
RESULTS_FILE = "results.json"


class EvalConfig(ConfigModel):
    """What to evaluate. Every field changes the results, so all are in the version (`checkpoints`
    only says which further evaluate steps to make, each with its own `step`)."""

    tasks: list[str] = Field(default_factory=lambda: list(SUITE_TASKS), description="kiln's offline suite tasks "
                             "(next_passage, last_word), cut from the held-out documents as `suite` says.")
    lm_eval_tasks: list[str] = files(default_factory=list, description="lm-eval task or group names this machine "
                                     "can load, or task YAML files (versioned by their content and that of the data "
                                     "files they name, not by path).")
    limit: int | None = Field(500, ge=1, description="Examples per task, lm-eval's `limit`: the first ones, which "
                              "for the suite's tasks (shuffled by `suite.seed`) are a seeded random sample. None: all.")
    num_fewshot: int = Field(0, ge=0, description="Few-shot examples lm-eval puts before each question.")
    apply_chat_template: bool = identity_when_set(False, description="lm-eval's --apply_chat_template: each "
                                                  "task's prompt (few-shot examples as earlier turns) in the chat "
                                                  "template the tokenizer carries (a Hugging Face checkpoint's, "
                                                  "tokenizer kind hf; else kiln's, which needs its chat tokens), "
                                                  "special-token strings read as their tokens, as lm-eval's hf "
                                                  "model reads them. For a model that chats (trained on from an "
                                                  "Instruct checkpoint).")
    bits_per_byte: bool = Field(True, description="Also loss, perplexity and bits per byte on the held-out token "
                                "shards (the tokenize output's validation split).")
    heldout_tokens: int | None = Field(None, ge=2, description="Score only the first this many held-out tokens; "
                                       "None: all of them.")
    validation_fraction: float = Field(0.01, ge=0.0, le=1.0, description="Which documents are held out; must equal "
                                       "`tokenize.validation_fraction` (the pipeline copies it).")
    suite: SuiteConfig = Field(SuiteConfig(), description="How the suite tasks are cut from the held-out documents.")
    batch_size: int = identity_when_set(16, ge=1, description="Sequences per forward pass. Identity: the batch "
                                        "shape changes the last bits of the scores (tests/test_eval_adapter.py "
                                        "allows 2e-4 between batch sizes), and so the results; 16 keeps the "
                                        "versions made when it was a setting.")
    checkpoints: Literal["every"] | tuple[int, ...] | None = setting(
        None, description="Also evaluate the model at these steps of its training (`every`: each "
        "train.checkpoint_every steps and the last), one evaluate step per step (`evaluate/step-<N>`), "
        "and `kiln compare --over steps` shows each metric against the step. The train step keeps those "
        "steps (train.keep_checkpoints, a setting); one trained before they were named lacks them (kiln plan warns).")
    step: int | None = identity_when_set(None, ge=1, description="The training step whose parameters are "
                                         "scored (the pipeline sets it for each of `checkpoints`); None: the "
                                         "trained model.")

    @field_validator("tasks")
    @classmethod
    def _known(cls, tasks: list[str]) -> list[str]:
        unknown = [t for t in tasks if t not in SUITE_TASKS]
        if unknown:
            raise ValueError(f"unknown kiln suite tasks {unknown}; kiln builds {list(SUITE_TASKS)}. "
                             "lm-eval's own tasks go under lm_eval_tasks")
        return tasks

    @model_validator(mode="after")
    def _something(self) -> "EvalConfig":
        if not (self.tasks or self.lm_eval_tasks or self.bits_per_byte):
            raise ValueError("nothing to evaluate: name tasks, lm_eval_tasks, or set bits_per_byte: true")
        return self


def load_kiln_lm(model_dir: Path, tokenizer_dir: Path, step: int | None = None, **kwargs) -> KilnLM:
    """The lm-eval adapter over a training output folder (at one of its kept steps, if `step`) and a
    tokenizer step output folder. A post-trained output's generation ends at its turn's end too."""
    from evaluation.adapter import KilnLM
    from evaluation.generate import output_chat
    from training.loop import load_model

    cfg, params = load_model(model_at(model_dir, step))
    meta = read_tokenizer_meta(tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    return KilnLM(cfg, params, tokenizer, meta["eos_id"], meta.get("bos_id"),
                  end_ids=output_chat(model_dir, tokenizer_dir, tokenizer)[0], **kwargs)


def model_at(model_dir: Path, step: int | None) -> Path:
    """The model folder of a train output (`step` None), or of one step it kept (`steps/<step>/`)."""
    if step is None:
        return model_dir
    folder = model_dir / KEPT_DIR / str(step)
    if not (folder / "params.safetensors").is_file():
        kept = sorted(int(p.name) for p in (model_dir / KEPT_DIR).glob("*")) if (model_dir / KEPT_DIR).is_dir() else []
        raise FileNotFoundError(f"{model_dir} kept no parameters at step {step} (it kept {kept or 'none'}): it was "
                                "trained before eval.checkpoints or a soup named the step; delete it to train it "
                                "again (kiln then keeps the step: train.keep_checkpoints), or name a step it kept")
    return folder


def checkpoint_steps(checkpoints, steps: int, checkpoint_every: int) -> tuple[int, ...]:
    """The training steps an `eval.checkpoints` value names, increasing."""
    if checkpoints is None:
        return ()
    if checkpoints == "every":
        return tuple(sorted({*range(checkpoint_every, steps + 1, checkpoint_every), steps}))
    outside = [s for s in checkpoints if not 1 <= s <= steps]
    if outside:
        raise ValueError(f"eval.checkpoints names steps {outside} outside the run's 1..{steps} (train.steps)")
    return tuple(sorted(set(checkpoints)))


def _check_inputs(config: EvalConfig, tokens_dir: Path, tokenizer_dir: Path) -> None:
    tokens_meta, tok_meta = read_meta(tokens_dir), read_tokenizer_meta(tokenizer_dir)
    if tokens_meta["validation_fraction"] != config.validation_fraction:
        raise ValueError(f"eval.validation_fraction is {config.validation_fraction} but {tokens_dir} held out "
                         f"{tokens_meta['validation_fraction']}: set them equal, or the suite would be cut from "
                         "documents the model was trained on")
    if tokens_meta["tokenizer_version"] != tok_meta["version"]:
        raise ValueError(f"{tokens_dir} was tokenized with tokenizer {tokens_meta['tokenizer_version']}, but the "
                         f"tokenizer input is {tok_meta['version']}: give evaluate the tokenizer of its tokens")


def run_evaluate(ctx: StepContext) -> dict:
    from evaluation.harness import evaluate, metric_table
    from evaluation.perplexity import heldout_metrics

    config: EvalConfig = ctx.config
    tokenizer_dir, tokens_dir, documents_dir = ctx.inputs["tokenizer"], ctx.inputs["tokens"], ctx.inputs["documents"]
    _check_inputs(config, tokens_dir, tokenizer_dir)
    chat = chat_template(tokenizer_dir) if config.apply_chat_template else None
    lm = load_kiln_lm(ctx.inputs["model"], tokenizer_dir, config.step, batch_size=config.batch_size, chat=chat)

    suite_dir = ctx.out / SUITE_DIR
    held_out = (d for d in read_documents(documents_dir, strict=True)
                if is_validation(str(d["id"]), config.validation_fraction))
    counts = build_suite(held_out, suite_dir, config.tasks, config.suite) if config.tasks else {}
    results: dict = {}
    if config.tasks or config.lm_eval_tasks:  # a scaling sweep may ask for bits per byte only
        ctx.log.info("suite: %s examples from held-out documents", counts)
        results = evaluate(lm, task_configs(suite_dir, config.tasks), config.lm_eval_tasks, config.limit,
                           config.num_fewshot, config.apply_chat_template)

    table = [{**row, "task": short_name(row["task"])} for row in metric_table(results)] if results else []
    if "next_passage" in config.tasks:  # the chance row right after the task's own rows
        after = max(i for i, row in enumerate(table) if row["task"] == "next_passage") + 1
        table.insert(after, {"task": "next_passage", "metric": "chance", "value": 1 / config.suite.num_choices,
                             "samples": None})
    heldout = None
    if config.bits_per_byte:
        dataset = TokenDataset(tokens_dir, "validation")
        heldout = heldout_metrics(lm.cfg, lm.params, dataset, lm.tok, config.batch_size,
                                  config.heldout_tokens, score=lm.scorer)
        for metric in ("bits_per_byte", "perplexity", "loss"):
            table.append({"task": "heldout", "metric": metric, "value": float(heldout[metric]),
                          "samples": heldout["tokens"]})
    for row in table:
        ctx.log.info("%s %s = %.4f", row["task"], row["metric"], row["value"])

    record = {"table": table, "suite_examples": counts, "heldout": heldout,
              **{k: results[k] for k in ("results", "groups", "versions", "n-shot", "n-samples") if k in results},
              **({"chat_template": chat.source} if chat is not None else {})}  # the prompts' template, if any
    (ctx.out / RESULTS_FILE).write_text(json.dumps(record, indent=2, sort_keys=True, default=float) + "\n")
    ctx.show("table", "results", table, f"kiln evaluation {ctx.step.version}: accuracy per task, held-out bits per byte")

    stats: dict = {f"{r['task']}_{r['metric']}": r["value"] for r in table if r["task"] != "heldout"}
    if heldout is not None:
        stats.update({"bits_per_byte": float(heldout["bits_per_byte"]), "perplexity": float(heldout["perplexity"]),
                      "heldout_loss": float(heldout["loss"]), "heldout_tokens": heldout["tokens"]})
    stats.update({f"{name}_examples": n for name, n in counts.items()})
    stats["table"] = table
    return stats


def evaluate_step(config: EvalConfig, *, model: Step, tokenizer: Step, tokens: Step, documents: Step) -> Step:
    return Step(name="evaluate", stage="evaluate", stage_version=STAGE_VERSION, config=config, run=run_evaluate,
                inputs={"model": model, "tokenizer": tokenizer, "tokens": tokens, "documents": documents})
