"""Small array idioms every layer shares, each defined once: the index dtype, division by a block size (a shift
for a power of two) and ceil division, several counts in one reduction, the first positions of a mask, the
inverse of a priority order, prefix sums in a priority order (by a scan or dense), and the length of a run of
leading Trues (an accepted draft prefix, a matched hash chain). Several exist because each reduction, division
fix-up or scatter is kernels a step: see docs/scheduler.md, "A seventh round"."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

i32 = jnp.int32
"""The dtype of every count, id, length and position in the state pytrees."""


def floor_div(x, s: int):
    """x // s for a static positive int s: Python ints or int arrays. A power of two is an arithmetic shift, which
    is floor division for every int (negatives included): jnp's `//` on an int array emits a dozen sign fix-ups
    per element, which XLA then repeats in every fusion that reads the quotient (a block column is read by most
    of a step's index computations)."""
    if s & (s - 1) or not _traced_int(x):
        return x // s
    return jnp.right_shift(x, s.bit_length() - 1)


def floor_mod(x, s: int):
    """x % s (Python's sign: in [0, s)) for a static positive int s, a mask when s is a power of two
    (`floor_div`'s reason)."""
    if s & (s - 1) or not _traced_int(x):
        return x % s
    return jnp.bitwise_and(x, s - 1)


def _traced_int(x) -> bool:
    """x is a jax integer array (host values keep Python's and numpy's own operators)."""
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.integer)


def div_nonneg(x: jax.Array, y: jax.Array) -> jax.Array:
    """x // y for int arrays with x >= 0 and y > 0 (the caller's invariant): truncating division, which equals
    floor division there, without the sign fix-ups jnp's `//` adds per element (a fused chain that divides by
    data, such as the draft controller's fixed-point estimates, repeats them at every use)."""
    return jax.lax.div(x, y)


def cdiv(x, s: int):
    """ceil(x / s) for non-negative x: blocks of s tokens needed to hold x tokens. Python ints or int arrays."""
    return floor_div(x + (s - 1), s)


SMALL_TRAILING = 8  # `sums` adds a trailing axis up to this long column by column, inside one elementwise pass


def sums(*xs: jax.Array) -> jax.Array:
    """int32[len(xs)]: the sum of each of xs (bool or int arrays with one leading length), in one reduction. Each
    reduction is its own kernel on a GPU and two or three on XLA:CPU (its tree rewrite splits a reduction over more
    than 32 elements and materialises the input first), so a phase's counters summed together cost one set. A
    trailing axis of at most `SMALL_TRAILING` is added column by column (elementwise, so it fuses); a longer one
    is reduced on its own first."""
    rows = []
    for x in xs:
        x = x.astype(i32).reshape(x.shape[0], -1)
        if x.shape[1] > SMALL_TRAILING:
            rows.append(jnp.sum(x, axis=1, dtype=i32))
        else:
            rows.append(functools.reduce(jnp.add, [x[:, j] for j in range(x.shape[1])], jnp.zeros(x.shape[:1], i32)))
    return jnp.sum(jnp.stack(rows), axis=1, dtype=i32)


def first_trues(mask: jax.Array, size: int, fill: int) -> tuple[jax.Array, jax.Array]:
    """(positions int32[size], rank int32[X]): the positions of the first `size` Trues of mask bool[X] in order,
    `fill` past the last (`jnp.nonzero(mask, size=size, fill_value=fill)[0]`), and mask's inclusive running count
    (rank[-1]: its Trues; mask & (rank > size): the ones left out). One running count and one scatter, where
    jnp.nonzero with a size takes two running counts, a bincount and a total: ~12 kernels on XLA:CPU against ~6,
    and a GPU launch each."""
    x = mask.shape[0]
    rank = jnp.cumsum(mask, dtype=i32)
    dst = jnp.where(mask & (rank <= size), rank - 1, size)
    return jnp.full((size,), fill, i32).at[dst].set(jnp.arange(x, dtype=i32), mode="drop"), rank


