"""The allocator's state pytrees and results, `init`, and the stack operations every transition shares.

Block states (int8) come from `pallas_kernels`, where the block-state kernels read the same definition.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

# One definition of the block states, shared with the block-state kernels.
from pallas_kernels import FREE, RESERVED, SPECULATIVE, STALE, VALIDATED  # noqa: F401  (re-exported: the block states)
from skvs_jax.arrays import SMALL_TRAILING, i32, take_each
from skvs_jax.config import NULL_BLOCK, CacheConfig

STATE_NAMES = ("FREE", "RESERVED", "SPECULATIVE", "VALIDATED", "STALE")



# ----------------------------------------------------------------------------------------------- state


@struct.dataclass
class Counters:
    """Cumulative event counts (int32[] scalars). Counters are data: a failure shows up here, never raises."""

    alloc_failures: jax.Array  # sequences whose allocate / allocate_speculative request was refused
    spec_blocks_allocated: jax.Array  # blocks newly given SPECULATIVE state by allocate_speculative
    spec_pool_hits: jax.Array  # of those, blocks taken from the speculative pool
    spec_blocks_wasted: jax.Array  # SPECULATIVE blocks that held only rejected drafts at a commit
    spec_blocks_reclaimed: jax.Array  # pool blocks returned to the free stack by reclaim_expired
    cow_copies: jax.Array  # shared partially-filled blocks copied before a write
    evictions: jax.Array  # cached ref-0 blocks evicted by evict_lru


@struct.dataclass
class BlockPool:
    """Per-block metadata and the two stacks, kept in one array so that a release pushes onto both, and an
    allocation pops from both, with one scatter or gather (a kernel launch each on a GPU)."""

    state: jax.Array  # int8[N] FREE / RESERVED / SPECULATIVE / VALIDATED / STALE (block 0: VALIDATED, never used)
    ref_count: jax.Array  # int32[N] block-table references
    generation: jax.Array  # int32[N] step that last gave the block SPECULATIVE state
    cached: jax.Array  # bool[N] pinned by the prefix cache (kept after ref_count reaches 0, evictable)
    last_used: jax.Array  # int32[N] `clock` value when the block last lost its final reference (LRU key)
    stacks: jax.Array  # int32[N + P] the free stack in [:N], the speculative pool in [N:] (`free_stack`, `pool_stack`)
    free_top: jax.Array  # int32[] free_stack[:free_top] are free ids; the top is free_stack[free_top - 1]
    pool_top: jax.Array  # int32[] pool_stack[:pool_top] are speculative-pool ids, most recently released on top
    clock: jax.Array  # int32[] advances on every `free` and `evict_lru`

    @property
    def free_stack(self) -> jax.Array:
        """int32[N] the free stack's region of `stacks` (entries at free_top and above are stale)."""
        return self.stacks[: self.state.shape[0]]

    @property
    def pool_stack(self) -> jax.Array:
        """int32[P] the speculative pool's region of `stacks` (entries at pool_top and above are stale)."""
        return self.stacks[self.state.shape[0]:]


@struct.dataclass
class SeqBlocks:
    """Per-sequence block tables and lengths."""

    block_table: jax.Array  # int32[B, M] physical block of each logical block; NULL_BLOCK past num_blocks
    num_blocks: jax.Array  # int32[B] table entries in use
    num_committed: jax.Array  # int32[B] validated tokens (their KV is final)
    num_allocated: jax.Array  # int32[B] token slots reserved: committed + pending (decode/prefill slots and drafts)
    num_drafts: jax.Array  # int32[B] pending draft tokens, <= K


@struct.dataclass
class AllocatorState:
    """The whole allocator: the pool, the tables, the counters."""

    blocks: BlockPool
    seqs: SeqBlocks
    counters: Counters


