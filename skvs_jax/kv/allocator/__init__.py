"""The speculation-aware block allocator: an immutable pytree and pure, batched, jittable transitions.

The pool owns N physical KV blocks of S tokens. Block 0 is the null block: dead block-table entries point to
it and it is never handed out, so padding can never alias real data. Every other block is, at all times,
owned by exactly one of

  * the free stack            (state FREE, ref_count 0),
  * the speculative pool      (state STALE, ref_count 0; blocks of rejected drafts, reused first by drafts),
  * the evictable set         (state VALIDATED, ref_count 0, cached: pinned by the prefix cache, see `evict`),
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
counts) → `reclaim_expired`; `free` ends a sequence and is idempotent. `allocate_step` is the first two in one
pass (one scatter per table), as the scheduler runs them.

Batched semantics, shared by every transition: decisions are taken from the state at call entry; sequences
are served in a given priority order `order` (a permutation of slots, `order[r]` = slot served r-th); a
request is all-or-nothing per sequence, and once a sequence that needs new blocks does not fit, no later one
that needs new blocks is served ("stop at the first that does not fit", by a prefix sum). Blocks are popped
from the top of a stack; released blocks are pushed in row-major (sequence slot, table column) order. Nothing
raises inside jit: failures come back as per-sequence `ok` flags and counters.

Modules: `state` (the pytrees, `init`, `with_budget`, the stack operations), `grow` (`allocate_unchecked`, in
phases, `allocate_split_unchecked`, its result in a window and the full table, and `allocate_step_unchecked`,
slots and drafts in one pass), `transitions` (commit, free,
share, fork, reclaim, pin, evict), `api` (the checked public transitions). Everything public is re-exported
here: `from skvs_jax.kv import allocator; allocator.allocate(...)`.
"""

from skvs_jax.kv.allocator.api import (
    allocate,
    allocate_speculative,
    allocate_step,
    check_state,
    commit,
    evict_lru,
    fork,
    free,
    reclaim_expired,
    set_cached,
    share,
)
from skvs_jax.kv.allocator.grow import allocate_split_unchecked, allocate_step_unchecked, allocate_unchecked
from skvs_jax.kv.allocator.state import (
    FREE,
    RESERVED,
    SPECULATIVE,
    STALE,
    STATE_NAMES,
    VALIDATED,
    AllocatorState,
    AllocResult,
    BlockPool,
    CommitResult,
    Counters,
    SeqBlocks,
    Unreffed,
    init,
    with_budget,
)
from skvs_jax.kv.allocator.transitions import (
    accepted_lengths,
    commit_unchecked,
    evict_ids_unchecked,
    evict_lru_unchecked,
    evict_unchecked,
    evicted_ids,
    fork_unchecked,
    free_unchecked,
    lru_order,
    pin_unchecked,
    reclaim_expired_unchecked,
    set_cached_unchecked,
    share_unchecked,
    unpin_unchecked,
    unref_unchecked,
)

__all__ = [
    "FREE", "RESERVED", "SPECULATIVE", "STALE", "VALIDATED", "STATE_NAMES",
    "AllocatorState", "AllocResult", "BlockPool", "CommitResult", "Counters", "SeqBlocks", "init", "with_budget",
    "allocate", "allocate_speculative", "allocate_step", "check_state", "commit", "evict_lru", "fork", "free",
    "reclaim_expired", "set_cached", "share", "accepted_lengths",
    "allocate_split_unchecked", "allocate_step_unchecked", "allocate_unchecked", "commit_unchecked",
    "evict_lru_unchecked", "evict_unchecked", "evict_ids_unchecked", "evicted_ids", "fork_unchecked",
    "free_unchecked", "lru_order", "pin_unchecked", "reclaim_expired_unchecked", "set_cached_unchecked",
    "share_unchecked", "unpin_unchecked", "Unreffed", "unref_unchecked",
]
