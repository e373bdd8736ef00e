"""The spec-aware prefix cache: an index from block-aligned token prefixes to physical KV blocks.

Only *full blocks of validated tokens* are indexed by `insert_after_validation`, so a draft token can never reach a
shared block. (The naive integration, `Policy.insert == "on_fill"`, also indexes blocks holding drafts and removes
the ones verification rejects within the same `update`: see `kv.manager.settle_on_fill`.) `lookup` returns the
longest cached block-aligned prefix of each prompt, shrunk by the article's **speculative barrier**: with
`spec_window > 0`, `buffer_blocks = max(1, int(max_spec_ratio * spec_window / S))` blocks are given up, and
`spec_boundary` (the token index where speculation may start, beyond which nothing is shared) is returned with the
hit. The module is an index, not an owner: hits feed `allocator.share`, newly indexed blocks must be pinned with
`allocator.set_cached`, cached ref-0 blocks are evicted leaves of the forest first (`kv.manager.evict`, in the
order `kv.manager.eviction_order` reads off `subtree_max`), and the evicted ids go to `remove`. The scheduler
never pairs these by hand: `kv.manager` does.

Keys. Block j of a sequence has the chain hash h_j = A * h_{j-1} + digest(tokens of block j) (mod 2^32, h_{-1} = 0),
in two independent 32-bit lanes (64 bits). `digest` sums a murmur3 finaliser of (token, position) over the
block, so it is order-sensitive and nonlinear; because the chain step is affine, every h_j of a row comes from one
`cumsum` (h_j = A^j * sum_{i<=j} digest_i * A^-i) instead of a sequential scan. The stored key is one more
finaliser of h_j, masked to `hash_bits` bits per lane (32 in production; tests use 2 to force collisions).

Salts. A request may carry a cache salt (vLLM's `cache_salt`: int32, 0 = none), so that tenants never share a
block and one cannot probe another's prompts through hit timing. The salt is the chain's seed, h_{-1} =
fmix(salt) (0 for salt 0, so unsalted keys are unchanged), and every entry stores the salt of its chain; a lookup
or an insert matches an entry only under its own salt, so requests with different salts never share a block,
whatever the policy (even through a key collision), and equal salts share exactly as unsalted requests do.

Collisions can never return wrong content. The table holds at most one live entry per key, and each entry
stores its block's S token ids and its *parent*, the block id of the entry for the prefix one block shorter (0 =
root). A lookup accepts block j only if the unique entry with key h_j holds exactly the request's tokens for
block j and its parent is the block it accepted for j - 1; by induction the accepted chain holds exactly the
request's prefix. A colliding insert (same key, other content) is refused and counted. `remove` also removes
every descendant of a removed entry (their parent block id may be reused for other content), so the live
entries always form a forest whose parents are live; it returns the descendants so the caller can unpin them.

Table: C = num_buckets * ways slots, set-associative (bucket = key mod num_buckets). Chosen over open
addressing with unbounded probing because every lookup is one gather of a fixed [ways] window (no probe loop, no
early exit), removal just clears a slot (no tombstones, since a lookup always scans the whole bucket), and a
batch of inserts into one bucket gets its ways in one shot (rank among same-bucket inserts -> rank-th free way),
with no rounds of conflict resolution. The price is that a bucket can overflow before the table is full; an
insert that finds no free way is dropped and counted (`dropped_full`), which costs a future hit, never
correctness. The default capacity is four times the usable blocks (load <= 0.25): in 8-way buckets one then
overflows with probability about 2e-4 (Poisson(2) >= 9), against 2e-2 at half full.

A prompt always keeps at least one token to compute: a hit covers at most (length - 1) // S blocks, so a prompt
that is entirely cached in whole blocks recomputes its last block (vLLM v1 caps the hit at length - 1 tokens the
same way; sharing S - 1 tokens of the last block would instead need a copy-on-write of a cached block).

Why this module is ~770 lines: one structure, its hash, its three transitions (lookup, insert, remove) and their
checked forms; the insert's per-position step is the longest part and reads best beside the table it writes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from skvs_jax import checks, vmap_flow
from skvs_jax.arrays import count_leading, first_trues, floor_div, sums
from skvs_jax.config import NULL_BLOCK, CacheConfig, SpecConfig

i32, u32 = jnp.int32, jnp.uint32
ROOT = NULL_BLOCK  # parent of a first block; block 0 is never indexed, so it cannot be confused with one
BROKEN = -1  # a chain that stopped: nothing after it can be accepted or inserted

# Per-lane constants (odd multipliers; A must be odd to be invertible mod 2^32).
_TOKEN_MUL = (0x9E3779B1, 0x85EBCA77)
_POS_MUL = (0xC2B2AE3D, 0x27D4EB2F)
_CHAIN_MUL = (0x01000193, 0x5BD1E995)
_FINAL_XOR = (0x165667B1, 0xD3A2646C)
_SALT_MUL = (0xCC9E2D51, 0x1B873593)


# ----------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class PrefixCacheConfig:
    """Static geometry of the prefix cache (hashable: a static argument of the jitted transitions).

    Attributes:
      num_blocks: N, the allocator's physical blocks (including the null block 0): block ids lie in [1, N).
      block_size: S, tokens per block.
      max_blocks_per_seq: M, width of the block tables it reads and of the hits it returns.
      capacity: C, table slots; a multiple of `ways`.
      ways: slots per bucket (entries whose keys map to the same bucket).
      hash_bits: bits kept per 32-bit key lane. 32 in production; small values are for tests that need
        collisions (they are refused, never returned as hits).
    """

    num_blocks: int
    block_size: int
    max_blocks_per_seq: int
    capacity: int
    ways: int = 8
    hash_bits: int = 32

    def __post_init__(self) -> None:
        for name, minimum in (("num_blocks", 2), ("block_size", 1), ("max_blocks_per_seq", 1), ("capacity", 1),
                              ("ways", 1), ("hash_bits", 1)):
            checks.at_least(name, getattr(self, name), minimum)
        if self.capacity % self.ways:
            raise ValueError(f"capacity ({self.capacity}) must be a multiple of ways ({self.ways})")
        if self.hash_bits > 32:
            raise ValueError(f"hash_bits must be <= 32, got {self.hash_bits}")

    @classmethod
    def for_cache(cls, cfg: CacheConfig, capacity: int | None = None, ways: int = 8, hash_bits: int = 32):
        """The prefix cache for an allocator geometry; capacity defaults to 4 * usable blocks (load <= 0.25)."""
        if capacity is None:
            capacity = -(-4 * cfg.usable_blocks // ways) * ways
        return cls(cfg.num_blocks, cfg.block_size, cfg.max_blocks_per_seq, capacity, ways, hash_bits)

    @property
    def num_buckets(self) -> int:
        return self.capacity // self.ways


# ------------------------------------------------------------------------------------------------ state


@struct.dataclass
class PrefixCounters:
    """Cumulative int32[] scalars: what inserts and removals did (failures are data, never exceptions)."""

    inserted: jax.Array  # entries added
    collisions: jax.Array  # inserts refused: their key is taken by (or shared in the call with) other content
    dropped_full: jax.Array  # inserts refused: no free way in their bucket
    rejected: jax.Array  # inserts refused: the block id is invalid or already indexed under another prefix
    removed: jax.Array  # entries removed (requested and descendants)


# The columns of `PrefixCache.entries`: an entry is one row, so an insert writes it with one scatter and a probe
# reads what it compares with one gather (a kernel each on a GPU). What a lookup compares is contiguous: the key and
# block at a bucket's ways, then block, parent, salt and tokens at the slot it found.
_KEY, _BLOCK, _PARENT, _SALT, _TOKENS = 0, 2, 3, 4, 5  # key: 2 columns; tokens: S columns; the chain: the last 2


@struct.dataclass
class PrefixCache:
    """The table. A slot is live iff block > 0; live entries form a forest through `parent`. The per-slot fields
    are column views of `entries`, one row a slot."""

    entries: jax.Array  # int32[C, S + 7]: key (2), block, parent, salt, tokens (S), chain (2) per slot
    # int32[N, 2] per block: the slot indexing it (-1 if none: a block is indexed at most once), then that entry's
    # parent (stale where the slot is -1). A copy of an entry column keyed by block: an insert checks a row's own
    # indexed blocks here, in N rows that stay in cache, not at C random rows of `entries`.
    by_block: jax.Array
    counters: PrefixCounters

    @property
    def slot_of_block(self) -> jax.Array:
        """int32[N] the slot indexing each block, -1 if none."""
        return self.by_block[:, 0]

    @property
    def key(self) -> jax.Array:
        """uint32[C, 2] chain hash of the prefix ending with this block (two lanes)."""
        return jax.lax.bitcast_convert_type(self.entries[:, _KEY:_KEY + 2], u32)

    @property
    def block(self) -> jax.Array:
        """int32[C] physical block id; 0 = empty slot."""
        return self.entries[:, _BLOCK]

    @property
    def parent(self) -> jax.Array:
        """int32[C] block id of the entry one block shorter; ROOT (0) for a first block."""
        return self.entries[:, _PARENT]

    @property
    def salt(self) -> jax.Array:
        """int32[C] the cache salt of the entry's chain (0 = none); a hit needs the request's own salt."""
        return self.entries[:, _SALT]

    @property
    def tokens(self) -> jax.Array:
        """int32[C, S] the block's token ids (every hit is checked against them)."""
        return self.entries[:, _TOKENS:-2]

    @property
    def chain(self) -> jax.Array:
        """uint32[C, 2] h_j before its finaliser: an insert continues a row's chain from its entry."""
        return jax.lax.bitcast_convert_type(self.entries[:, -2:], u32)