@struct.dataclass
class AllocResult:
    """What `allocate` / `allocate_speculative` did.

    cow_src/dst:  int32[B]  copy-on-write: copy block src's KV to dst before writing (NULL_BLOCK, NULL_BLOCK: none)"""

    ok: jax.Array  # bool[B] request granted (True for slots that requested nothing)
    cow_src: jax.Array  # int32[B] copy-on-write: copy block cow_src's KV to cow_dst before writing (NULL_BLOCK: none)
    cow_dst: jax.Array  # int32[B]


@struct.dataclass
class CommitResult:
    """What `commit` did."""

    ok: jax.Array  # bool[B] the accepted count was within [0, pending]
    released: jax.Array  # int32[] blocks given back


class Unreffed(NamedTuple):
    """What `transitions.unref_unchecked` left for the next `transitions.free_unchecked` to route: ids int32[B, M]
    the table entries the rows dropped (N where none); clock int32[] the clock of that free (their cached blocks'
    LRU time); blocks int32[] of the blocks they released, those going to a stack (uncached): `free_blocks` until
    then misses them; some bool[] the mask named a row (False: ids are all N), so the free need not reduce ids
    ([B, M]) to learn whether it has work."""

    ids: jax.Array
    clock: jax.Array
    blocks: jax.Array
    some: jax.Array


# ------------------------------------------------------------------------------------------------ init


