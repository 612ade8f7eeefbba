"""The soup step: the mean of several trained models' parameters, a "model soup" (Wortsman et al.,
2022). OLMo 2's final models are soups of anneals, each trained from one stable run on another
data order; averaging a run's kept steps (LAWA, Kaddour 2022) is another. The output is a model
folder as a train step's (`model.json`, `params.safetensors`), so evaluate, export, SFT, DPO,
`kiln generate` and `kiln serve-model` read it as any trained model. A soup has no train state:
no phase continues from it.

Inputs `part/0`, `part/1`, ...: train outputs, each at its trained model or a step it kept.
Parameters are read one tensor at a time across the parts and averaged in float64, so memory
holds the soup (float32) and one tensor of each part, never two models.

Stats: `param_count`, `parts` (each part's step, version and kept step), `kept_parts` (how many
it averaged), and `spread`: the averaged parts' root-mean-square distance from their mean over
the mean's norm, so a soup of models that share little (0.5 and up) is seen before its scores are.

A greedy soup (`greedy`, Wortsman et al.'s recipe) ranks the parts by their loss on held-out
tokens (inputs `tokens` and `tokenizer`: `select_tokens` of the validation split from
`select_from` on, which the pipeline puts after those the evaluate step scores), starts from the
best, and adds each next one only if the soup's loss does not rise; the output is the mean of
those it kept. It holds every part in memory while it chooses. Stats `greedy`: each part's loss
alone, and the soup's when it was tried, in the order tried, and whether it was kept.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
from pydantic import Field, model_validator

from tasks.engine.config import ConfigModel, Count, identity_when_set, setting
from tasks.engine.step import Step, StepContext
from tasks.evaluate import model_at

STAGE_VERSION = 1


class SoupConfig(ConfigModel):
    """Which model of each part: its trained model (None) or a step it kept, in the order of the
    inputs `part/<i>` (whose versions enter this one's)."""

    steps: tuple[Count | None, ...] = Field(description="Per part: a step it kept, or None for its trained model.")
    greedy: bool = identity_when_set(False, description="Keep only the parts that lower the soup's held-out loss, "
                                     "best part first (Wortsman et al.'s greedy soup).")
    select_from: int = identity_when_set(0, ge=0, description="Greedy: the first held-out token it scores.")
    select_tokens: Count | None = identity_when_set(None, description="Greedy: how many held-out tokens it scores.")
    batch_size: Count = setting(16, description="Greedy: windows scored at once.")

    @model_validator(mode="after")
    def _check_greedy(self) -> "SoupConfig":
        if self.greedy and self.select_tokens is None:
            raise ValueError("a greedy soup scores `select_tokens` held-out tokens: give them")
        return self


def run_soup(ctx: StepContext) -> dict:
    from training.config import ModelConfig
    from training.loop import save_model
    from training.model import param_count

    steps = ctx.config.steps
    names = [f"part/{i}" for i in range(len(steps))]
    folders = [model_at(ctx.inputs[name], step) for name, step in zip(names, steps)]
    models = [ModelConfig.model_validate_json((folder / "model.json").read_text()) for folder in folders]
    for name, folder, model in zip(names[1:], folders[1:], models[1:]):
        if model != models[0]:
            differ = sorted(model.differences(models[0]))
            raise ValueError(f"a soup averages models of one architecture: {folder} differs from {folders[0]} in "
                             f"{', '.join(differ)}; average phases of one model")
    chosen, trace = list(range(len(folders))), None
    if ctx.config.greedy:
        chosen, trace = greedy_choice(ctx, models[0], folders)
    soup, spread = mean_of([folders[i] for i in chosen])
    save_model(ctx.out, models[0], soup)
    count = param_count(soup)
    parts = [{"step": ctx.step.inputs[name].name, "version": ctx.step.inputs[name].version, "kept_step": step}
             for name, step in zip(names, steps)]
    ctx.log.info("averaged %d models (%s): %d parameters, the parts %.2f%% of the soup's norm from it",
                 len(chosen), ", ".join(p["step"] + (f"@{p['kept_step']}" if p["kept_step"] else "")
                                        for p in (parts[i] for i in chosen)), count, 100 * spread)
    return {"param_count": count, "parts": parts, "kept_parts": len(chosen), "spread": round(spread, 6),
            **({"greedy": trace} if trace is not None else {})}


def mean_of(folders: list) -> tuple[dict, float]:
    """The float32 mean of the models in `folders` (float64 sums, one tensor at a time) and their
    spread (RMS distance from the mean over its norm)."""
    from safetensors import safe_open  # the averaging is numpy's, one tensor at a time

    soup, moved, norm = {}, 0.0, 0.0
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(safe_open(str(f / "params.safetensors"), framework="numpy")) for f in folders]
        keys = same_parameters(folders, [sorted(f.keys()) for f in files])
        for key in keys:
            tensors = [f.get_tensor(key).astype(np.float64) for f in files]
            mean = sum(tensors) / len(tensors)
            moved += sum(float(np.sum((t - mean) ** 2)) for t in tensors) / len(tensors)
            norm += float(np.sum(mean ** 2))
            soup[key] = mean.astype(np.float32)
    return soup, math.sqrt(moved) / math.sqrt(norm) if norm else 0.0


