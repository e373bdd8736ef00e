"""`simulate` on synthetic traces and acceptance models (replaying a real engine run: tests/test_engine.py)."""

import jax
import jax.numpy as jnp
import numpy as np

from skvs_jax import engine, policies, workloads
from skvs_jax.config import CacheConfig
from skvs_jax.sim import cost_model as cm
from skvs_jax.sim import simulate as sim

# As in test_engine: tight enough that recompute preemptions and prefix hits happen.
CACHE = CacheConfig(num_blocks=48, block_size=8, max_seqs=8, max_blocks_per_seq=16)


def test_chain_acceptance_has_the_expected_mean_run():
    alphas = jnp.asarray([0.8, 0.6, 0.5, 0.4], jnp.float32)
    runs = np.asarray(sim.chain_acceptance(alphas, (200, 250), jax.random.key(0)))
    expected = float(np.sum(np.cumprod(np.asarray(alphas))))  # E[run] = sum_i prod_{j<=i} alpha_j
    assert abs(runs.mean() - expected) < 0.02 and runs.min() == 0 and runs.max() == 4


def test_a_synthetic_trace_with_arrivals_runs_to_completion():
    """Poisson arrivals, synthetic outputs, a chain acceptance model: every request finishes, the clock jumps
    over idle gaps, and latencies are consistent."""
    cfg = engine.sc.SchedulerConfig(cache=CACHE, policy=policies.naive_spec(4), max_running=8, token_budget=64)
    trace = workloads.make("sharegpt", 24, seed=2, rate=20.0, max_prompt_len=60, max_output_len=40)
    runs = sim.chain_acceptance([0.7, 0.5, 0.4, 0.3], (24, cfg.max_len + 5), jax.random.key(1))
    st_trace = sim.make_trace(trace, cfg, accept_runs={r.request_id: np.asarray(runs[i])
                                                        for i, r in enumerate(sorted(trace.requests,
                                                                                     key=lambda r: (r.arrival_time,
                                                                                                    r.request_id)))})
    cost = cm.CostModel(cm.MODELS["llama-3.1-8b"], cm.DEVICES["h100-sxm"])
    st, log = sim.simulate(st_trace, policies.naive_spec(4).knobs(), cfg=cfg, cost=cost, max_steps=600)
    m = sim.summarize(log, st_trace, cfg)
    assert m["num_aborted"] == 0 and int(st.counters.finished) == 24
    first, finish = np.asarray(log.first_token_time), np.asarray(log.finish_time)
    arrival = np.asarray(st_trace.arrival)
    assert np.all(arrival <= first) and np.all(first <= finish)
    assert 0 < m["acceptance_rate"] < 1 and m["throughput"] > 0


def test_one_compiled_call_sweeps_policy_knobs_and_matches_separate_runs():
    """Knobs are data: `vmap` over draft length and max_spec_ratio runs four simulations in one program, each
    identical to its own run."""
    cfg = engine.sc.SchedulerConfig(cache=CACHE, policy=policies.skvs(4), max_running=8, token_budget=64)
    trace = workloads.make("sharegpt", 16, seed=2, rate=20.0, max_prompt_len=60, max_output_len=30)
    reqs = sorted(trace.requests, key=lambda r: (r.arrival_time, r.request_id))
    runs = sim.chain_acceptance([0.7, 0.5, 0.4, 0.3], (16, cfg.max_len + 5), jax.random.key(1))
    st_trace = sim.make_trace(trace, cfg, accept_runs={r.request_id: np.asarray(runs[i]) for i, r in enumerate(reqs)})
    cost = cm.CostModel(cm.MODELS["llama-3.1-8b"], cm.DEVICES["h100-sxm"])
    base = policies.skvs(4).knobs()
    ks, ratios = jnp.asarray([0, 2, 4, 4], jnp.int32), jnp.asarray([0.3, 0.3, 0.3, 1.0], jnp.float32)
    sweep = base.replace(draft_len=ks, max_spec_ratio=ratios, generation_threshold=jnp.full((4,), 8, jnp.int32))
    states, logs = jax.vmap(lambda kn: sim.simulate(st_trace, kn, cfg=cfg, cost=cost, max_steps=400))(sweep)
    assert np.all(np.asarray(states.counters.finished) == 16)
    assert int(states.counters.drafted[0]) == 0 < int(states.counters.drafted[2])  # draft length 0: no speculation
    for i in (1, 3):
        _, alone = sim.simulate(st_trace, base.replace(draft_len=ks[i], max_spec_ratio=ratios[i]), cfg=cfg,
                                cost=cost, max_steps=400)
        for field in ("blocks_used", "drafted", "accepted", "output_tokens", "duration"):
            np.testing.assert_array_equal(np.asarray(getattr(alone, field)), np.asarray(getattr(logs, field))[i])
