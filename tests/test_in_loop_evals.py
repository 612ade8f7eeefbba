"""Hooks that see the train state, and the in-loop evals built on them (training/hooks.py,
evaluation/in_loop.py): a hook reads the parameters the checkpoint of that step holds; in-loop
bits per byte and suite-task accuracy are the evaluate step's numbers on the same parameters and
examples; a mixture's train step logs one bits-per-byte curve per source."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from evaluation.in_loop import InLoopEvals, prepare_suite
from evaluation.perplexity import heldout_metrics
from evaluation.suite import SuiteConfig
from tasks.engine.step import Step, StepContext
from tasks.engine.store import Located
from tasks.evaluate import EvalConfig, evaluate_step, load_kiln_lm
from tasks.tokenize import TokenizeConfig
from tasks.train import train_step
from tests.test_eval_data import VALIDATION_FRACTION, kjv_data, run_body  # noqa: F401  (a fixture)
from tests.test_eval_trained import TinyTrain
from tests.test_mixture import T, B, parts  # noqa: F401  (a fixture)
from tests.test_training_kjv_data import WindowBatches, kjv_tokens
from tests.test_training_loop import tiny
from training.checkpoint import Checkpoints
from training.config import InLoopEvalConfig, MixtureSourceConfig, ModelConfig, ResourcesConfig, TrainConfig
from training.data import BatchLoader, TokenDataset, validation_batches
from training.hooks import Hook
from training.loop import compiled_program, flatten_params, params_sha256, train
from training.metrics import plot_curves, read_metrics
from training.sharding import make_mesh


def sha(params) -> str:
    return params_sha256(flatten_params(jax.device_get(params)))


def test_a_hook_reads_the_parameters_its_step_checkpoints_and_adds_metrics(tmp_path):
    tokens, vocab = kjv_tokens()
    model, cfg = tiny(vocab, steps=20, warmup=2, log_every=5, eval_every=10, checkpoint_every=10)
    data = WindowBatches(tokens, cfg.batch_size, model.seq_len, seed=cfg.seed)
    seen = {}

    def checksum(info):
        seen[info.step] = (sha(info.params), info.metrics is not None)
        if info.metrics is not None:
            info.metrics["hook/first_embedding"] = float(jax.numpy.sum(info.params["norm"]["weight"]))

    stats = train(model, cfg, data.batch_at, data.val_batches(16), tmp_path / "work", tmp_path / "out",
                  hooks=[Hook(checksum, every=10), Hook(lambda info: seen.setdefault(f"odd{info.step}", info.metrics),
                                                        every=7)])
    assert sorted(k for k in seen if isinstance(k, int)) == [10, 20]
    program = compiled_program(model, cfg, make_mesh(cfg.mesh))
    checkpoints = Checkpoints(tmp_path / "work" / "checkpoints")
    try:
        for step in (10, 20):
            state, meta = checkpoints.restore(step, program.abstract, program.shardings)
            assert meta["step"] == step and seen[step] == (sha(state["params"]), True)
    finally:
        checkpoints.close()
    assert seen[20][0] == stats["params_sha256"]  # the last step's parameters are the published model's
    assert seen[10][0] != seen[20][0]
    records = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in records if "hook/first_embedding" in r] == [10, 20]
    # a hook at a step with no metrics record (7, 14) gets none; at the last step (20) it gets one
    assert seen["odd7"] is None and seen["odd14"] is None and seen["odd20"]["step"] == 20


def test_in_loop_bits_per_byte_and_task_accuracy_equal_the_evaluate_steps(kjv_data, tmp_path):  # noqa: F811
    """The same parameters, the same held-out tokens and the same suite examples: the numbers the
    hook logs at the last step are the evaluate step's on the published model."""
    model = ModelConfig(vocab_size=1024, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=176, seq_len=64)
    suite = SuiteConfig(context_words=48, choice_words=12)
    evals = InLoopEvalConfig(every=20, heldout_tokens=4096, tasks=["next_passage"], limit=40)
    cfg = TrainConfig(batch_size=16, steps=40, lr=3e-3, warmup=5, checkpoint_every=40, log_every=10,
                      eval_every=20, eval_batches=2, peak_flops=1e11, evals=evals)
    train_set, val = TokenDataset(kjv_data.tokens, "train"), TokenDataset(kjv_data.tokens, "validation")
    loader = BatchLoader([(train_set, 1.0)], cfg.batch_size, model.seq_len, seed=cfg.seed)
    work, out = tmp_path / "work", tmp_path / "model"
    counts = prepare_suite(kjv_data.documents, work, evals, suite, VALIDATION_FRACTION)
    assert counts["next_passage"] > evals.limit
    hook = InLoopEvals(evals, Located(None, "", "", str(kjv_data.tokenizer)),
                       (("heldout", Located(None, "", "", str(kjv_data.tokens)), 1.0),), ("next_passage",))
    train(model, cfg, loader.batch, validation_batches(val, cfg.batch_size, model.seq_len, 2), work, out,
          hooks=[hook])

    records = read_metrics(out / "metrics.jsonl")
    logged = [r for r in records if "eval/heldout/bpb" in r]
    assert [r["step"] for r in logged] == [20, 40]
    assert all(r["eval/heldout_seconds"] > 0 and r["eval/tasks_seconds"] > 0 for r in logged)
    assert logged[0]["eval/heldout/bpb"] > logged[1]["eval/heldout/bpb"]  # it learns between the two

    model_step = Step(name="train", stage="train", stage_version=1, config=TinyTrain(model=model, train=cfg),
                      run=lambda ctx: {}, inputs={"tokens": kjv_data.tokens_step})
    config = EvalConfig(tasks=["next_passage"], limit=evals.limit, heldout_tokens=evals.heldout_tokens,
                        validation_fraction=VALIDATION_FRACTION, suite=suite, batch_size=evals.batch_size)
    step = evaluate_step(config, model=model_step, tokenizer=kjv_data.tokenizer_step, tokens=kjv_data.tokens_step,
                         documents=kjv_data.documents_step)
    stats = run_body(step, tmp_path / "evaluate", {"model": out, "tokenizer": kjv_data.tokenizer,
                                                    "tokens": kjv_data.tokens, "documents": kjv_data.documents})
    last = logged[-1]
    assert last["eval/next_passage/acc"] == stats["next_passage_acc"]
    assert last["eval/next_passage/acc_norm"] == stats["next_passage_acc_norm"]
    assert last["eval/heldout/bpb"] == pytest.approx(stats["bits_per_byte"], rel=1e-6)
    assert last["eval/heldout/loss"] == pytest.approx(stats["heldout_loss"], rel=1e-6)
    assert plot_curves(records).startswith(b"\x89PNG")


