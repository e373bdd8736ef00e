"""The prefix cache against a plain-Python oracle (a dict from token prefixes to block ids), its collision
safety under a deliberately weak hash, its boundary checks, and its use together with the allocator."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as hs

from skvs_jax import testing
from skvs_jax.config import NULL_BLOCK, CacheConfig, SpecConfig
from skvs_jax.kv import allocator, manager
from skvs_jax.kv import prefix_cache as pc

i32 = jnp.int32
B, S, M = 4, 2, 6
L = M * S
X = 8  # ids per remove call (fixed, so remove compiles once)
# Strong hash, roomy table: every insert must succeed, so the table must equal the oracle exactly.
CFG = pc.PrefixCacheConfig(num_blocks=64, block_size=S, max_blocks_per_seq=M, capacity=256, ways=8)
# 2-bit key lanes (16 keys) in 4 buckets of 2 ways: collisions and full buckets on almost every insert.
WEAK = pc.PrefixCacheConfig(num_blocks=64, block_size=S, max_blocks_per_seq=M, capacity=8, ways=2, hash_bits=2)


# ------------------------------------------------------------------------------------------------ oracle


class OraclePrefixCache:
    """The ideal index: prefix (tuple of tokens, a whole number of blocks) -> block id, prefix-closed."""

    def __init__(self):
        self.index: dict[tuple[int, ...], int] = {}

    def matched(self, row) -> int:
        j = 0
        while j < min(len(row) // S, M) and tuple(row[: (j + 1) * S]) in self.index:
            j += 1
        return j

    def lookup(self, row, length, window, ratio):
        matched = min(self.matched(row), max(length - 1, 0) // S)
        buffer = max(1, int(np.float32(ratio) * np.float32(window)) // S) if window > 0 else 0
        shared = max(0, matched - buffer)
        ids = [self.index[tuple(row[: (j + 1) * S])] for j in range(shared)]
        return matched, shared, ids

    def insert(self, rows, num_validated, table):
        """Row by row; the JAX version goes position by position, which gives every prefix the same winner
        (the lowest row that holds it) as long as no insert is refused."""
        new = np.zeros((len(rows), M), np.int32)
        for b, row in enumerate(rows):
            for j in range(min(num_validated[b] // S, L // S, M)):
                prefix = tuple(row[: (j + 1) * S])
                if prefix not in self.index:
                    self.index[prefix] = int(table[b][j])
                    new[b, j] = table[b][j]
        return new

    def remove(self, ids):
        """Drop the entries of ids and, level by level, every entry whose parent prefix is gone."""
        ids = {int(i) for i in ids if i > 0}
        gone = {p for p, blk in self.index.items() if blk in ids}
        for p in sorted(self.index, key=len):
            if len(p) > S and p[:-S] in gone:
                gone.add(p)
        descendants = sorted(self.index[p] for p in gone if self.index[p] not in ids)
        for p in gone:
            del self.index[p]
        return len(gone), descendants


# -------------------------------------------------------------------------------------------- workload

rows_st = hs.lists(hs.lists(hs.integers(0, 1), min_size=L, max_size=L), min_size=B, max_size=B)
operation = hs.one_of(
    hs.tuples(hs.just("insert"), rows_st, hs.lists(hs.integers(0, L), min_size=B, max_size=B),
              hs.lists(hs.booleans(), min_size=B, max_size=B)),
    hs.tuples(hs.just("lookup"), rows_st, hs.lists(hs.integers(0, L), min_size=B, max_size=B),
              hs.lists(hs.sampled_from([0, 1, 3, 5, 10]), min_size=B, max_size=B), hs.sampled_from([0.0, 0.3, 1.0])),
    hs.tuples(hs.just("remove"), hs.lists(hs.integers(0, 40), min_size=1, max_size=X)),
)


def block_table_for(rows, reuse, oracle):
    """Each row's table: its already-indexed prefix blocks (a row that shared them, when reuse) and fresh ids
    that are neither indexed nor used elsewhere in the call, lowest first (so removed ids get reused)."""
    indexed = set(oracle.index.values())
    fresh = (i for i in range(1, CFG.num_blocks) if i not in indexed)
    table = np.zeros((B, M), np.int32)
    for b, row in enumerate(rows):
        shared = oracle.matched(row) if reuse[b] else 0
        for j in range(M):
            table[b, j] = oracle.index[tuple(row[: (j + 1) * S])] if j < shared else next(fresh, 0)
    return table


def run_workload(ops, cfg, check_exact):
    """Apply ops to the JAX cache and the oracle. Always: hits hold exactly the request's prefix (by the
    ground-truth content of each block), never more than the oracle's. check_exact: everything agrees."""
    cache, oracle = pc.init(cfg), OraclePrefixCache()
    truth: dict[int, tuple[int, ...]] = {}  # block id -> the prefix it was indexed with (ground truth)
    for op in ops:
        if op[0] == "insert":
            _, rows, nv, reuse = op
            table = block_table_for(rows, reuse, oracle)
            if (table == 0).any():  # out of fresh ids: drop the whole index instead
                op = ("remove", sorted(oracle.index.values()))
            else:
                cache, res = pc.insert_after_validation(
                    cache, jnp.asarray(rows, i32), jnp.asarray(nv, i32), jnp.asarray(table), cfg=cfg
                )
                want = oracle.insert(rows, nv, table)
                ids = np.asarray(res.block_ids)
                for b, j in zip(*np.nonzero(ids)):
                    assert (j + 1) * S <= nv[b], "only whole blocks of validated tokens are indexed"
                    truth[int(ids[b, j])] = tuple(rows[b][: (j + 1) * S])
                if check_exact:
                    np.testing.assert_array_equal(ids, want, err_msg="newly inserted blocks")
                    assert int(res.collisions) == int(res.dropped_full) == int(res.rejected) == 0
                else:
                    # Refused inserts leave the oracle ahead: resync it with what the table really holds.
                    oracle.index = testing.prefix_index_as_dict(cache, cfg)
        if op[0] == "lookup":
            _, rows, lengths, windows, ratio = op
            res = pc.lookup(cache, jnp.asarray(rows, i32), jnp.asarray(lengths, i32), jnp.asarray(windows, i32),
                            cfg=cfg, max_spec_ratio=ratio)
            for b, row in enumerate(rows):
                matched, shared, ids = oracle.lookup(row, lengths[b], windows[b], ratio)
                got = np.asarray(res.block_ids[b])
                n = int(res.num_blocks[b])
                for j in range(n):  # a hit is only ever the request's own prefix
                    assert truth[int(got[j])] == tuple(row[: (j + 1) * S]), "a hit returned other content"
                assert (got[n:] == NULL_BLOCK).all()
                assert int(res.num_matched[b]) <= matched and n <= max(lengths[b] - 1, 0) // S
                assert int(res.spec_boundary[b]) == int(res.num_tokens[b]) == n * S
                if check_exact:
                    assert (int(res.num_matched[b]), n, got[:n].tolist()) == (matched, shared, ids), f"row {b}"
        if op[0] == "remove":
            ids = list(op[1])
            for start in range(0, max(len(ids), 1), X):
                chunk = ids[start: start + X]
                cache, res = pc.remove(cache, jnp.asarray(chunk + [0] * (X - len(chunk)), i32), cfg=cfg)
                count, descendants = oracle.remove(chunk)
                got = np.asarray(res.descendants)
                assert int(res.num_removed) == count
                assert sorted(got[got > 0].tolist()) == descendants
        if check_exact:
            assert testing.prefix_index_as_dict(cache, cfg) == oracle.index
        else:
            for prefix, blk in testing.prefix_index_as_dict(cache, cfg).items():
                assert truth[blk] == prefix, "an entry's stored chain differs from its block's content"
    return cache


