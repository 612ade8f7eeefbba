"""`kiln serve` stops within 30 s of SIGTERM even when its Prefect server is already gone, and says
that it could not pause the deployments (Prefect's own pause on shutdown waited forever)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.conftest import REPO, free_port, stop_group
from tests.test_deployments import wait_for


def test_serve_exits_on_sigterm_after_its_server_died(tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_API_URL": api, "PREFECT_API_URL": api, "PYTHONUNBUFFERED": "1"}
    server_log, serve_log = open(tmp_path / "server.log", "w"), open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], env=env, stdout=server_log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    serve = None
    try:
        def healthy():
            try:
                return httpx.get(f"{api}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        wait_for(healthy, 180, "the Prefect server")
        serve = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", str(REPO / "configs" / "tiny_cpu.yaml"),
                                  "--store", str(tmp_path / "store")], cwd=REPO, env=env, stdout=serve_log,
                                 stderr=subprocess.STDOUT, start_new_session=True)

        def deployed():
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            names = {d["name"] for d in httpx.post(f"{api}/deployments/filter", json={}, timeout=5).json()}
            return {"pipeline", "data-refresh", "evaluate"} <= names
        wait_for(deployed, 240, "kiln serve to register its deployments")

        stop_group(server, grace_s=0)  # SIGKILL at once: a server that is simply gone
        assert server.poll() is not None
        sent = time.monotonic()
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError("kiln serve still running 30 s after SIGTERM:\n"
                                 + (tmp_path / "serve.log").read_text()[-3000:]) from None
        took = time.monotonic() - sent
        output = (tmp_path / "serve.log").read_text()
        assert "could not pause the deployments" in output, (serve.returncode, took, output[-3000:])
        assert took < 30
    finally:
        for proc in (serve, server):
            if proc is not None:
                stop_group(proc, grace_s=5)
        server_log.close()
        serve_log.close()
