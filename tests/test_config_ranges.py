"""Every field of the experiment config, set to a wrong type and then to a value outside its
range (one at a time, the rest of the config valid), makes `kiln plan` exit 2 with a message that
names that field. Every numeric field must declare a range for the second half to exist."""

from __future__ import annotations

import copy
import json
import types
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from flows.cli import main
from flows.config import ExperimentConfig, load_config
from tests.conftest import REPO

SKIP = {"variants", "grid"}  # free-form overrides of other fields, checked as those fields


def base_configs() -> dict[str, dict]:
    """Valid configs that between them hold every section: post-training with the optional data
    stages and W&B tracking, and the scaling sweep."""
    full = yaml.safe_load((REPO / "configs" / "posttrain_cpu.yaml").read_text())
    full["data"]["extract"] = {}
    full["data"]["sources"][0]["limit"] = 10
    full["tracking"] = {"wandb": {"mode": "offline"}}
    full["train"]["peak_flops"] = 1e12
    scaling = yaml.safe_load((REPO / "configs" / "scaling_cpu.yaml").read_text())
    return {"full": full, "scaling": scaling}


def _strip(annotation):
    """(base type, whether None is allowed) of an annotation."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), True
    return annotation, False


def _bounds(info) -> dict:
    flat = [m for i in info for m in (getattr(i, "metadata", None) or [i])]
    return {k: getattr(i, k) for i in flat for k in ("ge", "gt", "le", "lt") if getattr(i, k, None) is not None}


def _ranged(annotation) -> tuple[type, dict]:
    if typing.get_origin(annotation) is typing.Annotated:
        base, *info = typing.get_args(annotation)
        return base, _bounds(info)
    return annotation, {}


def fields() -> list[tuple[tuple, type, object]]:
    """(path, model, field info) of every field, each model once (at its first path)."""
    out, seen, queue = [], set(), [((), ExperimentConfig)]
    while queue:
        path, model = queue.pop(0)
        if model in seen:
            continue
        seen.add(model)
        for name, info in model.model_fields.items():
            if name in SKIP:
                continue
            out.append(((*path, name), model, info))
            base, _ = _strip(info.annotation)
            if typing.get_origin(base) is list and isinstance(typing.get_args(base)[0], type) \
                    and issubclass(typing.get_args(base)[0], BaseModel):
                queue.append(((*path, name, 0), typing.get_args(base)[0]))
            elif isinstance(base, type) and issubclass(base, BaseModel):
                queue.append(((*path, name), base))
    return out


def out_of_range(info) -> list:
    """Values just outside the field's declared range (or choices, or pattern); [] if it has none."""
    base, _ = _strip(info.annotation)
    base, bounds = _ranged(base)
    bounds = _bounds(info.metadata) or bounds
    origin = typing.get_origin(base)
    if origin is typing.Literal:
        return ["not-one-of-the-choices"]
    if origin is list:
        item, item_bounds = _ranged(typing.get_args(base)[0])
        return [[v] for v in _outside(item, item_bounds)]
    if origin is dict:
        key, _ = _ranged(typing.get_args(base)[0])
        value, value_bounds = _ranged(typing.get_args(base)[1])
        return [{1: v} for v in _outside(value, value_bounds)]
    if base is str and any(getattr(m, "pattern", None) for m in info.metadata):
        return ["!not the pattern!"]
    return _outside(base, bounds)


def _outside(base, bounds: dict) -> list:
    step = 1 if base is int else 0.5
    values = []
    if "ge" in bounds:
        values.append(bounds["ge"] - step)
    if "gt" in bounds:
        values.append(bounds["gt"])
    if "le" in bounds:
        values.append(bounds["le"] + step)
    if "lt" in bounds:
        values.append(bounds["lt"])
    return [base(v) for v in values]


def wrong_type(info):
    base, _ = _strip(info.annotation)
    base, _ = _ranged(base)
    origin = typing.get_origin(base)
    if origin in (list, tuple, dict) or (isinstance(base, type) and issubclass(base, BaseModel)):
        return 7
    if base is str or origin is typing.Literal:
        return ["a", "list"]
    if base is bool:
        return "maybe"
    return "not-a-number"  # int, float


def numeric(info) -> bool:
    base, _ = _strip(info.annotation)
    base, _ = _ranged(base)
    return base in (int, float)


def set_path(raw: dict, path: tuple, value) -> None:
    node = raw
    for key in path[:-1]:
        if isinstance(key, int):
            node = node[key]
        else:  # a section the base leaves out is created, holding only the wrong field
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
    node[path[-1]] = value


def base_for(path: tuple, bases: dict[str, dict]) -> dict:
    return bases["scaling"] if path[0] == "scaling" else bases["full"]


def cases() -> list:
    out = []
    for path, model, info in fields():
        out.append(pytest.param(path, wrong_type(info), id=".".join(map(str, path)) + ":type"))
        for i, value in enumerate(out_of_range(info)):
            out.append(pytest.param(path, value, id=".".join(map(str, path)) + f":range{i}"))
    return out


