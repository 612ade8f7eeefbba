"""Step versions, and the Prefect cache policy that makes the version the cache key.

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
import os
import socket
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from prefect.cache_policies import CachePolicy
from prefect.locking.filesystem import FileSystemLockManager
from prefect.transactions import IsolationLevel
from pydantic import BaseModel

from training.config import is_identity

if TYPE_CHECKING:
    from tasks.store import Store

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


# --- Prefect side -----------------------------------------------------------------------------


def result_storage(store: "Store"):
    """Where Prefect keeps step result records: inside the store, so a copied store keeps its hits."""
    if store.is_local:
        return store.local_root / ".prefect-results"
    from prefect.filesystems import RemoteFileSystem

    return RemoteFileSystem(basepath=f"{store.root}/.prefect-results")


def step_cache_policy(store: "Store"):
    """The cache policy for every kiln step: key `<stage>-<version>`, serializable, locked.

    The key is passed in as the task's `cache_key` argument, so Prefect's input hashing (which
    falls back to cloudpickle and differs per process) is never used.
    """
    # No `key_storage`: Prefect then writes metadata and value as one record in the task's
    # result storage (`result_storage` below), which a copied store carries along whole.
    return StepVersionPolicy().configure(
        lock_manager=StaleAwareLockManager(store.local_root / ".prefect-locks"),
        isolation_level=IsolationLevel.SERIALIZABLE,
    )


@dataclass
class StepVersionPolicy(CachePolicy):
    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs):
        return inputs["cache_key"]


class StaleAwareLockManager(FileSystemLockManager):
    """Prefect's file lock manager, plus: a lock whose holder process died is released.

    Prefect's lock files have no expiry by default, so a runner killed with SIGKILL would leave
    every later run of that step waiting forever. We record host and pid beside the holder and
    treat a lock held by a dead process on this host as free.
    """

    def acquire_lock(self, key, holder, acquire_timeout=None, hold_timeout=None) -> bool:
        acquired = super().acquire_lock(key, holder, acquire_timeout, hold_timeout)
        if acquired:
            path = self._lock_path_for_key(key)
            info = json.loads(path.read_bytes())
            info.update(host=socket.gethostname(), pid=os.getpid())
            path.write_text(json.dumps(info))
        return acquired

    def is_locked(self, key: str, use_cache: bool = False) -> bool:
        info = self._get_lock_info(key, use_cache=use_cache)
        if info is not None and info.get("host") == socket.gethostname():
            pid = info.get("pid")
            if pid is not None and not _alive(pid):
                Path(info["path"]).unlink(missing_ok=True)
                self._locks.pop(key, None)
                return False
        return super().is_locked(key, use_cache=use_cache)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
