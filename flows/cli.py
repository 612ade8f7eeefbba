"""`kiln`: run, plan and trace experiments, and sample from or serve the models they make. See `kiln --help`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EPILOG = """examples:
  kiln run configs/tiny_cpu.yaml                 raw text to an evaluated model, cached by version
  kiln run configs/tiny_cpu.yaml --until acquire run only what `acquire` needs
  kiln run configs/ablation_cpu.yaml             every variant; shared steps run once
  kiln run experiments/two_widths.py             a Python experiment file, like a YAML one
  kiln plan configs/tiny_cpu.yaml --json         every step's name, version, path, status, variants
  kiln compare configs/ablation_cpu.yaml         one row per variant: what it changed, its results
  kiln compare CONFIG --over steps               each metric against the training step (eval.checkpoints)
  kiln lineage kiln_store/acquire/<version>      the tree back to the raw sources
  kiln verify --store kiln_store                 check every artefact against its recorded sha256s
  kiln generate kiln_store/sft/<version> --prompt "Who made the light?" --chat   sample from a model
  kiln serve-model kiln_store/sft/<version>     an OpenAI-compatible API at http://127.0.0.1:8000/v1
  kiln why configs/tiny_cpu.yaml kjv/01-001      which data stage kept or dropped a document, and why
  kiln serve configs/tiny_cpu.yaml               serve deployments on the server at PREFECT_API_URL

The store is ./kiln_store unless --store or KILN_STORE says otherwise (a path or fsspec URL).
Runs use Prefect's ephemeral API unless PREFECT_API_URL names a server."""


