"""KV caches in bfloat16, int8 and float8_e4m3fn: the model, the runner, the tiers and the engine.

The quantised caches go through the kernels' quantised path (`write_kv` quantises per token and KV head and
returns the scales, `paged_attention` dequantises), so their logits are close to float32's, not equal. Measured
on the shipped model, 3 held-out sequences of 50 bytes fed as 10 verification-sized calls of 5 tokens (each call
reads everything earlier calls wrote), max |logits - fp32 logits| / max |fp32 logits|: bfloat16 3.1e-3,
int8 6.6e-3, float8_e4m3fn 4.0e-2; greedy tokens equal to fp32's at 100% / 99.3% / 96.0% of the 150 positions.
"""

import contextlib
import io
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dequantize_kv
from reference_models import corpus
from reference_models.llama import KVCache
from reference_models.medusa_tree import _move_kv
from skvs_jax import commands, policies
from skvs_jax.config import CacheConfig
from skvs_jax.kv import tiers
from skvs_jax.serve import engine
from skvs_jax.serve.model_runner import LlamaMedusaRunner

QUANTISED = ("int8", "float8_e4m3fn")
# Measured (module docstring) x 1.5-3, so that a real regression (e.g. lost scales: errors of O(1)) fails.
LOGIT_TOLERANCE = {"bfloat16": 1e-2, "int8": 1e-2, "float8_e4m3fn": 6e-2}
B, C, Q, S, M = 3, 10, 5, 8, 8  # sequences, calls, tokens per call, block size, blocks per sequence
T = C * Q  # tokens written per sequence
N = 1 + B * M + 4  # the null block, the sequences' blocks and 4 never used


@pytest.fixture(scope="module")
def paged(shipped):
    """Per KV dtype: (logits [B, T, V] of C successive paged calls of Q tokens, the cache after them), for the
    same held-out tokens and the same shuffled block tables."""
    model, _ = shipped
    _, heldout = corpus.train_heldout_split()
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(heldout) - T, B)
    tokens = jnp.asarray(np.stack([heldout[s:s + T] for s in starts]).astype(np.int32))
    tables = jnp.asarray(rng.permutation(np.arange(1, N))[: B * M].reshape(B, M).astype(np.int32))
    out = {}
    for dtype in ("float32", "bfloat16") + QUANTISED:
        cache, logits = KVCache.zeros(model.config, N, S, dtype), []
        for c in range(C):
            pos = c * Q + jnp.broadcast_to(jnp.arange(Q, dtype=jnp.int32), (B, Q))
            step, _, cache = model.forward_paged(tokens[:, c * Q:(c + 1) * Q], pos, cache, tables,
                                                 jnp.full((B,), (c + 1) * Q, jnp.int32))
            logits.append(np.asarray(step))
        out[dtype] = (np.concatenate(logits, axis=1), cache)
    out["tables"] = np.asarray(tables)
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", *QUANTISED])
def test_paged_forward_is_close_to_float32(paged, dtype):
    got, ref = paged[dtype][0], paged["float32"][0]
    rel = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert rel <= LOGIT_TOLERANCE[dtype], f"{dtype}: relative logit error {rel:.2e}"
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.9  # measured >= 96%
    cache = paged[dtype][1]
    assert cache.dtype == jnp.dtype(dtype) and cache.quantised == (dtype in QUANTISED)
    assert all(k.dtype == jnp.dtype(dtype) for k in cache.k + cache.v)


