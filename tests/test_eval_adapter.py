"""The lm-eval adapter and the held-out perplexity against direct computations with the model's
forward pass, one unpadded sequence at a time. A random-init model (large init, so its
predictions are far from uniform) over the BPE tokenizer trained on the KJV."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from lm_eval.api.instance import Instance

from evaluation.adapter import KilnLM
from evaluation.perplexity import heldout_metrics
from evaluation.suite import SuiteConfig, build_suite, task_configs
from tasks.tokenizer import load_tokenizer, read_tokenizer_meta
from tests.test_eval_data import kjv_data  # noqa: F401  (a fixture)
from training.config import ModelConfig
from training.data import TokenDataset
from training.model import forward, init_params

CFG = ModelConfig(vocab_size=1024, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, seq_len=64,
                  init_std=0.15)
_forward = jax.jit(forward, static_argnums=2)


@pytest.fixture(scope="module")
def lm(kjv_data) -> KilnLM:  # noqa: F811
    meta = read_tokenizer_meta(kjv_data.tokenizer)
    assert meta["vocab_size"] == CFG.vocab_size
    params = jax.jit(init_params, static_argnums=0)(CFG, jax.random.PRNGKey(0))
    return KilnLM(CFG, params, load_tokenizer(kjv_data.tokenizer), meta["eos_id"], batch_size=8, max_gen_toks=24)


def last_logits(lm: KilnLM, seq: list[int]) -> np.ndarray:
    """float64 logits [len(seq), V] of one sequence, from one forward pass of fixed length T (so it
    compiles once): the tail is filled with random tokens, which a causal model must ignore."""
    T = lm.cfg.seq_len
    assert len(seq) <= T
    tokens = np.random.default_rng(len(seq)).integers(0, lm.cfg.vocab_size, (1, T)).astype(np.int32)
    tokens[0, :len(seq)] = seq
    return np.asarray(_forward(lm.params, tokens, lm.cfg))[0, :len(seq)].astype(np.float64)


def logprobs(lm: KilnLM, seq: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """log p(seq[t+1] | seq[:t+1]) for every t, from one forward pass; and whether each is the argmax."""
    logits = last_logits(lm, seq[:-1])
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return logits[np.arange(len(seq) - 1), seq[1:]] - logz, logits.argmax(-1) == np.asarray(seq[1:])


def direct_loglikelihood(lm: KilnLM, context: str, continuation: str) -> tuple[float, bool]:
    if context:
        ctx = lm.tok_encode(context.rstrip())
        cont = lm.tok_encode(context.rstrip() + context[len(context.rstrip()):] + continuation)[len(ctx):]
    else:
        ctx, cont = [lm.eos_id], lm.tok_encode(continuation)
    seq = (ctx + cont)[-(lm.cfg.seq_len + 1):]
    lp, greedy = logprobs(lm, seq)
    return float(lp[-len(cont):].sum()), bool(greedy[-len(cont):].all())


@pytest.fixture(scope="module")
def requests(kjv_data, tmp_path_factory) -> list[Instance]:  # noqa: F811
    """A sample of the suite's real requests, as lm-eval builds them (with empty contexts for acc_mutual_info)."""
    from lm_eval.tasks import TaskManager

    out = tmp_path_factory.mktemp("suite")
    build_suite(kjv_data.held_out(), out, ["next_passage", "last_word"], SuiteConfig(context_words=48, choice_words=12))
    tasks = TaskManager(include_defaults=False).load(task_configs(out, ["next_passage", "last_word"]))["tasks"]
    reqs = []
    for task in tasks.values():
        for doc in list(task.test_docs())[:12]:
            made = task.construct_requests(doc, task.doc_to_text(doc), metadata=(task.task_name, 0, 1))
            reqs += made if isinstance(made, list) else [made]
    return reqs


def test_loglikelihood_matches_the_forward_pass(lm, requests):
    assert any(a.args[0] == "" for a in requests) and len(requests) > 100
    assert any(len(lm.tok_encode(r.args[0])) > lm.cfg.seq_len for r in requests)  # some get cut from the left
    got = lm.loglikelihood(requests, disable_tqdm=True)
    _, batches = lm.plan_batches([lm._encode_pair(*r.args) for r in requests if r.args[0]])
    assert any(window < inputs.shape[1] for _, inputs, _, _, window in batches)  # the windowed head ran
    assert len(got) == len(requests)
    for req, (logprob, greedy) in zip(requests, got, strict=True):
        expected, expected_greedy = direct_loglikelihood(lm, *req.args)
        assert logprob == pytest.approx(expected, abs=2e-4, rel=1e-5), req.args
        assert greedy == expected_greedy
    # Batch size, request order and the scored window change nothing; the scorer compiled at most
    # twice per bucket.
    one = KilnLM(lm.cfg, lm.params, lm.tok, lm.eos_id, batch_size=1, score_window=None)  # full rows
    reversed_got = one.loglikelihood(requests[::-1], disable_tqdm=True)[::-1]
    assert len(reversed_got) == len(got)
    assert np.allclose([g[0] for g in got], [r[0] for r in reversed_got], atol=2e-4)
    assert lm.scorer._cache_size() <= 2 * len(lm.buckets)  # a window and a full-row variant per bucket


