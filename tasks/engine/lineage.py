"""Lineage: the `lineage.json` beside every output, its Prefect artifact and asset event, and
the tree from any artefact back to its raw inputs.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from tasks.engine.step import Step
from tasks.engine.store import LINEAGE, Store
from tasks.engine.versioning import file_sha256, identity_fields

PACKAGES = ["kiln", "prefect", "ray", "jax", "jaxlib", "flax", "optax", "numpy", "tokenizers",
            "fasttext-numpy2-wheel", "lm-eval", "pydantic"]
REPO = Path(__file__).resolve().parents[2]


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


@lru_cache(maxsize=1)
def git_state() -> dict:
    """The commit kiln runs from and whether its tree is dirty (None outside a git checkout)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (subprocess.SubprocessError, FileNotFoundError):
        return {"commit": None, "dirty": None}


def source_hash(step: Step) -> str:
    """Hash of the module that defines the stage body (what `kiln plan` compared before lineage
    recorded `module_hashes`; kept so older outputs are still compared)."""
    path = inspect.getsourcefile(step.run)
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12] if path else ""


KILN_PACKAGES = ("flows", "tasks", "training", "evaluation")


def module_hashes(step: Step) -> dict[str, str]:
    """sha256 (12 hex) of the module that defines the stage body and of every kiln module it
    imports, directly or through others (KILN_PACKAGES, in this repo), by path relative to the
    repo: what `kiln plan` compares across runs, so an edit in `training/model.py` warns for the
    train steps it made. Imports are read from the source, so those inside functions (JAX and
    lm-eval load when a step runs, not when it is planned) count; those under `if TYPE_CHECKING:`
    never run and do not."""
    path = inspect.getsourcefile(step.run)
    if not path:
        return {}
    root = Path(path).resolve()
    start = [root, *_module_files(_repo_name(root).removesuffix(".py").replace("/", "."))]  # with its packages
    return {_repo_name(p): file_sha256(p)[:12] for p in _module_closure(start)}


def _repo_name(path: Path) -> str:
    """A module's path relative to the repo; a module elsewhere (an experiment file) by its name."""
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name


def _module_closure(start: list[Path]) -> list[Path]:
    seen, todo = set(), list(start)
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            stat = path.stat()
            todo += [Path(p) for p in _kiln_imports(str(path), stat.st_mtime_ns, stat.st_size)]
    return sorted(seen)


