"""Sweeps (`sim.sweep`): many lanes in one compiled call, each identical to its own run; acceptance models."""

import functools
import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skvs_jax import policies, vmap_flow, workloads
from skvs_jax import scheduler as sc
from skvs_jax.config import CacheConfig
from skvs_jax.sim import acceptance_model as am
from skvs_jax.sim import cost_model as cm
from skvs_jax.sim import simulate as sim
from skvs_jax.sim import sweep

CACHE = CacheConfig(num_blocks=48, block_size=8, max_seqs=8, max_blocks_per_seq=16)
SMALL = CacheConfig(num_blocks=25, block_size=8, max_seqs=8, max_blocks_per_seq=16)  # 24 usable blocks
COST = cm.CostModel(cm.MODELS["llama-3.1-8b"], cm.DEVICES["h100-sxm"])
POLICY = policies.skvs(4)


def _cfg(cache):  # one prefix-table size for both pools, so a budget lane and a small pool hash identically
    return sc.SchedulerConfig(cache=cache, policy=POLICY, max_running=8, token_budget=64, prefix_capacity=256)


def _trace(cfg, seed):
    trace = workloads.make("sharegpt", 16, seed=seed, rate=20.0, max_prompt_len=60, max_output_len=30)
    reqs = sorted(trace.requests, key=lambda r: (r.arrival_time, r.request_id))
    runs = sim.chain_acceptance([0.7, 0.5, 0.4, 0.3], (16, cfg.max_len + 5), jax.random.key(seed))
    return sim.make_trace(trace, cfg, accept_runs={r.request_id: np.asarray(runs[i]) for i, r in enumerate(reqs)})


FIELDS = ("blocks_used", "spec_blocks", "drafted", "accepted", "output_tokens", "duration", "oom", "preempted",
          "num_seqs")


def _assert_same_run(alone: sim.SimLog, lanes_log: sim.SimLog, i: int) -> None:
    n = int(np.asarray(alone.active).sum())
    assert int(np.asarray(lanes_log.active)[i].sum()) == n
    for field in FIELDS:
        got = np.asarray(getattr(lanes_log, field))[i, :n]
        np.testing.assert_array_equal(np.asarray(getattr(alone, field))[:n], got, err_msg=field)
    for field in ("ttft", "e2e", "cached_tokens", "preemptions", "req_output"):
        np.testing.assert_array_equal(np.asarray(getattr(alone, field)), np.asarray(getattr(lanes_log, field))[i],
                                      err_msg=field)


@pytest.mark.slow  # the default run's time budget (docs: `pytest -m slow`)
def test_one_sweep_call_over_knobs_budget_load_and_seeds_matches_separate_runs():
    """16 lanes (draft length x KV budget x arrival rate x trace) in one compiled call, advanced in chunks until
    every lane is done. Every lane equals its own run: a KV budget of 24 blocks schedules exactly as a pool of 25
    blocks, and an arrival scale of 0.25 exactly as the trace with its arrival times scaled."""
    cfg = _cfg(CACHE)
    traces = sweep.stack([_trace(cfg, 1), _trace(cfg, 2)])
    base = POLICY.knobs()
    lanes, labels = sweep.grid(base, cfg=cfg, draft_len=[0, 4], kv_blocks=[24, 47], arrival_scale=[1.0, 0.25],
                               traces=[0, 1])
    assert len(labels) == 16 and labels[0] == dict(draft_len=0, max_spec_ratio=pytest.approx(0.3), kv_blocks=24,
                                                   arrival_scale=1.0, trace=0,
                                                   verify_budget=policies.NO_VERIFY_CAP)
    states, logs = sweep.run(traces, lanes, cfg=cfg, cost=COST, max_steps=512, chunk=64)
    assert np.all(sweep.finished(states) == 16)
    assert logs.active.shape[1] < 512  # stopped once every lane was done
    drafted = np.asarray(states.counters.drafted)
    assert all((drafted[i] == 0) == (lab["draft_len"] == 0) for i, lab in enumerate(labels))
    # Memory pressure shows: the 24-block lanes use a larger share of their budget and preempt more.
    ms = sweep.summaries(logs, traces, lanes, cfg)
    tight = [m for m, lab in zip(ms, labels) if lab["kv_blocks"] == 24]
    roomy = [m for m, lab in zip(ms, labels) if lab["kv_blocks"] == 47]
    assert np.mean([m["memory_utilisation"] for m in tight]) > np.mean([m["memory_utilisation"] for m in roomy])
    assert all(0 < m["mean_batch"] <= 8 for m in ms)

    # Every lane against its own run: budget-24 lanes against a 25-block pool, scaled lanes against the trace with
    # its arrival times scaled, each draft length as its own knobs.
    small = _cfg(SMALL)
    for i, lab in enumerate(labels):
        own_cfg = small if lab["kv_blocks"] == 24 else cfg
        tr = _trace(own_cfg, 1 + lab["trace"])
        tr = tr.replace(arrival=tr.arrival * lab["arrival_scale"])
        _, alone = sim.simulate(tr, base.replace(draft_len=jnp.asarray(lab["draft_len"], jnp.int32)), cfg=own_cfg,
                                cost=COST, max_steps=300)
        _assert_same_run(alone, logs, i)
        if i == 0:
            assert ms[i] == pytest.approx(sim.summarize(alone, tr, own_cfg) | {"mean_batch": ms[i]["mean_batch"]},
                                          nan_ok=True)


