"""The JAX allocator against the plain-Python oracle, its invariants, and its boundary checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from skvs_jax import testing
from skvs_jax.arrays import take_each
from skvs_jax.config import NULL_BLOCK, CacheConfig, SpecConfig
from skvs_jax.kv import allocator
from skvs_jax.kv.allocator import FREE, RESERVED, SPECULATIVE, STALE, VALIDATED
from skvs_jax.testing.oracle import OracleAllocator

i32 = jnp.int32
CFG = CacheConfig(num_blocks=16, block_size=4, max_seqs=3, max_blocks_per_seq=5)
SPEC = SpecConfig(draft_len=4, generation_threshold=2)


def vec(*xs):
    return jnp.asarray(xs, i32)


# --------------------------------------------------------------------------------------- stateful


class AllocatorMachine(RuleBasedStateMachine):
    """Random interleavings of every transition, applied to the JAX allocator and the oracle in lockstep."""

    @initialize(cfg=testing.cache_configs(), spec=testing.spec_configs())
    def setup(self, cfg, spec):
        self.cfg, self.spec = cfg, spec
        self.st, self.oracle = allocator.init(cfg), OracleAllocator(cfg, spec)
        self.step = 0

    def _do(self, op):
        self.step += 1
        self.st = testing.apply(op, self.st, self.oracle, self.cfg, self.spec, generation=self.step)

    @rule(data=hs.data())
    def operation(self, data):
        self._do(data.draw(testing.operations(self.cfg, self.spec)))

    @rule(data=hs.data())
    def engine_step(self, data):
        """The order an engine uses: decode slot, drafts, commit with a random accept count, reclaim."""
        b, k = self.cfg.max_seqs, self.spec.draft_len
        order = tuple(data.draw(hs.permutations(range(b))))
        self._do(testing.Allocate((1,) * b, order))
        self._do(testing.AllocateSpeculative((k,) * b, order))
        self._do(testing.Commit(tuple(data.draw(hs.lists(hs.integers(0, k + 1), min_size=b, max_size=b)))))
        self._do(testing.Reclaim(self.spec.generation_threshold))

    @rule(data=hs.data())
    def engine_step_one_pass(self, data):
        """The scheduler's order: a decode slot and drafts in one `allocate_step`, commit, reclaim."""
        b, k = self.cfg.max_seqs, self.spec.draft_len
        order = tuple(data.draw(hs.permutations(range(b))))
        window = data.draw(hs.sampled_from([None, 2]))
        self._do(testing.AllocateStep((1,) * b, (k,) * b, order, window))
        self._do(testing.Commit(tuple(data.draw(hs.lists(hs.integers(0, k + 1), min_size=b, max_size=b)))))
        self._do(testing.Reclaim(self.spec.generation_threshold))

    @rule(data=hs.data())
    def fork_then_step(self, data):
        """Every holder of a shared partial block appends and drafts in one `allocate_step`: the copies are made,
        the original is released once, after the drafts popped."""
        b, k = self.cfg.max_seqs, self.spec.draft_len
        parent = data.draw(hs.integers(0, b - 1))
        parent_of = tuple(parent if slot != parent else -1 for slot in range(b))
        self._do(testing.Free(tuple(slot != parent for slot in range(b))))
        self._do(testing.Fork(parent_of))
        self._do(testing.AllocateStep((1,) * b, (k,) * b, tuple(range(b)), data.draw(hs.sampled_from([None, 2]))))

    @rule(data=hs.data())
    def fork_then_both_append(self, data):
        """Parent and child write into their shared partial block in the same call: both must copy it, and
        the original is released exactly once."""
        b = self.cfg.max_seqs
        parent = data.draw(hs.integers(0, b - 1))
        parent_of = tuple(parent if slot != parent else -1 for slot in range(b))
        self._do(testing.Free(tuple(slot != parent for slot in range(b))))
        self._do(testing.Fork(parent_of))
        self._do(testing.Allocate((1,) * b, tuple(range(b))))

    @precondition(lambda self: hasattr(self, "st"))
    @invariant()
    def agrees_and_holds(self):
        testing.check_invariants(self.st, self.cfg, self.spec)
        testing.assert_matches_oracle(self.st, self.oracle)

    def teardown(self):
        if hasattr(self, "st"):
            self._do(testing.Free((True,) * self.cfg.max_seqs))
            testing.assert_matches_oracle(self.st, self.oracle)
            testing.assert_no_leak(self.st, self.cfg)


TestAllocatorMachine = AllocatorMachine.TestCase


@given(cfg=testing.cache_configs(), spec=testing.spec_configs(), data=hs.data())
def test_random_sequences_match_oracle_and_do_not_leak(cfg, spec, data):
    ops = data.draw(testing.operation_sequences(cfg, spec, max_size=25))
    testing.run_sequence(ops, cfg, spec)


