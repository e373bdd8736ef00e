"""`skvs micro attention`: paged decode attention (the XLA path "auto" takes off-GPU) vs dense attention over the
same KV stored contiguously, in one process, interleaved repeat by repeat so machine noise hits both alike.

Dense is timed three ways and the fastest is the baseline: (a) one einsum softmax over [B, ctx, Hkv, D];
(b) the paged path's chunked online softmax written over contiguous KV with dynamic slices; (c) the paged code
itself over the contiguous KV through the identity block table. The ratio therefore measures the cost of
paging (scattered blocks read through a shuffled table), not an algorithm difference.

KV read bandwidth = bytes of K and V inside the context lengths / median time, compared with this machine's
copy bandwidth (bytes read + written by an in-place elementwise op over a buffer of the same size).
The last line is exactly `paged/dense time ratio: <r>`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _common as c
from pallas_kernels.attention import paged_attention

CHUNK = 32  # tokens per online-softmax step, as in the paged XLA path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=32, help="sequences B")
    p.add_argument("--context", type=int, default=2048, help="context length of every sequence")
    p.add_argument("--heads", type=int, default=32, help="query heads Hq")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads Hkv")
    p.add_argument("--head-dim", type=int, default=128, help="head dim D")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block S")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="q and KV dtype")
    p.add_argument("--repeats", type=int, default=10, help="timed calls of each variant (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls of each variant after compiling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--with-reference", action="store_true",
                   help="also time the gather-then-dense reference path (why 'auto' chunks instead)")


def _parse(argv):
    p = argparse.ArgumentParser(prog="skvs micro attention", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return p.parse_args(argv)


@jax.jit
def dense_einsum(q, k, v, lens):
    """q [B, 1, Hq, D], k/v [B, ctx, Hkv, D] contiguous, lens [B] -> [B, 1, Hq, D]; one masked softmax."""
    B, _, Hq, D = q.shape
    ctx, Hkv = k.shape[1], k.shape[2]
    qf = q.astype(jnp.float32).reshape(B, Hkv, Hq // Hkv, D) * jnp.float32(1 / math.sqrt(D))
    s = jnp.einsum("bhgd,blhd->bhgl", qf, k.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    mask = (jnp.arange(ctx)[None, :] < lens[:, None])[:, None, None, :]
    s = jnp.where(mask, s, -jnp.inf)
    p = jnp.where(mask, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
    o = jnp.einsum("bhgl,blhd->bhgd", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return (o / jnp.sum(p, axis=-1)[..., None]).reshape(B, 1, Hq, D).astype(q.dtype)


@jax.jit
def dense_chunked(q, k, v, lens):
    """Same contract as dense_einsum; online softmax over CHUNK-token slices of the contiguous KV."""
    B, _, Hq, D = q.shape
    ctx, Hkv = k.shape[1], k.shape[2]
    qf = q.astype(jnp.float32).reshape(B, Hkv, Hq // Hkv, D) * jnp.float32(1 / math.sqrt(D))

    def step(i, carry):
        m, l, acc = carry
        kc = lax.dynamic_slice_in_dim(k, i * CHUNK, CHUNK, axis=1).astype(jnp.float32)
        vc = lax.dynamic_slice_in_dim(v, i * CHUNK, CHUNK, axis=1).astype(jnp.float32)
        mask = ((i * CHUNK + jnp.arange(CHUNK))[None, :] < lens[:, None])[:, None, None, :]
        s = jnp.where(mask, jnp.einsum("bhgd,bchd->bhgc", qf, kc, precision=lax.Precision.HIGHEST), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.exp(m - m_safe)
        acc = alpha[..., None] * acc + jnp.einsum("bhgc,bchd->bhgd", p, vc, precision=lax.Precision.HIGHEST)
        return m_new, alpha * l + jnp.sum(p, axis=-1), acc

    G = Hq // Hkv
    init = (jnp.full((B, Hkv, G), -jnp.inf), jnp.zeros((B, Hkv, G)), jnp.zeros((B, Hkv, G, D)))
    _, l, acc = lax.fori_loop(0, ctx // CHUNK, step, init)
    return (acc / l[..., None]).reshape(B, 1, Hq, D).astype(q.dtype)


def _time_once(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """GB/s (read + write) of a jitted elementwise negation over a float32 buffer of `nbytes` bytes, in place
    (donated), so that the figure is memory traffic and not the page faults of a fresh output allocation."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    neg = jax.jit(jnp.negative, donate_argnums=0)
    x = jax.block_until_ready(neg(x))
    times = []
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        x = jax.block_until_ready(neg(x))
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / statistics.median(times) / 1e9


def main(argv: list[str]) -> int:
    return run(_parse(argv))


