"""Watching training from the Prefect UI: a train step publishes a progress artifact that reaches
100% and, beside its task, its curves (loss and validation loss, learning rate, tokens/s) as a
picture and its logged points as a table; the evaluation results are a table too.

The first tests read the artifacts back through the Prefect API. The slow one runs `kiln run`
against a `prefect server start` and opens the flow-run page in headless Chromium, following the
page's own links to the artifacts. With KILN_SCREENSHOTS=docs it also rewrites the screenshots
docs/watching.md shows (docs/prefect-flow-run.png, docs/prefect-curves.png).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prefect import flow

from tasks.engine.runner import artifact_key
from tasks.engine.scheduler import execute
from tasks.engine.step import Step
from tasks.engine.store import Store
from tasks.train import show_curves
from tests.conftest import REPO, kiln, stop_group
from tests.test_faults import tiny_pipeline
from tasks.engine.config import ConfigModel
from training.metrics import curve_points, read_metrics

PNG = b"\x89PNG\r\n\x1a\n"
DATA_URL = re.compile(r"data:image/png;base64,([A-Za-z0-9+/=]+)")


def artifacts_of(step: Step) -> dict:
    """The step's artifacts (latest version of each key), by the name it showed them under."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    names = {artifact_key(step, n): n for n in ("progress", "curves", "metrics", "results")}
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=list(names))))
    return {names[a.key]: a for a in sorted(found, key=lambda a: a.created)}


def check_training_artifacts(train: Step, output: Path) -> dict:
    """What the UI shows beside a train step, against its output; returns its artifacts."""
    shown = artifacts_of(train)
    assert shown["progress"].type == "progress" and shown["progress"].data == 100.0
    assert shown["curves"].type == "markdown"
    (png,) = DATA_URL.findall(shown["curves"].data)  # the picture inline: nothing to fetch from the store
    png = base64.b64decode(png)
    assert png.startswith(PNG) and int.from_bytes(png[16:20], "big") > 600  # a PNG, wide enough for three panels
    records = read_metrics(output / "metrics.jsonl")
    assert shown["metrics"].type == "table" and json.loads(shown["metrics"].data) == curve_points(records)
    assert {a.task_run_id for a in shown.values()} == {shown["progress"].task_run_id}  # beside the train task
    return shown


class Logged(ConfigModel):
    steps: int
    eval_every: int


