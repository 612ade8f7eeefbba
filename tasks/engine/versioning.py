"""Step versions: the hash that names every output, and the Prefect cache key (tasks/engine/caching.py).

A version is `sha256(canonical_json({stage, stage_version, config identity fields, upstream
versions}))[:12]` (DESIGN.md section 2). Everything that can change an output's bytes enters
it; nothing else does: not the store's location, not worker counts, not the code's commit (that
goes into lineage, where `kiln plan` compares it, so that editing a comment does not fork every
downstream artefact).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path, PurePath
from typing import Any

from pydantic import BaseModel

from training.config import is_identity

VERSION_CHARS = 12


def identity_fields(config: BaseModel) -> dict[str, Any]:
    """The config's fields that can change the output, recursively, as plain JSON values."""
    out: dict[str, Any] = {}
    for name in type(config).model_fields:
        if is_identity(type(config), name):
            out[name] = _identity_value(getattr(config, name))
    return out


def _identity_value(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return identity_fields(value)
    if isinstance(value, (list, tuple)):
        return [_identity_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _identity_value(v) for k, v in value.items()}
    return value


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

