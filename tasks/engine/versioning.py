"""Step versions: the hash that names every output, and the Prefect cache key (tasks/engine/caching.py).

A version is `sha256(canonical_json({stage, stage_version, config identity fields, upstream
versions}))[:12]` (DESIGN.md section 2). Everything that can change an output's bytes enters
it; nothing else does: not the store's location, not worker counts, not the code's commit (that
goes into lineage, where `kiln plan` compares it, so that editing a comment does not fork every
downstream artefact).
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import re
from functools import lru_cache
from pathlib import Path, PurePath
from typing import Any

from pydantic import BaseModel

from tasks.engine.config import is_identity, left_out_at_default, names_files

VERSION_CHARS = 12


def identity_fields(config: BaseModel) -> dict[str, Any]:
    """The config's fields that can change the output, recursively, as plain JSON values; a
    field that names files (tasks/engine/config.py `files`) as the content of what it names."""
    out: dict[str, Any] = {}
    for name in type(config).model_fields:
        value = getattr(config, name)
        if is_identity(type(config), name) and not left_out_at_default(type(config), name, value):
            out[name] = content_identity(value) if names_files(type(config), name) else _identity_value(value)
    return out


def _identity_value(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return identity_fields(value)
    if isinstance(value, (list, tuple)):
        return [_identity_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _identity_value(v) for k, v in value.items()}
    return value


# --- files by content --------------------------------------------------------------------------

YAML_SUFFIXES = (".yaml", ".yml")


def content_identity(value: Any) -> Any:
    """What a field that names files contributes to a version: for each string that names files
    (a path, or a glob matching something), the content of each of them; other strings as they
    are. A file enters as its name and sha256 (its folder is left out: a source's file names can
    reach document ids); a folder as its files' relative names and sha256s; a YAML file (an
    lm-eval task) as its parsed content, in which every string naming a file is itself replaced
    by that file's content, so the task's data files count and the paths to them do not.

    A URL (`s3://`, `https://`, ...) enters by its file name only, never its host or bucket: its
    content is for the stage that reads it to fingerprint (acquire asks the filesystem, with the
    source's storage options, for the file's ETag or checksum and size: tasks/acquire.py)."""
    if isinstance(value, (list, tuple)):
        return [content_identity(v) for v in value]
    if not isinstance(value, str):
        return _identity_value(value)
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", value) and not value.startswith("file://"):
        return {"url_file": value.rstrip("/").rsplit("/", 1)[-1]}
    matches = sorted(glob.glob(value, recursive=True)) if glob.has_magic(value) else [value]
    matches = [m for m in matches if os.path.exists(m)]
    return [_content(Path(m)) for m in matches] if matches else value


def files_under(folder: Path) -> list[Path]:
    """The files that make a folder's content, sorted: all it holds but the bytecode Python writes into
    __pycache__/ beside a module it imports (a task's helper module, on a machine that writes bytecode),
    which is not an edit and must not change a version."""
    return [f for f in sorted(folder.rglob("*")) if f.is_file() and "__pycache__" not in f.relative_to(folder).parts]


def _content(path: Path, depth: int = 0) -> Any:
    if path.is_dir():
        files = {f.relative_to(path).as_posix(): file_sha256(f) for f in files_under(path)}
        return {"folder": path.name, "files": files}
    if path.suffix in YAML_SUFFIXES and depth < 4:
        return {"yaml": _yaml_content(path, depth)}
    return {"file": path.name, "sha256": file_sha256(path)}


def _yaml_content(path: Path, depth: int) -> Any:
    import yaml

    class Loader(yaml.SafeLoader):  # lm-eval's `!function module.name` and other tags, kept as text
        pass

    Loader.add_multi_constructor("", lambda loader, tag, node: {tag: loader.construct_scalar(node)}
                                 if isinstance(node, yaml.ScalarNode) else {tag: str(node.value)})
    try:
        data = yaml.load(path.read_text(), Loader=Loader)
    except (yaml.YAMLError, UnicodeDecodeError):
        return {"sha256": file_sha256(path)}

    def named(text: str) -> Path | None:
        for candidate in (Path(text), path.parent / text):  # lm-eval resolves against the cwd
            try:
                if candidate.is_file() and candidate.resolve() != path.resolve():
                    return candidate
            except OSError:
                return None
        return None

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if len(node) == 1 and "!function" in node:  # module.function, beside the YAML
                module = path.parent / (str(node["!function"]).rsplit(".", 1)[0] + ".py")
                return {"!function": node["!function"], **({"sha256": file_sha256(module)} if module.is_file() else {})}
            return {str(k): walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, str) and len(node) < 4096 and (file := named(node)) is not None:
            return _content(file, depth + 1)
        if isinstance(node, float) and not math.isfinite(node):
            return repr(node)
        return node if node is None or isinstance(node, (bool, int, float, str)) else str(node)

    return walk(data)


def file_sha256(path: Path) -> str:
    """A file's sha256, computed once per process while its size and mtime stay: what a file a
    stage reads outside its config (a model file) contributes to the step's fingerprint."""
    stat = path.stat()
    return _sha256_of(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=4096)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    """Hashed once per process while size and mtime stay (versions are computed often)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys, no whitespace, and floats written the same way in every process.

    Sets are refused rather than sorted (their order is not stable across processes, which is
    the Prefect trap that makes keys change per run); paths must already be store-relative.
    """
    return json.dumps(_canonical(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _canonical(obj: Any) -> Any:
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        # json writes floats with repr, the shortest string that round-trips: the same bits
        # give the same text in every process. NaN and infinity have no JSON form.
        if not math.isfinite(obj):
            raise ValueError(f"cannot version a non-finite float {obj!r}")
        return obj
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _canonical(v) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        raise TypeError("sets have no stable order; use a sorted list in the config")
    if isinstance(obj, PurePath):
        raise TypeError(f"path {obj} must enter a version relative to the store, as a string")
    if isinstance(obj, BaseModel):
        return _canonical(identity_fields(obj))
    raise TypeError(f"cannot version a value of type {type(obj).__name__}: {obj!r}")


def step_version(
    stage: str,
    stage_version: int,
    config: BaseModel,
    input_versions: list[str],
    fingerprint: str | None = None,
) -> str:
    record: dict[str, Any] = {
        "stage": stage,
        "stage_version": stage_version,
        "config": identity_fields(config),
        "inputs": list(input_versions),
    }
    if fingerprint is not None:
        record["fingerprint"] = fingerprint
    return hashlib.sha256(canonical_json(record).encode()).hexdigest()[:VERSION_CHARS]

