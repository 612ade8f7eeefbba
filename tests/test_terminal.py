"""What `kiln run` prints: plain aligned tables when piped, rich tables and a bar per running step
on a terminal, with Prefect's log lines printed above the bars while several steps run at once."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import threading

from prefect import flow
from prefect.logging.handlers import PrefectConsoleHandler
from rich.console import Console

from flows.cli import SUMMARY_HEADER, summary_rows
from flows.terminal import print_table, step_bars
from tasks.engine import runner
from tasks.engine.runner import StepRun
from tasks.engine.scheduler import execute
from tasks.engine.step import Step
from tasks.engine.store import Store
from tasks.engine.config import ConfigModel
from tests.conftest import REPO

RUNS = [StepRun("acquire", "acquire", "3f9c0a1b2c4d", "cached", 0.02, "kiln_store/acquire/3f9c0a1b2c4d",
                {"documents": 1075}),
        StepRun("train/d128-l4", "train", "0123456789ab", "ran", 131.4, "kiln_store/train/0123456789ab",
                {"tokens": 1228800, "final_loss": 5.123456, "final_val_loss": 5.4}),
        StepRun("evaluate", "evaluate", "ba9876543210", "not run", 0.0, "kiln_store/evaluate/ba9876543210",
                error="its input train/d128-l4 failed")]


def test_the_piped_summary_is_plain_aligned_text_whatever_the_environment_says(capsys, monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich alone would take these for a terminal
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    print_table(SUMMARY_HEADER, summary_rows(RUNS), "ran/cached")
    out = capsys.readouterr().out
    assert "\x1b" not in out and not re.search("[\u2500-\u257f]", out)  # no colour codes, no box drawing
    lines = out.splitlines()
    assert len(lines) == 2 + len(RUNS) and set(lines[1]) == {"-", " "}
    starts = [m.start() for m in re.finditer(r"-+", lines[1])]
    assert [lines[0].index(h) for h in SUMMARY_HEADER] == starts  # every header over its column
    for line, run in zip(lines[2:], RUNS):
        cells = [run.name, run.version, run.status]
        assert [line.index(cell, start) for cell, start in zip(cells, starts)] == starts[:3]
        assert line[starts[4]:].startswith(run.path)
    assert "final_loss=5.123, final_val_loss=5.4" in lines[3] and lines[4].endswith("its input train/d128-l4 failed")


def terminal_table(width: int) -> str:
    buffer = io.StringIO()
    print_table(SUMMARY_HEADER, summary_rows(RUNS), "ran/cached",
                console=Console(file=buffer, force_terminal=True, width=width, color_system="standard"))
    return buffer.getvalue()


def test_on_a_terminal_the_summary_is_a_rich_table():
    out = terminal_table(160)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert "┃ stage" in text and "━" in text  # rich's box: a heavy rule under the header
    for run in RUNS:
        row = next(line for line in text.splitlines() if run.version in line)
        assert run.name in row and run.status in row and run.path in row
    assert "\x1b[32mran" in out and "\x1b[33mnot run" in out  # the status coloured: green, yellow
    narrow = re.sub(r"\x1b\[[0-9;]*m", "", terminal_table(80))  # folds, never cuts: paths stay whole
    column = [line.split("│")[5].strip() for line in narrow.splitlines() if line.startswith("│")]
    assert "…" not in narrow and "kiln_store/train/0123456789ab" in "".join(column)


class Slow(ConfigModel):
    name: str
    units: int


BARRIER = threading.Barrier(3, timeout=60)


def _units(ctx):
    """Reports progress unit by unit and logs each, while two other such steps do the same."""
    BARRIER.wait()  # the three run side by side
    for done in range(1, ctx.config.units + 1):
        ctx.log.info("%s finished unit %d of %d", ctx.config.name, done, ctx.config.units)
        ctx.progress(done, ctx.config.units)
        threading.Event().wait(0.15)
    (ctx.out / "done").write_text(ctx.config.name)
    return {"units": ctx.config.units}


@flow
def three_at_once(steps: list, store: str):
    return execute(steps, Store(store), max_concurrent=3)


def test_bars_for_steps_running_side_by_side_with_their_log_lines_above(tmp_path, prefect_harness, caplog):
    steps = [Step(n, "toy_units", 1, Slow(name=n, units=6), _units) for n in ("red", "green", "blue")]
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120, color_system=None)
    streams = (sys.stdout, sys.stderr)
    # What `kiln run` has on the root logger once Prefect set up its logging (pytest takes it off).
    prefect_console = PrefectConsoleHandler(stream=sys.stderr, level=logging.INFO)
    logging.getLogger().addHandler(prefect_console)
    try:
        with caplog.at_level(logging.INFO, logger="prefect"), step_bars(console, share_stderr=True):
            assert sys.stderr is not streams[1] and prefect_console.stream is sys.stderr  # rich's proxy
            runs = three_at_once(steps, str(tmp_path / "store"))
    finally:
        logging.getLogger().removeHandler(prefect_console)
    assert [r.status for r in runs] == ["ran"] * 3
    assert (sys.stdout, sys.stderr) == streams and not runner.WATCHERS
    assert prefect_console.stream is streams[1] and prefect_console.console.file is streams[1]

    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "\n", screen.getvalue())  # cursor moves between redraws
    for step in steps:
        assert f"{step.name} {step.version}" in drawn  # its bar, named by step and version
    assert re.search(r"(red|green|blue) [0-9a-f]{12} .*\b[1-6]/6\b", drawn)  # a bar with its count
    # Every log line printed above the bars, whole: none cut by a redraw or by another thread's line.
    lines = re.findall(r"(red|green|blue) finished unit ([1-6]) of 6", drawn)
    assert sorted(set(lines)) == sorted((s.name, str(u)) for s in steps for u in range(1, 7))


def test_a_stage_without_documents_per_source_shows_no_empty_per_source():
    shuffled = StepRun("negative_examples", "negative_examples", "4ba97061c545", "ran", 1.0, "kiln_store/n",
                       {"docs_out": 1075, "per_source": {}})
    kept = StepRun("filter", "filter", "3fced5ecf3cd", "ran", 1.0, "kiln_store/f",
                   {"docs_out": 1075, "per_source": {"chichewa": {"docs_out": 0}, "kjv": {"docs_out": 1075}}})
    (_, *_, empty), (_, *_, listed) = summary_rows([shuffled, kept])
    assert empty == "docs_out=1075"
    assert listed == "docs_out=1075, per_source=chichewa=0,kjv=1075"


def test_a_reader_that_closed_its_end_gets_a_quiet_exit_not_a_traceback(tmp_path):
    """`kiln compare --json | head`: once the reader is gone, kiln stops with exit 1 and prints
    nothing on stderr (it printed BrokenPipeError's traceback)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before kiln writes its first line
    try:
        proc = subprocess.run([sys.executable, "-m", "flows.cli", "compare", "configs/ablation_cpu.yaml", "--json",
                               "--store", str(tmp_path / "store")], stdout=write_end, stderr=subprocess.PIPE,
                              cwd=REPO, timeout=300, text=True)
    finally:
        os.close(write_end)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr
