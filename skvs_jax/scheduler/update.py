"""`update`: settle a step after the model ran, as named phases; and `add` / `abort`, the requests' arrival and end.

    drop_aborted → (index_on_fill) → commit → append_tokens → (settle_on_fill | index_validated) → reclaim
    → record

The accepted drafts become validated tokens and the rest roll back; the sampled tokens are appended; rows that
reached their limits finish; whole blocks enter the prefix index (validated tokens only, or, for the naive
integration, on fill with a roll-back of what verification rejected); expired speculative-pool blocks are
reclaimed. The KV side of each phase is the KV manager's (`kv.manager`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from skvs_jax import arrays
from skvs_jax.arrays import cdiv, count_leading, first_trues, floor_div, i32, sums
from skvs_jax.kv import manager
from skvs_jax.policies import Knobs
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
    StepResult,
)


def drop_aborted(st: SchedState, batch: Batch) -> Batch:
    """A row aborted since `schedule` (no longer RUNNING) has lost its blocks: its batch.block_table row names
    freed blocks, which must never be indexed or committed. It is dropped from the batch."""
    live = st.seqs.status == RUNNING
    return batch.replace(scheduled=batch.scheduled & live, samples=batch.samples & live,
                         num_query=jnp.where(live, batch.num_query, 0),
                         num_drafts=jnp.where(live, batch.num_drafts, 0), restore=jnp.where(live, batch.restore, 0))


def rows_to_index(st: SchedState, batch: Batch, accepted: jax.Array, cfg: SchedulerConfig
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Running rows that filled a block this step wait to be indexed; up to R of them (slot order) are offered per
    step.
    Returns (filled_to int32[B]: the tokens a row's full blocks may now cover, drafts included on fill; sel
    int32[R]: the slots offered, B = padding; pending bool[B]: those still waiting)."""
    s, b = cfg.cache.block_size, cfg.cache.max_seqs
    start = batch.start
    on_fill = cfg.policy.prefix_cache and cfg.policy.insert == "on_fill"
    computed = start + batch.num_query + (batch.num_drafts if on_fill else accepted)
    filled_to = jnp.where(batch.scheduled, computed, start) + batch.restore
    # Only a row still running indexes: one aborted since schedule (or preempted while pending) has lost its blocks,
    # and batch.block_table would name freed ones.
    pending = (st.seqs.index_pending | (floor_div(filled_to, s) > floor_div(start, s))) & (st.seqs.status == RUNNING)
    sel, rank = first_trues(pending, cfg.rows_indexed, b)
    return filled_to, sel, pending & (rank > cfg.rows_indexed)


def drafts_in_cache_order(st: SchedState, batch: Batch, view_tokens: jax.Array, cfg: SchedulerConfig) -> jax.Array:
    """int32[B, M*S] each row's tokens followed by its drafts as the forward pass placed them in the cache
    (view_tokens int32[B, K], a draft tree's slot order): what an on-fill index hashes."""
    b, k, max_len = cfg.cache.max_seqs, max(cfg.policy.draft_len, 1), cfg.max_len
    slot = jnp.arange(k, dtype=i32)[None, :]
    pos = jnp.where(slot < batch.num_drafts[:, None], st.seqs.num_tokens[:, None] + slot, max_len)
    return st.seqs.tokens.at[jnp.arange(b, dtype=i32)[:, None], pos].set(view_tokens[:, :k], mode="drop")


def append_tokens(st: SchedState, batch: Batch, accepted: jax.Array, next_tokens: jax.Array,
                  draft_tokens: jax.Array, stop: jax.Array, cfg: SchedulerConfig
                  ) -> tuple[SchedState, jax.Array, jax.Array]:
    """A sampling row gains its `accepted` drafts, then the target's token after them; it finishes on `stop`, at
    max_new_tokens, or when its table is full. Returns the state, num_new int32[B] and finished bool[B]."""
    b, k, max_len = cfg.cache.max_seqs, cfg.policy.draft_len, cfg.max_len
    seqs = st.seqs
    num_tokens = seqs.num_tokens
    new = jnp.where(batch.samples, accepted + 1, 0)
    slot = jnp.arange(k + 1, dtype=i32)[None, :]
    out_tokens = jnp.where(slot == accepted[:, None], next_tokens[:, None],
                           jnp.pad(draft_tokens, ((0, 0), (0, k + 1 - draft_tokens.shape[1]))))
    pos = jnp.where(slot < new[:, None], num_tokens[:, None] + slot, max_len)
    tokens = seqs.tokens.at[jnp.arange(b, dtype=i32)[:, None], pos].set(out_tokens, mode="drop")
    num_tokens = num_tokens + new
    finished = (seqs.status == RUNNING) & batch.samples & (
        stop | (num_tokens - seqs.prompt_len >= seqs.max_new_tokens) | (num_tokens >= max_len))
    seqs = seqs.replace(status=jnp.where(finished, FINISHED, seqs.status).astype(jnp.int8), tokens=tokens,
                        num_tokens=num_tokens)
    return st.replace(seqs=seqs), new, finished


