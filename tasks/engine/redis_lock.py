"""Step locks in Redis, so that runners on different machines compute each step once.

The file locks of tasks/engine/caching.py live on the runner's own disk: two machines that share a
store (a `gs://` bucket) would not see each other's. With `run.lock_url: redis://HOST:PORT/DB`
every step's lock is a Redis key instead, `kiln:lock:<stage>-<version>`, holding its holder's id.

A lock is a lease: it is set with an expiry (`lease_s`) that a thread of the holding process
renews every third of the lease for as long as it holds the lock. A holder killed with SIGKILL (or
a machine that dies) stops renewing, so its lock is gone one lease later and the next runner takes
the step; a live holder keeps its lock through a training step of any length. Release deletes the
key only if this holder still owns it (compare-and-delete in one Lua script), so a holder whose
lease ran out cannot release someone else's lock.

It implements Prefect's `LockManager` protocol, so Prefect's SERIALIZABLE transactions use it the
way they use the file lock manager: the second runner waits, then finds the first one's record.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import lru_cache

import redis
from prefect.locking.protocol import LockManager

from tasks.engine import local_ray

log = logging.getLogger("kiln.locks")
PREFIX = "kiln:lock:"
POLL_S = 0.2

# KEYS[1]: the lock; ARGV[1]: the holder. Delete (or extend by ARGV[2] ms) only our own lock.
RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"


@lru_cache(maxsize=None)
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=10)


class RedisLockManager(LockManager):
    def __init__(self, url: str, lease_s: float = 30.0):
        self.url, self.lease_ms = url, int(lease_s * 1000)
        self.client = _client(url)

    def __reduce__(self):  # a picklable description; the connection is made anew
        return (RedisLockManager, (self.url, self.lease_ms / 1000))

    def acquire_lock(self, key: str, holder: str, acquire_timeout: float | None = None,
                     hold_timeout: float | None = None) -> bool:
        deadline = None if acquire_timeout is None else time.monotonic() + acquire_timeout
        while True:
            try:
                taken = self.client.set(PREFIX + key, holder, nx=True, px=self.lease_ms)
            except redis.ConnectionError as e:
                raise ConnectionError(f"cannot reach the step lock server at {self.url} (run.lock_url): {e}") from e
            if taken:
                _renewer.hold(self, key, holder)
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            local_ray.raise_if_stopping(f"another run's {key}")
            time.sleep(POLL_S)

    async def aacquire_lock(self, key: str, holder: str, acquire_timeout: float | None = None,
                            hold_timeout: float | None = None) -> bool:
        return self.acquire_lock(key, holder, acquire_timeout, hold_timeout)

    def release_lock(self, key: str, holder: str) -> None:
        _renewer.drop(self, key)
        if not self.client.eval(RELEASE, 1, PREFIX + key, holder):
            # The output is published by now; failing the step for it would lose nothing but the run.
            log.warning("the lock of %s was no longer %s's (its lease ran out while it ran): raise "
                        "run.lock_lease_s if the holder can stall that long", key, holder)

    def is_locked(self, key: str) -> bool:
        return bool(self.client.exists(PREFIX + key))

    def is_lock_holder(self, key: str, holder: str) -> bool:
        owner = self.client.get(PREFIX + key)
        return owner is not None and owner.decode() == holder

    def wait_for_lock(self, key: str, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_locked(key):
            local_ray.raise_if_stopping(f"another run's {key}")
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    async def await_for_lock(self, key: str, timeout: float | None = None) -> bool:
        return self.wait_for_lock(key, timeout)


class _Renewer:
    """One daemon thread per process that extends every lease this process holds."""

    def __init__(self):
        self.held: dict[tuple[str, str], tuple[RedisLockManager, str]] = {}
        self.failing_since: dict[tuple[str, str], float] = {}  # renewals failing since (monotonic)
        self.lost: dict[str, str] = {}  # step key -> why this process no longer holds its lock
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def hold(self, manager: RedisLockManager, key: str, holder: str) -> None:
        with self.lock:
            self.held[(manager.url, key)] = (manager, holder)
            self.lost.pop(key, None)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="kiln-lock-renewer", daemon=True)
                self.thread.start()

    def drop(self, manager: RedisLockManager, key: str) -> None:
        with self.lock:
            self.held.pop((manager.url, key), None)

    def _run(self) -> None:
        while True:
            with self.lock:
                held = list(self.held.items())
            interval = min([m.lease_ms for _, (m, _) in held] or [3000]) / 3000
            for (url, key), (manager, holder) in held:
                why = None
                try:
                    if manager.client.eval(RENEW, 1, PREFIX + key, holder, manager.lease_ms):
                        self.failing_since.pop((url, key), None)
                    else:
                        why = "its lease had run out and the key was gone or another runner's"
                except redis.RedisError as e:  # retried next round, until the lease would have run out
                    since = self.failing_since.setdefault((url, key), time.monotonic())
                    log.warning("could not renew the lock of %s at %s: %s", key, url, e)
                    if time.monotonic() - since >= manager.lease_ms / 1000:
                        why = f"renewing it failed for a whole lease ({manager.lease_ms / 1000:g} s): {e}"
                if why is not None:
                    with self.lock:
                        self.held.pop((url, key), None)
                        self.failing_since.pop((url, key), None)
                        self.lost[key] = f"the lock of {key} at {url} was lost: {why}"
                    log.error("%s", self.lost[key])
            time.sleep(interval)


_renewer = _Renewer()


def lease_lost(key: str) -> str | None:
    """Why this process lost the Redis lock of step `key` while holding it, or None: a runner that
    lost its lock must not publish, since another runner may be computing the same step."""
    with _renewer.lock:
        return _renewer.lost.get(key)
