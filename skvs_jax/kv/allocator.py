"""The speculation-aware block allocator: an immutable pytree and pure, batched, jittable transitions.

The pool owns N physical KV blocks of S tokens. Block 0 is the null block: dead block-table entries point to
it and it is never handed out, so padding can never alias real data. Every other block is, at all times,
owned by exactly one of

  * the free stack            (state FREE, ref_count 0),
  * the speculative pool      (state STALE, ref_count 0; blocks of rejected drafts, reused first by drafts),
  * the evictable set         (state VALIDATED, ref_count 0, cached: pinned by the prefix cache, see `evict_lru`),
  * one or more sequences     (ref_count = number of block-table references; state RESERVED, SPECULATIVE,
                               VALIDATED, or STALE for blocks a lazily-releasing sequence still holds).

A block's state says what its content is:
  RESERVED     allocated for tokens that are being computed (prefill chunk, decode token), none committed yet;
  SPECULATIVE  allocated by `allocate_speculative`; holds only draft tokens; `generation` records the step;
  VALIDATED    holds at least one committed token;
  STALE        holds only rejected drafts (in the speculative pool, or held by a lazily-releasing sequence).

Per sequence the allocator keeps two lengths, `num_committed <= num_allocated`, plus `num_drafts` (pending
draft tokens, <= K) and `num_blocks` (table entries in use, >= ceil(num_allocated / S)). One step of an engine
runs `allocate` (decode/prefill slots) → `allocate_speculative` (draft slots) → model → `commit` (accepted
counts) → `reclaim_expired`; `free` ends a sequence and is idempotent.

Batched semantics, shared by every transition: decisions are taken from the state at call entry; sequences
are served in a given priority order `order` (a permutation of slots, `order[r]` = slot served r-th); a
request is all-or-nothing per sequence, and once a sequence that needs new blocks does not fit, no later one
that needs new blocks is served ("stop at the first that does not fit", by a prefix sum). Blocks are popped
from the top of a stack; released blocks are pushed in row-major (sequence slot, table column) order. Nothing
raises inside jit: failures come back as per-sequence `ok` flags and counters.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# One definition of the block states, shared with the block-state kernels.
from pallas_kernels import FREE, RESERVED, SPECULATIVE, STALE, VALIDATED
from skvs_jax import checks, vmap_flow
from skvs_jax.arrays import cdiv, count_leading, i32, rank_of
from skvs_jax.config import NULL_BLOCK, CacheConfig, SpecConfig

STATE_NAMES = ("FREE", "RESERVED", "SPECULATIVE", "VALIDATED", "STALE")



# ----------------------------------------------------------------------------------------------- state


@struct.dataclass
class Counters:
    """Cumulative event counts (int32 scalars). Counters are data: a failure shows up here, never raises."""

    alloc_failures: jax.Array  # sequences whose allocate / allocate_speculative request was refused
    spec_blocks_allocated: jax.Array  # blocks newly given SPECULATIVE state by allocate_speculative
    spec_pool_hits: jax.Array  # of those, blocks taken from the speculative pool
    spec_blocks_wasted: jax.Array  # SPECULATIVE blocks that held only rejected drafts at a commit
    spec_blocks_reclaimed: jax.Array  # pool blocks returned to the free stack by reclaim_expired
    cow_copies: jax.Array  # shared partially-filled blocks copied before a write
    evictions: jax.Array  # cached ref-0 blocks evicted by evict_lru


@struct.dataclass
class BlockPool:
    """Per-block metadata and the two stacks.

    state:       int8[N]   FREE / RESERVED / SPECULATIVE / VALIDATED / STALE (block 0: VALIDATED, never used)
    ref_count:   int32[N]  block-table references
    generation:  int32[N]  step that last gave the block SPECULATIVE state
    cached:      bool[N]   pinned by the prefix cache (kept after ref_count reaches 0, evictable)
    last_used:   int32[N]  `clock` value when the block last lost its final reference (LRU key)
    free_stack:  int32[N]  free_stack[:free_top] are free ids; the top is free_stack[free_top - 1]
    free_top:    int32[]
    pool_stack:  int32[P]  pool_stack[:pool_top] are speculative-pool ids, most recently released on top
    pool_top:    int32[]
    clock:       int32[]   advances on every `free` and `evict_lru`
    """

    state: jax.Array
    ref_count: jax.Array
    generation: jax.Array
    cached: jax.Array
    last_used: jax.Array
    free_stack: jax.Array
    free_top: jax.Array
    pool_stack: jax.Array
    pool_top: jax.Array
    clock: jax.Array


@struct.dataclass
class SeqBlocks:
    """Per-sequence block tables and lengths.

    block_table:   int32[B, M]  physical block of each logical block; NULL_BLOCK past num_blocks
    num_blocks:    int32[B]     table entries in use
    num_committed: int32[B]     validated tokens (their KV is final)
    num_allocated: int32[B]     token slots reserved: committed + pending (decode/prefill slots and drafts)
    num_drafts:    int32[B]     pending draft tokens, <= K
    """

    block_table: jax.Array
    num_blocks: jax.Array
    num_committed: jax.Array
    num_allocated: jax.Array
    num_drafts: jax.Array


@struct.dataclass
class AllocatorState:
    blocks: BlockPool
    seqs: SeqBlocks
    counters: Counters


@struct.dataclass
class AllocResult:
    """What `allocate` / `allocate_speculative` did.

    ok:           bool[B]   request granted (True for slots that requested nothing)
    cow_src/dst:  int32[B]  copy-on-write: copy block src's KV to dst before writing (NULL_BLOCK, NULL_BLOCK: none)
    """

    ok: jax.Array
    cow_src: jax.Array
    cow_dst: jax.Array


@struct.dataclass
class CommitResult:
    """ok: bool[B] accepted count was within [0, pending]; released: int32[] blocks given back."""

    ok: jax.Array
    released: jax.Array


# ------------------------------------------------------------------------------------------------ init


def init(cfg: CacheConfig) -> AllocatorState:
    """A pool with every usable block on the free stack (block 1 on top, so allocation order is 1, 2, …)."""
    n, b, m, p = cfg.num_blocks, cfg.max_seqs, cfg.max_blocks_per_seq, cfg.pool_capacity
    free_stack = jnp.zeros((n,), i32).at[: n - 1].set(jnp.arange(n - 1, 0, -1, dtype=i32))
    state = jnp.full((n,), FREE, jnp.int8).at[NULL_BLOCK].set(VALIDATED)
    zero = jnp.zeros((), i32)
    blocks = BlockPool(
        state=state,
        ref_count=jnp.zeros((n,), i32),
        generation=jnp.zeros((n,), i32),
        cached=jnp.zeros((n,), bool),
        last_used=jnp.zeros((n,), i32),
        free_stack=free_stack,
        free_top=jnp.asarray(n - 1, i32),
        pool_stack=jnp.zeros((p,), i32),
        pool_top=zero,
        clock=zero,
    )
    seqs = SeqBlocks(
        block_table=jnp.full((b, m), NULL_BLOCK, i32),
        num_blocks=jnp.zeros((b,), i32),
        num_committed=jnp.zeros((b,), i32),
        num_allocated=jnp.zeros((b,), i32),
        num_drafts=jnp.zeros((b,), i32),
    )
    counters = Counters(*([zero] * len(Counters.__dataclass_fields__)))
    return AllocatorState(blocks=blocks, seqs=seqs, counters=counters)


# ------------------------------------------------------------------------------------------- helpers


def _push(stack, top, ids, mask, rank) -> tuple[jax.Array, jax.Array]:
    """Push ids[mask] (flat [X]) onto a stack in their given order; rank = inclusive count of mask so far.

    The caller computes the ranks, so that several pushes share one cumsum (on CPU each cumsum is several
    reduce-window ops, the single largest cost of a step).
    """
    stack = stack.at[jnp.where(mask, top + rank - 1, stack.shape[0])].set(ids, mode="drop")
    return stack, top + rank[-1]


def _prefix_counts(*masks: jax.Array) -> jax.Array:
    """Inclusive running counts of several [X] masks with one cumsum: int32[len(masks), X]."""
    return jnp.cumsum(jnp.stack(masks), axis=1, dtype=i32)


def _pop_two(first, first_top, second, second_top, index):
    """The block at combined pop position `index` (0 = top of `first`; `second` continues below it)."""
    from_first = index < first_top
    a = first[jnp.clip(first_top - 1 - index, 0, first.shape[0] - 1)]
    b = second[jnp.clip(second_top - 1 - (index - first_top), 0, second.shape[0] - 1)]
    return jnp.where(from_first, a, b), from_first


def _release(
    blocks: BlockPool, ids: jax.Array, released: jax.Array, use_pool: bool
) -> tuple[BlockPool, jax.Array]:
    """Route blocks whose ref count just reached 0 (flat ids[X], distinct where `released`).

    cached → evictable (stays VALIDATED); SPECULATIVE/STALE → speculative pool (if enabled and not full);
    everything else, and pool overflow → free stack. Returns the new pool and the number routed.
    """
    safe = jnp.where(released, ids, NULL_BLOCK)
    cached = released & blocks.cached[safe]
    state = blocks.state[safe]
    drafty = (state == SPECULATIVE) | (state == STALE)
    uncached = released & ~cached
    want_pool = uncached & drafty if use_pool else jnp.zeros_like(released)
    room = blocks.pool_stack.shape[0] - blocks.pool_top
    # The pool takes the first `room` candidates; the rest and every other uncached block go to the free stack.
    want_rank, uncached_rank = _prefix_counts(want_pool, uncached)
    to_pool = want_pool & (want_rank <= room)
    pool_rank = jnp.minimum(want_rank, room)
    to_free = uncached & ~to_pool

    pool_stack, pool_top = _push(blocks.pool_stack, blocks.pool_top, ids, to_pool, pool_rank)
    free_stack, free_top = _push(blocks.free_stack, blocks.free_top, ids, to_free, uncached_rank - pool_rank)
    n = blocks.state.shape[0]
    new_state = jnp.where(to_pool, STALE, FREE).astype(jnp.int8)
    state_arr = blocks.state.at[jnp.where(to_pool | to_free, ids, n)].set(new_state, mode="drop")
    last_used = blocks.last_used.at[jnp.where(cached, ids, n)].set(blocks.clock, mode="drop")
    blocks = blocks.replace(
        state=state_arr,
        last_used=last_used,
        free_stack=free_stack,
        free_top=free_top,
        pool_stack=pool_stack,
        pool_top=pool_top,
    )
    return blocks, jnp.sum(released, dtype=i32)


# ------------------------------------------------------------------------------------------ allocate


class _Request(NamedTuple):
    """What each row asks of `_grow` (all [B]): the phases after `_requested_blocks` read it."""

    requested: jax.Array  # bool: a non-zero token count
    bad: jax.Array  # bool: an invalid request, refused
    cow: jax.Array  # bool: the first token lands in a shared (or pinned) partial block, to be copied
    need: jax.Array  # int32: new blocks (the copy included); 0 for a refused row
    partial_col: jax.Array  # int32: the table column of the first new token
    partial_blk: jax.Array  # int32: the block at that column
    new_alloc: jax.Array  # int32: num_allocated after the request


class _Window(NamedTuple):
    """The [B, W] view of the table window that `_pop_blocks` fills: column j is logical block partial_col + j."""

    col: jax.Array  # int32[B, W] the logical block of each window column
    take: jax.Array  # bool[B, W] gets a popped block (a new column or the copy of the partial block)
    is_cow: jax.Array  # bool[B, W] the copy (column 0 of a copying row)
    is_held: jax.Array  # bool[B, W] a lazily held block, reused in place
    new_id: jax.Array  # int32[B, W] the popped block (where take)
    from_pool: jax.Array  # bool[B, W] taken from the speculative pool (else from the free stack)
    taken: jax.Array  # int32[] blocks popped
    taken_pool: jax.Array  # int32[] of those, from the speculative pool


def _requested_blocks(cfg: CacheConfig, seqs: SeqBlocks, blocks: BlockPool, num_tokens: jax.Array, *,
                      speculative: bool, max_draft_len: int, window: int) -> _Request:
    """Validity, copy-on-write and new blocks of each row's request to extend num_allocated by num_tokens[B]."""
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
    partial_col = alloc // s
    partial_blk = seqs.block_table[b_idx, jnp.clip(partial_col, 0, m - 1)]
    cow = (alloc % s != 0) & ((blocks.ref_count[partial_blk] > 1) | blocks.cached[partial_blk])
    need = jnp.maximum(cdiv(new_alloc, s) - held, 0) + cow.astype(i32)
    # The window covers logical blocks partial_col .. ceil(new_alloc / S) - 1.
    bad |= cdiv(new_alloc, s) - partial_col > window
    need = jnp.where(requested & ~bad, need, 0)
    return _Request(requested, bad, cow, need, partial_col, partial_blk, new_alloc)


