"""`kiln serve` stops within 30 s of SIGTERM even when its Prefect server is already gone, and says
that it could not pause the deployments (Prefect's own pause on shutdown waited forever)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.conftest import REPO, prefect_server_process, stop_group, log_tail, wait_until


def test_serve_exits_on_sigterm_after_its_server_died(tmp_path):
    with prefect_server_process() as (server_env, server):
        env = {**server_env, "PYTHONUNBUFFERED": "1"}
        api = env["PREFECT_API_URL"]
        serve_log = tmp_path / "serve.log"
        with open(serve_log, "ab") as out:
            serve = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", str(REPO / "configs" / "tiny_cpu.yaml"),
                                      "--store", str(tmp_path / "store")], cwd=REPO, env=env, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        try:
            def deployed():
                assert serve.poll() is None, log_tail(serve_log)
                names = {d["name"] for d in httpx.post(f"{api}/deployments/filter", json={}, timeout=5).json()}
                return {"pipeline", "data-refresh", "evaluate"} <= names
            wait_until(deployed, 240, "kiln serve to register its deployments", interval_s=0.5,
                       detail=lambda: log_tail(serve_log))

            stop_group(server, grace_s=0)  # SIGKILL at once: a server that is simply gone
            assert server.poll() is not None
            sent = time.monotonic()
            os.killpg(serve.pid, signal.SIGTERM)
            try:
                serve.wait(timeout=30)
            except subprocess.TimeoutExpired:
                raise AssertionError("kiln serve still running 30 s after SIGTERM:\n" + log_tail(serve_log)) from None
            took = time.monotonic() - sent
            output = serve_log.read_text()
            assert "could not pause the deployments" in output, (serve.returncode, took, output[-3000:])
            assert took < 30
        finally:
            stop_group(serve, grace_s=5)
