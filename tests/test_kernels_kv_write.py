"""write_kv: one shared contract run by every implementation, against a plain-NumPy scatter oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pallas_kernels as pk

FEW = settings(max_examples=10 if settings.default.max_examples <= 30 else settings.default.max_examples,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors])
QUANT = (jnp.int8, jnp.float8_e4m3fn)


def make_pages(rng, N, S, H, D, dtype):
    k = rng.standard_normal((N, S, H, D)).astype(np.float32)
    v = rng.standard_normal((N, S, H, D)).astype(np.float32)
    if dtype in QUANT:
        kq, ks = pk.quantize_kv(jnp.asarray(k), dtype)
        vq, vs = pk.quantize_kv(jnp.asarray(v), dtype)
        return kq, vq, ks, vs
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype), None, None


def oracle(pages, new, slots):
    """Plain loop: pages [N, S, ...] numpy, new [T, ...], slots [T] -> written copy."""
    out = np.array(pages, copy=True)
    S = out.shape[1]
    for t, slot in enumerate(slots):
        if slot >= 0:
            out[slot // S, slot % S] = new[t]
    return out


def as_np(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


class WriteKvContract:
    impl: str
    interpret: bool | None = None

    @FEW
    @given(seed=st.integers(0, 2**31 - 1), S=st.sampled_from([8, 16]), T=st.integers(1, 9),
           dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn]))
    def test_matches_scatter_oracle(self, seed, S, T, dtype):
        rng = np.random.default_rng(seed)
        N, H, D = 4, 2, 16
        kp, vp, ks, vs = make_pages(rng, N, S, H, D, dtype)
        slots = rng.choice(N * S, size=T, replace=False).astype(np.int32)
        slots[rng.random(T) < 0.3] = -1  # padding tokens
        k_new = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
        v_new = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
        out = pk.write_kv(kp, vp, k_new, v_new, jnp.asarray(slots), k_scales=ks, v_scales=vs, impl=self.impl,
                          interpret=self.interpret)
        if dtype in QUANT:
            kq, kss = pk.quantize_kv(k_new, dtype)
            vq, vss = pk.quantize_kv(v_new, dtype)
            want = [oracle(as_np(kp), as_np(kq), slots), oracle(as_np(vp), as_np(vq), slots),
                    oracle(np.asarray(ks), np.asarray(kss), slots), oracle(np.asarray(vs), np.asarray(vss), slots)]
            assert len(out) == 4 and out[0].dtype == jnp.dtype(dtype)
            # The dequantised write is within half a quantisation step of the float input.
            deq = np.asarray(pk.dequantize_kv(out[0], out[2]))
            live = slots >= 0
            got_rows = deq[slots[live] // S, slots[live] % S]
            x, scale = np.asarray(k_new)[live], np.asarray(kss)[live][..., None]
            # int8: half a step; e4m3: 3 mantissa bits (relative 2^-4) down to subnormal steps of 2^-9.
            bound = 0.5 * scale if dtype == jnp.int8 else np.abs(x) / 16 + scale / 1024
            assert np.all(np.abs(got_rows - x) <= bound + 1e-6)
        else:
            want = [oracle(as_np(kp), as_np(k_new.astype(dtype)), slots),
                    oracle(as_np(vp), as_np(v_new.astype(dtype)), slots)]
            assert len(out) == 2 and out[0].dtype == jnp.dtype(dtype)
        for got, w in zip(out, want):
            np.testing.assert_array_equal(as_np(got), w)

    def test_jitted_with_donation_updates_in_place(self):
        rng = np.random.default_rng(0)
        kp, vp, _, _ = make_pages(rng, 3, 8, 2, 16, jnp.float32)
        new = jnp.ones((2, 2, 16), jnp.float32)
        step = jax.jit(lambda k, v, s: pk.write_kv(k, v, new, new, s, impl=self.impl, interpret=self.interpret),
                       donate_argnums=(0, 1))
        k2, v2 = step(kp + 0, vp + 0, jnp.asarray([9, -1], jnp.int32))
        np.testing.assert_array_equal(np.asarray(k2[1, 1]), 1.0)
        np.testing.assert_array_equal(np.asarray(k2[0]), np.asarray(kp[0]))


class TestReference(WriteKvContract):
    impl = "reference"


class TestPallasInterpret(WriteKvContract):
    impl = "pallas"
    interpret = True


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Pallas kernels need a GPU")
class TestPallasCompiled(WriteKvContract):
    impl = "pallas"
    interpret = False


def test_quantize_round_trip_and_zero_vector():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 3, 16)), jnp.float32).at[0, 0].set(0.0)
    for dtype, rel in ((jnp.int8, 0.5 / 127), (jnp.float8_e4m3fn, 1 / 16)):
        q, s = pk.quantize_kv(x, dtype)
        assert q.dtype == jnp.dtype(dtype) and s.shape == (5, 3) and s.dtype == jnp.float32
        assert float(s[0, 0]) == 0.0 and np.all(np.asarray(pk.dequantize_kv(q, s))[0, 0] == 0)
        err = np.abs(np.asarray(pk.dequantize_kv(q, s)) - np.asarray(x))
        assert np.all(err <= rel * np.max(np.abs(np.asarray(x)), axis=-1, keepdims=True) + 1e-7)


@pytest.mark.parametrize("kw, error, match", [
    (dict(k_new=jnp.zeros((2, 3, 16))), ValueError, "k_new must have shape"),
    (dict(slot_mapping=jnp.zeros((3,), jnp.int32)), ValueError, "slot_mapping must have shape"),
    (dict(slot_mapping=jnp.zeros((2,), jnp.float32)), TypeError, "slot_mapping must have dtype"),
    (dict(slot_mapping=jnp.asarray([0, 24], jnp.int32)), ValueError, "slot_mapping entries must be <"),
    (dict(k_new=jnp.zeros((2, 2, 16), jnp.int32)), TypeError, "k_new must have dtype"),
    (dict(k_scales=jnp.zeros((3, 8, 2))), ValueError, "must be None"),
    (dict(k_pages=jnp.zeros((0, 8, 2, 16)), v_pages=jnp.zeros((0, 8, 2, 16))), ValueError, "N = 0"),
    (dict(k_pages=jnp.zeros((3, 8, 2, 0), jnp.int8), v_pages=jnp.zeros((3, 8, 2, 0), jnp.int8),
          k_scales=jnp.zeros((3, 8, 2)), v_scales=jnp.zeros((3, 8, 2)), k_new=jnp.zeros((2, 2, 0)),
          v_new=jnp.zeros((2, 2, 0))), ValueError, "D = 0"),  # failed inside the quantiser's reduction
])
def test_bad_input_names_the_argument(kw, error, match):
    args = dict(k_pages=jnp.zeros((3, 8, 2, 16)), v_pages=jnp.zeros((3, 8, 2, 16)), k_new=jnp.zeros((2, 2, 16)),
                v_new=jnp.zeros((2, 2, 16)), slot_mapping=jnp.zeros((2,), jnp.int32))
    args.update(kw)
    with pytest.raises(error, match=match):
        pk.write_kv(**args)
