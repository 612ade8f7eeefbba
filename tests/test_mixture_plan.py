"""A mixture's steps and what reruns, seen through `kiln plan`: the data steps of two sources run
for real (acquire to tokenize, each source its own chain), then a weight change leaves every
one of them done and only training and what follows it missing, and a change to one source's
file leaves the other source's chain and tokens done."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from prefect import flow

from flows.cli import main
from flows.experiment import load_experiment
from flows.plan import select
from tasks.engine.scheduler import execute
from tasks.engine.store import Store
from tests.conftest import kjv_chapters

AFTER_TRAINING = {"train", "evaluate", "export"}


@flow
def run_until_tokenize(config: str, store: str) -> list:
    return execute(select(load_experiment(config).steps, "tokenize"), Store(store))


def write_source(path: Path, chapters: list[dict]) -> None:
    path.write_text("".join(json.dumps({"id": c["id"], "text": c["text"]}) + "\n" for c in chapters))


def config(tmp: Path, name: str, weights: dict[str, float]) -> Path:
    raw = {
        "name": "mixture-plan",
        "data": {
            "sources": [{"name": n, "kind": "files", "paths": [str(tmp / f"{n}.jsonl")], "format": "jsonl"}
                        for n in ("alpha", "beta")],
            "filter": {"heuristics": {"min_words": 50}, "language": {"enabled": False}},
            "mixture": {"sources": {n: {"weight": w} for n, w in weights.items()}},
        },
        "tokenizer": {"kind": "gpt2"},
        "tokenize": {"validation_fraction": 0.1},
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64, "seq_len": 32},
        "train": {"batch_size": 4, "steps": 4, "warmup": 1, "eval_batches": 2},
        "eval": {"tasks": ["next_passage"], "limit": 10},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def planned(path: Path, store: Path, capsys) -> dict[str, dict]:
    assert main(["plan", str(path), "--store", str(store), "--json"]) == 0
    return {s["name"]: s for s in json.loads(capsys.readouterr().out)}


@pytest.mark.ray  # its training (or data workers) starts a local Ray: tests/conftest.py ray_lock
def test_a_weight_change_reruns_training_only(tmp_path, prefect_harness, capsys):
    chapters = list(kjv_chapters())
    write_source(tmp_path / "alpha.jsonl", chapters[:30])
    write_source(tmp_path / "beta.jsonl", chapters[30:45])
    store = tmp_path / "store"
    first = config(tmp_path, "first", {"alpha": 0.7, "beta": 0.3})
    runs = run_until_tokenize(str(first), str(store))
    assert {r.status for r in runs} == {"ran"}
    assert {r.name for r in runs} >= {"acquire/alpha", "acquire/beta", "tokenize/alpha", "tokenize/beta"}

    before = planned(first, store, capsys)
    reweighted = planned(config(tmp_path, "second", {"alpha": 0.6, "beta": 0.4}), store, capsys)
    assert before.keys() == reweighted.keys()
    for name, step in reweighted.items():
        if step["stage"] in AFTER_TRAINING:
            assert step["status"] == "missing" and step["version"] != before[name]["version"], name
        else:  # every data step, the tokenizer and both tokenize steps: the same version, done
            assert step["status"] == "done" and step["version"] == before[name]["version"], name

    # One source changed: only its own chain (and training) reruns; the other's tokens are kept.
    write_source(tmp_path / "beta.jsonl", chapters[30:46])
    changed = planned(first, store, capsys)
    for name, step in changed.items():
        rerun = name.endswith("/beta") or step["stage"] in AFTER_TRAINING
        assert step["status"] == ("missing" if rerun else "done"), name


BPE = {"tokenizer": {"kind": "bpe", "vocab_size": 1024}}


@pytest.mark.parametrize("mixture, other, field", [
    ({"sources": {"alpha": {"weight": 1}, "gamma": {"weight": 1}, "beta": {"weight": 0}}}, {}, "data.mixture:"),
    ({"sources": {"alpha": {"weight": -0.5}, "beta": {"weight": 1}}}, {}, "data.mixture.sources.alpha.weight:"),
    ({"sources": {"alpha": {"weight": 0}, "beta": {"weight": 0}}}, {}, "data.mixture:"),
    ({"sources": {"alpha": {"weight": 1}}}, {}, "data.mixture:"),
    ({"sources": {"alpha": {"weight": 1}, "beta": {"weight": 1}}}, BPE, "data.mixture.tokenizer_source"),
    ({"tokens": 100, "sources": {"alpha": {"weight": 1}, "beta": {"weight": 1}}}, {}, "data.mixture.tokens"),
])
def test_a_wrong_mixture_exits_2_naming_the_field(tmp_path, capsys, mixture, other, field):
    path = config(tmp_path, "wrong", {"alpha": 1, "beta": 1})
    raw = {**yaml.safe_load(path.read_text()), **other}
    raw["data"]["mixture"] = mixture
    path.write_text(yaml.safe_dump(raw))
    assert main(["plan", str(path), "--store", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert field in err, err
    if "gamma" in json.dumps(mixture):
        assert "gamma" in err and "not sources" in err
