"""Paged attention for decode (Q = 1) and multi-query draft verification (Q > 1, causal or tree mask).

Layout: pages [N, S, Hkv, D] (the layout the model writes with `write_kv`: one token's K for all heads is
contiguous), block_tables [B, M] (entries past a sequence's blocks point at block 0, the null block),
context_lens [B] counting every token in the cache *including* the Q query tokens of this call.

Semantics (defined by `paged_attention_reference`):
  * q_len = query_lens[b] (default Q) real query rows; rows i >= q_len are padding and give 0.
  * prefix = context_len - q_len. Causal (tree_mask None, bottom-right aligned): query i sees positions
    p <= prefix + i. Tree: query i sees every p < prefix, plus p = prefix + j iff tree_mask[b, i, j].
  * Always p < context_len. A row that sees nothing (context_len 0, padding) gives exactly 0.
  * logits = sm_scale * q.k (then soft_cap * tanh(logits / soft_cap)); softmax and sums in float32.
  * int8 / fp8 pages are dequantised as pages.astype(f32) * scales[..., None].

Three implementations behind `impl=`:
  * "reference": gather every block into [B, M*S, Hkv, D], dense masked softmax. Defines the semantics.
  * "xla": online softmax over chunks of ~32 tokens, gathering only the chunk's blocks (a while loop up to the
    longest context). Reads each KV byte once; the fastest correct path measured on CPU ("auto" off-GPU).
  * "pallas": one program per (sequence, KV head, split) holding the Q*G query rows of that KV head; it loops
    over its share of the sequence's blocks, a few pages per step, with an online softmax, so nothing larger
    than one [rows, pages*S] logit tile ever exists; the splits (flash-decoding) are merged by a jnp epilogue.
    Its launch parameters (pages per step, splits, Triton warps and stages) come from `config=` (an
    `AttentionConfig`), else from the table of configs tuned on GPUs (`tuning.TUNED`, compiled on a GPU only), else
    from the defaults below.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _common as c
from pallas_kernels import tuning
from pallas_kernels.tuning import AttentionConfig

_XLA_CHUNK_TOKENS = 32  # tokens per online-softmax step of the XLA path (measured best on CPU: 32-64)


# ----------------------------------------------------------------------------------------------------- masks
def visibility(pos, context_lens, query_lens, tree_mask, num_queries: int) -> jax.Array:
    """Which key positions each query row may attend to.

    pos [keys] int32 key positions; context_lens, query_lens [B]; tree_mask [B, Q, Q] bool or None.
    Returns [B, Q, keys] bool.
    """
    qi = jnp.arange(num_queries, dtype=jnp.int32)[None, :, None]  # [1, Q, 1]
    p = pos[None, None, :]  # [1, 1, keys]
    ctx = context_lens[:, None, None]  # [B, 1, 1]
    qlen = query_lens[:, None, None]  # [B, 1, 1]
    prefix = ctx - qlen
    if tree_mask is None:
        seen = p <= prefix + qi
    else:
        j = p - prefix  # [B, 1, keys] index of the key among the query tokens
        in_tree = (j >= 0) & (j < qlen) & (j < num_queries)  # a traced qlen > Q: keys past Q are not in the tree
        jc = jnp.clip(j, 0, num_queries - 1)
        jc = jnp.broadcast_to(jc, (tree_mask.shape[0], num_queries, pos.shape[0]))
        tree = jnp.take_along_axis(tree_mask, jc, axis=2)  # [B, Q, keys]
        seen = (p < prefix) | (in_tree & tree)
    return seen & (p < ctx) & (p >= 0) & (qi < qlen)


def _soft_cap(logits, soft_cap):
    if soft_cap is None:
        return logits
    cap = jnp.float32(soft_cap)
    return cap * jnp.tanh(logits / cap)


# ------------------------------------------------------------------------------------------------ reference
@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap"))
def paged_attention_reference(
    q, k_pages, v_pages, block_tables, context_lens, *, query_lens=None, tree_mask=None, sm_scale=None,
    soft_cap=None, k_scales=None, v_scales=None,
):
    """Pure-jnp paged attention: gather all blocks, dense masked softmax in float32. Same contract as
    `paged_attention`; q [B, Q, Hq, D] -> [B, Q, Hq, D] in q.dtype."""
    B, Q, Hq, D = q.shape
    _, S, Hkv, _ = k_pages.shape
    M = block_tables.shape[1]
    G, keys = Hq // Hkv, M * S
    scale = jnp.float32(1.0 / math.sqrt(D) if sm_scale is None else sm_scale)
    if query_lens is None:
        query_lens = jnp.full((B,), Q, jnp.int32)
    k = c.dequantize_kv(k_pages, k_scales)[block_tables].reshape(B, keys, Hkv, D)
    v = c.dequantize_kv(v_pages, v_scales)[block_tables].reshape(B, keys, Hkv, D)
    seen = visibility(jnp.arange(keys, dtype=jnp.int32), context_lens, query_lens, tree_mask, Q)  # [B, Q, keys]
    in_ctx = jnp.arange(keys)[None, :] < context_lens[:, None]  # [B, keys]
    v = jnp.where(in_ctx[:, :, None, None], v, 0.0)  # NaN / garbage outside the context never reaches the sum

    qf = q.astype(jnp.float32).reshape(B, Q, Hkv, G, D)
    logits = jnp.einsum("bqhgd,blhd->bhgql", qf, k, precision=lax.Precision.HIGHEST) * scale
    logits = _soft_cap(logits, soft_cap)
    mask = seen[:, None, None, :, :]  # [B, 1, 1, Q, keys]
    logits = jnp.where(mask, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1)  # [B, Hkv, G, Q]
    out = jnp.einsum("bhgql,blhd->bhgqd", p, v, precision=lax.Precision.HIGHEST)
    # == 0, not > 0: a NaN in a visible key must give NaN, not a quiet zero row that hides the upstream bug.
    out = jnp.where(denom[..., None] == 0, 0.0, out / jnp.where(denom == 0, 1.0, denom)[..., None])
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, Q, Hq, D).astype(q.dtype)


# ------------------------------------------------------------------------------------------------- XLA path
@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "has_tree"))
def _paged_attention_xla(q, k_pages, v_pages, block_tables, context_lens, query_lens, tree_mask, k_scales,
                         v_scales, *, sm_scale, soft_cap, has_tree):
    B, Q, Hq, D = q.shape
    _, S, Hkv, _ = k_pages.shape
    M = block_tables.shape[1]
    G = Hq // Hkv
    pages = max(1, _XLA_CHUNK_TOKENS // S)  # blocks per step
    chunk = pages * S  # tokens per step
    M_pad = -(-M // pages) * pages
    tables = jnp.pad(block_tables, ((0, 0), (0, M_pad - M)))  # pad with the null block (masked anyway)
    # Keys end at the table (M * S) even if a traced context_lens runs past it, as in the reference: the padding
    # above is the null block, which must never be read as context.
    key_end = jnp.minimum(context_lens, M * S)
    tree = tree_mask if has_tree else None
    qf = jnp.transpose(q.astype(jnp.float32).reshape(B, Q, Hkv, G, D), (0, 2, 3, 1, 4)) * jnp.float32(sm_scale)

    def step(i, carry):
        m, l, acc = carry  # [B, Hkv, G, Q], [B, Hkv, G, Q], [B, Hkv, G, Q, D]
        ids = lax.dynamic_slice_in_dim(tables, i * pages, pages, axis=1)  # [B, pages]
        kc = c.dequantize_kv(k_pages[ids], None if k_scales is None else k_scales[ids]).reshape(B, chunk, Hkv, D)
        vc = c.dequantize_kv(v_pages[ids], None if v_scales is None else v_scales[ids]).reshape(B, chunk, Hkv, D)
        pos = i * chunk + jnp.arange(chunk, dtype=jnp.int32)
        vc = jnp.where((pos[None, :] < key_end[:, None])[:, :, None, None], vc, 0.0)
        in_table = (pos < M * S)[None, None, None, None, :]
        seen = visibility(pos, context_lens, query_lens, tree, Q)[:, None, None] & in_table  # [B, 1, 1, Q, chunk]
        s = jnp.einsum("bhgqd,bchd->bhgqc", qf, kc, precision=lax.Precision.HIGHEST)
        s = jnp.where(seen, _soft_cap(s, soft_cap), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(seen, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("bhgqc,bchd->bhgqd", p, vc, precision=lax.Precision.HIGHEST)
        return m_new, l, acc

    steps = (jnp.max(context_lens, initial=0) + chunk - 1) // chunk
    init = (jnp.full((B, Hkv, G, Q), -jnp.inf), jnp.zeros((B, Hkv, G, Q)), jnp.zeros((B, Hkv, G, Q, D)))
    _, l, acc = lax.fori_loop(0, jnp.minimum(steps, M_pad // pages), step, init)
    out = jnp.where(l[..., None] == 0, 0.0, acc / jnp.where(l == 0, 1.0, l)[..., None])  # NaN stays NaN
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, Q, Hq, D).astype(q.dtype)


# ---------------------------------------------------------------------------------------------- Pallas path
def _attention_kernel(*refs, S, PP, G, num_words, max_keys, steps_per_split, sm_scale, soft_cap, quantised, has_tree,
                      use_dot, dot_dtype):
    """Program (b, h, p): rows [num_rows, D] = the Q*G query rows of sequence b sharing KV head h, over steps
    [p * steps_per_split, (p + 1) * steps_per_split) of the sequence (split-K, flash-decoding style); step j
    gathers the PP blocks block_tables[b, j*PP : (j+1)*PP], i.e. chunk = PP*S tokens.
    Writes the normalised partial output [num_rows, D], its row max m [num_rows] and row sum l [num_rows]; the
    wrapper merges."""
    refs = list(refs)
    q_ref, bt_ref, ctx_ref, qlen_ref = refs[:4]
    bits_ref = refs[4] if has_tree else None
    k_ref, v_ref = refs[4 + has_tree: 6 + has_tree]
    ks_ref, vs_ref = (refs[6 + has_tree], refs[7 + has_tree]) if quantised else (None, None)
    o_ref, m_ref, l_ref = refs[-3:]

    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_rows, D = q_ref.shape
    ctx = ctx_ref[b]
    qlen = qlen_ref[b]
    prefix = ctx - qlen
    key_end = jnp.minimum(ctx, max_keys)  # max_keys = M * S: keys end at the table, never in the null-block padding
    q = q_ref[...]
    q = q.astype(jnp.float32) * jnp.float32(sm_scale) if dot_dtype == jnp.float32 else q
    chunk = PP * S  # tokens per step
    qi = lax.broadcasted_iota(jnp.int32, (num_rows, chunk), 0) // G  # query index of each row
    col = lax.broadcasted_iota(jnp.int32, (num_rows, chunk), 1)
    words = [bits_ref[b, w, :][:, None] for w in range(num_words)] if has_tree else []  # num_words x [num_rows, 1]
    precision = lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None

    def body(j, carry):
        m, l, acc = carry  # [num_rows], [num_rows], [num_rows, D] float32
        blk = bt_ref[b, pl.ds(j * PP, PP)]  # [PP] block ids
        k = k_ref[blk, :, h, :].reshape(chunk, D)  # gather PP pages -> [chunk, D]
        v = v_ref[blk, :, h, :].reshape(chunk, D)
        if quantised:
            k = k.astype(jnp.float32) * ks_ref[blk, :, h].reshape(chunk)[:, None]
            v = v.astype(jnp.float32) * vs_ref[blk, :, h].reshape(chunk)[:, None]
        pos = j * chunk + col  # [num_rows, chunk]
        if use_dot:
            s = jnp.dot(q, k.astype(dot_dtype).T, preferred_element_type=jnp.float32, precision=precision)
        else:
            s = jnp.sum(q.astype(jnp.float32)[:, None, :] * k.astype(jnp.float32)[None, :, :], axis=-1)
        if dot_dtype != jnp.float32:
            s = s * jnp.float32(sm_scale)
        s = _soft_cap(s, soft_cap)
        if has_tree:
            jj = jnp.clip(pos - prefix, 0, 32 * num_words - 1)
            word = words[0] if num_words == 1 else sum(jnp.where((jj >> 5) == w, words[w], 0) for w in range(num_words))
            in_tree = ((word >> (jj & 31)) & 1) == 1
            seen = (pos < prefix) | ((pos >= prefix) & in_tree)
        else:
            seen = pos <= prefix + qi
        seen = seen & (pos < key_end) & (qi < qlen)
        s = jnp.where(seen, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.where(seen, jnp.exp(s - m_safe[:, None]), 0.0)  # [num_rows, chunk]
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + jnp.sum(p, axis=1)
        in_ctx = (j * chunk + lax.broadcasted_iota(jnp.int32, (chunk, D), 0)) < key_end
        v = jnp.where(in_ctx, v.astype(jnp.float32), 0.0)  # garbage past the context never reaches the sum
        if use_dot:
            pv = jnp.dot(p.astype(dot_dtype), v.astype(dot_dtype), preferred_element_type=jnp.float32,
                         precision=precision)
        else:
            pv = jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
        return m_new, l, alpha[:, None] * acc + pv

    init = (jnp.full((num_rows,), -jnp.inf, jnp.float32), jnp.zeros((num_rows,), jnp.float32),
            jnp.zeros((num_rows, D), jnp.float32))
    first = split * steps_per_split
    last = jnp.minimum(first + steps_per_split, (key_end + chunk - 1) // chunk)
    m, l, acc = lax.fori_loop(first, jnp.maximum(first, last), body, init)
    o_ref[...] = jnp.where(l[:, None] == 0, 0.0, acc / jnp.where(l == 0, 1.0, l)[:, None])  # NaN stays NaN
    m_ref[...] = m
    l_ref[...] = l


def _merge_splits(o, m, l):
    """o [..., splits, rows, D] normalised partials, m/l [..., splits, rows] -> [..., rows, D]; rows that saw
    nothing give 0."""
    m_max = jnp.max(m, axis=-2, keepdims=True)  # [..., 1, rows]
    m_safe = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = l * jnp.exp(m - m_safe)  # [..., splits, rows]; 0 for splits that saw nothing
    total = jnp.sum(w, axis=-2)  # [..., rows]
    out = jnp.sum(w[..., None] * o, axis=-3)
    return jnp.where(total[..., None] == 0, 0.0, out / jnp.where(total == 0, 1.0, total)[..., None])


def default_num_splits(B: int, Hkv: int, steps: int, interpret: bool) -> int:
    """Split-K factor: enough (b, h, split) programs to fill a GPU (~8 per SM); 1 when interpreting."""
    if interpret:
        return 1
    cores = getattr(jax.devices()[0], "core_count", None) or 132
    return max(1, min(steps, -(-8 * cores // (B * Hkv))))


def default_pages_per_step(S: int) -> int:
    """Blocks gathered per loop step: 64 tokens per step (a power of two, so Triton tensors stay powers of two);
    also makes every step wide enough for tl.dot when S < 16."""
    return max(1, 64 // S)


DEFAULT_NUM_WARPS = 4  # Triton launch parameters when neither config= nor the tuned table gives them
DEFAULT_NUM_STAGES = 2


def resolve_config(config: AttentionConfig | None, *, B: int, Hkv: int, S: int, M: int,
                   interpret: bool) -> AttentionConfig:
    """`config` with every None field replaced by the default for B sequences, Hkv KV heads, block size S and
    table width M: `default_pages_per_step(S)`, `default_num_splits` over the steps those pages give, 4 warps,
    2 stages. The result is what the Pallas kernel is launched with (it still caps the pages at the table and the
    splits at the steps)."""
    config = AttentionConfig() if config is None else config
    pages = default_pages_per_step(S) if config.pages_per_step is None else config.pages_per_step
    steps = -(-M // pages)
    splits = default_num_splits(B, Hkv, steps, interpret) if config.num_splits is None else config.num_splits
    warps = DEFAULT_NUM_WARPS if config.num_warps is None else config.num_warps
    stages = DEFAULT_NUM_STAGES if config.num_stages is None else config.num_stages
    return AttentionConfig(pages_per_step=pages, num_splits=splits, num_warps=warps, num_stages=stages)


def _tree_bits(tree_mask, num_words: int) -> jax.Array:
    """tree_mask [B, Q, Q] bool -> [B, num_words, Q] int32 bit words: bit j % 32 of word j // 32 is
    tree_mask[b, i, j]."""
    B, Q, _ = tree_mask.shape
    t = jnp.pad(tree_mask, ((0, 0), (0, 0), (0, 32 * num_words - Q))).reshape(B, Q, num_words, 32).astype(jnp.uint32)
    weights = jnp.arange(32, dtype=jnp.uint32)[None, None, None, :]
    bits = jnp.sum(t << weights, axis=-1, dtype=jnp.uint32)  # [B, Q, num_words]
    return jnp.transpose(lax.bitcast_convert_type(bits, jnp.int32), (0, 2, 1))


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "has_tree", "interpret", "num_splits",
                                             "pages_per_step", "num_warps", "num_stages"))
def _paged_attention_pallas(q, k_pages, v_pages, block_tables, context_lens, query_lens, tree_mask, k_scales,
                            v_scales, *, sm_scale, soft_cap, has_tree, interpret, num_splits, pages_per_step,
                            num_warps=DEFAULT_NUM_WARPS, num_stages=DEFAULT_NUM_STAGES):
    B, Q, Hq, D = q.shape
    _, S, Hkv, _ = k_pages.shape
    G = Hq // Hkv
    quantised = k_scales is not None
    # bf16 operands (f32 accumulation) only when both q and pages are bf16; otherwise exact f32 dots.
    both_bf16 = q.dtype == jnp.bfloat16 and k_pages.dtype == jnp.bfloat16
    dot_dtype = jnp.dtype(jnp.bfloat16) if both_bf16 else jnp.dtype(jnp.float32)
    # Blocks per step: a power of two (Triton loads), no more than the table needs; the table is padded to whole
    # steps with the null block (masked by context_lens).
    PP = min(pl.next_power_of_2(max(1, pages_per_step)), pl.next_power_of_2(block_tables.shape[1]))
    use_dot = PP * S >= 16 and D >= 16  # Triton's tl.dot needs every dimension >= 16
    num_rows = Q * G
    rows_padded = max(16 if use_dot else 1, pl.next_power_of_2(num_rows))  # Triton tensors are powers of two
    rows = jnp.transpose(q.reshape(B, Q, Hkv, G, D), (0, 2, 1, 3, 4)).reshape(B, Hkv, num_rows, D)
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, rows_padded - num_rows), (0, 0)))
    if quantised or q.dtype != dot_dtype:
        rows = rows.astype(dot_dtype)
    num_words = -(-Q // 32)
    M = block_tables.shape[1]
    steps = -(-M // PP)
    tables = jnp.pad(block_tables, ((0, 0), (0, steps * PP - M)))  # whole steps; padding is the null block
    inputs = [rows, tables, context_lens, query_lens]
    if has_tree:
        # [B, num_words, num_rows]: row r belongs to query r // G
        bits = jnp.repeat(_tree_bits(tree_mask, num_words), G, axis=2)
        inputs.append(jnp.pad(bits, ((0, 0), (0, 0), (0, rows_padded - num_rows))))
    inputs += [k_pages, v_pages] + ([k_scales, v_scales] if quantised else [])
    splits = max(1, min(num_splits, steps))
    whole = pl.no_block_spec
    in_specs = [pl.BlockSpec((None, None, rows_padded, D), lambda b, h, p: (b, h, 0, 0))] + [whole] * (len(inputs) - 1)
    kernel = functools.partial(
        _attention_kernel, S=S, PP=PP, G=G, num_words=num_words, max_keys=M * S,
        steps_per_split=-(-steps // splits), sm_scale=sm_scale, soft_cap=soft_cap, quantised=quantised,
        has_tree=has_tree, use_dot=use_dot, dot_dtype=dot_dtype)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, Hkv, splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, rows_padded, D), lambda b, h, p: (b, h, p, 0, 0)),
                   pl.BlockSpec((None, None, None, rows_padded), lambda b, h, p: (b, h, p, 0)),
                   pl.BlockSpec((None, None, None, rows_padded), lambda b, h, p: (b, h, p, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, Hkv, splits, rows_padded, D), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hkv, splits, rows_padded), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hkv, splits, rows_padded), jnp.float32)],
        interpret=interpret,
        name="skvs_paged_attention",
        **c.pallas_kwargs(interpret, num_warps=num_warps, num_stages=num_stages),
    )(*inputs)
    out = _merge_splits(o, m, l)[:, :, :num_rows].reshape(B, Hkv, Q, G, D)  # [B, Hkv, Q, G, D]
    return jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(B, Q, Hq, D).astype(q.dtype)


# ----------------------------------------------------------------------------------------------- public API
F32_MAX = float(np.finfo(np.float32).max)


def _check_args(q, k_pages, v_pages, block_tables, context_lens, query_lens, tree_mask, sm_scale, soft_cap,
                k_scales, v_scales):
    c.check_ndim("q", q, 4, "[B, Q, Hq, D]")
    c.check_dtype("q", q, c.FLOAT_KV_DTYPES)
    c.check_kv_pages(k_pages, v_pages, k_scales, v_scales)
    B, Q, Hq, D = q.shape
    N, S, Hkv, Dk = k_pages.shape
    M = block_tables.shape[1] if len(getattr(block_tables, "shape", ())) == 2 else 1
    for name, size in (("the head dim D of q", D), ("the heads Hq of q", Hq),  # k_pages: check_kv_pages
                       ("the table width M of block_tables", M)):
        if size < 1:  # B = 0 sequences or Q = 0 queries are fine: an empty output
            raise ValueError(f"{name} must be >= 1, got {size}")
    if Dk != D:
        raise ValueError(f"k_pages head dim {Dk} must equal q head dim {D}")
    if Hq % Hkv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of the KV heads of k_pages ({Hkv})")
    c.check_block_tables(block_tables, B)
    c.check_int32_vector("context_lens", context_lens, B)
    if query_lens is not None:
        c.check_int32_vector("query_lens", query_lens, B)
    if tree_mask is not None:
        c.check_shape("tree_mask", tree_mask, (B, Q, Q), "[B, Q, Q]")
        c.check_dtype("tree_mask", tree_mask, (jnp.bool_,))
    for name, value in (("sm_scale", sm_scale), ("soft_cap", soft_cap)):  # static: they shape the program
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a float or None, got {type(value).__name__}")
        # Used as float32: 1e39 is finite here but inf there. inf * tanh(x / inf) is NaN.
        if not (math.isfinite(value) and abs(value) <= F32_MAX) or (name == "soft_cap" and value <= 0):
            raise ValueError(f"{name} must be a finite{' positive' if name == 'soft_cap' else ''} float or None "
                             f"(None: {'1 / sqrt(D)' if name == 'sm_scale' else 'no cap'}), got {value!r}")
    # Eager value checks (skipped under tracing).
    M = block_tables.shape[1]
    bt = c.concrete(block_tables)
    if bt is not None and bt.size and (bt.min() < 0 or bt.max() >= N):
        raise ValueError(f"block_tables entries must lie in [0, {N}), got range [{bt.min()}, {bt.max()}]")
    ctx = c.concrete(context_lens)
    if ctx is not None and ctx.size and (ctx.min() < 0 or ctx.max() > M * S):
        raise ValueError(f"context_lens must lie in [0, M * S = {M * S}], got range [{ctx.min()}, {ctx.max()}]")
    ql = c.concrete(query_lens)
    if ql is not None and ql.size and (ql.min() < 0 or ql.max() > Q):
        raise ValueError(f"query_lens must lie in [0, Q = {Q}], got range [{ql.min()}, {ql.max()}]")
    if ql is not None and ctx is not None and np.any(ql > ctx):
        raise ValueError("query_lens must not exceed context_lens (the query tokens are part of the context)")


def paged_attention(
    q, k_pages, v_pages, block_tables, context_lens, *, query_lens=None, tree_mask=None, sm_scale=None,
    soft_cap=None, k_scales=None, v_scales=None, impl="auto", interpret=None, config=None,
):
    """Attention of Q query tokens per sequence over a paged KV cache.

    q [B, Q, Hq, D] f32/bf16; k_pages, v_pages [N, S, Hkv, D] f32/bf16/int8/float8_e4m3fn; block_tables [B, M]
    int32; context_lens [B] int32 (including the query tokens); query_lens [B] int32 or None; tree_mask
    [B, Q, Q] bool or None; k_scales, v_scales [N, S, Hkv] f32 for quantised pages. Returns [B, Q, Hq, D] in
    q.dtype. impl: "auto" | "pallas" | "xla" | "reference". See the module docstring for the masks.
    config: an `AttentionConfig` (the Pallas kernel's launch parameters; its None fields take the defaults) or
    None: the entry of `tuning.TUNED` for this GPU and shape when the kernel runs compiled on a GPU, else the
    defaults (`resolve_config`). Other implementations ignore it; it never changes the result beyond rounding.
    """
    _check_args(q, k_pages, v_pages, block_tables, context_lens, query_lens, tree_mask, sm_scale, soft_cap,
                k_scales, v_scales)
    tuning.check_config(config)
    impl, interpret = c.resolve_impl(impl, interpret)
    if q.shape[0] == 0 or q.shape[1] == 0:  # nothing to attend for: no kernel launch with an empty grid
        return jnp.zeros(q.shape, q.dtype)
    D = q.shape[-1]
    scale = float(1.0 / math.sqrt(D) if sm_scale is None else sm_scale)
    cap = None if soft_cap is None else float(soft_cap)
    if impl == "reference":
        return paged_attention_reference(
            q, k_pages, v_pages, block_tables, context_lens, query_lens=query_lens, tree_mask=tree_mask,
            sm_scale=scale, soft_cap=cap, k_scales=k_scales, v_scales=v_scales)
    if query_lens is None:
        query_lens = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
    if impl == "pallas" and not interpret:
        S = k_pages.shape[1]
        for name, n in (("block size S of k_pages", S), ("head dim D of q", D)):
            if n & (n - 1):
                raise ValueError(f"compiled Pallas (Triton) path needs a power-of-two {name}, got {n}")
    fn = _paged_attention_pallas if impl == "pallas" else _paged_attention_xla
    extra = {}
    if impl == "pallas":
        (B, Q, Hq, _), (_, S, Hkv, _), M = q.shape, k_pages.shape, block_tables.shape[1]
        if config is None and not interpret and c.on_gpu():  # tuned on a GPU, for a GPU: never consulted elsewhere
            config = tuning.lookup(jax.devices()[0].device_kind, dtype=k_pages.dtype, Q=Q, G=Hq // Hkv, D=D, S=S,
                                   context=M * S)
        launch = resolve_config(config, B=B, Hkv=Hkv, S=S, M=M, interpret=interpret)
        extra = {"interpret": interpret, **dataclasses.asdict(launch)}
    return fn(q, k_pages, v_pages, block_tables, context_lens, query_lens, tree_mask, k_scales, v_scales,
              sm_scale=scale, soft_cap=cap, has_tree=tree_mask is not None, **extra)
