"""The Prefect side of versions: the cache policy whose key is the step version, where Prefect
keeps result records (inside the store), and the lock that makes concurrent runs compute once.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from prefect.cache_policies import CachePolicy
from prefect.locking.filesystem import FileSystemLockManager
from prefect.transactions import IsolationLevel

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
