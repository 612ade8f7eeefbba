"""The artefact store: `<root>/<stage>/<version>/`, published atomically, `lineage.json` last.

A folder is done exactly when its `lineage.json` exists. Outputs are written under a temporary
name and renamed into place, so a crash mid-write leaves a `.tmp-*` folder that nothing reads.
`lineage.json` records a sha256 and a size per output file (`files`, `sizes`). A run's cache
hit costs no reading of outputs: `check_output` compares one listing of the folder with the
recorded names and sizes (a file gone or cut short is not done), in time independent of the
bytes, and on a remote store without downloading anything. `verify_output` recomputes every
sha256, for `kiln verify` and `run.verify: full`.
The root is a local path (default `./kiln_store`, or `KILN_STORE`) or any fsspec URL (`gs://`,
`s3://`, ...): a remote store publishes by uploading the folder and writing `lineage.json` last,
and downloads inputs into a local cache before a stage reads them. Replacing a published version
(`--force`) swaps the new folder in at publish, in one step on a local store (`publish` says what
a reader sees meanwhile, locally and remotely).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import json
import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import fsspec

DEFAULT_STORE = "kiln_store"
LINEAGE = "lineage.json"


def default_store_root() -> str:
    return os.environ.get("KILN_STORE", DEFAULT_STORE)


def local_cache() -> Path:
    """This machine's cache for kiln (KILN_CACHE, default ~/.cache/kiln): copies of a remote
    store's files, their locks and work folders, compiled programs (training/compile_cache.py)."""
    return Path(os.environ.get("KILN_CACHE", Path.home() / ".cache" / "kiln"))


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
        return local_cache() / self.root.replace("://", "/")

    def work_dir(self, stage: str, version: str) -> Path:
        """Scratch that survives a crash (training checkpoints), stable per version."""
        return self.local_root / ".work" / f"{stage}-{version}"

    def failure_record(self, stage: str, version: str) -> Path:
        return self.local_root / ".failed" / f"{stage}-{version}.json"

    # --- state ---------------------------------------------------------------------------------
    def is_done(self, stage: str, version: str) -> bool:
        return self.fs.exists(self._fs_path(stage, version) + "/" + LINEAGE)

    def read_lineage(self, stage: str, version: str) -> dict:
        return json.loads(self.read_text(stage, version, LINEAGE))

    def read_text(self, stage: str, version: str, name: str) -> str:
        """A small file of a published output (its lineage, a model's model.json), local or remote."""
        with self.fs.open(self._fs_path(stage, version) + "/" + name, "r") as f:
            return f.read()

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
        then move it into place. Returns the location.

        What a reader of `<stage>/<version>/` sees while a version is replaced (a `--force` rerun,
        or a leftover without lineage): on a local store, the old folder until one `renameat2`
        exchanges it with the new one, then the new; never nothing, never a mix (see
        `_move_into_place` for filesystems without the exchange). On an fsspec store, which has no
        rename, the old `lineage.json` (the commit marker) goes first, then the old files, then
        the new files are uploaded and the new `lineage.json` last: a reader sees the old whole
        version, then none (not done), then the new whole version, never a half one as done."""
        lineage["files"] = file_checksums(tmp)
        lineage["sizes"] = {rel: (tmp / rel).stat().st_size for rel in lineage["files"]}
        (tmp / (LINEAGE + ".part")).write_text(json.dumps(lineage, indent=2, sort_keys=True))
        if self.is_local:
            final = Path(self.output(stage, version))
            os.replace(tmp / (LINEAGE + ".part"), tmp / LINEAGE)
            _move_into_place(tmp, final)
            return str(final)
        dest = self._fs_path(stage, version)
        if self.fs.exists(dest):
            if self.fs.exists(f"{dest}/{LINEAGE}"):
                self.fs.rm_file(f"{dest}/{LINEAGE}")  # no longer done before any file of it goes
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
        """A local folder holding a published output; remote ones are downloaded once per machine
        (per KILN_CACHE), under a file lock, so two steps or Ray hosts on one node that need the
        same input at once download it once and never see it half-written."""
        if not self.is_done(stage, version):
            raise FileNotFoundError(
                f"input {stage}/{version} is not in the store {self.root}: run its step first")
        if self.is_local:
            return Path(self.output(stage, version))
        local = self.local_root / stage / version
        if (local / LINEAGE).exists():
            return local
        local.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(local.with_name(f".{version}.fetch-lock")):
            if not (local / LINEAGE).exists():
                part = local.with_name(local.name + f".part-{uuid.uuid4().hex[:8]}")
                self.fs.get(self._fs_path(stage, version) + "/", str(part), recursive=True)
                if local.exists():  # a copy cut short by a crash before its rename (no lineage)
                    shutil.rmtree(local)
                os.rename(part, local)
        return local

    def workspace(self, stage: str, version: str) -> "Workspace":
        return Workspace(self.root, stage, version)


def _move_into_place(new: Path, final: Path) -> None:
    """Rename the complete folder `new` to `final`, replacing whatever is there in one step.

    A rename onto an absent (or empty) folder is atomic. A non-empty one, the previous output of a
    forced rerun, cannot be renamed over, so the two are swapped with Linux's
    `renameat2(RENAME_EXCHANGE)` (ext4, XFS, btrfs, tmpfs; Linux 3.15+) and the old one, now at
    `new`'s name, is deleted: `final` names a whole version at every moment. Where the exchange is
    missing (other systems, NFS, FUSE), the old folder is renamed aside first, which leaves
    `final` absent between two renames: a reader then sees no version for that instant, never a
    partial one, and a crash there leaves a version that is simply not done (rerun it)."""
    try:
        os.rename(new, final)
        return
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
    if not _exchange(new, final):
        aside = new.with_name(new.name + "-old")
        os.rename(final, aside)
        os.rename(new, final)
        new = aside
    shutil.rmtree(new)


RENAME_EXCHANGE = 2  # linux/fs.h
AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (`renameat2` with RENAME_EXCHANGE); False where the system or
    filesystem cannot."""
    renameat2 = getattr(_libc(), "renameat2", None) if sys.platform == "linux" else None
    if renameat2 is None:
        return False
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, f"cannot swap {a} with {b}: {os.strerror(err)}")


