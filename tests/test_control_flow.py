"""The GPU's program, traced and run on this CPU: `SchedulerConfig.control_flow="select"` (no `cond` or data-dependent
loop where rare work was skipped) and `prefix_sums="dense"` (no gather, scan or sort for sums in priority order)
decide exactly what the CPU's program ("skip", "scan") decides, and the step program holds few heavy primitives and
no host round trip but the ones kept on purpose (`testing.program`; docs/scheduler.md, "The step program as a
GPU runs it").

Equality: the scheduler in lockstep with the plain-Python oracle (tests/test_scheduler.py's workloads and
configs), a vmapped simulator sweep against its lanes' own runs, and the engine against the CPU engine's tokens
(tests/test_engine_dispatch.py).
"""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from test_scheduler import CONFIGS, KNOBS, VOCAB, workload

from skvs_jax import policies, workloads
from skvs_jax import scheduler as sc
from skvs_jax.config import CacheConfig
from skvs_jax.sim import cost_model as cm
from skvs_jax.sim import simulate as sim
from skvs_jax.sim import sweep
from skvs_jax.testing import program
from skvs_jax.testing.scheduler_harness import Harness

GPU = dict(control_flow="select", prefix_sums="dense")


def _gpu(cfg: sc.SchedulerConfig) -> sc.SchedulerConfig:
    return dataclasses.replace(cfg, **GPU)


def test_the_choices_default_from_the_backend_and_are_checked():
    cfg = CONFIGS["skvs"]
    cpu = jax.default_backend() == "cpu"
    assert cfg.control_flow == ("skip" if cpu else "select") and cfg.prefix_sums == ("scan" if cpu else "dense")
    assert _gpu(cfg).dense and not _gpu(cfg).skip and not _gpu(cfg).kv.skip
    big = dataclasses.replace(cfg, cache=CacheConfig(num_blocks=2000, block_size=4, max_seqs=513,
                                                     max_blocks_per_seq=8), max_running=5)
    assert not _gpu(big).dense  # past RANK_BY_COUNTING slots prefix sums scan whatever the choice
    for field, bad in (("control_flow", "branchless"), ("prefix_sums", "cumsum")):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(cfg, **{field: bad})


def test_select_forms_mean_what_the_skips_mean_under_jit_and_vmap():
    """`vmap_flow.cond(..., skip=False)` and `select_when` give `lax.cond`'s and `when`'s results, with no control
    flow left in the program, unbatched and per lane under vmap."""
    import jax.numpy as jnp

    from skvs_jax import vmap_flow

    def both(pred, x):
        c = vmap_flow.cond(pred, lambda v: v * 2, lambda v: v - 1, x, skip=False)
        w = vmap_flow.when_for(False)(pred, lambda v: v + 10, x)
        return c, w

    xs, preds = jnp.arange(6.0), jnp.asarray([True, False, True, True, False, False])
    for fn in (jax.jit(jax.vmap(both)), jax.vmap(jax.jit(both))):
        c, w = fn(preds, xs)
        np.testing.assert_array_equal(c, np.where(preds, xs * 2, xs - 1))
        np.testing.assert_array_equal(w, np.where(preds, xs + 10, xs))
    assert program.heavy(jax.make_jaxpr(both)(True, 1.0))["cond"] == 0
    assert program.heavy(jax.make_jaxpr(both)(True, 1.0))["while"] == 0
    assert vmap_flow.when_for(True) is vmap_flow.when


# Every phase the choices touch: preemption by recompute and by swap, priced draft blocks (a cond in skip mode),
# the goodput controller, prefix hits (admission's lookup and shared idle blocks), on-fill indexing (stale
# entries removed), lazy release without a pool, mandatory drafts.
LOCKSTEP = ("skvs", "naive_spec", "skvs_article-priced-swap", "skvs-lazy-nopool-nobarrier-onfill",
            "skvs-fixedK-prefillspec-preempt-most_progress")


@pytest.mark.parametrize("name", LOCKSTEP)
@settings(max_examples=2, deadline=None)
@given(seed=hs.integers(0, 2**32 - 1), steps=hs.integers(30, 60), add_p=hs.sampled_from([0.5, 0.8]))
def test_the_gpu_program_matches_the_oracle(name, seed, steps, add_p):
    cfg = _gpu(CONFIGS[name])
    h = Harness(cfg, vocab=VOCAB, knobs=KNOBS.get(name))
    h.run(workload(cfg, seed, steps, add_p, 0.05))


@pytest.mark.parametrize("name", ["skvs_article-priced-swap", "skvs-lazy-nopool-nobarrier-onfill"])
@settings(max_examples=1, deadline=None)
@given(seed=hs.integers(0, 2**32 - 1), steps=hs.integers(30, 60))
def test_the_mixed_program_matches_the_oracle(name, seed, steps):
    """control_flow "mixed": cheap skips selected, the passes over [B, M], [N] or [C] skipped (each site is one of
    the two forms the other programs run; this checks them combined)."""
    cfg = dataclasses.replace(CONFIGS[name], control_flow="mixed", prefix_sums="dense")
    assert cfg.skip_costly and not cfg.skip
    h = Harness(cfg, vocab=VOCAB, knobs=KNOBS.get(name))
    h.run(workload(cfg, seed, steps, 0.8, 0.05))


