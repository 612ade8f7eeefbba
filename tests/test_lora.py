"""LoRA (`train.lora`, training/lora.py) in the one training loop: only the adapters train and hold
optimizer state, the base parameters stay bit for bit, the published model is the merged one;
DPO's reference is the base; exports: merged (transformers' logits equal kiln's) and a peft
adapter folder that peft loads onto the base export with the same logits."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.conftest import needs
from tests.test_hf_import import LLAMA_TOKENS, tokenizer_folder, torch_logits
from tests.test_loader import run_body
from tests.test_training_kjv_data import WindowBatches, kjv_tokens
from tasks.tokenizer import TokenizerConfig, read_tokenizer_meta, tokenizer_step
from training.config import LoraConfig, ModelConfig, TrainConfig
from tasks.engine.step import Step
from tasks.export import ExportConfig, export_step
from training.export import export_adapter, export_hf
from training.hooks import Hook
from training.lora import merged
from training.loop import LORA_DIR, flatten_params, load_model, params_sha256, train, unflatten
from training.model import forward, init_params
from training.posttrain import DPOObjective, reference_logprobs

LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
forward = jax.jit(forward, static_argnums=2)


def sha(params) -> str:
    return params_sha256(flatten_params(jax.device_get(params)))


@pytest.fixture(scope="module")
def base():
    tokens, vocab = kjv_tokens()
    model = ModelConfig(vocab_size=vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192, seq_len=64)
    return tokens, model, jax.device_get(init_params(model, jax.random.PRNGKey(7)))


def test_only_the_adapters_train_and_the_published_model_is_the_merged_one(base, tmp_path):
    tokens, model, start = base
    cfg = TrainConfig(batch_size=16, steps=30, lr=1e-2, warmup=3, log_every=10, eval_every=10, checkpoint_every=30,
                      peak_flops=1e11, lora=LORA)
    data = WindowBatches(tokens, cfg.batch_size, model.seq_len, seed=cfg.seed)
    seen = {}

    def last(info):
        seen["base"] = sha(info.state["params"])
        seen["opt_shapes"] = {tuple(x.shape) for x in jax.tree_util.tree_leaves(info.state["opt_state"]) if x.ndim}
        seen["adapter_shapes"] = {tuple(x.shape) for x in jax.tree_util.tree_leaves(info.state["adapters"])}

    stats = train(model, cfg, data.batch_at, data.val_batches(16), tmp_path / "work", tmp_path / "out",
                  init_params=start, hooks=[Hook(last, every=30)])
    assert seen["base"] == sha(start)  # the base parameters are bit for bit what they were
    assert seen["opt_shapes"] == seen["adapter_shapes"]  # moments of the adapters, of nothing else
    assert seen["adapter_shapes"] == {(64, 4), (4, 64), (4, 32), (192, 4)}  # q [64,64], v [64,32], down [192,64]
    _, published = load_model(tmp_path / "out")
    nested = unflatten(load_file(str(tmp_path / "out" / LORA_DIR / "adapters.safetensors")))
    assert sha(published) == stats["params_sha256"]
    recomputed = flatten_params(jax.device_get(merged(jax.device_put(start), jax.device_put(nested), LORA)))
    for name, value in flatten_params(published).items():  # W + (alpha/rank) A B, to float rounding
        np.testing.assert_allclose(value, recomputed[name], rtol=1e-6, atol=1e-7, err_msg=name)
    assert sha(published) != sha(start)
    moved = [k for k, v in flatten_params(published).items() if not np.array_equal(v, flatten_params(start)[k])]
    assert sorted({k.split("/")[2] for k in moved}) == ["down_proj", "q_proj", "v_proj"]  # nothing else changed


def test_dpo_with_lora_scores_against_the_base(base, tmp_path):
    """DPO's reference log-probabilities are the base model's (no second copy held): at the start
    the adapters change nothing, so the first step's loss is log 2 exactly as without LoRA."""
    tokens, model, start = base
    rng = np.random.default_rng(0)
    rows = 8
    inputs = rng.integers(0, model.vocab_size, size=(rows, 2, model.seq_len)).astype(np.int32)
    arrays = {"inputs": inputs, "targets": np.roll(inputs, -1, axis=2),
              "loss_mask": np.ones((rows, 2, model.seq_len), np.float32)}
    arrays["loss_mask"][:, :, : model.seq_len // 2] = 0
    arrays["ref_logp"] = reference_logprobs(start, arrays, model, pairs_per_call=4)
    objective = DPOObjective(0.1)
    cfg = TrainConfig(batch_size=4, steps=6, lr=1e-2, warmup=1, log_every=1, eval_every=6, checkpoint_every=6,
                      weight_decay=0.0, peak_flops=1e11, lora=LORA)
    batch_at = lambda step: {k: v[(step * 4) % rows:(step * 4) % rows + 4] for k, v in arrays.items()}  # noqa: E731
    spec = objective.batch_spec(4, model.seq_len)
    batch_at = (lambda f: lambda step: {k: f(step)[k].astype(spec[k][1]) for k in spec})(batch_at)
    train(model, cfg, batch_at, [], tmp_path / "work", tmp_path / "out", objective=objective, init_params=start)
    from training.metrics import read_metrics

    records = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert records[0]["loss"] == pytest.approx(np.log(2), rel=1e-5) and records[-1]["loss"] < records[0]["loss"]


def test_merged_and_adapter_exports_give_kiln_logits(base, tmp_path):
    torch, transformers, peft = needs("torch"), needs("transformers"), needs("peft")
    tokens, model, start = base
    step = tokenizer_step(TokenizerConfig(kind="hf", path=str(tokenizer_folder(tmp_path / "hf", LLAMA_TOKENS))))
    run_body(step, tmp_path / "tokenizer", {})
    tokenizer_json, meta = (tmp_path / "tokenizer" / "tokenizer.json").read_text(), read_tokenizer_meta(tmp_path / "tokenizer")
    cfg = TrainConfig(batch_size=16, steps=20, lr=1e-2, warmup=2, log_every=10, eval_every=10, checkpoint_every=20,
                      peak_flops=1e11, lora=LORA)
    data = WindowBatches(tokens, cfg.batch_size, model.seq_len, seed=cfg.seed)
    train(model, cfg, data.batch_at, [], tmp_path / "work", tmp_path / "out", init_params=start)
    _, trained = load_model(tmp_path / "out")

    (tmp_path / "base").mkdir()
    export_hf(model, start, tokenizer_json, meta, tmp_path / "base")
    # the export step: the merged model as a Hugging Face folder, and the adapters in adapter/
    fake = Step(name="train", stage="train", stage_version=1, config=cfg, run=None)
    exported = export_step(ExportConfig(lora="adapter"), model=fake, tokenizer=step)
    stats = run_body(exported, tmp_path / "merged", {"model": tmp_path / "out", "tokenizer": tmp_path / "tokenizer"})
    assert stats["adapter_tensors"] == 2 * 3 * model.n_layers
    adapter = tmp_path / "merged" / "adapter"
    ids = np.random.default_rng(1).integers(0, model.vocab_size, size=(2, 40)).astype(np.int32)
    expected = np.asarray(forward(trained, ids, model))

    def logits(m):
        return torch_logits((torch, transformers), m, ids)

    def close(got):
        rel = np.abs(got - expected).max() / np.abs(expected).max()
        assert rel < 1e-4, f"max relative difference {rel:.2e}"

    close(logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()))
    base_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    assert np.abs(logits(base_model) - expected).max() > 1e-3  # the adapters do change the logits
    close(logits(peft.PeftModel.from_pretrained(base_model, adapter).eval()))


