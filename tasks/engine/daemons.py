"""The background processes kiln starts (the local Ray's keeper, `kiln server`'s services): who
one is, and what its log says when it fails.

A pid alone does not name a process: once it exits, the system may give the pid to another.
Records of a daemon keep its start time beside its pid, and a check compares both.
"""

from __future__ import annotations

from pathlib import Path

import psutil

_PROC = Path("/proc/self/stat").exists()  # Linux; not macOS


def process_start(pid: int) -> str | None:
    """The start time of a live (not zombie) process, None when it is gone: a pid that was reused
    by a newer process gives a different value. From /proc where there is one (the kernel's own
    count, exact across processes); elsewhere (macOS) from psutil."""
    if not _PROC:
        return _start_from_psutil(pid)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def _start_from_psutil(pid: int) -> str | None:
    """process_start without /proc: the start time the system recorded for the process (on macOS
    the kernel's own timestamp, the same in every process that asks)."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else f"{proc.create_time():.6f}"
    except psutil.Error:
        return None


def log_tail(path: Path | str, chars: int = 3000) -> str:
    """The last `chars` characters of a log, or "(no log yet)": what an error says a process it
    waited on printed last."""
    try:
        return Path(path).read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return "(no log yet)"
