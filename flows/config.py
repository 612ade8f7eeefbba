"""The experiment config: one YAML file, one section per stage, validated by pydantic.

The same model is the `pipeline` flow's parameter, so the Prefect UI renders it as a form.
Each stage's version hashes only its own section (plus the shared fields it reads, like `seed`),
so editing `eval` never reruns training.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from tasks.acquire import AcquireConfig, SourceConfig
from tasks.chat_data import ChatDataConfig
from tasks.decontaminate import DecontaminateConfig
from tasks.dedup import DedupConfig
from tasks.dpo import DPOConfig
from tasks.sft import SFTConfig
from tasks.evaluate import EvalConfig, checkpoint_steps
from tasks.export import ExportConfig
from tasks.extract import ExtractConfig
from tasks.filter import FilterConfig
from tasks.quality import NegativeExamplesConfig, QualityClassifierConfig, QualityFilterConfig
from tasks.tokenize import TokenizeConfig
from tasks.tokenizer import TokenizerConfig
from tasks.engine.config import ConfigModel, Count, Fraction, setting
from training.config import (MixtureConfig, MixtureSourceConfig, ModelConfig, ResourcesConfig, TrainConfig,
                             check_cpu_devices)
from training.scaling import ScalingConfig
from training.tracking import TrackingConfig


class QualityConfig(ConfigModel):
    """A DCLM-style quality filter: a fastText classifier trained on positives (the documents that
    passed `filter`, or files) against negatives (those documents with their words shuffled, or
    files), then used to score every document."""

    classifier: QualityClassifierConfig = Field(QualityClassifierConfig(), description="The fastText classifier "
                                                "and its training (the `train_quality_classifier` step).")
    negatives: NegativeExamplesConfig = Field(NegativeExamplesConfig(), description="The negatives made from the "
                                              "positives by shuffling their words (the `negative_examples` step).")
    filter: QualityFilterConfig = Field(QualityFilterConfig(keep_fraction=0.9), description="Which scored "
                                        "documents are kept (the `quality_filter` step).")


def _config_class(annotation: Any) -> type[BaseModel] | None:
    """The config class a field holds (`X` or `X | None`), if it holds one."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _holds_source_drop(model: type[BaseModel]) -> bool:
    subs = [_config_class(field.annotation) for field in model.model_fields.values()]
    return "max_source_drop" in model.model_fields or any(sub is not None and _holds_source_drop(sub) for sub in subs)


def with_source_drop_limit(model: type[BaseModel], section: Any, limit: float) -> Any:
    """`section` (a mapping or a `model`) with `limit` as the `max_source_drop` of every data stage
    in it: the stages are the configs that declare the field, so a new one needs no list here."""
    if section is None:
        return None
    updates: dict[str, Any] = {"max_source_drop": limit} if "max_source_drop" in model.model_fields else {}
    for name, field in model.model_fields.items():
        sub = _config_class(field.annotation)
        if sub is not None and _holds_source_drop(sub):
            value = section.get(name, field.get_default(call_default_factory=True)) if isinstance(section, dict) \
                else getattr(section, name)
            updates[name] = with_source_drop_limit(sub, value, limit)
    return {**section, **updates} if isinstance(section, dict) else section.model_copy(update=updates)


