"""The soup step: the mean of several trained models' parameters, a "model soup" (Wortsman et al.,
2022). OLMo 2's final models are soups of anneals, each trained from one stable run on another
data order; averaging a run's kept steps (LAWA, Kaddour 2022) is another. The output is a model
folder as a train step's (`model.json`, `params.safetensors`), so evaluate, export, SFT, DPO,
`kiln generate` and `kiln serve-model` read it as any trained model. A soup has no train state:
no phase continues from it.

Inputs `part/0`, `part/1`, ...: train outputs, each at its trained model or a step it kept.
Parameters are read one tensor at a time across the parts and averaged in float64, so memory
holds the soup (float32) and one tensor of each part, never two models.

Stats: `param_count`, `parts` (each part's step, version and kept step), and `spread`: the parts'
root-mean-square distance from their mean over the mean's norm, so a soup of models that share
little (0.5 and up) is seen before its scores are.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
from pydantic import Field

from tasks.engine.config import ConfigModel, Count
from tasks.engine.step import Step, StepContext
from tasks.evaluate import model_at

STAGE_VERSION = 1


class SoupConfig(ConfigModel):
    """Which model of each part: its trained model (None) or a step it kept, in the order of the
    inputs `part/<i>` (whose versions enter this one's)."""

    steps: tuple[Count | None, ...] = Field(description="Per part: a step it kept, or None for its trained model.")


def run_soup(ctx: StepContext) -> dict:
    from safetensors import safe_open  # the averaging is numpy's, one tensor at a time

    from training.config import ModelConfig
    from training.loop import save_model
    from training.model import param_count

    steps = ctx.config.steps
    names = [f"part/{i}" for i in range(len(steps))]
    folders = [model_at(ctx.inputs[name], step) for name, step in zip(names, steps)]
    models = [ModelConfig.model_validate_json((folder / "model.json").read_text()) for folder in folders]
    for name, folder, model in zip(names[1:], folders[1:], models[1:]):
        if model != models[0]:
            differ = sorted(k for k, v in model.model_dump().items() if v != getattr(models[0], k))
            raise ValueError(f"a soup averages models of one architecture: {folder} differs from {folders[0]} in "
                             f"{', '.join(differ)}; average phases of one model")
    soup, moved, norm = {}, 0.0, 0.0
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(safe_open(str(f / "params.safetensors"), framework="numpy")) for f in folders]
        keys = sorted(files[0].keys())
        for folder, f in zip(folders[1:], files[1:]):
            if sorted(f.keys()) != keys:
                raise ValueError(f"{folder} holds other parameters than {folders[0]} (LoRA adapters merged into "
                                 "one and not the other?); a soup averages models of one architecture")
        for key in keys:
            tensors = [f.get_tensor(key).astype(np.float64) for f in files]
            mean = sum(tensors) / len(tensors)
            moved += sum(float(np.sum((t - mean) ** 2)) for t in tensors) / len(tensors)
            norm += float(np.sum(mean ** 2))
            soup[key] = mean.astype(np.float32)
    save_model(ctx.out, models[0], soup)
    spread = math.sqrt(moved) / math.sqrt(norm) if norm else 0.0
    count = param_count(soup)
    parts = [{"step": ctx.step.inputs[name].name, "version": ctx.step.inputs[name].version, "kept_step": step}
             for name, step in zip(names, steps)]
    ctx.log.info("averaged %d models (%s): %d parameters, the parts %.2f%% of the soup's norm from it",
                 len(parts), ", ".join(p["step"] + (f"@{p['kept_step']}" if p["kept_step"] else "") for p in parts),
                 count, 100 * spread)
    return {"param_count": count, "parts": parts, "spread": round(spread, 6)}


def soup_step(parts: list[tuple[Step, int | None]]) -> Step:
    """The soup of `parts`: each a train step (or another step whose output is a model folder)
    with the step it kept, None for its trained model."""
    if len(parts) < 2:
        raise ValueError(f"a soup averages two or more models, got {len(parts)}")
    return Step(name="soup", stage="soup", stage_version=STAGE_VERSION,
                config=SoupConfig(steps=tuple(step for _, step in parts)), run=run_soup,
                inputs={f"part/{i}": model for i, (model, _) in enumerate(parts)})
