"""`schedule`: decide one step's batch and make every allocation for it, as a list of named phases.

    drop_finished → plan_drafts (→ goodput_plan) → budget_tokens → preempt (→ price_draft_preemption)
    → grant_opportunistic_drafts → count_draft_blocks → swap_in → admit → evict_and_allocate → make_batch
    → price_step

Each phase is a pure function of the state and what the phases before it decided; jit traces through them into
one program. Rows are served in priority order (`priority_order`); every prefix sum over rows is taken in that
order. The phases' contracts are in their docstrings; the step as a whole is described in docs/design.md and
docs/scheduler.md.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from skvs_jax import vmap_flow
from skvs_jax.arrays import (
    before,
    cdiv,
    count_leading,
    first_trues,
    floor_div,
    floor_mod,
    i32,
    prefix_sum,
    rank_of,
    running_sum,
    sums,
    take_each,
)
from skvs_jax.config import NULL_BLOCK
from skvs_jax.kv import manager
from skvs_jax.policies import Knobs, Policy
from skvs_jax.scheduler import buckets, draft_control
from skvs_jax.scheduler.state import (
    EMPTY,
    FINISHED,
    RANK_BY_COUNTING,
    RUNNING,
    SWAPPED,
    WAITING,
    Batch,
    SchedState,
    SchedulerConfig,
    SeqTable,
    StepCost,
    flat_step_cost,
)

# ------------------------------------------------------------------------------------------ ordering and drafts

def priority_order(seqs: SeqTable) -> jax.Array:
    """Slots by (priority, arrival, slot): int32[B], order[r] = slot served r-th.

    Up to 512 slots a slot's rank is the number of slots ahead of it ([B, B] compares, one fused op): XLA:CPU
    sorts through a compiled comparator, and a three-key sort cost ~2.3x the count at B = 256 (measured, 1000
    calls in a loop). The order is total (the slot breaks ties), so the ranks are a permutation."""
    b = seqs.priority.shape[0]
    if b > RANK_BY_COUNTING:
        b_idx = jnp.arange(b, dtype=i32)
        return jnp.lexsort((b_idx, seqs.arrival, seqs.priority)).astype(i32)
    return jnp.zeros((b,), i32).at[_counted_rank(seqs)].set(jnp.arange(b, dtype=i32), unique_indices=True)


def _counted_rank(seqs: SeqTable) -> jax.Array:
    """int32[B] each slot's rank by (priority, arrival, slot): the slots ahead of it, by [B, B] compares."""
    p, a = seqs.priority, seqs.arrival
    b_idx = jnp.arange(p.shape[0], dtype=i32)
    return _rank_by_keys((p, a, b_idx))


def _rank_by_keys(keys: tuple[jax.Array, ...]) -> jax.Array:
    """int32[B]: how many rows come before each by the keys int32[B] each, compared lexicographically (the last
    key must break every tie: then the ranks are a permutation). [B, B] compares and one sum, no sort."""
    ahead = jnp.zeros((keys[0].shape[0],) * 2, bool)
    for k in reversed(keys):  # ahead[i, j]: row i comes before row j
        ahead = (k[:, None] < k[None, :]) | ((k[:, None] == k[None, :]) & ahead)
    return jnp.sum(ahead, axis=0, dtype=i32)


def step_order(seqs: SeqTable, cfg: SchedulerConfig) -> Order:
    """The step's priority order (`priority_order`) as the phases use it: with dense prefix sums
    (`SchedulerConfig.dense`) its rank and `arrays.before` matrix alone (no order array, no scatter); else the
    order and its rank."""
    if cfg.dense:
        rank = _counted_rank(seqs)
        return Order(order=None, rank=rank, ahead=before(rank))
    order = priority_order(seqs)
    return Order(order=order, rank=rank_of(order))


def in_order(x: jax.Array, order: jax.Array | None, rank: jax.Array, ahead: jax.Array | None = None) -> jax.Array:
    """Inclusive prefix sum of x[B] taken in `order` (rank = its inverse), returned per slot; ahead bool[B, B]
    (`arrays.before(rank)`): the same sum, dense (`arrays.prefix_sum`; order is then not read)."""
    return prefix_sum(x, order, rank, ahead)


def draft_lengths(seqs: SeqTable, knobs: Knobs, policy: Policy, widths: jax.Array | None = None,
                  reach_of: tuple[int, ...] | None = None) -> jax.Array:
    """int32[B] drafts each sequence would propose (before memory and room limits).

    Fixed: knobs.draft_len. Adaptive: the smallest draft bucket whose reach (reach_of[bucket],
    `SchedulerConfig.reach_of`; for a chain the bucket itself) is >= round(1.5 * mean accepted count) of the request's
    histogram, which holds one prior observation of full acceptance (so a new request starts at the largest bucket).
    Drafting half again the expected accepted length keeps the chance of extra tokens without paying for K - a rejected
    slots every step; a request whose drafts keep failing drops to 0 (no speculation). The buckets are the
    policy's `draft_buckets`, or, given widths int32[widths] (`SchedState.draft_widths`, data),
    those widths, each reaching reach_of[w] (`SchedulerConfig.reach_of`, per count 0..K; default a chain).
    Goodput control (`policy.draft_control`): knobs.draft_len, the cap below which `plan_drafts` decides.
    """
    k_max = jnp.clip(knobs.draft_len, 0, policy.draft_len).astype(i32)
    if not policy.speculation:
        return jnp.zeros(seqs.num_tokens.shape, i32)
    if not policy.adaptive_draft_len or policy.goodput_control:
        return jnp.broadcast_to(k_max, seqs.num_tokens.shape)
    k = policy.draft_len
    reach_of = reach_of or tuple(range(k + 1))
    if widths is None:
        reach = tuple(reach_of[b] for b in policy.draft_buckets or (k,))
        widths, reach_arr, top = jnp.asarray(policy.draft_buckets or (k,), i32), jnp.asarray(reach, i32), reach[-1]
    else:
        reach_arr, top = jnp.asarray(reach_of, i32)[widths], reach_of[k]
    hist = seqs.accept_hist.at[:, top].add(1).astype(jnp.float32)  # the prior: everything reachable accepted
    mean = jnp.sum(hist * jnp.arange(k + 1, dtype=jnp.float32)[None, :], axis=1) / jnp.sum(hist, axis=1)
    target = jnp.floor(mean * 1.5 + 0.5).astype(i32)
    return jnp.minimum(buckets.snap_up(jnp.minimum(target, top), widths, reach_arr), k_max)


