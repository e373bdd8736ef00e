"""The jitted scheduler against the plain-Python oracle, with a ground-truth KV shadow, under every switch."""

import dataclasses
import functools
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as hs

from skvs_jax import policies, testing, victims
from skvs_jax import scheduler as sc
from skvs_jax.config import CacheConfig
from skvs_jax.kv import allocator, manager, prefix_cache
from skvs_jax.kv.allocator import STALE
from skvs_jax.scheduler import draft_control
from skvs_jax.testing.oracle import leaves_first
from skvs_jax.testing.scheduler_harness import Harness

VOCAB = 3  # a tiny alphabet: prompts share prefixes often, so the prefix cache is busy


def _cfg(policy, num_blocks=14, block_size=4, max_seqs=6, max_blocks=8, **kw):
    cache = CacheConfig(num_blocks=num_blocks, block_size=block_size, max_seqs=max_seqs,
                        max_blocks_per_seq=max_blocks)
    kw.setdefault("max_running", 5)
    kw.setdefault("token_budget", 16)
    kw.setdefault("prefix_capacity", 1024)  # no bucket ever overflows: the dict oracle can be exact
    return sc.SchedulerConfig(cache=cache, policy=policy, **kw)


SKVS, NAIVE, VLLM = policies.skvs(4), policies.naive_spec(4), policies.vllm_default()
ARTICLE = policies.skvs_article(4)  # the article's skvs: the histogram draft rule
# Every switch and every victim rule appears in at least one config; memory is tight so preemption happens.
CONFIGS = {
    "vllm_default": _cfg(VLLM),
    "naive_spec": _cfg(NAIVE),
    "skvs": _cfg(SKVS),
    # A rule given to the config as a function (the hook for a rule with no name).
    "skvs-swap-least_progress": _cfg(SKVS.replace(preemption="swap", generation_threshold=1), swap_blocks=12,
                                     victim=sc.least_progress),
    # The victim rule named by the policy (Policy.victim), not by the config.
    "naive-swap-most_blocks": _cfg(NAIVE.replace(preemption="swap", victim="most_blocks"), swap_blocks=6,
                                   block_size=2, num_blocks=16),
    "skvs-lazy-nopool-nobarrier-onfill": _cfg(SKVS.replace(release="lazy", spec_pool=False, generation_threshold=0,
                                                           prefix_barrier=False, insert="on_fill"), prefill_chunk=3,
                                              index_rows=1),
    "skvs-index-2-rows": _cfg(SKVS, index_rows=2),
    "skvs-fixedK-prefillspec-preempt-most_progress": _cfg(SKVS.replace(
        adaptive_draft_len=False, draft_buckets=(4,), spec_in_prefill=True, drafts_preempt=True, max_spec_ratio=1.0,
        victim="most_progress"), admit_window=2),
    "no-prefix-cache-K2": _cfg(policies.naive_spec(2).replace(prefix_cache=False, prefix_barrier=False),
                               token_budget=6, max_running=6),
    # Compute-aware drafting: 1 decode row drafts K, 2 rows 2 each, 3 rows 1, 4 or more none. The budget is a
    # knob (data, KNOBS below), so these run skvs's and naive_spec's compiled schedulers.
    "skvs-verify-budget-6": _cfg(SKVS),
    "naive-verify-budget-5": _cfg(NAIVE),
    # The article's histogram rule (skvs is the goodput controller now), and the controller with mandatory drafts
    # (its attribution counters count the preemptions drafts cause).
    "skvs_article": _cfg(policies.skvs_article(4)),
    "skvs-goodput-drafts-preempt": _cfg(SKVS.replace(drafts_preempt=True, max_spec_ratio=1.0)),
    # skvs prices draft blocks (drafts preempt only when the step's expected tokens per second say it pays);
    # the controller with opportunistic drafts and its tail guard (behind rows bound the step's time); the
    # histogram rule with priced blocks, and swap victims.
    "skvs-opportunistic": _cfg(SKVS.replace(draft_memory="opportunistic", tail_guard=64)),
    "skvs_article-priced-swap": _cfg(ARTICLE.replace(draft_memory="priced", preemption="swap"), swap_blocks=12),
    # vLLM's EAGLE/MTP prefix-cache path: every hit loses the blocks the drafts reach.
    "naive_spec_vllm": _cfg(policies.naive_spec_vllm(4)),
    # The goodput controller on a draft tree of 4 slots reaching depth 2 (slot counts 0..4 reach 0, 1, 1, 2, 2):
    # it drafts to a depth in the fewest slots, and counts the depths reached.
    "skvs-tree": _cfg(SKVS, reach_of=(0, 1, 1, 2, 2)),
}
# Knobs other than the config's policy's own (`Policy.knobs()`), by config name.
KNOBS = {"skvs-verify-budget-6": SKVS.replace(verify_budget=6).knobs(),
         "naive-verify-budget-5": NAIVE.replace(verify_budget=5).knobs()}
# A step cost for the goodput controller: 400 us a step, 60 us a token, a row 3 us, a context token 20 ns, heads
# 150 us: drafts pay only while the rows' acceptance is high enough.
GOODPUT_COST = sc.StepCost(token_us=jnp.asarray(400 + 60 * np.arange(17), jnp.int32), row_us=jnp.asarray(3, jnp.int32),
                           ctx_ns=jnp.asarray(20, jnp.int32), head_us=jnp.asarray(150, jnp.int32))
# A padded engine's fitted cost (`serve.step_cost.fit`): tokens nearly free, the step priced by its widest row
# (1 + drafts for a decode row, the widest entry when some row has prompt work), programs at widths 1, 3, 5, 8.
WIDTH_COST = sc.StepCost(token_us=jnp.full((17,), 900, jnp.int32), row_us=jnp.asarray(0, jnp.int32),
                         ctx_ns=jnp.asarray(0, jnp.int32), head_us=jnp.asarray(0, jnp.int32),
                         width_us=jnp.asarray([0, 0, 60, 60, 500, 500, 1400, 1400, 1400], jnp.int32))
# A roofline's step (`sim.cost_model.step_cost` in the roofline mode): compute overlapped with the weights' and the
# context's reads, so drafts are free while the step is memory-bound and cost their compute past that.
ROOF_COST = sc.StepCost(token_us=jnp.full((17,), 30, jnp.int32), row_us=jnp.asarray(0, jnp.int32),
                        ctx_ns=jnp.asarray(2000, jnp.int32), head_us=jnp.asarray(40, jnp.int32),
                        compute_us=jnp.asarray(60 * np.arange(17), jnp.int32), mem_us=jnp.asarray(300, jnp.int32),
                        overlap=jnp.asarray(1024, jnp.int32))
# A fitted engine's cost carries its uncertainty: priced draft preemptions must then win by that margin.
COSTS = {"tokens": GOODPUT_COST, "widths": WIDTH_COST, "roofline": ROOF_COST,
         "widths-margin": WIDTH_COST.replace(margin=jnp.asarray(96, jnp.int32))}


