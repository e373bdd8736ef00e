"""`vmap_flow.cond`, `.when`, `.while_loop`: jax.lax's meaning, unbatched and under vmap, against plain
Python run lane by lane; and the batched forms skip the work no lane needs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as hs

from skvs_jax import vmap_flow

i32 = jnp.int32
D = 4  # the operand's width

lanes_st = hs.lists(hs.tuples(hs.booleans(), hs.lists(hs.integers(-50, 50), min_size=D, max_size=D),
                              hs.integers(-9, 9), hs.integers(0, 6)), min_size=1, max_size=5)


def _arrays(lanes):
    p = jnp.asarray([ln[0] for ln in lanes])
    x = jnp.asarray([ln[1] for ln in lanes], i32)
    y = jnp.asarray([ln[2] for ln in lanes], i32)
    n = jnp.asarray([ln[3] for ln in lanes], i32)
    return p, x, y, n


# The functions close over traced values (z, y) on purpose: the rules must see batched closures.
def f_cond(p, x, y):
    z = y * 3
    return vmap_flow.cond(p, lambda x: (x + z, jnp.sum(x)), lambda x: (x * y, jnp.max(x) - z), x)


def f_when(p, x, y):
    z = y - 1
    return vmap_flow.when(p, lambda c: (c[0] * 2 + z, c[1] + y), (x, y))


def f_while(n, x, y):
    def body(c):
        k, x = c
        return k + 1, x * 2 + y

    return vmap_flow.while_loop(lambda c: c[0] < n, body, (jnp.zeros((), i32), x))


def f_masked(n, x, y):
    """A loop that masks its own updates past its trip count (k stops, x stays): identity_when_done holds."""
    def body(c):
        k, x = c
        live = k < n
        return k + live.astype(i32), jnp.where(live, x + y + k, x)

    return vmap_flow.while_loop(lambda c: c[0] < n, body, (jnp.zeros((), i32), x), identity_when_done=True)


def py_cond(p, x, y):
    return (x + 3 * y, int(x.sum())) if p else (x * y, int(x.max()) - 3 * y)


def py_when(p, x, y):
    return (x * 2 + y - 1, 2 * y) if p else (x, y)


def py_while(n, x, y):
    k = 0
    while k < n:
        k, x = k + 1, x * 2 + y
    return k, x


def f_when_masked(p, x, y):
    """An update that masks itself by p (identity where p is False): identity_when_false holds."""
    return vmap_flow.when(p, lambda c: (jnp.where(p, c[0] * 2 + y - 1, c[0]), c[1] + p.astype(i32) * y), (x, y),
                       identity_when_false=True)


def py_masked(n, x, y):
    for k in range(n):
        x = x + y + k
    return n, x


def _check(out, expected):
    for i, exp in enumerate(expected):
        for got, want in zip(jax.tree.leaves(out), exp):
            np.testing.assert_array_equal(np.asarray(got)[i], np.asarray(want))


@given(lanes_st)
def test_cond_and_when_match_python_per_lane(lanes):
    p, x, y, _ = _arrays(lanes)
    xs, ys = np.asarray(x), np.asarray(y)
    _check(jax.jit(jax.vmap(f_cond))(p, x, y), [py_cond(bool(p[i]), xs[i], ys[i]) for i in range(len(lanes))])
    _check(jax.jit(jax.vmap(f_when))(p, x, y), [py_when(bool(p[i]), xs[i], ys[i]) for i in range(len(lanes))])
    _check(jax.jit(jax.vmap(f_when_masked))(p, x, y), [py_when(bool(p[i]), xs[i], ys[i]) for i in range(len(lanes))])
    # Unbatched: it is lax's.
    for i in range(len(lanes)):
        _check(jax.tree.map(lambda v: v[None], jax.jit(f_cond)(p[i], x[i], y[i])), [py_cond(bool(p[i]), xs[i], ys[i])])
        _check(jax.tree.map(lambda v: v[None], jax.jit(f_when)(p[i], x[i], y[i])), [py_when(bool(p[i]), xs[i], ys[i])])


@given(lanes_st)
def test_while_loops_match_python_per_lane(lanes):
    _, x, y, n = _arrays(lanes)
    xs, ys, ns = np.asarray(x), np.asarray(y), np.asarray(n)
    _check(jax.jit(jax.vmap(f_while))(n, x, y), [py_while(int(ns[i]), xs[i], ys[i]) for i in range(len(lanes))])
    _check(jax.jit(jax.vmap(f_masked))(n, x, y), [py_masked(int(ns[i]), xs[i], ys[i]) for i in range(len(lanes))])
    k, out = jax.jit(f_while)(n[0], x[0], y[0])
    assert int(k) == int(ns[0]) and np.array_equal(np.asarray(out), py_while(int(ns[0]), xs[0], ys[0])[1])


def test_mixed_batching_and_nested_vmap():
    """Unbatched predicates or operands, and a vmap of a vmap, mean what they mean for lax."""
    p = jnp.asarray([True, False, True])
    x = jnp.arange(3 * D, dtype=i32).reshape(3, D)
    y = jnp.asarray([1, 2, 3], i32)
    want = [py_cond(bool(p[i]), np.asarray(x[i]), 2) for i in range(3)]
    _check(jax.vmap(f_cond, in_axes=(0, 0, None))(p, x, jnp.asarray(2, i32)), want)
    _check(jax.vmap(f_cond, in_axes=(None, 0, 0))(jnp.asarray(False), x, y),
           [py_cond(False, np.asarray(x[i]), int(y[i])) for i in range(3)])
    _check(jax.vmap(f_when, in_axes=(0, None, 0))(p, x[0], y),
           [py_when(bool(p[i]), np.asarray(x[0]), int(y[i])) for i in range(3)])
    nested = jax.vmap(jax.vmap(f_while))(jnp.asarray([[0, 2], [5, 1]], i32), jnp.stack([x[:2], x[1:]]),
                                         jnp.asarray([[1, 2], [3, 4]], i32))
    for a in range(2):
        for b in range(2):
            want = py_while([[0, 2], [5, 1]][a][b], np.asarray(jnp.stack([x[:2], x[1:]])[a, b]), [[1, 2], [3, 4]][a][b])
            assert int(nested[0][a, b]) == want[0]
            np.testing.assert_array_equal(np.asarray(nested[1][a, b]), want[1])


@pytest.mark.parametrize("preds", [(False, False), (True, False), (True, True)])
def test_batched_forms_skip_work_no_lane_needs(preds):
    """Under vmap, lax.cond runs both branches for every lane; vmap_flow.cond and vmap_flow.when run a branch only
    when some lane takes it (seen by a host callback in the true branch / the update)."""
    calls = []

    def work(x):
        jax.debug.callback(lambda v: calls.append(1), x)
        return x + 1

    p = jnp.asarray(preds)
    x = jnp.zeros((2, D), i32)
    jax.block_until_ready(jax.jit(jax.vmap(lambda p, x: vmap_flow.cond(p, work, lambda x: x, x)))(p, x))
    assert bool(calls) == any(preds)
    calls.clear()
    jax.block_until_ready(jax.jit(jax.vmap(lambda p, x: vmap_flow.when(p, work, x)))(p, x))
    assert bool(calls) == any(preds)
    calls.clear()
    jax.block_until_ready(jax.jit(jax.vmap(lambda p, x: jax.lax.cond(p, work, lambda x: x, x)))(p, x))
    assert calls  # lax: always


def test_identity_when_false_runs_the_update_on_every_lane_without_a_select():
    """The promise is taken at its word: with lanes that disagree, an update that is not an identity where pred is
    False reaches those lanes too (no select), unless no lane needs it; without the promise they keep x."""
    p = jnp.asarray([True, False, False])
    x = jnp.zeros((3, D), i32)
    promised = jax.jit(jax.vmap(lambda p, x: vmap_flow.when(p, lambda x: x + 1, x, identity_when_false=True)))
    np.testing.assert_array_equal(promised(p, x), np.ones((3, D)))
    np.testing.assert_array_equal(promised(jnp.zeros(3, bool), x), np.zeros((3, D)))
    plain = jax.jit(jax.vmap(lambda p, x: vmap_flow.when(p, lambda x: x + 1, x)))
    np.testing.assert_array_equal(plain(p, x), [[1] * D, [0] * D, [0] * D])
    # Unbatched it is a plain `when`.
    assert int(jax.jit(lambda p: vmap_flow.when(p, lambda x: x + 1, jnp.zeros((), i32), identity_when_false=True))(
        jnp.asarray(False))) == 0


@given(hs.lists(hs.lists(hs.booleans(), min_size=3, max_size=3), min_size=1, max_size=4))
def test_all_lanes_is_pred_alone_and_the_and_over_lanes_under_vmap(rows):
    p = jnp.asarray(rows)  # [outer, inner]
    assert bool(jax.jit(vmap_flow.all_lanes)(p[0, 0])) == rows[0][0]
    np.testing.assert_array_equal(jax.vmap(vmap_flow.all_lanes)(p[0]), [all(rows[0])] * 3)
    # Nested: each outer lane gets the and over its own inner lanes; a lane-uniform choice picks one computation.
    np.testing.assert_array_equal(jax.vmap(jax.vmap(vmap_flow.all_lanes))(p), [[all(r)] * 3 for r in rows])
    pick = jax.vmap(lambda q, x: vmap_flow.when(vmap_flow.all_lanes(q), lambda x: x + 1, x))(p[0], jnp.zeros(3, i32))
    np.testing.assert_array_equal(pick, [int(all(rows[0]))] * 3)
