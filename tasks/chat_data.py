"""The chat data step: conversations for SFT and preference pairs for DPO, each split into a
training part and an evaluation part.

Two sources:

    heldout  (default) built from the held-out documents of the corpus (the tokenize step's
             validation split, chosen by the same id hash), so pretraining never saw this text.
             Each document is cut into spans of `prompt_words + answer_words` words; a span
             becomes the conversation
                 user:      "<instruction>\n\n<the first prompt_words words>"
                 assistant: "<the next answer_words words>"            (the true continuation)
             and the preference pair (prompt = the user turn, chosen = the true continuation,
             rejected = as many words from another held-out document, at a seeded random place).
             When documents carry the metadata field `label_field` (the Bible corpora's book
             `title`), each span also becomes the question
                 user:      "<label_question>\n\n<the first prompt_words words>"
                 assistant: "<the document's label>"                    (e.g. "Nahum")
             and the pair (chosen = its label, rejected = another held-out document's label).
    files    JSON-lines files (optionally .gz) or `datasets` folders (`save_to_disk`) whose rows
             hold `messages` (a conversation: [{"role", "content"}, ...]) and/or a preference
             pair (`prompt`: a list of messages or a string, `chosen`, `rejected`: strings).

Output folder (JSON lines, one record a line, sorted keys, in a stable order):

    sft_train.jsonl  sft_eval.jsonl      {"id", "messages"}
    pairs_train.jsonl pairs_eval.jsonl   {"id", "prompt": [messages], "chosen": str, "rejected": str}

The evaluation part is chosen by a hash of each record's id (`eval_fraction`), so it never
depends on the other records.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Literal

import numpy as np
from pydantic import Field, model_validator

from tasks.documents import read_documents
from tasks.tokenize import is_validation
from tasks.engine.config import ConfigModel, Seed, files
from training.chat_template import check_messages

if TYPE_CHECKING:
    from tasks.engine.step import Step, StepContext

STAGE_VERSION = 2  # 2: label questions
FILES = {"sft": ("sft_train.jsonl", "sft_eval.jsonl"), "pairs": ("pairs_train.jsonl", "pairs_eval.jsonl")}


class ChatDataConfig(ConfigModel):
    source: Literal["heldout", "files"] = Field(
        "heldout", description="`heldout`: conversations and pairs built from the documents pretraining held out; "
        "`files`: read from `paths`.")
    paths: tuple[str, ...] = files((), description="source `files`: JSON-lines files (optionally .gz) or `datasets` "
                                   "folders whose rows hold `messages` and/or a preference pair (`prompt`, `chosen`, "
                                   "`rejected`); versioned by content.")
    validation_fraction: float = Field(0.01, ge=0.0, le=1.0, description="source heldout: which documents "
                                       "pretraining held out; must equal `tokenize.validation_fraction` (the "
                                       "pipeline copies it).")
    eval_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="Share of the records kept for evaluation, "
                                 "chosen by a hash of each record's id.")
    prompt_words: int = Field(40, ge=1, description="source heldout: words of the passage in each prompt.")
    answer_words: int = Field(12, ge=1, description="source heldout: words of each answer (the true continuation, "
                              "and the rejected span from another document).")
    instruction: str = Field("Continue this passage:", description="source heldout: the user turn's text before "
                             "the passage.")
    label_field: str | None = Field("title", description="source heldout: a second kind of question, about a span "
                                    "rather than after it: which value of this document metadata field (the Bible "
                                    "corpora's `title`: the book) it comes from. None: continuations only.")
    label_question: str = Field("Which book is this passage from?", description="source heldout: the user turn's "
                                "text before the passage in `label_field` questions.")
    seed: Seed = Field(0, description="source heldout: seeds the choice of each pair's rejected answer.")

    @model_validator(mode="after")
    def _check(self) -> "ChatDataConfig":
        if self.source == "files" and not self.paths:
            raise ValueError("chat source 'files' needs paths (JSON-lines files or datasets folders)")
        if self.source == "heldout" and self.paths:
            raise ValueError("paths apply to chat source 'files' only")
        return self


# --- building the records ----------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return text.split()


def heldout_records(documents: Iterator[dict], cfg: ChatDataConfig) -> tuple[list[dict], list[dict]]:
    """(conversations, preference pairs) from held-out documents, in document order."""
    docs = [d for d in documents if is_validation(str(d["id"]), cfg.validation_fraction) and d["text"].strip()]
    words = [_words(d["text"]) for d in docs]
    span = cfg.prompt_words + cfg.answer_words
    donors = [i for i, w in enumerate(words) if len(w) >= cfg.answer_words]
    labels = [_label(d, cfg.label_field) for d in docs]
    label_values = sorted({v for v in labels if v is not None})
    rng = np.random.default_rng(cfg.seed)
    convs, pairs = [], []
    for i, doc in enumerate(docs):
        others = [j for j in donors if j != i]
        for start in range(0, len(words[i]) - span + 1, span):
            passage = " ".join(words[i][start:start + cfg.prompt_words])
            prompt = [{"role": "user", "content": f"{cfg.instruction}\n\n{passage}"}]
            answer = " ".join(words[i][start + cfg.prompt_words:start + span])
            rid = f"{doc['id']}@{start}"
            convs.append({"id": rid, "messages": prompt + [{"role": "assistant", "content": answer}]})
            if others:
                j = others[int(rng.integers(len(others)))]
                o = int(rng.integers(len(words[j]) - cfg.answer_words + 1))
                rejected = " ".join(words[j][o:o + cfg.answer_words])
                if rejected != answer:
                    pairs.append({"id": rid, "prompt": prompt, "chosen": answer, "rejected": rejected})
            if labels[i] is not None:
                question = [{"role": "user", "content": f"{cfg.label_question}\n\n{passage}"}]
                convs.append({"id": f"{rid}/label", "messages": question + [{"role": "assistant", "content": labels[i]}]})
                wrong = [v for v in label_values if v != labels[i]]
                if wrong:
                    pairs.append({"id": f"{rid}/label", "prompt": question, "chosen": labels[i],
                                  "rejected": wrong[int(rng.integers(len(wrong)))]})
    if not convs:
        raise ValueError(f"the {len(docs)} held-out documents give no span of {span} words: lower prompt_words/"
                         "answer_words or raise validation_fraction (it must equal the tokenize step's)")
    return convs, pairs


def _label(doc: dict, field: str | None) -> str | None:
    value = (doc.get("metadata") or {}).get(field) if field else None
    return None if value is None or not str(value).strip() else str(value).strip()


def _rows(path: Path) -> Iterator[dict]:
    if path.is_dir():
        import datasets

        yield from datasets.load_from_disk(str(path))
        return
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e.msg}); chat files hold one JSON object a line") from None


def file_records(paths: list[Path]) -> tuple[list[dict], list[dict]]:
    """(conversations, preference pairs) from the rows of JSON-lines files / datasets folders."""
    convs, pairs = [], []
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"chat data {path} not found (paths are read relative to the working directory)")
        for n, row in enumerate(_rows(path)):
            rid = str(row.get("id", f"{path.name}:{n}"))
            if row.get("messages") is not None:
                convs.append({"id": rid, "messages": check_messages(list(row["messages"]))})
            if row.get("chosen") is not None:
                prompt = row.get("prompt")
                prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
                if not isinstance(row.get("rejected"), str) or not isinstance(row["chosen"], str):
                    raise ValueError(f"{path} row {n}: a preference pair needs string 'chosen' and 'rejected'")
                pairs.append({"id": rid, "prompt": check_messages(prompt), "chosen": row["chosen"],
                              "rejected": row["rejected"]})
            if row.get("messages") is None and row.get("chosen") is None:
                raise ValueError(f"{path} row {n} has neither 'messages' nor 'chosen'/'rejected'")
    return convs, pairs


def files_fingerprint(paths: tuple[str, ...]) -> str:
    """A content hash of the chat files, so changed files give a new version."""
    h = hashlib.sha256()
    for p in map(Path, paths):
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def write_split(records: list[dict], folder: Path, names: tuple[str, str], eval_fraction: float) -> dict:
    counts = {}
    for name, held in zip(names, (False, True)):
        part = [r for r in records if is_validation(r["id"], eval_fraction) == held]
        with open(folder / name, "w", encoding="utf-8") as f:
            for r in part:
                f.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")
        counts[name.removesuffix(".jsonl")] = len(part)
    return counts


def read_records(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --- the stage ---------------------------------------------------------------------------------


def run_chat_data(ctx: StepContext) -> dict:
    cfg: ChatDataConfig = ctx.config
    if cfg.source == "heldout":
        convs, pairs = heldout_records(read_documents(ctx.inputs["documents"], strict=True), cfg)
    else:
        convs, pairs = file_records([Path(p) for p in cfg.paths])
    stats = write_split(convs, ctx.out, FILES["sft"], cfg.eval_fraction)
    stats.update(write_split(pairs, ctx.out, FILES["pairs"], cfg.eval_fraction))
    ctx.log.info("chat data: %s", stats)
    return stats


def chat_data_step(config: ChatDataConfig, *, documents: Step | None = None) -> Step:
    from tasks.engine.step import Step

    if config.source == "heldout":
        if documents is None:
            raise ValueError("chat source 'heldout' builds from documents: pass documents=<a document step>")
        return Step(name="chat_data", stage="chat_data", stage_version=STAGE_VERSION, config=config,
                    run=run_chat_data, inputs={"documents": documents})
    return Step(name="chat_data", stage="chat_data", stage_version=STAGE_VERSION, config=config,
                run=run_chat_data, fingerprint=lambda: files_fingerprint(config.paths))