# ------------------------------------------------------------------------------------------- properties


@given(ops=hs.lists(operation, max_size=12))
def test_matches_the_oracle_exactly(ops):
    """Inserted ids, lookups (with the barrier and the keep-one-token cap), removals with their descendants,
    and the whole table equal the dict oracle."""
    run_workload(ops, CFG, check_exact=True)


@given(ops=hs.lists(operation, max_size=12))
def test_collisions_never_return_wrong_content(ops):
    """With a 2-bit hash almost every insert collides or finds its bucket full; hits must still be exact."""
    run_workload(ops, WEAK, check_exact=False)


@pytest.mark.parametrize("cfg", [CFG, WEAK], ids=["strong", "weak"])
@given(ops=hs.lists(operation, max_size=8), rows=rows_st, nv=hs.lists(hs.integers(0, L), min_size=B, max_size=B),
       reuse=hs.lists(hs.booleans(), min_size=B, max_size=B), scramble=hs.lists(hs.integers(0, 40), max_size=B * M),
       window=hs.sampled_from([1, 2, 4]))
def test_a_windowed_insert_equals_the_dense_one(cfg, ops, rows, nv, reuse, scramble, window):
    """`insert_unchecked(window=)` finds where each row's insert starts from its own indexed blocks and a window
    past them (probing every position of the rows that leaves undecided): the table, the ids and the counters
    must equal the dense probe's, on any index (a weak hash: collisions, full buckets) and any table, including
    tables whose ids are scrambled so that a row's block is indexed under another row's content."""
    cache = run_workload(ops, cfg, check_exact=False)
    oracle = OraclePrefixCache()
    oracle.index = testing.prefix_index_as_dict(cache, cfg)
    table = block_table_for(rows, reuse, oracle)
    flat = table.reshape(-1)
    flat[: len(scramble)] = np.where(np.arange(len(scramble)) % 3 == 0, scramble, flat[: len(scramble)])
    args = (cache, jnp.asarray(rows, i32), jnp.asarray(nv, i32), jnp.asarray(flat.reshape(B, M)))
    dense = pc.insert_unchecked(*args, cfg=cfg)
    windowed = pc.insert_unchecked(*args, cfg=cfg, window=window)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), dense, windowed)
    assert all(jax.tree.leaves(same)), same
    blocks = jnp.asarray(rows, i32).reshape(B, M, S)
    full = jnp.minimum(jnp.asarray(nv, i32) // S, M)
    _, conclusive = pc._start_windowed(cache, blocks, full, args[3], jnp.zeros((B,), i32), cfg, window)
    undecided = int(jnp.sum(~conclusive))  # B = 4: one such row is probed alone, more by one dense probe of all
    event("the window decides" if undecided == 0 else "one row probed alone" if undecided == 1 else "all probed")


@pytest.mark.parametrize("cfg", [CFG, WEAK], ids=["strong", "weak"])
@given(ops=hs.lists(operation, max_size=8), rows=rows_st, nv=hs.lists(hs.integers(0, L), min_size=B, max_size=B),
       reuse=hs.lists(hs.booleans(), min_size=B, max_size=B), window=hs.sampled_from([1, 2, 4]))
def test_a_windowed_insert_over_tables_of_own_content_equals_the_dense_one(cfg, ops, rows, nv, reuse, window):
    """`insert_unchecked(window=, own_content=True)` (the scheduler's: a row's validated blocks hold its own tokens)
    reads the entries of a row's own indexed blocks without their tokens: on tables where that holds (the shared
    prefix blocks a lookup found, fresh blocks after them) the table, the ids and the counters equal the dense
    probe's."""
    cache = run_workload(ops, cfg, check_exact=False)
    oracle = OraclePrefixCache()
    oracle.index = testing.prefix_index_as_dict(cache, cfg)
    table = block_table_for(rows, reuse, oracle)
    args = (cache, jnp.asarray(rows, i32), jnp.asarray(nv, i32), jnp.asarray(table))
    dense = pc.insert_unchecked(*args, cfg=cfg)
    windowed = pc.insert_unchecked(*args, cfg=cfg, window=window, own_content=True)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), dense, windowed)
    assert all(jax.tree.leaves(same)), same