def _entry_rows(key: jax.Array, block: jax.Array, parent: jax.Array, salt: jax.Array, tokens: jax.Array,
                chain: jax.Array) -> jax.Array:
    """int32[..., S + 7] `PrefixCache.entries` rows from their fields (key, chain uint32[..., 2]; tokens [..., S])."""
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=i32)
    return jnp.concatenate([bits(key), block[..., None], parent[..., None], salt[..., None], tokens, bits(chain)],
                           axis=-1)


@struct.dataclass
class LookupResult:
    """What `lookup` found, per sequence."""

    num_matched: jax.Array  # int32[B] cached full blocks of the prompt before the barrier (for hit-rate metrics)
    num_blocks: jax.Array  # int32[B] blocks to share after the barrier
    num_tokens: jax.Array  # int32[B] num_blocks * S: pass to `allocator.share` with block_ids
    block_ids: jax.Array  # int32[B, M] the shared blocks, NULL_BLOCK past num_blocks
    spec_boundary: jax.Array  # int32[B] token index where speculation may start; nothing at or after it is shared


@struct.dataclass
class InsertResult:
    """What `insert` did."""

    block_ids: jax.Array  # int32[B, M] blocks newly indexed (NULL_BLOCK elsewhere): pin them (`allocator.set_cached`)
    num_inserted: jax.Array  # int32[B]
    collisions: jax.Array  # int32[] refusals in this call: same key, other content
    dropped_full: jax.Array  # int32[] refusals in this call: the bucket had no free way
    rejected: jax.Array  # int32[] refusals in this call: an invalid or already indexed block id


@struct.dataclass
class RemoveResult:
    """What `remove` did."""

    num_removed: jax.Array  # int32[] entries removed
    # int32[C] ids of entries removed because an ancestor was (NULL_BLOCK-padded): they are still pinned, so unpin
    # them with `allocator.set_cached(..., False)`
    descendants: jax.Array


def init(cfg: PrefixCacheConfig) -> PrefixCache:
    """An empty table."""
    c, s = cfg.capacity, cfg.block_size
    zero = jnp.zeros((), i32)
    return PrefixCache(
        entries=jnp.zeros((c, s + 7), i32),
        by_block=jnp.zeros((cfg.num_blocks, 2), i32).at[:, 0].set(-1),
        counters=PrefixCounters(*([zero] * len(PrefixCounters.__dataclass_fields__))),
    )


