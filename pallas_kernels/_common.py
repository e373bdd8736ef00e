"""Shared plumbing for the kernels: block-state constants, `impl=` dispatch, argument checks, KV quantisation.

Dimension names (the project's glossary): B sequences, N blocks in the pool, S block size (tokens per block),
M max blocks per sequence, T new tokens in a step, Q query tokens per sequence, K draft length, Hq query heads,
Hkv key/value heads, G = Hq // Hkv query heads per KV head, D head dim, E = B * W flattened block-id entries.

Every check here runs at trace time (shapes, dtypes) or eagerly on concrete arrays (values). Nothing raises
inside jit: a traced value is simply not value-checked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Block states (int8): the one definition; skvs_jax.kv.allocator imports them from here.
FREE = 0
RESERVED = 1
SPECULATIVE = 2
VALIDATED = 3
STALE = 4
BLOCK_STATE_DTYPE = jnp.int8

IMPLS = ("auto", "pallas", "xla", "reference")
FLOAT_KV_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
QUANT_KV_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
# Largest magnitude a quantised value may take: symmetric int8, and the finite range of e4m3fn.
QUANT_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def pallas_kwargs(interpret: bool, num_warps: int = 4, num_stages: int = 2) -> dict:
    """Extra `pl.pallas_call` arguments: compiled, select Pallas's Triton backend explicitly (jax 0.10 otherwise
    defaults GPU kernels to Mosaic GPU, for which these kernels are not written); interpreted, nothing."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as pltriton

    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def check_triton_row(k_pages, impl: str, interpret: bool) -> None:
    """Compiled kernels that store whole [Hkv, D] token rows need Hkv * D to be a power of two (Triton)."""
    _, _, Hkv, D = k_pages.shape
    n = Hkv * D
    if impl == "pallas" and not interpret and n & (n - 1):
        raise ValueError(f"compiled Pallas (Triton) path needs Hkv * D of k_pages to be a power of two, got {n}")


def resolve_impl(impl: str, interpret: bool | None) -> tuple[str, bool]:
    """Map `impl`/`interpret` to a concrete ("pallas" | "xla" | "reference", interpret) pair.

    "auto" is Pallas (compiled) on GPU and the fastest XLA path elsewhere; "pallas" off-GPU interprets.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "pallas" if on_gpu() else "xla"
    if interpret is None:
        interpret = not on_gpu()
    return impl, bool(interpret)


def check_ndim(name: str, x, ndim: int, shape_doc: str) -> None:
    if not hasattr(x, "shape") or len(x.shape) != ndim:
        got = getattr(x, "shape", type(x).__name__)
        raise ValueError(f"{name} must have shape {shape_doc}, got {got}")


def check_shape(name: str, x, shape: tuple[int, ...], shape_doc: str) -> None:
    check_ndim(name, x, len(shape), shape_doc)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {shape_doc} = {tuple(shape)}, got {tuple(x.shape)}")


def check_dtype(name: str, x, allowed) -> None:
    allowed = tuple(jnp.dtype(a) for a in allowed)
    if jnp.dtype(x.dtype) not in allowed:
        names = ", ".join(a.name for a in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {jnp.dtype(x.dtype).name}")


def check_block_tables(block_tables, batch: int) -> None:
    """block_tables must be int32 [B, M] with B = batch."""
    check_ndim("block_tables", block_tables, 2, "[B, M]")
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have shape [B, M] with B = {batch}, got {tuple(block_tables.shape)}")
    check_dtype("block_tables", block_tables, (jnp.int32,))


def check_int32_vector(name: str, x, batch: int) -> None:
    """x must be int32 [B] with B = batch (per-sequence lengths and offsets)."""
    check_shape(name, x, (batch,), "[B]")
    check_dtype(name, x, (jnp.int32,))


def concrete(x) -> np.ndarray | None:
    """The value of `x` as numpy if it is concrete (not traced), else None; used for eager value checks."""
    if x is None or isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def check_kv_pages(k_pages, v_pages, k_scales, v_scales) -> bool:
    """Validate a paged K/V pair [N, S, Hkv, D] (+ scales [N, S, Hkv]); return True if quantised."""
    check_ndim("k_pages", k_pages, 4, "[N, S, Hkv, D]")
    check_shape("v_pages", v_pages, k_pages.shape, "[N, S, Hkv, D] like k_pages")
    for name, size in zip(("N", "S", "Hkv", "D"), k_pages.shape):  # quantising over D = 0 fails in a reduction
        if size < 1:
            raise ValueError(f"k_pages [N, S, Hkv, D] must have every dimension >= 1, got {name} = {size}")
    check_dtype("k_pages", k_pages, FLOAT_KV_DTYPES + QUANT_KV_DTYPES)
    if v_pages.dtype != k_pages.dtype:
        raise TypeError(f"v_pages dtype {v_pages.dtype} must equal k_pages dtype {k_pages.dtype}")
    quantised = jnp.dtype(k_pages.dtype) in QUANT_KV_DTYPES
    if quantised:
        for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            if s is None:
                raise ValueError(f"{name} is required when pages are {jnp.dtype(k_pages.dtype).name}")
            check_shape(name, s, k_pages.shape[:3], "[N, S, Hkv]")
            check_dtype(name, s, (jnp.float32,))
    elif k_scales is not None or v_scales is not None:
        raise ValueError(f"k_scales/v_scales must be None for {jnp.dtype(k_pages.dtype).name} pages")
    return quantised


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Symmetric per-vector quantisation over the last axis.

    x [..., D] float -> (values [..., D] in `dtype` (int8 or float8_e4m3fn), scales [...] float32), such that
    values.astype(f32) * scales[..., None] approximates x. An all-zero vector gets scale 0 and values 0.
    """
    dtype = jnp.dtype(dtype)
    if dtype not in QUANT_KV_DTYPES:
        raise TypeError(f"dtype must be int8 or float8_e4m3fn, got {dtype.name}")
    qmax = QUANT_MAX[dtype]
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)  # [...]
    scales = amax / jnp.float32(qmax)
    safe = jnp.where(scales > 0, scales, jnp.float32(1))
    y = xf / safe[..., None]
    if dtype == jnp.dtype(jnp.int8):
        y = jnp.round(y)
    y = jnp.clip(y, -qmax, qmax)
    return y.astype(dtype), scales


def dequantize_kv(values: jax.Array, scales: jax.Array | None) -> jax.Array:
    """values [..., D], scales [...] or None -> float32 [..., D]."""
    out = values.astype(jnp.float32)
    if scales is not None:
        out = out * scales[..., None]
    return out
