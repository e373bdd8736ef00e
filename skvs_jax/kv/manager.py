"""The KV manager: the one facade between the scheduler and the two structures that must agree about blocks.

The allocator (the `allocator` package) owns blocks and block tables; the prefix index (`prefix_cache`) maps hash
chains of full, validated blocks to block ids. Each promise of one is a duty of the other: an indexed block is
pinned (`cached`) so that its ref count may reach 0 without freeing it; evicting a pinned block removes its index
entry, and removing an entry removes its descendants, whose blocks must be unpinned in turn. This module keeps
those pairings, so the scheduler asks for blocks and reports what was accepted and never pairs the two by hand
(vLLM's `KVCacheManager` plays the same part over its block pool and hash map).

Everything here is an unchecked, traceable transition `kv, ... = op(kv, ..., cfg=cfg)` over the `KVState`
pytree, called inside the scheduler's jitted step: the boundary checks live in `allocator` and `prefix_cache`'s
public functions, which users call directly. Most steps need none of the rarer work (sharing a hit, evicting,
removing stale entries, unpinning), so each skips itself with `vmap_flow.when` when there is nothing to do.

Dimension names as in `skvs_jax/__init__.py`; in addition A is the admission window (waiting sequences looked
up per step), R the rows offered to the prefix index per step, C the prefix index's slots and W the table
window of a decode step (`KVConfig.window`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from skvs_jax import vmap_flow
from skvs_jax.arrays import cdiv, floor_div, i32
from skvs_jax.config import NULL_BLOCK, CacheConfig, SpecConfig
from skvs_jax.kv import allocator
from skvs_jax.kv import prefix_cache as pc
from skvs_jax.kv.allocator import SPECULATIVE, STALE, AllocatorState, AllocResult


@dataclasses.dataclass(frozen=True)
class KVConfig:
    """Static configuration of the KV manager (hashable).

    Attributes:
      cache: the pool and table geometry (N, S, B, M).
      spec: what the allocator needs of the policy (K, release mode, speculative pool).
      prefix: the prefix index's geometry (C slots in buckets of `ways`).
      rows_indexed: R, rows offered to the prefix index per step (see `index_rows`).
      impl: how `commit` writes block states (`allocator.commit`): "pallas" (the Pallas kernel
        `pallas_kernels.update_block_states`), "xla" (two scatters) or "auto" (the kernel on a GPU); the engine
        passes its own `impl`.
      skip: rare work is skipped by control flow (True) or computed every call and selected (False: no host
        round trip on a GPU); `SchedulerConfig.control_flow`. Eviction and the index's insert skip either way.
      skip_costly: the same for the rare passes over [B, M], [N] or [C] (frees, the full-table allocation and
        commit passes, releasing copied blocks, the prefix lookup, removing stale entries): `skip` or, under
        `control_flow="mixed"`, True while cheap work is selected.
    """

    cache: CacheConfig
    spec: SpecConfig
    prefix: pc.PrefixCacheConfig
    rows_indexed: int
    impl: str = "xla"
    skip: bool = True
    skip_costly: bool = True

    @property
    def window(self) -> int:
        """W = ceil((1 + K) / S) + 1: table columns a decode step touches (its partial block, and the blocks its
        decode token and K drafts spill into; with lazy release the held blocks lie within the same span)."""
        return min(cdiv(1 + self.spec.draft_len, self.cache.block_size) + 1, self.cache.max_blocks_per_seq)

    @property
    def insert_window(self) -> int:
        """Block positions past a row's own indexed prefix that the index's insert probes where costly passes
        are skipped (`prefix_cache.insert_unchecked(window=)`): `window`, which holds every block a decode step
        can fill and one more, so a decoding row is decided by it; a row with more new blocks (a prompt chunk)
        takes the exact dense probe. Each position is a probe of every row's bucket ([rows, ways] entries of the
        table), the insert's largest reads in a decode step."""
        return self.window


@struct.dataclass
class KVState:
    """The allocator's pool and tables, and the prefix index over them; `manager`'s transitions keep them
    consistent (every indexed block is pinned, every pinned block is indexed)."""

    alloc: AllocatorState
    prefix: pc.PrefixCache


