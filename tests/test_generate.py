"""`kiln generate` on a tiny model trained here for a few steps: the same seed gives the same text
(in this process and in a fresh `kiln generate` process), temperature 0 is greedy argmax
decoding (checked against full forward passes without a cache), and an export folder samples
what its training output samples."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from evaluation.generate import generate, load, sample
from tasks.documents import ShardWriter
from tasks.engine.step import Step
from tasks.tokenize import TokenizeConfig
from tasks.tokenizer import TokenizerConfig, tokenizer_step
from tests.conftest import kiln
from tests.test_training_kjv_data import kjv_text
from tests.test_training_task import context
from training.config import ModelConfig, TrainConfig
from training.export import export_hf
from training.loop import train
from training.model import forward
from training.chat_template import CHAT_SPECIAL_TOKENS

PROMPT = "And God said"


def write_lineage(folder: Path, stage: str, inputs: list[tuple[str, str]]) -> None:
    record = {"stage": stage, "name": stage, "version": folder.name, "stats": {},
              "inputs": [{"name": s, "stage": s, "version": v, "path": f"{s}/{v}"} for s, v in inputs]}
    (folder / "lineage.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """store/tokenizer/t0 (a 400-token BPE with the chat tokens), store/tokenize/k0 and
    store/train/m0 (a 2-layer model trained 40 steps on KJV text), linked by lineage.json."""
    root = tmp_path_factory.mktemp("store")
    text = kjv_text(100_000)
    lines = text.strip().splitlines()
    with ShardWriter(root / "docs", docs_per_shard=500) as w:
        for i in range(0, len(lines), 5):
            w.write({"id": f"kjv-{i}", "text": "\n".join(lines[i:i + 5]), "source": "kjv", "metadata": {}})
    docs = Step(name="docs", stage="docs", stage_version=1, config=TokenizeConfig(), run=lambda ctx: {})
    step = tokenizer_step(TokenizerConfig(kind="bpe", vocab_size=400, special_tokens=["<|endoftext|>", *CHAT_SPECIAL_TOKENS]),
                          documents=docs)
    step.run(context(step, root / "tokenizer" / "t0", {"documents": root / "docs"}, root / "w"))
    write_lineage(root / "tokenizer" / "t0", "tokenizer", [])
    (root / "tokenize" / "k0").mkdir(parents=True)
    write_lineage(root / "tokenize" / "k0", "tokenize", [("tokenizer", "t0")])

    from tasks.tokenizer import load_tokenizer

    tok = load_tokenizer(root / "tokenizer" / "t0")
    tokens = np.array(tok.encode(text).ids, np.int32)
    model = ModelConfig(vocab_size=tok.get_vocab_size(), d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                        seq_len=64)
    cfg = TrainConfig(batch_size=8, steps=40, lr=1e-2, warmup=4, log_every=20, eval_every=40, checkpoint_every=40,
                      peak_flops=1e11)
    rows = len(tokens) // (model.seq_len + 1)
    windows = tokens[:rows * (model.seq_len + 1)].reshape(rows, -1)
    batch_at = lambda step: windows[np.random.default_rng(step).choice(rows, cfg.batch_size)]  # noqa: E731
    train(model, cfg, batch_at, [], root / ".work" / "m0", root / "train" / "m0")
    write_lineage(root / "train" / "m0", "train", [("tokenize", "k0")])
    return root


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Argmax decoding by full forward passes over the whole sequence, no cache at all (one
    compiled shape: the sequence padded on the right, which causal attention never sees)."""
    fwd = jax.jit(forward, static_argnums=2)
    ids = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, model.cfg.seq_len), np.int32)
        padded[0, :len(ids)] = ids
        ids.append(int(jnp.argmax(fwd(model.params, jnp.asarray(padded), model.cfg)[0, len(ids) - 1])))
    return ids[len(prompt):]


def test_same_seed_same_text_and_temperature_zero_is_greedy(store):
    model = load(store / "train" / "m0")  # the tokenizer found through lineage: train -> tokenize -> tokenizer
    first = generate(model, PROMPT, max_tokens=24, temperature=1.0, top_p=0.9, seed=3)
    assert first and generate(model, PROMPT, max_tokens=24, temperature=1.0, top_p=0.9, seed=3) == first
    others = {generate(model, PROMPT, max_tokens=24, temperature=1.0, top_p=0.9, seed=s) for s in range(4, 8)}
    assert others - {first}, "other seeds should give other text"

    prompt = [model.eos_id, *model.tokenizer.encode(PROMPT).ids]
    greedy = sample(model, prompt, 24, temperature=0.0)
    reference = greedy_reference(model, prompt, 24)
    assert greedy == reference[:len(greedy)] and (len(greedy) == 24 or reference[len(greedy)] == model.eos_id)
    assert len(greedy) > 4
    assert sample(model, prompt, 24, temperature=0.0, seed=99) == greedy  # no randomness at all
    # top_p so small that only the most likely token survives: sampling is greedy too
    assert sample(model, prompt, 24, temperature=1.0, top_p=1e-6, seed=5) == greedy


