"""Property-testing kit for the allocator: invariant checker, oracle comparison, abstract operations.

The hypothesis strategies that draw operations live in `skvs_jax.testing.strategies`.

Public so that researchers can property-test their own policies the way our tests do:

    from hypothesis import given, strategies as hs
    from skvs_jax import testing

    @given(testing.cache_configs(), testing.spec_configs(), hs.data())
    def test_my_policy(cfg, spec, data):
        ops = data.draw(testing.operation_sequences(cfg, spec, max_size=40))
        testing.run_sequence(ops, cfg, spec)   # invariants + exact oracle agreement after every step

Operations are small frozen dataclasses with *abstract* parameters (e.g. "accept up to 3 of the pending
tokens") that `apply` turns into concrete arguments from the oracle's current state, so a pre-drawn sequence
stays meaningful whatever happened before it. Every transition is exercised; invalid-looking requests (too
long, no room) are drawn on purpose, since refusing them correctly is part of the contract.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from skvs_jax.arrays import i32
from skvs_jax.config import NULL_BLOCK, CacheConfig, SpecConfig
from skvs_jax.kv import allocator, prefix_cache
from skvs_jax.kv.allocator import FREE, RESERVED, SPECULATIVE, STALE, VALIDATED, AllocatorState
from skvs_jax.testing.oracle import OracleAllocator

# ------------------------------------------------------------------------------------------ invariants


def check_invariants(st: AllocatorState, cfg: CacheConfig, spec: SpecConfig) -> None:
    """Assert every structural invariant of a concrete allocator state; the message says which broke."""
    n, s = cfg.num_blocks, cfg.block_size
    state = np.asarray(st.blocks.state)
    ref = np.asarray(st.blocks.ref_count)
    cached = np.asarray(st.blocks.cached)
    free = np.asarray(st.blocks.free_stack)[: int(st.blocks.free_top)]
    pool = np.asarray(st.blocks.pool_stack)[: int(st.blocks.pool_top)]
    table = np.asarray(st.seqs.block_table)
    num_blocks = np.asarray(st.seqs.num_blocks)
    committed = np.asarray(st.seqs.num_committed)
    allocated = np.asarray(st.seqs.num_allocated)
    drafts = np.asarray(st.seqs.num_drafts)

    # Table references and ref counts.
    col = np.arange(cfg.max_blocks_per_seq)[None, :]
    live = col < num_blocks[:, None]
    assert (table[~live] == NULL_BLOCK).all(), "dead table entries must point at the null block"
    assert ((table[live] >= 1) & (table[live] < n)).all(), "live table entries must be real blocks"
    refs = np.bincount(table[live], minlength=n)
    assert (refs == ref).all(), f"ref_count != table references at blocks {np.nonzero(refs != ref)[0][:8]}"

    # Exactly one owner per usable block.
    owners = np.zeros(n, np.int64)
    np.add.at(owners, free, 1)
    np.add.at(owners, pool, 1)
    evictable = cached & (ref == 0)
    owners += evictable + (ref > 0)
    assert owners[NULL_BLOCK] == 0 and ref[NULL_BLOCK] == 0, "the null block must never be owned"
    bad = np.nonzero(owners[1:] != 1)[0] + 1
    assert bad.size == 0, f"blocks {bad[:8]} have {owners[bad[:8]]} owners (want exactly 1)"
    assert len(free) + len(pool) + int(evictable.sum()) + int((ref > 0).sum()) == n - 1
    assert len(pool) <= cfg.pool_capacity
    if not spec.use_spec_pool:
        assert len(pool) == 0, "the speculative pool is disabled but holds blocks"

    # States agree with owners.
    assert (state[free] == FREE).all(), "free-stack blocks must be FREE"
    assert (state[pool] == STALE).all(), "speculative-pool blocks must be STALE"
    assert (state[evictable] == VALIDATED).all(), "evictable cached blocks must be VALIDATED"
    assert (state[cached] == VALIDATED).all(), "the prefix cache may only pin validated blocks"
    used = ref > 0
    assert np.isin(state[used], [RESERVED, SPECULATIVE, VALIDATED, STALE]).all()

    # Lengths.
    assert (committed <= allocated).all() and (allocated <= num_blocks * s).all()
    assert (num_blocks >= -(-allocated // s)).all()
    assert (drafts >= 0).all() and (drafts <= spec.draft_len).all() and (drafts <= allocated - committed).all()
    if spec.release == "immediate":
        assert (num_blocks == -(-allocated // s)).all(), "immediate release keeps no block past the slots"
    full = col < (committed // s)[:, None]
    assert (state[table[full]] == VALIDATED).all(), "blocks full of committed tokens must be VALIDATED"

    # Speculative memory is bounded.
    per_seq = ((state[table] == SPECULATIVE) & live).sum(axis=1)
    bound = spec.max_spec_blocks_per_seq(s)
    assert (per_seq <= bound).all(), f"a sequence holds {per_seq.max()} speculative blocks > ceil(K/S) = {bound}"
    active = int(((num_blocks > 0) | (allocated > 0)).sum())
    assert int((state == SPECULATIVE).sum()) <= active * bound


def assert_no_leak(st: AllocatorState, cfg: CacheConfig) -> None:
    """After every sequence is freed: every usable block is free, in the pool, or cached and evictable."""
    ref = np.asarray(st.blocks.ref_count)
    assert (ref == 0).all(), f"blocks {np.nonzero(ref)[0][:8]} still referenced after freeing everything"
    evictable = int(np.asarray(st.blocks.cached).sum())
    assert int(st.blocks.free_top) + int(st.blocks.pool_top) + evictable == cfg.num_blocks - 1


def assert_matches_oracle(st: AllocatorState, oracle: OracleAllocator) -> None:
    """The JAX state and the oracle agree on every block, stack, table, length and counter."""
    cfg = oracle.cfg
    np.testing.assert_array_equal(np.asarray(st.blocks.state), oracle.state, err_msg="block states")
    np.testing.assert_array_equal(np.asarray(st.blocks.ref_count), oracle.ref, err_msg="ref counts")
    np.testing.assert_array_equal(np.asarray(st.blocks.cached), oracle.cached, err_msg="cached flags")
    np.testing.assert_array_equal(
        np.asarray(st.blocks.free_stack)[: int(st.blocks.free_top)], oracle.free_stack, err_msg="free stack"
    )
    np.testing.assert_array_equal(
        np.asarray(st.blocks.pool_stack)[: int(st.blocks.pool_top)], oracle.pool, err_msg="speculative pool"
    )
    pool = np.asarray(oracle.pool, np.int64)
    np.testing.assert_array_equal(
        np.asarray(st.blocks.generation)[pool], np.asarray(oracle.generation)[pool], err_msg="pool generations"
    )
    evictable = np.asarray(oracle.cached) & (np.asarray(oracle.ref) == 0)
    np.testing.assert_array_equal(
        np.asarray(st.blocks.last_used)[evictable], np.asarray(oracle.last_used)[evictable], err_msg="LRU keys"
    )
    assert int(st.blocks.clock) == oracle.clock
    table = np.full((cfg.max_seqs, cfg.max_blocks_per_seq), NULL_BLOCK)
    for b, row in enumerate(oracle.tables):
        table[b, : len(row)] = row
    np.testing.assert_array_equal(np.asarray(st.seqs.block_table), table, err_msg="block tables")
    np.testing.assert_array_equal(np.asarray(st.seqs.num_blocks), [len(t) for t in oracle.tables])
    np.testing.assert_array_equal(np.asarray(st.seqs.num_committed), oracle.committed, err_msg="committed")
    np.testing.assert_array_equal(np.asarray(st.seqs.num_allocated), oracle.allocated, err_msg="allocated")
    np.testing.assert_array_equal(np.asarray(st.seqs.num_drafts), oracle.drafts, err_msg="drafts")
    got = {k: int(v) for k, v in dataclasses.asdict(st.counters).items()}
    assert got == oracle.counters, f"counters differ: jax {got} vs oracle {oracle.counters}"


def prefix_index_as_dict(cache, cfg, salted: bool = False) -> dict[tuple[int, ...], int]:
    """Rebuild prefix -> block from the JAX table through the parent links, checking its invariants. salted: keys
    are (salt, *tokens), as `oracle.OraclePrefixIndex` keeps them; else token tuples, and every entry must be
    unsalted (salt 0)."""
    block = np.asarray(cache.block)
    live = block > 0
    salt = dict(zip(block[live].tolist(), np.asarray(cache.salt)[live].tolist()))
    assert salted or not any(salt.values()), "salted entries: pass salted=True"
    parent = dict(zip(block[live].tolist(), np.asarray(cache.parent)[live].tolist()))
    tokens = dict(zip(block[live].tolist(), np.asarray(cache.tokens)[live].tolist()))
    keys = [tuple(k) for k in np.asarray(cache.key)[live].tolist()]
    assert len(set(keys)) == len(keys), "live keys must be unique"
    slot_of_block = np.asarray(cache.slot_of_block)
    assert (slot_of_block[block[live]] == np.flatnonzero(live)).all(), "slot_of_block must point at the entry"
    assert (slot_of_block >= 0).sum() == live.sum(), "slot_of_block must hold exactly the live entries"
    by_block = np.asarray(cache.by_block)[block[live]]
    assert (by_block[:, 1] == np.asarray(cache.parent)[live]).all(), "by_block must hold each entry's parent"

    def prefix(blk, depth=0):
        assert depth <= cfg.max_blocks_per_seq, "parent chains must be acyclic and at most M long"
        p = parent[blk]
        assert p == prefix_cache.ROOT or p in parent, f"entry {blk} has parent {p}, which is not live"
        if p != prefix_cache.ROOT:
            assert salt[p] == salt[blk], f"entry {blk} has salt {salt[blk]}, its parent {p} salt {salt[p]}"
            return prefix(p, depth + 1) + tuple(tokens[blk])
        return ((salt[blk],) if salted else ()) + tuple(tokens[blk])

    return {prefix(blk): blk for blk in parent}


# ------------------------------------------------------------------------------------------ operations


@dataclasses.dataclass(frozen=True)
class Allocate:
    num_tokens: tuple[int, ...]  # per slot; may exceed what fits, on purpose
    order: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class AllocateSpeculative:
    num_drafts: tuple[int, ...]  # clipped to K - pending drafts at apply time
    order: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class AllocateStep:
    num_tokens: tuple[int, ...]  # slots, as Allocate
    num_drafts: tuple[int, ...]  # drafts on top of them, 0..K (beyond K - pending: refused)
    order: tuple[int, ...]
    window: int | None = None  # the drafts' bound and the narrow pass's width (`allocator.allocate_step(window=)`)


@dataclasses.dataclass(frozen=True)
class Commit:
    accept: tuple[int, ...]  # accept min(accept, pending) per slot
    window: int | None = None  # table columns examined per sequence (None = all)
    impl: str = "xla"  # the block-state kernel's implementation (`allocator.commit(impl=)`)


@dataclasses.dataclass(frozen=True)
class Free:
    mask: tuple[bool, ...]


@dataclasses.dataclass(frozen=True)
class Fork:
    parent: tuple[int, ...]  # -1 = no fork


@dataclasses.dataclass(frozen=True)
class SharePrefix:
    source: int  # share the full committed blocks of this slot into every empty slot in `into`
    into: tuple[bool, ...]
    short: int = 0  # share this many tokens fewer (at least one), so a share can end inside a (cached) block


@dataclasses.dataclass(frozen=True)
class SetCached:
    slot: int  # pin (or unpin) the full committed blocks of this slot
    pin: bool


@dataclasses.dataclass(frozen=True)
class Evict:
    num_blocks: int


@dataclasses.dataclass(frozen=True)
class Reclaim:
    threshold: int


Operation = (Allocate | AllocateSpeculative | AllocateStep | Commit | Free | Fork | SharePrefix | SetCached | Evict
             | Reclaim)
MAX_EVICT = 4


def apply(
    op: Operation,
    st: AllocatorState,
    oracle: OracleAllocator,
    cfg: CacheConfig,
    spec: SpecConfig,
    generation: int = 0,
) -> AllocatorState:
    """Apply one operation to the JAX state and the oracle; assert that their per-call results agree.

    `generation` is the step number used by AllocateSpeculative, AllocateStep and Reclaim.
    """
    gen = generation
    b = cfg.max_seqs
    if isinstance(op, Allocate):
        counts = jnp.asarray(op.num_tokens, i32)
        st, res = allocator.allocate(st, counts, jnp.asarray(op.order, i32), cfg=cfg, spec=spec)
        ok, pairs = oracle.allocate(op.num_tokens, op.order)
        _same("allocate ok", res.ok, ok)
        _same("allocate cow", np.stack([res.cow_src, res.cow_dst], 1), pairs)
    elif isinstance(op, AllocateSpeculative):
        room = [spec.draft_len - d for d in oracle.drafts]
        drafts = tuple(min(k, r) for k, r in zip(op.num_drafts, room))
        st, res = allocator.allocate_speculative(
            st, jnp.asarray(drafts, i32), gen, jnp.asarray(op.order, i32), cfg=cfg, spec=spec
        )
        ok, pairs = oracle.allocate_speculative(drafts, gen, op.order)
        _same("allocate_speculative ok", res.ok, ok)
        _same("allocate_speculative cow", np.stack([res.cow_src, res.cow_dst], 1), pairs)
    elif isinstance(op, AllocateStep):
        st, res, dres = allocator.allocate_step(st, jnp.asarray(op.num_tokens, i32), jnp.asarray(op.num_drafts, i32),
                                                gen, jnp.asarray(op.order, i32), cfg=cfg, spec=spec, window=op.window)
        ok, pairs, draft_ok = oracle.allocate_step(op.num_tokens, op.num_drafts, gen, op.order, window=op.window)
        _same("allocate_step ok", res.ok, ok)
        _same("allocate_step cow", np.stack([res.cow_src, res.cow_dst], 1), pairs)
        _same("allocate_step draft ok", dres.ok, draft_ok)
        _same("allocate_step draft cow", np.stack([dres.cow_src, dres.cow_dst], 1), [(NULL_BLOCK, NULL_BLOCK)] * b)
    elif isinstance(op, Commit):
        pending = [a - c for a, c in zip(oracle.allocated, oracle.committed)]
        accept = tuple(min(a, p) for a, p in zip(op.accept, pending))
        st, res = allocator.commit(st, jnp.asarray(accept, i32), cfg=cfg, spec=spec, window=op.window, impl=op.impl)
        ok, released = oracle.commit(accept, op.window)
        _same("commit ok", res.ok, ok)
        assert int(res.released) == released, "commit released counts differ"
    elif isinstance(op, Free):
        st, released = allocator.free(st, jnp.asarray(op.mask), cfg=cfg, spec=spec)
        assert int(released) == oracle.free(op.mask), "free released counts differ"
    elif isinstance(op, Fork):
        st, ok = allocator.fork(st, jnp.asarray(op.parent, i32), cfg=cfg)
        _same("fork ok", ok, oracle.fork(op.parent))
    elif isinstance(op, SharePrefix):
        full = oracle.committed[op.source] // cfg.block_size
        ids = np.full((b, cfg.max_blocks_per_seq), NULL_BLOCK, np.int32)
        tokens = np.zeros((b,), np.int32)
        for slot in range(b):
            if op.into[slot] and full > 0:
                ids[slot, :full] = oracle.tables[op.source][:full]
                tokens[slot] = max(full * cfg.block_size - op.short, 1)
        st, ok = allocator.share(st, jnp.asarray(ids), jnp.asarray(tokens), cfg=cfg)
        _same("share ok", ok, oracle.share(ids, tokens))
    elif isinstance(op, SetCached):
        full = oracle.committed[op.slot] // cfg.block_size
        ids = np.zeros((cfg.max_blocks_per_seq,), np.int32)
        ids[:full] = oracle.tables[op.slot][:full]
        flags = np.full(ids.shape, op.pin)
        st = allocator.set_cached(st, jnp.asarray(ids), jnp.asarray(flags))
        oracle.set_cached(ids, flags)
    elif isinstance(op, Evict):
        st, evicted = allocator.evict_lru(st, op.num_blocks, max_evict=MAX_EVICT)
        want = oracle.evict_lru(op.num_blocks, MAX_EVICT)
        _same("evicted ids", evicted, want + [NULL_BLOCK] * (MAX_EVICT - len(want)))
    elif isinstance(op, Reclaim):
        st, count = allocator.reclaim_expired(st, gen, op.threshold)
        assert int(count) == oracle.reclaim_expired(gen, op.threshold), "reclaimed counts differ"
    else:
        raise TypeError(f"op must be an Operation, got {type(op).__name__}")
    return st


def _same(what: str, got, want) -> None:
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=what)


# ------------------------------------------------------------------------------ configurations the strategies draw

SMALL_CONFIGS = (
    CacheConfig(num_blocks=12, block_size=4, max_seqs=3, max_blocks_per_seq=6),
    CacheConfig(num_blocks=24, block_size=2, max_seqs=4, max_blocks_per_seq=8, spec_pool_capacity=3),
    CacheConfig(num_blocks=9, block_size=8, max_seqs=2, max_blocks_per_seq=4),
)
SPEC_CONFIGS = (
    SpecConfig(draft_len=4, generation_threshold=3, release="immediate", use_spec_pool=True),
    SpecConfig(draft_len=3, generation_threshold=2, release="lazy", use_spec_pool=False),
    SpecConfig(draft_len=5, generation_threshold=1, release="immediate", use_spec_pool=False),
    SpecConfig(draft_len=2, generation_threshold=0, release="lazy", use_spec_pool=True),
)


def run_sequence(ops, cfg: CacheConfig, spec: SpecConfig) -> tuple[AllocatorState, OracleAllocator]:
    """Apply ops then free every sequence, checking invariants and the oracle after each step."""
    st, oracle = allocator.init(cfg), OracleAllocator(cfg, spec)
    for step, op in enumerate(list(ops) + [Free((True,) * cfg.max_seqs)]):
        st = apply(op, st, oracle, cfg, spec, generation=step)
        check_invariants(st, cfg, spec)
        assert_matches_oracle(st, oracle)
    assert_no_leak(st, cfg)
    return st, oracle
