"""The Prefect side of versions: the cache policy whose key is the step version, where Prefect
keeps result records (inside the store), and the lock that makes concurrent runs compute once.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import pydantic_core
from prefect.cache_policies import CachePolicy
from prefect.locking.filesystem import FileSystemLockManager
from prefect.transactions import IsolationLevel
from prefect.types._datetime import now

if TYPE_CHECKING:
    from tasks.engine.store import Store



def result_storage(store: "Store"):
    """Where Prefect keeps step result records: inside the store, so a copied store keeps its hits."""
    if store.is_local:
        return store.local_root / ".prefect-results"
    return _remote_results_block(store.root)


@lru_cache(maxsize=None)
def _remote_results_block(root: str):
    """Prefect accepts remote result storage only as a block saved on its API."""
    from prefect.filesystems import RemoteFileSystem

    block = RemoteFileSystem(basepath=f"{root}/.prefect-results")
    block.save(f"kiln-results-{hashlib.sha256(root.encode()).hexdigest()[:12]}", overwrite=True)
    return block


def step_cache_policy(store: "Store", lock_url: str | None = None, lease_s: float = 30.0):
    """The cache policy for every kiln step: key `<stage>-<version>`, serializable, locked.

    The key is passed in as the task's `cache_key` argument, so Prefect's input hashing (which
    falls back to cloudpickle and differs per process) is never used.
    """
    # No `key_storage`: Prefect then writes metadata and value as one record in the task's
    # result storage (`result_storage` below), which a copied store carries along whole.
    return StepVersionPolicy().configure(
        lock_manager=lock_manager(store, lock_url, lease_s),
        isolation_level=IsolationLevel.SERIALIZABLE,
    )


def lock_manager(store: "Store", lock_url: str | None = None, lease_s: float = 30.0):
    """Step locks: files beside the store's local root (one machine), or Redis at `lock_url`
    (every machine that uses the same server; tasks/engine/redis_lock.py)."""
    if lock_url:
        from tasks.engine.redis_lock import RedisLockManager

        return RedisLockManager(lock_url, lease_s)
    return StaleAwareLockManager(store.local_root / ".prefect-locks")


@dataclass
class StepVersionPolicy(CachePolicy):
    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs):
        return inputs["cache_key"]


class StaleAwareLockManager(FileSystemLockManager):
    """Prefect's file lock manager, made safe for several processes, plus: a lock whose holder
    process died is released.

    Prefect's own manager creates the lock file empty and writes its JSON afterwards, so a second
    process that reads it in between fails the step with "EOF while parsing a value" (seen in CI
    with two `kiln run`s on one store). Here the JSON is written to a private file first and
    linked into place, which either creates the complete lock file or fails because one exists.
    Lock files have no expiry by default, so a runner killed with SIGKILL would leave every later
    run of that step waiting forever: host and pid are recorded beside the holder, and a lock
    held by a dead process on this host counts as free.
    """

    def acquire_lock(self, key, holder, acquire_timeout=None, hold_timeout=None) -> bool:
        self._ensure_lock_files_directory_exists()
        path = self._lock_path_for_key(key)
        while True:
            if self.is_locked(key) and not self.is_lock_holder(key, holder):
                if not self.wait_for_lock(key, acquire_timeout):
                    return False
            expiration = now("UTC") + timedelta(seconds=hold_timeout) if hold_timeout is not None else None
            record = {"holder": holder, "expiration": str(expiration) if expiration else None,
                      "host": socket.gethostname(), "pid": os.getpid()}
            private = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
            private.write_bytes(pydantic_core.to_json(record))
            try:
                os.link(private, path)
            except FileExistsError:
                if self.is_lock_holder(key, holder):
                    return True
                continue  # another runner took it between our check and our link: wait again
            finally:
                private.unlink()
            self._locks[key] = {**record, "expiration": expiration, "path": path}
            return True

    async def aacquire_lock(self, key, holder, acquire_timeout=None, hold_timeout=None) -> bool:
        return self.acquire_lock(key, holder, acquire_timeout, hold_timeout)

    def is_locked(self, key: str, use_cache: bool = False) -> bool:
        info = self._get_lock_info(key, use_cache=use_cache)
        if info is None:
            return False
        dead_holder = (info.get("host") == socket.gethostname() and info.get("pid") is not None
                       and not _alive(info["pid"]))
        expired = info.get("expiration") is not None and info["expiration"] < now("UTC")
        if dead_holder or expired:
            # Two runners may both see the stale lock: whichever unlinks second finds it gone.
            Path(info["path"]).unlink(missing_ok=True)
            self._locks.pop(key, None)
            return False
        return True

    def release_lock(self, key: str, holder: str) -> None:
        if not self.is_lock_holder(key, holder):
            raise ValueError(f"No lock held by {holder} for the step with cache key {key}")
        Path(self._lock_path_for_key(key)).unlink(missing_ok=True)
        self._locks.pop(key, None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