@pytest.mark.parametrize("dtype", QUANTISED)
def test_quantised_cache_holds_scales_exactly_for_written_slots(paged, dtype):
    cache, ref = paged[dtype][1], paged["float32"][1]
    tables = paged["tables"]
    written = np.zeros((N, S), bool)  # slots of positions 0 .. T - 1 of every sequence
    for row in tables:
        for p in range(T):
            written[row[p // S], p % S] = True
    for layer in range(cache.num_layers):
        k, v, k_scales, v_scales = cache.layer(layer)
        for pages, scales in ((k, k_scales), (v, v_scales)):
            scales = np.asarray(scales)
            assert scales.shape == (N, S, 2) and scales.dtype == np.float32
            assert np.all(scales[written] > 0), "every written token has a positive scale per KV head"
            assert np.all(scales[~written] == 0) and np.all(np.asarray(pages)[~written] == 0), \
                "the null block and unwritten slots keep their initial zeros"
    # Layer 0's K/V depend on the tokens alone, so they equal the float32 cache's before quantisation: the
    # dequantised values are within one rounding step (int8: half a step; e4m3: 3 mantissa bits, subnormals).
    (k, v, k_scales, v_scales), (ref_k, ref_v, _, _) = cache.layer(0), ref.layer(0)
    for got, sc, want in ((k, k_scales, ref_k), (v, v_scales, ref_v)):
        deq, want, sc = np.asarray(dequantize_kv(got, sc)), np.asarray(want), np.asarray(sc)[..., None]
        bound = 0.5 * sc if dtype == "int8" else 2.0**-4 * np.abs(want) + 2.0**-10 * sc
        assert np.all(np.abs(deq - want) <= bound * (1 + 1e-5) + 1e-7)


def random_cache(config, dtype: str, seed: int) -> KVCache:
    """A cache of `dtype` filled with random values (and positive scales when quantised)."""
    cache = KVCache.zeros(config, 6, 4, dtype)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(cache))))
    return jax.tree.map(lambda x: (jax.random.uniform(next(keys), x.shape, jnp.float32, 0.1, 2.0)
                                   * jnp.float32(50.0 if x.dtype == jnp.int8 else 1.0)).astype(x.dtype), cache)


