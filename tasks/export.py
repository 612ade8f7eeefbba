"""The export step: a trained model as a Hugging Face Llama folder with a model card, ready to
upload to a hub as it is.

Inputs: `model` (a training output), `tokenizer`, and optionally `evaluation` (an evaluate step
output, whose results table goes into the card). The card's data lineage is read from the
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
from tasks.tokenizer import TOKENIZER_FILE, load_tokenizer, read_tokenizer_meta
from tasks.engine.config import ConfigModel, identity_when_set
from training.config import LoraConfig

# 2: a post-trained model's generation_config.json lists its end-of-turn token beside EOS
STAGE_VERSION = 2


class ExportConfig(ConfigModel):
    """What the export holds and what its card says: every field changes the files, so all are identity."""

    name: str = Field("kiln-model", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      description="Title of the model card; a hub-style repository name.")
    license: str | None = Field(None, description="License id for the card's metadata, e.g. apache-2.0.")
    lora: Literal["merged", "adapter"] = identity_when_set(
        "merged", description="For a model trained with train.lora: `merged`, a plain Hugging Face folder; "
        "`adapter`, also the adapters as a peft adapter folder in `adapter/` (peft loads it onto the base "
        "model's export).")


def model_lineage(model_dir: Path) -> dict | None:
    """The model's lineage tree (tasks.engine.lineage) with its own step's config and code, for the model
    card; None when `model_dir` has no lineage.json (a model not made in a kiln store)."""
    if not (Path(model_dir) / LINEAGE).is_file():
        return None
    record = read_lineage(model_dir)
    return {**lineage_tree(model_dir), "config": record.get("config", {}), "code": record.get("code", {})}


def run_export(ctx: StepContext) -> dict:
    from evaluation.generate import output_chat
    from training.export import export_hf, model_card  # JAX, and only when exporting: not for plans
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
        from safetensors.numpy import load_file

        from training.export import export_adapter
        from training.loop import LORA_DIR

        lora_dir = Path(model_dir) / LORA_DIR
        if not (lora_dir / "lora.json").is_file():
            raise ValueError(f"export.lora is `adapter` but {model_dir} was not trained with train.lora (no {LORA_DIR}/): "
                             "use lora: merged")
        lora = LoraConfig.model_validate_json((lora_dir / "lora.json").read_text())
        stats.update(export_adapter(cfg, lora, load_file(str(lora_dir / "adapters.safetensors")), ctx.out / "adapter"))

    eval_table = None
    if "evaluation" in ctx.inputs:
        eval_table = json.loads((Path(ctx.inputs["evaluation"]) / RESULTS_FILE).read_text())["table"]
    lineage = model_lineage(model_dir)
    if lineage is None:
        ctx.log.warning("%s has no %s: the model card cannot trace the data", model_dir, LINEAGE)
    card = model_card(cfg, param_count(params), config.name, config.license, lineage, eval_table)
    (ctx.out / "README.md").write_text(card, encoding="utf-8")
    ctx.log.info("exported %s (%d parameters) in the Hugging Face Llama layout", config.name, stats["param_count"])
    return {**stats, "files": sorted(p.name for p in ctx.out.iterdir()),
            "commit": (lineage or {}).get("code", {}).get("commit")}


def export_step(config: ExportConfig, *, model: Step, tokenizer: Step, evaluation: Step | None = None) -> Step:
    inputs = {"model": model, "tokenizer": tokenizer}
    if evaluation is not None:
        inputs["evaluation"] = evaluation
    return Step(name="export", stage="export", stage_version=STAGE_VERSION, config=config, run=run_export,
                inputs=inputs)
