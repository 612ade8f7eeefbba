"""The recipe: one config as a list of steps (Marin's `experiments/defaults.py`, on Prefect).

`recipe` reads like what it is: each line makes one step from its config section and the steps
it consumes; a new stage is one module in tasks/ and one line here (plus its section in
flows/config.py, for a stage configured from YAML). Nothing here runs anything:
`kiln plan` prints an experiment's steps (flows/experiment.py: one recipe per variant, shared
steps once) with their versions and statuses, and the scheduler (tasks/engine/scheduler.py)
runs them.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flows.config import DataConfig, ExperimentConfig, away_from_default, trained_in
from tasks.acquire import acquire_step
from tasks.chat_data import chat_data_step
from tasks.decontaminate import decontaminate_step
from tasks.dedup import dedup_step
from tasks.dpo import dpo_step
from tasks.sft import sft_step
from tasks.soup import GreedySelection, soup_step
from tasks.evaluate import checkpoint_steps, evaluate_step
from tasks.export import export_step
from tasks.extract import extract_step
from tasks.filter import filter_step
from tasks.quality import negative_examples_step, quality_filter_step, train_quality_classifier_step
from tasks.tokenize import tokenize_step
from tasks.tokenizer import GPT2_EOS, TokenizerConfig, tokenizer_step
from tasks.train import train_step
from tasks.engine.step import Step, upstream_order
from tasks.engine.store import Store
from tasks.engine.caching import lock_manager
from tasks.engine.config import ConfigModel
from training.config import KEPT_DIR, InitConfig, ModelConfig, model_mismatch

if TYPE_CHECKING:
    from flows.experiment import Experiment


def recipe(config: ExperimentConfig) -> list[Step]:
    """Every step of one config, upstream before downstream."""
    if config.data.mixture is not None:
        return mixture_recipe(config)
    documents = data_steps(config, config.data)
    tokenizer = tokenizer_step(config.tokenizer, documents=documents if config.tokenizer.kind == "bpe" else None)
    tokens = tokenize_step(config.tokenize, tokenizer=tokenizer, documents=documents)
    if config.scaling is not None:  # a sweep of many models in place of one
        from flows.scaling import scaling_steps

        return upstream_order([documents, tokens,
                               *scaling_steps(config, tokens=tokens, tokenizer=tokenizer, documents=documents)])
    models = train_steps(config, tokens, tokenizer, documents)
    return upstream_order([documents, tokens, *after_training(config, models, tokenizer, tokens, documents)])


def data_steps(config: ExperimentConfig, data: DataConfig) -> Step:
    """acquire -> [extract] -> filter -> [quality] -> [dedup] -> [decontaminate]: the documents to tokenize."""
    documents = acquire_step(data.acquire())
    if data.extract is not None:
        documents = extract_step(data.extract, documents=documents)
    documents = filter_step(data.filter, documents=documents)
    if data.quality is not None:
        negatives = negative_examples_step(data.quality.negatives, documents=documents)
        classifier = train_quality_classifier_step(data.quality.classifier, positive=documents,
                                                   negative=negatives)
        documents = quality_filter_step(data.quality.filter, documents=documents, classifier=classifier)
    if data.dedup is not None:
        documents = dedup_step(data.dedup, documents=documents)
    if data.decontaminate is not None:  # against the held-out documents and the lm-eval tasks' data
        documents = decontaminate_step(data.decontaminate.model_copy(update={
            "validation_fraction": config.tokenize.validation_fraction, "lm_eval_tasks": config.eval.lm_eval_tasks}),
            documents=documents)
    return documents


def mixture_recipe(config: ExperimentConfig) -> list[Step]:
    """A mixture (docs/mixtures.md): each source's own data steps and tokenize step, named
    `<step>/<source>`, so a changed source recomputes only its chain; one train step mixes them by
    weight. The BPE, if any, is trained on `tokenizer_source` alone. Evaluation and post-training
    read the first source of `data.sources`."""
    mixture = config.data.mixture
    documents = {name: named(data_steps(config, config.data.of_source(name)), name) for name in mixture.sources}
    bpe = config.tokenizer.kind == "bpe"
    tokenizer = tokenizer_step(config.tokenizer, documents=documents[mixture.tokenizer_source] if bpe else None)
    tokens = {name: named(tokenize_step(config.tokenize, tokenizer=tokenizer, documents=docs), name, upstream=False)
              for name, docs in documents.items()}
    first = config.data.sources[0].name
    models = train_steps(config, tokens, tokenizer, documents[first])
    return upstream_order([*documents.values(), *tokens.values(),
                           *after_training(config, models, tokenizer, tokens[first], documents[first])])


def train_steps(config: ExperimentConfig, tokens: Step | dict[str, Step], tokenizer: Step,
                documents: Step) -> dict[str, Step]:
    """The train step and one per phase (`train/<phase>`) in the config's order, each started
    from the step its `train.init.from` names, or, for a soup phase, the soup of the steps it
    averages; a mixture's `tokens` is source name -> tokenize step. What train.evals reads besides
    the tokens: the tokenizer, and the documents its suite tasks are cut from, as the evaluate
    step cuts them (eval.suite, tokenize.validation_fraction)."""
    model_cfg = model_of(config)
    trains, soups = config.phase_steps()
    steps: dict[str, Step] = {}
    for name in ["train", *(f"train/{phase}" for phase in config.phases)]:
        if name in soups:
            greedy = None
            if config.phases[name.removeprefix("train/")].greedy:  # scored past what the evaluate step scores
                held_out = tokens[config.data.sources[0].name] if isinstance(tokens, dict) else tokens
                greedy = GreedySelection(held_out, tokenizer, first_token=config.eval.heldout_tokens,
                                         tokens=config.eval.heldout_tokens, batch_size=config.eval.batch_size)
            steps[name] = dataclasses.replace(soup_step([(steps[part], at) for part, at in soups[name]], greedy),
                                              name=name)
            continue
        train_cfg, mixture = trains[name]
        parent = None
        if train_cfg.init is not None and train_cfg.init.from_:
            parent = steps.get(train_cfg.init.from_) or published_step(train_cfg.init.from_, name, train_cfg.init)
        step = train_step(model_cfg, train_cfg, config.resources, tokens=tokens, mixture=mixture,
                          tracking=config.tracking, tokenizer=tokenizer, documents=documents, suite=config.eval.suite,
                          validation_fraction=config.tokenize.validation_fraction, init=parent)
        steps[name] = dataclasses.replace(step, name=name)
    return steps


def named(final: Step, source: str, upstream: bool = True) -> Step:
    """`final` named `<name>/<source>`, and with `upstream` every step it depends on (its inputs
    rewired to the renamed ones); names never enter a version."""
    renamed: dict[int, Step] = {}
    for step in upstream_order([final]) if upstream else [final]:
        renamed[id(step)] = dataclasses.replace(
            step, name=f"{step.name}/{source}", inputs={n: renamed.get(id(u), u) for n, u in step.inputs.items()})
    return renamed[id(final)]


def after_training(config: ExperimentConfig, models: dict[str, Step], tokenizer: Step, tokens: Step,
                   documents: Step) -> list[Step]:
    """Evaluation of every train and soup step (`evaluate`, `evaluate/<phase>`), the last train
    step's checkpoint series (eval.checkpoints; a step before a continue phase's start is its
    parent's, evaluated there), optional post-training of the last model (with
    posttrain.evaluate, `evaluate/sft` and `evaluate/dpo` of its models) and the export of the
    final model, whose model card carries that model's own evaluation (none where it was not
    evaluated)."""
    eval_cfg = config.eval.model_copy(update={"validation_fraction": config.tokenize.validation_fraction})

    def evaluation_of(model: Step, name: str, step: int | None = None) -> Step:
        config = eval_cfg if step is None else eval_cfg.model_copy(update={"step": step})
        return dataclasses.replace(evaluate_step(config, model=model, tokenizer=tokenizer, tokens=tokens,
                                                 documents=documents), name=name)

    evaluations = {name: evaluation_of(model, name.replace("train", "evaluate", 1)) for name, model in models.items()}
    model, evaluation = list(models.values())[-1], list(evaluations.values())[-1]
    trains = {name: (m.config.train, None) for name, m in models.items() if m.stage == "train"}
    trained = list(trains)[-1]  # a soup keeps no steps; each step is evaluated where it was trained
    series = [evaluation_of(models[trained_in(trains, trained, step)], f"{evaluations[trained].name}/step-{step}", step)
              for step in checkpoint_steps(config.eval.checkpoints, models[trained].config.train.steps,
                                           models[trained].config.train.checkpoint_every)]
    final, posttrained = model, []
    if config.posttrain is not None:
        pt = config.posttrain
        chat = chat_data_step(pt.chat.model_copy(update={"validation_fraction": config.tokenize.validation_fraction}),
                              documents=documents)
        final = sft_step(pt.sft, model=model, tokenizer=tokenizer, chat=chat, tracking=config.tracking)
        posttrained.append(final)
        if pt.dpo is not None:
            final = dpo_step(pt.dpo, model=final, tokenizer=tokenizer, pairs=chat, tracking=config.tracking)
            posttrained.append(final)
        evaluation = None  # the base model's scores are not the post-trained model's
        if pt.evaluate:
            posttrained += [evaluation_of(m, f"evaluate/{m.stage}") for m in posttrained]
            evaluation = posttrained[-1]
    exported = export_step(config.export, model=final, tokenizer=tokenizer, evaluation=evaluation)
    return [*models.values(), *series, *evaluations.values(), *posttrained, exported]


class PublishedConfig(ConfigModel):
    """A step that is already in the store, named by its place there (train.init.from)."""

    stage: str
    version: str


def published_step(place: str, child: str, init: InitConfig | None = None) -> Step:
    """`<stage>/<version>` of a train, SFT, DPO or soup output already in the store, as a step
    whose version is that version: a cache hit when it is there, an error naming it when it is
    not. A soup has parameters only: `init` (the child's train.init) must take them so."""
    match = re.fullmatch(r"(train|sft|dpo|soup)/([0-9a-f]{12})", place)
    if match is None:
        raise ValueError(f"{child}: train.init.from {place!r} is neither a train step before it (`train`, "
                         "`train/<phase>`) nor a published output `train/<version>` (or sft/, dpo/, soup/)")
    if match[1] == "soup" and init is not None and (init.mode != "weights" or init.step != "latest"):
        raise ValueError(f"{child}: train.init.from {place!r} is a soup, an average of parameters with no train "
                         "state and no kept steps: start from it with mode weights and no step")

    def missing(ctx):
        raise FileNotFoundError(f"{place} is not in the store: {child} starts from it (train.init.from); "
                                "run the experiment that made it into this store, or name a step of this one")

    step = Step(name=f"init/{match[1]}-{match[2]}", stage=match[1], stage_version=0,
                config=PublishedConfig(stage=match[1], version=match[2]), run=missing)
    step.__dict__["version"] = match[2]  # its place in the store is its version
    return step


def model_of(config: ExperimentConfig) -> ModelConfig:
    """The model the train steps train: the `model` section with the tokenizer's vocabulary (or
    the section's own `vocab_size`, where it gives one: at least the tokenizer's, its extra rows
    never produced from text, as a model trained from a Hugging Face checkpoint with a padded
    vocabulary has), or, starting from a Hugging Face model (train.init.hf), that model's
    architecture (config.json, read here) with the section's seq_len as a cap and its compute_dtype."""
    init = config.train.init
    if init is None or init.hf is None:
        tokens = vocab_size(config.tokenizer)
        if not away_from_default(config.model, ["vocab_size"]):
            return config.model.model_copy(update={"vocab_size": tokens})
        if config.model.vocab_size < tokens:
            raise ValueError(f"model.vocab_size is {config.model.vocab_size} but the tokenizer has {tokens} tokens: "
                             "leave it out (the tokenizer's) or give at least that many")
        return config.model
    from training.hf_import import model_config, read_config

    folder = Path(init.hf)
    return model_config(read_config(folder), config.model.seq_len, folder).model_copy(
        update={"compute_dtype": config.model.compute_dtype})


def vocab_size(tokenizer: TokenizerConfig) -> int:
    """The model's vocabulary: GPT-2's 50257 plus any added special tokens, the BPE's size, or
    the size of a Hugging Face tokenizer.json (added tokens included)."""
    if tokenizer.kind == "bpe":
        return tokenizer.vocab_size
    if tokenizer.kind == "hf":
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(Path(tokenizer.path) / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    return 50257 + len([t for t in tokenizer.special_tokens if t != GPT2_EOS])


def select(steps: list[Step], until: str | None = None) -> list[Step]:
    """The steps needed to produce stage `until` (all of them when None)."""
    if until is None:
        return steps
    targets = [s for s in steps if s.stage == until or s.name == until]
    if not targets:
        known = ", ".join(dict.fromkeys(s.stage for s in steps))
        raise ValueError(f"--until {until!r} names no stage of this experiment (stages: {known})")
    return upstream_order(targets)


@dataclass(frozen=True)
class PlannedStep:
    stage: str
    name: str
    version: str
    path: str
    status: str  # done, missing, running, failed
    variants: list[str]  # the variants whose branch holds this step ([] without variants)
    warning: str | None = None  # e.g. the stage's code changed since the cached run


def step_status(step: Step, store: Store, lock_url: str | None = None) -> str:
    if store.is_done(step.stage, step.version):
        return "done"
    if lock_manager(store, lock_url).is_locked(step.key):
        return "running"
    if store.failure_record(step.stage, step.version).exists():
        return "failed"
    return "missing"


def code_drift(step: Step, store: Store) -> str | None:
    """A warning when a done step's code differs from the code that produced it: the stage's
    module and every kiln module it imports (lineage `module_hashes`; an output made before those
    were recorded is compared by its stage module alone).

    Code is not part of the version (so comments don't fork artefacts); if the change does
    alter outputs, bump the stage's STAGE_VERSION or rerun with --force.
    """
    from tasks.engine.lineage import module_hashes, source_hash

    recorded = store.read_lineage(step.stage, step.version).get("code", {})
    since = (f"since this output was made (commit {str(recorded.get('commit'))[:10]}); if outputs would differ, "
             "bump STAGE_VERSION or --force it")
    if recorded.get("module_hashes"):
        now, then = module_hashes(step), recorded["module_hashes"]
        changed = sorted(m for m in now.keys() | then.keys() if now.get(m) != then.get(m))
        if changed:
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            return f"{step.name}: its code changed ({', '.join(changed[:3])}{more}) {since}"
    elif recorded.get("source_sha256") and recorded["source_sha256"] != source_hash(step):
        return f"{step.name}: its stage source changed {since}"
    return None


def missing_kept_step(step: Step, store: Store) -> str | None:
    """A warning when a step not yet run starts from (train.init), evaluates (eval.checkpoints) or
    averages (a soup) a step of a train output that is done but did not keep it: trained before
    anything named it (what a train output keeps is a setting, so its version, and the cache
    hit, stay)."""
    if step.stage == "train" and "init" in step.inputs and step.config.train.init is not None:
        parent, init = step.inputs["init"], step.config.train.init
        trained = store.read_lineage(parent.stage, parent.version)["stats"].get("steps") \
            if store.is_done(parent.stage, parent.version) else None  # `latest`: what it trained
        needed = init.kept_step(trained)
    elif step.stage == "evaluate" and step.config.step is not None:
        parent, needed = step.inputs["model"], step.config.step
    elif step.stage == "soup":
        return next(filter(None, (_not_kept(step, step.inputs[f"part/{i}"], needed, store)
                                  for i, needed in enumerate(step.config.steps))), None)
    else:
        return None
    return _not_kept(step, parent, needed, store)


def _not_kept(step: Step, parent: Step, needed: int | None, store: Store) -> str | None:
    if needed is None or not store.is_done(parent.stage, parent.version):
        return None
    files = store.read_lineage(parent.stage, parent.version).get("files", {})
    if f"{KEPT_DIR}/{needed}/model.json" in files:
        return None
    kept = sorted({int(f.split("/")[1]) for f in files if f.startswith(f"{KEPT_DIR}/")})
    return (f"{step.name} needs step {needed} of {parent.name} {parent.version}, which was trained before any step "
            f"named it and did not keep it (it kept {kept or 'none'}): delete {store.output(parent.stage, parent.version)} "
            "to train it again (kiln then keeps the step), or name a step it kept")


def starting_point_mismatch(step: Step, store: Store) -> str | None:
    """Why a train step cannot start from another experiment's model that its train.init.from
    names and the store holds: the model fields that differ from this step's, each with both
    values (training/config.py `model_mismatch`). Found as the run is planned; before, when the
    step started to train, after every data stage before it."""
    if step.stage != "train" or not isinstance(getattr(step.inputs.get("init"), "config", None), PublishedConfig):
        return None
    parent = step.inputs["init"]
    if not store.is_done(parent.stage, parent.version):
        return None  # the step that stands for it says so
    theirs = ModelConfig.model_validate_json(store.read_text(parent.stage, parent.version, "model.json"))
    if theirs == step.config.model:
        return None
    return f"{step.name}: {model_mismatch(f'{parent.stage}/{parent.version}', theirs, step.config.model)}"


def check_starting_points(steps: list[Step], store: Store) -> None:
    """Refuse a run whose train step starts from a published model of another config
    (`starting_point_mismatch`), before any step runs."""
    wrong = [why for why in (starting_point_mismatch(s, store) for s in steps) if why]
    if wrong:
        raise ValueError("; ".join(wrong))


def plan(experiment: Experiment, store: Store, until: str | None = None) -> list[PlannedStep]:
    """Every step of the experiment once, with its status; the scaling forecast's steps too once
    the fit they depend on is in the store."""
    planned = []
    steps = select(experiment.steps, until)
    if until is None:
        experiment = with_followups(experiment, store)
        steps = experiment.steps
    for s in steps:
        status = step_status(s, store, experiment.run.lock_url)
        warning = code_drift(s, store) if status == "done" else (missing_kept_step(s, store)
                                                                  or starting_point_mismatch(s, store))
        planned.append(PlannedStep(s.stage, s.name, s.version, store.output(s.stage, s.version), status,
                                   [v for v in experiment.variants_of[s.key] if v], warning))
    return planned


def with_followups(experiment: Experiment, store: Store) -> Experiment:
    """The experiment plus the steps that can only be built from another step's output: a scaling
    sweep's forecast check, once its held-out fit is in the store (flows/scaling.py)."""
    from flows.scaling import ready_forecast_steps

    branches = {}
    for variant, branch in experiment.branches.items():
        extra = []
        if branch.config is not None and branch.config.scaling is not None and branch.config.scaling.forecast:
            extra = ready_forecast_steps(branch.config, store, upstream_order(branch.steps))
        branches[variant] = dataclasses.replace(branch, steps=[*branch.steps, *extra]) if extra else branch
    return dataclasses.replace(experiment, branches=branches)