def run(a: argparse.Namespace) -> int:
    for flag in ("batch", "context", "heads", "kv_heads", "head_dim", "block_size", "repeats"):
        if getattr(a, flag) < 1:
            raise SystemExit(f"skvs micro attention: --{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if a.warmup < 0:
        raise SystemExit(f"skvs micro attention: --warmup must be >= 0, got {a.warmup}")
    B, ctx, Hq, Hkv, D, S = a.batch, a.context, a.heads, a.kv_heads, a.head_dim, a.block_size
    if ctx % S or ctx % CHUNK or Hq % Hkv:
        raise SystemExit("skvs micro attention: --context must be a multiple of --block-size and of 32, and --heads "
                         "a multiple of --kv-heads")
    dtype = jnp.dtype(a.dtype)
    M = ctx // S
    N = B * M + 1  # + the null block 0
    rng = np.random.default_rng(a.seed)
    k = jnp.asarray(rng.standard_normal((B, ctx, Hkv, D), np.float32), dtype)  # contiguous KV, [B, ctx, Hkv, D]
    v = jnp.asarray(rng.standard_normal((B, ctx, Hkv, D), np.float32), dtype)
    q = jnp.asarray(rng.standard_normal((B, 1, Hq, D), np.float32), dtype)
    lens = jnp.full((B,), ctx, jnp.int32)
    tables = jnp.asarray(rng.permutation(np.arange(1, N)).reshape(B, M).astype(np.int32))  # non-contiguous
    order = jnp.argsort(tables.reshape(-1))
    k_pages = jnp.concatenate([jnp.zeros((1, S, Hkv, D), dtype), k.reshape(B * M, S, Hkv, D)[order]])
    v_pages = jnp.concatenate([jnp.zeros((1, S, Hkv, D), dtype), v.reshape(B * M, S, Hkv, D)[order]])

    paged = jax.jit(lambda *x: paged_attention(*x, impl="auto"))
    identity = jnp.arange(B * M, dtype=jnp.int32).reshape(B, M)  # contiguous KV seen through a trivial table
    k_flat, v_flat = k.reshape(B * M, S, Hkv, D), v.reshape(B * M, S, Hkv, D)
    variants = {"dense (einsum)": (dense_einsum, (q, k, v, lens)),
                "dense (chunked online softmax)": (dense_chunked, (q, k, v, lens)),
                "dense (paged code, contiguous)": (paged, (q, k_flat, v_flat, identity, lens)),
                "paged (impl=auto)": (paged, (q, k_pages, v_pages, tables, lens))}
    if a.with_reference:
        gather_dense = jax.jit(lambda *x: paged_attention(*x, impl="reference"))
        variants["paged (gather-then-dense)"] = (gather_dense, (q, k_pages, v_pages, tables, lens))
    outs = {name: jax.block_until_ready(fn(*args)) for name, (fn, args) in variants.items()}
    ref = np.asarray(outs["dense (einsum)"].astype(jnp.float32))
    for name, out in outs.items():
        err = float(np.max(np.abs(np.asarray(out.astype(jnp.float32)) - ref)))
        if err > (1e-4 if dtype == jnp.float32 else 3e-2):
            raise SystemExit(f"skvs micro attention: {name} disagrees with dense attention: max abs err {err:.3g}")
    for _ in range(a.warmup):
        for fn, args in variants.values():
            _time_once(fn, *args)
    times = {name: [] for name in variants}
    for _ in range(a.repeats):  # interleaved: noise from other processes hits every variant alike
        for name, (fn, args) in variants.items():
            times[name].append(_time_once(fn, *args))
    med = {name: statistics.median(t) for name, t in times.items()}

    kv_bytes = 2 * B * ctx * Hkv * D * dtype.itemsize
    copy_gbs = copy_bandwidth(kv_bytes, a.repeats)
    kind = "Pallas" if c.on_gpu() else "XLA"
    print(f"setup: backend={jax.default_backend()} jax={jax.__version__} devices={len(jax.devices())}; "
          f"B={B} context={ctx} Hq={Hq} Hkv={Hkv} D={D} block_size={S} dtype={dtype.name}; "
          f"KV {kv_bytes / 1e6:.1f} MB; paged path = {kind}; {a.repeats} interleaved repeats")
    print(f"copy bandwidth (jitted negate, read+write): {copy_gbs:.2f} GB/s")
    for name, t in med.items():
        gbs = kv_bytes / t / 1e9
        print(f"{name:32s} median {t * 1e3:9.2f} ms   KV read {gbs:7.2f} GB/s = {gbs / copy_gbs:5.1%} of copy")
    dense_name = min((name for name in med if name.startswith("dense")), key=med.get)
    print(f"baseline: {dense_name}")
    print(f"paged/dense time ratio: {med['paged (impl=auto)'] / med[dense_name]:.3f}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
