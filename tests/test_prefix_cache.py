"""`kiln serve-model`'s prefix cache (evaluation/prefix_cache.py) on small random models: a prompt
that starts as earlier ones did prefills only its rest over their cached blocks, and draws what
it draws without the cache (plain, sliding-window and LongRoPE shapes, prompts admitted alone and
beside others, with and without cached blocks in one batch); LongRoPE's blocks are not shared
across its two frequency sets; the least recently used blocks go first, a prefix's tail before
its head; a failed admission forgets the pool."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, models

from evaluation.generate import Model, Request, sample_batch
from evaluation.prefix_cache import BLOCK, PrefixCache, default_prefix_tokens
from evaluation.server import Job, Scheduler
from training.config import ModelConfig
from training.model import init_params

CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, seq_len=256)
SHAPES = {
    "plain": {},
    "sliding": {"sliding_window": 5, "layer_types": ("sliding_attention", "full_attention")},
    # positions from 100 on switch a prompt to the long factors
    "longrope": {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [3.0] * 8,
                                  "original_max_position_embeddings": 100, "factor": 2.56}},
}


def tiny_model(cfg: ModelConfig) -> Model:
    return Model(cfg, init_params(cfg, jax.random.PRNGKey(0)), Tokenizer(models.WordLevel({"a": 0}, unk_token="a")),
                 eos_id=1)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_prompt_prefills_only_what_follows_the_cached_blocks(shape):
    model = tiny_model(ModelConfig(**{**CFG.model_dump(), **SHAPES[shape]}))
    rng = np.random.default_rng(0)
    shared = rng.integers(2, 64, 100).tolist()
    groups = [[shared + rng.integers(2, 64, 7).tolist()],  # alone: leaves its 3 whole blocks
              # together: each reuses those 3 (a prompt always prefills its last token), and leaves its own
              [shared + rng.integers(2, 64, k).tolist() for k in (3, 40, 70)],
              # one without a cached block beside one with: 64 tokens of 65 cached, on the short side
              [rng.integers(2, 64, 20).tolist(), shared[:64] + [5]]]
    seen, found = [], []
    scheduler = Scheduler(model, max_batch=4, on_prefix=lambda tokens, cached: seen.append((tokens, cached)))
    try:
        for i, group in enumerate(groups):
            # the second group draws at random, and penalises every token of its prompts, the cached ones too
            jobs = [Job(Request(p, 6, 1.0 if i == 1 else 0.0, seed=j, stop_ids=(),
                                repetition_penalty=2.0 if i == 1 else 1.0), top_logprobs=0)
                    for j, p in enumerate(group)]
            results = [f.result(300) for f in [scheduler.submit(job) for job in jobs]]
            found += [result.cached_tokens for result in results]  # what each answer's usage reports
            for job, result in zip(jobs, results):
                (alone,) = sample_batch(model, [job.row], top_logprobs=0)
                assert result.sampled.ids == alone.ids
                np.testing.assert_allclose(result.sampled.logprobs, alone.logprobs, atol=2e-5)
    finally:
        scheduler.close()
    # LongRoPE: every prompt but the last reaches position 100 (the long factors), so the last finds none
    assert seen == [(107, 0), (413, 3 * 3 * BLOCK), (85, 0 if shape == "longrope" else 2 * BLOCK)]
    assert found == [0, *[3 * BLOCK] * 3, 0, 0 if shape == "longrope" else 2 * BLOCK]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_an_answers_blocks_are_kept_for_the_next_turn(shape):
    """A conversation's next turn sends the answer back in its prompt: the whole blocks of the
    first prompt and its answer (all but the last token drawn, which was never fed back) are
    found, and the second answer draws what it draws without the cache. Sliding-window layers
    hold rings, not every column, so only the first prompt's block is kept there; LongRoPE's
    second prompt reaches its long factors, which no earlier block was computed with."""
    model = tiny_model(ModelConfig(**{**CFG.model_dump(), **SHAPES[shape]}))
    rng = np.random.default_rng(1)
    first = rng.integers(2, 64, 40).tolist()
    seen = []
    scheduler = Scheduler(model, max_batch=2, on_prefix=lambda tokens, cached: seen.append((tokens, cached)))
    try:
        answer = scheduler.submit(Job(Request(first, 56, 1.0, seed=3, stop_ids=()))).result(300).sampled.ids
        # 116 tokens, of which the first 95 were fed to the model before (its 96th, the answer's
        # last token, was drawn and never fed back): two whole blocks, the second half answer
        again = first + answer + rng.integers(2, 64, 20).tolist()
        job = Job(Request(again, 6, 1.0, seed=4, stop_ids=()), top_logprobs=0)
        result = scheduler.submit(job).result(300)
    finally:
        scheduler.close()
    (alone,) = sample_batch(model, [job.row], top_logprobs=0)
    assert result.sampled.ids == alone.ids
    np.testing.assert_allclose(result.sampled.logprobs, alone.logprobs, atol=2e-5)
    expected = {"plain": 2 * BLOCK, "sliding": BLOCK, "longrope": 0}[shape]
    assert seen == [(40, 0), (116, expected)] and result.cached_tokens == expected


def test_prompts_that_share_a_new_prefix_prefill_it_once():
    """A burst of questions after one new context (lm-eval's batch of prompts): one of them is
    admitted first and leaves the context's blocks, the others find them; two groups sharing two
    contexts, each once; the answers are those drawn without the cache."""
    model = tiny_model(CFG)
    rng = np.random.default_rng(2)
    context, other = rng.integers(2, 64, 100).tolist(), rng.integers(2, 64, 70).tolist()
    prompts = [context + rng.integers(2, 64, k).tolist() for k in (5, 9, 30)]
    prompts += [other + rng.integers(2, 64, k).tolist() for k in (4, 8)] + [rng.integers(2, 64, 12).tolist()]
    seen = []
    scheduler = Scheduler(model, max_batch=8, window_s=5,  # the six are admitted together
                          on_prefix=lambda tokens, cached: seen.append((tokens, cached)))
    try:
        jobs = [Job(Request(p, 4, 1.0, seed=i, stop_ids=()), top_logprobs=0) for i, p in enumerate(prompts)]
        results = [f.result(300) for f in [scheduler.submit(job) for job in jobs]]
    finally:
        scheduler.close()
    for job, result in zip(jobs, results):
        (alone,) = sample_batch(model, [job.row], top_logprobs=0)
        assert result.sampled.ids == alone.ids
        np.testing.assert_allclose(result.sampled.logprobs, alone.logprobs, atol=2e-5)
    # the first of each group alone, then the rest: 3 and 2 blocks found by each of the others
    assert seen == [(105, 0), (74, 0), (109 + 130 + 78 + 12, 2 * 3 * BLOCK + 2 * BLOCK)]
    assert [r.cached_tokens for r in results] == [0, 3 * BLOCK, 3 * BLOCK, 0, 2 * BLOCK, 0]


def test_the_least_recently_used_blocks_go_first_a_prefixs_tail_before_its_head():
    cache = PrefixCache(CFG, 4 * BLOCK + BLOCK - 1)  # four blocks
    a, b = list(range(2, 2 + 5 * BLOCK)), [7] * (2 * BLOCK + 1)
    plan = cache.plan([a])
    assert plan.done.tolist() == [0] and plan.read is None
    assert sorted(plan.write[0, :4].tolist()) == [0, 1, 2, 3]  # the fifth block finds no room: the plan holds all four
    assert cache.plan([a]).done.tolist() == [4 * BLOCK]
    tail = [cache.where[name] for name in cache.names(a)[2:4]]
    plan = cache.plan([b])  # its two blocks take the rows of a's last two
    assert sorted(plan.write[0, :2].tolist()) == sorted(tail)
    assert cache.plan([a]).done.tolist() == [2 * BLOCK]  # a's head is still there; its tail takes b's rows back,
    assert cache.plan([b + [9]]).done.tolist() == [0]  # b being the least recently used
    cache.forget()
    assert cache.plan([a]).done.tolist() == [0] and cache.pool is not None
    # by default as many tokens as the slots' contexts; none where no prompt could reuse a block
    assert default_prefix_tokens(CFG, 8) == 8 * 256
    assert default_prefix_tokens(CFG.model_copy(update={"seq_len": BLOCK + 1}), 8) == 0


def test_a_failed_admission_forgets_the_cached_blocks():
    """An admission that fails (a seed that is no integer) may have taken the pool with it: every
    block is forgotten, its prompt is answered alone, and later prompts fill the cache again."""
    model = tiny_model(CFG)
    prompt = list(range(2, 2 + 2 * BLOCK + 5))
    seen = []
    scheduler = Scheduler(model, max_batch=2, on_prefix=lambda tokens, cached: seen.append((tokens, cached)))
    try:
        scheduler.submit(Job(Request(prompt, 3, 0.0, stop_ids=()))).result(120)
        assert len(scheduler.prefixes.where) == 2
        bad = scheduler.submit(Job(Request(prompt + [3], 3, 1.0, seed="x", stop_ids=())))
        with pytest.raises(Exception):
            bad.result(120)
        assert not scheduler.prefixes.where and scheduler.prefixes.pool is None
        scheduler.submit(Job(Request(prompt, 3, 0.0, stop_ids=()))).result(120)
        scheduler.submit(Job(Request(prompt + [4], 3, 0.0, stop_ids=()))).result(120)
    finally:
        scheduler.close()
    assert seen[0] == (len(prompt), 0) and seen[-2:] == [(len(prompt), 0), (len(prompt) + 1, 2 * BLOCK)]
