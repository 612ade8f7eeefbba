"""Sampling text from a kiln model (`kiln generate`, `kiln serve-model`): prefill the prompts,
then decode token by token with the model's key/value cache (training.model.init_cache /
decode_step), in one compiled loop that ends once every row is done. `sample_batch` runs several
prompts as one batch, each row with its own settings and the tokens it would get alone.

Each new token is drawn from softmax(logits / temperature), restricted to the smallest set of
most likely tokens whose probabilities add up to at least `top_p` (nucleus sampling, Holtzman
et al. 2020). Randomness comes from one PRNG key per row made from its seed, folded with the
token's index, so the same seed, prompt and settings give the same text, alone or in a batch.
Temperature 0 is greedy: the argmax at every step, no randomness.

A row can be streamed (`Request.stream`): each token, with its log-probabilities when the batch
computes them, goes to its callback as the loop draws it, through a host callback inside the
compiled loop (`jax.experimental.io_callback`), so a server sends text while the batch is still
decoding; the batch's tokens are the same either way.

Models: a train, SFT or DPO output folder (`model.json`, `params.safetensors`; the tokenizer is
found through its lineage, or given), or a Hugging Face folder (`config.json`, safetensors weights,
`tokenizer.json`): kiln's export, or a checkpoint of a class training/hf_import.py reads (Llama,
Qwen2, Qwen3, OLMo 2, OLMo 3, Mistral, Gemma, Gemma 2, Gemma 3, SmolLM3, Phi-3, Granite). No Prefect here.
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from tokenizers import Tokenizer

from training.config import ModelConfig
from training.model import decode_step, init_cache


@dataclass(frozen=True)
class Model:
    """What generation needs: the config and parameters, the tokenizer and its EOS/BOS ids, and the
    other tokens that end a generation as EOS does: a post-trained model's end-of-turn `<|end|>`,
    which its export's generation_config.json lists beside EOS (as Llama 3 Instruct's does), so
    that kiln, `transformers` and vLLM all stop a reply where its turn ends."""

    cfg: ModelConfig
    params: dict
    tokenizer: Tokenizer
    eos_id: int
    bos_id: int | None = None
    end_ids: tuple[int, ...] = ()
    # the model's Jinja chat template (a Hugging Face checkpoint's, or post-training's CHAT_TEMPLATE) and
    # the special tokens' text it reads (evaluation/chat_prompt.py); None: post-training's, where the
    # tokenizer has its chat tokens
    chat_template: str | None = None
    template_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every token that ends a generation: EOS, then `end_ids`."""
        return (self.eos_id, *self.end_ids)

    @property
    def start_id(self) -> int:
        """The token before every training document, so before a text prompt: BOS, else EOS."""
        return self.eos_id if self.bos_id is None else self.bos_id


Stream = Callable[[int, int, float | None, list[tuple[int, float]]], None]  # Request.stream
MAX_LOGPROBS = 20  # alternatives per token at most (`top_logprobs`; vLLM's default limit too)


