"""`simulate`: the engine's scheduler stepped in a `while_loop` against a cost model, with no model execution.

Each loop iteration is one engine step, exactly as `Engine.step` does it, with the model replaced:

  admit arrived requests into EMPTY slots (in arrival order, as many as there are EMPTY slots)
  → `scheduler.schedule_unchecked` → accepted drafts from the trace's acceptance table → `scheduler.update_unchecked`
  → step time from `CostModel.step_time(scheduler.step_shape(batch))`, plus the swaps' transfer time
  (`swap_seconds`: `CostModel.swap_time` over the host link) under preemption="swap" → simulated clock.

It calls the *same* `add_unchecked` / `schedule_unchecked` / `update_unchecked` as the engine (no second copy
of the scheduler), so with the same trace, output tokens and acceptance the scheduling is the engine's, step for
step. What replaces the model:

* `SimTrace.tokens` [requests, width]: each request's full token sequence (prompt, then its outputs). The
  scheduler appends these as the "model's" tokens, so the prefix cache hashes what a real run would. Synthetic
  outputs (`synthetic_outputs`) or, to replay a real run, the engine's outputs.
* `SimTrace.accept_run` [requests, width]: at a sequence holding n tokens, how many of its next drafts the target
  accepts if offered K (a row granted d drafts accepts min(d, run)). From an acceptance model (`chain_acceptance`) or,
  for a greedy engine run, from the model itself (`replay_acceptance`): with greedy Medusa verification the
  accepted run depends only on the text, not on the schedule.

Padding: by default the clock prices the tokens scheduled, as for a ragged engine. `EngineLayout` makes it price
what this engine computes: the padded [rows, Q] query of the width the host would pick, and logits at every row's
sampling slots (`cost_model`'s "Padding"; `sim.fidelity` checks it against the engine on this CPU).

Arrivals: a request enters the engine's queue at `arrival`; when nothing runs and nothing has arrived, the clock
jumps to the next arrival. Everything is one jitted program; `vmap` it over knobs or traces for sweeps.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from skvs_jax import checks, metrics, vmap_flow, workloads
from skvs_jax import scheduler as sc
from skvs_jax.arrays import count_leading
from skvs_jax.config import NULL_BLOCK
from skvs_jax.kv import manager
from skvs_jax.policies import Knobs
from skvs_jax.sim.cost_model import CostModel, step_cost

i32, f32 = jnp.int32, jnp.float32


@struct.dataclass
class SimTrace:
    """A trace as arrays: its requests in arrival order (ties by request id); width = max_len + K + 1 columns."""

    prompts: jax.Array  # int32[requests, M*S] prompt tokens, 0-padded
    prompt_len: jax.Array  # int32[requests]
    max_new: jax.Array  # int32[requests]
    priority: jax.Array  # int32[requests]
    arrival: jax.Array  # float32[requests] seconds
    tokens: jax.Array  # int32[requests, width] prompt then outputs
    accept_run: jax.Array  # int32[requests, width] drafts the target accepts at each length (module docstring)
    request_id: jax.Array  # int32[requests] the trace's ids (the simulator itself numbers requests from 0)
    tpot_target: jax.Array  # int32[requests] microseconds per output token each asks for (0: none; draft control)


@struct.dataclass
class StepRow:
    """One simulated step: a row of `SimLog`'s per-step fields (stacked to [steps] there). Fields in name order,
    the order the loop carries them in; `active` False marks an idle row after the trace finished."""

    accepted: jax.Array  # int32[] of the drafts, accepted
    active: jax.Array  # bool[]
    blocks_used: jax.Array  # int32[] at the step's peak (after allocation, before commit), out of the KV budget
    decode_step: jax.Array  # bool[] no prompt work: the engine would run a draft width (`padding`)
    draft_bound: jax.Array  # int32[] the bound that picks that width, were every width compiled
    draft_hist: jax.Array  # int32[K + 1] decoding rows granted 0..K drafts (the draft-length histogram)
    drafted: jax.Array  # int32[] draft tokens proposed (and verified)
    duration: jax.Array  # float32[] simulated seconds (the cost model's step time)
    num_seqs: jax.Array  # int32[] sequences in the step (`scheduler.step_shape`)
    oom: jax.Array  # bool[]
    output_tokens: jax.Array  # int32[]
    preempted: jax.Array  # int32[] sequences preempted (recompute or swap)
    query_slots: jax.Array  # int32[] what the clock priced: the engine's padded query (`EngineLayout`), else tokens
    spec_blocks: jax.Array  # int32[] blocks holding only unvalidated or rejected drafts
    start_time: jax.Array  # float32[] simulated seconds
    verifications: jax.Array  # int32[] rows that verified >= 1 draft


@struct.dataclass
class RequestStats:
    """What the simulation records per request [requests] (fields in name order, as carried). Times are kept
    relative to the request's arrival: an absolute float32 time near 3,000 s has a resolution of 0.24 ms, a large
    share of a short TTFT; a difference taken in the loop does not lose it."""

    admitted_tokens: jax.Array  # int32[requests] tokens looked up at admissions (prompt + output so far)
    cached_tokens: jax.Array  # int32[requests] of those, prefix hits
    e2e: jax.Array  # float32[requests] seconds from arrival to the finish, NaN if unfinished
    first_cached_tokens: jax.Array  # int32[requests] of those, the first admission's (kv_hit_rate_first)
    preemptions: jax.Array  # int32[requests]
    req_accepted: jax.Array  # int32[requests]
    req_drafted: jax.Array  # int32[requests]
    req_output: jax.Array  # int32[requests]
    ttft: jax.Array  # float32[requests] seconds from arrival to the first token, NaN if none


@struct.dataclass
class SimLog(RequestStats, StepRow):
    """A run's log: every `StepRow` field stacked over its steps [steps] (rows with active False are padding
    after the trace finished), every `RequestStats` field [requests], and the KV budget the run had.
    blocks_used counts blocks held out of that budget (withheld blocks are not counted)."""

    kv_blocks: jax.Array  # int32[] the KV budget the run had (`simulate`'s kv_blocks)


def make_trace(trace: workloads.Trace, cfg: sc.SchedulerConfig, outputs: dict[int, list[int]] | None = None,
               accept_runs: dict[int, np.ndarray] | None = None, *, alphas=None, seed: int = 0,
               vocab_size: int = 256, tpot_target: float | None = None) -> SimTrace:
    """A `workloads.Trace` as `SimTrace` arrays. tpot_target: every request's TPOT objective in seconds (None:
    none), which the goodput controller drafts first for and `summarize` reports attainment of. outputs: request id
    -> output tokens (default synthetic); accept_runs:
    request id -> int array over sequence lengths; or alphas: a chain acceptance model (`chain_acceptance`, drawn
    with `jax.random.key(seed)`; the draws depend on the trace, K and seed only, so policies with the same K meet
    the same ones): float[K], or float[requests, K] per request id (classes of requests that accept differently).
    Neither: no draft is ever accepted."""
    reqs = sorted(trace.requests, key=lambda r: (r.arrival_time, r.request_id))
    k, big_l = cfg.policy.draft_len, cfg.max_len
    w = big_l + k + 1
    r_n = len(reqs)
    if alphas is not None:
        if accept_runs is not None:
            raise ValueError("pass accept_runs or alphas, not both")
        alphas = np.asarray(alphas, np.float32)
        if alphas.ndim == 2:  # per request id, to the trace's arrival order
            alphas = alphas[[r.request_id for r in reqs]]
        drawn = np.asarray(chain_acceptance(alphas, (r_n, w), jax.random.key(seed)))
        accept_runs = {r.request_id: drawn[i] for i, r in enumerate(reqs)}
    prompts = np.zeros((r_n, big_l), np.int32)
    tokens = np.zeros((r_n, w), np.int32)
    runs = np.zeros((r_n, w), np.int32)
    for i, r in enumerate(reqs):
        if len(r.prompt) + r.max_new_tokens > big_l:
            raise ValueError(f"request {r.request_id}: prompt + max_new_tokens exceeds max_len {big_l}")
        prompts[i, : len(r.prompt)] = r.prompt
        out = outputs[r.request_id] if outputs is not None else synthetic_outputs(r, vocab_size)
        seq = list(r.prompt) + list(out)
        tokens[i, : min(len(seq), w)] = seq[:w]
        if accept_runs is not None:
            run = np.asarray(accept_runs[r.request_id], np.int32)[:w]
            runs[i, : len(run)] = run
    col = lambda f, dt: np.asarray([f(r) for r in reqs], dt)  # noqa: E731
    return SimTrace(
        prompts=jnp.asarray(prompts), prompt_len=jnp.asarray(col(lambda r: len(r.prompt), np.int32)),
        max_new=jnp.asarray(col(lambda r: r.max_new_tokens, np.int32)),
        priority=jnp.asarray(col(lambda r: r.priority, np.int32)),
        arrival=jnp.asarray(col(lambda r: r.arrival_time, np.float32)), tokens=jnp.asarray(tokens),
        accept_run=jnp.asarray(runs), request_id=jnp.asarray(col(lambda r: r.request_id, np.int32)),
        tpot_target=jnp.full((r_n,), sc.tpot_target_us(tpot_target), jnp.int32))


def synthetic_outputs(request: workloads.Request, vocab_size: int) -> list[int]:
    """Deterministic stand-in output tokens (a hash of request id and position): distinct across requests."""
    rid, n = request.request_id, request.max_new_tokens
    return [int((rid * 7919 + j * 104729 + 17) % vocab_size) for j in range(n)]


def chain_acceptance(alphas, shape: tuple[int, int], key: jax.Array) -> jax.Array:
    """int32[shape] accepted runs of a chain acceptance model: draft i is accepted with probability alphas[i] given
    drafts < i were (conditional per-position acceptance), independently at every (request, length). alphas
    float[K], or float[shape[0], K] per request (the uniform draws are the same either way: equal rows give equal
    runs)."""
    alphas = jnp.asarray(alphas, f32)
    u = jax.random.uniform(key, (*shape, alphas.shape[-1]), f32)
    return count_leading(u < (alphas[None, None, :] if alphas.ndim == 1 else alphas[:, None, :]))


def replay_acceptance(runner, params, sequences: dict[int, list[int]], k: int, *, block_size: int = 16,
                      impl: str = "xla") -> dict[int, np.ndarray]:
    """Accepted runs of greedy chain verification, from the model itself: request id -> int32[len + K + 1].

    sequences: request id -> its full token sequence (prompt + output of a greedy run). With n tokens known, the
    engine drafts from the hidden state at position n - 2 (the one that produced token n - 1), head j proposing
    token n + j; greedy verification accepts the leading drafts equal to the text. That depends only on the text,
    so a schedule replayed with these runs accepts what the engine accepted. runner: a `ModelRunner`.
    """
    ids = list(sequences)
    lengths = [len(sequences[r]) for r in ids]
    m = -(-max(lengths) // block_size)
    width = m * block_size
    tokens = np.zeros((len(ids), width), np.int32)
    for row, r in enumerate(ids):
        tokens[row, : lengths[row]] = sequences[r]
    cache = runner.init_cache(1 + len(ids) * m, block_size, "float32")
    table = jnp.asarray(1 + np.arange(len(ids) * m, dtype=np.int32).reshape(len(ids), m))
    lens = jnp.asarray(lengths, i32)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=i32)[None, :], (len(ids), width))
    _, hidden, _ = runner.forward(params, jnp.asarray(tokens), positions, cache, table, lens, lens, impl=impl)
    drafts = np.asarray(jax.vmap(lambda h: runner.draft(params, h))(hidden))[:, :, :k]  # [requests, width, K]
    out = {}
    for row, r in enumerate(ids):
        t, seq = lengths[row], tokens[row]
        run = np.zeros(t + k + 1, np.int32)
        for n in range(2, t + 1):
            target = seq[n: min(n + k, t)]
            match = drafts[row, n - 2, : len(target)] == target
            run[n] = int(np.cumprod(match).sum()) if len(target) else 0
        out[r] = run
    return out


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """How this engine lays out a step's query, for a clock that prices padding (`serve.engine`): a step runs at
    the width the host picked before scheduling it, the prompt width when it has prompt work or admits, else
    1 + the draft width its bound snaps up to (`WidthPicker.pick`); at the prompt width the batch takes the first
    layout that fits (`scheduler.buckets.query_layout`); every row computes logits at its sampling slots.
    `sim.fidelity.layout_of(engine)` reads the three numbers off an engine."""

    prompt_width: int  # max(prefill chunk, 1 + K)
    split_rows: int  # the prompt width's extra rows (`EngineConfig.split_rows`), 0: no split layout
    logit_slots: int  # sampling slots per row: K + 1 for a chain

    def computed(self, batch: sc.Batch, decode_step: jax.Array, bound: jax.Array, draft_widths: jax.Array,
                 k: int) -> tuple[jax.Array, jax.Array]:
        """(query slots, logit rows) int32[] the engine computes for `batch`: decode_step bool[] (no prompt work
        and no admission: a draft width), bound int32[] the draft bound that picks it, draft_widths int32[widths]."""
        width = jnp.where(decode_step, 1 + sc.buckets.snap_up(bound, draft_widths), self.prompt_width)
        b = batch.scheduled.shape[0]
        return (sc.buckets.query_slots(batch, width, 1 + k, self.split_rows),
                jnp.asarray(b * self.logit_slots, i32))


def swap_seconds(batch: sc.Batch, cost: CostModel, cfg: sc.SchedulerConfig) -> jax.Array:
    """float32[] the step's swap traffic priced by `CostModel.swap_time`: the victims' committed blocks swapped out
    (batch.swap_out_blocks) and the restored rows' blocks swapped in (ceil(batch.restore / S)). Every swapped block
    is priced over the host link; the scheduler counts one swap space (`SchedulerConfig.swap_blocks`), so a disk
    tier behind the host is not told apart here (`swap_time`'s disk_blocks stays 0)."""
    s = cfg.cache.block_size
    out_blocks = jnp.sum(batch.swap_out_blocks != NULL_BLOCK, dtype=i32)
    in_blocks = jnp.sum(jnp.where(batch.swap_in, -(-batch.restore // s), 0), dtype=i32)
    return cost.swap_time(out_blocks, in_blocks, s).astype(f32)


def _gather(table, rows, cols):
    cols = jnp.clip(cols, 0, table.shape[1] - 1)
    return table[rows[:, None], cols] if cols.ndim == 2 else table[rows, cols]


@struct.dataclass
class SimCarry:
    """What one simulation carries from step to step: the scheduler state, the simulated clock, the next request
    to admit (requests nxt.. have not entered the engine) and the per-request fields of `SimLog`."""

    st: sc.SchedState
    clock: jax.Array  # float32[] simulated seconds
    clock_err: jax.Array  # float32[] what rounding left out of clock (Kahan): a long run's sum of ~10 ms steps
    nxt: jax.Array  # int32[]
    req: RequestStats
    kv_blocks: jax.Array  # int32[]


def start(trace: SimTrace, cfg: sc.SchedulerConfig, kv_blocks: jax.Array | None = None,
          draft_widths: jax.Array | None = None) -> SimCarry:
    """The carry before the first step. kv_blocks: int32[] usable KV blocks, 1..cfg.cache.usable_blocks (default
    all): a budget below the static pool, as data (`kv.manager.with_budget`). draft_widths: int32[widths] the
    draft widths the scheduler drafts from (`SchedState.draft_widths`, e.g. `scheduler.buckets.padded(chosen,
    W)`; default the policy's buckets), data like the budget."""
    r_n = trace.prompt_len.shape[0]
    kv_blocks = jnp.asarray(cfg.cache.usable_blocks if kv_blocks is None else kv_blocks, i32)
    nan = jnp.full((r_n,), jnp.nan, f32)
    zr = jnp.zeros((r_n,), i32)
    req = RequestStats(ttft=nan, e2e=nan, admitted_tokens=zr, cached_tokens=zr, preemptions=zr,
                       req_drafted=zr, req_accepted=zr, req_output=zr, first_cached_tokens=zr)
    st = sc.init(cfg)
    if draft_widths is not None:
        st = st.replace(draft_widths=jnp.asarray(draft_widths, i32).reshape(st.draft_widths.shape))
    st = st.replace(kv=manager.with_budget(st.kv, kv_blocks))
    return SimCarry(st=st, clock=jnp.zeros((), f32), clock_err=jnp.zeros((), f32), nxt=jnp.zeros((), i32), req=req,
                    kv_blocks=kv_blocks)


def done(carry: SimCarry) -> jax.Array:
    """bool[] every request has arrived, entered the engine and left it (finished or aborted)."""
    live = jnp.any(sc.live(carry.st.seqs.status))
    return (carry.nxt >= carry.req.req_output.shape[0]) & ~live


# ------------------------------------------------------------------------------------------ one step's phases


def admit_arrivals(c: SimCarry, trace: SimTrace, slots: jax.Array) -> tuple[SimCarry, jax.Array, jax.Array]:
    """The host loop's part of a step: when nothing runs and the next request has not arrived, the clock jumps to
    its arrival; then the arrived requests are offered EMPTY slots in arrival order, as many as there are.
    Returns (the carry, ok bool[B]: the rows that admit, idx int32[B]: the request each row takes). The state is
    not yet admitted into: `admit` does that after the width bound is read from the state the last update left.
    slots: int32[B] 0..B-1 (made once, outside the loop)."""
    r_n = trace.prompt_len.shape[0]
    st, clock, err, nxt = c.st, c.clock, c.clock_err, c.nxt
    status = st.seqs.status
    live = jnp.any(sc.live(status))
    pending = nxt < r_n
    jump = ~live & pending & (trace.arrival[jnp.minimum(nxt, r_n - 1)] > clock)  # idle until the next arrival
    clock = jnp.where(jump, trace.arrival[jnp.minimum(nxt, r_n - 1)], clock)
    err = jnp.where(jump, 0.0, err)
    free = jnp.sum(status == sc.EMPTY, dtype=i32)
    idx = nxt + slots
    ok = (idx < r_n) & (slots < free) & (trace.arrival[jnp.clip(idx, 0, r_n - 1)] <= clock)
    return c.replace(clock=clock, clock_err=err), ok, idx


def admit(st: sc.SchedState, ok: jax.Array, idx: jax.Array, trace: SimTrace, cfg: sc.SchedulerConfig
          ) -> sc.SchedState:
    """The rows in ok (bool[B]) take the requests idx (int32[B]) names (`scheduler.add_unchecked`); most steps
    admit nobody, and then the [B, M*S] prompts are not gathered."""
    ci = jnp.clip(idx, 0, trace.prompt_len.shape[0] - 1)

    def add(st):
        return sc.add_unchecked(st, jnp.where(ok[:, None], trace.prompts[ci], 0),
                                jnp.where(ok, trace.prompt_len[ci], 0), jnp.where(ok, trace.max_new[ci], 1),
                                trace.priority[ci], jnp.where(ok, idx, -1), None, trace.tpot_target[ci],
                                cfg=cfg)[0]

    return vmap_flow.when(jnp.any(ok), add, st, identity_when_false=True)


def stand_in_model(st: sc.SchedState, batch: sc.Batch, rid: jax.Array, trace: SimTrace, k: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What the model would return for `batch`, read off the trace (rid int32[B]: each row's request): (accepted
    int32[B] drafts the target accepts, next_token int32[B] the token after them, drafts int32[B, max(K, 1)]: the
    text after each row's tokens where accepted, a different token where rejected)."""
    n = st.seqs.num_tokens
    accepted = jnp.minimum(batch.num_drafts, _gather(trace.accept_run, rid, n))
    j = jnp.arange(max(k, 1), dtype=i32)[None, :]
    drafts = _gather(trace.tokens, rid, n[:, None] + j)  # [B, K] the text after each row's tokens
    drafts = jnp.where(j < accepted[:, None], drafts, drafts + 1)  # rejected drafts differ from the text
    next_token = _gather(trace.tokens, rid, n + accepted)
    return accepted, next_token, drafts


def step_seconds(batch: sc.Batch, cost: CostModel, cfg: sc.SchedulerConfig, query_slots: jax.Array | int = 0,
                 logit_rows: jax.Array | int = 0) -> tuple[jax.Array, sc.StepShape]:
    """(float32[] the step's simulated time, its shape): the cost model's price of the batch's shape, plus the
    swaps' transfer time where the policy swaps (static: programs that cannot swap are unchanged). query_slots,
    logit_rows: what a padding engine computes (`EngineLayout.computed`); 0 prices the tokens alone."""
    shape = sc.step_shape(batch)
    dt = cost.step_time(shape.prefill_tokens, shape.decode_tokens, shape.kv_tokens_read, shape.num_seqs,
                        shape.drafting_rows, query_slots, logit_rows).astype(f32)
    if cfg.policy.preemption == "swap" and cfg.swap_blocks > 0:
        dt = dt + swap_seconds(batch, cost, cfg)
    return dt, shape


def advance_clock(clock: jax.Array, err: jax.Array, dt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(end, end_err): clock + dt by Kahan summation, so end + end_err is the clock to float32 precision however
    many steps came before."""
    y = dt - err
    end = clock + y
    end_err = (end - clock) - y
    return end, end_err


def record_requests(req: RequestStats, batch: sc.Batch, res: sc.StepResult, rid: jax.Array, since: jax.Array,
                    admitted_len: jax.Array) -> RequestStats:
    """The step's per-request fields: rid int32[B] each row's request, since float32[B] seconds from its arrival
    to the step's end, admitted_len int32[B] its tokens at admission (prompt, plus output after a recompute)."""
    r_n = req.ttft.shape[0]
    on = batch.scheduled | batch.admitted | batch.preempted | batch.swap_out
    dst = jnp.where(on | (res.num_new > 0) | res.finished, rid, r_n)  # r_n: dropped
    first = req.ttft
    # A request's first admission: nothing looked up for it yet (every admission looks up >= its prompt).
    first_admission = batch.admitted & (req.admitted_tokens[rid] == 0)
    new_first = (res.num_new > 0) & jnp.isnan(first[rid])
    return RequestStats(
        ttft=first.at[jnp.where(new_first, rid, r_n)].set(since, mode="drop"),
        e2e=req.e2e.at[jnp.where(res.finished, rid, r_n)].set(since, mode="drop"),
        admitted_tokens=req.admitted_tokens.at[dst].add(jnp.where(batch.admitted, admitted_len, 0), mode="drop"),
        cached_tokens=req.cached_tokens.at[dst].add(jnp.where(batch.admitted, batch.hit_tokens, 0), mode="drop"),
        preemptions=req.preemptions.at[dst].add((batch.preempted | batch.swap_out).astype(i32), mode="drop"),
        req_drafted=req.req_drafted.at[dst].add(batch.num_drafts, mode="drop"),
        req_accepted=req.req_accepted.at[dst].add(res.accepted, mode="drop"),
        req_output=req.req_output.at[dst].add(res.num_new, mode="drop"),
        first_cached_tokens=req.first_cached_tokens.at[dst].add(jnp.where(first_admission, batch.hit_tokens, 0),
                                                                mode="drop"),
    )


def step_row(batch: sc.Batch, res: sc.StepResult, shape: sc.StepShape, start_time: jax.Array, dt: jax.Array,
             withheld: jax.Array, prompt_work: jax.Array, ok: jax.Array, bound: jax.Array, k: int,
             query_slots: jax.Array) -> StepRow:
    """The step's row of the log: a decode step has no prompt work before admission and admits nobody."""
    return StepRow(active=jnp.asarray(True), start_time=start_time, duration=dt,
                   blocks_used=batch.blocks_used - withheld, spec_blocks=batch.spec_blocks, oom=batch.oom,
                   preempted=jnp.sum(batch.preempted | batch.swap_out, dtype=i32),
                   drafted=jnp.sum(batch.num_drafts, dtype=i32), accepted=jnp.sum(res.accepted, dtype=i32),
                   verifications=jnp.sum(batch.num_drafts > 0, dtype=i32),
                   output_tokens=jnp.sum(res.num_new, dtype=i32), num_seqs=shape.num_seqs.astype(i32),
                   draft_hist=draft_hist(batch, k), decode_step=~prompt_work & ~jnp.any(ok),
                   draft_bound=bound.astype(i32), query_slots=jnp.asarray(query_slots, i32))


def idle_row(k: int) -> StepRow:
    """A row after the trace finished (active False)."""
    zero = jnp.zeros((), i32)
    return StepRow(active=jnp.asarray(False), start_time=jnp.zeros((), f32), duration=jnp.zeros((), f32),
                   blocks_used=zero, spec_blocks=zero, oom=jnp.asarray(False), preempted=zero, drafted=zero,
                   accepted=zero, verifications=zero, output_tokens=zero, num_seqs=zero,
                   draft_hist=jnp.zeros((k + 1,), i32), decode_step=jnp.asarray(False), draft_bound=zero,
                   query_slots=zero)


# ------------------------------------------------------------------------------------------------ the loop


def advance(carry: SimCarry, trace: SimTrace, knobs: Knobs, *, cfg: sc.SchedulerConfig, cost: CostModel,
            steps: int, controller_cost: sc.StepCost | None = None,
            layout: EngineLayout | None = None) -> tuple[SimCarry, StepRow]:
    """`steps` more engine steps (steps after `done` are idle rows with active False). Returns the carry and the
    per-step rows (a `StepRow` of [steps] arrays). Traceable: jit it, or vmap it over lanes. controller_cost: the
    step cost the goodput draft controller plans with (default: `cost_model.step_cost(cost)`, the clock's own
    costs; pass another to replay an engine that planned with its own, e.g. `scheduler.flat_step_cost`).
    layout: price this engine's padded steps (`EngineLayout`), static; None prices the tokens scheduled."""
    b, k = cfg.cache.max_seqs, cfg.policy.draft_len
    r_n = trace.prompt_len.shape[0]
    slots = jnp.arange(b, dtype=i32)
    withheld = cfg.cache.usable_blocks - carry.kv_blocks
    # The goodput draft controller prices candidate steps with the cost model the clock uses.
    if controller_cost is None and cfg.policy.goodput_control:
        controller_cost = step_cost(cost, cfg.token_budget)

    def step(c: SimCarry) -> tuple[SimCarry, StepRow]:
        c, ok, idx = admit_arrivals(c, trace, slots)
        # What the engine picks its width from (`scheduler.width_bounds` of the state after the last update).
        prompt_work, _, bound = sc.width_bounds(c.st, knobs, cfg, controller_cost)
        st = admit(c.st, ok, idx, trace, cfg)
        nxt = c.nxt + jnp.sum(ok, dtype=i32)

        st, batch = sc.schedule_unchecked(st, knobs, controller_cost, cfg=cfg)
        rid = jnp.clip(st.seqs.request_id, 0, r_n - 1)
        admitted_len = st.seqs.num_tokens  # the row's tokens at admission (prompt, plus output after a recompute)
        accepted, next_token, drafts = stand_in_model(st, batch, rid, trace, k)
        st, res = sc.update_unchecked(st, batch, accepted, next_token, drafts, jnp.zeros((b,), bool), knobs, cfg=cfg)

        padded = (0, 0)
        if layout is not None:
            padded = layout.computed(batch, ~prompt_work & ~jnp.any(ok), bound, st.draft_widths, k)
        dt, shape = step_seconds(batch, cost, cfg, *padded)
        priced = padded[0] if layout is not None else shape.prefill_tokens + shape.decode_tokens
        end, end_err = advance_clock(c.clock, c.clock_err, dt)
        since = (end - trace.arrival[rid]) - end_err  # [B] seconds since each row's arrival, exact subtraction
        req = record_requests(c.req, batch, res, rid, since, admitted_len)
        row = step_row(batch, res, shape, c.clock, dt, withheld, prompt_work, ok, bound, k, priced)
        return c.replace(st=st, clock=end, clock_err=end_err, nxt=nxt, req=req), row

    # A while_loop, not a scan over `cond(done, idle, step)`: a cond whose idle branch returns the carry makes
    # XLA copy the whole carry (prefix table included) every step; the loop updates it in place and stops early.
    rows = jax.tree.map(lambda x: jnp.broadcast_to(x, (steps, *x.shape)), idle_row(k))

    def body(state):
        i, c, rows = state
        c, row = step(c)
        return i + 1, c, jax.tree.map(lambda buf, x: buf.at[i].set(x), rows, row)

    _, carry, rows = vmap_flow.while_loop(lambda state: (state[0] < steps) & ~done(state[1]), body,
                                       (jnp.zeros((), i32), carry, rows))
    rows = rows.replace(start_time=jnp.where(rows.active, rows.start_time, carry.clock))  # idle: the final clock
    return carry, rows


def draft_hist(batch: sc.Batch, k: int) -> jax.Array:
    """int32[K + 1]: the step's decoding rows (one query token that samples) by the drafts they were granted."""
    decode = batch.scheduled & batch.samples & (batch.num_query == 1)
    return jnp.zeros((k + 2,), i32).at[jnp.where(decode, jnp.clip(batch.num_drafts, 0, k), k + 1)].add(1)[: k + 1]


def finish(carry: SimCarry, rows: StepRow) -> SimLog:
    """The log of a run from its final carry and its per-step rows (concatenated over `advance` calls)."""
    return SimLog(**vars(rows), **vars(carry.req), kv_blocks=carry.kv_blocks)


def simulate(trace: SimTrace, knobs: Knobs, *, cfg: sc.SchedulerConfig, cost: CostModel, max_steps: int,
             kv_blocks: jax.Array | int | None = None,
             controller_cost: sc.StepCost | None = None,
             draft_widths: jax.Array | None = None,
             layout: EngineLayout | None = None) -> tuple[sc.SchedState, SimLog]:
    """Run the trace to completion (or max_steps steps), one jitted program. Returns the final scheduler state
    and the log. kv_blocks: the KV budget (see `start`), data, so sweeps over memory need no recompilation;
    checked to lie in [1, cfg.cache.usable_blocks] when concrete (a larger one put blocks that do not exist on
    the free stack). A budget smaller than one request needs stalls that request until max_steps.
    For runs of unknown length, `sweep.run` advances in chunks and stops when every lane is done.
    controller_cost, layout: see `advance`; draft_widths: see `start`."""
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
    if kv_blocks is not None:
        checks.scalar_int("kv_blocks", kv_blocks)
        checks.in_range("kv_blocks", kv_blocks, 1, cfg.cache.usable_blocks)
    return _simulate(trace, knobs, cfg=cfg, cost=cost, max_steps=max_steps, kv_blocks=kv_blocks,
                     controller_cost=controller_cost, draft_widths=draft_widths, layout=layout)


@functools.partial(jax.jit, static_argnames=("cfg", "cost", "max_steps", "layout"))
def _simulate(trace, knobs, *, cfg, cost, max_steps, kv_blocks, controller_cost, draft_widths=None, layout=None):
    carry, rows = advance(start(trace, cfg, kv_blocks, draft_widths), trace, knobs, cfg=cfg, cost=cost, steps=max_steps,
                          controller_cost=controller_cost, layout=layout)
    return carry.st, finish(carry, rows)


def bucket_hist(log: SimLog, k: int) -> list[int]:
    """Decode rows by their step's draft bound (`draft_bound`), over the decode-only steps of one run: the
    histogram `scheduler.buckets.choose_widths` chooses widths from."""
    log = jax.device_get(log)
    on = np.asarray(log.active) & np.asarray(log.decode_step)
    return np.bincount(np.clip(np.asarray(log.draft_bound)[on], 0, k), weights=np.asarray(log.num_seqs)[on],
                       minlength=k + 1).astype(np.int64).tolist()


def padding(log: SimLog, widths) -> int:
    """Draft slots the engine would verify without a draft over one run's decode-only steps, were its draft widths
    `widths`: sum of rows * snap_up(bound, widths) - drafted (`scheduler.buckets`). The simulator's clock does not
    charge padding (its cost model prices the tokens drafted); this counts it. Exact for widths that do not
    change the schedule (the goodput controller ignores them; the histogram rule drafts from them)."""
    log = jax.device_get(log)
    on = np.asarray(log.active) & np.asarray(log.decode_step)
    bound = np.asarray(log.draft_bound)[on]
    rows, drafted = np.asarray(log.num_seqs)[on].astype(np.int64), np.asarray(log.drafted)[on].astype(np.int64)
    return int(np.sum(rows * sc.buckets.snap_up(bound, widths) - drafted))


def request_records(log: SimLog, trace: SimTrace) -> list[metrics.RequestRecord]:
    """Every request of a run as a `metrics.RequestRecord`, in the trace's order, times in simulated seconds. A
    request that did not finish within the run (cut by max_steps) counts as aborted; its finish time is the end
    of the run, or its arrival if it had not arrived by then."""
    log = jax.device_get(log)
    arrival, plen = np.asarray(trace.arrival).astype(np.float64), np.asarray(trace.prompt_len)
    target = np.asarray(trace.tpot_target)
    end = float(np.nanmax(log.start_time + log.duration, initial=0.0))
    return [metrics.RequestRecord(
        request_id=int(trace.request_id[i]), arrival_time=arrival[i],
        first_token_time=arrival[i] + float(log.ttft[i]),
        finish_time=arrival[i] + float(log.e2e[i]) if np.isfinite(log.e2e[i]) else max(end, arrival[i]),
        num_prompt_tokens=int(plen[i]), num_output_tokens=int(log.req_output[i]),
        num_cached_prompt_tokens=int(log.cached_tokens[i]), num_admitted_prompt_tokens=int(log.admitted_tokens[i]),
        num_preemptions=int(log.preemptions[i]), num_drafted=int(log.req_drafted[i]),
        num_accepted=int(log.req_accepted[i]), aborted=not np.isfinite(log.e2e[i]),
        num_first_cached_prompt_tokens=int(log.first_cached_tokens[i]),
        tpot_target=float(target[i]) * 1e-6 if target[i] > 0 else None,
    ) for i in range(len(arrival))]


def summarize(log: SimLog, trace: SimTrace, cfg: sc.SchedulerConfig) -> dict[str, float]:
    """The metrics (docs/design.md) of a simulated run (`metrics.summarize` over `request_records`), times in
    simulated seconds; the scheduler time metrics are left out (the simulated clock has no host time). A request
    cut by max_steps counts as aborted: out of throughput and latency, in hit rate and preemptions."""
    log = jax.device_get(log)
    act = np.asarray(log.active)
    steps = metrics.StepRecord(
        start_time=log.start_time[act], duration=log.duration[act], blocks_used=log.blocks_used[act],
        blocks_total=np.full(int(act.sum()), int(log.kv_blocks)), spec_waste_blocks=log.spec_blocks[act],
        oom=log.oom[act], num_preempted=log.preempted[act], num_drafted=log.drafted[act],
        num_accepted=log.accepted[act], num_verifications=log.verifications[act],
        num_output_tokens=log.output_tokens[act])
    out = metrics.summarize(request_records(log, trace), steps)
    for key in ("scheduler_time_per_step", "scheduler_time_share"):  # the simulator has no host scheduler time
        out.pop(key, None)
    return out


def summarize_groups(log: SimLog, trace: SimTrace, group_of: np.ndarray) -> list[dict[str, float]]:
    """`metrics.summarize_groups` of the lane's requests (group_of: int[ids] the group of each request id,
    `SimTrace.request_id` indexes it)."""
    return metrics.summarize_groups(request_records(log, trace), group_of)