def _grant_in_order(blocks: BlockPool, req: _Request, order: jax.Array | None, *,
                    use_pool: bool) -> tuple[jax.Array, jax.Array]:
    """Grant the requests whose blocks fit, by a prefix sum of need over the free stack (and the pool) in
    priority order; a row past the first that does not fit does not fit either. Returns (ok bool[B], offset
    int32[B]: the combined pop position of each row's first block)."""
    need, bad = req.need, req.bad
    if use_pool:
        available = blocks.free_top + blocks.pool_top
    else:
        available = blocks.free_top
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
    if speculative and use_pool:
        new_id, from_first = _pop_two(
            blocks.pool_stack, blocks.pool_top, blocks.free_stack, blocks.free_top, pop_index
        )
        from_pool = take & from_first
    elif use_pool:
        new_id, from_first = _pop_two(
            blocks.free_stack, blocks.free_top, blocks.pool_stack, blocks.pool_top, pop_index
        )
        from_pool = take & ~from_first
    else:
        new_id = blocks.free_stack[jnp.clip(blocks.free_top - 1 - pop_index, 0, cfg.num_blocks - 1)]
        from_pool = jnp.zeros_like(take)
    taken = jnp.sum(take, dtype=i32)
    taken_pool = jnp.sum(from_pool, dtype=i32)
    return _Window(col, take, is_cow, is_held, new_id, from_pool, taken, taken_pool)


