"""`kiln`: run, plan and trace experiments, and sample from or serve the models they make. See `kiln --help`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path
from typing import Sequence

EPILOG = """examples:
  kiln run configs/tiny_cpu.yaml                 raw text to an evaluated model, cached by version
  kiln run configs/tiny_cpu.yaml --until acquire run only what `acquire` needs
  kiln run configs/ablation_cpu.yaml             every variant; shared steps run once
  kiln run experiments/two_widths.py             a Python experiment file, like a YAML one
  kiln run configs/tiny_cpu.yaml --set train.optimizer=muon   one field changed; only what reads it reruns
  kiln plan configs/tiny_cpu.yaml --json         each step's name, stage, version, path, status, variants, warning
  kiln capacity configs/medium_gpu.yaml --devices 8   per-device memory, fit and step time, no GPU needed
  kiln compare configs/ablation_cpu.yaml         one row per variant: what it changed, its results
  kiln compare CONFIG --over steps               each metric against the training step (eval.checkpoints)
  kiln forecast kiln_store/scaling_fit/<version> --budget 1e21   N_opt, D_opt and loss from a sweep's fitted law
  kiln lineage kiln_store/acquire/<version>      the tree back to the raw sources
  kiln verify --store kiln_store                 check every artefact against its recorded sha256s
  kiln generate kiln_store/sft/<version> --prompt "Who made the light?" --chat   sample from a model
  kiln serve-model kiln_store/sft/<version>     an OpenAI-compatible API at http://127.0.0.1:8000/v1
  kiln why configs/tiny_cpu.yaml kjv/01-001      which data stage kept or dropped a document, and why
  kiln serve configs/tiny_cpu.yaml               serve deployments on the server at PREFECT_API_URL
  kiln server start --dir /srv/kiln-server       a team's Prefect server on PostgreSQL, with Redis for step locks
  kiln deploy configs/tiny_cpu.yaml --pool cpus --store /shared/kiln_store   deployments for `prefect worker start --pool cpus`
  kiln canary configs/tiny_cpu.yaml              a fresh run of the day, checked against the config's canary: bounds

The store is ./kiln_store unless --store or KILN_STORE says otherwise (a path or fsspec URL).
Runs use Prefect's ephemeral API unless PREFECT_API_URL names a server."""


def _prefect_defaults() -> None:
    """Quiet, offline-safe Prefect settings unless the user set them."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LOG_PRINTS", "true")
    # The Prefect API server (and the Ray) this run starts end with it, even after a SIGKILL.
    from tasks.engine.reaper import watch_this_process

    watch_this_process()
    _ephemeral_server_apart()
    # Prefect's console format before anything else logs: absl (imported by orbax) otherwise puts
    # Python's bare `INFO:name:` handler on the root logger first, and Prefect keeps it.
    from prefect.logging.configuration import setup_logging

    setup_logging()


TRIGGERS_ENABLED = "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED"  # Prefect's automations (triggers and their actions)


def _ephemeral_server_apart() -> None:
    """Prefect's ephemeral API server, when this process starts one, in a session of its own and
    deaf to a stop meant for the whole job until this process is done with it.

    Ctrl-C in a terminal goes to the whole foreground process group, and so does `kill -- -PGID`;
    systemd's stop and Slurm's `scancel` send SIGTERM to every process of the job. The server
    stopped with kiln, the run could no longer report its states, and Prefect's client retried for
    minutes before kiln exited 1 saying the API had stopped answering (142 s here) instead of 130
    at once. Apart, and run by `flows/ephemeral_api.py` (which holds SIGINT and SIGTERM until its
    stdin closes), it outlives the signal and ends as before: at exit (Prefect's atexit, which
    stops it here), or when this process dies (its stdin closes; kiln's reaper too).
    Prefect looks its server up as `SubprocessASGIServer()` (one per process, keyed by port None):
    the instance made here is the one it finds.

    It runs no automations: Prefect's ephemeral server keeps the database `prefect server start`
    keeps (PREFECT_HOME's), so a team's server there with `kiln serve`'s automation had it fired
    by every laptop run, each train step's completion making an `evaluate` flow run for the
    team's workers, on this run's store."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return
    from prefect.server.api import server

    real = server.subprocess

    def popen(args, env, **kwargs):
        at = args.index("uvicorn")  # Prefect's `python -m uvicorn ...`, run by kiln's module
        kiln = str(Path(__file__).resolve().parents[1])  # importable there however this process found it
        env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [kiln, env.get("PYTHONPATH")])),
               # automations are a server's: this one shares their database by default, and ran them
               TRIGGERS_ENABLED: "false"}
        return real.Popen([*args[:at], "flows.ephemeral_api", *args[at + 1:]], env=env, stdin=real.PIPE,
                          start_new_session=True, **kwargs)

    class ServerApart(server.SubprocessASGIServer):
        def _run_uvicorn_command(self):
            server.subprocess = types.SimpleNamespace(Popen=popen)  # only Prefect's module sees it
            try:
                return super()._run_uvicorn_command()
            finally:
                server.subprocess = real

        def stop(self):
            if self.server_process is not None:
                self.server_process.stdin.close()  # the server takes its SIGTERM again
            super().stop()

    if None not in server.SubprocessASGIServer._instances:  # else this process made (or started) it already
        ServerApart()