def rank_of(order: jax.Array) -> jax.Array:
    """Inverse permutation: rank[slot] = position of slot in `order` (order[r] = slot served r-th). [B] -> [B]."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def count_leading(mask: jax.Array, axis: int = -1) -> jax.Array:
    """int32 number of leading Trues of `mask` along `axis` (the axis is reduced away): the first False's index,
    or the length when there is none. One min-reduction of the positions of the Falses, not a cumulative product
    (on a GPU a scan is several kernels) nor an argmin (a reduction of (value, index) pairs: ~3x the time of a min
    on XLA:CPU at [64, 64], measured)."""
    mask = jnp.asarray(mask, bool)
    n = mask.shape[axis]
    pos = jax.lax.broadcasted_iota(i32, mask.shape, axis % mask.ndim)
    return jnp.min(jnp.where(mask, n, pos), axis=axis, initial=n)


def before(rank: jax.Array) -> jax.Array:
    """bool[B, B]: before[i, j] = rank[j] <= rank[i], slot j is served no later than slot i (rank int32[B], a
    permutation). The matrix a dense prefix sum reduces over (`prefix_sum`)."""
    return rank[None, :] <= rank[:, None]


def prefix_sum(x: jax.Array, order: jax.Array, rank: jax.Array, ahead: jax.Array | None = None) -> jax.Array:
    """Inclusive prefix sum of x int32[B] taken in `order` (rank: its inverse), returned per slot.

    ahead None: a gather, a cumulative sum and a gather back (cheapest on a CPU). ahead bool[B, B] (`before(rank)`):
    one masked row sum, no gather or scan, one fused kernel on a GPU, where the scan is several; it does B^2 work,
    which a CPU pays for (4x the scan at B = 256, six sums, measured)."""
    if ahead is None:
        return jnp.cumsum(x[order], dtype=i32)[rank]
    return jnp.sum(jnp.where(ahead, x[None, :], 0), axis=1, dtype=i32)


def running_sum(x: jax.Array, dense: bool = False) -> jax.Array:
    """Inclusive cumulative sum of x int32[A] in index order; dense: as a masked [A, A] row sum (no scan), for a
    short A on a GPU."""
    if not dense:
        return jnp.cumsum(x, dtype=i32)
    idx = jnp.arange(x.shape[0])
    return jnp.sum(jnp.where(idx[None, :] <= idx[:, None], x[None, :], 0), axis=1, dtype=i32)


def take_each(arrays: tuple[jax.Array, ...], index: jax.Array) -> tuple[jax.Array, ...]:
    """(a[index] for a in arrays): several arrays of one leading length N (int32, int8 or bool; index int32[...]
    in range) read at the same index by one gather of their int32 stack, each cast back to its dtype: one kernel
    launch on a GPU, not k.

    It pays only where XLA fuses the stack into the gather's operand. Where it does not, the program writes the
    [k, N] stack first (a copy of the arrays: ~30 us at N = 65,536 on this project's CPU, and a kernel as well),
    which costs more than the gathers it saves; XLA:CPU did that for share's, pin's and the allocation request's
    reads of the block pool (2026-12-07), so those read each array apart. A new use checks the optimised program
    of the step at 256 slots for a `concatenate` fusion of shape [k, N] (docs/scheduler.md, "A fifth round")."""
    stacked = jnp.stack([a.astype(i32) for a in arrays])[:, index]
    return tuple(row.astype(a.dtype) for a, row in zip(arrays, stacked, strict=True))


def rows_into(slot: jax.Array, n: int) -> jax.Array:
    """int32[n]: for each of n rows, which entry of `slot` (int32[m], distinct; out of [0, n): none) writes it,
    -1 where none does: the inverse of a row scatter, to write it densely (`set_rows_from`)."""
    return jnp.full((n,), -1, i32).at[slot].set(jnp.arange(slot.shape[0], dtype=i32), mode="drop")


def set_rows_from(x: jax.Array, src: jax.Array, value) -> jax.Array:
    """x with row r set to value[src[r]] where src[r] >= 0 (`rows_into`), else kept: `x.at[slot].set(value)` as
    a gather and a select over x's rows, which a GPU fuses with its siblings of the same `src` (a scatter per
    array is a kernel each). value: an array with a leading axis of src's entries' range, or a scalar."""
    value = jnp.asarray(value, x.dtype)
    rows = value[jnp.clip(src, 0, None)] if value.ndim else value
    keep = (src < 0).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(keep, x, rows)
