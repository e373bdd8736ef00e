"""Many engine steps per dispatch: `run_steps`, one jitted program that runs up to n engine steps in a
`lax.while_loop`, and the rules that end it early.

Each iteration is the one-step engine's step (`engine_step.fused_step`: schedule, model step at the program's
width, update), so the scheduler, the allocator, the prefix cache, drafting and verification never leave the
device between steps. The width a step needs is picked on the device from what the previous step left in the
state (`EngineState.prompt_work`, `EngineState.next_want`), by the host's own rule (`serve.widths`): the prompt
width while some row has prompt work, else 1 + the smallest draft width holding the bound. A program has one
width: a step that needs a wider one ends the dispatch, and so does a run of steps needing narrower ones once
their padding has cost a host turn (`fits_width`); no `lax.switch` on a computed index, which on XLA:GPU is one
more host round trip per step. The schedule never depends on the width (it is an upper bound), so a dispatch makes
exactly the one-step engine's schedules: only the number of host visits changes.

Before step i the loop ends (`STOP_*`, first that holds) when:

  BOUND        i == n (the caller's bound; n <= the program's `capacity`, the output buffers' length)
  IDLE         no slot holds a live request
  FORK         an n > 1 request's output 0 has sampled its first token: its outputs 1.. fork on the host
  ADMIT        the empty slots left after the staged admissions reach `admit_at`: the host's first request not
               staged fits, and the one-step engine would admit it before this step (the host passes a huge
               number when every queued request is staged)
  WIDTH        the step needs a wider width, or a narrower one and the padding the steps needing narrower ones
               have paid in a row has reached the price of a host turn (`fits_width`, by the fitted step cost: a
               ski rental); step 0 of a dispatch the host chose the width of runs at any width at least the one
               needed
  FIRST_TOKEN  (i > 0) the previous step sampled some request's first token: the host streams it now, so the
               time to first token does not wait for the rest of the dispatch

and after step i's schedule, with swap preemption only:

  SWAP         the schedule swaps a sequence to or from the host tier: the step is dropped (the state from before
               it is kept: the state is functional) and the host runs it through the two-program path with the
               tier copies between them (`Engine`).

A finish does not end the dispatch when the host has staged its queue (`Staged`, `EngineState.staged`): before
each step the loop admits the staged requests, in queue order, into the slots the one-step engine's host would
have given them at that step (its rule: FCFS, as many as the empty slots less those held for unforked outputs),
so the schedules stay the one-step engine's and the host learns the admissions when it reads the dispatch
(`Dispatched.took`). The host stages a prefix of its queue with every dispatch it sends (requests of one output
each, up to B), and forgets what it staged at each of its own turns: the next dispatch stages the queue afresh
(`Limits.restage`). Swap preemption stages nothing (a swapping step is dropped and rerun by the host).

Per-step outputs go into buffers of `capacity` rows (`StepOut` with a leading step axis); the host reads them
once per dispatch, rows [0, steps).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from skvs_jax import scheduler as sc
from skvs_jax import vmap_flow
from skvs_jax.arrays import i32
from skvs_jax.serve import engine_step, sampling
from skvs_jax.serve.engine_step import EngineConfig, EngineState, StepOut

RUNNING, BOUND, IDLE, FORK, ADMIT, WIDTH, FIRST_TOKEN, SWAP = range(8)
STOP_NAMES = ("running", "bound", "idle", "fork", "admit", "width", "first_token", "swap")
CAPACITY = 64  # the output buffers' length: the most steps one dispatch runs (every bound shares one program)
AUTO_STEPS = 32  # steps_per_dispatch="auto": the bound of every dispatch (the stop rules end most of them sooner)
NO_ADMISSION = 2**31 - 1  # `admit_at` when the host's queue is empty: no count of empty slots reaches it


@struct.dataclass
class Dispatched:
    """What one dispatch did (the host reads it once)."""

    steps: jax.Array  # int32[] engine steps run
    stop: jax.Array  # int32[] why it ended (`STOP_NAMES`)
    out: StepOut  # every leaf [capacity, ...]: step i's outputs in row i < steps, zeros past them
    # int32[capacity, B]: the slots of the staged requests admitted before step i, in queue order, then -1
    # (all -1 without staging)
    took: jax.Array


@struct.dataclass
class Staged:
    """Requests the host queued on the device for the dispatch loop to admit (`admit_staged`), in queue order:
    rows [0, count) are staged, the rest padding. B rows (the slots), each `engine_step.add_requests`' row."""

    prompts: jax.Array  # int32[B, max_len]
    prompt_len: jax.Array  # int32[B]
    max_new: jax.Array  # int32[B]
    priority: jax.Array  # int32[B]
    request_id: jax.Array  # int32[B]
    cache_salt: jax.Array  # int32[B]
    tpot_target: jax.Array  # int32[B] microseconds, 0 = none
    rows: sampling.SamplingRows  # B rows
    count: jax.Array  # int32[]


