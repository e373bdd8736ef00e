"""Chosen draft widths (`scheduler.buckets`): the exact choice, the one snapping rule, re-choice with hysteresis,
widths as data in the scheduler (against the oracle), and the engine's compile count."""

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from skvs_jax import policies
from skvs_jax import scheduler as sc
from skvs_jax.config import CacheConfig
from skvs_jax.scheduler import buckets
from skvs_jax.serve import speculation
from skvs_jax.testing.scheduler_harness import Harness


def _brute_force(hist, budget, k):
    """(least cost, fewest widths at that cost) over every set of <= budget widths of 0..K holding K."""
    best = None
    for n in range(0, min(budget, k + 1)):
        for rest in itertools.combinations(range(k), n):
            widths = (*rest, k)
            key = (buckets.cost(hist, widths), len(widths))
            best = key if best is None or key < best else best
    return best


@settings(max_examples=200)
@given(data=hs.data(), k=hs.integers(0, 8), budget=hs.integers(1, 6))
def test_the_choice_is_exactly_optimal_against_brute_force(data, k, budget):
    hist = data.draw(hs.lists(hs.integers(0, 1000) | hs.just(0), min_size=k + 1, max_size=k + 1))
    widths = buckets.choose_widths(hist, budget, k)
    assert widths == tuple(sorted(set(widths))) and widths[-1] == k and len(widths) <= budget
    assert (buckets.cost(hist, widths), len(widths)) == _brute_force(hist, budget, k)
    assert buckets.choose_widths(hist, budget, k) == widths  # deterministic


def test_the_choice_on_small_cases():
    assert buckets.choose_widths([3, 0, 50, 0, 1], 3, 4) == (0, 2, 4)  # the fixed {0, K/2, K} when that is optimal
    assert buckets.choose_widths([0, 10, 0, 10, 0], 3, 4) == (1, 3, 4)
    assert buckets.choose_widths([0] * 5, 3, 4) == (4,)  # nothing observed: only the widest program
    assert buckets.choose_widths([9, 1, 1, 1, 9], 2, 4) == (0, 4)
    with pytest.raises(ValueError, match="budget"):
        buckets.choose_widths([1, 1], 0, 1)
    with pytest.raises(ValueError, match="hist"):
        buckets.choose_widths([1, -1], 2, 1)


@settings(max_examples=50)
@given(widths=hs.lists(hs.integers(0, 8), min_size=1, max_size=5), need=hs.lists(hs.integers(-1, 9), max_size=6))
def test_snap_up_is_the_smallest_fitting_width_on_host_and_device(widths, need):
    want = [min([w for w in widths if w >= x], default=max(widths)) for x in need]
    host = buckets.snap_up(np.asarray(need, np.int32), widths)
    device = buckets.snap_up(jnp.asarray(need, jnp.int32), jnp.asarray(widths, jnp.int32))
    assert isinstance(host, np.ndarray)
    assert host.tolist() == want == np.asarray(device).tolist()


def _feed(chooser, bound, steps, rows=4):
    out = []
    for _ in range(steps):
        chooser.observe(bound, rows, rows * bound)
        got = chooser.rechoose()
        if got is not None:
            out.append(got)
    return out


def test_a_drift_is_followed_once_and_a_steady_mix_never_thrashes():
    c = buckets.BucketChooser(k=4, budget=3, widths=(0, 2, 4), every=16)
    assert _feed(c, 1, 48) == [(1, 4)]  # every step wants 1: width 1 replaces 2 (and 0 is not needed)
    assert _feed(c, 3, 48) == [(3, 4)]  # the load drifts to 3
    # A steady mix of 1 and 3 re-chooses once, to both, and then stays.
    out = []
    for _ in range(64):
        out += _feed(c, 1, 1) + _feed(c, 3, 1)
    assert out == [(1, 3, 4)] and c.rechoices == 3


def test_hysteresis_keeps_widths_that_are_nearly_optimal():
    """A window whose best set saves less than HYSTERESIS of its padding does not switch."""
    for hysteresis, want in ((buckets.HYSTERESIS, None), (0.0, (1, 2, 4))):
        c = buckets.BucketChooser(k=4, budget=3, widths=(2, 4), every=10, hysteresis=hysteresis)
        for _ in range(9):  # bound 2, rows drafting nothing: padding no width removes
            c.observe(2, 4, 0)
        c.observe(1, 4, 4)  # one step at bound 1: adding width 1 saves 4 of the window's 76 padded slots
        assert c.rechoose() == want


def test_re_choices_are_bounded():
    c = buckets.BucketChooser(k=4, budget=2, widths=(2, 4), every=4, max_rechoices=3)
    seen = []
    for i in range(40):  # a drift every window
        seen += _feed(c, (1, 3)[i % 2], 4)
    assert len(seen) == 3 and c.rechoices == 3


def test_bucket_budget_is_validated():
    with pytest.raises(ValueError, match="bucket_budget"):
        policies.skvs(4).replace(bucket_budget=2)  # fewer than the 3 buckets it starts from
    with pytest.raises(ValueError, match="bucket_budget"):
        policies.vllm_default().replace(bucket_budget=1)
    assert policies.skvs(4).replace(bucket_budget=5).width_slots == 5


# ------------------------------------------------------------------------- widths as data in the scheduler

CACHE = CacheConfig(num_blocks=14, block_size=4, max_seqs=6, max_blocks_per_seq=8)


