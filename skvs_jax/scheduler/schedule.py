"""`schedule`: decide one step's batch and make every allocation for it, as a list of named phases.

    release_finished → plan_drafts (→ goodput_plan) → budget_tokens → preempt → grant_opportunistic_drafts
    → count_draft_blocks → swap_in → admit → evict_and_allocate → make_batch

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
from skvs_jax.arrays import cdiv, count_leading, i32, rank_of
from skvs_jax.config import NULL_BLOCK
from skvs_jax.kv import manager
from skvs_jax.policies import Knobs, Policy
from skvs_jax.scheduler import draft_control
from skvs_jax.scheduler.state import (
    EMPTY,
    FINISHED,
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

RANK_BY_COUNTING = 512  # up to this many slots, priority_order counts instead of sorting


def priority_order(seqs: SeqTable) -> jax.Array:
    """Slots by (priority, arrival, slot): int32[B], order[r] = slot served r-th.

    Up to 512 slots a slot's rank is the number of slots ahead of it ([B, B] compares, one fused op): XLA:CPU
    sorts through a compiled comparator, and a three-key sort cost ~2.3x the count at B = 256 (measured, 1000
    calls in a loop). The order is total (the slot breaks ties), so the ranks are a permutation."""
    b = seqs.priority.shape[0]
    b_idx = jnp.arange(b, dtype=i32)
    if b > RANK_BY_COUNTING:
        return jnp.lexsort((b_idx, seqs.arrival, seqs.priority)).astype(i32)
    p, a = seqs.priority, seqs.arrival
    ahead = (p[:, None] < p[None, :]) | ((p[:, None] == p[None, :]) & (
        (a[:, None] < a[None, :]) | ((a[:, None] == a[None, :]) & (b_idx[:, None] < b_idx[None, :]))))
    rank = jnp.sum(ahead, axis=0, dtype=i32)  # rank[j]: slots i ahead of slot j
    return jnp.zeros((b,), i32).at[rank].set(b_idx, unique_indices=True)


def in_order(x: jax.Array, order: jax.Array, rank: jax.Array) -> jax.Array:
    """Inclusive prefix sum of x[B] taken in `order` (rank = its inverse), returned per slot."""
    return jnp.cumsum(x[order], dtype=i32)[rank]


def draft_lengths(seqs: SeqTable, knobs: Knobs, policy: Policy, reach: tuple[int, ...] | None = None) -> jax.Array:
    """int32[B] drafts each sequence would propose (before memory and room limits).

    Fixed: knobs.draft_len. Adaptive: the smallest draft bucket whose reach (`SchedulerConfig.draft_reach`;
    for a chain the bucket itself) is >= round(1.5 * mean accepted count) of the request's histogram, which
    holds one prior observation of full acceptance (so a new request starts at the largest bucket). Drafting
    half again the expected accepted length keeps the chance of extra tokens without paying for K - a rejected
    slots every step; a request whose drafts keep failing drops to 0 (no speculation).
    Goodput control (`policy.draft_control`): knobs.draft_len, the cap below which `plan_drafts` decides.
    """
    k_max = jnp.clip(knobs.draft_len, 0, policy.draft_len).astype(i32)
    if not policy.speculation:
        return jnp.zeros(seqs.num_tokens.shape, i32)
    if not policy.adaptive_draft_len or policy.goodput_control:
        return jnp.broadcast_to(k_max, seqs.num_tokens.shape)
    k = policy.draft_len
    reach = reach or policy.draft_buckets or (k,)
    hist = seqs.accept_hist.at[:, reach[-1]].add(1).astype(jnp.float32)  # the prior: everything reachable accepted
    mean = jnp.sum(hist * jnp.arange(k + 1, dtype=jnp.float32)[None, :], axis=1) / jnp.sum(hist, axis=1)
    target = jnp.floor(mean * 1.5 + 0.5).astype(i32)
    buckets, reach_arr = jnp.asarray(policy.draft_buckets or (k,), i32), jnp.asarray(reach, i32)
    fits = reach_arr[None, :] >= jnp.minimum(target, reach[-1])[:, None]
    chosen = jnp.where(jnp.any(fits, axis=1), buckets[jnp.argmax(fits, axis=1)], k)
    return jnp.minimum(chosen, k_max)


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
    """The step's priority order: order int32[B] (order[r] = slot served r-th) and its inverse rank int32[B]."""

    order: jax.Array
    rank: jax.Array