def test_an_adapter_of_a_phi3_class_model_loads_onto_its_fused_base_export(tmp_path):
    """A model exported as Phi3ForCausalLM (here: 12 of each head's 16 dimensions rotated, as
    Phi-4-mini rotates 96 of 128) has q, k, v in one Linear and gate, up in another: the adapters on
    q_proj and v_proj become one of twice the rank on qkv_proj, the one on up_proj one on
    gate_up_proj (gate's rows zero), down_proj's stays its own; peft loads them onto the base export
    and computes kiln's merged model."""
    torch, transformers, peft = needs("torch"), needs("transformers"), needs("peft")
    from training.lora import init_adapters

    step = tokenizer_step(TokenizerConfig(kind="hf", path=str(tokenizer_folder(tmp_path / "hf", LLAMA_TOKENS))))
    run_body(step, tmp_path / "tokenizer", {})
    tokenizer_json = (tmp_path / "tokenizer" / "tokenizer.json").read_text()
    meta = read_tokenizer_meta(tmp_path / "tokenizer")
    model = ModelConfig(vocab_size=meta["vocab_size"], d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                        seq_len=64, rotary_width=12)
    lora = LoraConfig(rank=3, alpha=5.0, targets=("q_proj", "v_proj", "up_proj", "down_proj"))
    start = jax.device_get(init_params(model, jax.random.PRNGKey(7)))
    adapters = jax.device_get(init_adapters(start, model, lora, jax.random.PRNGKey(8)))
    rng = np.random.default_rng(9)
    adapters = jax.tree_util.tree_map(lambda x: x if x.any() else 0.05 * rng.standard_normal(x.shape), adapters)
    (tmp_path / "base").mkdir()
    export_hf(model, start, tokenizer_json, meta, tmp_path / "base")
    stats = export_adapter(model, [(lora, flatten_params(adapters))], tmp_path / "adapter")
    assert stats["adapter_tensors"] == 2 * 3 * model.n_layers  # qkv_proj, gate_up_proj, down_proj
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"].shape == ((4 + 2 * 2) * 16, 6)

    ids = np.random.default_rng(1).integers(0, model.vocab_size, size=(2, 40)).astype(np.int32)
    expected = np.asarray(forward(merged(start, adapters, lora), ids, model))
    base_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    assert type(base_model).__name__ == "Phi3ForCausalLM"
    with torch.no_grad():  # (the base first: peft puts the adapters into base_model's own modules)
        plain = base_model(torch.from_numpy(ids.astype(np.int64))).logits.float().numpy()
        got = peft.PeftModel.from_pretrained(base_model, tmp_path / "adapter").eval()(
            torch.from_numpy(ids.astype(np.int64))).logits.float().numpy()
    assert np.abs(plain - expected).max() > 1e-3  # the adapters do change the logits
    rel = np.abs(got - expected).max() / np.abs(expected).max()
    assert rel < 1e-4, f"max relative difference {rel:.2e}"


