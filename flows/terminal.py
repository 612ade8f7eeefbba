"""What kiln prints in a terminal: rich tables, and a progress bar per running step while `kiln run`
works. Piped to a file or another program (CI, tests), the same tables are plain aligned text and
the run's progress is its log lines, as before.

"A terminal" means the stream itself is one (`isatty`), never rich's guesses from FORCE_COLOR or
TTY_COMPATIBLE: what a script reads from a pipe must not change with the environment.
"""

from __future__ import annotations

import contextlib
import logging
import sys

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

STATUS_STYLES = {"ran": "green", "cached": "cyan", "failed": "bold red", "not run": "yellow", "done": "cyan",
                 "running": "magenta", "missing": "dim"}


SHORT = 24  # characters: a column no wider than this never wraps


def stdout_console() -> Console:
    return Console(force_terminal=sys.stdout.isatty())


def table(header: list[str], rows: list[list]) -> str:
    """Plain text, one row per line, columns aligned with spaces, a dashed line under the header."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def rich_table(header: list[str], rows: list[list], status_column: str | None = None) -> Table:
    """The same table for a terminal: ruled, the header bold, a status column (`ran`, `cached`,
    `failed`, ...) coloured by its value. Short columns (names, versions, numbers) stay on one
    line; in the others a cell too long for the screen wraps and folds onto more lines, never
    cut short: a path must stay whole to be copied."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    t = Table(*(Column(h, no_wrap=w <= SHORT, overflow="fold") for h, w in zip(header, widths)), header_style="bold")
    status = header.index(status_column) if status_column in header else None
    for row in rows:
        cells = [str(c) for c in row]
        if status is not None:
            style = STATUS_STYLES.get(cells[status])
            cells[status] = f"[{style}]{cells[status]}[/]" if style else cells[status]
        t.add_row(*cells)
    return t


def print_table(header: list[str], rows: list[list], status_column: str | None = None,
                console: Console | None = None) -> None:
    """`rich_table` on a terminal, `table` anywhere else (to stdout unless `console` says)."""
    console = console or stdout_console()
    if console.is_terminal:
        console.print(rich_table(header, rows, status_column))
    else:
        console.file.write(table(header, rows) + "\n")


class StepBars:
    """A bar per running step (a tasks.engine.runner.StepWatcher): training steps or shards done of
    the total as the step reports them, a pulsing bar for a step that reports none. Safe to call
    from the threads steps run in (rich's Progress takes its own lock)."""

    def __init__(self, bars: Progress):
        self.bars = bars
        self.ids: dict[str, int] = {}  # step key -> its bar

    def started(self, step) -> None:
        self.ids[step.key] = self.bars.add_task(f"{step.name} {step.version}", total=None, count="")

    def progress(self, step, done: int, total: int) -> None:
        self.bars.update(self.ids[step.key], completed=done, total=total, count=f"{done}/{total}")

    def ended(self, step) -> None:
        self.bars.remove_task(self.ids.pop(step.key))


@contextlib.contextmanager
def step_bars(console: Console | None = None, share_stderr: bool | None = None):
    """While the block runs, a bar per running step at the bottom of `console` (stdout) if it is a
    terminal; nothing otherwise.

    Log lines (Prefect's console handler, any stream handler) and prints meant for the terminal
    the bars are drawn on go through rich's Live console, which prints them above the bars, so
    the two never overwrite each other, also with several steps logging at once. stderr counts as
    that terminal when it is one too (`share_stderr`; default: `sys.stderr.isatty()`); a stderr
    sent to a file keeps getting its log lines unchanged."""
    from tasks.engine.runner import watching

    console = console or stdout_console()
    if not console.is_terminal:
        yield
        return
    share_stderr = sys.stderr.isatty() if share_stderr is None else share_stderr
    bars = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                    TimeElapsedColumn(), console=console, transient=True, redirect_stdout=True,
                    redirect_stderr=share_stderr)
    with bars:  # replaces sys.stdout (and, sharing, sys.stderr) with rich's proxies
        proxies = {getattr(proxy, "rich_proxied_file", None): proxy for proxy in (sys.stdout, sys.stderr)}
        proxies.pop(None, None)
        with _handlers_writing_to(proxies), watching(StepBars(bars)):
            yield


@contextlib.contextmanager
def _handlers_writing_to(proxies: dict):
    """Every logging stream handler that writes to one of `proxies`' streams writes to its proxy
    for the block. Prefect's console handler prints through a rich Console of its own, holding
    the stream it was made with; a Console given rich's proxy as its file unwraps it and writes
    past the bars, so that Console gets the proxy behind a plain file (`_Into`)."""
    moved = []
    for handler in _stream_handlers():
        proxy = proxies.get(handler.stream)
        if proxy is not None:
            moved.append((handler, handler.setStream(proxy)))
            if hasattr(handler, "console"):
                handler.console.file = _Into(proxy)
    try:
        yield
    finally:
        for handler, stream in moved:
            handler.setStream(stream)
            if hasattr(handler, "console"):
                handler.console.file = stream


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    seen: dict[int, logging.StreamHandler] = {}
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                seen[id(h)] = h
    return list(seen.values())


class _Into:
    """A file whose writes go into rich's proxy, and which rich does not recognise as one."""

    def __init__(self, proxy):
        self.proxy = proxy
        self.encoding = getattr(proxy, "encoding", "utf-8")

    def write(self, text: str) -> int:
        return self.proxy.write(text)

    def flush(self) -> None:
        self.proxy.flush()

    def isatty(self) -> bool:
        return self.proxy.isatty()

    def fileno(self) -> int:
        return self.proxy.fileno()
