"""Tests of the simulator's cost model: published shapes, the issue's A100 numbers, jit/vmap, the CPU fit, and the
measured mode (Vidur's A100 profiles; its fidelity against Vidur's results: tests/test_sim_vidur_fidelity.py).

Llama-3.1-8B on the A100 defaults to the measured mode, so tests of the roofline's own figures pin mode="roofline".
"""

import dataclasses
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from skvs_jax import policies
from skvs_jax.sim import (
    DEVICES,
    MODELS,
    CostModel,
    DeviceSpec,
    ModelSpec,
    StepSample,
    fit_cpu_device,
    kernel_profiles,
)

KIB = 1024
WEIGHTS = pathlib.Path(__file__).resolve().parents[1] / "reference_models" / "weights"
A100 = DEVICES["a100-80gb"]
LLAMA_8B, LLAMA_70B, TINY = MODELS["llama-3.1-8b"], MODELS["llama-3-70b"], MODELS["tiny"]


def ideal(device: DeviceSpec) -> DeviceSpec:
    """The pure roofline: efficiencies 1, no host overhead."""
    return dataclasses.replace(device, compute_efficiency=1.0, bandwidth_efficiency=1.0, host_overhead_s=0.0)


def decode_batch1(cm: CostModel, context: int = 512) -> dict[str, float]:
    """One sequence decoding one token against `context` cached tokens, no drafting."""
    return {k: float(v) for k, v in cm.breakdown(0, 1, context, 1, 0).items()}


# ------------------------------------------------------------------------------------------------ model shapes


def test_kv_bytes_per_token_match_the_issue():
    assert LLAMA_8B.kv_bytes_per_token == 128 * KIB  # 2 * 32 layers * 8 KV heads * 128 * 2 bytes
    assert LLAMA_70B.kv_bytes_per_token == 320 * KIB  # 2 * 80 * 8 * 128 * 2


def test_param_counts_match_published_sizes():
    # Published: 8.03B (Llama-3.1-8B) and 70.6B (Meta-Llama-3-70B); tolerance 0.5%.
    assert LLAMA_8B.param_count == pytest.approx(8.03e9, rel=5e-3)
    assert LLAMA_70B.param_count == pytest.approx(70.6e9, rel=5e-3)
    assert LLAMA_8B.param_count == 8_030_261_248  # the safetensors total of meta-llama/Llama-3.1-8B
    assert LLAMA_8B.weight_bytes == 2 * LLAMA_8B.param_count


def test_param_counts_agree_with_the_reference_model_config():
    from reference_models.llama import LlamaConfig

    for spec in (LLAMA_8B, LLAMA_70B, TINY):
        config = LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                             intermediate_size=spec.intermediate_size, num_layers=spec.num_layers,
                             num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                             tie_word_embeddings=spec.tie_word_embeddings)
        assert spec.param_count == config.num_params, spec.name


def test_tiny_preset_is_the_shipped_model():
    config = json.loads((WEIGHTS / "tiny_llama" / "config.json").read_text())
    medusa = json.loads((WEIGHTS / "tiny_llama_medusa" / "config.json").read_text())
    assert config["torch_dtype"] == "float32"
    assert ModelSpec.from_hf_config("tiny", config, medusa, weight_dtype_bytes=4, kv_dtype_bytes=4) == TINY


def test_medusa_params_match_the_reference_heads():
    from flax import nnx

    from reference_models.medusa import MedusaConfig, MedusaHeads

    heads = MedusaHeads(MedusaConfig(hidden_size=TINY.hidden_size, vocab_size=TINY.vocab_size,
                                     num_heads=TINY.num_medusa_heads, num_layers=TINY.medusa_layers))
    assert TINY.medusa_param_count == sum(x.size for x in jax.tree.leaves(nnx.state(heads, nnx.Param)))


