"""kiln's offline task suite: evaluation tasks cut from held-out real text, as lm-eval tasks.

The documents come from the validation split (the tokenize step never trains on them), so a
model meets this text for the first time here. Two tasks:

    next_passage  multiple choice. Context: `context_words` words of a document. Choices: the
                  `choice_words` words that really follow, and `num_choices - 1` spans of as many
                  words from other held-out documents (of the same source when there are any),
                  starting at random words. Chance is 1 / num_choices. Metrics: acc, acc_norm.
    last_word     LAMBADA-style. The context runs up to the last word of a sentence that already
                  occurs in the context; the target is that word. Metrics: acc (the greedy
                  continuation is exactly the word), perplexity.

Each task is written as JSON lines plus an lm-eval YAML whose `data_files` name the JSON file
relative to the YAML's folder; `task_configs` returns the same configs with absolute paths, which
is what lm-eval needs (it resolves relative paths against the working directory). Examples are
shuffled by `seed`, so lm-eval's `limit` takes a random sample rather than the first documents.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

import numpy as np
import yaml
from pydantic import Field, model_validator

from tasks.engine.config import ConfigModel, Seed

SUITE_TASKS = ("next_passage", "last_word")
TASK_PREFIX = "kiln_"  # lm-eval task names; keeps clear of lm-eval's own task names
FORMAT_VERSION = 1
_WORD = re.compile(r"\S+")
_SENTENCE_END = re.compile(r"^(\w+)[.!?;:]['\")\]]*$")


class SuiteConfig(ConfigModel):
    """How the offline tasks are cut from the held-out documents (all of it changes the tasks)."""

    context_words: int = Field(64, ge=4, description="Words of context before each question: next_passage's "
                               "passage, and last_word's words before the target.")
    choice_words: int = Field(16, ge=1, description="next_passage: words in each choice (the true continuation and "
                              "each distractor).")
    num_choices: int = Field(4, ge=2, description="next_passage: choices per question, the true one and "
                             "num_choices - 1 distractors from other held-out documents; chance is 1 / num_choices.")
    min_target_chars: int = Field(3, ge=1, description="last_word: shorter target words are skipped.")
    seed: Seed = Field(0, description="Seeds the distractors, the place of the true choice and the shuffle of the "
                       "examples (so `limit` takes a random sample).")

    @model_validator(mode="after")
    def _check(self) -> "SuiteConfig":
        if self.choice_words > self.context_words:
            raise ValueError(f"choice_words={self.choice_words} should not exceed context_words={self.context_words}")
        return self


def task_name(name: str) -> str:
    """The lm-eval name of a suite task: next_passage -> kiln_next_passage."""
    return TASK_PREFIX + name


def short_name(task: str) -> str:
    """A suite task's name without lm-eval's prefix (kiln_next_passage -> next_passage), others as they are."""
    return task[len(TASK_PREFIX):] if task.startswith(TASK_PREFIX) else task


def _words(text: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of the whitespace-separated words of `text`."""
    return [m.span() for m in _WORD.finditer(text)]


def _span(text: str, words: list[tuple[int, int]], first: int, stop: int) -> str:
    """The original text of words[first:stop], whitespace inside kept as it was."""
    return text[words[first][0]:words[stop - 1][1]]


def next_passage_examples(docs: list[dict], cfg: SuiteConfig, rng: np.random.Generator) -> list[dict]:
    C, K = cfg.context_words, cfg.choice_words
    words = [_words(d["text"]) for d in docs]
    pool_of: dict[str, list[int]] = {}  # source -> documents long enough to give a distractor
    for i, d in enumerate(docs):
        if len(words[i]) >= K:
            pool_of.setdefault(d.get("source", ""), []).append(i)
    everyone = [i for i in range(len(docs)) if len(words[i]) >= K]

    examples = []
    for i, doc in enumerate(docs):
        same = [j for j in pool_of.get(doc.get("source", ""), []) if j != i]
        pool = same or [j for j in everyone if j != i]
        if len(pool) == 0:
            continue
        for b in range(0, len(words[i]) - (C + K) + 1, C + K):
            true = _span(doc["text"], words[i], b + C, b + C + K)
            choices, tries = [true], 0
            while len(choices) < cfg.num_choices:
                tries += 1
                if tries > 100 * cfg.num_choices:
                    raise ValueError(f"too little held-out text besides {doc['id']} for {cfg.num_choices - 1} "
                                     "different distractors: raise validation_fraction or lower num_choices")
                j = pool[int(rng.integers(len(pool)))]
                o = int(rng.integers(len(words[j]) - K + 1))
                span = _span(docs[j]["text"], words[j], o, o + K)
                if span not in choices:
                    choices.append(span)
            label = int(rng.integers(cfg.num_choices))
            choices[0], choices[label] = choices[label], choices[0]
            examples.append({"id": f"{doc['id']}@{b}", "source": doc.get("source", ""),
                             "context": _span(doc["text"], words[i], b, b + C),
                             "choices": choices, "label": label})
    return examples