def staged_from(prompts, prompt_len, max_new, priority, request_id, cache_salt, tpot_target, rows,
                count: int) -> Staged:
    """A `Staged` from `RequestTable.admission_arrays`' arrays and `requests.sampling_rows`' rows (host arrays
    of B rows each), of which the first `count` are requests."""
    return Staged(prompts=prompts, prompt_len=prompt_len, max_new=max_new, priority=priority, request_id=request_id,
                  cache_salt=cache_salt, tpot_target=tpot_target, rows=rows, count=np.int32(count))


def _rows(queue: Staged, src: jax.Array) -> Staged:
    """queue's rows src (int32[B]), count None (set by the caller)."""
    return jax.tree.map(lambda x: x[src], queue.replace(count=None))


def stage(queue: Staged, new: Staged, restage: jax.Array) -> Staged:
    """`queue` with new's first new.count rows after its own (restage > 0: instead of them). The host sends no
    more than the rows it knows are free, so nothing is dropped (rows past B would be)."""
    b = queue.prompt_len.shape[0]
    base = jnp.where(restage > 0, 0, queue.count)
    p = jnp.arange(b, dtype=i32)
    take = (p >= base) & (p < base + new.count)
    moved = _rows(new, jnp.clip(p - base, 0, b - 1))
    merged = jax.tree.map(lambda a, c: jnp.where(take.reshape((-1,) + (1,) * (a.ndim - 1)), a, c), moved,
                          queue.replace(count=None))
    return merged.replace(count=jnp.minimum(base + new.count, b).astype(i32))


def admissible(st: EngineState, lim: Limits) -> jax.Array:
    """int32[]: the staged requests the loop admits before the next step: as many as the empty slots less the
    ones held for unforked outputs (`Limits.held`), the one-step engine's host rule for requests of one output."""
    if st.staged is None:
        return jnp.asarray(0, i32)
    empty = jnp.sum(st.sched.seqs.status == sc.EMPTY, dtype=i32)
    return jnp.clip(empty - lim.held, 0, st.staged.count).astype(i32)


def admit_staged(st: EngineState, k: jax.Array, *, cfg: EngineConfig) -> tuple[EngineState, jax.Array]:
    """The first k staged requests admitted (`engine_step.add_requests_unchecked`) and popped off the queue.
    Returns (state, slots int32[B]: row i's slot for i < k, -1 after). k <= the empty slots (`admissible`).
    Where the program runs it on every step (no skips: a GPU's), the rows are written densely (gathers and
    selects that fuse, not a scatter per field)."""
    q = st.staged
    b = q.prompt_len.shape[0]
    row = jnp.arange(b, dtype=i32)
    lens = jnp.where(row < k, q.prompt_len, 0)  # a row of length 0 is padding to `add`
    st, slots = engine_step.add_requests_unchecked(st, q.prompts, lens, q.max_new, q.priority, q.request_id, q.rows,
                                                   q.cache_salt, q.tpot_target, cfg=cfg, dense=not cfg.sched.skip)
    popped = _rows(q, jnp.clip(row + k, 0, b - 1)).replace(count=q.count - k)
    return st.replace(staged=popped), slots


