"""`kiln serve-model`'s prefix cache: the keys and values of prompts' leading tokens, kept so that a
later prompt that starts the same way (a few-shot context lm-eval sends with every question, a
chat's system prompt, a conversation's earlier turns) prefills only what follows them (vLLM's
automatic prefix caching). The host side: which blocks are kept, and where.

A prompt is cut into blocks of BLOCK tokens; block j is named by a hash of every token up to its
end (so one name means one whole prefix), and its keys and values, every layer's, sit in one row
of a pool on the device, `[blocks, layers, 2, BLOCK, kv heads, head width]`. Admitting prompts
(evaluation/slots.py's `admit`) reads each prompt's longest run of cached leading blocks from the
pool, prefills the rest over them, and writes the prompt's new whole blocks into the rows `plan`
claimed for them, in the same compiled call. The least recently used blocks make room for new
ones; a prefix's first blocks are used more recently than its later ones, so a long prefix loses
its tail first, never its head.

An answer's blocks are kept too, when it ends (`keep`: its prompt and the tokens fed back to the
model, whose keys and values its slot holds), so that a conversation's next turn, which sends
the answer back inside its prompt, prefills only the new message (where the answer's tokens are
the ones its text tokenizes to; models with sliding-window layers keep only prompts' blocks:
their slots hold a ring of the window, not every column). A prompt reuses at most its length
less one token, so that its last token is always prefilled (its hidden state gives the first
token drawn). Keys and values from the cache were computed in another prompt's prefill, in a
batch of other shapes: the same numbers up to float rounding, as prompts batched together are
(docs/serving.md says what that means for `seed`). LongRoPE picks its frequencies by a prompt's
length, so its blocks are named with that choice too: a prompt within the original context never
reuses one computed in a longer prompt, nor the other way. No Prefect, no threads here: the
scheduler's thread is its only user.
"""

from __future__ import annotations

import collections
import hashlib
import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from evaluation.scoring import bucket_for, buckets
from training.config import LongRopeScaling, ModelConfig

BLOCK = 32  # tokens per block: the granularity of reuse (a prefix is reused in whole blocks)
NOWHERE = np.iinfo(np.int32).max  # a pool row written nowhere (past the last: `admit` drops it)


def default_prefix_tokens(cfg: ModelConfig, slots: int) -> int:
    """The prefix cache's default size: as many tokens as `slots` whole contexts, so that what is
    kept for reuse takes about what the slots' own cache does (less, for sliding layers' rings);
    none where a context is too short for a prompt to reuse a block."""
    return slots * cfg.seq_len if cfg.seq_len > BLOCK + 1 else 0


def pool_bytes(cfg: ModelConfig, tokens: int) -> int:
    """The bytes of the pool of a prefix cache of `tokens` tokens (whole blocks, every layer's keys and values)."""
    block = cfg.n_layers * 2 * BLOCK * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize
    return tokens // BLOCK * block


@dataclass(frozen=True)
class Plan:
    """How prompts [m] are admitted over the cache: prompt i's first done[i] tokens come from pool
    rows read[i] (blocks in order; None where no prompt has a cached block), `tokens` [m, Lp] being
    those tokens (zeros past done[i]: the repetition penalty's record of the prompt); the rest is
    prefilled in `width` columns; and its whole blocks go to pool rows write[i] (block j at
    write[i, j]; NOWHERE where a block is cached already or not whole)."""

    done: np.ndarray
    read: np.ndarray | None
    tokens: np.ndarray | None
    width: int
    write: np.ndarray

    def arrays(self, rows: int) -> dict[str, np.ndarray]:
        """The plan as `admit` takes it, for `rows` rows (those past the prompts: padding rows that
        read nothing and write nowhere)."""
        pad = rows - len(self.done)
        out = {"done": np.pad(self.done, (0, pad)), "write": np.pad(self.write, ((0, pad), (0, 0)),
                                                                    constant_values=NOWHERE)}
        if self.read is not None:
            out["read"] = np.pad(self.read, ((0, pad), (0, 0)))
            out["tokens"] = np.pad(self.tokens, ((0, pad), (0, 0)))
        return out