# the default run's time budget (`pytest -m slow`); test_engine_dispatch keeps the GPU program's tokens
@pytest.mark.slow
def test_a_vmapped_sweep_of_the_gpu_program_matches_its_lanes_own_runs():
    """Under vmap, selects replace the batched `vmap_flow` rules: each lane still runs as it would alone."""
    cache = CacheConfig(num_blocks=25, block_size=8, max_seqs=8, max_blocks_per_seq=16)
    cfg = sc.SchedulerConfig(cache=cache, policy=policies.skvs(4), max_running=8, token_budget=64,
                             prefix_capacity=256, **GPU)
    cost = cm.CostModel(cm.MODELS["llama-3.1-8b"], cm.DEVICES["h100-sxm"])
    tr = workloads.make("sharegpt", 12, seed=3, rate=20.0, max_prompt_len=60, max_output_len=30)
    runs = sim.chain_acceptance([0.7, 0.5, 0.4, 0.3], (12, cfg.max_len + 5), jax.random.key(3))
    reqs = sorted(tr.requests, key=lambda r: (r.arrival_time, r.request_id))
    trace = sim.make_trace(tr, cfg, accept_runs={r.request_id: np.asarray(runs[i]) for i, r in enumerate(reqs)})
    lanes, labels = sweep.grid(cfg.policy.knobs(), cfg=cfg, draft_len=[0, 4], arrival_scale=[1.0, 0.25])
    states, logs = sweep.run(sweep.stack([trace]), lanes, cfg=cfg, cost=cost, max_steps=256, chunk=64)
    assert np.all(sweep.finished(states) == 12)
    for i, lab in enumerate(labels):
        knobs = cfg.policy.knobs().replace(draft_len=np.int32(lab["draft_len"]))
        _, alone = sim.simulate(trace.replace(arrival=trace.arrival * lab["arrival_scale"]), knobs, cfg=cfg,
                                cost=cost, max_steps=256)
        n = int(np.asarray(alone.active).sum())
        for field in ("blocks_used", "drafted", "accepted", "output_tokens", "preempted"):
            np.testing.assert_array_equal(np.asarray(getattr(alone, field))[:n],
                                          np.asarray(getattr(logs, field))[i, :n], err_msg=field)


# Upper bounds on `schedule`'s heavy primitives at the bench's geometry (8 slots, 64 blocks of 8, K = 4), per
# policy and program. The jaxpr does not depend on the backend; the bounds hold the counts measured when they were
# set (docs/scheduler.md) with a little room, so that a change that adds kernels to every step shows here.
SMALL = CacheConfig(num_blocks=65, block_size=8, max_seqs=8, max_blocks_per_seq=16)
BOUNDS = {  # (policy, program): {kind: most}; "total" bounds the sum
    # The CPU's 8th loop is the skip of swap-in and admission in steps with no SWAPPED or WAITING row (a loop
    # costs a CPU nothing; its ~100 kernels cost ~30-60 us a step at 256 slots, measured); its 6th cond skips
    # room_after's recount of the evictable blocks ([N]) when nobody was preempted.
    ("skvs", "cpu"): dict(total=146, gather=61, scatter=49, sort=3, cumsum=22, **{"while": 8, "cond": 6}),
    ("skvs", "gpu"): dict(total=76, gather=37, scatter=34, sort=1, cumsum=5, **{"while": 1, "cond": 0}),
    ("naive_spec", "gpu"): dict(total=75, gather=36, scatter=34, sort=1, cumsum=5, **{"while": 1, "cond": 0}),
    ("skvs", "mixed"): dict(total=88, gather=40, scatter=37, sort=1, cumsum=5, **{"while": 5, "cond": 1}),
}


@pytest.mark.parametrize("name, target", list(BOUNDS))
def test_schedule_holds_few_heavy_primitives(name, target):
    choices = {"gpu": GPU, "cpu": dict(control_flow="skip", prefix_sums="scan"),
               "mixed": dict(control_flow="mixed", prefix_sums="dense")}[target]
    cfg = sc.SchedulerConfig(cache=SMALL, policy=policies.preset(name), max_running=8, token_budget=128,
                             prefill_chunk=32, **choices)
    jaxpr = jax.make_jaxpr(lambda st, k: sc.schedule_unchecked(st, k, cfg=cfg))(sc.init(cfg), cfg.policy.knobs())
    counts = program.heavy(jaxpr)
    bound = BOUNDS[name, target]
    assert sum(counts.values()) <= bound["total"], counts
    assert all(counts[k] <= bound[k] for k in program.KINDS), counts
    if target == "gpu":  # the one loop left is eviction's skip (a sort over N blocks), kept on purpose
        assert program.by_source(jaxpr, ("while", "cond")) == {"kv/manager.py:evict": {"while": 1}}


def test_the_engine_step_keeps_only_the_round_trips_chosen(shipped):
    """The fused step (schedule, model, sampling, verification, update) outside the model, as a GPU runs it: the
    control flow left is eviction's skip, the prefix index's insert (its skip and its loop over new block
    positions) and three vocabulary-sized sampling options (filtering, n > 1 siblings, logprobs)."""
    from skvs_jax.serve import engine, engine_step

    model, heads = shipped
    e = engine.Engine(model, heads, policies.skvs(4), SMALL, token_budget=128, prefill_chunk=32, step_cost="flat",
                      steps_per_dispatch=1, **GPU)
    width = engine_step.narrow_width(e.cfg)
    jaxpr = jax.make_jaxpr(lambda p, st, k: engine_step.fused_step(e.runner, p, st, k, cfg=e.cfg, width=width))(
        e.params, e.state, e.knobs)
    flow = program.by_source(jaxpr, ("while", "cond"), exclude=program.MODEL_SOURCES)
    assert flow == {"kv/manager.py:evict": {"while": 1}, "kv/manager.py:index_rows": {"while": 1},
                    "kv/prefix_cache.py:insert_unchecked": {"while": 1},
                    "serve/engine_step.py:_emitted_logprobs": {"cond": 1}, "serve/sampling.py:process": {"cond": 1},
                    "serve/sampling.py:sibling_tokens": {"cond": 1}}, flow
