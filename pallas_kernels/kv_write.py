"""`write_kv`: scatter the K/V of T new tokens into the paged cache at a slot mapping.

slot = block_id * S + offset; slot < 0 means padding (dropped). Slots must be distinct among the non-negative
ones (the model writes each token once); with duplicates the winner is unspecified, as for any scatter.
Quantised pages (int8 / float8_e4m3fn) get the new values quantised per token and head by `quantize_kv`
(done once in jnp before the scatter, so every implementation stores bit-identical values and scales).

Pallas kernel: one program per new token; it reads its slot, and when valid stores one [Hkv, D] row of K and
of V (and [Hkv] scales) into the aliased page buffers. Nothing else in the pages is touched.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as c


@jax.jit
def write_kv_reference(k_pages, v_pages, k_new, v_new, slot_mapping, *, k_scales=None, v_scales=None):
    """Pure-jnp scatter. Same contract as `write_kv`."""
    N, S, Hkv, D = k_pages.shape
    quantised = k_scales is not None
    slots = jnp.where(slot_mapping < 0, N * S, slot_mapping)  # out of range -> dropped (negatives would wrap)

    def put(pages, new):
        flat = pages.reshape((N * S,) + pages.shape[2:])
        return flat.at[slots].set(new, mode="drop").reshape(pages.shape)

    if not quantised:
        return put(k_pages, k_new.astype(k_pages.dtype)), put(v_pages, v_new.astype(v_pages.dtype))
    kq, ks = c.quantize_kv(k_new, k_pages.dtype)
    vq, vs = c.quantize_kv(v_new, v_pages.dtype)
    return put(k_pages, kq), put(v_pages, vq), put(k_scales, ks), put(v_scales, vs)


def _write_kernel(*refs, S, N, quantised):
    """Program t: store token t's [Hkv, D] K/V (and [Hkv] scales) at its slot, if the slot is valid."""
    n_new = 4 if quantised else 2
    slot_ref = refs[0]
    new_refs = refs[1:1 + n_new]  # k_new, v_new (, k_scales_new, v_scales_new)
    out_refs = refs[1 + 2 * n_new:]  # aliased pages (, scales); the aliased inputs in between are unused
    t = pl.program_id(0)
    slot = slot_ref[t]

    @pl.when((slot >= 0) & (slot < N * S))
    def _store():
        blk, off = slot // S, slot % S
        for new_ref, out_ref in zip(new_refs, out_refs):
            out_ref[blk, off] = new_ref[...]


@functools.partial(jax.jit, static_argnames=("interpret",))
def _write_kv_pallas(k_pages, v_pages, k_new, v_new, slot_mapping, k_scales, v_scales, *, interpret):
    N, S, Hkv, D = k_pages.shape
    T = k_new.shape[0]
    quantised = k_scales is not None
    if quantised:
        kq, ks = c.quantize_kv(k_new, k_pages.dtype)
        vq, vs = c.quantize_kv(v_new, v_pages.dtype)
        news, pages = [kq, vq, ks, vs], [k_pages, v_pages, k_scales, v_scales]
    else:
        news, pages = [k_new.astype(k_pages.dtype), v_new.astype(v_pages.dtype)], [k_pages, v_pages]
    new_specs = [pl.BlockSpec((None,) + x.shape[1:], lambda t, nd=x.ndim: (t,) + (0,) * (nd - 1)) for x in news]
    inputs = [slot_mapping] + news + pages
    return tuple(pl.pallas_call(
        functools.partial(_write_kernel, S=S, N=N, quantised=quantised),
        grid=(T,),
        in_specs=[pl.no_block_spec] + new_specs + [pl.no_block_spec] * len(pages),
        out_specs=[pl.no_block_spec] * len(pages),
        out_shape=[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pages],
        input_output_aliases={1 + len(news) + i: i for i in range(len(pages))},
        interpret=interpret,
        name="skvs_write_kv",
        **c.pallas_kwargs(interpret, num_warps=1, num_stages=1),
    )(*inputs))


def write_kv(k_pages, v_pages, k_new, v_new, slot_mapping, *, k_scales=None, v_scales=None, impl="auto",
             interpret=None):
    """Write T new tokens' K/V into the paged cache.

    k_pages, v_pages [N, S, Hkv, D]; k_new, v_new [T, Hkv, D] float; slot_mapping [T] int32 (slot < 0: drop);
    k_scales, v_scales [N, S, Hkv] f32 when the pages are int8/float8_e4m3fn.
    Returns (k_pages, v_pages), or (k_pages, v_pages, k_scales, v_scales) when quantised. The Pallas kernel
    aliases its outputs to the page buffers, so inside a caller's jit that donates the cache the update is in
    place; the XLA paths are plain scatters (also in place under donation).
    """
    quantised = c.check_kv_pages(k_pages, v_pages, k_scales, v_scales)
    N, S, Hkv, D = k_pages.shape
    c.check_ndim("k_new", k_new, 3, "[T, Hkv, D]")
    c.check_shape("k_new", k_new, (k_new.shape[0], Hkv, D), "[T, Hkv, D] matching k_pages")
    c.check_shape("v_new", v_new, k_new.shape, "[T, Hkv, D] like k_new")
    c.check_dtype("k_new", k_new, c.FLOAT_KV_DTYPES)
    c.check_dtype("v_new", v_new, c.FLOAT_KV_DTYPES)
    c.check_shape("slot_mapping", slot_mapping, (k_new.shape[0],), "[T]")
    c.check_dtype("slot_mapping", slot_mapping, (jnp.int32,))
    slots = c.concrete(slot_mapping)
    if slots is not None and slots.size and slots.max() >= N * S:
        raise ValueError(f"slot_mapping entries must be < N * S = {N * S}, got {slots.max()}")
    impl, interpret = c.resolve_impl(impl, interpret)
    c.check_triton_row(k_pages, impl, interpret)
    if impl != "pallas" or k_new.shape[0] == 0:
        return write_kv_reference(k_pages, v_pages, k_new, v_new, slot_mapping, k_scales=k_scales,
                                  v_scales=v_scales)
    out = _write_kv_pallas(k_pages, v_pages, k_new, v_new, slot_mapping, k_scales, v_scales, interpret=interpret)
    return out if quantised else out[:2]
