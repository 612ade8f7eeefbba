"""Not collected by the suite: tests/test_servers_end.py runs this in a pytest of its own, while
another process holds the Ray lock, to check that waiting for the lock does not count against a
test's timeout (tests/conftest.py ray_lock)."""

from __future__ import annotations

import time

import pytest


@pytest.mark.ray_heavy  # takes the lock exclusively in its setup, after the holder lets go
@pytest.mark.timeout(5)
def test_runs_once_the_lock_is_free():
    time.sleep(1)