def test_every_identity_when_false_promise_holds_on_a_sweep(monkeypatch):
    """`vmap_flow.when(..., identity_when_false=True)` drops the per-lane select of a vmapped sweep on its caller's
    word that the update changes nothing where the predicate is False. Each such call here also runs its update
    unconditionally and compares the result with the operand, lane by lane, on a sweep whose lanes disagree
    (two loads, a pool tight enough to evict and preempt, drafts on and off). Every site must be seen with a
    False predicate while another lane's held, and never change anything in such a lane."""
    seen = {}  # "file:function:line" -> [lanes False while another was True, of which the update changed any]

    def record(site, pred, some, same):
        skipped = np.asarray(some).ravel() & ~np.asarray(pred).ravel()  # run without a select, result kept
        counts = seen.setdefault(site, [0, 0])
        counts[0] += int(np.sum(skipped))
        counts[1] += int(np.sum(skipped & ~np.asarray(same).ravel()))

    unchecked = vmap_flow.when

    def checked(pred, fun, x, *, identity_when_false=False):
        if identity_when_false:
            caller = inspect.stack()[1]  # at trace time only
            y = fun(x)
            same = jnp.all(jnp.stack([jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(x))]))
            some = ~vmap_flow.all_lanes(~pred)  # the update runs in every lane only when some lane needs it
            site = f"{os.path.basename(caller.filename)}:{caller.function}:{caller.lineno}"
            jax.debug.callback(functools.partial(record, site), pred, some, same)
        return unchecked(pred, fun, x, identity_when_false=identity_when_false)

    monkeypatch.setattr(vmap_flow, "when", checked)
    jax.clear_caches()  # retrace with the check
    try:
        cfg = _cfg(SMALL)
        lanes, _ = sweep.grid(POLICY.knobs(), cfg=cfg, draft_len=[0, 4], arrival_scale=[1.0, 0.25])
        # Seed 5: every lane preempts (12, 12, 7, 11 recomputes); seed 3 stopped preempting in its K = 4 lane
        # once skvs reserved draft slots during prefill.
        states, _ = sweep.run(sweep.stack([_trace(cfg, 5)]), lanes, cfg=cfg, cost=COST, max_steps=400)
        jax.effects_barrier()
    finally:
        jax.clear_caches()  # later tests must not reuse programs that call back into this one
    assert np.all(sweep.finished(states) == 16)
    assert np.all(np.asarray(states.counters.preempt_recompute) > 0)  # every lane preempts
    assert np.all(np.asarray(states.kv.alloc.counters.evictions) > 0)  # and evicts cached blocks
    assert set(seen) == _promises(), seen  # every promise in the source was exercised here
    for site, (false_lanes, changed) in seen.items():
        assert false_lanes > 0 and changed == 0, (site, false_lanes, changed)


def _promises() -> set[str]:
    """"file:function:line" of every `identity_when_false=True` call in the modules a simulation runs."""
    import ast
    import pathlib

    import skvs_jax

    def visit(node, name, function, sites):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef):
                visit(child, name, child.name, sites)
                continue
            if isinstance(child, ast.Call) and any(
                    k.arg == "identity_when_false" and getattr(k.value, "value", None) is True for k in child.keywords):
                sites.add(f"{name}:{function}:{child.lineno}")
            visit(child, name, function, sites)
        return sites

    sites = set()
    root = pathlib.Path(inspect.getsourcefile(skvs_jax)).parent
    paths = [*sorted((root / "kv").rglob("*.py")), *sorted((root / "scheduler").glob("*.py")),
             root / "sim" / "simulate.py"]
    for path in paths:
        visit(ast.parse(path.read_text()), path.name, "<module>", sites)
    return sites