@pytest.mark.parametrize("cfg", [CFG, WEAK], ids=["strong", "weak"])
@given(ops=hs.lists(operation, max_size=8), rows=rows_st, nv=hs.lists(hs.integers(0, L), min_size=B, max_size=B),
       reuse=hs.lists(hs.booleans(), min_size=B, max_size=B), order=hs.permutations(range(B + 2)),
       window=hs.sampled_from([0, 1, 4]), own_content=hs.booleans())
def test_an_insert_of_rows_read_from_a_larger_token_array_equals_the_insert_of_those_rows(
        cfg, ops, rows, nv, reuse, order, window, own_content):
    """`insert_unchecked(rows=)` reads row b's tokens at tokens[rows[b]] where it needs them (the scheduler passes
    its whole token table): the table, ids and counters equal the insert of the gathered rows, whatever the source
    order and with rows of the source left out."""
    cache = run_workload(ops, cfg, check_exact=False)
    oracle = OraclePrefixCache()
    oracle.index = testing.prefix_index_as_dict(cache, cfg)
    table = jnp.asarray(block_table_for(rows, reuse, oracle))
    junk = [[1] * L, [0, 1] * (L // 2)]  # two source rows no row reads
    source = np.asarray(rows + junk, np.int32)[np.asarray(order)]
    where = jnp.asarray([order.index(b) for b in range(B)], i32)  # source[where[b]] is rows[b]
    flags = dict(cfg=cfg, window=window, own_content=own_content and window > 0)
    gathered = pc.insert_unchecked(cache, jnp.asarray(rows, i32), jnp.asarray(nv, i32), table, **flags)
    read = pc.insert_unchecked(cache, jnp.asarray(source), jnp.asarray(nv, i32), table, None, where, **flags)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), gathered, read)
    assert all(jax.tree.leaves(same)), same


