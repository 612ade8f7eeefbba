"""SFT and DPO on the shared training loop: they start from the given parameters, learn what
they should, and a run killed with SIGKILL after a checkpoint resumes to the same bits as one
that was never interrupted. Real text (KJV), GPT-2's tokenizer with the chat tokens; token ids
are compacted to those used so the model stays small."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.slow  # minutes of training; run with `uv run --dev pytest -m slow`


from tasks.chat_data import ChatDataConfig, heldout_records
from tasks.dpo import encode_pairs
from tests.test_training_kjv_data import kjv_text
from tests.test_training_loop import written_checkpoints
from training.config import ModelConfig, TrainConfig
from training.hooks import Hook
from training.loop import train
from training.model import init_params
from training.chat_template import ChatTemplate
from training.posttrain import (DPOObjective, RowBatches, SFTObjective, fixed_batches, pack, pad_pairs,
                                reference_logprobs)

REPO = Path(__file__).resolve().parent.parent
SEQ = 64


@functools.cache
def data() -> dict:
    """Packed SFT rows and DPO pair rows from KJV text, ids compacted; and the vocabulary size."""
    from tests.test_posttrain import tokenizer

    words = kjv_text(200_000).split()
    docs = [{"id": f"kjv/{i}", "text": " ".join(words[i:i + 300])} for i in range(0, len(words), 300)]
    cfg = ChatDataConfig(validation_fraction=1.0, prompt_words=16, answer_words=8, instruction="Continue:")
    convs, pairs = heldout_records(iter(docs), cfg)
    template = ChatTemplate(tokenizer())
    eos = tokenizer().token_to_id("<|endoftext|>")
    sft, _ = pack([template.encode(c["messages"]) for c in convs[:400]], SEQ, eos)
    dpo, _ = pad_pairs(encode_pairs(pairs[:200], template), SEQ, eos)
    used, _ = np.unique(np.concatenate([sft["inputs"].ravel(), sft["targets"].ravel(), dpo["inputs"].ravel(),
                                        dpo["targets"].ravel()]), return_inverse=True)
    remap = np.zeros(used.max() + 1, np.int32)
    remap[used] = np.arange(len(used))
    for rows in (sft, dpo):
        rows["inputs"], rows["targets"] = remap[rows["inputs"]], remap[rows["targets"]]
    return {"sft": sft, "dpo": dpo, "vocab": len(used)}


def setup(kind: str):
    """(model config, train config, objective, start params, batch_at, val batches) for `kind`."""
    d = data()
    model = ModelConfig(vocab_size=d["vocab"], d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192, seq_len=SEQ)
    cfg = TrainConfig(batch_size=8, steps=30, lr=3e-3, warmup=3, weight_decay=0.0, log_every=5, eval_every=10,
                      checkpoint_every=10, eval_batches=2, peak_flops=1e11)
    start = init_params(model, jax.random.PRNGKey(7))  # stands in for a pretrained model
    rows = {k: v for k, v in d[kind].items()}
    if kind == "dpo":
        rows["ref_logp"] = reference_logprobs(start, rows, model, cfg.batch_size)
    train_rows = {k: v[16:] for k, v in rows.items()}
    held = {k: v[:16] for k, v in rows.items()}
    objective = SFTObjective() if kind == "sft" else DPOObjective(beta=0.5)
    return model, cfg, objective, start, RowBatches(train_rows, cfg.batch_size, cfg.seed).batch_at, \
        fixed_batches(held, cfg.batch_size, cfg.eval_batches)


def run(tmp: Path, kind: str, on_metrics=None, hooks=()) -> dict:
    model, cfg, objective, start, batch_at, val = setup(kind)
    return train(model, cfg, batch_at, val, tmp / "work", tmp / "out", on_metrics, objective=objective,
                 init_params=start, hooks=hooks)


@pytest.mark.ci  # 9-14 s alone: CI runs it after the fast suite (the SIGKILL-and-resume pair below stays -m slow)
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_learns_from_the_given_start(tmp_path, kind):
    model, cfg, objective, start, batch_at, val = setup(kind)
    loss = jax.jit(objective.loss, static_argnums=2)
    first_loss = float(loss(start, batch_at(0), model)[0])
    start_val_loss = float(np.mean([loss(start, b, model)[0] for b in val]))
    after_first = {}

    def keep_first(info):
        if info.step == 1:
            after_first[1] = jax.device_get(info.params)

    records = []
    stats = run(tmp_path, kind, records.append, hooks=[Hook(keep_first, every=1)])
    # The loop starts from `start`, not from a fresh initialisation: Adam's first update moves each
    # parameter by at most the first step's learning rate (lr / warmup; no weight decay), where
    # another initialisation differs by the init's scale.
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(after_first[1]),
                                                            jax.tree_util.tree_leaves(start), strict=True))
    assert 0 < moved <= 1.01 * cfg.lr / cfg.warmup, moved
    if kind == "dpo":
        assert abs(first_loss - np.log(2)) < 1e-5  # the policy is the reference at step 0
        assert records[-1]["accuracy"] > 0.5 and records[-1]["margin"] > records[0]["margin"]
    assert stats["final_val_loss"] < start_val_loss  # the held-out rows too, not only the trained ones
    assert records[-1]["loss"] < first_loss
    assert (tmp_path / "out" / "params.safetensors").is_file() and (tmp_path / "out" / "model.json").is_file()


CHILD = """
import json, sys
from pathlib import Path
from tests.test_posttrain_steps import run

def on_metrics(record):
    print(json.dumps({"step": record["step"]}), flush=True)
    if sys.argv[3] == "pause" and record["step"] == 15:
        sys.stdin.readline()

stats = run(Path(sys.argv[1]), sys.argv[2], on_metrics=on_metrics)
print(json.dumps({"stats": stats}), flush=True)
"""


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_sigkill_then_rerun_gives_the_uninterrupted_bits(tmp_path, kind):
    cmd = [sys.executable, "-c", CHILD]
    straight = subprocess.run(cmd + [str(tmp_path / "straight"), kind, "straight"], cwd=REPO, capture_output=True,
                              text=True, timeout=900)
    assert straight.returncode == 0, straight.stderr[-3000:]
    reference = json.loads(straight.stdout.splitlines()[-1])["stats"]

    killed = tmp_path / "killed"
    child = subprocess.Popen(cmd + [str(killed), kind, "pause"], cwd=REPO, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        for line in child.stdout:
            if line.startswith("{") and json.loads(line).get("step") == 15:
                break
        assert written_checkpoints(killed / "work" / "checkpoints", "10") == ["10"]  # written in the background
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    rerun = subprocess.run(cmd + [str(killed), kind, "straight"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    lines = [json.loads(x) for x in rerun.stdout.splitlines() if x.startswith("{")]
    stats = lines[-1]["stats"]
    assert [x["step"] for x in lines[:-1]] == [15, 20, 25, 30]
    assert stats["resumed_from_step"] == 10
    assert stats["params_sha256"] == reference["params_sha256"]
    assert stats["final_loss"] == reference["final_loss"]
