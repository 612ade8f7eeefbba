"""The training data loader: token windows from tokenize outputs, in an order fixed by (seed, step).

A tokenize output folder (see tasks/tokenize.py) holds, per split, flat token shards that we
memory-map and treat as one long stream. A window is `T + 1` consecutive tokens (inputs and
shifted targets); windows start every `T` tokens and may span document boundaries, which EOS
tokens mark, as in nanoGPT and GPT-2.

The order is a pure function, never state: the row `r` of batch `step` is global sample
`g = step * B + r`. Samples are dealt to sources in blocks of `block_size`: each block holds a
fixed number of each source's samples (its weight times the block, rounded), shuffled by a
generator seeded with (seed, block). A source's n-th sample is window `perm_e[n % W]` of its
epoch `e = n // W`, where `perm_e` is a permutation of its W windows seeded with
(seed, source, e). So batch k can be computed directly, without replaying batches 0..k-1, and
resuming a run is "start the loader at step k". `write_global_order` saves the whole order, as
OLMo publishes its `global_indices`, so anyone can see which tokens were trained on when.

A mixture of tokenize outputs (`open_mixture`, docs/mixtures.md) is this loader with a weight and
a repetition cap per source: given the run's length, a source whose weight would repeat it past
`max_epochs` gets its cap's share instead, for the whole run, and the others fill the rest, so
the per-block counts stay fixed and the order stays a pure function of (seed, step).

Numpy only: no Prefect, no Ray, no JAX.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

META_FILE = "meta.json"
FORMAT, FORMAT_VERSION = "kiln-tokens", 1
_BLOCK_STREAM, _EPOCH_STREAM = 0, 1  # keep the two kinds of generator seeds apart


class TokenDataset:
    """One split of one tokenize output folder, as one stream of tokens read by memory map.

    Every disagreement between `meta.json` and the files is an error naming the file: a
    loader must never train on a half-written or foreign dataset, nor re-tokenize silently.
    `expect_tokenizer`, when given, is the tokenizer version the caller was built for.
    """

    def __init__(self, folder: Path, split: str = "train", expect_tokenizer: str | None = None):
        self.folder, self.split = Path(folder), split
        meta = read_meta(self.folder)
        if split not in meta["splits"]:
            raise ValueError(f"{self.folder / META_FILE} has no split {split!r}; it has {sorted(meta['splits'])}")
        if expect_tokenizer is not None and meta["tokenizer_version"] != expect_tokenizer:
            raise ValueError(f"{self.folder} was tokenized with tokenizer version {meta['tokenizer_version']}, "
                             f"but the caller expects {expect_tokenizer}: tokenize the documents with "
                             "that tokenizer (or point at the matching tokenize output)")
        self.meta = meta
        self.dtype = np.dtype(meta["dtype"])
        self.vocab_size: int = meta["vocab_size"]
        self.eos_id: int = meta["eos_id"]
        self.tokenizer_version: str = meta["tokenizer_version"]
        info = meta["splits"][split]
        self.n_documents: int = info["documents"]
        self.n_bytes: int = info["bytes"]  # UTF-8 bytes of the text, for bits per byte

        self.shards: list[np.ndarray] = []
        for shard in info["shards"]:
            tokens = self._open_shard(shard)
            if len(tokens):
                self.shards.append(tokens)
        sizes = [len(s) for s in self.shards]
        # starts[j]: offset of shard j in the stream; the last entry is the total
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.n_tokens: int = int(self.starts[-1])
        if self.n_tokens != info["tokens"]:
            raise ValueError(f"{self.folder / META_FILE}: split {split} says {info['tokens']} tokens, "
                             f"its shards list {self.n_tokens}")

    def _open_shard(self, shard: dict) -> np.ndarray:
        base = self.folder / self.split / shard["name"]
        bin_path, idx_path = base.with_name(base.name + ".bin"), base.with_name(base.name + ".idx.npy")
        for p in (bin_path, idx_path):
            if not p.is_file():
                raise FileNotFoundError(f"{p} is listed in {self.folder / META_FILE} but missing: "
                                        "the tokenize output is incomplete; rerun the tokenize step")
        expected = shard["tokens"] * self.dtype.itemsize
        if bin_path.stat().st_size != expected:
            raise ValueError(f"{bin_path} has {bin_path.stat().st_size} bytes, but {META_FILE} says "
                             f"{shard['tokens']} {self.dtype.name} tokens ({expected} bytes): the shard "
                             "is truncated or from another run; rerun the tokenize step")
        n_docs = len(np.load(idx_path, mmap_mode="r"))
        if n_docs != shard["documents"]:
            raise ValueError(f"{idx_path} indexes {n_docs} documents, but {META_FILE} says "
                             f"{shard['documents']}: rerun the tokenize step")
        if shard["tokens"] == 0:
            return np.zeros(0, self.dtype)  # an empty file cannot be memory-mapped
        return np.memmap(bin_path, dtype=self.dtype, mode="r")

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.folder)!r}, {self.split!r}, tokens={self.n_tokens})"

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """tokens[start:stop] of the whole split, read across shard boundaries."""
        if not 0 <= start <= stop <= self.n_tokens:
            raise IndexError(f"tokens[{start}:{stop}] outside {self} ({self.n_tokens} tokens)")
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts, pos, j = [], start, first
        while pos < stop:
            shard_end = int(self.starts[j + 1])
            take = min(stop, shard_end) - pos
            local = pos - int(self.starts[j])
            parts.append(self.shards[j][local:local + take])
            pos += take
            j += 1
        if len(parts) == 1:
            return np.asarray(parts[0])
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def windows(self, seq_len: int) -> int:
        """Number of windows of `seq_len + 1` tokens starting at multiples of `seq_len`."""
        return max(0, (self.n_tokens - 1) // seq_len)

    def window(self, i: int, seq_len: int) -> np.ndarray:
        """tokens[i*T : i*T + T + 1]: inputs are the first T, targets the last T.

        A window may span document (and shard) boundaries; the EOS token between documents
        is an ordinary token in it, as in nanoGPT and GPT-2.
        """
        if not 0 <= i < self.windows(seq_len):
            raise IndexError(f"window {i} of length {seq_len}+1 outside {self} ({self.windows(seq_len)} windows)")
        return self.tokens(i * seq_len, i * seq_len + seq_len + 1)


def unigram_entropy(counts: np.ndarray) -> float:
    """Entropy in nats of a token-count histogram: the loss of the best model that ignores context."""
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def read_meta(folder: Path) -> dict:
    path = Path(folder) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {folder} is not a finished tokenize output. Point the "
                                "loader at <store>/tokenize/<version>, or run the tokenize step first")
    meta = json.loads(path.read_text())
    if (meta.get("format"), meta.get("format_version")) != (FORMAT, FORMAT_VERSION):
        raise ValueError(f"{path} is format {meta.get('format')!r} v{meta.get('format_version')}; this "
                         f"loader reads {FORMAT!r} v{FORMAT_VERSION}")
    return meta


def block_counts(weights: list[float], block_size: int) -> np.ndarray:
    """Samples per source in one block: weight * block_size, rounded so they sum to block_size.

    Largest remainder rounding, ties to the earlier source, so the counts are exact and stable.
    """
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * block_size
    counts = np.floor(exact).astype(np.int64)
    short = block_size - int(counts.sum())
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:short]] += 1
    return counts


def capped_weights(weights: list[float], capacity: list[int | None], samples: int, names: list[str]) -> list[float]:
    """The weights to mix with so that no source gives more than its `capacity` samples out of
    `samples`: a source the weights would overdraw gets exactly its capacity, and the remaining
    samples go to the others in proportion to their weights (water-filling, repeated until no
    source is over). Spreading the capped source evenly over the run keeps the mixture the same
    from the first step to the last, instead of exhausting the source early and shifting the
    mixture mid-run; the shares drawn are what the train step records."""
    fixed: dict[int, int] = {}
    while True:
        free = [s for s in range(len(weights)) if s not in fixed]
        left = samples - sum(fixed.values())
        if not free:
            if left > 0:
                raise ValueError(_exhausted(names, capacity, samples))
            break
        total = sum(weights[s] for s in free)
        over = [s for s in free if capacity[s] is not None and weights[s] / total * left > capacity[s]]
        if not over:
            break
        fixed.update({s: capacity[s] for s in over})
    if not fixed:
        return list(weights)
    left = samples - sum(fixed.values())
    total = sum(weights[s] for s in range(len(weights)) if s not in fixed)
    return [fixed[s] / samples if s in fixed else weights[s] / total * left / samples for s in range(len(weights))]


def _exhausted(names: list[str], capacity: list[int | None], samples: int) -> str:
    caps = ", ".join(f"{n}: {c}" for n, c in zip(names, capacity))
    return (f"the run draws {samples} windows, more than every source's max_epochs allows together ({caps} "
            "windows): raise a max_epochs, add a source without a cap, or train fewer tokens")


class BatchLoader:
    """Batches of `(batch_size, seq_len + 1)` int32 tokens from a weighted mixture of datasets.

    `batch(step)` is a pure function of (seed, step) and the sources; see the module docstring.
    A source of weight 0 is never sampled (it is there for validation only). Every sampled
    source must have been tokenized with the same tokenizer. `max_epochs` (one cap or None per
    source) needs the run's length in `steps`: the weights are then lowered where they would
    repeat a source past its cap (`capped_weights`), and a batch past `steps` that would go
    beyond a cap is refused.
    """

    def __init__(self, sources: list[tuple[TokenDataset, float]], batch_size: int, seq_len: int,
                 seed: int, block_size: int = 1024, max_epochs: list[float | None] | None = None,
                 steps: int | None = None, names: list[str] | None = None):
        if any(w < 0 for _, w in sources):
            raise ValueError(f"mixture weights must be >= 0, got {[w for _, w in sources]}")
        caps = list(max_epochs) if max_epochs is not None else [None] * len(sources)
        if len(caps) != len(sources):
            raise ValueError(f"max_epochs has {len(caps)} entries for {len(sources)} sources")
        if any(c is not None for c in caps) and steps is None:
            raise ValueError("a repetition cap (max_epochs) needs the run's length: pass steps")
        kept = [i for i, (_, w) in enumerate(sources) if w > 0]
        self.sources = [(sources[i][0], float(sources[i][1])) for i in kept]
        if not self.sources:
            raise ValueError("no source has a positive weight: nothing to train on")
        self.batch_size, self.seq_len, self.seed, self.block_size = batch_size, seq_len, seed, block_size
        self.steps = steps
        self.names = [names[i] if names else str(sources[i][0]) for i in kept]  # for errors
        self.n_windows = [ds.windows(seq_len) for ds, _ in self.sources]
        for (ds, _), n in zip(self.sources, self.n_windows):
            if n == 0:
                raise ValueError(f"{ds} has no window of {seq_len}+1 tokens: lower seq_len or add data")
        first = self.sources[0][0]
        for ds, _ in self.sources[1:]:
            if (ds.vocab_size, ds.eos_id, ds.tokenizer_version) != (first.vocab_size, first.eos_id,
                                                                    first.tokenizer_version):
                raise ValueError(f"{ds} and {first} were tokenized with different tokenizers "
                                 f"({ds.tokenizer_version} vs {first.tokenizer_version}): mix only "
                                 "datasets tokenized with the same one")
        self.vocab_size, self.eos_id = first.vocab_size, first.eos_id
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        # The most samples each source may give: max_epochs passes over its windows (None: no cap).
        self.capacity = [None if caps[i] is None else int(caps[i] * n) for i, n in zip(kept, self.n_windows)]
        weights = [w for _, w in self.sources]
        if steps is not None:
            weights = capped_weights(weights, self.capacity, steps * batch_size, self.names)
        self.counts = block_counts(weights, block_size)
        if steps is not None:
            self._fit_counts_to_caps(steps * batch_size)

    def _fit_counts_to_caps(self, samples: int) -> None:
        """Rounding a capped source's share to whole slots per block can leave it a sample or two
        over its cap in `samples`: move such slots, one at a time, to the uncapped source of the
        largest weight (or, with every source capped, the one furthest below its cap)."""
        for _ in range(self.block_size):  # each move shifts one slot of one block
            drawn = self.draws(samples)
            over = [s for s, cap in enumerate(self.capacity) if cap is not None and drawn[s] > cap]
            if not over:
                return
            room = [s for s, cap in enumerate(self.capacity) if s not in over
                    and (cap is None or drawn[s] < cap)]
            if not room:
                raise ValueError(_exhausted(self.names, self.capacity, samples))
            uncapped = [s for s in room if self.capacity[s] is None]
            to = (max(uncapped, key=lambda s: self.sources[s][1]) if uncapped
                  else max(room, key=lambda s: self.capacity[s] - drawn[s]))
            self.counts = self.counts.copy()
            self.counts[over[0]] -= 1
            self.counts[to] += 1
            self._blocks.clear()
        raise ValueError(_exhausted(self.names, self.capacity, samples))

    def _block(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """For block k: the source of each slot, and its rank among that source's slots."""
        if k not in self._blocks:
            rng = np.random.default_rng([self.seed, _BLOCK_STREAM, k])
            source = rng.permutation(np.repeat(np.arange(len(self.counts)), self.counts))
            rank = np.empty(self.block_size, dtype=np.int64)
            for s in range(len(self.counts)):
                slots = np.flatnonzero(source == s)
                rank[slots] = np.arange(len(slots))
            if len(self._blocks) >= 4:  # a batch touches at most a few consecutive blocks
                self._blocks.pop(next(iter(self._blocks)))
            self._blocks[k] = (source, rank)
        return self._blocks[k]

    def _permutation(self, s: int, epoch: int) -> np.ndarray:
        key = (s, epoch)
        if key not in self._perms:
            rng = np.random.default_rng([self.seed, _EPOCH_STREAM, s, epoch])
            if len(self._perms) >= 2 * len(self.sources):
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = rng.permutation(self.n_windows[s])
        return self._perms[key]

    def order(self, step: int) -> np.ndarray:
        """(batch_size, 2) int64: the (source index, window index) of each row of batch `step`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        out = np.empty((self.batch_size, 2), dtype=np.int64)
        for row, g in enumerate(range(step * self.batch_size, (step + 1) * self.batch_size)):
            k, j = divmod(g, self.block_size)
            source, rank = self._block(k)
            s = int(source[j])
            n = k * int(self.counts[s]) + int(rank[j])  # this source's n-th sample
            if self.capacity[s] is not None and n >= self.capacity[s]:
                raise ValueError(f"batch {step} would repeat {self.names[s]} past its max_epochs: this "
                                 f"mixture was planned for {self.steps} steps")
            epoch, pos = divmod(n, self.n_windows[s])
            out[row] = (s, self._permutation(s, epoch)[pos])
        return out

    def draws(self, samples: int) -> np.ndarray:
        """Windows drawn from each source in the first `samples` samples (`steps * batch_size`),
        counted from the blocks the order is made of: whole blocks, then the head of the next."""
        k, r = divmod(samples, self.block_size)
        source, _ = self._block(k)
        return k * self.counts + np.bincount(source[:r], minlength=len(self.counts))

    def batch(self, step: int) -> np.ndarray:
        """int32 (batch_size, seq_len + 1) tokens of batch `step`."""
        rows = [self.sources[s][0].window(int(w), self.seq_len) for s, w in self.order(step)]
        return np.stack(rows).astype(np.int32)

    def write_global_order(self, path: Path, steps: int) -> None:
        """Save the order of the first `steps` batches as an int64 .npy of shape (steps, B, 2).

        Entry [step, row] is (source index, window index); window w of a source is its tokens
        [w*T : w*T + T + 1]. Written by memory map, so memory stays small for long runs.
        """
        order = np.lib.format.open_memmap(Path(path), mode="w+", dtype=np.int64,
                                          shape=(steps, self.batch_size, 2))
        for step in range(steps):
            order[step] = self.order(step)
        order.flush()
        del order


def validation_batches(ds: TokenDataset, batch_size: int, seq_len: int, max_batches: int) -> list[np.ndarray]:
    """The first `max_batches` full batches of consecutive windows, in order, as int32.

    Consecutive windows share one token (the last target of one is the first input of the
    next), so every token after the first is predicted exactly once. A trailing partial batch
    is left out, so every batch has the same shape (one compiled eval step).
    """
    n = min(max_batches, ds.windows(seq_len) // batch_size)
    if n == 0:
        raise ValueError(f"{ds} has {ds.windows(seq_len)} windows of {seq_len}+1 tokens, fewer than one "
                         f"batch of {batch_size}: raise validation_fraction or lower batch_size/seq_len")
    return [np.stack([ds.window(b * batch_size + r, seq_len) for r in range(batch_size)]).astype(np.int32)
            for b in range(n)]


class MixtureInput(NamedTuple):
    """One source of a training mixture: a tokenize output folder on this machine, its weight
    (0: validation only) and its repetition cap in epochs (None: none)."""

    name: str
    folder: Path
    weight: float
    max_epochs: float | None = None


class MixtureData(NamedTuple):
    batch_at: Callable[[int], np.ndarray]  # step -> int32 (batch_size, seq_len + 1)
    val_batches: list[np.ndarray]
    drawn: dict[str, dict]  # per source: weight, tokens drawn over the run, share, epochs, validation batches


def open_mixture(sources: list[MixtureInput], batch_size: int, seq_len: int, seed: int, steps: int,
                 eval_batches: int) -> MixtureData:
    """The training data of a run of `steps` steps: batches mixed from the sources' train splits by
    weight (BatchLoader, with each source's max_epochs), validation batches from every source
    (taken in turn, one batch from each, up to `eval_batches`), and what the run draws from each
    source, for the train step's lineage. A source of weight 0 is never trained on, so all of it
    is held out: its validation batches come from its validation split, then its train split. A
    trained source whose validation split holds less than one batch is left out of validation
    (a small source may hold out no document at all); a weight-0 source must give one."""
    if eval_batches < len(sources):
        raise ValueError(f"eval_batches={eval_batches} is fewer than the mixture's {len(sources)} sources: "
                         "raise train.eval_batches so that each source gets a validation batch")
    loader = BatchLoader([(TokenDataset(s.folder, "train"), s.weight) for s in sources], batch_size, seq_len,
                         seed, max_epochs=[s.max_epochs for s in sources], steps=steps,
                         names=[s.name for s in sources])
    val = [_held_out_batches(s, batch_size, seq_len, eval_batches) for s in sources]  # up to all, if others have none
    if not any(val):
        raise ValueError(f"no source's validation split holds one batch of {batch_size} windows of {seq_len}+1 "
                         "tokens: raise validation_fraction or lower batch_size/seq_len")
    turns = [(s.name, batches[i]) for i in range(eval_batches) for s, batches in zip(sources, val) if i < len(batches)]
    turns = turns[:eval_batches]
    samples = steps * batch_size
    trained = [s.name for s in sources if s.weight > 0]  # the loader's sources, in its order
    windows = dict(zip(trained, zip(loader.draws(samples).tolist(), loader.n_windows)))
    drawn = {}
    for s in sources:
        n, total = windows.get(s.name, (0, 0))
        drawn[s.name] = {"weight": s.weight, "tokens": n * seq_len, "share": round(n / samples, 6),
                         "epochs": round(n / total, 4) if total else 0.0,
                         "validation_batches": sum(name == s.name for name, _ in turns)}
    return MixtureData(loader.batch, [batch for _, batch in turns], drawn)


def _held_out_batches(source: MixtureInput, batch_size: int, seq_len: int, n: int) -> list[np.ndarray]:
    """Up to `n` validation batches of one source: its validation split's, then (weight 0 only)
    its train split's; none when there is not one full batch, which is an error naming a source of
    weight 0 (it is there to be validated on)."""
    splits = ["validation"] if source.weight > 0 else ["validation", "train"]
    batches: list[np.ndarray] = []
    for split in splits:
        ds = TokenDataset(source.folder, split)
        if len(batches) < n and ds.windows(seq_len) >= batch_size:
            batches += validation_batches(ds, batch_size, seq_len, n - len(batches))
    if not batches and source.weight == 0:
        raise ValueError(f"source {source.name} (weight 0: validation only) holds fewer than one batch of "
                         f"{batch_size} windows of {seq_len}+1 tokens: give it more documents or lower "
                         "batch_size/seq_len")
    return batches
