"""The scheduler's static configuration, its state pytrees and the step's outputs; `init`.

Statuses of a slot: EMPTY (free), WAITING (queued, or preempted by recompute), RUNNING (in the batch), SWAPPED
(preempted, its committed KV on the host tier), FINISHED (done; its blocks are released at the next schedule).
Field documentation: the shape and dtype of every field, in the glossary's letters (`skvs_jax/__init__.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels import IMPLS
from skvs_jax import checks
from skvs_jax.arrays import i32
from skvs_jax.config import CacheConfig
from skvs_jax.kv import manager
from skvs_jax.kv import prefix_cache as pc
from skvs_jax.policies import Policy
from skvs_jax.victims import VICTIM_RULES, VictimRule, check_custom_rule

EMPTY, WAITING, RUNNING, SWAPPED, FINISHED = 0, 1, 2, 3, 4
STATUS_NAMES = ("EMPTY", "WAITING", "RUNNING", "SWAPPED", "FINISHED")


# ---------------------------------------------------------------------------------------------- config

CONTROL_FLOWS = ("skip", "select", "mixed")
PREFIX_SUMS = ("scan", "dense")
RANK_BY_COUNTING = 512  # up to this many slots, priority order counts instead of sorting (and may go dense)


def default_control_flow() -> str:
    """`SchedulerConfig.control_flow`'s default for the default backend: "skip" on a CPU, where a loop of 0 trips
    costs nothing and the work it skips costs its full time; "select" elsewhere, where each `while` trip and
    `cond` waits for the host (docs/design.md, "Per-backend choices")."""
    return "skip" if jax.default_backend() == "cpu" else "select"


def default_prefix_sums() -> str:
    """`SchedulerConfig.prefix_sums`'s default for the default backend: "scan" on a CPU, "dense" elsewhere."""
    return "scan" if jax.default_backend() == "cpu" else "dense"


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
      victim: None (the default): the policy's rule, named by `Policy.victim` (`skvs_jax.victims`). A function
        (rank, computed, held) -> int32[B] key overrides it: the hook for a custom rule, which has no name to put
        in a policy. A rule's name goes on the policy (`policy.replace(victim=...)`), not here.
      index_rows: R, rows `update` offers to the prefix index per step (default min(B, 64)): those that filled a
        block, in slot order; the others wait for a later step. Indexing hashes whole rows, so R bounds its cost;
        a decode step fills about B * (tokens per step) / S blocks.
      prefix_capacity / prefix_ways: the prefix cache's table (default: `PrefixCacheConfig.for_cache`'s, four
        times the usable blocks, in 8-way buckets).
      impl: the kernels' implementation (`pallas_kernels.IMPLS`) the KV manager's commit runs its block-state
        update with (`KVConfig.impl`); the engine sets it to its own `impl`.
      reach_of: per draft count d in 0..K, the most drafts d slots can accept: a draft tree of d nodes reaches
        only their depth (`serve.speculation.reach`; the engine sets it for a tree). () or a chain (d itself) is
        resolved to this policy's chain at construction. The draft widths are data (`SchedState.draft_widths`),
        so their reach is looked up here, and adaptive draft length compares the expected accepted length with a
        bucket's reach, not its node count.
      control_flow: how the step skips rare work (`vmap_flow`): "skip" (a `cond` or a loop of 0 or 1 trips: the
        work runs only when needed), "select" (the work runs every step and its result is selected: no
        control flow, so no host round trip on XLA:GPU) or "mixed" (select where the work is a few kernels, skip
        the passes over [B, M], [N] or [C]: frees, full-table allocation and commit passes, releases of copied
        blocks, the prefix lookup, removing stale index entries; `skip_costly`). "" (the default) resolves at
        construction from the backend, `default_control_flow()`: "skip" on a CPU, "select" on a GPU or TPU. Set
        it to trace a GPU's program on a CPU (`skvs micro program`). Work that costs more than a round trip keeps
        its skip in all three (eviction, the prefix index's insert). Decisions are the same in all three
        (tests/test_control_flow.py).
      prefix_sums: how prefix sums over rows in priority order are taken (`arrays.prefix_sum`): "scan" (a
        gather, a cumulative sum and a gather back; sorts where an order is needed) or "dense" (masked [B, B] row
        sums and rank counting: no gather, scan or sort, one kernel each on a GPU, B^2 work a CPU pays for). ""
        (the default): "scan" on a CPU, "dense" elsewhere (`default_prefix_sums()`). Dense applies up to
        `RANK_BY_COUNTING` = 512 slots; past that, scans. Decisions are the same in both.
    """

    cache: CacheConfig
    policy: Policy
    max_running: int
    token_budget: int
    prefill_chunk: int = 0
    admit_window: int = 0
    swap_blocks: int = 0
    victim: VictimRule | None = None
    index_rows: int = 0
    prefix_capacity: int | None = None
    prefix_ways: int = 8
    impl: str = "xla"
    reach_of: tuple[int, ...] = ()
    control_flow: str = ""
    prefix_sums: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.cache, CacheConfig):
            raise TypeError(f"cache must be a CacheConfig, got {type(self.cache).__name__}")
        if not isinstance(self.policy, Policy):
            raise TypeError(f"policy must be a Policy, got {type(self.policy).__name__}")
        for name, lo in (("max_running", 1), ("token_budget", 1), ("prefill_chunk", 0), ("admit_window", 0),
                         ("swap_blocks", 0), ("index_rows", 0)):
            checks.at_least(name, getattr(self, name), lo)
        if self.max_running > self.cache.max_seqs:
            raise ValueError(f"max_running ({self.max_running}) cannot exceed cache.max_seqs "
                             f"({self.cache.max_seqs})")
        check_custom_rule(self.victim)
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        k = self.policy.draft_len
        reach = tuple(self.reach_of)
        if reach == tuple(range(len(reach))):  # none given, or a chain (of any K, e.g. after a policy replace)
            reach = tuple(range(k + 1))
        if (any(not checks.is_int(r) for r in reach) or len(reach) != k + 1 or list(reach) != sorted(reach)
                or any(not 0 <= r <= d for d, r in enumerate(reach))):
            raise ValueError(f"reach_of must give, per draft count 0..{k}, a non-decreasing reach <= the count, "
                             f"got {self.reach_of}")
        object.__setattr__(self, "reach_of", tuple(int(r) for r in reach))  # frozen: resolved once, here
        if self.control_flow not in ("",) + CONTROL_FLOWS:
            raise ValueError(f"control_flow must be one of {CONTROL_FLOWS} (or '' for the backend's), got "
                             f"{self.control_flow!r}")
        object.__setattr__(self, "control_flow", self.control_flow or default_control_flow())
        if self.prefix_sums not in ("",) + PREFIX_SUMS:
            raise ValueError(f"prefix_sums must be one of {PREFIX_SUMS} (or '' for the backend's), got "
                             f"{self.prefix_sums!r}")
        object.__setattr__(self, "prefix_sums", self.prefix_sums or default_prefix_sums())

    @property
    def skip(self) -> bool:
        """Whether rare work is skipped by control flow (`control_flow` == "skip") or computed and selected."""
        return self.control_flow == "skip"

    @property
    def skip_costly(self) -> bool:
        """Whether the costly rare passes are skipped by control flow: under "skip" and "mixed"."""
        return self.control_flow != "select"

    @property
    def dense(self) -> bool:
        """Whether prefix sums in priority order are dense (`prefix_sums` == "dense" and B <= 512)."""
        return self.prefix_sums == "dense" and self.cache.max_seqs <= RANK_BY_COUNTING

    @property
    def chunk(self) -> int:
        return self.prefill_chunk or self.token_budget

    @property
    def admit_rows(self) -> int:
        """A, the WAITING rows admission examines per step: `admit_window` resolved (0: min(32, B))."""
        return min(self.admit_window or 32, self.cache.max_seqs)

    @property
    def rows_indexed(self) -> int:
        return min(self.index_rows or 64, self.cache.max_seqs)

    @property
    def victim_rule(self) -> VictimRule:
        """The rule preemption orders victims by: `victim` when set, else the policy's (`Policy.victim`)."""
        return VICTIM_RULES[self.policy.victim] if self.victim is None else self.victim

    @property
    def max_len(self) -> int:
        """M * S: the most tokens (prompt + output) one request can hold."""
        return self.cache.max_tokens_per_seq

    @property
    def prefix(self) -> pc.PrefixCacheConfig:
        return pc.PrefixCacheConfig.for_cache(self.cache, self.prefix_capacity, self.prefix_ways)

    @property
    def kv(self) -> manager.KVConfig:
        """What the KV manager needs: the geometry, the policy's allocator switches, the index, R."""
        return manager.KVConfig(cache=self.cache, spec=self.policy.spec_config(), prefix=self.prefix,
                                rows_indexed=self.rows_indexed, impl=self.impl, skip=self.skip,
                                skip_costly=self.skip_costly)


# ----------------------------------------------------------------------------------------------- state


@struct.dataclass
class SeqTable:
    """Per-slot request state (the allocator keeps the block tables and computed lengths)."""

    status: jax.Array  # int8[B] EMPTY / WAITING / RUNNING / SWAPPED / FINISHED
    tokens: jax.Array  # int32[B, M*S] prompt, then the accepted output tokens; 0 past num_tokens
    num_tokens: jax.Array  # int32[B] known tokens (prompt + outputs)
    prompt_len: jax.Array  # int32[B]
    max_new_tokens: jax.Array  # int32[B] the request finishes when it has produced this many
    priority: jax.Array  # int32[B] lower is served first
    arrival: jax.Array  # int32[B] arrival number (FCFS within a priority)
    request_id: jax.Array  # int32[B] the caller's id, -1 for EMPTY
    swapped_len: jax.Array  # int32[B] committed tokens of a SWAPPED sequence, held by the host tier
    num_preemptions: jax.Array  # int32[B]
    num_cached: jax.Array  # int32[B] prompt tokens served from the prefix cache, summed over admissions
    accept_hist: jax.Array  # int32[B, K+1] verification steps by number of accepted drafts (adaptive draft len)
    draft_tried: jax.Array  # int32[B, K] verifications that reached draft d (d < min(accepted + 1, offered))
    draft_passed: jax.Array  # int32[B, K] of those, verifications that accepted draft d (d < accepted)
    lag: jax.Array  # int32[B] microseconds the row's decoding lost to speculation (`draft_control.record_lag`)
    elapsed: jax.Array  # int32[B] microseconds of its decode steps, as priced (saturating)
    undrafted: jax.Array  # int32[B] consecutive decode steps it went undrafted while other rows drafted
    index_pending: jax.Array  # bool[B] filled a block that `update` has not offered to the prefix index yet
    cache_salt: jax.Array  # int32[B] the request's cache salt (0 = none): it shares blocks only with its own salt
    tpot_target: jax.Array  # int32[B] microseconds per output token the request asks for (0 = none; draft control)


@struct.dataclass
class SchedCounters:
    """Cumulative int32[] scalars."""

    steps: jax.Array  # `update`s
    oom_steps: jax.Array  # steps in which some sequence could not get its blocks without preemption
    preempt_recompute: jax.Array  # preemptions by recompute (blocks released, back to WAITING)
    preempt_swap: jax.Array  # preemptions by swap to the host tier
    swap_ins: jax.Array  # SWAPPED sequences restored
    admitted: jax.Array  # admissions (a recomputed request is admitted again)
    finished: jax.Array
    aborted: jax.Array  # requests ended by `abort` before they finished
    prompt_tokens: jax.Array  # tokens to prefill at admission, before prefix hits
    cached_tokens: jax.Array  # of those, served by prefix hits
    drafted: jax.Array  # draft tokens proposed (decode)
    accepted: jax.Array  # of those, accepted
    verifications: jax.Array  # (sequence, step) pairs that verified >= 1 draft
    output_tokens: jax.Array  # tokens appended by `update` (accepted drafts + the target's token)
    draft_blocks: jax.Array  # new blocks granted to draft slots (decode drafts and prefill reservations)
    oom_steps_drafts: jax.Array  # OOM steps whose query tokens alone would have fit: the drafts caused them
    preempt_drafts: jax.Array  # preemptions (recompute or swap) in those steps: caused by drafts
    first_prompt_tokens: jax.Array  # prompt tokens of first admissions (a recompute re-admission is not one)
    first_cached_tokens: jax.Array  # of those, served by prefix hits: the hit rate a preemption cannot inflate


@struct.dataclass
class SchedState:
    """The whole scheduler: the KV manager's state (pool, tables, prefix index), the request table, counters."""

    kv: manager.KVState  # the allocator and the prefix index (`kv.manager` keeps them consistent)
    seqs: SeqTable  # per-slot request state
    counters: SchedCounters
    step: jax.Array  # int32[] the generation recorded on speculative blocks (one per `update`)
    next_arrival: jax.Array  # int32[] arrival number of the next added request
    swap_used: jax.Array  # int32[] host-tier blocks held by SWAPPED sequences
    pop_tried: jax.Array  # int32[K] the population's draft_tried totals (halved together past POP_HALVE_AT)
    pop_passed: jax.Array  # int32[K] the population's draft_passed totals
    priced: jax.Array  # int32[2] the last scheduled step's time and its time without drafts, as the goodput
    #                    controller prices them (`draft_control.priced_step`; zeros under other policies)
    draft_widths: jax.Array  # int32[widths] the draft widths compiled (sorted, padded with the largest; `buckets`)


@struct.dataclass
class StepCost:
    """A step's time as data, for the goodput draft controller (`policy.draft_control == "goodput"`).

    time(step) = token_us[min(T, len - 1)] + row_us * rows + ctx_ns * context_tokens // 1000 + [drafts > 0] *
    head_us, in microseconds, where T is the tokens the step computes (prefill chunks, decode tokens, draft
    slots), rows the running rows, context_tokens the cached context they read, and head_us the draft heads'
    time when some row drafts. `sim.cost_model.step_cost(cost, t_max)` builds one from a
    `CostModel` (so the simulator's controller and its clock agree); `flat_step_cost` is the default: every
    step costs the same, so drafts are free and only acceptance decides.

    width_us (None, or int32[max_width + 1]): a padded engine's term, + width_us[min(w, max_width)] where w is the
    widest row's tokens (query + drafts), or max_width when the step has prompt work (the engine then runs its widest
    program). An engine computes every slot at the step's compiled width, so its step time is set by the widest row,
    not by the tokens; `serve.step_cost.fit` measures one per compiled width at warm-up. With a width table the
    controller also searches a cap on every row's drafts (a narrower program); None (the simulator's, whose
    clock prices tokens) leaves the search over survival thresholds alone.

    compute_us, mem_us, overlap (None, or int32[T_max + 1], int32[], int32[] in [0, 1024]): a roofline's step, whose
    compute hides under its memory traffic: with them the context term moves inside
        core = C + M - overlap * min(C, M) // 1024,  C = compute_us[T],  M = mem_us + ctx_ns * context_tokens // 1000
    and time = token_us[T] + row_us * rows + [drafts > 0] * head_us + core, token_us then holding only what does
    not overlap (host overhead, all-reduces). The simulator's roofline mode builds one (a decode step of 128 rows
    reading their KV is memory-bound, so drafts that a sum of terms would price are nearly free there).

    margin (None, or int32[] in 1/1024): how uncertain the cost is. Drafts preempt a running row only when that
    beats keeping it by more than this share of the step's goodput (`draft_control.preemption_pays`): a
    preemption cannot be taken back, so a call that the cost's own error could reverse keeps the row. None (the
    simulator's, whose clock is this cost): 0. `serve.step_cost.fit` sets `FIT_MARGIN`, from the run-to-run spread
    of fits measured on a 2-core CPU."""

    token_us: jax.Array  # int32[T_max + 1] time of a one-row step computing t tokens, no context (>= 1)
    row_us: jax.Array  # int32[] time per further running row
    ctx_ns: jax.Array  # int32[] nanoseconds per context token read
    head_us: jax.Array  # int32[] the draft heads' time in a step where some row drafts
    width_us: jax.Array | None = None  # int32[max_width + 1] extra time of a step whose widest row computes w tokens
    compute_us: jax.Array | None = None  # int32[T_max + 1] a roofline's compute time of t tokens (overlapped)
    mem_us: jax.Array | None = None  # int32[] its memory time of a step reading no context (weights)
    overlap: jax.Array | None = None  # int32[] share of min(compute, memory) hidden, in 1/1024
    margin: jax.Array | None = None  # int32[] the cost's uncertainty, in 1/1024 (None: exact)


@struct.dataclass
class Batch:
    """One step's work, fixed-shape over the B slots."""

    scheduled: jax.Array  # bool[B] the slot computes tokens this step
    start: jax.Array  # int32[B] position of its first query token (its committed length)
    num_query: jax.Array  # int32[B] tokens to compute from `tokens` (prefill chunk, or 1 for decode)
    num_drafts: jax.Array  # int32[B] draft tokens to propose and verify after them (decode only)
    num_reserved: jax.Array  # int32[B] draft slots reserved while prefilling (spec_in_prefill); never verified
    samples: jax.Array  # bool[B] the step computes the last known token, so it samples a new one
    block_table: jax.Array  # int32[B, M] tables after allocation
    cow_src: jax.Array  # int32[B] copy block cow_src's KV into cow_dst before the step (NULL_BLOCK: none)
    cow_dst: jax.Array  # int32[B]
    swap_out: jax.Array  # bool[B] preempted by swap this step: copy swap_out_blocks to the host tier first
    swap_out_blocks: jax.Array  # int32[B, M] their committed blocks, NULL_BLOCK-padded (read before any write)
    swap_in: jax.Array  # bool[B] restored: the host copy goes into the first ceil(restore / S) blocks; computes nothing
    restore: jax.Array  # int32[B] committed tokens restored by swap_in
    preempted: jax.Array  # bool[B] recomputed (blocks released, back to WAITING)
    admitted: jax.Array  # bool[B] admitted this step; hit_tokens[B] of them shared from the prefix cache
    hit_tokens: jax.Array  # int32[B]
    oom: jax.Array  # bool[] some sequence could not get its blocks without preemption
    num_tokens: jax.Array  # int32[] tokens computed this step (query + drafts + reserved)
    blocks_used: jax.Array  # int32[] blocks not on the free stack after allocation (null block excluded)
    spec_blocks: jax.Array  # int32[] blocks holding only unvalidated or rejected drafts (SPECULATIVE or STALE)
    cached_idle: jax.Array  # int32[] cached blocks no sequence holds (evictable)
    alloc_ok: jax.Array  # bool[] every allocation succeeded (False would be a scheduler bug; tests check it)


@struct.dataclass
class StepShape:
    """The work of one step, as a model (or a cost model) sees it."""

    prefill_tokens: jax.Array  # int32[] known tokens of rows that do not sample (prompt chunks before the last)
    decode_tokens: jax.Array  # int32[] query tokens of rows that sample: the last chunk or last token, plus draft slots
    kv_tokens_read: jax.Array  # int32[] cached context the attention reads: sum of `start` over scheduled rows
    num_seqs: jax.Array  # int32[] scheduled rows
    drafting_rows: jax.Array  # int32[] rows with draft slots (the draft heads run for them)


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
    """What `update` did."""

    num_new: jax.Array  # int32[B] tokens appended
    finished: jax.Array  # bool[B]
    accepted: jax.Array  # int32[B] accepted drafts


def flat_step_cost(cfg: SchedulerConfig, max_width: int | None = None) -> StepCost:
    """Every step costs the same (1 us): drafts are free, the controller takes every draft worth >= one level.
    max_width: also a width table of zeros, int32[max_width + 1], and a margin of 0 (the structure an engine's
    fitted cost will have, so fitting one replaces data, not the compiled step's); the decisions are the same
    as without."""
    if max_width is None:
        width = margin = None
    else:
        width, margin = jnp.zeros((max_width + 1,), i32), jnp.zeros((), i32)
    return StepCost(token_us=jnp.ones((cfg.token_budget + 1,), i32), row_us=jnp.zeros((), i32),
                    ctx_ns=jnp.zeros((), i32), head_us=jnp.zeros((), i32), width_us=width, margin=margin)


def init(cfg: SchedulerConfig) -> SchedState:
    """Every slot EMPTY, every usable block free, an empty prefix index, counters at 0."""
    b, max_len, k = cfg.cache.max_seqs, cfg.max_len, cfg.policy.draft_len
    zb = jnp.zeros((b,), i32)
    zero = jnp.zeros((), i32)
    seqs = SeqTable(
        status=jnp.zeros((b,), jnp.int8), tokens=jnp.zeros((b, max_len), i32), num_tokens=zb, prompt_len=zb,
        max_new_tokens=zb, priority=zb, arrival=zb, request_id=jnp.full((b,), -1, i32), swapped_len=zb,
        num_preemptions=zb, num_cached=zb, accept_hist=jnp.zeros((b, k + 1), i32),
        draft_tried=jnp.zeros((b, k), i32), draft_passed=jnp.zeros((b, k), i32), lag=zb, elapsed=zb, undrafted=zb,
        index_pending=jnp.zeros((b,), bool),
        cache_salt=jnp.zeros((b,), i32), tpot_target=zb,
    )
    counters = SchedCounters(*([zero] * len(SchedCounters.__dataclass_fields__)))
    widths = cfg.policy.draft_buckets or (k,)
    widths = widths + widths[-1:] * (cfg.policy.width_slots - len(widths))
    return SchedState(kv=manager.init(cfg.kv), seqs=seqs, counters=counters, step=zero, next_arrival=zero,
                      swap_used=zero, pop_tried=jnp.zeros((k,), i32), pop_passed=jnp.zeros((k,), i32),
                      priced=jnp.zeros((2,), i32),
                      draft_widths=jnp.asarray(widths, i32))
