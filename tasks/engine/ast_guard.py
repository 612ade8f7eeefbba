"""One lock around `ast.parse` for the whole process, because steps run side by side in threads.

CPython 3.11 keeps the AST constructor's recursion depth in one counter per interpreter, not per
thread. When a thread is turning a parse into `ast` objects and the garbage collector runs a
finalizer that hands the GIL to another thread that parses too, the first parse fails with
`SystemError: AST constructor recursion depth mismatch`. Parsing happens in step threads all the
time: numpy reads every .npy header with `ast.literal_eval`, `inspect.signature` parses the
signatures of builtins, the lineage scans kiln's imports (tasks/engine/lineage.py). A CI run lost
two evaluate steps that ran side by side to it. `ast.literal_eval` calls the module's `parse`, so
the lock covers it too; code that calls `compile(..., ast.PyCF_ONLY_AST)` itself is not covered.
"""

from __future__ import annotations

import ast
import threading

_LOCK = threading.RLock()  # re-entrant: a finalizer run inside a parse may parse again
_UNGUARDED = ast.parse


def _parse(*args, **kwargs):
    with _LOCK:
        return _UNGUARDED(*args, **kwargs)


def serialize_ast_parse() -> None:
    """Make every `ast.parse` in this process take one lock (idempotent)."""
    ast.parse = _parse
