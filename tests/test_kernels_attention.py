"""paged_attention: every implementation runs through one shared test base class (the tokamax pattern).

The oracle is a float64 NumPy attention over each sequence's *contiguous* KV, gathered block by block from the
table in plain Python, so it shares no code with the kernels. Pages are poisoned: blocks outside every table
(including the null block 0) hold NaN, slots past a sequence's length inside its last block hold large finite
garbage; neither may change the output.
"""

from __future__ import annotations

import math
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pallas_kernels as pk
from pallas_kernels import attention as attention_module
from pallas_kernels import tuning

GARBAGE = 3.0e4  # large, finite: q.k overflows nothing in f32 but would dominate any unmasked softmax
# Interpret-mode Pallas compiles per shape: keep CI short. The one property test is shared by every
# implementation's subclass on purpose, hence differing_executors.
FEW = settings(max_examples=12 if settings.default.max_examples <= 30 else settings.default.max_examples,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors])


# ------------------------------------------------------------------------------------------------ test cases
def make_case(seed, *, B, Q, Hkv, G, D, S, M, ctx_kind="ragged", kv_dtype=jnp.float32, q_dtype=jnp.float32,
              tree=False, query_lens=False):
    """Random paged cache with poisoned padding. Returns a dict of kernel arguments plus numpy copies."""
    rng = np.random.default_rng(seed)
    lens = []
    for b in range(B):
        kind = ctx_kind if ctx_kind != "mixed" else ["zero", "one", "block", "ragged", "full"][b % 5]
        low = 1 if kind == "nonempty" else 0
        lens.append({"zero": 0, "one": 1, "block": S, "full": M * S}.get(kind, int(rng.integers(low, M * S + 1))))
    lens = np.array(lens, np.int32)
    qlens = np.full((B,), Q, np.int32)  # query_lens None: every row is real (bottom-right aligned)
    if query_lens:
        qlens = np.array([rng.integers(0, min(n, Q) + 1) for n in lens], np.int32)
    used = [-(-int(n) // S) for n in lens]
    N = 1 + sum(used) + 2  # null block + used + two spare blocks
    perm = rng.permutation(np.arange(1, N))
    tables = np.zeros((B, M), np.int32)
    i = 0
    for b in range(B):
        tables[b, :used[b]] = perm[i:i + used[b]]
        i += used[b]
    quantised = jnp.dtype(kv_dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
    k = rng.standard_normal((N, S, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((N, S, Hkv, D)).astype(np.float32)
    ks = vs = None
    if quantised:
        kq, ks = pk.quantize_kv(jnp.asarray(k), kv_dtype)
        vq, vs = pk.quantize_kv(jnp.asarray(v), kv_dtype)
        k, v = np.asarray(pk.dequantize_kv(kq, ks)), np.asarray(pk.dequantize_kv(vq, vs))  # what the oracle sees
        kq, vq, ks, vs = np.asarray(kq), np.asarray(vq), np.array(ks), np.array(vs)
    # Poison: every block not used by a sequence, and slots past each length in its last block.
    live = np.zeros((N, S), bool)
    for b in range(B):
        for t in range(lens[b]):
            live[tables[b, t // S], t % S] = True
    used_blocks = np.zeros(N, bool)
    used_blocks[[tables[b, j] for b in range(B) for j in range(used[b])]] = True
    k_store, v_store = (kq.copy(), vq.copy()) if quantised else (k.copy(), v.copy())
    if quantised:  # NaN cannot live in int8/fp8: poison the scales, and garbage the values
        ks[~used_blocks], vs[~used_blocks] = np.nan, np.nan
        partial = (~live) & used_blocks[:, None]
        ks[partial], vs[partial] = GARBAGE, GARBAGE
    else:
        k_store[~used_blocks], v_store[~used_blocks] = np.nan, np.nan
        partial = (~live) & used_blocks[:, None]
        k_store[partial], v_store[partial] = GARBAGE, -GARBAGE
    Hq = Hkv * G
    q = rng.standard_normal((B, Q, Hq, D)).astype(np.float32)
    tree_mask = None
    if tree:
        tree_mask = (rng.random((B, Q, Q)) < 0.5) | np.eye(Q, dtype=bool)[None]
    return dict(
        q=jnp.asarray(q, q_dtype), k_pages=jnp.asarray(k_store, kv_dtype), v_pages=jnp.asarray(v_store, kv_dtype),
        block_tables=jnp.asarray(tables), context_lens=jnp.asarray(lens),
        query_lens=jnp.asarray(qlens) if query_lens else None,
        tree_mask=None if tree_mask is None else jnp.asarray(tree_mask),
        k_scales=None if ks is None else jnp.asarray(ks), v_scales=None if vs is None else jnp.asarray(vs),
        np=dict(q=np.asarray(jnp.asarray(q, q_dtype).astype(jnp.float32)), k=k, v=v, tables=tables, lens=lens,
                qlens=qlens, tree=tree_mask, S=S),
    )


def oracle(case, sm_scale=None, soft_cap=None):
    """float64 attention over each sequence's contiguous KV, in plain Python loops."""
    n = case["np"]
    q, S = n["q"].astype(np.float64), n["S"]
    B, Q, Hq, D = q.shape
    Hkv = n["k"].shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    out = np.zeros((B, Q, Hq, D))
    for b in range(B):
        L, ql = int(n["lens"][b]), int(n["qlens"][b])
        if L == 0:
            continue
        blocks = [n["tables"][b, j] for j in range(-(-L // S))]
        k = np.concatenate([n["k"][blk] for blk in blocks])[:L].astype(np.float64)  # [L, Hkv, D]
        v = np.concatenate([n["v"][blk] for blk in blocks])[:L].astype(np.float64)
        prefix, pos = L - ql, np.arange(L)
        for i in range(ql):
            if n["tree"] is None:
                seen = pos <= prefix + i
            else:
                j = pos - prefix
                seen = (pos < prefix) | ((j >= 0) & (j < ql) & n["tree"][b, i, np.clip(j, 0, Q - 1)])
            if not seen.any():
                continue
            for h in range(Hq):
                logits = (k[seen, h // G] @ q[b, i, h]) * scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                w = np.exp(logits - logits.max())
                out[b, i, h] = (w / w.sum()) @ v[seen, h // G]
    return out


def run(impl, interpret, case, **kw):
    args = {k: case[k] for k in ("q", "k_pages", "v_pages", "block_tables", "context_lens")}
    opts = {k: case[k] for k in ("query_lens", "tree_mask", "k_scales", "v_scales")}
    return pk.paged_attention(**args, **opts, **kw, impl=impl, interpret=interpret)


def assert_close(got, want, rtol):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got)), "non-finite output"
    atol = rtol * max(1.0, float(np.max(np.abs(want), initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


shapes = st.fixed_dictionaries({
    "B": st.integers(1, 3), "Q": st.sampled_from([1, 1, 3, 5]), "Hkv": st.sampled_from([1, 2]),
    "G": st.sampled_from([1, 2, 4, 8]), "D": st.sampled_from([16, 32]), "S": st.sampled_from([8, 16, 32]),
    "M": st.integers(1, 4), "ctx_kind": st.sampled_from(["mixed", "ragged", "block", "one", "full"]),
})


# ------------------------------------------------------------------------------------------- shared base class
class AttentionContract:
    """Every implementation must pass these. Subclasses set `impl` and `interpret`."""

    impl: str
    interpret: bool | None = None

    @FEW
    @given(shape=shapes, seed=st.integers(0, 2**31 - 1), tree=st.booleans(), query_lens=st.booleans(),
           soft_cap=st.sampled_from([None, 2.0]))
    def test_matches_float64_oracle(self, shape, seed, tree, query_lens, soft_cap):
        case = make_case(seed, **shape, tree=tree and shape["Q"] > 1, query_lens=query_lens)
        got = run(self.impl, self.interpret, case, soft_cap=soft_cap)
        assert_close(got, oracle(case, soft_cap=soft_cap), rtol=1e-5)

    @pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
    def test_quantised_matches_dequantised_oracle(self, kv_dtype):
        case = make_case(1, B=3, Q=3, Hkv=2, G=2, D=16, S=8, M=3, ctx_kind="mixed", kv_dtype=kv_dtype, tree=True)
        assert_close(run(self.impl, self.interpret, case), oracle(case), rtol=1e-5)

    @pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
    def test_bfloat16_pages(self, q_dtype):
        case = make_case(2, B=2, Q=2, Hkv=2, G=4, D=32, S=16, M=3, kv_dtype=jnp.bfloat16, q_dtype=q_dtype)
        case["np"]["k"] = np.asarray(case["k_pages"].astype(jnp.float32))  # oracle on the stored bf16 values
        case["np"]["v"] = np.asarray(case["v_pages"].astype(jnp.float32))
        got = run(self.impl, self.interpret, case)
        assert got.dtype == q_dtype
        assert_close(got, oracle(case), rtol=1e-2)

    def test_tree_of_40_nodes_spans_two_mask_words(self):
        case = make_case(10, B=2, Q=40, Hkv=1, G=2, D=16, S=16, M=4, ctx_kind="full", tree=True, query_lens=True)
        assert_close(run(self.impl, self.interpret, case), oracle(case), rtol=1e-5)

    def test_sm_scale_and_soft_cap(self):
        case = make_case(3, B=2, Q=3, Hkv=1, G=2, D=16, S=16, M=2)
        got = run(self.impl, self.interpret, case, sm_scale=0.7, soft_cap=1.5)
        assert_close(got, oracle(case, sm_scale=0.7, soft_cap=1.5), rtol=1e-5)

    def test_empty_sequence_and_padding_rows_are_exactly_zero(self):
        case = make_case(4, B=3, Q=3, Hkv=2, G=2, D=16, S=8, M=2, ctx_kind="mixed", query_lens=True)
        case["context_lens"] = case["context_lens"].at[0].set(0)
        case["query_lens"] = jnp.asarray([0, 1, 2], jnp.int32)  # row i >= query_lens[b] is padding
        case["np"]["lens"][0], case["np"]["qlens"][:] = 0, [0, 1, 2]
        got = np.asarray(run(self.impl, self.interpret, case))
        assert np.all(got[0] == 0) and np.all(got[1, 1:] == 0) and np.all(got[2, 2:] == 0)
        assert_close(got, oracle(case), rtol=1e-5)

    def test_deterministic_and_jittable(self):
        case = make_case(5, B=2, Q=2, Hkv=2, G=2, D=16, S=16, M=2, tree=True)
        args = {k: case[k] for k in ("q", "k_pages", "v_pages", "block_tables", "context_lens", "tree_mask")}
        fn = jax.jit(lambda a: pk.paged_attention(**a, impl=self.impl, interpret=self.interpret))
        first, second = fn(args), fn(args)
        np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
        assert_close(first, oracle(case), rtol=1e-5)

    def test_decode_agrees_with_jax_reference(self):
        """Single-query decode vs jax.experimental.pallas.ops.gpu.paged_attention's reference (no scale;
        contiguous [B, L, Hkv, D] layout; non-empty sequences, since the two disagree on empty ones)."""
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention_reference as jax_ref

        case = make_case(6, B=3, Q=1, Hkv=2, G=4, D=32, S=16, M=4, ctx_kind="nonempty")
        lens, tables = case["context_lens"], case["block_tables"]
        got = run(self.impl, self.interpret, case, sm_scale=1.0)
        n = case["np"]
        B, M, S = tables.shape[0], tables.shape[1], n["S"]
        k = np.asarray(case["k_pages"])[np.asarray(tables)].reshape(B, M * S, *n["k"].shape[2:])
        v = np.asarray(case["v_pages"])[np.asarray(tables)].reshape(B, M * S, *n["v"].shape[2:])
        k, v = np.nan_to_num(k), np.nan_to_num(v)  # jax's reference multiplies masked weights by V
        # jax's reference uses the default matmul precision, which is TF32 on a GPU (~1e-3 relative); ours
        # computes f32 at HIGHEST, so ask the same of theirs or the comparison measures TF32, not the kernel.
        with jax.default_matmul_precision("highest"):
            want = jax_ref(case["q"][:, 0], jnp.asarray(k), jnp.asarray(v), lens)
        np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want), rtol=1e-5, atol=1e-5)


class TestReference(AttentionContract):
    impl = "reference"


class TestXla(AttentionContract):
    impl = "xla"


class TestPallasInterpret(AttentionContract):
    impl = "pallas"
    interpret = True


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Pallas kernels need a GPU")
class TestPallasCompiled(AttentionContract):
    impl = "pallas"
    interpret = False


@settings(FEW, max_examples=8 if settings.default.max_examples <= 30 else settings.default.max_examples)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), splits=st.integers(2, 4), pages=st.sampled_from([1, 2, 4]),
       tree=st.booleans())
def test_pallas_split_k_and_pages_per_step_match_oracle(shape, seed, splits, pages, tree):
    """On GPU each sequence's blocks are split over several programs (flash-decoding) and each loop step
    gathers several pages; interpret mode defaults to one split, so force other tilings here, including more
    splits than a sequence has steps and steps that run past the block table."""
    case = make_case(seed, **shape, tree=tree and shape["Q"] > 1, query_lens=True)
    with mock.patch.object(attention_module, "default_num_splits", lambda *a: splits), \
            mock.patch.object(attention_module, "default_pages_per_step", lambda *a: pages):
        got = run("pallas", True, case)
    assert_close(got, oracle(case), rtol=1e-5)


# ------------------------------------------------------------------------------------------ launch parameters
def test_an_explicit_config_gives_the_defaults_output():
    """Warps and stages do not change an interpreted program (bit-identical); other tilings only reorder the sums."""
    case = make_case(11, B=3, Q=3, Hkv=2, G=4, D=16, S=8, M=4, ctx_kind="mixed", query_lens=True)
    default = np.asarray(run("pallas", True, case))
    launch = run("pallas", True, case, config=pk.AttentionConfig(num_warps=8, num_stages=3))
    np.testing.assert_array_equal(np.asarray(launch), default)
    tiled = run("pallas", True, case, config=pk.AttentionConfig(pages_per_step=1, num_splits=3, num_warps=8,
                                                                num_stages=3))
    assert_close(tiled, np.asarray(default, np.float64), rtol=1e-5)
    assert_close(tiled, oracle(case), rtol=1e-5)
    assert attention_module.resolve_config(None, B=3, Hkv=2, S=8, M=4, interpret=True) == pk.AttentionConfig(8, 1, 4, 2)
    assert attention_module.resolve_config(pk.AttentionConfig(num_splits=2), B=3, Hkv=2, S=8, M=4,
                                           interpret=True) == pk.AttentionConfig(8, 2, 4, 2)


@pytest.mark.parametrize("config, error, match", [
    (pk.AttentionConfig(pages_per_step=3), ValueError, "config.pages_per_step must be a power of two"),
    (pk.AttentionConfig(pages_per_step=0), ValueError, "config.pages_per_step must be >= 1"),
    (pk.AttentionConfig(num_splits=0), ValueError, "config.num_splits must be >= 1"),
    (pk.AttentionConfig(num_warps=-4), ValueError, "config.num_warps must be >= 1"),
    (pk.AttentionConfig(num_warps=6), ValueError, "config.num_warps must be a power of two"),
    (pk.AttentionConfig(num_stages=0), ValueError, "config.num_stages must be >= 1"),
    (pk.AttentionConfig(num_splits=2.0), TypeError, "config.num_splits must be an int"),
    (pk.AttentionConfig(num_stages=True), TypeError, "config.num_stages must be an int"),
    ({"num_warps": 8}, TypeError, "config must be an AttentionConfig"),
])
def test_a_bad_config_names_the_field(config, error, match):
    for impl in ("pallas", "xla"):  # checked at the boundary, whichever implementation would run
        with pytest.raises(error, match=match):
            pk.paged_attention(**_good(), impl=impl, config=config)


def test_the_tuned_table_is_keyed_by_device_and_shape(monkeypatch):
    assert tuning.lookup("no such GPU", dtype=jnp.bfloat16, Q=1, G=4, D=128, S=16, context=512) is None
    key = tuning.shape_key(dtype=jnp.bfloat16, Q=5, G=4, D=128, S=16, context=600)
    assert key == tuning.ShapeKey("bfloat16", 8, 4, 128, 16, "<=2048")
    buckets = [tuning.context_bucket(n) for n in (1, 512, 513, 8192, 8193)]
    assert buckets == ["<=512", "<=512", "<=2048", "<=8192", ">8192"]
    monkeypatch.setitem(tuning.TUNED, ("Some GPU", key), pk.AttentionConfig(2, 4, 8, 3))
    assert tuning.lookup("Some GPU", dtype=jnp.bfloat16, Q=7, G=4, D=128, S=16, context=2048) == \
        pk.AttentionConfig(2, 4, 8, 3)
    assert tuning.lookup("Some GPU", dtype=jnp.float32, Q=7, G=4, D=128, S=16, context=2048) is None


def test_every_tuned_entry_is_a_valid_config():
    for (device_kind, key), config in tuning.TUNED.items():
        assert isinstance(device_kind, str) and isinstance(key, tuning.ShapeKey)
        tuning.check_config(config)


def test_the_compiled_kernel_on_a_gpu_launches_with_the_tuned_entry(monkeypatch):
    """The launch parameters the compiled kernel gets (the kernel itself stubbed: this CPU cannot compile it): the
    table's entry for this device and shape when config is None, an explicit config over it, the defaults when
    interpreted."""
    args = _good()  # S = 8, D = 16, Q = 2, G = 2, M = 2
    launches = []
    monkeypatch.setattr(attention_module, "_paged_attention_pallas", lambda *a, **kw: launches.append(kw))
    monkeypatch.setattr(attention_module.c, "on_gpu", lambda: True)
    key = tuning.shape_key(dtype=args["k_pages"].dtype, Q=2, G=2, D=16, S=8, context=16)
    monkeypatch.setitem(tuning.TUNED, (jax.devices()[0].device_kind, key), pk.AttentionConfig(1, 2, 8, 3))
    pk.paged_attention(**args, impl="pallas", interpret=False)
    pk.paged_attention(**args, impl="pallas", interpret=False, config=pk.AttentionConfig(num_stages=4))
    pk.paged_attention(**args, impl="pallas", interpret=True)
    params = [tuple(kw[k] for k in ("pages_per_step", "num_splits", "num_warps", "num_stages")) for kw in launches]
    assert params[0] == (1, 2, 8, 3)
    assert params[1][2:] == (4, 4) and params[2] == (8, 1, 4, 2)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU the compiled kernel consults the table")
def test_off_a_gpu_the_tuned_table_is_never_consulted():
    with mock.patch.object(tuning, "lookup", side_effect=AssertionError("consulted off a GPU")):
        for impl in ("pallas", "xla", "auto"):
            pk.paged_attention(**_good(), impl=impl)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on GPU auto is the compiled Pallas kernel")
def test_auto_is_xla_off_gpu():
    case = make_case(7, B=2, Q=1, Hkv=1, G=2, D=16, S=8, M=2)
    want = run("xla", None, case)
    np.testing.assert_array_equal(np.asarray(run("auto", None, case)), np.asarray(want))


# -------------------------------------------------------------------------------------------------- bad input
def _good():
    case = make_case(8, B=2, Q=2, Hkv=2, G=2, D=16, S=8, M=2)
    return {k: case[k] for k in ("q", "k_pages", "v_pages", "block_tables", "context_lens")}


@pytest.mark.parametrize("name, bad, error, match", [
    ("q", jnp.zeros((2, 2, 4)), ValueError, "q must have shape"),
    ("q", jnp.zeros((2, 2, 4, 16), jnp.int32), TypeError, "q must have dtype"),
    ("q", jnp.zeros((2, 2, 3, 16)), ValueError, "multiple of the KV heads"),
    ("q", jnp.zeros((2, 2, 4, 8)), ValueError, "head dim"),
    ("v_pages", jnp.zeros((7, 8, 2, 8)), ValueError, "v_pages must have shape"),
    ("k_pages", jnp.zeros((7, 8, 2, 16), jnp.int8), ValueError, "k_scales is required"),
    ("block_tables", jnp.zeros((3, 2), jnp.int32), ValueError, "block_tables must have shape"),
    ("block_tables", jnp.zeros((2, 2), jnp.float32), TypeError, "block_tables must have dtype"),
    ("block_tables", jnp.full((2, 2), 99, jnp.int32), ValueError, "block_tables entries must lie"),
    ("context_lens", jnp.zeros((3,), jnp.int32), ValueError, "context_lens must have shape"),
    ("context_lens", jnp.full((2,), 17, jnp.int32), ValueError, "context_lens must lie"),
    ("tree_mask", jnp.zeros((2, 2, 3), bool), ValueError, "tree_mask must have shape"),
    ("query_lens", jnp.full((2,), 3, jnp.int32), ValueError, "query_lens must lie"),
    ("k_pages", jnp.zeros((7, 0, 2, 16)), ValueError, "k_pages .* every dimension >= 1, got S = 0"),
    ("block_tables", jnp.zeros((2, 0), jnp.int32), ValueError, "table width M of block_tables must be >= 1"),
    ("q", jnp.zeros((2, 2, 4, 0)), ValueError, "head dim D of q must be >= 1"),
])
def test_bad_input_names_the_argument(name, bad, error, match):
    args = _good()
    if name == "k_pages":
        args["v_pages"] = bad
    args[name] = bad
    with pytest.raises(error, match=match):
        pk.paged_attention(**args, impl="reference")


def test_bad_impl_and_soft_cap():
    with pytest.raises(ValueError, match="impl must be one of"):
        pk.paged_attention(**_good(), impl="cuda")
    with pytest.raises(ValueError, match="soft_cap"):
        pk.paged_attention(**_good(), soft_cap=-1.0)
    for kw in (dict(soft_cap=float("inf")), dict(soft_cap=float("nan")), dict(sm_scale=float("nan")),
               dict(sm_scale=float("inf")),  # each gave all-zero rows (or NaN, depending on impl)
               dict(sm_scale=1e39), dict(soft_cap=1e39)):  # finite in float64, inf in float32: all NaN
        with pytest.raises(ValueError, match="must be a finite"):
            pk.paged_attention(**_good(), **kw)
    with pytest.raises(TypeError, match="soft_cap must be a float"):
        pk.paged_attention(**_good(), soft_cap="30")
    np.testing.assert_array_equal(pk.paged_attention(**_good(), sm_scale=np.float32(0.5), impl="reference"),
                                  pk.paged_attention(**_good(), sm_scale=0.5, impl="reference"))


def test_a_traced_context_past_the_table_ends_at_the_table():
    """Under jit a context length above M * S is not refused: keys end at the table in every implementation, as
    in the reference, never in the (NaN-poisoned) null block the fast paths pad the table with."""
    case = make_case(9, B=2, Q=2, Hkv=1, G=2, D=16, S=8, M=3, ctx_kind="full")
    args = {k: case[k] for k in ("q", "k_pages", "v_pages", "block_tables", "context_lens")}
    longer = args | {"context_lens": args["context_lens"] + 5}
    run_jit = lambda impl: jax.jit(lambda a: pk.paged_attention(**a, impl=impl))(longer)  # noqa: E731
    want = np.asarray(run_jit("reference"), np.float64)
    assert np.all(np.isfinite(want)) and np.any(want != 0)
    for impl in ("xla", "pallas"):
        assert_close(run_jit(impl), want, rtol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas", "pallas-split"])
def test_a_nan_in_a_visible_key_gives_nan_where_it_is_seen(impl):
    """NaN inside the context propagates, as in any attention, to exactly the rows that see it (it used to give
    quiet zero rows, which hid the upstream bug); masked NaN (the poisoned padding) still changes nothing.
    pallas-split: three split-K programs per row, the NaN in the first, so the merge must carry it."""
    case = make_case(4, B=3, Q=2, Hkv=2, G=2, D=16, S=4, M=3, ctx_kind="full")
    k = np.array(case["k_pages"])
    k[case["np"]["tables"][0, 0], 1, 0, 3] = np.nan  # row 0, position 1, kv head 0: visible to both queries
    with mock.patch.object(attention_module, "default_num_splits", lambda *a: 3 if impl == "pallas-split" else 1), \
            mock.patch.object(attention_module, "default_pages_per_step", lambda *a: 1):
        impl = impl.removesuffix("-split")
        clean = np.asarray(run(impl, None, case), np.float64)
        poisoned = np.asarray(run(impl, None, case | {"k_pages": jnp.asarray(k)}), np.float64)
    assert np.isnan(poisoned[0, :, :2]).all()  # query heads 0, 1 share kv head 0
    np.testing.assert_array_equal(poisoned[0, :, 2:], clean[0, :, 2:])
    np.testing.assert_array_equal(poisoned[1:], clean[1:])
    assert np.isfinite(clean).all()


def test_a_traced_query_len_past_q_with_a_tree_agrees_across_implementations():
    """Outside the contract (query_lens <= Q, checked only when concrete), but every implementation must still
    read the same keys: those past the Q tree nodes are not in the tree (the reference reused node Q - 1's
    column for them, the kernel did not)."""
    case = make_case(5, B=1, Q=2, Hkv=1, G=2, D=16, S=4, M=3, ctx_kind="full", tree=True)
    args = {k: case[k] for k in ("q", "k_pages", "v_pages", "block_tables", "context_lens", "tree_mask")}
    args["query_lens"] = jnp.asarray([4], jnp.int32)
    run_jit = lambda impl: jax.jit(lambda a: pk.paged_attention(**a, impl=impl))(args)  # noqa: E731
    want = np.asarray(run_jit("reference"), np.float64)
    for impl in ("xla", "pallas"):
        assert_close(run_jit(impl), want, rtol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_no_sequences_or_no_queries_give_an_empty_output(impl):
    for b, q in ((0, 2), (2, 0)):  # B = 0 crashed the Pallas grid
        args = _good()
        args |= {"q": jnp.zeros((b, q, 4, 16)), "block_tables": args["block_tables"][:b],
                 "context_lens": args["context_lens"][:b]}
        assert pk.paged_attention(**args, impl=impl).shape == (b, q, 4, 16)


def test_value_checks_are_skipped_under_jit():
    args = _good()
    out = jax.jit(lambda a: pk.paged_attention(**a))(args)
    assert out.shape == args["q"].shape


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("tree", [False, True])
def test_model_sized_case(impl, tree):
    """Llama-like head dim and a longer context (seconds here; kept out of the default run to bound CI time)."""
    case = make_case(9, B=4, Q=5, Hkv=2, G=4, D=128, S=16, M=24, ctx_kind="mixed", tree=tree)
    assert_close(run(impl, None, case, soft_cap=30.0), oracle(case, soft_cap=30.0), rtol=1e-5)
