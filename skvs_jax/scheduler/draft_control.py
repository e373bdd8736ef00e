"""The goodput draft controller: each step, drafts go where the expected accepted tokens per second of the whole
step rise (`Policy.draft_control == "goodput"`).

    estimates (`acceptance_estimates`) → survival (`survival`) → the threshold that maximises goodput
    (`goodput_drafts`); `update` feeds the counts back (`record_drafts`).

Estimates. Per request and draft depth d, `SeqTable.draft_tried[b, d]` counts verifications that reached draft d
(d < min(accepted + 1, offered)) and `draft_passed[b, d]` those that accepted it (d < accepted); the state keeps
the population's totals per depth (`SchedState.pop_tried / pop_passed`). In fixed point (ONE = 4096):

    pop[d]      = (pop_passed[d] * ONE + POP_PRIOR_W * POP_PRIOR) // (pop_tried[d] + POP_PRIOR_W)
    alpha[b, d] = (draft_passed[b, d] * ONE + REQ_PRIOR_W * pop[d]) // (draft_tried[b, d] + REQ_PRIOR_W)
    surv[b, d]  = surv[b, d - 1] * alpha[b, d] // ONE,  surv[b, -1] = ONE  (the chance draft d is accepted)

so a new request starts from what the population shows, and the population from an optimistic prior (0.75:
a controller that starts pessimistic never drafts, and so never learns otherwise).

Decision. Survival falls with depth, so "every (b, d) with surv >= threshold and d < the row's cap" gives each row a
prefix of its drafts. Over a fixed grid of thresholds (none, ONE, ..., ONE / LEVELS; no sort), the step's goodput
is (sampling rows * ONE + sum of the selected surv) / time(base tokens + selected drafts) from a `StepCost`; the
first maximum wins (ties: fewer drafts). A `StepCost` with a width table (a padded engine, whose step time is
set by its widest row) adds a second axis, a cap on every row's drafts at each compiled draft width, so "two
drafts each in the 3-wide program" competes with "four for the best rows in the 5-wide one". Sums are over
integers and the one division is float32, so the jitted controller and the plain-Python oracle agree bit for bit.

The tail: no row locked out, no row slowed. A greedy controller traps a row whose first drafts were rejected: its
estimate falls below the step's threshold, so it is never drafted again and its estimate never recovers, while it
rides in steps that the other rows' drafts made longer. Three per-row quantities, kept by `update`
(`record_lag`), close the trap:

    lag[b]       microseconds the row has lost to speculation: each decode step adds T - T0 * (1 + accepted),
                 T the step's priced time and T0 its time without drafts (`priced_step`), so lag > 0 means its
                 tokens took longer than drafting off would have taken them (a local counterfactual: same batch);
    elapsed[b]   microseconds of its decode steps;
    undrafted[b] consecutive decode steps it went undrafted while other rows drafted.

* Probe. A decoding row with undrafted[b] >= PROBE_AFTER is drafted at least to depth 1 by every choice but
  "none", whatever the threshold, so a priced-out row is re-measured and its estimate moves again.
* Behind. A row with lag[b] > elapsed[b] / LAG_SLACK whose estimated first-draft acceptance is at least
  1 / PROTECT_WITHIN of the population's is drafted at least to depth 1 at every threshold but "none", and
  deeper by its hope (`optimistic_estimates`: OPTIMISM_W extra passes per depth, a bonus that shrinks as its
  tries grow) instead of its estimate, so a row three rejections priced out is drafted as its peers are.
* Over target. A request may ask for a TPOT (`SeqTable.tpot_target`, microseconds per output token; 0: none).
  A row whose decode steps took longer per token than that (elapsed // its decoded tokens > target:
  `over_target`) is behind too, whether or not speculation caused it: when not every row can be drafted at
  the step's threshold, the rows missing their target are drafted first, and under the guard the step
  lengthens no more than they hope to gain. Elapsed is the step cost's price of its steps, so the target
  means what the cost model means by a microsecond (the simulator's clock; an engine's fitted step cost).
* Over peers (`Policy.tail_peers`, a slack p in 1/1024ths; None: off). A decoding row whose TPOT so far is more
  than p / 1024 above the mean of its decoding peers' (`over_peers`) is behind too. A busy batch's slowest
  requests are mostly slow whatever is drafted (short ones that decode through a burst's longest steps); their
  own lag, a counterfactual against drafting off in the same steps, stays near zero, so only a comparison with
  their peers sees them, and the guard then keeps drafting from making them slower still.
* Guard (`Policy.tail_guard`, a slack g in 1/1024ths; None: off). A choice is allowed only if, for every behind
  row with a draft cap, T * ONE * 1024 <= T0 * (ONE + its hoped gain) * (1024 + g): the step lengthens no more
  than each behind row hopes to gain from it. "none" always qualifies. A row measured far below the population
  is not behind: it cannot gain from the batch's drafts, and protecting it would stop them for every other row;
  and a behind row that held the batch back for PROBE_AFTER steps is probed (its streak counts the steps it was
  behind) and holds nothing back that step, so no row's veto outlasts its own measurement (docs/design.md
  "Draft control's tail" measures what the guard costs).

Bound: a decoding row with a draft cap >= 1 is drafted at the latest in the first drafting step after
PROBE_AFTER consecutive undrafted drafting steps, so no row waits longer than PROBE_AFTER such steps for a draft
(`tests/test_draft_control.py` holds it). A row of truly low acceptance is drafted about once per PROBE_AFTER + 1
drafting steps once its estimate has fallen below what a draft costs.

Trees. A draft tree's n slots reach depth reach_of[n] <= n (`SchedulerConfig.reach_of`): depths are what the
estimates count (`update` records the depth a row's slots reached, not its slot count) and what the threshold
selects; a row drafting to depth r takes the fewest slots that reach it (`slots_for`) and is priced for those.
A chain is the identity case. The estimate at depth d pools every width the row was given (a wider prefix of
the tree has more candidates at a depth, so it passes more often): the controller slightly under-rates wide
trees at shallow depths and over-rates narrow ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from skvs_jax.arrays import cdiv, div_nonneg, floor_div, floor_mod, i32, sums
from skvs_jax.scheduler.state import StepCost

ONE = 4096  # fixed-point 1.0 of acceptance and survival probabilities
LEVELS = 64  # survival thresholds ONE * j / LEVELS, j = LEVELS .. 1, after "none"
REQ_PRIOR_W = 4  # a request's estimate weighs the population's rate as this many verifications
POP_PRIOR_W = 4  # the population's rate weighs its prior as this many verifications
POP_PRIOR = 3 * ONE // 4  # the population's prior conditional acceptance (optimistic: see the module docstring)
POP_HALVE_AT = 2**17  # population totals at a depth halve once its tried count reaches this (int32-safe, recency)
OPTIMISM_W = 4  # the behind rows' bound counts this many extra passes at every depth (an optimistic estimate)
PROBE_AFTER = 8  # a decoding row undrafted for this many consecutive drafting steps is drafted (one depth) next
LAG_SLACK = 64  # a row is behind when the time it lost to speculation exceeds 1 / LAG_SLACK of its decode time
LAG_CAP = 2**29  # |lag| and elapsed saturate here (microseconds; int32-safe sums of a step's time)
PROTECT_WITHIN = 2  # a behind row is protected while its hoped gain is >= 1 / this of the population's


def thresholds() -> jax.Array:
    """int32[LEVELS + 1] the grid, largest first: ONE + 1 (no drafts), then ONE * j // LEVELS for j = LEVELS..1."""
    j = jnp.arange(LEVELS, 0, -1, dtype=i32)
    return jnp.concatenate([jnp.full((1,), ONE + 1, i32), ONE * j // LEVELS])


def acceptance_estimates(draft_tried: jax.Array, draft_passed: jax.Array, pop_tried: jax.Array,
                         pop_passed: jax.Array) -> jax.Array:
    """int32[B, K] conditional acceptance per request and depth, in fixed point (see the module docstring)."""
    # Counts are non-negative and the priors' weights positive: truncating division is the floor.
    pop = div_nonneg(pop_passed * ONE + POP_PRIOR_W * POP_PRIOR, pop_tried + POP_PRIOR_W)
    return div_nonneg(draft_passed * ONE + REQ_PRIOR_W * pop[None, :], draft_tried + REQ_PRIOR_W)


def optimistic_estimates(draft_tried: jax.Array, draft_passed: jax.Array, pop_tried: jax.Array,
                         pop_passed: jax.Array) -> jax.Array:
    """int32[B, K] `acceptance_estimates` with OPTIMISM_W more verifications that all passed: what a behind row's
    bound on the step's time counts on, and what selects its deeper drafts (module docstring). The bonus shrinks
    as the row's tries grow: a row priced out by a few rejections still hopes for its peers' acceptance."""
    return acceptance_estimates(draft_tried + OPTIMISM_W, draft_passed + OPTIMISM_W, pop_tried, pop_passed)


def survival(alpha: jax.Array) -> jax.Array:
    """int32[B, K] surv[b, d] = prod_{j <= d} alpha[b, j], in fixed point, rounded down at every depth."""
    s, out = jnp.full(alpha.shape[:1], ONE, i32), []
    for d in range(alpha.shape[1]):  # K is static and small
        s = floor_div(s * alpha[:, d], ONE)
        out.append(s)
    return jnp.stack(out, axis=1) if out else jnp.zeros(alpha.shape, i32)


def step_time_us(cost: StepCost, tokens: jax.Array, rows: jax.Array, ctx: jax.Array, drafts: jax.Array,
                 widest: jax.Array | None = None) -> jax.Array:
    """int32[...] `StepCost`'s time of a step computing `tokens` (of which `drafts` draft slots) over `rows`
    running rows reading `ctx` context tokens; with a width table, `widest` is the widest row's tokens (the
    table's last entry for a step with prompt work: pass its length or more)."""
    t = jnp.clip(tokens, 0, cost.token_us.shape[0] - 1)
    time = cost.token_us[t] + cost.row_us * rows + jnp.where(drafts > 0, cost.head_us, 0)
    # ctx_ns and ctx are non-negative (`scheduler.api` checks the one, a context length is the other): the context
    # term's floor is a truncating division, one op where jnp's `//` adds a remainder and sign fix-ups (a kernel
    # more each on XLA:CPU, priced for every candidate cap of every row).
    ctx_us = div_nonneg(cost.ctx_ns * ctx, 1000)
    if cost.compute_us is None:
        time = time + ctx_us
    else:  # a roofline: compute hides under memory traffic (the context's KV read among it)
        c, m = cost.compute_us[t], cost.mem_us + ctx_us
        time = time + c + m - floor_div(cost.overlap * jnp.minimum(c, m), 1024)
    if cost.width_us is None:
        return time
    if widest is None:
        raise ValueError("a StepCost with a width table (width_us) prices a step by its widest row: pass widest")
    return time + cost.width_us[jnp.clip(widest, 0, cost.width_us.shape[0] - 1)]


def slots_for(reach_of: tuple[int, ...]) -> tuple[int, ...]:
    """Per depth r in 0..K, the fewest draft slots whose subtree reaches it: min {n : reach_of[n] >= r} (K + 1
    past the deepest reach). reach_of: per slot count 0..K, the depth those slots reach (`SchedulerConfig.reach_of`;
    a chain: the identity, and so is this)."""
    k = len(reach_of) - 1
    return tuple(next((n for n, r in enumerate(reach_of) if r >= depth), k + 1) for depth in range(k + 1))


def population_survival(pop_tried: jax.Array, pop_passed: jax.Array) -> jax.Array:
    """int32[K] the survival of a row with no counts of its own: the population's estimates multiplied down."""
    b = jnp.zeros((1, pop_tried.shape[0]), i32)
    return survival(acceptance_estimates(b, b, pop_tried, pop_passed))[0]


def priority_rows(lag: jax.Array, elapsed: jax.Array, undrafted: jax.Array, decoding: jax.Array,
                  surv: jax.Array, pop: jax.Array, over: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(behind bool[B], probe bool[B]) of decoding rows (bool[B]). probe: undrafted int32[B] >= PROBE_AFTER.
    behind: not a probe, `lagging` (lag, elapsed int32[B]) or over its TPOT target (over bool[B], `over_target`;
    None: no row is), and the row's estimated first-draft acceptance (surv int32[B, K] at depth 0) at least
    1 / PROTECT_WITHIN of the population's (pop int32[K], `population_survival`): a row measured far below the
    rows the batch drafts for is not protected, and a row that held the batch back PROBE_AFTER steps without a
    draft is probed instead (module docstring)."""
    hopeful = PROTECT_WITHIN * surv[:, 0] >= pop[0]
    probe = decoding & (undrafted >= PROBE_AFTER)
    late = lagging(lag, elapsed) if over is None else lagging(lag, elapsed) | over
    return decoding & late & hopeful & ~probe, probe


def over_target(target: jax.Array, elapsed: jax.Array, decoded: jax.Array) -> jax.Array:
    """bool[B] rows with a TPOT target (target int32[B] microseconds per token, 0 = none) whose decode steps took
    longer per token than it: elapsed // decoded > target, elapsed int32[B] their priced time and decoded int32[B]
    the tokens they gave (floored at 1). A quotient, so no product overflows int32."""
    return (target > 0) & (div_nonneg(elapsed, jnp.maximum(decoded, 1)) > target)  # elapsed >= 0: the floor


def over_peers(elapsed: jax.Array, decoded: jax.Array, decoding: jax.Array, slack: int) -> jax.Array:
    """bool[B] decoding rows (bool[B]) with a decoded token whose TPOT so far (elapsed int32[B] // decoded int32[B])
    is more than slack / 1024 above the mean TPOT of such rows. Integers throughout, so the plain-Python oracle
    agrees: each TPOT is capped so that B of them sum within int32 (at B = 256, 8.4 s a token), and the margin is
    floor(mean * slack / 1024) computed without a product past int32."""
    b = elapsed.shape[0]
    on = decoding & (decoded > 0)
    tpot = jnp.minimum(div_nonneg(elapsed, jnp.maximum(decoded, 1)), (2**31 - 1) // b)  # elapsed >= 0: the floor
    total, count = sums(jnp.where(on, tpot, 0), on)
    mean = div_nonneg(total, jnp.maximum(count, 1))
    margin = floor_div(mean, 1024) * slack + floor_div(floor_mod(mean, 1024) * slack, 1024)
    return on & (tpot > mean + margin)


def lagging(lag: jax.Array, elapsed: jax.Array) -> jax.Array:
    """bool[B] the rows that lost more than 1 / LAG_SLACK of their decode time to speculation."""
    return lag > floor_div(elapsed, LAG_SLACK)


def goodput_drafts(surv: jax.Array, cap: jax.Array, base_tokens: jax.Array, rows: jax.Array, ctx: jax.Array,
                   sampling: jax.Array, cost: StepCost, query: jax.Array | None = None,
                   wide: jax.Array | None = None, reach_of: tuple[int, ...] | None = None,
                   caps: jax.Array | None = None, priority: jax.Array | None = None,
                   behind: jax.Array | None = None, bound_surv: jax.Array | None = None,
                   guard: int | None = 0) -> jax.Array:
    """int32[B] draft slots per row: the (threshold of `thresholds()`, cap) that maximises the step's expected
    accepted tokens per second. A row drafts to depth r = the number of depths d with surv[b, d] >= the threshold
    among those its slots can reach (d < reach_of[min(cap[b], the cap)]), in the fewest slots reaching r
    (`slots_for`); for a chain (reach_of the identity, the default) r drafts in r slots.

    surv int32[B, K] (per depth of the tree's reach: the chance the accepted path gets past depth d); cap int32[B]
    the row's most draft slots (0 for a row that does not decode); base_tokens int32[] the step's tokens without
    drafts; rows int32[] running rows; ctx int32[] context they read; sampling int32[] rows that emit a token
    this step whatever is drafted. A second axis caps every row's drafts: over 0..K, or with a width table in
    `cost` over caps int32[caps] (sorted; the engine's compiled draft widths, `SchedState.draft_widths`: a cap
    between two of them runs in the wider program anyway); with a table, query int32[B] (each row's tokens
    besides drafts) and wide bool[] (the step has prompt work, so it runs at the widest width whatever is
    drafted) give the step's widest row. The first maximum wins, over thresholds from "none" down and, within
    one, caps in order (ties: fewer drafts). Survival falls with depth, so every choice takes a prefix of a
    row's depths: surv and bound_surv must be non-negative and non-increasing along K, as `survival` of
    estimates in [0, ONE] is (the oracle's controller counts the clearing depths as that prefix too).

    priority bool[B]: rows drafted at least to depth 1 by every choice but "none"; behind bool[B]: rows whose
    expected gain bounds the step's time (a choice is allowed when T * ONE <= T0 * (ONE + the row's expected
    accepted drafts * ONE) for each behind row with cap > 0, T0 the time with no drafts), that gain counted with
    bound_surv int32[B, K] (default surv; the controller passes `optimistic_estimates`' survival); a behind row
    is selected by the larger of its survival and that one. guard: the bound's slack in 1/1024ths (T * ONE *
    1024 <= T0 * (ONE + gain) * (1024 + guard)); None (`Policy.tail_guard` off) keeps the selection and drops
    the bound. Module docstring."""
    b, k = surv.shape
    reach_of = tuple(range(k + 1)) if reach_of is None else tuple(reach_of)
    reach, slots = jnp.asarray(reach_of, i32), jnp.asarray(slots_for(reach_of), i32)
    thr = thresholds()
    if cost.width_us is None or caps is None:  # a cap shared by every row: "one draft each" is a choice too
        caps = jnp.arange(k + 1, dtype=i32)
    reachable = jnp.minimum(jnp.clip(cap, 0, k)[:, None], caps[None, :])  # [B, caps] slots, then the depths they reach
    if reach_of != tuple(range(k + 1)):  # a tree's (a chain's slots reach their own count)
        reachable = reach[reachable]
    bs = surv if bound_surv is None else bound_surv
    key = surv if behind is None else jnp.where(behind[:, None], jnp.maximum(surv, bs), surv)
    # Survival falls with depth, so the depths clearing a threshold are a prefix, counted per (row, threshold); a
    # choice's depth is that count capped by what the slots reach. The per-choice sums over rows are then a
    # reduction over rows per (threshold, depth) and the guard's bound a min of a per-threshold and a per-cap term:
    # no [B, K, LEVELS + 1, caps] tensor (0.12 ms of a 1.1 ms scheduler step at 256 rows on a CPU, measured), and no
    # [B, LEVELS + 1, caps] one unless the step is priced by its widest row (a width table).
    clearing = jnp.sum(key[:, :, None] >= thr[None, None, :], axis=1, dtype=i32)  # [B, LEVELS + 1]
    if priority is not None:  # a priority row's first depth clears every threshold but "none"'s
        clearing = jnp.maximum(clearing, (priority[:, None] & (thr[None, :] <= ONE)).astype(i32))
    step_slots = jnp.broadcast_to(jnp.diff(slots)[None, :], (b, k))  # the slots each next depth adds
    # reach_of is non-decreasing, so a row's reach at a cap is the lesser of its own and the cap's: the sums over
    # rows factor into a [LEVELS + 1, K] reduction and a [K, caps] indicator (no [B, LEVELS + 1, caps] tensor).
    row_reach, cap_reach = jnp.clip(cap, 0, k), jnp.minimum(caps, k)
    if reach_of != tuple(range(k + 1)):  # a tree's (a chain's slots reach their own count: no gather)
        row_reach, cap_reach = reach[row_reach], reach[cap_reach]
    n = _sum_below_min_depth(step_slots, clearing, row_reach, cap_reach)  # [LEVELS + 1, caps] drafts per choice
    gain = _sum_below_min_depth(surv, clearing, row_reach, cap_reach)  # expected accepted * ONE
    widest = widest0 = None
    if cost.width_us is not None:
        q = jnp.zeros((b,), i32) if query is None else query
        per_row = jnp.minimum(clearing[:, :, None], reachable[:, None, :])  # [B, LEVELS + 1, caps] depths
        per_row = per_row if reach_of == tuple(range(k + 1)) else slots[per_row]  # the slots reaching them
        widest = jnp.max(jnp.where((q > 0)[:, None, None], q[:, None, None] + per_row, 0), axis=0)
        widest0 = jnp.max(jnp.where(q > 0, q, 0))
        if wide is not None:
            widest = jnp.where(wide, cost.width_us.shape[0] - 1, widest)
            widest0 = jnp.where(wide, cost.width_us.shape[0] - 1, widest0)
    time = jnp.maximum(step_time_us(cost, base_tokens + n, rows, ctx, n, widest), 1)
    rate = (sampling * ONE + gain).astype(jnp.float32) / time.astype(jnp.float32)
    if behind is not None and guard is not None:  # the step lengthens no more than each behind row hopes to gain
        f32 = jnp.float32
        time0 = jnp.maximum(step_time_us(cost, base_tokens, rows, ctx, jnp.zeros((), i32), widest0), 1)
        bound = behind & (cap > 0)
        # A row's hope at a choice is its sum over depths below min(clearing, reachable), so the least hope of the
        # bound rows is the min of two mins; `pays` grows with hope (float32 rounding is monotone), so it holds for
        # every bound row exactly when it holds for the least hope.
        least = jnp.iinfo(i32).max // 2
        by_thr = jnp.min(jnp.where(bound[:, None], _sum_below(bs, clearing), least), axis=0)  # [LEVELS + 1]
        by_cap = jnp.min(jnp.where(bound[:, None], _sum_below(bs, reachable), least), axis=0)  # [caps]
        least_hope = jnp.minimum(by_thr[:, None], by_cap[None, :])
        pays = (time.astype(f32) * f32(ONE * 1024)
                <= time0.astype(f32) * (ONE + least_hope).astype(f32) * f32(1024 + guard))
        rate = jnp.where(pays | ~jnp.any(bound), rate, -1.0)
    best_t, best_c = jnp.divmod(jnp.argmax(rate.reshape(-1)).astype(i32), rate.shape[1])
    depth = jnp.minimum(clearing[:, best_t], reachable[:, best_c])
    return depth if reach_of == tuple(range(k + 1)) else slots[depth]  # a chain drafts one slot a depth


def _sum_below(values: jax.Array, depth: jax.Array) -> jax.Array:
    """int32[B, X]: the sum of values[b, d] (int32[B, K]) over the depths d < depth[b, x] (int32[B, X])."""
    d = jnp.arange(values.shape[1], dtype=i32)
    return jnp.sum(jnp.where(d[None, None, :] < depth[:, :, None], values[:, None, :], 0), axis=2, dtype=i32)


def _sum_below_min_depth(values: jax.Array, clearing: jax.Array, row_reach: jax.Array, cap_reach: jax.Array
                         ) -> jax.Array:
    """int32[LEVELS + 1, caps]: the sum over rows b and depths d < min(clearing[b, t], row_reach[b], cap_reach[c])
    of values[b, d] (int32[B, K], each in [0, ONE]; clearing int32[B, LEVELS + 1], row_reach int32[B], cap_reach
    int32[caps]). Summed in int32 over rows per (threshold, depth), then over depths per cap: exact, and the same
    whatever the order, so the plain-Python oracle's sums agree bit for bit."""
    b, k = values.shape
    if b * k * ONE >= 2**31:
        raise ValueError(f"the goodput controller sums over fewer than 2^19 (row, depth) pairs, got {b} x {k}")
    d = jnp.arange(k, dtype=i32)
    own = jnp.where(d[None, :] < row_reach[:, None], values, 0)  # [B, K]
    by_depth = jnp.sum(jnp.where(d[None, None, :] < clearing[:, :, None], own[:, None, :], 0), axis=0,
                       dtype=i32)  # [LEVELS + 1, K]
    return jnp.sum(jnp.where(d[None, None, :] < cap_reach[None, :, None], by_depth[:, None, :], 0), axis=2,
                   dtype=i32)


def record_drafts(draft_tried: jax.Array, draft_passed: jax.Array, pop_tried: jax.Array, pop_passed: jax.Array,
                  verified: jax.Array, offered: jax.Array, accepted: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The counts after one step: a verified row (bool[B]) whose drafts reached depth `offered` (int32[B]; a
    chain's draft count, a tree's `reach_of` of its slots) and accepted `accepted` (int32[B]) tried depths
    d < min(accepted + 1, offered) and passed d < accepted. Population totals at a depth halve (both, rounding
    down) once its tried count reaches POP_HALVE_AT."""
    d = jnp.arange(draft_tried.shape[1], dtype=i32)[None, :]
    tried = verified[:, None] & (d < jnp.minimum(accepted + 1, offered)[:, None])
    passed = verified[:, None] & (d < accepted[:, None])
    pop = jnp.sum(jnp.stack([tried, passed]), axis=1, dtype=i32)  # [2, K]: one reduction for both
    pop_t, pop_p = pop_tried + pop[0], pop_passed + pop[1]
    halve = pop_t >= POP_HALVE_AT
    return (draft_tried + tried.astype(i32), draft_passed + passed.astype(i32),
            jnp.where(halve, floor_div(pop_t, 2), pop_t), jnp.where(halve, floor_div(pop_p, 2), pop_p))


def priced_step(cost: StepCost, tokens: jax.Array, rows: jax.Array, ctx: jax.Array, drafts: jax.Array,
                widest: jax.Array, widest0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(T, T0) int32[]: `step_time_us` of a step computing `tokens` of which `drafts` draft slots, and of the
    same step without its drafts (widest / widest0: its widest row with and without them; see `step_time_us`)."""
    time = step_time_us(cost, tokens, rows, ctx, drafts, widest if cost.width_us is not None else None)
    time0 = step_time_us(cost, tokens - drafts, rows, ctx, jnp.zeros((), i32),
                         widest0 if cost.width_us is not None else None)
    return jnp.maximum(time, 1), jnp.maximum(time0, 1)


def record_lag(lag: jax.Array, elapsed: jax.Array, undrafted: jax.Array, decoded: jax.Array, drafts: jax.Array,
               accepted: jax.Array, priced: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(lag, elapsed, undrafted) int32[B] after a step that priced[0] microseconds (priced[1] without its drafts;
    `priced_step`): each decoded row (bool[B]: sampled a token after its first) adds T - T0 * (1 + accepted) to
    its lag and T to its elapsed time (both saturating at LAG_CAP); its undrafted streak restarts at a draft
    (drafts int32[B] > 0) and grows by one in a step where other rows drafted or it was `lagging` (as the step
    was scheduled: a behind row that holds the batch's drafts back is probed after PROBE_AFTER such steps)."""
    t, t0 = priced[0], priced[1]
    waits = decoded & (jnp.any(drafts > 0) | lagging(lag, elapsed))  # its streak grows: others drafted, or behind
    undrafted = jnp.where(decoded & (drafts > 0), 0, jnp.where(waits, undrafted + 1, undrafted))
    lag = jnp.where(decoded, jnp.clip(lag + t - t0 * (1 + accepted), -LAG_CAP, LAG_CAP), lag)
    elapsed = jnp.where(decoded, jnp.minimum(elapsed + t, LAG_CAP), elapsed)
    return lag, elapsed, undrafted


# ------------------------------------------------------------------------------- memory: pricing draft blocks


def row_gain(surv: jax.Array, drafts: jax.Array, reach_of: tuple[int, ...] | None = None) -> jax.Array:
    """int32[B] expected accepted drafts * ONE of a row drafting drafts[b] (int32[B]) slots: the sum of surv[b, d]
    over the depths d < reach_of[drafts[b]] they reach (default a chain: d < drafts[b])."""
    d = jnp.arange(surv.shape[1], dtype=i32)[None, :]
    if reach_of is None or tuple(reach_of) == tuple(range(len(reach_of))):  # a chain: d slots reach depth d
        reach = drafts
    else:
        reach = jnp.asarray(reach_of, i32)[jnp.clip(drafts, 0, len(reach_of) - 1)]
    return jnp.sum(jnp.where(d < reach[:, None], surv, 0), axis=1, dtype=i32)


def recompute_us(cost: StepCost, tokens: jax.Array) -> jax.Array:
    """int32[] the time `tokens` recomputed tokens add to the steps that absorb them: tokens times the mean time per
    token of a full step, (token_us[T] - token_us[0]) / T (with a roofline's terms, compute_us's too), plus, with
    a width table, one widest program's premium width_us[max_width] - width_us[0] for every max_width tokens
    begun: a padded engine recomputes a prompt in its widest program, max_width tokens of a row a step, and runs a step
    with no prompt tokens narrow (`serve.engine_step.model_step_at`), so the recompute's steps are wide only because of
    it (an upper bound: another row's prompt work may share them). Zero under `flat_step_cost`: on a device where a step
    costs the same whatever it carries, a recompute that fits in other steps' slack is free."""
    t = cost.token_us.shape[0] - 1
    per_token_ns = (cost.token_us[t] - cost.token_us[0]) * 1000 // max(t, 1)
    if cost.compute_us is not None:  # a roofline: a recomputed token costs its compute (an upper bound)
        per_token_ns = per_token_ns + (cost.compute_us[t] - cost.compute_us[0]) * 1000 // max(t, 1)
    time = tokens * per_token_ns // 1000
    if cost.width_us is not None:
        w = cost.width_us.shape[0] - 1
        time = time + cdiv(tokens, max(w, 1)) * (cost.width_us[w] - cost.width_us[0])
    return time.astype(i32)


def preemption_pays(tokens_keep: jax.Array, time_keep: jax.Array, tokens_preempt: jax.Array,
                    time_preempt: jax.Array, recompute: jax.Array, margin: jax.Array | None = None) -> jax.Array:
    """bool[] drafts should preempt: the step's expected output tokens * ONE per microsecond when the drafts take
    the victims' blocks (tokens_preempt, which has lost the victims' output; time_preempt plus the victims'
    `recompute_us`) beats the step without those victims (tokens_keep, time_keep) by more than margin / 1024 of
    it (`StepCost.margin`; None: 0). All int32[]; compared as float32 cross products (one rounding per side, the
    margin's factor exact), so the plain-Python oracle agrees bit for bit."""
    f = jnp.float32
    lhs = tokens_preempt.astype(f) * jnp.maximum(time_keep, 1).astype(f)
    rhs = tokens_keep.astype(f) * (jnp.maximum(time_preempt, 1) + recompute).astype(f)
    margin = jnp.zeros((), i32) if margin is None else margin  # x 1024 on both sides is exact: 0 is no margin
    return lhs * f(1024) > rhs * (1024 + margin).astype(f)