def test_greedy_continuations_are_found(lm):
    """A continuation the model itself would produce greedily is reported as greedy."""
    context = lm.tok_encode("And God said, Let there be light")
    seq = list(context)
    for _ in range(3):
        seq.append(int(last_logits(lm, seq)[-1].argmax()))
    (logprob, greedy), = lm.score_continuations([(context, seq[len(context):])])
    assert greedy and logprob < 0


def rolling_reference(lm: KilnLM, tokens: list[int]) -> float:
    """lm-eval's rolling windows written out: blocks of T predicted tokens; the first block is
    conditioned on EOS, each full block on the token before it, the last partial block on a full
    window of preceding tokens."""
    T, total, start = lm.cfg.seq_len, 0.0, 0
    while start < len(tokens):
        end = min(start + T, len(tokens))
        if start == 0:
            seq = [lm.eos_id] + tokens[:end]
        else:
            seq = tokens[max(0, end - T - 1):end]
        total += logprobs(lm, seq)[0][-(end - start):].sum()
        start = end
    return total


def test_loglikelihood_rolling_scores_every_token_once(lm, kjv_data):  # noqa: F811
    texts = [d["text"] for d in kjv_data.held_out()[:3]] + ["Jesus wept."]
    assert len(lm.tok_encode(texts[0])) > 5 * lm.cfg.seq_len
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), 0) for t in texts],
                                   disable_tqdm=True)
    assert len(got) == len(texts) and all(isinstance(g, float) for g in got)
    for text, value in zip(texts, got, strict=True):
        assert value == pytest.approx(rolling_reference(lm, lm.tok_encode(text)), rel=1e-5)


def naive_greedy(lm: KilnLM, prompt: list[int], max_gen: int) -> list[int]:
    """Greedy decoding by recomputing the whole sequence every step (no cache, no left padding)."""
    seq = prompt[-(lm.cfg.seq_len - max_gen):]
    out = []
    for _ in range(max_gen):
        nxt = int(last_logits(lm, seq)[-1].argmax())
        if nxt == lm.eos_id:
            break
        out.append(nxt)
        seq.append(nxt)
    return out


def test_generate_until_is_greedy_decoding_with_a_cache(lm, kjv_data):  # noqa: F811
    text = kjv_data.held_out()[0]["text"]
    prompts = [text[:40], text[:400], "In the", text[:120]]  # different lengths: left padding in one batch
    expected = [lm.tok_decode(naive_greedy(lm, lm.tok_encode(p), 24)) for p in prompts]
    # A stop string taken from inside the second continuation: that one must be cut before it.
    stop = expected[1][len(expected[1]) // 2:][:3]
    assert stop and stop in expected[1]
    reqs = [Instance("generate_until", {}, (p, {"until": ["\n\n"] if i != 1 else [stop], "max_gen_toks": 24}), 0)
            for i, p in enumerate(prompts)]
    got = lm.generate_until(reqs, disable_tqdm=True)
    assert got[1] == expected[1].split(stop)[0] and len(got[1]) < len(expected[1])
    for i in (0, 2, 3):
        assert got[i] == expected[i].split("\n\n")[0]
    # Generation settings lm-eval tasks pass; sampling is refused with a message.
    with pytest.raises(ValueError, match="decodes greedily"):
        lm.generate_until([Instance("generate_until", {}, ("x", {"do_sample": True}), 0)])


def test_heldout_perplexity_and_bits_per_byte(lm, kjv_data):  # noqa: F811
    val = TokenDataset(kjv_data.tokens, "validation")
    T = lm.cfg.seq_len
    # Direct: the first three windows of T + 1 tokens, each scored whole in one forward pass.
    part = heldout_metrics(lm.cfg, lm.params, val, lm.tok, batch_size=2, max_tokens=3 * T + 1)
    nats = -sum(logprobs(lm, val.tokens(s, s + T + 1).astype(int).tolist())[0].sum() for s in (0, T, 2 * T))
    assert part["tokens"] == 3 * T
    assert part["loss"] == pytest.approx(nats / (3 * T), rel=1e-5)
    assert part["perplexity"] == pytest.approx(math.exp(nats / (3 * T)), rel=1e-5)
    # The whole split: every text byte but the first token's is counted exactly once.
    full = heldout_metrics(lm.cfg, lm.params, val, lm.tok, batch_size=16, score=lm.scorer)
    first = len(lm.tok_decode([int(val.tokens(0, 1)[0])]).encode())
    assert full["tokens"] == val.n_tokens - 1
    assert full["bytes"] == val.n_bytes - first
    assert full["text_tokens"] == val.n_tokens - 1 - val.n_documents  # EOS after each document excluded
    # A random model is about as bad as uniform over the vocabulary, no better.
    assert full["loss"] > 0.8 * math.log(lm.cfg.vocab_size)
    assert full["bits_per_byte"] == pytest.approx(full["loss"] * full["tokens"] / math.log(2) / full["bytes"], rel=0.1)