@struct.dataclass
class Limits:
    """A dispatch's data arguments (int32[] each): every value shares one program."""

    n: jax.Array  # most steps to run, 1 <= n <= capacity
    admit_at: jax.Array  # empty slots at which the host would admit its first queued request not staged (or
    # `NO_ADMISSION`: none)
    exact: jax.Array  # 1: step 0 too must need exactly the program's width (a dispatch the host did not size)
    probe: jax.Array  # 1: run exactly n steps whatever else holds (warm-up and the step-cost fit, on empty slots)
    held: jax.Array  # empty slots held for unforked outputs of n > 1 requests: no staged request takes them
    restage: jax.Array  # 1: the dispatch's staged rows replace the device's (the host forgot what it staged)


def limits(n: int, admit_at: int = NO_ADMISSION, exact: bool = False, probe: bool = False, held: int = 0,
           restage: bool = False) -> Limits:
    """`Limits` as host scalars (numpy int32), an argument of `run_steps`."""
    return Limits(n=np.int32(n), admit_at=np.int32(min(admit_at, NO_ADMISSION)), exact=np.int32(exact),
                  probe=np.int32(probe), held=np.int32(held), restage=np.int32(restage))


def prompt_width(cfg: EngineConfig) -> int:
    """The width of steps with prompt work: the prefill chunk, at least 1 + K (`engine_step.narrow_width`)."""
    return max(cfg.sched.chunk, engine_step.narrow_width(cfg))


def needed_width(st: EngineState, cfg: EngineConfig, admits: jax.Array | bool = False) -> jax.Array:
    """int32[]: the width the next step needs, by `serve.widths.WidthPicker.pick`'s rule, from the state (admits:
    staged requests are admitted before it, which have prompt work)."""
    decode = 1 + sc.buckets.snap_up(st.next_want, st.sched.draft_widths)
    return jnp.where(st.prompt_work | admits, prompt_width(cfg), decode).astype(i32)


def swaps_possible(cfg: EngineConfig) -> bool:
    """Static: the schedule may swap to the host tier (and the host must then run the step)."""
    return cfg.sched.policy.preemption == "swap" and cfg.sched.swap_blocks > 0


HOST_TURN_STEPS = 1.0  # a dispatch's end is priced at this many steps of the running program (fitted cost)


def fits_width(st: EngineState, need: jax.Array, padded: jax.Array, *, cfg: EngineConfig,
               width: int) -> tuple[jax.Array, jax.Array]:
    """Whether a step that needs width `need` runs on in this program of `width` instead of ending the dispatch,
    and what the padding paid in a row comes to if it does: (bool[], float32[]). padded float32[]: the padding the
    steps before it in a row that needed narrower widths paid (`EngineState.padded_us`).

    A ski rental: ending the dispatch for a narrower program costs a host turn (priced at `HOST_TURN_STEPS` steps
    of the running program), running on costs the step's padding (the width the program runs minus the one needed,
    by the state's fitted step cost), and how long the narrower needs will last is unknown. So the steps run on
    until their padding has summed to a host turn's price, then the dispatch ends: never more than twice what the
    better choice in hindsight costs. A step that needs the whole width ends the run. A decode step in a program
    wider than 1 + K runs its narrow branch (`engine_step.model_step_at`), so a prompt-width program pads it to
    1 + K only. Without a width table (a flat cost: widths priced alike) every narrower need runs on. On this
    project's CPU a width costs up to a fifth more than the next narrower one and a host turn about one step; a
    GPU's fitted widths are nearly flat, so its runs rarely end."""
    narrow = engine_step.narrow_width(cfg)
    cost = st.step_cost
    zero = jnp.zeros((), jnp.float32)
    if cost is None or cost.width_us is None:
        return need <= width, zero
    table = cost.width_us
    runs = jnp.where((width > narrow) & (need <= narrow), narrow, width)
    top = table.shape[0] - 1
    pad = jnp.maximum(table[jnp.minimum(runs, top)] - table[jnp.minimum(need, top)], 0).astype(jnp.float32)
    turn = jnp.float32(HOST_TURN_STEPS) * (cost.token_us[0] + table[jnp.minimum(runs, top)]).astype(jnp.float32)
    fits = (need <= width) & ((pad == 0) | (padded < turn))
    return fits, jnp.where(pad > 0, padded + pad, zero)