def test_medusa_vocab_projection_is_a_real_cost_at_128k_vocab():
    # 4 heads each with a [128256, 4096] projection: ~2.2B parameters, ~29% of the base model's matmul FLOPs.
    assert LLAMA_8B.medusa_param_count == pytest.approx(2.17e9, rel=1e-2)
    assert LLAMA_8B.medusa_flops_per_row / LLAMA_8B.flops_per_token() == pytest.approx(0.289, abs=2e-3)
    cm = CostModel(LLAMA_8B, A100, mode="roofline")
    assert float(cm.step_time(0, 1, 512, 1, 1)) > float(cm.step_time(0, 1, 512, 1, 0)) + 2e-3


# -------------------------------------------------------------------------------------------- A100 numbers


def test_llama8b_a100_batch1_decode_is_about_10ms_and_memory_bound():
    terms = decode_batch1(CostModel(LLAMA_8B, A100, mode="roofline"))
    assert terms["step_s"] == pytest.approx(10e-3, rel=0.10)
    assert terms["memory_s"] > 10 * terms["compute_s"]
    assert terms["allreduce_s"] == 0.0


def test_llama8b_a100_pure_roofline_is_7_9ms():
    terms = decode_batch1(CostModel(LLAMA_8B, ideal(A100)))
    assert terms["step_s"] == pytest.approx(7.9e-3, rel=0.02)  # 16.06 GB weights + 64 MiB KV at 2.039 TB/s


def test_knee_between_128_and_256_tokens():
    # Definition: tokens per step at which matmul compute time equals weight-read time. Both with the preset's
    # efficiencies (0.7 compute, 0.78 bandwidth) and on the pure roofline.
    assert 128 <= CostModel(LLAMA_8B, A100, mode="roofline").knee_tokens() <= 256
    assert 128 <= CostModel(LLAMA_8B, ideal(A100)).knee_tokens() <= 256


def test_step_shape_changes_from_memory_to_compute_bound_around_the_knee():
    cm = CostModel(LLAMA_8B, A100, mode="roofline")
    small = cm.breakdown(0, 64, 64 * 512, 64)
    large = cm.breakdown(1024, 0, 0, 1)
    assert float(small["memory_s"]) > float(small["compute_s"])
    assert float(large["compute_s"]) > float(large["memory_s"])
    # Flat below the knee: 64 decode tokens cost far less than 64 single-token steps.
    assert float(small["step_s"]) < 2 * float(cm.step_time(0, 1, 512, 1))


def test_llama70b_needs_tp2_on_a100_and_pays_allreduce():
    tp1, tp2 = CostModel(LLAMA_70B, A100, tp=1), CostModel(LLAMA_70B, A100, tp=2)
    assert tp1.max_kv_tokens() == 0  # 141 GB of bf16 weights do not fit in 80 GiB
    # Per GPU, 0.9 * 80 GiB = 77.3 GB hold 70.6 GB of base weights and 4.5 GB of Medusa heads; the rest at
    # 160 KiB per token (half the KV heads): ~14k tokens, ~41k without Medusa.
    assert 10_000 < tp2.max_kv_tokens() < 20_000
    assert CostModel(dataclasses.replace(LLAMA_70B, num_medusa_heads=0), A100, tp=2).max_kv_tokens() > 35_000
    for args in ((0, 1, 512, 1), (0, 64, 64 * 1024, 64), (2048, 0, 0, 1)):
        t1, t2 = tp1.breakdown(*args), tp2.breakdown(*args)
        assert float(t2["step_s"]) < float(t1["step_s"])
        assert float(t2["allreduce_s"]) > 0.0 and float(t1["allreduce_s"]) == 0.0
    # Batch-1 decode: 70.6 GB of weights per GPU at 78% of 2.039 TB/s, plus 160 all-reduces of ~9 us.
    assert float(tp2.step_time(0, 1, 512, 1)) == pytest.approx(45.9e-3, rel=0.02)


def test_empty_step_costs_nothing():
    cm = CostModel(LLAMA_70B, A100, tp=2)
    assert float(cm.step_time(0, 0, 4096, 3, 0)) == 0.0


