"""Accelerator slots: a step that trains holds slots of a named limit for as long as it runs.

A team's runs share the GPUs of its machines. `resources.slots: gpu` makes a train, SFT or DPO
step take `hosts x gpus_per_host` slots (one per host where it asks for no GPU) of the limit
`gpu`, whose size `run.slot_limits` gives, before it starts and give them back when it ends,
whichever way it ends; a step that finds too few free waits, and says so in its log and in its
Prefect state (`Waiting for slots`), until they are. Slots are taken all at once or not at all,
so two steps that each want half never deadlock holding a quarter each.

Two back ends, one behaviour:
- Redis (`run.lock_url`), for runners on several machines: a limit is the sorted set
  `kiln:slots:<name>`, one member per held slot scored by the expiry of its lease. One Lua script
  drops expired members and adds the request's only if they fit. A thread renews the lease every
  third of it while the step runs; a holder killed with SIGKILL (or a machine that dies) stops
  renewing, and its slots are free one lease (`run.lock_lease_s`) later.
- Files, without a lock URL (one machine): slot i of a limit is the file `<dir>/<name>/<i>`, held
  by an exclusive `flock`; the kernel lets go of it when the holder dies, however it dies.

The size of a limit is recorded beside it at first use (`kiln:slots:<name>:size`, `<dir>/<name>/size`):
a config that gives another size is an error naming both, since two sizes for one set of GPUs
would let the larger double-book them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

from pydantic import BaseModel

from tasks.engine import local_ray

DIR_ENV = "KILN_SLOTS_DIR"  # the file back end's folder (default: one per user in the temp folder)
REPORT_S = 30.0  # how often a waiting step says it still waits
POLL_S = 0.5

# KEYS[1] the limit; ARGV: now (ms), expiry (ms), size, then the members to add. Adds them all
# only if, once expired members are dropped, they fit; returns 1 if it did, else 0.
TAKE = """
redis.call('zremrangebyscore', KEYS[1], '-inf', ARGV[1])
local wanted = #ARGV - 3
if redis.call('zcard', KEYS[1]) + wanted > tonumber(ARGV[3]) then return 0 end
for i = 4, #ARGV do redis.call('zadd', KEYS[1], ARGV[2], ARGV[i]) end
return 1
"""
# KEYS[1] the limit; ARGV: expiry (ms), then the members. Extends those still held; returns how many.
RENEW = """
local held = 0
for i = 2, #ARGV do
  if redis.call('zscore', KEYS[1], ARGV[i]) then redis.call('zadd', KEYS[1], 'XX', ARGV[1], ARGV[i]); held = held + 1 end