@lru_cache(maxsize=1024)
def _kiln_imports(path: str, mtime_ns: int, size: int) -> tuple[str, ...]:
    """The kiln module files that `path` imports (cached while the file stays the same)."""
    package = _repo_name(Path(path)).removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    if not Path(path).name == "__init__.py":
        package = package.rpartition(".")[0]
    names = []
    tree = ast.parse(Path(path).read_bytes())  # under tasks/engine/ast_guard.py's lock when steps run
    for node in _executed(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            names += [base, *(f"{base}.{a.name}" for a in node.names)]
    return tuple(sorted({str(f) for name in names for f in _module_files(name)}))


def _executed(tree: ast.AST):
    """Every node of `tree` that can run, i.e. all but the bodies of `if TYPE_CHECKING:`."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        else:
            todo += list(ast.iter_child_nodes(node))


def _module_files(name: str) -> list[Path]:
    """The files importing module `name` runs, if it is kiln's: each package's __init__ and the module."""
    parts = name.split(".")
    if parts[0] not in KILN_PACKAGES:
        return []
    found = [REPO.joinpath(*parts[:i], "__init__.py") for i in range(1, len(parts) + 1)]
    found.append(REPO.joinpath(*parts[:-1], parts[-1] + ".py"))
    return [f.resolve() for f in found if f.is_file()]


@lru_cache(maxsize=1)
def environment() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    env = {"python": platform.python_version(), "platform": platform.platform(),
           "packages": versions, "cpus": os.cpu_count()}
    if "jax" in sys.modules:  # only stages that use JAX pay for asking it about devices
        import jax

        devices = jax.devices()
        env["devices"] = {"kind": devices[0].device_kind, "platform": devices[0].platform,
                          "count": len(devices)}
    return env


def build_lineage(step: Step, store: Store, stats: dict, started: str, ended: str,
                  run_ids: dict, upstream: dict[str, dict]) -> dict:
    """The record written as `lineage.json`. `upstream` maps input name to its lineage record."""
    return {
        "stage": step.stage,
        "name": step.name,
        "version": step.version,
        "stage_version": step.stage_version,
        "config": identity_fields(step.config),
        "settings": step.config.model_dump(mode="json"),
        "inputs": [
            {"name": name, "stage": s.stage, "version": s.version,
             "path": f"{s.stage}/{s.version}",
             "flow_run_id": upstream.get(name, {}).get("prefect", {}).get("flow_run_id")}
            for name, s in step.inputs.items()
        ],
        "code": {**git_state(), "source_sha256": source_hash(step), "module_hashes": module_hashes(step)},
        "environment": environment(),
        "prefect": run_ids,
        "started": started,
        "ended": ended,
        "stats": stats,
    }


# --- the Prefect dashboard ---------------------------------------------------------------------

def ui_run_link(flow_run_id: str | None) -> str | None:
    if not flow_run_id:
        return None
    from prefect.settings import PREFECT_UI_URL

    base = PREFECT_UI_URL.value()
    return f"{base.rstrip('/')}/runs/flow-run/{flow_run_id}" if base else None


def artifact_markdown(lineage: dict) -> str:
    lines = [f"# {lineage['name']} `{lineage['version']}`", "",
             f"stage `{lineage['stage']}` (stage version {lineage['stage_version']}), "
             f"code `{(lineage['code'].get('commit') or 'unknown')[:10]}`", "", "## Stats", "",
             "| stat | value |", "| --- | --- |"]
    for key, value in lineage["stats"].items():
        lines.append(f"| {key} | {json.dumps(value) if isinstance(value, (dict, list)) else value} |")
    lines += ["", "## Upstream", ""]
    if not lineage["inputs"]:
        lines.append("raw sources only (see the config)")
    for inp in lineage["inputs"]:
        link = ui_run_link(inp.get("flow_run_id"))
        run = f" — [produced by flow run]({link})" if link else ""
        lines.append(f"- **{inp['name']}**: `{inp['stage']}/{inp['version']}`{run}")
    return "\n".join(lines)


def publish_to_prefect(lineage: dict, store: Store) -> None:
    """A markdown artifact per step, and an asset materialisation event with its upstream edges."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.events import emit_event

    create_markdown_artifact(
        key=f"{lineage['stage'].replace('_', '-')}-{lineage['version']}",
        markdown=artifact_markdown(lineage),
        description=f"kiln {lineage['stage']} {lineage['version']}",
    )
    emit_event(
        event="prefect.asset.materialization.succeeded",
        resource={"prefect.resource.id": asset_key(store, lineage["stage"], lineage["version"]),
                  "prefect.resource.name": lineage["name"]},
        related=[{"prefect.resource.id": asset_key(store, i["stage"], i["version"]),
                  "prefect.resource.role": "asset"} for i in lineage["inputs"]],
        payload={"stats": lineage["stats"]},
    )


def asset_key(store: Store, stage: str, version: str) -> str:
    location = store.output(stage, version)
    return location if "://" in location else f"file://{location}"


# --- kiln lineage PATH -------------------------------------------------------------------------

def read_lineage(path: Path) -> dict:
    file = Path(path) / LINEAGE
    if not file.exists():
        raise FileNotFoundError(f"{path} has no {LINEAGE}: it is not a finished kiln artefact")
    return json.loads(file.read_text())


def lineage_tree(path: Path) -> dict:
    """The artefact at `path` with its inputs, recursively, read from the store it sits in."""
    path = Path(path).resolve()
    record = read_lineage(path)
    store_root = path.parent.parent
    children = []
    for inp in record["inputs"]:
        child = store_root / inp["stage"] / inp["version"]
        children.append(lineage_tree(child) if (child / LINEAGE).exists()
                        else {"stage": inp["stage"], "version": inp["version"], "missing": True})
    return {"stage": record["stage"], "name": record["name"], "version": record["version"],
            "path": str(path), "stats": record["stats"], "sources": _sources(record),
            "inputs": children}


def store_lineage_tree(store: Store, stage: str, version: str) -> dict:
    """The tree of `<stage>/<version>` read through `store`, local or any fsspec URL (`memory://`,
    `s3://`, `file://`, ...): what `lineage_tree` gives for a local folder, with store locations
    as paths."""
    if not store.is_done(stage, version):
        raise FileNotFoundError(f"{store.output(stage, version)} has no {LINEAGE}: it is not a finished kiln artefact")
    record = store.read_lineage(stage, version)
    children = [store_lineage_tree(store, inp["stage"], inp["version"]) if store.is_done(inp["stage"], inp["version"])
                else {"stage": inp["stage"], "version": inp["version"], "missing": True} for inp in record["inputs"]]
    return {"stage": record["stage"], "name": record["name"], "version": record["version"],
            "path": store.output(stage, version), "stats": record["stats"], "sources": _sources(record),
            "inputs": children}


def lineage_at(location: str) -> dict:
    """The tree of the artefact at `location`: a local folder, or `<store URL>/<stage>/<version>`
    (a `file://` URL too)."""
    if "://" not in location:
        return lineage_tree(Path(location))
    root, stage, version = location.rstrip("/").rsplit("/", 2)
    if "://" not in root or not root.split("://", 1)[1]:
        raise FileNotFoundError(f"{location} is not <store URL>/<stage>/<version> (for example "
                                "memory://bucket/kiln/train/3f9c0a1b2c4d)")
    return store_lineage_tree(Store(root), stage, version)


SHOWN_ABOVE = "(its inputs as above)"  # an artefact met again in a tree: the phases, soups and
# post-training of one run share their data steps, so each is spelt out once


def tree_markdown(node: dict, depth: int = 0, shown: set | None = None) -> str:
    """The lineage tree as nested markdown bullets, with links to the producing flow runs; an
    artefact met again lists no inputs (SHOWN_ABOVE)."""
    pad, shown = "  " * depth, set() if shown is None else shown
    if node.get("missing"):
        return f"{pad}- `{node['stage']}/{node['version']}` (missing from this store)"
    record = read_lineage(Path(node["path"]))
    link = ui_run_link(record.get("prefect", {}).get("flow_run_id"))
    run = f" — [flow run]({link})" if link else ""
    again = (node["stage"], node["version"]) in shown
    lines = [f"{pad}- **{node['name']}** `{node['version']}`{run}" + (f" {SHOWN_ABOVE}" if again and (
        node["inputs"] or node.get("sources")) else "")]
    if again:
        return lines[0]
    shown.add((node["stage"], node["version"]))
    for src in node.get("sources", []):
        lines.append(f"{pad}  - source **{src.get('name')}**: {src.get('origin', '')}")
    lines += [tree_markdown(child, depth + 1, shown) for child in node["inputs"]]
    return "\n".join(lines)


def _sources(record: dict) -> list:
    return record["stats"].get("sources", []) if not record["inputs"] else []


def format_tree(node: dict, indent: str = "", shown: set | None = None) -> str:
    """The lineage tree as indented text (`kiln lineage`); an artefact met again lists no inputs
    (SHOWN_ABOVE)."""
    shown = set() if shown is None else shown
    if node.get("missing"):
        return f"{indent}{node['stage']}/{node['version']}  (missing from this store)"
    keys = ("documents", "docs_out", "tokens", "final_loss")
    brief = ", ".join(f"{k}={node['stats'][k]}" for k in keys if k in node["stats"])
    line = f"{indent}{node['name']} {node['version']}  {node['path']}" + (f"  [{brief}]" if brief else "")
    if (node["stage"], node["version"]) in shown:
        return line + (f"  {SHOWN_ABOVE}" if node["inputs"] or node.get("sources") else "")
    shown.add((node["stage"], node["version"]))
    lines = [line]
    for src in node.get("sources", []):
        lines.append(f"{indent}  <- source {src.get('name')}: {src.get('origin', '')}")
    for child in node["inputs"]:
        lines.append(format_tree(child, indent + "  ", shown))
    return "\n".join(lines)