# ------------------------------------------------------------------------------------------------- hash


def _fmix32(x: jax.Array) -> jax.Array:
    """murmur3's finaliser: a bijection of uint32 with full avalanche."""
    x = x ^ (x >> 16)
    x = x * u32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * u32(0xC2B2AE35)
    return x ^ (x >> 16)


def _digest(blocks: jax.Array) -> jax.Array:
    """int32[..., S] token blocks -> uint32[..., 2] digest of each (order-sensitive: position is mixed in)."""
    s, lead = blocks.shape[-1], (1,) * (blocks.ndim - 1)
    t = jax.lax.bitcast_convert_type(blocks, u32)[..., None]  # [..., S, 1]
    pos = jnp.arange(1, s + 1, dtype=u32).reshape(lead + (s, 1))
    tok_mul, pos_mul = (jnp.asarray(m, u32).reshape(lead + (1, 2)) for m in (_TOKEN_MUL, _POS_MUL))
    return jnp.sum(_fmix32(t * tok_mul + pos * pos_mul), axis=-2, dtype=u32)


def _seed(salt: jax.Array) -> jax.Array:
    """int32[B] salts -> uint32[B, 2] h_{-1} = fmix(salt) (0 for salt 0)."""
    return _fmix32(jax.lax.bitcast_convert_type(salt, u32)[:, None] * jnp.asarray(_SALT_MUL, u32)[None, :])


def _finalise(chain: jax.Array, hash_bits: int) -> jax.Array:
    """uint32[..., 2] chain values h_j -> the stored keys."""
    return _fmix32(chain ^ jnp.asarray(_FINAL_XOR, u32).reshape((1,) * (chain.ndim - 1) + (2,))) & u32(
        (1 << hash_bits) - 1)


def _next_chain(chain: jax.Array, blocks: jax.Array) -> jax.Array:
    """uint32[B, 2] h_{j-1} and int32[B, S] block j -> h_j = A h_{j-1} + digest (mod 2^32): the chain one block on,
    equal to `chains`' column j (modular arithmetic is exact)."""
    return jnp.asarray(_CHAIN_MUL, u32)[None, :] * chain + _digest(blocks)


def chains(blocks: jax.Array, salt: jax.Array | None = None) -> jax.Array:
    """int32[B, J, S] token blocks -> uint32[B, J, 2] chain values h_j (before the finaliser); salt int32[B]
    (default 0) seeds each row's chain."""
    b, j, _ = blocks.shape
    digest = _digest(blocks)  # [B, J, 2]
    # h_j = A^j * sum_{i<=j} digest_i * A^-i (mod 2^32): the affine chain h_j = A h_{j-1} + digest_j by cumsum.
    powers = np.array([[pow(a, i, 2**32) for a in _CHAIN_MUL] for i in range(j)], np.uint32).reshape(1, j, 2)
    inverse = np.array([[pow(a, -i, 2**32) for a in _CHAIN_MUL] for i in range(j)], np.uint32).reshape(1, j, 2)
    chain = jnp.asarray(powers) * jnp.cumsum(digest * jnp.asarray(inverse), axis=1, dtype=u32)
    if salt is not None:  # the seed h_{-1} = fmix(salt): h_j gains A^(j+1) * h_{-1}
        reach = np.array([[pow(a, i + 1, 2**32) for a in _CHAIN_MUL] for i in range(j)], np.uint32).reshape(1, j, 2)
        chain = chain + jnp.asarray(reach) * _seed(salt).reshape(b, 1, 2)
    return chain


def chain_keys(blocks: jax.Array, hash_bits: int, salt: jax.Array | None = None) -> jax.Array:
    """int32[B, J, S] token blocks -> uint32[B, J, 2] keys of the prefixes ending with each block; salt int32[B]
    (default 0) seeds each row's chain."""
    return _finalise(chains(blocks, salt), hash_bits)


def _bucket(key: jax.Array, cfg: PrefixCacheConfig) -> jax.Array:
    """uint32[..., 2] -> int32[...] bucket index (lane 0 addresses, both lanes are compared)."""
    return (key[..., 0] % u32(cfg.num_buckets)).astype(i32)