def _write_table_and_states(cfg: CacheConfig, seqs: SeqBlocks, blocks: BlockPool, req: _Request, ok: jax.Array,
                            win: _Window, *, speculative: bool,
                            generation: jax.Array) -> tuple[BlockPool, jax.Array, jax.Array]:
    """Write the popped blocks into the table and give every touched block its state (a copy VALIDATED, others
    RESERVED or SPECULATIVE with the generation), ref count 1, the copied blocks one reference less; pop the
    stacks. Returns (blocks, block_table int32[B, M], old_cow_blk int32[B]: each copied block, N = none)."""
    m, n = cfg.max_blocks_per_seq, cfg.num_blocks
    b_idx = jnp.arange(seqs.num_blocks.shape[0], dtype=i32)
    take, new_id = win.take, win.new_id
    old_cow_blk = jnp.where(req.cow & ok & req.requested, req.partial_blk, n)
    table_col = jnp.where(take, win.col, m)
    block_table = seqs.block_table.at[b_idx[:, None], table_col].set(new_id, mode="drop")
    # Held columns are not written above, so reading the new table avoids keeping the old one alive (a copy).
    held_id = block_table[b_idx[:, None], jnp.clip(win.col, 0, m - 1)]
    fresh_state = SPECULATIVE if speculative else RESERVED
    touched = jnp.where(take, new_id, jnp.where(win.is_held, held_id, n))
    # A cow copy keeps the content (committed tokens) of its source: VALIDATED.
    touched_state = jnp.where(win.is_cow, VALIDATED, fresh_state).astype(jnp.int8)
    state = blocks.state.at[touched].set(touched_state, mode="drop")
    generation_arr = blocks.generation
    if speculative:
        generation_arr = generation_arr.at[jnp.where(win.is_cow, n, touched)].set(generation, mode="drop")
    ref_count = blocks.ref_count.at[jnp.where(take, new_id, n)].set(1, mode="drop")
    ref_count = ref_count.at[old_cow_blk].add(-1, mode="drop")

    free_taken = win.taken - win.taken_pool
    blocks = blocks.replace(
        state=state,
        ref_count=ref_count,
        generation=generation_arr,
        free_top=blocks.free_top - free_taken,
        pool_top=blocks.pool_top - win.taken_pool,
    )
    return blocks, block_table, old_cow_blk