class DataConfig(ConfigModel):
    sources: list[SourceConfig] = Field(min_length=1, description="Where the documents come from; acquire reads "
                                        "them in this order.")
    docs_per_shard: int = Field(500, ge=1, description="Documents per shard of the acquire output; each later data "
                                "stage writes one shard per input shard, so this also sets their count.")
    max_doc_bytes: int = Field(5_000_000, ge=1, description="Acquire: larger documents (by their text's UTF-8 "
                               "bytes, or a JSON line's) are counted as `too_large` and skipped.")
    strict: bool = Field(False, description="Acquire: make a bad record an error naming file and line, instead of "
                         "counting it. Each later data stage has its own `strict`.")
    extract: ExtractConfig | None = Field(None, description="HTML/WARC to main text; leave out for plain-text sources.")
    filter: FilterConfig = Field(FilterConfig(), description="Language identification and heuristic quality "
                                 "rules.")
    quality: QualityConfig | None = Field(None, description="A fastText quality classifier and filter after "
                                          "`filter`; leave out for none.")
    dedup: DedupConfig | None = Field(DedupConfig(), description="Exact and fuzzy deduplication; leave out with "
                                      "`dedup: null`.")
    decontaminate: DecontaminateConfig | None = Field(
        DecontaminateConfig(), description="Drop training documents sharing a long n-gram with an eval example "
        "(the held-out documents kiln's suite is cut from, and `eval.lm_eval_tasks` YAMLs' data files; the "
        "pipeline copies `validation_fraction` and `lm_eval_tasks` in). Leave out with `decontaminate: null`.")
    max_source_drop: Fraction = setting(0.9, description="A data stage that removes more than this share of any "
                                        "one source's documents warns, naming it, and records it in its stats "
                                        "(`warnings`); copied into every data stage's `max_source_drop`.")
    mixture: MixtureConfig | None = Field(
        None, description="Train on a weighted mixture of the sources instead of one stream of all of them: "
        "each source then runs the data stages and is tokenized on its own, so changing one source recomputes "
        "only its own steps, and changing a weight reruns training and what follows (docs/mixtures.md).")

    @model_validator(mode="before")
    @classmethod
    def _share_max_source_drop(cls, raw: Any) -> Any:
        """Copy `max_source_drop` into each data stage's section (a setting: no version changes):
        every section, at any depth, whose config has a `max_source_drop` field."""
        if not isinstance(raw, dict) or "max_source_drop" not in raw:
            return raw
        limit = raw["max_source_drop"]
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 <= limit <= 1:
            return raw  # refused by the field's own check, naming data.max_source_drop
        return with_source_drop_limit(cls, dict(raw), limit)

    @field_validator("mixture")
    @classmethod
    def _mixture_names_sources(cls, mixture: MixtureConfig | None, info: ValidationInfo) -> MixtureConfig | None:
        if mixture is None or "sources" not in info.data:  # no valid sources: refused naming data.sources
            return mixture
        names = [s.name for s in info.data["sources"]]
        unknown = [n for n in mixture.sources if n not in names]
        if unknown:
            raise ValueError(f"mixture.sources names {unknown}, which are not sources (data.sources: {names})")
        missing = [n for n in names if n not in mixture.sources]
        if missing:
            raise ValueError(f"mixture.sources leaves out the sources {missing}: give each a weight "
                             "(weight 0: validation only)")
        if mixture.tokenizer_source is not None and mixture.tokenizer_source not in names:
            raise ValueError(f"mixture.tokenizer_source {mixture.tokenizer_source!r} is not a source "
                             f"(data.sources: {names})")
        return mixture

    def acquire(self) -> AcquireConfig:
        return AcquireConfig(sources=self.sources, docs_per_shard=self.docs_per_shard,
                             max_doc_bytes=self.max_doc_bytes, strict=self.strict)

    def of_source(self, name: str) -> "DataConfig":
        """This section for one source alone: one chain of a mixture's data steps."""
        return self.model_copy(update={"sources": [s for s in self.sources if s.name == name], "mixture": None})


class PosttrainConfig(ConfigModel):
    """SFT on conversations built from held-out text, then DPO against the SFT model.

    Conversations are in kiln's chat template, whose tokens the tokenizer's `special_tokens` must
    include (`<|user|>`, `<|assistant|>`, `<|system|>`, `<|end|>`: training.chat_template.CHAT_SPECIAL_TOKENS),
    or, with `tokenizer.kind: hf`, in the chat template of the tokenizer's folder (docs/posttraining.md)."""

    chat: ChatDataConfig = Field(ChatDataConfig(), description="The conversations and preference pairs that "
                                 "SFT and DPO train and are evaluated on (the `chat_data` step).")
    sft: SFTConfig = Field(SFTConfig(), description="Supervised fine-tuning of the final model (the last train "
                           "step's, or a soup after it) on the conversations.")
    dpo: DPOConfig | None = Field(DPOConfig(), description="DPO of the SFT model on the preference pairs; leave out "
                                  "with `dpo: null`.")
    evaluate: bool = setting(True, description="Also score the SFT and DPO models with the `eval` section's "
                             "evaluate step (`evaluate/sft`, `evaluate/dpo`), beside the base model's, so "
                             "`kiln compare` shows each model's metrics in one table and the export's model card "
                             "shows the exported model's own; false: neither, and the card says it was not "
                             "evaluated.")

    @model_validator(mode="after")
    def _check_objectives(self) -> "PosttrainConfig":
        """Refused as the config is read, not when the step starts to train, after pretraining."""
        for name, section in (("sft", self.sft), ("dpo", self.dpo)):
            if section is not None and (set_here := section.train.pretraining_only()):
                raise ValueError(f"posttrain.{name}.train: {', '.join(set_here)}: only "
                                 f"pretraining's next-token objective takes that, not {name.upper()}'s: leave it out")
        return self


