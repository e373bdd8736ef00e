"""The engine sharded over a mesh of CPU devices serves the same tokens, with the same metrics, as on one device;
a simulator sweep sharded over devices gives the same numbers as on one.

XLA fixes the number of CPU devices when jax starts, so each device count runs in a subprocess: this file, run as
a script with XLA_FLAGS=--xla_force_host_platform_device_count=n, serves a small trace on one device and on the
meshes that n devices allow, checks the shardings it sees, and prints a JSON report that the tests read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

NON_TIMING = ("tokens", "blocks_used", "spec_blocks", "oom", "preempted", "drafted", "accepted", "verifications",
              "output_tokens", "prefill_tokens", "decode_tokens", "kv_tokens_read", "num_seqs", "drafting_rows")


# The subprocess compiles for correctness, not speed: with the suite's fast-compile flags (tests/conftest.py sets
# them, probed for this jaxlib, or none under SKVS_TEST_XLA_DEFAULTS=1), and both engines compared run under them.
XLA_FLAGS = os.environ["SKVS_TEST_XLA_FLAGS"]


def _check(devices: int, swap: bool) -> dict:
    """Runs inside the subprocess: serve a small trace on one device (mesh=None), then on a ("dp", "tp") mesh of
    every device with tp = 2 (the model's Hkv), and with swap: sharded again with preemption by swap."""
    import jax
    from jax.sharding import PartitionSpec as P

    from reference_models import checkpoint, train
    from skvs_jax import distributed, policies, workloads
    from skvs_jax.config import CacheConfig
    from skvs_jax.serve import engine

    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    assert jax.device_count() == devices, jax.devices()
    model = checkpoint.load_llama(train.WEIGHTS_DIR / "tiny_llama")
    heads = checkpoint.load_medusa(train.WEIGHTS_DIR / "tiny_llama_medusa")
    # Tight: 4 slots against 15 usable blocks of 8 tokens forces a preemption. One draft bucket and a prefill
    # chunk of 1 + K make every step one width, so each engine compiles one step program.
    cache = CacheConfig(num_blocks=16, block_size=8, max_seqs=4, max_blocks_per_seq=8)
    trace = workloads.make("system_prompts", 5, seed=1, system_prompt_len=16, max_prompt_len=32, max_output_len=12)
    policy = policies.skvs(4).replace(draft_buckets=(4,))
    kw = dict(token_budget=48, prefill_chunk=5)

    def serve(mesh, policy=policy, **extra):
        e = engine.Engine(model, heads, policy, cache, mesh=mesh, **kw, **extra)
        for r in trace.requests:
            e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens), request_id=r.request_id,
                          arrival_time=0.0)
        k0 = e.state.cache.k  # the cache the first step is given: it must be donated, not copied
        out = e.run()
        counters = {f: int(getattr(e.state.sched.counters, f)) for f in e.state.sched.counters.__dataclass_fields__}
        return e, dict(outputs={str(k): v for k, v in out.items()}, counters=counters,
                       steps=[{k: s[k] for k in NON_TIMING} for s in e.step_log],
                       compiled=len(e.compiled), donated=k0.is_deleted())

    def shardings(e) -> dict:
        k0, layer0 = e.state.cache.k, e.params[0]["layers"]  # [N, L, S, Hkv, D]; stacked layers [L, out, in]
        return dict(
            kv_spec=list(k0.sharding.spec), kv_shape=list(k0.shape), kv_devices=len(k0.sharding.device_set),
            kv_shard_shapes=sorted({tuple(s.data.shape) for s in k0.addressable_shards}),
            every_kv_split=all(x.sharding.spec == P(None, None, None, "tp") for x in e.runner.kv_pages(e.state.cache)),
            q_spec=list(layer0["self_attn"]["q_proj"]["weight"][...].sharding.spec),
            o_spec=list(layer0["self_attn"]["o_proj"]["weight"][...].sharding.spec),
            replicated=all(x.sharding.is_fully_replicated for x in jax.tree.leaves(e.state.replace(cache=None))),
        )

    mesh = distributed.make_mesh(tp=2, dp=devices // 2)
    report = dict(single=serve(None)[1], sweep=_check_sweep(devices))
    e, report["sharded"] = serve(mesh)
    report["sharded"].update(shardings(e))
    if swap:  # the cache goes to the host tier and back between the scheduler and the model, and stays split
        e, report["swap"] = serve(mesh, policy.replace(preemption="swap"), swap_blocks=32)
        report["swap"].update(shardings(e))
    if devices >= 4:  # tp = 4 > Hkv = 2: refused at the boundary
        try:
            engine.Engine(model, heads, policy, cache, mesh=distributed.make_mesh(tp=4), **kw)
        except ValueError as err:
            report["tp4_error"] = str(err)
    return report


def _check_sweep(devices: int) -> dict:
    """Runs inside the subprocess: a simulator sweep with its lanes sharded over a ("dp",) mesh of every device
    against the same sweep on one device. 2 * devices lanes divide evenly (their log stays split over dp); 2 *
    devices - 1 lanes are padded to a whole number per device and the padding dropped."""
    import jax
    import numpy as np

    from skvs_jax import policies, workloads
    from skvs_jax import scheduler as sc
    from skvs_jax.config import CacheConfig
    from skvs_jax.sim import cost_model as cm
    from skvs_jax.sim import simulate as sim
    from skvs_jax.sim import sweep

    cfg = sc.SchedulerConfig(cache=CacheConfig(num_blocks=24, block_size=8, max_seqs=4, max_blocks_per_seq=8),
                             policy=policies.skvs(4), max_running=4, token_budget=32)
    trace = workloads.make("sharegpt", 6, seed=3, rate=30.0, max_prompt_len=24, max_output_len=12)
    reqs = sorted(trace.requests, key=lambda r: (r.arrival_time, r.request_id))
    runs = sim.chain_acceptance([0.7, 0.6, 0.5, 0.4], (6, cfg.max_len + 5), jax.random.key(0))
    traces = sweep.stack([sim.make_trace(trace, cfg, accept_runs={r.request_id: np.asarray(runs[i])
                                                                  for i, r in enumerate(reqs)})])
    cost = cm.CostModel(cm.MODELS["llama-3.1-8b"], cm.DEVICES["a100-80gb"])
    lanes, _ = sweep.grid(policies.skvs(4).knobs(), cfg=cfg, kv_blocks=[10, 23], max_spec_ratio=[0.2, 1.0],
                          arrival_scale=[0.5, 1.0, 2.0, 4.0][: max(1, devices // 2)])
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("dp",))
    out = {}
    for num in (2 * devices, 2 * devices - 1):
        part = jax.tree.map(lambda x: x[:num], lanes)  # noqa: B023
        _, alone = sweep.run(traces, part, cfg=cfg, cost=cost, max_steps=256, chunk=64)
        states, split = sweep.run(traces, part, cfg=cfg, cost=cost, max_steps=256, chunk=64, mesh=mesh)
        same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)),
                            alone, split)
        out[str(num)] = dict(same=all(jax.tree.leaves(same)), lanes=int(split.active.shape[0]),
                             finished=np.asarray(states.counters.finished).tolist(),
                             spec=list(split.output_tokens.sharding.spec),
                             shard_rows=sorted({s.data.shape[0] for s in split.output_tokens.addressable_shards}))
    return out


