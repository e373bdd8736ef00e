"""The scheduler's public transitions, validated at the boundary: `add`, `schedule`, `update`, `abort`.

Shapes and dtypes are checked on every call (traced or not), values when they are concrete; then the jitted
`*_unchecked` transition runs. Inside a user's jit the value checks are skipped and bad values become flags.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from skvs_jax import checks
from skvs_jax.arrays import i32
from skvs_jax.kv import allocator
from skvs_jax.policies import NO_VERIFY_CAP, Knobs
from skvs_jax.scheduler.schedule import schedule_unchecked
from skvs_jax.scheduler.state import RUNNING, Batch, SchedState, SchedulerConfig, StepCost, StepResult
from skvs_jax.scheduler.update import abort_unchecked, add_unchecked, update_unchecked


def _check_state(st: SchedState, cfg: SchedulerConfig) -> None:
    if not isinstance(cfg, SchedulerConfig):
        raise TypeError(f"cfg must be a SchedulerConfig, got {type(cfg).__name__}")
    if not isinstance(st, SchedState):
        raise TypeError(f"st must be a SchedState, got {type(st).__name__}")
    allocator.check_state(st.kv.alloc, cfg.cache)
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
    cache_salt: jax.Array | None = None,
    tpot_target: jax.Array | None = None,
    *,
    cfg: SchedulerConfig,
) -> tuple[SchedState, jax.Array]:
    """Queue requests as WAITING in EMPTY slots (lowest slots first, arrival numbers in row order).

    prompts: int32[requests, width] (width <= M * S, padded); prompt_len: int32[requests], 0 = padding row;
    max_new_tokens, priority, request_id: int32[requests]; cache_salt: int32[requests] (default 0 = none):
    requests with different salts never share a prefix-cache block, equal salts share as usual; tpot_target:
    int32[requests] microseconds per output token (default 0 = none), >= 0: the goodput draft controller drafts
    first for a row whose decode steps are slower per token than its target (`draft_control.over_target`). A
    request needs
    prompt_len + max_new_tokens <= M * S.
    Returns the state and int32[requests] slots (-1: padding, or no EMPTY slot left -- keep it queued and add it
    again later). A padding row's max_new_tokens is ignored. Inside a user's jit a row that breaks these rules is
    treated as padding.
    """
    _check_state(st, cfg)
    if not hasattr(prompts, "shape") or len(prompts.shape) != 2:
        raise ValueError(f"prompts must be a 2-D [requests, width] array, got shape {getattr(prompts, 'shape', None)}")
    a, lp = prompts.shape
    if lp > cfg.max_len:
        raise ValueError(f"prompts has {lp} columns; a request holds at most L = M * S = {cfg.max_len} tokens")
    checks.array("prompts", prompts, (a, lp), "i")
    priority = jnp.zeros((a,), i32) if priority is None else priority
    request_id = jnp.arange(a, dtype=i32) if request_id is None else request_id
    cache_salt = jnp.zeros((a,), i32) if cache_salt is None else cache_salt
    tpot_target = jnp.zeros((a,), i32) if tpot_target is None else tpot_target
    for name, x in (("prompt_len", prompt_len), ("max_new_tokens", max_new_tokens), ("priority", priority),
                    ("request_id", request_id), ("cache_salt", cache_salt), ("tpot_target", tpot_target)):
        checks.array(name, x, (a,), "i")
    checks.in_range("tpot_target", tpot_target, 0, 2**31 - 1)
    checks.in_range("prompt_len", prompt_len, 0, lp)
    if checks.is_concrete(prompt_len) and checks.is_concrete(max_new_tokens):
        checks.in_range("max_new_tokens", np.asarray(max_new_tokens)[np.asarray(prompt_len) > 0], 1, cfg.max_len)
        total = np.asarray(prompt_len) + np.asarray(max_new_tokens)
        bad = (np.asarray(prompt_len) > 0) & (total > cfg.max_len)
        if bad.any():
            r = int(np.nonzero(bad)[0][0])
            raise ValueError(f"request {r}: prompt_len + max_new_tokens = {total[r]} exceeds L = M * S = "
                             f"{cfg.max_len} tokens per sequence (max_blocks_per_seq * block_size)")
    return add_unchecked(st, jnp.asarray(prompts, i32), jnp.asarray(prompt_len, i32),
                         jnp.asarray(max_new_tokens, i32), jnp.asarray(priority, i32), jnp.asarray(request_id, i32),
                         jnp.asarray(cache_salt, i32), jnp.asarray(tpot_target, i32), cfg=cfg)


MAX_TPOT_TARGET_S = 1000.0  # seconds; `SeqTable.tpot_target` holds microseconds in int32 (up to ~2,147 s)


def tpot_target_us(seconds: float | None, name: str = "tpot_target") -> int:
    """A TPOT target in seconds as `add`'s int32 microseconds (None: 0, no target; at least 1 us). ValueError
    naming `name` unless None or a finite number in (0, MAX_TPOT_TARGET_S]."""
    if seconds is None:
        return 0
    if (isinstance(seconds, bool) or not isinstance(seconds, (int, float, np.integer, np.floating))
            or not 0 < seconds <= MAX_TPOT_TARGET_S):  # NaN fails the comparison
        raise ValueError(f"{name} must be None or seconds in (0, {MAX_TPOT_TARGET_S:g}], got {seconds!r}")
    return max(int(round(float(seconds) * 1e6)), 1)


def check_step_cost(cost: StepCost, cfg: SchedulerConfig) -> None:
    if not isinstance(cost, StepCost):
        raise TypeError(f"step_cost must be a StepCost, got {type(cost).__name__}")
    checks.array("step_cost.token_us", cost.token_us, (cfg.token_budget + 1,), "i")
    checks.scalar_int("step_cost.row_us", cost.row_us)
    checks.scalar_int("step_cost.ctx_ns", cost.ctx_ns)
    checks.scalar_int("step_cost.head_us", cost.head_us)
    checks.in_range("step_cost.head_us", cost.head_us, 0, 2**24)
    checks.in_range("step_cost.token_us", cost.token_us, 1, 2**31 - 1)
    checks.in_range("step_cost.row_us", cost.row_us, 0, 2**20)
    checks.in_range("step_cost.ctx_ns", cost.ctx_ns, 0, 2**12)
    roofline = (cost.compute_us, cost.mem_us, cost.overlap)
    if any(x is not None for x in roofline):
        if any(x is None for x in roofline):
            raise ValueError("step_cost.compute_us, mem_us and overlap go together (a roofline's terms)")
        checks.array("step_cost.compute_us", cost.compute_us, (cfg.token_budget + 1,), "i")
        checks.in_range("step_cost.compute_us", cost.compute_us, 0, 2**21)  # x 1000 stays in int32
        checks.scalar_int("step_cost.mem_us", cost.mem_us)
        checks.in_range("step_cost.mem_us", cost.mem_us, 0, 2**24)
        checks.scalar_int("step_cost.overlap", cost.overlap)
        checks.in_range("step_cost.overlap", cost.overlap, 0, 1024)
    if cost.margin is not None:
        checks.scalar_int("step_cost.margin", cost.margin)
        checks.in_range("step_cost.margin", cost.margin, 0, 1024)
    if cost.width_us is not None:
        shape = tuple(getattr(cost.width_us, "shape", ()))
        if not hasattr(cost.width_us, "dtype"):
            raise TypeError(f"step_cost.width_us must be None or an int32 array, got {type(cost.width_us).__name__}")
        if len(shape) != 1 or shape[0] < 1:
            raise ValueError(f"step_cost.width_us must be None or int32[max_width + 1], got shape {shape}")
        checks.array("step_cost.width_us", cost.width_us, shape, "i")
        checks.in_range("step_cost.width_us", cost.width_us, 0, 2**24)


def schedule(st: SchedState, knobs: Knobs | None = None, *, cfg: SchedulerConfig,
             step_cost: StepCost | None = None) -> tuple[SchedState, Batch]:
    """Decide and allocate one step's batch (see the module docstring). knobs default: cfg.policy.knobs().
    step_cost: the goodput draft controller's price of a step (token_us int32[token_budget + 1]); None: every step
    costs the same (`flat_step_cost`). Other policies ignore it."""
    _check_state(st, cfg)
    knobs = cfg.policy.knobs() if knobs is None else knobs
    _check_knobs(knobs, cfg)
    if step_cost is not None:
        check_step_cost(step_cost, cfg)
    return schedule_unchecked(st, knobs, step_cost, cfg=cfg)


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
    committed = st.kv.alloc.seqs.num_committed
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