@pytest.mark.parametrize("undecided_rows", [1, 3])
def test_rows_indexed_through_other_rows_blocks_fall_back_to_the_full_probe(undecided_rows):
    """Rows whose whole prefix is indexed, but by another row's blocks (their own are duplicates), are not decided
    by a window of 2: one such row is probed alone, three (more than B/8) by a dense probe of every row. Either
    way the result is the dense probe's."""
    others = [[0] * L, [0, 1] * (L // 2), [1, 0] * (L // 2)]  # distinct first blocks: each row owns its entries
    rows = [[1] * L] * undecided_rows + others[: B - undecided_rows]
    first = np.arange(1, B * M + 1, dtype=np.int32).reshape(B, M)
    cache, _ = pc.insert_unchecked(pc.init(CFG), jnp.asarray(rows, i32), jnp.full((B,), L, i32), jnp.asarray(first),
                                   cfg=CFG)
    fresh = np.where(np.arange(B)[:, None] < undecided_rows, first + B * M, first)  # the others keep their own
    args = (cache, jnp.asarray(rows, i32), jnp.full((B,), L, i32), jnp.asarray(fresh))
    _, conclusive = pc._start_windowed(cache, jnp.asarray(rows, i32).reshape(B, M, S), jnp.full((B,), M, i32),
                                       args[3], jnp.zeros((B,), i32), CFG, 2)
    assert int(jnp.sum(~conclusive)) == undecided_rows
    dense, windowed = pc.insert_unchecked(*args, cfg=CFG), pc.insert_unchecked(*args, cfg=CFG, window=2)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), dense, windowed)))


def test_a_chain_goes_on_one_block_at_a_time_as_the_cumulative_form_computes_it():
    """`_next_chain` from the seed, block after block, gives `chains`' columns (and so the same keys), salted
    or not: the windowed insert continues a row's chain from its entry's stored value."""
    rng = np.random.default_rng(0)
    blocks = jnp.asarray(rng.integers(0, 300, (3, 6, S)), i32)
    for salt in (None, jnp.asarray([0, 5, -7], i32)):
        full = np.asarray(pc.chains(blocks, salt))
        chain = pc._seed(jnp.zeros((3,), i32) if salt is None else salt)
        for j in range(6):
            chain = pc._next_chain(chain, blocks[:, j])
            np.testing.assert_array_equal(np.asarray(chain), full[:, j])


def test_the_weak_hash_really_collides_and_hits_stay_exact():
    rows = [[(b >> k) & 1 for k in range(L)] for b in range(B)]
    ops = [("insert", [[(seed * 7 + b * 3 + k) % 2 ^ (k * seed % 3 == 0) for k in range(L)] for b in range(B)],
            [L] * B, [False] * B) for seed in range(6)]
    ops += [("lookup", rows, [L] * B, [0] * B, 0.3)]
    cache = run_workload(ops, WEAK, check_exact=False)
    assert int(cache.counters.collisions) > 0 and int(cache.counters.dropped_full) > 0


# ---------------------------------------------------------------------------------------------- examples