end
return held
"""


def wanted(config: BaseModel) -> tuple[str, int] | None:
    """(limit, slots) a step's config asks for: its `resources.slots`, hosts x GPUs per host
    (hosts where it asks for no GPU); None when it names no limit."""
    resources = getattr(config, "resources", None)
    name = getattr(resources, "slots", None)
    if not name:
        return None
    return name, resources.hosts * (resources.gpus_per_host or 1)


@contextlib.contextmanager
def held(name: str, count: int, limits: dict[str, int], lock_url: str | None, lease_s: float,
         log: logging.Logger, on_wait: Callable[[bool], None] = lambda waiting: None) -> Iterator[None]:
    """Hold `count` slots of limit `name` for the duration of the block. `on_wait(True)` is called
    once the step has to wait, `on_wait(False)` once it has its slots after waiting."""
    if name not in limits:
        raise ValueError(f"resources.slots names the limit {name!r}, but run.slot_limits gives no size for it: "
                         f"add `slot_limits: {{{name}: N}}` under run (N: the slots there are, e.g. the GPUs)")
    size = limits[name]
    if count > size:
        raise ValueError(f"this step needs {count} slot(s) of {name!r} (hosts x gpus_per_host), but the limit has "
                         f"{size} (run.slot_limits): it could never run; lower resources or raise the limit")
    pool = RedisSlots(lock_url, name, size, lease_s) if lock_url else FileSlots(name, size)
    start, reported, waiting = time.monotonic(), None, False
    while not pool.take(count):
        local_ray.raise_if_stopping(f"{count} slot(s) of {name!r}, which other steps hold")
        now = time.monotonic()
        if reported is None or now - reported >= REPORT_S:
            log.info("waiting for %d slot(s) of %r (limit %d, %s): other steps hold them; waited %.0f s",
                     count, name, size, pool.where, now - start)
            reported = now
        if not waiting:
            waiting = True
            on_wait(True)
        time.sleep(POLL_S)
    if waiting:
        on_wait(False)
        log.info("took %d slot(s) of %r after %.0f s", count, name, time.monotonic() - start)
    try:
        yield
    finally:
        lost = pool.release()
        if lost:
            log.error("%d slot(s) of %r were no longer this step's when it ended (their lease ran out: "
                      "raise run.lock_lease_s if a holder can stall that long): another step may have run "
                      "beside it", lost, name)


class FileSlots:
    """Slots as files held by `flock`, on this machine."""

    def __init__(self, name: str, size: int):
        root = Path(os.environ.get(DIR_ENV) or Path(tempfile.gettempdir()) / f"kiln-slots-{os.getuid()}")
        self.folder = root / name
        self.folder.mkdir(parents=True, exist_ok=True)
        self.where = f"slot files in {self.folder}"
        _same_size(self.folder / "size", name, size)
        self.size, self.fds = size, []

    def take(self, count: int) -> bool:
        fds = []
        for i in range(self.size):
            fd = os.open(self.folder / str(i), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            fds.append(fd)
            if len(fds) == count:
                self.fds = fds
                return True
        for fd in fds:  # too few free: hold none of them while waiting
            os.close(fd)
        return False

    def release(self) -> int:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        return 0  # a flock is never lost while its holder lives


def _same_size(path: Path, name: str, size: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        recorded = int(path.read_text() or size)
        if recorded != size:
            raise ValueError(f"the slot limit {name!r} has {recorded} slots here ({path}), but run.slot_limits "
                             f"says {size}: give every config that shares it the same size") from None
        return
    with os.fdopen(fd, "w") as f:
        f.write(str(size))


class RedisSlots:
    """Slots as members of a sorted set in Redis, each scored by its lease's expiry."""

    def __init__(self, url: str, name: str, size: int, lease_s: float):
        from tasks.engine.redis_lock import _client

        self.client, self.key = _client(url), f"kiln:slots:{name}"
        self.where = f"Redis at {url}, key {self.key}"
        self.size, self.lease_ms = size, int(lease_s * 1000)
        self.members: list[str] = []
        self.stop = threading.Event()
        self.lost = 0
        recorded = self._call(lambda: self.client.set(f"{self.key}:size", size, nx=True) or
                              self.client.get(f"{self.key}:size"))
        if recorded is not True and int(recorded) != size:
            raise ValueError(f"the slot limit {name!r} has {int(recorded)} slots in {self.where}:size, but "
                             f"run.slot_limits says {size}: give every config that shares it the same size")

    def _call(self, fn):
        import redis

        try:
            return fn()
        except redis.ConnectionError as e:
            raise ConnectionError(f"cannot reach the slot server at {self.where} (run.lock_url): {e}") from e

    def take(self, count: int) -> bool:
        holder = uuid.uuid4().hex
        members = [f"{holder}:{i}" for i in range(count)]
        now = int(time.time() * 1000)
        if not self._call(lambda: self.client.eval(TAKE, 1, self.key, now, now + self.lease_ms, self.size, *members)):
            return False
        self.members = members
        threading.Thread(target=self._renew, name="kiln-slot-renewer", daemon=True).start()
        return True

    def _renew(self) -> None:
        import redis

        while not self.stop.wait(self.lease_ms / 3000):
            try:
                expiry = int(time.time() * 1000) + self.lease_ms
                held = self.client.eval(RENEW, 1, self.key, expiry, *self.members)
            except redis.RedisError:  # tried again next round; the lease covers a few misses
                continue
            self.lost = len(self.members) - held

    def release(self) -> int:
        self.stop.set()
        if self.members:
            self._call(lambda: self.client.zrem(self.key, *self.members))
        return self.lost
