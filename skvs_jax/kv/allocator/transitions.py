"""The allocator's other transitions: commit / roll back, free, share and fork, reclaim, pin, evict."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from skvs_jax import vmap_flow
from skvs_jax.arrays import cdiv, count_leading, floor_div, i32, sums, take_each
from skvs_jax.config import NULL_BLOCK, CacheConfig, SpecConfig
from skvs_jax.kv.allocator.state import (
    FREE,
    SPECULATIVE,
    STALE,
    VALIDATED,
    AllocatorState,
    BlockPool,
    CommitResult,
    SeqBlocks,
    Unreffed,
    push,
    release_blocks,
)

# -------------------------------------------------------------------------------------------- commit


def accepted_lengths(accept_mask: jax.Array) -> jax.Array:
    """bool[B, K] per-draft acceptance -> int32[B] length of the accepted prefix (leading Trues)."""
    return count_leading(accept_mask)


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "window", "impl"))
def commit_unchecked(
    st: AllocatorState, num_accepted: jax.Array, *, cfg: CacheConfig, spec: SpecConfig, window: int | None,
    impl: str = "xla",
) -> tuple[AllocatorState, CommitResult]:
    # Works on the [B, W] table columns from each sequence's first non-full committed block; a sequence
    # whose span (num_blocks - num_committed // S) exceeds W is left untouched and flagged. W = M always fits.
    s, m, n = cfg.block_size, cfg.max_blocks_per_seq, cfg.num_blocks
    window = min(window or m, m)
    blocks, seqs = st.blocks, st.seqs
    b_idx = jnp.arange(seqs.num_blocks.shape[0], dtype=i32)[:, None]
    num_accepted = num_accepted.astype(i32)
    fits = seqs.num_blocks - floor_div(seqs.num_committed, s) <= window
    pending = seqs.num_allocated - seqs.num_committed
    ok = fits & (num_accepted >= 0) & (num_accepted <= pending)
    committed = jnp.where(fits, seqs.num_committed + jnp.clip(num_accepted, 0, pending), seqs.num_committed)
    keep = cdiv(committed, s)

    col = floor_div(seqs.num_committed, s)[:, None] + jnp.arange(window, dtype=i32)[None, :]  # [B, W]
    in_table = (col < seqs.num_blocks[:, None]) & fits[:, None]
    ids = jnp.where(in_table, seqs.block_table[b_idx, jnp.clip(col, 0, m - 1)], n)
    # The masks below are made to depend on the values just gathered (ids, old_state): without that data
    # dependence XLA cannot order the gathers before the in-place scatters and copies the table and the
    # state array on every call. For live entries both conditions hold by invariant.
    old_state = blocks.state[jnp.clip(ids, 0, n - 1)]
    in_table &= (ids != NULL_BLOCK) & (old_state != FREE)
    validate = in_table & (col < keep[:, None])
    rejected = in_table & (col >= keep[:, None])
    # Both counts in one reduction (`arrays.sums`): the released blocks are the rejected entries.
    wasted, rejected_count = sums(rejected & (old_state == SPECULATIVE), rejected)

    # The block-state transition is the article's kernel, `pallas_kernels.update_block_states`: entries of committed
    # tokens -> VALIDATED, entries past them -> STALE. Generations stay what `allocate_speculative` stamped (the
    # step that allocated the block), so its generation output is not used. A block named by an accepted and a
    # rejected entry stays VALIDATED (never happens: blocks past the committed prefix are never shared). Off the
    # Pallas kernel (impl "xla", "reference", or "auto" off a GPU) the kernel's states by a scatter over the entries,
    # not its jnp reference's passes over all N blocks, and one scatter: entries that name one block agree on its
    # state (a shared block holds committed tokens of every holder, so none rejects it), where the kernel's generic
    # form (`pallas_kernels.update_states_by_scatter`) takes a second to let an accepting entry win; under immediate
    # release it is the release's own state scatter (a rejected block's state after it is where it was routed).
    settled = validate | rejected
    kernel_states = jnp.where(validate, VALIDATED, STALE).astype(jnp.int8)
    by_scatter = pk.resolve_impl(impl, None)[0] != "pallas"
    if not by_scatter:
        state, _, _ = pk.update_block_states(blocks.state, blocks.generation, ids, validate, settled, 0, impl=impl)
        blocks = blocks.replace(state=state)
    table = seqs.block_table
    if spec.release == "immediate":
        # Blocks past the committed prefix are never shared (fork shares committed blocks only): ref 1 -> 0. They
        # are STALE now (the kernel's states), which routes them to the pool first. Nor are they pinned: the
        # prefix cache pins VALIDATED blocks, and these hold no committed token (a share adopts blocks as committed).
        ref_count = blocks.ref_count.at[jnp.where(rejected, ids, n)].add(-1, mode="drop")
        blocks = blocks.replace(ref_count=ref_count)
        # The [B, W] entries as rows (`prefix_counts`: one running count over B, not over B * W).
        also = (settled, kernel_states) if by_scatter else None
        blocks, _ = release_blocks(blocks, ids, rejected, spec.use_spec_pool, routed_as=STALE, also=also,
                                   unpinned=True)
        released = rejected_count
        table = table.at[b_idx, jnp.where(rejected, col, m)].set(NULL_BLOCK, mode="drop")
        num_blocks = jnp.where(fits, jnp.minimum(seqs.num_blocks, keep), seqs.num_blocks)
    else:
        if by_scatter:
            blocks = blocks.replace(state=blocks.state.at[jnp.where(settled, ids, n)].set(kernel_states, mode="drop"))
        released = jnp.zeros((), i32)
        num_blocks = seqs.num_blocks

    seqs = seqs.replace(
        block_table=table,
        num_blocks=num_blocks,
        num_committed=committed,
        num_allocated=jnp.where(fits, committed, seqs.num_allocated),
        num_drafts=jnp.where(fits, 0, seqs.num_drafts),
    )
    counters = st.counters.replace(spec_blocks_wasted=st.counters.spec_blocks_wasted + wasted)
    return AllocatorState(blocks=blocks, seqs=seqs, counters=counters), CommitResult(ok=ok, released=released)


# ---------------------------------------------------------------------------------------------- free


def _dropped_ids(seqs: SeqBlocks, seq_mask: jax.Array, n: int) -> jax.Array:
    """int32[B, M] the table entries of the rows in seq_mask, N elsewhere."""
    col = jnp.arange(seqs.block_table.shape[1], dtype=i32)[None, :]
    return jnp.where(seq_mask[:, None] & (col < seqs.num_blocks[:, None]), seqs.block_table, n)


def _cleared(seqs: SeqBlocks, seq_mask: jax.Array) -> SeqBlocks:
    zero = jnp.zeros_like(seqs.num_blocks)
    return SeqBlocks(
        block_table=jnp.where(seq_mask[:, None], NULL_BLOCK, seqs.block_table),
        num_blocks=jnp.where(seq_mask, zero, seqs.num_blocks),
        num_committed=jnp.where(seq_mask, zero, seqs.num_committed),
        num_allocated=jnp.where(seq_mask, zero, seqs.num_allocated),
        num_drafts=jnp.where(seq_mask, zero, seqs.num_drafts),
    )


@functools.partial(jax.jit, static_argnames=("cfg", "skip"))
def unref_unchecked(st: AllocatorState, seq_mask: jax.Array, *, cfg: CacheConfig, skip: bool = True
                    ) -> tuple[AllocatorState, Unreffed]:
    """The first half of `free_unchecked`: the rows in seq_mask bool[B] drop their references (one scatter-add)
    and their tables, and the clock advances, but the blocks released are not routed yet: the next
    `free_unchecked(first=...)` routes them before its own, exactly as two frees in a row would (the order pushed,
    the pool's room, the LRU clocks). Until then the state is between the two: ref counts, tables and what is
    evictable (`cached & ref_count == 0`) are final, the stacks and states of the released uncached blocks are
    not (`Unreffed.blocks` of them). For a scheduler whose phases read counts between two frees (finished rows
    at the start of a step, preemption victims later) and that routes both at once: one set of routing kernels a
    step, not two."""
    n = cfg.num_blocks
    blocks, seqs = st.blocks, st.seqs
    ids = _dropped_ids(seqs, seq_mask, n)

    def drop(operand):
        st, _ = operand
        ref_count = st.blocks.ref_count.at[ids.reshape(-1)].add(-1, mode="drop")
        # The uncached blocks this drop left with no reference: a dense count over [N], no gather of the ids.
        gone = jnp.sum((st.blocks.ref_count > 0) & (ref_count == 0) & ~st.blocks.cached, dtype=i32)
        return st.replace(blocks=st.blocks.replace(ref_count=ref_count), seqs=_cleared(st.seqs, seq_mask)), gone

    some = jnp.any(seq_mask)
    new, gone = vmap_flow.when_for(skip)(some, drop, (st, jnp.zeros((), i32)), identity_when_false=True)
    out = Unreffed(ids=ids, clock=blocks.clock, blocks=gone, some=some)
    return new.replace(blocks=new.blocks.replace(clock=blocks.clock + 1)), out


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "skip"))
def free_unchecked(
    st: AllocatorState, seq_mask: jax.Array, *, cfg: CacheConfig, spec: SpecConfig = SpecConfig(), skip: bool = True,
    first: Unreffed | None = None,
) -> tuple[AllocatorState, jax.Array]:
    """`api.free` without the checks. first: an earlier `unref_unchecked`'s blocks, routed here before these rows'
    (rows of both are disjoint: the earlier ones' tables are empty now). Returns the state and the blocks routed."""
    n = cfg.num_blocks

    def release(operand):
        st, _ = operand
        blocks, seqs = st.blocks, st.seqs
        own = _dropped_ids(seqs, seq_mask, n)
        ref_count = blocks.ref_count.at[own.reshape(-1)].add(-1, mode="drop")
        flat = jnp.arange(own.size, dtype=i32)
        if first is None:
            ids, earlier, pos = own.reshape(-1), None, flat
        else:  # the earlier free's entries first: a block both held is released by the later one
            earlier = (own == n).reshape(-1)
            ids = jnp.where(earlier, first.ids.reshape(-1), own.reshape(-1))
            pos = jnp.where(earlier, flat, own.size + flat)
        # A block shared by several freed sequences is released once, at its last reference (row-major order).
        last = jnp.full((n,), -1, i32).at[ids].max(pos, mode="drop")
        refs, last_pos = take_each((ref_count, last), jnp.clip(ids, 0, n - 1))
        released = (ids < n) & (refs == 0) & (last_pos == pos)
        blocks, num_released = release_blocks(blocks.replace(ref_count=ref_count), ids, released, spec.use_spec_pool,
                                              first=earlier, first_clock=None if first is None else first.clock)
        return st.replace(blocks=blocks, seqs=_cleared(seqs, seq_mask)), num_released

    # Freeing no sequence changes nothing but the clock, and the scheduler frees (finished rows, victims) every
    # step: skip the [B, M] and [N] passes then (skip=False: run them anyway, `vmap_flow`).
    any_work = jnp.any(seq_mask) if first is None else jnp.any(seq_mask) | first.some
    st, num_released = vmap_flow.when_for(skip)(any_work, release, (st, jnp.zeros((), i32)),
                                                identity_when_false=True)
    return st.replace(blocks=st.blocks.replace(clock=st.blocks.clock + 1)), num_released


# --------------------------------------------------------------------------------------- share / fork


@functools.partial(jax.jit, static_argnames=("cfg", "indexed"))
def share_unchecked(
    st: AllocatorState, block_ids: jax.Array, num_tokens: jax.Array, *, cfg: CacheConfig, indexed: bool = False
) -> tuple[AllocatorState, jax.Array]:
    """`api.share` without the checks. indexed: the ids are the prefix index's hits in this very state (the
    scheduler's admission), so each is VALIDATED and owned by the index's invariant (an indexed block is pinned,
    and a pinned block is never written: a write into it copies it first), and that is not read back (three
    [B, M] gathers, a kernel each on a GPU); the range, empty-row and length checks stay."""
    s, m, n = cfg.block_size, cfg.max_blocks_per_seq, cfg.num_blocks
    blocks, seqs = st.blocks, st.seqs
    num_tokens = num_tokens.astype(i32)
    requested = num_tokens != 0
    nb = cdiv(jnp.maximum(num_tokens, 0), s)
    col = jnp.arange(m, dtype=i32)[None, :]
    used = col < nb[:, None]
    in_range = (block_ids >= 1) & (block_ids < n)
    if indexed:
        good_block = in_range
    else:
        safe = jnp.where(in_range, block_ids, NULL_BLOCK)
        owned = (blocks.ref_count[safe] > 0) | blocks.cached[safe]
        good_block = in_range & (blocks.state[safe] == VALIDATED) & owned
    empty = (seqs.num_blocks == 0) & (seqs.num_allocated == 0)
    ok = (num_tokens > 0) & empty & (num_tokens <= m * s) & jnp.all(good_block | ~used, axis=1)
    take = used & ok[:, None]

    ref_count = blocks.ref_count.at[jnp.where(take, block_ids, n)].add(1, mode="drop")
    seqs = seqs.replace(
        block_table=jnp.where(ok[:, None], jnp.where(take, block_ids, NULL_BLOCK), seqs.block_table),
        num_blocks=jnp.where(ok, nb, seqs.num_blocks),
        num_committed=jnp.where(ok, num_tokens, seqs.num_committed),
        num_allocated=jnp.where(ok, num_tokens, seqs.num_allocated),
    )
    return st.replace(blocks=blocks.replace(ref_count=ref_count), seqs=seqs), ok | ~requested


@functools.partial(jax.jit, static_argnames=("cfg",))
def fork_unchecked(st: AllocatorState, parent: jax.Array, *, cfg: CacheConfig) -> tuple[AllocatorState, jax.Array]:
    seqs = st.seqs
    wants = parent >= 0
    p = jnp.clip(parent, 0, seqs.num_blocks.shape[0] - 1)
    settled = seqs.num_allocated[p] == seqs.num_committed[p]
    valid = wants & (parent < seqs.num_blocks.shape[0]) & settled & (parent != jnp.arange(p.shape[0]))
    # The child side of a pair whose parent is itself a child in this call would read a half-built row.
    is_child = jnp.zeros(p.shape, bool).at[jnp.where(wants, jnp.arange(p.shape[0]), p.shape[0])].set(
        True, mode="drop"
    )
    valid &= ~is_child[p] & (seqs.num_committed[p] > 0)
    num_tokens = jnp.where(valid, seqs.num_committed[p], 0)
    st, ok = share_unchecked(st, seqs.block_table[p], num_tokens, cfg=cfg)
    return st, jnp.where(wants, ok & valid, True)


# ---------------------------------------------------------------------------------- reclaim / evict


@functools.partial(jax.jit, static_argnames=("skip",))
def reclaim_expired_unchecked(
    st: AllocatorState, current_generation: jax.Array, threshold: jax.Array, *, skip: bool = True
) -> tuple[AllocatorState, jax.Array]:
    n = st.blocks.state.shape[0]
    current_generation = jnp.asarray(current_generation, i32)

    def pool(blocks: BlockPool) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """(position int32[P], id int32[P], live bool[P], expired bool[P]) of the pool's entries. Computed again
        inside the skip's body: arrays from outside it are materialised to be passed in, and these fuse."""
        k = jnp.arange(blocks.stacks.shape[0] - n, dtype=i32)
        ids = blocks.pool_stack
        live = k < blocks.pool_top
        return k, ids, live, live & (current_generation - blocks.generation[ids] > threshold)

    count = jnp.sum(pool(st.blocks)[3], dtype=i32)

    def compact(blocks: BlockPool) -> BlockPool:
        # The kept entries close ranks from the pool's bottom; the expired go onto the free stack: one scatter.
        k, ids, live, expired = pool(blocks)
        kept = live & ~expired
        expired_rank = jnp.cumsum(expired, dtype=i32)
        kept_rank = jnp.minimum(k + 1, blocks.pool_top) - expired_rank
        blocks = push(blocks.replace(pool_top=jnp.zeros((), i32)), ids, expired, expired_rank, kept, kept_rank)
        return blocks.replace(state=blocks.state.at[jnp.where(expired, ids, n)].set(FREE, mode="drop"))

    blocks = vmap_flow.when_for(skip)(count > 0, compact, st.blocks)
    counters = st.counters.replace(spec_blocks_reclaimed=st.counters.spec_blocks_reclaimed + count)
    return st.replace(blocks=blocks, counters=counters), count


@jax.jit
def set_cached_unchecked(st: AllocatorState, block_ids: jax.Array, cached: jax.Array) -> AllocatorState:
    blocks = st.blocks
    n = blocks.state.shape[0]
    pin = _pinnable(blocks, block_ids) & cached
    unpin = _pinned(blocks, block_ids) & ~cached
    flags = blocks.cached.at[jnp.where(pin, block_ids, n)].set(True, mode="drop")
    flags = flags.at[jnp.where(unpin, block_ids, n)].set(False, mode="drop")
    return _release_orphans(st.replace(blocks=blocks.replace(cached=flags)), blocks, block_ids, unpin, distinct=False)


def pin_unchecked(st: AllocatorState, block_ids: jax.Array) -> AllocatorState:
    """`set_cached_unchecked(st, block_ids, block_ids > 0)`: every listed block pinned, none unpinned, so nothing
    is released, and the unpin and release passes are left out (the index pins what it just inserted, every
    step). Traceable; block_ids int32[X], ids <= 0 ignored."""
    blocks = st.blocks
    pin = _pinnable(blocks, block_ids)
    flags = blocks.cached.at[jnp.where(pin, block_ids, blocks.state.shape[0])].set(True, mode="drop")
    return st.replace(blocks=blocks.replace(cached=flags))


def unpin_unchecked(st: AllocatorState, block_ids: jax.Array, *, distinct: bool = False,
                    flags_only: bool = False) -> AllocatorState:
    """`set_cached_unchecked(st, block_ids, False)`: the listed blocks unpinned, the ref-0 ones released to the
    free stack in list order, and no pin pass. distinct (static): the caller guarantees no id > 0 repeats, so the
    pass that releases a repeated block once is left out. flags_only (static): the flags alone are cleared, one
    scatter, and nothing is released: `set_cached_unchecked`'s effect when every listed block is held (ref > 0),
    or when the caller routes the ref-0 ones itself (`evict_ids_unchecked`); clearing an unpinned block's flag
    changes nothing, so the pinned check goes too. Traceable; block_ids int32[X], ids <= 0 ignored."""
    blocks = st.blocks
    if flags_only:
        valid, _ = _safe(blocks, block_ids)
        flags = blocks.cached.at[jnp.where(valid, block_ids, blocks.state.shape[0])].set(False, mode="drop")
        return st.replace(blocks=blocks.replace(cached=flags))
    unpin = _pinned(blocks, block_ids)
    flags = blocks.cached.at[jnp.where(unpin, block_ids, blocks.state.shape[0])].set(False, mode="drop")
    return _release_orphans(st.replace(blocks=blocks.replace(cached=flags)), blocks, block_ids, unpin,
                            distinct=distinct)


def _safe(blocks: BlockPool, block_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(valid bool[X]: ids in [1, N), safe int32[X]: the ids, NULL_BLOCK where not valid)."""
    valid = (block_ids > 0) & (block_ids < blocks.state.shape[0])
    return valid, jnp.where(valid, block_ids, NULL_BLOCK)


def _pinnable(blocks: BlockPool, block_ids: jax.Array) -> jax.Array:
    """bool[X]: a pin would take (only VALIDATED blocks a sequence holds: the index holds validated content)."""
    valid, safe = _safe(blocks, block_ids)
    return valid & (blocks.state[safe] == VALIDATED) & (blocks.ref_count[safe] > 0)


def _pinned(blocks: BlockPool, block_ids: jax.Array) -> jax.Array:
    """bool[X]: an unpin would take (the block is pinned)."""
    valid, safe = _safe(blocks, block_ids)
    return valid & blocks.cached[safe]


def _release_orphans(st: AllocatorState, before: BlockPool, block_ids: jax.Array, unpin: jax.Array, *,
                     distinct: bool) -> AllocatorState:
    """Release the unpinned blocks no sequence holds (ref 0 in `before`, the pool the flags were read from), each
    once (the first entry naming it, unless the caller guarantees distinct ids), to the free stack."""
    _, safe = _safe(before, block_ids)
    orphan = unpin & (before.ref_count[safe] == 0)
    if not distinct:
        orphan &= _first_of_each(block_ids, orphan, before.state.shape[0])
    blocks, _ = release_blocks(st.blocks, block_ids, orphan, use_pool=False)
    return st.replace(blocks=blocks)


def _first_of_each(block_ids: jax.Array, mask: jax.Array, n: int) -> jax.Array:
    """bool[X]: entry i of mask is the first masked entry naming its block (a repeated block is released once)."""
    flat = jnp.arange(block_ids.shape[0], dtype=i32)
    first = jnp.full((n,), block_ids.shape[0], i32).at[jnp.where(mask, block_ids, n)].min(flat, mode="drop")
    return first[jnp.where(mask, block_ids, NULL_BLOCK)] == flat


@functools.partial(jax.jit, static_argnames=("max_evict",))
def evict_unchecked(
    st: AllocatorState, order: jax.Array, num_blocks: jax.Array, *, max_evict: int
) -> tuple[AllocatorState, jax.Array]:
    """Evict the first num_blocks int32[] (<= max_evict, static) cached ref-0 blocks of order int32[N] (block ids
    in the caller's eviction order: `lru_order`, or the KV manager's leaves-first `eviction_order`). They are
    unpinned and pushed to the free stack in that order; returns the state and their ids, int32[max_evict]
    padded with NULL_BLOCK. `evicted_ids` then `evict_ids_unchecked`, for a caller with work between the two."""
    ids = evicted_ids(st.blocks, order, num_blocks, max_evict=max_evict)
    return evict_ids_unchecked(st, ids), ids


def evicted_ids(blocks: BlockPool, order: jax.Array, num_blocks: jax.Array, *, max_evict: int) -> jax.Array:
    """int32[max_evict]: the first num_blocks int32[] evictable (cached, ref-0) blocks of order int32[N], in that
    order, padded with NULL_BLOCK; what `evict_unchecked` evicts. Traceable."""
    evictable = blocks.cached & (blocks.ref_count == 0)
    # The first num_blocks evictable blocks of `order`, wherever the others stand in it (one prefix sum over N;
    # eviction is rare, only when the free stack runs dry).
    ev = evictable[order]
    rank = jnp.cumsum(ev, dtype=i32)  # the chosen blocks' places in the output, by the one prefix sum
    chosen = ev & (rank <= num_blocks)
    return jnp.full((max_evict,), NULL_BLOCK, i32).at[jnp.where(chosen, rank - 1, max_evict)].set(order, mode="drop")


def evict_ids_unchecked(st: AllocatorState, ids: jax.Array, unpin_held: jax.Array | None = None) -> AllocatorState:
    """Evict ids int32[E] (`evicted_ids`: distinct evictable blocks first, NULL_BLOCK padding after): unpinned,
    FREE, pushed to the free stack in that order. unpin_held int32[X] (NULL_BLOCK = none): blocks some sequence
    holds whose pins go too, in the same scatter as the evicted blocks' (`unpin_unchecked(flags_only=True)` of
    both). Traceable."""
    n = st.blocks.state.shape[0]
    unpinned = ids if unpin_held is None else jnp.concatenate([ids, unpin_held])
    blocks = unpin_unchecked(st, unpinned, flags_only=True).blocks  # evicted: routed below; the others held
    take = ids > NULL_BLOCK
    count = jnp.sum(take, dtype=i32)
    slot = jnp.arange(ids.shape[0], dtype=i32)
    state = blocks.state.at[jnp.where(take, ids, n)].set(FREE, mode="drop")
    blocks = push(blocks, ids, take, jnp.minimum(slot + 1, count)).replace(state=state, clock=blocks.clock + 1)
    counters = st.counters.replace(evictions=st.counters.evictions + count)
    return st.replace(blocks=blocks, counters=counters)


def lru_order(blocks: BlockPool) -> jax.Array:
    """int32[N] block ids, the evictable ones first, least recently released first (ties by id)."""
    evictable = blocks.cached & (blocks.ref_count == 0)
    key = jnp.where(evictable, blocks.last_used, jnp.iinfo(jnp.int32).max)
    return jnp.argsort(key, stable=True).astype(i32)


@functools.partial(jax.jit, static_argnames=("max_evict",))
def evict_lru_unchecked(
    st: AllocatorState, num_blocks: jax.Array, *, max_evict: int
) -> tuple[AllocatorState, jax.Array]:
    return evict_unchecked(st, lru_order(st.blocks), num_blocks, max_evict=max_evict)
