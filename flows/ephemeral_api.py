"""Prefect's ephemeral API server for one kiln process, which ends when that process is done with it.

A stop meant for a whole job reaches every process in it: systemd's `systemctl stop` (its default
KillMode) and Slurm's `scancel` or time limit send SIGTERM to every process of the unit or job.
The server stopped at once, and the run could no longer record how it ended: Prefect's client
retried the dead API for minutes. So here SIGINT and SIGTERM wait, blocked, for as long as kiln
holds its end of this process's stdin open; when kiln closes it (at exit, `flows/cli.py`) or dies,
the server takes them again and stops as uvicorn stops on SIGTERM. The other signals that stop a
run (SIGUSR1 and SIGUSR2: a batch scheduler's warning that the job's time is nearly up) are
kiln's to act on, and ignored here. Run as Prefect runs uvicorn:
`python -m flows.ephemeral_api <uvicorn's arguments>`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import uvicorn.main

from tasks.engine.local_ray import STOP_SIGNALS

STOPS = {signal.SIGINT, signal.SIGTERM}  # uvicorn stops on them: once kiln is done with the server


def _stop_when_kiln_is_done() -> None:
    sys.stdin.buffer.read()  # end of file: kiln closed it, or kiln is gone
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # this thread alone takes them: a pending one arrives now
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    for sig in set(STOP_SIGNALS) - STOPS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # and in every thread started from here on
    threading.Thread(target=_stop_when_kiln_is_done, name="stop-when-kiln-is-done", daemon=True).start()
    try:
        uvicorn.main.main()
    finally:
        # uvicorn raises the SIGTERM it stopped on again as it returns, to end the process as that
        # signal would have: it waits, blocked, in this thread until now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)


if __name__ == "__main__":
    main()