def _release_copied(blocks: BlockPool, old_cow_blk: jax.Array, *, use_pool: bool) -> BlockPool:
    """Route the copied blocks (old_cow_blk int32[B], N = none) whose last reference the copies dropped."""
    n = blocks.state.shape[0]
    b_idx = jnp.arange(old_cow_blk.shape[0], dtype=i32)

    def release_copied(blocks: BlockPool) -> BlockPool:
        # Every holder of a shared partial block may copy it in one call; the last copy drops it to 0.
        released = (old_cow_blk < n) & (blocks.ref_count[jnp.clip(old_cow_blk, 0, n - 1)] == 0)
        last_holder = jnp.full((n,), -1, i32).at[old_cow_blk].max(b_idx, mode="drop")
        released &= last_holder[jnp.clip(old_cow_blk, 0, n - 1)] == b_idx
        return _release(blocks, old_cow_blk, released, use_pool)[0]

    # Copies are rare; skip the O(N) bookkeeping when there is none.
    return vmap_flow.when(jnp.any(old_cow_blk < n), release_copied, blocks)


def _count_grow(c: Counters, req: _Request, ok: jax.Array, grant: jax.Array, win: _Window, *,
                speculative: bool) -> Counters:
    """Refused requests, copies, and (drafts) the blocks given SPECULATIVE state and those from the pool."""
    c = c.replace(
        alloc_failures=c.alloc_failures + jnp.sum(req.requested & ~ok, dtype=i32),
        cow_copies=c.cow_copies + jnp.sum(req.cow & grant, dtype=i32),
    )
    if speculative:
        new_spec = jnp.sum((win.take & ~win.is_cow) | win.is_held, dtype=i32)
        c = c.replace(
            spec_blocks_allocated=c.spec_blocks_allocated + new_spec,
            spec_pool_hits=c.spec_pool_hits + win.taken_pool,
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
) -> tuple[AllocatorState, AllocResult]:
    """Shared body of `allocate` and `allocate_speculative`: extend num_allocated by num_tokens[B].

    In phases: what each row asks for, which requests fit in priority order, the blocks each pops into its
    [B, W] window, the table and block-state writes, the release of the blocks copied away, the counters."""
    seqs = st.seqs
    req = _requested_blocks(cfg, seqs, st.blocks, num_tokens, speculative=speculative, max_draft_len=max_draft_len,
                            window=window)
    ok, offset = _grant_in_order(st.blocks, req, order, use_pool=use_pool)
    win = _pop_blocks(cfg, seqs, st.blocks, req, ok, offset, speculative=speculative, use_pool=use_pool,
                      window=window)
    blocks, block_table, old_cow_blk = _write_table_and_states(cfg, seqs, st.blocks, req, ok, win,
                                                               speculative=speculative, generation=generation)
    blocks = _release_copied(blocks, old_cow_blk, use_pool=use_pool)

    grant = ok & req.requested
    seqs = seqs.replace(
        block_table=block_table,
        num_blocks=jnp.where(grant, jnp.maximum(seqs.num_blocks, cdiv(req.new_alloc, cfg.block_size)),
                             seqs.num_blocks),
        num_allocated=jnp.where(grant, req.new_alloc, seqs.num_allocated),
        num_drafts=jnp.where(grant & speculative, seqs.num_drafts + num_tokens, seqs.num_drafts),
    )
    counters = _count_grow(st.counters, req, ok, grant, win, speculative=speculative)
    cow_src = jnp.where(req.cow & grant, req.partial_blk, NULL_BLOCK)
    cow_dst = jnp.where(req.cow & grant, win.new_id[:, 0], NULL_BLOCK)
    result = AllocResult(ok=ok | ~req.requested, cow_src=cow_src, cow_dst=cow_dst)
    return AllocatorState(blocks=blocks, seqs=seqs, counters=counters), result


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "window", "speculative"))
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
) -> tuple[AllocatorState, AllocResult]:
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
    )


# -------------------------------------------------------------------------------------------- commit


