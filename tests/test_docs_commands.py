"""Every `kiln` command the README, docs/ and `--help` examples show is one the CLI takes: its
subcommand and flags parse, and the shipped config it names loads with the `--set` values it
gives. A renamed flag, a dropped subcommand or a config field the docs still set fails here, not
on a user's first try. Nothing runs: the commands are parsed and their configs validated."""

from __future__ import annotations

import re
import shlex

import pytest

from flows.cli import KilnUserError, _experiment, parser
from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`uv run (kiln [^`]*)`")  # a whole command in prose (not a fragment: `kiln compare CONFIG`)
OPTIONAL = re.compile(r"\[--[^\]]*\]")  # `[--canary CONFIG]`: usage notation for an optional argument


def shown_commands() -> list[tuple[str, str]]:
    """(where, command line) for each `kiln ...` line in the docs' code blocks (continued lines
    joined, a trailing comment or `&` dropped), each `uv run kiln ...` in their prose, and each
    subcommand's `--help` example."""
    found = []
    for doc in DOCS:
        found += [(doc.relative_to(REPO).as_posix(), command) for command in INLINE.findall(doc.read_text())]
        for block in FENCE.findall(doc.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip().removeprefix("$ ").removeprefix("uv run ")
                if line.startswith("kiln "):
                    command = OPTIONAL.sub("", line.split(" #", 1)[0]).strip().removesuffix("&").strip()
                    found.append((doc.relative_to(REPO).as_posix(), command))
    subcommands = next(a for a in parser()._actions if a.dest == "command").choices
    for name, sub in subcommands.items():
        example = sub.epilog.split("example:", 1)[1].strip().splitlines()
        found += [(f"kiln {name} --help", line.strip()) for line in example if line.strip().startswith("kiln ")]
    return found


COMMANDS = shown_commands()


def test_the_docs_show_commands_of_every_kind():
    shown = {shlex.split(command)[1] for _, command in COMMANDS}
    assert len(COMMANDS) > 40 and {"run", "plan", "compare", "serve-model", "deploy", "capacity"} <= shown


@pytest.mark.parametrize("where,command", COMMANDS, ids=[f"{w}: {c}"[:90] for w, c in COMMANDS])
def test_a_command_the_docs_show_parses_and_its_config_loads(where, command):
    argv = shlex.split(command)[1:]
    if argv == ["--help"]:
        return  # kiln's own help: parsing it prints the help and exits
    try:
        args = parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where} shows `{command}`, which kiln's CLI does not take (its error is above)")
    config = getattr(args, "config", None)
    if config and config.startswith("configs/"):
        assert (REPO / config).is_file(), f"{where} shows `{command}`, but {config} is not in the repo"
        try:
            _experiment(str(REPO / config), getattr(args, "sets", []))
        except KilnUserError as e:
            pytest.fail(f"{where} shows `{command}`, whose config does not load: {e}")


def test_an_option_of_several_values_given_twice_keeps_them_all():
    """`--device h100-80gb --device h200-141gb` checked the fit against the H200 only (argparse's
    nargs="+" keeps the last list), silently; the same for `kiln run --force` and `kiln forecast
    --budget`. Each now adds to the list."""
    args = parser().parse_args(["capacity", "c.yaml", "--device", "h100-80gb", "--device", "h200-141gb", "a100-40gb"])
    assert args.device == ["h100-80gb", "h200-141gb", "a100-40gb"]
    assert parser().parse_args(["run", "c.yaml", "--force", "train", "--force", "sft"]).force == ["train", "sft"]
    assert parser().parse_args(["run", "c.yaml"]).force == []
    assert parser().parse_args(["forecast", "law.json", "--budget", "1e19", "--budget", "1e21"]).budget == [1e19, 1e21]
