"""The functional scheduler: continuous batching over the KV manager, as pure jitted steps.

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
       and no tokens; an idle cached block they take out of the evictable set is counted once, however many
       share it), each with a chunk of the remaining token budget, stopping at the first that does not fit.
    6. Blocks: the shortfall, if any, is evicted from the idle cached blocks, leaves of the prefix forest
       first, least recently used first (k blocks cost k blocks of hits); stale speculative-pool blocks are
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

Modules: `state` (config, state pytrees, Batch, StepCost, `init`), `schedule` (the schedule phases),
`draft_control` (the goodput draft controller: acceptance estimates, survival, the decision), `buckets` (which
draft widths to compile, chosen from the draft-length histogram; the one snapping rule),
`update` (the update phases, `add`, `abort`), `api` (the checked public transitions). Everything public is
re-exported here: `from skvs_jax import scheduler; scheduler.schedule(...)`, and so are the victim rules
(`skvs_jax.victims`, their one home, below the scheduler so that a `Policy` can name them).
"""

from skvs_jax.scheduler import buckets, draft_control
from skvs_jax.scheduler.api import MAX_TPOT_TARGET_S, abort, add, check_step_cost, schedule, tpot_target_us, update
from skvs_jax.scheduler.schedule import (
    RANK_BY_COUNTING,
    decoding_rows,
    draft_lengths,
    in_order,
    live,
    plan_drafts,
    priority_order,
    prompt_work,
    release_finished,
    schedule_unchecked,
    verify_cap,
    width_bounds,
)
from skvs_jax.scheduler.state import (
    EMPTY,
    FINISHED,
    RUNNING,
    STATUS_NAMES,
    SWAPPED,
    WAITING,
    Batch,
    SchedCounters,
    SchedState,
    SchedulerConfig,
    SeqTable,
    StepCost,
    StepResult,
    StepShape,
    flat_step_cost,
    init,
    step_shape,
)
from skvs_jax.scheduler.update import abort_unchecked, add_unchecked, fork_unchecked, update_unchecked
from skvs_jax.victims import VICTIM_RULES, least_progress, lowest_priority, most_blocks, most_progress

__all__ = [
    "EMPTY", "WAITING", "RUNNING", "SWAPPED", "FINISHED", "STATUS_NAMES", "VICTIM_RULES", "RANK_BY_COUNTING",
    "SchedulerConfig", "SeqTable", "SchedCounters", "SchedState", "Batch", "StepShape", "StepResult", "StepCost",
    "flat_step_cost", "check_step_cost", "draft_control", "buckets", "tpot_target_us", "MAX_TPOT_TARGET_S",
    "init", "add", "schedule", "update", "abort", "step_shape", "live", "priority_order", "in_order", "draft_lengths",
    "decoding_rows", "verify_cap", "plan_drafts", "prompt_work", "lowest_priority", "least_progress", "most_blocks",
    "most_progress",
    "release_finished", "schedule_unchecked", "update_unchecked", "width_bounds", "add_unchecked", "abort_unchecked",
    "fork_unchecked",
]
