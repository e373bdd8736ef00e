"""update_block_states and invalidate_drafts: one shared contract per op, run by every implementation, against
plain-Python oracles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pallas_kernels as pk

FEW = settings(max_examples=10 if settings.default.max_examples <= 30 else settings.default.max_examples,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors])


def test_constants_match_the_allocator_contract():
    assert (pk.FREE, pk.RESERVED, pk.SPECULATIVE, pk.VALIDATED, pk.STALE) == (0, 1, 2, 3, 4)
    assert pk.BLOCK_STATE_DTYPE == jnp.int8


def states_oracle(states, gens, ids, accept, valid, generation):
    """Plain Python: any accepting entry wins; count distinct blocks turned STALE."""
    states, gens = list(states), list(gens)
    decision = {}
    for blk, a, ok in zip(ids.ravel(), accept.ravel(), valid.ravel()):
        if ok:
            decision[int(blk)] = decision.get(int(blk), False) or bool(a)
    for blk, a in decision.items():
        states[blk] = pk.VALIDATED if a else pk.STALE
        if not a:
            gens[blk] = generation
    return np.array(states, np.int8), np.array(gens, np.int32), sum(not a for a in decision.values())


class BlockStatesContract:
    impl: str
    interpret: bool | None = None

    @FEW
    @given(seed=st.integers(0, 2**31 - 1), N=st.integers(1, 300), B=st.integers(1, 5), W=st.integers(1, 6),
           distinct=st.booleans())
    def test_update_matches_oracle(self, seed, N, B, W, distinct):
        rng = np.random.default_rng(seed)
        states = rng.integers(0, 5, N).astype(np.int8)
        gens = rng.integers(0, 100, N).astype(np.int32)
        if distinct and B * W <= N:
            ids = rng.choice(N, B * W, replace=False).reshape(B, W).astype(np.int32)
        else:
            ids = rng.integers(0, N, (B, W)).astype(np.int32)
        accept, valid = rng.random((B, W)) < 0.5, rng.random((B, W)) < 0.8
        got = pk.update_block_states(jnp.asarray(states), jnp.asarray(gens), jnp.asarray(ids), jnp.asarray(accept),
                                     jnp.asarray(valid), jnp.int32(123), impl=self.impl, interpret=self.interpret)
        want = states_oracle(states, gens, ids, accept, valid, 123)
        assert got[0].dtype == jnp.int8 and got[1].dtype == jnp.int32 and got[2].dtype == jnp.int32
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), w)
        if distinct and B * W <= N:
            assert int(got[2]) == int(np.sum(valid & ~accept))  # distinct ids: one stale block per rejected entry
        # The states-only form the allocator's commit uses off a GPU: the same states, repeated ids included.
        np.testing.assert_array_equal(np.asarray(pk.update_states_by_scatter(
            jnp.asarray(states), jnp.asarray(ids), jnp.asarray(accept), jnp.asarray(valid))), want[0])

    def test_update_under_jit_with_traced_generation(self):
        fn = jax.jit(lambda s, g, gen: pk.update_block_states(
            s, g, jnp.asarray([[1, 2]], jnp.int32), jnp.asarray([[True, False]]), jnp.asarray([[True, True]]),
            gen, impl=self.impl, interpret=self.interpret))
        s, g, n = fn(jnp.full((4,), pk.SPECULATIVE, jnp.int8), jnp.zeros((4,), jnp.int32), jnp.int32(9))
        np.testing.assert_array_equal(np.asarray(s), [pk.SPECULATIVE, pk.VALIDATED, pk.STALE, pk.SPECULATIVE])
        np.testing.assert_array_equal(np.asarray(g), [0, 0, 9, 0])
        assert int(n) == 1

    @FEW
    @given(seed=st.integers(0, 2**31 - 1), S=st.sampled_from([8, 16]), K=st.integers(1, 6),
           quantised=st.booleans())
    def test_invalidate_matches_oracle(self, seed, S, K, quantised):
        rng = np.random.default_rng(seed)
        B, M, H, D = 3, 3, 2, 16
        N = 1 + B * M
        tables = (1 + rng.permutation(B * M)).reshape(B, M).astype(np.int32)
        start = rng.integers(-2, M * S, B).astype(np.int32)  # some drafts run off either end of the table
        accept = rng.random((B, K)) < 0.5
        lens = rng.integers(0, K + 1, B).astype(np.int32)
        k = rng.standard_normal((N, S, H, D)).astype(np.float32) + 5.0  # nowhere zero before the scrub
        v = rng.standard_normal((N, S, H, D)).astype(np.float32) + 5.0
        if quantised:
            (kp, ks), (vp, vs) = pk.quantize_kv(jnp.asarray(k), jnp.int8), pk.quantize_kv(jnp.asarray(v), jnp.int8)
        else:
            kp, vp, ks, vs = jnp.asarray(k), jnp.asarray(v), None, None
        out = pk.invalidate_drafts(kp, vp, jnp.asarray(tables), jnp.asarray(start), jnp.asarray(accept),
                                   draft_lens=jnp.asarray(lens), k_scales=ks, v_scales=vs, impl=self.impl,
                                   interpret=self.interpret)
        killed = np.zeros((N, S), bool)
        for b in range(B):
            for j in range(lens[b]):
                pos = start[b] + j
                if not accept[b, j] and 0 <= pos < M * S:
                    killed[tables[b, pos // S], pos % S] = True
        bufs = [kp, vp] + ([ks, vs] if quantised else [])
        assert len(out) == len(bufs)
        for got, before in zip(out, bufs):
            got, before = np.asarray(got.astype(jnp.float32)), np.asarray(before.astype(jnp.float32))
            assert np.all(got[killed] == 0)
            np.testing.assert_array_equal(got[~killed], before[~killed])

    def test_traced_out_of_range_table_entries_zero_nothing(self):
        """Under jit the range checks are skipped: a rejected draft whose table entry is -1 or >= N must be
        skipped, not written to block N - 1 (the reference wrapped -1 there; the kernel clamped N there)."""
        N, S = 4, 4
        k = jnp.ones((N, S, 1, 8), jnp.float32)
        fn = jax.jit(lambda t: pk.invalidate_drafts(k, k, t, jnp.asarray([0], jnp.int32), jnp.asarray([[False]]),
                                                    impl=self.impl, interpret=self.interpret))
        for entry in (-1, N, N + 1):
            k2, _ = fn(jnp.asarray([[entry, 1]], jnp.int32))
            assert float(jnp.min(k2)) == 1.0, entry
        k2, _ = fn(jnp.asarray([[2, 1]], jnp.int32))  # in range: the slot is zeroed
        assert float(jnp.abs(k2[2, 0]).sum()) == 0.0 and float(jnp.min(k2[3])) == 1.0

    def test_empty_batches_return_the_pages_unchanged(self):  # the Pallas grid crashed on B = 0 or M = 0
        k = jnp.ones((3, 4, 1, 8), jnp.float32)
        for b, m in ((0, 2), (1, 0)):
            out = pk.invalidate_drafts(k, k, jnp.zeros((b, m), jnp.int32), jnp.zeros((b,), jnp.int32),
                                       jnp.zeros((b, 2), bool), impl=self.impl, interpret=self.interpret)
            np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(k))
        s, g, n = pk.update_block_states(jnp.zeros((4,), jnp.int8), jnp.zeros((4,), jnp.int32),
                                         jnp.zeros((0, 2), jnp.int32), jnp.zeros((0, 2), bool),
                                         jnp.zeros((0, 2), bool), 1, impl=self.impl, interpret=self.interpret)
        assert int(n) == 0 and not np.asarray(s).any()

    def test_rolled_back_sequence_attends_only_to_accepted_tokens(self):
        """After a rejection the caller shrinks context_len; attention then equals attention over a cache that
        never held the rejected drafts, and the scrubbed slots hold zeros."""
        rng = np.random.default_rng(3)
        N, S, H, D = 4, 8, 1, 16
        k = jnp.asarray(rng.standard_normal((N, S, H, D)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((N, S, H, D)), jnp.float32)
        tables = jnp.asarray([[2, 1]], jnp.int32)
        accept = jnp.asarray([[True, True, False, False]])  # drafts at positions 6..9; 8 and 9 rejected
        k2, v2 = pk.invalidate_drafts(k, v, tables, jnp.asarray([6], jnp.int32), accept, impl=self.impl,
                                      interpret=self.interpret)
        assert float(jnp.abs(k2[1, 0:2]).sum()) == 0.0 and float(jnp.abs(v2[1, 0:2]).sum()) == 0.0
        q = jnp.asarray(rng.standard_normal((1, 1, 2, D)), jnp.float32)
        ctx = jnp.asarray([8], jnp.int32)
        np.testing.assert_array_equal(np.asarray(pk.paged_attention(q, k2, v2, tables, ctx, impl="reference")),
                                      np.asarray(pk.paged_attention(q, k, v, tables, ctx, impl="reference")))


class TestReference(BlockStatesContract):
    impl = "reference"


class TestPallasInterpret(BlockStatesContract):
    impl = "pallas"
    interpret = True


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Pallas kernels need a GPU")
class TestPallasCompiled(BlockStatesContract):
    impl = "pallas"
    interpret = False


@pytest.mark.parametrize("kw, error, match", [
    (dict(states=jnp.zeros((4,), jnp.int32)), TypeError, "states must have dtype"),
    (dict(generations=jnp.zeros((5,), jnp.int32)), ValueError, "generations must have shape"),
    (dict(accept_mask=jnp.zeros((1, 3), bool)), ValueError, "accept_mask must have shape"),
    (dict(valid=jnp.ones((1, 2), jnp.int32)), TypeError, "valid must have dtype"),
    (dict(block_ids=jnp.asarray([[0, 4]], jnp.int32)), ValueError, "block_ids of valid entries must lie"),
    (dict(generation=1.5), TypeError, "generation must be an integer scalar"),
    (dict(generation=np.int64(2**40)), ValueError, "generation must fit in int32"),  # was stored as 0
])
def test_update_bad_input_names_the_argument(kw, error, match):
    args = dict(states=jnp.zeros((4,), jnp.int8), generations=jnp.zeros((4,), jnp.int32),
                block_ids=jnp.asarray([[0, 1]], jnp.int32), accept_mask=jnp.ones((1, 2), bool),
                valid=jnp.ones((1, 2), bool), generation=1)
    args.update(kw)
    with pytest.raises(error, match=match):
        pk.update_block_states(**args)


@pytest.mark.parametrize("kw, error, match", [
    (dict(block_tables=jnp.zeros((2, 2), jnp.int32)), ValueError, "block_tables must have shape"),
    (dict(block_tables=jnp.full((1, 2), 3, jnp.int32)), ValueError, "block_tables entries must lie"),
    (dict(draft_start=jnp.zeros((1,), jnp.float32)), TypeError, "draft_start must have dtype"),
    (dict(accept_mask=jnp.ones((1, 2), jnp.int32)), TypeError, "accept_mask must have dtype"),
    (dict(draft_lens=jnp.zeros((2,), jnp.int32)), ValueError, "draft_lens must have shape"),
    (dict(k_pages=jnp.zeros((3, 8, 1, 0)), v_pages=jnp.zeros((3, 8, 1, 0))), ValueError, "D = 0"),
])
def test_invalidate_bad_input_names_the_argument(kw, error, match):
    args = dict(k_pages=jnp.zeros((3, 8, 1, 16)), v_pages=jnp.zeros((3, 8, 1, 16)),
                block_tables=jnp.zeros((1, 2), jnp.int32), draft_start=jnp.zeros((1,), jnp.int32),
                accept_mask=jnp.ones((1, 2), bool))
    args.update(kw)
    with pytest.raises(error, match=match):
        pk.invalidate_drafts(**args)