class DraftPlan(NamedTuple):
    """decode int32[B]: drafts wanted by decode rows; reserved int32[B]: draft slots wanted by prefilling rows
    (spec_in_prefill); reserve int32[]: the reservation a newly admitted row asks for; k_max int32[]: the draft
    length knob clamped to [0, K]; spec_ratio float32[]: the max_spec_ratio knob clamped to [0, 1]."""

    decode: jax.Array
    reserved: jax.Array
    reserve: jax.Array
    k_max: jax.Array
    spec_ratio: jax.Array


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
    not get its blocks without preempting."""

    victim: jax.Array
    swap: jax.Array
    swap_out_blocks: jax.Array
    oom: jax.Array


class Room(NamedTuple):
    """What is left for the phases after preemption: free int32[] blocks allocation can take without evicting,
    avail int32[] that plus evictable cached blocks, evictable bool[N], need int32[] blocks granted so far,
    running int32[] rows in the batch so far."""

    free: jax.Array
    avail: jax.Array
    evictable: jax.Array
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


def release_finished(st: SchedState, cfg: SchedulerConfig) -> SchedState:
    """0. FINISHED slots give back their blocks and become EMPTY."""
    seqs = st.seqs
    done = seqs.status == FINISHED
    kv = manager.release(st.kv, done, cfg.kv)
    seqs = seqs.replace(status=jnp.where(done, EMPTY, seqs.status).astype(jnp.int8),
                        request_id=jnp.where(done, -1, seqs.request_id))
    return st.replace(kv=kv, seqs=seqs)


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
    decode = jnp.clip(jnp.minimum(draft_lengths(seqs, knobs, pol, cfg.reach), out_room), 0, cfg.max_len - num_tokens)
    decoding = decoding_rows(seqs.status, num_tokens, committed, seqs.prompt_len)
    decode = jnp.minimum(jnp.where(decoding, decode, 0), verify_cap(decoding, knobs))
    if pol.goodput_control:
        decode = goodput_plan(st, decode, chunk, cfg, step_cost)
    reserve = k_max if (pol.speculation and pol.spec_in_prefill) else jnp.zeros((), i32)
    reserved = jnp.where(running & (remaining > 1), jnp.clip(reserve, 0, cfg.max_len - committed - chunk), 0)
    return DraftPlan(decode=decode, reserved=reserved, reserve=reserve, k_max=k_max, spec_ratio=spec_ratio)


def goodput_plan(st: SchedState, cap: jax.Array, chunk: jax.Array, cfg: SchedulerConfig,
                 step_cost: StepCost | None) -> jax.Array:
    """int32[B] the goodput controller's drafts (`draft_control.goodput_drafts`) below cap int32[B], for a step
    whose other work is the running rows' chunks int32[B] (admissions come later and are not counted): its base
    tokens (within the token budget), rows, context read and the rows that sample whatever is drafted."""
    seqs, committed = st.seqs, st.kv.alloc.seqs.num_committed
    running = seqs.status == RUNNING
    alpha = draft_control.acceptance_estimates(seqs.draft_tried, seqs.draft_passed, st.pop_tried, st.pop_passed)
    surv = draft_control.survival(alpha)
    base = jnp.minimum(jnp.sum(chunk, dtype=i32), cfg.token_budget)
    rows = jnp.sum(running, dtype=i32)
    ctx = jnp.sum(jnp.where(running, committed, 0), dtype=i32)
    sampling = jnp.sum(running & (chunk > 0) & (committed + chunk == seqs.num_tokens), dtype=i32)
    cost = flat_step_cost(cfg) if step_cost is None else step_cost
    return draft_control.goodput_drafts(surv, cap, base, rows, ctx, sampling, cost)


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

    partial = table[jnp.arange(b, dtype=i32), jnp.clip(committed // s, 0, m - 1)]
    cow = running & (query > 0) & (committed % s != 0) & (alloc.blocks.ref_count[partial] > 1)
    need_query = jnp.where(query > 0, jnp.maximum(cdiv(committed + query, s) - held, 0) + cow.astype(i32), 0)
    need_all = jnp.where(query > 0, jnp.maximum(cdiv(committed + query + drafts, s) - held, 0) + cow.astype(i32), 0)
    return Grant(query=query, drafts=drafts, need_query=need_query, need_drafts=need_all - need_query, cow=cow)


def choose_victims(st: SchedState, need: jax.Array, rank: jax.Array, cfg: SchedulerConfig
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fewest running rows, in victim-rule order, whose release makes need int32[B] blocks fit in the free,
    speculative-pool and evictable blocks. Returns (victim bool[B]; the rows int32[B] in the rule's order, the
    victims first; oom bool[], some row could not get its blocks without preemption). Most steps fit without
    preempting anyone: the victim order (a sort) is skipped then."""
    m, b = cfg.cache.max_blocks_per_seq, cfg.cache.max_seqs
    alloc, running = st.kv.alloc, st.seqs.status == RUNNING
    committed, held, table = alloc.seqs.num_committed, alloc.seqs.num_blocks, alloc.seqs.block_table
    avail = manager.free_blocks(st.kv, cfg.kv) + jnp.sum(manager.evictable(st.kv), dtype=i32)
    total = jnp.sum(need, dtype=i32)
    b_idx = jnp.arange(b, dtype=i32)

    def victims(_):
        in_table = jnp.arange(m, dtype=i32)[None, :] < held[:, None]
        freed = jnp.sum(in_table & (alloc.blocks.ref_count[table] == 1), axis=1, dtype=i32)  # a victim gives back
        key = cfg.victim_rule(rank, committed, held).astype(i32)
        victim_order = jnp.lexsort((-rank, key, ~running)).astype(i32)  # running first, by key, then lower priority
        fits = total - jnp.cumsum(need[victim_order], dtype=i32) <= avail + jnp.cumsum(freed[victim_order], dtype=i32)
        fits = jnp.concatenate([(total <= avail)[None], fits])  # fits[j]: preempting the first j victims suffices
        return jnp.argmax(fits).astype(i32), victim_order, rank_of(victim_order)

    num_victims, victim_order, victim_rank = vmap_flow.cond(
        total <= avail, lambda _: (jnp.zeros((), i32), b_idx, b_idx), victims, None)
    return running & (victim_rank < num_victims), victim_order, num_victims > 0