def test_a_padding_engines_logit_rows_are_priced_as_given():
    """A step of 4 rows, one ending its prompt with a 23-token chunk: 26 decode tokens (a sampling row's whole last
    chunk counts), but the engine computes logits at its 8 rows' sampling slots. Given logit_rows, exactly those
    are priced (the LM head and the vocabulary's elements); without, the shape's bound (decode tokens + 1 for a
    prefill) is. Strictly cheaper where the head's rows cost time (a fitted device: additive FLOPs and logit
    elements); an A100 at these row counts is weight-bound, so there (both modes) the step only never costs more,
    to float32 rounding."""
    for cm, strict in ((CostModel(LLAMA_8B, DEVICES["cpu-measured"]), True),
                       (CostModel(LLAMA_8B, A100, mode="roofline"), False), (CostModel(LLAMA_8B, A100), False)):
        given = {k: float(v) for k, v in cm.breakdown(9, 26, 900, 4, 0, query_slots=64, logit_rows=8).items()}
        bound = {k: float(v) for k, v in cm.breakdown(9, 26, 900, 4, 0, query_slots=64).items()}
        more = {k: float(v) for k, v in cm.breakdown(9, 26, 900, 4, 0, query_slots=64, logit_rows=40).items()}
        assert given["step_s"] <= bound["step_s"] * (1 + 1e-6) and bound["step_s"] <= more["step_s"] * (1 + 1e-6)
        if strict:
            assert given["step_s"] < bound["step_s"] < more["step_s"]
            assert given["logit_elements"] == 8 * LLAMA_8B.vocab_size
            assert bound["logit_elements"] == 27 * LLAMA_8B.vocab_size


# ------------------------------------------------------------------------------------------ traced behaviour


COST_MODELS = [
    CostModel(LLAMA_8B, A100, mode="roofline"),
    CostModel(LLAMA_70B, A100, tp=2),
    CostModel(LLAMA_8B, dataclasses.replace(DEVICES["h100-sxm"], host_overhead_s=1e-4, compute_memory_overlap=0.5)),
]
_JITTED = [jax.jit(cm.step_time) for cm in COST_MODELS]


@pytest.mark.parametrize("index", range(len(COST_MODELS)))
@given(base=st.tuples(*(st.integers(0, 4096) for _ in range(3)), st.integers(1, 64), st.integers(0, 64)),
       step=st.integers(1, 2048))
def test_step_time_is_monotone(index, base, step):
    """Non-decreasing in prefill, decode, KV read and Medusa rows; non-increasing in num_seqs."""
    variants = [base] + [tuple(v + step * (i == j) for j, v in enumerate(base)) for i in range(5)]
    inputs = np.asarray(variants, np.int32).T  # [5 inputs, 6 variants]
    times = np.asarray(_JITTED[index](*inputs))
    assert np.all(np.isfinite(times)) and np.all(times >= 0)
    slack = 1e-6 * times[0]  # float32 rounding
    for i in (0, 1, 2, 4):
        assert times[1 + i] >= times[0] - slack, (i, times)
    assert times[4] <= times[0] + slack, times


def test_jit_vmap_and_scan_match_eager():
    cm = CostModel(LLAMA_70B, A100, tp=2)
    rng = np.random.default_rng(0)
    inputs = [jnp.asarray(rng.integers(lo, hi, size=16), jnp.int32)
              for lo, hi in ((0, 2048), (0, 256), (0, 100_000), (1, 64), (0, 64))]
    eager = cm.step_time(*inputs)
    assert eager.dtype == jnp.float32 and eager.shape == (16,)
    np.testing.assert_allclose(jax.jit(cm.step_time)(*inputs), eager, rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(cm.step_time)(*inputs), eager, rtol=1e-6)

    def body(clock, step_inputs):
        dt = cm.step_time(*step_inputs)
        return clock + dt, dt

    clock, per_step = jax.lax.scan(body, jnp.float32(0.0), tuple(inputs))
    np.testing.assert_allclose(per_step, eager, rtol=1e-6)
    np.testing.assert_allclose(clock, np.sum(np.asarray(eager, np.float64)), rtol=1e-5)
    # Float32 inputs and broadcasting of a scalar against an array work too.
    np.testing.assert_allclose(cm.step_time(inputs[0].astype(jnp.float32), inputs[1], inputs[2], 8, 0),
                               cm.step_time(inputs[0], inputs[1], inputs[2], jnp.full(16, 8), jnp.zeros(16)),
                               rtol=1e-6)