def test_bases_are_valid(tmp_path):
    for name, raw in base_configs().items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
        load_config(tmp_path / f"{name}.yaml")


def test_every_numeric_field_declares_a_range():
    bare = [".".join(map(str, p)) for p, _, info in fields() if numeric(info) and not out_of_range(info)]
    assert not bare, f"numeric config fields without a range: {bare}"


def test_each_wrong_field_exits_2_naming_it(tmp_path, capsys):
    bases, failures, tried = base_configs(), [], 0
    for param in cases():
        path, value = param.values
        raw = copy.deepcopy(base_for(path, bases))
        set_path(raw, path, value)
        file = tmp_path / "wrong.yaml"
        file.write_text(yaml.safe_dump(raw))
        code = main(["plan", str(file)])
        err = capsys.readouterr().err
        tried += 1
        dotted = ".".join(map(str, path))
        if code != 2 or not (f": {dotted}:" in err or f": {dotted}." in err):  # .0: a list's item
            failures.append(f"{param.id} = {value!r}: exit {code}: {err.strip()[:300]}")
    assert not failures, f"{len(failures)} of {tried} wrong configs not refused naming their field:\n" + "\n".join(failures)


# --- `--set PATH=VALUE` ---------------------------------------------------------------------------


def planned(capsys, *args: str) -> dict[str, str]:
    """`kiln plan --json` of the quickstart with `args`: step name -> version."""
    assert main(["plan", str(REPO / "configs" / "tiny_cpu.yaml"), "--json", *args]) == 0
    return {step["name"]: step["version"] for step in json.loads(capsys.readouterr().out)}


def test_set_overrides_a_field_and_moves_only_the_steps_that_read_it(tmp_path, capsys):
    store = ["--store", str(tmp_path / "store")]
    plain = planned(capsys, *store)
    muon = planned(capsys, *store, "--set", "train.optimizer=muon")
    assert muon.keys() == plain.keys()
    moved = {name for name in plain if muon[name] != plain[name]}
    assert moved == {"train", "evaluate", "export"}, moved  # the data steps are the same steps
    # values are YAML (a number, a list), several --set at once, and the file's own values under them
    both = planned(capsys, *store, "--set", "train.optimizer=muon", "--set", "train.lr=1e-3",
                   "--set", "eval.tasks=[next_passage]")
    assert both["train"] not in (plain["train"], muon["train"]) and both["tokenize"] == plain["tokenize"]
    config = load_config(REPO / "configs" / "tiny_cpu.yaml", ["train.lr=1e-3", "eval.tasks=[next_passage]"])
    assert config.train.lr == 1e-3 and config.eval.tasks == ["next_passage"] and config.train.steps == 300
    # kiln compare shows the values set with each variant's overrides (a variant's own value over a set one)
    assert main(["compare", str(REPO / "configs" / "ablation_cpu.yaml"), *store, "--json",
                 "--set", "train.optimizer=muon", "--set", "train.lr=0.002"]) == 0
    rows = {row["variant"]: row["overrides"] for row in json.loads(capsys.readouterr().out)}
    assert rows["base"] == 'train.optimizer="muon", train.lr=0.002'
    assert rows["lr1e-3"] == 'train.optimizer="muon", train.lr=0.001'


@pytest.mark.parametrize("item,said", [("train.optimiser=muon", "train.optimiser"),
                                       ("train.optimizer", "give PATH=VALUE"),
                                       ("train..lr=1", "give PATH=VALUE"),
                                       ("train.lr=[1", "not valid YAML"),
                                       ("train.optimizer=sgd", "train.optimizer")])
def test_a_wrong_set_exits_2_saying_what_was_wrong(capsys, item, said):
    assert main(["plan", str(REPO / "configs" / "tiny_cpu.yaml"), "--set", item]) == 2
    err = capsys.readouterr().err
    assert said in err and f"--set {item}" in err.replace(repr(item), item), err


@pytest.mark.parametrize("command", [["serve"], ["deploy", "--pool", "cpus"], ["canary", "--check-only"]])
def test_the_team_commands_take_set_too(command):
    """serve, deploy and canary read the config as run does: a --set is applied (and checked) before
    they reach any server or store."""
    from tests.conftest import kiln

    done = kiln(command[0], str(REPO / "configs" / "tiny_cpu.yaml"), *command[1:], "--set", "train.optimiser=muon",
                check=False)
    assert done.returncode == 2 and "(with --set train.optimiser=muon): train.optimiser" in done.stderr, done.stderr


def test_set_is_refused_for_a_python_experiment(capsys):
    assert main(["plan", str(REPO / "experiments" / "two_widths.py"), "--set", "train.lr=1e-3"]) == 2
    assert "a Python experiment sets its values in its own code" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["serve"], ["deploy", "--pool", "cpus"], ["canary", "--check-only"], ["capacity"]])
def test_a_command_that_takes_yaml_says_so_for_a_python_experiment(command):
    from tests.conftest import kiln

    done = kiln(command[0], str(REPO / "experiments" / "two_widths.py"), *command[1:], check=False)
    assert done.returncode == 2 and "a Python experiment, which kiln run, plan and compare take" in done.stderr
