"""Document shards: gzip JSON lines of `{"id", "text", "source", "metadata"}`, read robustly.

Every data stage reads and writes documents through this module, so there is one answer to
"what happens to a bad record": it is counted under a reason and skipped, or, with
`strict=True`, it is an error naming the file and line. Nothing is dropped silently. Only
malformed data is counted (a bad line, a truncated or corrupt gzip stream); a file that cannot
be read at all (permission denied, an I/O error, a folder) stops the stage, naming the file.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

SHARD_GLOB = "shard-*.jsonl.gz"


class BadRecord(ValueError):
    """A record that cannot be read, raised only in strict mode."""


class UnreadableShard(OSError):
    """A shard the operating system will not read (permission denied, a folder, an I/O error).

    Never counted as bad data: a whole shard must not vanish as one counted record."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.jsonl.gz"


def list_shards(folder: Path) -> list[Path]:
    shards = sorted(Path(folder).glob(SHARD_GLOB))
    if not shards:
        raise FileNotFoundError(f"no document shards ({SHARD_GLOB}) in {folder}")
    return shards


def dumps(doc: dict) -> str:
    return json.dumps(doc, ensure_ascii=False, sort_keys=True)


def write_shard(path: Path, docs: Iterable[dict]) -> dict:
    """Write documents to one shard; gzip mtime 0 so equal input gives equal bytes. Returns counts."""
    n = size = 0
    try:
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            for doc in docs:
                line = (dumps(doc) + "\n").encode()
                gz.write(line)
                n += 1
                size += len(doc["text"].encode())
    except OSError as e:  # a full disk, say: say where, so the user knows which filesystem
        if e.filename is not None:
            raise
        raise OSError(e.errno, f"{e.strerror or e} (writing {path})") from e
    return {"docs": n, "bytes": size}


class ShardWriter:
    """Writes documents into numbered shards of at most `docs_per_shard` documents."""

    def __init__(self, folder: Path, docs_per_shard: int = 2000):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.docs_per_shard = docs_per_shard
        self._buffer: list[dict] = []
        self.shards = 0
        self.docs = 0

    def write(self, doc: dict) -> None:
        self._buffer.append(doc)
        if len(self._buffer) >= self.docs_per_shard:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            write_shard(self.folder / shard_name(self.shards), self._buffer)
            self.shards += 1
            self.docs += len(self._buffer)
            self._buffer = []

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.flush()


def read_shard(
    path: Path,
    bad: Counter | None = None,
    strict: bool = False,
    max_doc_bytes: int | None = None,
) -> Iterator[dict]:
    """Yield the documents of one shard, counting each unreadable record in `bad` by reason.

    Reasons: `invalid_utf8`, `malformed_json`, `missing_fields`, `too_large`, `truncated_shard`.
    """
    bad = Counter() if bad is None else bad

    def reject(reason: str, lineno: int, detail: str) -> None:
        if strict:
            raise BadRecord(f"{path}:{lineno}: {reason}: {detail} (set strict: false to skip and count)")
        bad[reason] += 1

    lineno = 0
    try:
        with gzip.open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                if max_doc_bytes is not None and len(raw) > max_doc_bytes:
                    reject("too_large", lineno, f"{len(raw)} bytes > max_doc_bytes {max_doc_bytes}")
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    reject("invalid_utf8", lineno, str(e))
                    continue
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError as e:
                    reject("malformed_json", lineno, str(e))
                    continue
                if not isinstance(doc, dict) or not isinstance(doc.get("text"), str) or "id" not in doc:
                    reject("missing_fields", lineno, "a document needs a string `text` and an `id`")
                    continue
                try:  # a JSON escape like "\ud800" decodes to a lone surrogate, which no UTF-8 can hold
                    doc["text"].encode("utf-8")
                except UnicodeEncodeError as e:
                    reject("invalid_utf8", lineno, str(e))
                    continue
                doc.setdefault("source", "")
                doc.setdefault("metadata", {})
                yield doc
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # the archive itself is cut off or corrupt
        reject("truncated_shard", lineno + 1, f"{type(e).__name__}: {e}")
    except FileNotFoundError:
        raise
    except OSError as e:  # the file cannot be read (permissions, a folder, an I/O error): not bad data
        raise UnreadableShard(f"cannot read document shard {path}: {type(e).__name__}: {e}") from e


def read_documents(folder: Path, bad: Counter | None = None, strict: bool = False) -> Iterator[dict]:
    for shard in list_shards(folder):
        yield from read_shard(shard, bad=bad, strict=strict)


def gzip_bytes(data: bytes) -> bytes:
    """gzip with mtime 0, for byte-reproducible small files."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        gz.write(data)
    return buf.getvalue()