DTYPE_HELP = ("what the model computes in, its weights held in it (default: its compute_dtype; float32 for a "
              "Hugging Face folder); bfloat16 halves the weights' memory")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="Reproducible LM training: every stage a "
                                "cached, versioned Prefect step with lineage.", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, example: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, epilog=f"example:\n  {example}",
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    def sets(p: argparse.ArgumentParser) -> None:
        p.add_argument("--set", dest="sets", metavar="PATH=VALUE", action="append", default=[],
                       help="override one field of the YAML config given as CONFIG (not a --canary one), under "
                       "every variant: a dotted path and a YAML "
                       "value (train.optimizer=muon, train.lr=1e-3); repeatable. Give the same to run, plan and "
                       "compare: they name the same steps")

    run = command("run", "Run the pipeline for a config or Python experiment; cached steps are not "
                  "recomputed; exits 1 naming every step that failed.",
                  "kiln run configs/tiny_cpu.yaml --until tokenize --force train")
    run.add_argument("config", help="experiment YAML, or a Python experiment file (.py)")
    run.add_argument("--store", help="artefact store: path or fsspec URL (default ./kiln_store or $KILN_STORE)")
    run.add_argument("--until", metavar="STAGE", help="stop after this stage (and what it needs)")
    run.add_argument("--force", metavar="STAGE", nargs="+", action="extend", default=[],
                     help="recompute these stages even if cached")
    sets(run)

    pl = command("plan", "List every step once with its version, output path, status and the variants "
                 "that use it; runs nothing.", "kiln plan configs/ablation_cpu.yaml --json")
    pl.add_argument("config", help="experiment YAML, or a Python experiment file (.py)")
    pl.add_argument("--store")
    pl.add_argument("--until", metavar="STAGE")
    pl.add_argument("--json", action="store_true",
                    help="a JSON list of {name, stage, version, path, status, variants, warning}")
    sets(pl)

    ca = command("capacity", "Compile the train step for the config's mesh on simulated CPU devices (no "
                 "GPU, no parameters allocated) and print per device: parameter, optimizer and gradient bytes, "
                 "the compiler's temporaries, FLOPs per step, whether it fits each named device, and the step "
                 "time at an assumed MFU (docs/capacity.md).",
                 "kiln capacity configs/llama3_8b_gpu.yaml --devices 8 --device h100-80gb --strategy dp")
    ca.add_argument("config", help="experiment YAML")
    ca.add_argument("--devices", type=int, help="simulated devices the mesh spans (default: the config's "
                    "resources, hosts x gpus_per_host or TPU chips; 8 for a CPU config)")
    ca.add_argument("--device", nargs="+", action="extend", metavar="KIND",
                    help="devices to check the fit against, one or more, the option given once or more "
                    "(default: h100-80gb h200-141gb a100-40gb a100-80gb tpu-v4 tpu-v5e)")
    ca.add_argument("--mfu", type=float, default=0.4, help="assumed MFU for the step time (default 0.4)")
    ca.add_argument("--memory-fraction", type=float, default=0.75, help="share of a GPU's memory JAX may use "
                    "(XLA_PYTHON_CLIENT_MEM_FRACTION; default 0.75, JAX's preallocation)")
    ca.add_argument("--remat", choices=["none", "full", "dots_saveable", "offload"], help="override train.remat")
    ca.add_argument("--strategy", choices=["dp", "fsdp"], help="override train.mesh.strategy")
    ca.add_argument("--step", default="train", metavar="NAME", help="the train step to plan: train (default), "
                    "a phase's, train/<phase>, whose train section may change the batch, the mesh or remat, or "
                    "post-training's sft or dpo (their own train and resources sections, the same model)")
    ca.add_argument("--json", action="store_true", help="the numbers as JSON (bytes per device)")
    sets(ca)

    co = command("compare", "One row per variant (or sweep run): its overrides, losses, eval metrics, "
                 "bits per byte, parameters, tokens and seconds, read from the store.",
                 "kiln compare configs/ablation_cpu.yaml --json")
    co.add_argument("config", help="experiment YAML, or a Python experiment file (.py)")
    co.add_argument("--store")
    co.add_argument("--json", action="store_true", help="the rows as a JSON list (null: not run yet)")
    co.add_argument("--over", choices=["variants", "steps"], default="variants",
                    help="steps: one row per evaluated training step of each variant (eval.checkpoints, then "
                    "the final model at the last step), each metric against the step (default: one row per variant)")
    sets(co)

    fo = command("forecast", "A scaling sweep's fitted law at other budgets: the compute-optimal N and D "
                 "and the loss, from both fits, with the parametric law's intervals and its backtest's correction, "
                 "and how far each budget lies beyond the sweep (docs/scaling_laws.md).",
                 "kiln forecast kiln_store/scaling_fit/<version> --budget 1e19 1e21 --json")
    fo.add_argument("law", help="a scaling_fit output folder (`kiln plan CONFIG` lists them) or its law.json")
    fo.add_argument("--budget", type=float, nargs="+", action="extend", required=True, metavar="FLOPS",
                    help="training budgets C in FLOPs (6N + attention per token, as the sweep counted them)")
    fo.add_argument("--json", action="store_true", help="one object per budget")

    li = command("lineage", "Print the tree from an artefact back to its raw inputs.",
                 "kiln lineage kiln_store/tokenize/3f9c0a1b2c4d --json")
    li.add_argument("path", help="an artefact folder (one with lineage.json), or its store URL: "
                    "<store>/<stage>/<version> with an fsspec store such as s3://bucket/kiln or file:///data/kiln")
    li.add_argument("--json", action="store_true")

    ve = command("verify", "Check every artefact in the store against the sha256 of each file its lineage "
                 "recorded; exits 1 naming each missing or changed file.", "kiln verify --store kiln_store")
    ve.add_argument("--store", help="the store to check (default ./kiln_store or $KILN_STORE)")

    gen = command("generate", "Sample text from a trained, post-trained or exported model (KV-cached "
                  "decoding; the same seed gives the same text; temperature 0 is greedy).",
                  'kiln generate kiln_store/train/<version> --prompt "In the beginning" --max-tokens 40 --seed 1')
    gen.add_argument("path", help="a train, sft or dpo output folder, or a Hugging Face folder (an export, or "
                     "a Llama, Qwen2, Qwen3, OLMo 2, OLMo 3, Mistral, Gemma, Gemma 2, Gemma 3, SmolLM3, Phi-3 or "
                     "Granite checkpoint)")
    gen.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    gen.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    gen.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95; 1: off)")
    gen.add_argument("--top-k", type=int, default=0, help="draw from the k most likely tokens only (default 0: off)")
    gen.add_argument("--min-p", type=float, default=0.0,
                     help="draw only tokens at least this times as likely as the most likely one (default 0: off)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    gen.add_argument("--chat", action="store_true", help="apply the chat template (post-trained models, or a "
                     "checkpoint's own); the answer ends at the end-of-turn token")
    gen.add_argument("--tokenizer", help="tokenizer step output folder (default: found through lineage)")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], help=DTYPE_HELP)

    sm = command("serve-model", "Serve a trained, post-trained or exported model over an OpenAI-compatible "
                 "HTTP API (/v1/models, /v1/completions, /v1/chat/completions; docs/serving.md) until SIGTERM "
                 "or Ctrl-C; concurrent requests decode together (continuously batched), and answers can stream "
                 "as they are generated.",
                 "kiln serve-model kiln_store/export/<version> --port 8000 --name my-model")
    sm.add_argument("path", help="a train, sft or dpo output folder, or a Hugging Face folder (an export, or "
                    "a Llama, Qwen2, Qwen3, OLMo 2, OLMo 3, Mistral, Gemma, Gemma 2, Gemma 3, SmolLM3, Phi-3 or "
                    "Granite checkpoint)")
    sm.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                    "only; on a shared network, give --api-key too)")
    sm.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    sm.add_argument("--tokenizer", help="tokenizer step output folder (default: found through lineage)")
    sm.add_argument("--name", help="the model's name in the API (default: <stage>/<version> of the folder)")
    sm.add_argument("--max-batch", type=int, default=8,
                    help="prompts decoding together at most; more wait for a slot (default 8)")
    sm.add_argument("--dtype", choices=["float32", "bfloat16"], help=DTYPE_HELP)
    sm.add_argument("--max-model-len", type=int, help="the context at most, prompt and answer (default: the "
                    "model's): each slot holds a key/value cache this long")
    sm.add_argument("--prefix-cache-tokens", type=int, help="prompt tokens whose keys and values are kept, so "
                    "that a prompt starting as an earlier one did (a few-shot context, a system prompt) prefills "
                    "only the rest (default: --max-batch times the context, none for a context of 33 tokens or fewer; "
                    "0: keep none)")
    sm.add_argument("--api-key", default=os.environ.get("KILN_API_KEY"),
                    help="require `Authorization: Bearer KEY` on /v1 requests, an OpenAI client's api_key "
                    "(default: $KILN_API_KEY; unset: no key)")

    why = command("why", "Show which data stage kept or dropped a document, with its scores.",
                  "kiln why configs/tiny_cpu.yaml chichewa/01-001")
    why.add_argument("config")
    why.add_argument("doc_id", help="a document id as acquire wrote it: <source name>/<the record's own id>, "
                     "or <source name>/<file>:<line> for a record without one")
    why.add_argument("--store")
    sets(why)

    serve = command("serve", "Register the pipeline, data-refresh and evaluate deployments on the "
                    "Prefect server at PREFECT_API_URL and run them when triggered or scheduled.",
                    "PREFECT_API_URL=http://127.0.0.1:4200/api kiln serve configs/tiny_cpu.yaml --cron '0 3 * * *'")
    serve.add_argument("config", help="experiment YAML: the deployments' default parameters")
    serve.add_argument("--store", help="the store runs write to (default ./kiln_store or $KILN_STORE)")
    serve.add_argument("--cron", default="0 3 * * *", help="data-refresh schedule (default: daily at 03:00)")
    serve.add_argument("--refresh-until", default="tokenize", metavar="STAGE",
                       help="the last stage data-refresh reruns (default: tokenize)")
    serve.add_argument("--canary", metavar="CONFIG", help="also serve a `canary` deployment of this config (one "
                       "with a `canary:` section) on a daily schedule")
    sets(serve)
    add_team_commands(command, sets)
    return p


