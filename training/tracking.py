"""What a researcher watches while a model trains: TensorBoard event files, and optionally W&B.

Both receive exactly the records of `metrics.jsonl` (loss, val_loss, lr, grad_norm, tokens,
tokens_per_s, mfu, and an objective's own metrics such as DPO's margin), one scalar per key at
the record's step, under the same names.

- TensorBoard: `training.loop.train` always writes event files to `<work_dir>/tensorboard/`
  while it runs and copies them to `<out_dir>/tensorboard/` with the model, so
  `tensorboard --logdir kiln_store/train` shows every trained version side by side.
- Weights & Biases: the `tracking.wandb` section of the experiment config (project, entity,
  mode). The step logs the relayed records from its own process (the driver, not the Ray
  worker), in a run named and identified `<stage>-<version>` with the step's config attached.
  Tracking is a setting: it never enters a version. W&B is an optional extra
  (`pip install "kiln[wandb]"`); offline runs land under $WANDB_DIR (`wandb sync` uploads them).

No Prefect, no Ray here; tensorboardX and wandb are imported only when used.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterator, Literal

from tasks.engine.config import ConfigModel, setting

TENSORBOARD_DIR = "tensorboard"


class WandbConfig(ConfigModel):
    """A Weights & Biases run per training step, named after the step version."""

    project: str = setting("kiln", description="The W&B project runs are logged to.")
    entity: str | None = setting(None, description="The W&B team or user; None: the account's default.")
    mode: Literal["online", "offline", "disabled"] = setting(
        "online", description="online: upload as it trains; offline: write the run under $WANDB_DIR "
        "for `wandb sync`; disabled: log nothing.")


class TrackingConfig(ConfigModel):
    """Where training metrics go besides metrics.jsonl and TensorBoard (always written)."""

    wandb: WandbConfig | None = setting(None, description="Log to Weights & Biases; leave out for no W&B.")


def scalars(record: dict) -> dict[str, float]:
    """The numeric values of a metrics record other than its step (None, e.g. an unknown MFU, is left out)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardLog:
    """Metrics records as TensorBoard scalars in `folder`, one tag per metrics.jsonl key.

    `history` is what metrics.jsonl already holds (after a resume, the records up to the
    checkpoint): the folder is started afresh with them, so a run that died after its last
    checkpoint leaves no steps in TensorBoard that metrics.jsonl no longer has."""

    def __init__(self, folder: Path, history: list[dict] = ()):
        SummaryWriter = _summary_writer()
        self.folder = Path(folder)
        shutil.rmtree(self.folder, ignore_errors=True)
        self.writer = SummaryWriter(logdir=str(self.folder), flush_secs=10)
        for record in history:
            self.write(record)

    def write(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, global_step=record["step"])

    def close(self) -> None:
        self.writer.close()


def _summary_writer():
    """tensorboardX's SummaryWriter, imported without PyTorch. Where torch is installed, importing
    tensorboardX imports it too (2.2 s of every training process: benchmarks/compile_cache_bench.py)
    only so that its `add_*` calls accept torch tensors; kiln logs floats. So unless this process
    has torch already, `import torch` fails for the moment tensorboardX is imported, and works
    again afterwards."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # Python's marker for "import torch raises ImportError"
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


@contextlib.contextmanager
def tracked(relay: Callable[[dict], None] | None, tracking: TrackingConfig, name: str,
            config: dict) -> Iterator[Callable[[dict], None]]:
    """`relay` extended to the trackers `tracking` asks for, for as long as the block runs:
    the `on_metrics` a step passes to training. `name` ("<stage>-<version>") names the W&B run;
    `config` (the step's config, as JSON) is attached to it."""
    with wandb_run(tracking.wandb, name, config) as to_wandb:
        def on_metrics(record: dict) -> None:
            if relay is not None:
                relay(record)
            if to_wandb is not None:
                to_wandb(record)
        yield on_metrics


@contextlib.contextmanager
def wandb_run(cfg: WandbConfig | None, name: str, config: dict) -> Iterator[Callable[[dict], None] | None]:
    """A W&B run for one step (None when not asked for), finished when the block ends.

    The run's id is its name, so a resumed step version continues its own run (online)."""
    if cfg is None or cfg.mode == "disabled":
        yield None
        return
    try:
        import wandb
    except ImportError:
        raise ImportError("tracking.wandb is set but wandb is not installed: pip install \"kiln[wandb]\" "
                          "(or uv sync --extra wandb), or remove tracking.wandb from the config") from None
    # $WANDB_DIR read now, not when wandb first set itself up in this process: a long-lived driver
    # (kiln serve, a test session) whose environment changed writes where it now says.
    run = wandb.init(project=cfg.project, entity=cfg.entity, mode=cfg.mode, name=name, id=name, config=config,
                     resume="allow", reinit="create_new", dir=os.environ.get("WANDB_DIR") or None,
                     settings=wandb.Settings(console="off", silent=True))
    failed = True
    try:
        yield lambda record: run.log(scalars(record), step=record["step"])
        failed = False
    finally:
        run.finish(exit_code=1 if failed else 0)
