"""What training reports: `metrics.jsonl` (one JSON object per log step), `loss.png`, the curves
shown in the Prefect UI, and the device peak that MFU is measured against.
"""

from __future__ import annotations

import functools
import io
import json
import time
from pathlib import Path

# Dense bfloat16 peak FLOP/s per device, from the vendors' data sheets (SXM parts for NVIDIA).
DECLARED_PEAK = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12,
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12,
}


@functools.cache
def measured_matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """Best-of-`repeats` float32 FLOP/s of one jitted n x n matmul on the default device: the
    practical ceiling of this CPU for the same kind of work a training step does."""
    import jax  # here, not at the top: the stages read metrics files for plans and tables without JAX
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def device_peak_flops(declared: float | None = None) -> tuple[float | None, str]:
    """Peak FLOP/s of all devices together, and where the number comes from.

    `declared` (per device) wins; else a known accelerator's data-sheet peak; else, on CPU, the
    measured float32 matmul peak of this host times the number of hosts (XLA's CPU devices of
    one process share its cores, so the host, not the device, is the unit).
    """
    import jax

    devices = jax.devices()
    if declared:
        return declared * len(devices), "declared"
    kind = devices[0].device_kind
    if devices[0].platform == "cpu":
        return measured_matmul_peak() * jax.process_count(), "measured fp32 matmul"
    for name, peak in DECLARED_PEAK.items():
        if name.lower() in kind.lower():
            return peak * len(devices), f"{name} data sheet"
    return None, f"unknown device {kind!r}: set train.peak_flops"


class MetricsLog:
    """Appends records to `metrics.jsonl`. On resume, records past the restored step (written
    after the checkpoint by the run that died) are dropped, so the file reads as one run."""

    def __init__(self, path: Path, resume_step: int):
        self.path = Path(path)
        kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step] if self.path.exists() else []
        self.records = kept
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_loss(records: list[dict], path: Path, title: str = "") -> None:
    """Training loss per log step and validation loss where measured, to a PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    _loss_panel(ax, records)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_curves(records: list[dict], title: str = "") -> bytes:
    """What a researcher looks at first, as one PNG (its bytes): loss and validation loss on top,
    the learning rate and the throughput (tokens/s) under it, per log step; with in-loop evals
    (evaluation/in_loop.py) a row more: held-out bits per byte per source, and task metrics.
    Sized to stay legible at the ~600 px the Prefect UI gives an artifact's picture."""
    plt = _pyplot()
    bpb = sorted({k for r in records for k in r if k.startswith("eval/") and k.endswith("/bpb")})
    acc = sorted({k for r in records for k in r if k.startswith("eval/") and k.endswith(("/acc", "/acc_norm"))})
    rows = 3 if bpb or acc else 2
    fig = plt.figure(figsize=(8, 6 if rows == 2 else 8.5), dpi=90)
    grid = fig.add_gridspec(rows, 2, height_ratios=(3, 2, 2)[:rows])
    loss, lr, speed = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    _loss_panel(loss, records)
    steps = [r["step"] for r in records]
    lr.plot(steps, [r["lr"] for r in records], color="tab:green")
    lr.set_ylabel("learning rate")
    speed.plot(steps, [r["tokens_per_s"] for r in records], color="tab:purple")
    speed.set_ylabel("tokens/s")
    panels = [lr, speed]
    for column, (keys, label) in enumerate(((bpb, "held-out bits per byte"), (acc, "task accuracy"))):
        if rows == 3 and keys:
            ax = fig.add_subplot(grid[2, column])
            for key in keys:
                points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
                ax.plot(*zip(*points), "o-", markersize=3, label=key.removeprefix("eval/"))
            ax.set_ylabel(label)
            ax.legend(fontsize=7)
            panels.append(ax)
    for ax in panels:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def curve_points(records: list[dict], most: int = 500) -> list[dict]:
    """The records as table rows (6 significant digits), at most `most` of them, evenly spaced
    and always with the last, so a long run's table stays small enough to browse."""
    if len(records) > most:
        records = [records[round(i * (len(records) - 1) / (most - 1))] for i in range(most)]
    return [{k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in r.items()} for r in records]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _loss_panel(ax, records: list[dict]) -> None:
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train")
    val = [r for r in records if r.get("val_loss") is not None]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
