"""The functional scheduler: continuous batching over the allocator and the prefix cache, as pure jitted steps.

One engine step is `schedule → (model or cost model) → update`:

  schedule(state, knobs)  decides the step's batch and makes every allocation for it:
    0. FINISHED slots release their blocks and become EMPTY.
    1. Draft lengths: decode sequences (one sampled token left to compute) draft k <= knobs.draft_len tokens
       (adaptive: from each request's acceptance histogram); with `spec_in_prefill`, prefilling sequences
       reserve k draft slots too.
    2. Token budget: RUNNING sequences in priority order get min(remaining, prefill_chunk) tokens, then their
       draft slots, by a prefix sum over the per-step `token_budget` (chunked prefill falls out of this).
    3. Preemption: the blocks the running sequences need (their drafts too when `drafts_preempt`) must fit in
       free + speculative-pool + evictable (cached, ref 0) blocks. If they do not, victims are taken in the
       order of the pluggable victim rule until they do (the fewest victims; one prefix sum). A victim is
       swapped (its committed blocks copied to the host tier, status SWAPPED) when the policy says swap and
       the tier has room, else recomputed (blocks released, back to WAITING with its tokens).
    4. Opportunistic drafts (when not `drafts_preempt`): in priority order while their new blocks fit in
       floor(max_spec_ratio * free blocks left); never at the expense of another sequence or a cached prefix.
    5. When nobody was preempted: SWAPPED sequences come back first (blocks for their committed tokens, in
       priority order, while they fit); then, if none is left swapped, up to `admit_window` WAITING sequences
       are admitted in priority order with their prefix-cache hits shared by reference (hits cost no blocks
       and no tokens), each with a chunk of the remaining token budget, stopping at the first that does not fit.
    6. Blocks: the shortfall, if any, is evicted from the LRU cached blocks; stale speculative-pool blocks are
       spent before that (the allocator takes them after the free stack), so a validated prefix is never
       evicted while a stale draft block is kept. Then one `allocate` (prefill chunks, decode tokens,
       restored blocks) and one `allocate_speculative` (draft slots) for the whole batch.
  update(state, batch, accepted, ...) settles the step: commits accepted tokens, rolls back the rest,
    appends the sampled tokens, finishes sequences (max tokens, stop flag, table full), indexes whole blocks in
    the prefix cache (validated tokens only, or on fill with a roll-back of rejected drafts), and reclaims
    expired speculative-pool blocks.

Everything is fixed-shape: B sequence slots hold WAITING, RUNNING and SWAPPED requests alike; `max_running`
bounds the batch. There is no Python loop over sequences; failures are flags and counters. The same two
functions drive the engine (a real model between them) and the simulator (a cost model between them).

Priority order: (priority, arrival number, slot), lower first; FCFS within a priority. Counters are int32.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from skvs_jax import checks, vmap_flow
from skvs_jax.arrays import cdiv, count_leading, i32, rank_of
from skvs_jax.config import NULL_BLOCK, CacheConfig
from skvs_jax.kv import allocator
from skvs_jax.kv import prefix_cache as pc
from skvs_jax.kv.allocator import SPECULATIVE, STALE, AllocatorState
from skvs_jax.policies import NO_VERIFY_CAP, Knobs, Policy

EMPTY, WAITING, RUNNING, SWAPPED, FINISHED = 0, 1, 2, 3, 4
STATUS_NAMES = ("EMPTY", "WAITING", "RUNNING", "SWAPPED", "FINISHED")


# ---------------------------------------------------------------------------------------- victim rules
#
# A victim rule maps (rank, computed, held) -- int32[B] each: the slot's position in priority order, its
# committed tokens, its table entries -- to an int32[B] key; running sequences are preempted in increasing key
# order (ties: lower priority first). Production engines found that the choice changes wasted work by 20-60%.


def lowest_priority(rank: jax.Array, computed: jax.Array, held: jax.Array) -> jax.Array:
    """vLLM's rule: the last in priority order goes first (FCFS: the most recent arrival)."""
    del computed, held
    return -rank


def least_progress(rank: jax.Array, computed: jax.Array, held: jax.Array) -> jax.Array:
    """The sequence with the fewest computed tokens goes first: the least work to recompute."""
    del rank, held
    return computed


def most_blocks(rank: jax.Array, computed: jax.Array, held: jax.Array) -> jax.Array:
    """The sequence holding the most blocks goes first: the fewest victims free the memory."""
    del rank, computed
    return -held


VICTIM_RULES: dict[str, Callable[[jax.Array, jax.Array, jax.Array], jax.Array]] = {
    "lowest_priority": lowest_priority,
    "least_progress": least_progress,
    "most_blocks": most_blocks,
}


