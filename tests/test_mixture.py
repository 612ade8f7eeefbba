"""Mixtures in the loader (training/data.py open_mixture), in what the Ray hosts open
(training/launch.py token_data) and in the train step, on real tokenize outputs: three parts of
the KJV, GPT-2 tokens. Every row a batch holds is traced back to its source by its content (each
window of each split, looked up by its bytes), so what is counted is what training would see,
not what the config asked for."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import logging

import numpy as np
import pytest

from tasks.documents import ShardWriter
from tasks.engine.step import Step, StepContext
from tasks.tokenize import TokenizeConfig, tokenize_step
from tasks.tokenizer import TokenizerConfig, tokenizer_step
from tasks.train import train_step
from tests.test_loader import kjv_paragraphs, run_body
from training.config import MixtureSourceConfig, ModelConfig, ResourcesConfig, TrainConfig
from training.data import MixtureInput, TokenDataset, open_mixture
from training.launch import TokenSource, token_data

T, B = 64, 8


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> dict[str, Path]:
    """big (900 verses), small (150) and heldout (250), tokenized as three outputs."""
    root = tmp_path_factory.mktemp("mixture")
    tok = tokenizer_step(TokenizerConfig())
    run_body(tok, root / "tok", {})
    verses = kjv_paragraphs()
    out = {}
    for name, texts in {"big": verses[:900], "small": verses[900:1050], "heldout": verses[1050:1300]}.items():
        with ShardWriter(root / f"docs-{name}", docs_per_shard=100) as w:
            for i, text in enumerate(texts):
                w.write({"id": f"{name}/{i}", "text": text, "source": name, "metadata": {}})
        docs = Step(name=f"docs-{name}", stage="docs", stage_version=1, config=TokenizeConfig(), run=None)
        step = tokenize_step(TokenizeConfig(validation_fraction=0.2), tokenizer=tok, documents=docs)
        run_body(step, root / name, {"tokenizer": root / "tok", "documents": root / f"docs-{name}"})
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def origin(parts) -> dict[bytes, tuple[str, str, int]]:
    """The bytes of every window of every split -> (source, split, window index)."""
    where: dict[bytes, tuple[str, str, int]] = {}
    for name, folder in parts.items():
        for split in ("train", "validation"):
            ds = TokenDataset(folder, split)
            for i in range(ds.windows(T)):
                key = ds.window(i, T).astype(np.int32).tobytes()
                assert key not in where, f"window {i} of {name}/{split} also appears in {where[key]}"
                where[key] = (name, split, i)
    return where


def rows(batches, origin) -> list[tuple[str, str, int]]:
    return [origin[row.tobytes()] for batch in batches for row in batch]


def mixture(parts, weights: dict[str, float], caps: dict[str, float] | None = None, steps: int = 300,
            eval_batches: int = 3):
    sources = [MixtureInput(name, parts[name], w, (caps or {}).get(name)) for name, w in weights.items()]
    return open_mixture(sources, B, T, seed=0, steps=steps, eval_batches=eval_batches)


def test_weights_0_7_and_0_3_draw_those_shares_of_the_tokens(parts, origin):
    steps = 300  # 2400 rows: two whole blocks of 1024 and part of a third
    data = mixture(parts, {"big": 0.7, "small": 0.3}, steps=steps)
    seen = Counter(source for source, split, _ in rows((data.batch_at(s) for s in range(steps)), origin))
    assert seen["big"] + seen["small"] == steps * B
    share = seen["big"] / (steps * B)
    assert abs(share - 0.7) < 0.02, share
    # what the train step records is what the batches held
    assert {n: d["tokens"] for n, d in data.drawn.items()} == {"big": seen["big"] * T, "small": seen["small"] * T}
    assert data.drawn["small"]["epochs"] > 1.5  # the small source is repeated: no cap asked for


def test_a_repetition_cap_stops_a_small_source_and_the_others_fill_the_run(parts, origin):
    steps = 400  # 3200 rows: at weight 0.5 the small source would be drawn 1600 times, ~4 epochs
    small_windows = TokenDataset(parts["small"]).windows(T)
    assert 0.5 * steps * B > 3 * small_windows
    data = mixture(parts, {"big": 0.5, "small": 0.5}, caps={"small": 2}, steps=steps)
    drawn = rows((data.batch_at(s) for s in range(steps)), origin)
    small = Counter(i for source, split, i in drawn if source == "small")
    assert max(small.values()) <= 2, "a window of the capped source was trained on more than max_epochs times"
    n_small = sum(small.values())
    assert 0.95 * 2 * small_windows <= n_small <= 2 * small_windows  # its share lowered to the cap
    assert len(drawn) == steps * B  # and the big source filled the rest of the run
    assert data.drawn["small"]["tokens"] == n_small * T and data.drawn["small"]["epochs"] <= 2
    assert data.drawn["big"]["share"] == pytest.approx(1 - n_small / (steps * B), abs=1e-6)
    # A batch past the run the mixture was planned for would repeat it past the cap: refused.
    with pytest.raises(ValueError, match="past its max_epochs"):
        for s in range(steps, 4 * steps):
            data.batch_at(s)
    # Every source capped below the run's length: an error before training starts, naming them.
    with pytest.raises(ValueError, match=r"more than every source's max_epochs allows.*small"):
        mixture(parts, {"big": 0.5, "small": 0.5}, caps={"big": 1, "small": 1}, steps=steps * 4)


def test_weight_zero_is_validation_only(parts, origin):
    steps = 100
    data = mixture(parts, {"big": 0.7, "small": 0.3, "heldout": 0.0}, steps=steps, eval_batches=3)
    trained = {source for source, _, _ in rows((data.batch_at(s) for s in range(steps)), origin)}
    assert trained == {"big", "small"}
    validated = rows(data.val_batches, origin)
    assert {source for source, _, _ in validated} == {"big", "small", "heldout"}
    assert {split for _, split, _ in validated} == {"validation"}
    assert data.drawn["heldout"] == {"weight": 0.0, "tokens": 0, "share": 0.0, "epochs": 0.0, "validation_batches": 1}
    # Never trained on, all of it is held out: past its validation split, its train split validates too.
    per_source = TokenDataset(parts["heldout"], "validation").windows(T) // B + 1
    more = rows(mixture(parts, {"big": 0.7, "small": 0.3, "heldout": 0.0}, steps=steps,
                        eval_batches=3 * per_source).val_batches, origin)
    assert {split for source, split, _ in more if source == "heldout"} == {"validation", "train"}
    assert {split for source, split, _ in more if source != "heldout"} == {"validation"}
    with pytest.raises(ValueError, match="eval_batches=2 is fewer than the mixture's 3 sources"):
        mixture(parts, {"big": 0.7, "small": 0.3, "heldout": 0.0}, eval_batches=2)


def test_a_source_too_small_to_validate_on(parts, tmp_path):
    """Two verses, none held out: trained on, it is left out of validation; at weight 0 (where
    its train split would validate too) it is an error naming it."""
    with ShardWriter(tmp_path / "docs", docs_per_shard=10) as w:
        for i, text in enumerate(kjv_paragraphs()[2000:2002]):
            w.write({"id": f"tiny/{i}", "text": text, "source": "tiny", "metadata": {}})
    docs = Step(name="docs-tiny", stage="docs", stage_version=1, config=TokenizeConfig(), run=None)
    step = tokenize_step(TokenizeConfig(validation_fraction=0.0), tokenizer=tokenizer_step(TokenizerConfig()),
                         documents=docs)
    run_body(step, tmp_path / "tiny", {"tokenizer": parts["big"].parent / "tok", "documents": tmp_path / "docs"})
    parts = {**parts, "tiny": tmp_path / "tiny"}
    data = mixture(parts, {"big": 0.9, "tiny": 0.1}, steps=20, eval_batches=2)
    assert data.drawn["tiny"]["validation_batches"] == 0 and data.drawn["tiny"]["tokens"] > 0
    assert data.drawn["big"]["validation_batches"] == len(data.val_batches) == 2
    with pytest.raises(ValueError, match=r"source tiny \(weight 0: validation only\) holds fewer than one batch"):
        mixture(parts, {"big": 1.0, "tiny": 0.0}, steps=20, eval_batches=2)


def test_token_data_hands_the_hosts_the_same_mixture(parts):
    """What a Ray host opens (training/launch.py token_data) is the loader's mixture, by source."""
    train = TrainConfig(batch_size=B, steps=50, warmup=1, eval_batches=3)
    model = ModelConfig(seq_len=T)
    sources = [TokenSource("big", parts["big"], 0.7), TokenSource("small", parts["small"], 0.3, 1.0),
               TokenSource("heldout", parts["heldout"], 0.0)]
    data, drawn = token_data(sources, model, train)
    batch_at, val = data()
    direct = open_mixture([MixtureInput(*s) for s in sources], B, T, seed=0, steps=50, eval_batches=3)
    assert drawn == direct.drawn and drawn["heldout"]["tokens"] == 0
    assert all(np.array_equal(batch_at(k), direct.batch_at(k)) for k in (0, 17, 49))
    assert all(np.array_equal(a, b) for a, b in zip(val, direct.val_batches, strict=True))