@dataclass(frozen=True)
class Request:
    """One row of a batch: prompt ids, how many new tokens at most, and how to draw them."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()  # end the row after any of these (not returned)
    # called as stream(i, token, logprob, top) with each new token as it is drawn (i counts from 0;
    # the stop token is not sent): its log-probability and its batch's `top_logprobs` most likely
    # (id, log-probability) pairs as in `Sampled` (None and [] in a batch run without them); a
    # failed batch may run again, sending the same tokens again
    stream: Stream | None = None
    # OpenAI's: (token id, bias) pairs added to the logits a token is drawn from; each new token's
    # logit lowered by presence_penalty once it was drawn before and by frequency_penalty per time
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's: draw from the top_k most likely tokens only (0: all), and only from those at least
    # min_p times as likely as the most likely one (0: all); no stop id ends the row before
    # min_tokens new tokens (they are never drawn before); every token of the prompt or drawn
    # before has its logit divided by repetition_penalty where positive, multiplied where negative
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class Sampled:
    """A row's new tokens (before the stop token, if one ended it), the model's log-probability of
    each (log-softmax of its logits, float32, before temperature, top-p, bias or penalties), and
    per token the `top_logprobs` most likely (id, log-probability) pairs, most likely first."""

    ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    stopped: bool  # a stop id ended it (else max_tokens did)


def sample(model: Model, prompt: list[int], max_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
           seed: int = 0, stop_ids: tuple[int, ...] = (),
           stream: Stream | None = None, top_k: int = 0, min_p: float = 0.0) -> list[int]:
    """Up to `max_tokens` new token ids after `prompt`, ending before the model's stop ids (EOS, and
    a post-trained model's end of turn) or any of `stop_ids`; `stream`, `top_k` and `min_p` as `Request`'s.

    The prompt is cut from the left to leave room for `max_tokens` in the model's context."""
    T = model.cfg.seq_len
    if not 0 < max_tokens < T:
        raise ValueError(f"max_tokens={max_tokens} must be between 1 and the model's context of {T} tokens "
                         "minus one (the prompt needs at least one)")
    prompt = (list(prompt) or [model.start_id])[-(T - max_tokens):]
    row = Request(prompt, max_tokens, temperature, top_p, seed, (*model.stop_ids, *stop_ids), stream, top_k=top_k,
                  min_p=min_p)
    return sample_batch(model, [row])[0].ids


def sample_batch(model: Model, rows: list[Request], top_logprobs: int | None = None,
                 pad_rows_to: int | None = None) -> list[Sampled]:
    """Each row's new tokens, all rows in one prefill and one compiled decoding loop, each row as
    it would come out alone: its own PRNG key (from its seed, folded with the token's index),
    temperature, top-p and stops; left padding that nothing attends to (position -1).

    Shapes are padded to few sizes (rows to `pad_rows_to`, else a power of two; prompt and new
    tokens to `evaluation.scoring.buckets`), so a server compiles a handful of times. The loop
    ends as soon as every row has stopped, so a generous max_tokens costs nothing once rows are
    done. `top_logprobs` None: no log-probabilities at all (`Sampled.logprobs` and `top` empty),
    which saves a log-softmax over the vocabulary per token. A batch with a row that has a logit
    bias or a penalty runs a program that keeps each row's token counts; other batches do not."""
    from evaluation.scoring import bucket_for, buckets

    check_rows(model, rows)
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"top_logprobs={top_logprobs} must be between 0 and {MAX_LOGPROBS}")
    T = model.cfg.seq_len
    B = max(len(rows), pad_rows_to or 1 << (len(rows) - 1).bit_length())
    sizes = buckets(T)
    P = bucket_for(max(len(r.prompt) for r in rows), sizes)
    W = bucket_for(max(r.max_tokens for r in rows), sizes)
    n_stops = max(4, 1 << (max(len(r.stop_ids) for r in rows) - 1).bit_length())  # few compiled variants
    tokens, positions = np.zeros((B, P), np.int32), np.full((B, P), -1, np.int32)
    keys, stops = np.zeros((B, 2), np.uint32), np.full((B, n_stops), -1, np.int32)
    rule = {"temperature": np.zeros(B, np.float32), "top_p": np.ones(B, np.float32), "top_k": np.zeros(B, np.int32),
            "min_p": np.zeros(B, np.float32), "max_new": np.zeros(B, np.int32)}  # max_new 0: a padding row
    for b, r in enumerate(rows):
        tokens[b, P - len(r.prompt):] = r.prompt
        positions[b, P - len(r.prompt):] = np.arange(len(r.prompt))
        keys[b] = seed_key(r.seed)
        stops[b, :len(r.stop_ids)] = r.stop_ids
        for name, value in zip(rule, (r.temperature, r.top_p, r.top_k, r.min_p, r.max_tokens)):
            rule[name][b] = value
    # None: no row holds its stop ids back, and the program masks none
    min_new = np.array([r.min_tokens for r in rows] + [0] * (B - len(rows)), np.int32) if any(
        r.min_tokens for r in rows) else None
    bias = penalties = None  # None: a batch without biases or penalties, whose program keeps no counts
    if any(r.logit_bias or r.presence_penalty or r.frequency_penalty or r.repetition_penalty != 1 for r in rows):
        bias, penalties = np.zeros((B, model.cfg.vocab_size), np.float32), np.ones((3, B), np.float32)
        for b, r in enumerate(rows):
            for token, value in r.logit_bias:
                bias[b, token] = value
            penalties[:, b] = r.presence_penalty, r.frequency_penalty, r.repetition_penalty
    streamed = any(r.stream is not None for r in rows)
    tag = next(_stream_tags)
    if streamed:
        _STREAMS[tag] = _RowStreams(rows, top_logprobs)
    try:
        ids, logprobs, top_ids, top_lps = jax.device_get(_decode_rows(
            model.params, tokens, positions, keys, rule, stops, bias, penalties, min_new, np.int32(tag), cfg=model.cfg,
            cache_len=P + W, alternatives=top_k_size(top_logprobs), stream=streamed))
    finally:
        _STREAMS.pop(tag, None)
    out = []
    for b, r in enumerate(rows):
        row = ids[b, :r.max_tokens].tolist()
        n = next((i for i, t in enumerate(row) if t in r.stop_ids), len(row))
        if top_logprobs is None:
            out.append(Sampled(row[:n], [], [], n < len(row)))
            continue
        top = [list(zip(top_ids[b, i, :top_logprobs].tolist(), top_lps[b, i, :top_logprobs].tolist()))
               for i in range(n)]
        out.append(Sampled(row[:n], logprobs[b, :n].tolist(), top, n < len(row)))
    return out