def test_kiln_generate_command_and_export_agree(store, tmp_path):
    model = load(store / "train" / "m0")
    expected = generate(model, PROMPT, max_tokens=24, temperature=0.8, top_p=0.95, seed=11)
    out = kiln("generate", str(store / "train" / "m0"), "--prompt", PROMPT, "--max-tokens", "24",
               "--temperature", "0.8", "--top-p", "0.95", "--seed", "11")
    assert out.stdout == expected + "\n"  # another process, the same text
    greedy = kiln("generate", str(store / "train" / "m0"), "--prompt", PROMPT, "--max-tokens", "24",
                  "--temperature", "1.0", "--top-k", "1", "--seed", "11")
    assert greedy.stdout == generate(model, PROMPT, max_tokens=24, temperature=0.0) + "\n"  # one token left to draw
    with pytest.raises(ValueError, match=r"min_p=2.0 in \[0, 1\]"):
        generate(model, PROMPT, max_tokens=4, min_p=2.0)

    tokenizer = store / "tokenizer" / "t0"
    meta = json.loads((tokenizer / "tokenizer_meta.json").read_text())
    export_hf(model.cfg, model.params, (tokenizer / "tokenizer.json").read_text(), meta, tmp_path)
    exported = load(tmp_path)
    assert exported.cfg.model_dump() == model.cfg.model_dump()
    assert generate(exported, PROMPT, max_tokens=24, temperature=0.8, top_p=0.95, seed=11) == expected

    chat = generate(model, "Who made the light?", max_tokens=24, temperature=0.0, chat=True)
    from training.chat_template import ChatTemplate

    ids, _ = ChatTemplate(model.tokenizer).encode([{"role": "user", "content": "Who made the light?"}], True)
    end = model.tokenizer.token_to_id("<|end|>")
    assert chat == model.tokenizer.decode(sample(model, [model.eos_id, *ids], 24, 0.0, stop_ids=(end,)),
                                          skip_special_tokens=False)

    bad = kiln("generate", str(tmp_path / "nothing"), "--prompt", "x", check=False)
    assert bad.returncode == 2 and "neither a training output" in bad.stderr


def test_a_bfloat16_model_holds_its_weights_in_bfloat16_and_gives_the_same_bits(store, tmp_path):
    """`load` casts the weights once to the dtype the model computes in: the same logits and text,
    bit for bit, as float32 weights that the model casts at each use, in half the bytes."""
    folder = tmp_path / "m0-bf16"
    shutil.copytree(store / "train" / "m0", folder)
    config = json.loads((folder / "model.json").read_text())
    # fields added after versions were in use are left out at their defaults: older kilns read it
    assert "rope_scaling" not in config and "attention_bias" not in config and config["d_model"] == 32
    (folder / "model.json").write_text(json.dumps({**config, "compute_dtype": "bfloat16"}))
    model = load(folder, store / "tokenizer" / "t0")
    as_stored = load(store / "train" / "m0")  # float32, the model's own casts at each use
    assert model.cfg.compute_dtype == "bfloat16" and as_stored.cfg.compute_dtype == "float32"
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(model.params)} == {jnp.dtype(jnp.bfloat16)}
    nbytes = lambda m: sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(m.params))  # noqa: E731
    assert 2 * nbytes(model) == nbytes(as_stored)

    unheld = dataclasses.replace(as_stored, cfg=model.cfg)  # float32 weights, bfloat16 compute
    tokens = jnp.asarray([[model.eos_id, *model.tokenizer.encode(PROMPT).ids]], jnp.int32)
    fwd = jax.jit(forward, static_argnums=2)
    logits = fwd(model.params, tokens, model.cfg)
    assert np.array_equal(logits, fwd(unheld.params, tokens, model.cfg))
    assert not np.array_equal(logits, fwd(as_stored.params, tokens, as_stored.cfg))  # bfloat16 is not float32
    text = generate(model, PROMPT, max_tokens=24, temperature=0.8, top_p=0.95, seed=11)
    assert text and text == generate(unheld, PROMPT, max_tokens=24, temperature=0.8, top_p=0.95, seed=11)

    chosen = load(store / "train" / "m0", dtype="bfloat16", max_model_len=32)  # `--dtype`, `--max-model-len`
    assert (chosen.cfg.compute_dtype, chosen.cfg.seq_len) == ("bfloat16", 32)
    assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(np.array_equal, chosen.params, model.params)))
    with pytest.raises(ValueError, match="the model's context of 64 tokens"):
        load(store / "train" / "m0", max_model_len=65)