@pytest.mark.ray  # its training (or data workers) starts a local Ray: tests/conftest.py ray_lock
@pytest.mark.slow  # a local Ray and a compile: 16 s alone, ~40 s on the shared 2 cores
@pytest.mark.ci  # CI runs it after the fast suite
def test_the_train_step_mixes_by_weight_and_records_what_it_drew(parts, tmp_path):
    """The train step on three tokenize outputs, through a local Ray host: its version holds the
    weights and caps, and its stats the tokens drawn from each source."""
    model = ModelConfig(vocab_size=50257, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, seq_len=T)
    train = TrainConfig(batch_size=B, steps=6, warmup=1, log_every=3, eval_every=3, checkpoint_every=6,
                        eval_batches=3)
    mixture = {"big": MixtureSourceConfig(weight=0.7), "small": MixtureSourceConfig(weight=0.3, max_epochs=1),
               "heldout": MixtureSourceConfig(weight=0)}
    tokens = {name: Step(name=f"tokenize/{name}", stage="tokenize", stage_version=1,
                         config=TokenizeConfig(validation_fraction=0.2), run=None) for name in mixture}
    step = train_step(model, train, ResourcesConfig(hosts=1, cpus_per_host=1), tokens=tokens, mixture=mixture)
    reweighted = {**mixture, "small": MixtureSourceConfig(weight=0.4, max_epochs=1)}
    assert train_step(model, train, ResourcesConfig(), tokens=tokens, mixture=reweighted).version != step.version
    assert train_step(model, train, ResourcesConfig(hosts=2), tokens=tokens, mixture=mixture).version == step.version

    (tmp_path / "out").mkdir()
    ctx = StepContext(step=step, out=tmp_path / "out", inputs={f"tokens/{n}": parts[n] for n in mixture},
                      input_stats={}, work_dir=tmp_path / "work", log=logging.getLogger("test"))
    stats = step.run(ctx)
    drawn = open_mixture([MixtureInput(n, parts[n], m.weight, m.max_epochs) for n, m in mixture.items()],
                         B, T, seed=train.seed, steps=train.steps, eval_batches=3).drawn
    assert stats["mixture"] == drawn
    assert sum(d["tokens"] for d in drawn.values()) == stats["tokens"] == 6 * B * T
    assert drawn["heldout"]["tokens"] == 0 and drawn["big"]["tokens"] > drawn["small"]["tokens"] > 0
    assert stats["final_val_loss"] is not None