def check_rows(model: Model, rows: list[Request]) -> None:
    """Raises ValueError, saying what to change, for a row the model cannot run: a prompt and
    max_tokens that do not fit its context, sampling settings out of range, a logit bias
    outside its vocabulary, or stop ids outside it."""
    T = model.cfg.seq_len
    for r in rows:
        if not r.prompt or r.max_tokens < 1 or len(r.prompt) + r.max_tokens > T:
            raise ValueError(f"a prompt of {len(r.prompt)} tokens and max_tokens={r.max_tokens} do not fit the "
                             f"model's context of {T} tokens (the prompt needs at least one, max_tokens too)")
        if r.temperature < 0 or not 0 < r.top_p <= 1 or r.top_k < 0 or not 0 <= r.min_p <= 1:
            raise ValueError(f"temperature={r.temperature} must be >= 0, top_p={r.top_p} in (0, 1], top_k={r.top_k} "
                             f">= 0 and min_p={r.min_p} in [0, 1]")
        if r.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={r.repetition_penalty} must be > 0 (1: none)")
        if not 0 <= r.min_tokens <= r.max_tokens:
            raise ValueError(f"min_tokens={r.min_tokens} must be between 0 and max_tokens={r.max_tokens}")
        if any(not 0 <= t < model.cfg.vocab_size for t, _ in r.logit_bias):
            raise ValueError(f"logit_bias names token ids outside the model's vocabulary of {model.cfg.vocab_size}")
        if any(not 0 <= t < model.cfg.vocab_size for t in r.stop_ids):
            raise ValueError(f"stop ids {list(r.stop_ids)} name token ids outside the model's vocabulary of "
                             f"{model.cfg.vocab_size}")


class _RowStreams:
    """Hands each streamed row its tokens (and their log-probabilities, when the batch has them)
    from the loop's per-step callback, until the row ends."""

    def __init__(self, rows: list[Request], top_logprobs: int | None):
        self.rows, self.ended, self.k = rows, [r.stream is None for r in rows], top_logprobs

    def __call__(self, i: int, tokens: np.ndarray, logprobs: np.ndarray, top_ids: np.ndarray,
                 top_lps: np.ndarray) -> None:
        for b, r in enumerate(self.rows):
            if self.ended[b]:
                continue
            token = int(tokens[b])
            if token in r.stop_ids:
                self.ended[b] = True
                continue
            self.ended[b] = i + 1 >= r.max_tokens
            if self.k is None:
                r.stream(i, token, None, [])
            else:
                r.stream(i, token, float(logprobs[b]), list(zip(top_ids[b, :self.k].tolist(),
                                                                top_lps[b, :self.k].tolist())))


