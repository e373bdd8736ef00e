"""The goodput draft controller (`scheduler.draft_control`): its decision against a brute-force search, its
properties, the estimates' arithmetic, and the sim's step cost against the cost model it is built from."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from skvs_jax import policies
from skvs_jax import scheduler as sc
from skvs_jax.config import CacheConfig
from skvs_jax.scheduler import draft_control as dc
from skvs_jax.sim import cost_model as cm

T_MAX = 24


def _cost(base_us: int, slope_us: int, head_us: int = 0) -> sc.StepCost:
    return sc.StepCost(token_us=jnp.asarray(base_us + slope_us * np.arange(T_MAX + 1), jnp.int32),
                       row_us=jnp.asarray(3, jnp.int32), ctx_ns=jnp.asarray(20, jnp.int32),
                       head_us=jnp.asarray(head_us, jnp.int32))


def _widths(cost: sc.StepCost, width_us) -> sc.StepCost:
    """cost with a padded engine's width table (int32[W + 1])."""
    return cost.replace(width_us=jnp.asarray(width_us, jnp.int32))


def _decide(surv, cap, base, cost, rows=2, ctx=100, sampling=2, wide=False, reach_of=None):
    query = jnp.ones((len(cap),), jnp.int32)  # decode rows: one sampled token each
    return np.asarray(dc.goodput_drafts(jnp.asarray(surv, jnp.int32), jnp.asarray(cap, jnp.int32),
                                        jnp.asarray(base, jnp.int32), jnp.asarray(rows, jnp.int32),
                                        jnp.asarray(ctx, jnp.int32), jnp.asarray(sampling, jnp.int32), cost,
                                        query=query, wide=jnp.asarray(wide), reach_of=reach_of))


def _rate(surv, drafts, base, cost, rows, ctx, sampling, wide=False, reach_of=None):
    """Expected accepted tokens per us of drafts[b] slots per row; with a tree, n slots reach depth reach_of[n]."""
    n = int(sum(drafts))
    reach = list(range(len(surv[0]) + 1)) if reach_of is None else reach_of
    gain = sum(int(surv[b][d]) for b in range(len(drafts)) for d in range(reach[drafts[b]]))
    widest = None
    if cost.width_us is not None:  # decode rows: 1 + drafts; a prompt step runs the widest program
        widest = jnp.asarray(cost.width_us.shape[0] - 1 if wide else 1 + max(drafts, default=0))
    t = int(np.asarray(dc.step_time_us(cost, jnp.asarray(base + n), rows, ctx, jnp.asarray(n), widest)))
    return (sampling * dc.ONE + gain) / max(t, 1)


def _surv(alphas):
    return np.asarray(dc.survival(jnp.asarray(alphas, jnp.int32)))


alpha_rows = hs.lists(hs.integers(0, dc.ONE), min_size=3, max_size=3)


width_tables = hs.one_of(hs.none(), hs.lists(hs.integers(0, 3000), min_size=1, max_size=6).map(
    lambda steps: np.cumsum(steps).tolist()))  # None, or a padded engine's table (non-decreasing, like a fit)


@settings(max_examples=80)
@given(alphas=hs.lists(alpha_rows, min_size=1, max_size=3), caps=hs.lists(hs.integers(0, 3), min_size=3, max_size=3),
       base=hs.integers(0, 12), slope=hs.integers(0, 400), head=hs.integers(0, 2000), width=width_tables)
def test_the_decision_is_the_best_of_every_prefix_choice_to_grid_precision(alphas, caps, base, slope, head, width):
    """Brute force over every per-row prefix choice within the caps: the controller's goodput is within one grid
    level's worth of the best; and its choice is itself a prefix choice within the caps. With a width table
    (the step priced by its widest row) the best choice may cap rows the threshold alone would let draft more."""
    surv = _surv(alphas)
    cap = caps[: len(alphas)]
    cost = _cost(1000, slope, head)
    if width is not None:
        cost = _widths(cost, width)
    got = _decide(surv, cap, base, cost)
    assert all(0 <= g <= c for g, c in zip(got, cap))
    best = max(_rate(surv, list(ch), base, cost, 2, 100, 2)
               for ch in itertools.product(*[range(c + 1) for c in cap]))
    mine = _rate(surv, got.tolist(), base, cost, 2, 100, 2)
    # A threshold grid cannot split survivals within one level (ONE / LEVELS) of each other.
    slack = sum(cap) * (dc.ONE / dc.LEVELS) / 1000
    assert mine >= best - slack - 1e-9


