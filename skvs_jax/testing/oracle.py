"""The KV layer's oracles in plain Python, written to be obviously right: `OracleAllocator` (the exact semantics
of `skvs_jax.kv.allocator`) and `OraclePrefixIndex` (an ideal prefix index, a dict from token prefixes to blocks).

Per-block lists and per-sequence lists, one sequence at a time, one block at a time: no vectorisation to get
wrong. It is the oracle the property tests compare the JAX allocator against (block ids, stacks, states, ref
counts, counters must agree exactly), and the baseline the allocator micro-benchmark times. Its shape follows
the article's `SpecAwareAllocator`.

The batched rules it spells out sequentially (see the allocator's module docstring): decisions use the state
at call entry; sequences are served in `order`; once one that needs blocks does not fit, no later one that
needs blocks is served; pops come off the top of a stack; blocks released by a call are pushed after all its
pops, in row-major (slot, column) order.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from skvs_jax.arrays import cdiv
from skvs_jax.config import NULL_BLOCK, CacheConfig, SpecConfig
from skvs_jax.kv.allocator import FREE, RESERVED, SPECULATIVE, STALE, VALIDATED


@dataclasses.dataclass
class OracleAllocator:
    cfg: CacheConfig
    spec: SpecConfig = SpecConfig()

    def __post_init__(self) -> None:
        n, b = self.cfg.num_blocks, self.cfg.max_seqs
        self.state = [FREE] * n
        self.state[NULL_BLOCK] = VALIDATED
        self.ref = [0] * n
        self.generation = [0] * n
        self.cached = [False] * n
        self.last_used = [0] * n
        self.free_stack = list(range(n - 1, 0, -1))  # top of stack = end of list
        self.pool = []
        self.clock = 0
        self.tables: list[list[int]] = [[] for _ in range(b)]
        self.committed = [0] * b
        self.allocated = [0] * b
        self.drafts = [0] * b
        self.counters = dict(
            alloc_failures=0,
            spec_blocks_allocated=0,
            spec_pool_hits=0,
            spec_blocks_wasted=0,
            spec_blocks_reclaimed=0,
            cow_copies=0,
            evictions=0,
        )

    # ------------------------------------------------------------------------------------------ helpers

    def _release(self, blk: int) -> None:
        """blk's ref count just reached 0: route it to the evictable set, the pool or the free stack."""
        if self.cached[blk]:
            self.last_used[blk] = self.clock
        elif (
            self.state[blk] in (SPECULATIVE, STALE)
            and self.spec.use_spec_pool
            and len(self.pool) < self.cfg.pool_capacity
        ):
            self.state[blk] = STALE
            self.pool.append(blk)
        else:
            self.state[blk] = FREE
            self.free_stack.append(blk)

    def _available(self) -> int:
        return len(self.free_stack) + (len(self.pool) if self.spec.use_spec_pool else 0)

    def _pop(self, pool_first: bool) -> tuple[int, bool]:
        """Take one block; returns (id, came_from_pool)."""
        if self.spec.use_spec_pool and pool_first and self.pool:
            return self.pool.pop(), True
        if self.free_stack:
            return self.free_stack.pop(), False
        return self.pool.pop(), True

    # ------------------------------------------------------------------------------------- transitions

    def allocate(self, num_tokens, order=None, *, speculative=False, generation=0, window=None):
        """Returns (ok, cow_pairs) with ok: list[bool] and cow_pairs: list[(src, dst)] per slot."""
        ok, cow_pairs, cowed_old = self._grow(num_tokens, order, speculative, generation, window, None)
        self._release_copied(cow_pairs, cowed_old)
        return ok, cow_pairs

    def allocate_step(self, num_tokens, num_drafts, generation, order=None, *, window=None):
        """`allocate(num_tokens)` (over the whole table) and `allocate_speculative(num_drafts, window=window)` as
        one transition: a row's drafts ride on its slots (refused unless its slot request was granted and
        nonzero), and the blocks the slots copied away are released after both have popped. Returns (ok,
        cow_pairs, draft_ok)."""
        ok, cow_pairs, cowed_old = self._grow(num_tokens, order, False, 0, None, None)
        refuse = [not (ok[b] and int(num_tokens[b]) > 0) for b in range(self.cfg.max_seqs)]
        draft_ok, draft_pairs, _ = self._grow(num_drafts, order, True, generation, window, refuse)
        assert all(p[0] == NULL_BLOCK for p in draft_pairs), "drafts on granted slots never copy"
        self._release_copied(cow_pairs, cowed_old)
        return ok, cow_pairs, draft_ok

    def _release_copied(self, cow_pairs, cowed_old) -> None:
        for b in range(self.cfg.max_seqs):  # released after all pops, at the last slot that copied the block
            old = cow_pairs[b][0]
            if old != NULL_BLOCK and self.ref[old] == 0 and cowed_old[old] == b:
                self._release(old)

    def _grow(self, num_tokens, order, speculative, generation, window, refuse):
        """allocate's pops and writes, its copied blocks not yet released; refuse: rows refused outright."""
        s, m = self.cfg.block_size, self.cfg.max_blocks_per_seq
        window = window or m
        num_seqs = self.cfg.max_seqs
        order = list(range(num_seqs)) if order is None else list(order)
        ok = [True] * num_seqs
        cow_pairs = [(NULL_BLOCK, NULL_BLOCK)] * num_seqs
        # Copy-on-write decisions use the ref counts at call entry.
        cow = []
        for b in range(num_seqs):
            alloc = self.allocated[b]
            blk = self.tables[b][alloc // s] if alloc % s else NULL_BLOCK
            cow.append(alloc % s != 0 and (self.ref[blk] > 1 or self.cached[blk]))
        cowed_old: dict[int, int] = {}  # old block -> last slot that copied it
        remaining = self._available()
        stopped = False
        for b in order:
            n = int(num_tokens[b])
            if n == 0:
                continue
            alloc, table = self.allocated[b], self.tables[b]
            new_alloc = alloc + n
            bad = n < 0 or new_alloc > m * s or cdiv(new_alloc, s) - alloc // s > window
            bad = bad or (self.drafts[b] + n > self.spec.draft_len if speculative else self.drafts[b] > 0)
            bad = bad or (refuse is not None and refuse[b])
            need = max(0, cdiv(new_alloc, s) - len(table)) + int(cow[b])
            if bad or (need > 0 and (stopped or need > remaining)):
                ok[b] = False
                self.counters["alloc_failures"] += 1
                stopped = stopped or not bad
                continue
            remaining -= need
            if cow[b]:
                old = table[alloc // s]
                new, _ = self._pop(pool_first=speculative)
                table[alloc // s] = new
                self.ref[new], self.state[new] = 1, VALIDATED
                self.ref[old] -= 1
                cowed_old[old] = b
                cow_pairs[b] = (old, new)
                self.counters["cow_copies"] += 1
            fresh = SPECULATIVE if speculative else RESERVED
            for col in range(cdiv(alloc, s), cdiv(new_alloc, s)):
                if col < len(table):  # a block this sequence still holds (lazy release): reuse in place
                    blk = table[col]
                else:
                    blk, from_pool = self._pop(pool_first=speculative)
                    table.append(blk)
                    self.ref[blk] = 1
                    if speculative and from_pool:
                        self.counters["spec_pool_hits"] += 1
                self.state[blk] = fresh
                if speculative:
                    self.generation[blk] = int(generation)
                    self.counters["spec_blocks_allocated"] += 1
            self.allocated[b] = new_alloc
            if speculative:
                self.drafts[b] += n
        return ok, cow_pairs, cowed_old

    def allocate_speculative(self, num_drafts, generation, order=None, *, window=None):
        return self.allocate(num_drafts, order, speculative=True, generation=generation, window=window)

    def commit(self, num_accepted, window=None):
        s = self.cfg.block_size
        window = min(window or self.cfg.max_blocks_per_seq, self.cfg.max_blocks_per_seq)
        ok, released = [], 0
        for b in range(self.cfg.max_seqs):
            table = self.tables[b]
            if len(table) - self.committed[b] // s > window:  # outside the window: untouched, flagged
                ok.append(False)
                continue
            pending = self.allocated[b] - self.committed[b]
            acc = int(num_accepted[b])
            ok.append(0 <= acc <= pending)
            acc = min(max(acc, 0), pending)
            old_committed = self.committed[b]
            self.committed[b] = self.allocated[b] = old_committed + acc
            self.drafts[b] = 0
            keep = cdiv(self.committed[b], s)
            for col in range(old_committed // s, min(keep, len(table))):
                self.state[table[col]] = VALIDATED
            for col in range(keep, len(table)):
                if self.state[table[col]] == SPECULATIVE:
                    self.counters["spec_blocks_wasted"] += 1
                self.state[table[col]] = STALE
            if self.spec.release == "immediate":
                for blk in table[keep:]:
                    self.ref[blk] -= 1
                    assert self.ref[blk] == 0, "a block past the committed prefix is never shared"
                    assert not self.cached[blk], "nor pinned: it holds no committed token (commit_unchecked: unpinned)"
                    self._release(blk)
                    released += 1
                del table[keep:]
        return ok, released

    def free(self, seq_mask):
        released = 0
        for b in range(self.cfg.max_seqs):
            if not seq_mask[b]:
                continue
            for blk in self.tables[b]:
                self.ref[blk] -= 1
                if self.ref[blk] == 0:
                    self._release(blk)
                    released += 1
            self.tables[b] = []
            self.committed[b] = self.allocated[b] = self.drafts[b] = 0
        self.clock += 1
        return released

    def share(self, block_ids, num_tokens):
        s, n = self.cfg.block_size, self.cfg.num_blocks
        ok = [True] * self.cfg.max_seqs
        plans = []
        for b in range(self.cfg.max_seqs):
            tokens = int(num_tokens[b])
            if tokens == 0:
                continue
            ids = [int(x) for x in block_ids[b][: cdiv(max(tokens, 0), s)]]
            good = all(
                1 <= i < n and self.state[i] == VALIDATED and (self.ref[i] > 0 or self.cached[i]) for i in ids
            )
            empty = not self.tables[b] and self.allocated[b] == 0
            ok[b] = tokens > 0 and good and empty and tokens <= self.cfg.max_tokens_per_seq
            if ok[b]:
                plans.append((b, ids, tokens))
        for b, ids, tokens in plans:
            for i in ids:
                self.ref[i] += 1
            self.tables[b] = list(ids)
            self.committed[b] = self.allocated[b] = tokens
        return ok

    def fork(self, parent):
        s = self.cfg.block_size
        num_seqs = self.cfg.max_seqs
        ids = [[NULL_BLOCK] * self.cfg.max_blocks_per_seq for _ in range(num_seqs)]
        tokens = [0] * num_seqs
        valid = [True] * num_seqs
        for b in range(num_seqs):
            p = int(parent[b])
            if p < 0:
                continue
            valid[b] = (
                p != b
                and self.allocated[p] == self.committed[p]
                and int(parent[p]) < 0
                and self.committed[p] > 0
            )
            if valid[b]:
                tokens[b] = self.committed[p]
                ids[b][: cdiv(tokens[b], s)] = self.tables[p][: cdiv(tokens[b], s)]
        ok = self.share(ids, tokens)
        return [ok[b] and valid[b] if int(parent[b]) >= 0 else True for b in range(num_seqs)]

    def reclaim_expired(self, current_generation, threshold):
        kept, count = [], 0
        for blk in self.pool:  # bottom to top
            if int(current_generation) - self.generation[blk] > int(threshold):
                self.state[blk] = FREE
                self.free_stack.append(blk)
                count += 1
            else:
                kept.append(blk)
        self.pool = kept
        self.counters["spec_blocks_reclaimed"] += count
        return count

    def set_cached(self, block_ids, cached):
        n = self.cfg.num_blocks
        was_cached = list(self.cached)
        entry_state, entry_ref = list(self.state), list(self.ref)
        for i, c in zip(block_ids, cached):
            i = int(i)
            if 0 < i < n and c and entry_state[i] == VALIDATED and entry_ref[i] > 0:
                self.cached[i] = True
        orphans = []
        for i, c in zip(block_ids, cached):
            i = int(i)
            if 0 < i < n and not c and was_cached[i]:
                self.cached[i] = False
                if self.ref[i] == 0 and i not in orphans:
                    orphans.append(i)
        for i in orphans:
            self.state[i] = FREE
            self.free_stack.append(i)

    def evict_lru(self, num_blocks, max_evict):
        evictable = [i for i in range(self.cfg.num_blocks) if self.cached[i] and self.ref[i] == 0]
        evictable.sort(key=lambda i: (self.last_used[i], i))
        return self.evict(evictable[: min(int(num_blocks), max_evict)])

    def evict(self, evicted):
        """Evict these evictable blocks, in this order (pushed to the free stack in it)."""
        for i in evicted:
            self.cached[i] = False
            self.state[i] = FREE
            self.free_stack.append(i)
        self.clock += 1
        self.counters["evictions"] += len(evicted)
        return evicted


class OraclePrefixIndex:
    """The ideal prefix index: (salt, prefix) -> block id, prefix-closed. A key is the tuple (salt, *tokens) of a
    whole number of blocks: a request's cache salt (0 = none) comes first, so requests with different salts
    never reach each other's entries.

    Agrees with `prefix_cache` whenever the table refuses nothing (no key collision, no full bucket), which a
    64-bit key and a table at most half full make the practical case.
    """

    def __init__(self, block_size: int, max_blocks: int):
        self.s, self.m = block_size, max_blocks
        self.index: dict[tuple[int, ...], int] = {}

    def key(self, row, num_blocks: int, salt: int = 0) -> tuple[int, ...]:
        return (int(salt), *(int(t) for t in row[: num_blocks * self.s]))

    def matched(self, row, salt: int = 0) -> int:
        j = 0
        while j < min(len(row) // self.s, self.m) and self.key(row, j + 1, salt) in self.index:
            j += 1
        return j

    def lookup(self, row, length: int, window: int, ratio: float, salt: int = 0) -> tuple[int, list[int]]:
        """(shared blocks after the barrier, their ids)."""
        s = self.s
        matched = min(self.matched(row, salt), max(length - 1, 0) // s)
        buffer = max(1, int(np.floor(np.float32(ratio) * np.float32(window))) // s) if window > 0 else 0
        shared = max(0, matched - buffer)
        return shared, [self.index[self.key(row, j + 1, salt)] for j in range(shared)]

    def insert(self, rows, num_validated, tables, salts=None) -> list[list[int]]:
        """Index every whole validated block not indexed yet (under each row's salt, default 0); returns each
        row's newly indexed ids."""
        new = []
        salts = [0] * len(rows) if salts is None else salts
        for row, nv, table, salt in zip(rows, num_validated, tables, salts):
            ids = []
            for j in range(min(nv // self.s, len(row) // self.s, self.m)):
                prefix = self.key(row, j + 1, salt)
                if prefix not in self.index:
                    self.index[prefix] = int(table[j])
                    ids.append((j, int(table[j])))
            new.append(ids)
        return new

    def remove(self, ids) -> list[int]:
        """Drop the entries of ids and every entry below them; returns the descendants' ids, sorted."""
        ids = {int(i) for i in ids if i > 0}
        gone = {p for p, blk in self.index.items() if blk in ids}
        for p in sorted(self.index, key=len):
            if len(p) > 1 + self.s and p[: -self.s] in gone:  # a key is (salt, *tokens): its parent is one block less
                gone.add(p)
        descendants = sorted(self.index[p] for p in gone if self.index[p] not in ids)
        for p in gone:
            del self.index[p]
        return descendants


def leaves_first(alloc: OracleAllocator, index: OraclePrefixIndex) -> list[int]:
    """The evictable blocks in the order the KV manager evicts them (`kv.manager.eviction_order`), read off the
    prefixes: an entry's subtree is every entry whose prefix extends its own; its recency is the latest over the
    subtree (the release time, or infinity for a block a sequence holds), its height the most blocks by which
    a prefix in the subtree is longer; blocks go by (recency, height, id). Keys are (salt, *tokens), so a
    subtree never crosses salts."""
    def recency(blk: int) -> float:
        return alloc.last_used[blk] if alloc.ref[blk] == 0 else math.inf

    entries = list(index.index.items())
    keys = []
    for p, blk in entries:
        if alloc.cached[blk] and alloc.ref[blk] == 0:
            below = [(q, c) for q, c in entries if q[: len(p)] == p]  # itself and its descendants
            keys.append((max(recency(c) for _, c in below), max(len(q) - len(p) for q, _ in below) // index.s, blk))
    return [blk for *_, blk in sorted(keys)]
