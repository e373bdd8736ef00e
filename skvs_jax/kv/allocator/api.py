"""The allocator's public transitions, validated at the boundary."""

from __future__ import annotations

import jax
import numpy as np

import pallas_kernels as pk
from skvs_jax import checks
from skvs_jax.config import CacheConfig, SpecConfig
from skvs_jax.kv.allocator.grow import allocate_step_unchecked, allocate_unchecked
from skvs_jax.kv.allocator.state import AllocatorState, AllocResult, CommitResult
from skvs_jax.kv.allocator.transitions import (
    commit_unchecked,
    evict_lru_unchecked,
    fork_unchecked,
    free_unchecked,
    reclaim_expired_unchecked,
    set_cached_unchecked,
    share_unchecked,
)

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
    checks.array("st.blocks.stacks", st.blocks.stacks, (n + cfg.pool_capacity,), "i")
    checks.array("st.seqs.block_table", st.seqs.block_table, (b, m), "i")


def _check_counts(name: str, x, cfg: CacheConfig) -> None:
    checks.array(name, x, (cfg.max_seqs,), "i")
    checks.in_range(name, x, 0, cfg.max_tokens_per_seq)


def _check_drafts(num_drafts, generation, order, cfg: CacheConfig, spec: SpecConfig) -> None:
    """The draft request's arguments (`allocate_speculative`, `allocate_step`) and the priority order."""
    _check_counts("num_drafts", num_drafts, cfg)
    checks.in_range("num_drafts", num_drafts, 0, spec.draft_len)
    checks.scalar_int("generation", generation)
    checks.in_range("generation", generation, 0, 2**31 - 1)  # reclaim's age is a difference of two of these
    if order is not None:
        checks.permutation("order", order, cfg.max_seqs)


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
    _check_drafts(num_drafts, generation, order, cfg, spec)
    return allocate_unchecked(st, num_drafts, generation, order, cfg=cfg, spec=spec, window=window, speculative=True)


def allocate_step(
    st: AllocatorState,
    num_tokens: jax.Array,
    num_drafts: jax.Array,
    generation: jax.Array | int,
    order: jax.Array | None = None,
    *,
    cfg: CacheConfig,
    spec: SpecConfig = SpecConfig(),
    window: int | None = None,
) -> tuple[AllocatorState, AllocResult, AllocResult]:
    """An engine step's allocations in one pass: `allocate(num_tokens)` (over the whole table), then
    `allocate_speculative(num_drafts, generation, window=window)`, each in priority order, with one scatter per
    table for both. Two rules make them one pass: a row's drafts ride on its slots (refused unless its slot
    request was granted and nonzero: a decode step drafts after the token it verifies), and the blocks the slots
    copied away are released after the drafts have popped. Where those change nothing the state and results are
    the two calls'. `window` (static): the drafts' bound, as in `allocate_speculative`, and the width of the pass
    that serves every row whose slots and drafts fit in it (a decode step's); the rest take a pass over the whole
    table, skipped when there are none. Returns (state, the slots' result, the drafts' result: no copies)."""
    check_state(st, cfg)
    checks.static_int("window", window, 1, cfg.max_blocks_per_seq)
    _check_counts("num_tokens", num_tokens, cfg)
    _check_drafts(num_drafts, generation, order, cfg, spec)
    return allocate_step_unchecked(st, num_tokens, num_drafts, generation, order, cfg=cfg, spec=spec,
                                   draft_window=window, split_window=window)


def commit(
    st: AllocatorState,
    num_accepted: jax.Array,
    *,
    cfg: CacheConfig,
    spec: SpecConfig = SpecConfig(),
    window: int | None = None,
    impl: str = "xla",
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
    (commit it again with a wider window); with the default every sequence fits. `impl` (static) picks the
    block-state transition: "pallas" the Pallas kernel `pallas_kernels.update_block_states` (interpreted off-GPU),
    "auto" that kernel on a GPU; "xla" / "reference" (and "auto" elsewhere) the same states written by two scatters
    over the examined entries (the kernel's `jnp` reference reduces over all N blocks).
    """
    check_state(st, cfg)
    if impl not in pk.IMPLS:
        raise ValueError(f"impl must be one of {pk.IMPLS}, got {impl!r}")
    checks.static_int("window", window, 1, cfg.max_blocks_per_seq)
    checks.array("num_accepted", num_accepted, (cfg.max_seqs,), "i")
    if checks.is_concrete(num_accepted) and checks.is_concrete(st.seqs.num_allocated):
        pending = np.asarray(st.seqs.num_allocated) - np.asarray(st.seqs.num_committed)
        acc = np.asarray(num_accepted)
        if (acc < 0).any() or (acc > pending).any():
            b = int(np.nonzero((acc < 0) | (acc > pending))[0][0])
            raise ValueError(f"num_accepted[{b}] = {acc[b]} is outside [0, pending = {pending[b]}]")
    return commit_unchecked(st, num_accepted, cfg=cfg, spec=spec, window=window, impl=impl)


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