def tree_bytes(tree, ids) -> list[bytes]:
    return [np.asarray(x)[np.asarray(ids)].tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", *QUANTISED])
def test_runner_copies_and_exposes_scales_and_tiers_carry_them(shipped, dtype):
    runner, _ = LlamaMedusaRunner.create(*shipped)
    cache = random_cache(runner.config, dtype, seed=1)
    layers = runner.config.num_layers
    pages = runner.kv_pages(cache)
    assert len(pages) == (4 if dtype in QUANTISED else 2) and all(p.shape[:2] == (6, layers) for p in pages)
    if dtype in QUANTISED:
        assert [p.shape for p in pages[2:]] == [(6, layers, 4, 2)] * 2
    assert tree_bytes(runner.with_kv_pages(cache, pages), range(6)) == tree_bytes(cache, range(6))
    with pytest.raises(ValueError, match="pages"):
        runner.with_kv_pages(cache, pages[:-1])

    copied = runner.copy_blocks(cache, jnp.asarray([1, 2], jnp.int32), jnp.asarray([4, 5], jnp.int32))
    assert tree_bytes(copied, [4, 5]) == tree_bytes(cache, [1, 2]), "pages and scales both move"
    assert tree_bytes(copied, [0, 1, 2, 3]) == tree_bytes(cache, [0, 1, 2, 3])

    tier = tiers.Tier(pages, 4)
    handle = tiers.swap_out(pages, np.asarray([2, 3], np.int32), tier)
    back = runner.with_kv_pages(cache, tiers.swap_in(runner.kv_pages(KVCache.zeros(runner.config, 6, 4, dtype)),
                                                     handle, np.asarray([5, 1], np.int32)))
    assert tree_bytes(back, [5, 1]) == tree_bytes(cache, [2, 3]), "a swap round trip is bit-identical"


def test_tree_verification_moves_scales_with_the_values(shipped):
    cache = random_cache(shipped[0].config, "int8", seed=2)
    src, dst = jnp.asarray([5, 9, 0], jnp.int32), jnp.asarray([17, 2, -1], jnp.int32)  # slot = block * 4 + offset
    moved = _move_kv(cache, src, dst)
    for before, after in zip(jax.tree.leaves(cache), jax.tree.leaves(moved)):
        # [N, L, S, ...] -> one row per slot (block, offset), every layer in it
        flat_before, flat_after = (np.moveaxis(np.asarray(x), 1, 2).reshape(24, -1) for x in (before, after))
        expect = flat_before.copy()
        expect[[17, 2]] = flat_before[[5, 9]]  # dst -1 is skipped
        assert flat_after.tobytes() == expect.tobytes()


@pytest.mark.parametrize("bad", ["float16", "int4", "nonsense", jnp.uint8])
def test_a_bad_kv_dtype_raises_value_error_naming_dtype(shipped, bad):
    model, heads = shipped
    with pytest.raises(ValueError, match="dtype"):
        KVCache.zeros(model.config, 4, 4, bad)
    runner, _ = LlamaMedusaRunner.create(model, heads)
    with pytest.raises(ValueError, match="dtype"):
        runner.init_cache(4, 4, bad)
    with pytest.raises(ValueError, match="dtype"):  # the engine passes its kv_dtype string to init_cache
        engine.Engine(model, heads, policies.naive_spec(4), CacheConfig(4, 4, 1, 2), kv_dtype=bad)


# ------------------------------------------------------------------------------------------- the engine

BENCH_FLAGS = ["--prompts", "6", "--new-tokens", "16", "--dtypes", "float8_e4m3fn"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """`skvs micro precision` at a tiny size: the real engine with float32 (always run, the baseline) and
    float8_e4m3fn KV, K = 1..4. Returns (stdout, the JSON it wrote)."""
    path = tmp_path_factory.mktemp("precision") / "precision.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = commands.main(["micro", "precision", *BENCH_FLAGS, "--json", str(path)])
    assert code == 0, out.getvalue()
    return out.getvalue(), json.loads(path.read_text())


def test_cli_precision_prints_the_table_and_the_ratio_line(bench_run):
    text, report = bench_run
    lines = text.strip().splitlines()
    assert re.fullmatch(r"precision: acceptance ratio fp8/fp32 at K=4: [0-9]+\.[0-9]{3}x", lines[-1]), lines[-1]
    assert "acceptance rate = accepted drafts / drafted tokens" in text and "float8_e4m3fn" in lines[4]
    assert report["dtypes"] == ["float32", "float8_e4m3fn"] and report["draft_lens"] == [1, 2, 3, 4]
    ratio = report["results"]["float8_e4m3fn"]["4"]["acceptance_vs_fp32"]
    assert lines[-1].endswith(f"{ratio:.3f}x")


def test_engine_serves_greedy_requests_with_an_fp8_cache(bench_run):
    _, report = bench_run
    assert report["preempted"] == 0 and report["float32_outputs_identical_across_k"]
    for k in map(str, report["draft_lens"]):
        r, base = report["results"]["float8_e4m3fn"][k], report["results"]["float32"][k]
        assert [len(o) for o in r["outputs"]] == [16] * 6
        assert all(0 <= t < 256 for o in r["outputs"] for t in o)
        assert r["drafted"] > 0 and 0 <= r["accepted"] <= r["drafted"]
        # Quantisation may change greedy outputs; report how many tokens agree rather than demand equality
        # (measured: 86 / 96 at every K).
        same = sum(a == b for o, ob in zip(r["outputs"], base["outputs"]) for a, b in zip(o, ob))
        print(f"float8_e4m3fn K={k}: {same}/96 tokens equal to float32-KV, acceptance {r['acceptance']:.3f} "
              f"(float32 {base['acceptance']:.3f})")
        assert same == round(r["same_as_fp32"] * 96)


@pytest.mark.slow  # the default run's time budget; tests/test_tiers.py swaps through the tiers and the fp8 engine test
# above serves a quantised cache
def test_engine_swaps_an_int8_cache_to_the_host_tier_and_back(shipped, bench_run):
    """int8 KV with swap preemption: the scales travel with the pages (lost or stale scales would dequantise the
    swapped sequences to garbage), and the outputs stay close to the float32-KV run of the benchmark
    (measured: 96 / 96 tokens equal)."""
    _, report = bench_run
    model, heads = shipped
    tight = CacheConfig(num_blocks=24, block_size=8, max_seqs=6, max_blocks_per_seq=11)
    e = engine.Engine(model, heads, policies.naive_spec(4).replace(preemption="swap"), tight, token_budget=30,
                      prefill_chunk=5, kv_dtype="int8", swap_blocks=64)
    out = e.generate(report["prompts"], engine.SamplingParams(max_tokens=16))
    c = e.state.sched.counters
    assert int(c.preempt_swap) > 0 and int(c.swap_ins) > 0
    assert e.state.cache.quantised and e.state.cache.dtype == jnp.int8
    same = sum(a == b for o, ob in zip(out, report["results"]["float32"]["4"]["outputs"]) for a, b in zip(o, ob))
    print(f"int8 with {int(c.preempt_swap)} swaps: {same}/96 tokens equal to the float32-KV run")
    assert same >= 0.9 * 96  # a swap that loses the scales measured 66 / 96
