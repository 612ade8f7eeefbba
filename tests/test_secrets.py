"""No secrets at rest: a source's credentials live in the environment (`${ENV_VAR}` in
storage_options) or in a Prefect Secret block (`${prefect-secret:BLOCK}`), are read when its files
are opened, and appear nowhere kiln writes: not the store (lineage, outputs, locks, Prefect
results), not Prefect's database, not the run's output. A literal credential in a config is
refused, naming the field."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from tasks.acquire import SourceConfig
from tests.conftest import kiln, moto_server, prefect_server_process


def files_holding(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_a_literal_credential_is_refused():
    with pytest.raises(ValueError, match=r"storage_options\.secret holds a literal credential"):
        SourceConfig(name="s", kind="files", paths=["s3://b/*.jsonl"], storage_options={"key": "${K}", "secret": "x"})
    with pytest.raises(ValueError, match=r"storage_options\.client_kwargs\.aws_session_token"):
        SourceConfig(name="s", kind="files", paths=["s3://b/*.jsonl"],
                     storage_options={"client_kwargs": {"aws_session_token": "abc"}})
    SourceConfig(name="s", kind="files", paths=["s3://b/*.jsonl"],  # endpoints and references are fine
                 storage_options={"key": "${K}", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}})


def checking_credentials(endpoint: str) -> tuple[str, str]:
    """An access key of a user allowed every S3 action, made in moto's IAM; from then on moto
    checks every request's signature and permissions (by default it takes any key at all)."""
    import boto3

    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="setup",
                       aws_secret_access_key="setup")
    iam.create_user(UserName="kiln-test")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName="kiln-test", PolicyName="s3", PolicyDocument=json.dumps(policy))
    made = iam.create_access_key(UserName="kiln-test")["AccessKey"]
    request = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                     headers={"Content-Type": "text/plain"})  # a form body would not be read
    with urllib.request.urlopen(request, timeout=30) as answer:  # no request without a valid key from here on
        assert json.loads(answer.read())["status"] == "ok"
    return made["AccessKeyId"], made["SecretAccessKey"]


def test_a_planted_secret_is_nowhere_kiln_writes(tmp_path, monkeypatch):
    import s3fs

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    records = "".join(json.dumps({"id": i, "text": f"In the beginning was document {i}, " * 20}) + "\n"
                      for i in range(12))
    with moto_server() as endpoint, prefect_server_process() as (env, _):
        key, secret = checking_credentials(endpoint)
        with pytest.raises(PermissionError):  # moto now refuses a wrong secret
            s3fs.S3FileSystem(key=key, secret=secret[::-1], client_kwargs={"endpoint_url": endpoint},
                              skip_instance_cache=True).mkdir("refused")
        fs = s3fs.S3FileSystem(key=key, secret=secret, client_kwargs={"endpoint_url": endpoint},
                               skip_instance_cache=True)
        fs.mkdir("corpus")
        fs.pipe("corpus/notes.jsonl", records.encode())
        config = {"name": "secrets", "data": {"sources": [{
            "name": "notes", "kind": "files", "paths": ["s3://corpus/*.jsonl"],
            "storage_options": {"key": "${KILN_TEST_S3_KEY}", "secret": "${KILN_TEST_S3_SECRET}",
                                "client_kwargs": {"endpoint_url": endpoint}}}]}}
        path, store = tmp_path / "secrets.yaml", tmp_path / "store"
        path.write_text(yaml.safe_dump(config))
        run = kiln("run", str(path), "--store", str(store), "--until", "acquire",
                   env={**env, "KILN_TEST_S3_KEY": key, "KILN_TEST_S3_SECRET": secret})
        (lineage,) = store.glob("acquire/*/lineage.json")
        assert json.loads(lineage.read_text())["stats"]["documents"] == 12  # read with the secret (moto checks it)
        assert "${KILN_TEST_S3_SECRET}" in lineage.read_text()  # the reference is recorded, not its value
        for needle in (secret, key):
            assert needle not in run.stdout + run.stderr
            assert files_holding(store, needle.encode()) == []
            assert files_holding(Path(env["PREFECT_HOME"]), needle.encode()) == []  # the database too
        assert any(Path(env["PREFECT_HOME"]).rglob("*.db"))  # where Prefect keeps it, and it was searched

        without = kiln("run", str(path), "--store", str(tmp_path / "other"), "--until", "acquire", env=env,
                       check=False)
        assert without.returncode != 0 and "KILN_TEST_S3_KEY" in without.stdout + without.stderr
        wrong = kiln("run", str(path), "--store", str(tmp_path / "wrong"), "--until", "acquire", check=False,
                     env={**env, "KILN_TEST_S3_KEY": key, "KILN_TEST_S3_SECRET": secret[::-1]})
        assert wrong.returncode != 0 and not list((tmp_path / "wrong").glob("acquire/*/lineage.json"))

        # The secret from a Prefect Secret block instead (the API's database keeps it encrypted)
        options = config["data"]["sources"][0]["storage_options"]
        options["secret"] = "${prefect-secret:kiln-test-s3}"
        path.write_text(yaml.safe_dump(config))
        missing = kiln("run", str(path), "--store", str(tmp_path / "other"), "--until", "acquire",
                       env={**env, "KILN_TEST_S3_KEY": key}, check=False)
        assert missing.returncode != 0 and "no Secret block 'kiln-test-s3'" in missing.stdout + missing.stderr
        save = "import sys; from prefect.blocks.system import Secret; Secret(value=sys.stdin.read()).save('kiln-test-s3')"
        subprocess.run([sys.executable, "-c", save], input=secret, text=True, env=env, check=True, timeout=120)
        blocks_store = tmp_path / "blocks-store"
        run = kiln("run", str(path), "--store", str(blocks_store), "--until", "acquire",
                   env={**env, "KILN_TEST_S3_KEY": key})
        (lineage,) = blocks_store.glob("acquire/*/lineage.json")
        assert json.loads(lineage.read_text())["stats"]["documents"] == 12
        assert "${prefect-secret:kiln-test-s3}" in lineage.read_text()
        assert secret not in run.stdout + run.stderr
        assert files_holding(blocks_store, secret.encode()) == []
        assert files_holding(Path(env["PREFECT_HOME"]), secret.encode()) == []