def valid_on_fill(committed: jax.Array, accepted: jax.Array, view_tokens: jax.Array, draft_tokens: jax.Array,
                  cfg: SchedulerConfig) -> jax.Array:
    """int32[B] tokens of each row an on-fill entry may cover: its committed tokens, less the accepted drafts
    where the cache's order (view_tokens) and the accepted path (draft_tokens) part (a tree's accepted path can
    differ from its slot order; for a chain the two agree on every accepted draft)."""
    k = max(cfg.policy.draft_len, 1)
    agree = jnp.minimum(count_leading(view_tokens[:, :k] == draft_tokens[:, :k], axis=1), accepted)
    return committed - (accepted - agree)


def record(st: SchedState, batch: Batch, accepted: jax.Array, new: jax.Array, finished: jax.Array,
           pending: jax.Array, cfg: SchedulerConfig) -> SchedState:
    """The request's acceptance histogram and per-depth counts (and the population's; the depths a row's drafts
    reached, `SchedulerConfig.reach_of` of its draft slots), under goodput control each decoding row's lag
    (`draft_control.record_lag`), the rows still waiting to be indexed, the step's counters."""
    b = st.seqs.status.shape[0]
    verified = batch.samples & (batch.num_drafts > 0)
    hist = st.seqs.accept_hist.at[jnp.where(verified, jnp.arange(b, dtype=i32), b), accepted].add(1, mode="drop")
    reached = jnp.asarray(cfg.reach_of, i32)[jnp.clip(batch.num_drafts, 0, cfg.policy.draft_len)]
    tried, passed, pop_tried, pop_passed = draft_control.record_drafts(
        st.seqs.draft_tried, st.seqs.draft_passed, st.pop_tried, st.pop_passed, verified, reached, accepted)
    ct = st.counters
    n_finished, n_drafted, n_accepted, n_verified, n_new = sums(finished, batch.num_drafts, accepted, verified, new)
    counters = ct.replace(
        steps=ct.steps + 1,
        finished=ct.finished + n_finished,
        drafted=ct.drafted + n_drafted,
        accepted=ct.accepted + n_accepted,
        verifications=ct.verifications + n_verified,
        output_tokens=ct.output_tokens + n_new,
    )
    seqs = st.seqs.replace(accept_hist=hist, draft_tried=tried, draft_passed=passed, index_pending=pending)
    if cfg.policy.goodput_control:  # a row decoded when it sampled a token after its first one
        decoded = batch.samples & (batch.start >= st.seqs.prompt_len)
        lag, elapsed, undrafted = draft_control.record_lag(seqs.lag, seqs.elapsed, seqs.undrafted, decoded,
                                                           batch.num_drafts, accepted, st.priced)
        seqs = seqs.replace(lag=lag, elapsed=elapsed, undrafted=undrafted)
    return st.replace(seqs=seqs, counters=counters, step=st.step + 1, pop_tried=pop_tried, pop_passed=pop_passed)