def test_a_streamed_row_gets_its_tokens_from_inside_the_decoding_loop():
    """`Request.stream` gets each new token of its row, in order, as the compiled loop draws it (a
    host callback in the while loop's body), not the stop token, nothing after the row ends;
    the rows' tokens are those of the same batch without streaming, and with log-probabilities
    asked for, each token comes with the log-probability and alternatives `Sampled` holds."""
    from evaluation.generate import Model, Request, _decode_rows, sample_batch
    from training.model import init_params

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, seq_len=64)
    model = Model(cfg, init_params(cfg, jax.random.PRNGKey(0)), None, eos_id=5)
    rows = [Request([1, 2, 3], 24, 1.0, 1.0, seed, (5, 9)) for seed in range(6)] + [Request([4], 40, 0.0, 1.0, 0, (5,))]
    plain = sample_batch(model, rows)
    assert any(r.stopped for r in plain) and any(not r.stopped for r in plain)  # both ends are checked
    got: dict[int, list] = {b: [] for b in range(len(rows))}
    streaming = [Request(r.prompt, r.max_tokens, r.temperature, r.top_p, r.seed, r.stop_ids,
                         lambda i, t, lp, top, b=b: got[b].append((i, t, lp, top))) for b, r in enumerate(rows)]
    for b, (streamed, alone) in enumerate(zip(sample_batch(model, streaming), plain, strict=True)):
        assert streamed.ids == alone.ids
        assert got[b] == [(i, t, None, []) for i, t in enumerate(alone.ids)]

    for b in got:
        got[b].clear()
    scored = sample_batch(model, rows, top_logprobs=3)
    assert [s.ids for s in sample_batch(model, streaming, top_logprobs=3)] == [s.ids for s in plain]
    for b, alone in enumerate(scored):
        assert got[b] == [(i, t, lp, top) for i, (t, lp, top) in enumerate(zip(alone.ids, alone.logprobs, alone.top))]
        assert all(len(top) == 3 and lp <= top[0][1] for _, _, lp, top in got[b])

    rule = {"temperature": np.ones(1, np.float32), "top_p": np.ones(1, np.float32), "top_k": np.zeros(1, np.int32),
            "min_p": np.zeros(1, np.float32), "max_new": np.full(1, 8, np.int32)}
    args = (model.params, np.ones((1, 4), np.int32), np.arange(4)[None].astype(np.int32), np.zeros((1, 2), np.uint32),
            rule, np.full((1, 4), 5, np.int32), None, None, None, np.int32(0))
    for stream in (True, False):
        jaxpr = jax.make_jaxpr(lambda *a: _decode_rows(*a, cfg=cfg, cache_len=16, alternatives=None,
                                                       stream=stream))(*args)
        loops = [e for e in jaxpr.jaxpr.eqns[0].params["jaxpr"].jaxpr.eqns if e.primitive.name == "while"]
        body = str(loops[0].params["body_jaxpr"])
        assert ("io_callback" in body) == stream


def test_streamed_text_never_splits_a_character_or_runs_past_a_stop_string():
    """TextStream's pieces: a token that ends between the bytes of a character waits for the rest
    of it; a tail that could begin a stop string waits until it cannot; the pieces add up to the
    whole text (without stops) or to the text before the first stop (through it, with `include`)."""
    from evaluation.generate import TextStream, stop_end
    from tasks.tokenizer import build_gpt2

    tok = build_gpt2(("<|endoftext|>",))
    text = "Light 😀 and dark: the end. Light again"
    ids = tok.encode(text).ids
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # the emoji's bytes span several tokens

    def pieces(stops: list[str], include: bool = False) -> list[str]:
        stream = TextStream(lambda some: tok.decode(some), stops, include)
        out = [stream.push(i, t) for i, t in enumerate(ids)]
        whole = tok.decode(ids)
        cut = stop_end(whole, stops, include)
        return out + [stream.rest(whole[:cut])]

    plain = pieces([])
    assert "".join(plain) == text and not any("\ufffd" in p for p in plain)
    assert sum(bool(p) for p in plain) > 5  # it does come in pieces
    stopped = pieces(["the end", "dark!"])
    assert "".join(stopped) == "Light 😀 and dark: "
    sent = ""
    for piece in stopped[:-1]:  # before the end, nothing past a place where a stop could still begin
        sent += piece
        assert not sent.endswith("dark") and "the end" not in sent
    assert "".join(pieces(["the end", "dark!"], include=True)) == "Light 😀 and dark: the end"
    assert "".join(pieces(["end. L", "the"], include=True)) == "Light 😀 and dark: the"  # the first to begin
    assert stop_end(text, ["nothing"]) is None and stop_end(text, ["dark", "and"]) == text.find("and")