class PrefixCache:
    def __init__(self, cfg: ModelConfig, tokens: int):
        """Room for `tokens` prompt tokens' keys and values (in whole blocks), allocated on first use."""
        self.cfg, self.size = cfg, tokens // BLOCK
        if self.size < 1:
            raise ValueError(f"a prefix cache of {tokens} tokens holds no block of {BLOCK}: give at least {BLOCK} "
                             "tokens, or 0 for none")
        scaling = cfg.rope_scaling
        self.long_from = scaling.original_max_position_embeddings if isinstance(scaling, LongRopeScaling) else None
        self.where: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # least recently used first
        self.free = list(range(self.size - 1, -1, -1))
        self.pool = None  # [size, layers, 2, BLOCK, kv heads, head width], made at the first admission
        self.columns = buckets(cfg.seq_len)
        self.blocks = buckets(math.ceil(cfg.seq_len / BLOCK), smallest=1)

    def names(self, prompt: list[int]) -> list[bytes]:
        """The name of each whole block of `prompt`: a hash of its tokens and every block's before it."""
        long = self.long_from is not None and len(prompt) - 1 >= self.long_from
        name, out = b"long" if long else b"", []
        ids = np.asarray(prompt, np.int32)
        for j in range(len(prompt) // BLOCK):
            name = hashlib.blake2b(name + ids[j * BLOCK:(j + 1) * BLOCK].tobytes(), digest_size=16).digest()
            out.append(name)
        return out

    def plan(self, prompts: list[list[int]]) -> Plan:
        """Find each prompt's cached leading blocks and claim pool rows for its new ones (`Plan`).
        The rows read or written here are not given to another block in the same plan."""
        if self.pool is None:
            self.pool = jnp.zeros((self.size, self.cfg.n_layers, 2, BLOCK, self.cfg.n_kv_heads, self.cfg.head_dim),
                                  self.cfg.compute_dtype)
        names = [self.names(p) for p in prompts]
        found = []
        for prompt, chain in zip(prompts, names):
            rows = []
            for name in chain[:(len(prompt) - 1) // BLOCK]:
                if name not in self.where:
                    break
                rows.append(self.where[name])
            found.append(rows)
            self._touch(chain[:len(rows)])
        done = np.array([len(rows) * BLOCK for rows in found], np.int32)
        width = bucket_for(max(len(p) - d for p, d in zip(prompts, done)), self.columns)
        read = tokens = None
        if done.any():
            n = bucket_for(max(len(rows) for rows in found), self.blocks)
            read, tokens = np.zeros((len(prompts), n), np.int32), np.zeros((len(prompts), n * BLOCK), np.int32)
            for i, (prompt, rows) in enumerate(zip(prompts, found)):
                read[i, :len(rows)] = rows
                tokens[i, :done[i]] = prompt[:done[i]]
        columns = min((0 if read is None else read.shape[1] * BLOCK) + width, self.cfg.seq_len)
        write = np.full((len(prompts), math.ceil(columns / BLOCK)), NOWHERE, np.int32)
        held = {name for chain, rows in zip(names, found) for name in chain[:len(rows)]}
        for i, chain in enumerate(names):
            for j in range(len(found[i]), len(chain)):
                if chain[j] in self.where:
                    continue
                row = self._room(held)
                if row is None:  # every row is in use by this plan
                    break
                self.where[chain[j]] = write[i, j] = row
                held.add(chain[j])
        for chain in names:
            self._touch([name for name in chain if name in self.where])
        return Plan(done, read, tokens, width, write)

    def shared_new(self, prompts: list[list[int]]) -> int | None:
        """The first of `prompts` whose first reusable block another of them starts with too and
        the cache lacks (admitted first, it leaves the block for the others to find), or None."""
        firsts = [self.names(p)[:1] if len(p) > BLOCK else [] for p in prompts]  # LongRoPE: named by the whole
        counts = collections.Counter(name for chain in firsts for name in chain)
        return next((i for i, chain in enumerate(firsts)
                     if chain and counts[chain[0]] > 1 and chain[0] not in self.where), None)

    def keep(self, fed: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """Claim pool rows for the whole blocks of `fed` that the pool lacks: a finished answer's
        prompt and the tokens fed back to the model after it (all but its last), whose keys and
        values its slot holds. -> (their block numbers, pool rows), padded to a bucket of
        `self.blocks` (block 0 to row NOWHERE), or None where nothing is new. A LongRoPE answer
        that reached past the original context is not kept: its keys mix both frequency sets."""
        if self.pool is None or (self.long_from is not None and len(fed) - 1 >= self.long_from):
            return None
        chain = self.names(fed)
        held = set(chain)
        self._touch([name for name in chain if name in self.where])  # the least recently used is another's
        blocks, rows = [], []
        for j, name in enumerate(chain):
            if name in self.where:
                continue
            row = self._room(held)
            if row is None:
                break
            self.where[name] = row
            blocks.append(j)
            rows.append(row)
        if not blocks:
            return None
        self._touch([name for name in chain if name in self.where])
        n = bucket_for(len(blocks), self.blocks)
        return (np.pad(np.asarray(blocks, np.int32), (0, n - len(blocks))),
                np.pad(np.asarray(rows, np.int32), (0, n - len(rows)), constant_values=NOWHERE))

    def _touch(self, chain: list[bytes]) -> None:
        """Mark a prefix's blocks used now, its first block last of all (the last to be dropped)."""
        for name in reversed(chain):
            self.where.move_to_end(name)

    def _room(self, held: set[bytes]) -> int | None:
        """A free pool row: an unused one, or the least recently used block's (unless this plan holds it)."""
        if self.free:
            return self.free.pop()
        name = next(iter(self.where))
        if name in held:
            return None
        return self.where.pop(name)

    def forget(self) -> None:
        """Drop every block (an admission failed: what the pool holds is not known)."""
        self.where.clear()
        self.free = list(range(self.size - 1, -1, -1))
        self.pool = None