@settings(max_examples=12)  # each (config, window) pair compiles its own programs
@given(
    cfg=hs.just(testing.SMALL_CONFIGS[0]),
    spec=hs.sampled_from(testing.SPEC_CONFIGS[:2]),
    window=hs.sampled_from([1, 2]),
    data=hs.data(),
)
def test_window_never_changes_a_granted_result(cfg, spec, window, data):
    """A narrow window only refuses (flags) what does not fit; whatever it grants equals the full program's."""
    st, oracle = allocator.init(cfg), OracleAllocator(cfg, spec)
    for step, op in enumerate(data.draw(testing.operation_sequences(cfg, spec, max_size=12))):
        st = testing.apply(op, st, oracle, cfg, spec, generation=step)
    b = cfg.max_seqs
    accept = jnp.asarray(data.draw(hs.lists(hs.integers(0, 3), min_size=b, max_size=b)), i32)
    accept = jnp.minimum(accept, st.seqs.num_allocated - st.seqs.num_committed)
    narrow_st, narrow = allocator.commit(st, accept, cfg=cfg, spec=spec, window=window)
    fits = np.asarray(st.seqs.num_blocks - st.seqs.num_committed // cfg.block_size) <= window
    np.testing.assert_array_equal(narrow.ok, fits)
    if fits.all():  # then the narrow program is just a faster one
        wide_st, _ = allocator.commit(st, accept, cfg=cfg, spec=spec)
        jax.tree.map(np.testing.assert_array_equal, narrow_st, wide_st)
    for field in ("num_committed", "num_allocated", "num_drafts", "num_blocks", "block_table"):
        before, after = np.asarray(getattr(st.seqs, field)), np.asarray(getattr(narrow_st.seqs, field))
        np.testing.assert_array_equal(after[~fits], before[~fits], err_msg=f"flagged rows keep {field}")
    counts = jnp.asarray(data.draw(hs.lists(hs.integers(0, 9), min_size=b, max_size=b)), i32)
    st_w, res_w = allocator.allocate(narrow_st, counts, cfg=cfg, spec=spec)
    st_n, res_n = allocator.allocate(narrow_st, counts, cfg=cfg, spec=spec, window=window)
    alloc = np.asarray(narrow_st.seqs.num_allocated)
    wide = -(-(alloc + np.asarray(counts)) // cfg.block_size) - alloc // cfg.block_size > window
    assert not np.asarray(res_n.ok)[wide & (np.asarray(counts) > 0)].any()
    if not wide.any():
        jax.tree.map(np.testing.assert_array_equal, (st_w, res_w), (st_n, res_n))


@settings(max_examples=30)
@given(cfg=testing.cache_configs(), spec=testing.spec_configs(), window=hs.sampled_from([None, 1, 2]),
       data=hs.data())
def test_allocate_step_is_the_two_calls_when_drafts_ride_on_slots(cfg, spec, window, data):
    """`allocate_step` gives the state and results of `allocate` then `allocate_speculative` wherever its two
    rules change nothing: every row that drafts has a granted, nonzero slot request, and no slot copies a block
    (a copied block released between the two calls could be popped by the drafts)."""
    st, oracle = allocator.init(cfg), OracleAllocator(cfg, spec)
    for step, op in enumerate(data.draw(testing.operation_sequences(cfg, spec, max_size=12))):
        st = testing.apply(op, st, oracle, cfg, spec, generation=step)
    b = cfg.max_seqs
    tokens = np.asarray(data.draw(hs.lists(hs.integers(0, 2 * cfg.block_size), min_size=b, max_size=b)), np.int32)
    drafts = np.asarray(data.draw(hs.lists(hs.integers(0, spec.draft_len), min_size=b, max_size=b)), np.int32)
    order = jnp.asarray(data.draw(hs.permutations(range(b))), i32)
    gen = 7
    two, res = allocator.allocate(st, jnp.asarray(tokens), order, cfg=cfg, spec=spec)
    two, dres = allocator.allocate_speculative(two, jnp.asarray(drafts), gen, order, cfg=cfg, spec=spec, window=window)
    one, res1, dres1 = allocator.allocate_step(st, jnp.asarray(tokens), jnp.asarray(drafts), gen, order, cfg=cfg,
                                               spec=spec, window=window)
    rides = np.all((drafts == 0) | (np.asarray(res.ok) & (tokens > 0)))
    copies = np.any(np.asarray(res.cow_src) != NULL_BLOCK)
    if rides and not copies:
        jax.tree.map(np.testing.assert_array_equal, (two, res, dres), (one, res1, dres1))
    # Whatever happens, the slots' part is the same call's.
    np.testing.assert_array_equal(res1.ok, res.ok)
    np.testing.assert_array_equal(np.stack([res1.cow_src, res1.cow_dst]), np.stack([res.cow_src, res.cow_dst]))


def _split_and_single(st, counts, order, cfg, spec, window, skip):
    """(state, result) of the split allocation and of the one pass over the full table."""
    split = allocator.allocate_split_unchecked(st, counts, order, cfg=cfg, spec=spec, window=window, skip=skip)
    single = allocator.allocate_unchecked(st, counts, 0, order, cfg=cfg, spec=spec, window=None, speculative=False)
    return split, single


@settings(max_examples=12)  # each (config, window, skip) triple compiles its own programs
@given(
    cfg=hs.just(testing.SMALL_CONFIGS[0]),
    spec=hs.sampled_from(testing.SPEC_CONFIGS[:2]),
    window=hs.sampled_from([1, 2]),
    skip=hs.booleans(),
    data=hs.data(),
)
def test_split_allocation_is_the_one_pass_over_the_full_table(cfg, spec, window, skip, data):
    """`allocate_split_unchecked` (narrow rows in a window, then the wide ones) leaves the same state and result as
    one pass over [B, M]: the same grants, copies, block ids and stacks, whatever the mix of rows."""
    st, oracle = allocator.init(cfg), OracleAllocator(cfg, spec)
    for step, op in enumerate(data.draw(testing.operation_sequences(cfg, spec, max_size=12))):
        st = testing.apply(op, st, oracle, cfg, spec, generation=step)
    b = cfg.max_seqs
    counts = jnp.asarray(data.draw(hs.lists(hs.integers(0, 3 * cfg.block_size), min_size=b, max_size=b)), i32)
    order = jnp.asarray(data.draw(hs.permutations(range(b))), i32)
    split, single = _split_and_single(st, counts, order, cfg, spec, window, skip)
    jax.tree.map(np.testing.assert_array_equal, split, single)


@pytest.mark.parametrize("skip", [True, False])
def test_split_allocation_pops_past_a_copy_the_window_pass_released(skip):
    """Two children copy the partial block they share with nobody else, so it is released, in the same call where
    a wide row allocates: the one pass releases it after every pop, and so must the split one."""
    cfg = CacheConfig(num_blocks=24, block_size=4, max_seqs=4, max_blocks_per_seq=5)
    st, oracle = allocator.init(cfg), OracleAllocator(cfg, SPEC)
    for op in [
        testing.Allocate((6, 0, 0, 0), (0, 1, 2, 3)),
        testing.Commit((6, 0, 0, 0)),
        testing.Fork((-1, 0, 0, -1)),  # rows 1 and 2 share blocks 1 and 2 (2 of 4 tokens) with row 0
        testing.Free((True, False, False, False)),  # block 2 is now held by the two children alone
    ]:
        st = testing.apply(op, st, oracle, cfg, SPEC)
    counts, order = vec(0, 1, 1, 9), vec(1, 3, 2, 0)  # row 3 spans 3 columns: wide for a window of 1
    (st_s, res_s), single = _split_and_single(st, counts, order, cfg, SPEC, 1, skip)
    jax.tree.map(np.testing.assert_array_equal, (st_s, res_s), single)
    ok, pairs = oracle.allocate(np.asarray(counts).tolist(), np.asarray(order).tolist())
    assert all(ok) and int(st_s.counters.cow_copies) == 2 and int(st_s.blocks.state[2]) == FREE
    np.testing.assert_array_equal(np.stack([res_s.cow_src, res_s.cow_dst], 1), pairs)
    testing.assert_matches_oracle(st_s, oracle)
    testing.check_invariants(st_s, cfg, SPEC)


def _two_frees_and_deferred(st, first, then, cfg, spec, skip):
    """(state, routed) of two frees in a row and of `unref_unchecked(first)` then `free_unchecked(then, first=)`;
    and the state between the deferred pair's halves, with its `Unreffed`."""
    mid, _ = allocator.free_unchecked(st, first, cfg=cfg, spec=spec, skip=skip)
    two = allocator.free_unchecked(mid, then, cfg=cfg, spec=spec, skip=skip)
    half, pending = allocator.unref_unchecked(st, first, cfg=cfg, skip=skip)
    deferred = allocator.free_unchecked(half, then, cfg=cfg, spec=spec, skip=skip, first=pending)
    return two, deferred, (mid, half, pending)


def _check_deferred_free(st, first, then, cfg, spec, skip):
    two, deferred, (mid, half, pending) = _two_frees_and_deferred(st, first, then, cfg, spec, skip)
    jax.tree.map(np.testing.assert_array_equal, deferred[0], two[0])
    # The routed count differs by design (the deferred free routes both groups); the state is the judge.
    # Between the halves, what a scheduler reads is already final: ref counts, tables, what is evictable, and the
    # free count once the pending blocks are added.
    for name in ("ref_count", "cached"):
        np.testing.assert_array_equal(getattr(half.blocks, name), getattr(mid.blocks, name), err_msg=name)
    jax.tree.map(np.testing.assert_array_equal, half.seqs, mid.seqs)
    pool = spec.use_spec_pool
    free = lambda b: int(b.free_top) + (int(b.pool_top) if pool else 0)  # noqa: E731
    assert free(half.blocks) + int(pending.blocks) == free(mid.blocks)
    assert int(half.blocks.clock) == int(mid.blocks.clock)


@settings(max_examples=40)  # each (config, spec, skip) compiles its own programs
@given(cfg=hs.sampled_from(testing.SMALL_CONFIGS), spec=hs.sampled_from(testing.SPEC_CONFIGS), skip=hs.booleans(),
       data=hs.data())
def test_a_deferred_free_routes_as_two_frees_in_a_row(cfg, spec, skip, data):
    """`unref_unchecked(A)` then `free_unchecked(B, first=...)` leaves the state two frees (A, then B) leave: the
    same stacks in the same order, pool routing, states, LRU clocks; and between the halves the ref counts, tables
    and free count (with `Unreffed.blocks`) are those after the first free. Random allocator histories, with forks
    (blocks shared between the groups) and cached blocks."""
    st, oracle = allocator.init(cfg), OracleAllocator(cfg, spec)
    for step, op in enumerate(data.draw(testing.operation_sequences(cfg, spec, max_size=14))):
        st = testing.apply(op, st, oracle, cfg, spec, generation=step)
    b = cfg.max_seqs
    group = data.draw(hs.lists(hs.integers(0, 2), min_size=b, max_size=b))  # 0: kept, 1: first, 2: then
    first, then = (jnp.asarray([g == k for g in group]) for k in (1, 2))
    _check_deferred_free(st, first, then, cfg, spec, skip)


@pytest.mark.parametrize("skip", [True, False])
def test_a_block_both_groups_hold_is_released_by_the_later_free(skip):
    """A fork shares the parent's blocks with a child; the parent is freed first (deferred), the child later: the
    shared blocks reach 0 in the later free and are pushed, and last-used stamped, as its own; the first group's
    private block comes first."""
    cfg = CacheConfig(num_blocks=24, block_size=4, max_seqs=4, max_blocks_per_seq=5)
    st, oracle = allocator.init(cfg), OracleAllocator(cfg, SPEC)
    for op in [
        testing.Allocate((6, 6, 0, 0), (0, 1, 2, 3)),
        testing.Commit((6, 6, 0, 0)),
        testing.Fork((-1, -1, 0, -1)),  # row 2 shares rows 0's blocks 1 and 2
        testing.SetCached(0, True),  # full blocks cached: last-used stamped (block 1 by the later free), not pushed
        testing.SetCached(1, True),  # block 3, by the first free
    ]:
        st = testing.apply(op, st, oracle, cfg, SPEC)
    first, then = jnp.asarray([True, True, False, False]), jnp.asarray([False, False, True, False])
    _check_deferred_free(st, first, then, cfg, SPEC, skip)
    two, _, (_, half, pending) = _two_frees_and_deferred(st, first, then, cfg, SPEC, skip)
    assert int(pending.blocks) == 1  # row 1's uncached block 4; rows 0's are still row 2's
    assert int(half.blocks.ref_count[1]) == int(half.blocks.ref_count[2]) == 1
    last_used = np.asarray(two[0].blocks.last_used)
    assert last_used[3] == int(st.blocks.clock) and last_used[1] == int(st.blocks.clock) + 1


@settings(max_examples=25)
@given(cfg=hs.sampled_from(testing.SMALL_CONFIGS), spec=hs.sampled_from(testing.SPEC_CONFIGS), data=hs.data())
def test_pin_and_unpin_are_set_cached_with_every_flag_the_same(cfg, spec, data):
    """`pin_unchecked` and `unpin_unchecked` (what the KV manager calls every step) leave out passes, not
    effects: on any reachable state and any ids (repeats, padding, free and held blocks) they equal
    `set_cached_unchecked` with every flag True / False; `distinct=True` equals it on distinct ids, `flags_only=True`
    on ids of held blocks."""
    st, oracle = allocator.init(cfg), OracleAllocator(cfg, spec)
    for step, op in enumerate(data.draw(testing.operation_sequences(cfg, spec, max_size=12))):
        st = testing.apply(op, st, oracle, cfg, spec, generation=step)
    ids = jnp.asarray(data.draw(hs.lists(hs.integers(-1, cfg.num_blocks - 1), min_size=1, max_size=12)), i32)
    same = functools.partial(jax.tree.map, np.testing.assert_array_equal)
    same(allocator.pin_unchecked(st, ids), allocator.set_cached_unchecked(st, ids, jnp.ones(ids.shape, bool)))
    none = jnp.zeros(ids.shape, bool)
    same(allocator.unpin_unchecked(st, ids), allocator.set_cached_unchecked(st, ids, none))
    distinct = jnp.asarray(sorted(set(np.asarray(ids).tolist())), i32)
    same(allocator.unpin_unchecked(st, distinct, distinct=True),
         allocator.set_cached_unchecked(st, distinct, jnp.zeros(distinct.shape, bool)))
    held = jnp.where(st.blocks.ref_count[jnp.clip(ids, 0, cfg.num_blocks - 1)] > 0, ids, 0)  # ids of held blocks
    same(allocator.unpin_unchecked(st, held, flags_only=True), allocator.set_cached_unchecked(st, held, none))


# --------------------------------------------------------------------------------------- examples


def test_init_puts_every_usable_block_on_the_free_stack():
    st = allocator.init(CFG)
    testing.check_invariants(st, CFG, SPEC)
    assert int(st.blocks.free_top) == CFG.num_blocks - 1
    assert int(st.blocks.free_stack[st.blocks.free_top - 1]) == 1  # block 1 is handed out first


def test_a_budget_of_k_blocks_allocates_as_a_pool_of_k_plus_one():
    """`with_budget` (the simulator's memory sweeps, as data): the same block ids and refusals as a pool that
    really has k usable blocks; the blocks above k are never handed out."""
    big = CacheConfig(num_blocks=12, block_size=4, max_seqs=3, max_blocks_per_seq=5)
    small = CacheConfig(num_blocks=6, block_size=4, max_seqs=3, max_blocks_per_seq=5)
    budget = allocator.with_budget(allocator.init(big), jnp.asarray(small.usable_blocks, jnp.int32))
    got = allocator.allocate(budget, vec(13, 4, 8), vec(2, 0, 1), cfg=big, spec=SPEC)
    want = allocator.allocate(allocator.init(small), vec(13, 4, 8), vec(2, 0, 1), cfg=small, spec=SPEC)
    for _, res in (got, want):
        np.testing.assert_array_equal(res.ok, [False, False, True])
    np.testing.assert_array_equal(got[0].seqs.block_table, want[0].seqs.block_table)
    assert int(got[0].blocks.free_top) == int(want[0].blocks.free_top) == 3
    assert (np.asarray(got[0].seqs.block_table) <= small.usable_blocks).all()


def test_allocate_is_all_or_nothing_in_priority_order():
    cfg = CacheConfig(num_blocks=6, block_size=4, max_seqs=3, max_blocks_per_seq=5)  # 5 usable blocks
    st = allocator.init(cfg)
    # Slot 2 first (2 blocks), then slot 0 (4 blocks: does not fit), then slot 1 (1 block: not served either).
    st, res = allocator.allocate(st, vec(13, 4, 8), vec(2, 0, 1), cfg=cfg, spec=SPEC)
    np.testing.assert_array_equal(res.ok, [False, False, True])
    np.testing.assert_array_equal(st.seqs.num_blocks, [0, 0, 2])
    assert int(st.counters.alloc_failures) == 2
    np.testing.assert_array_equal(st.seqs.block_table[2, :2], [1, 2])


def test_request_that_needs_no_block_succeeds_after_a_failure():
    cfg = CacheConfig(num_blocks=3, block_size=4, max_seqs=2, max_blocks_per_seq=2)
    st = allocator.init(cfg)
    st, _ = allocator.allocate(st, vec(1, 0), cfg=cfg, spec=SPEC)
    st, _ = allocator.commit(st, vec(1, 0), cfg=cfg, spec=SPEC)
    st, res = allocator.allocate(st, vec(1, 8), vec(1, 0), cfg=cfg, spec=SPEC)  # slot 1 asks 2 blocks, 1 left
    np.testing.assert_array_equal(res.ok, [True, False])


def test_speculative_blocks_come_from_the_pool_first_and_rejected_ones_return_at_once():
    st = allocator.init(CFG)
    st, _ = allocator.allocate(st, vec(4, 0, 0), cfg=CFG, spec=SPEC)  # one full block
    st, _ = allocator.commit(st, vec(4, 0, 0), cfg=CFG, spec=SPEC)
    st, _ = allocator.allocate_speculative(st, vec(4, 0, 0), 1, cfg=CFG, spec=SPEC)
    spec_block = int(st.seqs.block_table[0, 1])
    assert int(st.blocks.state[spec_block]) == SPECULATIVE and int(st.blocks.generation[spec_block]) == 1
    st, res = allocator.commit(st, vec(0, 0, 0), cfg=CFG, spec=SPEC)  # all drafts rejected
    assert int(res.released) == 1 and int(st.blocks.state[spec_block]) == STALE
    assert int(st.blocks.pool_top) == 1 and int(st.counters.spec_blocks_wasted) == 1
    st, _ = allocator.allocate_speculative(st, vec(4, 0, 0), 2, cfg=CFG, spec=SPEC)
    assert int(st.seqs.block_table[0, 1]) == spec_block and int(st.counters.spec_pool_hits) == 1
    st, _ = allocator.commit(st, vec(2, 0, 0), cfg=CFG, spec=SPEC)  # two drafts accepted
    assert int(st.blocks.state[spec_block]) == VALIDATED and int(st.seqs.num_committed[0]) == 6


def test_lazy_release_keeps_rejected_blocks_until_the_sequence_ends():
    lazy = SpecConfig(draft_len=4, release="lazy", use_spec_pool=False)
    st = allocator.init(CFG)
    st, _ = allocator.allocate(st, vec(4, 0, 0), cfg=CFG, spec=lazy)
    st, _ = allocator.commit(st, vec(4, 0, 0), cfg=CFG, spec=lazy)
    st, _ = allocator.allocate_speculative(st, vec(4, 0, 0), 1, cfg=CFG, spec=lazy)
    st, res = allocator.commit(st, vec(0, 0, 0), cfg=CFG, spec=lazy)
    held = int(st.seqs.block_table[0, 1])
    assert int(res.released) == 0 and int(st.seqs.num_blocks[0]) == 2 and int(st.blocks.state[held]) == STALE
    st, _ = allocator.allocate(st, vec(1, 0, 0), cfg=CFG, spec=lazy)  # reuses the held block in place
    assert int(st.seqs.block_table[0, 1]) == held and int(st.blocks.state[held]) == RESERVED
    st, n = allocator.free(st, jnp.array([True, False, False]), cfg=CFG, spec=lazy)
    assert int(n) == 2
    testing.assert_no_leak(st, CFG)


def test_reclaim_returns_only_expired_pool_blocks():
    st = allocator.init(CFG)
    for gen, counts in [(1, vec(4, 4, 0)), (5, vec(0, 0, 4))]:  # the second takes one block from the pool
        st, _ = allocator.allocate_speculative(st, counts, gen, cfg=CFG, spec=SPEC)
        st, _ = allocator.commit(st, vec(0, 0, 0), cfg=CFG, spec=SPEC)
    assert int(st.blocks.pool_top) == 2 and int(st.counters.spec_pool_hits) == 1
    st, n = allocator.reclaim_expired(st, 6, 2)  # 6 - 1 > 2 expires; 6 - 5 does not
    assert int(n) == 1 and int(st.blocks.pool_top) == 1
    testing.check_invariants(st, CFG, SPEC)


def test_fork_shares_blocks_and_copy_on_write_protects_the_partial_block():
    st = allocator.init(CFG)
    st, _ = allocator.allocate(st, vec(6, 0, 0), cfg=CFG, spec=SPEC)  # blocks 1 (full) and 2 (2 of 4 tokens)
    st, _ = allocator.commit(st, vec(6, 0, 0), cfg=CFG, spec=SPEC)
    st, ok = allocator.fork(st, vec(-1, 0, -1), cfg=CFG)
    assert bool(ok[1])
    np.testing.assert_array_equal(st.seqs.block_table[1, :2], [1, 2])
    np.testing.assert_array_equal(st.blocks.ref_count[1:3], [2, 2])
    st, res = allocator.allocate(st, vec(0, 1, 0), cfg=CFG, spec=SPEC)  # child appends into shared block 2
    assert int(res.cow_src[1]) == 2 and int(res.cow_dst[1]) not in (0, 1, 2)
    assert int(st.blocks.ref_count[2]) == 1 and int(st.seqs.block_table[1, 1]) == int(res.cow_dst[1])
    st, res = allocator.allocate(st, vec(1, 0, 0), cfg=CFG, spec=SPEC)  # parent now owns block 2 alone
    assert int(res.cow_src[0]) == NULL_BLOCK
    testing.check_invariants(st, CFG, SPEC)


def test_parent_and_child_appending_together_both_copy_and_release_the_original_once():
    st, oracle = allocator.init(CFG), OracleAllocator(CFG, SPEC)
    for op in [
        testing.Allocate((6, 0, 0), (0, 1, 2)),
        testing.Commit((6, 0, 0)),
        testing.Fork((-1, 0, 0)),  # two children share blocks 1 and 2 (2 of 4 tokens) with the parent
        testing.Allocate((1, 1, 1), (2, 0, 1)),
    ]:
        st = testing.apply(op, st, oracle, CFG, SPEC)
        testing.check_invariants(st, CFG, SPEC)
        testing.assert_matches_oracle(st, oracle)
    assert int(st.counters.cow_copies) == 3 and int(st.blocks.state[2]) == FREE
    assert int(st.blocks.free_stack[st.blocks.free_top - 1]) == 2


def test_cached_blocks_become_evictable_and_are_evicted_lru():
    st = allocator.init(CFG)
    st, _ = allocator.allocate(st, vec(8, 4, 0), cfg=CFG, spec=SPEC)
    st, _ = allocator.commit(st, vec(8, 4, 0), cfg=CFG, spec=SPEC)
    st = allocator.set_cached(st, vec(1, 2, 3), jnp.array([True, True, True]))
    st, n = allocator.free(st, jnp.array([False, True, False]), cfg=CFG, spec=SPEC)  # block 3 first
    st, n = allocator.free(st, jnp.array([True, False, False]), cfg=CFG, spec=SPEC)
    assert int(n) == 2 and int(st.blocks.free_top) == CFG.num_blocks - 1 - 3
    # A prefix hit revives a cached block without copying.
    ids = jnp.zeros((3, 5), i32).at[2, 0].set(1)
    st, ok = allocator.share(st, ids, vec(0, 0, 4), cfg=CFG)
    assert bool(ok[2]) and int(st.blocks.ref_count[1]) == 1
    st, evicted = allocator.evict_lru(st, 2, max_evict=4)
    np.testing.assert_array_equal(evicted, [3, 2, 0, 0])  # block 3 was released first; block 1 is in use
    testing.check_invariants(st, CFG, SPEC)


def test_appending_inside_a_cached_block_copies_it_first():
    """A share may end inside a block (here 3 of a cached block's 4 tokens, ref 0 -> 1); the next token must go
    to a copy, never into the block the prefix cache pins (its index entry promises the old content)."""
    st, oracle = allocator.init(CFG), OracleAllocator(CFG, SPEC)
    for op in [testing.Allocate((4, 0, 0), (0, 1, 2)), testing.Commit((4, 0, 0)), testing.SetCached(0, True),
               testing.Free((True, False, False))]:
        st = testing.apply(op, st, oracle, CFG, SPEC)
    cached = 1
    ids = np.zeros((3, 5), np.int32)
    ids[1, 0] = cached
    st, ok = allocator.share(st, jnp.asarray(ids), vec(0, 3, 0), cfg=CFG)
    assert np.asarray(ok).tolist() == oracle.share(ids, [0, 3, 0]) == [True] * 3
    assert bool(st.blocks.cached[cached]) and int(st.blocks.ref_count[cached]) == 1
    st = testing.apply(testing.Allocate((0, 1, 0), (0, 1, 2)), st, oracle, CFG, SPEC)  # also checks the oracle
    assert int(st.counters.cow_copies) == 1 and int(st.seqs.block_table[1, 0]) != cached
    assert bool(st.blocks.cached[cached]) and int(st.blocks.ref_count[cached]) == 0  # evictable, unchanged
    testing.check_invariants(st, CFG, SPEC)
    testing.assert_matches_oracle(st, oracle)


def test_evict_lru_pads_when_max_evict_exceeds_the_pool():
    st = allocator.init(CFG)
    st, _ = allocator.allocate(st, vec(8, 0, 0), cfg=CFG, spec=SPEC)
    st, _ = allocator.commit(st, vec(8, 0, 0), cfg=CFG, spec=SPEC)
    st = allocator.set_cached(st, vec(1, 2), jnp.array([True, True]))
    st, _ = allocator.free(st, jnp.array([True, False, False]), cfg=CFG, spec=SPEC)
    st, evicted = allocator.evict_lru(st, 3, max_evict=CFG.num_blocks + 4)  # raised a shape error
    assert evicted.shape == (CFG.num_blocks + 4,) and sorted(np.asarray(evicted)[:2].tolist()) == [1, 2]
    assert (np.asarray(evicted)[2:] == NULL_BLOCK).all()
    testing.check_invariants(st, CFG, SPEC)


def test_traced_bad_values_become_flags_not_exceptions():
    @jax.jit
    def step(st, counts, accepted):
        st, res = allocator.allocate(st, counts, cfg=CFG, spec=SPEC)
        st, com = allocator.commit(st, accepted, cfg=CFG, spec=SPEC)
        return st, res.ok, com.ok

    st, ok, com_ok = step(allocator.init(CFG), vec(-1, 3, 10_000), vec(0, 5, 0))
    np.testing.assert_array_equal(ok, [False, True, False])
    np.testing.assert_array_equal(com_ok, [True, False, True])  # 5 > 3 pending: clipped and flagged
    assert int(st.seqs.num_committed[1]) == 3 and int(st.counters.alloc_failures) == 2

    # A count that wraps int32 when added to the row's length (3 + 2^31 - 3) is refused, not granted.
    st, ok, _ = step(st, vec(0, 2**31 - 3, 0), vec(0, 0, 0))
    np.testing.assert_array_equal(ok, [True, False, True])  # a zero count asks for nothing and is granted
    assert int(st.seqs.num_allocated[1]) == 3
    testing.check_invariants(st, CFG, SPEC)
    spec_step = jax.jit(lambda st, d: allocator.allocate_speculative(st, d, 0, cfg=CFG, spec=SPEC))
    _, res = spec_step(st, vec(0, 2**31 - 1, 0))
    assert not bool(res.ok[1])


def test_a_traced_non_permutation_order_refuses_every_request():
    cfg = CacheConfig(num_blocks=9, block_size=4, max_seqs=3, max_blocks_per_seq=5)  # 8 usable blocks
    step = jax.jit(lambda st, counts, order: allocator.allocate(st, counts, order, cfg=cfg, spec=SPEC))
    for order in (vec(0, 7, 1), vec(0, 0, 1), vec(-1, 1, 2)):  # out of range, repeated, negative
        st, res = step(allocator.init(cfg), vec(12, 12, 12), order)
        np.testing.assert_array_equal(res.ok, [False, False, False])
        assert int(st.counters.alloc_failures) == 3
        testing.check_invariants(st, cfg, SPEC)
        assert int(st.blocks.free_top) == cfg.usable_blocks
    st, res = step(allocator.init(cfg), vec(12, 12, 12), vec(2, 0, 1))  # a permutation: served in its order
    np.testing.assert_array_equal(res.ok, [True, False, True])  # 3 + 3 blocks granted, 2 left for slot 1


def test_vmap_over_independent_pools():
    states = jax.vmap(lambda _: allocator.init(CFG))(jnp.arange(4))
    counts = jnp.asarray([[4, 0, 0], [8, 0, 0], [0, 4, 4], [60, 0, 0]], i32)
    states, res = jax.vmap(lambda s, c: allocator.allocate(s, c, cfg=CFG, spec=SPEC))(states, counts)
    np.testing.assert_array_equal(res.ok[:, 0], [True, True, True, False])
    np.testing.assert_array_equal(states.seqs.num_blocks.sum(axis=1), [1, 2, 2, 0])


# ---------------------------------------------------------------------------------- boundary errors


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda st: allocator.allocate(st, vec(-1, 0, 0), cfg=CFG), "num_tokens"),
        (lambda st: allocator.allocate(st, vec(1, 0), cfg=CFG), "num_tokens"),
        (lambda st: allocator.allocate(st, vec(1, 0, 0), vec(0, 0, 1), cfg=CFG), "order"),
        (lambda st: allocator.allocate_speculative(st, vec(5, 0, 0), 0, cfg=CFG, spec=SPEC), "num_drafts"),
        (lambda st: allocator.commit(st, vec(1, 0, 0), cfg=CFG), "num_accepted"),
        (lambda st: allocator.fork(st, vec(3, -1, -1), cfg=CFG), "parent"),
        (lambda st: allocator.share(st, jnp.full((3, 5), 99, i32), vec(4, 0, 0), cfg=CFG), "block_ids"),
        (lambda st: allocator.reclaim_expired(st, 3, -1), "threshold"),
        (lambda st: allocator.evict_lru(st, 5, max_evict=4), "num_blocks"),
        (lambda st: allocator.allocate(st, vec(1, 0, 0), cfg=CacheConfig(32, 4, 3, 5)), "st.blocks.state"),
        (lambda st: allocator.allocate(st, vec(1, 0, 0), cfg=CFG, window=-1), "window"),
        (lambda st: allocator.allocate_speculative(st, vec(1, 0, 0), 0, cfg=CFG, spec=SPEC, window=0), "window"),
        (lambda st: allocator.commit(st, vec(0, 0, 0), cfg=CFG, window=6), "window"),
        # Generations are step numbers: a negative one made reclaim's int32 age wrap.
        (lambda st: allocator.allocate_speculative(st, vec(1, 0, 0), -1, cfg=CFG, spec=SPEC), "generation"),
        (lambda st: allocator.allocate_speculative(st, vec(1, 0, 0), 2**31, cfg=CFG, spec=SPEC), "generation"),
        (lambda st: allocator.reclaim_expired(st, -1, 0), "current_generation"),
        (lambda st: allocator.reclaim_expired(st, 2**40, 0), "current_generation"),
        (lambda st: allocator.set_cached(st, vec(CFG.num_blocks), jnp.ones(1, bool)), "block_ids"),
    ],
)
def test_bad_values_raise_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call(allocator.init(CFG))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda st: allocator.allocate(st, jnp.zeros(3, jnp.float32), cfg=CFG), "num_tokens"),
        (lambda st: allocator.free(st, vec(1, 0, 0), cfg=CFG), "seq_mask"),
        (lambda st: allocator.allocate_speculative(st, vec(1, 0, 0), 1.5, cfg=CFG), "generation"),
        (lambda st: allocator.allocate(st, [1, 0, 0], cfg=CFG), "num_tokens"),
        (lambda st: allocator.allocate(st, vec(1, 0, 0), cfg=CFG, window=2.5), "window"),
        (lambda st: allocator.reclaim_expired("st", 3, 1), "st must be an AllocatorState"),
        (lambda st: allocator.set_cached(None, vec(1), jnp.ones(1, bool)), "st must be an AllocatorState"),
        (lambda st: allocator.evict_lru(None, 1, max_evict=4), "st must be an AllocatorState"),
    ],
)
def test_bad_types_raise_type_error_naming_the_argument(call, match):
    with pytest.raises(TypeError, match=match):
        call(allocator.init(CFG))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_blocks=1, block_size=4, max_seqs=1, max_blocks_per_seq=1), "num_blocks"),
        (dict(num_blocks=8, block_size=0, max_seqs=1, max_blocks_per_seq=1), "block_size"),
        (dict(num_blocks=8, block_size=4, max_seqs=1, max_blocks_per_seq=8), "max_blocks_per_seq"),
        (dict(num_blocks=8, block_size=4, max_seqs=-1, max_blocks_per_seq=2), "max_seqs"),
    ],
)
def test_cache_config_that_cannot_fit_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(**kwargs)