class RunSettings(ConfigModel):
    """Where and how fast, never what: none of these enter a version."""

    workers: int = setting(1, ge=1, description="Parallel workers for data stages (Ray when > 1).")
    max_concurrent: int = setting(1, ge=1, description="Steps run at once, each as soon as its inputs are done; "
                                  "raise it when Ray has room for several trainings (a cluster, or more cores).")
    compare_metric: str = setting("bits_per_byte", description="The metric `kiln compare` and the pipeline's "
                                  "comparison plot show per variant (any key of the compare table).")
    lock_url: str | None = setting(None, pattern=r"^rediss?://", description="`redis://HOST:PORT/DB`: step locks in "
                                   "Redis, shared by every runner that uses it (runners on several machines that "
                                   "share a store); without it, lock files beside the store's local root.")
    lock_lease_s: float = setting(30.0, gt=0, description="A Redis lock's lease: renewed while its holder lives, "
                                  "released this long after a holder dies.")
    slot_limits: dict[str, Annotated[int, Field(ge=1)]] = setting(
        {}, description="The size of each slot limit a step's resources.slots may name, e.g. `{gpu: 8}` for the "
        "GPUs the runs share; every config that shares a limit gives it the same size (a different one is an "
        "error naming both).")
    verify: Literal["sizes", "full"] = setting(
        "sizes", description="How a finished step is checked before it counts as cached: `sizes`, one listing "
        "of its folder against the file names and sizes its lineage recorded (nothing read or downloaded); "
        "`full`, every file's sha256 recomputed (every byte read), as `kiln verify` does.")
    notify_webhook: str | None = setting(
        None, pattern=r"^(https?://|block:)", description="Where a failed kiln flow run (pipeline, experiment, "
        "data-refresh, evaluate, canary) is reported, through a Prefect notification block: an `http(s)://` URL "
        "gets a JSON POST (Prefect's CustomWebhookNotificationBlock) with the flow-run id, name, state and "
        "message; `block:<type>/<name>` loads a saved block (e.g. `block:slack-webhook/team`), which keeps a "
        "secret URL out of the config (flows/notify.py).")


class CanaryConfig(ConfigModel):
    """What a healthy run of the canary's config reaches (flows/canary.py); None: not checked."""

    max_final_loss: float | None = setting(None, gt=0, description="The last training loss of each branch's final model.")
    min_steps: int | None = setting(None, ge=0, description="Training steps the final model must have run.")
    max_wall_s: float | None = setting(None, gt=0, description="Seconds the whole canary run may take.")
    min: dict[str, float] = setting({}, description="Evaluate metric -> its lowest healthy value (e.g. "
                                    "`next_passage_acc: 0.3`); a metric the run does not report fails the check.")
    max: dict[str, float] = setting({}, description="Evaluate metric -> its highest healthy value (e.g. "
                                    "`bits_per_byte: 1.8`).")


def away_from_default(model: ConfigModel, names: Sequence[str]) -> list[str]:
    """Which of the fields `names` hold other than their default. Not `model_fields_set`: a
    branch's config (variants, grid) and a deployment's parameters are dumped whole and validated
    again, every field then given."""
    fields = type(model).model_fields
    return [n for n in names if getattr(model, n) != fields[n].get_default(call_default_factory=True)]