def _run(devices: int, swap: bool = False) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {XLA_FLAGS}",
               JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(devices), str(int(swap))], cwd=root,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_split(m: dict, devices: int) -> None:
    """The cache is split over tp, not replicated: each device holds [N, S, Hkv / tp, D] of every layer."""
    n, layers, s, hkv, d = m["kv_shape"]
    assert m["kv_spec"] == [None, None, None, "tp"] and m["every_kv_split"]
    assert m["kv_shard_shapes"] == [[n, layers, s, hkv // 2, d]] and m["kv_devices"] == devices
    assert m["q_spec"] == [None, "tp", None] and m["o_spec"] == [None, None, "tp"]
    assert m["replicated"]  # scheduler / allocator state, hidden states, sampling parameters, rng
    assert m["donated"] and m["compiled"] == 1


def _assert_same_as_one_device(report: dict, devices: int) -> None:
    single, sharded = report["single"], report["sharded"]
    c = single["counters"]
    assert c["drafted"] > c["accepted"] > 0 and c["preempt_recompute"] > 0 and c["cached_tokens"] > 0
    assert sharded["outputs"] == single["outputs"]  # token-identical greedy outputs
    assert sharded["counters"] == single["counters"]
    assert sharded["steps"] == single["steps"]  # every non-timing per-step metric
    _assert_split(sharded, devices)


def _assert_sweep_split(report: dict, devices: int) -> None:
    even, padded = report["sweep"][str(2 * devices)], report["sweep"][str(2 * devices - 1)]
    assert even["same"] and padded["same"]  # the sharded sweep gives the unsharded sweep's numbers, every field
    assert even["lanes"] == 2 * devices and padded["lanes"] == 2 * devices - 1
    assert all(f == 6 for f in even["finished"] + padded["finished"])
    assert even["spec"] == ["dp"] and even["shard_rows"] == [2]  # two lanes per device, not replicated


@pytest.mark.slow  # the default run's time budget (docs: `pytest -m slow`)
def test_four_devices_give_the_same_tokens_and_metrics():
    report = _run(4)
    _assert_same_as_one_device(report, 4)
    _assert_sweep_split(report, 4)
    assert "mesh" in report["tp4_error"] and "num_kv_heads" in report["tp4_error"]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 8])
def test_two_and_eight_devices_give_the_same_tokens_and_metrics(devices):
    report = _run(devices)
    _assert_same_as_one_device(report, devices)
    _assert_sweep_split(report, devices)
    if devices >= 4:
        assert "mesh" in report["tp4_error"] and "num_kv_heads" in report["tp4_error"]


@pytest.mark.slow
def test_swap_preemption_keeps_the_cache_split():
    report = _run(2, swap=True)
    _assert_same_as_one_device(report, 2)
    swap = report["swap"]
    assert swap["counters"]["preempt_swap"] > 0 and swap["counters"]["swap_ins"] > 0
    assert swap["outputs"] == report["single"]["outputs"]
    _assert_split(swap, 2)