# -------------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("field, value", [
    ("num_layers", 0), ("hidden_size", -1), ("num_kv_heads", 3), ("head_dim", 1.5), ("vocab_size", True),
    ("num_medusa_heads", -1), ("weight_dtype_bytes", 3), ("kv_dtype_bytes", 0), ("tie_word_embeddings", 1),
    ("name", ""),
])
def test_bad_model_spec_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(LLAMA_8B, **{field: value})


@pytest.mark.parametrize("field, value", [
    ("peak_flops_per_s", 0.0), ("hbm_bytes_per_s", -1.0), ("hbm_capacity_bytes", math.nan),
    ("compute_efficiency", 1.5), ("bandwidth_efficiency", 0.0), ("link_bytes_per_s", "fast"),
    ("allreduce_latency_s", -1e-6), ("tp_degree", 0), ("host_overhead_s", -1.0), ("compute_memory_overlap", 2.0),
])
def test_bad_device_spec_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(A100, **{field: value})


def test_bad_tp_degree_names_the_field():
    with pytest.raises(ValueError, match="tp"):
        CostModel(LLAMA_8B, A100, tp=3)  # 32 heads are not divisible by 3
    with pytest.raises(ValueError, match="tp"):
        CostModel(LLAMA_8B, A100, tp=0)
    assert CostModel(LLAMA_8B, dataclasses.replace(A100, tp_degree=4)).tp == 4


# ----------------------------------------------------------------------------------------------- CPU fit


def test_fit_cpu_device_recovers_known_constants():
    known = DeviceSpec("known", peak_flops_per_s=20e9, hbm_bytes_per_s=4e9, hbm_capacity_bytes=math.inf,
                       compute_efficiency=1.0, bandwidth_efficiency=1.0, link_bytes_per_s=math.inf,
                       allreduce_latency_s=0.0, host_overhead_s=3e-3, compute_memory_overlap=0.0)
    truth = CostModel(TINY, known)
    rng = np.random.default_rng(1)
    n = 300
    prefill = rng.integers(0, 512, n) * (rng.random(n) < 0.3)
    num_seqs = rng.integers(1, 16, n)
    decode = num_seqs * rng.integers(1, 6, n)
    kv_read = num_seqs * rng.integers(0, 1024, n)
    medusa = num_seqs * (rng.random(n) < 0.5)
    seconds = np.asarray(truth.step_time(prefill, decode, kv_read, num_seqs, medusa), np.float64)
    seconds *= 1.0 + 0.01 * rng.standard_normal(n)  # 1% measurement noise
    samples = [StepSample(*row) for row in zip(prefill.tolist(), decode.tolist(), kv_read.tolist(),
                                                seconds.tolist(), num_seqs.tolist(), medusa.tolist())]
    fitted = fit_cpu_device(samples, TINY)
    assert fitted.name == "cpu-measured" and fitted.compute_memory_overlap == 0.0
    assert fitted.host_overhead_s == pytest.approx(3e-3, rel=0.05)
    assert fitted.peak_flops_per_s == pytest.approx(20e9, rel=0.05)
    assert fitted.hbm_bytes_per_s == pytest.approx(4e9, rel=0.05)
    predicted = np.asarray(CostModel(TINY, fitted).step_time(prefill, decode, kv_read, num_seqs, medusa))
    np.testing.assert_allclose(predicted, seconds, rtol=0.05)


