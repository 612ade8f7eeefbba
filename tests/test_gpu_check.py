"""The one-shot GPU check (benchmarks/gpu_check.sh) keeps working between the sessions that are
lent a GPU: its CPU dry run goes through the same script, the same configs and the same kiln and
bare-JAX loops on tiny models, and must print every line the GPU run is read for."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


# 2-4 min of a fast-suite worker for a script only a lent GPU runs: CI runs it in its `ci` stage
@pytest.mark.slow
@pytest.mark.ci
def test_gpu_check_dry_run_on_cpu():
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "cpu"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    small, medium = out.index("small_gpu:"), out.index("medium_gpu:")
    assert small < medium
    for block in (out[small:medium], out[medium:]):  # each preset's own lines
        assert re.search(r"MFU \d+\.\d%", block), block
        assert re.search(r"kiln / bare = \d+\.\d{3}", block), block
        assert "same parameter hash in two runs: yes" in block, block
    assert "bfloat16" in out and "(16 microbatches)" in out and "(8 microbatches)" in out
    assert "gpu check passed" in out
