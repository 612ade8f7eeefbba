"""In-loop evaluations (`train.evals`): every N steps, on the parameters the run has now, held-out
bits per byte per source and kiln-suite or lm-eval tasks, with no reload and no second process.

Marin and OLMo watch these curves while a model trains (Levanter's `eval/paloma/<domain>/bpb`,
OLMo-core's in-loop downstream evals); here they are one hook of the training loop
(training/hooks.py), built on each host from what the driver prepared:

    eval/<source>/bpb, eval/<source>/loss   bits per byte and nats per token on the first
                                            `heldout_tokens` held-out tokens of each source of a
                                            mixture (weight 0 sources are eval-only domains);
                                            `heldout` for a run on one stream
    eval/<task>/<metric>                    each task's lm-eval metrics (acc, acc_norm, ...)
    eval/heldout_seconds, eval/tasks_seconds   what each evaluation took (not train time)

The numbers are those of the evaluate step on the same parameters and examples: bits per byte
through `evaluation.perplexity.heldout_metrics`, tasks through the same `KilnLM` and lm-eval
call, on the suite cut from the same held-out documents with the same `SuiteConfig`. They land in
metrics.jsonl, TensorBoard, W&B and the train step's curves in the Prefect UI. No Prefect here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import jax

from tasks.engine.store import Located
from training.config import InLoopEvalConfig
from training.hooks import Hook, LoopContext, StepInfo

SUITE_DIR = "in_loop_tasks"  # in the train step's work folder: the suite the driver cut for the hosts


@dataclass(frozen=True)
class InLoopEvals:
    """A hook factory (training/hooks.py `HookFactory`): pickled to every host, where it opens the
    tokenizer, the held-out tokens of each source and the suite in the work folder."""

    cfg: InLoopEvalConfig
    tokenizer: Located
    # (name, tokenize output, mixture weight) of each source; weight 0: an eval-only source
    sources: tuple[tuple[str, Located, float], ...]
    suite_tasks: tuple[str, ...] = ()  # kiln suite tasks written under <work folder>/SUITE_DIR

    def __call__(self, ctx: LoopContext) -> list[Hook]:
        return [Hook(_Evaluations(self, ctx), self.cfg.every)]


class _Evaluations:
    def __init__(self, spec: InLoopEvals, ctx: LoopContext):
        from evaluation.adapter import KilnLM
        from evaluation.suite import task_configs
        from tasks.tokenizer import chat_template, load_tokenizer, read_tokenizer_meta

        self.cfg, self.ctx = spec.cfg, ctx
        folder = spec.tokenizer.local()
        meta = read_tokenizer_meta(folder)
        self.tokenizer = load_tokenizer(folder)
        # the driver (tasks/train.py) left out the sources with nothing held out
        self.heldout = {name: held_out(tokens.local(), weight) for name, tokens, weight in spec.sources} \
            if spec.cfg.heldout_tokens else {}
        self.suite = task_configs(ctx.work_dir / SUITE_DIR, spec.suite_tasks) if spec.suite_tasks else []
        # One adapter for the whole run: its compiled functions are kept, its parameters replaced.
        self.lm = KilnLM(ctx.model_cfg, None, self.tokenizer, meta["eos_id"], meta.get("bos_id"),
                         batch_size=spec.cfg.batch_size,
                         chat=chat_template(folder, self.tokenizer) if spec.cfg.apply_chat_template else None)

    def __call__(self, info: StepInfo) -> None:
        params = info.published  # what the evaluate step would score: with train.ema the average
        if jax.process_count() > 1:  # every host gathers (a collective); host 0 evaluates
            from training.loop import on_host

            params = jax.tree_util.tree_map(jax.numpy.asarray, on_host(params))
        if not self.ctx.primary or info.metrics is None:
            return
        info.metrics.update(self.evaluate(params))

    def evaluate(self, params) -> dict[str, float]:
        from evaluation.harness import evaluate, metric_table
        from evaluation.perplexity import heldout_metrics
        from evaluation.suite import short_name

        out: dict[str, float] = {}
        if self.heldout:
            t0 = time.perf_counter()
            for name, dataset in self.heldout.items():
                m = heldout_metrics(self.ctx.model_cfg, params, dataset, self.tokenizer, self.cfg.batch_size,
                                    self.cfg.heldout_tokens, score=self.lm.scorer)
                out[f"eval/{name}/loss"] = m["loss"]
                if m["bits_per_byte"] is not None:
                    out[f"eval/{name}/bpb"] = m["bits_per_byte"]
            out["eval/heldout_seconds"] = time.perf_counter() - t0
        if self.suite or self.cfg.lm_eval_tasks:
            t0 = time.perf_counter()
            self.lm.params = params
            results = evaluate(self.lm, self.suite, list(self.cfg.lm_eval_tasks), self.cfg.limit,
                               self.cfg.num_fewshot, self.cfg.apply_chat_template)
            for row in metric_table(results):
                out[f"eval/{short_name(row['task'])}/{row['metric']}"] = row["value"]
            out["eval/tasks_seconds"] = time.perf_counter() - t0
        return out


def held_out(folder: Path, weight: float):
    """The tokens scored for a source, as the mixture's validation takes them (training/data.py):
    its validation split; for an eval-only source (weight 0), never trained on, its train split
    when that is empty. None when neither has two tokens."""
    from training.data import TokenDataset

    for split in ("validation",) if weight > 0 else ("validation", "train"):
        dataset = TokenDataset(folder, split)
        if dataset.n_tokens >= 2:
            return dataset
    return None


def prepare_suite(documents: Path, work_dir: Path, cfg: InLoopEvalConfig, suite, validation_fraction: float) -> dict:
    """On the driver: cut the suite tasks from the held-out documents into the work folder (which
    the hosts pull), as the evaluate step cuts them; the examples per task."""
    from evaluation.suite import build_suite
    from tasks.documents import read_documents
    from tasks.tokenize import is_validation

    held_out = (d for d in read_documents(documents, strict=True) if is_validation(str(d["id"]), validation_fraction))
    return build_suite(held_out, Path(work_dir) / SUITE_DIR, cfg.tasks, suite)