_STREAMS: dict[int, _RowStreams] = {}  # a streaming sample_batch call's tag -> its rows' callbacks
_stream_tags = itertools.count()


def _send_tokens(tag, i, tokens, logprobs, top_ids, top_lps) -> None:
    """The host side of the loop's callback: step i's tokens [B], their log-probabilities [B] and
    top alternatives [B, top_k] to the rows of call `tag`."""
    _STREAMS[int(tag)](int(i), *(np.asarray(a) for a in (tokens, logprobs, top_ids, top_lps)))


def seed_key(seed: int) -> np.ndarray:
    """A raw PRNG key (uint32 [2]) from any integer seed, taken modulo 2**64; for seeds in
    [0, 2**32) it is `jax.random.PRNGKey(seed)`."""
    seed %= 1 << 64
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


@functools.partial(jax.jit, static_argnames=("cfg", "cache_len", "alternatives", "stream"))
def _decode_rows(params, tokens, positions, keys, rule, stop_ids, bias, penalties, min_new, tag, *,
                 cfg: ModelConfig, cache_len: int, alternatives: int | None, stream: bool = False):
    """Left-padded prompts tokens, positions [B, P] -> new tokens [B, W] (W = cache_len - P), their
    log-probabilities [B, W] and the `alternatives` most likely tokens' ids and log-probabilities
    [B, W, alternatives] (None: no log-probabilities, zeros). `rule` holds each row's
    temperature, top_p, top_k, min_p (`pick`) and max_new [B]: row b is done after max_new[b]
    tokens or one in stop_ids[b]; what a done row draws after that is never read. One prefill,
    then a while loop of one-token steps that ends once every row is done. With `stream`, each
    step's tokens (with their log-probabilities and alternatives) also go to the host as they are
    drawn (`_send_tokens`), in order.

    `bias` [B, V] and `penalties` [3, B] (presence, frequency, repetition), unless None, adjust
    the logits a token is drawn from as vLLM does (the bias added, then the repetition penalty on
    the tokens of the prompt or drawn before, then presence and frequency on those drawn), with
    each row's counts of its new tokens [B, V] carried through the loop; `min_new` [B], unless
    None, keeps row b from drawing its stop ids before min_new[b] new tokens. Log-probabilities
    are the model's own, before any of these."""
    B, P = tokens.shape
    W = cache_len - P
    max_new = rule["max_new"]
    logits, cache = prefill(params, cfg, tokens, init_cache(cfg, B, cache_len), positions)
    if penalties is not None:  # which tokens each prompt holds (padding, at position -1, is none)
        in_prompt = jnp.zeros(bias.shape, bool).at[jnp.arange(B)[:, None], tokens].max(positions >= 0)

    def emit(i, logits, out, done, counts):  # draw token i of every row from logits [B, V]; record it
        drawn_from = logits
        if bias is not None:
            drawn_from = penalised(logits, bias, *penalties, in_prompt, counts)
        if min_new is not None:  # a row's stop ids at -inf until it has min_new tokens (-1: no stop id there)
            held = jnp.where((i < min_new)[:, None] & (stop_ids >= 0), -jnp.inf, jnp.inf)
            drawn_from = drawn_from.at[jnp.arange(B)[:, None], jnp.maximum(stop_ids, 0)].min(held)
        token = pick(drawn_from, jax.vmap(jax.random.fold_in, (0, None))(keys, i), rule["temperature"],
                     rule["top_p"], rule["top_k"], rule["min_p"])
        if bias is not None:
            counts = counts.at[jnp.arange(B), token].add(1)
        ids, lps, top_ids, top_lps = out
        ids = ids.at[:, i].set(token)
        lp = jnp.zeros((B,), jnp.float32)
        best, best_ids = jnp.zeros((B, alternatives or 0), jnp.float32), jnp.zeros((B, alternatives or 0), jnp.int32)
        if alternatives is not None:
            logp = jax.nn.log_softmax(logits, axis=-1)
            lp = jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
            lps = lps.at[:, i].set(lp)
        if alternatives:
            best, best_ids = jax.lax.top_k(logp, alternatives)
            top_ids, top_lps = top_ids.at[:, i].set(best_ids), top_lps.at[:, i].set(best)
        done = done | (token[:, None] == stop_ids).any(axis=-1) | (i + 1 >= max_new)
        if stream:
            io_callback(_send_tokens, None, tag, i, token, lp, best_ids, best, ordered=True)
        return token, (ids, lps, top_ids, top_lps), done, counts

    out = (jnp.zeros((B, W), jnp.int32), jnp.zeros((B, W), jnp.float32),
           jnp.zeros((B, W, alternatives or 0), jnp.int32), jnp.zeros((B, W, alternatives or 0), jnp.float32))
    counts = None if bias is None else jnp.zeros(bias.shape, jnp.int32)
    token, out, done, counts = emit(0, logits, out, jnp.zeros((B,), bool), counts)

    def step(state):
        i, token, pos, cache, out, counts, done = state
        logits, cache = decode_step(params, cfg, token[:, None], cache, pos[:, None])
        token, out, done, counts = emit(i, logits[:, 0], out, done, counts)
        return i + 1, token, pos + 1, cache, out, counts, done

    state = (jnp.int32(1), token, positions[:, -1] + 1, cache, out, counts, done)
    return jax.lax.while_loop(lambda s: (s[0] < W) & ~s[-1].all(), step, state)[4]