def test_spec_config_validation():
    with pytest.raises(ValueError, match="max_spec_ratio"):
        SpecConfig(max_spec_ratio=1.5)
    with pytest.raises(ValueError, match="release"):
        SpecConfig(release="eager")
    with pytest.raises(TypeError, match="draft_len"):
        SpecConfig(draft_len=2.0)
    assert hash(SpecConfig()) == hash(SpecConfig()) and hash(CFG) == hash(CacheConfig(16, 4, 3, 5))


def test_state_names_cover_every_state():
    assert [allocator.STATE_NAMES[s] for s in (FREE, RESERVED, SPECULATIVE, VALIDATED, STALE)] == [
        "FREE",
        "RESERVED",
        "SPECULATIVE",
        "VALIDATED",
        "STALE",
    ]


@settings(max_examples=6)  # the Pallas kernel runs interpreted, and each config compiles its own commit
@given(cfg=testing.cache_configs(), spec=testing.spec_configs(), data=hs.data())
def test_commit_through_the_pallas_block_state_kernel_matches_the_oracle(cfg, spec, data):
    """The commit's block-state transition under impl="pallas" (`pallas_kernels.update_block_states`, what the
    engine runs with impl="pallas") keeps every invariant and agrees with the oracle after every operation."""
    import dataclasses

    ops = data.draw(testing.operation_sequences(cfg, spec, max_size=16))
    ops = [dataclasses.replace(op, impl="pallas") if isinstance(op, testing.Commit) else op for op in ops]
    # Settle what the sequence leaves pending through the kernel too, so at least one commit runs it.
    ops.append(testing.Commit((cfg.block_size,) * cfg.max_seqs, impl="pallas"))
    testing.run_sequence(ops, cfg, spec)


