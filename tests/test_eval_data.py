"""Real data for the evaluation tests: the King James Bible, one document per chapter, through the
real tokenizer (a byte-level BPE trained on it) and tokenize stage bodies.

The other test_eval_* files import `kjv_data` (a session fixture, built once per pytest run)
and the helpers below.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pytest

from tasks.documents import ShardWriter, read_documents
from tasks.engine.step import Step, StepContext
from tasks.tokenize import TokenizeConfig, is_validation, tokenize_step
from tasks.tokenizer import TokenizerConfig, tokenizer_step
from training.data import TokenDataset
from tests.conftest import kjv_chapters

VALIDATION_FRACTION = 0.05  # ~60 of the 1189 chapters held out
VOCAB = 1024


@dataclass(frozen=True)
class KJVData:
    documents: Path
    tokenizer: Path
    tokens: Path
    documents_step: Step
    tokenizer_step: Step
    tokens_step: Step

    def held_out(self) -> list[dict]:
        return [d for d in read_documents(self.documents) if is_validation(d["id"], VALIDATION_FRACTION)]


def run_body(step: Step, out: Path, inputs: dict) -> dict:
    """Run a stage body as the runner would, without Prefect."""
    out.mkdir(parents=True)
    ctx = StepContext(step=step, out=out, inputs=inputs, input_stats={}, work_dir=out.parent / f"{out.name}-work",
                      log=logging.getLogger("test"))
    return step.run(ctx)


def write_kjv(folder: Path) -> Path:
    with ShardWriter(folder, docs_per_shard=400) as w:
        for doc in kjv_chapters():
            w.write({"id": f"kjv/{doc['id']}", "text": doc["text"], "source": "kjv", "metadata": doc["metadata"]})
    return folder


def build_kjv_data(root: Path) -> KJVData:
    documents = write_kjv(root / "documents")
    docs_step = Step(name="documents", stage="dedup", stage_version=1, config=TokenizeConfig(), run=lambda ctx: {})
    tok_step = tokenizer_step(TokenizerConfig(kind="bpe", vocab_size=VOCAB), documents=docs_step)
    run_body(tok_step, root / "tokenizer", {"documents": documents})
    tokens_step = tokenize_step(TokenizeConfig(validation_fraction=VALIDATION_FRACTION), tokenizer=tok_step,
                                documents=docs_step)
    run_body(tokens_step, root / "tokens", {"tokenizer": root / "tokenizer", "documents": documents})
    return KJVData(documents, root / "tokenizer", root / "tokens", docs_step, tok_step, tokens_step)


_BUILT: list[KJVData] = []  # one build per pytest run, shared by every module that imports the fixture


@pytest.fixture(scope="session")
def kjv_data(tmp_path_factory) -> KJVData:
    if not _BUILT:
        _BUILT.append(build_kjv_data(tmp_path_factory.mktemp("kjv-eval")))
    return _BUILT[0]


def test_kjv_data_holds_out_whole_chapters(kjv_data):
    held = kjv_data.held_out()
    assert 30 < len(held) < 100
    val = TokenDataset(kjv_data.tokens, "validation")
    assert val.n_documents == len(held)
    assert val.n_bytes == sum(len(d["text"].encode()) for d in held)
