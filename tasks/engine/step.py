"""A step: one stage applied to one config and its upstream steps, producing one artefact folder.

Steps are plain data (Marin's `ExecutorStep` without the executor): a pipeline is a list of them,
so `kiln plan` can compute every version and status without running anything, and the Prefect
side (`tasks/engine/scheduler.py`) only has to run each once its inputs are done.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Mapping

from pydantic import BaseModel

from tasks.engine.store import Located, Workspace
from tasks.engine.versioning import step_version


@dataclass(frozen=True)
class Shown:
    """Something a step wants shown beside its task in the Prefect UI, as plain data: the runner
    publishes it once the output is in the store (stage bodies never talk to Prefect)."""

    kind: str  # "table" (content: list of row dicts), "markdown" (text), "image" (the bytes of a PNG)
    name: str  # short, e.g. "results"; the artifact key is `<stage>-<name>-<version>`
    content: Any
    description: str = ""


@dataclass(frozen=True)
class StepContext:
    """What a stage body gets: where to write, where its inputs are, and how to report."""

    step: "Step"
    out: Path  # write outputs here; renamed to <store>/<stage>/<version>/ only when the body returns
    inputs: Mapping[str, Path]  # local folder of each named upstream output
    input_stats: Mapping[str, dict]  # the `stats` each upstream step reported
    work_dir: Path  # stable per version, survives a crash (checkpoints); removed once published
    log: logging.Logger
    workers: int = 1  # parallelism for this run; never changes the bytes of the output
    shown: list[Shown] = field(default_factory=list)  # filled by `show`, published by the runner
    on_progress: Callable[[int, int], None] | None = None  # installed by the runner
    store_root: str | None = None  # the store the inputs came from (None: plain folders, in tests)

    @property
    def config(self) -> Any:
        return self.step.config

    def located(self, name: str) -> Located:
        """Input `name` by its place in the store, for code that runs on another machine (Ray
        hosts): it opens the input there, never through this machine's path."""
        if self.store_root is None:
            return Located(None, "", "", str(self.inputs[name]))
        step = self.step.inputs[name]
        return Located(self.store_root, step.stage, step.version, str(self.inputs[name]))

    @property
    def workspace(self) -> Workspace:
        """`work_dir` as every machine reaches it (in the store; see tasks/engine/store.py)."""
        return Workspace(self.store_root, self.step.stage, self.step.version, str(self.work_dir))

    def show(self, kind: str, name: str, content: Any, description: str = "") -> None:
        """Ask for a table, markdown text or image (PNG bytes) beside the step's task."""
        if kind not in ("table", "markdown", "image"):
            raise ValueError(f"cannot show a {kind!r}: use table, markdown or image")
        self.shown.append(Shown(kind, name, content, description))

    def progress(self, done: int, total: int) -> None:
        """Report `done` of `total` units (training steps, shards): a progress artifact in the UI
        and, under `kiln run` in a terminal, a progress bar."""
        if self.on_progress is not None:
            self.on_progress(done, total)


StageBody = Callable[[StepContext], dict]


@dataclass(frozen=True, eq=False)
class Step:
    """One versioned unit of work. `run(ctx)` writes into `ctx.out` and returns its stats."""

    name: str  # unique within a pipeline: "acquire", "train", "train/d128-l4"
    stage: str  # the kind of output, and its folder in the store: "acquire", "tokenize", ...
    stage_version: int  # the stage module's STAGE_VERSION
    config: BaseModel
    run: StageBody
    inputs: Mapping[str, "Step"] = field(default_factory=dict)
    # Inputs that a setting reads and that change nothing the step outputs, so they stay out of
    # its version: a train step's in-loop evals read the documents their tasks are cut from.
    unversioned: frozenset[str] = frozenset()
    # Identity that lives outside the config, e.g. a content hash of the source files that
    # `acquire` reads, so that a refresh reruns downstream only when the source changed.
    fingerprint: Callable[[], str] | None = None

    @cached_property
    def version(self) -> str:
        return step_version(
            self.stage,
            self.stage_version,
            self.config,
            [s.version for name, s in self.inputs.items() if name not in self.unversioned],
            fingerprint=self.fingerprint() if self.fingerprint else None,
        )

    @property
    def key(self) -> str:
        """The Prefect cache key and result file name: `<stage>-<version>`."""
        return f"{self.stage}-{self.version}"


def upstream_order(final: list[Step]) -> list[Step]:
    """Every step reachable from `final`, each once, upstream before downstream."""
    seen: dict[int, Step] = {}

    def visit(step: Step) -> None:
        if id(step) in seen:
            return
        for s in step.inputs.values():
            visit(s)
        seen[id(step)] = step

    for s in final:
        visit(s)
    return list(seen.values())