def penalised(logits, bias, presence, frequency, repetition, in_prompt, counts):
    """Logits [B, V] as a token is drawn from them under vLLM's adjustments: `bias` [B, V] added,
    then each row's `repetition` [B] penalty on the tokens of its prompt (`in_prompt` [B, V]) or
    drawn before (`counts` [B, V] of its new tokens), then its `presence` and `frequency` [B]
    penalties on those drawn. Neutral values (0, 0, 0, 1) give the logits back unchanged."""
    drawn_from = logits + bias
    repeated = jnp.where(drawn_from > 0, drawn_from / repetition[:, None], drawn_from * repetition[:, None])
    drawn_from = jnp.where(in_prompt | (counts > 0), repeated, drawn_from)
    return drawn_from - presence[:, None] * (counts > 0) - frequency[:, None] * counts


def prefill(params, cfg: ModelConfig, tokens, cache: dict, positions):
    """training.model.decode_step over whole prompts [B, P], with the output layer on the last
    position only: logits [B, V]. The other positions' logits are never read, and at a GPT-2
    vocabulary they cost more than the rest of the model (prefill 8x faster at the tiny_cpu shape)."""
    from evaluation.scoring import output_logits, trunk

    index = cache["index"]
    pos = jax.lax.dynamic_update_slice(cache["pos"], positions, (0, index))
    hidden, layers = trunk(params, tokens, positions, cfg, {"index": index, "pos": pos, "layers": cache["layers"]})
    return output_logits(params, hidden[:, -1], cfg), {"index": index + tokens.shape[1], "pos": pos, "layers": layers}