@pytest.mark.parametrize("tree_reach", [False, True])
def test_the_histogram_rule_drafts_from_the_states_widths_as_the_oracle_does(tree_reach):
    """skvs_article with a budget of 3 widths, replaced mid-run (what a re-choice does): the jitted scheduler and
    the oracle agree step for step, and the rule's drafts are always one of the current widths (or cut by
    room / memory). With a tree's reach table the rule compares reach, not node counts."""
    pol = policies.skvs_article(4).replace(bucket_budget=3)
    reach = (0, 1, 1, 2, 2) if tree_reach else ()
    cfg = sc.SchedulerConfig(cache=CACHE, policy=pol, max_running=5, token_budget=16, prefix_capacity=1024,
                             reach_of=reach)
    h = Harness(cfg, vocab=3)
    rng = np.random.default_rng(0)
    ops = [("add", [[1, 2, 1], [0, 1], [2, 2, 2, 1]], [12, 10, 14], [0, 1, 0])]
    for i, widths in enumerate(([1, 3, 4], [4, 4, 4], [0, 1, 4], [2, 4, 4])):
        ops += [("widths", widths)] + [("step", int(rng.integers(2**31)), ("random", "all", "none")[j % 3])
                                       for j in range(6)]
        ops += [("add", [[1, 1, 0, i % 3]], [8], [0])]
    h.run(ops)
    assert np.asarray(h.st.draft_widths).tolist() == [2, 4, 4]
    assert int(h.st.counters.drafted) > 0


def test_a_reach_table_is_checked_and_a_chain_is_resolved_to_the_policys_k():
    """`SchedulerConfig.reach_of`: a tree's table is kept; () or a chain (of any K: a config whose policy was
    replaced) is this policy's chain; a table of the wrong length, decreasing, or past its count is refused."""
    pol = policies.skvs_article(15)
    tree = speculation.reach(speculation.SMALL_TREE, range(16))
    cfg = sc.SchedulerConfig(cache=CACHE, policy=pol, max_running=5, token_budget=16, reach_of=tree)
    assert cfg.reach_of == tree and cfg.reach_of[7] == 3 and cfg.reach_of[6] == 2 and cfg.reach_of[15] == 4
    chain = sc.SchedulerConfig(cache=CACHE, policy=pol, max_running=5, token_budget=16)
    assert chain.reach_of == tuple(range(16))
    assert dataclasses.replace(chain, policy=policies.skvs_article(4)).reach_of == (0, 1, 2, 3, 4)
    for bad in ((0, 2), (0, 1, 1, 0) + (1,) * 12, (0, 2) + (2,) * 14, ("a",) * 16):
        with pytest.raises(ValueError, match="reach_of must give"):
            sc.SchedulerConfig(cache=CACHE, policy=pol, max_running=5, token_budget=16, reach_of=bad)


# ---------------------------------------------------------------------------------- the engine's programs


@pytest.mark.slow  # three engine programs compile (~20 s each on a 2-core CPU)
def test_the_engine_compiles_one_program_per_width_it_has_and_re_chooses_on_drift(shipped):
    """Warmed up with a histogram, the engine compiles the prompt width and the chosen widths only; when the draft
    length knob drops mid-run (a drift of the bounds) it re-chooses once, compiles the one new width once, and
    every program compiled over the run is a width it had: 1 + budget * (1 + re-choices) at most. Greedy output
    is unchanged, and the scheduler's state holds the chooser's widths."""
    from reference_models import greedy_generate
    from skvs_jax.serve import dispatch, engine

    model, heads = shipped
    cache = CacheConfig(num_blocks=48, block_size=8, max_seqs=8, max_blocks_per_seq=16)
    policy = policies.skvs(4).replace(bucket_budget=3)
    # Two steps a dispatch: the knob below drops at a known engine step (a dispatch of up to 32 could finish every
    # request before it), and the steps still run through the multi-step program whose compilations are counted.
    e = engine.Engine(model, heads, policy, cache, token_budget=96, prefill_chunk=32, steps_per_dispatch=2)
    e.picker.chooser.every = 6
    before = dispatch.run_steps._cache_size()
    assert e.warmup({4: 40}) == [e.picker.prompt_width, 5] and e.picker.decode_widths == (5,)  # only K was ever wanted
    assert dispatch.run_steps._cache_size() - before == 2
    rng = np.random.default_rng(1)
    prompts = [rng.integers(32, 127, size=int(rng.integers(6, 20))).tolist() for _ in range(3)]
    ids = [e.add_request(p, engine.SamplingParams(max_tokens=48)) for p in prompts]
    dropped = False
    while e.has_work():
        if not dropped and len(e.step_log) >= 8:  # engine steps, not calls to step()
            e.knobs, dropped = e.knobs.replace(draft_len=jnp.asarray(2, jnp.int32)), True
        e.step()
    assert dropped
    for rid, p in zip(ids, prompts):
        assert e.requests[rid].tokens == greedy_generate(model, np.asarray([p]), 48)[0, len(p):].tolist()
    compiled = dispatch.run_steps._cache_size() - before
    # bounds of 2 drafts: width 1 + 2 joins K's
    assert e.picker.chooser.rechoices == 1 and e.picker.decode_widths == (3, 5)
    assert compiled == len(e.picker.widths) == 3 <= 1 + policy.bucket_budget * (1 + e.picker.chooser.rechoices)
    assert np.asarray(e.state.sched.draft_widths).tolist() == [2, 4, 4]
    assert e.picker.width_hist[3] > 0 and e.picker.padding >= 0 and e.picker.bucket_hist