@functools.partial(jax.jit, static_argnames=("cfg",))
def update_unchecked(
    st: SchedState,
    batch: Batch,
    accepted: jax.Array,
    next_tokens: jax.Array,
    draft_tokens: jax.Array,
    stop: jax.Array,
    knobs: Knobs,
    *,
    cfg: SchedulerConfig,
    view_tokens: jax.Array | None = None,
) -> tuple[SchedState, StepResult]:
    """`update` without the boundary checks. view_tokens int32[B, K]: the draft tokens in the order the forward
    pass placed them in the cache (a draft tree's slot order; default draft_tokens, a chain), which on-fill
    indexing hashes; the accepted ones are draft_tokens[:accepted], moved into place by the caller."""
    pol = cfg.policy
    batch = drop_aborted(st, batch)
    accepted = jnp.where(batch.samples, jnp.clip(accepted, 0, batch.num_drafts), 0).astype(i32)
    filled_to, sel, pending = rows_to_index(st, batch, accepted, cfg)
    rows = jnp.clip(sel, 0, cfg.cache.max_seqs - 1)
    on_fill = pol.prefix_cache and pol.insert == "on_fill"
    view = draft_tokens if view_tokens is None else view_tokens
    kv = st.kv
    if on_fill:  # before verification's outcome is known, as a naive integration indexes
        view_all = drafts_in_cache_order(st, batch, view, cfg)
        kv, filled_ids = manager.index_on_fill(kv, view_all, filled_to, batch.block_table, sel, cfg.kv,
                                               st.seqs.cache_salt)
    kv = manager.commit(kv, jnp.where(batch.scheduled, batch.num_query + accepted, 0) + batch.restore, cfg.kv)
    st, new, finished = append_tokens(st.replace(kv=kv), batch, accepted, next_tokens, draft_tokens, stop, cfg)
    committed = kv.alloc.seqs.num_committed
    if on_fill:
        valid = committed if view_tokens is None else valid_on_fill(committed, accepted, view, draft_tokens, cfg)
        kv = manager.settle_on_fill(kv, filled_ids, valid[rows], cfg.kv, drafts=pol.speculation)
    elif pol.prefix_cache:
        kv = manager.index_validated(kv, st.seqs.tokens, committed, sel, cfg.kv, st.seqs.cache_salt)
    if pol.spec_pool:
        kv = manager.reclaim(kv, st.step, knobs.generation_threshold, cfg.skip)
    st = record(st.replace(kv=kv), batch, accepted, new, finished, pending, cfg)
    return st, StepResult(num_new=new, finished=finished, accepted=accepted)


# ------------------------------------------------------------------------------------------ add / abort


def _start_rows(seqs: SeqTable, slot: jax.Array, dense: bool = False, **given) -> SeqTable:
    """The rows `slot` (int32[B'], B = dropped; distinct) of the table set for sequences that start there: the
    `given` fields (arrays with a leading B' axis, or scalars), every other field zero (its statistics, counters
    and flags). The one place a row starts (`add`, `fork`), so a field added to `SeqTable` starts at zero in both
    instead of keeping the slot's previous occupant's value. dense (static): each field is a row gather and a
    select over the B slots (`arrays.rows_into`) instead of a scatter: the same table, in kernels a GPU fuses
    (one scatter in all, for the slots' sources, against one per field)."""
    names = {f.name for f in dataclasses.fields(seqs)}
    if unknown := set(given) - names:
        raise TypeError(f"SeqTable has no fields {sorted(unknown)}")
    src = arrays.rows_into(slot, seqs.status.shape[0]) if dense else None

    def start(name):
        x = getattr(seqs, name)
        value = given.get(name, jnp.zeros((), x.dtype))
        if dense:
            return arrays.set_rows_from(x, src, value)
        return x.at[slot].set(value, mode="drop")

    return seqs.replace(**{n: start(n) for n in names})


@functools.partial(jax.jit, static_argnames=("cfg", "dense"))
def add_unchecked(st, prompts, prompt_len, max_new, priority, request_id, cache_salt=None, tpot_target=None, *,
                  cfg: SchedulerConfig, dense: bool = False):
    """`add` without the boundary checks (a row that breaks its rules is padding). cache_salt, tpot_target:
    int32[requests] (None: 0, no salt, no target). dense (static): rows written as gathers and selects
    (`_start_rows`), for a program that admits on every step (a GPU's dispatch loop)."""
    b = cfg.cache.max_seqs
    seqs = st.seqs
    # A row that breaks add's rules (checked at the boundary when concrete) is padding here, never a sequence
    # that could outgrow its table.
    fits = (prompt_len <= prompts.shape[1]) & (max_new >= 1) & (max_new <= cfg.max_len - prompt_len)
    valid = (prompt_len > 0) & fits
    free_slots, empty_rank = first_trues(seqs.status == EMPTY, b, b)
    rank = jnp.cumsum(valid, dtype=i32) - 1
    slot = jnp.where(valid & (rank < empty_rank[-1]), free_slots[jnp.clip(rank, 0, b - 1)], b)
    placed = slot < b
    arrival = st.next_arrival + rank
    prompts = jnp.pad(prompts, ((0, 0), (0, cfg.max_len - prompts.shape[1])))
    prompts = jnp.where(jnp.arange(cfg.max_len)[None, :] < prompt_len[:, None], prompts, 0)
    seqs = _start_rows(seqs, slot, dense, status=WAITING, tokens=prompts, num_tokens=prompt_len, prompt_len=prompt_len,
                       max_new_tokens=max_new, priority=priority, arrival=arrival, request_id=request_id,
                       cache_salt=0 if cache_salt is None else cache_salt,
                       tpot_target=0 if tpot_target is None else jnp.maximum(tpot_target, 0))
    st = st.replace(seqs=seqs, next_arrival=st.next_arrival + jnp.sum(placed, dtype=i32))
    return st, jnp.where(placed, slot, -1)