def _prefect_defaults() -> None:
    """Quiet, offline-safe Prefect settings unless the user set them."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LOG_PRINTS", "true")
    # The Prefect API server (and the Ray) this run starts end with it, even after a SIGKILL.
    from training.reaper import watch_this_process

    watch_this_process()
    # Prefect's console format before anything else logs: absl (imported by orbax) otherwise puts
    # Python's bare `INFO:name:` handler on the root logger first, and Prefect keeps it.
    from prefect.logging.configuration import setup_logging

    setup_logging()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="Reproducible LM training: every stage a "
                                "cached, versioned Prefect step with lineage.", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, example: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, epilog=f"example:\n  {example}",
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    run = command("run", "Run the pipeline for a config or Python experiment; cached steps are not "
                  "recomputed; exits 1 naming every step that failed.",
                  "kiln run configs/tiny_cpu.yaml --until tokenize --force train")
    run.add_argument("config", help="experiment YAML, or a Python experiment file (.py)")
    run.add_argument("--store", help="artefact store: path or fsspec URL (default ./kiln_store or $KILN_STORE)")
    run.add_argument("--until", metavar="STAGE", help="stop after this stage (and what it needs)")
    run.add_argument("--force", metavar="STAGE", nargs="+", default=[], help="recompute these stages even if cached")

    pl = command("plan", "List every step once with its version, output path, status and the variants "
                 "that use it; runs nothing.", "kiln plan configs/ablation_cpu.yaml --json")
    pl.add_argument("config", help="experiment YAML, or a Python experiment file (.py)")
    pl.add_argument("--store")
    pl.add_argument("--until", metavar="STAGE")
    pl.add_argument("--json", action="store_true",
                    help="a JSON list of {name, stage, version, path, status, variants}")

    co = command("compare", "One row per variant (or sweep run): its overrides, losses, eval metrics, "
                 "bits per byte, parameters, tokens and seconds, read from the store.",
                 "kiln compare configs/ablation_cpu.yaml --json")
    co.add_argument("config", help="experiment YAML, or a Python experiment file (.py)")
    co.add_argument("--store")
    co.add_argument("--json", action="store_true", help="the rows as a JSON list (null: not run yet)")
    co.add_argument("--over", choices=["variants", "steps"], default="variants",
                    help="steps: one row per evaluated training step of each variant (eval.checkpoints), "
                    "each metric against the step (default: one row per variant)")

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
    gen.add_argument("path", help="a train, sft or dpo output folder, or an export folder")
    gen.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    gen.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    gen.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95; 1: off)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    gen.add_argument("--chat", action="store_true", help="apply the chat template (post-trained models); "
                     "the answer ends at the end-of-turn token")
    gen.add_argument("--tokenizer", help="tokenizer step output folder (default: found through lineage)")

    sm = command("serve-model", "Serve a trained, post-trained or exported model over an OpenAI-compatible "
                 "HTTP API (/v1/models, /v1/completions, /v1/chat/completions; docs/serving.md) until SIGTERM "
                 "or Ctrl-C; concurrent requests run in batches.",
                 "kiln serve-model kiln_store/export/<version> --port 8000 --name my-model")
    sm.add_argument("path", help="a train, sft or dpo output folder, or an export folder")
    sm.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                    "only; the server has no authentication)")
    sm.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    sm.add_argument("--tokenizer", help="tokenizer step output folder (default: found through lineage)")
    sm.add_argument("--name", help="the model's name in the API (default: <stage>/<version> of the folder)")
    sm.add_argument("--max-batch", type=int, default=8, help="prompts run together at most (default 8)")

    why = command("why", "Show which data stage kept or dropped a document, with its scores.",
                  "kiln why configs/tiny_cpu.yaml chichewa/01-001")
    why.add_argument("config")
    why.add_argument("doc_id", help="a document id as acquire wrote it: <source name>/<the record's own id>, "
                     "or <source name>/<file>:<line> for a record without one")
    why.add_argument("--store")

    serve = command("serve", "Register the pipeline, data-refresh and evaluate deployments on the "
                    "Prefect server at PREFECT_API_URL and run them when triggered or scheduled.",
                    "PREFECT_API_URL=http://127.0.0.1:4200/api kiln serve configs/tiny_cpu.yaml --cron '0 3 * * *'")
    serve.add_argument("config", help="experiment YAML: the deployments' default parameters")
    serve.add_argument("--store", help="the store runs write to (default ./kiln_store or $KILN_STORE)")
    serve.add_argument("--cron", default="0 3 * * *", help="data-refresh schedule (default: daily at 03:00)")
    serve.add_argument("--refresh-until", default="tokenize", metavar="STAGE",
                       help="the last stage data-refresh reruns (default: tokenize)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KilnUserError as e:
        print(f"kiln: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        lost = _lost_prefect_api(e)
        if lost is None:
            raise
        print(f"kiln: the Prefect API at {lost} stopped answering during the {args.command} "
              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); is its server still running? "
              "What was published is kept: rerun when it is back and finished steps are cache hits", file=sys.stderr)
        return 1


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


def _config(path: str):
    from flows.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as e:
        raise KilnUserError(str(e)) from None


def _experiment(path: str):
    from flows.config import ConfigError
    from flows.experiment import load_experiment

    try:
        return load_experiment(path)
    except ConfigError as e:
        raise KilnUserError(str(e)) from None


def _store(arg: str | None):
    from tasks.engine.store import Store

    return Store(arg)


def cmd_plan(args) -> int:
    from flows.plan import plan

    experiment, store = _experiment(args.config), _store(args.store)
    try:
        steps = plan(experiment, store, args.until)
    except (ValueError, FileNotFoundError) as e:
        raise KilnUserError(str(e)) from None
    for s in steps:
        if s.warning:
            print(f"kiln: warning: {s.warning}", file=sys.stderr)
    if args.json:
        print(json.dumps([{"name": s.name, "stage": s.stage, "version": s.version, "path": s.path,
                           "status": s.status, "variants": s.variants} for s in steps], indent=2))
    else:
        from flows.terminal import print_table

        rows = [[s.name, s.version, s.status, ",".join(s.variants) or "-", s.path] for s in steps]
        print_table(["step", "version", "status", "variants", "path"], rows, "status")
    return 0


def cmd_compare(args) -> int:
    from flows.compare import cells, columns, comparison, over_steps
    from flows.terminal import print_table

    experiment, store = _experiment(args.config), _store(args.store)
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
    experiment, store = _experiment(args.config), _store(args.store)
    from flows.plan import select

    try:
        select(experiment.steps, args.until)
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
        model = load(Path(args.path), None if args.tokenizer is None else Path(args.tokenizer))
        text = generate(model, args.prompt, args.max_tokens, args.temperature, args.top_p, args.seed, args.chat)
    except (ValueError, FileNotFoundError) as e:
        raise KilnUserError(str(e)) from None
    print(text)
    return 0


def cmd_serve_model(args) -> int:
    from evaluation.server import serve_model

    try:
        serve_model(Path(args.path), args.host, args.port, None if args.tokenizer is None else Path(args.tokenizer),
                    args.name, args.max_batch)
    except (ValueError, FileNotFoundError) as e:
        raise KilnUserError(str(e)) from None
    return 0


def cmd_why(args) -> int:
    from tasks.engine.judging import explain

    experiment, store = _experiment(args.config), _store(args.store)
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
    config, store = _config(args.config), _store(args.store)
    from deployments.serve import NoServer, serve

    try:
        serve(config, store.root, cron=args.cron, refresh_until=args.refresh_until)
    except NoServer as e:
        raise KilnUserError(str(e)) from None
    return 0


COMMANDS = {"run": cmd_run, "plan": cmd_plan, "compare": cmd_compare, "lineage": cmd_lineage, "verify": cmd_verify,
            "generate": cmd_generate, "serve-model": cmd_serve_model, "why": cmd_why, "serve": cmd_serve}

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
        if isinstance(r.stats.get("per_source"), dict):  # data stages: documents out per source
            pairs.append(("per_source", per_source_summary(r.stats["per_source"])))
        if r.stats.get("warnings"):
            pairs.append(("warnings", len(r.stats["warnings"])))
        stats = r.error if r.error else ", ".join(f"{k}={_fmt(v)}" for k, v in pairs)
        rows.append([r.name, r.version, r.status, f"{r.seconds:.1f}", r.path, stats])
    return rows


def per_source_summary(per_source: dict) -> str:
    """`kjv=1075,chichewa=0`: each source's documents out of a data stage."""
    from tasks.engine.judging import UNREAD

    return ",".join(f"{name or '?'}={c['docs_out'] if isinstance(c, dict) else c}"
                    for name, c in per_source.items() if name != UNREAD)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    sys.exit(main())
