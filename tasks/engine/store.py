"""The artefact store: `<root>/<stage>/<version>/`, published atomically, `lineage.json` last.

A folder is done exactly when its `lineage.json` exists. Outputs are written under a temporary
name and renamed into place, so a crash mid-write leaves a `.tmp-*` folder that nothing reads.
`lineage.json` records a sha256 per output file (`files`); `verify_output` checks a published
folder against it, so a file changed or cut short after publishing is never taken as done.
The root is a local path (default `./kiln_store`, or `KILN_STORE`) or any fsspec URL (`gs://`,
`s3://`, ...): a remote store publishes by uploading the folder and writing `lineage.json` last,
and downloads inputs into a local cache before a stage reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import fsspec

DEFAULT_STORE = "kiln_store"
LINEAGE = "lineage.json"


def default_store_root() -> str:
    return os.environ.get("KILN_STORE", DEFAULT_STORE)


class Store:
    def __init__(self, root: str | Path | None = None):
        root = str(root if root is not None else default_store_root())
        if root.startswith("file://"):
            root = root[len("file://"):]
        self.is_local = "://" not in root
        if self.is_local:
            self.root = str(Path(root).expanduser().resolve())
            self.fs = fsspec.filesystem("file")
        else:
            self.fs, path = fsspec.core.url_to_fs(root)
            self.root = root.rstrip("/")
            self._remote_path = path.rstrip("/")

    def __repr__(self) -> str:
        return f"Store({self.root!r})"

    # --- places --------------------------------------------------------------------------------
    def output(self, stage: str, version: str) -> str:
        """Where a step's output lives, as a path (local) or URL (remote)."""
        return f"{self.root}/{stage}/{version}"

    def relative(self, location: str) -> str:
        """A store location relative to the root: how paths enter versions and lineage."""
        prefix = self.root + "/"
        if not location.startswith(prefix):
            raise ValueError(f"{location} is not inside the store {self.root}")
        return location[len(prefix):]

    @property
    def local_root(self) -> Path:
        """Local folder for Prefect results, locks, work folders and (remote stores) caches."""
        if self.is_local:
            return Path(self.root)
        cache = Path(os.environ.get("KILN_CACHE", Path.home() / ".cache" / "kiln"))
        return cache / self.root.replace("://", "/")

    def work_dir(self, stage: str, version: str) -> Path:
        """Scratch that survives a crash (training checkpoints), stable per version."""
        return self.local_root / ".work" / f"{stage}-{version}"

    def failure_record(self, stage: str, version: str) -> Path:
        return self.local_root / ".failed" / f"{stage}-{version}.json"

    # --- state ---------------------------------------------------------------------------------
    def is_done(self, stage: str, version: str) -> bool:
        return self.fs.exists(self._fs_path(stage, version) + "/" + LINEAGE)

    def read_lineage(self, stage: str, version: str) -> dict:
        with self.fs.open(self._fs_path(stage, version) + "/" + LINEAGE, "r") as f:
            return json.load(f)

    def _fs_path(self, stage: str, version: str) -> str:
        return f"{self.root if self.is_local else self._remote_path}/{stage}/{version}"

    # --- writing -------------------------------------------------------------------------------
    def begin(self, stage: str, version: str) -> Path:
        """A fresh local folder to write an output into before it is published."""
        base = self.local_root / stage if self.is_local else self.local_root / ".staging" / stage
        tmp = base / f".tmp-{version}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        return tmp

    def publish(self, tmp: Path, stage: str, version: str, lineage: dict) -> str:
        """Record each file's sha256 in `lineage["files"]`, write `lineage.json` into `tmp` last,
        then move it into place. Returns the location."""
        lineage["files"] = file_checksums(tmp)
        (tmp / (LINEAGE + ".part")).write_text(json.dumps(lineage, indent=2, sort_keys=True))
        if self.is_local:
            final = Path(self.output(stage, version))
            if final.exists():  # an unfinished leftover (no lineage.json) or a forced rerun
                shutil.rmtree(final)
            os.replace(tmp / (LINEAGE + ".part"), tmp / LINEAGE)
            os.rename(tmp, final)
            return str(final)
        dest = self._fs_path(stage, version)
        if self.fs.exists(dest):
            self.fs.rm(dest, recursive=True)
        for path in sorted(tmp.rglob("*")):
            if path.is_file() and path.name != LINEAGE + ".part":
                self.fs.put_file(str(path), f"{dest}/{path.relative_to(tmp).as_posix()}")
        self.fs.put_file(str(tmp / (LINEAGE + ".part")), f"{dest}/{LINEAGE}")
        shutil.rmtree(tmp)
        return self.output(stage, version)

    def discard(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def unpublish(self, stage: str, version: str) -> None:
        """Remove a published output (for `--force`): lineage first, so it is never half-done."""
        path = self._fs_path(stage, version)
        if self.fs.exists(path + "/" + LINEAGE):
            self.fs.rm(path + "/" + LINEAGE)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    # --- reading -------------------------------------------------------------------------------
    def local_input(self, stage: str, version: str) -> Path:
        """A local folder holding a published output; remote ones are downloaded once."""
        if not self.is_done(stage, version):
            raise FileNotFoundError(
                f"input {stage}/{version} is not in the store {self.root}: run its step first")
        if self.is_local:
            return Path(self.output(stage, version))
        local = self.local_root / stage / version
        if not (local / LINEAGE).exists():
            part = local.with_name(local.name + f".part-{uuid.uuid4().hex[:8]}")
            self.fs.get(self._fs_path(stage, version) + "/", str(part), recursive=True)
            if local.exists():
                shutil.rmtree(local)
            os.rename(part, local)
        return local


# --- checksums ---------------------------------------------------------------------------------

CHUNK = 1 << 20


def file_checksums(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (but lineage.json), by path relative to it."""
    out = {}
    for path in sorted(Path(folder).rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel not in (LINEAGE, LINEAGE + ".part"):
            out[rel] = _sha256(path.open("rb"))
    return out


def _sha256(f) -> str:
    digest = hashlib.sha256()
    with f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_output(store: Store, stage: str, version: str) -> list[str]:
    """The files of a published output that are missing or no longer match the sha256 its
    lineage recorded: empty when it is whole. `lineage.json` itself is named when it is missing
    or unreadable. Lineage written before checksums were recorded has none to compare: such an
    output is accepted unverified (`is_verifiable` tells them apart)."""
    base = store._fs_path(stage, version)
    try:
        with store.fs.open(f"{base}/{LINEAGE}", "r") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return [LINEAGE]
    if not isinstance(record, dict) or record.get("stage") != stage or record.get("version") != version:
        return [LINEAGE]
    bad = []
    for rel, expected in sorted((record.get("files") or {}).items()):
        try:
            actual = _sha256(store.fs.open(f"{base}/{rel}", "rb"))
        except OSError:
            actual = None
        if actual != expected:
            bad.append(rel)
    return bad


def is_verifiable(store: Store, stage: str, version: str) -> bool:
    """Whether the output's lineage records checksums (lineage from before they existed does not)."""
    try:
        return "files" in store.read_lineage(stage, version)
    except (OSError, ValueError):
        return True  # unreadable lineage: verify_output reports it


def published(store: Store) -> list[tuple[str, str]]:
    """(stage, version) of every published output in the store, sorted."""
    root = store.root if store.is_local else store._remote_path
    found = []
    for path in store.fs.glob(f"{root}/*/*/{LINEAGE}"):
        stage, version = path.rstrip("/").split("/")[-3:-1]
        if not stage.startswith(".") and not version.startswith("."):
            found.append((stage, version))
    return sorted(found)
