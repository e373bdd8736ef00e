"""`scheduler.fork_unchecked` (n > 1 outputs of one prompt) against a plain-Python statement of what it does.

Rows are driven by the lockstep harness until some have committed their prompt and sampled a token; then random
subsets of them fork into empty slots. Checked: each child's row is its parent's committed tokens plus its own
first token, RUNNING, with the parent's prompt length, budget, priority and arrival; it holds the parent's
committed blocks by reference (ref count + 1 per child, the allocator's invariants intact); an unplaced request
(padding, no empty slot, an unsettled parent) changes nothing; aborting everything afterwards leaks no block.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as hs

from skvs_jax import policies, testing
from skvs_jax import scheduler as sc
from skvs_jax.config import CacheConfig
from skvs_jax.testing.scheduler_harness import Harness

CACHE = CacheConfig(num_blocks=40, block_size=4, max_seqs=6, max_blocks_per_seq=8)
CFG = sc.SchedulerConfig(cache=CACHE, policy=policies.skvs(4), max_running=6, token_budget=32, prefix_capacity=256)


@settings(max_examples=6)
@given(seed=hs.integers(0, 2**16), lens=hs.lists(hs.integers(1, 11), min_size=1, max_size=3))
def test_fork_shares_the_parents_committed_blocks(seed, lens):
    cfg = CFG
    rng = np.random.default_rng(seed)
    h = Harness(cfg)
    h.add([rng.integers(0, 3, n).tolist() for n in lens], [6] * len(lens))
    for i in range(6):  # until every prompt sampled its first token
        h.step(np.random.default_rng(i))
        seqs = h.st.seqs
        if np.all(np.asarray(seqs.num_tokens)[: len(lens)] > np.asarray(seqs.prompt_len)[: len(lens)]):
            break
    before = h.st
    b = CACHE.max_seqs
    parents = rng.integers(-1, len(lens), size=b).astype(np.int32)  # -1: padding
    first = rng.integers(0, 3, size=b).astype(np.int32)
    ids = (100 + np.arange(b)).astype(np.int32)
    st, slots = sc.fork_unchecked(before, parents, ids, first, cfg=cfg)
    slots = np.asarray(slots)

    old, new = before.seqs, st.seqs
    alloc_old, alloc_new = before.kv.alloc, st.kv.alloc
    empty = [s for s in range(b) if int(old.status[s]) == sc.EMPTY]
    placed = 0
    ref = np.asarray(alloc_old.blocks.ref_count).copy()
    for i, p in enumerate(parents):
        committed = int(alloc_old.seqs.num_committed[p]) if p >= 0 else 0
        settled = p >= 0 and committed == int(alloc_old.seqs.num_allocated[p]) and committed > 0
        if p < 0 or placed >= len(empty):
            assert slots[i] == -1, i
            continue
        c = empty[placed]  # the empty slots go to the requests in order; one whose fork fails leaves its slot empty
        placed += 1
        if not settled:
            assert slots[i] == -1, i
            continue
        assert slots[i] == c
        want = np.asarray(old.tokens[p])[:committed].tolist() + [int(first[i])]
        assert np.asarray(new.tokens[c])[: committed + 1].tolist() == want
        assert not np.asarray(new.tokens[c])[committed + 1:].any()
        assert int(new.status[c]) == sc.RUNNING and int(new.num_tokens[c]) == committed + 1
        assert int(new.request_id[c]) == ids[i]
        for field in ("prompt_len", "max_new_tokens", "priority", "arrival"):
            assert int(getattr(new, field)[c]) == int(getattr(old, field)[p]), field
        nb = -(-committed // CACHE.block_size)
        table = np.asarray(alloc_new.seqs.block_table[c])
        assert table[:nb].tolist() == np.asarray(alloc_old.seqs.block_table[p])[:nb].tolist()
        assert int(alloc_new.seqs.num_committed[c]) == committed
        ref[table[:nb]] += 1
    assert np.asarray(alloc_new.blocks.ref_count).tolist() == ref.tolist()
    testing.check_invariants(alloc_new, CACHE, cfg.kv.spec)
    untouched = [s for s in range(b) if s not in slots]
    assert np.asarray(new.status)[untouched].tolist() == np.asarray(old.status)[untouched].tolist()
    done = sc.abort_unchecked(st, np.ones(b, bool), cfg=cfg)
    testing.assert_no_leak(done.kv.alloc, CACHE)