def workload(cfg, seed: int, steps: int, add_p: float, abort_p: float, salts: tuple[int, ...] = (),
             targets: tuple[int, ...] = ()) -> list:
    """A random workload of `steps` steps: batches of requests (prompts often sharing a 'system prompt'), steps
    with random, full or no acceptance, and aborts (between steps, or between a step's schedule and update).
    Generated from a seed so that every example is long enough
    to fill the memory (hypothesis's smallest examples would barely reach it). salts: each request draws its
    cache salt from them (none: unsalted, and the random stream is the one without salts); targets: likewise its
    TPOT target in microseconds."""
    rng = np.random.default_rng(seed)
    length = cfg.max_len // 2
    system = [1, 2, 0, 1, 1, 2, 0, 0, 2, 1, 1, 0][:length]
    ops = []
    for _ in range(steps):
        if rng.random() < add_p:
            prompts, max_new, prio = [], [], []
            for _ in range(int(rng.integers(1, 4))):
                if rng.random() < 0.6:
                    p = system[: int(rng.integers(1, len(system) + 1))] + list(rng.integers(0, VOCAB, rng.integers(5)))
                else:
                    p = list(rng.integers(0, VOCAB, rng.integers(1, length + 1)))
                prompts.append([int(t) for t in p[:length]])
                max_new.append(int(rng.integers(1, length + 1)))
                prio.append(int(rng.integers(0, 3)))
            op = ("add", prompts, max_new, prio)
            if salts or targets:
                op += tuple([int(rng.choice(x)) for _ in prompts] if x else None for x in (salts, targets))
            ops.append(op)
        if rng.random() < abort_p:
            if rng.random() < 0.5:  # half of the aborts come between a step's schedule and its update
                ops.append(("step_abort", int(rng.integers(2**31))))
                continue
            ops.append(("abort", int(rng.integers(2**31))))
        ops.append(("step", int(rng.integers(2**31)), str(rng.choice(["random", "random", "all", "none"]))))
    return ops


# The default run keeps one config per concern; the rest (each also covered by a switch's own test below) run
# with `pytest -m slow`: every config compiles its own scheduler (~10 s here), and the run has 20 minutes.
SLOW_CONFIGS = {"skvs-index-2-rows", "no-prefix-cache-K2", "skvs_article-priced-swap", "naive_spec_vllm",
                "skvs-fixedK-prefillspec-preempt-most_progress", "skvs-lazy-nopool-nobarrier-onfill",
                "skvs-swap-least_progress"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CONFIGS else n
                                  for n in CONFIGS])
@settings(max_examples=4)
@given(seed=hs.integers(0, 2**32 - 1), steps=hs.integers(30, 60), add_p=hs.sampled_from([0.25, 0.5, 0.8]),
       abort_p=hs.sampled_from([0.0, 0.05]))
def test_matches_the_oracle_and_the_ground_truth(name, seed, steps, add_p, abort_p):
    cfg = CONFIGS[name]
    h = Harness(cfg, vocab=VOCAB, knobs=KNOBS.get(name))
    h.run(workload(cfg, seed, steps, add_p, abort_p))
    event(f"preempted: {int(h.st.counters.preempt_recompute) + int(h.st.counters.preempt_swap) > 0}")


# Every config with every cost under `pytest -m slow`; the default run takes a diagonal (each config once, each
# cost at least once: the engine's width cost with plain skvs (with and without a margin) and the tree, the
# simulator's roofline with mandatory drafts, the per-token cost with opportunistic drafts).
_GOODPUT_DEFAULT = {("skvs", "widths"), ("skvs-tree", "widths"), ("skvs-goodput-drafts-preempt", "roofline"),
                    ("skvs-opportunistic", "tokens"), ("skvs", "widths-margin")}


@pytest.mark.parametrize("name, cost", [
    pytest.param(n, c, marks=() if (n, c) in _GOODPUT_DEFAULT else pytest.mark.slow, id=f"{n}-{c}")
    for n in ("skvs", "skvs-goodput-drafts-preempt", "skvs-opportunistic", "skvs-tree") for c in COSTS])
@settings(max_examples=3)
@given(seed=hs.integers(0, 2**32 - 1), steps=hs.integers(30, 60), add_p=hs.sampled_from([0.25, 0.5, 0.8]))
def test_goodput_controller_with_a_step_cost_matches_the_oracle(name, cost, seed, steps, add_p):
    h = Harness(CONFIGS[name], vocab=VOCAB, step_cost=COSTS[cost])
    h.run(workload(CONFIGS[name], seed, steps, add_p, 0.05))
    event(f"drafted: {int(h.st.counters.drafted) > 0}")


@pytest.mark.parametrize("name, cost", [("skvs", "tokens"), ("skvs-opportunistic", "roofline")])
@settings(max_examples=3)
@given(seed=hs.integers(0, 2**32 - 1), steps=hs.integers(30, 60))
def test_tpot_targets_match_the_oracle(name, cost, seed, steps):
    """Requests with TPOT targets around a step's priced time (none, 0.3, 0.7 and 1.5 ms against ~1 ms steps): the
    rows over their target are drafted first, in the jitted controller and the oracle alike."""
    h = Harness(CONFIGS[name], vocab=VOCAB, step_cost=COSTS[cost])
    h.run(workload(CONFIGS[name], seed, steps, 0.5, 0.05, targets=(0, 300, 700, 1500)))
    over = draft_control.over_target(h.st.seqs.tpot_target, h.st.seqs.elapsed,
                                     h.st.seqs.num_tokens - h.st.seqs.prompt_len - 1)
    event(f"some row over its target: {bool(np.any(np.asarray(over)))}")


def test_drafts_preempting_are_attributed():
    """With mandatory drafts, the steps the drafts made short and their victims are counted; opportunistic drafts
    never make a step short."""
    h = Harness(CONFIGS["skvs-goodput-drafts-preempt"], vocab=VOCAB)
    h.run(workload(CONFIGS["skvs-goodput-drafts-preempt"], 5, 60, 0.8, 0.0))
    ct = h.st.counters
    assert 0 < int(ct.oom_steps_drafts) <= int(ct.oom_steps) and int(ct.preempt_drafts) > 0
    assert int(ct.draft_blocks) > 0
    opp = Harness(CONFIGS["skvs-opportunistic"], vocab=VOCAB)
    opp.run(workload(CONFIGS["skvs-opportunistic"], 5, 60, 0.8, 0.0))
    assert int(opp.st.counters.oom_steps_drafts) == 0 and int(opp.st.counters.preempt_drafts) == 0


def test_priced_draft_blocks_preempt_only_when_it_pays():
    """Priced draft blocks, in lockstep with the oracle: with the flat cost a recompute is free, so drafts preempt
    in the steps where the tokens they add beat the victims' lost output (counted as theirs), and less often when
    the cost's margin asks them to win by it; when the step cost
    makes a recomputed token expensive (62 ms each), they preempt only victims whose tokens the prefix index
    holds (nothing to recompute), and without a prefix cache never: they take only blocks that are there."""
    cfg = CONFIGS["skvs"]
    ops = workload(cfg, 5, 60, 0.8, 0.0)
    h = Harness(cfg, vocab=VOCAB)
    h.run(ops)
    ct = h.st.counters
    assert 0 < int(ct.oom_steps_drafts) <= int(ct.oom_steps) and 0 < int(ct.preempt_drafts)
    flat_preempts = int(ct.preempt_drafts)
    # A cost that may be off by 100% (margin 1024): drafts must double the step's goodput to preempt.
    h = Harness(cfg, vocab=VOCAB, step_cost=sc.flat_step_cost(cfg).replace(margin=jnp.asarray(1024, jnp.int32)))
    h.run(ops)
    assert int(h.st.counters.preempt_drafts) < flat_preempts
    costly = sc.StepCost(token_us=jnp.asarray([100] * cfg.token_budget + [10**6], jnp.int32),
                         row_us=jnp.asarray(0, jnp.int32), ctx_ns=jnp.asarray(0, jnp.int32),
                         head_us=jnp.asarray(0, jnp.int32))
    h = Harness(cfg, vocab=VOCAB, step_cost=costly)
    h.run(ops)
    assert int(h.st.counters.preempt_drafts) < flat_preempts and int(h.st.counters.draft_blocks) > 0
    uncached = _cfg(SKVS.replace(prefix_cache=False))
    h = Harness(uncached, vocab=VOCAB, step_cost=costly)
    h.run(ops)
    ct = h.st.counters
    assert int(ct.oom_steps_drafts) == 0 and int(ct.preempt_drafts) == 0 and int(ct.draft_blocks) > 0


