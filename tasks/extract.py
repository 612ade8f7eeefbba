"""Extract the main text of HTML documents with resiliparse; plain-text documents pass through.

`acquire` puts a page's raw HTML (from a WARC record or an HTML file) in `text`, with
`metadata["content_type"] = "text/html"` and `metadata["charset"]` when known. Here resiliparse
(DCLM's choice: fast, and its main-content heuristics drop navigation, footers and scripts)
turns it into plain text with paragraph breaks kept.

A page decoded with the wrong charset shows up as mojibake ("cafÃ©" for "café": UTF-8 bytes
read as Windows-1252). That is reversible, so it is repaired and counted under
`repaired: {charset: n}`; text whose characters were replaced by U+FFFD is not, and is dropped
as `bad_charset` when more than `max_replacement_fraction` of it is lost.
"""

from __future__ import annotations

import codecs
import re
from typing import TYPE_CHECKING

from pydantic import Field
from resiliparse.extract.html2text import extract_plain_text
from resiliparse.parse.html import HTMLParserException

from tasks.judging import (DEFAULT_MAX_DOC_BYTES, MAX_DOC_BYTES_DESCRIPTION, STRICT_DESCRIPTION, WORKERS_DESCRIPTION,
                           Judge, Verdict, run_judged)
from tasks.engine.config import ConfigModel, Count, Fraction, setting

if TYPE_CHECKING:  # tasks.engine.step loads Prefect (seconds), which Ray workers running this module never need
    from tasks.engine.step import Step, StepContext

STAGE_VERSION = 1
HTML_TYPES = ("text/html", "application/xhtml+xml")
# Windows-1252's characters for bytes 0x80-0x9f, mapped back to those bytes as Latin-1 characters;
# with it any text read as Windows-1252 or Latin-1 encodes back to its original bytes.
_CP1252_BYTES = {ord(bytes([b]).decode("cp1252")): b
                 for b in range(0x80, 0xA0) if b not in (0x81, 0x8D, 0x8F, 0x90, 0x9D)}  # 5 are unassigned
# A UTF-8 lead byte read that way, followed by a continuation byte read that way.
MOJIBAKE = re.compile("[\u00c2-\u00f4][\u0080-\u00bf" + "".join(map(chr, _CP1252_BYTES)) + "]")


class ExtractConfig(ConfigModel):
    main_content: bool = Field(True, description="Keep only the page's main content: resiliparse's boilerplate "
                               "removal drops navigation, footers and the like.")
    preserve_formatting: bool = Field(True, description="Keep paragraph and line breaks (and lists and "
                                      "preformatted text); off: all white space collapses into single spaces.")
    list_bullets: bool = Field(True, description="Put a bullet or number before each list item.")
    alt_texts: bool = Field(False, description="Keep images' alternative texts in the extracted text.")
    max_replacement_fraction: Fraction = Field(0.01, description="A page with more than this share of U+FFFD "
                                               "replacement characters (after the mojibake repair) is dropped "
                                               "as `bad_charset`.")
    max_doc_bytes: Count = Field(DEFAULT_MAX_DOC_BYTES, description=MAX_DOC_BYTES_DESCRIPTION)
    strict: bool = Field(False, description=STRICT_DESCRIPTION)
    workers: Count | None = setting(None, description=WORKERS_DESCRIPTION)
    max_source_drop: Fraction = setting(0.9, description="Warn (and record under `warnings`) when more than this "
                                        "share of one source is removed; set from `data.max_source_drop`.")


def is_html(doc: dict) -> bool:
    content_type = str(doc["metadata"].get("content_type", "")).split(";")[0].strip().lower()
    return content_type in HTML_TYPES


def repair_mojibake(text: str) -> str | None:
    """The text as it was before UTF-8 bytes were decoded as Windows-1252 or Latin-1, or None
    when it shows no mojibake or does not round-trip (then it was not mojibake)."""
    if not MOJIBAKE.search(text):
        return None
    try:
        return text.translate(_CP1252_BYTES).encode("latin-1").decode("utf-8")
    except UnicodeError:
        return None


def make_extract_judge(cfg: ExtractConfig) -> Judge:
    def judge(doc: dict) -> Verdict:
        if not is_html(doc):
            return doc, None, {"html": False}
        html = doc["text"]
        scores: dict = {"html": True, "html_chars": len(html)}
        charset = doc["metadata"].get("charset")
        if charset is not None:
            try:
                codecs.lookup(str(charset))
            except LookupError:
                scores["unknown_charset"] = str(charset)
        repaired = repair_mojibake(html)
        if repaired is not None:
            html = repaired
            scores["repaired"] = "charset"
        lost = html.count("\ufffd") / len(html)
        if lost > cfg.max_replacement_fraction:
            return None, "bad_charset", {**scores, "replacement_fraction": round(lost, 4)}
        try:
            text = extract_plain_text(html, main_content=cfg.main_content,
                                      preserve_formatting=cfg.preserve_formatting,
                                      list_bullets=cfg.list_bullets, alt_texts=cfg.alt_texts,
                                      links=False, form_fields=False)
        except HTMLParserException as e:
            return None, "html_parse_error", {**scores, "error": str(e)[:200]}
        scores["text_chars"] = len(text)
        if not text.strip():
            return None, "empty_after_extraction", scores
        metadata = {**doc["metadata"], "content_type": "text/plain", "extracted_from": "text/html"}
        return {**doc, "text": text, "metadata": metadata}, None, scores

    return judge


def run_extract(ctx: StepContext) -> dict:
    return run_judged(ctx, make_extract_judge, ctx.config)


def extract_step(config: ExtractConfig, *, documents: Step) -> Step:
    from tasks.engine.step import Step

    return Step(name="extract", stage="extract", stage_version=STAGE_VERSION, config=config,
                run=run_extract, inputs={"documents": documents})
