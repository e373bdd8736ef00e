"""Validation at the API boundary.

Shapes and dtypes are static, so they are checked on every call, traced or not. Values are checked only when
they are concrete (an eager call); inside a user's jit they are data, and the transitions turn bad values into
flags instead. Every error names the offending argument.
"""

from __future__ import annotations

import numbers

import jax
import numpy as np


def is_int(x) -> bool:
    """A Python or numpy integer, not a bool (True is an int to Python, never a count or an id here)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def at_least(name: str, value: object, minimum: int) -> int:
    """A static (Python or numpy) int >= minimum, returned as an int: TypeError for another type, ValueError below."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _kind(x) -> str:
    return np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype).kind


def array(name: str, x, shape: tuple[int, ...], kind: str) -> None:
    """x must have exactly `shape` and a dtype of numpy kind `kind` ("i" signed int, "b" bool)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    got = _kind(x)
    if kind == "i" and got not in ("i", "u"):
        raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
    if kind == "b" and got != "b":
        raise TypeError(f"{name} must have dtype bool, got {x.dtype}")


def scalar_int(name: str, x) -> None:
    if isinstance(x, bool):
        raise TypeError(f"{name} must be an integer, got bool")
    if isinstance(x, int):
        return
    if not hasattr(x, "dtype") or getattr(x, "shape", None) != () or _kind(x) not in ("i", "u"):
        raise TypeError(f"{name} must be an integer scalar, got {type(x).__name__} {getattr(x, 'shape', '')}")


def in_range(name: str, x, lo: int, hi: int) -> None:
    """Concrete values of x must lie in [lo, hi] (NaN does not)."""
    if is_concrete(x):
        v = np.asarray(x)
        outside = ~((v >= lo) & (v <= hi))  # written so that NaN, which fails every comparison, is outside
        if outside.any():
            raise ValueError(f"{name} must lie in [{lo}, {hi}], got {v[outside].reshape(-1)[0]}")


def static_int(name: str, x, lo: int, hi: int, *, allow_none: bool = True) -> None:
    """A static (Python) int argument in [lo, hi], or None when allowed."""
    if x is None and allow_none:
        return
    if not is_int(x):
        raise TypeError(f"{name} must be an int{' or None' if allow_none else ''}, got {type(x).__name__} {x!r}")
    if not lo <= x <= hi:
        raise ValueError(f"{name} must lie in [{lo}, {hi}], got {x}")


def permutation(name: str, x, n: int) -> None:
    array(name, x, (n,), "i")
    if is_concrete(x) and sorted(np.asarray(x).tolist()) != list(range(n)):
        raise ValueError(f"{name} must be a permutation of range({n})")