def test_sft_then_dpo_each_with_lora_export_one_adapter_onto_the_base_they_started_from(base, tmp_path):
    """Two LoRA steps in a row (SFT with LoRA, then DPO with LoRA on its merged model): the export's
    adapter/ holds both updates (the plan gives it the SFT step and the base model as inputs), so
    peft loads it onto base/, the model SFT started from, and computes the DPO model's logits; the
    DPO step's own adapters alone do not."""
    torch, transformers, peft = needs("torch"), needs("transformers"), needs("peft")
    from tasks.dpo import DPOConfig, dpo_step
    from tasks.sft import SFTConfig, sft_step
    from training.loop import save_model

    tokens, model, start = base
    step = tokenizer_step(TokenizerConfig(kind="hf", path=str(tokenizer_folder(tmp_path / "hf", LLAMA_TOKENS))))
    run_body(step, tmp_path / "tokenizer", {})
    save_model(tmp_path / "pretrained", model, flatten_params(start))
    second = LoraConfig(rank=2, alpha=6.0, targets=("q_proj", "k_proj"))  # q in both, k in the second only
    outs = {}
    for name, lora, steps, init in (("sft", LORA, 20, start), ("dpo", second, 10, None)):
        cfg = TrainConfig(batch_size=16, steps=steps, lr=1e-2, warmup=2, log_every=10, eval_every=10,
                          checkpoint_every=steps, peak_flops=1e11, lora=lora, seed=len(name))
        data = WindowBatches(tokens, cfg.batch_size, model.seq_len, seed=cfg.seed)
        init = load_model(outs["sft"])[1] if init is None else init
        train(model, cfg, data.batch_at, [], tmp_path / f"work-{name}", tmp_path / name, init_params=init)
        outs[name] = tmp_path / name
    _, trained = load_model(outs["dpo"])

    # the plan: SFT from the pretrained model, DPO from SFT, both with LoRA
    pretrained = Step(name="train", stage="train", stage_version=1, config=TrainConfig(), run=None)
    chat = Step(name="chat_data", stage="chat_data", stage_version=1, config=TrainConfig(), run=None)
    sft = sft_step(SFTConfig(train=TrainConfig(lora=LORA)), model=pretrained, tokenizer=step, chat=chat)
    dpo = dpo_step(DPOConfig(train=TrainConfig(lora=second)), model=sft, tokenizer=step, pairs=chat)
    exported = export_step(ExportConfig(lora="adapter"), model=dpo, tokenizer=step)
    assert {n: s.name for n, s in exported.inputs.items()} == {"model": "dpo", "tokenizer": "tokenizer",
                                                               "lora_0": "sft", "base": "train"}
    merged_only = export_step(ExportConfig(), model=dpo, tokenizer=step)
    assert set(merged_only.inputs) == {"model", "tokenizer"}  # the merged export's inputs (and version) as they were
    inputs = {"model": outs["dpo"], "lora_0": outs["sft"], "base": tmp_path / "pretrained",
              "tokenizer": tmp_path / "tokenizer"}
    stats = run_body(exported, tmp_path / "export", inputs)
    assert stats["adapter_steps"] == 2 and stats["adapter_base"]
    saved = json.loads((tmp_path / "export" / "adapter" / "adapter_config.json").read_text())
    assert (saved["r"], saved["rank_pattern"]) == (2, {"down_proj": 4, "q_proj": 6, "v_proj": 4})

    ids = np.random.default_rng(2).integers(0, model.vocab_size, size=(2, 40)).astype(np.int32)
    expected = np.asarray(forward(trained, ids, model))

    def logits(m):
        return torch_logits((torch, transformers), m, ids)

    def rel(got):
        return np.abs(got - expected).max() / np.abs(expected).max()

    base_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "base").eval()
    start_logits = np.asarray(forward(jax.device_put(start), ids, model))
    assert np.abs(logits(base_model) - start_logits).max() / np.abs(start_logits).max() < 1e-4  # base/ is the start
    assert rel(logits(base_model)) > 1e-3  # the adapters change the logits
    assert rel(logits(peft.PeftModel.from_pretrained(base_model, tmp_path / "export" / "adapter").eval())) < 1e-4
    # the DPO step's adapters alone (what the export wrote before) miss SFT's update
    export_adapter(model, [(second, load_file(str(outs["dpo"] / LORA_DIR / "adapters.safetensors")))],
                   tmp_path / "dpo-only")
    base_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "base").eval()
    assert rel(logits(peft.PeftModel.from_pretrained(base_model, tmp_path / "dpo-only").eval())) > 1e-3



