"""`allocate_unchecked`: extend every sequence's allocation at once, for slots or drafts, as named phases.

    _requested_blocks → _grant_in_order → _pop_blocks → _tally → _write_table_and_states → _release_copied
    → _count_grow

Rows are served in priority order, all-or-nothing each, stopping at the first that does not fit (a prefix sum
over the free stack and the speculative pool); blocks are popped from the stacks' tops in a [B, W] window.

A scheduler's step takes the same phases once for its slots and drafts together (`allocate_step_unchecked`, and
`allocate_split_unchecked` for slots alone):

    _requested_blocks → _grant_in_order → _drafts_after_slots → _pop_step → _write_table_and_states
    → _release_copied
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from skvs_jax import vmap_flow
from skvs_jax.arrays import cdiv, floor_div, floor_mod, i32, prefix_sum, rank_of, sums
from skvs_jax.config import NULL_BLOCK, CacheConfig, SpecConfig
from skvs_jax.kv.allocator.state import (
    RESERVED,
    SPECULATIVE,
    VALIDATED,
    AllocatorState,
    AllocResult,
    BlockPool,
    Counters,
    SeqBlocks,
    pop_position,
    pop_two,
    release_blocks,
)


class _Request(NamedTuple):
    """What each row asks of `_grow` (all [B]): the phases after `_requested_blocks` read it."""

    requested: jax.Array  # bool: a non-zero token count
    bad: jax.Array  # bool: an invalid request, refused
    cow: jax.Array  # bool: the first token lands in a shared (or pinned) partial block, to be copied
    need: jax.Array  # int32: new blocks (the copy included); 0 for a refused row
    partial_col: jax.Array  # int32: the table column of the first new token
    partial_blk: jax.Array  # int32: the block at that column
    new_alloc: jax.Array  # int32: num_allocated after the request
    window_blk: jax.Array | None  # int32[B, W]: the table's blocks at the window's columns (None: not read)


class _Window(NamedTuple):
    """The [B, W] view of the table window that `_pop_blocks` fills: column j is logical block partial_col + j."""

    col: jax.Array  # int32[B, W] the logical block of each window column
    take: jax.Array  # bool[B, W] gets a popped block (a new column or the copy of the partial block)
    is_cow: jax.Array  # bool[B, W] the copy (column 0 of a copying row)
    is_held: jax.Array  # bool[B, W] a lazily held block, reused in place
    new_id: jax.Array  # int32[B, W] the popped block (where take)
    from_pool: jax.Array | None  # bool[B, W] taken from the speculative pool (else the free stack); None: not
    # counted from the window (`_pop_step`: its caller counts pool pops from the grants' totals)
    is_draft: jax.Array | None = None  # bool[B, W] (`allocate_step`) touched by the drafts: SPECULATIVE, generation


class _Tally(NamedTuple):
    """A pass's counts (int32[] each), summed in one reduction (`arrays.sums`); None where the pass does not
    count it."""

    taken: jax.Array  # blocks popped
    taken_pool: jax.Array  # of those, from the speculative pool
    failures: jax.Array | None  # requests refused
    copies: jax.Array | None  # granted requests that copy their partial block
    spec_new: jax.Array | None  # (drafts) blocks given SPECULATIVE state, the held ones among them


def _requested_blocks(cfg: CacheConfig, seqs: SeqBlocks, blocks: BlockPool, num_tokens: jax.Array, *,
                      speculative: bool, max_draft_len: int, window: int, window_ids: bool = True) -> _Request:
    """Validity, copy-on-write and new blocks of each row's request to extend num_allocated by num_tokens[B].
    window_ids: read the table's whole [B, window] window (the held blocks `_write_table_and_states` gives a state)
    with the partial block, one gather for both; False: the partial block alone (a caller whose passes have other
    widths)."""
    s, m = cfg.block_size, cfg.max_blocks_per_seq
    b_idx = jnp.arange(seqs.num_blocks.shape[0], dtype=i32)
    alloc, held = seqs.num_allocated, seqs.num_blocks
    new_alloc = alloc + num_tokens  # may wrap for an oversized count: such rows are refused just below

    requested = num_tokens != 0
    bad = num_tokens < 0
    bad |= num_tokens > m * s - alloc  # not new_alloc > M * S, which an int32 wrap would pass
    if speculative:
        bad |= num_tokens > max_draft_len - seqs.num_drafts
    else:
        bad |= seqs.num_drafts > 0  # decode/prefill slots always precede the drafts of a step
    # Copy-on-write: the first token lands in a partially-filled block that someone else also references, or
    # that the prefix cache pins (its index entry promises the old content; `share` may end inside it).
    partial_col = floor_div(alloc, s)
    if window_ids:
        window_col = partial_col[:, None] + jnp.arange(window, dtype=i32)[None, :]
        window_blk = seqs.block_table[b_idx[:, None], jnp.clip(window_col, 0, m - 1)]
        partial_blk = window_blk[:, 0]
    else:
        window_blk, partial_blk = None, seqs.block_table[b_idx, jnp.clip(partial_col, 0, m - 1)]
    cow = (floor_mod(alloc, s) != 0) & ((blocks.ref_count[partial_blk] > 1) | blocks.cached[partial_blk])
    need = jnp.maximum(cdiv(new_alloc, s) - held, 0) + cow.astype(i32)
    # The window covers logical blocks partial_col .. ceil(new_alloc / S) - 1.
    bad |= cdiv(new_alloc, s) - partial_col > window
    need = jnp.where(requested & ~bad, need, 0)
    return _Request(requested, bad, cow, need, partial_col, partial_blk, new_alloc, window_blk)


def _grant_in_order(blocks: BlockPool, req: _Request, order: jax.Array | None, ahead: jax.Array | None, *,
                    use_pool: bool) -> tuple[jax.Array, jax.Array]:
    """Grant the requests whose blocks fit, by a prefix sum of need over the free stack (and the pool) in
    priority order; a row past the first that does not fit does not fit either. Returns (ok bool[B], offset
    int32[B]: the combined pop position of each row's first block). ahead bool[B, B] (`arrays.before` of the
    order's rank, from the scheduler, trusted): the sum is dense and order is not read."""
    need, bad = req.need, req.bad
    if use_pool:
        available = blocks.free_top + blocks.pool_top
    else:
        available = blocks.free_top
    if ahead is not None:
        cum = prefix_sum(need, None, None, ahead)
        return req.requested & ~bad & ((need == 0) | (cum <= available)), cum - need
    if order is not None:  # inside a user's jit `order` is data: a non-permutation refuses every request
        seen = jnp.zeros_like(order).at[order].add(1, mode="drop")
        need = jnp.where(jnp.all(seen == 1), need, 0)
        bad |= jnp.any(seen != 1)
    if order is None:  # slot order: no permutation to apply
        cum = jnp.cumsum(need, dtype=i32)
    else:
        cum = jnp.cumsum(need[order], dtype=i32)[rank_of(order)]  # inclusive prefix sum in priority order
    ok = req.requested & ~bad & ((need == 0) | (cum <= available))
    return ok, cum - need


def _pop_blocks(cfg: CacheConfig, seqs: SeqBlocks, blocks: BlockPool, req: _Request, ok: jax.Array,
                offset: jax.Array, *, speculative: bool, use_pool: bool, window: int) -> _Window:
    """The [B, W] window of each granted row: which columns get a popped block (from which stack: drafts take
    the speculative pool first, decode/prefill slots the free stack first), which held blocks are reused."""
    s = cfg.block_size
    alloc, held, cow = seqs.num_allocated, seqs.num_blocks, req.cow
    j = jnp.arange(window, dtype=i32)[None, :]
    col = req.partial_col[:, None] + j
    in_range = (col < cdiv(req.new_alloc, s)[:, None]) & ok[:, None] & req.requested[:, None]
    is_cow = in_range & (j == 0) & cow[:, None]
    is_new = in_range & (col >= held[:, None])
    is_held = in_range & ~is_new & (col >= cdiv(alloc, s)[:, None])  # lazily held blocks, reused in place
    take = is_cow | is_new
    pop_index = offset[:, None] + jnp.where(is_cow, 0, col - held[:, None] + cow[:, None].astype(i32))
    if use_pool:
        new_id, from_first = pop_two(blocks, pop_index, pool_first=speculative)
        from_pool = take & (from_first if speculative else ~from_first)
    else:
        new_id = blocks.stacks[jnp.clip(blocks.free_top - 1 - pop_index, 0, cfg.num_blocks - 1)]
        from_pool = jnp.zeros_like(take)
    return _Window(col, take, is_cow, is_held, new_id, from_pool)


def _tally(req: _Request | None, ok: jax.Array, win: _Window, *, speculative: bool) -> _Tally:
    """The window's popped blocks and, for req (None: not counted here), the requests refused and copied (and
    the drafts' new SPECULATIVE blocks)."""
    xs = [win.take, win.from_pool]
    if req is not None:
        xs += [req.requested & ~ok, req.cow & ok & req.requested]
        if speculative:
            xs.append((win.take & ~win.is_cow) | win.is_held)
    t = list(sums(*xs)) + [None] * (5 - len(xs))
    return _Tally(*t)


def _write_table_and_states(cfg: CacheConfig, seqs: SeqBlocks, blocks: BlockPool, req: _Request, ok: jax.Array,
                            win: _Window, tally: _Tally | None, *, speculative: bool,
                            generation: jax.Array) -> tuple[BlockPool, jax.Array, jax.Array]:
    """Write the popped blocks into the table and give every touched block its state (a copy VALIDATED, others
    RESERVED or SPECULATIVE with the generation), ref count 1, the copied blocks one reference less; pop the
    stacks by tally's counts (None: the caller sets the tops). Returns (blocks, block_table int32[B, M],
    old_cow_blk int32[B]: each copied block, N = none)."""
    m, n = cfg.max_blocks_per_seq, cfg.num_blocks
    b_idx = jnp.arange(seqs.num_blocks.shape[0], dtype=i32)
    take, new_id = win.take, win.new_id
    old_cow_blk = jnp.where(req.cow & ok & req.requested, req.partial_blk, n)
    table_col = jnp.where(take, win.col, m)
    block_table = seqs.block_table.at[b_idx[:, None], table_col].set(new_id, mode="drop")
    if req.window_blk is not None:  # read with the request (held columns are not written above)
        held_id = req.window_blk
    else:  # read from the new table, which avoids keeping the old one alive (a copy)
        held_id = block_table[b_idx[:, None], jnp.clip(win.col, 0, m - 1)]
    if win.is_draft is None:
        fresh_state = SPECULATIVE if speculative else RESERVED
    else:  # slots and drafts in one window
        fresh_state = jnp.where(win.is_draft, SPECULATIVE, RESERVED)
    touched = jnp.where(take, new_id, jnp.where(win.is_held, held_id, n))
    # A cow copy keeps the content (committed tokens) of its source: VALIDATED.
    touched_state = jnp.where(win.is_cow, VALIDATED, fresh_state).astype(jnp.int8)
    state = blocks.state.at[touched].set(touched_state, mode="drop")
    generation_arr = blocks.generation
    if speculative:
        generation_arr = generation_arr.at[jnp.where(win.is_cow, n, touched)].set(generation, mode="drop")
    elif win.is_draft is not None:
        generation_arr = generation_arr.at[jnp.where(win.is_draft, touched, n)].set(generation, mode="drop")
    # A popped block had no reference (it was on a stack), so one scatter-add gives it its 1 and takes the copied
    # blocks' (never popped: they are held) away.
    new_ref = jnp.where(take, new_id, n).reshape(-1)
    ref_count = blocks.ref_count.at[jnp.concatenate([new_ref, old_cow_blk])].add(
        jnp.concatenate([jnp.ones_like(new_ref), jnp.full_like(old_cow_blk, -1)]), mode="drop")

    blocks = blocks.replace(state=state, ref_count=ref_count, generation=generation_arr)
    if tally is not None:  # None: the caller sets the stacks' tops
        blocks = blocks.replace(free_top=blocks.free_top - (tally.taken - tally.taken_pool),
                                pool_top=blocks.pool_top - tally.taken_pool)
    return blocks, block_table, old_cow_blk


def _release_copied(blocks: BlockPool, old_cow_blk: jax.Array, copies: jax.Array, *, use_pool: bool,
                    skip: bool) -> BlockPool:
    """Route the copied blocks (old_cow_blk int32[B], N = none; copies int32[] how many are not N) whose last
    reference the copies dropped."""
    n = blocks.state.shape[0]

    def release_copied(blocks: BlockPool) -> BlockPool:
        # Every holder of a shared partial block may copy it in one call; the last copy drops it to 0. (The row
        # ids are made here: an array from outside a skip's body is materialised to be passed in.)
        b_idx = jnp.arange(old_cow_blk.shape[0], dtype=i32)
        released = (old_cow_blk < n) & (blocks.ref_count[jnp.clip(old_cow_blk, 0, n - 1)] == 0)
        last_holder = jnp.full((n,), -1, i32).at[old_cow_blk].max(b_idx, mode="drop")
        released &= last_holder[jnp.clip(old_cow_blk, 0, n - 1)] == b_idx
        return release_blocks(blocks, old_cow_blk, released, use_pool)[0]

    # Copies are rare; skip the O(N) bookkeeping when there is none. skip=False: run it every call; without copies
    # it releases nothing (an identity, so no select is needed then).
    return vmap_flow.when_for(skip)(copies > 0, release_copied, blocks, identity_when_false=not skip)


def _count_grow(c: Counters, tally: _Tally, *, speculative: bool) -> Counters:
    """Refused requests, copies, and (drafts) the blocks given SPECULATIVE state and those from the pool."""
    c = c.replace(alloc_failures=c.alloc_failures + tally.failures, cow_copies=c.cow_copies + tally.copies)
    if speculative:
        c = c.replace(
            spec_blocks_allocated=c.spec_blocks_allocated + tally.spec_new,
            spec_pool_hits=c.spec_pool_hits + tally.taken_pool,
        )
    return c


def _grow(
    cfg: CacheConfig,
    st: AllocatorState,
    num_tokens: jax.Array,
    order: jax.Array | None,
    *,
    speculative: bool,
    use_pool: bool,
    generation: jax.Array,
    max_draft_len: int,
    window: int,
    skip: bool = True,
    ahead: jax.Array | None = None,
) -> tuple[AllocatorState, AllocResult]:
    """Shared body of `allocate` and `allocate_speculative`: extend num_allocated by num_tokens[B].

    In phases: what each row asks for, which requests fit in priority order, the blocks each pops into its
    [B, W] window, the table and block-state writes, the release of the blocks copied away, the counters."""
    seqs = st.seqs
    req = _requested_blocks(cfg, seqs, st.blocks, num_tokens, speculative=speculative, max_draft_len=max_draft_len,
                            window=window)
    ok, offset = _grant_in_order(st.blocks, req, order, ahead, use_pool=use_pool)
    win = _pop_blocks(cfg, seqs, st.blocks, req, ok, offset, speculative=speculative, use_pool=use_pool,
                      window=window)
    tally = _tally(req, ok, win, speculative=speculative)
    blocks, block_table, old_cow_blk = _write_table_and_states(cfg, seqs, st.blocks, req, ok, win, tally,
                                                               speculative=speculative, generation=generation)
    blocks = _release_copied(blocks, old_cow_blk, tally.copies, use_pool=use_pool, skip=skip)

    return _grown(cfg, st, blocks, block_table, num_tokens, req, ok, win.new_id[:, 0], tally, speculative=speculative)


def _grown(cfg: CacheConfig, st: AllocatorState, blocks: BlockPool, block_table: jax.Array, num_tokens: jax.Array,
           req: _Request, ok: jax.Array, first_new: jax.Array, tally: _Tally, *,
           speculative: bool) -> tuple[AllocatorState, AllocResult]:
    """The state and result after the writes: each granted row's lengths (and pending drafts), the counters (from
    tally, the request's counts), and its copy-on-write pair (the partial block and first_new int32[B], the block
    popped into its window's first column)."""
    seqs = st.seqs
    grant = ok & req.requested
    seqs = seqs.replace(
        block_table=block_table,
        num_blocks=jnp.where(grant, jnp.maximum(seqs.num_blocks, cdiv(req.new_alloc, cfg.block_size)),
                             seqs.num_blocks),
        num_allocated=jnp.where(grant, req.new_alloc, seqs.num_allocated),
        num_drafts=jnp.where(grant & speculative, seqs.num_drafts + num_tokens, seqs.num_drafts),
    )
    counters = _count_grow(st.counters, tally, speculative=speculative)
    cow = req.cow & grant
    result = AllocResult(ok=ok | ~req.requested, cow_src=jnp.where(cow, req.partial_blk, NULL_BLOCK),
                         cow_dst=jnp.where(cow, first_new, NULL_BLOCK))
    return AllocatorState(blocks=blocks, seqs=seqs, counters=counters), result


class _Drafts(NamedTuple):
    """`allocate_step`'s drafts as `allocate_speculative` would see them after the slots were granted (all [B])."""

    req: _Request  # the draft request (never a copy: a granted slot request leaves its partial block the row's own)
    ok: jax.Array  # bool[B] granted, in priority order, from the stacks as the slots' pops left them
    offset: jax.Array  # int32[B] the drafts' pop position of the row's first new block
    start: jax.Array  # int32[B] ceil(allocated after the slots / S): the first column that only drafts occupy


def _tops_after(blocks: BlockPool, taken: jax.Array, *, use_pool: bool,
                pool_first: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(free_top, pool_top, taken from the pool) after `taken` int32[] pops, the pool first or the free stack."""
    if not use_pool:
        return blocks.free_top - taken, blocks.pool_top, jnp.zeros((), i32)
    from_pool = jnp.minimum(taken, blocks.pool_top) if pool_first else taken - jnp.minimum(taken, blocks.free_top)
    return blocks.free_top - (taken - from_pool), blocks.pool_top - from_pool, from_pool


def _drafts_after_slots(cfg: CacheConfig, seqs: SeqBlocks, after: BlockPool, req: _Request, ok: jax.Array,
                        num_drafts: jax.Array, order: jax.Array | None, ahead: jax.Array | None, *, use_pool: bool,
                        max_draft_len: int, window: int) -> _Drafts:
    """The draft request of each row on top of its granted slot request (a row whose slots were not granted, or
    asked none, is refused its drafts), granted by a second prefix sum in priority order over what the slots left
    (`after`: the stacks' tops after their pops). The draft rule of `allocate_speculative(window=window)`: at most K
    pending drafts, at most `window` columns from the partial block."""
    s, m = cfg.block_size, cfg.max_blocks_per_seq
    granted = ok & req.requested
    alloc1 = jnp.where(granted, req.new_alloc, seqs.num_allocated)
    start = cdiv(alloc1, s)
    held1 = jnp.where(granted, jnp.maximum(seqs.num_blocks, start), seqs.num_blocks)
    new_alloc = alloc1 + num_drafts  # may wrap for an oversized count: such rows are refused
    requested = num_drafts != 0
    bad = (num_drafts < 0) | (num_drafts > m * s - alloc1) | (num_drafts > max_draft_len - seqs.num_drafts)
    bad |= ~granted | (cdiv(new_alloc, s) - floor_div(alloc1, s) > window)
    need = jnp.where(requested & ~bad, jnp.maximum(cdiv(new_alloc, s) - held1, 0), 0)
    dreq = _Request(requested, bad, jnp.zeros_like(requested), need, floor_div(alloc1, s),
                    jnp.full_like(alloc1, NULL_BLOCK), new_alloc, None)
    d_ok, d_offset = _grant_in_order(after, dreq, order, ahead, use_pool=use_pool)
    return _Drafts(dreq, d_ok, d_offset, start)


def _pop_step(cfg: CacheConfig, seqs: SeqBlocks, blocks: BlockPool, after: BlockPool, req: _Request, ok: jax.Array,
              offset: jax.Array, d: _Drafts | None, *, use_pool: bool, window: int) -> _Window:
    """`_pop_blocks` of the slots and the drafts (None: none) in one [B, W] window from the slots' partial column:
    the slot columns pop in the slots' order (free stack first), the draft-only columns after them (pool first,
    from the tops `after` the slots); one gather reads both."""
    s, n = cfg.block_size, cfg.num_blocks
    alloc, held, cow = seqs.num_allocated, seqs.num_blocks, req.cow
    j = jnp.arange(window, dtype=i32)[None, :]
    col = req.partial_col[:, None] + j
    is_new = col >= held[:, None]
    in_slots = (col < cdiv(req.new_alloc, s)[:, None]) & (ok & req.requested)[:, None]
    is_cow = in_slots & (j == 0) & cow[:, None]
    take = is_cow | (in_slots & is_new)
    is_held = in_slots & ~is_new & (col >= cdiv(alloc, s)[:, None])
    index = offset[:, None] + jnp.where(is_cow, 0, col - held[:, None] + cow[:, None].astype(i32))
    if use_pool:
        pos = pop_position(n, blocks.free_top, blocks.pool_top, index, pool_first=False)[0]
    else:
        pos = blocks.free_top - 1 - index
    in_drafts = None
    if d is not None:
        in_drafts = ((col >= d.start[:, None]) & (col < cdiv(d.req.new_alloc, s)[:, None])
                     & (d.ok & d.req.requested)[:, None])
        take_draft = in_drafts & is_new
        d_index = d.offset[:, None] + col - jnp.maximum(held, d.start)[:, None]
        if use_pool:
            d_pos = pop_position(n, after.free_top, after.pool_top, d_index, pool_first=True)[0]
        else:
            d_pos = after.free_top - 1 - d_index
        pos = jnp.where(in_drafts, d_pos, pos)
        take |= take_draft
        is_held |= in_drafts & ~is_new
    new_id = blocks.stacks[jnp.clip(pos, 0, blocks.stacks.shape[0] - 1)]
    return _Window(col, take, is_cow, is_held, new_id, None, in_drafts)


def _grow_step(
    cfg: CacheConfig,
    st: AllocatorState,
    num_tokens: jax.Array,
    num_drafts: jax.Array | None,
    generation: jax.Array,
    order: jax.Array | None,
    *,
    use_pool: bool,
    max_draft_len: int,
    draft_window: int,
    split_window: int | None,
    skip: bool,
    ahead: jax.Array | None,
) -> tuple[AllocatorState, AllocResult, AllocResult | None]:
    """A step's slots over the full table and, unless num_drafts is None, its drafts on top of them, in one pass
    (`allocate_step_unchecked`, `allocate_split_unchecked`): the slots' request and grant, the drafts', both popped
    into one window and written with one scatter per table; the copied blocks released after every pop, the tops
    and counters set from the grants' totals. split_window W: a CPU's program, the rows whose slots and drafts span
    at most W columns in a [B, W] window and the others over [B, M] (skipped when there are none, unless not skip);
    None: one pass over [B, M]. Each row's request is read from the state at entry and every pop position from the
    grants' prefix sums, so the split changes nothing."""
    s, m, n = cfg.block_size, cfg.max_blocks_per_seq, cfg.num_blocks
    seqs, entry = st.seqs, st.blocks
    split = split_window is not None and split_window < m
    req = _requested_blocks(cfg, seqs, entry, num_tokens, speculative=False, max_draft_len=0, window=m,
                            window_ids=not split)
    ok, offset = _grant_in_order(entry, req, order, ahead, use_pool=use_pool)
    granted = ok & req.requested
    taken = jnp.sum(jnp.where(ok, req.need, 0), dtype=i32)
    free_top, pool_top, _ = _tops_after(entry, taken, use_pool=use_pool, pool_first=False)
    after = entry.replace(free_top=free_top, pool_top=pool_top)
    d = None if num_drafts is None else _drafts_after_slots(
        cfg, seqs, after, req, ok, num_drafts, order, ahead, use_pool=use_pool, max_draft_len=max_draft_len,
        window=draft_window)

    def one_pass(x, side, width):
        """Pop and write the rows of side bool[B] (None: all) into x = (blocks, table) in a [B, width] window;
        returns (blocks, table, copied block per row, its copy; N where none)."""
        r, dr = req, d
        if side is not None:
            r = req._replace(requested=req.requested & side)
            dr = None if d is None else d._replace(req=d.req._replace(requested=d.req.requested & side))
        # x's stacks and tops are entry's (the writes leave them to the end), so the pass pops from x: a skip's body
        # that read `entry` would make XLA:CPU pass it in, a copy of the stacks each step.
        x_after = x[0].replace(free_top=after.free_top, pool_top=after.pool_top)
        win = _pop_step(cfg, seqs, x[0], x_after, r, ok, offset, dr, use_pool=use_pool, window=width)
        out, table, old_cow_blk = _write_table_and_states(cfg, seqs.replace(block_table=x[1]), x[0], r, ok, win,
                                                          None, speculative=False, generation=generation)
        return out, table, old_cow_blk, jnp.where(old_cow_blk < n, win.new_id[:, 0], n)

    end = jnp.where(granted, req.new_alloc, seqs.num_allocated)
    d_granted = None if d is None else d.ok & d.req.requested
    if d is not None:
        end = jnp.where(d_granted, d.req.new_alloc, end)
    narrow = cdiv(end, s) - floor_div(seqs.num_allocated, s) <= split_window if split else None
    # The counters and the split's "any wide row" in one reduction (`arrays.sums`): each is two kernels on XLA:CPU.
    counted = [req.requested & ~ok, req.cow & granted] + ([granted & ~narrow] if split else [])
    if d is not None:
        counted[0] = counted[0].astype(i32) + (d.req.requested & ~d.ok).astype(i32)
        counted += [jnp.where(d.ok, d.req.need, 0), jnp.where(d_granted, cdiv(d.req.new_alloc, s) - d.start, 0)]
    failures, copies, *rest = sums(*counted)
    if split:
        blocks1, table1, old_n, dst_n = one_pass((entry, seqs.block_table), narrow, split_window)
        none = jnp.full(num_tokens.shape, n, i32)
        blocks, table, old_w, dst_w = vmap_flow.when_for(skip)(
            rest.pop(0) > 0, lambda x: one_pass(x[:2], ~narrow, m), (blocks1, table1, none, none),
            identity_when_false=True)
        old_cow_blk, first_new = jnp.where(narrow, old_n, old_w), jnp.where(narrow, dst_n, dst_w)
    else:
        blocks, table, old_cow_blk, first_new = one_pass((entry, seqs.block_table), None, m)

    c, tops = st.counters, (after.free_top, after.pool_top)
    if d is not None:
        taken_drafts, spec_new = rest
        *tops, pool_hits = _tops_after(after, taken_drafts, use_pool=use_pool, pool_first=True)
        c = c.replace(spec_blocks_allocated=c.spec_blocks_allocated + spec_new,
                      spec_pool_hits=c.spec_pool_hits + pool_hits)
    blocks = blocks.replace(free_top=tops[0], pool_top=tops[1])
    blocks = _release_copied(blocks, old_cow_blk, copies, use_pool=use_pool, skip=skip)

    held = seqs.num_blocks
    seqs = seqs.replace(
        block_table=table,
        num_blocks=jnp.where(granted, jnp.maximum(held, cdiv(end, s)), held),
        num_allocated=end,
        num_drafts=seqs.num_drafts if d is None else jnp.where(d_granted, seqs.num_drafts + num_drafts,
                                                                seqs.num_drafts),
    )
    counters = c.replace(alloc_failures=c.alloc_failures + failures, cow_copies=c.cow_copies + copies)
    cow = req.cow & granted
    result = AllocResult(ok=ok | ~req.requested, cow_src=jnp.where(cow, req.partial_blk, NULL_BLOCK),
                         cow_dst=jnp.where(cow, first_new, NULL_BLOCK))
    draft_result = None
    if d is not None:
        none = jnp.full_like(num_tokens, NULL_BLOCK)
        draft_result = AllocResult(ok=d.ok | ~d.req.requested, cow_src=none, cow_dst=none)
    return AllocatorState(blocks=blocks, seqs=seqs, counters=counters), result, draft_result


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "draft_window", "split_window", "skip"))
def allocate_step_unchecked(
    st: AllocatorState,
    num_tokens: jax.Array,
    num_drafts: jax.Array,
    generation: jax.Array,
    order: jax.Array | None,
    *,
    cfg: CacheConfig,
    spec: SpecConfig,
    draft_window: int | None,
    split_window: int | None = None,
    skip: bool = True,
    ahead: jax.Array | None = None,
) -> tuple[AllocatorState, AllocResult, AllocResult]:
    """A step's two allocations in one pass: `allocate_unchecked(num_tokens)` over the full table, then
    `allocate_speculative(num_drafts, window=draft_window)`, with two differences that make them one pass: a row's
    drafts are refused unless its slot request was granted and nonzero, and the blocks the slots copied away are
    released after the drafts popped (so the drafts never take one). Where neither matters (the scheduler's steps,
    except when the slots release a copied block and the drafts reach the free stack), the state and results are
    those of the two calls. Returns (state, the slots' result, the drafts' result). split_window / skip / ahead:
    `_grow_step`, `_grant_in_order`."""
    m = cfg.max_blocks_per_seq
    return _grow_step(cfg, st, num_tokens.astype(i32), num_drafts.astype(i32), jnp.asarray(generation, i32), order,
                      use_pool=spec.use_spec_pool, max_draft_len=spec.draft_len,
                      draft_window=min(draft_window or m, m),
                      split_window=None if split_window is None else min(split_window, m), skip=skip, ahead=ahead)


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "window", "skip"))
def allocate_split_unchecked(
    st: AllocatorState,
    num_tokens: jax.Array,
    order: jax.Array | None,
    *,
    cfg: CacheConfig,
    spec: SpecConfig,
    window: int | None,
    skip: bool = True,
    ahead: jax.Array | None = None,
) -> tuple[AllocatorState, AllocResult]:
    """`allocate_unchecked(window=None, speculative=False)`'s state and result, computed as `_grow_step` without
    drafts: in a [B, window] window for the rows whose request fits it, over [B, M] only for the rest (a CPU's
    program, where the full table's passes cost per element); window None: the one pass over [B, M] (a GPU's)."""
    m = cfg.max_blocks_per_seq
    return _grow_step(cfg, st, num_tokens.astype(i32), None, jnp.zeros((), i32), order, use_pool=spec.use_spec_pool,
                      max_draft_len=0, draft_window=m, split_window=None if window is None else min(window, m),
                      skip=skip, ahead=ahead)[:2]


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "window", "speculative", "skip"))
def allocate_unchecked(
    st: AllocatorState,
    num_tokens: jax.Array,
    generation: jax.Array,
    order: jax.Array | None,
    *,
    cfg: CacheConfig,
    spec: SpecConfig,
    window: int | None,
    speculative: bool,
    skip: bool = True,
    ahead: jax.Array | None = None,
) -> tuple[AllocatorState, AllocResult]:
    """`_grow` jitted; skip=False: no control flow (the rare release of copied blocks runs every call); ahead
    bool[B, B]: dense prefix sums in the order it encodes (`_grant_in_order`; order may then be None)."""
    return _grow(
        cfg,
        st,
        num_tokens.astype(i32),
        order,
        speculative=speculative,
        use_pool=spec.use_spec_pool,
        generation=jnp.asarray(generation, i32),
        max_draft_len=spec.draft_len,
        window=window or cfg.max_blocks_per_seq,
        skip=skip,
        ahead=ahead,
    )
