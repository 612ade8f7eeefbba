"""The export step: a trained model as a Hugging Face Llama folder with a model card, ready to
upload to a hub as it is.

Inputs: `model` (a training output), `tokenizer`, and optionally `evaluation` (an evaluate step
output, whose results table goes into the card). With `lora: adapter`, also the LoRA steps the
model's adapters were trained on top of (`lora_0`, ...) and the model the first of them started
from (`base`), where those are steps: `adapter_chain`. The card's data lineage is read from the
`lineage.json` files in the store: the model's own, then each input's, back to the raw sources.
The files themselves are written by `training.export`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field

from tasks.evaluate import RESULTS_FILE
from tasks.engine.lineage import lineage_tree, read_lineage
from tasks.engine.step import Step, StepContext
from tasks.engine.store import LINEAGE
from tasks.train import INIT
from tasks.tokenizer import TOKENIZER_FILE, load_tokenizer, read_tokenizer_meta
from tasks.engine.config import ConfigModel, identity_when_set
from training.config import LoraConfig

# 2: a post-trained model's generation_config.json lists its end-of-turn token beside EOS; 3: the card's data
# lineage lists an artefact's inputs once
STAGE_VERSION = 3


class ExportConfig(ConfigModel):
    """What the export holds and what its card says: every field changes the files, so all are identity."""

    name: str = Field("kiln-model", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      description="Title of the model card; a hub-style repository name.")
    license: str | None = Field(None, description="License id for the card's metadata, e.g. apache-2.0.")
    lora: Literal["merged", "adapter"] = identity_when_set(
        "merged", description="For a model trained with train.lora: `merged`, a plain Hugging Face folder; "
        "`adapter`, also the adapters as a peft adapter folder in `adapter/`, and in `base/` the model they "
        "apply to, exported (peft loads the adapter onto it; SFT then DPO, each with LoRA, make one adapter).")


def model_lineage(model_dir: Path) -> dict | None:
    """The model's lineage tree (tasks.engine.lineage) with its own step's config and code, for the model
    card; None when `model_dir` has no lineage.json (a model not made in a kiln store)."""
    if not (Path(model_dir) / LINEAGE).is_file():
        return None
    record = read_lineage(model_dir)
    return {**lineage_tree(model_dir), "config": record.get("config", {}), "code": record.get("code", {})}


def run_export(ctx: StepContext) -> dict:
    from evaluation.generate import output_chat
    from training.export import architecture, export_hf, model_card  # JAX, and only when exporting: not for plans
    from training.loop import load_model
    from training.model import param_count

    config: ExportConfig = ctx.config
    model_dir, tokenizer_dir = ctx.inputs["model"], ctx.inputs["tokenizer"]
    cfg, params = load_model(model_dir)
    meta = read_tokenizer_meta(tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)  # checks tokenizer.json against its recorded hash
    tokenizer_json = (Path(tokenizer_dir) / TOKENIZER_FILE).read_text(encoding="utf-8")
    # the template serving uses: a post-trained model's, whose turn's end joins EOS in generation_config.json,
    # or the one its tokenizer carries (a checkpoint's), as the checkpoint's own tokenizer_config.json did
    turn_end_ids, chat_template, _ = output_chat(Path(model_dir), Path(tokenizer_dir), tokenizer)
    stats = export_hf(cfg, params, tokenizer_json, meta, ctx.out, chat_template, next(iter(turn_end_ids), None))
    if config.lora == "adapter":
        stats.update(export_lora(ctx, cfg, tokenizer, tokenizer_json, meta))

    eval_table = None
    if "evaluation" in ctx.inputs:
        eval_table = json.loads((Path(ctx.inputs["evaluation"]) / RESULTS_FILE).read_text())["table"]
    lineage = model_lineage(model_dir)
    if lineage is None:
        ctx.log.warning("%s has no %s: the model card cannot trace the data", model_dir, LINEAGE)
    card = model_card(cfg, param_count(params), config.name, config.license, lineage, eval_table)
    (ctx.out / "README.md").write_text(card, encoding="utf-8")
    ctx.log.info("exported %s (%d parameters) as a Hugging Face %s", config.name, stats["param_count"],
                 architecture(cfg)[0])
    return {**stats, "files": sorted(p.name for p in ctx.out.iterdir()),
            "commit": (lineage or {}).get("code", {}).get("commit")}


def export_lora(ctx: StepContext, cfg, tokenizer, tokenizer_json: str, meta: dict) -> dict:
    """`lora: adapter`: the adapters of the model and of the LoRA steps under it as one peft folder in
    `adapter/`, and the model they apply to in `base/` (where it is a step of the store; a Hugging
    Face folder of train.init.hf is the user's already)."""
    from safetensors.numpy import load_file

    from evaluation.generate import output_chat
    from training.export import export_adapter, export_hf
    from training.loop import LORA_DIR, load_model

    dirs = [Path(ctx.inputs[f"lora_{i}"]) for i in range(sum(name.startswith("lora_") for name in ctx.inputs))]
    adapters = []
    for model_dir in [*dirs, Path(ctx.inputs["model"])]:
        lora_dir = model_dir / LORA_DIR
        if not (lora_dir / "lora.json").is_file():
            raise ValueError(f"export.lora is `adapter` but {model_dir} was not trained with train.lora "
                             f"(no {LORA_DIR}/): use lora: merged")
        adapters.append((LoraConfig.model_validate_json((lora_dir / "lora.json").read_text()),
                         load_file(str(lora_dir / "adapters.safetensors"))))
    stats = export_adapter(cfg, adapters, ctx.out / "adapter")
    if "base" in ctx.inputs:
        base_dir = Path(ctx.inputs["base"])
        base_cfg, base_params = load_model(base_dir)
        if base_cfg != cfg:
            raise ValueError(f"the adapters' base {base_dir} is a model of another config than {ctx.inputs['model']}: "
                             "its adapters cannot apply to it")
        turn_end_ids, chat_template, _ = output_chat(base_dir, Path(ctx.inputs["tokenizer"]), tokenizer)
        (ctx.out / "base").mkdir()
        export_hf(base_cfg, base_params, tokenizer_json, meta, ctx.out / "base", chat_template,
                  next(iter(turn_end_ids), None))
        ctx.log.info("wrote adapter/ (%d LoRA steps) and base/, the model it applies to", len(adapters))
    return {**stats, "adapter_steps": len(adapters), "adapter_base": "base" in ctx.inputs}


def adapter_chain(model: Step) -> tuple[list[Step], Step | None]:
    """What `lora: adapter` exports for `model`: the steps whose LoRA updates it holds, first to last
    (it last), and the step whose model those updates apply to (None where that is a Hugging Face
    folder, train.init.hf; a random initialisation is refused: no export holds it). SFT, DPO and a
    train step in mode weights add their update to the model they start from, merged, which may hold
    one of its own (SFT with LoRA, then DPO with LoRA): the walk goes back while the model started
    from was trained with LoRA. A train step in mode continue or reset carries its parent's adapters
    on, so its update is already the parent's too: the walk passes the parent without counting it."""
    chain, step = [model], model
    while (train := getattr(step.config, "train", None)) is not None and train.lora is not None:
        init = train.init if step.stage == "train" else None
        parent = step.inputs.get(INIT) if step.stage == "train" else step.inputs.get("model")
        if parent is None and step.stage == "train" and init is None:
            raise ValueError(f"export.lora: adapter: {step.name} trains its LoRA adapters on a random "
                             "initialisation (no train.init), which no export holds, so a peft adapter would load "
                             f"onto a base model that exists nowhere: start {step.name} from a model (train.init: "
                             "from or hf) or leave export.lora at merged")
        parent_train = getattr(parent.config, "train", None) if parent is not None else None
        if parent_train is None or parent_train.lora is None:
            return chain, parent
        if init is None or init.mode == "weights":
            chain.insert(0, parent)
        step = parent
    return chain, None


def export_step(config: ExportConfig, *, model: Step, tokenizer: Step, evaluation: Step | None = None) -> Step:
    inputs = {"model": model, "tokenizer": tokenizer}
    if evaluation is not None:
        inputs["evaluation"] = evaluation
    if config.lora == "adapter":
        chain, base = adapter_chain(model)
        inputs.update({f"lora_{i}": step for i, step in enumerate(chain[:-1])})
        if base is not None:
            inputs["base"] = base
    return Step(name="export", stage="export", stage_version=STAGE_VERSION, config=config, run=run_export,
                inputs=inputs)