class PhaseConfig(ConfigModel):
    """A later phase of training (docs/starting_points.md): a train step of its own,
    `train/<phase>`, that starts from another phase's kept state, with its own curves,
    checkpoints and evaluation; or, with `average`, a model soup: the mean of the parameters of
    phases before it (a `soup` step), evaluated and exported like a trained model."""

    model_config = ConfigDict(populate_by_name=True)

    steps: Count | None = Field(None, description="Steps this phase trains (every phase but a soup). Mode "
                                "continue: its run ends at the step it starts from plus these (the step counter "
                                "carries on); reset and weights: at these.")
    from_: str = setting("", alias="from", description="The phase it starts from: `train` (the train section) "
                         "or another phase's name; empty: the phase before it.")
    step: Count | Literal["latest"] = Field("latest", description="Which step of that phase: one it keeps "
                                            "(kiln makes it keep it), or its last.")
    mode: Literal["continue", "reset", "weights"] = Field(
        "continue", description="What the phase takes from the step it starts from (train.init.mode): `continue`, "
        "parameters, optimizer state, step counter and data position; `reset`, parameters and optimizer moments, "
        "with the step counter, schedule and data position starting at 0; `weights`, parameters only.")
    train: dict[str, Any] = Field(default_factory=dict, description="Fields of `train` this phase changes, over "
                                  "those of the phase it starts from (lr, schedule, decay_steps, batch_size, ...).")
    mixture: dict[str, MixtureSourceConfig] | None = Field(
        None, description="A mixture run's weights and caps for this phase (every source named); None: those "
        "of the phase it starts from.")
    average: list[str] = Field(
        [], description="A model soup instead of training: the mean of the parameters of these phases before "
        "it, each `train` or a phase's name (its trained model) or `<name>@<step>` (a step it keeps; kiln makes "
        "it keep it), two or more; e.g. anneals from one stable run on other data orders (`train.seed`), as "
        "OLMo 2's final models. Trains nothing: give none of steps, from, step, mode, train, mixture.")
    greedy: bool = Field(False, description="With `average`: a greedy soup (Wortsman et al.): the parts ranked by "
                         "their held-out loss, the best kept, each next one kept only if the soup's held-out loss "
                         "does not rise. Scored on the eval.heldout_tokens held-out tokens after those the evaluate "
                         "step scores (so set eval.heldout_tokens); `kiln compare` shows how many it kept.")

    @model_validator(mode="after")
    def _check_soup(self) -> "PhaseConfig":
        if self.greedy and not self.average:
            raise ValueError("greedy chooses among a soup's parts: give `average` too, or leave greedy out")
        if not self.average:
            if self.steps is None:
                raise ValueError("a phase trains `steps` steps (give them), or averages phases before it "
                                 "(`average`: a soup)")
            return self
        trained = away_from_default(self, ("from_", "mixture", "mode", "step", "steps", "train"))
        if trained:
            names = ", ".join(field.rstrip("_") for field in trained)
            raise ValueError(f"a soup (`average`) trains nothing: leave out {names}")
        if len(self.average) < 2 or len(set(self.average)) < len(self.average):
            raise ValueError(f"average: {self.average} names {len(set(self.average))} distinct part(s); a soup "
                             "averages two or more")
        self.parts()  # each part must read as `<name>` or `<name>@<step>`
        return self

    def parts(self) -> list[tuple[str, int | None]]:
        """The soup's parts as (phase name, kept step or None for its trained model)."""
        parts = []
        for part in self.average:
            name, at, step = part.partition("@")
            if not name or (at and not step.isdigit()) or (at and int(step) < 1):
                raise ValueError(f"average: {part!r} is not `<phase>` or `<phase>@<step>` (e.g. `train@160`)")
            parts.append((name, int(step) if at else None))
        return parts


