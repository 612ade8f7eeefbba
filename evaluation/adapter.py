"""An lm-eval model over kiln's JAX Llama and tokenizer: `KilnLM`.

lm-eval calls three methods, each with a list of requests:

    loglikelihood          (context, continuation) -> (log p(continuation | context), is_greedy)
    loglikelihood_rolling  (text,)                 -> log p(text), over windows of the context
    generate_until         (context, gen_kwargs)   -> greedy text until a stop string or a stop token
                                                      (EOS; a post-trained model's <|end|> too)

All three go through jitted functions on batches of a fixed number of rows, padded to a few
bucket lengths (`evaluation.scoring.buckets`), so a whole evaluation compiles a handful of times.
Requests are sorted by length so each batch pads little, and answers come back in request order.

Tokenization matches the tokenize step: text is encoded without special tokens, and special-token
strings inside it stay ordinary text. Generated special tokens are dropped from an answer, as
lm-eval's hf model (and vLLM) decode it. `parse_special_tokens` is for prompts and answers that
carry chat markers on purpose (kiln's chat evaluation, DPO's generated answers): their strings in
a prompt become their tokens, and they stay in the answer, where a stop string can find them.
An empty context is replaced by the BOS token, or EOS when the tokenizer has
no BOS, which is what precedes every document in training.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tokenizers import Tokenizer

from evaluation.generate import prefill
from evaluation.scoring import WINDOW, bucket_for, buckets, make_token_scorer, pad_rows
from training.config import ModelConfig
from training.model import decode_step, init_cache, param_count

LOOKAHEAD = 2  # batches in flight on the device while the host prepares the next one


class KilnLM(TemplateLM):
    """lm-eval's `LM` for a kiln model: its config and parameters, and the tokenizer it was trained with
    (`tasks.evaluate.load_kiln_lm` builds one from the train and tokenizer step outputs)."""

    def __init__(self, cfg: ModelConfig, params, tokenizer: Tokenizer, eos_id: int, bos_id: int | None = None,
                 batch_size: int = 16, max_gen_toks: int = 128, gen_chunk: int = 16,
                 parse_special_tokens: bool = False, score_window: int | None = WINDOW,
                 end_ids: tuple[int, ...] = (), chat=None):
        super().__init__()
        if tokenizer.get_vocab_size(with_added_tokens=True) > cfg.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} tokens but the "
                             f"model only {cfg.vocab_size} embeddings: pair the model with the tokenizer it was "
                             "trained with")
        self.cfg, self.params = cfg, params
        self.tok = Tokenizer.from_str(tokenizer.to_str())  # a copy: we change how it reads specials
        # lm-eval's --apply_chat_template renders prompts with `chat` (training.chat_template.ChatTemplate or
        # training.chat_jinja.CheckpointTemplate); their special-token strings become their tokens, as
        # lm-eval's hf model reads them
        self.chat = chat
        self.tok.encode_special_tokens = not (parse_special_tokens or chat is not None)
        self.skip_special_tokens = not parse_special_tokens
        self.eos_id, self.bos_id = eos_id, bos_id
        # generation also ends at these (a post-trained model's end of turn: evaluation.generate.output_chat),
        # as transformers ends it at the export's generation_config.json eos_token_id list
        self.stop_ids = np.array([eos_id, *end_ids])
        self.batch_size, self.max_gen_toks, self.gen_chunk = batch_size, max_gen_toks, gen_chunk
        self.score_window = score_window  # None: the output layer runs on every position
        self.buckets = buckets(cfg.seq_len)
        self.scorer = make_token_scorer(cfg)
        self._prefill = jax.jit(self._prefill_fn)
        self._decode = jax.jit(self._decode_fn, static_argnums=4)

    # --- what TemplateLM needs -------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.eos_id if self.bos_id is None else self.bos_id

    @property
    def max_length(self) -> int:
        return self.cfg.seq_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(list(tokens), skip_special_tokens=self.skip_special_tokens)

    # --- lm-eval's apply_chat_template -------------------------------------------------------------

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt's text in the model's chat template: lm-eval continues the last message (an
        assistant prefill) when it asks for no generation prompt, as its hf model does."""
        if self.chat is None:
            raise ValueError("this evaluation asks for the chat template (apply_chat_template), but the model was "
                             "given none: evaluate a model whose tokenizer carries one or has kiln's chat tokens")
        return self.chat.render(chat_history, add_generation_prompt=add_generation_prompt,
                                continue_final_message=not add_generation_prompt)

    @property
    def tokenizer_name(self) -> str:
        return "kiln-" + hashlib.sha256(self.tok.to_str().encode("utf-8")).hexdigest()[:12]

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.chat.source if self.chat is not None and chat_template else ""

    def get_model_info(self) -> dict:
        return {"model": "kiln", "params": param_count(self.params), "seq_len": self.cfg.seq_len,
                "vocab_size": self.cfg.vocab_size}

    # --- loglikelihood ---------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context ids, continuation ids)."""
        answers = self.score_continuations([(ctx, cont) for _, ctx, cont in requests])
        for (key, _, _), answer in zip(requests, answers):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def score_continuations(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation tokens), all of them greedy) for each (context, continuation)
        pair of token lists. The context is cut from the left to fit the model's window."""
        rows, batches = self.plan_batches(pairs)
        answers: list[tuple[float, bool] | None] = [None] * len(rows)
        in_flight: deque = deque()

        def collect() -> None:
            batch, starts, (logprob, greedy) = in_flight.popleft()
            logprob, greedy = np.asarray(logprob), np.asarray(greedy)
            for j, i in enumerate(batch):
                n, k = rows[i]
                first, stop = n - k - starts[j], n - starts[j]  # the continuation within the window
                answers[i] = (float(logprob[j, first:stop].sum()), bool(greedy[j, first:stop].all()))

        for batch, inputs, targets, starts, window in batches:
            scored = self.scorer(self.params, inputs, targets, starts, window)  # dispatched, not awaited
            in_flight.append((batch, starts, scored))
            if len(in_flight) > LOOKAHEAD:
                collect()
        while in_flight:
            collect()
        return answers  # type: ignore[return-value]

    def plan_batches(self, pairs: list[tuple[list[int], list[int]]]):
        """How `score_continuations` batches `pairs`: per pair (input length, continuation length),
        and the batches as (pair indices, inputs [B, L], targets [B, L], starts [B], window), L a
        bucket length. Longest first, so each batch pads little. Each row is scored on the
        `window` positions ending at its last token: `score_window` of them when every
        continuation in the batch fits (the usual case), else the whole row."""
        T = self.cfg.seq_len
        rows, seqs = [], []
        for ctx, cont in pairs:
            if not cont:
                raise ValueError("an empty continuation has no likelihood to score")
            if len(cont) > T:
                raise ValueError(f"a continuation of {len(cont)} tokens does not fit the model's context of "
                                 f"{T}; shorten the task's targets (kiln's next_passage: eval.suite.choice_words) "
                                 "or evaluate a model of a longer model.seq_len")
            whole = (list(ctx) + list(cont))[-(T + 1):]
            seqs.append(np.asarray(whole, np.int32))
            rows.append((len(whole) - 1, len(cont)))
        order = sorted(range(len(rows)), key=lambda i: -rows[i][0])
        batches = []
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            length = bucket_for(rows[batch[0]][0], self.buckets)
            inputs = pad_rows([seqs[i][:-1] for i in batch], length, self.batch_size)
            targets = pad_rows([seqs[i][1:] for i in batch], length, self.batch_size)
            w = self.score_window
            window = w if w is not None and max(rows[i][1] for i in batch) <= w < length else length
            starts = np.zeros(self.batch_size, np.int32)
            starts[:len(batch)] = [max(rows[i][0] - window, 0) for i in batch]
            batches.append((batch, inputs, targets, starts, window))
        return rows, batches

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log p(text) of whole texts, in windows of the model's context, each token predicted once
        (lm-eval's rolling windows with one token of context). One float per request."""
        pairs, owner = [], []
        for i, req in enumerate(requests):
            (text,) = req.args
            windows = get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id,
                                                self.cfg.seq_len, 1)
            for ctx, cont in map(make_disjoint_window, windows):
                pairs.append((ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self.score_continuations(pairs)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- greedy generation -----------------------------------------------------------------------

    def _prefill_fn(self, params, tokens, positions, cache):
        logits, cache = prefill(params, self.cfg, tokens, cache, positions)  # logits of the last position only
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    def _decode_fn(self, params, last, positions, cache, steps: int):
        """`steps` greedy tokens after `last` [B], in one compiled loop; returns them [B, steps]."""

        def step(carry, _):
            token, pos, cache = carry
            logits, cache = decode_step(params, self.cfg, token[:, None], cache, pos[:, None])
            nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            return (nxt, pos + 1, cache), nxt

        (last, positions, cache), out = jax.lax.scan(step, (last, positions, cache), None, length=steps)
        return out.T, last, positions, cache

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut before the first stop string (`until`) or stop token.

        Requests with the same generation settings are batched together, longest prompt first.
        """
        groups: dict[str, list[int]] = {}
        settings = []
        for i, req in enumerate(requests):
            _, gen_kwargs = req.args
            until, max_gen = self._generation_settings(gen_kwargs)
            settings.append((until, max_gen))
            groups.setdefault(json.dumps([until, max_gen]), []).append(i)

        results: list[str | None] = [None] * len(requests)
        for indices in groups.values():
            until, max_gen = settings[indices[0]]
            prompts = {i: self.tok_encode(requests[i].args[0]) for i in indices}
            indices = sorted(indices, key=lambda i: -len(prompts[i]))
            for start in range(0, len(indices), self.batch_size):
                batch = indices[start:start + self.batch_size]
                for i, text in zip(batch, self.generate([prompts[i] for i in batch], max_gen, until)):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results  # type: ignore[return-value]

    def _generation_settings(self, gen_kwargs: dict) -> tuple[list[str], int]:
        kwargs = dict(gen_kwargs or {})
        if kwargs.get("do_sample"):
            raise ValueError(f"generation settings {gen_kwargs} ask for sampling; kiln's adapter decodes "
                             "greedily: set do_sample: false in the task")
        until = kwargs.get("until") or []
        until = [s for s in ([until] if isinstance(until, str) else until) if s]
        return until, int(kwargs.get("max_gen_toks", self.max_gen_toks))

    def generate(self, prompts: list[list[int]], max_gen: int, until: list[str]) -> list[str]:
        """Greedy text for up to `batch_size` token prompts, each decoded as if it were alone.

        Prompts are left-padded (padding has position -1, so nothing attends to it) and cut from
        the left to leave room for `max_gen` tokens in the model's context. Decoding runs in
        compiled chunks of `gen_chunk` tokens and stops once every row has hit a stop token or string.
        """
        T, B = self.cfg.seq_len, self.batch_size
        if not 0 < len(prompts) <= B:
            raise ValueError(f"generate takes 1 to {B} prompts, got {len(prompts)}")
        if max_gen >= T:
            raise ValueError(f"max_gen_toks={max_gen} leaves no room for a prompt in the model's context of {T}")
        prompts = [p[-(T - max_gen):] if p else [self.prefix_token_id] for p in prompts]
        P = bucket_for(max(len(p) for p in prompts), self.buckets)
        chunks = -(-(max_gen - 1) // self.gen_chunk)
        tokens = np.zeros((B, P), np.int32)
        positions = np.full((B, P), -1, np.int32)
        for r, p in enumerate(prompts):
            tokens[r, P - len(p):] = p
            positions[r, P - len(p):] = np.arange(len(p))
        cache = init_cache(self.cfg, B, P + chunks * self.gen_chunk)
        last, cache = self._prefill(self.params, tokens, positions, cache)
        next_pos = np.array([len(p) for p in prompts] + [0] * (B - len(prompts)), np.int32)
        out = [np.asarray(last)[:, None]]
        for _ in range(chunks):
            if all(self._finished(np.concatenate(out, 1)[r], until) for r in range(len(prompts))):
                break
            new, last, next_pos, cache = self._decode(self.params, last, next_pos, cache, self.gen_chunk)
            out.append(np.asarray(new))
        generated = np.concatenate(out, axis=1)[:, :max_gen]
        return [self._cut(generated[r], until) for r in range(len(prompts))]

    def _finished(self, ids: np.ndarray, until: list[str]) -> bool:
        if np.isin(ids, self.stop_ids).any():
            return True
        text = self.tok_decode(ids.tolist())
        return any(stop in text for stop in until)

    def _cut(self, ids: np.ndarray, until: list[str]) -> str:
        stops = np.flatnonzero(np.isin(ids, self.stop_ids))
        text = self.tok_decode(ids[:stops[0] if len(stops) else len(ids)].tolist())
        for stop in until:
            text = text.split(stop, 1)[0]
        return text
