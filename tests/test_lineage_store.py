"""`kiln lineage` on a store URL: an fsspec memory:// store (in this process) and a file:// URL
(a fresh `kiln` process) give the tree a local folder gives."""

from __future__ import annotations

import json
import uuid

import pytest

from flows.cli import main
from tasks.engine.lineage import build_lineage, lineage_at, lineage_tree, now
from tasks.engine.step import Step
from tasks.engine.store import Store
from tasks.tokenize import TokenizeConfig
from tests.conftest import kiln


def publish_chain(store: Store) -> tuple[Step, Step]:
    """Two published steps, `docs` <- `tokens`, with the lineage.json kiln writes."""
    docs = Step(name="docs", stage="docs", stage_version=1, config=TokenizeConfig(), run=lambda ctx: {})
    tokens = Step(name="tokens", stage="tokens", stage_version=1, config=TokenizeConfig(validation_fraction=0.5),
                  run=lambda ctx: {}, inputs={"documents": docs})
    for step, stats in ((docs, {"documents": 3, "sources": [{"name": "notes", "origin": "notes.jsonl"}]}),
                        (tokens, {"tokens": 120})):
        tmp = store.begin(step.stage, step.version)
        (tmp / "data.txt").write_text(f"{step.name}\n")
        store.publish(tmp, step.stage, step.version, build_lineage(step, store, stats, now(), now(), {}, {}))
    return docs, tokens


def shape(node: dict) -> tuple:
    return (node["stage"], node["version"], node["stats"].get("documents"), node["stats"].get("tokens"),
            [s.get("name") for s in node["sources"]], [shape(c) for c in node["inputs"]])


def test_lineage_of_a_memory_store_url(capsys, tmp_path):
    store = Store(f"memory://kiln-test-{uuid.uuid4().hex[:8]}/store")
    docs, tokens = publish_chain(store)
    url = store.output(tokens.stage, tokens.version)
    tree = lineage_at(url)
    assert tree["path"] == url and tree["inputs"][0]["path"] == store.output(docs.stage, docs.version)
    assert shape(tree) == ("tokens", tokens.version, None, 120, [],
                           [("docs", docs.version, 3, None, ["notes"], [])])

    local = Store(tmp_path / "store")
    publish_chain(local)
    assert shape(lineage_tree(tmp_path / "store" / "tokens" / tokens.version)) == shape(tree)

    assert main(["lineage", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == tree
    assert main(["lineage", url]) == 0
    text = capsys.readouterr().out
    assert f"tokens {tokens.version}  {url}" in text and "<- source notes: notes.jsonl" in text

    store.fs.rm(store._fs_path(docs.stage, docs.version), recursive=True)  # an input gone from the store
    assert lineage_at(url)["inputs"] == [{"stage": "docs", "version": docs.version, "missing": True}]
    assert main(["lineage", f"{store.root}/tokens/000000000000"]) == 2
    assert "not a finished kiln artefact" in capsys.readouterr().err


def test_an_artefact_met_again_in_the_tree_is_written_out_once(tmp_path):
    """A diamond: `final` reads `tokens` and `other`, both made from `docs`. The text, the
    markdown and the exported model card list docs' source once; the second time docs says its
    inputs are above (the card listed a DPO model's data steps 14 times over before)."""
    from tasks.engine.lineage import SHOWN_ABOVE, format_tree, tree_markdown
    from training.export import lineage_lines

    store = Store(tmp_path / "store")
    docs, tokens = publish_chain(store)
    other = Step(name="other", stage="other", stage_version=1, config=TokenizeConfig(), run=lambda ctx: {},
                 inputs={"documents": docs})
    final = Step(name="final", stage="final", stage_version=1, config=TokenizeConfig(), run=lambda ctx: {},
                 inputs={"tokens": tokens, "other": other})
    for step in (other, final):
        store.publish(store.begin(step.stage, step.version), step.stage, step.version,
                      build_lineage(step, store, {}, now(), now(), {}, {}))
    tree = lineage_tree(tmp_path / "store" / "final" / final.version)
    assert [c["inputs"][0]["stage"] for c in tree["inputs"]] == ["docs", "docs"]  # --json: the whole tree
    for text in (format_tree(tree), tree_markdown(tree), "\n".join(lineage_lines(tree))):
        docs_lines = [line for line in text.splitlines() if docs.version in line]
        assert len(docs_lines) == 2 and SHOWN_ABOVE not in docs_lines[0] and SHOWN_ABOVE in docs_lines[1], text
        assert text.count("notes.jsonl") == 1 and text.count(SHOWN_ABOVE) == 1


def test_lineage_of_a_file_url_from_the_command_line(tmp_path):
    store = Store(tmp_path / "store")
    docs, tokens = publish_chain(store)
    out = kiln("lineage", f"file://{tmp_path}/store/tokens/{tokens.version}", "--json")
    tree = json.loads(out.stdout)
    assert tree == lineage_tree(tmp_path / "store" / "tokens" / tokens.version)
    assert tree["inputs"][0]["version"] == docs.version


@pytest.mark.parametrize("bad", ["memory://tokens", "memory://x/"])
def test_a_url_without_stage_and_version_is_refused(bad):
    with pytest.raises(FileNotFoundError):
        lineage_at(bad)