def test_fit_cpu_device_accepts_plain_tuples_and_clamps_negative_constants():
    # Time independent of KV: the per-byte cost must come out 0 (infinite bandwidth), never negative.
    samples = [(0, d, kv, 1e-3 + 1e-5 * d) for d in (1, 2, 4, 8) for kv in (0, 100, 1000)]
    fitted = fit_cpu_device(samples, TINY)
    assert fitted.host_overhead_s >= 0 and fitted.peak_flops_per_s > 0 and fitted.hbm_bytes_per_s > 0
    with pytest.raises(ValueError, match="samples"):
        fit_cpu_device([(0, 0, 10, 1.0)] * 5, TINY)
    for bad in ((0, 4, -100, 1e-3), (0, -4, 100, 1e-3), (0, float("nan"), 100, 1e-3)):
        with pytest.raises(ValueError, match="counts must be finite and >= 0"):
            fit_cpu_device(samples + [bad], TINY)
    # A fit whose per-FLOP cost is 0 (as for step times that do not grow with tokens) has infinite compute: the
    # knee is then infinite (never compute-bound), and a "knee" verify budget means no cap, not a division by 0.
    flat = dataclasses.replace(fitted, peak_flops_per_s=math.inf)
    assert math.isinf(CostModel(TINY, flat).knee_tokens())
    assert policies.parse_verify_budget("knee", knee=CostModel(TINY, flat).knee_tokens()) is None
    assert policies.parse_verify_budget("knee", knee=150.7) == 150


# ---------------------------------------------------------------------------------------------- measured mode


MEASURED = CostModel(LLAMA_8B, A100)  # the default for this pair: Vidur's A100 profiles


def test_measured_is_the_default_for_the_profiled_pair_only():
    assert MEASURED.resolved_mode == "measured" and not MEASURED.extrapolated
    assert CostModel(LLAMA_8B, A100, mode="roofline").resolved_mode == "roofline"
    for other in (CostModel(LLAMA_8B, DEVICES["h100-sxm"]), CostModel(LLAMA_70B, A100, tp=2),
                  CostModel(LLAMA_8B, ideal(A100)), CostModel(LLAMA_8B, A100, tp=16)):
        assert other.resolved_mode == "roofline", other  # no profile (tp 16 is not profiled)
    # A Medusa head count does not change the base model's profile.
    assert CostModel(dataclasses.replace(LLAMA_8B, num_medusa_heads=0), A100).resolved_mode == "measured"
    h100 = CostModel(LLAMA_8B, DEVICES["h100-sxm"], mode="measured")
    assert h100.extrapolated and "extrapolated" in h100.label
    assert "Vidur" in MEASURED.label and "extrapolated" not in MEASURED.label


def test_cpu_measured_is_a_measured_cost_model_too():
    cpu = CostModel(TINY, DEVICES["cpu-measured"])
    assert DEVICES["cpu-measured"].fitted and cpu.resolved_mode == "measured" and not cpu.extrapolated
    assert CostModel(TINY, DEVICES["cpu-measured"], mode="measured").step_time(0, 4, 100, 4) == cpu.step_time(
        0, 4, 100, 4)
    assert "fitted" in cpu.label
    for mode in ("roofline", "measured-vidur"):
        with pytest.raises(ValueError, match="fitted"):
            CostModel(TINY, DEVICES["cpu-measured"], mode=mode)


def test_bad_mode_names_the_argument():
    with pytest.raises(ValueError, match="mode"):
        CostModel(LLAMA_8B, A100, mode="vidur")
    with pytest.raises(ValueError, match="tp"):
        CostModel(LLAMA_8B, A100, tp=16, mode="measured")  # the profile has tp 1, 2, 4, 8
    with pytest.raises(ValueError, match="fitted"):
        dataclasses.replace(A100, fitted=1)


