"""`simulate` is the engine's scheduler: replaying a real run reproduces its schedule exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reference_models import checkpoint, train
from skvs_jax import engine, policies, workloads
from skvs_jax.config import CacheConfig
from skvs_jax.model_runner import LlamaMedusaRunner
from skvs_jax.sim import cost_model as cm
from skvs_jax.sim import simulate as sim

# As in test_engine: tight enough that recompute preemptions and prefix hits happen.
CACHE = CacheConfig(num_blocks=48, block_size=8, max_seqs=8, max_blocks_per_seq=16)


@pytest.fixture(scope="module")
def trace():
    return workloads.make("system_prompts", 10, seed=1, system_prompt_len=40, max_prompt_len=80, max_output_len=20)


@pytest.fixture(scope="module")
def served(trace):
    """The real engine (skvs, greedy) on the trace, warmed up, every request arriving at t = 0."""
    model = checkpoint.load_llama(train.WEIGHTS_DIR / "tiny_llama")
    heads = checkpoint.load_medusa(train.WEIGHTS_DIR / "tiny_llama_medusa")
    e = engine.Engine(model, heads, policies.skvs(4), CACHE, token_budget=96, prefill_chunk=32)
    e.warmup()
    for r in trace.requests:
        e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens), request_id=r.request_id,
                      arrival_time=0.0)
    out = e.run()
    runner, params = LlamaMedusaRunner.create(model, heads)
    runs = sim.replay_acceptance(runner, params, {r.request_id: list(r.prompt) + out[r.request_id]
                                                  for r in trace.requests}, e.policy.draft_len)
    return e, out, runs


def _cpu_cost(e: engine.Engine) -> cm.CostModel:
    log = e.step_log
    gaps = [b["start"] - a["start"] for a, b in zip(log, log[1:])] + [log[-1]["duration"]]
    samples = [cm.StepSample(s["prefill_tokens"], s["decode_tokens"], s["kv_tokens_read"], g, s["num_seqs"],
                             s["drafting_rows"]) for s, g in zip(log, gaps)]
    return cm.CostModel(cm.MODELS["tiny"], cm.fit_cpu_device(samples))


def test_replaying_a_real_run_reproduces_its_schedule_exactly(served, trace):
    e, out, runs = served
    st_trace = sim.make_trace(trace, e.cfg.sched, outputs=out, accept_runs=runs)
    st, log = sim.simulate(st_trace, e.knobs, cfg=e.cfg.sched, cost=_cpu_cost(e), max_steps=200)
    real, simulated = jax.device_get(e.state.sched.counters), jax.device_get(st.counters)
    for field in real.__dataclass_fields__:  # preemptions, prefix hits, drafts, acceptance, steps: all equal
        assert int(getattr(real, field)) == int(getattr(simulated, field)), field
    active = np.asarray(log.active)
    assert int(active.sum()) == len(e.step_log) and not active[len(e.step_log):].any()
    for key, col in (("blocks_used", log.blocks_used), ("spec_blocks", log.spec_blocks), ("oom", log.oom),
                     ("drafted", log.drafted), ("output_tokens", log.output_tokens)):
        assert np.asarray(col)[active].tolist() == [s[key] for s in e.step_log], key
    assert int(real.preempt_recompute) > 0 and int(real.cached_tokens) > 0 and int(real.accepted) > 0
    # The simulated tokens are the engine's: the final token table matches row by row.
    m = sim.summarize(log, st_trace, e.cfg.sched)
    assert m["num_requests"] == len(trace.requests) and m["num_aborted"] == 0
    assert m["output_tokens"] == sum(len(v) for v in out.values())


def test_the_cost_model_prices_the_schedule_a_large_model_would_run(served, trace):
    """The same schedule on Llama-3.1-8B / A100: memory-bound steps of ~10 ms; nothing about the schedule moves."""
    e, out, runs = served
    st_trace = sim.make_trace(trace, e.cfg.sched, outputs=out, accept_runs=runs)
    cost = cm.CostModel(cm.MODELS["llama-3.1-8b"], cm.DEVICES["a100-80gb"])
    st, log = sim.simulate(st_trace, e.knobs, cfg=e.cfg.sched, cost=cost, max_steps=200)
    dur = np.asarray(log.duration)[np.asarray(log.active)]
    assert len(dur) == len(e.step_log) and np.all(dur > 0.009) and np.all(dur < 0.2)
    assert int(st.counters.steps) == int(e.state.sched.counters.steps)


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