def last_word_examples(docs: list[dict], cfg: SuiteConfig) -> list[dict]:
    C = cfg.context_words
    examples = []
    for doc in docs:
        text, words = doc["text"], _words(doc["text"])
        last = -C
        for j in range(C, len(words)):
            m = _SENTENCE_END.match(text[words[j][0]:words[j][1]])
            if not m or j - last < C // 2:
                continue
            target = m.group(1)
            if len(target) < cfg.min_target_chars or not target.isalpha():
                continue
            context_words = {text[s:e].strip(".,;:!?'\"()[]") for s, e in words[j - C:j]}
            if target not in context_words:
                continue
            examples.append({"id": f"{doc['id']}@{j}", "source": doc.get("source", ""),
                             "context": _span(text, words, j - C, j), "target": target})
            last = j
    return examples


def _yaml_config(name: str, data_file: str) -> dict:
    common = {"task": task_name(name), "dataset_path": "json",
              "dataset_kwargs": {"data_files": {"test": data_file}}, "test_split": "test",
              "doc_to_text": "context", "metadata": {"version": FORMAT_VERSION}}
    if name == "next_passage":
        return {**common, "output_type": "multiple_choice", "doc_to_choice": "choices",
                "doc_to_target": "label",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                                {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
                                {"metric": "acc_mutual_info", "aggregation": "mean", "higher_is_better": True}]}
    # lm-eval puts `target_delimiter` before multiple-choice answers only; this target brings its space
    return {**common, "output_type": "loglikelihood", "doc_to_target": "{{' ' + target}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False}]}


def build_suite(held_out: Iterable[dict], out_dir: Path, tasks: Iterable[str], cfg: SuiteConfig) -> dict:
    """Write `<task>.jsonl` and `<task>.yaml` for each suite task into `out_dir`; return counts.

    `held_out` are documents of the validation split, in a stable order (the store's order).
    A task with no examples is an error: its score would be meaningless.
    """
    tasks = list(tasks)
    unknown = [t for t in tasks if t not in SUITE_TASKS]
    if unknown:
        raise ValueError(f"unknown kiln suite tasks {unknown}; kiln builds {list(SUITE_TASKS)} "
                         "(put lm-eval's own task names under lm_eval_tasks)")
    docs = [d for d in held_out if d["text"].strip()]
    if not docs:
        raise ValueError("no held-out documents to build evaluation tasks from: raise validation_fraction "
                         "(it must match the tokenize step's) or add data")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name in tasks:
        rng = np.random.default_rng([cfg.seed, SUITE_TASKS.index(name)])
        examples = (next_passage_examples(docs, cfg, rng) if name == "next_passage"
                    else last_word_examples(docs, cfg))
        if not examples:
            raise ValueError(f"the {len(docs)} held-out documents give no {name} examples with "
                             f"context_words={cfg.context_words}: use shorter contexts or more held-out text")
        examples = [examples[k] for k in rng.permutation(len(examples))]
        with open(out_dir / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for ex in examples:
                f.write(json.dumps(ex, ensure_ascii=False, sort_keys=True) + "\n")
        (out_dir / f"{name}.yaml").write_text(yaml.safe_dump(_yaml_config(name, f"{name}.jsonl"), sort_keys=False))
        counts[name] = len(examples)
    return counts


def task_configs(suite_dir: Path, tasks: Iterable[str]) -> list[dict]:
    """The suite's lm-eval task configs with `data_files` made absolute, ready for TaskManager.load."""
    configs = []
    for name in tasks:
        path = Path(suite_dir) / f"{name}.yaml"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: build the suite first (evaluation.suite.build_suite)")
        cfg = yaml.safe_load(path.read_text())
        files = cfg["dataset_kwargs"]["data_files"]
        cfg["dataset_kwargs"]["data_files"] = {k: str((path.parent / v).resolve()) for k, v in files.items()}
        configs.append(cfg)
    return configs