def test_measured_agrees_with_the_roofline_at_both_ends_and_not_between():
    """The issue's reading of the profiles: batch-1 decode and large prefills agree with the roofline; at 32-384
    tokens a step's GEMMs cost 1.2-2.0x the roofline, with tile steps (128 -> 136 tokens)."""
    roof = CostModel(LLAMA_8B, A100, mode="roofline")
    ratio = lambda *a: float(MEASURED.step_time(*a)) / float(roof.step_time(*a))  # noqa: E731
    assert 1.0 < ratio(0, 1, 512, 1) < 1.25  # 12.2 vs 10.1 ms: 0.745 of peak bandwidth, plus kernel floors
    assert 0.95 < ratio(2048, 0, 0, 1) < 1.4  # compute-bound: 0.63-0.70 of peak, plus the KV write
    lin = lambda t: float(MEASURED.breakdown(t, 0, 0, 1)["linear_s"])  # noqa: E731
    assert lin(136) > 1.3 * lin(128)  # the GEMM tile step (0.394 -> 0.546 ms a layer)
    assert lin(129) == lin(136)  # counts round up to 8, the profile's grid
    roof_lin = lambda t: float(roof.breakdown(t, 0, 0, 1)["roofline_s"])  # noqa: E731
    # The layers' GEMMs alone against the whole roofline step (LM head included), so a lower bound.
    for t in (64, 160, 288):
        assert 1.05 < lin(t) / roof_lin(t) < 2.0, t
    assert lin(384) > roof_lin(384)


def test_measured_vidur_leaves_out_what_vidur_leaves_out():
    vidur = CostModel(LLAMA_8B, A100, mode="measured-vidur")
    decode = {k: float(v) for k, v in MEASURED.breakdown(0, 1, 512, 1).items()}
    assert float(vidur.breakdown(0, 1, 512, 1)["head_s"]) == 0.0
    assert decode["head_s"] == pytest.approx(0.67e-3, rel=0.1)  # LM head ~0.65 ms and the embedding gather
    assert float(vidur.step_time(0, 1, 512, 1)) == pytest.approx(decode["step_s"] - decode["head_s"], rel=1e-6)
    # A fresh 1024-token prefill: Vidur prices its attention as if its chunk were cached (~+5 ms a step).
    extra = float(vidur.breakdown(1024, 0, 0, 1)["attention_s"]) - float(MEASURED.breakdown(1024, 0, 0, 1)[
        "attention_s"])
    assert 3e-3 < extra < 7e-3


_MEASURED_JITTED = [jax.jit(CostModel(LLAMA_8B, A100, tp=tp, mode=mode).step_time)
                    for tp, mode in ((1, "measured"), (2, "measured"), (1, "measured-vidur"))]
_MEASURED_JITTED.append(jax.jit(CostModel(LLAMA_70B, DEVICES["h200"], tp=2, mode="measured").step_time))


@pytest.mark.parametrize("index", range(len(_MEASURED_JITTED)))
@given(base=st.tuples(*(st.integers(0, 4096) for _ in range(3)), st.integers(1, 64), st.integers(0, 64)),
       step=st.integers(1, 2048))
def test_measured_step_time_is_monotone_in_work(index, base, step):
    """Non-decreasing in prefill, decode, KV read and Medusa rows (the tables are running maxima). Not asserted
    for num_seqs: more rows at the same tokens is more decode-attention launches, which the profile charges."""
    variants = [base] + [tuple(v + step * (i == j) for j, v in enumerate(base)) for i in range(5)]
    times = np.asarray(_MEASURED_JITTED[index](*np.asarray(variants, np.int32).T))
    assert np.all(np.isfinite(times)) and np.all(times >= 0)
    slack = 1e-6 * times[0]
    for i in (0, 1, 2, 4):
        assert times[1 + i] >= times[0] - slack, (i, times)


