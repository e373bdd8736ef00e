"""`skvs_jax.arrays`: the shared idioms against plain-Python oracles."""

from __future__ import annotations

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
