"""`kiln capacity CONFIG`: whether an experiment's train step fits a device, before renting one.

The experiment's model (with its tokenizer's vocabulary, as the pipeline trains it) and train
sections go to training/capacity.py in a fresh process that starts JAX with N simulated CPU
devices (the device count can only be set before JAX starts). There the real train step is
compiled for the config's mesh from abstract shapes, and this prints what each device holds,
whether it fits each named device, and the step time at an assumed MFU. docs/capacity.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from training.capacity import DEFAULT_MEMORY_FRACTION, DEVICES, report, table

REPO = Path(__file__).resolve().parents[1]


def planned(model_cfg, train_cfg, devices: int, objective=None, timeout_s: float = 1800) -> dict:
    """training/capacity.py's plan of one config on `devices` simulated devices, in a subprocess;
    `objective` a post-training one (training/posttrain.py), or None: pretraining's."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO)
    objective_args = [] if objective is None else ["--objective", json.dumps(dataclasses.asdict(objective))]
    done = subprocess.run([sys.executable, "-m", "training.capacity", "--model", model_cfg.model_dump_json(),
                           "--train", train_cfg.model_dump_json(by_alias=True), "--devices", str(devices),
                           *objective_args], capture_output=True, text=True, env=env, timeout=timeout_s)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise RuntimeError(f"planning on {devices} simulated devices failed: {lines[-1] if lines else done.returncode} "
                           "(kiln capacity --devices N plans for N devices)")
    return json.loads(done.stdout.strip().splitlines()[-1])


def default_devices(resources) -> int:
    """The accelerators a config's resources ask for (hosts x GPUs or TPU chips per host), else 8."""
    per_host = resources.tpus_per_host if resources.tpu_hosts else resources.gpus_per_host
    return resources.hosts * per_host if per_host else 8


def capacity(config_path: str, devices: int | None = None, targets: list[str] | None = None, mfu: float = 0.4,
             memory_fraction: float = DEFAULT_MEMORY_FRACTION, remat: str | None = None,
             strategy: str | None = None, sets: Sequence[str] = (), step: str = "train") -> dict:
    """The report for an experiment config's train step `step` (`train`, or a phase's,
    `train/<phase>`, whose train section may change the batch or the mesh; or post-training's `sft`
    or `dpo`, of the same model with their own train and resources sections) on `devices`
    simulated devices (None: as many as its resources ask for); `remat` and `strategy` override
    its train section, `sets` any field (`--set`: flows.config.load_config)."""
    from flows.config import load_config
    from flows.plan import model_of

    config = load_config(config_path, sets)
    trains = {name: (train, config.resources, None) for name, (train, _) in config.phase_trains().items()}
    trains.update(posttraining(config))
    if step not in trains:
        raise ValueError(f"{config_path} has no train step {step!r}; its train steps: {', '.join(trains)}")
    train, resources, objective = trains[step]
    if remat is not None:
        train = train.model_copy(update={"remat": remat})
    if strategy is not None:
        train = train.model_copy(update={"mesh": train.mesh.model_copy(update={"strategy": strategy})})
    if train.document_mask and train.eos_id is None:  # any id: no shape depends on it
        train = train.model_copy(update={"eos_id": 0})
    train = type(train).model_validate(train.model_dump(by_alias=True))  # re-checked with the overrides
    model = model_of(config)  # a preset's own vocab_size (Llama 3's) as it gives it: a padded vocabulary
    r = report(planned(model, train, devices or default_devices(resources), objective), targets or list(DEVICES), mfu,
               memory_fraction)
    return {"step": step, "train_steps": list(trains), **r}


def posttraining(config) -> dict:
    """The post-training steps that train, by name: each its train and resources sections and its
    objective. They train the final model (the last train step's, or a soup's) as it is."""
    from training.posttrain import SFTObjective

    pt = config.posttrain
    if pt is None:
        return {}
    steps = {"sft": (pt.sft.train, pt.sft.resources, SFTObjective())}
    if pt.dpo is not None:
        steps["dpo"] = (pt.dpo.train, pt.dpo.resources, pt.dpo.objective())
    return steps


def print_report(r: dict, config_path: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"config": config_path, **r}, indent=2))
        return
    others = [s for s in r["train_steps"] if s != r["step"]]
    print(f"{config_path}, {r['step']}" + (f" (also: {', '.join(others)}; --step NAME)" if others else "")
          + f":\n{table(r)}")