# A draft tree's reach per slot count 0..5: non-decreasing, at most the count, deeper by at most one a slot.
tree_reaches = hs.lists(hs.booleans(), min_size=5, max_size=5).map(
    lambda deeper: [0] + np.cumsum([True] + deeper[1:]).tolist())


@settings(max_examples=60)
@given(alphas=hs.lists(hs.lists(hs.integers(0, dc.ONE), min_size=5, max_size=5), min_size=1, max_size=2),
       caps=hs.lists(hs.integers(0, 5), min_size=2, max_size=2), base=hs.integers(0, 12),
       slope=hs.integers(0, 400), width=width_tables, reach=tree_reaches)
def test_a_tree_drafts_to_a_depth_in_its_fewest_slots_and_is_the_best_choice(alphas, caps, base, slope, width,
                                                                            reach):
    """With a draft tree (n slots reach depth reach[n] <= n), brute force over every slot count per row: the
    controller's goodput is within a grid level's worth of the best, and each row's slots are the fewest that
    reach their depth (more slots to the same depth cost time and add nothing)."""
    surv = _surv(alphas)
    cap = caps[: len(alphas)]
    cost = _cost(1000, slope) if width is None else _widths(_cost(1000, slope), width)
    got = _decide(surv, cap, base, cost, reach_of=tuple(reach)).tolist()
    fewest = set(dc.slots_for(tuple(reach)))
    assert all(0 <= g <= c and g in fewest for g, c in zip(got, cap))
    best = max(_rate(surv, list(ch), base, cost, 2, 100, 2, reach_of=reach)
               for ch in itertools.product(*[range(c + 1) for c in cap]))
    mine = _rate(surv, got, base, cost, 2, 100, 2, reach_of=reach)
    slack = sum(reach[c] for c in cap) * (dc.ONE / dc.LEVELS) / 1000
    assert mine >= best - slack - 1e-9


def test_slots_for_is_the_inverse_of_the_reach():
    assert dc.slots_for((0, 1, 2, 3)) == (0, 1, 2, 3)  # a chain
    assert dc.slots_for((0, 1, 1, 2, 2, 2)) == (0, 1, 3, 6, 6, 6)  # depth 3 and beyond: out of reach (K + 1)


def test_brute_force_exact_when_survivals_sit_on_the_grid():
    """Survivals on grid levels: the controller finds exactly the best threshold choice."""
    step = dc.ONE // dc.LEVELS
    surv = np.asarray([[60 * step, 40 * step, 10 * step], [50 * step, 30 * step, 5 * step]])
    for slope in (0, 5, 50, 200, 2000):
        cost = _cost(1000, slope)
        got = _decide(surv, [3, 3], 2, cost)
        rates = {}
        for thr in dc.thresholds().tolist():
            ch = [int(np.sum(surv[b] >= thr)) for b in range(2)]
            rates.setdefault(tuple(ch), _rate(surv, ch, 2, cost, 2, 100, 2))
        best = max(rates.values())
        assert _rate(surv, got.tolist(), 2, cost, 2, 100, 2) == pytest.approx(best, rel=1e-6), slope


@settings(max_examples=40)
@given(alphas=hs.lists(alpha_rows, min_size=1, max_size=4), caps=hs.lists(hs.integers(0, 3), min_size=4, max_size=4),
       base=hs.integers(0, 20))