def adapter_export_of(config: str, **sections) -> dict:
    """A shipped config with `export.lora: adapter` and `sections` merged in."""
    import yaml

    from flows.experiment import deep_merge
    from tests.conftest import REPO

    raw = yaml.safe_load((REPO / "configs" / f"{config}.yaml").read_text())
    return deep_merge({**raw, "export": {"lora": "adapter"}}, sections)


@pytest.mark.parametrize("config,said", [
    ("tiny_cpu", "the final model's training, train, has no LoRA: set train.lora"),
    ("soup_cpu", "the final model is the soup phases.soup"),  # whatever its parts trained
    ("posttrain_cpu", "the final model's training, posttrain.dpo.train, has no LoRA: set posttrain.dpo.train.lora")])
def test_an_adapter_export_of_a_final_model_without_adapters_is_refused_when_the_config_is_read(config, said):
    """Said when the config is read, not by the export step after every other step has run."""
    from pydantic import ValidationError

    from flows.config import ExperimentConfig

    with pytest.raises(ValidationError, match=said.replace(".", r"\.")):
        ExperimentConfig.model_validate(adapter_export_of(config))


# LoRA on the pretrained model: a phase that starts from the pretraining's weights
LORA_PHASE = {"lora": {"steps": 40, "mode": "weights", "train": {"lora": {"rank": 4}}}}