def test_sweep_inputs_are_checked_at_the_boundary():
    cfg = _cfg(CACHE)
    base = POLICY.knobs()
    with pytest.raises(ValueError, match="draft_len"):
        sweep.grid(base, cfg=cfg, draft_len=[5])
    with pytest.raises(ValueError, match="kv_blocks"):
        sweep.grid(base, cfg=cfg, kv_blocks=[48])
    with pytest.raises(ValueError, match="arrival_scale"):
        sweep.grid(base, cfg=cfg, arrival_scale=[0.0])
    with pytest.raises(ValueError, match="at least one"):
        sweep.grid(base, cfg=cfg, traces=[])
    traces = sweep.stack([_trace(cfg, 1)])
    lanes, _ = sweep.grid(base, cfg=cfg, traces=[1])
    with pytest.raises(ValueError, match="out of range"):
        sweep.run(traces, lanes, cfg=cfg, cost=COST, max_steps=8)
    lanes, _ = sweep.grid(base, cfg=cfg)
    with pytest.raises(ValueError, match="max_steps"):
        sweep.run(traces, lanes, cfg=cfg, cost=COST, max_steps=0)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("tp",))
    with pytest.raises(ValueError, match="'dp' axis"):
        sweep.run(traces, lanes, cfg=cfg, cost=COST, max_steps=8, mesh=mesh)
    # Lanes built by hand get grid's checks (out-of-range values used to run as data).
    for bad, match in ((lanes.replace(kv_blocks=lanes.kv_blocks + 1000), "kv_blocks"),
                       (lanes.replace(knobs=lanes.knobs.replace(draft_len=lanes.knobs.draft_len + 9)), "draft_len"),
                       (lanes.replace(arrival_scale=-lanes.arrival_scale), "arrival_scale")):
        with pytest.raises(ValueError, match=match):
            sweep.run(traces, bad, cfg=cfg, cost=COST, max_steps=8)
    with pytest.raises(TypeError, match="stacked SimTrace"):
        sweep.run(_trace(cfg, 1), lanes, cfg=cfg, cost=COST, max_steps=8)
    with pytest.raises(ValueError, match="equal shapes"):
        sweep.stack([_trace(cfg, 1), _trace(_cfg(CacheConfig(num_blocks=48, block_size=8, max_seqs=8,
                                                              max_blocks_per_seq=12)), 1)])


def test_acceptance_presets_and_the_chain_fit():
    assert am.alphas("medusa-1", 4).tolist() == pytest.approx([0.6] * 4)
    # A constant alpha gives the geometric series (1 - a^(K+1)) / (1 - a) tokens per verification.
    assert am.tokens_per_step([0.6] * 4) == pytest.approx((1 - 0.6**5) / 0.4)
    assert am.tokens_per_step(am.alphas("medusa-2", 4)) >= 2.83  # the bound the preset is derived from
    assert am.tokens_per_step([0.71] * 4) < 2.83  # and it is the smallest such alpha
    with pytest.raises(ValueError, match="unknown acceptance model"):
        am.alphas("eagle", 4)
    with pytest.raises(ValueError, match="gives 4 probabilities"):
        am.alphas([0.5] * 4, 5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        am.alphas([0.5, 1.5], 2)
    tiny = am.alphas("tiny", 4)  # its own float32 output, and numpy ints, were refused
    np.testing.assert_array_equal(am.alphas(tiny, np.int64(4)), tiny)
    # fit_chain recovers the conditional probabilities a chain model was drawn from.
    truth = jnp.asarray([0.8, 0.6, 0.5, 0.3], jnp.float32)
    runs = np.asarray(sim.chain_acceptance(truth, (400, 100), jax.random.key(3))).ravel()
    np.testing.assert_allclose(am.fit_chain(runs, 4), np.asarray(truth), atol=0.02)
    # Each position counts only the verifications that reached it; one nobody reached is NaN, not a guess.
    np.testing.assert_array_equal(am.fit_chain(np.asarray([0, 1]), np.asarray([1, 3])), [0.5, 0.0, np.nan])
