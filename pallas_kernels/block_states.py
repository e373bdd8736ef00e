"""Speculative bookkeeping kernels: `update_block_states` and `invalidate_drafts`.

update_block_states (the article's `update_block_states_kernel`): after verification, every (sequence, block)
entry that held drafts is either accepted (-> VALIDATED) or rejected (-> STALE, generation recorded). The
article uses atomics for the stale counter; here each block's new state is a max-reduction over the entries that
name it, and the counter is a sum: deterministic, no atomics. If one block appears in several valid entries, any
accepting entry wins (a block holding an accepted token must survive); num_stale counts distinct blocks turned
STALE, which equals the number of rejected entries when block ids are distinct (the normal case).

invalidate_drafts (the article's `spec_validate_kernel`): one program per (sequence, draft position); a rejected
draft's K/V slot (and its scales) is overwritten with zeros, so the rejected content can never be read back, not
even through a later bug in context lengths. (Attention already masks positions >= context_len; zeroing is the
scrub that keeps a reused slot from ever exposing another draft's data.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as c


# --------------------------------------------------------------------------------------- update_block_states
def _entry_codes(block_ids, accept_mask, valid, N):
    """-> ids [E] int32 (invalid entries -> N, out of range), codes [E] int32 (0 none, 1 reject, 2 accept)."""
    ids = block_ids.reshape(-1)
    ok = valid.reshape(-1) & (ids >= 0) & (ids < N)
    codes = jnp.where(ok, jnp.where(accept_mask.reshape(-1), 2, 1), 0).astype(jnp.int32)
    return jnp.where(ok, ids, N).astype(jnp.int32), codes


def _apply_flags(states, generations, flags, generation):
    new_states = jnp.where(flags == 2, jnp.int8(c.VALIDATED), jnp.where(flags == 1, jnp.int8(c.STALE), states))
    new_generations = jnp.where(flags == 1, generation, generations)
    return new_states.astype(c.BLOCK_STATE_DTYPE), new_generations.astype(jnp.int32)


@jax.jit
def update_block_states_reference(states, generations, block_ids, accept_mask, valid, generation):
    """Pure-jnp scatter-max. Same contract as `update_block_states`."""
    N = states.shape[0]
    ids, codes = _entry_codes(block_ids, accept_mask, valid, N)
    flags = jnp.zeros((N,), jnp.int32).at[ids].max(codes, mode="drop")  # [N]
    new_states, new_generations = _apply_flags(states, generations, flags, jnp.asarray(generation, jnp.int32))
    return new_states, new_generations, jnp.sum(flags == 1, dtype=jnp.int32)


def update_states_by_scatter(states, block_ids, accept_mask, valid):
    """The new states alone of `update_block_states` (same arguments, no generations, no count), by two scatters
    over the [B, W] entries, rejected first and accepted second, so any accepting entry wins as in the max-reduction.
    For a caller that needs only the states off a GPU: the reference reduces over all N blocks (a zero fill, a
    scatter-max and a select of [N]), which at N = 65,536 costs more than the rest of an allocator's commit."""
    N = states.shape[0]
    ids, codes = _entry_codes(block_ids, accept_mask, valid, N)
    states = states.at[jnp.where(codes == 1, ids, N)].set(jnp.int8(c.STALE), mode="drop")
    return states.at[jnp.where(codes == 2, ids, N)].set(jnp.int8(c.VALIDATED), mode="drop")