def test_barrier_and_keep_one_token():
    cache = pc.init(CFG)
    row = list(range(L))
    table = np.arange(1, M + 1, dtype=np.int32)[None].repeat(B, 0) + np.arange(B)[:, None] * M
    cache, res = pc.insert_after_validation(cache, jnp.asarray([row] * B, i32), jnp.asarray([L, 0, 0, 0], i32),
                                            jnp.asarray(table), cfg=CFG)
    assert int(res.num_inserted[0]) == M and int(res.num_inserted.sum()) == M
    # Entirely cached prompt of L tokens: (L - 1) // S = M - 1 blocks, the last block is recomputed.
    lengths = jnp.asarray([L, L, L, 3], i32)
    out = pc.lookup(cache, jnp.asarray([row] * B, i32), lengths, jnp.asarray([0, 1, 10, 0], i32), cfg=CFG,
                    max_spec_ratio=0.5)
    # window 1: max(1, int(0.5 * 1 / 2)) = 1 block; window 10: int(0.5 * 10 / 2) = 2 blocks.
    np.testing.assert_array_equal(out.num_matched, [M - 1, M - 1, M - 1, 1])
    np.testing.assert_array_equal(out.num_blocks, [M - 1, M - 2, M - 3, 1])
    np.testing.assert_array_equal(out.spec_boundary, np.asarray(out.num_blocks) * S)
    np.testing.assert_array_equal(out.block_ids[2], [1, 2, 3, 0, 0, 0])
    # A scalar window is broadcast.
    same = pc.lookup(cache, jnp.asarray([row] * B, i32), lengths, 1, cfg=CFG, max_spec_ratio=0.5)
    np.testing.assert_array_equal(same.num_blocks, [M - 2, M - 2, M - 2, 0])


def test_duplicate_prefixes_in_one_call_are_indexed_once_by_the_lowest_row():
    cache = pc.init(CFG)
    rows = [[1] * L, [1] * L, [1] * S + [2] * (L - S), [1] * L]
    table = np.arange(1, B * M + 1, dtype=np.int32).reshape(B, M)
    cache, res = pc.insert_after_validation(cache, jnp.asarray(rows, i32), jnp.asarray([4, 8, 6, 0], i32),
                                            jnp.asarray(table), cfg=CFG)
    # Row 0 indexes blocks 0-1; row 1 extends it with blocks 2-3 (parent: row 0's block 1); row 2 shares
    # block 0 with row 0 and indexes its own blocks 1-2 under row 0's block 0.
    np.testing.assert_array_equal(res.block_ids[:, :4], [[1, 2, 0, 0], [0, 0, 9, 10], [0, 14, 15, 0], [0] * 4])
    assert testing.prefix_index_as_dict(cache, CFG)[tuple([1] * 8)] == 10


def test_remove_drops_descendants_and_their_ids_come_back():
    cache = pc.init(CFG)
    cache, _ = pc.insert_after_validation(cache, jnp.asarray([[3] * L] * B, i32), jnp.asarray([L, 0, 0, 0], i32),
                                          jnp.asarray(np.arange(1, B * M + 1, dtype=np.int32).reshape(B, M)),
                                          cfg=CFG)
    cache, res = pc.remove(cache, jnp.asarray([3, 0, 0, 0, 0, 0, 0, 0], i32), cfg=CFG)
    assert int(res.num_removed) == 4
    got = np.asarray(res.descendants)
    assert sorted(got[got > 0].tolist()) == [4, 5, 6]
    assert set(testing.prefix_index_as_dict(cache, CFG).values()) == {1, 2}