def stop_before(i: jax.Array, st: EngineState, first_token: jax.Array, lim: Limits, *, cfg: EngineConfig,
                width: int, admits: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(int32[], float32[]): why the loop ends before step i (`RUNNING`: it does not), and the state's
    `padded_us` for step i: with the step's padding if it runs (`fits_width`), as it was if the loop ends.
    first_token: bool[] the previous step sampled some request's first token (False before step 0). admits:
    int32[] the staged requests the loop would admit before step i (`admissible`; None: none), which the rules
    see as admitted."""
    seqs = st.sched.seqs
    admits = jnp.asarray(0, i32) if admits is None else admits
    # A parent that finished with its first token still forks (off its FINISHED slot, before a schedule frees it).
    fork = jnp.any((seqs.status != sc.EMPTY) & (st.sampling.siblings > 0) & (seqs.num_tokens > seqs.prompt_len))
    empty = jnp.sum(seqs.status == sc.EMPTY, dtype=i32) - admits
    need = needed_width(st, cfg, admits > 0)
    padded = jnp.zeros((), jnp.float32) if st.padded_us is None else st.padded_us
    fits, padded_if_run = fits_width(st, need, padded, cfg=cfg, width=width)
    wrong_width = jnp.where((i == 0) & (lim.exact == 0), need > width, ~fits)
    idle = ~jnp.any(sc.live(seqs.status)) & (admits == 0)
    reasons = [(i >= lim.n, BOUND), (idle, IDLE), (fork, FORK),
               (empty >= lim.admit_at, ADMIT), (wrong_width, WIDTH), ((i > 0) & first_token, FIRST_TOKEN)]
    stop = jnp.asarray(RUNNING, i32)
    for hit, code in reversed(reasons):  # the first that holds wins
        stop = jnp.where(hit, code, stop)
    stop = jnp.where(lim.probe > 0, jnp.where(i >= lim.n, BOUND, RUNNING), stop).astype(i32)
    return stop, jnp.where(stop == RUNNING, padded_if_run, padded)


def _first_tokens(st: EngineState, out: StepOut) -> jax.Array:
    """bool[]: the step sampled some request's first output token (its known tokens were the prompt alone)."""
    seqs = st.sched.seqs
    return jnp.any((out.num_new > 0) & (seqs.num_tokens - out.num_new == seqs.prompt_len))


def _zeros_like_out(runner, params, st, knobs, cfg, width) -> StepOut:
    shape = jax.eval_shape(lambda: _one_step(runner, params, st, knobs, cfg, width)[1])
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape)


def _one_step(runner, params, st: EngineState, knobs, cfg: EngineConfig, width: int, branch=engine_step.AUTO,
              skip_swaps: StepOut | None = None):
    """One engine step (`engine_step.fused_step`'s body; branch as `engine_step.model_step_at`'s). skip_swaps (the
    step's zero outputs, or None): a step whose schedule swaps is not run (returns the state unchanged, these
    outputs and True). Passed in, so the step is not traced once more for their shapes."""
    sched, batch = sc.schedule_unchecked(st.sched, knobs, st.step_cost, cfg=cfg.sched)

    def run(_):
        return engine_step.model_step_at(runner, params, st.replace(sched=sched), batch, knobs, branch, cfg=cfg,
                                         width=width)

    if skip_swaps is None:
        new, out = run(None)
        return new, out, jnp.asarray(False)
    swap = jnp.any(batch.swap_out | batch.swap_in)
    new, out = jax.lax.cond(swap, lambda _: (st, skip_swaps), run, None)
    return new, out, swap


