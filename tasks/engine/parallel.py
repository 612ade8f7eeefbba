"""Run a function over shards, on a local Ray (or the cluster at RAY_ADDRESS) when workers > 1.

Results come back in input order and each call sees only its own item, so a stage's output is
the same bytes whatever the worker count.

A Ray worker may be on another machine, so it is never handed a path on the driver's disk
(`Places`): every path in an item that lies in one of the step's input folders is replaced, on
the worker, by that input fetched from the store onto the worker's node (`Located.local`), and
every path in the step's output or work folder by a private folder on the worker, whose files
come back with the result and are written into place here.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import ray

from tasks.engine import local_ray
from tasks.engine.store import Located

if TYPE_CHECKING:
    from tasks.engine.step import StepContext


@dataclass
class Places:
    """Where a step's folders are, for workers on other machines: each input folder (as the
    driver sees it) with its store location, and the folders the step writes (output, work).
    `nodes` collects the IP of every node that ran a shard."""

    inputs: dict[str, Located]
    outputs: list[str]
    output_dirs: list[str] = field(default_factory=list)  # sub-folders that exist before the map
    nodes: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, ctx: StepContext) -> "Places":
        outputs = [str(ctx.out), str(ctx.work_dir)]
        dirs = sorted({str(d) for base in outputs if Path(base).exists() for d in Path(base).rglob("*") if d.is_dir()})
        return cls({str(path): ctx.located(name) for name, path in ctx.inputs.items()}, outputs, dirs)


def map_shards(fn: Callable[[Any], Any], items: Sequence[Any], workers: int = 1,
               on_result: Callable[[int, Any], None] | None = None, places: Places | None = None) -> list[Any]:
    """`[fn(item) for item in items]`, spread over `workers` Ray workers when workers > 1.

    `fn` must be a module-level function (Ray pickles it by reference). `on_result(i, result)` is
    called as each result arrives, for progress reporting. With `places` (a stage's: see the
    module docstring) the workers reach inputs and outputs without the driver's paths; without,
    the paths in `items` must be valid on every node.
    """
    if workers <= 1 or len(items) <= 1:
        results = []
        for i, item in enumerate(items):
            results.append(fn(item))
            if on_result:
                on_result(i, results[-1])
        return results
    local_ray.ensure_ray()
    options = {"num_cpus": 1, "runtime_env": {"env_vars": local_ray.run_env()}}
    if places is None:
        refs = [ray.remote(fn).options(**options).remote(item) for item in items]
    else:
        remote = ray.remote(_on_worker).options(**options)
        refs = [remote.remote(fn, places, item) for item in items]
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(items)
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=0.5)
        local_ray.cancel_if_stopping(pending)  # Ctrl-C or SIGTERM
        if not done:
            continue
        i = index[done[0]]
        results[i] = ray.get(done[0])
        if places is not None:
            results[i] = _written_here(places, *results[i])
        if on_result:
            on_result(i, results[i])
    return results


def _on_worker(fn: Callable[[Any], Any], places: Places, item: Any) -> tuple[Any, str, dict[str, bytes]]:
    """On a Ray worker: run `fn` on `item` with its paths moved to this node (inputs fetched from
    the store, outputs into a private folder); return the result, this node's IP and the files
    written, by their path on the driver."""
    with tempfile.TemporaryDirectory(prefix="kiln-shard-") as tmp:
        private = {base: Path(tmp) / str(k) for k, base in enumerate(places.outputs)}
        for d in places.output_dirs:
            base = next(b for b in places.outputs if _under(d, b))
            (private[base] / os.path.relpath(d, base)).mkdir(parents=True, exist_ok=True)
        for folder in private.values():
            folder.mkdir(parents=True, exist_ok=True)
        result = fn(_moved(item, places, private))
        files = {}
        for base, folder in private.items():
            for path in sorted(folder.rglob("*")):
                if path.is_file():
                    files[str(Path(base) / path.relative_to(folder))] = path.read_bytes()
    return result, ray.util.get_node_ip_address(), files


def _written_here(places: Places, result: Any, node: str, files: dict[str, bytes]) -> Any:
    places.nodes.add(node)
    for path, data in files.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
    return result


def _moved(value: Any, places: Places, private: dict[str, Path]) -> Any:
    """`value` with every Path in it (through dataclasses, tuples, lists and dicts) moved."""
    if isinstance(value, Path):
        for base, folder in private.items():
            if _under(str(value), base):
                return folder / os.path.relpath(value, base)
        for base, located in places.inputs.items():
            if _under(str(value), base):
                return located.local() / os.path.relpath(value, base)
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _moved(getattr(value, f.name), places, private)
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, tuple):
        return type(value)(_moved(v, places, private) for v in value)
    if isinstance(value, list):
        return [_moved(v, places, private) for v in value]
    if isinstance(value, dict):
        return {k: _moved(v, places, private) for k, v in value.items()}
    return value


def _under(path: str, base: str) -> bool:
    return path == base or path.startswith(base.rstrip("/") + "/")
