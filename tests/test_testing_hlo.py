"""`skvs_jax.testing.hlo`: two compiled programs compared up to names, the check a refactor passes."""

import jax
import jax.numpy as jnp

from skvs_jax.testing import hlo


def _program(scale: int):
    """A fresh function object each call (so each compiles on its own, with its own names)."""
    def f(x, y):
        return jax.lax.cond(x.sum() > 0, lambda v: v * scale, lambda v: v - 1, x + y)

    return f


def _canonical(fn) -> str:
    return hlo.canonical(jax.jit(fn).lower(jnp.ones(4), jnp.ones(4)).compile().as_text())


def test_the_same_program_compiled_twice_is_the_same_text_and_a_changed_one_is_not():
    first, second, other = _canonical(_program(2)), _canonical(_program(2)), _canonical(_program(3))
    assert first == second and "%n0" in first and "metadata" not in first and "FileNames" not in first
    assert first != other
    changed = hlo.differing(first, other)
    assert changed and all("constant(2)" in a and "constant(3)" in b for a, b in changed)
    assert hlo.differing(first, second) == []