def init(cfg: KVConfig) -> KVState:
    """An empty pool (every usable block free) and an empty index."""
    return KVState(alloc=allocator.init(cfg.cache), prefix=pc.init(cfg.prefix))


# ------------------------------------------------------------------------------------------------ reading


def with_budget(kv: KVState, kv_blocks: jax.Array) -> KVState:
    """A fresh KV state with only kv_blocks (int32[]) usable blocks on the free stack (`allocator.with_budget`):
    a memory budget below the static pool, as data."""
    return kv.replace(alloc=allocator.with_budget(kv.alloc, kv_blocks))


def free_blocks(kv: KVState, cfg: KVConfig) -> jax.Array:
    """int32[] blocks an allocation can take without evicting: the free stack, and the speculative pool when it
    is on (the allocator takes pool blocks after the free stack for ordinary slots, before it for drafts)."""
    blocks = kv.alloc.blocks
    return blocks.free_top + (blocks.pool_top if cfg.spec.use_spec_pool else 0)


def evictable(kv: KVState) -> jax.Array:
    """bool[N] cached blocks no sequence holds: `evict` may free them."""
    blocks = kv.alloc.blocks
    return blocks.cached & (blocks.ref_count == 0)


@struct.dataclass
class Usage:
    """Occupancy after a step's allocations (int32 scalars, the null block excluded)."""

    blocks_used: jax.Array  # blocks not on the free stack
    spec_blocks: jax.Array  # blocks holding only unvalidated or rejected drafts (SPECULATIVE or STALE)
    cached_idle: jax.Array  # cached blocks no sequence holds (evictable)


def usage(kv: KVState, cfg: KVConfig) -> Usage:
    blocks = kv.alloc.blocks
    return Usage(
        blocks_used=cfg.cache.usable_blocks - blocks.free_top,
        spec_blocks=jnp.sum((blocks.state == SPECULATIVE) | (blocks.state == STALE), dtype=i32),
        cached_idle=jnp.sum(evictable(kv), dtype=i32),
    )


# ---------------------------------------------------------------------------------------- admission side


def release(kv: KVState, seq_mask: jax.Array, cfg: KVConfig, first: allocator.Unreffed | None = None) -> KVState:
    """The sequences in seq_mask bool[B] give back their blocks (cached ones stay, evictable). first: the blocks
    an earlier `unref` left, routed here first (as two releases in a row would)."""
    alloc, _ = allocator.free_unchecked(kv.alloc, seq_mask, cfg=cfg.cache, spec=cfg.spec, skip=cfg.skip_costly,
                                        first=first)
    return kv.replace(alloc=alloc)


def unref(kv: KVState, seq_mask: jax.Array, cfg: KVConfig) -> tuple[KVState, allocator.Unreffed]:
    """The first half of a `release` of seq_mask bool[B] (`allocator.unref_unchecked`): references and tables
    dropped, the blocks released routed by the next `release(first=...)`. In between, `free_blocks` misses the
    returned `Unreffed.blocks`; `evictable` and ref counts are final."""
    alloc, pending = allocator.unref_unchecked(kv.alloc, seq_mask, cfg=cfg.cache, skip=cfg.skip_costly)
    return kv.replace(alloc=alloc), pending