def same_parameters(folders: list, names: list[list[str]]) -> list[str]:
    """The parameter names (`names`, each folder's sorted) the parts share, checked before any is
    averaged or scored."""
    for folder, theirs in zip(folders[1:], names[1:]):
        if theirs != names[0]:
            raise ValueError(f"{folder} holds other parameters than {folders[0]} (LoRA adapters merged into "
                             "one and not the other?); a soup averages models of one architecture")
    return names[0]


def greedy_choice(ctx: StepContext, model, folders: list) -> tuple[list[int], list[dict]]:
    """Wortsman et al.'s greedy soup: the parts (indexes into `folders`) ranked by held-out loss
    alone, the best kept, each next kept if the mean with it scores no worse; and the trace."""
    from safetensors.numpy import load_file

    from evaluation.perplexity import heldout_metrics
    from evaluation.scoring import make_token_scorer
    from tasks.tokenizer import load_tokenizer
    from training.data import TokenDataset
    from training.loop import placed, unflatten

    cfg = ctx.config
    parts = [load_file(str(folder / "params.safetensors")) for folder in folders]
    same_parameters(folders, [sorted(part) for part in parts])
    dataset = TokenDataset(ctx.inputs["tokens"], "validation")
    end = cfg.select_from + cfg.select_tokens
    if dataset.n_tokens < end:
        raise ValueError(f"a greedy soup scores held-out tokens {cfg.select_from} to {end} (after those the "
                         f"evaluate step scores), but {ctx.inputs['tokens']} holds out "
                         f"{dataset.n_tokens}: lower eval.heldout_tokens or raise tokenize.validation_fraction")
    tokenizer, scorer = load_tokenizer(ctx.inputs["tokenizer"]), make_token_scorer(model)

    def loss(indexes: list[int]) -> float:
        mean = {k: (sum(parts[i][k].astype(np.float64) for i in indexes) / len(indexes)).astype(np.float32)
                for k in parts[indexes[0]]}
        return heldout_metrics(model, placed(unflatten(mean)), dataset, tokenizer, cfg.batch_size, cfg.select_tokens,
                               score=scorer, first_token=cfg.select_from)["loss"]

    alone = [loss([i]) for i in range(len(parts))]
    order = sorted(range(len(parts)), key=lambda i: alone[i])
    chosen, best = [order[0]], alone[order[0]]
    trace = [{"part": order[0], "loss": round(best, 6), "soup_loss": round(best, 6), "kept": True}]
    for i in order[1:]:
        tried = loss([*chosen, i])
        kept = tried <= best
        if kept:
            chosen, best = [*chosen, i], tried
        trace.append({"part": i, "loss": round(alone[i], 6), "soup_loss": round(tried, 6), "kept": kept})
        ctx.log.info("greedy soup: part %d alone %.4f, the soup with it %.4f: %s", i, alone[i], tried,
                     "kept" if kept else "left out")
    return sorted(chosen), trace


@dataclass(frozen=True)
class GreedySelection:
    """Where a greedy soup scores its candidates: `tokens` held-out tokens of the tokenize step
    `tokenized` (made with `tokenizer`) from `first_token` on."""

    tokenized: Step
    tokenizer: Step
    first_token: int
    tokens: int
    batch_size: int = 16


def soup_step(parts: list[tuple[Step, int | None]], greedy: GreedySelection | None = None) -> Step:
    """The soup of `parts`: each a train step (or another step whose output is a model folder)
    with the step it kept, None for its trained model; with `greedy`, a greedy soup chosen on
    those held-out tokens."""
    if len(parts) < 2:
        raise ValueError(f"a soup averages two or more models, got {len(parts)}")
    config = SoupConfig(steps=tuple(step for _, step in parts))
    inputs = {f"part/{i}": model for i, (model, _) in enumerate(parts)}
    if greedy is not None:
        config = config.model_copy(update={"greedy": True, "select_from": greedy.first_token,
                                           "select_tokens": greedy.tokens, "batch_size": greedy.batch_size})
        inputs = {**inputs, "tokens": greedy.tokenized, "tokenizer": greedy.tokenizer}
    return Step(name="soup", stage="soup", stage_version=STAGE_VERSION, config=config, run=run_soup, inputs=inputs)