def test_prefix_cache_with_the_allocator():
    """Two requests with one system prompt: the second shares the first's validated blocks; a block that
    holds a draft is never indexed; eviction removes entries and the pool ends without a leak."""
    ccfg = CacheConfig(num_blocks=16, block_size=4, max_seqs=2, max_blocks_per_seq=6)
    spec = SpecConfig(draft_len=3)
    pcfg = pc.PrefixCacheConfig.for_cache(ccfg)
    st, cache = allocator.init(ccfg), pc.init(pcfg)
    system, user_a, user_b = [7, 7, 1, 2, 3, 4, 5, 6], [10, 11, 12], [20, 21, 22]
    tokens = np.zeros((2, 24), np.int32)
    tokens[0, :11] = system + user_a

    def insert(st, cache):
        nv = st.seqs.num_committed
        cache, res = pc.insert_after_validation(cache, jnp.asarray(tokens), nv, st.seqs.block_table, cfg=pcfg)
        ids = res.block_ids.reshape(-1)
        return allocator.set_cached(st, ids, ids > 0), cache, res

    def check_index(st, cache):
        testing.check_invariants(st, ccfg, spec)
        state, cached = np.asarray(st.blocks.state), np.asarray(st.blocks.cached)
        committed, table = np.asarray(st.seqs.num_committed), np.asarray(st.seqs.block_table)
        for prefix, blk in testing.prefix_index_as_dict(cache, pcfg).items():
            assert state[blk] == allocator.VALIDATED and cached[blk], "indexed blocks are validated and pinned"
            holders = [b for b in range(2) if blk in table[b, : len(prefix) // 4]]
            for b in holders:  # every indexed token was committed by the sequences that hold it
                assert len(prefix) <= committed[b] and tuple(tokens[b, : len(prefix)]) == prefix

    # Request A: prefill 11 tokens (validated), then 3 drafts at positions 11..13.
    st, _ = allocator.allocate(st, jnp.asarray([11, 0], i32), cfg=ccfg, spec=spec)
    st, _ = allocator.commit(st, jnp.asarray([11, 0], i32), cfg=ccfg, spec=spec)
    st, _ = allocator.allocate_speculative(st, jnp.asarray([3, 0], i32), 1, cfg=ccfg, spec=spec)
    tokens[0, 11:14] = [90, 91, 92]  # drafts: block 2 now holds validated 8..10 and draft 11
    st, cache, res = insert(st, cache)
    assert int(res.num_inserted[0]) == 2, "block 2 holds a draft: only the system prompt's blocks are indexed"
    check_index(st, cache)
    st, _ = allocator.commit(st, jnp.asarray([1, 0], i32), cfg=ccfg, spec=spec)  # accept draft 11 only
    tokens[0, 12:14] = 0
    st, cache, res = insert(st, cache)
    assert int(res.num_inserted[0]) == 1  # block 2 is now 4 validated tokens
    check_index(st, cache)

    # Request B, same system prompt: lookup, then share the hit by reference.
    tokens[1, :11] = system + user_b
    hit = pc.lookup(cache, jnp.asarray(tokens), jnp.asarray([0, 11], i32), 0, cfg=pcfg)
    assert int(hit.num_blocks[1]) == 2 and int(hit.num_blocks[0]) == 0
    barrier = pc.lookup(cache, jnp.asarray(tokens), jnp.asarray([0, 11], i32), 4, cfg=pcfg, max_spec_ratio=1.0)
    assert int(barrier.num_blocks[1]) == 1 and int(barrier.spec_boundary[1]) == 4
    st, ok = allocator.share(st, hit.block_ids, hit.num_tokens, cfg=ccfg)
    assert bool(ok[1])
    shared = np.asarray(hit.block_ids[1, :2])
    np.testing.assert_array_equal(shared, np.asarray(st.seqs.block_table[0, :2]))
    np.testing.assert_array_equal(np.asarray(st.blocks.ref_count)[shared], [2, 2])
    st, _ = allocator.allocate(st, jnp.asarray([0, 3], i32), cfg=ccfg, spec=spec)
    st, _ = allocator.commit(st, jnp.asarray([0, 3], i32), cfg=ccfg, spec=spec)
    st, cache, res = insert(st, cache)
    assert int(res.num_inserted[1]) == 0  # B's third block is not full yet
    check_index(st, cache)

    # Both finish: the cached blocks stay, evictable. The KV manager evicts leaves first: one block costs one
    # entry, A's third block (the chain's tail), and the system prompt stays cached.
    st, _ = allocator.free(st, jnp.asarray([True, True]), cfg=ccfg, spec=spec)
    kcfg = manager.KVConfig(cache=ccfg, spec=spec, prefix=pcfg, rows_indexed=2)
    kv = manager.evict(manager.KVState(alloc=st, prefix=cache), jnp.asarray(1, i32), kcfg)
    assert int(kv.prefix.counters.removed) - int(cache.counters.removed) == 1
    assert testing.prefix_index_as_dict(kv.prefix, pcfg) == {
        k: v for k, v in testing.prefix_index_as_dict(cache, pcfg).items() if len(k) <= 8}
    testing.check_invariants(kv.alloc, ccfg, spec)
    # The allocator alone knows nothing of chains: its LRU takes the chain's head (the lowest id of one release),
    # and removing it from the index removes the whole chain, whose descendants are unpinned (and so freed).
    st, evicted = allocator.evict_lru(st, 1, max_evict=1)
    assert int(evicted[0]) == shared[0]
    cache, removed = pc.remove(cache, evicted, cfg=pcfg)
    assert int(removed.num_removed) == 3
    st = allocator.set_cached(st, removed.descendants, jnp.zeros(removed.descendants.shape, bool))
    assert testing.prefix_index_as_dict(cache, pcfg) == {}
    testing.check_invariants(st, ccfg, spec)
    testing.assert_no_leak(st, ccfg)


# ------------------------------------------------------------------------------------------- boundaries

TOK = jnp.zeros((B, L), i32)
LEN = jnp.zeros((B,), i32)
TABLE = jnp.ones((B, M), i32)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda c: pc.lookup(c, TOK.astype(jnp.float32), LEN, 0, cfg=CFG), TypeError, "tokens"),
        (lambda c: pc.lookup(c, TOK[0], LEN, 0, cfg=CFG), ValueError, "tokens"),
        (lambda c: pc.lookup(c, TOK, LEN + L + 1, 0, cfg=CFG), ValueError, "lengths"),
        (lambda c: pc.lookup(c, TOK, LEN[:2], 0, cfg=CFG), ValueError, "lengths"),
        (lambda c: pc.lookup(c, TOK, LEN, -1, cfg=CFG), ValueError, "spec_window"),
        (lambda c: pc.lookup(c, TOK, LEN, 2**31, cfg=CFG), ValueError, "spec_window"),  # was an OverflowError
        (lambda c: pc.lookup(c, TOK, LEN, 1.5, cfg=CFG), TypeError, "spec_window"),
        (lambda c: pc.lookup(c, TOK, LEN, jnp.zeros((3,), i32), cfg=CFG), ValueError, "spec_window"),
        (lambda c: pc.lookup(c, TOK, LEN, 0, cfg=CFG, max_spec_ratio=1.5), ValueError, "max_spec_ratio"),
        (lambda c: pc.lookup(c, TOK, LEN, 0, cfg=CFG, max_spec_ratio="x"), TypeError, "max_spec_ratio"),
        (lambda c: pc.lookup(c, TOK, LEN, 0, cfg=WEAK), ValueError, "cache"),
        (lambda c: pc.lookup(None, TOK, LEN, 0, cfg=CFG), TypeError, "cache"),
        (lambda c: pc.lookup(c, TOK, LEN, 0, cfg=None), TypeError, "cfg"),
        (lambda c: pc.insert_after_validation(c, TOK, LEN - 1, TABLE, cfg=CFG), ValueError, "num_validated"),
        (lambda c: pc.insert_after_validation(c, TOK, LEN + 4, TABLE * 0, cfg=CFG), ValueError, "block_table"),
        (lambda c: pc.insert_after_validation(c, TOK, LEN + 4, TABLE * 64, cfg=CFG), ValueError, "block_table"),
        (lambda c: pc.insert_after_validation(c, TOK, LEN, TABLE[:, :2], cfg=CFG), ValueError, "block_table"),
        (lambda c: pc.insert_after_validation(c, TOK, LEN > 0, TABLE, cfg=CFG), TypeError, "num_validated"),
        (lambda c: pc.remove(c, jnp.zeros((2, 2), i32), cfg=CFG), ValueError, "block_ids"),
        (lambda c: pc.remove(c, jnp.asarray([64], i32), cfg=CFG), ValueError, "block_ids"),
        (lambda c: pc.remove(c, jnp.asarray([1.0]), cfg=CFG), TypeError, "block_ids"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call(pc.init(CFG))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(capacity=10, ways=4), ValueError, "capacity"),
        (dict(capacity=8, ways=0), ValueError, "ways"),
        (dict(capacity=8, hash_bits=33), ValueError, "hash_bits"),
        (dict(capacity=8.0), TypeError, "capacity"),
    ],
)
def test_config_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        pc.PrefixCacheConfig(num_blocks=8, block_size=2, max_blocks_per_seq=4, **kwargs)