def init(cfg: CacheConfig) -> AllocatorState:
    """A pool with every usable block on the free stack (block 1 on top, so allocation order is 1, 2, …)."""
    n, b, m, p = cfg.num_blocks, cfg.max_seqs, cfg.max_blocks_per_seq, cfg.pool_capacity
    stacks = jnp.zeros((n + p,), i32).at[: n - 1].set(jnp.arange(n - 1, 0, -1, dtype=i32))
    state = jnp.full((n,), FREE, jnp.int8).at[NULL_BLOCK].set(VALIDATED)
    zero = jnp.zeros((), i32)
    blocks = BlockPool(
        state=state,
        ref_count=jnp.zeros((n,), i32),
        generation=jnp.zeros((n,), i32),
        cached=jnp.zeros((n,), bool),
        last_used=jnp.zeros((n,), i32),
        stacks=stacks,
        free_top=jnp.asarray(n - 1, i32),
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


# ------------------------------------------------------------------------------------ stack helpers


def with_budget(st: AllocatorState, kv_blocks: jax.Array) -> AllocatorState:
    """A fresh pool whose free stack holds only blocks 1..kv_blocks (int32[], 1 <= kv_blocks <= usable).

    The budget is data, so one compiled program serves every budget (the simulator's sweeps over memory): blocks
    are popped 1, 2, ... in order either way, so a pool with budget k allocates exactly the block ids a pool of
    k + 1 blocks would, and blocks above k are never on the free stack (they stay FREE and untouched). Only for
    a state from `init`."""
    blocks = st.blocks
    n = blocks.state.shape[0]
    idx = jnp.arange(blocks.stacks.shape[0], dtype=i32)
    stacks = jnp.where(idx < kv_blocks, kv_blocks - idx, jnp.where(idx < n, 0, blocks.stacks)).astype(i32)
    return st.replace(blocks=blocks.replace(stacks=stacks, free_top=jnp.asarray(kv_blocks, i32)))


def push(blocks: BlockPool, ids: jax.Array, to_free: jax.Array, free_rank: jax.Array,
         to_pool: jax.Array | None = None, pool_rank: jax.Array | None = None, *,
         totals: tuple[jax.Array, jax.Array] | None = None) -> BlockPool:
    """Push ids[to_free] onto the free stack and ids[to_pool] onto the speculative pool (all one shape, [X] or
    [R, W]; disjoint masks), each in the given order (rank: the inclusive count of its mask so far, in the order
    pushed), with one scatter. totals: (free, pool) int32[] the blocks pushed onto each; None: the ranks' last
    entries (ranks in the row-major order of ids).

    The caller computes the ranks, so that several pushes share one cumsum (on CPU each cumsum is several
    reduce-window ops, the single largest cost of a step).
    """
    n, size = blocks.state.shape[0], blocks.stacks.shape[0]
    if totals is None:
        totals = (last(free_rank), None if pool_rank is None else last(pool_rank))
    dst = jnp.where(to_free, blocks.free_top + free_rank - 1, size)
    pool_top = blocks.pool_top
    if to_pool is not None:
        dst = jnp.where(to_pool, n + blocks.pool_top + pool_rank - 1, dst)
        pool_top = pool_top + totals[1]
    return blocks.replace(stacks=blocks.stacks.at[dst].set(ids, mode="drop"), free_top=blocks.free_top + totals[0],
                          pool_top=pool_top)


def prefix_counts(*masks: jax.Array) -> jax.Array:
    """Inclusive running counts of several masks, all [X] or all [R, W] (counted in row-major order), with one
    cumsum: int32[len(masks), *shape]. Rows of W <= `arrays.SMALL_TRAILING` entries are counted within each row
    column by column (elementwise) and across rows by one cumsum over R: on XLA:CPU a cumsum over R * W = 512
    entries is seven kernels (two levels of its rewrite), over 256 three."""
    stacked = jnp.stack(masks).astype(i32)
    if stacked.ndim == 2 or stacked.shape[-1] > SMALL_TRAILING:
        return jnp.cumsum(stacked.reshape(len(masks), -1), axis=1, dtype=i32).reshape(stacked.shape)
    within = jnp.stack(list(itertools.accumulate(stacked[..., j] for j in range(stacked.shape[-1]))), axis=-1)
    totals = within[..., -1]  # [k, R]
    return within + (jnp.cumsum(totals, axis=-1, dtype=i32) - totals)[..., None]


def last(counts: jax.Array) -> jax.Array:
    """The last entry, in row-major order, of a running count of any shape (its total)."""
    return counts.reshape(-1)[-1]


def pop_position(n: int, free_top: jax.Array, pool_top: jax.Array, index: jax.Array, *,
                 pool_first: bool) -> tuple[jax.Array, jax.Array]:
    """The position in `stacks` (N blocks, so the pool starts at N) of combined pop position `index` (0 = the top
    of the first stack, the second continuing below it; the pool first when pool_first, else the free stack)
    from stacks whose tops are free_top and pool_top; and bool (same shape) from the first stack. Positions past
    both stacks are out of range."""
    if pool_first:
        first_top, first_base, second_top, second_base = pool_top, n, free_top, 0
    else:
        first_top, first_base, second_top, second_base = free_top, 0, pool_top, n
    from_first = index < first_top
    pos = jnp.where(from_first, first_base + first_top - 1 - index, second_base + second_top - 1 - (index - first_top))
    return pos, from_first


def pop_two(blocks: BlockPool, index: jax.Array, *, pool_first: bool) -> tuple[jax.Array, jax.Array]:
    """The block at combined pop position `index` (`pop_position`), with one gather; and bool (same shape) from
    the first stack. Positions past both stacks read an arbitrary block."""
    pos, from_first = pop_position(blocks.state.shape[0], blocks.free_top, blocks.pool_top, index,
                                   pool_first=pool_first)
    return blocks.stacks[jnp.clip(pos, 0, blocks.stacks.shape[0] - 1)], from_first


def release_blocks(
    blocks: BlockPool, ids: jax.Array, released: jax.Array, use_pool: bool, first: jax.Array | None = None,
    first_clock: jax.Array | None = None, routed_as: int | None = None,
    also: tuple[jax.Array, jax.Array] | None = None, unpinned: bool = False,
) -> tuple[BlockPool, jax.Array]:
    """Route blocks whose ref count just reached 0 (ids [X], or [R, W] rows taken in row-major order; distinct where
    `released`).

    cached → evictable (stays VALIDATED); SPECULATIVE/STALE → speculative pool (if enabled and not full);
    everything else, and pool overflow → free stack. Returns the new pool and the number routed.

    first bool[X] (None: none): entries released by an earlier free whose routing was deferred
    (`transitions.unref_unchecked`): they are routed as if before all the others, in their own order (pushed
    first, offered the pool's room first), and their cached blocks take the clock of that free, first_clock
    int32[], not the current one.

    routed_as (None: each block's state): the state every released block is routed by, for a caller that has just
    given them all that state and leaves the write to this scatter. also (mask bool[X], state int8[X]): the states
    of other entries (and of released cached ones, which keep theirs otherwise), written by the same scatter.
    unpinned: the caller knows no released block is pinned by the prefix cache (a commit's rejected blocks, which
    hold no committed token), so the pin flags are not read and no LRU clock is written: a gather and a scatter
    less, each a kernel.
    """
    n = blocks.state.shape[0]
    safe = jnp.where(released, ids, NULL_BLOCK)
    if unpinned:
        was_cached = jnp.zeros_like(released)
        state = routed_as if routed_as is not None else blocks.state[safe]
    elif use_pool and routed_as is None:
        was_cached, state = take_each((blocks.cached, blocks.state), safe)
    else:
        was_cached, state = blocks.cached[safe], routed_as
    cached = released & was_cached
    uncached = released & ~cached

    def group_major(rank_first: jax.Array, rank_rest: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Inclusive counts over ids in the first group, then the rest (each masked count in its own row)."""
        if first is None:
            return rank_rest, last(rank_rest)
        return jnp.where(first, rank_first, last(rank_first) + rank_rest), last(rank_first) + last(rank_rest)

    def split(mask: jax.Array) -> tuple[jax.Array, ...]:
        return (mask & first, mask & ~first) if first is not None else (mask,)

    if use_pool:
        want_pool = uncached & ((state == SPECULATIVE) | (state == STALE))
        room = blocks.stacks.shape[0] - n - blocks.pool_top
        # The pool takes the first `room` candidates; the rest and every other uncached block go to the free stack.
        if routed_as in (SPECULATIVE, STALE):  # every uncached block is a candidate: one running count serves both
            counts = prefix_counts(*split(uncached))
            want_rank, want_total = uncached_rank, uncached_total = group_major(counts[0], counts[-1])
        else:
            counts = prefix_counts(*split(want_pool), *split(uncached))
            half = counts.shape[0] // 2
            want_rank, want_total = group_major(counts[0], counts[half - 1])
            uncached_rank, uncached_total = group_major(counts[half], counts[-1])
        to_pool = want_pool & (want_rank <= room)
        pool_rank = jnp.minimum(want_rank, room)
        pool_total = jnp.minimum(want_total, room)
        to_free = uncached & ~to_pool
        blocks = push(blocks, ids, to_free, uncached_rank - pool_rank, to_pool, pool_rank,
                      totals=(uncached_total - pool_total, pool_total))
        new_state = jnp.where(to_pool, STALE, FREE).astype(jnp.int8)
    else:
        to_free = uncached
        counts = prefix_counts(*split(uncached))
        free_rank, free_total = group_major(counts[0], counts[-1])
        blocks = push(blocks, ids, to_free, free_rank, totals=(free_total, None))
        new_state = jnp.full(ids.shape, FREE, jnp.int8)
    if also is None:
        state_arr = blocks.state.at[jnp.where(uncached, ids, n)].set(new_state, mode="drop")
    else:
        state_arr = blocks.state.at[jnp.where(uncached | also[0], ids, n)].set(
            jnp.where(uncached, new_state, also[1]).astype(jnp.int8), mode="drop")
    if unpinned:
        return blocks.replace(state=state_arr), jnp.sum(released, dtype=i32)
    clock = blocks.clock if first is None else jnp.where(first, first_clock, blocks.clock)
    last_used = blocks.last_used.at[jnp.where(cached, ids, n)].set(clock, mode="drop")
    return blocks.replace(state=state_arr, last_used=last_used), jnp.sum(released, dtype=i32)
