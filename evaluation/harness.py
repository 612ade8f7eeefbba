"""Run lm-eval in-process on a kiln model: kiln's suite tasks and any lm-eval task this machine
can load, through `lm_eval.simple_evaluate` with one `TaskManager`.

lm-eval's own task index (~15k entries, 10-25 s to build on 2 cores) is read only when the
config names lm-eval tasks, and once per process. Each task is loaded before anything is evaluated, so a task that
cannot be loaded (a typo, or a dataset that is neither cached nor downloadable here) stops the
run at once with a `TaskUnavailable` that names the task and says why, instead of a network
traceback halfway through an evaluation. Only lm-eval's built-in metrics are used (a metric
outside its registry would be fetched from the hub). lm-eval itself (and with it `datasets` and
pandas, seconds to import) is imported by the functions that use it.
"""

from __future__ import annotations

import functools
import logging
import os
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

log = logging.getLogger("kiln.evaluation")

# Two evaluate steps can run side by side in one driver (the scheduler's threads). `datasets` wraps
# its loads in tqdm's `ensure_lock`, which deletes tqdm's class-level lock afterwards when it found
# none, under any other thread's bar ("type object 'tqdm' has no attribute '_lock'"). With the lock
# made once here, it is only ever restored, never deleted.
import tqdm.std  # noqa: E402

tqdm.std.tqdm.get_lock()


class TaskUnavailable(RuntimeError):
    """An lm-eval task that this machine cannot load; the message names it and says why."""


def _datasets_cache() -> str:
    return os.environ.get("HF_DATASETS_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "datasets")


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


@functools.lru_cache(maxsize=2)
def task_manager(include_defaults: bool) -> TaskManager:
    """An lm-eval TaskManager, built once per process: indexing lm-eval's own tasks takes seconds,
    and kiln's suite tasks are passed as configs, so one index serves every evaluation."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=include_defaults)


def load_task(manager: TaskManager, spec: str | dict) -> list:
    """The lm-eval objects (tasks or a group) for one task name or config, loaded now.

    Loading a task reads its dataset, so this is where an unavailable dataset shows up.
    """
    from datasets.exceptions import DatasetsError

    name = spec if isinstance(spec, str) else spec["task"]
    if isinstance(spec, str) and spec not in manager.all_tasks and not Path(spec).is_file():
        raise TaskUnavailable(
            f"lm-eval task {spec!r} is not a task, group or tag known to lm-eval "
            f"{metadata.version('lm-eval')}: check the name (`lm_eval ls tasks` lists them); kiln's own "
            "suite tasks go under eval.tasks, not eval.lm_eval_tasks")
    try:
        loaded = manager.load([spec])
    except (OSError, DatasetsError) as e:
        entry = manager.task_index.get(name) if isinstance(spec, str) else None
        dataset = (entry.cfg or {}).get("dataset_path") if entry is not None else spec.get("dataset_path")
        needs = f"its dataset {dataset!r}" if dataset else "its dataset"
        where = ("the Hugging Face hub is switched off here (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)"
                 if _offline() else "it could not be downloaded")
        reason = str(e).splitlines()[0] if str(e) else ""
        raise TaskUnavailable(
            f"lm-eval task {name!r} cannot be loaded on this machine: {needs} is not in the local "
            f"datasets cache ({_datasets_cache()}) and {where} ({type(e).__name__}: {reason}). "
            f"Run it once where the hub is reachable to cache it, or remove {name!r} from the eval config."
        ) from None
    if isinstance(spec, str) and spec in loaded["groups"]:
        return [loaded["groups"][spec]]  # keep the group, so lm-eval reports its aggregate too
    return list(loaded["tasks"].values())


def evaluate(lm: LM, suite_configs: list[dict], lm_eval_tasks: list[str], limit: int | None,
             num_fewshot: int = 0, apply_chat_template: bool = False) -> dict:
    """lm-eval's results dict (without per-sample logs) for the given tasks.

    `suite_configs` are task config dicts (see `evaluation.suite.task_configs`); `lm_eval_tasks`
    are names from lm-eval's registry. `limit` caps the examples per task. `apply_chat_template`
    is lm-eval's: each prompt in the model's chat template (few-shot examples as turns).
    """
    if not suite_configs and not lm_eval_tasks:
        raise ValueError("no tasks to evaluate: name kiln suite tasks and/or lm-eval tasks in the config")
    import lm_eval

    manager = task_manager(bool(lm_eval_tasks))
    objects = []
    for spec in [*suite_configs, *lm_eval_tasks]:
        objects += load_task(manager, spec)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=objects, task_manager=manager, num_fewshot=num_fewshot, limit=limit,
        bootstrap_iters=0, log_samples=False, apply_chat_template=apply_chat_template)
    return {k: results[k] for k in ("results", "groups", "configs", "versions", "n-shot", "higher_is_better",
                                    "n-samples", "config") if k in results}


def metric_table(results: dict) -> list[dict]:
    """One row per (task, metric): {"task", "metric", "value", "samples"}, stderr and filters left out."""
    rows = []
    for task, values in results["results"].items():
        samples = results.get("n-samples", {}).get(task, {}).get("effective")
        for key, value in values.items():
            metric, _, _filter = key.partition(",")
            if metric in ("alias", "name", "sample_len") or metric.endswith("_stderr") \
                    or not isinstance(value, (int, float)):
                continue
            rows.append({"task": task, "metric": metric, "value": float(value), "samples": samples})
    return rows
