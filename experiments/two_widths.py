"""Two model widths on the same tokens, as a Python experiment (docs/experiments.md).

The quickstart's data recipe is built once with the stage factories; each width is a branch with
its own train and evaluate steps on those tokens. `kiln plan experiments/two_widths.py` lists the
data steps once, used by both variants; `kiln run` trains both widths side by side (RUN below);
`kiln compare experiments/two_widths.py` prints one row per width.
"""

from pathlib import Path

from flows.config import RunSettings, load_config
from flows.plan import vocab_size
from tasks.acquire import acquire_step
from tasks.dedup import dedup_step
from tasks.evaluate import evaluate_step
from tasks.filter import filter_step
from tasks.tokenize import tokenize_step
from tasks.tokenizer import tokenizer_step
from tasks.train import train_step

BASE = load_config(Path(__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml")
RUN = RunSettings(max_concurrent=2)
WIDTHS = (96, 128)


def experiment() -> dict:
    data = BASE.data
    documents = dedup_step(data.dedup, documents=filter_step(data.filter, documents=acquire_step(data.acquire())))
    tokenizer = tokenizer_step(BASE.tokenizer, documents=documents)
    tokens = tokenize_step(BASE.tokenize, tokenizer=tokenizer, documents=documents)
    scoring = BASE.eval.model_copy(update={"validation_fraction": BASE.tokenize.validation_fraction})
    branches = {}
    for width in WIDTHS:
        model = BASE.model.model_copy(update={"d_model": width, "vocab_size": vocab_size(BASE.tokenizer)})
        trained = train_step(model, BASE.train.model_copy(update={"steps": 150}), BASE.resources, tokens=tokens)
        branches[f"d{width}"] = [evaluate_step(scoring, model=trained, tokenizer=tokenizer, tokens=tokens,
                                               documents=documents)]
    return branches