def test_logit_bias_and_penalties_change_the_draws_as_openai_defines_them():
    """Greedy rows with a logit bias, a presence, a frequency or a repetition penalty get the
    tokens of a plain loop that adjusts the full forward pass's last logits the same way, in
    vLLM's order (bias added; the logit of a token of the prompt or drawn before divided by the
    repetition penalty where positive, multiplied where negative; presence subtracted once a
    token was drawn, frequency per time it was); a plain row in the same batch gets its
    unadjusted tokens, and log-probabilities stay the model's own."""
    from evaluation.generate import Model, Request, sample_batch
    from training.model import init_params

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, seq_len=64,
                      init_std=0.1)
    params = init_params(cfg, jax.random.PRNGKey(1))
    model = Model(cfg, params, None, eos_id=63)
    prompt = [1, 2, 3, 4]

    last_logits = jax.jit(lambda tokens, at: forward(params, tokens, cfg)[0, at])  # causal: padding after is unseen

    def reference(new: int, bias: dict, presence: float, frequency: float, repetition: float = 1.0) -> list[int]:
        seq, counts = list(prompt), np.zeros(cfg.vocab_size)
        for _ in range(new):
            padded = np.zeros((1, len(prompt) + new), np.int32)
            padded[0, :len(seq)] = seq
            logits = np.asarray(last_logits(padded, len(seq) - 1)).astype(np.float64)
            for t, v in bias.items():
                logits[t] += v
            for t in set(seq):
                logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
            token = int(np.argmax(logits - presence * (counts > 0) - frequency * counts))
            counts[token] += 1
            seq.append(token)
        return seq[len(prompt):]

    plain = reference(16, {}, 0, 0)
    assert len(set(plain)) < 12  # it repeats itself, so the penalties have something to change
    cases = [({}, 0.0, 0.0, 1.0), ({plain[0]: -100.0}, 0.0, 0.0, 1.0), ({7: 5.0}, 0.0, 0.0, 1.0),
             ({}, 2.0, 0.0, 1.0), ({}, 0.0, 1.5, 1.0), ({7: 3.0}, 0.5, 0.8, 1.0), ({}, 0.0, 0.0, 1.8),
             ({7: 3.0}, 0.0, 0.5, 1.4)]
    rows = [Request(prompt, 16, 0.0, 1.0, 0, (), None, tuple(bias.items()), presence, frequency,
                    repetition_penalty=repetition) for bias, presence, frequency, repetition in cases]
    got = sample_batch(model, rows, top_logprobs=0)
    alone = sample_batch(model, rows[:1], top_logprobs=0)[0]
    assert got[0].ids == alone.ids == plain
    assert sample_batch(model, rows[-2:-1])[0].ids == got[-2].ids  # the repetition penalty alone runs the same
    for case, row in zip(cases, got):
        assert row.ids == reference(16, *case), case
    assert all(r.ids != plain for r in got[1:])  # each adjustment changed something
    forced = sample_batch(model, [Request(prompt, 4, 0.0, 1.0, 0, (), None, ((7, 100.0),))], top_logprobs=0)[0]
    assert forced.ids == [7] * 4
    assert max(forced.logprobs) < -0.5  # the model's own log-probability of a token it does not favour