@pytest.mark.parametrize("config,sections", [
    ("tiny_cpu", {"phases": LORA_PHASE}),
    ("tiny_cpu", {"phases": {**LORA_PHASE, "more": {"steps": 10}}}),  # inherited by the continuing phase
    ("posttrain_cpu", {"posttrain": {"dpo": {"train": {"lora": {"rank": 4}}}}})])
def test_an_adapter_export_of_a_final_model_trained_with_lora_is_accepted(config, sections):
    from flows.config import ExperimentConfig
    from flows.experiment import from_config

    from_config(ExperimentConfig.model_validate(adapter_export_of(config, **sections)))


@pytest.mark.parametrize("sections", [{"train": {"lora": {"rank": 4}}},
                                      {"train": {"lora": {"rank": 4}}, "phases": {"more": {"steps": 10}}}])
def test_an_adapter_export_of_lora_trained_on_a_random_initialisation_is_refused_before_anything_runs(tmp_path,
                                                                                                     sections):
    """Adapters trained on a random initialisation load onto a base model that no export holds:
    refused when the plan is made (`kiln plan`, `kiln run`), from a YAML config or a Python
    experiment, naming the step to start from a model. Before, the export wrote them, and no
    base to use them with."""
    import yaml

    from flows.config import ConfigError, ExperimentConfig
    from flows.experiment import from_config, load_experiment

    said = (r"export\.lora: adapter: train trains its LoRA adapters on a random initialisation .* "
            r"start train from a model")
    raw = adapter_export_of("tiny_cpu", **sections)
    with pytest.raises(ConfigError, match=rf"^x\.yaml: {said}"):
        from_config(ExperimentConfig.model_validate(raw), "x.yaml")
    python = tmp_path / "random_lora.py"
    python.write_text("from flows.config import ExperimentConfig\nfrom flows.plan import recipe\n\n"
                      f"def experiment():\n    return recipe(ExperimentConfig.model_validate({raw!r}))\n")
    with pytest.raises(ConfigError, match=rf"random_lora\.py: experiment\(\) failed: {said}"):
        load_experiment(python)
    (tmp_path / "merged.yaml").write_text(yaml.safe_dump({**raw, "export": {"lora": "merged"}}))
    load_experiment(tmp_path / "merged.yaml")  # the merged export of the same training is fine


@pytest.mark.parametrize("config,sections,lora_steps,base", [
    # SFT then DPO, each with LoRA: one adapter of both over the pretrained model
    ("posttrain_cpu", {"posttrain": {"sft": {"train": {"lora": {"rank": 4}}}, "dpo": {"train": {"lora": {"rank": 2}}}}},
     ["sft"], "train"),
    # DPO alone with LoRA: its adapters over the SFT model, exported as the base
    ("posttrain_cpu", {"posttrain": {"dpo": {"train": {"lora": {"rank": 2}}}}}, [], "sft"),
    # a continue phase carries the adapters on: its own are the whole update, over the pretraining
    ("tiny_cpu", {"phases": {**LORA_PHASE, "more": {"steps": 10}}}, [], "train"),
    # a weights phase trains new adapters on the merged model: both, over the pretraining
    ("tiny_cpu", {"phases": {**LORA_PHASE, "more": {"steps": 80, "mode": "weights"}}}, ["train/lora"], "train")])
def test_the_adapter_export_takes_the_lora_steps_under_the_final_model_and_their_base(config, sections,
                                                                                   lora_steps, base):
    from flows.config import ExperimentConfig
    from flows.experiment import from_config

    steps = {s.name: s for s in from_config(ExperimentConfig.model_validate(adapter_export_of(config,
                                                                                              **sections))).steps}
    inputs = steps["export"].inputs
    assert [inputs[f"lora_{i}"].name for i in range(len(lora_steps))] == lora_steps
    assert sum(name.startswith("lora_") for name in inputs) == len(lora_steps)
    assert (inputs["base"].name if "base" in inputs else None) == base