def lookup(kv: KVState, tokens: jax.Array, rows: jax.Array, lengths: jax.Array, spec_window: jax.Array,
           max_spec_ratio: jax.Array, cfg: KVConfig, salt: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Prefix hits of A candidates, the rows rows int32[A] (in [0, B)) of tokens int32[B, M*S]: lengths int32[A]
    (0: no candidate), spec_window int32[A] (the barrier's reach: K under the speculative barrier, else 0), salt
    int32[A] their cache salts (None: 0; only blocks indexed under a candidate's own salt are hits). Returns
    (num_blocks int32[A], block_ids int32[A, M]): the blocks to share. Most steps admit nobody: the hashing, and
    the gather of the candidates' tokens it reads (A x M*S), are skipped when no length is > 0 (the branches only
    read the index, so nothing is copied)."""
    a, m = rows.shape[0], cfg.cache.max_blocks_per_seq

    def look(_):
        hit = pc.lookup_unchecked(kv.prefix, tokens[rows], lengths, spec_window, max_spec_ratio, salt, cfg=cfg.prefix)
        return hit.num_blocks, hit.block_ids

    none = (jnp.zeros((a,), i32), jnp.zeros((a, m), i32))
    num_blocks, block_ids = vmap_flow.cond(jnp.any(lengths > 0), look, lambda _: none, None, skip=cfg.skip_costly)
    return jnp.where(lengths > 0, num_blocks, 0), block_ids


def share(kv: KVState, block_ids: jax.Array, num_tokens: jax.Array, cfg: KVConfig) -> KVState:
    """Rows with num_tokens int32[B] > 0 start from the cached blocks block_ids int32[B, M] (by reference): the
    prefix index's hits in this state (`lookup`), trusted to be indexed (`allocator.share_unchecked(indexed=True)`).
    Sharing nothing changes nothing, and most steps share no hit: skipped then."""
    def do_share(alloc):
        return allocator.share_unchecked(alloc, block_ids, num_tokens, cfg=cfg.cache, indexed=True)[0]

    alloc = vmap_flow.when_for(cfg.skip)(jnp.any(num_tokens > 0), do_share, kv.alloc, identity_when_false=True)
    return kv.replace(alloc=alloc)


def fork(kv: KVState, parent: jax.Array, cfg: KVConfig) -> tuple[KVState, jax.Array]:
    """Row b becomes a child of row parent[b] (int32[B], -1 = no fork), sharing its committed blocks by reference
    (`allocator.fork`: the parent must be settled, and the child row empty). Returns (kv, ok bool[B])."""
    alloc, ok = allocator.fork_unchecked(kv.alloc, parent, cfg=cfg.cache)
    return kv.replace(alloc=alloc), ok


IN_USE = jnp.iinfo(jnp.int32).max  # the recency of a block some sequence holds: it is being used now


def eviction_order(kv: KVState, cfg: KVConfig) -> jax.Array:
    """int32[N] block ids in the order `evict` takes the evictable ones: leaves of the prefix forest first, least
    recently used first (SGLang's radix-cache eviction; vLLM frees a request's blocks tail first).

    A cached prefix is in use whenever a longer one is, so a block's recency is the most recent over its indexed
    subtree (itself and its descendants: the time each was released, IN_USE for one a sequence holds), and
    blocks go by (recency, height, id), the height being 0 for a leaf. A block's descendants have a recency no
    later and a smaller height, so they all go before it: evicting k blocks removes exactly k index entries, and
    loses k blocks of hits, unless the only evictable blocks left lie above a block in use (they go last, and
    removing them takes the held descendants' entries along). A chain released at once (one clock) goes tail
    first; a prefix shared by a later request outlives the tails of the requests before it."""
    blocks = kv.alloc.blocks
    recency = jnp.where(evictable(kv), blocks.last_used, IN_USE)
    recency, height = pc.subtree_max(kv.prefix, recency, cfg.prefix)
    ids = jnp.arange(recency.shape[0], dtype=i32)
    return jnp.lexsort((ids, height, recency)).astype(i32)


def evict(kv: KVState, num_blocks: jax.Array, cfg: KVConfig) -> KVState:
    """Free num_blocks int32[] evictable blocks in `eviction_order` (leaves first, least recently used first),
    drop their index entries, and unpin the blocks of any entries that went with them (descendants, which leaves
    first leaves none of unless only blocks above a held one were left). Skipped when num_blocks is 0.

    Those descendants are all held (ref > 0), so unpinning them is their flags alone, no release: an evictable
    descendant goes before its ancestor in `eviction_order` (a recency no later, a smaller height), and eviction
    takes a prefix of the evictable blocks in that order, so it took every evictable descendant of a block it
    took; and an indexed block is pinned. (`unpin` would also release unpinned ref-0 blocks: 8 of eviction's 34
    primitives at the bench geometry, which could never fire here.)"""
    def run(kv):
        ids = allocator.evicted_ids(kv.alloc.blocks, eviction_order(kv, cfg), num_blocks,
                                    max_evict=cfg.cache.usable_blocks)
        prefix, removed = pc.remove_unchecked(kv.prefix, ids, cfg=cfg.prefix, loop=cfg.skip)
        # The held descendants' pins go in the evicted blocks' own scatter (`evict_ids_unchecked(unpin_held=)`).
        return KVState(alloc=allocator.evict_ids_unchecked(kv.alloc, ids, unpin_held=removed.descendants),
                       prefix=prefix)

    return vmap_flow.when(num_blocks > 0, run, kv)


def allocate(kv: KVState, num_tokens: jax.Array, order: jax.Array | None, cfg: KVConfig, *,
             ahead: jax.Array | None = None) -> tuple[KVState, AllocResult]:
    """`allocator.allocate_unchecked` of num_tokens int32[B] in priority order `order`: one allocation of every
    row's slots over the full table (a step with drafts allocates them with its slots: `allocate_step`).
    With the costly passes' skips (`KVConfig.skip_costly`: a CPU's program) it is computed as
    `allocator.allocate_split_unchecked`, the rows whose request spans <= W columns (every decode row) in a
    [B, W] window and only the wider ones (prefill chunks, swap-ins) over [B, M], skipped when there are none; a
    GPU's program runs the one pass over [B, M] (one set of kernels, not two). The same state and result either
    way. ahead bool[B, B]: the order as `arrays.before` of its rank, for dense prefix sums (then order may be
    None; the scheduler built it, so it is not checked to be a permutation)."""
    alloc, res = allocator.allocate_split_unchecked(kv.alloc, num_tokens, order, cfg=cfg.cache, spec=cfg.spec,
                                                    window=cfg.window if cfg.skip_costly else None,
                                                    skip=cfg.skip_costly, ahead=ahead)
    return kv.replace(alloc=alloc), res


def allocate_step(kv: KVState, num_tokens: jax.Array, num_drafts: jax.Array, generation: jax.Array,
                  order: jax.Array | None, cfg: KVConfig, *,
                  ahead: jax.Array | None = None) -> tuple[KVState, AllocResult, AllocResult]:
    """A step's slots (num_tokens, as `allocate`) and its draft slots (num_drafts) in one pass
    (`allocator.allocate_step_unchecked`: one scatter per table for both; a row's drafts ride on its granted
    slots, and the blocks the slots copied away are released after the drafts popped). With the costly passes'
    skips (a CPU's program) the rows whose slots and drafts span <= W columns (every decode row) take a [B, W]
    window and the others a pass over [B, M], skipped when there are none; a GPU's program runs the one pass over
    [B, M]. Returns (kv, the slots' result, the drafts')."""
    alloc, res, draft_res = allocator.allocate_step_unchecked(
        kv.alloc, num_tokens, num_drafts, generation, order, cfg=cfg.cache, spec=cfg.spec, draft_window=cfg.window,
        split_window=cfg.window if cfg.skip_costly else None, skip=cfg.skip_costly, ahead=ahead)
    return kv.replace(alloc=alloc), res, draft_res


# ------------------------------------------------------------------------------------------- settle side


def commit(kv: KVState, num_accepted: jax.Array, cfg: KVConfig) -> KVState:
    """Commit num_accepted int32[B] tokens per row and roll back the rest (`allocator.commit_unchecked`, its block
    states through the `cfg.impl` kernel) over a [B, W] window, then over the full table only if some row did not
    fit it (settled rows are settled again with 0 accepted, which changes nothing)."""
    s, alloc = cfg.cache.block_size, kv.alloc
    fits = alloc.seqs.num_blocks - floor_div(alloc.seqs.num_committed, s) <= cfg.window
    alloc, _ = allocator.commit_unchecked(alloc, num_accepted, cfg=cfg.cache, spec=cfg.spec, window=cfg.window,
                                          impl=cfg.impl)

    def full(alloc):
        return allocator.commit_unchecked(alloc, jnp.where(fits, 0, num_accepted), cfg=cfg.cache, spec=cfg.spec,
                                          window=None, impl=cfg.impl)[0]

    return kv.replace(alloc=vmap_flow.when_for(cfg.skip_costly)(jnp.any(~fits), full, alloc,
                                                                identity_when_false=True))


def reclaim(kv: KVState, generation: jax.Array, threshold: jax.Array, skip: bool = True) -> KVState:
    """Speculative-pool blocks more than `threshold` generations older than `generation` go to the free stack.
    skip: `KVConfig.skip`."""
    alloc, _ = allocator.reclaim_expired_unchecked(kv.alloc, generation, threshold, skip=skip)
    return kv.replace(alloc=alloc)


def pin(alloc: AllocatorState, ids: jax.Array, skip: bool = True, some: jax.Array | None = None) -> AllocatorState:
    """Mark the newly indexed blocks ids int32[X] (NULL_BLOCK = none) cached; most steps index none, and
    pinning nothing changes nothing, so the pass over them is skipped then (unless not skip: `KVConfig.skip`).
    some bool[]: whether any id is a block, when the caller knows it (else a reduction over ids)."""
    some = jnp.any(ids > 0) if some is None else some
    return vmap_flow.when_for(skip)(some, lambda alloc: allocator.pin_unchecked(alloc, ids), alloc,
                                    identity_when_false=True)


def unpin(alloc: AllocatorState, ids: jax.Array) -> AllocatorState:
    """Unpin blocks whose index entries were removed, ids int32[X] (distinct, NULL_BLOCK = none); the ref-0 ones
    go to the free stack in id order (a canonical order: the index's slot order is a hash order). The ids are put
    in id order by marking them in an [N] mask, not by sorting the X = C slots' ids."""
    n = alloc.blocks.state.shape[0]
    marked = jnp.zeros((n,), bool).at[jnp.where(ids > 0, ids, n)].set(True, mode="drop")
    in_order = jnp.where(marked, jnp.arange(n, dtype=i32), NULL_BLOCK)
    return allocator.unpin_unchecked(alloc, in_order, distinct=True)


def index_rows(prefix: pc.PrefixCache, tokens: jax.Array, lengths: jax.Array, table: jax.Array, sel: jax.Array,
               cfg: KVConfig, salt: jax.Array | None = None) -> tuple[pc.PrefixCache, jax.Array]:
    """Index the full blocks of the rows `sel` (int32[R] slots, live ones first, B = padding): their first
    lengths[b] tokens of tokens int32[B, M*S], held in table int32[B, M], under salt int32[B] (None: 0). Returns
    (prefix, ids int32[R, M]), the block ids newly indexed per selected row (NULL_BLOCK elsewhere). The caller
    pins them.

    A step usually has far fewer rows to index than R, and the insert's cost is per row, whether live or not.
    So it runs on the first R/4 rows when no more are live (skipped when none are): the rows left out are
    padding, which an insert ignores, so the table, the ids and the counters are the same as over all R. With
    the costly passes' skips (`KVConfig.skip_costly`: the CPU's and the mixed program), the insert probes a window
    past each row's own indexed blocks instead of every block position (`prefix_cache.insert_unchecked(window=)`:
    the same result). Under vmap, R/4 only when no lane has more live rows (`vmap_flow.all_lanes`); all R is right
    for every lane.
    """
    b, r = tokens.shape[0], sel.shape[0]
    count = jnp.sum(sel < b, dtype=i32)

    def insert(rows_run):
        def run(prefix):
            s = sel[:rows_run]
            live, rows = s < b, jnp.clip(s, 0, b - 1)
            prefix, res = pc.insert_unchecked(prefix, tokens, jnp.where(live, lengths[rows], 0), table[rows],
                                              None if salt is None else salt[rows], rows, cfg=cfg.prefix,
                                              window=cfg.insert_window if cfg.skip_costly else 0, own_content=True)
            return prefix, jnp.pad(res.block_ids, ((0, r - rows_run), (0, 0)), constant_values=NULL_BLOCK)
        return run

    small = r // 4
    if small == 0:
        return insert(r)(prefix)
    # Two one-trip loops, not a `cond`: a cond's branches would each copy the table they update. In a vmapped
    # sweep every lane takes the same size (the R/4 one only if it fits every lane), so one insert runs, not two;
    # a lane with no row to index inserts only padding, an identity, so no lane selects (copies) its table.
    # Without skips (`KVConfig.skip` False) one insert over all R rows, behind the one skip kept: its loop has a
    # data-dependent trip count either way.
    x = (prefix, jnp.full((r, cfg.cache.max_blocks_per_seq), NULL_BLOCK, i32))
    few = vmap_flow.all_lanes(count <= small) if cfg.skip else jnp.zeros((), bool)
    if cfg.skip:
        x = vmap_flow.when((count > 0) & few, lambda x: insert(small)(x[0]), x, identity_when_false=True)
    return vmap_flow.when((count > 0) & ~few, lambda x: insert(r)(x[0]), x, identity_when_false=True)


def index_validated(kv: KVState, tokens: jax.Array, lengths: jax.Array, sel: jax.Array, cfg: KVConfig,
                    salt: jax.Array | None = None) -> KVState:
    """Insert-after-validation: index the full blocks of lengths int32[B] committed tokens of the rows `sel`
    (int32[R], see `index_rows`) and pin them. Only validated content ever enters the index."""
    prefix, ids = index_rows(kv.prefix, tokens, lengths, kv.alloc.seqs.block_table, sel, cfg, salt)
    # The insert counts what it indexed: a new id exactly when the count moved (a scalar, not a pass over ids).
    some = prefix.counters.inserted != kv.prefix.counters.inserted
    return KVState(alloc=pin(kv.alloc, ids.reshape(-1), cfg.skip, some), prefix=prefix)


def index_on_fill(kv: KVState, view_tokens: jax.Array, filled_to: jax.Array, table: jax.Array, sel: jax.Array,
                  cfg: KVConfig, salt: jax.Array | None = None) -> tuple[KVState, jax.Array]:
    """The naive integration's on-fill indexing, before verification: every full block of view_tokens int32[B, M*S]
    (committed tokens, then the drafts as the forward pass placed them) up to filled_to int32[B] is indexed,
    drafts included. Returns the ids int32[R, M] indexed per selected row; `settle_on_fill` then keeps the
    entries verification confirmed and removes the others. Nothing is pinned yet."""
    prefix, ids = index_rows(kv.prefix, view_tokens, filled_to, table, sel, cfg, salt)
    return kv.replace(prefix=prefix), ids


def settle_on_fill(kv: KVState, ids: jax.Array, valid_len: jax.Array, cfg: KVConfig, drafts: bool = True) -> KVState:
    """After commit: entries indexed on fill, ids int32[R, M], whose block reaches past the row's valid_len
    int32[R] tokens (it holds a rejected draft) are removed with their descendants; the rest are pinned, and
    the descendants' blocks unpinned. Most steps index no stale block: the table-wide removal and the unpinning
    are skipped then (removing nothing changes nothing; the order remove, pin, unpin is kept), unless not
    `cfg.skip`. drafts False (a policy without speculation): no entry can be stale, every row's blocks hold
    computed tokens only, so there is nothing to remove and the removal is left out of the program."""
    s, m = cfg.cache.block_size, cfg.cache.max_blocks_per_seq
    if not drafts:
        return kv.replace(alloc=pin(kv.alloc, ids.reshape(-1), cfg.skip))
    stale = (ids > 0) & ((jnp.arange(m, dtype=i32)[None, :] + 1) * s > valid_len[:, None])

    def remove_stale(operand):
        prefix, _ = operand
        prefix, removed = pc.remove_unchecked(prefix, jnp.where(stale, ids, 0).reshape(-1), cfg=cfg.prefix,
                                              loop=cfg.skip)
        return prefix, removed.descendants

    no_descendants = jnp.zeros((cfg.prefix.capacity,), i32)
    prefix, descendants = vmap_flow.when_for(cfg.skip_costly)(jnp.any(stale), remove_stale,
                                                              (kv.prefix, no_descendants))
    alloc = pin(kv.alloc, jnp.where(stale, 0, ids).reshape(-1), cfg.skip)
    alloc = vmap_flow.when_for(cfg.skip_costly)(jnp.any(descendants > 0), lambda alloc: unpin(alloc, descendants),
                                                alloc)
    return KVState(alloc=alloc, prefix=prefix)


def reset_prefix(kv: KVState, cfg: KVConfig) -> KVState:
    """Forget every cached prefix (vLLM's `reset_prefix_cache`): the index empties (its cumulative counters stay),
    every cached block is unpinned, and the ones no sequence holds go to the free stack in id order. Blocks that
    sequences hold are untouched; their rows are indexed again when they next fill a block."""
    ids = jnp.where(kv.alloc.blocks.cached, jnp.arange(cfg.cache.num_blocks, dtype=i32), NULL_BLOCK)
    alloc = allocator.unpin_unchecked(kv.alloc, ids, distinct=True)
    return KVState(alloc=alloc, prefix=pc.init(cfg.prefix).replace(counters=kv.prefix.counters))