# ------------------------------------------------ the boundary, in this process (its devices) and under 4 devices

# Set in the subprocess that runs the in-process tests again under 4 forced devices.
_FOUR_DEVICE_RUN = "SKVS_TEST_FOUR_DEVICE_RUN"


def test_the_in_process_checks_hold_under_four_devices():
    """This process's device count is fixed when jax starts (1 on a plain CPU run): the in-process tests below run
    again in a pytest subprocess with 4 forced CPU devices, as a multi-GPU machine has, so the suite holds for
    either count."""
    import jax

    if os.environ.get(_FOUR_DEVICE_RUN) or jax.device_count() == 4:
        pytest.skip("this process already has 4 devices")
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {XLA_FLAGS}", JAX_PLATFORMS="cpu")
    env[_FOUR_DEVICE_RUN] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    here = os.path.abspath(__file__)
    tests = [f"{here}::{name}" for name in ("test_a_mesh_is_validated_at_the_boundary",
                                            "test_megatron_specs_split_what_they_should")]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", *tests],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout, proc.stdout[-2000:]


def test_a_mesh_is_validated_at_the_boundary(shipped):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from skvs_jax import distributed, policies
    from skvs_jax.config import CacheConfig
    from skvs_jax.serve import engine
    from skvs_jax.serve.model_runner import LlamaMedusaRunner

    if os.environ.get(_FOUR_DEVICE_RUN):
        assert jax.device_count() == 4, jax.devices()
    cache = CacheConfig(num_blocks=16, block_size=8, max_seqs=4, max_blocks_per_seq=8)
    model, heads = shipped
    with pytest.raises(ValueError, match="mesh must have a 'tp' axis"):
        engine.Engine(model, heads, policies.skvs(4), cache, mesh=Mesh(np.asarray(jax.devices()[:1]), ("x",)))
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        engine.Engine(model, heads, policies.skvs(4), cache, mesh="tp")
    explicit = jax.make_mesh((1,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,))  # jax.make_mesh's default
    with pytest.raises(ValueError, match="mesh axes must be AxisType.Auto"):
        engine.Engine(model, heads, policies.skvs(4), cache, mesh=explicit)
    with pytest.raises(ValueError, match="mesh axes must be AxisType.Auto"):
        distributed.check_mesh(jax.make_mesh((1,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,)), "dp")
    mesh = distributed.make_mesh(tp=1)
    with pytest.raises(ValueError, match="impl='pallas'"):
        engine.Engine(model, heads, policies.skvs(4), cache, mesh=mesh, impl="pallas")
    n = jax.device_count()
    with pytest.raises(ValueError, match=f"dp \\* tp = {2 * n} devices requested, only {n} available"):
        distributed.make_mesh(tp=2, dp=n)
    runner, params = LlamaMedusaRunner.create(model, heads)
    with pytest.raises(ValueError, match="num_kv_heads"):
        runner.param_specs(params, 4)  # tp = 4 does not divide Hkv = 2

    @dataclasses.dataclass(frozen=True)
    class Unshardable:  # a runner without the param_specs / cache_specs hooks
        inner: LlamaMedusaRunner

        def __getattr__(self, name):
            if name in ("param_specs", "cache_specs"):
                raise AttributeError(name)
            return getattr(self.inner, name)

    with pytest.raises(TypeError, match="cannot be sharded"):
        engine.Engine.from_runner(Unshardable(runner), params, policies.skvs(4), cache, mesh=mesh)


def test_megatron_specs_split_what_they_should(shipped):
    from jax.sharding import PartitionSpec as P

    from skvs_jax.serve.model_runner import LlamaMedusaRunner

    runner, params = LlamaMedusaRunner.create(*shipped)
    specs = runner.param_specs(params, 2)
    layer, head = specs[0]["layers"], specs[1]["heads"][2]  # the stacked layers: [L, out, in], L replicated
    for name in ("q_proj", "k_proj", "v_proj"):
        assert layer["self_attn"][name]["weight"].get_value() == P(None, "tp", None)
    assert layer["self_attn"]["o_proj"]["weight"].get_value() == P(None, None, "tp")
    for name in ("gate_proj", "up_proj"):
        assert layer["mlp"][name]["weight"].get_value() == P(None, "tp", None)
    assert layer["mlp"]["down_proj"]["weight"].get_value() == P(None, None, "tp")
    assert layer["input_layernorm"]["weight"].get_value() == P()
    assert specs[0]["embed_tokens"]["embedding"].get_value() == P("tp", None)  # tied: also the LM head
    assert head["lm_head"]["weight"].get_value() == P("tp", None)
    assert head["blocks"][0]["linear"]["weight"].get_value() == head["blocks"][0]["linear"]["bias"].get_value() == P()
    assert runner.cache_specs(runner.init_cache(4, 8, "int8")) == (P(None, None, None, "tp"),) * 4  # pages + scales


if __name__ == "__main__":
    print(json.dumps(_check(int(sys.argv[1]), bool(int(sys.argv[2])))))