def _split_blocks(tokens: jax.Array, cfg: PrefixCacheConfig) -> jax.Array:
    """int32[B, len] -> int32[B, J, S], J = min(len // S, M): the full blocks a block table can hold."""
    s = cfg.block_size
    j = min(tokens.shape[1] // s, cfg.max_blocks_per_seq)
    return tokens[:, : j * s].reshape(tokens.shape[0], j, s)


def _pad_cols(x: jax.Array, m: int) -> jax.Array:
    """[B, J] -> [B, M] padded with NULL_BLOCK."""
    return jnp.pad(x, ((0, 0), (0, m - x.shape[1])), constant_values=NULL_BLOCK)


# ----------------------------------------------------------------------------------------------- lookup


def _salts(salt: jax.Array | None, b: int) -> jax.Array:
    """int32[B] row salts (None: 0, no salt)."""
    return jnp.zeros((b,), i32) if salt is None else salt.astype(i32)


def _ways(cache: PrefixCache, slots: jax.Array) -> jax.Array:
    """int32[..., 3] the key (2 columns, uint32 bits: `_as_key`) and block of the slots int32[...], one gather."""
    return cache.entries[slots, _KEY:_BLOCK + 1]


def _as_key(probe: jax.Array) -> jax.Array:
    """uint32[..., 2] the key of `_ways` rows."""
    return jax.lax.bitcast_convert_type(probe[..., _KEY:_KEY + 2], u32)


class _Entry(NamedTuple):
    """An entry's fields read at some slots (`_entry_at`): block, parent, salt int32[...], tokens int32[..., S]."""

    block: jax.Array
    parent: jax.Array
    salt: jax.Array
    tokens: jax.Array


def _entry_at(cache: PrefixCache, slot: jax.Array) -> _Entry:
    """The block, parent, salt and tokens of the slots int32[...], read with one gather (they are contiguous)."""
    row = cache.entries[slot, _BLOCK:-2]
    return _Entry(row[..., _BLOCK - _BLOCK], row[..., _PARENT - _BLOCK], row[..., _SALT - _BLOCK],
                  row[..., _TOKENS - _BLOCK:])


def _longest_chain(
    cache: PrefixCache, blocks: jax.Array, cfg: PrefixCacheConfig, salt: jax.Array, key: jax.Array | None = None,
    first_parent: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """For int32[B, J, S] blocks under salt int32[B]: (matched int32[B] leading blocks found, ids int32[B, J]
    their block ids).

    Every block position is probed in parallel; the parent test against the previous position's candidate
    makes the accepted run a verified chain (see the module docstring), and the salt test keeps it the row's
    own tenant's. `key`: the blocks' chain keys, when the caller has them already. first_parent int32[B]: the
    block indexing the prefix before the first of `blocks` (default ROOT: they start the sequence).
    """
    b, j, _ = blocks.shape
    key = chain_keys(blocks, cfg.hash_bits, salt) if key is None else key  # [B, J, 2]
    slots = _bucket(key, cfg)[..., None] * cfg.ways + jnp.arange(cfg.ways, dtype=i32)[None, None, :]  # [B, J, ways]
    probe = _ways(cache, slots)  # [B, J, ways, 3]: key, block
    same_key = (probe[..., 2] > 0) & jnp.all(_as_key(probe) == key[:, :, None, :], axis=-1)
    found = jnp.any(same_key, axis=-1)  # keys are unique in the table: at most one way matches
    slot = jnp.take_along_axis(slots, jnp.argmax(same_key, axis=-1)[..., None], axis=-1)[..., 0]  # [B, J]
    entry = _entry_at(cache, slot)  # [B, J]
    ids = jnp.where(found, entry.block, BROKEN)
    first = jnp.full((b,), ROOT, i32) if first_parent is None else first_parent
    prev = jnp.concatenate([first[:, None], ids[:, :-1]], axis=1)
    valid = found & (entry.parent == prev) & jnp.all(entry.tokens == blocks, axis=-1)
    valid &= entry.salt == salt[:, None]
    matched = count_leading(valid, axis=1)
    return matched, ids


@functools.partial(jax.jit, static_argnames=("cfg",))
def lookup_unchecked(cache, tokens, lengths, spec_window, max_spec_ratio, salt=None, *,
                     cfg: PrefixCacheConfig) -> LookupResult:
    s, m = cfg.block_size, cfg.max_blocks_per_seq
    blocks = _split_blocks(tokens, cfg)
    matched, ids = _longest_chain(cache, blocks, cfg, _salts(salt, tokens.shape[0]))
    # Keep >= 1 prompt token to compute: at most (length - 1) // S blocks.
    matched = jnp.minimum(matched, floor_div(jnp.maximum(lengths - 1, 0), s))
    # buffer = max(1, int(ratio * window / S)) = max(1, floor(ratio * window) // S); one float32 multiply, so the
    # value is the same IEEE result in every implementation (the oracle computes it in numpy float32).
    scaled = jnp.floor(max_spec_ratio * spec_window.astype(jnp.float32)).astype(i32)
    buffer = jnp.where(spec_window > 0, jnp.maximum(1, floor_div(scaled, s)), 0)
    shared = jnp.maximum(matched - buffer, 0)
    col = jnp.arange(ids.shape[1], dtype=i32)[None, :]
    block_ids = _pad_cols(jnp.where(col < shared[:, None], ids, NULL_BLOCK), m)
    return LookupResult(
        num_matched=matched, num_blocks=shared, num_tokens=shared * s, block_ids=block_ids,
        spec_boundary=shared * s,
    )


# ----------------------------------------------------------------------------------------------- insert


def _insert_position(cfg: PrefixCacheConfig, carry, x):
    """One candidate block per row (row b's next block j_b): match, dedup, claim ways, write.

    Returns ((cache, resolved), ids): resolved[b] is the block that now indexes row b's prefix through j_b (the
    row's own, an older entry's, or a duplicate's leader's; BROKEN if refused), ids[b] the block newly indexed.
    """
    cache, prev = carry  # prev: int32[B] block indexing the row's prefix through j_b - 1 (ROOT, or BROKEN)
    key, toks, bid, want, salt, chain = x  # [B, 2] uint32, [B, S], [B], [B] bool, [B] int32, [B, 2] uint32
    c, n, ways = cfg.capacity, cfg.num_blocks, cfg.ways
    rows = jnp.arange(bid.shape[0], dtype=i32)
    want = want & (prev != BROKEN)

    # 1. The prefix is already indexed (same key, same content): nothing to insert, follow the entry.
    bucket = _bucket(key, cfg)
    slots = bucket[:, None] * ways + jnp.arange(ways, dtype=i32)[None, :]  # [B, ways]
    probe = _ways(cache, slots)  # [B, ways, 3]: key, block
    live = probe[..., 2] > 0
    same_key = live & jnp.all(_as_key(probe) == key[:, None, :], axis=-1)
    exists = jnp.any(same_key, axis=-1)
    old = jnp.take_along_axis(slots, jnp.argmax(same_key, axis=-1)[:, None], axis=-1)[:, 0]
    entry = _entry_at(cache, old)  # [B]
    same_entry = jnp.all(entry.tokens == toks, axis=-1) & (entry.parent == prev) & (entry.salt == salt)
    known = want & exists & same_entry
    clash = want & exists & ~same_entry

    # 2. New keys: rows with equal keys form a group led by its lowest row; equal content = a duplicate of the
    #    leader, other content = a collision (the leader wins).
    new = want & ~exists
    same_group = jnp.all(key[:, None, :] == key[None, :, :], axis=-1) & new[None, :]  # [B, B]
    leader = jnp.min(jnp.where(same_group, rows[None, :], rows[:, None]), axis=1)  # the lowest new row of its key
    is_leader = new & (leader == rows)
    same_content = jnp.all(toks == toks[leader], axis=-1) & (prev == prev[leader]) & (salt == salt[leader])
    duplicate = new & ~is_leader & same_content
    clash |= new & ~is_leader & ~same_content

    # 3. A leader's block must be a real block that no entry (old or earlier in this call) already indexes.
    safe_bid = jnp.clip(bid, 0, n - 1)
    earlier_same_bid = (bid[:, None] == bid[None, :]) & is_leader[None, :] & (rows[None, :] < rows[:, None])
    bad_id = (bid < 1) | (bid >= n) | (cache.slot_of_block[safe_bid] >= 0) | jnp.any(earlier_same_bid, axis=1)
    candidate = is_leader & ~bad_id

    # 4. Ways: the r-th candidate of a bucket (in row order) takes the bucket's r-th free way, if any.
    rank = jnp.sum((bucket[:, None] == bucket[None, :]) & candidate[None, :] & (rows[None, :] < rows[:, None]),
                   axis=1, dtype=i32)
    free = ~live
    free_rank = jnp.cumsum(free, axis=1, dtype=i32) - 1
    # `& ~known` never changes `got` (a candidate's key is new), but it makes the scatters below depend on the
    # token and parent gathers above, so XLA orders them first and updates the table in place, not a copy.
    got = candidate & (rank < jnp.sum(free, axis=1, dtype=i32)) & ~known
    way = jnp.argmax(free & (free_rank == rank[:, None]), axis=1).astype(i32)
    dst = jnp.where(got, bucket * ways + way, c)  # c: dropped by the scatters
    cache = cache.replace(
        entries=cache.entries.at[dst].set(_entry_rows(key, bid, prev, salt, toks, chain), mode="drop"),
        by_block=cache.by_block.at[jnp.where(got, bid, n)].set(jnp.stack([dst, prev], axis=1), mode="drop"),
    )

    leader_block = jnp.where(got, bid, BROKEN)
    # A known row's entry is a live slot, which the scatter above (into free ways) did not touch.
    resolved = jnp.where(known, entry.block, jnp.where(duplicate, leader_block[leader], leader_block))
    resolved = jnp.where(want, resolved, BROKEN)
    ct = cache.counters
    inserted, collisions, dropped_full, rejected = sums(got, clash, candidate & ~got, is_leader & bad_id)
    cache = cache.replace(counters=ct.replace(
        inserted=ct.inserted + inserted,
        collisions=ct.collisions + collisions,
        dropped_full=ct.dropped_full + dropped_full,
        rejected=ct.rejected + rejected,
    ))
    return (cache, resolved), jnp.where(got, bid, NULL_BLOCK)


def _start_dense(cache: PrefixCache, blocks: jax.Array, num_full: jax.Array, salt: jax.Array,
                 cfg: PrefixCacheConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(start int32[B], prev int32[B], chain uint32[B, 2]): where each row's insert starts, its first full block
    not indexed as its prefix (at most num_full), the block indexing the prefix before it (ROOT at 0) and the
    chain value there (the seed at 0), by probing every block position of every row (`_longest_chain`)."""
    rows = jnp.arange(blocks.shape[0], dtype=i32)
    ch = chains(blocks, salt)
    matched, found = _longest_chain(cache, blocks, cfg, salt, _finalise(ch, cfg.hash_bits))
    start = jnp.minimum(matched, num_full)
    before = jnp.maximum(start - 1, 0)
    return (start, jnp.where(start > 0, found[rows, before], ROOT),
            jnp.where((start > 0)[:, None], ch[rows, before], _seed(salt)))


def _start_windowed(cache: PrefixCache, blocks: jax.Array, num_full: jax.Array, block_table: jax.Array,
                    salt: jax.Array, cfg: PrefixCacheConfig, window: int,
                    own_content: bool = False, src: jax.Array | None = None) -> tuple[tuple, jax.Array]:
    """`_start_dense`'s answer from a window: ((start, prev, chain), conclusive bool[B]), exact where conclusive.
    Row b's blocks are blocks[src[b]] (src None: blocks[b]); with own_content only its window's are read.

    A row's leading blocks indexed as its own (the entry of table[b, j] is live, under the row's salt, holds the
    row's tokens of block j, and has parent table[b, j - 1]) form a verified chain of the row's prefix, and the
    index's keys are those chains' hashes, unique in the table: so the dense probe finds the same entries, and its
    matched count is at least that run's length h, with the same ids. Found through the row's own block ids, this
    costs no hashing and no probe of the ways. Only the next `window` positions are then probed, continuing the
    chain from the entry at h - 1 (`PrefixCache.chain`); the answer is exact unless all of them matched and the
    row has full blocks beyond them (not conclusive: the caller probes densely)."""
    b, j = num_full.shape[0], blocks.shape[1]
    n, c = cfg.num_blocks, cfg.capacity
    rows = jnp.arange(b, dtype=i32)
    src = rows if src is None else src
    own = block_table[:, :j]
    link = cache.by_block[jnp.clip(own, 0, n - 1)]  # [B, J, 2]: slot, and its entry's parent
    slot = link[..., 0]
    at = jnp.clip(slot, 0, c - 1)
    parent = jnp.concatenate([jnp.full((b, 1), ROOT, i32), own[:, :-1]], axis=1)
    # A live slot's entry holds the block that names it, and has its parent's salt (the index's invariants), so in
    # a leading run of entries each the child of the one before, only the first entry's salt needs reading.
    first_salt = jnp.concatenate([(cache.salt[at[:, 0]] == salt)[:, None], jnp.ones((b, j - 1), bool)], axis=1)
    mine = (own > 0) & (slot >= 0) & (link[..., 1] == parent) & first_salt
    if not own_content:  # the tokens, from the entries: C random rows of S + 7 columns
        mine &= jnp.all(_entry_at(cache, at).tokens == blocks[src], axis=-1)
    h = jnp.minimum(count_leading(mine, axis=1), num_full)
    last = jnp.maximum(h - 1, 0)
    first_prev = jnp.where(h > 0, own[rows, last], ROOT)
    first_chain = jnp.where((h > 0)[:, None], cache.chain[at[rows, last]], _seed(salt))
    cols = jnp.clip(h[:, None] + jnp.arange(window, dtype=i32)[None, :], 0, j - 1)  # [B, W]
    wblocks = blocks[src[:, None], cols]  # [B, W, S]
    wchain, ch = [], first_chain
    for i in range(window):  # static and small
        ch = _next_chain(ch, wblocks[:, i])
        wchain.append(ch)
    wchain = jnp.stack(wchain, axis=1)  # [B, W, 2]
    matched, found = _longest_chain(cache, wblocks, cfg, salt, _finalise(wchain, cfg.hash_bits), first_prev)
    matched = jnp.minimum(matched, num_full - h)  # past num_full, the clipped columns repeat the last block
    conclusive = (matched < window) | (h + window >= num_full)
    before = jnp.maximum(matched - 1, 0)
    start = h + matched
    prev = jnp.where(matched > 0, found[rows, before], first_prev)
    chain = jnp.where((matched > 0)[:, None], wchain[rows, before], first_chain)
    return (start, prev, chain), conclusive


def _start_rest(cache: PrefixCache, blocks: jax.Array, num_full: jax.Array, salt: jax.Array, cfg: PrefixCacheConfig,
                found: tuple, undecided: jax.Array, src: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`found` (start, prev, chain) with the rows the window left undecided (bool[B]) answered by `_start_dense`: a
    row's answer depends on its own blocks alone, so up to B/8 such rows are probed on their own (gathered, then
    scattered back), more as one dense probe of every row; nothing runs when every row is decided. Row b's blocks
    are blocks[src[b]] (src None: blocks[b]), gathered only where a probe runs."""
    b = num_full.shape[0]
    src = jnp.arange(b, dtype=i32) if src is None else src
    few = max(b // 8, 1)
    count = jnp.sum(undecided, dtype=i32)

    def some(x):
        idx = first_trues(undecided, few, b)[0]
        rows = jnp.clip(idx, 0, b - 1)
        answer = _start_dense(cache, blocks[src[rows]], num_full[rows], salt[rows], cfg)
        return tuple(v.at[idx].set(a, mode="drop") for v, a in zip(x, answer))

    found = vmap_flow.when((count > 0) & (count <= few), some, found)
    return vmap_flow.when(count > few, lambda _: _start_dense(cache, blocks[src], num_full, salt, cfg), found)


@functools.partial(jax.jit, static_argnames=("cfg", "window", "own_content"))
def insert_unchecked(cache, tokens, num_validated, block_table, salt=None, rows=None, *, cfg: PrefixCacheConfig,
                     window: int = 0, own_content: bool = False):
    """window: 0 probes every block position of every row for its indexed prefix (`_start_dense`); > 0 probes
    only `window` positions past each row's own indexed blocks, and every position only in a call where that
    is not conclusive (`_start_windowed`: a row's blocks indexed by others' entries, or more than `window` of
    them; `_start_rest`). The same table and result either way; the window is far cheaper in a decode step (a
    row's prefix is indexed, one block new), and its fallback is a data-dependent skip (a host round trip on a
    GPU). own_content (static, with a window): every row's table holds its own tokens in its validated blocks, as
    the scheduler's tables do (a row wrote them, or shared the block through a lookup that compared them, and an
    indexed block is never written: a write into it copies it first); the window's check of a row's own indexed
    blocks then reads their parents from `PrefixCache.by_block` and not their tokens from the entries (at
    256 slots, 64 rows of 128 entries from a 24 MB table: once the largest single cost of the CPU's scheduler
    step). Any table otherwise.
    rows (None, or int32[B] in [0, len(tokens))): row b's tokens are tokens[rows[b]] (num_validated, block_table and
    salt are per row b), read where a step needs them rather than gathered whole first (at 256 slots, 64 rows of
    2,048 tokens a decode step, of which the window reads 4 blocks)."""
    s, m = cfg.block_size, cfg.max_blocks_per_seq
    blocks = _split_blocks(tokens, cfg)  # [len(tokens), J, S]
    b, j = num_validated.shape[0], blocks.shape[1]
    src, rows = rows, jnp.arange(b, dtype=i32)
    at_src = rows if src is None else src
    salt = _salts(salt, b)
    # Only whole blocks of validated tokens: block j needs tokens [0, (j + 1) S) all validated.
    num_full = jnp.minimum(floor_div(num_validated, s), j)

    # Iteration k handles block start[b] + k of every row: a block's parent is what its row's previous block
    # resolved to, possibly another row's block inserted in the same call, so block positions go in order.
    # Rows holding the same new prefix have the same start, so they meet in the same iteration and dedup.
    # The trip count is data: the most new blocks of any row (0-2 in a decode step, chunk / S in prefill).
    # Past a row's last block the body changes nothing (no row is live, prev and the chain are kept, k stops),
    # which lets a vmapped sweep run the longest lane's trip count without selecting the table
    # (`vmap_flow.while_loop`). Each row's chain value goes one block on per iteration (`_next_chain`).
    def body(carry):
        k, cache, prev, chain, ids = carry
        col = start + k
        live = col < num_full
        c = jnp.clip(col, 0, j - 1)
        toks = blocks[at_src, c]
        here = _next_chain(chain, toks)
        x = (_finalise(here, cfg.hash_bits), toks, block_table[rows, c], live, salt, here)
        (cache, resolved), new_ids = _insert_position(cfg, (cache, prev), x)
        return (k + (k < steps).astype(i32), cache, jnp.where(live, resolved, prev),
                jnp.where(live[:, None], here, chain), ids.at[rows, jnp.where(live, col, j)].set(new_ids, mode="drop"))

    before = cache.counters
    ids = jnp.zeros((b, j), i32)
    if j > 0:  # static: tokens shorter than a block hold no full block
        # Each row's already-indexed prefix is skipped; the loop below walks the rest.
        if window:
            found, conclusive = _start_windowed(cache, blocks, num_full, block_table, salt, cfg, window, own_content,
                                                src)
            start, prev, chain = _start_rest(cache, blocks, num_full, salt, cfg, found, ~conclusive, src)
        else:
            start, prev, chain = _start_dense(cache, blocks if src is None else blocks[src], num_full, salt, cfg)
        steps = jnp.max(num_full - start, initial=0)
        init = (jnp.zeros((), i32), cache, prev, chain, ids)
        _, cache, _, _, ids = vmap_flow.while_loop(lambda carry: carry[0] < steps, body, init, identity_when_done=True)
    after = cache.counters
    result = InsertResult(
        block_ids=_pad_cols(ids, m),
        num_inserted=jnp.sum(ids > 0, axis=1, dtype=i32),
        collisions=after.collisions - before.collisions,
        dropped_full=after.dropped_full - before.dropped_full,
        rejected=after.rejected - before.rejected,
    )
    return cache, result


# ----------------------------------------------------------------------------------------------- remove


@functools.partial(jax.jit, static_argnames=("cfg", "loop"))
def remove_unchecked(cache: PrefixCache, block_ids: jax.Array, *, cfg: PrefixCacheConfig, loop: bool = True):
    """loop: how the removal closes over descendants (the same set either way). True: a `while` that adds one
    level per trip until nothing changes (1-2 trips in a step's removal; cheapest on a CPU). False: ceil(log2 M)
    rounds of pointer doubling, no data-dependent loop (each trip of one waits for the host on a GPU), ~7 [C]
    gathers more at M = 128 than a typical loop, which a CPU pays for (2x naive_spec's scheduler step at 256
    slots, measured)."""
    n = cfg.num_blocks
    live = cache.block > 0
    requested = jnp.zeros((n,), bool).at[jnp.where(block_ids > 0, block_ids, n)].set(True, mode="drop")
    named = requested[cache.block]  # [C] slots whose block was named
    gone = live & named  # [C] slots to clear

    if loop:  # a child goes when its parent does (depth <= M, so <= M trips)
        def grow(state):
            gone, _ = state
            gone_block = jnp.zeros((n,), bool).at[jnp.where(gone, cache.block, n)].set(True, mode="drop")
            more = gone | (live & gone_block[cache.parent] & (cache.parent != ROOT))
            return more, jnp.any(more != gone)

        gone, _ = jax.lax.while_loop(lambda st: st[1], grow, grow((gone, jnp.ones((), bool))))
    else:  # as `subtree_max`: after round r a slot has seen its ancestors fewer than 2^r levels up
        c = gone.shape[0]
        parent_slot = cache.slot_of_block[jnp.clip(cache.parent, 0, n - 1)]
        up = jnp.where(live & (cache.parent != ROOT) & (parent_slot >= 0), parent_slot, c)  # c: none
        for _ in range((cfg.max_blocks_per_seq - 1).bit_length()):
            # One gather a round for both (a kernel launch each on a GPU): row 0 the flags, row 1 the pointers.
            both = jnp.stack([jnp.append(gone.astype(i32), 0), jnp.append(up, c)])[:, up]  # [2, C]
            gone, up = gone | (both[0] > 0), both[1]
    descendants = jnp.where(gone & ~named, cache.block, NULL_BLOCK)
    by_block = cache.by_block.at[jnp.where(gone, cache.block, n), 0].set(-1, mode="drop")
    num_removed = jnp.sum(gone, dtype=i32)
    # A cleared slot reads key 0, block NULL_BLOCK, parent ROOT, salt 0 and tokens 0 (all zero); its chain is left.
    clear = gone[:, None] & (jnp.arange(cache.entries.shape[1]) < cache.entries.shape[1] - 2)[None, :]
    cache = cache.replace(
        entries=jnp.where(clear, 0, cache.entries),
        by_block=by_block,
        counters=cache.counters.replace(removed=cache.counters.removed + num_removed),
    )
    return cache, RemoveResult(num_removed=num_removed, descendants=descendants)


# ------------------------------------------------------------------------------------------ the forest


def subtree_max(cache: PrefixCache, value: jax.Array, cfg: PrefixCacheConfig) -> tuple[jax.Array, jax.Array]:
    """For value int32[N] per block: (int32[N] the max of value over each indexed block's subtree, itself and its
    indexed descendants; int32[N] its height, 0 for a leaf). A block that is not indexed keeps its value and has
    height 0. Traceable; for `kv.manager.eviction_order`, which evicts leaves first.

    By pointer doubling over blocks: after round r, a block holds the max over its descendants less than 2^r
    below it, and `up` points 2^r blocks up; a chain is at most M blocks deep, so ceil(log2 M) rounds of one
    [N] scatter-max and one [N] gather each (not one round per level)."""
    n = cfg.num_blocks
    live = cache.block > 0
    up = jnp.zeros((n,), i32).at[jnp.where(live, cache.block, n)].set(cache.parent, mode="drop")  # ROOT: none
    # Row 0 the value, row 1 the height: one scatter-max a round for both (a kernel launch each on a GPU).
    both = jnp.stack([value.astype(i32), jnp.zeros((n,), i32)])  # [2, N]
    for r in range((cfg.max_blocks_per_seq - 1).bit_length()):
        dst = jnp.where(up != ROOT, up, n)  # n: dropped
        both = both.at[:, dst].max(both + jnp.asarray([[0], [1 << r]], i32), mode="drop")
        up = up[up]  # up[ROOT] = ROOT: block 0 is never indexed
    return both[0], both[1]


# ------------------------------------------------------------------- public API (validated at the boundary)


def check_cache(cache: PrefixCache, cfg: PrefixCacheConfig) -> None:
    """Raise if the table's shapes do not match cfg (e.g. a table built for another config)."""
    if not isinstance(cfg, PrefixCacheConfig):
        raise TypeError(f"cfg must be a PrefixCacheConfig, got {type(cfg).__name__}")
    if not isinstance(cache, PrefixCache):
        raise TypeError(f"cache must be a PrefixCache, got {type(cache).__name__}")
    checks.array("cache.entries", cache.entries, (cfg.capacity, cfg.block_size + 7), "i")
    checks.array("cache.by_block", cache.by_block, (cfg.num_blocks, 2), "i")


def _check_tokens(tokens) -> tuple[int, int]:
    if not hasattr(tokens, "shape") or len(tokens.shape) != 2:
        raise ValueError(f"tokens must be a 2-D [B, len] array, got shape {getattr(tokens, 'shape', None)}")
    checks.array("tokens", tokens, tokens.shape, "i")
    if np.dtype(tokens.dtype) != np.int32:
        raise TypeError(f"tokens must have dtype int32, got {tokens.dtype}")
    return tokens.shape


def _checked_salt(salt, b: int) -> jax.Array | None:
    if salt is not None:
        checks.array("salt", salt, (b,), "i")
        salt = jnp.asarray(salt, i32)
    return salt


def lookup(
    cache: PrefixCache,
    tokens: jax.Array,
    lengths: jax.Array,
    spec_window: jax.Array | int = 0,
    *,
    cfg: PrefixCacheConfig,
    max_spec_ratio: float | jax.Array = SpecConfig().max_spec_ratio,
    salt: jax.Array | None = None,
) -> LookupResult:
    """Longest cached block-aligned prefix of each prompt, minus the speculative barrier.

    tokens: int32[B, len] prompts; lengths: int[B] in [0, len]; spec_window: int scalar or int[B] >= 0, the expected
    draft length of each sequence (0 = no speculation, no barrier); max_spec_ratio: float scalar in [0, 1] (data,
    so one program serves every value); salt: int[B] each request's cache salt (default 0, none): only entries
    inserted under the same salt are hits. Only the first min(len // S, M) blocks are considered, and at most
    (length - 1) // S of them are returned (>= 1 token left to compute). The table is not modified.
    """
    check_cache(cache, cfg)
    b, length = _check_tokens(tokens)
    checks.array("lengths", lengths, (b,), "i")
    checks.in_range("lengths", lengths, 0, length)
    if jnp.ndim(spec_window) == 0:
        checks.scalar_int("spec_window", spec_window)
    checks.in_range("spec_window", spec_window, 0, 2**31 - 1)  # before the int32 conversion can overflow
    if jnp.ndim(spec_window) == 0:
        spec_window = jnp.broadcast_to(jnp.asarray(spec_window, i32), (b,))
    checks.array("spec_window", spec_window, (b,), "i")
    if isinstance(max_spec_ratio, bool) or not (
        isinstance(max_spec_ratio, (int, float)) or getattr(max_spec_ratio, "shape", None) == ()
    ):
        raise TypeError(f"max_spec_ratio must be a float scalar, got {type(max_spec_ratio).__name__}")
    checks.in_range("max_spec_ratio", max_spec_ratio, 0, 1)
    ratio = jnp.asarray(max_spec_ratio, jnp.float32)
    return lookup_unchecked(cache, tokens, lengths.astype(i32), spec_window.astype(i32), ratio,
                            _checked_salt(salt, b), cfg=cfg)


def insert_after_validation(
    cache: PrefixCache,
    tokens: jax.Array,
    num_validated: jax.Array,
    block_table: jax.Array,
    *,
    cfg: PrefixCacheConfig,
    salt: jax.Array | None = None,
) -> tuple[PrefixCache, InsertResult]:
    """Index every whole block of validated tokens that is not indexed yet.

    tokens: int32[B, len]; num_validated: int[B] in [0, len], the committed (accepted) tokens of each row -- tokens
    past it (drafts, padding) are never read into the index; block_table: int[B, M], the physical block of each
    logical block; salt: int[B] each row's cache salt (default 0, none), stored with the entries it creates.
    Block j of row b is a candidate iff (j + 1) * S <= num_validated[b] and j < min(len // S, M).
    A candidate whose prefix is already indexed is skipped; identical new prefixes in one call are indexed
    once (the lowest row's block); refusals (collision, full bucket, block id invalid or already indexed under
    another prefix) are counted and end that row's chain. Returns the new table and the blocks newly indexed,
    which the caller pins: `allocator.set_cached(st, ids.reshape(-1), ids.reshape(-1) > 0)`.
    """
    check_cache(cache, cfg)
    b, length = _check_tokens(tokens)
    checks.array("num_validated", num_validated, (b,), "i")
    checks.in_range("num_validated", num_validated, 0, length)
    checks.array("block_table", block_table, (b, cfg.max_blocks_per_seq), "i")
    if checks.is_concrete(block_table) and checks.is_concrete(num_validated):
        j = min(length // cfg.block_size, cfg.max_blocks_per_seq)
        used = np.arange(cfg.max_blocks_per_seq)[None, :] < np.minimum(np.asarray(num_validated) // cfg.block_size,
                                                                      j)[:, None]
        checks.in_range("block_table", np.asarray(block_table)[used], 1, cfg.num_blocks - 1)
    return insert_unchecked(cache, tokens, num_validated.astype(i32), block_table.astype(i32), _checked_salt(salt, b),
                            cfg=cfg)


def remove(cache: PrefixCache, block_ids: jax.Array, *, cfg: PrefixCacheConfig) -> tuple[PrefixCache, RemoveResult]:
    """Drop the entries of block_ids (int[X] in [0, N), e.g. `allocator.evict_lru`'s output; 0 (padding) and ids
    that are not indexed are ignored, and inside a user's jit so are negative ones) and of all their descendants,
    whose ids come back to be unpinned."""
    check_cache(cache, cfg)
    if not hasattr(block_ids, "shape") or len(block_ids.shape) != 1:
        raise ValueError(f"block_ids must be a 1-D array, got shape {getattr(block_ids, 'shape', None)}")
    checks.array("block_ids", block_ids, block_ids.shape, "i")
    checks.in_range("block_ids", block_ids, 0, cfg.num_blocks - 1)
    return remove_unchecked(cache, block_ids.astype(i32), cfg=cfg)
