"""Replacing a published version never takes it from a reader: `--force` computes the new output
under the step's lock while the old one stays whole, and publish swaps it in in one step, so a
reader of `<stage>/<version>/` sees the old whole version or the new whole one, never none."""

from __future__ import annotations

import shutil
from pathlib import Path

from prefect import flow

from tasks.engine import store as store_module
from tasks.engine.scheduler import execute
from tasks.engine.step import Step
from tasks.engine.store import Store, check_output, verify_output
from tasks.engine.config import ConfigModel


class Toy(ConfigModel):
    name: str


SEEN: dict[str, object] = {}


def _write(ctx):
    """Writes `round` into out.txt. Runs with the step's lock held; records what a run reading this
    very version (as an input) would find in the store at that moment."""
    store = Store(ctx.store_root)
    step = ctx.step
    if store.is_done(step.stage, step.version):
        SEEN["while_computing"] = ((Path(store.output(step.stage, step.version)) / "out.txt").read_text(),
                                   check_output(store, step.stage, step.version))
    else:
        SEEN["while_computing"] = None
    (ctx.out / "out.txt").write_text(SEEN["round"])
    return {"round": SEEN["round"]}


@flow
def run_toy(steps: list, store: str, force: list[str]):
    return execute(steps, Store(store), force=frozenset(force))


def test_force_keeps_the_old_output_readable_until_the_new_one_replaces_it(tmp_path, prefect_harness):
    """The old runner unpublished a forced step before it even had the lock, so a run reading that
    output as an input lost it for as long as the step took."""
    step = Step("toy", "toy_force", 1, Toy(name="x"), _write)
    root = tmp_path / "store"
    SEEN["round"] = "old"
    assert [r.status for r in run_toy([step], str(root), [])] == ["ran"]
    SEEN["round"] = "new"
    assert [r.status for r in run_toy([step], str(root), ["toy_force"])] == ["ran"]
    assert SEEN["while_computing"] == ("old", [])  # published and whole while the new one was computed
    store = Store(root)
    assert (Path(store.output("toy_force", step.version)) / "out.txt").read_text() == "new"
    assert verify_output(store, "toy_force", step.version) == []
    assert store.read_lineage("toy_force", step.version)["stats"]["round"] == "new"
    assert not list((root / "toy_force").glob(".tmp-*"))  # the old folder went once swapped out
    assert [r.status for r in run_toy([step], str(root), [])] == ["cached"]


def _published(store: Store, version: str, text: str) -> None:
    tmp = store.begin("toy", version)
    (tmp / "out.txt").write_text(text)
    (tmp / "more.txt").write_text(text * 3)
    store.publish(tmp, "toy", version, {"stage": "toy", "version": version})


def test_a_reader_during_a_replace_sees_the_old_or_the_new_version_whole(tmp_path, monkeypatch):
    """Publish deletes a folder at two points: the old code removed the published version, then
    renamed the new one into place; the new code deletes the old folder once the new one is in
    place. A reader looks at the version at exactly those points (right after each deletion of a
    folder of the store), so the moment the old code left the version absent is always seen."""
    store = Store(tmp_path / "store")
    _published(store, "v1", "old")
    real_rmtree = shutil.rmtree
    views = []

    def rmtree_then_read(path, *args, **kwargs):
        real_rmtree(path, *args, **kwargs)
        if Path(path).is_relative_to(tmp_path / "store"):
            out = Path(store.output("toy", "v1"))
            views.append(None if not store.is_done("toy", "v1") else
                         ((out / "out.txt").read_text(), check_output(store, "toy", "v1"),
                          verify_output(store, "toy", "v1")))

    monkeypatch.setattr(store_module.shutil, "rmtree", rmtree_then_read)
    _published(store, "v1", "new")
    assert views  # the reader looked during the replace
    assert all(v is not None and v[0] in ("old", "new") and v[1:] == ([], []) for v in views), views
    assert (Path(store.output("toy", "v1")) / "out.txt").read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "store" / "toy").iterdir()) == ["v1"]


def test_without_the_exchange_a_replace_still_never_shows_a_partial_version(tmp_path, monkeypatch):
    """Where renameat2's exchange is missing (NFS, other systems), the old folder is renamed aside
    first: a reader may find no version for that instant, but never a partial one counted as done."""
    monkeypatch.setattr(store_module, "_exchange", lambda a, b: False)
    store = Store(tmp_path / "store")
    _published(store, "v1", "old")
    real_rename = store_module.os.rename
    views = []

    def rename_then_read(src, dst):
        real_rename(src, dst)
        views.append(store.is_done("toy", "v1") and (check_output(store, "toy", "v1"),
                                                     verify_output(store, "toy", "v1")))

    monkeypatch.setattr(store_module.os, "rename", rename_then_read)
    _published(store, "v1", "new")
    assert False in views  # the documented window: absent, not done
    assert all(v is False or v == ([], []) for v in views), views
    assert (Path(store.output("toy", "v1")) / "out.txt").read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "store" / "toy").iterdir()) == ["v1"]
