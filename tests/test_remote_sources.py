"""Sources by URL: a JSON-lines file served over HTTP (python's http.server on 127.0.0.1) or from an
S3 API (moto's server on 127.0.0.1) gives the same documents and ids as the same file on local
disk; acquire's version follows what the filesystem reports about the file, not the URL."""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import threading
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tasks.acquire import AcquireConfig, SourceConfig, acquire_step
from tasks.documents import list_shards, read_documents
from tasks.engine.step import StepContext
from tests.conftest import moto_server

RECORDS = [{"id": "a", "text": "the first note, with an id of its own", "lang": "en"},
           {"text": "a note without an id"},
           {"id": 3, "text": "the third note"}]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def acquire(out: Path, source: SourceConfig) -> tuple[str, list[dict]]:
    step = acquire_step(AcquireConfig(sources=[source], docs_per_shard=2))
    out.mkdir(parents=True)
    step.run(StepContext(step=step, out=out, inputs={}, input_stats={}, work_dir=out.parent / f"{out.name}-w",
                         log=logging.getLogger("test")))
    return step.version, list(read_documents(out))


def same_shards(a: Path, b: Path) -> bool:
    return [p.name for p in list_shards(a)] == [p.name for p in list_shards(b)] and \
        all(x.read_bytes() == y.read_bytes() for x, y in zip(list_shards(a), list_shards(b)))


@contextmanager
def http_server(folder: Path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def test_http_source_gives_the_documents_of_the_local_file(tmp_path):
    local = write_jsonl(tmp_path / "local" / "notes.jsonl", RECORDS)
    served = tmp_path / "served"
    shutil.copytree(local.parent, served)
    local_version, local_docs = acquire(tmp_path / "from-disk",
                                        SourceConfig(name="n", kind="files", paths=[str(local)]))
    with http_server(served) as url, http_server(served) as other_url:
        source = SourceConfig(name="n", kind="files", paths=[f"{url}/notes.jsonl"])
        version, docs = acquire(tmp_path / "from-http", source)
        assert [d["id"] for d in docs] == [d["id"] for d in local_docs] == ["n/a", "n/notes.jsonl:2", "n/3"]
        assert same_shards(tmp_path / "from-disk", tmp_path / "from-http")  # byte for byte
        # acquire's version differs from the local file's only by how the file is identified
        # (the server reports no checksum, so the content is hashed); never by the server's address
        assert version != local_version
        assert acquire_step(AcquireConfig(sources=[source.model_copy(update={"paths": [f"{other_url}/notes.jsonl"]})],
                                          docs_per_shard=2)).version == version
        write_jsonl(served / "notes.jsonl", [{**RECORDS[0], "text": RECORDS[0]["text"].upper()}, *RECORDS[1:]])
        changed = acquire_step(AcquireConfig(sources=[source], docs_per_shard=2)).version
        assert changed != version  # same size, new content
        with pytest.raises(FileNotFoundError, match="matches no file"):
            acquire_step(AcquireConfig(sources=[SourceConfig(name="n", kind="files",
                                                             paths=[f"{url}/missing.jsonl"])])).version


@pytest.fixture
def dummy_aws(monkeypatch):
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def test_s3_source_from_moto_server(tmp_path, dummy_aws):
    import s3fs

    local = write_jsonl(tmp_path / "local" / "notes.jsonl", RECORDS)
    local_version, local_docs = acquire(tmp_path / "from-disk",
                                        SourceConfig(name="n", kind="files", paths=[str(local)]))
    with moto_server() as endpoint:
        options = {"client_kwargs": {"endpoint_url": endpoint}}
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir("corpus")
        fs.put(str(local), "corpus/notes/notes.jsonl")
        source = SourceConfig(name="n", kind="files", paths=["s3://corpus/notes/*.jsonl"], storage_options=options)
        version, docs = acquire(tmp_path / "from-s3", source)
        assert [d["id"] for d in docs] == [d["id"] for d in local_docs]
        assert same_shards(tmp_path / "from-disk", tmp_path / "from-s3")
        assert version != local_version  # the S3 ETag and size, not the content's sha256
        # storage options are a setting: another endpoint for the same objects keeps the version
        other = source.model_copy(update={"storage_options": {"client_kwargs": {"endpoint_url": endpoint + "/"}}})
        assert acquire_step(AcquireConfig(sources=[other], docs_per_shard=2)).version == version
        fs.pipe("corpus/notes/notes.jsonl", (local.read_text().replace("first", "FIRST")).encode())
        fs.invalidate_cache()
        assert acquire_step(AcquireConfig(sources=[source], docs_per_shard=2)).version != version
    assert os.environ["AWS_ACCESS_KEY_ID"] == "testing"
