"""Running a benchmark's probe in this tree and in a baseline commit's, each in a process of its own.

A probe is a function of a benchmark script that takes JSON-able arguments and returns a JSON-able
dict; `probe_in` runs it in a fresh Python process that imports the code of the tree given (the
script itself is read from here, since the baseline may not have it), and `worktree` checks the
baseline commit out beside, removing it afterwards.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def worktree(commit: str, folder: Path) -> Iterator[Path]:
    """A git worktree of `commit` at `folder` for as long as the block runs."""
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), commit], cwd=REPO, check=True,
                   capture_output=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=REPO, check=False)


def probe_in(tree: Path, script: str, function: str, *args) -> dict:
    """`function(*args)` of `script` in a fresh process that imports `tree`'s code: its dict."""
    code = (f"import json, runpy, sys; sys.path.insert(0, {str(tree)!r}); "
            f"probe = runpy.run_path({script!r})[{function!r}]; "
            f"print(json.dumps(probe(*{list(args)!r})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the probe in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