def test_a_forced_collision_is_refused_at_insert_and_never_a_hit():
    """Two different first blocks with equal weak keys: the second is refused at insert, and looking it up
    finds the first one's entry under its key but must not return it (the stored tokens differ)."""
    blocks = np.asarray([[a, b] for a in range(8) for b in range(8)], np.int32)
    keys = np.asarray(pc.chain_keys(jnp.asarray(blocks)[:, None, :], WEAK.hash_bits))[:, 0]
    i, j = next((i, j) for i in range(64) for j in range(i + 1, 64) if (keys[i] == keys[j]).all())
    rows = [blocks[i].tolist() + [5] * (L - S), blocks[j].tolist() + [5] * (L - S)] * 2
    table = np.arange(1, B * M + 1, dtype=np.int32).reshape(B, M)
    cache, res = pc.insert_after_validation(pc.init(WEAK), jnp.asarray(rows, i32), jnp.asarray([L, L, 0, 0], i32),
                                            jnp.asarray(table), cfg=WEAK)
    assert int(res.collisions) >= 1 and int(res.block_ids[0, 0]) == 1 and int(res.block_ids[1, 0]) == 0
    out = pc.lookup(cache, jnp.asarray(rows, i32), jnp.asarray([L] * B, i32), 0, cfg=WEAK)
    assert int(out.num_matched[0]) >= 1 and int(out.block_ids[0, 0]) == 1
    assert int(out.num_matched[1]) == 0, "the colliding block must not hit the other block's entry"