def test_measured_jit_vmap_and_scan_match_eager():
    rng = np.random.default_rng(0)
    inputs = [jnp.asarray(rng.integers(lo, hi, size=16), jnp.int32)
              for lo, hi in ((0, 2048), (0, 256), (0, 100_000), (1, 64), (0, 64))]
    for cost in (MEASURED, CostModel(LLAMA_8B, DEVICES["h100-sxm"], mode="measured-vidur")):
        eager = cost.step_time(*inputs)
        assert eager.dtype == jnp.float32 and eager.shape == (16,)
        np.testing.assert_allclose(jax.jit(cost.step_time)(*inputs), eager, rtol=1e-6)
        np.testing.assert_allclose(jax.vmap(cost.step_time)(*inputs), eager, rtol=1e-6)
        _, per_step = jax.lax.scan(lambda clock, x, c=cost: (clock + c.step_time(*x), c.step_time(*x)),
                                   jnp.float32(0.0), tuple(inputs))
        np.testing.assert_allclose(per_step, eager, rtol=1e-6)
    assert float(MEASURED.step_time(0, 0, 4096, 3, 0)) == 0.0  # an empty step costs nothing in every mode


def test_extrapolation_follows_the_roofline_ratio():
    """H100 / H200 and other models: the profile scaled per operator by the roofline's ratio between them."""
    h100 = CostModel(LLAMA_8B, DEVICES["h100-sxm"], mode="measured")
    a100_lin = float(MEASURED.breakdown(0, 1, 0, 1)["linear_s"])
    # Batch 1 is weight-bound: the linear operators scale with bandwidth (2.039 -> 3.35 TB/s).
    assert float(h100.breakdown(0, 1, 0, 1)["linear_s"]) == pytest.approx(a100_lin * 2.039 / 3.35, rel=1e-5)
    # Llama-3-70B at tp 2 on A100: the per-layer weights ratio and 80 layers.
    big = CostModel(LLAMA_70B, A100, tp=2, mode="measured")
    ref = CostModel(LLAMA_8B, A100, tp=2, mode="measured")
    expected = (float(ref.breakdown(0, 1, 0, 1)["linear_s"]) * 80 / 32
                * LLAMA_70B._layer_matmul_params / LLAMA_8B._layer_matmul_params)
    assert float(big.breakdown(0, 1, 0, 1)["linear_s"]) == pytest.approx(expected, rel=1e-5)


def test_profile_file_states_its_source():
    doc = json.loads((kernel_profiles.PROFILE_DIR / kernel_profiles.REFERENCE_PROFILE.file).read_text())
    assert "microsoft/vidur" in doc["source"] and "MIT" in doc["source"] and "7d47513" in doc["source"]
    tables = kernel_profiles.load_profile(kernel_profiles.REFERENCE_PROFILE.file)
    assert sorted(tables["linear"]) == [1, 2, 4, 8]
    assert all(np.all(np.diff(t) >= 0) for t in tables["linear"].values())


# ----------------------------------------------------------------------------------------------- priced swaps