def _admit(st: EngineState, k: jax.Array, cfg: EngineConfig) -> tuple[EngineState, jax.Array]:
    """`admit_staged` of k requests; with skips (`vmap_flow.when`) only on the steps that admit some: the
    others would run the admission's scatters for nothing. Without (a GPU's program) it always runs, densely: with
    k = 0 it writes nothing, and a skip would cost a host round trip a step."""
    b = cfg.sched.cache.max_seqs
    none = jnp.full((b,), -1, i32)
    if not cfg.sched.skip:
        return admit_staged(st, k, cfg=cfg)
    part = (st.sched.replace(kv=None), st.sampling, st.prompt_work, st.staged, none)

    def admit(x):
        sched, rows, work, staged, _ = x
        new, slots = admit_staged(st.replace(sched=sched, sampling=rows, prompt_work=work, staged=staged), k,
                                  cfg=cfg)
        return new.sched, new.sampling, new.prompt_work, new.staged, slots

    sched, rows, work, staged, slots = vmap_flow.when(k > 0, admit, part)
    return st.replace(sched=sched.replace(kv=st.sched.kv), sampling=rows, prompt_work=work, staged=staged), slots


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("cfg", "width", "capacity"), donate_argnums=(2,))
def run_steps(runner, params, st: EngineState, knobs, lim: Limits, branch=engine_step.AUTO, incoming=None, *,
              cfg: EngineConfig, width: int, capacity: int) -> tuple[EngineState, Dispatched]:
    """Up to lim.n engine steps at query width `width` (static) in one program; returns (state, `Dispatched`).
    The state is donated. `capacity` (static) is the output buffers' length, the most steps one dispatch can run.
    branch (int32[]): `engine_step.model_step_at`'s, AUTO when serving (the step-cost fit forces one).
    incoming: a `Staged` the host queues behind the device's staged requests (`stage`; None: none), on a state
    that stages (`EngineState.staged`)."""
    swaps = swaps_possible(cfg)
    b = cfg.sched.cache.max_seqs
    if st.staged is not None and incoming is not None:
        st = st.replace(staged=stage(st.staged, incoming, lim.restage))
    zero = _zeros_like_out(runner, params, st, knobs, cfg, width)
    buf = jax.tree.map(lambda x: jnp.zeros((capacity,) + x.shape, x.dtype), zero)
    took = jnp.full((capacity, b), -1, i32)
    admits0 = admissible(st, lim)  # what the stop rule saw is what the step admits: carried, not recounted
    stop0, padded0 = stop_before(jnp.asarray(0, i32), st, jnp.asarray(False), lim, cfg=cfg, width=width,
                                 admits=admits0)
    st = _with_padded(st, padded0)

    def cond(carry):
        return carry[4] == RUNNING

    def body(carry):
        i, st, buf, took, _, admits = carry
        if st.staged is not None:
            st, slots = _admit(st, admits, cfg)
            took = jax.lax.dynamic_update_index_in_dim(took, slots, i, 0)
        new, out, swapped = _one_step(runner, params, st, knobs, cfg, width, branch,
                                      skip_swaps=zero if swaps else None)
        buf = jax.tree.map(lambda b, x: jax.lax.dynamic_update_index_in_dim(b, x, i, 0), buf, out)
        ran = i + jnp.where(swapped, 0, 1).astype(i32)
        admits = admissible(new, lim)
        stop, padded = stop_before(ran, new, _first_tokens(new, out), lim, cfg=cfg, width=width, admits=admits)
        return ran, _with_padded(new, padded), buf, took, jnp.where(swapped, SWAP, stop).astype(i32), admits

    init = (jnp.asarray(0, i32), st, buf, took, stop0, admits0)
    steps, st, buf, took, stop, _ = jax.lax.while_loop(cond, body, init)
    return st, Dispatched(steps=steps, stop=stop, out=buf, took=took)


def _with_padded(st: EngineState, padded: jax.Array) -> EngineState:
    """st with the width rule's running padding (kept where the state keeps it)."""
    return st if st.padded_us is None else st.replace(padded_us=padded)


@functools.partial(jax.jit, donate_argnums=(0,))
def settle_forks(st: EngineState, parents: jax.Array) -> EngineState:
    """The rows of bool[B] `parents` have no outputs left to fork (their outputs 1.. ended with their first token,
    or were aborted): the FORK rule no longer holds for them. `engine_step.fork_requests` does this for the rows
    it forks off."""
    rows = st.sampling
    return st.replace(sampling=rows.replace(siblings=jnp.where(parents, 0, rows.siblings)))