def preempt(st: SchedState, grant: Grant, rank: jax.Array, cfg: SchedulerConfig
            ) -> tuple[SchedState, Grant, Preemption]:
    """3. Preemption: the blocks the running rows need (their drafts too when `drafts_preempt`) must fit in
    free + speculative-pool + evictable blocks; if they do not, the fewest victims in victim-rule order go. A
    victim is swapped (status SWAPPED, its committed blocks to be copied to the host tier) when the policy says
    swap and the tier has room, in victim order; otherwise recomputed (blocks released, back to WAITING with its
    tokens). The victims' grants are withdrawn."""
    s, m, b = cfg.cache.block_size, cfg.cache.max_blocks_per_seq, cfg.cache.max_seqs
    pol, seqs = cfg.policy, st.seqs
    committed, table = st.kv.alloc.seqs.num_committed, st.kv.alloc.seqs.block_table
    need = grant.need_query + grant.need_drafts if pol.drafts_preempt else grant.need_query
    victim, victim_order, oom = choose_victims(st, need, rank, cfg)
    if pol.drafts_preempt:  # attribution: the step would not be short without its drafts' blocks
        avail = manager.free_blocks(st.kv, cfg.kv) + jnp.sum(manager.evictable(st.kv), dtype=i32)
        by_drafts = oom & (jnp.sum(grant.need_query, dtype=i32) <= avail)
    else:  # opportunistic drafts take only free blocks left over: they never make a step short
        by_drafts = jnp.zeros((), bool)

    swap_len = jnp.where(victim, committed, 0)
    if pol.preemption == "swap" and cfg.swap_blocks > 0:
        room = cfg.swap_blocks - st.swap_used
        swap = victim & (committed > 0) & (in_order(cdiv(swap_len, s), victim_order, rank_of(victim_order)) <= room)
    else:
        swap = jnp.zeros((b,), bool)
    swap_need = jnp.where(swap, cdiv(swap_len, s), 0)
    col = jnp.arange(m, dtype=i32)[None, :]
    swap_out_blocks = jnp.where(swap[:, None] & (col < swap_need[:, None]), table, NULL_BLOCK)
    kv = manager.release(st.kv, victim, cfg.kv)
    recompute = victim & ~swap
    seqs = seqs.replace(
        status=jnp.where(swap, SWAPPED, jnp.where(recompute, WAITING, seqs.status)).astype(jnp.int8),
        swapped_len=jnp.where(swap, swap_len, seqs.swapped_len),
        num_preemptions=seqs.num_preemptions + victim.astype(i32),
    )
    ct = st.counters
    counters = ct.replace(
        oom_steps=ct.oom_steps + oom.astype(i32),
        preempt_recompute=ct.preempt_recompute + jnp.sum(recompute, dtype=i32),
        preempt_swap=ct.preempt_swap + jnp.sum(swap, dtype=i32),
        oom_steps_drafts=ct.oom_steps_drafts + by_drafts.astype(i32),
        preempt_drafts=ct.preempt_drafts + jnp.where(by_drafts, jnp.sum(victim, dtype=i32), 0),
    )
    keep = (st.seqs.status == RUNNING) & ~victim
    grant = Grant(*(jnp.where(keep, x, 0) for x in grant[:4]), cow=grant.cow & keep)
    st = st.replace(kv=kv, seqs=seqs, counters=counters, swap_used=st.swap_used + jnp.sum(swap_need, dtype=i32))
    return st, grant, Preemption(victim=victim, swap=swap, swap_out_blocks=swap_out_blocks, oom=oom)