def _states_kernel(states_ref, gens_ref, ids_ref, codes_ref, gen_ref, new_states_ref, new_gens_ref, stale_ref):
    """Program i: blocks [i*TN, (i+1)*TN); flags = max over all entries naming the block (a reduction)."""
    TN = states_ref.shape[0]
    n = pl.program_id(0) * TN + jax.lax.broadcasted_iota(jnp.int32, (TN, 1), 0)  # [TN, 1]
    match = ids_ref[...][None, :] == n  # [TN, E]
    flags = jnp.max(jnp.where(match, codes_ref[...][None, :], 0), axis=1)  # [TN]
    new_states, new_gens = _apply_flags(states_ref[...], gens_ref[...], flags, gen_ref[0])
    new_states_ref[...] = new_states
    new_gens_ref[...] = new_gens
    stale_ref[...] = jnp.sum((flags == 1).astype(jnp.int32), keepdims=True)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _update_block_states_pallas(states, generations, block_ids, accept_mask, valid, generation, *, interpret):
    N = states.shape[0]
    ids, codes = _entry_codes(block_ids, accept_mask, valid, N)
    E = pl.next_power_of_2(max(ids.shape[0], 1))
    ids = jnp.pad(ids, (0, E - ids.shape[0]), constant_values=N)
    codes = jnp.pad(codes, (0, E - codes.shape[0]))
    TN = max(1, min(128, pl.next_power_of_2(N), 16384 // E))  # keeps the [TN, E] match tile small
    tiles = -(-N // TN)
    pad = tiles * TN - N
    st = jnp.pad(states, (0, pad))
    gens = jnp.pad(generations, (0, pad))
    gen = jnp.reshape(jnp.asarray(generation, jnp.int32), (1,))
    tile = pl.BlockSpec((TN,), lambda i: (i,))
    new_states, new_gens, stale = pl.pallas_call(
        _states_kernel,
        grid=(tiles,),
        in_specs=[tile, tile, pl.no_block_spec, pl.no_block_spec, pl.no_block_spec],
        out_specs=[tile, tile, pl.BlockSpec((1,), lambda i: (i,))],
        out_shape=[jax.ShapeDtypeStruct(st.shape, st.dtype), jax.ShapeDtypeStruct(gens.shape, jnp.int32),
                   jax.ShapeDtypeStruct((tiles,), jnp.int32)],
        interpret=interpret,
        name="skvs_update_block_states",
        **c.pallas_kwargs(interpret, num_warps=4, num_stages=1),
    )(st, gens, ids, codes, gen)
    return new_states[:N], new_gens[:N], jnp.sum(stale, dtype=jnp.int32)


def update_block_states(states, generations, block_ids, accept_mask, valid, generation, *, impl="auto",
                        interpret=None):
    """Commit or reject the blocks that held drafts, in one batched step.

    states [N] int8, generations [N] int32, block_ids [B, W] int32, accept_mask [B, W] bool, valid [B, W] bool,
    generation int32 scalar. Valid accepted entries -> VALIDATED; valid rejected entries -> STALE with
    generations[block] = generation; invalid entries untouched. Returns (new_states [N] int8,
    new_generations [N] int32, num_stale int32 scalar = blocks turned STALE).
    """
    c.check_ndim("states", states, 1, "[N]")
    c.check_dtype("states", states, (c.BLOCK_STATE_DTYPE,))
    c.check_shape("generations", generations, states.shape, "[N]")
    c.check_dtype("generations", generations, (jnp.int32,))
    c.check_ndim("block_ids", block_ids, 2, "[B, W]")
    c.check_dtype("block_ids", block_ids, (jnp.int32,))
    c.check_shape("accept_mask", accept_mask, block_ids.shape, "[B, W] like block_ids")
    c.check_dtype("accept_mask", accept_mask, (jnp.bool_,))
    c.check_shape("valid", valid, block_ids.shape, "[B, W] like block_ids")
    c.check_dtype("valid", valid, (jnp.bool_,))
    if jnp.ndim(generation) != 0 or not jnp.issubdtype(jnp.result_type(generation), jnp.integer):
        raise TypeError(f"generation must be an integer scalar, got {generation!r}")
    gen = c.concrete(generation)
    if gen is not None and not -(2**31) <= int(gen) < 2**31:  # stored as int32: a wider value would wrap
        raise ValueError(f"generation must fit in int32, got {int(gen)}")
    ids, ok = c.concrete(block_ids), c.concrete(valid)
    if ids is not None and ok is not None and ok.any():
        bad = ids[ok]
        if bad.min() < 0 or bad.max() >= states.shape[0]:
            raise ValueError(f"block_ids of valid entries must lie in [0, {states.shape[0]}), "
                             f"got range [{bad.min()}, {bad.max()}]")
    impl, interpret = c.resolve_impl(impl, interpret)
    if impl != "pallas" or states.shape[0] == 0 or block_ids.size == 0:  # an empty Pallas grid crashes
        return update_block_states_reference(states, generations, block_ids, accept_mask, valid, generation)
    return _update_block_states_pallas(states, generations, block_ids, accept_mask, valid,
                                       jnp.asarray(generation, jnp.int32), interpret=interpret)


# ----------------------------------------------------------------------------------------- invalidate_drafts
def _rejected(accept_mask, draft_lens):
    """[B, K] bool: draft k of sequence b exists (k < draft_lens[b]) and was rejected."""
    K = accept_mask.shape[1]
    exists = jnp.arange(K, dtype=jnp.int32)[None, :] < draft_lens[:, None]
    return exists & ~accept_mask


@jax.jit
def _killed(rejected, pos, blk, N, L):
    """bool [B, K]: the draft slots to zero. Under a caller's jit a position or table entry out of range is
    skipped: a block id of -1 or N would otherwise wrap or clamp onto block N - 1, another sequence's block."""
    return rejected & (pos >= 0) & (pos < L) & (blk >= 0) & (blk < N)


def invalidate_drafts_reference(k_pages, v_pages, block_tables, draft_start, accept_mask, *, draft_lens=None,
                                k_scales=None, v_scales=None):
    """Pure-jnp scatter of zeros. Same contract as `invalidate_drafts`."""
    N, S = k_pages.shape[:2]
    B, K = accept_mask.shape
    M = block_tables.shape[1]
    lens = jnp.full((B,), K, jnp.int32) if draft_lens is None else draft_lens
    pos = draft_start[:, None] + jnp.arange(K, dtype=jnp.int32)[None, :]  # [B, K]
    blk = jnp.take_along_axis(block_tables, jnp.clip(pos // S, 0, M - 1), axis=1)
    kill = _killed(_rejected(accept_mask, lens), pos, blk, N, M * S)
    slots = jnp.where(kill, blk * S + pos % S, N * S).reshape(-1)  # [B*K]; N*S = dropped

    def scrub(x):
        flat = x.reshape((N * S,) + x.shape[2:])
        return flat.at[slots].set(jnp.zeros((), x.dtype), mode="drop").reshape(x.shape)

    out = (scrub(k_pages), scrub(v_pages))
    return out if k_scales is None else out + (scrub(k_scales), scrub(v_scales))


def _invalidate_kernel(bt_ref, start_ref, kill_ref, *refs, S, M, n_bufs):
    """Program (b, k): if draft k of sequence b was rejected, zero its slot in every page buffer."""
    out_refs = refs[n_bufs:]
    b, k = pl.program_id(0), pl.program_id(1)
    pos = start_ref[b] + k

    @pl.when(kill_ref[b, k] != 0)  # position and block id checked by `_killed`
    def _zero():
        blk = bt_ref[b, pos // S]
        for out_ref in out_refs:
            row = out_ref.shape[2:]
            out_ref[blk, pos % S] = jnp.zeros(row, out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _invalidate_drafts_pallas(k_pages, v_pages, block_tables, draft_start, accept_mask, draft_lens, k_scales,
                              v_scales, *, interpret):
    N, S = k_pages.shape[:2]
    B, K = accept_mask.shape
    M = block_tables.shape[1]
    bufs = [k_pages, v_pages] + ([k_scales, v_scales] if k_scales is not None else [])
    pos = draft_start[:, None] + jnp.arange(K, dtype=jnp.int32)[None, :]  # [B, K]
    blk = jnp.take_along_axis(block_tables, jnp.clip(pos // S, 0, M - 1), axis=1)
    kill = _killed(_rejected(accept_mask, draft_lens), pos, blk, N, M * S).astype(jnp.int32)
    return tuple(pl.pallas_call(
        functools.partial(_invalidate_kernel, S=S, M=block_tables.shape[1], n_bufs=len(bufs)),
        grid=(B, K),
        in_specs=[pl.no_block_spec] * (3 + len(bufs)),
        out_specs=[pl.no_block_spec] * len(bufs),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in bufs],
        input_output_aliases={3 + i: i for i in range(len(bufs))},
        interpret=interpret,
        name="skvs_invalidate_drafts",
        **c.pallas_kwargs(interpret, num_warps=1, num_stages=1),
    )(block_tables, draft_start, kill, *bufs))


def invalidate_drafts(k_pages, v_pages, block_tables, draft_start, accept_mask, *, draft_lens=None,
                      k_scales=None, v_scales=None, impl="auto", interpret=None):
    """Zero the KV slots of rejected drafts.

    k_pages, v_pages [N, S, Hkv, D]; block_tables [B, M] int32; draft_start [B] int32 = position of draft 0 in
    each sequence (draft k sits at position draft_start[b] + k); accept_mask [B, K] bool (True = kept);
    draft_lens [B] int32 or None (= K): drafts k >= draft_lens[b] do not exist and are left alone;
    k_scales, v_scales [N, S, Hkv] f32 for quantised pages (zeroed too). Positions outside [0, M*S) are skipped.
    Returns (k_pages, v_pages) or (k_pages, v_pages, k_scales, v_scales) when quantised.
    """
    c.check_kv_pages(k_pages, v_pages, k_scales, v_scales)
    N = k_pages.shape[0]
    c.check_ndim("accept_mask", accept_mask, 2, "[B, K]")
    c.check_dtype("accept_mask", accept_mask, (jnp.bool_,))
    B, K = accept_mask.shape
    c.check_block_tables(block_tables, B)
    c.check_int32_vector("draft_start", draft_start, B)
    if draft_lens is not None:
        c.check_int32_vector("draft_lens", draft_lens, B)
    bt = c.concrete(block_tables)
    if bt is not None and bt.size and (bt.min() < 0 or bt.max() >= N):
        raise ValueError(f"block_tables entries must lie in [0, {N}), got range [{bt.min()}, {bt.max()}]")
    impl, interpret = c.resolve_impl(impl, interpret)
    c.check_triton_row(k_pages, impl, interpret)
    if impl != "pallas" or K == 0 or B == 0 or block_tables.shape[1] == 0:  # an empty Pallas grid crashes
        return invalidate_drafts_reference(k_pages, v_pages, block_tables, draft_start, accept_mask,
                                           draft_lens=draft_lens, k_scales=k_scales, v_scales=v_scales)
    lens = jnp.full((B,), K, jnp.int32) if draft_lens is None else draft_lens
    return _invalidate_drafts_pallas(k_pages, v_pages, block_tables, draft_start, accept_mask, lens, k_scales,
                                     v_scales, interpret=interpret)
