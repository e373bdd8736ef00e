"""`skvs_jax.arrays`: the shared idioms against plain-Python oracles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from skvs_jax import arrays


def _leading(row) -> int:
    n = 0
    for x in row:
        if not x:
            break
        n += 1
    return n


@given(shape=st.lists(st.integers(0, 6), min_size=1, max_size=3), seed=st.integers(0, 2**31 - 1),
       p=st.sampled_from([0.0, 0.5, 0.9, 1.0]), data=st.data())
def test_count_leading_counts_the_trues_before_the_first_false(shape, seed, p, data):
    """The first False's index along the axis, or the axis's length when there is none (every shape, empty axes
    included), as int32 with the axis reduced away."""
    mask = np.random.default_rng(seed).random(shape) < p
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    got = np.asarray(arrays.count_leading(mask, axis=axis))
    moved = np.moveaxis(mask, axis, -1)
    want = np.zeros(moved.shape[:-1], np.int32)
    for idx in np.ndindex(*moved.shape[:-1]):
        want[idx] = _leading(moved[idx])
    assert got.dtype == np.int32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@given(s=st.integers(1, 70), values=st.lists(st.integers(-2**31, 2**31 - 1), min_size=1, max_size=40),
       jit=st.booleans())
def test_floor_div_and_mod_are_pythons_on_every_int32(s, values, jit):
    """x // s and x % s with Python's signs (floor), for every int32 x, negatives and the extremes included: a
    power of two by a shift and a mask, any other s by jnp's operators; traced or not, host ints unchanged."""
    x = jnp.asarray(np.asarray(values, np.int32))
    div = jax.jit(arrays.floor_div, static_argnums=1) if jit else arrays.floor_div
    mod = jax.jit(arrays.floor_mod, static_argnums=1) if jit else arrays.floor_mod
    got_div, got_mod = np.asarray(div(x, s)), np.asarray(mod(x, s))
    assert got_div.dtype == np.int32 and got_mod.dtype == np.int32
    assert got_div.tolist() == [v // s for v in values]
    assert got_mod.tolist() == [v % s for v in values]
    assert arrays.floor_div(values[0], s) == values[0] // s and arrays.floor_mod(values[0], s) == values[0] % s
    assert arrays.cdiv(abs(values[0]) // 2, s) == -(-(abs(values[0]) // 2) // s)


@given(b=st.integers(1, 9), trailing=st.lists(st.sampled_from([(), (1,), (2,), (3, 2), (12,)]), min_size=1,
                                                max_size=5), seed=st.integers(0, 2**31 - 1))
def test_sums_is_each_arrays_sum(b, trailing, seed):
    """One int32 sum per array, in order, whatever their trailing shapes (short windows added column by column,
    long ones reduced first), bool and int alike."""
    rng = np.random.default_rng(seed)
    xs = [rng.random((b,) + t) < 0.5 if i % 2 else rng.integers(-5, 6, (b,) + t).astype(np.int32)
          for i, t in enumerate(trailing)]
    got = np.asarray(arrays.sums(*[jnp.asarray(x) for x in xs]))
    assert got.dtype == np.int32 and got.tolist() == [int(x.astype(np.int64).sum()) for x in xs]


@given(mask=st.lists(st.booleans(), min_size=1, max_size=40), size=st.integers(1, 45), fill=st.integers(-3, 50))
def test_first_trues_is_nonzero_with_a_size(mask, size, fill):
    """The first `size` True positions in order, then `fill`, as jnp.nonzero(size=, fill_value=) gives them; the
    running count is the inclusive count of Trues."""
    m = np.asarray(mask)
    pos, rank = arrays.first_trues(jnp.asarray(m), size, fill)
    want = np.full(size, fill, np.int32)
    trues = np.flatnonzero(m)[:size]
    want[: len(trues)] = trues
    np.testing.assert_array_equal(np.asarray(pos), want)
    np.testing.assert_array_equal(np.asarray(rank), np.cumsum(m))
    assert np.asarray(pos).dtype == np.int32 and np.asarray(rank).dtype == np.int32
    nonzero = jnp.nonzero(jnp.asarray(m), size=size, fill_value=fill)[0]
    np.testing.assert_array_equal(np.asarray(pos), np.asarray(nonzero))