def room_after(st: SchedState, grant: Grant, cfg: SchedulerConfig) -> Room:
    """The blocks left once the victims are gone, with the kept rows' query blocks and batch slots counted."""
    evictable = manager.evictable(st.kv)
    free = manager.free_blocks(st.kv, cfg.kv)
    return Room(free=free, avail=free + jnp.sum(evictable, dtype=i32), evictable=evictable,
                need=jnp.sum(grant.need_query, dtype=i32), running=jnp.sum(st.seqs.status == RUNNING, dtype=i32))


def grant_opportunistic_drafts(grant: Grant, room: Room, plan: DraftPlan, order: Order, cfg: SchedulerConfig
                               ) -> tuple[Grant, Room]:
    """4. Drafts that are not mandatory (`drafts_preempt` off) get blocks only within floor(max_spec_ratio *
    free blocks left), in priority order: never at the expense of another sequence or of a cached prefix."""
    drafts, need_drafts = grant.drafts, grant.need_drafts
    if not cfg.policy.drafts_preempt:
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


def newly_held(hit_ids: jax.Array, hit_col: jax.Array, evictable: jax.Array) -> jax.Array:
    """int32[A]: the idle cached blocks each admission candidate's hit (hit_ids int32[A, M] where hit_col
    bool[A, M]) takes out of the evictable set (bool[N]), each charged once, to the first candidate that shares
    it: candidates with a common cached prefix share its blocks, and admitting them all holds each block once."""
    a, m = hit_ids.shape
    n = evictable.shape[0]
    cand = jnp.broadcast_to(jnp.arange(a, dtype=i32)[:, None], (a, m))
    first = jnp.full((n,), a, i32).at[jnp.where(hit_col, hit_ids, n)].min(cand, mode="drop")  # [N] first sharer
    return jnp.sum(hit_col & evictable[hit_ids] & (first[hit_ids] == cand), axis=1, dtype=i32)