def pick(logits, keys, temperature, top_p, top_k, min_p):
    """One token per row of logits [B, V], row b with its own PRNG key keys[b], temperature[b],
    top_p[b], top_k[b] and min_p[b]: the argmax at temperature 0, else a draw from the
    temperature-scaled distribution cut as `_truncate` cuts it. The draw is skipped when every
    row is greedy, and the cut's sort when no sampled row cuts (top_p 1, top_k and min_p 0): work
    no row needs, and no row's token depends on it."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        cuts = (temperature > 0) & ((top_p < 1) | (top_k > 0) | (min_p > 0))
        scaled = jax.lax.cond(jnp.any(cuts), lambda: _truncate(scaled, top_p, top_k, min_p), lambda: scaled)
        drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), draw, lambda: greedy)


def _truncate(scaled, top_p, top_k, min_p):
    """Logits [B, V] with every token a row may not draw at -inf, in the order Hugging Face's and
    vLLM's samplers apply the cuts: outside the top_k most likely (top_k 0: none), then outside
    the top-p nucleus of what is left, renormalised (top_p 1: none), then less than min_p times
    as likely as the most likely token (min_p 0: none). The most likely token is always kept."""
    probs = jax.nn.softmax(scaled, axis=-1)
    order = jnp.argsort(-probs, axis=-1)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    in_top_k = (top_k[:, None] <= 0) | (jnp.arange(scaled.shape[1])[None] < top_k[:, None])
    mass = jnp.where(top_k > 0, jnp.sum(jnp.where(in_top_k, sorted_probs, 0), axis=-1), 1.0)[:, None]
    before = (jnp.cumsum(sorted_probs, axis=-1) - sorted_probs) / mass  # mass of the more likely tokens kept
    keep_sorted = in_top_k & ((before < top_p[:, None]) | (top_p[:, None] >= 1))
    keep_sorted &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(scaled.shape[0])[:, None], order].set(keep_sorted)
    return jnp.where(keep, scaled, -jnp.inf)


def top_k_size(k: int | None) -> int | None:
    """The alternatives computed per token for a request of `k`: 0, 1 or MAX_LOGPROBS (sliced to
    k after), so that the compiled functions come in a few variants, not twenty-two; None (no
    log-probabilities) stays None."""
    return None if k is None else 0 if k == 0 else 1 if k == 1 else MAX_LOGPROBS


def generate(model: Model, prompt: str, max_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
             seed: int = 0, chat: bool = False, on_text: Callable[[str], None] | None = None, top_k: int = 0,
             min_p: float = 0.0) -> str:
    """The text sampled after `prompt`. With `chat`, the prompt is one user message in the model's
    chat template (evaluation/chat_prompt.py: post-training's, or a checkpoint's own), and the
    answer ends where the assistant's turn does. Without, the prompt continues a document (EOS/BOS
    before it, as between training documents). `on_text` gets the text in pieces as the tokens are drawn."""
    stop_ids: tuple[int, ...] = ()
    if chat:
        from evaluation.chat_prompt import chat_for

        template = chat_for(model)
        ids, stop_ids = template.prompt([{"role": "user", "content": prompt}]), template.stop_ids
    else:
        tok = Tokenizer.from_str(model.tokenizer.to_str())
        tok.encode_special_tokens = True  # special-token strings in the prompt stay text, as in training
        ids = [model.start_id, *tok.encode(prompt, add_special_tokens=False).ids]
    decode = functools.partial(model.tokenizer.decode, skip_special_tokens=False)
    pieces = None if on_text is None else TextStream(decode, [])
    stream = None if pieces is None else lambda i, token, _lp, _top: on_text(pieces.push(i, token))
    out = sample(model, ids, max_tokens, temperature, top_p, seed, stop_ids, stream, top_k, min_p)
    text = decode(out)
    if pieces is not None:
        on_text(pieces.rest(text))
    return text


def stop_end(text: str, stops: list[str], include: bool = False) -> int | None:
    """Where `text` ends at its first stop string: before it, or after it with `include` (of stop
    strings starting at the same place, the first listed); None if it holds none."""
    found = min(((at, n) for n, stop in enumerate(stops) if (at := text.find(stop)) >= 0), default=None)
    if found is None:
        return None
    at, n = found
    return at + len(stops[n]) if include else at


class TextStream:
    """One streamed answer's text as its tokens arrive, given out in pieces that never run past a
    stop string (a tail that could begin one waits for the next token; with `include`, the first
    stop string met goes out too) or end inside a character (a token can end between the bytes
    of one). The last piece is what remains of the answer's text as it is without streaming
    (`kiln serve-model` cuts it at the first stop string), so the pieces add up to that text."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str], include: bool = False):
        self.decode, self.stops, self.include = decode, stops, include
        self.ids: list[int] = []
        self.sent = ""

    def push(self, i: int, token: int) -> str:
        """The new text that token i makes safe to send ('' if none)."""
        if i < len(self.ids):  # a failed batch ran again and sends its tokens again
            return ""
        self.ids.append(token)
        text = self.decode(self.ids).rstrip("\ufffd")  # an unfinished character decodes to U+FFFD
        found = stop_end(text, self.stops, self.include)
        end = len(text) if found is None else found
        for stop in self.stops:
            tail = next((k for k in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:k])), 0)
            end = min(end, len(text) - tail)
        piece = text[len(self.sent):end]
        self.sent += piece
        return piece

    def rest(self, final: str) -> str:
        """What is left of the answer's `final` text after the pieces sent."""
        if not final.startswith(self.sent):
            raise RuntimeError(f"the streamed text {self.sent!r} is not the start of the answer {final!r}: a kiln "
                               "bug, please report it; generate without streaming meanwhile")
        return final[len(self.sent):]


