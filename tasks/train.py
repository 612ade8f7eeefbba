"""The train step: a tokenize output (or, for a mixture, one per source) in, a trained model out.

The body hands everything to `training.launch.launch_training`, which runs the loop in Ray
task(s) and relays metrics here, to the step's log. Output folder (training/loop.py):
`model.json`, `params.safetensors`, `metrics.jsonl`, `loss.png`. Checkpoints live in the
step's work folder in the store (`ctx.workspace`), stable per version: a rerun of an unfinished
version resumes from the last one, on this machine or another.
In the Prefect UI, beside the step: its curves and a table of the logged points (`show_curves`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from evaluation.suite import SuiteConfig
from tasks.engine.config import ConfigModel, Fraction, setting
from training.config import MixtureSourceConfig, ModelConfig, ResourcesConfig, TrainConfig
from training.data import read_meta
from training.tracking import TrackingConfig, tracked

if TYPE_CHECKING:  # tasks.engine.step imports Prefect; Ray workers that import this module skip it
    from tasks.engine.step import Step, StepContext

# 2: fused projections, `project`'s weight gradients and the hand-written cross-entropy change the
# last bits of every trained parameter (training/model.py, training/step.py); 3: attention in query blocks, the same
# again (training/model.py `causal_attention`); 4: rotary positions in one fused pass, the same again
# (training/model.py `rotary`); 5: its cos and sin tables computed once per forward, constants while
# tracing (training/model.py `rope_tables`), and SwiGLU's hand-written backward (`swiglu`), the same again;
# 6: a sliding-window layer's query blocks skip the keys outside their rows' windows (`causal_attention`): the
# last bits of a model with a window shorter than seq_len move (a model without one computes the same bits)
STAGE_VERSION = 6
EVAL_TOKENIZER, EVAL_DOCUMENTS = "evals/tokenizer", "evals/documents"  # train.evals' unversioned inputs
INIT = "init"  # train.init's parent step (its version enters this step's)
HF_INIT = "hf_init"  # in the work folder: train.init.hf imported as a kiln model for the hosts


class TrainStepConfig(ConfigModel):
    """What to train (identity) and where (resources: never part of the version)."""

    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    resources: ResourcesConfig = setting(ResourcesConfig())
    tracking: TrackingConfig = setting(TrackingConfig())  # W&B and the like: watched, not learned
    # How train.evals' suite tasks are cut from the held-out documents: the experiment's eval.suite
    # and tokenize.validation_fraction (the pipeline copies them in), so that an in-loop task has
    # the evaluate step's examples.
    suite: SuiteConfig = setting(SuiteConfig())
    validation_fraction: Fraction = setting(0.01)


class MixtureTrainStepConfig(TrainStepConfig):
    """A train step on a mixture (docs/mixtures.md): its inputs are `tokens/<source>`, and each
    source's weight and max_epochs are identity. A subclass, not an optional field, so that the
    versions of one-stream train steps stay what they were."""

    mixture: dict[str, MixtureSourceConfig]


def run_train(ctx: StepContext) -> dict:
    from training.launch import TokenSource, launch_training, token_data  # Ray and JAX: when the step runs

    cfg: TrainStepConfig = ctx.config
    mixture = cfg.mixture if isinstance(cfg, MixtureTrainStepConfig) else None
    tokens = ctx.located("tokens") if mixture is None else [
        TokenSource(name, ctx.located(f"tokens/{name}"), s.weight, s.max_epochs) for name, s in mixture.items()]
    train_cfg = with_eos(cfg.train, tokens[0].tokens if isinstance(tokens, list) else tokens)
    data, drawn = token_data(tokens, cfg.model, train_cfg)
    ctx.log.info("training %d steps of %d x %d tokens on %d host(s)", cfg.train.steps, cfg.train.batch_size,
                 cfg.model.seq_len, cfg.resources.hosts)
    if mixture is not None:
        ctx.log.info("mixture: %s", ", ".join(f"{name} {d['share']:.1%} of the tokens ({d['epochs']:.2f} epochs)"
                                              for name, d in drawn.items()))

    def relay(record: dict) -> None:
        val = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
        mfu = f" mfu {record['mfu']:.1%}" if record.get("mfu") is not None else ""
        ctx.log.info("step %d/%d loss %.4f%s lr %.2e grad_norm %.3f %.0f tok/s%s", record["step"],
                     cfg.train.steps, record["loss"], val, record["lr"], record["grad_norm"],
                     record["tokens_per_s"], mfu)
        ctx.progress(record["step"], cfg.train.steps)

    hooks = [] if cfg.train.evals is None else [in_loop_evals(ctx, mixture)]
    with tracked(relay, cfg.tracking, f"train-{ctx.step.version}", cfg.model_dump(mode="json")) as on_metrics:
        stats = launch_training(cfg.model, train_cfg, cfg.resources, data, ctx.workspace, ctx.out,
                                on_metrics=on_metrics, hooks=hooks, **starting_point(ctx))
    show_curves(ctx, cfg.train.steps)
    return stats if mixture is None else {**stats, "mixture": drawn}  # the tokens drawn from each source


def with_eos(train_cfg: TrainConfig, tokens) -> TrainConfig:
    """train.document_mask cuts documents at the tokens' EOS: `eos_id` filled in from their meta
    (a mixture's sources share one tokenizer, which the loader checks). A setting, because the
    tokens' version, an input of this step's, already fixes it."""
    if not train_cfg.document_mask:
        return train_cfg
    eos = read_meta(tokens.local())["eos_id"]
    if train_cfg.eos_id is not None and train_cfg.eos_id != eos:
        raise ValueError(f"train.eos_id={train_cfg.eos_id}, but the tokens' EOS id is {eos}: leave train.eos_id out "
                         "(the train step fills it in)")
    return train_cfg.model_copy(update={"eos_id": eos})


def starting_point(ctx: StepContext) -> dict:
    """launch_training's init_model, init_step and init_mode for train.init: the parent step's
    output (at a step it kept), or a Hugging Face model imported here into the work folder,
    which the hosts pull with it. Nothing without train.init: a random initialisation."""
    init = ctx.config.train.init
    if init is None:
        return {}
    if init.hf is not None:
        from training.hf_import import load_hf  # JAX: not for plans
        from training.loop import flatten_params, save_model

        model, params = load_hf(Path(init.hf), seq_len=ctx.config.model.seq_len)
        if model != ctx.config.model:
            raise ValueError(f"train.init.hf {init.hf} is a model of config {model.model_dump()}, but the model "
                             f"section says {ctx.config.model.model_dump()}: set model to the Hugging Face model's")
        save_model(ctx.work_dir / HF_INIT, model, flatten_params(params))
        ctx.log.info("starting from the Hugging Face model in %s (%s)", init.hf, model)
        return {"init_model": HF_INIT, "init_mode": "weights"}
    parent = ctx.step.inputs[INIT]
    step = init.kept_step(ctx.input_stats[INIT].get("steps"))  # a soup trained no steps: mode weights
    ctx.log.info("starting from %s %s (%s) in mode %s", parent.name, parent.version,
                 "its trained model" if step is None else f"step {step}", init.mode)
    return {"init_model": ctx.located(INIT), "init_step": step, "init_mode": init.mode}


def in_loop_evals(ctx: StepContext, mixture: dict | None):
    """The hook factory of train.evals (evaluation/in_loop.py), with its suite tasks cut into the
    work folder, which the hosts pull."""
    from evaluation.in_loop import InLoopEvals, held_out, prepare_suite  # JAX and lm-eval: not for plans

    cfg: TrainStepConfig = ctx.config
    evals = cfg.train.evals
    sources = []
    for name, input_name, weight in ([("heldout", "tokens", 1.0)] if mixture is None else
                                     [(n, f"tokens/{n}", m.weight) for n, m in mixture.items()]):
        if held_out(ctx.inputs[input_name], weight) is None:
            ctx.log.warning("in-loop evals: source %s has no held-out tokens to score (its validation split is "
                            "empty): no eval/%s/bpb curve; raise tokenize.validation_fraction for one", name, name)
        else:
            sources.append((name, ctx.located(input_name), weight))
    if evals.tasks:
        counts = prepare_suite(ctx.inputs[EVAL_DOCUMENTS], ctx.work_dir, evals, cfg.suite, cfg.validation_fraction)
        ctx.log.info("in-loop evals every %d steps: suite %s examples from held-out documents", evals.every, counts)
    return InLoopEvals(evals, ctx.located(EVAL_TOKENIZER), tuple(sources), tuple(evals.tasks))


def show_curves(ctx: StepContext, steps: int) -> None:
    """Beside the step in the Prefect UI: its curves as a picture (loss and validation loss,
    learning rate, tokens/s) and the logged points as a table."""
    from training.metrics import curve_points, plot_curves, read_metrics  # JAX and matplotlib: not for plans

    records = read_metrics(ctx.out / "metrics.jsonl")
    name = f"{ctx.step.name} {ctx.step.version}"
    ctx.show("image", "curves", plot_curves(records, f"{name}: {steps} steps"),
             f"kiln {name}: loss and validation loss, learning rate, tokens/s per log step")
    ctx.show("table", "metrics", curve_points(records), f"kiln {name}: the logged metrics (metrics.jsonl)")


def train_step(model_cfg: ModelConfig, train_cfg: TrainConfig, resources: ResourcesConfig, *,
               tokens: Step | dict[str, Step], tracking: TrackingConfig = TrackingConfig(),
               mixture: dict[str, MixtureSourceConfig] | None = None, tokenizer: Step | None = None,
               documents: Step | None = None, suite: SuiteConfig = SuiteConfig(),
               validation_fraction: float = 0.01, init: Step | None = None) -> Step:
    """A train step on one tokenize step, or with `mixture` on one tokenize step per source
    (`tokens`: source name -> step), mixed by the mixture's weights and caps in its order.

    With `train.evals` it also reads the `tokenizer` and (for suite tasks) the `documents` the
    suite is cut from (with `suite` and `validation_fraction`, as the evaluate step cuts it). They
    are unversioned inputs: in-loop evals change what is logged, not what is learned. With
    `train.init.from`, `init` is the step it names (an input: its version enters this one's)."""
    from tasks.engine.step import Step  # here, not at the top: see the TYPE_CHECKING import

    settings = dict(resources=resources, tracking=tracking, suite=suite, validation_fraction=validation_fraction)
    evals = train_cfg.evals
    watched: dict[str, Step] = {}
    if evals is not None:
        if tokenizer is None or (evals.tasks and documents is None):
            raise ValueError("train.evals needs the tokenizer step (and for suite tasks the documents step) as "
                             "inputs of the train step: pass train_step(..., tokenizer=..., documents=...)")
        watched = {EVAL_TOKENIZER: tokenizer, **({EVAL_DOCUMENTS: documents} if evals.tasks else {})}
    starts = train_cfg.init is not None and train_cfg.init.from_ is not None
    if starts != (init is not None):
        raise ValueError(f"train.init.from names {train_cfg.init.from_ if starts else None!r} but the train step was "
                         f"given init={init.name if init is not None else None!r}: pass the step it names as init")
    parent = {INIT: init} if init is not None else {}
    if mixture is None:
        config = TrainStepConfig(model=model_cfg, train=train_cfg, **settings)
        inputs = {"tokens": tokens, **parent}
    else:
        if not isinstance(tokens, dict) or set(tokens) != set(mixture):
            raise ValueError(f"a mixture's train step takes one tokenize step per source of the mixture "
                             f"({sorted(mixture)}), got {sorted(tokens) if isinstance(tokens, dict) else tokens}")
        config = MixtureTrainStepConfig(model=model_cfg, train=train_cfg, mixture=mixture, **settings)
        inputs = {**{f"tokens/{name}": tokens[name] for name in mixture}, **parent}
    return Step(name="train", stage="train", stage_version=STAGE_VERSION, config=config, run=run_train,
                inputs={**inputs, **watched}, unversioned=frozenset(watched))
