"""kiln's offline task suite, cut from the held-out chapters of the KJV, loaded by lm-eval."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from evaluation.suite import SuiteConfig, build_suite, task_configs
from tests.test_eval_data import VALIDATION_FRACTION, kjv_data  # noqa: F401  (a fixture)
from tasks.tokenize import is_validation

CFG = SuiteConfig(context_words=48, choice_words=12)


def squeeze(text: str) -> str:
    """Whitespace runs as one space: lm-eval joins context and answer with one space."""
    return " ".join(text.split())


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def suite(kjv_data, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("suite")
    counts = build_suite(kjv_data.held_out(), out, ["next_passage", "last_word"], CFG)
    return out, counts


def test_next_passage_is_the_true_continuation_among_held_out_distractors(kjv_data, suite):  # noqa: F811
    out, counts = suite
    held = {d["id"]: squeeze(d["text"]) for d in kjv_data.held_out()}
    examples = read_jsonl(out / "next_passage.jsonl")
    assert len(examples) == counts["next_passage"] > 300
    for ex in examples:
        doc_id = ex["id"].split("@")[0]
        assert is_validation(doc_id, VALIDATION_FRACTION)  # never a training document
        text = held[doc_id]
        assert len(ex["choices"]) == 4 and len(set(ex["choices"])) == 4
        assert squeeze(ex["context"] + " " + ex["choices"][ex["label"]]) in text
        assert len(ex["context"].split()) == 48
        for k, choice in enumerate(ex["choices"]):
            assert len(choice.split()) == 12
            if k != ex["label"]:  # a span of another held-out chapter
                assert any(squeeze(choice) in t for i, t in held.items() if i != doc_id)
    labels = Counter(ex["label"] for ex in examples)
    assert set(labels) == {0, 1, 2, 3} and min(labels.values()) > len(examples) / 8


def test_last_word_targets_end_a_sentence_and_occur_in_the_context(kjv_data, suite):  # noqa: F811
    out, counts = suite
    held = {d["id"]: squeeze(d["text"]) for d in kjv_data.held_out()}
    examples = read_jsonl(out / "last_word.jsonl")
    assert len(examples) == counts["last_word"] > 100
    for ex in examples:
        text, passage = held[ex["id"].split("@")[0]], squeeze(ex["context"] + " " + ex["target"])
        after = text[text.index(passage) + len(passage):][:1]
        assert after in ".!?;:"
        assert ex["target"].isalpha() and ex["target"] in ex["context"]


def test_suite_is_deterministic_and_follows_the_seed(kjv_data, suite, tmp_path):  # noqa: F811
    out, _ = suite
    build_suite(kjv_data.held_out(), tmp_path / "again", ["next_passage", "last_word"], CFG)
    for name in ("next_passage.jsonl", "next_passage.yaml", "last_word.jsonl", "last_word.yaml"):
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes()
    build_suite(kjv_data.held_out(), tmp_path / "seed1", ["next_passage"], CFG.model_copy(update={"seed": 1}))
    assert (tmp_path / "seed1" / "next_passage.jsonl").read_bytes() != (out / "next_passage.jsonl").read_bytes()


def test_lm_eval_loads_the_suite_offline(suite):
    from lm_eval.tasks import TaskManager

    out, counts = suite
    manager = TaskManager(include_defaults=False)
    loaded = manager.load(task_configs(out, ["next_passage", "last_word"]))["tasks"]
    assert set(loaded) == {"kiln_next_passage", "kiln_last_word"}
    mc, lw = loaded["kiln_next_passage"], loaded["kiln_last_word"]
    docs = list(mc.test_docs())
    assert len(docs) == counts["next_passage"]
    requests = mc.construct_requests(docs[0], mc.doc_to_text(docs[0]))
    # four conditional answers, then four unconditional ones for acc_mutual_info; each " " + choice
    assert [r.arguments for r in requests[:4]] == [(docs[0]["context"], " " + c) for c in docs[0]["choices"]]
    assert [r.arguments for r in requests[4:]] == [("", " " + c) for c in docs[0]["choices"]]
    doc = next(iter(lw.test_docs()))
    assert lw.construct_requests(doc, lw.doc_to_text(doc)).arguments == (doc["context"], " " + doc["target"])


def test_suite_errors_say_what_to_do(kjv_data, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="unknown kiln suite tasks .'hellaswag'."):
        build_suite(kjv_data.held_out(), tmp_path, ["hellaswag"], CFG)
    with pytest.raises(ValueError, match="no held-out documents"):
        build_suite([], tmp_path, ["next_passage"], CFG)
    with pytest.raises(ValueError, match="give no last_word examples"):
        build_suite(kjv_data.held_out()[:1], tmp_path, ["last_word"], SuiteConfig(context_words=5000, choice_words=8))