@functools.lru_cache(maxsize=None)
def _libc():
    return ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive advisory lock on `path` (created if missing), held for the `with` block."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --- what code on other machines is given -----------------------------------------------------

@dataclass(frozen=True)
class Located:
    """A published output named by its place in the store, never by a path on the driver: code
    that runs on a Ray host calls `local()` there and gets a folder on its own machine (the store
    itself when it is a local path, which must then be a filesystem every node mounts; otherwise
    a copy fetched into that node's cache). `root` None: a plain folder, for tests and tools that
    run a stage body without a store."""

    root: str | None
    stage: str
    version: str
    path: str = ""

    def local(self) -> Path:
        if self.root is None:
            return Path(self.path)
        return Store(self.root).local_input(self.stage, self.version)


PUSHED = "checkpoints-pushed"  # one empty file per checkpoint step whose upload completed


@dataclass(frozen=True)
class Workspace:
    """A step's work folder (checkpoints, the metrics so far, files the step prepared for its Ray
    hosts, the output a remote host writes) as every machine reaches it: in the store, at
    `<store>/.work/<stage>-<version>/`, so a rerun on another machine, or after a node died,
    resumes from the last checkpoint.

    With a local store the folder is used in place (a filesystem every node mounts, or one
    machine). With a remote store each machine works in its own cache (`local()`) and moves
    files with `pull` and `push`; a checkpoint counts in the store only once its upload
    finished (a marker under `checkpoints-pushed/`, written last), so a crash mid-upload leaves
    nothing a resume would pick. `root` None: a plain folder (`path`), nothing to move."""

    root: str | None
    stage: str
    version: str
    path: str = ""

    @property
    def remote(self) -> bool:
        return self.root is not None and "://" in self.root and not self.root.startswith("file://")

    def local(self, host: int | None = None) -> Path:
        """This machine's folder: the driver's (`host` None), or training host `host`'s. With a
        remote store each host works in a folder of its own, since two hosts may share a node."""
        if self.root is None or not self.remote or host is None:
            return Path(self.path) if self.root is None else Store(self.root).work_dir(self.stage, self.version)
        return Store(self.root).local_root / ".hosts" / f"{self.stage}-{self.version}-{host}"

    def _remote(self) -> tuple[fsspec.AbstractFileSystem, str]:
        store = Store(self.root)
        return store.fs, f"{store._remote_path}/.work/{self.stage}-{self.version}"

    def pull(self, host: int | None = None) -> Path:
        """This machine's copy, brought up to date with what the store holds: every file but
        the checkpoints, and each checkpoint whose upload completed. Returns `local(host)`."""
        local = self.local(host)
        local.mkdir(parents=True, exist_ok=True)
        if not self.remote:
            return local
        if host is not None:
            # A host's own checkpoints are never trusted: only host 0 writes the arrays, so
            # another host's folder holds steps with metadata only, and host 0 may have died
            # before pushing its last one. Every host starts from exactly what the store holds.
            shutil.rmtree(local / "checkpoints", ignore_errors=True)
        fs, base = self._remote()
        if not fs.exists(base):
            return local
        complete = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(f"{base}/{PUSHED}", detail=False)} \
            if fs.exists(f"{base}/{PUSHED}") else set()
        for path in fs.find(base):
            rel = path[len(base) + 1:]
            top = rel.split("/", 1)[0]
            if top == PUSHED or top == "output":
                continue
            if top == "checkpoints" and rel.split("/")[1] not in complete:
                continue  # an upload cut short, or one still running
            dest = local / rel
            if dest.exists() and dest.stat().st_size == fs.size(path):
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(path, str(dest))
        return local

    def push(self, checkpoint_steps: list[int] | None = None, output: bool = False, host: int | None = None) -> None:
        """Upload this machine's files to the store: everything but `checkpoints/` and `output/`,
        then the checkpoints of `checkpoint_steps` that the store lacks (each marked complete
        once uploaded), dropping from the store any checkpoint not among them; with `output`,
        the `output/` folder too."""
        if not self.remote:
            return
        local, (fs, base) = self.local(host), self._remote()
        for path in sorted(local.rglob("*")):
            rel = path.relative_to(local).as_posix()
            if path.is_file() and rel.split("/", 1)[0] not in ("checkpoints", "output"):
                fs.put_file(str(path), f"{base}/{rel}")
        if checkpoint_steps is not None:
            have = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(f"{base}/{PUSHED}", detail=False)} \
                if fs.exists(f"{base}/{PUSHED}") else set()
            for step in checkpoint_steps:
                if str(step) not in have:
                    _put_folder(fs, local / "checkpoints" / str(step), f"{base}/checkpoints/{step}")
                    fs.pipe_file(f"{base}/{PUSHED}/{step}", b"")
            for old in have - {str(s) for s in checkpoint_steps}:
                fs.rm_file(f"{base}/{PUSHED}/{old}")  # unmarked first: never a marker without files
                if fs.exists(f"{base}/checkpoints/{old}"):
                    fs.rm(f"{base}/checkpoints/{old}", recursive=True)
        if output:
            _put_folder(fs, local / "output", f"{base}/output")

    def fetch_output(self, dest: Path) -> None:
        """Download the `output/` a remote host pushed into `dest` (the driver's output folder)."""
        fs, base = self._remote()
        for path in fs.find(f"{base}/output"):
            target = Path(dest) / path[len(base) + len("/output/"):]
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(path, str(target))

    def remove(self) -> None:
        """Delete the work folder everywhere it is (once the output is published)."""
        shutil.rmtree(self.local(), ignore_errors=True)
        if self.remote:
            for folder in self.local(0).parent.glob(f"{self.stage}-{self.version}-*"):  # hosts that ran here
                shutil.rmtree(folder, ignore_errors=True)
            fs, base = self._remote()
            if fs.exists(base):
                fs.rm(base, recursive=True)


