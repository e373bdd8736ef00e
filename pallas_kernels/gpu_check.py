"""`python -m pallas_kernels.gpu_check`: on a GPU, check the compiled Pallas kernels against the references, then
time decode and draft verification against jax's own Pallas paged-attention kernel, the XLA path, and the
device's measured copy bandwidth, printing one table. `tune` (run by `skvs gpu-check --only tune`) sweeps the
attention kernel's launch parameters (`tuning.AttentionConfig`) and reports the best per shape, the rows from
which `tuning.TUNED` is filled by hand.

Without a GPU it says so and exits 2; `--cpu-smoke` runs the same script end to end on CPU with the Pallas
kernels interpreted and tiny sizes (a check of the script, not of the GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels import attention, tuning

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


def benchmark(rng, interpret, small, repeats) -> list[dict]:
    """Time decode and verification (ours compiled, jax's Pallas kernel, our XLA path); print one table and return
    its rows (times in ms, NaN for a case that failed)."""
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
    out = []
    for name, t_ours, t_jax, t_xla, kv_bytes, err in rows:
        gbs = kv_bytes / t_ours / 1e9
        print(f"{name:28s} {t_ours * 1e3:10.3f}ms {t_jax * 1e3:10.3f}ms {t_xla * 1e3:10.3f}ms {gbs:10.1f} "
              f"{gbs / copy:9.1%} {err:10.2e}")
        out.append({"case": name, "skvs_pallas_ms": t_ours * 1e3, "jax_pallas_ms": t_jax * 1e3,
                    "skvs_xla_ms": t_xla * 1e3, "kv_bytes": kv_bytes, "skvs_gb_s": gbs, "copy_gb_s": copy,
                    "copy_fraction": gbs / copy, "max_abs_diff_vs_jax": err})
    return out  # NaN where a case failed (reported above)


# ------------------------------------------------------------------------------------------------- the sweep
# Peak HBM bytes/s by device kind (the SXM parts' datasheet figures; a PCIe H100 has 2.0e12): the roofline the
# sweep reports against, beside the measured copy bandwidth. Unknown kinds get no peak.
HBM_PEAK_B_S = {"H100": 3.35e12, "H200": 4.8e12}
TUNE_DIMS = {"B": 32, "Hq": 32, "Hkv": 8, "D": 128, "S": 16}  # Llama-3.1-8B's attention, a decode batch of 32
TUNE_DIMS_SMALL = {"B": 2, "Hq": 8, "Hkv": 2, "D": 16, "S": 16}
TUNE_CONTEXTS, TUNE_CONTEXTS_SMALL = (512, 2048, 8192), (64,)
TUNE_CASES = (("decode Q=1", 1), ("verify Q=5 (K=4)", 5))
TUNE_POOL_BYTES = 2**30  # K + V: ~20x an H100's or H200's 50 MB L2, so a timed call cannot read from L2
MAX_TUNE_CONFIGS = 24  # per shape: at most 13 tilings + TOP_TILINGS * len(LAUNCHES) = 9 launch variants
LAUNCHES = ((4, 3), (8, 2), (8, 3))  # (num_warps, num_stages) tried on the best tilings, beside the default (4, 2)
TOP_TILINGS = 3  # tilings of the first phase that the second retries with LAUNCHES
VERIFY_GOAL = 1.2  # verification's time over decode's at equal context, each at its best config


def hbm_peak(device_kind: str) -> float | None:
    """Peak HBM bytes/s of a device kind (`HBM_PEAK_B_S`), or None if it is not known."""
    return next((peak for name, peak in HBM_PEAK_B_S.items() if name in device_kind), None)


def tilings(*, B, Hkv, S, M, interpret, small) -> list[pk.AttentionConfig]:
    """The sweep's first phase: pages per step in {1, 2, 4, 8} x splits in {d/2, d, 2d} (d the default for those
    pages, capped at the steps), at the default warps and stages; the default configuration first. At most 13.
    `small` (interpreted): pages {1, 4} only, each interpreted config costing a second of compilation."""
    default = attention.resolve_config(None, B=B, Hkv=Hkv, S=S, M=M, interpret=interpret)
    out = [default]
    for pages in (1, 4) if small else (1, 2, 4, 8):
        steps = -(-M // pages)
        d = attention.default_num_splits(B, Hkv, steps, interpret)
        for splits in sorted({max(1, d // 2), d, min(steps, 2 * d)}):
            config = pk.AttentionConfig(pages, splits, default.num_warps, default.num_stages)
            if config not in out:
                out.append(config)
    return out


def launch_variants(best: list[pk.AttentionConfig], small: bool) -> list[pk.AttentionConfig]:
    """The sweep's second phase: the best tilings (pages, splits) of the first, each with every (warps, stages) of
    LAUNCHES; `small`: the last launch of the first tiling only (interpreted, warps and stages change nothing)."""
    launches = LAUNCHES[-1:] if small else LAUNCHES
    return [dataclasses.replace(t, num_warps=w, num_stages=st) for t in best[:1 if small else TOP_TILINGS]
            for w, st in launches]


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _random_pages(key, shape, dtype):
    """Standard-normal pages [N, S, Hkv, D] made on the device (a GiB from the host would take seconds), the null
    block 0 NaN."""
    return jax.random.normal(key, shape, dtype).at[0].set(jnp.nan)


def _tune_pool(key, rng, *, B, Q, Hq, Hkv, D, S, ctx, copies, dtype):
    """A paged cache of `copies` disjoint sets of B * M blocks, every row's table its own blocks, shuffled over the
    pool (null block 0 NaN). Returns q [B, Q, Hq, D], k_pages and v_pages [1 + copies * B * M, S, Hkv, D] in
    dtype, tables [copies, B, M] int32, lens [B] int32 in [max(Q, ctx/2), ctx]."""
    M = -(-ctx // S)
    N = 1 + copies * B * M
    kk, kv = jax.random.split(key)
    tables = jnp.asarray(rng.permutation(np.arange(1, N)).reshape(copies, B, M).astype(np.int32))
    lens = jnp.asarray(rng.integers(max(Q, ctx // 2), ctx + 1, B).astype(np.int32))
    q = jnp.asarray(rng.standard_normal((B, Q, Hq, D), np.float32), dtype)
    shape = (N, S, Hkv, D)
    return q, _random_pages(kk, shape, dtype), _random_pages(kv, shape, dtype), tables, lens


def _median_time_rotating(fn, arg_sets, repeats):
    """Median seconds of `repeats` calls after one untimed; call i reads arg_sets[i % len], so consecutive calls
    read disjoint pages (nothing left in L2 by the previous call)."""
    jax.block_until_ready(fn(*arg_sets[-1]))
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(config, arg_sets, want, tol, interpret, repeats) -> dict:
    """One configuration: checked against the reference output `want` (f32) on arg_sets[0], then timed if right.
    Returns its fields with ms (None unless right), rel_err, correct (None if it did not run) and error (None, or
    why it cannot win)."""
    fn = jax.jit(lambda *a: pk.paged_attention(*a, impl="pallas", interpret=interpret, config=config))
    entry = dataclasses.asdict(config) | {"ms": None, "rel_err": None, "correct": None, "error": None}
    try:
        got = fn(*arg_sets[0]).astype(jnp.float32)
        err = float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1.0))
        entry["rel_err"], entry["correct"] = err, bool(jnp.all(jnp.isfinite(got))) and err <= tol
        if not entry["correct"]:
            entry["error"] = f"WRONG: rel err {err:.2e} > {tol:.0e} (or non-finite)"
            return entry
        entry["ms"] = 1e3 * _median_time_rotating(fn, arg_sets, repeats)
    except Exception as e:  # noqa: BLE001 - a config that does not compile (e.g. out of shared memory) loses
        entry["error"] = _error(e)
    return entry


def _config_of(entry: dict) -> pk.AttentionConfig:
    return pk.AttentionConfig(*(entry[f.name] for f in dataclasses.fields(pk.AttentionConfig)))


def _label(entry: dict | None) -> str:
    """pages_per_step/num_splits/num_warps/num_stages of a timed entry."""
    return "-" if entry is None else "/".join(str(entry[f.name]) for f in dataclasses.fields(pk.AttentionConfig))


def _ms(entry: dict | None) -> str:
    return "-" if entry is None or entry["ms"] is None else f"{entry['ms']:.3f}"


def _fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def _tune_shape(key, rng, *, name, Q, ctx, dims, dtype, interpret, small, repeats, deadline) -> dict:
    """Sweep one shape until `deadline` (perf_counter seconds): the tilings, then the launch variants of the best
    three. Returns its row (see `tune`)."""
    B, Hq, Hkv, D, S = (dims[k] for k in ("B", "Hq", "Hkv", "D", "S"))
    M = -(-ctx // S)
    per_copy = 2 * B * M * S * Hkv * D * jnp.dtype(dtype).itemsize
    copies = 2 if small else max(1, -(-TUNE_POOL_BYTES // per_copy))
    q, kp, vp, tables, lens = _tune_pool(key, rng, B=B, Q=Q, Hq=Hq, Hkv=Hkv, D=D, S=S, ctx=ctx, copies=copies,
                                         dtype=dtype)
    arg_sets = [(q, kp, vp, tables[i], lens) for i in range(copies)]
    want = pk.paged_attention_reference(*arg_sets[0]).astype(jnp.float32)
    tol = TOL[jnp.dtype(dtype).name]
    timed, cut = [], False

    def sweep(configs):
        nonlocal cut
        for config in configs:
            if time.perf_counter() >= deadline:
                cut = True
                return
            if all(_config_of(e) != config for e in timed):
                timed.append(_measure(config, arg_sets, want, tol, interpret, repeats))

    sweep(tilings(B=B, Hkv=Hkv, S=S, M=M, interpret=interpret, small=small))
    ranked = sorted((e for e in timed if e["ms"] is not None), key=lambda e: e["ms"])
    sweep(launch_variants([_config_of(e) for e in ranked], small))
    default = timed[0] if timed else None  # tilings() puts the default first
    best = min((e for e in timed if e["ms"] is not None), key=lambda e: e["ms"], default=None)
    kv_bytes = float(jnp.sum(lens)) * Hkv * D * jnp.dtype(dtype).itemsize * 2  # K and V inside the lengths
    kind = jax.devices()[0].device_kind
    shape = tuning.shape_key(dtype=dtype, Q=Q, G=Hq // Hkv, D=D, S=S, context=M * S)
    row = {"case": f"{name} ctx {ctx}", "device": kind, "Q": Q, "ctx": ctx, **dims, "dtype": jnp.dtype(dtype).name,
           "shape_key": shape._asdict(), "pool_bytes": copies * per_copy, "kv_bytes": kv_bytes,
           "default": default, "best": best, "complete": not cut, "configs": timed,
           "speedup": None, "kv_gb_s": None, "hbm_fraction": None, "table_entry": None}
    if best is not None:
        row["kv_gb_s"] = kv_bytes / (best["ms"] / 1e3) / 1e9
        peak = hbm_peak(kind)
        row["hbm_fraction"] = None if peak is None else row["kv_gb_s"] * 1e9 / peak
        c = _config_of(best)
        row["table_entry"] = (f"({kind!r}, {shape!r}): AttentionConfig({c.pages_per_step}, {c.num_splits}, "
                              f"{c.num_warps}, {c.num_stages}),  # {kind}, {time.strftime('%Y-%m-%d')}, skvs "
                              f"gpu-check --only tune: {best['ms']:.3f} ms vs {_ms(default)} ms default")
        if default is not None and default["ms"] is not None:
            row["speedup"] = default["ms"] / best["ms"]
    return row


def tune(rng, interpret, small, repeats, budget_s) -> list[dict]:
    """Sweep the paged-attention kernel's launch parameters over decode (Q = 1) and verification (Q = 5) at each
    context of TUNE_CONTEXTS (B 32, Hq 32, Hkv 8, D 128, S 16, bf16; `small`: tiny sizes for interpreted kernels).

    Per shape at most MAX_TUNE_CONFIGS configurations, in two phases (`tilings`, then `launch_variants` of the
    best TOP_TILINGS), each checked against `paged_attention_reference` once before it is timed: a wrong or
    failing configuration is recorded with its error and cannot win. The pool is TUNE_POOL_BYTES of distinct pages
    (timed calls rotate over disjoint copies of the tables), far beyond L2. Each shape gets an equal share of what
    is left of `budget_s` (seconds, copy-bandwidth measurement included); a shape whose share runs out is reported
    with what was measured (`complete` False), and shapes never reached are left out.

    Returns one JSON-serialisable dict per shape: case, device, dims, shape_key (the `tuning.TUNED` key), the
    default's and the best's entries (config fields, ms, rel_err, correct, error), speedup, kv_gb_s (the best's), its
    hbm_fraction (None off an H100/H200) and copy_fraction, verify_over_decode (verification rows: best over the
    decode row's best at the same context), every entry timed (`configs`) and `table_entry`, the line to paste into
    `tuning.TUNED` by hand. Prints one table.
    """
    t_end = time.perf_counter() + budget_s
    dims = TUNE_DIMS_SMALL if small else TUNE_DIMS
    dtype = jnp.dtype(jnp.bfloat16)
    copy = copy_bandwidth(2**20 if small else TUNE_POOL_BYTES, repeats)  # GB/s, read + write
    shapes = [(name, Q, ctx) for ctx in (TUNE_CONTEXTS_SMALL if small else TUNE_CONTEXTS) for name, Q in TUNE_CASES]
    key, rows = jax.random.key(0), []
    for i, (name, Q, ctx) in enumerate(shapes):
        now = time.perf_counter()
        if now >= t_end:
            print(f"tune: budget of {budget_s:.0f} s spent; not reached: {[f'{n} ctx {c}' for n, _, c in shapes[i:]]}")
            break
        key, sub = jax.random.split(key)
        rows.append(_tune_shape(sub, rng, name=name, Q=Q, ctx=ctx, dims=dims, dtype=dtype, interpret=interpret,
                                small=small, repeats=repeats, deadline=now + (t_end - now) / (len(shapes) - i)))
    for row in rows:
        row["copy_gb_s"] = copy
        row["copy_fraction"] = None if row["kv_gb_s"] is None else row["kv_gb_s"] / copy
        decode = next((r for r in rows if r["ctx"] == row["ctx"] and r["Q"] == 1), None)
        row["verify_over_decode"] = None
        if row["Q"] > 1 and decode is not None and decode["best"] is not None and row["best"] is not None:
            row["verify_over_decode"] = row["best"]["ms"] / decode["best"]["ms"]
    _print_tune(rows, dims, copy, repeats)
    return rows


def _print_tune(rows, dims, copy, repeats):
    kind = jax.devices()[0].device_kind
    peak = hbm_peak(kind)
    print(f"\ntune: {kind}, " + " ".join(f"{k}={v}" for k, v in dims.items()) + f" bf16, contexts <= ctx per row, "
          f"{repeats} repeats, median; config = pages_per_step/num_splits/num_warps/num_stages; copy bandwidth "
          f"(read+write) {copy:.1f} GB/s; HBM peak {'unknown' if peak is None else f'{peak / 1e9:.0f} GB/s'}")
    print(f"{'case':26s} {'default':>12s} {'default ms':>10s} {'best':>12s} {'best ms':>9s} {'speedup':>8s} "
          f"{'KV GB/s':>8s} {'% HBM':>6s} {'% copy':>7s} {'configs':>8s}")
    for r in rows:
        d, b = r["default"], r["best"]
        print(f"{r['case']:26s} {_label(d):>12s} {_ms(d):>10s} {_label(b):>12s} {_ms(b):>9s} "
              f"{_fmt(r['speedup'], '{:.2f}x'):>8s} {_fmt(r['kv_gb_s'], '{:.0f}'):>8s} "
              f"{_fmt(r['hbm_fraction'], '{:.1%}'):>6s} {_fmt(r['copy_fraction'], '{:.1%}'):>7s} "
              f"{len(r['configs']):>5d}{'' if r['complete'] else ' cut'}")
        for e in r["configs"]:
            if e["error"] is not None:
                print(f"  {_label(e)}: {e['error']}")
    for r in rows:
        if r["verify_over_decode"] is not None:
            ratio = r["verify_over_decode"]
            print(f"verification / decode at ctx {r['ctx']} (each at its best config): {ratio:.2f}x "
                  f"({'within' if ratio <= VERIFY_GOAL else 'above'} the {VERIFY_GOAL}x goal)")


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
