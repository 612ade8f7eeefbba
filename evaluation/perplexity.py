"""Perplexity and bits per byte on the held-out token shards (the tokenize step's validation split).

The split is read as one stream, in windows of `seq_len + 1` tokens that share one token with the
next, so every token after the first is predicted exactly once, with as much context as the
window gives (the same windows as training's validation loss).

Two numbers, two denominators:

    loss, perplexity   nats per predicted token, over every token including the EOS between
                       documents: comparable to the training run's validation loss.
    bits_per_byte      bits per UTF-8 byte of text, over the text tokens only (special tokens
                       stand for no bytes): comparable across tokenizers. Each token's byte count
                       comes from the byte-level vocabulary, where one character is one byte.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
from tokenizers import Tokenizer, decoders

from evaluation.scoring import make_token_scorer, pad_rows
from training.config import ModelConfig
from training.data import TokenDataset


def token_bytes(tokenizer: Tokenizer, vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: UTF-8 bytes of each token id; 0 for special tokens and unused ids."""
    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        raise ValueError(f"bits per byte needs a byte-level tokenizer (kiln's gpt2 and bpe kinds are); this one "
                         f"decodes with {type(tokenizer.decoder).__name__}")
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    table = np.zeros(vocab_size, np.int64)
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and i not in special:
            table[i] = len(token)  # byte-level alphabet: one character per byte
    return table


def heldout_metrics(cfg: ModelConfig, params, dataset: TokenDataset, tokenizer: Tokenizer, batch_size: int = 16,
                    max_tokens: int | None = None, score: Callable | None = None, first_token: int = 0) -> dict:
    """Loss, perplexity and bits per byte of the model on `dataset`: its `max_tokens` tokens (all
    when None) from `first_token` on."""
    T = cfg.seq_len
    n = dataset.n_tokens if max_tokens is None else min(dataset.n_tokens, first_token + max_tokens)
    if n - first_token < 2:
        raise ValueError(f"{dataset} has {dataset.n_tokens} tokens; perplexity from token {first_token} needs at "
                         "least 2 more: raise validation_fraction in the tokenize config")
    score = score or make_token_scorer(cfg)
    nbytes = token_bytes(tokenizer, cfg.vocab_size)
    starts = list(range(first_token, n - 1, T))
    nats = text_nats = 0.0
    tokens = text_tokens = text_bytes = 0
    for b in range(0, len(starts), batch_size):
        windows = [dataset.tokens(s, min(s + T + 1, n)).astype(np.int32) for s in starts[b:b + batch_size]]
        inputs = pad_rows([w[:-1] for w in windows], T, batch_size)
        targets = pad_rows([w[1:] for w in windows], T, batch_size)
        logprob, _ = score(params, inputs, targets, np.zeros(batch_size, np.int32), T)
        logprob = np.asarray(logprob, np.float64)
        valid = np.zeros((batch_size, T), bool)
        for r, w in enumerate(windows):
            valid[r, :len(w) - 1] = True
        target_bytes = nbytes[targets] * valid
        text = target_bytes > 0
        nats -= logprob[valid].sum()
        text_nats -= logprob[text].sum()
        tokens += int(valid.sum())
        text_tokens += int(text.sum())
        text_bytes += int(target_bytes.sum())
    loss = float(nats / tokens)
    bpb = float(text_nats / math.log(2) / text_bytes) if text_bytes else None
    return {"tokens": tokens, "loss": loss, "perplexity": math.exp(loss), "text_tokens": text_tokens,
            "bytes": text_bytes, "bits_per_byte": bpb}