# --- loading a model folder ------------------------------------------------------------------


def load(path: Path, tokenizer_dir: Path | None = None, dtype: str | None = None,
         max_model_len: int | None = None) -> Model:
    """A train/SFT/DPO output folder with its tokenizer, or a Hugging Face folder (kiln's export,
    or a checkpoint of a class training/hf_import.py reads) with its tokenizer.json, ready to
    generate.

    `dtype` is what the model computes in: float32 or bfloat16 (None: its config's
    `compute_dtype`; a Hugging Face folder's is float32). Its weights are held in that dtype, each
    converted in host memory as it is read: the model casts each weight to its compute dtype
    wherever it uses it, so the results are the same bits, while a bfloat16 model holds half the
    bytes and its decoding calls make no cast copies of the weights (XLA hoists such casts out of
    a decoding loop but not out of the call). `max_model_len` caps the context (prompt and answer):
    a server's slots each hold a key/value cache that long, and a checkpoint's context may be tens
    of thousands of tokens."""
    from training.hf_import import INDEX_FILE, WEIGHTS_FILE

    path = Path(path)
    if (path / "model.json").is_file():
        from tasks.tokenizer import load_tokenizer, read_tokenizer_meta
        from training.loop import read_model

        cfg, params = read_model(path, None if dtype is None else jnp.dtype(dtype))
        folder = Path(tokenizer_dir) if tokenizer_dir is not None else tokenizer_of(path)
        meta = read_tokenizer_meta(folder)
        tokenizer = load_tokenizer(folder)
        model = Model(cfg, params, tokenizer, meta["eos_id"], meta.get("bos_id"),
                      *output_chat(path, folder, tokenizer))
    elif (path / "config.json").is_file() and ((path / WEIGHTS_FILE).is_file() or (path / INDEX_FILE).is_file()):
        model = load_export(path, jnp.dtype(dtype or "float32"))
    else:
        raise FileNotFoundError(f"{path} is neither a training output (model.json, params.safetensors) nor a "
                                f"Hugging Face folder (config.json, {WEIGHTS_FILE} or {INDEX_FILE}): point at "
                                "<store>/train|sft|dpo|export/<version>, or the folder of a checkpoint "
                                "docs/starting_points.md lists")
    cfg = model.cfg
    if max_model_len is not None and not 2 <= max_model_len <= cfg.seq_len:
        raise ValueError(f"max_model_len={max_model_len}: give 2 to the model's context of {cfg.seq_len} tokens "
                         "(more than it was made for is not offered)")
    cfg = ModelConfig.model_validate({**cfg.model_dump(), "seq_len": max_model_len or cfg.seq_len,
                                      "compute_dtype": dtype or cfg.compute_dtype})
    from training.loop import placed

    return replace(model, cfg=cfg, params=placed(model.params))