def test_never_exceeds_the_caps_and_zero_acceptance_drafts_nothing(alphas, caps, base):
    cap = caps[: len(alphas)]
    got = _decide(_surv(alphas), cap, base, _cost(500, 10))
    assert np.all(got <= np.asarray(cap)) and np.all(got >= 0)
    zero = _decide(_surv(np.zeros((len(alphas), 3), int)), cap, base, _cost(500, 0))
    assert np.all(zero == 0)


@settings(max_examples=40)
@given(alphas=hs.lists(alpha_rows, min_size=1, max_size=4), base=hs.integers(0, 20),
       slopes=hs.lists(hs.integers(0, 3000), min_size=2, max_size=5))
def test_monotone_in_cost(alphas, base, slopes):
    """A steeper per-token cost never buys more drafts."""
    surv = _surv(alphas)
    totals = [int(_decide(surv, [3] * len(alphas), base, _cost(1000, s)).sum()) for s in sorted(slopes)]
    assert totals == sorted(totals, reverse=True)


def test_a_width_table_caps_every_row_at_the_program_that_pays():
    """A padded engine: drafts cost nothing per token, but the 4-wide program (3 drafts) costs 2 ms more than
    the 3-wide one (1 ms steps). Two rows that would both take 3 drafts on survival alone take 2 each (the
    cheaper program); with a free 4-wide program they take all 3, and in a step with prompt work (run at the
    widest width anyway) all 3."""
    surv = _surv([[dc.ONE * 9 // 10] * 3, [dc.ONE * 9 // 10] * 3])
    flat = _cost(1000, 0)
    assert _decide(surv, [3, 3], 2, flat).tolist() == [3, 3]
    costly = _widths(flat, [0, 0, 0, 0, 2000])  # widest row's tokens: 1 + drafts; 4 = 3 drafts
    assert _decide(surv, [3, 3], 2, costly).tolist() == [2, 2]
    assert _decide(surv, [3, 3], 2, _widths(flat, [0, 0, 0, 0, 0])).tolist() == [3, 3]
    assert _decide(surv, [3, 3], 2, costly, wide=True).tolist() == [3, 3]
    with pytest.raises(ValueError, match="widest"):
        dc.step_time_us(costly, jnp.asarray(3), 2, 100, jnp.asarray(1))


def test_free_drafts_take_every_draft_worth_a_level():
    surv = _surv([[dc.ONE * 3 // 4] * 3, [dc.ONE // 100] * 3])
    got = _decide(surv, [3, 3], 4, sc.flat_step_cost(_cfg_budget(T_MAX)))
    assert got.tolist() == [3, 0]  # 0.75, 0.56, 0.42 vs 0.0098 < ONE / LEVELS


def _cfg_budget(t):
    from skvs_jax.config import CacheConfig
    return sc.SchedulerConfig(cache=CacheConfig(num_blocks=8, block_size=4, max_seqs=2, max_blocks_per_seq=4),
                              policy=policies.skvs(3), max_running=2, token_budget=t)


def test_estimates_prior_and_counts():
    """A new request reads the population's rate; counts pull it to its own; totals halve past the cap."""
    pop_t, pop_p = jnp.asarray([100, 0], jnp.int32), jnp.asarray([20, 0], jnp.int32)
    tried, passed = jnp.asarray([[0, 0], [40, 10]], jnp.int32), jnp.asarray([[0, 0], [40, 10]], jnp.int32)
    a = np.asarray(dc.acceptance_estimates(tried, passed, pop_t, pop_p))
    pop0 = (20 * dc.ONE + dc.POP_PRIOR_W * dc.POP_PRIOR) // (100 + dc.POP_PRIOR_W)
    assert a[0, 0] == pop0 and a[0, 1] == dc.POP_PRIOR  # no data: the population's rate, then its prior
    assert a[1, 0] == (40 * dc.ONE + dc.REQ_PRIOR_W * pop0) // (40 + dc.REQ_PRIOR_W)
    t, p, pt, pp = dc.record_drafts(tried, passed, jnp.asarray([dc.POP_HALVE_AT - 1, 3], jnp.int32),
                                    jnp.asarray([5, 1], jnp.int32), jnp.asarray([True, False]),
                                    jnp.asarray([2, 2], jnp.int32), jnp.asarray([0, 2], jnp.int32))
    assert np.asarray(t).tolist() == [[1, 0], [40, 10]] and np.asarray(p).tolist() == [[0, 0], [40, 10]]
    assert np.asarray(pt).tolist() == [dc.POP_HALVE_AT // 2, 3] and np.asarray(pp).tolist() == [2, 1]


@pytest.mark.parametrize("model,device", [("llama-3.1-8b", "a100-80gb"), ("llama-3-70b", "h100-sxm"),
                                          ("llama-3.1-8b", "h100-sxm")])
def test_sim_step_cost_tracks_the_cost_model(model, device):
    """The StepCost the simulator hands the controller prices decode and verification steps within 6% of the
    clock's own cost model: in the measured mode a sum of terms (as the profile is), in the roofline mode (70B on
    H100, 8B on H100) the roofline's own overlap of compute and memory (a sum of terms was 41% off at 128 rows
    of 700-token contexts drafting 3 each: the compute hides under the KV read)."""
    tp = 2 if model == "llama-3-70b" else 1
    cost = cm.CostModel(cm.MODELS[model], cm.DEVICES[device], tp=tp)
    table = cm.step_cost(cost, 2048)
    assert (table.compute_us is None) == (cost.resolved_mode == "measured")
    for rows, tokens, ctx, heads in [(1, 1, 512, 0), (1, 5, 512, 1), (32, 160, 32 * 512, 32),
                                     (64, 320, 64 * 512, 64), (64, 64, 64 * 512, 0), (128, 256, 128 * 512, 64),
                                     *[(128, 128 * (1 + d), 128 * 700, 128 * (d > 0)) for d in range(5)]]:
        clock = float(cost.step_time(0.0, float(tokens), float(ctx), float(rows), float(heads))) * 1e6
        mine = int(np.asarray(dc.step_time_us(table, jnp.asarray(tokens), rows, ctx, jnp.asarray(heads))))
        assert mine == pytest.approx(clock, rel=0.06), (rows, tokens)


def test_recompute_is_free_under_the_flat_cost_and_priced_by_the_mean_token_time():
    cfg = _cfg_budget(T_MAX)
    assert int(dc.recompute_us(sc.flat_step_cost(cfg), jnp.asarray(500))) == 0
    cost = _cost(1000, 40)  # 40 us per token over a full step
    assert int(dc.recompute_us(cost, jnp.asarray(100))) == 4000
    # A padded engine's widest program (8 tokens of a row) costs 1.6 ms more than the narrowest, and 100 tokens
    # begin 13 of its steps; 40 us a token on top of that.
    widths = _widths(_cost(1000, 0), [0] * 8 + [1600])
    assert [int(dc.recompute_us(widths, jnp.asarray(n))) for n in (0, 1, 8, 9, 100)] == [0, 1600, 1600, 3200, 20800]
    assert int(dc.recompute_us(_widths(cost, [0] * 8 + [1600]), jnp.asarray(100))) == 4000 + 20800


@settings(max_examples=60)
@given(tk=hs.integers(0, 10**6), tp=hs.integers(0, 10**6), time_k=hs.integers(0, 10**5), time_p=hs.integers(0, 10**5),
       rec=hs.integers(0, 10**5))
def test_preemption_pays_when_its_tokens_per_second_are_higher(tk, tp, time_k, time_p, rec):
    """The decision is the comparison of the two sides' expected tokens per microsecond (to float32 precision);
    a free recompute and equal times reduce it to more tokens."""
    got = bool(dc.preemption_pays(jnp.asarray(tk), jnp.asarray(time_k), jnp.asarray(tp), jnp.asarray(time_p),
                                  jnp.asarray(rec)))
    keep, pre = tk / max(time_k, 1), tp / (max(time_p, 1) + rec)
    if abs(keep - pre) > 1e-5 * max(keep, pre):
        assert got == (pre > keep)
    assert bool(dc.preemption_pays(jnp.asarray(tk), jnp.asarray(7), jnp.asarray(tp), jnp.asarray(7),
                                   jnp.asarray(0))) == (tp > tk)


@settings(max_examples=60)
@given(tk=hs.integers(0, 10**6), tp=hs.integers(0, 10**6), time_k=hs.integers(0, 10**5), time_p=hs.integers(0, 10**5),
       rec=hs.integers(0, 10**5), m1=hs.integers(0, 1024), m2=hs.integers(0, 1024))
def test_a_margin_asks_the_preemption_to_win_by_that_share(tk, tp, time_k, time_p, rec, m1, m2):
    """With a cost's margin m (1/1024), drafts preempt only when their side's tokens per microsecond beat keeping
    by more than m / 1024 of it; margin 0 is no margin; a larger margin never preempts where a smaller one did
    not."""
    args = [jnp.asarray(x) for x in (tk, time_k, tp, time_p, rec)]
    pays = lambda m: bool(dc.preemption_pays(*args, None if m is None else jnp.asarray(m, jnp.int32)))  # noqa: E731
    assert pays(0) == pays(None)
    keep, pre = tk / max(time_k, 1), tp / (max(time_p, 1) + rec)
    if abs(pre - keep * (1 + m1 / 1024)) > 1e-5 * max(keep, pre):
        assert pays(m1) == (pre > keep * (1 + m1 / 1024))
    lo, hi = sorted((m1, m2))
    assert pays(lo) or not pays(hi)


# ------------------------------------------------------------------------------------ the tail: probes and lag

_TAIL_B, _TAIL_K, _TAIL_STEPS = 4, 4, 48
_TAIL_CFG = sc.SchedulerConfig(
    cache=CacheConfig(num_blocks=4 * 48 + 1, block_size=8, max_seqs=_TAIL_B, max_blocks_per_seq=48),
    policy=policies.skvs(_TAIL_K), max_running=_TAIL_B, token_budget=64)
# Drafts pay for a row that accepts well (a step's fixed part dominates) but lengthen the step: an undrafted row
# riding with drafting ones is slowed, which is what the lag and the probes are for.
_TAIL_COST = _cost(2000, 40, 200)


def _serve_tail(outcomes: list[list[int]], steps: int = _TAIL_STEPS, max_new=(100,) * _TAIL_B, cost=_TAIL_COST
                ) -> tuple[list, list]:
    """Serve _TAIL_B requests of max_new[b] tokens for `steps` steps under `cost`; row b's i-th verification
    accepts min(outcomes[b][i mod len], drafts) drafts. Returns (per step (drafts int[B], decoded bool[B]) as
    scheduled, the rows' final lag)."""
    cfg, knobs = _TAIL_CFG, _TAIL_CFG.policy.knobs()
    st = sc.init(cfg)
    prompts = jnp.ones((_TAIL_B, 4), jnp.int32)
    st, _ = sc.add_unchecked(st, prompts, jnp.full((_TAIL_B,), 4, jnp.int32), jnp.asarray(max_new, jnp.int32),
                             jnp.zeros((_TAIL_B,), jnp.int32), jnp.arange(_TAIL_B, dtype=jnp.int32), cfg=cfg)
    seen, tried = [], [0] * _TAIL_B
    for _ in range(steps):
        st, batch = sc.schedule_unchecked(st, knobs, cost, cfg=cfg)
        drafts = np.asarray(batch.num_drafts)
        decoded = np.asarray(batch.samples) & (np.asarray(batch.start) >= 4)
        acc = np.zeros(_TAIL_B, np.int32)
        for b in range(_TAIL_B):
            if drafts[b] > 0:
                acc[b] = min(outcomes[b][tried[b] % len(outcomes[b])], drafts[b])
                tried[b] += 1
        st, _ = sc.update_unchecked(st, batch, jnp.asarray(acc), jnp.ones((_TAIL_B,), jnp.int32),
                                    jnp.ones((_TAIL_B, _TAIL_K), jnp.int32),
                                    jnp.zeros((_TAIL_B,), bool), knobs, cfg=cfg)
        seen.append((drafts, decoded))
    return seen, np.asarray(st.seqs.lag).tolist()


def _longest_wait(seen, b: int) -> int:
    """Row b's longest run of steps it decoded undrafted while some other row drafted."""
    run = longest = 0
    for drafts, decoded in seen:
        if decoded[b] and drafts[b] > 0:
            run = 0
        elif decoded[b] and drafts.any():
            run += 1
            longest = max(longest, run)
    return longest


@settings(max_examples=12, deadline=None)
@given(first=hs.lists(hs.lists(hs.integers(0, _TAIL_K), min_size=1, max_size=6), min_size=_TAIL_B,
                      max_size=_TAIL_B))
def test_no_row_waits_more_than_probe_after_drafting_steps_for_a_draft(first):
    """A population of identical acceptance (every row accepts 3 of 4 after its first outcomes, which hypothesis
    chooses: a row may start with any run of rejections). Bound: a decoding row with room for drafts waits at
    most PROBE_AFTER consecutive drafting steps undrafted (its probe clears every threshold but "none")."""
    seen, _ = _serve_tail([f + [3] * 32 for f in first])
    assert sum(d.sum() for d, _ in seen) > 0  # the population drafts
    assert max(_longest_wait(seen, b) for b in range(_TAIL_B)) <= dc.PROBE_AFTER


def test_a_row_that_never_accepts_is_drafted_rarely_and_the_others_often():
    """Row 0 rejects every draft; rows 1..3 accept 3 of 4, and decode beside it throughout. A draft costs a tenth
    of a step, so once row 0's estimate has fallen below that (its first ~30 tries: the population's prior weighs
    4), it is drafted only by its probes, about once every PROBE_AFTER + 1 drafting steps; the others in most."""
    seen, lag = _serve_tail([[0], [3], [3], [3]], steps=96, max_new=(90, 360, 360, 360), cost=_cost(1000, 300, 100))
    mine = [(d, dec) for d, dec in seen if dec[0]]
    late = mine[len(mine) // 2:]
    drafted_late = sum(int(d[0] > 0) for d, _ in late)
    assert drafted_late <= len(late) // (dc.PROBE_AFTER + 1) + 1, (drafted_late, len(late))
    others = [(sum(int(dec[b] and d[b] > 0) for d, dec in seen), sum(int(dec[b]) for _, dec in seen))
              for b in range(1, _TAIL_B)]
    assert all(n >= total * 3 // 4 for n, total in others), others
    assert all(lag[b] < 0 for b in range(1, _TAIL_B)), lag  # the rows that gain are ahead of drafting off


def test_a_behind_row_bounds_the_step_by_what_it_hopes_to_gain():
    """Two rows: row 0 is behind and its (optimistic) estimate is low, row 1's high. Unconstrained, the controller
    drafts row 1 deep; with row 0 behind, only choices whose time row 0's hoped gain covers are allowed."""
    surv = _surv([[dc.ONE // 8] * 3, [dc.ONE * 9 // 10] * 3])
    cost = _cost(1000, 200, 0)
    free = _decide(surv, [3, 3], 2, cost)
    assert free[1] == 3
    behind = np.asarray(dc.goodput_drafts(
        jnp.asarray(surv, jnp.int32), jnp.asarray([3, 3], jnp.int32), jnp.asarray(2, jnp.int32),
        jnp.asarray(2, jnp.int32), jnp.asarray(100, jnp.int32), jnp.asarray(2, jnp.int32), cost,
        behind=jnp.asarray([True, False]), bound_surv=jnp.asarray(surv, jnp.int32)))
    t0 = int(dc.step_time_us(cost, jnp.asarray(2), 2, 100, jnp.asarray(0)))
    t = int(dc.step_time_us(cost, jnp.asarray(2 + int(behind.sum())), 2, 100, jnp.asarray(int(behind.sum()))))
    hope = sum(int(surv[0][d]) for d in range(behind[0]))
    assert t * dc.ONE <= t0 * (dc.ONE + hope), (behind, t, t0, hope)
    assert behind.sum() < free.sum()


def test_a_row_over_its_tpot_target_is_behind_and_drafted_first():
    """over_target compares a row's priced time per decoded token with its target (0: none), by a quotient that
    cannot overflow; a row over it joins the behind rows (drafted at every threshold but "none") unless it is a
    probe or measured far below the population."""
    target = jnp.asarray([0, 1000, 1000, 1000, 2**31 - 1], jnp.int32)
    elapsed = jnp.asarray([10**6, 10_010, 10_000, 2**29, 2**29], jnp.int32)
    decoded = jnp.asarray([1, 10, 10, 0, 1], jnp.int32)
    assert np.asarray(dc.over_target(target, elapsed, decoded)).tolist() == [False, True, False, True, False]
    surv = jnp.asarray(_surv([[dc.ONE // 2] * 3, [dc.ONE // 2] * 3, [dc.ONE // 64] * 3]), jnp.int32)
    pop = jnp.asarray([dc.ONE // 2] * 3, jnp.int32)
    zeros, decoding = jnp.zeros((3,), jnp.int32), jnp.asarray([True, True, True])
    over = jnp.asarray([True, False, True])
    behind, probe = dc.priority_rows(zeros, zeros, zeros, decoding, surv, pop, over)
    assert np.asarray(behind).tolist() == [True, False, False]  # row 2 is far below the population: not protected
    assert not np.asarray(probe).any()
    assert not np.asarray(dc.priority_rows(zeros, zeros, zeros, decoding, surv, pop)[0]).any()


@settings(max_examples=80)
@given(rows=hs.lists(hs.tuples(hs.integers(0, dc.LAG_CAP), hs.integers(-1, 3000), hs.booleans()), min_size=1,
                     max_size=8),
       slack=hs.integers(0, 1024))
def test_a_row_slower_per_token_than_its_peers_is_over_them(rows, slack):
    """over_peers against its definition in exact arithmetic: a decoding row with a decoded token is over its peers
    when its TPOT (elapsed // decoded) exceeds the mean TPOT of those rows by more than slack / 1024 of it; any
    elapsed up to LAG_CAP, no overflow (each TPOT is capped at (2^31 - 1) // B first)."""
    elapsed, decoded, decoding = (jnp.asarray(x) for x in zip(*rows))
    cap = (2**31 - 1) // len(rows)
    on = [d and n > 0 for _, n, d in rows]
    tpot = [min(e // max(n, 1), cap) for e, n, _ in rows]
    mean = sum(t for t, o in zip(tpot, on) if o) // max(sum(on), 1)
    want = [o and t * 1024 > mean * (1024 + slack) - (mean * slack) % 1024 for t, o in zip(tpot, on)]
    got = dc.over_peers(elapsed.astype(jnp.int32), decoded.astype(jnp.int32), decoding, slack)
    assert np.asarray(got).tolist() == want


def test_the_slowest_rows_of_a_batch_are_behind_under_tail_peers():
    """Rows decoding 10 % or more slower per token than their peers' mean are behind (drafted first, bounding the
    step under the guard); a row not decoding this step and one with no decoded token are neither counted nor
    flagged."""
    elapsed = jnp.asarray([10_000, 10_000, 13_000, 50_000, 90_000], jnp.int32)
    decoded = jnp.asarray([10, 10, 10, 0, 10], jnp.int32)
    decoding = jnp.asarray([True, True, True, True, False])
    # peers: 1000, 1000, 1300 us a token: mean 1100, and 1100 * (1 + 102 / 1024) = 1209
    assert np.asarray(dc.over_peers(elapsed, decoded, decoding, 102)).tolist() == [False, False, True, False, False]
    assert np.asarray(dc.over_peers(elapsed, decoded, decoding, 1024)).tolist() == [False] * 5
