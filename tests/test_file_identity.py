"""Fields that name files enter versions by content, not by path: an lm-eval task YAML (and the
data file it names), a local source, the quality classifier's training files. Changing a file
changes the version of what reads it; the same file at another path is a cache hit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from flows.cli import main
from tasks.acquire import AcquireConfig, SourceConfig, acquire_step
from tasks.quality import QualityClassifierConfig, train_quality_classifier_step
from tests.conftest import REPO


def write_task(folder: Path, rows: list[dict]) -> Path:
    """An lm-eval multiple-choice task whose data is a JSON-lines file beside it (absolute path)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {"task": "kiln_pairs", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]}
    (folder / "kiln_pairs.yaml").write_text(yaml.safe_dump(task))
    return folder / "kiln_pairs.yaml"


def evaluate_version(tmp_path: Path, task_yaml: Path, capsys) -> str:
    cfg = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    cfg["eval"]["lm_eval_tasks"] = [str(task_yaml)]
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert main(["plan", str(config), "--store", str(tmp_path / "store"), "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)
    (version,) = {s["version"] for s in steps if s["stage"] == "evaluate"}
    return version


ROWS = [{"question": "The light was", "choices": [" good", " bad"], "answer": 0},
        {"question": "The water was", "choices": [" deep", " dry"], "answer": 0}]


def test_lm_eval_task_data_file_by_content_not_path(tmp_path, capsys):
    first = evaluate_version(tmp_path, write_task(tmp_path / "a", ROWS), capsys)
    edited = [dict(ROWS[0], answer=1), ROWS[1]]  # the task's data changes, its YAML does not
    assert evaluate_version(tmp_path, write_task(tmp_path / "a", edited), capsys) != first
    assert evaluate_version(tmp_path, write_task(tmp_path / "a", ROWS), capsys) == first
    shutil.rmtree(tmp_path / "a")  # the same task and data, somewhere else
    assert evaluate_version(tmp_path, write_task(tmp_path / "elsewhere" / "b", ROWS), capsys) == first


def test_local_source_moves_without_forking_and_reruns_when_edited(tmp_path):
    def version(path: Path) -> str:
        return acquire_step(AcquireConfig(sources=[SourceConfig(name="n", kind="files", paths=[str(path)])])).version

    (tmp_path / "a").mkdir()
    source = tmp_path / "a" / "notes.jsonl"
    source.write_text('{"text": "one"}\n')
    first = version(source)
    (tmp_path / "b").mkdir()
    moved = Path(shutil.move(source, tmp_path / "b" / "notes.jsonl"))
    assert version(moved) == first
    assert version(tmp_path / "b" / "*.jsonl") == first  # a glob matching the same file
    moved.write_text('{"text": "two"}\n')
    assert version(moved) != first


def test_quality_classifier_files_by_content(tmp_path):
    def version(folder: Path) -> str:
        cfg = QualityClassifierConfig(positive_paths=(str(folder / "good.jsonl"),),
                                      negative_paths=(str(folder / "bad.jsonl"),))
        return train_quality_classifier_step(cfg).version

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "good.jsonl").write_text('{"text": "fine prose"}\n')
        (tmp_path / name / "bad.jsonl").write_text('{"text": "spam spam"}\n')
    assert version(tmp_path / "a") == version(tmp_path / "b")
    (tmp_path / "b" / "bad.jsonl").write_text('{"text": "more spam"}\n')
    assert version(tmp_path / "a") != version(tmp_path / "b")


def test_a_folder_by_its_files_not_the_bytecode_python_writes_into_it(tmp_path):
    """A task folder with a helper module: importing it (lm-eval does, for `!function utils.x`) writes
    __pycache__/ beside it where bytecode writing is on, as on most laptops; that is not an edit."""
    def version(folder: Path) -> str:  # any field that names files goes through the same content_identity
        cfg = QualityClassifierConfig(positive_paths=(str(folder),), negative_paths=(str(tmp_path / "bad.jsonl"),))
        return train_quality_classifier_step(cfg).version

    (tmp_path / "bad.jsonl").write_text('{"text": "spam spam"}\n')
    folder = tmp_path / "task"
    folder.mkdir()
    (folder / "notes.jsonl").write_text('{"text": "one"}\n')
    (folder / "utils.py").write_text("def answer(doc):\n    return doc['answer']\n")
    first = version(folder)
    subprocess.run([sys.executable, "-c", "import utils"], cwd=folder, check=True, timeout=60,
                   env={**os.environ, "PYTHONDONTWRITEBYTECODE": ""})  # bytecode writing on, as on a laptop
    assert list((folder / "__pycache__").glob("utils.*.pyc"))  # it did write it
    assert version(folder) == first
    (folder / "utils.py").write_text("def answer(doc):\n    return 1 - doc['answer']\n")
    assert version(folder) != first  # an edit to the module still counts