# ---------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Static configuration of the scheduler (hashable: a static argument of the jitted steps).

    Attributes:
      cache: the paged cache geometry; B = cache.max_seqs slots hold waiting, running and swapped requests.
      policy: the switches (see `policies`); numeric knobs come as data to each step.
      max_running: most RUNNING sequences (the batch size).
      token_budget: most tokens computed per step (prefill chunks + decode tokens + draft slots).
      prefill_chunk: most prompt tokens of one sequence per step (chunked prefill); default token_budget.
      admit_window: A, WAITING sequences examined for admission per step (bounds the prefix lookup's work).
      swap_blocks: blocks the host tier holds for swapped sequences (preemption="swap"; 0 = always recompute).
      victim: a name in VICTIM_RULES or a function (rank, computed, held) -> int32[B] key.
      index_rows: R, rows `update` offers to the prefix index per step (default min(B, 64)): those that filled a
        block, in slot order; the others wait for a later step. Indexing hashes whole rows, so R bounds its cost;
        a decode step fills about B * tokens-per-step / S blocks (46 at B=256, 2.9 tokens, S=16).
      prefix_capacity / prefix_ways: the prefix cache's table (default: `PrefixCacheConfig.for_cache`'s, four
        times the usable blocks, in 8-way buckets).
      draft_reach: per draft bucket, the most drafts a step with that many draft slots can accept (default: the
        buckets themselves, a chain). A draft tree of d nodes reaches only its depth, so adaptive draft length
        compares the expected accepted length with the reach, not with the node count.
    """

    cache: CacheConfig
    policy: Policy
    max_running: int
    token_budget: int
    prefill_chunk: int = 0
    admit_window: int = 0
    swap_blocks: int = 0
    victim: str | Callable = "lowest_priority"
    index_rows: int = 0
    prefix_capacity: int | None = None
    prefix_ways: int = 8
    draft_reach: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.cache, CacheConfig):
            raise TypeError(f"cache must be a CacheConfig, got {type(self.cache).__name__}")
        if not isinstance(self.policy, Policy):
            raise TypeError(f"policy must be a Policy, got {type(self.policy).__name__}")
        for name, lo in (("max_running", 1), ("token_budget", 1), ("prefill_chunk", 0), ("admit_window", 0),
                         ("swap_blocks", 0), ("index_rows", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < lo:
                raise ValueError(f"{name} must be >= {lo}, got {value}")
        if self.max_running > self.cache.max_seqs:
            raise ValueError(f"max_running ({self.max_running}) cannot exceed cache.max_seqs "
                             f"({self.cache.max_seqs})")
        if isinstance(self.victim, str) and self.victim not in VICTIM_RULES:
            raise ValueError(f"victim must be one of {sorted(VICTIM_RULES)} or a function, got {self.victim!r}")
        if not isinstance(self.victim, str) and not callable(self.victim):
            raise TypeError(f"victim must be a rule name or a function, got {type(self.victim).__name__}")
        buckets = self.policy.draft_buckets or ((self.policy.draft_len,) if self.policy.speculation else ())
        if self.draft_reach and (len(self.draft_reach) != len(buckets) or list(self.draft_reach) != sorted(
                self.draft_reach) or any(not 0 <= r <= k for r, k in zip(self.draft_reach, buckets))):
            raise ValueError(f"draft_reach must give, per draft bucket {buckets}, a non-decreasing reach <= the "
                             f"bucket, got {self.draft_reach}")

    @property
    def reach(self) -> tuple[int, ...]:
        """Per draft bucket, the most drafts it can accept (see `draft_reach`)."""
        return self.draft_reach or self.policy.draft_buckets or (self.policy.draft_len,)

    @property
    def chunk(self) -> int:
        return self.prefill_chunk or self.token_budget

    @property
    def window(self) -> int:
        return min(self.admit_window or 32, self.cache.max_seqs)

    @property
    def rows_indexed(self) -> int:
        return min(self.index_rows or 64, self.cache.max_seqs)

    @property
    def victim_rule(self) -> Callable:
        return VICTIM_RULES[self.victim] if isinstance(self.victim, str) else self.victim

    @property
    def max_len(self) -> int:
        """L = M * S: the most tokens (prompt + output) one request can hold."""
        return self.cache.max_tokens_per_seq

    @property
    def prefix(self) -> pc.PrefixCacheConfig:
        return pc.PrefixCacheConfig.for_cache(self.cache, self.prefix_capacity, self.prefix_ways)


# ----------------------------------------------------------------------------------------------- state


@struct.dataclass
class SeqTable:
    """Per-slot request state (the allocator keeps the block tables and computed lengths).

    status:          int8[B]      EMPTY / WAITING / RUNNING / SWAPPED / FINISHED
    tokens:          int32[B, L]  prompt, then the accepted output tokens; 0 past num_tokens
    num_tokens:      int32[B]     known tokens (prompt + outputs)
    prompt_len:      int32[B]
    max_new_tokens:  int32[B]     the request finishes when it has produced this many
    priority:        int32[B]     lower is served first
    arrival:         int32[B]     arrival number (FCFS within a priority)
    request_id:      int32[B]     the caller's id, -1 for EMPTY
    swapped_len:     int32[B]     committed tokens of a SWAPPED sequence, held by the host tier
    num_preemptions: int32[B]
    num_cached:      int32[B]     prompt tokens served from the prefix cache, summed over admissions
    accept_hist:     int32[B, K+1] verification steps by number of accepted drafts (adaptive draft length)
    index_pending:   bool[B]      filled a block that `update` has not offered to the prefix index yet
    """

    status: jax.Array
    tokens: jax.Array
    num_tokens: jax.Array
    prompt_len: jax.Array
    max_new_tokens: jax.Array
    priority: jax.Array
    arrival: jax.Array
    request_id: jax.Array
    swapped_len: jax.Array
    num_preemptions: jax.Array
    num_cached: jax.Array
    accept_hist: jax.Array
    index_pending: jax.Array


@struct.dataclass
class SchedCounters:
    """Cumulative int32 scalars."""

    steps: jax.Array
    oom_steps: jax.Array  # steps in which some sequence could not get its blocks without preemption
    preempt_recompute: jax.Array
    preempt_swap: jax.Array
    swap_ins: jax.Array
    admitted: jax.Array
    finished: jax.Array
    aborted: jax.Array
    prompt_tokens: jax.Array  # tokens to prefill at admission, before prefix hits
    cached_tokens: jax.Array  # of those, served by prefix hits
    drafted: jax.Array  # draft tokens proposed (decode)
    accepted: jax.Array  # of those, accepted
    verifications: jax.Array  # (sequence, step) pairs that verified >= 1 draft
    output_tokens: jax.Array


@struct.dataclass
class SchedState:
    alloc: AllocatorState
    prefix: pc.PrefixCache
    seqs: SeqTable
    counters: SchedCounters
    step: jax.Array  # int32[], the generation recorded on speculative blocks
    next_arrival: jax.Array  # int32[]
    swap_used: jax.Array  # int32[], host-tier blocks held by SWAPPED sequences


@struct.dataclass
class Batch:
    """One step's work, fixed-shape over the B slots.

    scheduled:    bool[B]      the slot computes tokens this step
    start:        int32[B]     position of its first query token (its committed length)
    num_query:    int32[B]     tokens to compute from `tokens` (prefill chunk, or 1 for decode)
    num_drafts:   int32[B]     draft tokens to propose and verify after them (decode only)
    num_reserved: int32[B]     draft slots reserved while prefilling (spec_in_prefill); never verified
    samples:      bool[B]      the step computes the last known token, so it samples a new one
    block_table:  int32[B, M]  tables after allocation
    cow_src/dst:  int32[B]     copy block src's KV into dst before the step (NULL_BLOCK: none)
    swap_out:     bool[B]      preempted by swap this step: copy swap_out_blocks to the host tier first
    swap_out_blocks: int32[B, M]  their committed blocks, NULL_BLOCK-padded (read before anything is written)
    swap_in:      bool[B]      restored this step: copy the host copy into the first ceil(restore / S) blocks
                               of block_table; they compute nothing this step
    restore:      int32[B]     committed tokens restored by swap_in
    preempted:    bool[B]      recomputed (blocks released, back to WAITING)
    admitted:     bool[B]      admitted this step; hit_tokens[B] of them shared from the prefix cache
    hit_tokens:   int32[B]
    oom:          bool[]       some sequence could not get its blocks without preemption
    num_tokens:   int32[]      tokens computed this step (query + drafts + reserved)
    blocks_used:  int32[]      blocks not on the free stack after allocation (null block excluded)
    spec_blocks:  int32[]      blocks holding only unvalidated or rejected drafts (SPECULATIVE or STALE)
    cached_idle:  int32[]      cached blocks no sequence holds (evictable)
    alloc_ok:     bool[]       every allocation succeeded (False would be a scheduler bug; tests check it)
    """

    scheduled: jax.Array
    start: jax.Array
    num_query: jax.Array
    num_drafts: jax.Array
    num_reserved: jax.Array
    samples: jax.Array
    block_table: jax.Array
    cow_src: jax.Array
    cow_dst: jax.Array
    swap_out: jax.Array
    swap_out_blocks: jax.Array
    swap_in: jax.Array
    restore: jax.Array
    preempted: jax.Array
    admitted: jax.Array
    hit_tokens: jax.Array
    oom: jax.Array
    num_tokens: jax.Array
    blocks_used: jax.Array
    spec_blocks: jax.Array
    cached_idle: jax.Array
    alloc_ok: jax.Array


@struct.dataclass
class StepShape:
    """The work of one step, as a model (or a cost model) sees it: int32 scalars."""

    prefill_tokens: jax.Array  # known tokens of rows that do not sample this step (prompt chunks before the last)
    decode_tokens: jax.Array  # query tokens of rows that sample: the last chunk or last token, plus draft slots
    kv_tokens_read: jax.Array  # cached context the attention reads: sum of `start` over scheduled rows
    num_seqs: jax.Array  # scheduled rows
    drafting_rows: jax.Array  # rows with draft slots (the draft heads run for them)


def step_shape(batch: Batch) -> StepShape:
    """What `batch` asks of the model: the engine logs it, the simulator prices it with a cost model."""
    on = batch.scheduled
    q = jnp.where(on, batch.num_query, 0)
    d = jnp.where(on, batch.num_drafts, 0)
    return StepShape(
        prefill_tokens=jnp.sum(jnp.where(batch.samples, 0, q), dtype=i32),
        decode_tokens=jnp.sum(jnp.where(batch.samples, q, 0) + d, dtype=i32),
        kv_tokens_read=jnp.sum(jnp.where(on, batch.start, 0), dtype=i32),
        num_seqs=jnp.sum(on, dtype=i32),
        drafting_rows=jnp.sum(d > 0, dtype=i32),
    )


@struct.dataclass
class StepResult:
    """What `update` did: num_new int32[B] tokens appended; finished bool[B]; accepted int32[B] drafts."""

    num_new: jax.Array
    finished: jax.Array
    accepted: jax.Array


def init(cfg: SchedulerConfig) -> SchedState:
    b, l, k = cfg.cache.max_seqs, cfg.max_len, cfg.policy.draft_len
    zb = jnp.zeros((b,), i32)
    zero = jnp.zeros((), i32)
    seqs = SeqTable(
        status=jnp.zeros((b,), jnp.int8), tokens=jnp.zeros((b, l), i32), num_tokens=zb, prompt_len=zb,
        max_new_tokens=zb, priority=zb, arrival=zb, request_id=jnp.full((b,), -1, i32), swapped_len=zb,
        num_preemptions=zb, num_cached=zb, accept_hist=jnp.zeros((b, k + 1), i32),
        index_pending=jnp.zeros((b,), bool),
    )
    counters = SchedCounters(*([zero] * len(SchedCounters.__dataclass_fields__)))
    return SchedState(alloc=allocator.init(cfg.cache), prefix=pc.init(cfg.prefix), seqs=seqs, counters=counters,
                      step=zero, next_arrival=zero, swap_used=zero)


# --------------------------------------------------------------------------------------------- helpers


def _in_order(x: jax.Array, order: jax.Array, rank: jax.Array) -> jax.Array:
    """Inclusive prefix sum of x[B] taken in `order`, returned per slot."""
    return jnp.cumsum(x[order], dtype=i32)[rank]


def _unpin(alloc: AllocatorState, ids: jax.Array) -> AllocatorState:
    """Unpin blocks whose index entries were removed; the ref-0 ones go to the free stack in id order."""
    ids = jnp.sort(ids)  # a canonical order (the table's slot order is a hash order)
    return allocator.set_cached_unchecked(alloc, ids, jnp.zeros(ids.shape, bool))


def decode_window(cfg: SchedulerConfig) -> int:
    """W = ceil((1 + K) / S) + 1: table columns a decode step touches (its partial block, and the blocks its
    decode token and K drafts spill into; with lazy release the held blocks lie within the same span)."""
    return min(cdiv(1 + cfg.policy.draft_len, cfg.cache.block_size) + 1, cfg.cache.max_blocks_per_seq)


def _allocate_two_pass(alloc, num_tokens, generation, order, cfg: SchedulerConfig, *, speculative: bool):
    """`allocator.allocate_unchecked` in two passes: rows whose request spans <= W columns (every decode row) in a [B, W]
    window, then, only if some row is wider (prefill chunks, swap-ins), those rows over the full [B, M] table.
    The scheduler has already made everything fit, so both passes grant everything; the oracle mirrors the
    two passes (they decide which rows pop blocks first)."""
    ccfg, spec, s = cfg.cache, cfg.policy.spec_config(), cfg.cache.block_size
    w = decode_window(cfg)
    have = alloc.seqs.num_allocated
    narrow = cdiv(have + num_tokens, s) - have // s <= w
    alloc, first = allocator.allocate_unchecked(alloc, jnp.where(narrow, num_tokens, 0), generation, order, cfg=ccfg,
                                       spec=spec, window=w, speculative=speculative)
    wide = jnp.where(narrow, 0, num_tokens)

    def full(operand):
        return allocator.allocate_unchecked(operand[0], wide, generation, order, cfg=ccfg, spec=spec, window=None,
                                   speculative=speculative)

    z = jnp.zeros_like(wide)
    nothing = allocator.AllocResult(ok=jnp.ones(wide.shape, bool), cow_src=z, cow_dst=z)
    alloc, second = vmap_flow.when(jnp.any(wide > 0), full, (alloc, nothing), identity_when_false=True)
    return alloc, allocator.AllocResult(
        ok=first.ok & second.ok,
        cow_src=jnp.where(narrow, first.cow_src, second.cow_src),
        cow_dst=jnp.where(narrow, first.cow_dst, second.cow_dst),
    )


def _commit_two_pass(alloc, num_accepted, cfg: SchedulerConfig):
    """`allocator.commit_unchecked` over a [B, W] window, then over the full table only if some row did not fit it
    (settled rows are settled again with 0 accepted, which changes nothing)."""
    ccfg, spec, s = cfg.cache, cfg.policy.spec_config(), cfg.cache.block_size
    fits = alloc.seqs.num_blocks - alloc.seqs.num_committed // s <= decode_window(cfg)
    alloc, _ = allocator.commit_unchecked(alloc, num_accepted, cfg=ccfg, spec=spec, window=decode_window(cfg))

    def full(alloc):
        return allocator.commit_unchecked(alloc, jnp.where(fits, 0, num_accepted), cfg=ccfg, spec=spec, window=None)[0]

    return vmap_flow.when(jnp.any(~fits), full, alloc, identity_when_false=True)


_RANK_BY_COUNTING = 512  # up to this many slots, priority_order counts instead of sorting


def priority_order(seqs: SeqTable) -> jax.Array:
    """Slots by (priority, arrival, slot): int32[B], order[r] = slot served r-th.

    Up to 512 slots a slot's rank is the number of slots ahead of it ([B, B] compares, one fused op): XLA:CPU
    sorts through a compiled comparator, and a three-key sort cost ~2.3x the count at B = 256 (measured, 1000
    calls in a loop). The order is total (the slot breaks ties), so the ranks are a permutation."""
    b = seqs.priority.shape[0]
    b_idx = jnp.arange(b, dtype=i32)
    if b > _RANK_BY_COUNTING:
        return jnp.lexsort((b_idx, seqs.arrival, seqs.priority)).astype(i32)
    p, a = seqs.priority, seqs.arrival
    ahead = (p[:, None] < p[None, :]) | ((p[:, None] == p[None, :]) & (
        (a[:, None] < a[None, :]) | ((a[:, None] == a[None, :]) & (b_idx[:, None] < b_idx[None, :]))))
    rank = jnp.sum(ahead, axis=0, dtype=i32)  # rank[j]: slots i ahead of slot j
    return jnp.zeros((b,), i32).at[rank].set(b_idx, unique_indices=True)


def draft_lengths(seqs: SeqTable, knobs: Knobs, policy: Policy, reach: tuple[int, ...] | None = None) -> jax.Array:
    """int32[B] drafts each sequence would propose (before memory and room limits).

    Fixed: knobs.draft_len. Adaptive: the smallest draft bucket whose reach (`SchedulerConfig.draft_reach`;
    for a chain the bucket itself) is >= round(1.5 * mean accepted count) of the request's histogram, which
    holds one prior observation of full acceptance (so a new request starts at the largest bucket). Drafting
    half again the expected accepted length keeps the chance of extra tokens without paying for K - a rejected
    slots every step; a request whose drafts keep failing drops to 0 (no speculation).
    """
    k_max = jnp.clip(knobs.draft_len, 0, policy.draft_len).astype(i32)
    if not policy.speculation:
        return jnp.zeros(seqs.num_tokens.shape, i32)
    if not policy.adaptive_draft_len:
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


# -------------------------------------------------------------------------------------------- schedule


@functools.partial(jax.jit, static_argnames=("cfg",))
def schedule_unchecked(st: SchedState, knobs: Knobs, *, cfg: SchedulerConfig) -> tuple[SchedState, Batch]:
    ccfg, pol = cfg.cache, cfg.policy
    spec = pol.spec_config()
    s, m, b = ccfg.block_size, ccfg.max_blocks_per_seq, ccfg.max_seqs
    b_idx = jnp.arange(b, dtype=i32)

    # 0. Finished requests release their blocks.
    seqs = st.seqs
    done = seqs.status == FINISHED
    alloc, _ = allocator.free_unchecked(st.alloc, done, cfg=ccfg, spec=spec)
    status = jnp.where(done, EMPTY, seqs.status).astype(jnp.int8)
    seqs = seqs.replace(status=status, request_id=jnp.where(done, -1, seqs.request_id))

    order = priority_order(seqs)
    rank = rank_of(order)
    blocks = alloc.blocks
    c, held, table = alloc.seqs.num_committed, alloc.seqs.num_blocks, alloc.seqs.block_table
    n = seqs.num_tokens
    running = status == RUNNING
    remaining = jnp.where(running, n - c, 0)
    chunk = jnp.minimum(remaining, cfg.chunk)

    # 1. Draft lengths: decode drafts, bounded by the output room (the bonus token comes on top) and the table.
    k_max = jnp.clip(knobs.draft_len, 0, pol.draft_len).astype(i32)
    # Knobs are data (a vmapped sweep checks none of them at the boundary): a ratio outside [0, 1], or NaN, would
    # let drafts claim blocks the allocator then refuses, so it is clamped here (NaN -> 0, no opportunistic drafts).
    spec_ratio = jnp.where(knobs.max_spec_ratio >= 0, jnp.minimum(knobs.max_spec_ratio, 1), 0).astype(jnp.float32)
    out_room = seqs.max_new_tokens - (n - seqs.prompt_len) - 1
    k_dec = jnp.clip(jnp.minimum(draft_lengths(seqs, knobs, pol, cfg.reach), out_room), 0, cfg.max_len - n)
    decoding = decoding_rows(status, n, c, seqs.prompt_len)
    k_dec = jnp.where(decoding, k_dec, 0)
    k_dec = jnp.minimum(k_dec, verify_cap(decoding, knobs))
    reserve = k_max if (pol.speculation and pol.spec_in_prefill) else jnp.zeros((), i32)
    k_res = jnp.where(running & (remaining > 1), jnp.clip(reserve, 0, cfg.max_len - c - chunk), 0)
    k_want = k_dec + k_res

    # 2. Token budget in priority order: the chunk first, then the draft slots.
    tok_before = _in_order(chunk + k_want, order, rank) - (chunk + k_want)
    tok_left = cfg.token_budget - tok_before
    q = jnp.clip(tok_left, 0, chunk)
    d = jnp.where((q == chunk) & (q > 0), jnp.clip(tok_left - q, 0, k_want), 0)

    # Blocks each running sequence needs: for its tokens (+ a copy-on-write), then for its draft slots.
    partial = table[b_idx, jnp.clip(c // s, 0, m - 1)]
    cow = running & (q > 0) & (c % s != 0) & (blocks.ref_count[partial] > 1)
    need_q = jnp.where(q > 0, jnp.maximum(cdiv(c + q, s) - held, 0) + cow.astype(i32), 0)
    need_d = jnp.where(q > 0, jnp.maximum(cdiv(c + q + d, s) - held, 0) + cow.astype(i32), 0) - need_q
    need_a = need_q + need_d if pol.drafts_preempt else need_q

    # 3. Preemption: the fewest victims, in victim-rule order, that make the mandatory need fit.
    evictable = blocks.cached & (blocks.ref_count == 0)
    free_now = blocks.free_top + (blocks.pool_top if pol.spec_pool else 0)
    avail = free_now + jnp.sum(evictable, dtype=i32)
    col = jnp.arange(m, dtype=i32)[None, :]
    total = jnp.sum(need_a, dtype=i32)

    def victims(_):
        in_table = col < held[:, None]
        freed = jnp.sum(in_table & (blocks.ref_count[table] == 1), axis=1, dtype=i32)  # blocks a victim gives back
        key = cfg.victim_rule(rank, c, held).astype(i32)
        vorder = jnp.lexsort((-rank, key, ~running)).astype(i32)  # running first, by key, then lower priority
        fits = total - jnp.cumsum(need_a[vorder], dtype=i32) <= avail + jnp.cumsum(freed[vorder], dtype=i32)
        fits = jnp.concatenate([(total <= avail)[None], fits])  # fits[j]: preempting the first j victims suffices
        return jnp.argmax(fits).astype(i32), vorder, rank_of(vorder)

    # Most steps fit without preempting anyone: the victim order (a sort) is needed only when they do not.
    num_victims, vorder, vrank = vmap_flow.cond(total <= avail, lambda _: (jnp.zeros((), i32), b_idx, b_idx), victims,
                                             None)
    victim = running & (vrank < num_victims)
    oom = num_victims > 0

    # Swap a victim when the policy says so and the host tier has room (in victim order), else recompute.
    swap_len = jnp.where(victim, c, 0)
    if pol.preemption == "swap" and cfg.swap_blocks > 0:
        swap_need = cdiv(swap_len, s)
        room = cfg.swap_blocks - st.swap_used
        swap = victim & (c > 0) & (_in_order(swap_need, vorder, vrank) <= room)
    else:
        swap = jnp.zeros((b,), bool)
    swap_need = jnp.where(swap, cdiv(swap_len, s), 0)
    swap_out_blocks = jnp.where(swap[:, None] & (col < swap_need[:, None]), table, NULL_BLOCK)
    alloc, _ = allocator.free_unchecked(alloc, victim, cfg=ccfg, spec=spec)
    recompute = victim & ~swap
    status = jnp.where(swap, SWAPPED, jnp.where(recompute, WAITING, status)).astype(jnp.int8)
    keep = running & ~victim
    q, d = jnp.where(keep, q, 0), jnp.where(keep, d, 0)
    need_q, need_d = jnp.where(keep, need_q, 0), jnp.where(keep, need_d, 0)
    cow = cow & keep

    blocks = alloc.blocks
    free_now = blocks.free_top + (blocks.pool_top if pol.spec_pool else 0)
    evictable = blocks.cached & (blocks.ref_count == 0)
    avail = free_now + jnp.sum(evictable, dtype=i32)
    need_total = jnp.sum(need_q, dtype=i32)

    # 4. Opportunistic drafts: within max_spec_ratio of the free blocks left, in priority order.
    if not pol.drafts_preempt:
        cap = jnp.floor(spec_ratio * jnp.maximum(free_now - need_total, 0).astype(jnp.float32))
        granted = (need_d == 0) | (_in_order(need_d, order, rank) <= cap.astype(i32))
        d = jnp.where(granted, d, 0)
        need_d = jnp.where(granted, need_d, 0)
    need_total = need_total + jnp.sum(need_d, dtype=i32)
    num_running = jnp.sum(keep, dtype=i32)

    # 5a. Swapped sequences come back first, in priority order, while blocks and batch slots allow.
    swapped = (status == SWAPPED) & ~swap & ~oom
    restore = jnp.where(swapped, cdiv(seqs.swapped_len, s), 0)
    fit_in = (_in_order(restore, order, rank) <= avail - need_total) & (
        _in_order(swapped.astype(i32), order, rank) <= cfg.max_running - num_running)
    swap_in = swapped & (_in_order((swapped & ~fit_in).astype(i32), order, rank) == 0)
    need_total = need_total + jnp.sum(jnp.where(swap_in, restore, 0), dtype=i32)
    num_running = num_running + jnp.sum(swap_in, dtype=i32)
    still_swapped = jnp.any((status == SWAPPED) & ~swap_in)

    # 5b. Admission: the first A waiting sequences in priority order, with their prefix hits.
    a = cfg.window
    waiting_ranked = (status == WAITING)[order]
    pos = jnp.nonzero(waiting_ranked, size=a, fill_value=b)[0]
    cand = jnp.where(pos < b, order[jnp.clip(pos, 0, b - 1)], b)  # int32[A] slots, b = none
    real = (cand < b) & ~oom & ~still_swapped
    cs = jnp.clip(cand, 0, b - 1)
    cand_tokens = seqs.tokens[cs]  # [A, L]
    cand_len = jnp.where(real, n[cs], 0)
    if pol.prefix_cache:
        window = jnp.full((a,), k_max if (pol.prefix_barrier and pol.speculation) else 0, i32)
        ratio = spec_ratio

        def look(_):
            hit = pc.lookup_unchecked(st.prefix, cand_tokens, cand_len, window, ratio, cfg=cfg.prefix)
            return hit.num_blocks, hit.block_ids

        # Most decode steps admit nobody: skip the hashing (the branches only read the table, so no copy).
        hit_blocks, hit_ids = vmap_flow.cond(jnp.any(real), look, lambda _: (jnp.zeros((a,), i32),
                                                                           jnp.zeros((a, m), i32)), None)
        hit_blocks = jnp.where(real, hit_blocks, 0)
    else:
        hit_blocks, hit_ids = jnp.zeros((a,), i32), jnp.zeros((a, m), i32)
    h = hit_blocks * s
    a_chunk = jnp.minimum(cand_len - h, cfg.chunk)
    a_res = jnp.where(cand_len - h > 1, reserve, 0) if pol.spec_in_prefill else jnp.zeros((a,), i32)
    a_res = jnp.clip(a_res, 0, cfg.max_len - h - a_chunk)
    budget_left = cfg.token_budget - jnp.sum(q + d, dtype=i32)
    a_before = jnp.cumsum(a_chunk + a_res, dtype=i32) - (a_chunk + a_res)
    a_left = budget_left - a_before
    a_q = jnp.clip(a_left, 0, a_chunk)
    a_d = jnp.where(a_q == a_chunk, jnp.clip(a_left - a_q, 0, a_res), 0)
    a_need = cdiv(h + a_q + a_d, s) - hit_blocks
    hcol = jnp.arange(m, dtype=i32)[None, :] < hit_blocks[:, None]
    hit_evictable = jnp.sum(hcol & evictable[hit_ids], axis=1, dtype=i32)  # stop being available once shared
    fit = real & (a_q > 0) & (jnp.cumsum(a_need + hit_evictable, dtype=i32) <= avail - need_total) & (
        jnp.cumsum(real.astype(i32), dtype=i32) <= cfg.max_running - num_running)
    admit = jnp.cumprod(fit.astype(i32)).astype(bool)  # stop at the first that does not fit
    dst = jnp.where(admit, cand, b)
    admitted = jnp.zeros((b,), bool).at[dst].set(True, mode="drop")
    share_tokens = jnp.zeros((b,), i32).at[dst].set(h, mode="drop")
    share_ids = jnp.zeros((b, m), i32).at[dst].set(hit_ids, mode="drop")
    # Sharing nothing changes nothing; most steps admit no prefix hit.
    alloc = vmap_flow.when(jnp.any(share_tokens > 0),
                        lambda alloc: allocator.share_unchecked(alloc, share_ids, share_tokens, cfg=ccfg)[0], alloc,
                        identity_when_false=True)
    q = q.at[dst].set(a_q, mode="drop")
    d = d.at[dst].set(a_d, mode="drop")
    need_total = need_total + jnp.sum(jnp.where(admit, a_need, 0), dtype=i32)
    status = jnp.where(admitted | swap_in, RUNNING, status).astype(jnp.int8)

    # 6. Evict the shortfall (LRU cached blocks), drop their index entries, then allocate for everyone.
    blocks = alloc.blocks
    shortfall = jnp.maximum(need_total - (blocks.free_top + (blocks.pool_top if pol.spec_pool else 0)), 0)
    prefix = st.prefix

    def evict(operand):
        alloc, prefix = operand
        alloc, ids = allocator.evict_lru_unchecked(alloc, shortfall, max_evict=ccfg.usable_blocks)
        prefix, removed = pc.remove_unchecked(prefix, ids, cfg=cfg.prefix)
        return _unpin(alloc, removed.descendants), prefix

    alloc, prefix = vmap_flow.when(shortfall > 0, evict, (alloc, prefix))

    restore_tokens = jnp.where(swap_in, seqs.swapped_len, 0)
    alloc, res = _allocate_two_pass(alloc, q + restore_tokens, jnp.zeros((), i32), order, cfg, speculative=False)
    spec_ok = jnp.ones((b,), bool)
    if pol.speculation:
        alloc, sres = _allocate_two_pass(alloc, d, st.step, order, cfg, speculative=True)
        spec_ok = sres.ok

    seqs = seqs.replace(
        status=status,
        swapped_len=jnp.where(swap, swap_len, jnp.where(swap_in, 0, seqs.swapped_len)),
        num_preemptions=seqs.num_preemptions + victim.astype(i32),
        num_cached=seqs.num_cached + share_tokens,
    )
    ct = st.counters
    counters = ct.replace(
        oom_steps=ct.oom_steps + oom.astype(i32),
        preempt_recompute=ct.preempt_recompute + jnp.sum(recompute, dtype=i32),
        preempt_swap=ct.preempt_swap + jnp.sum(swap, dtype=i32),
        swap_ins=ct.swap_ins + jnp.sum(swap_in, dtype=i32),
        admitted=ct.admitted + jnp.sum(admitted, dtype=i32),
        prompt_tokens=ct.prompt_tokens + jnp.sum(jnp.where(admitted, n, 0), dtype=i32),
        cached_tokens=ct.cached_tokens + jnp.sum(share_tokens, dtype=i32),
    )
    swap_used = st.swap_used + jnp.sum(swap_need, dtype=i32) - jnp.sum(jnp.where(swap_in, restore, 0), dtype=i32)
    c_now = alloc.seqs.num_committed
    is_decode = (status == RUNNING) & (n - c_now == 1)
    batch = Batch(
        scheduled=q > 0,
        start=c_now,
        num_query=q,
        num_drafts=jnp.where(is_decode, d, 0),
        num_reserved=jnp.where(is_decode, 0, d),
        samples=(q > 0) & (c_now + q == n),
        block_table=alloc.seqs.block_table,
        cow_src=res.cow_src,
        cow_dst=res.cow_dst,
        swap_out=swap,
        swap_out_blocks=swap_out_blocks,
        swap_in=swap_in,
        restore=restore_tokens,
        preempted=recompute,
        admitted=admitted,
        hit_tokens=share_tokens,
        oom=oom,
        num_tokens=jnp.sum(q + d, dtype=i32),
        blocks_used=ccfg.usable_blocks - alloc.blocks.free_top,
        spec_blocks=jnp.sum((alloc.blocks.state == SPECULATIVE) | (alloc.blocks.state == STALE), dtype=i32),
        cached_idle=jnp.sum(alloc.blocks.cached & (alloc.blocks.ref_count == 0), dtype=i32),
        alloc_ok=jnp.all(res.ok) & jnp.all(spec_ok),
    )
    st = st.replace(alloc=alloc, prefix=prefix, seqs=seqs, counters=counters, swap_used=swap_used)
    return st, batch


# ---------------------------------------------------------------------------------------------- update


def _pin(alloc: AllocatorState, ids: jax.Array) -> AllocatorState:
    """Mark the newly indexed blocks ids int32[X] (NULL_BLOCK = none) cached; most steps index none, and
    pinning nothing changes nothing, so the pass over them is skipped then."""
    return vmap_flow.when(jnp.any(ids > 0), lambda alloc: allocator.set_cached_unchecked(alloc, ids, ids > 0), alloc,
                       identity_when_false=True)


def _index_rows(prefix: pc.PrefixCache, tokens: jax.Array, lengths: jax.Array, table: jax.Array, sel: jax.Array,
                cfg: SchedulerConfig) -> tuple[pc.PrefixCache, jax.Array]:
    """Index the full blocks of the rows `sel` (int32[R] slots, live ones first, B = padding): their first
    lengths[b] tokens of tokens int32[B, L], held in table int32[B, M]. Returns (prefix, ids int32[R, M]), the
    block ids newly indexed per selected row (NULL_BLOCK elsewhere).

    A step usually has far fewer rows to index than R, and the insert's cost is per row, whether live or not.
    So it runs on the first R/4 rows when no more are live (skipped when none are): the rows left out are
    padding, which an insert ignores, so the table, the ids and the counters are the same as over all R.
    Under vmap, R/4 only when no lane has more live rows (`vmap_flow.all_lanes`); all R is right for every lane.
    """
    b, r = tokens.shape[0], sel.shape[0]
    count = jnp.sum(sel < b, dtype=i32)

    def insert(n):
        def run(prefix):
            s = sel[:n]
            live, rows = s < b, jnp.clip(s, 0, b - 1)
            prefix, res = pc.insert_unchecked(prefix, tokens[rows], jnp.where(live, lengths[rows], 0), table[rows],
                                     cfg=cfg.prefix)
            return prefix, jnp.pad(res.block_ids, ((0, r - n), (0, 0)), constant_values=NULL_BLOCK)
        return run

    small = r // 4
    if small == 0:
        return insert(r)(prefix)
    # Two one-trip loops, not a `cond`: a cond's branches would each copy the table they update. In a vmapped
    # sweep every lane takes the same size (the R/4 one only if it fits every lane), so one insert runs, not two;
    # a lane with no row to index inserts only padding, an identity, so no lane selects (copies) its table.
    few = vmap_flow.all_lanes(count <= small)
    x = (prefix, jnp.full((r, cfg.cache.max_blocks_per_seq), NULL_BLOCK, i32))
    x = vmap_flow.when((count > 0) & few, lambda x: insert(small)(x[0]), x, identity_when_false=True)
    return vmap_flow.when((count > 0) & ~few, lambda x: insert(r)(x[0]), x, identity_when_false=True)


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
    """`update` inside jit. view_tokens int32[B, K]: the draft tokens in the order the forward pass placed them in
    the cache (a draft tree's slot order; default draft_tokens, a chain), which on-fill indexing hashes; the
    accepted ones are draft_tokens[:accepted], moved into place by the caller."""
    ccfg, pol = cfg.cache, cfg.policy
    s, m, L, k = ccfg.block_size, ccfg.max_blocks_per_seq, cfg.max_len, pol.draft_len
    b = ccfg.max_seqs
    b_idx = jnp.arange(b, dtype=i32)
    seqs, alloc, prefix = st.seqs, st.alloc, st.prefix
    # A row aborted since `schedule` (no longer RUNNING) has lost its blocks: its batch.block_table row names
    # freed blocks, which must never be indexed or committed. Drop it.
    live = seqs.status == RUNNING
    batch = batch.replace(scheduled=batch.scheduled & live, samples=batch.samples & live,
                          num_query=jnp.where(live, batch.num_query, 0),
                          num_drafts=jnp.where(live, batch.num_drafts, 0), restore=jnp.where(live, batch.restore, 0))
    n, c = seqs.num_tokens, batch.start
    sampling = batch.samples
    acc = jnp.where(sampling, jnp.clip(accepted, 0, batch.num_drafts), 0).astype(i32)

    # On-fill indexing (the naive integration): every full block of computed tokens, drafts included, is
    # indexed before verification; entries whose block then holds a rejected draft are rolled back below.
    computed = c + batch.num_query + batch.num_drafts
    # Rows that filled a block this step wait to be indexed; up to R of them (slot order) are, per step.
    on_fill = pol.prefix_cache and pol.insert == "on_fill"
    filled_to = jnp.where(batch.scheduled, computed if on_fill else c + batch.num_query + acc, c) + batch.restore
    pending = seqs.index_pending | (filled_to // s > c // s)
    sel = jnp.nonzero(pending, size=cfg.rows_indexed, fill_value=b)[0]  # int32[R], b = none
    rows = jnp.clip(sel, 0, b - 1)
    pending = pending.at[sel].set(False, mode="drop")
    if on_fill:
        kk = jnp.arange(max(k, 1), dtype=i32)[None, :]
        dpos = jnp.where(kk < batch.num_drafts[:, None], n[:, None] + kk, L)
        view_tokens = draft_tokens if view_tokens is None else view_tokens
        view = seqs.tokens.at[b_idx[:, None], dpos].set(view_tokens[:, : max(k, 1)], mode="drop")
        prefix, filled_ids = _index_rows(prefix, view, filled_to, batch.block_table, sel, cfg)

    commit = jnp.where(batch.scheduled, batch.num_query + acc, 0) + batch.restore
    alloc = _commit_two_pass(alloc, commit, cfg)
    c_new = alloc.seqs.num_committed

    # The new tokens: the a accepted drafts, then the target's token after them.
    new = jnp.where(sampling, acc + 1, 0)
    j = jnp.arange(k + 1, dtype=i32)[None, :]
    out_tokens = jnp.where(j == acc[:, None], next_tokens[:, None],
                           jnp.pad(draft_tokens, ((0, 0), (0, k + 1 - draft_tokens.shape[1]))))
    tpos = jnp.where(j < new[:, None], n[:, None] + j, L)
    tokens = seqs.tokens.at[b_idx[:, None], tpos].set(out_tokens, mode="drop")
    n_new = n + new
    running = seqs.status == RUNNING
    finished = running & sampling & (stop | (n_new - seqs.prompt_len >= seqs.max_new_tokens) | (n_new >= L))

    if on_fill:
        ids = filled_ids
        # A block indexed from the view is valid only up to where the view agrees with the committed tokens (a
        # tree's accepted path can differ from its slot order; for a chain the two agree on every accepted draft).
        c_valid = c_new
        if view_tokens is not None:
            same = view_tokens[:, : max(k, 1)] == draft_tokens[:, : max(k, 1)]
            agree = jnp.minimum(count_leading(same, axis=1), acc)
            c_valid = c_new - (acc - agree)
        stale = (ids > 0) & ((jnp.arange(m, dtype=i32)[None, :] + 1) * s > c_valid[rows][:, None])

        # Most steps index no stale block: skip the table-wide removal and the sort over its slots then
        # (removing nothing changes nothing; the order remove, pin, unpin is kept).
        def remove_stale(operand):
            prefix, _ = operand
            prefix, removed = pc.remove_unchecked(prefix, jnp.where(stale, ids, 0).reshape(-1), cfg=cfg.prefix)
            return prefix, removed.descendants

        no_descendants = jnp.zeros((cfg.prefix.capacity,), i32)
        prefix, descendants = vmap_flow.when(jnp.any(stale), remove_stale, (prefix, no_descendants))
        kept = jnp.where(stale, 0, ids).reshape(-1)
        alloc = _pin(alloc, kept)
        alloc = vmap_flow.when(jnp.any(descendants > 0), lambda alloc: _unpin(alloc, descendants), alloc)
    elif pol.prefix_cache:
        prefix, ids = _index_rows(prefix, tokens, c_new, alloc.seqs.block_table, sel, cfg)
        ids = ids.reshape(-1)
        alloc = _pin(alloc, ids)

    if pol.spec_pool:
        alloc, _ = allocator.reclaim_expired_unchecked(alloc, st.step, knobs.generation_threshold)

    verified = sampling & (batch.num_drafts > 0)
    hist = seqs.accept_hist.at[jnp.where(verified, b_idx, b), acc].add(1, mode="drop")
    seqs = seqs.replace(
        status=jnp.where(finished, FINISHED, seqs.status).astype(jnp.int8),
        tokens=tokens, num_tokens=n_new, accept_hist=hist, index_pending=pending,
    )
    ct = st.counters
    counters = ct.replace(
        steps=ct.steps + 1,
        finished=ct.finished + jnp.sum(finished, dtype=i32),
        drafted=ct.drafted + jnp.sum(batch.num_drafts, dtype=i32),
        accepted=ct.accepted + jnp.sum(acc, dtype=i32),
        verifications=ct.verifications + jnp.sum(verified, dtype=i32),
        output_tokens=ct.output_tokens + jnp.sum(new, dtype=i32),
    )
    st = st.replace(alloc=alloc, prefix=prefix, seqs=seqs, counters=counters, step=st.step + 1)
    return st, StepResult(num_new=new, finished=finished, accepted=acc)


# ------------------------------------------------------------------------------------------ add / abort


@functools.partial(jax.jit, static_argnames=("cfg",))
def add_unchecked(st, prompts, prompt_len, max_new, priority, request_id, *, cfg: SchedulerConfig):
    b = cfg.cache.max_seqs
    seqs = st.seqs
    # A row that breaks add's rules (checked at the boundary when concrete) is padding here, never a sequence
    # that could outgrow its table.
    fits = (prompt_len <= prompts.shape[1]) & (max_new >= 1) & (max_new <= cfg.max_len - prompt_len)
    valid = (prompt_len > 0) & fits
    empty = seqs.status == EMPTY
    free_slots = jnp.nonzero(empty, size=b, fill_value=b)[0]
    rank = jnp.cumsum(valid, dtype=i32) - 1
    slot = jnp.where(valid & (rank < jnp.sum(empty, dtype=i32)), free_slots[jnp.clip(rank, 0, b - 1)], b)
    placed = slot < b
    arrival = st.next_arrival + rank
    prompts = jnp.pad(prompts, ((0, 0), (0, cfg.max_len - prompts.shape[1])))
    prompts = jnp.where(jnp.arange(cfg.max_len)[None, :] < prompt_len[:, None], prompts, 0)
    z = jnp.zeros_like(prompt_len)
    seqs = seqs.replace(
        status=seqs.status.at[slot].set(WAITING, mode="drop"),
        tokens=seqs.tokens.at[slot].set(prompts, mode="drop"),
        num_tokens=seqs.num_tokens.at[slot].set(prompt_len, mode="drop"),
        prompt_len=seqs.prompt_len.at[slot].set(prompt_len, mode="drop"),
        max_new_tokens=seqs.max_new_tokens.at[slot].set(max_new, mode="drop"),
        priority=seqs.priority.at[slot].set(priority, mode="drop"),
        arrival=seqs.arrival.at[slot].set(arrival, mode="drop"),
        request_id=seqs.request_id.at[slot].set(request_id, mode="drop"),
        swapped_len=seqs.swapped_len.at[slot].set(z, mode="drop"),
        num_preemptions=seqs.num_preemptions.at[slot].set(z, mode="drop"),
        num_cached=seqs.num_cached.at[slot].set(z, mode="drop"),
        accept_hist=seqs.accept_hist.at[slot].set(0, mode="drop"),
        index_pending=seqs.index_pending.at[slot].set(False, mode="drop"),
    )
    st = st.replace(seqs=seqs, next_arrival=st.next_arrival + jnp.sum(placed, dtype=i32))
    return st, jnp.where(placed, slot, -1)


@functools.partial(jax.jit, static_argnames=("cfg",))
def abort_unchecked(st: SchedState, mask: jax.Array, *, cfg: SchedulerConfig) -> SchedState:
    seqs = st.seqs
    live = mask & (seqs.status != EMPTY)
    alloc, _ = allocator.free_unchecked(st.alloc, live, cfg=cfg.cache, spec=cfg.policy.spec_config())
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
    return st.replace(alloc=alloc, seqs=seqs, swap_used=swap_used, counters=counters)


# ------------------------------------------------------------------- public API (validated at the boundary)


def _check_state(st: SchedState, cfg: SchedulerConfig) -> None:
    if not isinstance(cfg, SchedulerConfig):
        raise TypeError(f"cfg must be a SchedulerConfig, got {type(cfg).__name__}")
    if not isinstance(st, SchedState):
        raise TypeError(f"st must be a SchedState, got {type(st).__name__}")
    allocator.check_state(st.alloc, cfg.cache)
    checks.array("st.seqs.tokens", st.seqs.tokens, (cfg.cache.max_seqs, cfg.max_len), "i")


def _check_knobs(knobs: Knobs, cfg: SchedulerConfig) -> None:
    if not isinstance(knobs, Knobs):
        raise TypeError(f"knobs must be a Knobs (policy.knobs()), got {type(knobs).__name__}")
    checks.scalar_int("knobs.draft_len", knobs.draft_len)
    checks.in_range("knobs.draft_len", knobs.draft_len, 0, cfg.policy.draft_len)
    if getattr(knobs.max_spec_ratio, "shape", ()) != ():
        raise ValueError(f"knobs.max_spec_ratio must be a scalar (vmap to sweep it), got shape "
                         f"{knobs.max_spec_ratio.shape}")
    checks.in_range("knobs.max_spec_ratio", knobs.max_spec_ratio, 0, 1)
    checks.scalar_int("knobs.generation_threshold", knobs.generation_threshold)
    checks.in_range("knobs.generation_threshold", knobs.generation_threshold, 0, 2**31 - 1)
    checks.scalar_int("knobs.verify_budget", knobs.verify_budget)
    checks.in_range("knobs.verify_budget", knobs.verify_budget, 1, NO_VERIFY_CAP)


def add(
    st: SchedState,
    prompts: jax.Array,
    prompt_len: jax.Array,
    max_new_tokens: jax.Array,
    priority: jax.Array | None = None,
    request_id: jax.Array | None = None,
    *,
    cfg: SchedulerConfig,
) -> tuple[SchedState, jax.Array]:
    """Queue requests as WAITING in EMPTY slots (lowest slots first, arrival numbers in row order).

    prompts: int32[A, Lp] (Lp <= L = M * S, padded); prompt_len: int32[A], 0 = padding row; max_new_tokens,
    priority, request_id: int32[A]. A request needs prompt_len + max_new_tokens <= L. Returns the state and
    int32[A] slots (-1: padding, or no EMPTY slot left -- keep it queued and add it again later). A padding
    row's max_new_tokens is ignored. Inside a user's jit a row that breaks these rules is treated as padding.
    """
    _check_state(st, cfg)
    if not hasattr(prompts, "shape") or len(prompts.shape) != 2:
        raise ValueError(f"prompts must be a 2-D [A, Lp] array, got shape {getattr(prompts, 'shape', None)}")
    a, lp = prompts.shape
    if lp > cfg.max_len:
        raise ValueError(f"prompts has {lp} columns; a request holds at most L = {cfg.max_len} tokens")
    checks.array("prompts", prompts, (a, lp), "i")
    priority = jnp.zeros((a,), i32) if priority is None else priority
    request_id = jnp.arange(a, dtype=i32) if request_id is None else request_id
    for name, x in (("prompt_len", prompt_len), ("max_new_tokens", max_new_tokens), ("priority", priority),
                    ("request_id", request_id)):
        checks.array(name, x, (a,), "i")
    checks.in_range("prompt_len", prompt_len, 0, lp)
    if checks.is_concrete(prompt_len) and checks.is_concrete(max_new_tokens):
        checks.in_range("max_new_tokens", np.asarray(max_new_tokens)[np.asarray(prompt_len) > 0], 1, cfg.max_len)
        total = np.asarray(prompt_len) + np.asarray(max_new_tokens)
        bad = (np.asarray(prompt_len) > 0) & (total > cfg.max_len)
        if bad.any():
            r = int(np.nonzero(bad)[0][0])
            raise ValueError(f"request {r}: prompt_len + max_new_tokens = {total[r]} exceeds L = {cfg.max_len} "
                             f"tokens per sequence (max_blocks_per_seq * block_size)")
    return add_unchecked(st, jnp.asarray(prompts, i32), jnp.asarray(prompt_len, i32), jnp.asarray(max_new_tokens, i32),
                jnp.asarray(priority, i32), jnp.asarray(request_id, i32), cfg=cfg)


def schedule(st: SchedState, knobs: Knobs | None = None, *, cfg: SchedulerConfig) -> tuple[SchedState, Batch]:
    """Decide and allocate one step's batch (see the module docstring). knobs default: cfg.policy.knobs()."""
    _check_state(st, cfg)
    knobs = cfg.policy.knobs() if knobs is None else knobs
    _check_knobs(knobs, cfg)
    return schedule_unchecked(st, knobs, cfg=cfg)


def update(
    st: SchedState,
    batch: Batch,
    accepted: jax.Array,
    next_tokens: jax.Array,
    draft_tokens: jax.Array | None = None,
    stop: jax.Array | None = None,
    knobs: Knobs | None = None,
    *,
    cfg: SchedulerConfig,
) -> tuple[SchedState, StepResult]:
    """Settle the step `batch` after the model ran.

    For each row that samples (batch.samples): accepted: int32[B] the length of the accepted prefix of its drafts
    (clipped to [0, num_drafts]); draft_tokens: int32[B, max(K, 1)] the drafts it proposed; next_tokens: int32[B]
    the target's token after the accepted prefix. The row gains accepted + 1 tokens: draft_tokens[:accepted],
    then next_tokens. stop: bool[B] (e.g. EOS sampled) finishes the row. Returns the state and what happened.
    batch must be the one `schedule` returned with this state: settled twice, a row would gain tokens no model
    computed. Checked when both are concrete (a scheduled row starts at its committed length); inside a user's
    jit that pairing is the caller's. A row aborted between schedule and update is dropped: it gains nothing.
    """
    _check_state(st, cfg)
    if not isinstance(batch, Batch):
        raise TypeError(f"batch must be the Batch returned by schedule, got {type(batch).__name__}")
    committed = st.alloc.seqs.num_committed
    if checks.is_concrete(batch.start) and checks.is_concrete(committed):
        running = np.asarray(st.seqs.status) == RUNNING  # rows aborted since schedule are dropped, not stale
        stale = np.asarray(batch.scheduled) & running & (np.asarray(batch.start) != np.asarray(committed))
        if stale.any():
            raise ValueError(f"batch does not belong to this state: row {int(np.argmax(stale))} starts at "
                             f"{int(np.asarray(batch.start)[stale][0])} but has {int(np.asarray(committed)[stale][0])} "
                             f"committed tokens (was it already settled by update?)")
    b, k = cfg.cache.max_seqs, cfg.policy.draft_len
    checks.array("accepted", accepted, (b,), "i")
    checks.array("next_tokens", next_tokens, (b,), "i")
    draft_tokens = jnp.zeros((b, max(k, 1)), i32) if draft_tokens is None else draft_tokens
    checks.array("draft_tokens", draft_tokens, (b, max(k, 1)), "i")
    stop = jnp.zeros((b,), bool) if stop is None else stop
    checks.array("stop", stop, (b,), "b")
    knobs = cfg.policy.knobs() if knobs is None else knobs
    _check_knobs(knobs, cfg)
    return update_unchecked(st, batch, jnp.asarray(accepted, i32), jnp.asarray(next_tokens, i32),
                   jnp.asarray(draft_tokens, i32), stop, knobs, cfg=cfg)


def abort(st: SchedState, mask: jax.Array, *, cfg: SchedulerConfig) -> SchedState:
    """End the requests in mask: bool[B] whatever their status; their blocks and host-tier room are released.

    Safe between `schedule` and `update`: `update` then drops the aborted rows of the batch (their blocks are
    gone, so nothing of theirs is committed or indexed); the model's writes for them land in freed blocks.
    """
    _check_state(st, cfg)
    checks.array("mask", mask, (cfg.cache.max_seqs,), "b")
    return abort_unchecked(st, mask, cfg=cfg)