def decoding_rows(status: jax.Array, num_tokens: jax.Array, num_committed: jax.Array,
                  prompt_len: jax.Array) -> jax.Array:
    """bool[B] the rows that decode, and so may draft, this step: running, with one token left to compute, and
    that token one the model sampled (num_tokens > prompt_len). Drafts are proposed from the model's output for
    the token before it, which exists only once the row has sampled: a row whose last *prompt* token is left (a
    prefill chunk ended just before it) computes that token without drafts, or they would come from a hidden
    state no step produced for it (the engine's slot holds the previous request's)."""
    return (status == RUNNING) & (num_tokens - num_committed == 1) & (num_tokens > prompt_len)


def verify_cap(decoding: jax.Array, knobs: Knobs) -> jax.Array:
    """int32[] most drafts a decode row may get under compute-aware drafting (`knobs.verify_budget`).

    decoding bool[B]: the rows that decode this step (`decoding_rows`). R such rows verify
    R * (1 + drafts) tokens; past the budget every row's drafts shrink evenly, to none once the rows alone fill
    it. Depends only on the step's decode rows, which are known before the step (the engine bounds its next
    query width with it).
    """
    rows = jnp.maximum(jnp.sum(decoding, dtype=i32), 1)
    return jnp.maximum(knobs.verify_budget // rows - 1, 0).astype(i32)


# ------------------------------------------------------------------------------ what the phases hand on


class Order(NamedTuple):
    """An order of the rows (the step's priority order, or preemption's victim order): order int32[B] (order[r] =
    slot served r-th; None with dense prefix sums), its inverse rank int32[B], and ahead bool[B, B]
    (`arrays.before(rank)`) with dense prefix sums, else None. `in_order(x, *order)` sums in it."""

    order: jax.Array | None
    rank: jax.Array
    ahead: jax.Array | None = None


class DraftPlan(NamedTuple):
    """decode int32[B]: drafts wanted by decode rows; reserved int32[B]: draft slots wanted by prefilling rows
    (spec_in_prefill); reserve int32[]: the reservation a newly admitted row asks for; k_max int32[]: the draft
    length knob clamped to [0, K]; spec_ratio float32[]: the max_spec_ratio knob clamped to [0, 1]; surv
    int32[B, K]: each row's survival per draft depth (`draft_control.survival`; zeros unless the goodput controller
    or priced draft blocks read it)."""

    decode: jax.Array
    reserved: jax.Array
    reserve: jax.Array
    k_max: jax.Array
    spec_ratio: jax.Array
    surv: jax.Array


class Grant(NamedTuple):
    """Per running row: query int32[B] tokens to compute, drafts int32[B] draft slots (decode drafts or prefill
    reservations), need_query / need_drafts int32[B] new blocks for them (a copy-on-write counts with the query),
    cow bool[B] the row's first token lands in a shared partial block."""

    query: jax.Array
    drafts: jax.Array
    need_query: jax.Array
    need_drafts: jax.Array
    cow: jax.Array


class Preemption(NamedTuple):
    """victim bool[B] preempted rows, of which swap bool[B] go to the host tier (the others are recomputed);
    swap_out_blocks int32[B, M] the swapped rows' committed blocks (NULL_BLOCK-padded); oom bool[] some row could
    not get its blocks without preempting; drafts_paid bool[]: under priced draft blocks, the drafts preempted
    (they keep every slot); else False. num_evictable int32[]: the idle cached blocks before the release (with no
    victim, the release leaves them as they are: `room_after`)."""

    victim: jax.Array
    swap: jax.Array
    swap_out_blocks: jax.Array
    oom: jax.Array
    drafts_paid: jax.Array
    num_evictable: jax.Array


class Room(NamedTuple):
    """What is left for the phases after preemption: free int32[] blocks allocation can take without evicting,
    avail int32[] that plus evictable cached blocks, need int32[] blocks granted so far, running int32[] rows in
    the batch so far."""

    free: jax.Array
    avail: jax.Array
    need: jax.Array
    running: jax.Array


class SwapIn(NamedTuple):
    """rows bool[B] SWAPPED rows restored this step; tokens int32[B] their committed tokens (0 elsewhere)."""

    rows: jax.Array
    tokens: jax.Array


class Admission(NamedTuple):
    """rows bool[B] admitted this step; hit_tokens int32[B] prompt tokens they share from the prefix cache."""

    rows: jax.Array
    hit_tokens: jax.Array


# -------------------------------------------------------------------------------------------------- phases


def _emptied(seqs: SeqTable, done: jax.Array) -> SeqTable:
    return seqs.replace(status=jnp.where(done, EMPTY, seqs.status).astype(jnp.int8),
                        request_id=jnp.where(done, -1, seqs.request_id))


def release_finished(st: SchedState, cfg: SchedulerConfig) -> SchedState:
    """FINISHED slots give back their blocks and become EMPTY: `drop_finished` and the routing of its blocks in
    one, for a caller outside `schedule` (an engine going idle)."""
    done = st.seqs.status == FINISHED
    return st.replace(kv=manager.release(st.kv, done, cfg.kv), seqs=_emptied(st.seqs, done))


def drop_finished(st: SchedState, cfg: SchedulerConfig) -> tuple[SchedState, manager.allocator.Unreffed]:
    """0. FINISHED slots drop their blocks (`manager.unref`) and become EMPTY. The blocks they released are routed
    with the victims' by `preempt`'s release (one set of routing kernels a step, not two); until then the free
    count misses the returned `Unreffed.blocks`, which `available_blocks` adds."""
    done = st.seqs.status == FINISHED
    kv, finished = manager.unref(st.kv, done, cfg.kv)
    return st.replace(kv=kv, seqs=_emptied(st.seqs, done)), finished


def plan_drafts(st: SchedState, knobs: Knobs, cfg: SchedulerConfig, step_cost: StepCost | None = None) -> DraftPlan:
    """1. Draft lengths: decode rows draft up to `draft_lengths`, bounded by the output room (the bonus token
    comes on top), the table and the verify budget; under goodput control (`draft_control`) the controller then
    picks, below those caps, the drafts that maximise the step's expected accepted tokens per second
    (`goodput_plan`); with `spec_in_prefill`, rows with prompt left reserve K."""
    pol, seqs = cfg.policy, st.seqs
    num_tokens, committed = seqs.num_tokens, st.kv.alloc.seqs.num_committed
    running = seqs.status == RUNNING
    remaining = jnp.where(running, num_tokens - committed, 0)
    chunk = jnp.minimum(remaining, cfg.chunk)
    k_max = jnp.clip(knobs.draft_len, 0, pol.draft_len).astype(i32)
    # Knobs are data (a vmapped sweep checks none of them at the boundary): a ratio outside [0, 1], or NaN, would
    # let drafts claim blocks the allocator then refuses, so it is clamped here (NaN -> 0, no opportunistic drafts).
    spec_ratio = jnp.where(knobs.max_spec_ratio >= 0, jnp.minimum(knobs.max_spec_ratio, 1), 0).astype(jnp.float32)
    out_room = seqs.max_new_tokens - (num_tokens - seqs.prompt_len) - 1
    want = draft_lengths(seqs, knobs, pol, widths=st.draft_widths, reach_of=cfg.reach_of)
    decode = jnp.clip(jnp.minimum(want, out_room), 0, cfg.max_len - num_tokens)
    decoding = decoding_rows(seqs.status, num_tokens, committed, seqs.prompt_len)
    decode = jnp.minimum(jnp.where(decoding, decode, 0), verify_cap(decoding, knobs))
    if pol.goodput_control or pol.priced_drafts:
        alpha = draft_control.acceptance_estimates(seqs.draft_tried, seqs.draft_passed, st.pop_tried, st.pop_passed)
        surv = draft_control.survival(alpha)
    else:
        surv = jnp.zeros(seqs.draft_tried.shape, i32)
    if pol.goodput_control:
        decode = goodput_plan(st, surv, decode, chunk, decoding, cfg, step_cost)
    reserve = k_max if (pol.speculation and pol.spec_in_prefill) else jnp.zeros((), i32)
    reserved = jnp.where(running & (remaining > 1), jnp.clip(reserve, 0, cfg.max_len - committed - chunk), 0)
    return DraftPlan(decode=decode, reserved=reserved, reserve=reserve, k_max=k_max, spec_ratio=spec_ratio,
                     surv=surv)


def goodput_plan(st: SchedState, surv: jax.Array, cap: jax.Array, chunk: jax.Array, decoding: jax.Array,
                 cfg: SchedulerConfig, step_cost: StepCost | None) -> jax.Array:
    """int32[B] the goodput controller's drafts (`draft_control.goodput_drafts`) over survivals surv int32[B, K]
    below cap int32[B], for a step whose other work is the running rows' chunks int32[B] (admissions come later and
    are not counted): its base tokens (within the token budget), rows, context read and the rows that sample
    whatever is drafted. Of the decoding rows bool[B], those due a probe or behind (`draft_control.priority_rows`:
    lagging, over their TPOT target, or under `Policy.tail_peers` slower per token than their peers) are drafted
    first, and under `Policy.tail_guard` the behind ones bound the step's time."""
    seqs, committed = st.seqs, st.kv.alloc.seqs.num_committed
    running = seqs.status == RUNNING
    base, rows, ctx, sampling = sums(chunk, running, jnp.where(running, committed, 0),
                                     running & (chunk > 0) & (committed + chunk == seqs.num_tokens))
    base = jnp.minimum(base, cfg.token_budget)
    cost = flat_step_cost(cfg) if step_cost is None else step_cost
    bound_surv = draft_control.survival(draft_control.optimistic_estimates(seqs.draft_tried, seqs.draft_passed,
                                                                           st.pop_tried, st.pop_passed))
    # Tokens from decode steps: every output but the first, which the prompt's last step gave.
    decoded = seqs.num_tokens - seqs.prompt_len - 1
    over = draft_control.over_target(seqs.tpot_target, seqs.elapsed, decoded) if cfg.policy.tpot_targets else None
    if cfg.policy.tail_peers is not None:  # slower per token than the decoding peers
        peers = draft_control.over_peers(seqs.elapsed, decoded, decoding, cfg.policy.tail_peers)
        over = peers if over is None else over | peers
    behind, probe = draft_control.priority_rows(seqs.lag, seqs.elapsed, seqs.undrafted, decoding, surv,
                                                draft_control.population_survival(st.pop_tried, st.pop_passed),
                                                over)
    return draft_control.goodput_drafts(surv, cap, base, rows, ctx, sampling, cost,
                                        query=jnp.where(running, chunk, 0), wide=prompt_work(st),
                                        reach_of=cfg.reach_of, caps=st.draft_widths, priority=probe | behind,
                                        behind=behind, bound_surv=bound_surv, guard=cfg.policy.tail_guard)


def prompt_work(st: SchedState) -> jax.Array:
    """bool[] some row is waiting or has more than its last token to compute: an engine runs the step (or the
    next, after `update`) at its wide width."""
    status = st.seqs.status
    remaining = st.seqs.num_tokens - st.kv.alloc.seqs.num_committed
    return jnp.any((status == WAITING) | ((status == RUNNING) & (remaining > 1)))


def budget_tokens(st: SchedState, plan: DraftPlan, order: Order, cfg: SchedulerConfig) -> Grant:
    """2. Token budget in priority order: each running row gets min(remaining, prefill_chunk) tokens, then its
    draft slots, by one prefix sum over `token_budget` (chunked prefill falls out of this); and the blocks each
    row needs for its tokens (+ a copy-on-write of a shared partial block), then for its draft slots."""
    s, m, b = cfg.cache.block_size, cfg.cache.max_blocks_per_seq, cfg.cache.max_seqs
    alloc = st.kv.alloc
    committed, held, table = alloc.seqs.num_committed, alloc.seqs.num_blocks, alloc.seqs.block_table
    running = st.seqs.status == RUNNING
    chunk = jnp.minimum(jnp.where(running, st.seqs.num_tokens - committed, 0), cfg.chunk)
    want = plan.decode + plan.reserved
    tokens_before = in_order(chunk + want, *order) - (chunk + want)
    tokens_left = cfg.token_budget - tokens_before
    query = jnp.clip(tokens_left, 0, chunk)
    drafts = jnp.where((query == chunk) & (query > 0), jnp.clip(tokens_left - query, 0, want), 0)

    partial = table[jnp.arange(b, dtype=i32), jnp.clip(floor_div(committed, s), 0, m - 1)]
    cow = running & (query > 0) & (floor_mod(committed, s) != 0) & (alloc.blocks.ref_count[partial] > 1)
    need_query = jnp.where(query > 0, jnp.maximum(cdiv(committed + query, s) - held, 0) + cow.astype(i32), 0)
    need_all = jnp.where(query > 0, jnp.maximum(cdiv(committed + query + drafts, s) - held, 0) + cow.astype(i32), 0)
    return Grant(query=query, drafts=drafts, need_query=need_query, need_drafts=need_all - need_query, cow=cow)


def preemption_yield(st: SchedState, cfg: SchedulerConfig) -> tuple[jax.Array, jax.Array]:
    """(freed int32[B]: the blocks each row would give back if preempted now, those of its table it alone holds;
    recompute int32[B]: the tokens it would compute again, its committed tokens less those in blocks of its table
    the prefix index holds: its re-admission finds them, unless evicted first, a lower bound on what is lost where
    the committed count is the upper one). One gather of the table's blocks for both."""
    alloc, m, s = st.kv.alloc, cfg.cache.max_blocks_per_seq, cfg.cache.block_size
    in_table = jnp.arange(m, dtype=i32)[None, :] < alloc.seqs.num_blocks[:, None]
    refs, cached = take_each((alloc.blocks.ref_count, alloc.blocks.cached), alloc.seqs.block_table)  # [B, M] each
    freed = jnp.sum(in_table & (refs == 1), axis=1, dtype=i32)
    indexed = jnp.sum(in_table & cached, axis=1, dtype=i32)
    return freed, jnp.maximum(alloc.seqs.num_committed - indexed * s, 0)


def recompute_tokens(st: SchedState, cfg: SchedulerConfig) -> jax.Array:
    """int32[B] `preemption_yield`'s recompute alone."""
    return preemption_yield(st, cfg)[1]


def available_blocks(st: SchedState, cfg: SchedulerConfig, pending: jax.Array | int = 0,
                     num_evictable: jax.Array | None = None) -> jax.Array:
    """int32[] the blocks a row's allocation can take now without preempting anyone: free (the speculative pool
    among them, `manager.free_blocks`, and pending int32[] released blocks not routed yet, `drop_finished`) plus
    idle cached blocks that can be evicted (num_evictable int32[], when the caller has counted them: a pass
    over [N])."""
    if num_evictable is None:
        num_evictable = jnp.sum(manager.evictable(st.kv), dtype=i32)
    return manager.free_blocks(st.kv, cfg.kv) + pending + num_evictable


def choose_victims(st: SchedState, need: jax.Array, rank: jax.Array, avail: jax.Array, cfg: SchedulerConfig,
                   freed: jax.Array | None = None) -> tuple[jax.Array, Order, jax.Array]:
    """The fewest running rows, in victim-rule order, whose release makes need int32[B] blocks fit in the free,
    speculative-pool and evictable blocks. Returns (victim bool[B]; the rows in the rule's order, the victims
    first, as an `Order`; oom bool[], some row could not get its blocks without preemption). Most steps fit
    without preempting anyone: the victim order (a sort, or with dense prefix sums a count) is skipped then
    (unless `SchedulerConfig.skip` is off: then it is computed and selected). avail: `available_blocks`.
    freed: `preemption_yield`'s, when the caller has it (else computed here, only when needed)."""
    b = cfg.cache.max_seqs
    alloc, running = st.kv.alloc, st.seqs.status == RUNNING
    committed, held = alloc.seqs.num_committed, alloc.seqs.num_blocks
    total = jnp.sum(need, dtype=i32)
    b_idx = jnp.arange(b, dtype=i32)

    def victims(_):
        given = preemption_yield(st, cfg)[0] if freed is None else freed
        key = cfg.victim_rule(rank, committed, held).astype(i32)
        if cfg.dense:  # the same order by counting: running first, by key, then lower priority
            victim_rank = _rank_by_keys(((~running).astype(i32), key, -rank))
            order = Order(order=None, rank=victim_rank, ahead=before(victim_rank))
            # Preempting the first j victims suffices where j - 1 is a fitting victim's rank: the smallest such j.
            fits = total - in_order(need, *order) <= avail + in_order(given, *order)
            first = jnp.min(jnp.where(fits, victim_rank + 1, b + 1))
            return jnp.where((total > avail) & (first <= b), first, 0).astype(i32), order
        victim_order = jnp.lexsort((-rank, key, ~running)).astype(i32)  # running first, by key, then lower priority
        fits = total - jnp.cumsum(need[victim_order], dtype=i32) <= avail + jnp.cumsum(given[victim_order], dtype=i32)
        fits = jnp.concatenate([(total <= avail)[None], fits])  # fits[j]: preempting the first j victims suffices
        return jnp.argmax(fits).astype(i32), Order(order=victim_order, rank=rank_of(victim_order))

    def none(_):
        return jnp.zeros((), i32), Order(order=None if cfg.dense else b_idx, rank=b_idx,
                                         ahead=before(b_idx) if cfg.dense else None)

    num_victims, victim_order = vmap_flow.cond(total <= avail, none, victims, None, skip=cfg.skip)
    return running & (victim_order.rank < num_victims), victim_order, num_victims > 0


def price_draft_preemption(st: SchedState, grant: Grant, plan: DraftPlan, order: Order, keep_victims: jax.Array,
                           all_victims: jax.Array, cost: StepCost, cfg: SchedulerConfig,
                           avail: jax.Array, yields: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """3'. Priced draft blocks: bool[], the drafts should preempt the rows all_victims has beyond keep_victims
    (bool[B] each: the victims the query tokens alone need, and those every draft slot too needs).

    Not preempting for them, the kept rows' drafts take blocks in priority order while they fit in what is
    available once keep_victims are gone (free, speculative pool, evictable, and the victims' blocks); preempting,
    every kept row keeps its drafts, the extra victims' output this step is lost, and their committed tokens'
    recompute (`draft_control.recompute_us`) is added to the step's time. Each side's expected output tokens
    (sampling rows * ONE + the survivals of its drafts, `draft_control.row_gain`) and time (`step_time_us`) go to
    `draft_control.preemption_pays`. avail: `available_blocks`. yields: `preemption_yield`'s (else computed)."""
    freed, recompute_all = preemption_yield(st, cfg) if yields is None else yields
    seqs, committed = st.seqs, st.kv.alloc.seqs.num_committed
    running = seqs.status == RUNNING
    kept1, kept2 = running & ~keep_victims, running & ~all_victims
    avail1 = avail + jnp.sum(jnp.where(keep_victims, freed, 0), dtype=i32)
    room1 = avail1 - jnp.sum(jnp.where(kept1, grant.need_query, 0), dtype=i32)
    fit1 = (grant.need_drafts == 0) | (in_order(jnp.where(kept1, grant.need_drafts, 0), *order) <= room1)
    samples = (grant.query > 0) & (committed + grant.query == seqs.num_tokens)

    wide = prompt_work(st)

    def side(kept, drafts):
        decode_drafts = jnp.where(plan.decode > 0, drafts, 0)
        sampled, gain, step_tokens, rows, ctx, step_drafts = sums(
            kept & samples, draft_control.row_gain(plan.surv, decode_drafts, cfg.reach_of),
            jnp.where(kept, grant.query + drafts, 0), kept, jnp.where(kept, committed, 0), decode_drafts)
        tokens = draft_control.ONE * sampled + gain
        widest = jnp.max(jnp.where(kept & (grant.query > 0), grant.query + drafts, 0))
        time = draft_control.step_time_us(
            cost, step_tokens, rows, ctx, step_drafts,
            None if cost.width_us is None else jnp.where(wide, cost.width_us.shape[0] - 1, widest))
        return tokens, time

    tokens1, time1 = side(kept1, jnp.where(kept1 & fit1, grant.drafts, 0))
    tokens2, time2 = side(kept2, jnp.where(kept2, grant.drafts, 0))
    extra = all_victims & ~keep_victims
    recompute = draft_control.recompute_us(cost, jnp.sum(jnp.where(extra, recompute_all, 0), dtype=i32))
    return jnp.any(extra) & draft_control.preemption_pays(tokens1, time1, tokens2, time2, recompute, cost.margin)


def preempt(st: SchedState, grant: Grant, plan: DraftPlan, order: Order, cfg: SchedulerConfig,
            step_cost: StepCost | None = None, finished: manager.allocator.Unreffed | None = None
            ) -> tuple[SchedState, Grant, Preemption]:
    """3. Preemption: the blocks the running rows need (their drafts too when `drafts_preempt`, or when priced
    draft blocks pay for it: `price_draft_preemption`) must fit in free + speculative-pool + evictable blocks; if
    they do not, the fewest victims in victim-rule order go. A victim is swapped (status SWAPPED, its committed
    blocks to be copied to the host tier) when the policy says swap and the tier has room, in victim order;
    otherwise recomputed (blocks released, back to WAITING with its tokens). The victims' grants are withdrawn.
    finished: `drop_finished`'s blocks, counted as free here and routed with the victims' (first)."""
    s, m, b = cfg.cache.block_size, cfg.cache.max_blocks_per_seq, cfg.cache.max_seqs
    pol, seqs, rank = cfg.policy, st.seqs, order.rank
    committed, table = st.kv.alloc.seqs.num_committed, st.kv.alloc.seqs.block_table
    need = grant.need_query + grant.need_drafts if pol.drafts_preempt else grant.need_query
    pending = 0 if finished is None else finished.blocks
    # Selecting (no skips: a GPU's program), every pass below runs each step: read the rows' yield once for them all.
    yields = None if cfg.skip else preemption_yield(st, cfg)
    num_evictable = jnp.sum(manager.evictable(st.kv), dtype=i32)  # before the release (`room_after` reuses it)
    avail = available_blocks(st, cfg, pending, num_evictable)
    victim, victim_order, oom = choose_victims(st, need, rank, avail, cfg, None if yields is None else yields[0])
    drafts_paid = jnp.zeros((), bool)
    if pol.drafts_preempt:  # attribution: the step would not be short without its drafts' blocks
        by_drafts = oom & (jnp.sum(grant.need_query, dtype=i32) <= avail)
        drafts_victims = jnp.where(by_drafts, jnp.sum(victim, dtype=i32), 0)
    elif pol.priced_drafts:  # the drafts' own victims, taken only when that pays
        cost = flat_step_cost(cfg) if step_cost is None else step_cost

        def priced(_):
            ys = preemption_yield(st, cfg) if yields is None else yields
            all_v, all_o, all_oom = choose_victims(st, grant.need_query + grant.need_drafts, rank, avail, cfg, ys[0])
            return all_v, all_o, all_oom, price_draft_preemption(st, grant, plan, order, victim, all_v, cost, cfg,
                                                                 avail, ys)

        # Most steps' drafts fit without anyone preempted: then no draft victim exists and pricing is moot. Skipped
        # then: 27 of the 1,048 top-level ops of the shipped model's fused engine step, where on a CPU a step's
        # time is mostly per-op overhead.
        fits = jnp.sum(grant.need_query + grant.need_drafts, dtype=i32) <= avail
        all_victims, all_order, all_oom, drafts_paid = vmap_flow.cond(
            fits, lambda _: (victim, victim_order, oom, jnp.zeros((), bool)), priced, None, skip=cfg.skip)
        by_drafts = drafts_paid
        drafts_victims = jnp.where(drafts_paid, jnp.sum(all_victims & ~victim, dtype=i32), 0)
        victim = jnp.where(drafts_paid, all_victims, victim)
        victim_order = jax.tree.map(lambda a, b: jnp.where(drafts_paid, a, b), all_order, victim_order)
        oom = jnp.where(drafts_paid, all_oom, oom)
    else:  # opportunistic drafts take only free blocks left over: they never make a step short
        by_drafts = jnp.zeros((), bool)
        drafts_victims = jnp.zeros((), i32)

    swap_len = jnp.where(victim, committed, 0)
    if pol.preemption == "swap" and cfg.swap_blocks > 0:
        room = cfg.swap_blocks - st.swap_used
        swap = victim & (committed > 0) & (in_order(cdiv(swap_len, s), *victim_order) <= room)
    else:
        swap = jnp.zeros((b,), bool)
    swap_need = jnp.where(swap, cdiv(swap_len, s), 0)
    col = jnp.arange(m, dtype=i32)[None, :]
    swap_out_blocks = jnp.where(swap[:, None] & (col < swap_need[:, None]), table, NULL_BLOCK)
    kv = manager.release(st.kv, victim, cfg.kv, first=finished)
    recompute = victim & ~swap
    seqs = seqs.replace(
        status=jnp.where(swap, SWAPPED, jnp.where(recompute, WAITING, seqs.status)).astype(jnp.int8),
        swapped_len=jnp.where(swap, swap_len, seqs.swapped_len),
        num_preemptions=seqs.num_preemptions + victim.astype(i32),
    )
    ct = st.counters
    n_recompute, n_swap, swapped_blocks = sums(recompute, swap, swap_need)
    counters = ct.replace(
        oom_steps=ct.oom_steps + oom.astype(i32),
        preempt_recompute=ct.preempt_recompute + n_recompute,
        preempt_swap=ct.preempt_swap + n_swap,
        oom_steps_drafts=ct.oom_steps_drafts + by_drafts.astype(i32),
        preempt_drafts=ct.preempt_drafts + drafts_victims,
    )
    keep = (st.seqs.status == RUNNING) & ~victim
    grant = Grant(*(jnp.where(keep, x, 0) for x in grant[:4]), cow=grant.cow & keep)
    st = st.replace(kv=kv, seqs=seqs, counters=counters, swap_used=st.swap_used + swapped_blocks)
    return st, grant, Preemption(victim=victim, swap=swap, swap_out_blocks=swap_out_blocks, oom=oom,
                                 drafts_paid=drafts_paid, num_evictable=num_evictable)


def room_after(st: SchedState, grant: Grant, preemption: Preemption, cfg: SchedulerConfig) -> Room:
    """The blocks left once the victims are gone, with the kept rows' query blocks and batch slots counted. The
    release routes finished rows' blocks to stacks (now counted free) and leaves the evictable set as it was, so
    with no victim the count before it holds; a CPU's program counts again ([N]) only after a preemption."""
    free = manager.free_blocks(st.kv, cfg.kv)
    num_evictable = vmap_flow.cond(jnp.any(preemption.victim),
                                   lambda _: jnp.sum(manager.evictable(st.kv), dtype=i32),
                                   lambda _: preemption.num_evictable, None, skip=cfg.skip)
    need, running = sums(grant.need_query, st.seqs.status == RUNNING)
    return Room(free=free, avail=free + num_evictable, need=need, running=running)


def grant_opportunistic_drafts(grant: Grant, room: Room, plan: DraftPlan, preemption: Preemption, order: Order,
                               cfg: SchedulerConfig) -> tuple[Grant, Room]:
    """4. Drafts that are not mandatory (`drafts_preempt` off) get blocks only within floor(max_spec_ratio *
    free blocks left), in priority order: never at the expense of another sequence or of a cached prefix. Priced
    draft blocks (`Policy.draft_memory`): every draft slot when the drafts preempted (`preemption.drafts_paid`),
    else in priority order while they fit in the blocks left, evictable ones included."""
    drafts, need_drafts, pol = grant.drafts, grant.need_drafts, cfg.policy
    if not pol.drafts_preempt:
        if pol.priced_drafts:
            fit = in_order(need_drafts, *order) <= room.avail - room.need
            granted = preemption.drafts_paid | (need_drafts == 0) | fit
        else:
            cap = jnp.floor(plan.spec_ratio * jnp.maximum(room.free - room.need, 0).astype(jnp.float32))
            granted = (need_drafts == 0) | (in_order(need_drafts, *order) <= cap.astype(i32))
        drafts, need_drafts = jnp.where(granted, drafts, 0), jnp.where(granted, need_drafts, 0)
    grant = grant._replace(drafts=drafts, need_drafts=need_drafts)
    return grant, room._replace(need=room.need + jnp.sum(need_drafts, dtype=i32))


def count_draft_blocks(st: SchedState, grant: Grant) -> SchedState:
    """The running rows' draft slots' new blocks join `SchedCounters.draft_blocks` (attribution)."""
    ct = st.counters
    return st.replace(counters=ct.replace(draft_blocks=ct.draft_blocks + jnp.sum(grant.need_drafts, dtype=i32)))


def swap_in(st: SchedState, room: Room, preemption: Preemption, order: Order, cfg: SchedulerConfig
            ) -> tuple[SchedState, Room, SwapIn]:
    """5a. When nobody was preempted, SWAPPED rows come back first, in priority order, while their committed
    tokens' blocks and batch slots fit; they become RUNNING and compute nothing this step."""
    s, seqs = cfg.cache.block_size, st.seqs
    swapped = (seqs.status == SWAPPED) & ~preemption.swap & ~preemption.oom
    restore = jnp.where(swapped, cdiv(seqs.swapped_len, s), 0)
    fit = (in_order(restore, *order) <= room.avail - room.need) & (
        in_order(swapped.astype(i32), *order) <= cfg.max_running - room.running)
    rows = swapped & (in_order((swapped & ~fit).astype(i32), *order) == 0)  # stop at the first that does not fit
    restored_blocks = jnp.sum(jnp.where(rows, restore, 0), dtype=i32)
    tokens = jnp.where(rows, seqs.swapped_len, 0)
    seqs = seqs.replace(status=jnp.where(rows, RUNNING, seqs.status).astype(jnp.int8),
                        swapped_len=jnp.where(rows, 0, seqs.swapped_len))
    counters = st.counters.replace(swap_ins=st.counters.swap_ins + jnp.sum(rows, dtype=i32))
    st = st.replace(seqs=seqs, counters=counters, swap_used=st.swap_used - restored_blocks)
    room = room._replace(need=room.need + restored_blocks, running=room.running + jnp.sum(rows, dtype=i32))
    return st, room, SwapIn(rows=rows, tokens=tokens)


def swap_in_and_admit(st: SchedState, grant: Grant, room: Room, plan: DraftPlan, preemption: Preemption,
                      order: Order, cfg: SchedulerConfig) -> tuple[SchedState, Grant, Room, SwapIn, Admission]:
    """5. `swap_in`, then `admit`. With no SWAPPED and no WAITING row both change nothing and report nothing, as
    in most decode steps; the CPU's program (`SchedulerConfig.skip`) then skips them (~100 kernels of a 256-slot
    step, where a kernel costs ~0.7 us), a GPU's runs them (no round trip)."""
    b = cfg.cache.max_seqs

    def run(x):
        st, grant, room, _, _ = x
        st, room, restored = swap_in(st, room, preemption, order, cfg)
        st, grant, room, admission = admit(st, grant, room, plan, preemption, order, cfg)
        return st, grant, room, restored, admission

    nobody = jnp.zeros((b,), bool), jnp.zeros((b,), i32)
    status = st.seqs.status
    return vmap_flow.when_for(cfg.skip)(jnp.any((status == WAITING) | (status == SWAPPED)), run,
                                        (st, grant, room, SwapIn(*nobody), Admission(*nobody)),
                                        identity_when_false=True)


def newly_held(hit_ids: jax.Array, hit_col: jax.Array, evictable: jax.Array) -> jax.Array:
    """int32[A]: the idle cached blocks each admission candidate's hit (hit_ids int32[A, M] where hit_col
    bool[A, M]) takes out of the evictable set (bool[N]), each charged once, to the first candidate that shares
    it: candidates with a common cached prefix share its blocks, and admitting them all holds each block once."""
    a, m = hit_ids.shape
    n = evictable.shape[0]
    cand = jnp.broadcast_to(jnp.arange(a, dtype=i32)[:, None], (a, m))
    first = jnp.full((n,), a, i32).at[jnp.where(hit_col, hit_ids, n)].min(cand, mode="drop")  # [N] first sharer
    return jnp.sum(hit_col & evictable[hit_ids] & (first[hit_ids] == cand), axis=1, dtype=i32)


def waiting_candidates(waiting: jax.Array, order: Order, a: int) -> jax.Array:
    """int32[A]: the first A slots of waiting bool[B] in `order`, B where there are fewer. Dense (order.ahead
    given): each waiting slot's position among the waiting is counted and the A positions matched, [A, B] compares
    and no scan or scatter; else a gather and `arrays.first_trues`."""
    b = waiting.shape[0]
    if order.ahead is None:
        pos = first_trues(waiting[order.order], a, b)[0]
        return jnp.where(pos < b, order.order[jnp.clip(pos, 0, b - 1)], b)
    position = jnp.sum(order.ahead & waiting[None, :], axis=1, dtype=i32) - 1  # among the waiting, in order
    match = waiting[None, :] & (position[None, :] == jnp.arange(a, dtype=i32)[:, None])  # [A, B]
    return jnp.where(jnp.any(match, axis=1), jnp.sum(jnp.where(match, jnp.arange(b, dtype=i32), 0), axis=1), b)


def admit(st: SchedState, grant: Grant, room: Room, plan: DraftPlan, preemption: Preemption, order: Order,
          cfg: SchedulerConfig) -> tuple[SchedState, Grant, Room, Admission]:
    """5b. When nobody was preempted and none is left swapped: up to A = `admit_window` WAITING rows in priority
    order are admitted, with their prefix-cache hits shared by reference (hits cost no blocks and no tokens;
    idle cached blocks a hit shares stop being evictable, and are counted once however many candidates share
    them: `newly_held`), each with a chunk of the remaining token budget, stopping at the first that does not
    fit."""
    s, m, b, a = cfg.cache.block_size, cfg.cache.max_blocks_per_seq, cfg.cache.max_seqs, cfg.admit_rows
    pol, seqs = cfg.policy, st.seqs
    still_swapped = jnp.any(seqs.status == SWAPPED)
    cand = waiting_candidates(seqs.status == WAITING, order, a)  # int32[A] slots, b = none
    real = (cand < b) & ~preemption.oom & ~still_swapped
    cand_slot = jnp.clip(cand, 0, b - 1)
    if pol.prefix_cache:
        cand_len, cand_salt = take_each((seqs.num_tokens, seqs.cache_salt), cand_slot)
    else:
        cand_len, cand_salt = seqs.num_tokens[cand_slot], None
    cand_len = jnp.where(real, cand_len, 0)
    if pol.prefix_cache:
        # The speculative barrier keeps the last blocks a row's drafts could reach out of its hit.
        window = jnp.full((a,), plan.k_max if (pol.prefix_barrier and pol.speculation) else 0, i32)
        hit_blocks, hit_ids = manager.lookup(st.kv, seqs.tokens, cand_slot, cand_len, window, plan.spec_ratio, cfg.kv,
                                             cand_salt)
        if pol.spec_hit_trim and pol.speculation:  # vLLM's EAGLE/MTP path: the hit loses the drafts' reach
            hit_blocks = jnp.maximum(hit_blocks - cdiv(plan.k_max, s), 0)
            hit_ids = jnp.where(jnp.arange(m, dtype=i32)[None, :] < hit_blocks[:, None], hit_ids, 0)
    else:
        hit_blocks, hit_ids = jnp.zeros((a,), i32), jnp.zeros((a, m), i32)
    hit = hit_blocks * s
    a_chunk = jnp.minimum(cand_len - hit, cfg.chunk)
    a_res = jnp.where(cand_len - hit > 1, plan.reserve, 0) if pol.spec_in_prefill else jnp.zeros((a,), i32)
    a_res = jnp.clip(a_res, 0, cfg.max_len - hit - a_chunk)
    budget_left = cfg.token_budget - jnp.sum(grant.query + grant.drafts, dtype=i32)
    a_left = budget_left - (running_sum(a_chunk + a_res, cfg.dense) - (a_chunk + a_res))
    a_query = jnp.clip(a_left, 0, a_chunk)
    a_drafts = jnp.where(a_query == a_chunk, jnp.clip(a_left - a_query, 0, a_res), 0)
    a_need = cdiv(hit + a_query + a_drafts, s) - hit_blocks
    hit_col = jnp.arange(m, dtype=i32)[None, :] < hit_blocks[:, None]
    hit_evictable = vmap_flow.cond(jnp.any(hit_blocks > 0),
                                   lambda _: newly_held(hit_ids, hit_col, manager.evictable(st.kv)),
                                   lambda _: jnp.zeros((a,), i32), None, skip=cfg.skip)
    fit = real & (a_query > 0) & (running_sum(a_need + hit_evictable, cfg.dense) <= room.avail - room.need) & (
        running_sum(real.astype(i32), cfg.dense) <= cfg.max_running - room.running)
    admitted = jnp.arange(a, dtype=i32) < count_leading(fit)  # stop at the first that does not fit
    dst = jnp.where(admitted, cand, b)
    # The candidates' columns to their slots in one scatter (a kernel each on a GPU): admitted, hit, query, drafts.
    to_slot = jnp.zeros((b, 4), i32).at[dst].set(jnp.stack([jnp.ones_like(hit), hit, a_query, a_drafts], axis=1),
                                                  mode="drop")
    rows, hit_tokens = to_slot[:, 0] > 0, to_slot[:, 1]
    kv = manager.share(st.kv, jnp.zeros((b, m), i32).at[dst].set(hit_ids, mode="drop"), hit_tokens, cfg.kv)
    # An admitted row was WAITING, so its grant was 0: the scattered values replace nothing.
    grant = grant._replace(query=jnp.where(rows, to_slot[:, 2], grant.query),
                           drafts=jnp.where(rows, to_slot[:, 3], grant.drafts))
    seqs = seqs.replace(status=jnp.where(rows, RUNNING, seqs.status).astype(jnp.int8),
                        num_cached=seqs.num_cached + hit_tokens)
    ct = st.counters
    first = rows & (seqs.num_preemptions == 0)  # never admitted before: only a recompute sends a row back to WAITING
    n_rows, n_prompt, n_cached, n_first_prompt, n_first_cached = sums(
        rows, jnp.where(rows, seqs.num_tokens, 0), hit_tokens, jnp.where(first, seqs.num_tokens, 0),
        jnp.where(first, hit_tokens, 0))
    counters = ct.replace(
        admitted=ct.admitted + n_rows,
        prompt_tokens=ct.prompt_tokens + n_prompt,
        cached_tokens=ct.cached_tokens + n_cached,
        first_prompt_tokens=ct.first_prompt_tokens + n_first_prompt,
        first_cached_tokens=ct.first_cached_tokens + n_first_cached,
    )
    room = room._replace(need=room.need + jnp.sum(jnp.where(admitted, a_need, 0), dtype=i32))
    return st.replace(kv=kv, seqs=seqs, counters=counters), grant, room, Admission(rows=rows, hit_tokens=hit_tokens)


def evict_and_allocate(st: SchedState, grant: Grant, room: Room, restored: SwapIn, order: Order,
                       cfg: SchedulerConfig) -> tuple[SchedState, manager.AllocResult, jax.Array]:
    """6. The shortfall, if any, is evicted from the idle cached blocks, leaves first and least recently used
    first (`manager.eviction_order`), with their index entries; stale
    speculative-pool blocks are spent before that (the allocator takes them after the free stack), so a
    validated prefix is never evicted while a stale draft block is kept. Then one allocation of every row's
    tokens (prefill chunks, decode tokens, restored blocks) and of its draft slots, for the whole batch in one
    pass (`manager.allocate_step`).
    Returns the state, the first allocation's result (its copy-on-write pairs) and ok bool[]: every allocation
    succeeded (False would be a scheduler bug; the tests check it)."""
    shortfall = jnp.maximum(room.need - manager.free_blocks(st.kv, cfg.kv), 0)
    kv = manager.evict(st.kv, shortfall, cfg.kv)
    tokens = grant.query + restored.tokens
    if cfg.policy.speculation:
        # One pass for the slots and the drafts: a row has drafts only with its whole chunk (query > 0), so
        # they ride on its granted slots, which leave its partial block one it alone holds (popped, copied, or its
        # own unshared one) or none: drafts never copy.
        kv, res, draft_res = manager.allocate_step(kv, tokens, grant.drafts, st.step, order.order, cfg.kv,
                                                   ahead=order.ahead)
        return st.replace(kv=kv), res, jnp.all(res.ok & draft_res.ok)
    kv, res = manager.allocate(kv, tokens, order.order, cfg.kv, ahead=order.ahead)
    return st.replace(kv=kv), res, jnp.all(res.ok)


def make_batch(st: SchedState, grant: Grant, preemption: Preemption, restored: SwapIn, admission: Admission,
               res: manager.AllocResult, alloc_ok: jax.Array, cfg: SchedulerConfig) -> Batch:
    """The step's `Batch`, read off the state after allocation: a row that has one token left to compute decodes
    (its draft slots are verified drafts), any other row prefills (its draft slots are unused reservations)."""
    seqs, alloc = st.seqs, st.kv.alloc
    committed = alloc.seqs.num_committed
    decode = (seqs.status == RUNNING) & (seqs.num_tokens - committed == 1)
    usage = manager.usage(st.kv, cfg.kv)
    return Batch(
        scheduled=grant.query > 0,
        start=committed,
        num_query=grant.query,
        num_drafts=jnp.where(decode, grant.drafts, 0),
        num_reserved=jnp.where(decode, 0, grant.drafts),
        samples=(grant.query > 0) & (committed + grant.query == seqs.num_tokens),
        block_table=alloc.seqs.block_table,
        cow_src=res.cow_src,
        cow_dst=res.cow_dst,
        swap_out=preemption.swap,
        swap_out_blocks=preemption.swap_out_blocks,
        swap_in=restored.rows,
        restore=restored.tokens,
        preempted=preemption.victim & ~preemption.swap,
        admitted=admission.rows,
        hit_tokens=admission.hit_tokens,
        oom=preemption.oom,
        num_tokens=jnp.sum(grant.query + grant.drafts, dtype=i32),
        blocks_used=usage.blocks_used,
        spec_blocks=usage.spec_blocks,
        cached_idle=usage.cached_idle,
        alloc_ok=alloc_ok,
    )


def price_step(st: SchedState, batch: Batch, cfg: SchedulerConfig, step_cost: StepCost | None) -> SchedState:
    """7. Under goodput control, the scheduled step's time with and without its drafts (`draft_control.
    priced_step`: its tokens, rows, context read, and its widest row, the widest width when a row computes a
    prompt chunk) for `update` to charge each decoding row's lag."""
    if not cfg.policy.goodput_control:
        return st
    cost = flat_step_cost(cfg) if step_cost is None else step_cost
    on = batch.scheduled
    rows, ctx, drafts = sums(on, jnp.where(on, batch.start, 0), batch.num_drafts)
    widest = widest0 = jnp.zeros((), i32)
    if cost.width_us is not None:
        prompt = jnp.any(on & (batch.num_query > 1))
        last = cost.width_us.shape[0] - 1
        widest = jnp.where(prompt, last, jnp.max(jnp.where(on, batch.num_query + batch.num_drafts, 0)))
        widest0 = jnp.where(prompt, last, jnp.max(jnp.where(on, batch.num_query, 0)))
    t, t0 = draft_control.priced_step(cost, batch.num_tokens, rows, ctx, drafts, widest, widest0)
    return st.replace(priced=jnp.stack([t, t0]))


@functools.partial(jax.jit, static_argnames=("cfg",))
def schedule_unchecked(st: SchedState, knobs: Knobs, step_cost: StepCost | None = None, *, cfg: SchedulerConfig
                       ) -> tuple[SchedState, Batch]:
    """`schedule` without the boundary checks: the phases in order (see the module docstring). step_cost: what
    the goodput draft controller prices a step with (None: `flat_step_cost`); other policies ignore it."""
    st, finished = drop_finished(st, cfg)
    order = step_order(st.seqs, cfg)
    plan = plan_drafts(st, knobs, cfg, step_cost)
    grant = budget_tokens(st, plan, order, cfg)
    st, grant, preemption = preempt(st, grant, plan, order, cfg, step_cost, finished)
    room = room_after(st, grant, preemption, cfg)
    grant, room = grant_opportunistic_drafts(grant, room, plan, preemption, order, cfg)
    st = count_draft_blocks(st, grant)
    st, grant, room, restored, admission = swap_in_and_admit(st, grant, room, plan, preemption, order, cfg)
    st, res, alloc_ok = evict_and_allocate(st, grant, room, restored, order, cfg)
    batch = make_batch(st, grant, preemption, restored, admission, res, alloc_ok, cfg)
    return price_step(st, batch, cfg, step_cost), batch


def live(status: jax.Array) -> jax.Array:
    """bool[...]: slots holding a request that has not left the engine (WAITING, RUNNING or SWAPPED)."""
    return (status == WAITING) | (status == RUNNING) | (status == SWAPPED)


def width_bounds(st: SchedState, knobs: Knobs, cfg: SchedulerConfig, step_cost: StepCost | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What picks the next step's query width, from the state the next `schedule` will see (the engine calls it
    after `update`, the simulator before `schedule`; between them only `add` writes, and only to empty rows).

    Returns (prompt_work bool[]: some row is waiting or has more than its last token to compute, so the step
    needs the wide width; next_drafts int32[]: the most drafts any live row may get, an upper bound (memory and
    room only lower it); next_want int32[]: the same bound were every width 0..K compiled, the bucket
    histogram's key (`buckets`): the histogram rule snaps its target to the compiled widths, and a choice made
    from snapped counts would only ever see them. `buckets.snap_up(next_want, widths)` is next_drafts's width)."""
    status = st.seqs.status
    wide = prompt_work(st)
    if cfg.policy.goodput_control:  # the controller's own choice: a pure function of the state, known now
        bound = jnp.max(plan_drafts(st, knobs, cfg, step_cost).decode)
        return wide, bound, bound
    # The next schedule caps drafts by its decode rows (`verify_cap` of `decoding_rows`), known now.
    cap = verify_cap(decoding_rows(status, st.seqs.num_tokens, st.kv.alloc.seqs.num_committed, st.seqs.prompt_len),
                     knobs)

    def bound(widths):
        want = draft_lengths(st.seqs, knobs, cfg.policy, widths=widths, reach_of=cfg.reach_of)
        return jnp.minimum(jnp.max(jnp.where(live(status), want, 0)), cap)

    return wide, bound(st.draft_widths), bound(jnp.arange(cfg.policy.draft_len + 1, dtype=i32))