@pytest.mark.ray  # its training starts a local Ray: tests/conftest.py ray_lock
def test_a_mixture_train_step_logs_one_bits_per_byte_curve_per_source(parts, tmp_path):  # noqa: F811
    """Through the train step body and a Ray host: the evals travel as a hook factory, open the
    tokenizer and each source's held-out tokens on the host, and leave the version alone."""
    model = ModelConfig(vocab_size=50257, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, seq_len=T)
    evals = InLoopEvalConfig(every=3, heldout_tokens=1024)
    train = TrainConfig(batch_size=B, steps=6, warmup=1, log_every=3, eval_every=3, checkpoint_every=6,
                        eval_batches=3, peak_flops=1e11, evals=evals)
    mixture = {"big": MixtureSourceConfig(weight=0.7), "small": MixtureSourceConfig(weight=0.3),
               "heldout": MixtureSourceConfig(weight=0)}
    tokens = {name: Step(name=f"tokenize/{name}", stage="tokenize", stage_version=1,
                         config=TokenizeConfig(validation_fraction=0.2), run=None) for name in mixture}
    tokenizer = Step(name="tokenizer", stage="tokenizer", stage_version=1, config=TokenizeConfig(), run=None)
    step = train_step(model, train, ResourcesConfig(hosts=1, cpus_per_host=1), tokens=tokens, mixture=mixture,
                      tokenizer=tokenizer)
    plain = train_step(model, train.model_copy(update={"evals": None}), ResourcesConfig(), tokens=tokens,
                       mixture=mixture)
    assert step.version == plain.version and "evals/tokenizer" in step.inputs
    with pytest.raises(ValueError, match="needs the tokenizer"):
        train_step(model, train, ResourcesConfig(), tokens=tokens, mixture=mixture)

    tokenizer_dir = parts["big"].parent / "tok"
    (tmp_path / "out").mkdir()
    ctx = StepContext(step=step, out=tmp_path / "out",
                      inputs={**{f"tokens/{n}": parts[n] for n in mixture}, "evals/tokenizer": tokenizer_dir},
                      input_stats={}, work_dir=tmp_path / "work", log=logging.getLogger("test"))
    step.run(ctx)
    records = read_metrics(tmp_path / "out" / "metrics.jsonl")
    for source in mixture:
        assert [r["step"] for r in records if f"eval/{source}/bpb" in r] == [3, 6], source
    # the last point is the published model's bits per byte on that source's held-out tokens
    kiln_lm = load_kiln_lm(tmp_path / "out", tokenizer_dir)
    for source in mixture:
        m = heldout_metrics(model, kiln_lm.params, TokenDataset(parts[source], "validation"), kiln_lm.tok,
                            evals.batch_size, evals.heldout_tokens)
        assert records[-1][f"eval/{source}/bpb"] == pytest.approx(m["bits_per_byte"], rel=1e-6), source
    assert len({records[-1][f"eval/{s}/bpb"] for s in mixture}) == 3
    assert np.isfinite([records[-1][f"eval/{s}/loss"] for s in mixture]).all()