@settings(max_examples=25)
@given(cfg=hs.sampled_from(testing.SMALL_CONFIGS), spec=hs.sampled_from(testing.SPEC_CONFIGS), data=hs.data())
def test_eviction_in_two_halves_is_evict_then_unpin_of_held_blocks(cfg, spec, data):
    """`evicted_ids` then `evict_ids_unchecked(unpin_held=)` (the KV manager's eviction, with the prefix index's
    removal between the two) equals `evict_unchecked` followed by `unpin_unchecked(flags_only=True)` of the held blocks:
    one scatter of the pins for both, the same state. Random allocator histories, any k, held ids with repeats and
    padding."""
    st, oracle = allocator.init(cfg), OracleAllocator(cfg, spec)
    for step, op in enumerate(data.draw(testing.operation_sequences(cfg, spec, max_size=14))):
        st = testing.apply(op, st, oracle, cfg, spec, generation=step)
    n = cfg.num_blocks
    held = [i for i in range(1, n) if int(st.blocks.ref_count[i]) > 0]
    # Pin some held blocks (the validated ones take it): those are the ones whose unpin shows.
    pins = data.draw(hs.lists(hs.sampled_from(held), max_size=n)) if held else []
    st = allocator.pin_unchecked(st, jnp.asarray(pins + [0], i32))
    pinned = [i for i in held if bool(st.blocks.cached[i])]
    ids = data.draw(hs.lists(hs.sampled_from(held + [0]), max_size=6)) if held else []
    ids = ids + pinned[:2]  # at least the pins that show, when there are any
    unpin = jnp.asarray(ids + [0] * (8 - len(ids)), i32)
    k = jnp.asarray(data.draw(hs.integers(0, n)), i32)
    order = allocator.lru_order(st.blocks)
    want, want_ids = allocator.evict_unchecked(st, order, k, max_evict=n)
    want = allocator.unpin_unchecked(want, unpin, flags_only=True)
    got_ids = allocator.evicted_ids(st.blocks, order, k, max_evict=n)
    got = allocator.evict_ids_unchecked(st, got_ids, unpin_held=unpin)
    np.testing.assert_array_equal(got_ids, want_ids)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    testing.check_invariants(got, cfg, spec)


@settings(max_examples=25)
@given(n=hs.integers(1, 40), shape=hs.lists(hs.integers(0, 5), max_size=2), seed=hs.integers(0, 2**16),
       kinds=hs.lists(hs.sampled_from(["int32", "int8", "bool"]), min_size=1, max_size=3))
def test_take_each_reads_every_array_at_the_index(n, shape, seed, kinds):
    """`arrays.take_each` (one gather of the int32 stack) equals indexing each array apart, dtypes kept."""
    rng = np.random.default_rng(seed)
    arrays = [jnp.asarray(rng.integers(-100, 100, n)).astype(k) if k != "bool" else jnp.asarray(rng.random(n) < 0.5)
              for k in kinds]
    index = jnp.asarray(rng.integers(0, n, tuple(shape)), i32)
    got = take_each(tuple(arrays), index)
    for a, g in zip(arrays, got, strict=True):
        assert g.dtype == a.dtype and g.shape == index.shape
        np.testing.assert_array_equal(g, a[index])