def admit(st: SchedState, grant: Grant, room: Room, plan: DraftPlan, preemption: Preemption, order: Order,
          cfg: SchedulerConfig) -> tuple[SchedState, Grant, Room, Admission]:
    """5b. When nobody was preempted and none is left swapped: up to A = `admit_window` WAITING rows in priority
    order are admitted, with their prefix-cache hits shared by reference (hits cost no blocks and no tokens;
    idle cached blocks a hit shares stop being evictable, and are counted once however many candidates share
    them: `newly_held`), each with a chunk of the remaining token budget, stopping at the first that does not
    fit."""
    s, m, b, a = cfg.cache.block_size, cfg.cache.max_blocks_per_seq, cfg.cache.max_seqs, cfg.window
    pol, seqs = cfg.policy, st.seqs
    still_swapped = jnp.any(seqs.status == SWAPPED)
    pos = jnp.nonzero((seqs.status == WAITING)[order.order], size=a, fill_value=b)[0]
    cand = jnp.where(pos < b, order.order[jnp.clip(pos, 0, b - 1)], b)  # int32[A] slots, b = none
    real = (cand < b) & ~preemption.oom & ~still_swapped
    cand_slot = jnp.clip(cand, 0, b - 1)
    cand_len = jnp.where(real, seqs.num_tokens[cand_slot], 0)
    if pol.prefix_cache:
        # The speculative barrier keeps the last blocks a row's drafts could reach out of its hit.
        window = jnp.full((a,), plan.k_max if (pol.prefix_barrier and pol.speculation) else 0, i32)
        hit_blocks, hit_ids = manager.lookup(st.kv, seqs.tokens[cand_slot], cand_len, window, plan.spec_ratio, cfg.kv,
                                             seqs.cache_salt[cand_slot])
    else:
        hit_blocks, hit_ids = jnp.zeros((a,), i32), jnp.zeros((a, m), i32)
    hit = hit_blocks * s
    a_chunk = jnp.minimum(cand_len - hit, cfg.chunk)
    a_res = jnp.where(cand_len - hit > 1, plan.reserve, 0) if pol.spec_in_prefill else jnp.zeros((a,), i32)
    a_res = jnp.clip(a_res, 0, cfg.max_len - hit - a_chunk)
    budget_left = cfg.token_budget - jnp.sum(grant.query + grant.drafts, dtype=i32)
    a_left = budget_left - (jnp.cumsum(a_chunk + a_res, dtype=i32) - (a_chunk + a_res))
    a_query = jnp.clip(a_left, 0, a_chunk)
    a_drafts = jnp.where(a_query == a_chunk, jnp.clip(a_left - a_query, 0, a_res), 0)
    a_need = cdiv(hit + a_query + a_drafts, s) - hit_blocks
    hit_col = jnp.arange(m, dtype=i32)[None, :] < hit_blocks[:, None]
    hit_evictable = vmap_flow.cond(jnp.any(hit_blocks > 0), lambda _: newly_held(hit_ids, hit_col, room.evictable),
                                   lambda _: jnp.zeros((a,), i32), None)
    fit = real & (a_query > 0) & (jnp.cumsum(a_need + hit_evictable, dtype=i32) <= room.avail - room.need) & (
        jnp.cumsum(real.astype(i32), dtype=i32) <= cfg.max_running - room.running)
    admitted = jnp.arange(a, dtype=i32) < count_leading(fit)  # stop at the first that does not fit
    dst = jnp.where(admitted, cand, b)
    rows = jnp.zeros((b,), bool).at[dst].set(True, mode="drop")
    hit_tokens = jnp.zeros((b,), i32).at[dst].set(hit, mode="drop")
    kv = manager.share(st.kv, jnp.zeros((b, m), i32).at[dst].set(hit_ids, mode="drop"), hit_tokens, cfg.kv)
    grant = grant._replace(query=grant.query.at[dst].set(a_query, mode="drop"),
                           drafts=grant.drafts.at[dst].set(a_drafts, mode="drop"))
    seqs = seqs.replace(status=jnp.where(rows, RUNNING, seqs.status).astype(jnp.int8),
                        num_cached=seqs.num_cached + hit_tokens)
    ct = st.counters
    counters = ct.replace(
        admitted=ct.admitted + jnp.sum(rows, dtype=i32),
        prompt_tokens=ct.prompt_tokens + jnp.sum(jnp.where(rows, seqs.num_tokens, 0), dtype=i32),
        cached_tokens=ct.cached_tokens + jnp.sum(hit_tokens, dtype=i32),
    )
    room = room._replace(need=room.need + jnp.sum(jnp.where(admitted, a_need, 0), dtype=i32))
    return st.replace(kv=kv, seqs=seqs, counters=counters), grant, room, Admission(rows=rows, hit_tokens=hit_tokens)


