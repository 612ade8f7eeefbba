"""Step locks in Redis (run.lock_url): runners that share a store but no lock folder compute each
step once, and a holder killed with SIGKILL blocks nobody past its lease. A real redis-server on a
free 127.0.0.1 port, started and stopped by the test (tests/conftest.py redis_url)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tasks.engine.redis_lock import RedisLockManager
from tests.conftest import REPO, moto_server
from tests.test_scheduler import run_names


HOLD_SCRIPT = textwrap.dedent("""
    import sys, time
    from tasks.engine.redis_lock import RedisLockManager
    assert RedisLockManager(sys.argv[1], lease_s=1.0).acquire_lock("step-x", holder="dying")
    print("HOLDING", flush=True)
    time.sleep(600)
""")


def test_a_lease_is_renewed_while_its_holder_lives_and_ends_when_it_dies(redis_url, tmp_path):
    mine = RedisLockManager(redis_url, lease_s=1.0)
    assert mine.acquire_lock("step-a", holder="me")
    other = RedisLockManager(redis_url, lease_s=1.0)
    assert not other.acquire_lock("step-a", holder="you", acquire_timeout=0)
    time.sleep(3)  # three leases: the renewer keeps it
    assert mine.is_lock_holder("step-a", "me") and not other.acquire_lock("step-a", holder="you", acquire_timeout=0)
    mine.release_lock("step-a", holder="me")
    assert other.acquire_lock("step-a", holder="you", acquire_timeout=0)
    other.release_lock("step-a", holder="you")

    script = tmp_path / "hold.py"
    script.write_text(HOLD_SCRIPT)
    with subprocess.Popen([sys.executable, str(script), redis_url], cwd=REPO, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}) as proc:  # closes its pipe on the way out
        try:
            assert proc.stdout.readline().strip() == "HOLDING"
            assert other.is_locked("step-x")
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            t0 = time.monotonic()
            assert other.acquire_lock("step-x", holder="next", acquire_timeout=10)
            assert time.monotonic() - t0 < 5  # freed within about one lease, not never
            other.release_lock("step-x", holder="next")
        finally:
            proc.kill()


TOY = textwrap.dedent('''
    """Three steps that take a while, for two runners at once."""
    import os
    import time

    from flows.config import RunSettings
    from tasks.engine.step import Step
    from tasks.engine.config import ConfigModel

    RUN = RunSettings(lock_url=os.environ["KILN_TEST_LOCK_URL"], lock_lease_s=5)


    class Toy(ConfigModel):
        name: str


    def work(ctx):
        time.sleep(2)
        (ctx.out / "out.txt").write_text(ctx.config.name)
        return {"name": ctx.config.name}


    def experiment():
        first = Step("first", "toy_lock", 1, Toy(name="first"), work)
        second = Step("second", "toy_lock", 1, Toy(name="second"), work, inputs={"first": first})
        return [Step("third", "toy_lock", 1, Toy(name="third"), work, inputs={"second": second})]
''')


@pytest.fixture
def s3_store():
    """A bucket on an S3-compatible server (moto, tests/conftest.py) on 127.0.0.1; yields
    the store URL and the environment a runner needs to reach it."""
    import s3fs

    with moto_server() as endpoint:
        s3fs.S3FileSystem(endpoint_url=endpoint, key="test", secret="test").mkdir("kiln-locks")
        yield "s3://kiln-locks/store", {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}


def test_two_runners_without_a_shared_lock_folder_compute_each_step_once(redis_url, s3_store, tmp_path):
    experiment = tmp_path / "toy_locks.py"
    experiment.write_text(TOY)
    store, s3_env = s3_store  # a store both runners see; each keeps its caches and lock files in its own
    # KILN_CACHE, as two machines would, so only the Redis lock is shared
    procs = [subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(experiment), "--store", store],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **s3_env, "KILN_TEST_LOCK_URL": redis_url,
                                   "KILN_CACHE": str(tmp_path / f"machine-{i}")})
             for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    rows = [run_names(out) for out, _ in outs]
    for name in ("first", "second", "third"):
        assert sorted(r[name] for r in rows) == ["cached", "ran"], rows


# TOY's kind of step, one of it, slower, under a short lease
SLOW_TOY = (TOY.replace("lock_lease_s=5", "lock_lease_s=1.5").replace("time.sleep(2)", "time.sleep(6)")
            .split("def experiment():")[0]
            + 'def experiment():\n    return [Step("slow", "toy_lease", 1, Toy(name="slow"), work)]\n')
assert "lock_lease_s=1.5" in SLOW_TOY and "time.sleep(6)" in SLOW_TOY


def test_a_runner_that_loses_its_lease_fails_the_step_instead_of_publishing(redis_url, tmp_path):
    """Another runner's id in the lock's key (what a lease that ran out during a stall lets happen)
    while the step computes: the holder's next renewal finds it, and the step fails saying so,
    publishing nothing. The unit: the renewer reports the loss for that key."""
    import redis

    manager = RedisLockManager(redis_url, lease_s=1.0)
    assert manager.acquire_lock("step-lost", holder="me")
    redis.Redis.from_url(redis_url).set("kiln:lock:step-lost", "thief")
    from tasks.engine.redis_lock import lease_lost

    deadline = time.monotonic() + 10
    while lease_lost("step-lost") is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "another runner's" in (lease_lost("step-lost") or "")

    path, store = tmp_path / "slow.py", tmp_path / "store"
    path.write_text(SLOW_TOY)
    env = {**os.environ, "KILN_TEST_LOCK_URL": redis_url}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(path), "--store", str(store)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 120
        while not client.keys("kiln:lock:toy_lease-*") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        (key,) = client.keys("kiln:lock:toy_lease-*")
        client.set(key, "another-runner")
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert run_names(out) == {"slow": "failed"}
    assert "did not publish it" in err and "another runner's" in err
    assert not list(store.glob("toy_lease/*/lineage.json"))


def test_a_lease_that_ran_out_goes_to_exactly_one_runner_and_its_old_holder_cannot_free_it(redis_url):
    """Redis has no takeover code to race: the server itself ends a lease (the key's expiry), taking
    is one SET NX, and release and renewal compare the holder in the same Lua call as they act. So
    two runners that both find a lease gone cannot both take it, and the holder whose lease ran out
    (a long stall) cannot delete its successor's lock on the way out."""
    import threading

    import redis

    client = redis.Redis.from_url(redis_url)
    old = RedisLockManager(redis_url, lease_s=30)
    assert old.acquire_lock("step-stale", holder="stalled")
    client.delete("kiln:lock:step-stale")  # its lease ran out during a stall: the server dropped the key
    start, got = threading.Barrier(2, timeout=30), {}

    def contend(name: str) -> None:
        start.wait()
        got[name] = RedisLockManager(redis_url, lease_s=30).acquire_lock("step-stale", holder=name, acquire_timeout=0)

    threads = [threading.Thread(target=contend, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    (winner,) = [name for name, ok in got.items() if ok]
    assert sorted(got) == ["a", "b"]
    old.release_lock("step-stale", holder="stalled")  # warns; must not delete the winner's lock
    assert client.get("kiln:lock:step-stale") == winner.encode()
    RedisLockManager(redis_url).release_lock("step-stale", holder=winner)
    assert not client.exists("kiln:lock:step-stale")