def output_chat(model_dir: Path, tokenizer_dir: Path,
                tokenizer: Tokenizer | None = None) -> tuple[tuple[int, ...], str | None, dict[str, str]]:
    """A training output's (turn end ids, chat template, the template's special tokens' text). A
    post-trained output (SFT, DPO) keeps the template it learned beside its weights, and a reply ends
    at its end of turn; any other output chats in its tokenizer's template (a Hugging Face
    checkpoint's, which a tokenizer step of kind hf carries), if any, and stops at EOS. `tokenizer`:
    the tokenizer folder's, where the caller has loaded it already."""
    from tasks.tokenizer import carried_chat_template, chat_template
    from training.chat_template import TEMPLATE_FILE

    carried = carried_chat_template(tokenizer_dir)
    template_tokens = {} if carried is None else carried[1]
    template_file = Path(model_dir) / TEMPLATE_FILE
    if not template_file.is_file():
        return (), None if carried is None else carried[0], template_tokens
    template = chat_template(tokenizer_dir, tokenizer)
    if template.source != template_file.read_text(encoding="utf-8"):
        raise ValueError(f"{model_dir} was post-trained with another chat template than the tokenizer {tokenizer_dir} "
                         "carries: pair it with the tokenizer it was post-trained with (kiln generate and "
                         "serve-model: --tokenizer)")
    return (template.end_id,), template.source, template_tokens


def tokenizer_of(model_dir: Path) -> Path:
    """The tokenizer step output a training output was made with, found through lineage.json:
    an input named `tokenizer` (SFT, DPO), or the tokenizer upstream of its tokens (train)."""
    store_root = Path(model_dir).resolve().parent.parent
    pending, seen = [Path(model_dir).resolve()], set()
    while pending:
        folder = pending.pop(0)
        lineage = folder / "lineage.json"
        if folder in seen or not lineage.is_file():
            continue
        seen.add(folder)
        for inp in json.loads(lineage.read_text())["inputs"]:
            child = store_root / inp["stage"] / inp["version"]
            if inp["stage"] == "tokenizer" and child.is_dir():
                return child
            pending.append(child)
    raise FileNotFoundError(f"no tokenizer step output found upstream of {model_dir} (through lineage.json in "
                            f"{store_root}): pass the tokenizer folder with --tokenizer")


def load_export(folder: Path, dtype=np.float32) -> Model:
    """A Hugging Face folder as kiln's model, its parameters in host memory in `dtype` (`load`
    places them): kiln's export (training/export.py), or a checkpoint of a class training/hf_import.py
    reads, read by the export's inverse (q/k/v biases, fused projections, shards, bfloat16 weights,
    and what kiln's model cannot compute refused with the reason), with the folder's tokenizer.json
    and chat template. Generation stops at config.json's EOS and at every other id it or
    generation_config.json lists (a post-trained export's end of turn, Llama 3 Instruct's
    <|eot_id|>)."""
    from training.chat_jinja import checkpoint_template
    from training.hf_import import load_hf, read_config

    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{tokenizer_file} not found: kiln reads a Hugging Face folder's tokenizer from its "
                                "tokenizer.json (save the tokenizer with transformers' `save_pretrained` into it)")
    cfg, params = load_hf(folder, dtype=dtype)
    hf = read_config(folder)
    generation = folder / "generation_config.json"  # what transformers and vLLM stop at: one id or a list
    listed = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    stops = [i for value in (hf.get("eos_token_id"), listed) if value is not None
             for i in (value if isinstance(value, list) else [value])]
    if not stops:
        raise ValueError(f"{folder}: neither config.json nor generation_config.json names an eos_token_id, so kiln "
                         "would not know where an answer ends: add it to config.json")
    eos = stops[0]
    template, template_tokens = checkpoint_template(folder)
    return Model(cfg, params, Tokenizer.from_file(str(tokenizer_file)), eos, hf.get("bos_token_id"),
                 tuple(i for i in dict.fromkeys(stops) if i != eos), template, template_tokens)