def test_a_victims_recompute_counts_only_what_the_prefix_index_does_not_hold():
    """`recompute_tokens`: committed tokens less the indexed blocks' (whole blocks of S tokens), never below 0."""
    cfg = CONFIGS["skvs"]
    h = Harness(cfg, vocab=VOCAB)
    h.run(workload(cfg, 3, 25, 0.8, 0.0))
    alloc = jax.device_get(h.st.kv.alloc)
    s = cfg.cache.block_size
    want = [max(int(alloc.seqs.num_committed[b]) - s * sum(
        bool(alloc.blocks.cached[alloc.seqs.block_table[b, j]]) for j in range(int(alloc.seqs.num_blocks[b]))), 0)
        for b in range(cfg.cache.max_seqs)]
    from skvs_jax.scheduler.schedule import recompute_tokens

    got = np.asarray(recompute_tokens(h.st, cfg)).tolist()
    assert got == want and any(g < int(c) for g, c in zip(got, alloc.seqs.num_committed))


@pytest.mark.parametrize("name", ["naive_spec", "skvs-swap-least_progress"])
def test_aborts_between_schedule_and_update_are_dropped(name):
    """update drops rows aborted since schedule: it used to report their tokens as output (num_new, counters,
    acceptance histogram) and append them to the EMPTY slot. naive_spec indexes drafts on fill, so its update
    also has index entries to roll back; the swap config has swap-outs and swap-ins in flight."""
    cfg = CONFIGS[name]
    ops = workload(cfg, seed=11, steps=30, add_p=0.6, abort_p=0.3)
    assert sum(op[0] == "step_abort" for op in ops) >= 4
    h = Harness(cfg, vocab=VOCAB)
    h.run(ops)
    assert int(h.st.counters.aborted) > 0


def _drain(h: Harness, rng, max_steps: int) -> int:
    for i in range(max_steps):
        if not (np.asarray(h.st.seqs.status) != sc.EMPTY).any():
            return i
        h.step(rng)
    return max_steps