def test_swap_time_is_the_blocks_bytes_over_the_host_link():
    """Llama-3-70B on 2 x H100: a 16-token block is 16 * 320 KiB / 2 per device; the H100's default link is PCIe
    Gen5 x16 (50.4 GB/s effective). Linear in the blocks, inversely in the link; zero blocks cost zero; disk blocks
    add the whole model's KV of each block at the disk's bandwidth."""
    from skvs_jax.sim.specs import DISK_BYTES_PER_S, HOST_LINKS

    h100 = DEVICES["h100-sxm"]
    cm = CostModel(LLAMA_70B, h100, tp=2)
    assert cm.host_link == h100.host_link == "pcie-gen5-x16" and CostModel(LLAMA_8B, A100).host_link == "pcie-gen4-x16"
    block = 16 * 320 * KIB / 2
    assert float(cm.swap_time(100, 0, 16)) == pytest.approx(100 * block / 50.4e9, rel=1e-6)
    assert float(cm.swap_time(30, 70, 16)) == pytest.approx(float(cm.swap_time(100, 0, 16)), rel=1e-6)
    assert float(cm.swap_time(200, 0, 16)) == pytest.approx(2 * float(cm.swap_time(100, 0, 16)), rel=1e-6)
    assert float(cm.swap_time(0, 0, 16)) == 0.0
    times = {name: float(CostModel(LLAMA_70B, h100, tp=2, host_link=name).swap_time(100, 0, 16))
             for name in HOST_LINKS}
    assert times["pcie-gen4-x16"] == pytest.approx(2 * times["pcie-gen5-x16"], rel=1e-6)
    assert times["nvlink-c2c"] == pytest.approx(times["pcie-gen5-x16"] * 50.4 / 360, rel=1e-6)
    assert times["unpriced"] == 0.0
    disk = float(cm.swap_time(100, 0, 16, disk_blocks=100)) - float(cm.swap_time(100, 0, 16))
    assert disk == pytest.approx(100 * 16 * 320 * KIB / DISK_BYTES_PER_S, rel=1e-5)
    batched = cm.swap_time(jnp.asarray([0, 10, 20]), jnp.asarray([5, 0, 0]), 16)  # jnp: jit/vmap-friendly
    assert batched.shape == (3,) and float(batched[2]) == pytest.approx(2 * float(batched[1]), rel=1e-6)
    with pytest.raises(ValueError, match="host_link"):
        CostModel(LLAMA_70B, h100, tp=2, host_link="usb-2")
    with pytest.raises(ValueError, match="host_link"):
        dataclasses.replace(h100, host_link="usb-2")
    with pytest.raises(ValueError, match="disk_bytes_per_s"):
        CostModel(LLAMA_70B, h100, tp=2, disk_bytes_per_s=0.0)


@pytest.fixture(scope="module")
def starved():
    """Llama-3.1-8B on an A100 with 40 KV blocks of 16 for 12 requests arriving at once: preemption happens."""
    from skvs_jax import scheduler as sc
    from skvs_jax import workloads
    from skvs_jax.config import CacheConfig
    from skvs_jax.sim import simulate as sim

    trace = workloads.make("sharegpt", 12, seed=3, rate=None, max_prompt_len=160, max_output_len=96)
    cache = CacheConfig(num_blocks=41, block_size=16, max_seqs=8, max_blocks_per_seq=16)

    def run(preemption: str, host_link: str):
        cfg = sc.SchedulerConfig(cache=cache, policy=policies.vllm_default().replace(preemption=preemption),
                                 max_running=8, token_budget=256, prefill_chunk=128, swap_blocks=400)
        cost = CostModel(LLAMA_8B, A100, host_link=host_link)
        st, log = sim.simulate(sim.make_trace(trace, cfg), cfg.policy.knobs(), cfg=cfg, cost=cost, max_steps=600)
        act = np.asarray(log.active)
        return jax.device_get(st.counters), float(np.asarray(log.duration, np.float64)[act].sum())

    return run


@pytest.mark.slow  # the default run's time budget (docs: `pytest -m slow`)
def test_the_simulator_prices_swaps_and_nothing_else(starved):
    """Arrivals at t = 0, so the schedule does not depend on the clock: swap runs schedule the same on every link,
    and their simulated time grows by the transfer time, twice as much on PCIe Gen4 as on Gen5. (A policy that
    recomputes never reaches the pricing: it is traced only under preemption="swap" with a swap space.)"""
    unpriced, t0 = starved("swap", "unpriced")
    gen4, t4 = starved("swap", "pcie-gen4-x16")
    gen5, t5 = starved("swap", "pcie-gen5-x16")
    assert int(unpriced.preempt_swap) > 0 and int(unpriced.swap_ins) > 0
    for field in unpriced.__dataclass_fields__:
        assert int(getattr(unpriced, field)) == int(getattr(gen4, field)) == int(getattr(gen5, field)), field
    assert t4 - t0 > 0 and (t4 - t0) == pytest.approx(2 * (t5 - t0), rel=1e-3)
