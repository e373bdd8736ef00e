"""Small array idioms every layer shares, each defined once: the index dtype, ceil division, the inverse of a
priority order, and the length of a run of leading Trues (an accepted draft prefix, a matched hash chain)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

i32 = jnp.int32
"""The dtype of every count, id, length and position in the state pytrees."""


def cdiv(x, s: int):
    """ceil(x / s) for non-negative x: blocks of s tokens needed to hold x tokens. Python ints or int arrays."""
    return (x + (s - 1)) // s


def rank_of(order: jax.Array) -> jax.Array:
    """Inverse permutation: rank[slot] = position of slot in `order` (order[r] = slot served r-th). [B] -> [B]."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def count_leading(mask: jax.Array, axis: int = -1) -> jax.Array:
    """int32 number of leading Trues of `mask` along `axis` (the axis is reduced away)."""
    return jnp.sum(jnp.cumprod(mask.astype(i32), axis=axis), axis=axis, dtype=i32)