def evict_and_allocate(st: SchedState, grant: Grant, room: Room, restored: SwapIn, order: Order,
                       cfg: SchedulerConfig) -> tuple[SchedState, manager.AllocResult, jax.Array]:
    """6. The shortfall, if any, is evicted from the idle cached blocks, leaves first and least recently used
    first (`manager.eviction_order`), with their index entries; stale
    speculative-pool blocks are spent before that (the allocator takes them after the free stack), so a
    validated prefix is never evicted while a stale draft block is kept. Then one allocation of every row's
    tokens (prefill chunks, decode tokens, restored blocks) and one of the draft slots, for the whole batch.
    Returns the state, the first allocation's result (its copy-on-write pairs) and ok bool[]: every allocation
    succeeded (False would be a scheduler bug; the tests check it)."""
    shortfall = jnp.maximum(room.need - manager.free_blocks(st.kv, cfg.kv), 0)
    kv = manager.evict(st.kv, shortfall, cfg.kv)
    kv, res = manager.allocate(kv, grant.query + restored.tokens, jnp.zeros((), i32), order.order, cfg.kv,
                               speculative=False)
    ok = jnp.all(res.ok)
    if cfg.policy.speculation:
        kv, spec_res = manager.allocate(kv, grant.drafts, st.step, order.order, cfg.kv, speculative=True)
        ok &= jnp.all(spec_res.ok)
    return st.replace(kv=kv), res, ok


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


@functools.partial(jax.jit, static_argnames=("cfg",))
def schedule_unchecked(st: SchedState, knobs: Knobs, step_cost: StepCost | None = None, *, cfg: SchedulerConfig
                       ) -> tuple[SchedState, Batch]:
    """`schedule` without the boundary checks: the phases in order (see the module docstring). step_cost: what
    the goodput draft controller prices a step with (None: `flat_step_cost`); other policies ignore it."""
    st = release_finished(st, cfg)
    order = priority_order(st.seqs)
    order = Order(order=order, rank=rank_of(order))
    plan = plan_drafts(st, knobs, cfg, step_cost)
    grant = budget_tokens(st, plan, order, cfg)
    st, grant, preemption = preempt(st, grant, order.rank, cfg)
    room = room_after(st, grant, cfg)
    grant, room = grant_opportunistic_drafts(grant, room, plan, order, cfg)
    st = count_draft_blocks(st, grant)
    st, room, restored = swap_in(st, room, preemption, order, cfg)
    st, grant, room, admission = admit(st, grant, room, plan, preemption, order, cfg)
    st, res, alloc_ok = evict_and_allocate(st, grant, room, restored, order, cfg)
    return st, make_batch(st, grant, preemption, restored, admission, res, alloc_ok, cfg)
