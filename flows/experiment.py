"""An experiment: one or many branches of steps, shared where their versions agree.

A branch is the steps one variant wants. From a YAML config, each entry of `variants` and each
point of `grid` is the base config with overrides deep-merged into it, and its branch is the
recipe (flows/plan.py `recipe`) of that config; a config without either is one branch named "".
A Python experiment file builds its branches itself with the stage factories (docs/experiments.md).

Steps with the same version are one step: `Experiment.steps` lists each once, upstream first,
named after the variants that use it (`train/keep70`; `tokenize/base+wide`; the plain name when
every variant uses it), so `kiln plan` shows what is shared and the scheduler computes it once.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

from pydantic import ValidationError

from flows.config import ConfigError, ExperimentConfig, RunSettings, load_config, parse_sets
from tasks.engine.step import Step, upstream_order


@dataclass(frozen=True)
class Branch:
    """One variant: the steps it wants (their inputs are found by walking), and how it was made."""

    steps: list[Step]
    overrides: dict[str, Any] = field(default_factory=dict)  # dotted path -> value, for `kiln compare`
    config: ExperimentConfig | None = None  # its whole config, for YAML experiments


@dataclass(frozen=True, eq=False)
class Experiment:
    name: str
    branches: dict[str, Branch]
    run: RunSettings = RunSettings()
    config: ExperimentConfig | None = None  # the YAML config it came from (the pipeline flow's parameter)

    @cached_property
    def variants_of(self) -> dict[str, list[str]]:
        """Step key -> the variants whose branch contains it."""
        users: dict[str, list[str]] = {}
        for variant, branch in self.branches.items():
            for step in upstream_order(branch.steps):
                users.setdefault(step.key, [])
                if variant not in users[step.key]:
                    users[step.key].append(variant)
        return users

    @cached_property
    def steps(self) -> list[Step]:
        """Every step once, upstream first, named with the variants that use it."""
        named: dict[str, Step] = {}
        kept = self._kept_steps()
        for variant, branch in self.branches.items():
            for step in upstream_order(branch.steps):
                if step.key not in named:
                    config = step.config
                    if step.key in kept and kept[step.key] != config.train.keep_checkpoints:
                        config = config.model_copy(update={"train": config.train.model_copy(
                            update={"keep_checkpoints": kept[step.key]})})
                    renamed = dataclasses.replace(
                        step, name=self._label(step), config=config,
                        inputs={n: named[u.key] for n, u in step.inputs.items()})
                    renamed.__dict__["version"] = step.version  # the same by construction; not hashed again
                    named[step.key] = renamed
        return list(named.values())

    def _kept_steps(self) -> dict[str, tuple[int, ...]]:
        """Train step key -> the steps it keeps for every branch together: a stable run shared by
        cooldown branches keeps the step each of them starts from (a setting: one version)."""
        kept: dict[str, set[int]] = {}
        for branch in self.branches.values():
            for step in upstream_order(branch.steps):
                if step.stage == "train" and hasattr(step.config, "train"):  # not an output named by its place
                    kept.setdefault(step.key, set()).update(step.config.train.keep_checkpoints)
        return {key: tuple(sorted(steps)) for key, steps in kept.items()}

    def branch_steps(self, variant: str) -> list[Step]:
        """The (named) steps of one variant's branch, upstream first."""
        return [s for s in self.steps if variant in self.variants_of[s.key]]

    def _label(self, step: Step) -> str:
        users = self.variants_of[step.key]
        if len(users) == len(self.branches) or users == [""]:
            return step.name
        return f"{step.name}/{'+'.join(users)}"


# --- YAML: variants and grids -----------------------------------------------------------------


def from_config(config: ExperimentConfig, source: str = "config") -> Experiment:
    """The experiment a config describes: one branch, or one per variant x grid point."""
    from flows.plan import recipe

    branches = {}
    for name, (overrides, cfg) in branch_configs(config, source).items():
        try:
            branches[name] = Branch(recipe(cfg), overrides, cfg)
        except ValueError as e:  # a step refusing what the config asks of it, before anything runs
            raise ConfigError(f"{source}: {f'variant {name!r}: ' if name else ''}{e}") from None
    return Experiment(config.name, branches, config.run, config)


