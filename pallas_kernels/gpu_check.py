"""`python -m pallas_kernels.gpu_check`: on a GPU, check the compiled Pallas kernels against the references, then
time decode and draft verification against jax's own Pallas paged-attention kernel, the XLA path, and the
device's measured copy bandwidth, printing one table.

Without a GPU it says so and exits 2; `--cpu-smoke` runs the same script end to end on CPU with the Pallas
kernels interpreted and tiny sizes (a check of the script, not of the GPU).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

TOL = {"float32": 1e-5, "bfloat16": 1e-2, "int8": 1e-5, "float8_e4m3fn": 1e-5}


def _case(rng, *, B, Q, Hq, Hkv, D, S, ctx, dtype, tree=False):
    """Random paged cache (shuffled block tables, NaN in unused blocks) and queries."""
    M = -(-ctx // S)
    N = B * M + 1
    tables = jnp.asarray(rng.permutation(np.arange(1, N)).reshape(B, M).astype(np.int32))
    k = rng.standard_normal((N, S, Hkv, D), np.float32)
    v = rng.standard_normal((N, S, Hkv, D), np.float32)
    k[0] = v[0] = np.nan
    kw = {}
    if dtype in ("int8", "float8_e4m3fn"):
        k_pages, ks = pk.quantize_kv(jnp.asarray(np.nan_to_num(k)), dtype)
        v_pages, vs = pk.quantize_kv(jnp.asarray(np.nan_to_num(v)), dtype)
        kw = dict(k_scales=ks.at[0].set(jnp.nan), v_scales=vs.at[0].set(jnp.nan))
        q_dtype = jnp.float32
    else:
        k_pages, v_pages, q_dtype = jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.dtype(dtype)
    lens = jnp.asarray(rng.integers(max(Q, ctx // 2), ctx + 1, B).astype(np.int32))
    q = jnp.asarray(rng.standard_normal((B, Q, Hq, D), np.float32), q_dtype)
    if tree:
        kw["tree_mask"] = jnp.asarray((rng.random((B, Q, Q)) < 0.5) | np.tril(np.eye(Q, dtype=bool))[None])
    return (q, k_pages, v_pages, tables, lens), kw


def _median_time(fn, *args, repeats):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes, repeats):
    """Device-to-device GB/s (read + write) of an in-place elementwise op over `nbytes` bytes."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    neg = jax.jit(jnp.negative, donate_argnums=0)
    x = jax.block_until_ready(neg(x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = jax.block_until_ready(neg(x))
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / statistics.median(times) / 1e9


def _error(e: Exception) -> str:
    """One line for a failure, so the first run on a new GPU or jax reports every case, not the first crash."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"ERROR {type(e).__name__}: {first[:160]}"


def check_correctness(rng, interpret, small):
    """Compiled (or interpreted) Pallas vs reference for every op; returns False on any mismatch."""
    ok = True
    D, S = (16, 16) if small else (128, 16)
    configs = [("decode", 1, False), ("verify K=4", 5, False), ("tree Q=8", 8, True)]
    print("correctness: Pallas vs reference (max |diff| / max |ref|)")
    for dtype in ("float32", "bfloat16", "int8", "float8_e4m3fn"):
        for name, Q, tree in configs:
            args, kw = _case(rng, B=3, Q=Q, Hq=8, Hkv=2, D=D, S=S, ctx=70, dtype=dtype, tree=tree)
            try:
                got = pk.paged_attention(*args, **kw, impl="pallas", interpret=interpret).astype(jnp.float32)
                want = pk.paged_attention(*args, **kw, impl="reference").astype(jnp.float32)
            except Exception as e:  # noqa: BLE001 - report and go on to the next case
                ok = False
                print(f"  paged_attention {dtype:14s} {name:11s} {_error(e)}")
                continue
            err = float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1.0))
            good = bool(jnp.all(jnp.isfinite(got))) and err <= TOL[dtype]
            ok &= good
            print(f"  paged_attention {dtype:14s} {name:11s} rel err {err:.2e}  {'ok' if good else 'FAIL'}")
    for dtype in ("float32", "int8"):
        args, kw = _case(rng, B=2, Q=1, Hq=4, Hkv=2, D=D, S=S, ctx=40, dtype=dtype)
        _, kp, vp, tables, _ = args
        sc = {k: v for k, v in kw.items() if k in ("k_scales", "v_scales")}
        new = jnp.asarray(rng.standard_normal((6, 2, D), np.float32))
        slots = jnp.asarray([3, -1, 17, 40, 41, 5], jnp.int32)
        acc = jnp.asarray(rng.random((2, 4)) < 0.5)
        start = jnp.asarray([5, 20], jnp.int32)
        for name, op, op_args in (("write_kv", pk.write_kv, (kp, vp, new, new, slots)),
                                  ("invalidate_drafts", pk.invalidate_drafts, (kp, vp, tables, start, acc))):
            try:
                a = op(*op_args, **sc, impl="pallas", interpret=interpret)
                b = op(*op_args, **sc, impl="reference")
            except Exception as e:  # noqa: BLE001
                ok = False
                print(f"  {name} {dtype}: {_error(e)}")
                continue
            same = all(bool(jnp.array_equal(x.astype(jnp.float32), y.astype(jnp.float32), equal_nan=True))
                       for x, y in zip(a, b))
            ok &= same
            print(f"  {name} {dtype}: {'ok' if same else 'FAIL'}")
    states = jnp.asarray(rng.integers(0, 5, 1000), jnp.int8)
    gens = jnp.zeros((1000,), jnp.int32)
    ids = jnp.asarray(rng.integers(0, 1000, (64, 8)), jnp.int32)
    acc, val = jnp.asarray(rng.random((64, 8)) < 0.5), jnp.asarray(rng.random((64, 8)) < 0.9)
    try:
        a = pk.update_block_states(states, gens, ids, acc, val, 7, impl="pallas", interpret=interpret)
        b = pk.update_block_states(states, gens, ids, acc, val, 7, impl="reference")
    except Exception as e:  # noqa: BLE001
        print(f"  update_block_states: {_error(e)}")
        return False
    same = all(bool(jnp.array_equal(x, y)) for x, y in zip(a, b))
    ok &= same
    print(f"  update_block_states: {'ok' if same else 'FAIL'} (num_stale {int(a[2])})")
    return ok


def _time_or_nan(label, fn, *args, repeats):
    try:
        return _median_time(fn, *args, repeats=repeats)
    except Exception as e:  # noqa: BLE001 - one failing implementation leaves the others' figures
        print(f"  {label}: {_error(e)}")
        return float("nan")


def benchmark(rng, interpret, small, repeats):
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    B, Hq, Hkv, D, S = (4, 8, 2, 16, 16) if small else (32, 32, 8, 128, 16)
    contexts = (256,) if small else (512, 2048, 8192)
    dtype = "bfloat16"
    rows = []
    for ctx in contexts:
        for name, Q in (("decode Q=1", 1), ("verify Q=5 (K=4)", 5)):
            (q, kp, vp, tables, lens), _ = _case(rng, B=B, Q=Q, Hq=Hq, Hkv=Hkv, D=D, S=S, ctx=ctx, dtype=dtype)
            kp, vp = jnp.nan_to_num(kp), jnp.nan_to_num(vp)
            kv_bytes = float(jnp.sum(lens)) * Hkv * D * 2 * 2
            ours = jax.jit(lambda *a: pk.paged_attention(*a, impl="pallas", interpret=interpret))
            xla = jax.jit(lambda *a: pk.paged_attention(*a, impl="xla"))
            # jax's kernel is single-query: run verification as B*Q decode rows, row i of a sequence seeing
            # context_len - Q + i + 1 tokens (exactly the causal mask), on its [Hkv, N, S, D] layout.
            kh, vh = jnp.transpose(kp, (2, 0, 1, 3)), jnp.transpose(vp, (2, 0, 1, 3))
            q_rows = q.reshape(B * Q, Hq, D)
            t_rows = jnp.repeat(tables, Q, axis=0)
            l_rows = (lens[:, None] - Q + 1 + jnp.arange(Q, dtype=jnp.int32)[None, :]).reshape(-1)
            splits = math.gcd(16, tables.shape[1])
            pages = min(8, tables.shape[1] // splits)
            theirs = jax.jit(lambda qq, tt, ll, kh=kh, vh=vh, splits=splits, pages=pages: jax_paged.paged_attention(
                qq * (1 / math.sqrt(D)), kh, vh, tt, ll, k_splits=splits, pages_per_compute_block=pages,
                interpret=interpret))
            t_ours = _time_or_nan(f"skvs pallas {name} ctx {ctx}", ours, q, kp, vp, tables, lens, repeats=repeats)
            t_xla = _time_or_nan(f"skvs xla {name} ctx {ctx}", xla, q, kp, vp, tables, lens, repeats=repeats)
            t_jax = _time_or_nan(f"jax pallas {name} ctx {ctx}", theirs, q_rows, t_rows, l_rows, repeats=repeats)
            try:
                err = float(jnp.max(jnp.abs(ours(q, kp, vp, tables, lens).astype(jnp.float32)
                                            - theirs(q_rows, t_rows, l_rows).reshape(q.shape).astype(jnp.float32))))
            except Exception:  # noqa: BLE001 - already reported by the timing
                err = float("nan")
            rows.append((f"{name} ctx {ctx}", t_ours, t_jax, t_xla, kv_bytes, err))
    copy = copy_bandwidth(int(B * max(contexts) * Hkv * D * 2 * 2), repeats)
    print(f"\ntiming: B={B} context<= ctx (per row) Hq={Hq} Hkv={Hkv} D={D} S={S} bf16, {repeats} repeats, median; "
          f"device copy bandwidth (read+write) {copy:.1f} GB/s")
    print(f"{'case':28s} {'skvs pallas':>12s} {'jax pallas':>12s} {'skvs xla':>12s} {'skvs GB/s':>10s} "
          f"{'% of copy':>9s} {'|skvs-jax|':>10s}")
    for name, t_ours, t_jax, t_xla, kv_bytes, err in rows:
        gbs = kv_bytes / t_ours / 1e9
        print(f"{name:28s} {t_ours * 1e3:10.3f}ms {t_jax * 1e3:10.3f}ms {t_xla * 1e3:10.3f}ms {gbs:10.1f} "
              f"{gbs / copy:9.1%} {err:10.2e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pallas_kernels.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="run on CPU with interpreted kernels, tiny sizes")
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    if not on_gpu and not a.cpu_smoke:
        print("no GPU visible: nothing checked (use --cpu-smoke to exercise this script on CPU)")
        return 2
    interpret, small = not on_gpu, not on_gpu
    rng = np.random.default_rng(0)
    ok = check_correctness(rng, interpret, small)
    benchmark(rng, interpret, small, a.repeats if on_gpu else 2)
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
