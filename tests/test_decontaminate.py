"""decontaminate: a training document sharing a 13-gram with an eval example (an lm-eval task's data
file, or the held-out text kiln's suite is cut from) is dropped, or has the span cut out; short
overlaps are kept; the stats count per eval task and `explain` says why."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import yaml

from tasks.decontaminate import SUITE_TASK, DecontaminateConfig, decontaminate_step
from tasks.documents import ShardWriter, read_documents
from tasks.judging import explain
from tasks.engine.step import Step, StepContext
from tasks.tokenize import is_validation
from tests.conftest import kjv_chapters

QUESTION = ("All human beings are born free and equal in dignity and rights. They are endowed with reason "
            "and conscience and should act towards one another in a spirit of brotherhood.")
FRACTION = 0.2


def lm_eval_task(folder: Path) -> Path:
    """A local lm-eval task YAML whose JSON-lines data file holds the example."""
    folder.mkdir()
    with open(folder / "qa.jsonl", "w") as f:
        f.write(json.dumps({"question": QUESTION, "choices": ["yes", "no"], "label": 0}) + "\n")
    spec = {"task": "planted_qa", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": "qa.jsonl"}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "question",
            "doc_to_choice": "choices", "doc_to_target": "label", "metric_list": [{"metric": "acc"}]}
    (folder / "qa.yaml").write_text(yaml.safe_dump(spec))
    return folder / "qa.yaml"


def ids(prefix: str, held_out: bool, n: int) -> list[str]:
    found = (f"web/{prefix}-{i}" for i in range(10_000))
    return [i for i in found if is_validation(i, FRACTION) == held_out][:n]


def corpus(folder: Path) -> dict[str, str]:
    (held,) = ids("h", True, 1)
    kjv = [d["text"] for d in kjv_chapters()]
    train = ids("t", False, 5)
    passage = " ".join(kjv[20].split()[40:60])  # 20 words of the held-out chapter
    words = QUESTION.split()
    docs = {
        held: kjv[20],
        train[0]: kjv[0] + "\n\n" + QUESTION.upper().replace(".", "!") + "\n\n" + kjv[1],  # case, punctuation
        train[1]: kjv[2] + " " + " ".join(words[:8]) + ". " + kjv[3] + " " + " ".join(words[8:16]),  # 8-grams only
        train[2]: kjv[4],
        train[3]: kjv[5] + " " + passage + " " + kjv[6],
        train[4]: QUESTION,  # nothing but the example: nothing left once it is cut
    }
    with ShardWriter(folder, docs_per_shard=4) as w:
        for doc_id, text in docs.items():
            w.write({"id": doc_id, "text": text, "source": "web", "metadata": {}})
    return docs


def run(tmp_path: Path, name: str, **config) -> tuple[dict, Path]:
    upstream = Step(name="dedup", stage="dedup", stage_version=1, config=DecontaminateConfig(), run=lambda c: {})
    step = decontaminate_step(DecontaminateConfig(validation_fraction=FRACTION, **config), documents=upstream)
    out = tmp_path / name
    out.mkdir()
    ctx = StepContext(step=step, out=out, inputs={"documents": tmp_path / "docs"}, input_stats={},
                      work_dir=tmp_path / f"{name}-work", log=logging.getLogger("test"))
    return step.run(ctx), out


def test_planted_eval_examples_are_removed_and_short_overlaps_kept(tmp_path):
    docs = corpus(tmp_path / "docs")
    held, *train = docs
    task = lm_eval_task(tmp_path / "task")
    stats, out = run(tmp_path, "drop", lm_eval_tasks=[str(task), "hellaswag"])
    kept = {d["id"]: d["text"] for d in read_documents(out)}
    assert sorted(kept) == sorted([held, train[1], train[2]])
    assert kept[held] == docs[held] and kept[train[1]] == docs[train[1]]
    assert stats["contaminated"] == {SUITE_TASK: 1, "planted_qa": 2}
    assert stats["dropped"] == {"contaminated": 3} and stats["per_source"]["web"]["docs_out"] == 3
    assert stats["unchecked_tasks"] == ["hellaswag"]  # a registry name: no data file to read
    record = explain(out, train[0])
    assert record["reason"] == "contaminated" and record["scores"]["tasks"] == ["planted_qa"]
    assert explain(out, train[3])["scores"]["tasks"] == [SUITE_TASK]
    assert explain(out, held)["scores"] == {"held_out": True}  # the eval text itself stays

    stats, out = run(tmp_path, "spans", lm_eval_tasks=[str(task)], mode="spans")
    kept = {d["id"]: d["text"] for d in read_documents(out)}
    kjv = [d["text"] for d in kjv_chapters()]
    assert train[4] not in kept  # nothing left
    assert "BROTHERHOOD" not in kept[train[0]] and kept[train[0]].startswith(kjv[0]) \
        and kept[train[0]].rstrip().endswith(kjv[1])
    assert " ".join(kjv[20].split()[40:60]) not in kept[train[3]] and kept[train[3]].startswith(kjv[5])
    assert stats["spans_cut"] == {SUITE_TASK: 1, "planted_qa": 1} and stats["contaminated"] == {"planted_qa": 1}
