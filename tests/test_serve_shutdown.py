"""`kiln serve` stops within 30 s of SIGTERM even when its Prefect server is already gone, and says
that it could not pause the deployments (Prefect's own pause on shutdown waited forever); a second
SIGTERM while it pauses does not cut the pause short."""

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


# `kiln serve` whose pause takes 5 s before it starts (a server slow to answer), so that a second
# SIGTERM surely lands in the middle of it; everything else is the real CLI and Prefect.
SLOW_PAUSE = """
import sys, time
import deployments.serve
from flows.cli import main

real_pause = deployments.serve.pause

def pause_slowly(*args):
    time.sleep(5)
    return real_pause(*args)

deployments.serve.pause = pause_slowly
sys.exit(main(sys.argv[1:]))
"""


def test_a_second_sigterm_while_pausing_waits_for_the_pause(tmp_path, prefect_server):
    """CI once saw `kiln serve` exit 0 right after Prefect's "SIGTERM received" line, without the
    pause's message and with the schedules left active. This is a way to that ending: Prefect's
    SIGTERM handler, still installed once serving has ended, calls sys.exit(0) in the middle of
    kiln's pause unless kiln's wrapper holds it off."""
    env = {**prefect_server, "PYTHONUNBUFFERED": "1"}
    serve_log = tmp_path / "serve.log"
    with open(serve_log, "ab") as out:
        serve = subprocess.Popen([sys.executable, "-c", SLOW_PAUSE, "serve", str(REPO / "configs" / "tiny_cpu.yaml"),
                                  "--store", str(tmp_path / "store")], cwd=REPO, env=env, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def said(text):
            assert serve.poll() is None, log_tail(serve_log)
            return text in serve_log.read_text()
        wait_until(lambda: said("kiln serve: serving"), 240, "kiln serve to serve", interval_s=0.2,
                   detail=lambda: log_tail(serve_log))
        os.killpg(serve.pid, signal.SIGTERM)
        wait_until(lambda: said("pausing the schedules"), 60, "kiln serve to stop serving", interval_s=0.1,
                   detail=lambda: log_tail(serve_log))
        os.killpg(serve.pid, signal.SIGTERM)  # within the 5 s before the pause itself runs
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError("kiln serve still running 30 s after SIGTERM:\n" + log_tail(serve_log)) from None
        output = serve_log.read_text()
        assert "SIGTERM while pausing the schedules" in output, output[-3000:]
        assert "kiln serve: paused the schedules of pipeline/pipeline" in output, output[-3000:]
        assert serve.returncode == 0, (serve.returncode, output[-3000:])
        deployments = httpx.post(f"{prefect_server['PREFECT_API_URL']}/deployments/filter", json={}, timeout=5).json()
        assert {d["name"]: d["paused"] for d in deployments} == {"pipeline": True, "data-refresh": True,
                                                                  "evaluate": True}
    finally:
        stop_group(serve, grace_s=5)