def test_top_k_and_min_p_cut_as_the_samplers_of_hugging_face_and_vllm_cut():
    """`_truncate` keeps what a plain float64 reference keeps: the top_k most likely tokens, then
    the top-p nucleus of those renormalised, then those at least min_p times as likely as the
    most likely; in sample_batch every drawn token lies inside its row's cut (read off the
    model's own top alternatives), top_k 1 and min_p 1 are greedy, and a row draws the same
    alone as in a batch of other settings."""
    from evaluation.generate import Model, Request, _truncate, sample_batch
    from training.model import init_params

    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (6, 40)).astype(np.float32)
    rules = [(1.0, 0, 0.0), (0.7, 0, 0.0), (1.0, 5, 0.0), (0.6, 8, 0.0), (1.0, 0, 0.2), (0.9, 12, 0.05)]
    top_p, top_k, min_p = (np.array(c, dtype) for c, dtype in zip(zip(*rules), (np.float32, np.int32, np.float32)))
    kept = np.isfinite(np.asarray(_truncate(jnp.asarray(logits), top_p, top_k, min_p)))
    for b, (p, k, m) in enumerate(rules):
        probs = np.exp(logits[b].astype(np.float64) - logits[b].max())
        probs /= probs.sum()
        order = np.argsort(-probs)
        allowed = set(order[:k] if k else order)
        mass, nucleus = sum(probs[t] for t in allowed), set()
        for t in order:
            if t in allowed and (p >= 1 or sum(probs[u] for u in nucleus) / mass < p):
                nucleus.add(t)
        want = {t for t in nucleus if probs[t] >= m * probs.max()}
        assert set(np.flatnonzero(kept[b])) == want, (p, k, m)
    assert kept.sum(axis=1).tolist()[0] == 40 and all(kept[b].sum() < 40 for b in range(1, 6))

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, seq_len=64,
                      init_std=0.1)
    model = Model(cfg, init_params(cfg, jax.random.PRNGKey(2)), None, eos_id=63)
    greedy = sample_batch(model, [Request([1, 2, 3], 24, 0.0)])[0].ids
    assert sample_batch(model, [Request([1, 2, 3], 24, 1.0, seed=4, top_k=1)])[0].ids == greedy
    assert sample_batch(model, [Request([1, 2, 3], 24, 1.0, seed=4, min_p=1.0)])[0].ids == greedy
    rows = [Request([1, 2, 3], 24, 1.0, 1.0, seed) for seed in range(4)]
    rows += [Request([1, 2, 3], 24, 1.0, 1.0, seed, top_k=3) for seed in range(4)]
    rows += [Request([1, 2, 3], 24, 1.0, 1.0, seed, min_p=0.3) for seed in range(4)]
    got = sample_batch(model, rows, top_logprobs=20)
    free, by_top_k, by_min_p = got[:4], got[4:8], got[8:]

    def ranks(row) -> list[int]:  # each drawn token's rank among the model's 20 most likely at its step (20: below)
        return [next((r for r, (t, _) in enumerate(top) if t == token), 20) for token, top in zip(row.ids, row.top)]

    def ratios(row) -> list[float]:  # each drawn token's probability over the most likely one's
        return [float(np.exp(lp - top[0][1])) for lp, top in zip(row.logprobs, row.top)]

    assert max(r for row in free for r in ranks(row)) >= 3  # the free rows draw where the cuts would not
    assert min(x for row in free for x in ratios(row)) < 0.3
    assert all(r < 3 for row in by_top_k for r in ranks(row)) and any(r > 0 for row in by_top_k for r in ranks(row))
    assert all(x >= 0.3 - 1e-5 for row in by_min_p for x in ratios(row))
    assert any(x < 1 for row in by_min_p for x in ratios(row))
    for row, batched in zip(rows[4:], got[4:]):
        assert sample_batch(model, [row])[0].ids == batched.ids


def test_min_tokens_holds_the_stop_ids_back():
    """A greedy row whose first token is its stop id ends at once; with min_tokens 3 that id is
    never drawn before the third token, and with min_tokens = max_tokens never at all; other
    rows of the batch are untouched."""
    from evaluation.generate import Model, Request, sample_batch
    from training.model import init_params

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, seq_len=64,
                      init_std=0.1)
    model = Model(cfg, init_params(cfg, jax.random.PRNGKey(3)), None, eos_id=63)
    greedy = sample_batch(model, [Request([1, 2, 3], 12, 0.0)])[0]
    stop = (greedy.ids[0],)
    at_once = sample_batch(model, [Request([1, 2, 3], 12, 0.0, stop_ids=stop)])[0]
    assert at_once.ids == [] and at_once.stopped
    held, never, other = sample_batch(model, [Request([1, 2, 3], 12, 0.0, stop_ids=stop, min_tokens=3),
                                              Request([1, 2, 3], 12, 0.0, stop_ids=stop, min_tokens=12),
                                              Request([1, 2, 3], 12, 0.0)])
    assert len(held.ids) >= 3 and stop[0] not in held.ids[:3] and held.ids != greedy.ids[:len(held.ids)]
    assert len(never.ids) == 12 and stop[0] not in never.ids and not never.stopped
    assert other.ids == greedy.ids
    with pytest.raises(ValueError, match="min_tokens=13 must be between 0 and max_tokens=12"):
        sample_batch(model, [Request([1, 2, 3], 12, 0.0, min_tokens=13)])