def add_team_commands(command, sets) -> None:
    """`kiln server`, `kiln deploy` and `kiln canary`: kiln for a team (docs/operating.md)."""
    sv = command("server", "Start, stop or show a team's Prefect server on PostgreSQL with Redis for step locks, "
                 "all daemons whose data, logs and pids live in DIR (docs/operating.md).",
                 "kiln server start --dir /srv/kiln-server --port 4200")
    sv.add_argument("action", choices=["start", "stop", "status"])
    sv.add_argument("--dir", default="kiln_server", help="the folder the server's database, logs and pids live in "
                    "(default ./kiln_server; created; as root it is handed to the `postgres` user, which must be "
                    "able to reach it)")
    sv.add_argument("--host", default="127.0.0.1", help="address the Prefect API and Redis listen on (default "
                    "127.0.0.1: this machine only; PostgreSQL always listens on 127.0.0.1)")
    sv.add_argument("--port", type=int, default=4200, help="the Prefect server's port (default 4200)")
    sv.add_argument("--pg-port", type=int, default=5433, help="PostgreSQL's port on 127.0.0.1 (default 5433)")
    sv.add_argument("--redis-port", type=int, default=6380, help="Redis's port (default 6380)")
    sv.add_argument("--timeout", type=float, default=300, help="seconds start waits for everything to answer "
                    "(default 300)")

    de = command("deploy", "Register the pipeline, data-refresh and evaluate deployments (and a canary) to a "
                 "Prefect `process` work pool (created if missing) on the server at PREFECT_API_URL, for "
                 "`prefect worker start --pool NAME` to run on the machines that compute.",
                 "kiln deploy configs/tiny_cpu.yaml --pool gpus --store s3://team/kiln --lock-url redis://10.0.0.5:6380/0")
    de.add_argument("config", help="experiment YAML: the deployments' default parameters")
    de.add_argument("--pool", required=True, help="the work pool's name")
    de.add_argument("--store", help="the store every worker writes to: a URL or an absolute path all of them mount "
                    "(default $KILN_STORE)")
    de.add_argument("--lock-url", help="redis://HOST:PORT/DB for the step locks (replaces the config's run.lock_url)")
    de.add_argument("--ray-address", help="the Ray cluster the runs' training uses (RAY_ADDRESS in their "
                    "environment; default: each worker machine's local Ray)")
    de.add_argument("--cron", default="0 3 * * *", help="data-refresh schedule (default: daily at 03:00)")
    de.add_argument("--refresh-until", default="tokenize", metavar="STAGE")
    de.add_argument("--canary", metavar="CONFIG", help="also deploy a `canary` of this config (with a `canary:` "
                    "section), daily at --canary-cron")
    de.add_argument("--canary-cron", default="0 5 * * *", help="the canary's schedule (default: daily at 05:00)")
    de.add_argument("--canary-store", help="the root of the canary's stores of the day (default: <store>-canary)")
    sets(de)

    cn = command("canary", "Run a config into a fresh store of the day and check its `canary:` bounds (final loss, "
                 "steps, evaluate metrics, wall time); exits 1 naming each result out of bounds.",
                 "kiln canary configs/tiny_cpu.yaml --store-root /shared/kiln-canary")
    cn.add_argument("config", help="experiment YAML with a `canary:` section")
    cn.add_argument("--store-root", default="kiln_canary", help="where the stores of each day go: <root>/<YYYY-MM-DD> "
                    "(default ./kiln_canary)")
    cn.add_argument("--day", help="the day's store to use (default today, UTC)")
    cn.add_argument("--check-only", action="store_true", help="check the day's finished store without running "
                    "anything (the wall time is then not checked)")
    sets(cn)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KilnUserError as e:
        print(f"kiln: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or another stop signal during run and canary (stop_on_signals)
        import signal

        from tasks.engine.local_ray import Terminated

        signum = e.signal if isinstance(e, Terminated) else signal.SIGINT
        print(f"kiln: {'interrupted' if signum == signal.SIGINT else f'terminated ({signal.Signals(signum).name})'}"
              + (": the steps that finished are published, and a train step goes on from its last checkpoint "
                 "when the same command runs again" if args.command in ("run", "canary") else ""), file=sys.stderr)
        return 128 + signum  # as the shell reports a process a signal ended: 130 for Ctrl-C, 143 for SIGTERM
    except BrokenPipeError:
        if not _stdout_reader_gone():  # a socket's broken pipe, not the reader of our output: an error
            raise
        # `kiln compare --json | head`: the reader took what it wanted. Stop quietly, as Unix tools
        # do, and point stdout at /dev/null so that the interpreter's last flush does not fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:
        lost = _lost_prefect_api(e)
        if lost is None:
            raise
        print(f"kiln: the Prefect API at {lost} stopped answering during the {args.command} "
              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); is its server still running? "
              "What was published is kept: rerun when it is back and finished steps are cache hits", file=sys.stderr)
        return 1


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports an error on it)."""
    import select

    poller = select.poll()
    poller.register(sys.stdout.fileno(), select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _lost_prefect_api(error: BaseException) -> str | None:
    """The API URL, if `error` comes from a Prefect API server that went away mid-command."""
    import httpx

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError,
                              httpx.ConnectTimeout, ConnectionRefusedError)):
            from prefect.settings import PREFECT_API_URL

            return PREFECT_API_URL.value() or "(Prefect's ephemeral server)"
        error = error.__cause__ or error.__context__
    return None


class KilnUserError(Exception):
    """Something the user can fix; printed as one line, exit status 2."""


def _config(path: str, sets: Sequence[str] = ()):
    from flows.config import ConfigError, load_config

    try:
        return load_config(path, sets)
    except ConfigError as e:
        raise KilnUserError(str(e)) from None


def _experiment(path: str, sets: Sequence[str] = ()):
    from flows.config import ConfigError
    from flows.experiment import load_experiment

    try:
        return load_experiment(path, sets)
    except ConfigError as e:
        raise KilnUserError(str(e)) from None


def _store(arg: str | None):
    from tasks.engine.store import Store

    return Store(arg)


def cmd_plan(args) -> int:
    from flows.plan import plan

    experiment, store = _experiment(args.config, args.sets), _store(args.store)
    try:
        steps = plan(experiment, store, args.until)
    except (ValueError, FileNotFoundError) as e:
        raise KilnUserError(str(e)) from None
    for s in steps:
        if s.warning:
            print(f"kiln: warning: {s.warning}", file=sys.stderr)
    if args.json:
        print(json.dumps([{"name": s.name, "stage": s.stage, "version": s.version, "path": s.path,
                           "status": s.status, "variants": s.variants, "warning": s.warning} for s in steps], indent=2))
    else:
        from flows.terminal import print_table

        rows = [[s.name, s.version, s.status, ",".join(s.variants) or "-", s.path] for s in steps]
        print_table(["step", "version", "status", "variants", "path"], rows, "status")
    return 0


def cmd_capacity(args) -> int:
    from flows.capacity import capacity, print_report

    try:
        r = capacity(args.config, args.devices, args.device, args.mfu, args.memory_fraction, args.remat, args.strategy,
                     args.sets, args.step)
    except (ValueError, RuntimeError) as e:  # a config the mesh cannot take, an unknown device, a failed compile
        raise KilnUserError(str(e)) from None
    print_report(r, args.config, args.json)
    return 0


def cmd_compare(args) -> int:
    from flows.compare import cells, columns, comparison, over_steps
    from flows.terminal import print_table

    experiment, store = _experiment(args.config, args.sets), _store(args.store)
    rows = comparison(experiment, store) if args.over == "variants" else over_steps(experiment, store)
    if not rows and args.over == "steps":
        raise KilnUserError(f"{args.config} evaluates no training steps: set eval.checkpoints (a list of steps, "
                            "or every) to make an evaluate step per kept step")
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(columns(rows), cells(rows), "status")
    return 0


def cmd_run(args) -> int:
    _prefect_defaults()
    from tasks.engine.local_ray import stop_on_signals

    stop_on_signals()  # Ctrl-C and SIGTERM stop the steps' Ray work and unwind the flow; the rerun resumes
    experiment, store = _experiment(args.config, args.sets), _store(args.store)
    from flows.plan import check_starting_points, select

    try:
        check_starting_points(select(experiment.steps, args.until), store)  # the flow checks too: for deployments
    except (ValueError, FileNotFoundError) as e:
        raise KilnUserError(str(e)) from None
    from flows.pipeline import StepsFailed, experiment_flow, pipeline
    from flows.terminal import print_table, step_bars
    from tasks.engine.scheduler import MissingInput

    try:
        with step_bars():  # a bar per running step on a terminal; log lines only when piped
            if experiment.config is None:  # a Python experiment file
                runs = experiment_flow(path=args.config, store=store.root, until=args.until, force=args.force)
            else:
                runs = pipeline(config=experiment.config, store=store.root, until=args.until, force=args.force)
    except StepsFailed as e:
        print_table(SUMMARY_HEADER, summary_rows(e.runs), "ran/cached")
        for r in e.runs:
            if r.error:
                print(f"kiln: {r.name} {r.status}: {r.error}", file=sys.stderr)
        return 1
    except MissingInput as e:
        raise KilnUserError(str(e)) from None
    print_table(SUMMARY_HEADER, summary_rows(runs), "ran/cached")
    if any(b.config is not None and b.config.scaling is not None for b in experiment.branches.values()):
        from flows.scaling import forecast_line

        line = forecast_line(runs)
        print(line or "forecast: not run (scaling.forecast is off, or --until stopped before it)")
    return 0


def cmd_forecast(args) -> int:
    from flows.scaling import forecast_rows
    from flows.terminal import print_table
    from training.scaling import budget_label, law_from_json

    if any(c <= 0 for c in args.budget):
        raise KilnUserError(f"budgets must be positive FLOPs, got {args.budget}")
    path = Path(args.law)
    path = path / "law.json" if path.is_dir() else path
    if not path.is_file():
        raise KilnUserError(f"no {path}: give a scaling_fit output folder (kiln plan CONFIG lists them) "
                            "or its law.json")
    try:
        law = law_from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise KilnUserError(f"{path} is not a scaling_fit step's law.json ({type(e).__name__}: {e})") from None
    rows = forecast_rows(law, args.budget)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0

    def spread(value, interval, fmt):
        if value is None:
            return "-"
        return f"{value:{fmt}}" + (f" [{interval[0]:{fmt}}, {interval[1]:{fmt}}]" if interval else "")

    print_table(["budget", "ladder steps beyond", "N_opt", "D_opt", "loss (one run)", "corrected by the backtest",
                 "isoFLOP N_opt", "isoFLOP loss"],
                [[budget_label(r["budget"]), "-" if r["steps_beyond"] is None else f"{r['steps_beyond']:.1f}",
                  spread(r["n_opt"], r["n_opt_interval"], ",.0f"), spread(r["d_opt"], r["d_opt_interval"], ",.0f"),
                  spread(r["loss"], r["run_interval"], ".4f"),
                  spread(r["backtest_loss"], r["backtest_run_interval"], ".4f"),
                  f"{r['isoflop_n_opt']:,.0f}", f"{r['isoflop_loss']:.4f} ± {r['isoflop_loss_err']:.4f}"]
                 for r in rows])
    for r in rows:
        if r["steps_beyond"] is not None and r["steps_beyond"] > 1.05:
            bt = law.backtest
            print(f"kiln: warning: C={budget_label(r['budget'])} is {r['steps_beyond']:.1f} steps of the sweep's "
                  f"budget ladder (x{bt.budget / max(bt.fitted):.3g}) beyond its largest budget "
                  f"{budget_label(bt.budget)}; the backtest measured one step, so read its interval as a lower "
                  "bound on the error there", file=sys.stderr)
    return 0


def cmd_verify(args) -> int:
    from tasks.engine.store import is_verifiable, published, verify_output

    store = _store(args.store)
    outputs = published(store)
    if not outputs:
        raise KilnUserError(f"no published artefacts in the store {store.root}")
    damaged = unverified = 0
    for stage, version in outputs:
        bad = verify_output(store, stage, version)
        if bad:
            damaged += 1
            print(f"MISMATCH    {stage}/{version}: {', '.join(bad)} (missing or changed since published)")
        elif not is_verifiable(store, stage, version):
            unverified += 1
            print(f"unverified  {stage}/{version}: its lineage predates checksums; accepted as it is")
        else:
            print(f"ok          {stage}/{version}")
    print(f"{len(outputs)} artefacts: {len(outputs) - damaged - unverified} ok, {damaged} damaged, "
          f"{unverified} unverified", file=sys.stderr)
    return 1 if damaged else 0


def cmd_lineage(args) -> int:
    from tasks.engine.lineage import format_tree, lineage_at

    try:
        tree = lineage_at(args.path)
    except FileNotFoundError as e:
        raise KilnUserError(str(e)) from None
    print(json.dumps(tree, indent=2) if args.json else format_tree(tree))
    return 0


def cmd_generate(args) -> int:
    from evaluation.generate import generate, load

    try:
        model = load(Path(args.path), None if args.tokenizer is None else Path(args.tokenizer), args.dtype)
        generate(model, args.prompt, args.max_tokens, args.temperature, args.top_p, args.seed, args.chat,
                 on_text=lambda piece: print(piece, end="", flush=True),  # as the tokens are drawn
                 top_k=args.top_k, min_p=args.min_p)
    except (ValueError, FileNotFoundError) as e:
        raise KilnUserError(str(e)) from None
    print()
    return 0


def cmd_serve_model(args) -> int:
    from evaluation.server import serve_model

    try:
        serve_model(Path(args.path), args.host, args.port, None if args.tokenizer is None else Path(args.tokenizer),
                    args.name, args.max_batch, args.api_key, args.dtype, args.max_model_len, args.prefix_cache_tokens)
    except (ValueError, FileNotFoundError) as e:
        raise KilnUserError(str(e)) from None
    return 0


def cmd_why(args) -> int:
    from tasks.judging import explain

    experiment, store = _experiment(args.config, args.sets), _store(args.store)
    seen = False
    for step in experiment.steps:
        folder = Path(store.output(step.stage, step.version))
        if not (folder / "attributes").is_dir():
            continue
        record = explain(folder, args.doc_id)
        if record is None:
            continue
        seen = True
        verdict = "kept" if record["kept"] else f"DROPPED: {record['reason']}"
        print(f"{step.name} {step.version}: {verdict}  scores={json.dumps(record.get('scores', {}))}")
        if not record["kept"]:
            break
    if not seen:
        raise KilnUserError(f"no finished data stage in {store.root} has a record of document "
                            f"{args.doc_id!r}; check the id (`<source>/<id>`) and run the data stages first")
    return 0


def cmd_serve(args) -> int:
    _prefect_defaults()
    config, store = _config(args.config, args.sets), _store(args.store)
    from deployments.serve import NoServer, serve

    canary = _config(args.canary) if args.canary else None
    try:
        serve(config, store.root, cron=args.cron, refresh_until=args.refresh_until, canary=canary)
    except NoServer as e:
        raise KilnUserError(str(e)) from None
    return 0


def cmd_server(args) -> int:
    from flows import server

    folder = Path(args.dir).resolve()
    try:
        if args.action == "start":
            state = server.start(folder, args.host, server.Ports(args.port, args.pg_port, args.redis_port),
                                 args.timeout)
            print(server.how_to_use(state))
        elif args.action == "stop":
            stopped = server.stop(folder)
            print(f"kiln server: stopped {', '.join(stopped)} in {folder}" if stopped
                  else f"kiln server: nothing of it runs in {folder}")
        else:
            rows = server.status(folder)
            from flows.terminal import print_table

            print_table(["service", "state", "address"], [list(r) for r in rows], "state")
            return 0 if all(r[1].startswith("running") for r in rows) else 1
    except server.ServerError as e:
        raise KilnUserError(str(e)) from None
    return 0


def cmd_deploy(args) -> int:
    _prefect_defaults()
    config = _config(args.config, args.sets)
    canary = _config(args.canary) if args.canary else None
    from deployments.pool import DeployError, NoServer, deploy

    try:
        deploy(config, args.store, args.pool, cron=args.cron, refresh_until=args.refresh_until,
               lock_url=args.lock_url, ray_address=args.ray_address, canary=canary, canary_cron=args.canary_cron,
               canary_root=args.canary_store)
    except (NoServer, DeployError, ValueError) as e:
        raise KilnUserError(str(e)) from None
    return 0


def cmd_canary(args) -> int:
    _prefect_defaults()
    from tasks.engine.local_ray import stop_on_signals

    stop_on_signals()  # Ctrl-C and SIGTERM stop the steps' Ray work and unwind the flow; the rerun resumes
    config = _config(args.config, args.sets)
    from flows.canary import CanaryFailed, canary, canary_store, check, today
    from flows.pipeline import StepsFailed
    from tasks.engine.store import Store

    root = args.store_root if "://" in args.store_root else str(Path(args.store_root).resolve())
    try:
        if args.check_only:
            found = check(config, Store(canary_store(root, args.day or today())))
        else:
            found = canary(config=config, store_root=root, day=args.day)
    except (CanaryFailed, StepsFailed) as e:
        print(f"kiln: {e}", file=sys.stderr)
        return 1
    print(json.dumps(found, indent=2, default=str))
    return 0


COMMANDS = {"run": cmd_run, "plan": cmd_plan, "compare": cmd_compare, "lineage": cmd_lineage, "verify": cmd_verify,
            "generate": cmd_generate, "serve-model": cmd_serve_model, "why": cmd_why, "serve": cmd_serve}
COMMANDS["capacity"] = cmd_capacity
COMMANDS["forecast"] = cmd_forecast
COMMANDS.update({"server": cmd_server, "deploy": cmd_deploy, "canary": cmd_canary})

KEY_STATS = ["documents", "docs_out", "tokens", "unigram_entropy", "final_loss", "final_val_loss",
             "next_passage_acc", "next_passage_chance", "last_word_acc", "bits_per_byte"]


# Post-training steps report a chat evaluation per model (base, sft, dpo) under eval_<model>.
CHAT_STATS = ["generation_exact_match", "generation_chrf", "preference_acc"]


SUMMARY_HEADER = ["stage", "version", "ran/cached", "seconds", "output", "key stats"]


def summary_rows(runs) -> list[list[str]]:
    """One row per step of the run: name, version, how it went, seconds, output, its key stats."""
    rows = []
    for r in runs:
        pairs = [(k, r.stats[k]) for k in KEY_STATS if k in r.stats]
        for model in ("base", "sft", "dpo"):
            scores = r.stats.get(f"eval_{model}") or {}
            pairs += [(f"{model}.{m}", scores[m]) for m in CHAT_STATS if m in scores]
        per_source = r.stats.get("per_source")
        if per_source and isinstance(per_source, dict):  # data stages: documents kept per source read
            pairs.append(("per_source", per_source_summary(per_source)))
        if r.stats.get("warnings"):
            pairs.append(("warnings", len(r.stats["warnings"])))
        stats = r.error if r.error else ", ".join(f"{k}={_fmt(v)}" for k, v in pairs)
        rows.append([r.name, r.version, r.status, f"{r.seconds:.1f}", r.path, stats])
    return rows


def per_source_summary(per_source: dict) -> str:
    """`kjv=1075,chichewa=0`: each source's documents out of a data stage."""
    from tasks.judging import UNREAD

    return ",".join(f"{name or '?'}={c['docs_out'] if isinstance(c, dict) else c}"
                    for name, c in per_source.items() if name != UNREAD)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    sys.exit(main())