def branch_configs(config: ExperimentConfig, source: str = "config") -> dict[str, tuple[dict, ExperimentConfig]]:
    """Variant name -> (its overrides as dotted paths, its config), validated.

    Each variant of `variants` is crossed with each point of `grid`; with neither, the config
    itself is the one branch "". List the base config as a variant (`base: {}`) to run it too.
    """
    if not config.variants and not config.grid:
        return {"": ({}, config)}
    base = config.model_dump(mode="json", exclude={"variants", "grid"})
    variants = {name: flatten(over) for name, over in config.variants.items()} or {"": {}}
    out = {}
    for (vname, vover), (gname, gover) in itertools.product(variants.items(), grid_points(config.grid)):
        name = ",".join(n for n in (vname, gname) if n)
        overrides = {**vover, **gover}
        try:
            cfg = ExperimentConfig.model_validate(deep_merge(base, nest(overrides)))
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            raise ConfigError(f"{source}: variant {name!r}: {where}: {err['msg']}") from None
        out[name] = (overrides, cfg)
    return out


def grid_points(grid: dict[str, list]) -> list[tuple[str, dict]]:
    """The cartesian product of the grid's fields, each point named like `lr=0.003,d_model=128`."""
    if not grid:
        return [("", {})]
    paths = list(grid)
    points = []
    for values in itertools.product(*(grid[p] for p in paths)):
        name = ",".join(f"{p.rsplit('.', 1)[-1]}={_short(v)}" for p, v in zip(paths, values))
        points.append((name, dict(zip(paths, values))))
    return points


def _short(value: Any) -> str:
    return json.dumps(value, separators=(",", ":")) if isinstance(value, (dict, list)) else str(value)


def flatten(override: dict, prefix: str = "") -> dict[str, Any]:
    """A nested or dotted override as {dotted path: value} (mappings are walked into)."""
    flat: dict[str, Any] = {}
    for key, value in override.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def nest(flat: dict[str, Any]) -> dict:
    """{dotted path: value} as nested mappings."""
    nested: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return nested


def deep_merge(base: Any, override: Any) -> Any:
    """`override` on top of `base`: mappings merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: deep_merge(base.get(k), v) for k, v in override.items()}}
    return override


# --- Python experiment files ------------------------------------------------------------------


def from_python(path: Path) -> Experiment:
    """Load `experiment()` from a Python file: it returns {variant: [steps]} or a list of steps.

    The module may also define `RUN = RunSettings(...)` (max_concurrent, workers) and `NAME`."""
    spec = importlib.util.spec_from_file_location(f"kiln_experiment_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ConfigError(f"{path}: importing it failed: {type(e).__name__}: {e}") from e
    build = getattr(module, "experiment", None)
    if not callable(build):
        raise ConfigError(f"{path}: a Python experiment defines `experiment()`, returning "
                          "{variant name: [steps]} or a list of steps")
    try:
        built = build()
    except ValueError as e:  # a step factory refusing its arguments (tasks/export.py's adapter chain, say)
        raise ConfigError(f"{path}: experiment() failed: {e}") from e
    if isinstance(built, (list, tuple)):
        built = {"": list(built)}
    if not isinstance(built, dict) or not all(isinstance(s, Step) for ss in built.values() for s in ss):
        raise ConfigError(f"{path}: experiment() must return {{variant name: [Step, ...]}} or [Step, ...]")
    run = getattr(module, "RUN", RunSettings())
    return Experiment(getattr(module, "NAME", path.stem), {k: Branch(list(v)) for k, v in built.items()}, run)


_PYTHON_EXPERIMENTS: dict[tuple, Experiment] = {}  # (file, mtime, size) -> what it built, in this process


def load_experiment(path: str | Path, sets: Sequence[str] = ()) -> Experiment:
    """A YAML config (with `--set` overrides: `load_config`) or a Python experiment file, as an
    experiment. A Python file is executed once per process while it stays unchanged: `kiln run`
    checks the plan and then runs it in a flow, and the file's `experiment()` may do work or have
    effects of its own."""
    path = Path(path)
    if path.suffix == ".py" and sets:
        raise ConfigError(f"{path}: --set overrides a YAML config's fields; a Python experiment sets its values "
                          "in its own code")
    if path.suffix == ".py":
        if not path.exists():
            raise ConfigError(f"{path}: no such experiment file")
        stat = path.stat()
        key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
        if key not in _PYTHON_EXPERIMENTS:
            _PYTHON_EXPERIMENTS[key] = from_python(path)
        return _PYTHON_EXPERIMENTS[key]
    experiment = from_config(load_config(path, sets), str(path))
    if not sets:
        return experiment
    given = parse_sets(sets)  # `kiln compare` shows them as every variant's overrides, under each one's own
    branches = {name: dataclasses.replace(branch, overrides={**given, **branch.overrides})
                for name, branch in experiment.branches.items()}
    return dataclasses.replace(experiment, branches=branches)