class ExperimentConfig(ConfigModel):
    name: str = setting("experiment", description="A label for runs and deployments; enters no version.")
    data: DataConfig = Field(description="The sources and the data stages that turn them into training documents.")
    tokenizer: TokenizerConfig = Field(TokenizerConfig(), description="The tokenizer: GPT-2's, a BPE trained on the "
                                       "documents, or a Hugging Face model's.")
    tokenize: TokenizeConfig = Field(TokenizeConfig(), description="Documents to token shards, and which documents "
                                     "are held out for validation and evaluation.")
    model: ModelConfig = Field(ModelConfig(), description="`vocab_size` is set from the tokenizer unless given "
                               "(a padded vocabulary).")
    train: TrainConfig = Field(TrainConfig(), description="The pretraining recipe: batch, steps, optimizer, "
                               "schedule, checkpoints.")
    phases: dict[str, PhaseConfig] = Field(
        {}, description="Later phases of training, in order, each a train step `train/<phase>` that starts from "
        "the one before (or the one its `from` names) and is evaluated on its own; post-training and the export "
        "start from the last. A grid over `phases.<name>.step` makes cooldown branches (docs/starting_points.md).")
    eval: EvalConfig = Field(EvalConfig(), description="`validation_fraction` is set from `tokenize`.")
    export: ExportConfig = Field(ExportConfig(), description="The final model as a Hugging Face folder with a "
                                 "model card.")
    posttrain: PosttrainConfig | None = Field(None, description="Optional SFT and DPO after pretraining.")
    scaling: ScalingConfig | None = Field(
        None, description="An isoFLOP sweep instead of one model: its runs replace `model`, `train`, `phases`, "
        "`eval`, `export` and `posttrain` (given beside it, they are refused), and the fits and forecast check "
        "follow (docs/scaling_laws.md).")
    resources: ResourcesConfig = setting(ResourcesConfig(), description="Where the train steps run (hosts, CPUs, "
                                         "GPUs, TPUs, Ray); enters no version.")
    run: RunSettings = setting(RunSettings(), description="How steps are run: data-stage workers, steps at once, "
                               "locks, cache checks, failure notices; enters no version.")
    variants: dict[str, dict[str, Any]] = setting(
        {}, description="Named partial overrides of this config (nested, or by dotted path such as "
        "`train.lr`), deep-merged; each variant is a branch of steps, and steps whose versions agree are shared. "
        "List `base: {}` to run the config itself too.")
    grid: dict[str, list[Any]] = setting(
        {}, description="Dotted path -> values: one branch per point of their cartesian product (crossed with "
        "`variants` when both are given).")
    canary: CanaryConfig | None = setting(
        None, description="Bounds for `kiln canary` and the `canary` deployment (flows/canary.py): a daily run "
        "of this config into a fresh store fails, naming the metric, when a result leaves them.")
    tracking: TrackingConfig = setting(
        TrackingConfig(), description="Training metrics beyond metrics.jsonl and TensorBoard (always written): "
        "`wandb` logs every train, SFT and DPO step to Weights & Biases. Enters no version.")


    @model_validator(mode="after")
    def _check_mixture(self) -> "ExperimentConfig":
        mixture = self.data.mixture
        if mixture is None:
            return self
        if self.scaling is not None:
            raise ValueError("data.mixture: a scaling sweep trains on one token stream; leave out one of the two")
        if self.tokenizer.kind == "bpe" and mixture.tokenizer_source is None:
            raise ValueError("data.mixture.tokenizer_source: tokenizer kind 'bpe' with a mixture trains on one "
                             "named source (so that changing another retrains no tokenizer): name it, or use "
                             "tokenizer kind 'gpt2'")
        if self.tokenizer.kind != "bpe" and mixture.tokenizer_source is not None:
            raise ValueError(f"data.mixture.tokenizer_source: the {self.tokenizer.kind} tokenizer is not trained; "
                             "leave it out")
        if self.train.eval_batches < len(mixture.sources):
            raise ValueError(f"train.eval_batches: {self.train.eval_batches} is fewer than the mixture's "
                             f"{len(mixture.sources)} sources, and each source gets a validation batch")
        steps = self.train_config().steps
        if mixture.tokens is not None and steps <= self.train.warmup:
            raise ValueError(f"data.mixture.tokens: {mixture.tokens} tokens are {steps} steps of "
                             f"{self.train.batch_size} x {self.model.seq_len} tokens, not more than "
                             f"train.warmup={self.train.warmup}")
        return self

    @model_validator(mode="after")
    def _check_scaling(self) -> "ExperimentConfig":
        if self.scaling is None:
            return self
        unread = away_from_default(self, ("model", "train", "phases", "eval", "export", "posttrain"))
        if unread:
            raise ValueError(f"scaling: a sweep plans each run's model, training and evaluation from its own fields "
                             f"(scaling.*, e.g. scaling.optimizer), so {', '.join(unread)} would never be read: "
                             "leave them out")
        return self

    @model_validator(mode="after")
    def _check_chat_tokens(self) -> "ExperimentConfig":
        """Post-training in kiln's chat template needs its tokens in the tokenizer: said here, not
        after pretraining, when the SFT step would find them missing. A Hugging Face tokenizer
        folder with a chat template of its own is post-trained in that (read here where the folder
        is; where it is not, the tokenizer step says so)."""
        from training.chat_template import CHAT_SPECIAL_TOKENS

        if self.posttrain is None:
            return self
        if self.tokenizer.kind == "hf":
            from tokenizers import Tokenizer

            from tasks.tokenizer import TOKENIZER_FILE, hf_chat_template

            folder = Path(self.tokenizer.path)
            if not (folder / TOKENIZER_FILE).is_file() or hf_chat_template(folder) is not None:
                return self
            vocabulary = Tokenizer.from_file(str(folder / TOKENIZER_FILE)).get_vocab(with_added_tokens=True)
            missing = [t for t in CHAT_SPECIAL_TOKENS if t not in vocabulary]
            if missing:
                raise ValueError(f"posttrain: {folder} has no chat template (tokenizer_config.json's chat_template "
                                 f"or chat_template.jinja), and kiln's chat template needs the tokens {missing}, "
                                 "which its tokenizer lacks: post-train from a checkpoint that chats (its Instruct "
                                 "release's tokenizer folder), or add a chat template to the folder")
            return self
        missing = [t for t in CHAT_SPECIAL_TOKENS if t not in self.tokenizer.special_tokens]
        if missing:
            raise ValueError(f"posttrain: SFT and DPO write conversations in kiln's chat template, whose tokens "
                             f"{missing} are not in tokenizer.special_tokens: add them (e.g. special_tokens: "
                             f"{[*self.tokenizer.special_tokens, *missing]}), or take a Hugging Face tokenizer with a "
                             "chat template (tokenizer.kind hf)")
        return self

    @model_validator(mode="after")
    def _check_greedy_soups(self) -> "ExperimentConfig":
        greedy = [name for name, phase in self.phases.items() if phase.greedy]
        if greedy and self.eval.heldout_tokens is None:
            raise ValueError(f"phases.{greedy[0]}.greedy: a greedy soup scores the eval.heldout_tokens held-out tokens "
                             "after those the evaluate step scores; with eval.heldout_tokens unset it scores them all: "
                             "set it (e.g. 16384)")
        return self

    @model_validator(mode="after")
    def _check_hf_model(self) -> "ExperimentConfig":
        """From a Hugging Face checkpoint (train.init.hf) the architecture is its config.json's: a
        `model` field that would not be read is said here, not left to train another model."""
        if self.train.init is None or self.train.init.hf is None:
            return self
        unread = away_from_default(self.model, [n for n in type(self.model).model_fields
                                                if n not in ("seq_len", "compute_dtype")])
        if unread:
            raise ValueError(f"train.init.hf: the model is {self.train.init.hf}'s, as its config.json gives it, so "
                             f"model.{', model.'.join(unread)} would never be read: leave them out (`model` gives "
                             "only seq_len, a cap on the checkpoint's context, and compute_dtype)")
        return self

    @model_validator(mode="after")
    def _check_adapter_export(self) -> "ExperimentConfig":
        """`export.lora: adapter` writes the final model's adapters: one trained without any is said
        here, not by the export after every other step has run."""
        if self.export.lora != "adapter" or self.scaling is not None:
            return self
        if self.posttrain is not None:
            where = "posttrain.dpo.train" if self.posttrain.dpo is not None else "posttrain.sft.train"
            lora = (self.posttrain.dpo or self.posttrain.sft).train.lora
        else:
            trains, soups = self.phase_steps()
            last = f"train/{list(self.phases)[-1]}" if self.phases else "train"
            if last in soups:
                raise ValueError(f"export.lora: `adapter` exports the final model's adapters, but the final model is "
                                 f"the soup phases.{last.removeprefix('train/')}, an average of parameters without "
                                 "any: leave export.lora at merged")
            where = "train" if last == "train" else f"phases.{last.removeprefix('train/')}.train"
            lora = trains[last][0].lora
        if lora is None:
            raise ValueError(f"export.lora: `adapter` exports the final model's adapters, but the final model's "
                             f"training, {where}, has no LoRA: set {where}.lora (e.g. {{rank: 8}}) or leave "
                             "export.lora at merged")
        return self

    @model_validator(mode="after")
    def _check_cpu_devices(self) -> "ExperimentConfig":
        for train, _ in self.phase_trains().values():
            check_cpu_devices(train, self.resources)
        return self

    def train_config(self) -> TrainConfig:
        """The `train` section as the train step gets it: `steps` from the mixture's token budget
        when there is one, and `keep_params` the steps of `eval.checkpoints`."""
        train, mixture = self.train, self.data.mixture
        if mixture is not None and mixture.tokens is not None:
            train = train.model_copy(update={"steps": mixture.tokens // (train.batch_size * self.model.seq_len)})
        return train

    def phase_trains(self) -> dict[str, tuple[TrainConfig, dict[str, MixtureSourceConfig] | None]]:
        """Every train step's config by name (`train`, then `train/<phase>` in order) with its
        mixture weights (None without a mixture): each phase's `train` over the one it starts
        from, its `steps` counted as its mode says, its `train.init` naming that step, and
        `keep_checkpoints` every step a later step starts from, a soup averages or `eval.checkpoints`
        evaluates. Soup phases are not train steps: `phase_soups` has them."""
        return self.phase_steps()[0]

    def phase_steps(self) -> tuple[dict, dict]:
        """`phase_trains` and `phase_soups` from one walk of the phases."""
        trains, soups = self._phases()
        return _with_kept_steps(trains, soups, self.eval), soups

    def phase_soups(self) -> dict[str, tuple[tuple[str, int | None], ...]]:
        """Every soup phase (`average`) by its step's name, `train/<phase>`, with its parts: each a
        train step's name and the step it kept (None: its trained model)."""
        return self._phases()[1]

    def _phases(self) -> tuple[dict, dict]:
        base = self.train_config()
        trains = {"train": (base, self.data.mixture.sources if self.data.mixture is not None else None)}
        soups: dict[str, tuple[tuple[str, int | None], ...]] = {}
        previous = "train"
        for name, phase in self.phases.items():
            if phase.average:
                soups[f"train/{name}"] = self._soup_parts(name, phase, trains, soups)
                previous = f"train/{name}"
                continue
            parent = "train" if phase.from_ == "train" else f"train/{phase.from_}" if phase.from_ else previous
            if parent in soups:
                raise ValueError(f"phases.{name}.from: {parent.removeprefix('train/')!r} is a soup, an average of "
                                 "parameters with no train state to carry on: start from a phase it averages, or "
                                 "put the soup last (post-training and the export start from the last phase)")
            if parent not in trains:
                raise ValueError(f"phases.{name}.from: {phase.from_!r} is not `train` or a phase before {name!r} "
                                 f"(the phases so far: {[n.removeprefix('train/') for n in trains][1:]})")
            parent_cfg, parent_mixture = trains[parent]
            start = parent_cfg.steps if phase.step == "latest" else phase.step
            if start > parent_cfg.steps:
                raise ValueError(f"phases.{name}.step: {start} is past the end of {parent} ({parent_cfg.steps} steps)")
            fields = {k: v for k, v in parent_cfg.model_dump().items()
                      if k not in ("init", "keep_checkpoints", "keep_every", "schedule_steps")}  # its own
            fields = {**fields, **phase.train,
                      "steps": (start if phase.mode == "continue" else 0) + phase.steps,
                      "init": {"from": parent, "step": phase.step, "mode": phase.mode}}
            try:
                cfg = TrainConfig.model_validate(fields)
            except ValidationError as e:
                err = e.errors()[0]
                raise ValueError(f"phases.{name}.train: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
            if phase.mode != "weights" and (cfg.ema is None) != (parent_cfg.ema is None):
                raise ValueError(f"phases.{name}.train.ema: mode {phase.mode} carries on {parent}'s train state, which "
                                 f"holds a moving average only if its train.ema is set ({parent_cfg.ema}): set both "
                                 "or neither, or start in mode weights")
            if (phase.mixture is None) != (parent_mixture is None) or (
                    phase.mixture is not None and set(phase.mixture) != set(parent_mixture)):
                raise ValueError(f"phases.{name}.mixture: a phase of a mixture run names every source of "
                                 f"data.mixture.sources, and one of a run on one stream none")
            trains[f"train/{name}"] = (cfg, phase.mixture or parent_mixture)
            previous = f"train/{name}"
        return trains, soups

    @staticmethod
    def _soup_parts(name: str, phase: PhaseConfig, trains: dict, soups: dict) -> tuple[tuple[str, int | None], ...]:
        """A soup's parts as train step names, each checked to be a phase before it that trains
        (a soup of soups would weigh their parts unevenly) and its step one that phase trains."""
        parts = []
        for part, step in phase.parts():
            train = "train" if part == "train" else f"train/{part}"
            if train in soups:
                raise ValueError(f"phases.{name}.average: {part!r} is a soup itself; name the phases it averages")
            if train not in trains:
                raise ValueError(f"phases.{name}.average: {part!r} is not `train` or a phase before {name!r} "
                                 f"(the phases so far: {[n.removeprefix('train/') for n in trains][1:]})")
            cfg, first = trains[train][0], _started_after(trains, train)
            if step is not None and not first < step <= cfg.steps:
                raise ValueError(f"phases.{name}.average: {part}@{step} is not a step {train} trains "
                                 f"({first + 1} to {cfg.steps})")
            parts.append((train, step))
        return tuple(parts)


def _started_after(trains: dict, name: str) -> int:
    """The step after which train step `name`'s run trains (`trains`: train configs by step name,
    first in each value): a phase in mode continue carries on from its parent's step, any other
    run counts from 0."""
    init = trains[name][0].init
    if init is None or init.mode != "continue" or init.from_ not in trains:
        return 0
    return init.kept_step(trains[init.from_][0].steps)


def trained_in(trains: dict, name: str, step: int) -> str:
    """The train step whose run trained `step` of the training that ends at train step `name`: a
    phase in mode continue trains only the steps after the one it starts from, and those up to it
    are its parent's (and so up)."""
    while step <= _started_after(trains, name):
        name = trains[name][0].init.from_
    return name


def _with_kept_steps(trains: dict, soups: dict, eval_cfg: EvalConfig) -> dict:
    """Each train config with `keep_checkpoints` naming every step that a later phase starts
    from (continue or reset; weights from the last step read the published model) or a soup
    averages and, for the last train phase, the steps of `eval.checkpoints` (each kept by the
    phase that trains it: `trained_in`)."""
    kept: dict[str, set[int]] = {name: set() for name in trains}
    for cfg, _ in trains.values():
        init = cfg.init
        if init is not None and init.from_ in trains:
            step = init.kept_step(trains[init.from_][0].steps)
            if step is not None:
                kept[init.from_].add(step)
    for parts in soups.values():
        for train, step in parts:
            if step is not None:
                kept[train].add(step)
    last = list(trains)[-1]
    last_cfg = trains[last][0]
    for step in checkpoint_steps(eval_cfg.checkpoints, last_cfg.steps, last_cfg.checkpoint_every):
        kept[trained_in(trains, last, step)].add(step)
    return {name: (cfg if not kept[name] else cfg.model_copy(update={"keep_checkpoints": tuple(sorted(kept[name]))}),
                   mixture) for name, (cfg, mixture) in trains.items()}


class ConfigError(ValueError):
    """A config file that does not validate; the message is one line naming file and field."""


def parse_sets(sets: Sequence[str]) -> dict[str, Any]:
    """`--set PATH=VALUE` items as {dotted path: value}, each value read as YAML."""
    out = {}
    for item in sets:
        field, equals, value = item.partition("=")
        if not equals or not field.strip() or any(not part for part in field.strip().split(".")):
            raise ConfigError(f"--set {item!r}: give PATH=VALUE, a dotted path and a YAML value, such as "
                              "train.optimizer=muon or train.lr=1e-3")
        try:
            out[field.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML: {str(e).splitlines()[0]}") from None
    return out


def with_sets(raw: dict, sets: Sequence[str]) -> dict:
    """A config's raw values (as read from its YAML) with `--set PATH=VALUE` overrides on them."""
    from flows.experiment import deep_merge, nest  # here: that module builds on this one

    return deep_merge(raw, nest(parse_sets(sets)))


def load_config(path: str | Path, sets: Sequence[str] = ()) -> ExperimentConfig:
    """The config in a YAML file, validated with its variants; `sets` are `--set PATH=VALUE`
    overrides of single fields (dotted paths, values read as YAML), put on the file's values
    before validation, and so under every variant's."""
    from flows.experiment import branch_configs  # here: that module builds on this one

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such config file")
    if path.suffix == ".py":  # kiln run, plan and compare read one through flows.experiment.load_experiment
        raise ConfigError(f"{path}: a Python experiment, which kiln run, plan and compare take; this command "
                          "takes a YAML config")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    raw = with_sets(raw, sets)
    try:
        config = ExperimentConfig.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        got = f"; got {err['input']!r}" if err["type"] != "missing" and not isinstance(err["input"], dict) else ""
        given = f" (with --set {' '.join(sets)})" if sets else ""
        raise ConfigError(f"{path}{given}: {field}: {err['msg']}{got}{more}") from None
    branch_configs(config, str(path))  # every variant must validate too
    return config
