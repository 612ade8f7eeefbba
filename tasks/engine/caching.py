"""The Prefect side of versions: the cache policy whose key is the step version, where Prefect
keeps result records (inside the store), and the lock that makes concurrent runs compute once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import socket
import time
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
from prefect.types._datetime import now, parse_datetime

from tasks.engine import local_ray
from tasks.engine.daemons import process_start

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
    held by a dead process on this host (or past its expiry) counts as free.

    Removing a lock file is the dangerous part: two runners that both read the same stale record
    must not both remove "it", since the second would remove the fresh lock the first had linked
    in its place, and then both would hold the step. So every removal (a takeover, a release)
    happens under an exclusive `flock` of the lock folder and only if the file still holds the
    very bytes that were judged stale (or released): a compare-and-delete. Creation needs no such
    guard: `os.link` is atomic and never replaces a file. `flock` on a folder works between
    processes and threads of one machine, which is what file locks are for (several machines
    share locks through Redis, `run.lock_url`).
    """

    def acquire_lock(self, key, holder, acquire_timeout=None, hold_timeout=None) -> bool:
        self._ensure_lock_files_directory_exists()
        path = self._lock_path_for_key(key)
        deadline = None if acquire_timeout is None else time.monotonic() + acquire_timeout
        while True:
            seen = _read(path)
            if seen is not None:
                info = _parse(seen, path)
                if info["holder"] == holder:
                    self._locks[key] = info
                    return True
                if not _stale(info):
                    left = None if deadline is None else max(deadline - time.monotonic(), 0)
                    if left == 0 or not self.wait_for_lock(key, left):
                        return False
                    continue
                self._remove_if_unchanged(path, seen)
                continue  # free now, unless another runner linked its lock first: look again
            record = _record(holder, hold_timeout)
            private = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
            private.write_bytes(pydantic_core.to_json(record))
            try:
                os.link(private, path)
            except FileExistsError:
                continue  # another runner took it between our read and our link
            finally:
                private.unlink()
            self._locks[key] = {**record, "expiration": _expiry(record), "path": path}
            return True

    async def aacquire_lock(self, key, holder, acquire_timeout=None, hold_timeout=None) -> bool:
        return self.acquire_lock(key, holder, acquire_timeout, hold_timeout)

    def wait_for_lock(self, key: str, timeout: float | None = None) -> bool:
        """Prefect's wait (None or 0: without end), which a stop of this run (Ctrl-C, SIGTERM) ends."""
        deadline = time.monotonic() + timeout if timeout else None
        while self.is_locked(key):
            local_ray.raise_if_stopping(f"another run's {key}")
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def is_locked(self, key: str, use_cache: bool = False) -> bool:
        """Whether a live holder has the lock. A stale lock counts as free but is left in place:
        only `acquire_lock` removes it, by compare-and-delete."""
        seen = _read(self._lock_path_for_key(key))
        if seen is None:
            self._locks.pop(key, None)
            return False
        info = _parse(seen, self._lock_path_for_key(key))
        self._locks[key] = info
        return not _stale(info)

    def release_lock(self, key: str, holder: str) -> None:
        path = self._lock_path_for_key(key)
        seen = _read(path)
        if seen is None or _parse(seen, path)["holder"] != holder:
            raise ValueError(f"No lock held by {holder} for the step with cache key {key}")
        self._remove_if_unchanged(path, seen)
        self._locks.pop(key, None)

    def _remove_if_unchanged(self, path: Path, seen: bytes) -> bool:
        """Delete the lock file at `path` if it still holds exactly `seen`; True if it did."""
        with _folder_locked(self.lock_files_directory):
            if _read(path) != seen:
                return False
            path.unlink()
            return True


def _record(holder: str, hold_timeout: float | None) -> dict:
    expiration = now("UTC") + timedelta(seconds=hold_timeout) if hold_timeout is not None else None
    return {"holder": holder, "expiration": str(expiration) if expiration else None,
            "host": socket.gethostname(), "pid": os.getpid(), "started": process_start(os.getpid())}


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _parse(raw: bytes, path: Path) -> dict:
    info = pydantic_core.from_json(raw)
    return {**info, "expiration": _expiry(info), "path": path}


def _expiry(info: dict):
    return parse_datetime(info["expiration"]) if info.get("expiration") else None


def _stale(info: dict) -> bool:
    """A lock whose holder process died on this host, or whose expiry passed."""
    dead_holder = (info.get("host") == socket.gethostname() and info.get("pid") is not None
                   and not _alive(info["pid"], info.get("started")))
    expired = info.get("expiration") is not None and info["expiration"] < now("UTC")
    return dead_holder or expired


@contextlib.contextmanager
def _folder_locked(folder: Path):
    """An exclusive `flock` of `folder` itself (no file of its own to leave behind)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the flock


def _alive(pid: int, started: str | None = None) -> bool:
    """Whether the holder `pid` still runs. Where the record has its start time, a process with the
    same pid but another start time is not the holder: pids are reused, and a container's restart
    hands the low ones out again. Records written before kiln kept the start time go by the pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return started is None or process_start(pid) in (started, None)