def _put_folder(fs, folder: Path, dest: str) -> None:
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            fs.put_file(str(path), f"{dest}/{path.relative_to(folder).as_posix()}")


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


def check_output(store: Store, stage: str, version: str) -> list[str]:
    """The files of a published output that are missing or not the size its lineage recorded
    (lineage.json itself when it is unreadable): what a cache hit checks. One listing of the
    folder, no file opened, so it costs the same for 1 KB and 20 GB, locally and on `s3://`.
    Lineage from before sizes were recorded is checked for the files' presence only."""
    record = _lineage_of(store, stage, version)
    if record is None:
        return [LINEAGE]
    base = store._fs_path(stage, version)
    listed = {info["name"].rstrip("/")[len(base.rstrip("/")) + 1:]: info.get("size")
              for info in store.fs.find(base, detail=True).values()}
    sizes = record.get("sizes") or {}
    return [rel for rel in sorted(record.get("files") or {})
            if rel not in listed or (rel in sizes and listed[rel] != sizes[rel])]


def _lineage_of(store: Store, stage: str, version: str) -> dict | None:
    """The output's lineage record, or None when it is missing, unreadable or of another step."""
    try:
        with store.fs.open(f"{store._fs_path(stage, version)}/{LINEAGE}", "r") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("stage") != stage or record.get("version") != version:
        return None
    return record


def verify_output(store: Store, stage: str, version: str) -> list[str]:
    """The files of a published output that are missing or no longer match the sha256 its
    lineage recorded: empty when it is whole. `lineage.json` itself is named when it is missing
    or unreadable. Lineage written before checksums were recorded has none to compare: such an
    output is accepted unverified (`is_verifiable` tells them apart)."""
    base = store._fs_path(stage, version)
    record = _lineage_of(store, stage, version)
    if record is None:
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