@pytest.mark.parametrize("name", ["vllm_default", "naive_spec", "skvs", "skvs-swap-least_progress"])
def test_every_request_finishes_and_nothing_leaks_when_arrivals_stop(name):
    """No starvation: with arrivals stopped, every admitted request finishes within a bound; then every block is
    free, in the speculative pool, or cached (evictable)."""
    cfg = CONFIGS[name]
    h = Harness(cfg, vocab=VOCAB)
    rng = np.random.default_rng(7)
    for _ in range(4):
        prompts = [list(rng.integers(0, VOCAB, rng.integers(1, cfg.max_len // 2))) for _ in range(3)]
        h.add(prompts, [int(x) for x in rng.integers(1, cfg.max_len // 2, 3)])
        for _ in range(3):
            h.step(rng)
    # Each request needs at most L steps alone; the slots run them at least one at a time.
    bound = cfg.cache.max_seqs * cfg.max_len * 4
    steps = _drain(h, rng, bound)
    assert steps < bound, "requests starved"
    alloc = h.st.kv.alloc
    assert (np.asarray(alloc.blocks.ref_count) == 0).all()
    cached = int(np.asarray(alloc.blocks.cached & (alloc.blocks.ref_count == 0)).sum())
    assert int(alloc.blocks.free_top) + int(alloc.blocks.pool_top) + cached == cfg.cache.usable_blocks


@settings(max_examples=20)
@given(hs.data())
def test_priority_order_is_the_sorted_order_by_counting_and_by_sorting(data):
    """(priority, arrival, slot) order, ties included, on both sides of the size where it stops counting."""
    b = data.draw(hs.sampled_from([1, 2, 7, 64, sc.RANK_BY_COUNTING, sc.RANK_BY_COUNTING + 1]))
    pri = np.asarray(data.draw(hs.lists(hs.integers(-2, 2), min_size=b, max_size=b)), np.int32)
    arr = np.asarray(data.draw(hs.lists(hs.integers(0, 5), min_size=b, max_size=b)), np.int32)
    order = jax.jit(lambda p, a: sc.priority_order(types.SimpleNamespace(priority=p, arrival=a)))  # the two fields
    want = sorted(range(b), key=lambda j: (pri[j], arr[j], j))
    assert np.asarray(order(jnp.asarray(pri), jnp.asarray(arr))).tolist() == want


def test_fcfs_within_a_priority_and_priorities_first():
    """With room for one running sequence, requests run in (priority, arrival) order."""
    cfg = _cfg(VLLM, max_running=1, token_budget=32)
    h = Harness(cfg, vocab=VOCAB)
    slots = h.add([[1, 1], [2, 2], [0, 1], [1, 2]], [2, 2, 2, 2], priority=[1, 0, 1, 0])
    rng = np.random.default_rng(0)
    finished_order = []
    for _ in range(40):
        before = np.asarray(h.st.seqs.status)
        h.step(rng)
        after = np.asarray(h.st.seqs.status)
        finished_order += [s for s in slots if before[s] != sc.FINISHED and after[s] == sc.FINISHED]
    assert finished_order == [slots[1], slots[3], slots[0], slots[2]]


# ---------------------------------------------------------------------------------------- a long trace


@pytest.mark.slow  # the default run's time budget (docs: `pytest -m slow`); the lockstep tests check every step
def test_a_trace_of_10000_requests_ends_with_every_block_free_or_cached():
    """10,000 requests through `schedule`/`update` alone (random accept masks, no model): at the end every block
    is free, pooled or cached, and the counters are consistent."""
    policy = SKVS
    # 192 blocks: skvs (no barrier, so more hits) still runs out of blocks and preempts on this trace.
    cache = CacheConfig(num_blocks=192, block_size=4, max_seqs=64, max_blocks_per_seq=16)
    cfg = sc.SchedulerConfig(cache=cache, policy=policy, max_running=48, token_budget=256, prefill_chunk=32,
                             admit_window=16)
    rng = np.random.default_rng(0)
    total, a = 10_000, 16
    system = np.pad(rng.integers(0, 8, 24), (0, 16))
    lens = rng.integers(4, 40, total).astype(np.int32)
    prompts = np.where(np.arange(40)[None, :] < 24, system[None, :], rng.integers(0, 8, (total, 40)))
    prompts = np.where(rng.random(total)[:, None] < 0.5, prompts, rng.integers(0, 8, (total, 40))).astype(np.int32)
    max_new = rng.integers(1, 24, total).astype(np.int32)
    knobs = policy.knobs()
    k = policy.draft_len

    @jax.jit
    def step(st, key):
        st, batch = sc.schedule_unchecked(st, knobs, cfg=cfg)
        k1, k2, k3 = jax.random.split(key, 3)
        acc = jax.random.randint(k1, (cache.max_seqs,), 0, k + 1)
        drafts = jax.random.randint(k2, (cache.max_seqs, k), 0, 8)
        nxt = jax.random.randint(k3, (cache.max_seqs,), 0, 8)
        st, _ = sc.update_unchecked(st, batch, acc, nxt, drafts, jnp.zeros((cache.max_seqs,), bool), knobs, cfg=cfg)
        return st, batch.alloc_ok

    st = sc.init(cfg)
    key = jax.random.key(0)
    queued, steps = 0, 0
    while queued < total or (np.asarray(st.seqs.status) != sc.EMPTY).any():
        if queued < total:
            rows = slice(queued, min(queued + a, total))
            st, slots = sc.add(st, jnp.asarray(prompts[rows]), jnp.asarray(lens[rows]), jnp.asarray(max_new[rows]),
                               cfg=cfg)
            queued += int((np.asarray(slots) >= 0).sum())
            # Requests that found no slot are re-offered from the first unplaced one.
            placed = np.asarray(slots) >= 0
            assert placed.tolist() == sorted(placed.tolist(), reverse=True)
        for _ in range(4):
            key, sub = jax.random.split(key)
            st, ok = step(st, sub)
            assert bool(ok)
            steps += 1
        assert steps < 200_000
    c = st.counters
    assert int(c.finished) == total and int(c.admitted) >= total
    assert int(c.admitted) == total + int(c.preempt_recompute)
    assert int(c.accepted) <= int(c.drafted)
    assert int(c.output_tokens) == int(max_new.sum())
    alloc = st.kv.alloc
    assert (np.asarray(alloc.blocks.ref_count) == 0).all()
    assert (np.asarray(alloc.seqs.num_blocks) == 0).all()
    cached = int(np.asarray(alloc.blocks.cached).sum())
    assert int(alloc.blocks.free_top) + int(alloc.blocks.pool_top) + cached == cache.usable_blocks
    assert int(c.cached_tokens) > 0, "the shared system prompt should have been hit"
    assert int(c.preempt_recompute) > 0 and int(c.oom_steps) > 0, "the trace is meant to run out of blocks"



# ------------------------------------------------------------------- prefix cache: what a vLLM / SGLang user expects


def _serve(h: Harness, prompts: list[list[int]], max_steps: int = 8, salts: list[int] | None = None) -> list[sc.Batch]:
    """Add the prompts (one output token each, cache salts `salts`) and step until nothing waits or runs; returns
    the batches."""
    h.add(prompts, [1] * len(prompts), salts=salts)
    batches = []
    for i in range(max_steps):
        batches.append(h.step(np.random.default_rng(i)))
        if not np.isin(np.asarray(h.st.seqs.status), (sc.WAITING, sc.RUNNING)).any():
            break
    return batches


def test_evicting_one_cached_block_takes_a_tail_block_and_keeps_the_prefix_above_it():
    """Issue 23, defect 1: A (13 tokens) leaves 3 cached blocks; B needs 2 blocks with 1 free, so one cached
    block goes. vLLM frees a request's blocks tail first and SGLang evicts leaves: one block of hits is lost and C
    (A's prompt again) still hits 8 tokens. Taking the chain's head instead lost all three (0 hit tokens)."""
    cfg = sc.SchedulerConfig(cache=CacheConfig(num_blocks=5, block_size=4, max_seqs=2, max_blocks_per_seq=4),
                             policy=VLLM, max_running=2, token_budget=64)
    h = Harness(cfg, vocab=100)  # lockstep with the oracle, which must evict the same block
    _serve(h, [list(range(13))])
    assert len(h.oracle.index.index) == 3
    _serve(h, [[50] * 5])
    assert int(h.st.kv.alloc.counters.evictions) == 1 and int(h.st.kv.prefix.counters.removed) == 1
    batches = _serve(h, [list(range(13))])
    assert sum(int(np.asarray(b.hit_tokens).sum()) for b in batches) == 8


def test_admission_charges_a_shared_idle_cached_prefix_once():
    """Issue 23, defect 2: after one request leaves 12 tokens (3 blocks) cached and idle, two requests sharing
    them need 1 new block each: 3 shared + 2 new blocks fit in the 6 usable, so vLLM admits both. Charging the
    shared blocks once per candidate (3 + 1 + 3 + 1 = 8 > 6) admitted only the first."""
    cfg = sc.SchedulerConfig(cache=CacheConfig(num_blocks=7, block_size=4, max_seqs=4, max_blocks_per_seq=6),
                             policy=VLLM, max_running=4, token_budget=64)
    h = Harness(cfg, vocab=100)
    _serve(h, [list(range(12)) + [90]])
    h.add([list(range(12)) + [91], list(range(12)) + [92]], [1, 1])
    batch = h.step(np.random.default_rng(0))
    assert int(np.asarray(batch.admitted).sum()) == 2
    assert sorted(np.asarray(batch.hit_tokens).tolist()) == [0, 0, 12, 12]



SALT_POLICIES = ["vllm_default", "naive_spec", "skvs", "skvs-lazy-nopool-nobarrier-onfill"]


@pytest.mark.parametrize("name", SALT_POLICIES)
def test_requests_with_other_cache_salts_never_hit_and_equal_salts_share_as_unsalted(name):
    """vLLM's cache_salt: a prompt served under salt 5 gives no hit to the same prompt under salt 9 or unsalted,
    and the same hit as without salts to the same prompt under salt 5 again (lockstep with the oracle)."""
    prompt = [1, 2, 0, 1, 1, 2, 0, 0, 2, 1, 1, 0, 2]

    def hits(batches):
        return sum(int(np.asarray(b.hit_tokens).sum()) for b in batches)

    plain = Harness(CONFIGS[name], vocab=VOCAB)
    _serve(plain, [prompt])
    want = hits(_serve(plain, [prompt]))
    assert want > 0, "the unsalted repeat must hit, or the test shows nothing"
    h = Harness(CONFIGS[name], vocab=VOCAB)
    _serve(h, [prompt], salts=[5])
    assert hits(_serve(h, [prompt], salts=[9])) == 0
    assert hits(_serve(h, [prompt], salts=[0])) == 0
    assert hits(_serve(h, [prompt], salts=[5])) == want


@pytest.mark.parametrize("name", SALT_POLICIES)
@settings(max_examples=2)
@given(seed=hs.integers(0, 2**32 - 1), steps=hs.integers(30, 50), add_p=hs.sampled_from([0.5, 0.8]))
def test_salted_workloads_match_the_oracle_and_share_no_block_across_salts(name, seed, steps, add_p):
    """Random workloads whose requests carry salts 0, 1 or 2: the jitted scheduler agrees with the oracle, whose
    index keys by (salt, tokens), and the harness checks after every transition that no block is held under two
    salts or indexed under a salt other than its holders'."""
    cfg = CONFIGS[name]
    h = Harness(cfg, vocab=VOCAB)
    h.run(workload(cfg, seed, steps, add_p, 0.05, salts=(0, 1, 2)))
    event(f"hits: {int(h.st.counters.cached_tokens) > 0}")


_evict = jax.jit(manager.evict, static_argnames=("cfg",))
_eviction_order = jax.jit(manager.eviction_order, static_argnames=("cfg",))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _evict_unpinning(kv, num_blocks, cfg):
    """`manager.evict` with the general `manager.unpin` of the removed entries' descendants (which releases the
    unpinned ref-0 blocks): what `evict`, which only clears their flags, must equal."""
    def run(kv):
        alloc, ids = allocator.evict_unchecked(kv.alloc, manager.eviction_order(kv, cfg), num_blocks,
                                               max_evict=cfg.cache.usable_blocks)
        prefix, removed = prefix_cache.remove_unchecked(kv.prefix, ids, cfg=cfg.prefix, loop=cfg.skip)
        return manager.KVState(alloc=manager.unpin(alloc, removed.descendants), prefix=prefix)

    return jax.lax.cond(num_blocks > 0, run, lambda kv: kv, kv)  # as `evict`: nothing, not even the clock, at 0


@settings(max_examples=8)
@given(name=hs.sampled_from(["vllm_default", "skvs", "naive-swap-most_blocks"]), seed=hs.integers(0, 2**16),
       steps=hs.integers(10, 40))
def test_evicting_k_blocks_loses_k_blocks_of_hits(name, seed, steps):
    """After a random workload, evicting k = 0, 1, ... of the idle cached blocks: the jitted order is the oracle's
    (`testing.oracle.leaves_first`); the k blocks go with exactly k index entries (every other cached prefix
    stays a hit) as long as k blocks lie above no block in use; past that, only entries of held blocks go with
    them; the allocator's invariants hold."""
    cfg = CONFIGS[name]
    h = Harness(cfg, vocab=VOCAB)
    h.run(workload(cfg, seed, steps, add_p=0.5, abort_p=0.1))
    kv, o = h.st.kv, h.oracle
    before = testing.prefix_index_as_dict(kv.prefix, cfg.prefix)
    want = leaves_first(o.alloc, o.index)
    idle = np.asarray(manager.evictable(kv))
    order = np.asarray(_eviction_order(kv, cfg.kv))
    assert order[idle[order]].tolist() == want
    held = {blk for blk in before.values() if o.alloc.ref[blk] > 0}
    above_held = {blk for p, blk in before.items() if any(q[: len(p)] == p and c in held for q, c in before.items())}
    free_standing = sum(1 for blk in want if blk not in above_held)
    event(f"{len(want)} idle cached blocks, {len(want) - free_standing} above a held one")
    for k in range(len(want) + 1):
        after_kv = _evict(kv, jnp.asarray(k, jnp.int32), cfg.kv)
        # The descendants whose entries went too are held: unpinning them releases nothing.
        jax.tree.map(np.testing.assert_array_equal, after_kv, _evict_unpinning(kv, jnp.asarray(k, jnp.int32), cfg.kv))
        testing.check_invariants(after_kv.alloc, cfg.cache, cfg.policy.spec_config())
        after = testing.prefix_index_as_dict(after_kv.prefix, cfg.prefix)
        lost = {p: blk for p, blk in before.items() if p not in after}
        assert set(after.items()) <= set(before.items())
        assert set(want[:k]) <= set(lost.values()), "an evicted block's entry is gone"
        assert set(lost.values()) - set(want[:k]) <= held, "only held blocks' entries go with the evicted ones"
        if k <= free_standing:
            assert len(lost) == k, f"evicting {k} blocks lost {len(lost)} blocks of hits"


def test_evicting_blocks_above_a_held_one_unpins_it_and_releases_nothing():
    """A and B are admitted together and miss; A's two full blocks are indexed, and B's third block as their
    child (B's own first two duplicate A's keys). A finishes: A's blocks are idle cached, above B's held block.
    Evicting them takes the held block's entry along: it is unpinned and stays B's (no release, no leak), as the
    general unpin (which would release an unpinned ref-0 block) leaves it."""
    cfg = sc.SchedulerConfig(cache=CacheConfig(num_blocks=20, block_size=4, max_seqs=2, max_blocks_per_seq=8),
                             policy=VLLM, max_running=2, token_budget=64)
    h = Harness(cfg, vocab=100)
    h.add([list(range(9)), list(range(13))], [1, 10])
    for i in range(2):
        h.step(np.random.default_rng(i + 11))
    assert np.asarray(h.st.seqs.status).tolist() == [sc.EMPTY, sc.RUNNING]
    kv = h.st.kv
    index = testing.prefix_index_as_dict(kv.prefix, cfg.prefix)
    ref, table = np.asarray(kv.alloc.blocks.ref_count), np.asarray(kv.alloc.seqs.block_table)
    held = [blk for blk in index.values() if ref[blk] > 0]
    assert held == [table[1, 2]] and sorted(ref[blk] for blk in index.values()) == [0, 0, 1]
    for k in (1, 2):
        after = _evict(kv, jnp.asarray(k, jnp.int32), cfg.kv)
        jax.tree.map(np.testing.assert_array_equal, after, _evict_unpinning(kv, jnp.asarray(k, jnp.int32), cfg.kv))
        testing.check_invariants(after.alloc, cfg.cache, cfg.policy.spec_config())
        left = testing.prefix_index_as_dict(after.prefix, cfg.prefix)  # leaves first: A's second block, then its first
        assert list(left) == [p for p in index if len(p) <= 4 * (2 - k)], left  # and the held child's entry goes
        assert not bool(after.alloc.blocks.cached[held[0]]) and int(after.alloc.blocks.ref_count[held[0]]) == 1


# --------------------------------------------------------------------------------------- the switches


def _run(cfg, seed=3, steps=60, accept="random"):
    h = Harness(cfg, vocab=VOCAB)
    rng = np.random.default_rng(seed)
    system = [1, 2, 0, 1, 1, 2, 0, 0, 2, 1, 1, 0]
    for i in range(steps):
        if i % 3 == 0:
            prompts = [system[: int(rng.integers(6, 12))] + list(rng.integers(0, VOCAB, 2)) for _ in range(2)]
            h.add(prompts, [int(x) for x in rng.integers(4, 14, 2)])
        h.step(rng, accept)
    return h


def test_speculation_switch_and_draft_length_knob():
    off = _run(_cfg(VLLM))
    on = _run(_cfg(NAIVE))
    assert int(off.st.counters.drafted) == 0 and int(on.st.counters.drafted) > 0
    short = Harness(_cfg(NAIVE), vocab=VOCAB, knobs=NAIVE.knobs().replace(draft_len=jnp.asarray(1, jnp.int32)))
    rng = np.random.default_rng(0)
    short.add([[1, 2, 1]], [8])
    batches = [short.step(rng) for _ in range(6)]
    assert max(int(np.asarray(b.num_drafts).max()) for b in batches) == 1


# naive_spec slow-marked for the default run's time budget; skvs drafts through the same path.
@pytest.mark.parametrize("pol", [pytest.param(NAIVE, marks=pytest.mark.slow), SKVS], ids=["naive_spec", "skvs"])
def test_the_last_prompt_token_is_computed_without_drafts(pol):
    """A prefill chunk that ends one token before the prompt's end leaves a row with one token to compute, like a
    decode row; but no step has sampled for it, so there is nothing to draft from (the engine's hidden state is
    the previous request's): that step computes the token alone, and drafting starts on the next."""
    h = Harness(_cfg(pol, prefill_chunk=4), vocab=VOCAB)
    h.add([[1, 2, 0, 1, 2]], [8])
    rng = np.random.default_rng(0)
    first, last, decode = (h.step(rng) for _ in range(3))
    assert int(first.num_query[0]) == 4 and not bool(first.samples[0])
    assert int(last.num_query[0]) == 1 and bool(last.samples[0]) and int(last.num_drafts[0]) == 0
    assert int(last.num_reserved[0]) == 0
    assert int(decode.num_query[0]) == 1 and int(decode.num_drafts[0]) > 0


@settings(max_examples=25, deadline=None)
@given(seed=hs.integers(0, 2**31 - 1), live=hs.sampled_from([0, 1, 3, 4, 5, 6, 9, 16]))  # R = 16: R/4 = 4
def test_indexing_a_few_rows_on_a_short_insert_equals_indexing_all_rows(seed, live):
    """`manager.index_rows` runs the insert over R/4 rows when no more are live; the result must be the one over all R:
    the same table, counters and ids. Tiny alphabet and few block ids: duplicates, collisions and bad ids occur."""
    cfg = _cfg(SKVS, num_blocks=40, max_seqs=24, max_blocks=6, index_rows=16, max_running=24)
    b, r, L, m = 24, cfg.rows_indexed, cfg.max_len, cfg.cache.max_blocks_per_seq
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 2, size=(b, L)), jnp.int32)
    lengths = jnp.asarray(rng.integers(0, L + 1, size=b), jnp.int32)
    table = jnp.asarray(rng.integers(0, 40, size=(b, m)), jnp.int32)
    pending = np.zeros(b, bool)
    pending[rng.choice(b, size=min(live, b), replace=False)] = True
    sel = jnp.nonzero(jnp.asarray(pending), size=r, fill_value=b)[0]
    prefix = sc.init(cfg).kv.prefix
    # Something indexed already, so that some rows follow existing entries.
    prefix, _ = prefix_cache.insert_unchecked(prefix, tokens[:4], lengths[:4], table[:4], cfg=cfg.prefix)

    got_prefix, got_ids = jax.jit(manager.index_rows, static_argnames=("cfg",))(prefix, tokens, lengths, table, sel,
                                                                                 cfg=cfg.kv)
    rows, live_sel = jnp.clip(sel, 0, b - 1), sel < b
    # The same insert (index_rows' window and own-content choice) over all R rows. Random tables break the
    # own-content premise, so this is not the dense probe's answer here; on tables of own content it is
    # (tests/test_prefix_cache.py).
    want_prefix, want = prefix_cache.insert_unchecked(prefix, tokens[rows], jnp.where(live_sel, lengths[rows], 0),
                                                      table[rows], cfg=cfg.prefix,
                                                      window=cfg.kv.insert_window if cfg.kv.skip_costly else 0,
                                                      own_content=True)
    chex_equal = jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), got_prefix, want_prefix)
    assert all(jax.tree.leaves(chex_equal))
    np.testing.assert_array_equal(got_ids, want.block_ids)
    event(f"live rows {'none' if live == 0 else '<= R/4' if live <= r // 4 else '> R/4'}")


def test_verify_budget_shares_drafts_evenly_and_stops_them_past_the_budget():
    """With R decode rows every row drafts at most floor(verify_budget / R) - 1 (never more than K); no cap
    without a budget. Measured on naive_spec (fixed K = 4), so the cap is the only thing that varies. The budget
    is a knob (data): one compiled scheduler serves every budget."""
    cfg = _cfg(NAIVE, num_blocks=48, max_blocks=8, token_budget=64)
    for budget, rows, want in ((None, 5, 4), (12, 1, 4), (12, 2, 4), (12, 3, 3), (12, 5, 1), (9, 5, 0)):
        h = Harness(cfg, vocab=VOCAB, knobs=NAIVE.replace(verify_budget=budget).knobs())
        h.add([[1, 2, 1 + i % 2] for i in range(rows)], [20] * rows)
        rng = np.random.default_rng(0)
        h.step(rng)  # prefill
        batch = h.step(rng)
        nd = np.asarray(batch.num_drafts)
        decoding = np.asarray(batch.scheduled)
        assert int(decoding.sum()) == rows
        assert (nd[decoding] == want).all(), (budget, rows, nd)


def test_adaptive_draft_length_follows_acceptance():
    """Rejecting every draft pulls the adaptive length down to the smallest bucket; the fixed one stays at K.
    (The article's histogram rule, `skvs_article`; the goodput controller's own tests are in test_draft_control.)"""
    for adaptive, want in ((True, 0), (False, 4)):
        pol = ARTICLE if adaptive else ARTICLE.replace(adaptive_draft_len=False, draft_buckets=(4,))
        h = Harness(_cfg(pol), vocab=VOCAB)
        h.add([[1, 2, 1]], [28])
        rng = np.random.default_rng(0)
        drafts = [int(np.asarray(h.step(rng, "none").num_drafts)[0]) for _ in range(20)]
        assert drafts[1] == 4 and drafts[-1] == want, drafts
        if adaptive:
            assert 2 in drafts, "it passes through the middle bucket"


def test_release_and_pool_switches_change_what_rejected_drafts_hold():
    lazy = _run(_cfg(SKVS.replace(release="lazy", spec_pool=False, generation_threshold=0)), accept="none")
    now = _run(_cfg(SKVS), accept="none")
    assert int(lazy.st.kv.alloc.counters.spec_pool_hits) == 0 and int(now.st.kv.alloc.counters.spec_pool_hits) > 0
    stale_held = lambda h: (int(np.asarray(h.st.kv.alloc.blocks.state == STALE).sum())  # noqa: E731
                            - int(h.st.kv.alloc.blocks.pool_top))
    assert stale_held(now) == 0


def test_prefix_cache_barrier_and_insert_switches():
    no_cache = _run(_cfg(NAIVE.replace(prefix_cache=False)))
    assert int(no_cache.st.counters.cached_tokens) == 0 and not no_cache.oracle.index.index
    barrier = _run(_cfg(ARTICLE))
    no_barrier = _run(_cfg(ARTICLE.replace(prefix_barrier=False)))
    assert 0 < int(barrier.st.counters.cached_tokens) < int(no_barrier.st.counters.cached_tokens)
    on_fill = _run(_cfg(SKVS.replace(insert="on_fill")))
    validated = _run(_cfg(SKVS))
    # On fill, entries of blocks that then held rejected drafts are rolled back; validated inserts never are, so
    # there every removal is an eviction's (the harness checks after each step that the index holds only
    # validated content, for both modes).
    assert int(on_fill.st.kv.prefix.counters.removed) > int(on_fill.st.kv.alloc.counters.evictions)
    assert int(validated.st.kv.prefix.counters.inserted) > 0


@pytest.mark.parametrize("block_size, max_blocks, draft_len, trimmed", [
    pytest.param(4, 8, 4, 1, marks=pytest.mark.slow), (4, 8, 1, 1),
    pytest.param(2, 16, 4, 2, marks=pytest.mark.slow)])  # slow: the run's time budget
def test_spec_hit_trim_shortens_a_hit_by_the_draft_reach_in_blocks(block_size, max_blocks, draft_len, trimmed):
    """A prompt served once is cached; the same prompt again hits its whole blocks (naive_spec), or those less
    ceil(K / S) blocks (naive_spec_vllm, vLLM's EAGLE/MTP path), K the draft-length knob."""
    prompt = [1, 2, 0, 1, 1, 2, 0, 0, 2, 1, 1, 0, 2]  # 13 tokens: (13 - 1) // S whole blocks can hit
    hits = {}
    for pol in (NAIVE, policies.naive_spec_vllm(4)):
        cfg = _cfg(pol, block_size=block_size, max_blocks=max_blocks, num_blocks=4 * max_blocks)
        h = Harness(cfg, vocab=VOCAB, knobs=pol.knobs().replace(draft_len=jnp.asarray(draft_len, jnp.int32)))
        rng = np.random.default_rng(0)
        h.add([prompt], [2])
        while int(h.st.counters.finished) < 1:
            h.step(rng, "none")
        h.add([prompt], [2])
        hits[pol.name] = int(np.asarray(h.step(rng, "none").hit_tokens).sum())
    assert hits["naive_spec"] == (len(prompt) - 1) // block_size * block_size
    assert hits["naive_spec_vllm"] == hits["naive_spec"] - trimmed * block_size
    assert not policies.naive_spec(4).spec_hit_trim and not any(
        policies.preset(n).spec_hit_trim for n in ("vllm_default", "naive_spec", "skvs", "skvs_article"))


def test_spec_in_prefill_reserves_draft_slots():
    cfg = _cfg(NAIVE, prefill_chunk=2)
    h = Harness(cfg, vocab=VOCAB)
    h.add([[1, 2, 1, 2, 1, 2, 1]], [4])
    b = h.step(np.random.default_rng(0))
    assert int(np.asarray(b.num_reserved)[0]) == 4 and int(np.asarray(b.num_drafts)[0]) == 0
    h2 = Harness(dataclasses.replace(cfg, policy=NAIVE.replace(spec_in_prefill=False)), vocab=VOCAB)
    h2.add([[1, 2, 1, 2, 1, 2, 1]], [4])
    assert int(np.asarray(h2.step(np.random.default_rng(0)).num_reserved)[0]) == 0


@pytest.mark.slow  # the run's time budget; test_drafts_preempting_are_attributed checks the switch by default
def test_mandatory_drafts_run_out_of_blocks_more_often_than_opportunistic_ones():
    """Tight memory: mandatory drafts cause preemptions that opportunistic drafts never cause. One 50-step run is
    a noisy count (seed 3 alone gives 7 vs 8 since the cache fixes of issue 23), so three runs are summed."""
    tight = dict(num_blocks=14, max_running=6, token_budget=40)
    oom = lambda pol, seed: int(_run(_cfg(pol, **tight), seed=seed, steps=50).st.counters.oom_steps)  # noqa: E731
    pre = sum(oom(SKVS.replace(drafts_preempt=True, max_spec_ratio=1.0), seed) for seed in (3, 4, 5))
    opp = sum(oom(SKVS.replace(max_spec_ratio=1.0), seed) for seed in (3, 4, 5))
    assert pre > opp


# Slow-marked for the default run's time budget: the lockstep config naive-swap-most_blocks swaps by default.
@pytest.mark.slow
def test_swap_and_recompute_preemption():
    tight = dict(num_blocks=12, max_running=6, token_budget=40)
    rec = _run(_cfg(NAIVE, **tight), steps=50)
    swp = _run(_cfg(NAIVE.replace(preemption="swap"), swap_blocks=20, **tight), steps=50)
    assert int(rec.st.counters.preempt_recompute) > 0 and int(rec.st.counters.preempt_swap) == 0
    assert int(swp.st.counters.preempt_swap) > 0 and int(swp.st.counters.swap_ins) > 0


def test_generation_reclaim_knob():
    """With the article's rule drafts stop once they keep failing, so the pool's blocks age and are reclaimed."""
    zero = Harness(_cfg(ARTICLE), vocab=VOCAB,
                   knobs=ARTICLE.knobs().replace(generation_threshold=jnp.asarray(0, jnp.int32)))
    rng = np.random.default_rng(3)
    zero.add([[1, 2, 1], [2, 2]], [20, 20])
    for _ in range(10):
        zero.step(rng, "none")
    assert int(zero.st.kv.alloc.counters.spec_blocks_reclaimed) > 0


def test_max_spec_ratio_bounds_opportunistic_draft_blocks():
    # skvs prices draft blocks; the ratio bounds opportunistic ones. Without prefill reservations: an admitted
    # row's reservation is fit against the available blocks, not the ratio (docs/scheduler.md, phase 5b).
    opp = SKVS.replace(draft_memory="opportunistic", spec_in_prefill=False)
    none = _run(_cfg(opp, num_blocks=16), accept="none", steps=40)
    zero = Harness(_cfg(opp, num_blocks=16), vocab=VOCAB,
                   knobs=opp.knobs().replace(max_spec_ratio=jnp.asarray(0.0, jnp.float32)))
    rng = np.random.default_rng(3)
    zero.add([[1, 2, 1, 2, 2]], [12])
    batches = [zero.step(rng) for _ in range(8)]
    # A ratio of 0 still lets drafts use the room left in blocks already held, never a new block.
    assert int(zero.st.kv.alloc.counters.spec_blocks_allocated) == 0
    assert int(none.st.kv.alloc.counters.spec_blocks_allocated) > 0
    del batches


# ------------------------------------------------------------------------------------------- boundary


def test_bad_inputs_raise_naming_the_argument():
    cfg = CONFIGS["skvs"]
    st = sc.init(cfg)
    one = jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sc.add(st, jnp.ones((1, 4), jnp.int32), jnp.asarray([4], jnp.int32), jnp.asarray([0], jnp.int32), cfg=cfg)
    with pytest.raises(ValueError, match="exceeds L"):
        sc.add(st, jnp.ones((1, 20), jnp.int32), jnp.asarray([20], jnp.int32), jnp.asarray([20], jnp.int32),
               cfg=cfg)
    with pytest.raises(ValueError, match="prompts"):
        sc.add(st, jnp.ones((4,), jnp.int32), one, one, cfg=cfg)
    # A padding row's max_new_tokens is ignored; inside jit a row that breaks the rules is padding too.
    _, slots = sc.add(st, jnp.ones((2, 4), jnp.int32), jnp.asarray([0, 4], jnp.int32), jnp.asarray([0, 3], jnp.int32),
                      cfg=cfg)
    assert np.asarray(slots).tolist() == [-1, 0]
    jit_add = jax.jit(lambda st, n, new: sc.add(st, jnp.ones((3, 20), jnp.int32), n, new, cfg=cfg))
    added, slots = jit_add(st, jnp.asarray([20, 4, 4], jnp.int32), jnp.asarray([20, 0, 3], jnp.int32))
    assert np.asarray(slots).tolist() == [-1, -1, 0] and int(added.next_arrival) == 1
    with pytest.raises(ValueError, match="knobs.verify_budget"):
        sc.schedule(st, SKVS.knobs().replace(verify_budget=jnp.asarray(0, jnp.int32)), cfg=cfg)
    with pytest.raises(ValueError, match="verify_budget"):
        SKVS.replace(verify_budget=0)
    with pytest.raises(ValueError, match="knobs.draft_len"):
        sc.schedule(st, SKVS.knobs().replace(draft_len=jnp.asarray(9, jnp.int32)), cfg=cfg)
    with pytest.raises(ValueError, match="max_running"):
        dataclasses.replace(cfg, max_running=99)
    with pytest.raises(TypeError, match=r"victim takes a function.*policy.replace\(victim='oldest'\)"):
        dataclasses.replace(cfg, victim="oldest")
    with pytest.raises(TypeError, match="batch"):
        sc.update(st, None, jnp.zeros((6,), jnp.int32), jnp.zeros((6,), jnp.int32), cfg=cfg)


def test_a_custom_victim_rule_plugs_in():
    def youngest_first(rank, computed, held):
        return -computed

    cfg = _cfg(NAIVE, num_blocks=12, max_running=6, token_budget=40, victim=youngest_first)
    h = _run(cfg, steps=30)
    assert int(h.st.counters.preempt_recompute) > 0


def test_the_policy_names_the_victim_rule_and_a_config_rule_overrides_it():
    """SchedulerConfig.victim None (the default) reads Policy.victim; a function there wins (the way to plug in a
    rule that has no name). Under memory pressure the policy's rule changes who is preempted."""
    pol = NAIVE.replace(victim="most_progress")
    assert _cfg(pol).victim_rule is sc.most_progress and _cfg(NAIVE).victim_rule is sc.lowest_priority
    assert _cfg(pol, victim=sc.least_progress).victim_rule is sc.least_progress
    assert set(sc.VICTIM_RULES) == set(victims.VICTIM_RULE_NAMES)
    runs = {v: _run(_cfg(NAIVE.replace(victim=v), num_blocks=12, max_running=6, token_budget=40))
            for v in ("lowest_priority", "most_progress")}  # each checked against the oracle step by step
    assert all(int(h.st.counters.preempt_recompute) > 0 for h in runs.values())
    tokens = [np.asarray(h.st.seqs.tokens) for h in runs.values()]
    assert np.any(tokens[0] != tokens[1])


def test_first_admissions_are_counted_apart_from_recompute_readmissions():
    """A recompute re-admission looks its tokens up again and finds its own blocks; the first-admission counters
    leave it out. Prompts that share nothing: every first-admission hit is 0, the re-admissions still hit."""
    cfg = _cfg(VLLM, num_blocks=12, max_running=6, token_budget=40)
    h = Harness(cfg, vocab=VOCAB)
    rng = np.random.default_rng(1)
    for i in range(40):
        if i % 4 == 0:  # each prompt's first block is a distinct base-3 number: no two prompts share a block
            n = [i // 2 + j for j in range(2)]
            h.add([[x // 3**d % 3 for d in range(4)] + [int(t) for t in rng.integers(0, VOCAB, 6)] for x in n],
                  [14, 14])
        h.step(rng, "none")
    ct = h.st.counters
    assert int(ct.preempt_recompute) > 0 and int(ct.cached_tokens) > 0
    assert int(ct.first_cached_tokens) == 0 and 0 < int(ct.first_prompt_tokens) < int(ct.prompt_tokens)
    assert int(ct.first_prompt_tokens) % 10 == 0  # a first admission looks up its 10-token prompt, no output yet


def test_traced_knobs_are_clamped_and_bad_knobs_or_a_stale_batch_are_refused_at_the_boundary():
    """Under vmap no knob is checked at the boundary: a ratio above 1 must not grant drafts without blocks (it
    acts as 1), and NaN acts as 0."""
    # Opportunistic drafts: the grant that reads max_spec_ratio (priced drafts take any available block).
    pol = policies.skvs(4).replace(adaptive_draft_len=False, draft_buckets=(4,), draft_memory="opportunistic")
    cache = CacheConfig(num_blocks=10, block_size=2, max_seqs=2, max_blocks_per_seq=6)
    cfg = sc.SchedulerConfig(cache=cache, policy=pol, max_running=2, token_budget=64, prefix_capacity=64)
    st = sc.init(cfg)
    st, _ = sc.add(st, jnp.asarray([[1, 2, 3, 4, 5], [2, 3, 4, 5, 6]], jnp.int32), jnp.asarray([5, 5], jnp.int32),
                   jnp.asarray([6, 6], jnp.int32), cfg=cfg)
    knobs = pol.knobs()
    st, batch = sc.schedule(st, knobs, cfg=cfg)
    st, _ = sc.update(st, batch, jnp.zeros(2, jnp.int32), jnp.asarray([7, 7], jnp.int32), cfg=cfg)
    ratios = jnp.asarray([0.0, 1.0, 3.0, np.inf, np.nan], jnp.float32)
    out = jax.vmap(lambda r: sc.schedule(st, knobs.replace(max_spec_ratio=r), cfg=cfg)[1])(ratios)
    assert np.asarray(out.alloc_ok).all()
    drafts = np.asarray(out.num_drafts)
    assert drafts[1].sum() > drafts[0].sum()  # the pool is tight enough that the ratio matters
    lane = lambda i: jax.tree.map(lambda x: x[i], out)  # noqa: E731
    for i, same_as in ((2, 1), (3, 1), (4, 0)):
        chex.assert_trees_all_equal(lane(i), lane(same_as))
    with pytest.raises(ValueError, match="knobs.max_spec_ratio must lie in"):
        sc.schedule(st, knobs.replace(max_spec_ratio=jnp.float32(np.nan)), cfg=cfg)
    with pytest.raises(ValueError, match="knobs.max_spec_ratio must be a scalar"):
        sc.schedule(st, knobs.replace(max_spec_ratio=jnp.ones(3, jnp.float32)), cfg=cfg)
    with pytest.raises(ValueError, match="knobs.generation_threshold must lie in"):
        sc.schedule(st, knobs.replace(generation_threshold=jnp.int32(-1)), cfg=cfg)
    # A batch settles once: a second update with it would append tokens that no model computed.
    after, batch = sc.schedule(st, knobs, cfg=cfg)
    after, _ = sc.update(after, batch, jnp.zeros(2, jnp.int32), jnp.asarray([8, 8], jnp.int32), cfg=cfg)
    with pytest.raises(ValueError, match="batch does not belong to this state"):
        sc.update(after, batch, jnp.zeros(2, jnp.int32), jnp.asarray([9, 9], jnp.int32), cfg=cfg)


def test_schedule_vmaps_over_knobs():
    """Knobs are data: one compiled schedule serves a batch of draft lengths."""
    cfg = CONFIGS["naive_spec"]
    st = sc.init(cfg)
    st, _ = sc.add(st, jnp.asarray([[1, 2, 1, 2]], jnp.int32), jnp.asarray([4], jnp.int32),
                   jnp.asarray([8], jnp.int32), cfg=cfg)
    knobs = jax.tree.map(lambda x: jnp.stack([x, x]), NAIVE.knobs())
    knobs = knobs.replace(draft_len=jnp.asarray([1, 4], jnp.int32))
    sts = jax.tree.map(lambda x: jnp.stack([x, x]), st)
    out, batch = jax.vmap(lambda s, k: sc.schedule_unchecked(s, k, cfg=cfg))(sts, knobs)
    assert np.asarray(batch.num_reserved)[:, 0].tolist() == [1, 4]
    assert np.asarray(batch.num_query)[:, 0].tolist() == [4, 4]
    del out
