"""The extract stage: resiliparse main-text extraction of HTML documents (also as they come out
of a real WARC file read by fastwarc), plain text passed through, wrong charsets repaired or
counted."""

from __future__ import annotations

import gzip
import io
import json
import logging
from pathlib import Path

from tasks.documents import ShardWriter, list_shards, read_shard
from tasks.extract import ExtractConfig, extract_step, repair_mojibake
from tasks.judging import explain
from tasks.engine.step import Step, StepContext

ARTICLE = ("The town council met on Tuesday evening to discuss the new library. Members agreed that "
           "the old building on Main Street would be repaired and opened again next spring, with longer "
           "hours on weekends and a reading room for children.")
PAGE = f"""<!DOCTYPE html><html><head><meta charset="utf-8"><title>News</title>
<script>var tracking = "do not keep this";</script><style>body {{ color: red }}</style></head>
<body><nav><a href="/">Home</a> | <a href="/news">News</a> | <a href="/contact">Contact</a></nav>
<article><h1>Library to reopen in the café district</h1><p>{ARTICLE}</p>
<p>Residents can send their comments to the council until the end of the month.</p></article>
<footer>Copyright 2024 Example Town. All rights reserved.</footer></body></html>"""


def write_docs(folder: Path, docs: list[dict]) -> Path:
    with ShardWriter(folder, docs_per_shard=3) as w:
        for d in docs:
            w.write({"source": "test", **d})
    return folder


def run_extract_body(config: ExtractConfig, docs_folder: Path, out: Path) -> dict:
    out.mkdir(parents=True)
    upstream = Step(name="acquire", stage="acquire", stage_version=1, config=config, run=lambda ctx: {})
    step = extract_step(config, documents=upstream)
    ctx = StepContext(step=step, out=out, inputs={"documents": docs_folder}, input_stats={},
                      work_dir=out.parent / "work", log=logging.getLogger("test"))
    return step.run(ctx)


def output(out: Path) -> dict[str, dict]:
    return {d["id"]: d for s in list_shards(out) for d in read_shard(s)}


def html_doc(doc_id: str, html: str, **meta) -> dict:
    return {"id": doc_id, "text": html, "metadata": {"content_type": "text/html", **meta}}


def test_html_gets_its_main_text_and_plain_text_passes_through(tmp_path):
    plain = {"id": "plain", "text": "Just text, <b>not</b> parsed.\n\nSecond paragraph.", "metadata": {}}
    docs = [html_doc("page", PAGE, charset="utf-8"), plain,
            html_doc("typed", PAGE, charset="utf-8") | {"metadata": {"content_type": "text/html; charset=utf-8"}}]
    stats = run_extract_body(ExtractConfig(), write_docs(tmp_path / "in", docs), tmp_path / "out")
    out = output(tmp_path / "out")
    text = out["page"]["text"]
    assert "Library to reopen in the café district" in text and ARTICLE in text
    assert "\n" in text  # paragraphs kept
    for boilerplate in ("tracking", "color: red", "Contact", "All rights reserved", "<p>"):
        assert boilerplate not in text, boilerplate
    assert out["page"]["metadata"] == {"content_type": "text/plain", "charset": "utf-8", "extracted_from": "text/html"}
    assert out["typed"]["text"] == text
    assert out["plain"] == {**plain, "source": "test"}
    assert stats["docs_in"] == stats["docs_out"] == 3 and stats["dropped"] == {}
    assert explain(tmp_path / "out", "page")["scores"]["html"] is True


def test_wrong_charset_is_repaired_or_counted(tmp_path):
    mojibake = PAGE.encode("utf-8").decode("cp1252", errors="replace")  # UTF-8 bytes read as Windows-1252
    assert "cafÃ©" in mojibake
    replaced = PAGE.replace("e", "\ufffd")  # characters lost for good
    docs = [html_doc("mojibake", mojibake, charset="windows-1252"),
            html_doc("replaced", replaced, charset="utf-8"),
            html_doc("unknown", PAGE, charset="no-such-charset"),
            html_doc("empty-body", "<html><head><title>x</title></head><body><script>1</script></body></html>")]
    stats = run_extract_body(ExtractConfig(), write_docs(tmp_path / "in", docs), tmp_path / "out")
    out = output(tmp_path / "out")
    assert "Library to reopen in the café district" in out["mojibake"]["text"]
    assert stats["repaired"] == {"charset": 1}
    assert stats["dropped"] == {"bad_charset": 1, "empty_after_extraction": 1}
    assert explain(tmp_path / "out", "unknown")["scores"]["unknown_charset"] == "no-such-charset"
    assert "unknown" in out


def test_mojibake_repair_leaves_correct_text_alone():
    for text in ("plain ascii", "déjà vu — “quoted” ünïcödé", "中文 and русский"):
        assert repair_mojibake(text) is None
    assert repair_mojibake("â€œquotedâ€\x9d cafÃ©") == "“quoted” café"


def test_pages_from_a_warc_file(tmp_path):
    """A real WARC response record, read with fastwarc as acquire does, then extracted."""
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    body = PAGE.encode("utf-8")
    http = b"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: " + \
        str(len(body)).encode() + b"\r\n\r\n" + body
    warc = (b"WARC/1.0\r\nWARC-Type: response\r\nWARC-Target-URI: http://example.com/news\r\n"
            b"WARC-Date: 2024-01-01T00:00:00Z\r\nWARC-Record-ID: <urn:uuid:12345678-1234-1234-1234-123456789012>\r\n"
            b"Content-Type: application/http; msgtype=response\r\nContent-Length: " + str(len(http)).encode() +
            b"\r\n\r\n" + http + b"\r\n\r\n")
    docs = []
    for record in ArchiveIterator(io.BytesIO(gzip.compress(warc)), record_types=WarcRecordType.response):
        docs.append(html_doc(record.record_id, record.reader.read().decode(record.http_charset),
                             charset=record.http_charset, url=record.headers.get("WARC-Target-URI")))
    assert len(docs) == 1
    run_extract_body(ExtractConfig(), write_docs(tmp_path / "in", docs), tmp_path / "out")
    (doc,) = output(tmp_path / "out").values()
    assert ARTICLE in doc["text"] and "Home" not in doc["text"]
    assert doc["metadata"]["url"] == "http://example.com/news"


def test_bad_records_are_counted(tmp_path):
    folder = write_docs(tmp_path / "in", [html_doc("ok", PAGE)])
    with gzip.open(folder / "shard-00001.jsonl.gz", "wb") as f:
        f.write(json.dumps(html_doc("big", "<p>" + "x" * 6_000_000 + "</p>")).encode() + b"\n" + b"\xff\xfe\n")
    stats = run_extract_body(ExtractConfig(), folder, tmp_path / "out")
    assert stats["dropped"] == {"too_large": 1, "invalid_utf8": 1}
    assert stats["docs_out"] == 1