@functools.partial(jax.jit, static_argnames=("cfg",))
def fork_unchecked(st: SchedState, parent: jax.Array, request_id: jax.Array, first_token: jax.Array, *,
                   cfg: SchedulerConfig) -> tuple[SchedState, jax.Array]:
    """New sequences that continue other slots' committed tokens with a token of their own (n > 1 outputs of one
    prompt): request i (parent int32[B'] a slot, -1 = padding) goes into an EMPTY slot, shares its parent's
    committed blocks (`manager.fork`, by reference: the prompt is stored once), and is RUNNING with known tokens
    = the parent's committed ones + first_token[i]. It inherits the parent's prompt length, max_new_tokens,
    cache salt, TPOT target, priority and arrival; its statistics start at zero. Returns (state, slots int32[B']: each
    request's slot, -1 where it was not placed (padding, no empty slot, or a parent the allocator cannot fork:
    unsettled, or nothing committed))."""
    b = cfg.cache.max_seqs
    seqs = st.seqs
    valid = (parent >= 0) & (parent < b)
    free_slots, empty_rank = first_trues(seqs.status == EMPTY, b, b)
    rank = jnp.cumsum(valid, dtype=i32) - 1
    slot = jnp.where(valid & (rank < empty_rank[-1]), free_slots[jnp.clip(rank, 0, b - 1)], b)
    p = jnp.clip(parent, 0, b - 1)
    parent_of = jnp.full((b,), -1, i32).at[slot].set(p, mode="drop")
    kv, ok = manager.fork(st.kv, parent_of, cfg.kv)
    placed = (slot < b) & ok[jnp.clip(slot, 0, b - 1)]
    slot = jnp.where(placed, slot, b)
    committed = st.kv.alloc.seqs.num_committed[p]
    col = jnp.arange(cfg.max_len, dtype=i32)[None, :]
    tokens = jnp.where(col < committed[:, None], seqs.tokens[p],
                       jnp.where(col == committed[:, None], first_token[:, None], 0))
    # The tenant's salt goes with its outputs: a fork's own blocks are indexed under the parent's salt.
    seqs = _start_rows(seqs, slot, status=RUNNING, tokens=tokens, num_tokens=committed + 1,
                       prompt_len=seqs.prompt_len[p], max_new_tokens=seqs.max_new_tokens[p], priority=seqs.priority[p],
                       arrival=seqs.arrival[p], request_id=request_id, cache_salt=seqs.cache_salt[p],
                       tpot_target=seqs.tpot_target[p])
    return st.replace(kv=kv, seqs=seqs), jnp.where(placed, slot, -1)


@functools.partial(jax.jit, static_argnames=("cfg",))
def abort_unchecked(st: SchedState, mask: jax.Array, *, cfg: SchedulerConfig) -> SchedState:
    """`abort` without the boundary checks."""
    seqs = st.seqs
    live = mask & (seqs.status != EMPTY)
    kv = manager.release(st.kv, live, cfg.kv)
    was_swapped = live & (seqs.status == SWAPPED)
    swap_used = st.swap_used - jnp.sum(jnp.where(was_swapped, cdiv(seqs.swapped_len, cfg.cache.block_size), 0),
                                       dtype=i32)
    seqs = seqs.replace(
        status=jnp.where(live, EMPTY, seqs.status).astype(jnp.int8),
        request_id=jnp.where(live, -1, seqs.request_id),
        swapped_len=jnp.where(live, 0, seqs.swapped_len),
    )
    counters = st.counters.replace(aborted=st.counters.aborted + jnp.sum(live & (st.seqs.status != FINISHED),
                                                                         dtype=i32))
    return st.replace(kv=kv, seqs=seqs, swap_used=swap_used, counters=counters)