def accepted_lengths(accept_mask: jax.Array) -> jax.Array:
    """bool[B, K] per-draft acceptance -> int32[B] length of the accepted prefix (leading Trues)."""
    return count_leading(accept_mask)


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "window"))
def commit_unchecked(
    st: AllocatorState, num_accepted: jax.Array, *, cfg: CacheConfig, spec: SpecConfig, window: int | None
) -> tuple[AllocatorState, CommitResult]:
    # Works on the [B, W] table columns from each sequence's first non-full committed block; a sequence
    # whose span (num_blocks - num_committed // S) exceeds W is left untouched and flagged. W = M always fits.
    s, m, n = cfg.block_size, cfg.max_blocks_per_seq, cfg.num_blocks
    window = min(window or m, m)
    blocks, seqs = st.blocks, st.seqs
    b_idx = jnp.arange(seqs.num_blocks.shape[0], dtype=i32)[:, None]
    num_accepted = num_accepted.astype(i32)
    fits = seqs.num_blocks - seqs.num_committed // s <= window
    pending = seqs.num_allocated - seqs.num_committed
    ok = fits & (num_accepted >= 0) & (num_accepted <= pending)
    committed = jnp.where(fits, seqs.num_committed + jnp.clip(num_accepted, 0, pending), seqs.num_committed)
    keep = cdiv(committed, s)

    col = (seqs.num_committed // s)[:, None] + jnp.arange(window, dtype=i32)[None, :]  # [B, W]
    in_table = (col < seqs.num_blocks[:, None]) & fits[:, None]
    ids = jnp.where(in_table, seqs.block_table[b_idx, jnp.clip(col, 0, m - 1)], n)
    # The masks below are made to depend on the values just gathered (ids, old_state): without that data
    # dependence XLA cannot order the gathers before the in-place scatters and copies the table and the
    # state array on every call. For live entries both conditions hold by invariant.
    old_state = blocks.state[jnp.clip(ids, 0, n - 1)]
    in_table &= (ids != NULL_BLOCK) & (old_state != FREE)
    validate = in_table & (col < keep[:, None])
    rejected = in_table & (col >= keep[:, None])
    wasted = jnp.sum(rejected & (old_state == SPECULATIVE), dtype=i32)

    state = blocks.state.at[jnp.where(validate, ids, n)].set(VALIDATED, mode="drop")
    state = state.at[jnp.where(rejected, ids, n)].set(STALE, mode="drop")
    blocks = blocks.replace(state=state)
    table = seqs.block_table
    if spec.release == "immediate":
        # Blocks past the committed prefix are never shared (fork shares committed blocks only): ref 1 -> 0.
        ref_count = blocks.ref_count.at[jnp.where(rejected, ids, n)].add(-1, mode="drop")
        blocks = blocks.replace(ref_count=ref_count)
        blocks, released = _release(blocks, ids.reshape(-1), rejected.reshape(-1), spec.use_spec_pool)
        table = table.at[b_idx, jnp.where(rejected, col, m)].set(NULL_BLOCK, mode="drop")
        num_blocks = jnp.where(fits, jnp.minimum(seqs.num_blocks, keep), seqs.num_blocks)
    else:
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


@functools.partial(jax.jit, static_argnames=("cfg", "spec"))
def free_unchecked(
    st: AllocatorState, seq_mask: jax.Array, *, cfg: CacheConfig, spec: SpecConfig = SpecConfig()
) -> tuple[AllocatorState, jax.Array]:
    n, m = cfg.num_blocks, cfg.max_blocks_per_seq

    def release(operand):
        st, _ = operand
        blocks, seqs = st.blocks, st.seqs
        col = jnp.arange(m, dtype=i32)[None, :]
        drop = seq_mask[:, None] & (col < seqs.num_blocks[:, None])  # [B, M]
        ids = jnp.where(drop, seqs.block_table, n).reshape(-1)
        ref_count = blocks.ref_count.at[ids].add(-1, mode="drop")
        # A block shared by several freed sequences is released once, at its last reference in row-major order.
        flat = jnp.arange(ids.shape[0], dtype=i32)
        last = jnp.full((n,), -1, i32).at[ids].max(flat, mode="drop")
        safe = jnp.clip(ids, 0, n - 1)
        released = (ids < n) & (ref_count[safe] == 0) & (last[safe] == flat)
        blocks, num_released = _release(blocks.replace(ref_count=ref_count), ids, released, spec.use_spec_pool)
        zero = jnp.zeros_like(seqs.num_blocks)
        seqs = SeqBlocks(
            block_table=jnp.where(seq_mask[:, None], NULL_BLOCK, seqs.block_table),
            num_blocks=jnp.where(seq_mask, zero, seqs.num_blocks),
            num_committed=jnp.where(seq_mask, zero, seqs.num_committed),
            num_allocated=jnp.where(seq_mask, zero, seqs.num_allocated),
            num_drafts=jnp.where(seq_mask, zero, seqs.num_drafts),
        )
        return st.replace(blocks=blocks, seqs=seqs), num_released

    # Freeing no sequence changes nothing but the clock, and the scheduler frees (finished rows, victims) every
    # step: skip the [B, M] and [N] passes then.
    st, num_released = vmap_flow.when(jnp.any(seq_mask), release, (st, jnp.zeros((), i32)), identity_when_false=True)
    return st.replace(blocks=st.blocks.replace(clock=st.blocks.clock + 1)), num_released


# --------------------------------------------------------------------------------------- share / fork


@functools.partial(jax.jit, static_argnames=("cfg",))
def share_unchecked(
    st: AllocatorState, block_ids: jax.Array, num_tokens: jax.Array, *, cfg: CacheConfig
) -> tuple[AllocatorState, jax.Array]:
    s, m, n = cfg.block_size, cfg.max_blocks_per_seq, cfg.num_blocks
    blocks, seqs = st.blocks, st.seqs
    num_tokens = num_tokens.astype(i32)
    requested = num_tokens != 0
    nb = cdiv(jnp.maximum(num_tokens, 0), s)
    col = jnp.arange(m, dtype=i32)[None, :]
    used = col < nb[:, None]
    in_range = (block_ids >= 1) & (block_ids < n)
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


@jax.jit
def reclaim_expired_unchecked(
    st: AllocatorState, current_generation: jax.Array, threshold: jax.Array
) -> tuple[AllocatorState, jax.Array]:
    blocks = st.blocks
    p = blocks.pool_stack.shape[0]
    k = jnp.arange(p, dtype=i32)
    ids = blocks.pool_stack
    live = k < blocks.pool_top
    expired = live & (jnp.asarray(current_generation, i32) - blocks.generation[ids] > threshold)
    count = jnp.sum(expired, dtype=i32)

    def compact(blocks: BlockPool) -> BlockPool:
        kept = live & ~expired
        expired_rank = jnp.cumsum(expired, dtype=i32)
        kept_rank = jnp.minimum(k + 1, blocks.pool_top) - expired_rank
        pool_stack, pool_top = _push(jnp.zeros_like(ids), jnp.zeros((), i32), ids, kept, kept_rank)
        free_stack, free_top = _push(blocks.free_stack, blocks.free_top, ids, expired, expired_rank)
        n = blocks.state.shape[0]
        state = blocks.state.at[jnp.where(expired, ids, n)].set(FREE, mode="drop")
        return blocks.replace(
            state=state, free_stack=free_stack, free_top=free_top, pool_stack=pool_stack, pool_top=pool_top
        )

    blocks = vmap_flow.when(count > 0, compact, blocks)
    counters = st.counters.replace(spec_blocks_reclaimed=st.counters.spec_blocks_reclaimed + count)
    return st.replace(blocks=blocks, counters=counters), count


@jax.jit
def set_cached_unchecked(st: AllocatorState, block_ids: jax.Array, cached: jax.Array) -> AllocatorState:
    blocks = st.blocks
    n = blocks.state.shape[0]
    valid = (block_ids > 0) & (block_ids < n)
    safe = jnp.where(valid, block_ids, NULL_BLOCK)
    pin = valid & cached & (blocks.state[safe] == VALIDATED) & (blocks.ref_count[safe] > 0)
    unpin = valid & ~cached & blocks.cached[safe]
    flags = blocks.cached.at[jnp.where(pin, block_ids, n)].set(True, mode="drop")
    flags = flags.at[jnp.where(unpin, block_ids, n)].set(False, mode="drop")
    orphan = unpin & (blocks.ref_count[safe] == 0)
    flat = jnp.arange(block_ids.shape[0], dtype=i32)
    first = jnp.full((n,), block_ids.shape[0], i32).at[jnp.where(orphan, block_ids, n)].min(flat, mode="drop")
    orphan &= first[safe] == flat
    blocks = blocks.replace(cached=flags)
    blocks, _ = _release(blocks, block_ids, orphan, use_pool=False)
    return st.replace(blocks=blocks)


@functools.partial(jax.jit, static_argnames=("max_evict",))
def evict_lru_unchecked(
    st: AllocatorState, num_blocks: jax.Array, *, max_evict: int
) -> tuple[AllocatorState, jax.Array]:
    blocks = st.blocks
    n = blocks.state.shape[0]
    evictable = blocks.cached & (blocks.ref_count == 0)
    # Eviction is rare (only when the free stack runs dry), so a stable sort over N is affordable here.
    key = jnp.where(evictable, blocks.last_used, jnp.iinfo(jnp.int32).max)
    ids = jnp.argsort(key, stable=True)[:max_evict].astype(i32)
    ids = jnp.pad(ids, (0, max_evict - ids.shape[0]))  # max_evict > N: the null block, never evictable, pads
    take = (jnp.arange(max_evict) < num_blocks) & evictable[ids]
    flags = blocks.cached.at[jnp.where(take, ids, n)].set(False, mode="drop")
    free_stack, free_top = _push(blocks.free_stack, blocks.free_top, ids, take, jnp.cumsum(take, dtype=i32))
    state = blocks.state.at[jnp.where(take, ids, n)].set(FREE, mode="drop")
    blocks = blocks.replace(
        cached=flags, state=state, free_stack=free_stack, free_top=free_top, clock=blocks.clock + 1
    )
    counters = st.counters.replace(evictions=st.counters.evictions + jnp.sum(take, dtype=i32))
    return st.replace(blocks=blocks, counters=counters), jnp.where(take, ids, NULL_BLOCK)


# ------------------------------------------------------------------- public API (validated at the boundary)
#
# Each public transition checks shapes and dtypes on every call (traced or not) and, when its arguments are
# concrete, their values; then it runs the jitted implementation above. Called inside a user's jit, the
# value checks are skipped and bad values come back as ok=False flags and counters.


def _check_type(st) -> None:
    if not isinstance(st, AllocatorState):
        raise TypeError(f"st must be an AllocatorState, got {type(st).__name__}")


def check_state(st: AllocatorState, cfg: CacheConfig) -> None:
    """Raise if the state's shapes do not match cfg (e.g. a state built for another config)."""
    _check_type(st)
    n, b, m = cfg.num_blocks, cfg.max_seqs, cfg.max_blocks_per_seq
    checks.array("st.blocks.state", st.blocks.state, (n,), "i")
    checks.array("st.blocks.pool_stack", st.blocks.pool_stack, (cfg.pool_capacity,), "i")
    checks.array("st.seqs.block_table", st.seqs.block_table, (b, m), "i")


def _check_counts(name: str, x, cfg: CacheConfig) -> None:
    checks.array(name, x, (cfg.max_seqs,), "i")
    checks.in_range(name, x, 0, cfg.max_tokens_per_seq)


def allocate(
    st: AllocatorState,
    num_tokens: jax.Array,
    order: jax.Array | None = None,
    *,
    cfg: CacheConfig,
    spec: SpecConfig = SpecConfig(),
    window: int | None = None,
) -> tuple[AllocatorState, AllocResult]:
    """Reserve slots for num_tokens[B] more tokens per sequence (prefill chunk or decode); new blocks RESERVED.

    Blocks come from the free stack, then (when the speculative pool is enabled) from the pool: stale draft
    blocks are spent before any cached prefix would have to be evicted. A sequence whose next token lands
    in a shared, partially-filled block gets a private copy first (result.cow_src → result.cow_dst; the
    caller copies the KV). `window` (static, default M) bounds the logical blocks one request may touch.
    Refused (ok=False, counted in alloc_failures): more than M * S tokens, pending drafts (decode/prefill
    slots come before the drafts of a step), a request wider than `window`, or no room in priority order.
    """
    check_state(st, cfg)
    checks.static_int("window", window, 1, cfg.max_blocks_per_seq)
    _check_counts("num_tokens", num_tokens, cfg)
    if order is not None:
        checks.permutation("order", order, cfg.max_seqs)
    return allocate_unchecked(st, num_tokens, 0, order, cfg=cfg, spec=spec, window=window, speculative=False)


def allocate_speculative(
    st: AllocatorState,
    num_drafts: jax.Array,
    generation: jax.Array | int,
    order: jax.Array | None = None,
    *,
    cfg: CacheConfig,
    spec: SpecConfig = SpecConfig(),
    window: int | None = None,
) -> tuple[AllocatorState, AllocResult]:
    """Reserve slots for num_drafts[B] draft tokens; blocks that hold only drafts become SPECULATIVE.

    New blocks come from the speculative pool first (recently released, still warm), then the free stack;
    `generation` (int32 scalar, usually the step number) is recorded on them for `reclaim_expired`. A
    sequence holds at most K = spec.draft_len pending drafts, so its drafts newly occupy at most ceil(K / S)
    blocks. Refused as in `allocate`, and when pending drafts would exceed K.
    """
    check_state(st, cfg)
    checks.static_int("window", window, 1, cfg.max_blocks_per_seq)
    _check_counts("num_drafts", num_drafts, cfg)
    checks.in_range("num_drafts", num_drafts, 0, spec.draft_len)
    checks.scalar_int("generation", generation)
    checks.in_range("generation", generation, 0, 2**31 - 1)  # reclaim's age is a difference of two of these
    if order is not None:
        checks.permutation("order", order, cfg.max_seqs)
    return allocate_unchecked(st, num_drafts, generation, order, cfg=cfg, spec=spec, window=window, speculative=True)


def commit(
    st: AllocatorState,
    num_accepted: jax.Array,
    *,
    cfg: CacheConfig,
    spec: SpecConfig = SpecConfig(),
    window: int | None = None,
) -> tuple[AllocatorState, CommitResult]:
    """Settle every pending slot: the first num_accepted[B] become committed, the rest are rolled back.

    Blocks covering committed tokens become VALIDATED. Blocks past ceil(num_committed / S) hold only
    rejected tokens: with spec.release="immediate" they leave the sequence at once (to the speculative pool
    when enabled, else the free stack); with "lazy" the sequence keeps them as STALE (the naive baseline)
    and reuses them for its next tokens. Each SPECULATIVE block among them counts in spec_blocks_wasted.
    Traced counts outside [0, pending] are clipped and flagged (ok=False). Afterwards num_allocated ==
    num_committed and num_drafts == 0 for every sequence. Use `accepted_lengths` to turn an accept mask
    into counts. `window` (static, default M) bounds the table columns examined per sequence, from its
    first non-full committed block: a decode step with windowed allocations needs ceil((1 + K) / S) + 1.
    A sequence whose span (num_blocks - num_committed // S) exceeds it is left untouched with ok=False
    (commit it again with a wider window); with the default every sequence fits.
    """
    check_state(st, cfg)
    checks.static_int("window", window, 1, cfg.max_blocks_per_seq)
    checks.array("num_accepted", num_accepted, (cfg.max_seqs,), "i")
    if checks.is_concrete(num_accepted) and checks.is_concrete(st.seqs.num_allocated):
        pending = np.asarray(st.seqs.num_allocated) - np.asarray(st.seqs.num_committed)
        acc = np.asarray(num_accepted)
        if (acc < 0).any() or (acc > pending).any():
            b = int(np.nonzero((acc < 0) | (acc > pending))[0][0])
            raise ValueError(f"num_accepted[{b}] = {acc[b]} is outside [0, pending = {pending[b]}]")
    return commit_unchecked(st, num_accepted, cfg=cfg, spec=spec, window=window)


def free(
    st: AllocatorState, seq_mask: jax.Array, *, cfg: CacheConfig, spec: SpecConfig = SpecConfig()
) -> tuple[AllocatorState, jax.Array]:
    """End the sequences in seq_mask: bool[B]; drop every table reference; blocks reaching ref 0 are released.

    A released block goes to the evictable set if cached, to the speculative pool if it holds only drafts
    (pool enabled and not full), else to the free stack. The slots are emptied, so freeing twice is a no-op:
    this is the one release path. Returns the new state and the number of blocks released (int32 scalar).
    """
    check_state(st, cfg)
    checks.array("seq_mask", seq_mask, (cfg.max_seqs,), "b")
    return free_unchecked(st, seq_mask, cfg=cfg, spec=spec)


def share(
    st: AllocatorState, block_ids: jax.Array, num_tokens: jax.Array, *, cfg: CacheConfig
) -> tuple[AllocatorState, jax.Array]:
    """Start empty sequences on existing validated blocks (prefix-cache hits), by reference.

    block_ids: int32[B, M], of which row b's first ceil(num_tokens[b] / S) entries are used; num_tokens:
    int32[B], 0 = slot not involved. Each referenced block's ref count grows by one (a cached ref-0 block
    leaves the evictable set this way) and the slot starts with num_committed = num_tokens. Refused
    (ok=False, slot unchanged): slot not empty, an id outside [1, N), or a block that is not VALIDATED and
    owned. Returns the new state and ok: bool[B] (True where num_tokens == 0).
    """
    check_state(st, cfg)
    checks.array("block_ids", block_ids, (cfg.max_seqs, cfg.max_blocks_per_seq), "i")
    _check_counts("num_tokens", num_tokens, cfg)
    if checks.is_concrete(block_ids) and checks.is_concrete(num_tokens):
        used = np.arange(cfg.max_blocks_per_seq)[None, :] < -(-np.asarray(num_tokens)[:, None] // cfg.block_size)
        checks.in_range("block_ids", np.asarray(block_ids)[used], 1, cfg.num_blocks - 1)
    return share_unchecked(st, block_ids, num_tokens, cfg=cfg)


def fork(st: AllocatorState, parent: jax.Array, *, cfg: CacheConfig) -> tuple[AllocatorState, jax.Array]:
    """parent: int32[B]; slot b becomes a child of slot parent[b] (-1 = no fork), sharing its committed blocks.

    The parent must have no pending slots and at least one committed token, must not itself be a child in
    the same call, and the child must be empty. The first append into the shared partially-filled last
    block copies it (copy-on-write, see `allocate`). Returns the new state and ok: bool[B].
    """
    check_state(st, cfg)
    checks.array("parent", parent, (cfg.max_seqs,), "i")
    checks.in_range("parent", parent, -1, cfg.max_seqs - 1)
    return fork_unchecked(st, parent, cfg=cfg)


def reclaim_expired(
    st: AllocatorState, current_generation: jax.Array | int, threshold: jax.Array | int
) -> tuple[AllocatorState, jax.Array]:
    """Return speculative-pool blocks with current_generation - generation > threshold to the free stack.

    Generations are step numbers in [0, 2^31 - 1] (refused otherwise when concrete), so the age never wraps.

    Both are int32 scalars and data, so one compiled program serves every threshold (vmap-able). The pool
    keeps its order; expired blocks are pushed bottom-of-pool first. Returns the state and the count.
    """
    _check_type(st)
    checks.scalar_int("current_generation", current_generation)
    checks.in_range("current_generation", current_generation, 0, 2**31 - 1)
    checks.scalar_int("threshold", threshold)
    checks.in_range("threshold", threshold, 0, 2**31 - 1)
    return reclaim_expired_unchecked(st, current_generation, threshold)


def set_cached(st: AllocatorState, block_ids: jax.Array, cached: jax.Array) -> AllocatorState:
    """Pin (cached=True) or unpin blocks for the prefix cache. block_ids: int32[X] below N; ids <= 0 are ignored.

    Only VALIDATED blocks held by a sequence can be pinned (others are ignored: the prefix cache must only
    ever hold validated content). Unpinning a ref-0 block returns it to the free stack.
    """
    _check_type(st)
    if not hasattr(block_ids, "shape") or len(block_ids.shape) != 1:
        raise ValueError(f"block_ids must be a 1-D array, got {getattr(block_ids, 'shape', type(block_ids))}")
    checks.array("block_ids", block_ids, block_ids.shape, "i")
    checks.in_range("block_ids", block_ids, -(2**31), st.blocks.state.shape[0] - 1)
    checks.array("cached", cached, block_ids.shape, "b")
    return set_cached_unchecked(st, block_ids, cached)


def evict_lru(
    st: AllocatorState, num_blocks: jax.Array | int, *, max_evict: int
) -> tuple[AllocatorState, jax.Array]:
    """Evict up to num_blocks (<= max_evict, static) cached ref-0 blocks, least recently released first.

    Evicted blocks are unpinned and pushed to the free stack. Returns the state and the evicted ids,
    int32[max_evict] padded with NULL_BLOCK (the prefix index drops its entries for them).
    """
    _check_type(st)
    if isinstance(max_evict, bool) or not isinstance(max_evict, int) or max_evict < 1:
        raise ValueError(f"max_evict must be a positive int, got {max_evict!r}")
    checks.scalar_int("num_blocks", num_blocks)
    checks.in_range("num_blocks", num_blocks, 0, max_evict)
    return evict_lru_unchecked(st, num_blocks, max_evict=max_evict)