def _logs_like_training(ctx) -> dict:
    """What the train step does around its training loop (tasks/train.py), minus the loop: reports
    each logged step as progress, leaves metrics.jsonl in its output, and shows the curves."""
    cfg, records = ctx.config, []
    for step in range(2, cfg.steps + 1, 2):
        record = {"step": step, "loss": 6.0 / step ** 0.2, "lr": 3e-3 * (1 - step / (cfg.steps + 1)),
                  "grad_norm": 0.5, "tokens": step * 256, "tokens_per_s": 5e4 + 100 * step, "mfu": None}
        if step % cfg.eval_every == 0:
            record["val_loss"] = record["loss"] + 0.1
        records.append(record)
        ctx.progress(step, cfg.steps)
    (ctx.out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    show_curves(ctx, cfg.steps)
    return {"records": len(records)}


@flow
def showing(steps: list, store: str):
    return execute(steps, Store(store))


def test_a_step_shows_its_progress_curves_and_points_beside_its_task(tmp_path, prefect_harness):
    """The train step's part of this (tasks/train.py `show_curves`) is checked on a real training
    run in tests/test_training_task.py, and end to end in the slow test below."""
    step = Step("train", "toy_train", 1, Logged(steps=40, eval_every=10), _logs_like_training)
    store = Store(tmp_path / "store")
    (run,) = showing([step], store.root)
    assert run.status == "ran"
    shown = check_training_artifacts(step, Path(store.output(step.stage, step.version)))
    points = json.loads(shown["metrics"].data)
    assert [p["step"] for p in points] == list(range(2, 41, 2))
    assert [p["step"] for p in points if p.get("val_loss") is not None] == [10, 20, 30, 40]


def test_a_long_run_shows_evenly_spaced_points_with_its_last():
    records = [{"step": s, "loss": 1.0 / s} for s in range(1, 1202)]
    points = curve_points(records, most=500)
    assert len(points) == 500 and points[0]["step"] == 1 and points[-1]["step"] == 1201
    gaps = {b["step"] - a["step"] for a, b in zip(points, points[1:])}
    assert gaps <= {2, 3} and points[7]["loss"] == float(f"{1.0 / points[7]['step']:.6g}")


# --- in the browser ------------------------------------------------------------------------------

def chromium(out: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium, in a profile of its own; every process it starts is stopped after."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("needs Chromium for the UI check: apt-get install -y chromium (.ci/run installs it)")
    proc = subprocess.Popen([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                             f"--user-data-dir={out / 'chromium-profile'}", "--virtual-time-budget=20000", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=180)
    finally:
        stop_group(proc, grace_s=5)
    assert proc.returncode == 0, f"chromium {' '.join(args)} exited {proc.returncode}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout)


def rendered(out: Path, url: str) -> str:
    """The page's DOM once its scripts have run (the UIs render client-side)."""
    return chromium(out, "--window-size=1400,1000", "--dump-dom", url).stdout


def screenshot(out: Path, url: str, name: str, size: str = "1280,900") -> Path:
    path = out / name
    chromium(out, f"--window-size={size}", f"--screenshot={path}", url)
    if os.environ.get("KILN_SCREENSHOTS"):  # 256 colours: a third of the bytes, same look
        from PIL import Image

        Image.open(path).convert("RGB").quantize(256).save(REPO / os.environ["KILN_SCREENSHOTS"] / name, optimize=True)
    return path


def painted(png: Path, rgb: tuple[int, int, int], tolerance: int = 30) -> int:
    """How many pixels of the screenshot are this colour, give or take `tolerance` per channel
    (the UI scales the picture down, which blends a line's edges with the white around it)."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(png).convert("RGB"), dtype=np.int16)
    return int((np.abs(pixels - np.array(rgb)).max(axis=-1) <= tolerance).sum())


TAB_BLUE, TAB_GREEN, TAB_PURPLE = (31, 119, 180), (44, 160, 44), (148, 103, 189)  # the three curves' colours


@pytest.mark.slow  # kiln run to an evaluated model against a Prefect server, then Chromium: 3-6 min on 2 cores
def test_the_flow_run_page_leads_to_the_curves_and_results(tmp_path, prefect_server):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    config_path = tiny_pipeline(tmp_path, posttrain=False)
    config = yaml.safe_load(config_path.read_text())
    config["train"].update(steps=60, log_every=2, eval_every=10, checkpoint_every=30)  # a curve worth a look
    config_path.write_text(yaml.safe_dump(config))
    store = tmp_path / "store"
    kiln("run", str(config_path), "--store", str(store), "--until", "evaluate", env=prefect_server)
    from flows.experiment import load_experiment

    steps = {s.name: s for s in load_experiment(str(config_path)).steps}
    train, evaluate = steps["train"], steps["evaluate"]
    with temporary_settings(updates={PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):  # this process's client
        shown = check_training_artifacts(train, store / "train" / train.version)
        results = artifacts_of(evaluate)["results"]
    assert results.type == "table" and any(r["task"] == "next_passage" for r in json.loads(results.data))
    flow_run = shown["curves"].flow_run_id
    assert results.flow_run_id == flow_run

    ui = prefect_server["PREFECT_API_URL"].removesuffix("/api")
    page = rendered(tmp_path, f"{ui}/v2/runs/flow-run/{flow_run}?tab=Artifacts")  # the default UI (/ leads there)
    assert 'data-testid="flow-run-artifacts-grid"' in page
    cards = dict(re.findall(r'<a href="(/v2/artifacts/artifact/[0-9a-f-]+)"[^>]*>.*?<h3[^>]*>([a-z0-9-]+)</h3>', page))
    links = {key: href for href, key in cards.items()}
    for name, artifact in [*shown.items(), ("results", results)]:
        assert artifact.key in links, f"no card for {artifact.key} on the flow-run page"
        assert links[artifact.key].endswith(str(artifact.id))

    curves = rendered(tmp_path, ui + links[shown["curves"].key])  # the card's link, followed
    assert DATA_URL.search(shown["curves"].data).group(0) in curves  # the published picture, in an <img>
    assert re.search(r'<img [^>]*src="data:image/png;base64,', curves)
    table = rendered(tmp_path, ui + links[results.key])
    assert 'data-testid="table-display"' in table and "next_passage" in table and "bits_per_byte" in table
    v1 = rendered(tmp_path, f"{ui}/artifacts/artifact/{shown['curves'].id}")  # the UI Prefect's log links open
    assert re.search(r'<img [^>]*src="data:image/png;base64,', v1)

    picture = screenshot(tmp_path, ui + links[shown["curves"].key], "prefect-curves.png", "1280,800")
    for colour in (TAB_BLUE, TAB_GREEN, TAB_PURPLE):  # loss, learning rate and tokens/s drawn on the page
        assert painted(picture, colour) > 40, f"no {colour} pixels: the curves were not drawn"
    screenshot(tmp_path, f"{ui}/v2/runs/flow-run/{flow_run}?tab=Artifacts", "prefect-flow-run.png", "1280,2200")