def test_runs_inside_jit_and_vmaps_over_the_ratio_knob():
    import jax

    rows = jnp.asarray([list(range(L))] * B, i32)
    table = jnp.asarray(np.arange(1, B * M + 1, dtype=np.int32).reshape(B, M))

    @jax.jit
    def step(cache, ratio):
        cache, _ = pc.insert_after_validation(cache, rows, jnp.full((B,), L, i32), table, cfg=CFG)
        return pc.lookup(cache, rows, jnp.full((B,), L, i32), 10, cfg=CFG, max_spec_ratio=ratio).num_blocks

    got = jax.vmap(step, in_axes=(None, 0))(pc.init(CFG), jnp.asarray([0.0, 0.5, 1.0], jnp.float32))
    # matched = (L - 1) // S = 5; buffer = max(1, floor(ratio * 10) // 2) = 1, 2, 5.
    np.testing.assert_array_equal(got[:, 0], [4, 3, 0])


def test_tokens_shorter_than_a_block_hold_nothing_to_share():
    short = jnp.ones((B, S - 1), i32)
    cache, res = pc.insert_after_validation(pc.init(CFG), short, jnp.full((B,), S - 1, i32), TABLE, cfg=CFG)
    assert int(res.num_inserted.sum()) == 0
    out = pc.lookup(cache, short, jnp.full((B,), S - 1, i32), 3, cfg=CFG)
    assert int(out.num_blocks.sum()) == 0 and (np.asarray(out.block_ids) == NULL_BLOCK).all()


def test_a_salt_sees_only_its_own_entries_even_through_a_key_collision():
    """Cache salts (vLLM's cache_salt): a prefix indexed under one salt is no hit under another, nor unsalted,
    and a hit under its own. With 2-bit key lanes two salts whose first-block keys collide are found by search:
    tokens and parent then match too, and only the stored salt keeps the other tenant out (its insert is
    refused)."""
    row = [1, 0] * (L // 2)
    rows = jnp.asarray([row] * B, i32)
    blocks = rows[:1, : M * S].reshape(1, M, S)
    key = lambda salt: np.asarray(pc.chain_keys(blocks, WEAK.hash_bits, jnp.asarray([salt], i32)))[0]  # noqa: E731
    a = 3
    b = next(s for s in range(4, 400) if (key(s)[0] == key(a)[0]).all())  # the first block's key collides
    full, table = jnp.full((B,), L, i32), jnp.asarray(np.arange(1, B * M + 1, dtype=np.int32).reshape(B, M))
    for cfg in (CFG, WEAK):
        cache, res = pc.insert_after_validation(pc.init(cfg), rows, full.at[1:].set(0), table, cfg=cfg,
                                                salt=jnp.full((B,), a, i32))
        n = int(res.num_inserted[0])  # the weak table's 2-way buckets may drop a block or two
        assert n == M or (cfg is WEAK and n >= 2)
        got = pc.lookup(cache, rows, full, 0, cfg=cfg, salt=jnp.asarray([a, b, 0, a + 1], i32))
        np.testing.assert_array_equal(got.num_blocks, [min(n, M - 1), 0, 0, 0])
        assert testing.prefix_index_as_dict(cache, cfg, salted=True) == {
            (a, *row[: (j + 1) * S]): j + 1 for j in range(n)}
        with pytest.raises(AssertionError, match="salted"):
            testing.prefix_index_as_dict(cache, cfg)
    # Under the weak hash, the other salt's insert of the same tokens collides and is refused, never merged.
    cache, res = pc.insert_after_validation(cache, rows, full.at[1:].set(0), table + B * M, cfg=WEAK,
                                            salt=jnp.full((B,), b, i32))
    assert int(res.num_inserted.sum()) == 0 and int(res.collisions) == 1
    with pytest.raises(ValueError, match="salt"):
        pc.lookup(cache, rows, full, 0, cfg=WEAK, salt=jnp.zeros((B + 1,), i32))
