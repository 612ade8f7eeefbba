"""Adding a stage takes one module and one line in a recipe (issue 4 of 6: "one place per stage").

The test writes a stage kiln has never seen, `word_count`, as a module of its own outside the
repo, and a Python experiment whose recipe is the quickstart's acquire step plus one line for the
new stage. Nothing else changes: no list to extend, no registration. kiln must then plan it,
version it by its config and its input, run it, record its lineage, cache it, rerun only it when
its config changes, and warn in `kiln plan` when its module is edited.
"""

from __future__ import annotations

import json
import textwrap

from tasks.documents import read_documents
from tests.conftest import REPO, kiln
from tests.test_scheduler import run_names

WORD_COUNT_STAGE = textwrap.dedent('''
    """A toy stage: how many documents have at least `min_words` words, and their words in all."""
    import json

    from tasks.documents import read_documents
    from tasks.engine.config import ConfigModel, Count, setting
    from tasks.engine.step import Step

    STAGE_VERSION = 1


    class WordCountConfig(ConfigModel):
        min_words: Count = 1
        report_every: Count = setting(1000)  # a setting: never part of the version


    def run_word_count(ctx):
        kept, words = 0, 0
        for doc in read_documents(ctx.inputs["documents"]):
            n = len(doc["text"].split())
            if n >= ctx.config.min_words:
                kept, words = kept + 1, words + n
        (ctx.out / "counts.json").write_text(json.dumps({"documents": kept, "words": words}))
        return {"documents": kept, "words": words}


    def word_count_step(config, *, documents):
        return Step(name="word_count", stage="word_count", stage_version=STAGE_VERSION, config=config,
                    run=run_word_count, inputs={"documents": documents})
''')

EXPERIMENT = textwrap.dedent(f'''
    import os
    from pathlib import Path

    from flows.config import load_config
    from tasks.acquire import acquire_step
    from word_count import WordCountConfig, word_count_step

    BASE = load_config(Path({str(REPO / "configs" / "tiny_cpu.yaml")!r}))


    def experiment():
        documents = acquire_step(BASE.data.acquire())
        config = WordCountConfig(min_words=int(os.environ.get("TOY_MIN_WORDS", "1")),
                                 report_every=int(os.environ.get("TOY_REPORT_EVERY", "1000")))
        return [word_count_step(config, documents=documents)]  # the new stage: its one line
''')


def test_a_new_stage_is_one_module_and_one_recipe_line(tmp_path):
    (tmp_path / "word_count.py").write_text(WORD_COUNT_STAGE)
    experiment = tmp_path / "counted.py"
    experiment.write_text(EXPERIMENT)
    store = tmp_path / "store"

    def run(*args: str, **env: str):
        return kiln(*args, str(experiment), "--store", str(store), env={"PYTHONPATH": str(tmp_path), **env})

    planned = {e["name"]: e for e in json.loads(run("plan", "--json").stdout)}
    assert list(planned) == ["acquire", "word_count"]
    assert planned["word_count"]["status"] == "missing"
    assert planned["word_count"]["path"] == str(store / "word_count" / planned["word_count"]["version"])

    assert run_names(run("run").stdout) == {"acquire": "ran", "word_count": "ran"}
    out = store / "word_count" / planned["word_count"]["version"]
    docs = list(read_documents(store / "acquire" / planned["acquire"]["version"]))
    assert json.loads((out / "counts.json").read_text()) == {
        "documents": len(docs), "words": sum(len(d["text"].split()) for d in docs)}
    lineage = json.loads((out / "lineage.json").read_text())
    assert lineage["stage"] == "word_count" and lineage["stats"]["documents"] == len(docs)
    assert [(i["name"], i["stage"], i["version"]) for i in lineage["inputs"]] == [
        ("documents", "acquire", planned["acquire"]["version"])]
    assert "word_count.py" in lineage["code"]["module_hashes"]

    # A setting changes nothing; an identity field makes a new version, and only it runs again.
    assert run_names(run("run", TOY_REPORT_EVERY="7").stdout) == {"acquire": "cached", "word_count": "cached"}
    longest = max(len(d["text"].split()) for d in docs)
    assert run_names(run("run", TOY_MIN_WORDS=str(longest)).stdout) == {"acquire": "cached", "word_count": "ran"}
    again = {e["name"]: e for e in json.loads(run("plan", "--json", TOY_MIN_WORDS=str(longest)).stdout)}
    assert again["word_count"]["version"] != planned["word_count"]["version"]
    counted = json.loads((store / "word_count" / again["word_count"]["version"] / "counts.json").read_text())
    assert counted["documents"] == sum(len(d["text"].split()) >= longest for d in docs) >= 1

    # An edit of the stage's module is code drift, which `kiln plan` names for its step alone.
    (tmp_path / "word_count.py").write_text(WORD_COUNT_STAGE + "\n# an edit\n")
    drifted = {e["name"]: e for e in json.loads(run("plan", "--json").stdout)}
    assert drifted["acquire"]["warning"] is None
    assert "word_count.py" in drifted["word_count"]["warning"]
