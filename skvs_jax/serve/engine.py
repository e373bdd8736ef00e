"""The engine: the scheduler driving a real model, many jitted steps per dispatch.

One step has no host round trip inside:

  schedule → copy-on-write copies → query tokens (prompt chunks; last token + Medusa drafts) → paged forward
  (prefill chunks and decode/verification rows in one [B, Q] batch) → verify (greedy or sampled; accept the
  longest prefix of drafts the target agrees with) → update (commit / roll back, append tokens, index blocks,
  reclaim) → per-step statistics.

Up to `steps_per_dispatch` steps run in one jitted program (`serve.dispatch.run_steps`, a `lax.while_loop`), which
ends before a step that needs the host (an admission of a request not staged, a fork, a swap, another width, a
first token); the requests the host staged with a dispatch are admitted by the loop where a finish frees a slot
(`dispatch.Staged`). The schedules are the one-step engine's. The host overlaps the device (`advance`, what `run`
and `stream` take): it sends dispatch k + 1 before it reads dispatch k. `steps_per_dispatch=1` runs one
`engine_step.fused_step` per step with the host between every two, the engine before dispatches of many steps.

The host loop around it is three parts behind one class, after vLLM's Processor / OutputProcessor / EngineCore:

  `serve.requests`  the request table: logs, the queue, slots, n > 1 forks, aborts (no device access);
  `serve.widths`    the width picker: the query width Q of each step from what the previous one reported, the
                    histograms, the padding, the draft widths' re-choice and the warm-up order;
  `Engine` (here)   the device state and its programs: admits the table's requests, runs the step at the
                    picker's width, swaps to the host/disk tiers, fits the step cost (`serve.step_cost`).

Q is an upper bound computed from state the host already read, so the scheduler's decisions never depend on it;
the number of compiled programs is (number of widths) per engine. The prompt width's program also holds the
1 + K width, which it runs when memory left the step without a prompt token, and a split of it: the rows at 1 + K
slots plus extra rows carrying the head of each long prompt chunk, so one row's chunk does not pad every row to
the chunk's width (`engine_step.model_step_at`). Under the policy's `bucket_budget` the draft widths are chosen
from the observed histogram (`warmup(draft_hist)`, and re-chosen as it drifts, `scheduler.buckets`): at most
1 + budget * (1 + re-choices) programs over its life.

Verification is lossless for both greedy and temperature sampling: Medusa's drafts are deterministic (a point
mass q = δ(draft)), for which the rule "accept with probability min(1, p/q), else resample from the normalised
max(0, p − q)" is the same as sampling t ~ p at each position and accepting while t equals the draft; the token
sampled at the first mismatch (or after the last draft) is the bonus token. Greedy is the temperature-0 limit.

Preemption by swap needs host I/O between the scheduler's decision and the model, so with `preemption="swap"`
a step that swaps runs as two jitted programs (schedule; then model + update) with the tier copies between them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from skvs_jax import distributed
from skvs_jax import scheduler as sc
from skvs_jax.config import NULL_BLOCK, CacheConfig
from skvs_jax.kv import manager
from skvs_jax.kv import tiers as tiers_mod
from skvs_jax.policies import Policy
from skvs_jax.serve import dispatch as dispatch_mod
from skvs_jax.serve import engine_step, oracle_drafter
from skvs_jax.serve import sampling as sampling_mod
from skvs_jax.serve import speculation as spec
from skvs_jax.serve import step_cost as step_cost_mod
from skvs_jax.serve.model_runner import LlamaMedusaRunner, ModelRunner
from skvs_jax.serve.options import EngineOptions, draft_tree
from skvs_jax.serve.requests import RequestLog, RequestTable, Result, salt_id, sampling_rows
from skvs_jax.serve.sampling_params import SamplingParams, stop_bytes
from skvs_jax.serve.widths import WidthPicker

# What callers import from here: the engine and, beside it, what a request is made of.
__all__ = ["Engine", "EngineOptions", "SamplingParams", "RequestLog", "salt_id", "stop_bytes"]

_reset_prefix = jax.jit(manager.reset_prefix, static_argnames=("cfg",))
_release_finished = jax.jit(sc.release_finished, static_argnames=("cfg",))


class Engine:
    """`Engine(model, heads, policy, cache_config, options=None, **options)`: add requests, `step()` or `run()`,
    read outputs.

    model: the base `reference_models.Llama`; heads: its `MedusaHeads`, or an `oracle_drafter.OracleDrafter` (drafts
    of a chosen acceptance, for a model without trained heads); required when the policy speculates; the first K
    heads draft; cache_config: the paged cache (its max_seqs slots hold waiting, running and
    swapped requests); options: an `EngineOptions` (docs there and in docs/serving.md), or its fields as keywords
    (which override the given options' fields). Any other model: `Engine.from_runner(runner, params, policy,
    cache_config, ...)` with a `model_runner.ModelRunner`.

    The parts (see the module docstring): `table` (`serve.requests.RequestTable`: `requests`, `queue`, `slot_of`),
    `picker` (`serve.widths.WidthPicker`: the widths and their histograms), and here the device `state`, the
    step log (`step_log`, one dict per step), `dispatch_log` (one dict per dispatch), the compiled (width, swaps)
    pairs (`compiled`), and the step cost (`step_cost`, its timed widths `step_cost_times` and the split
    branch's `split_step_us`).
    """

    def __init__(self, model, heads, policy: Policy, cache_config: CacheConfig, options: EngineOptions | None = None,
                 **overrides):
        if policy.speculation and heads is None:
            raise TypeError("heads must be MedusaHeads (or an OracleDrafter) when the policy speculates")
        options = EngineOptions.of(options, overrides)
        if isinstance(heads, oracle_drafter.OracleDrafter):
            runner, params = LlamaMedusaRunner.create(model, heads.heads if policy.speculation else None)
            if policy.speculation:
                runner, params = oracle_drafter.wrap(runner, params, heads)
        else:
            runner, params = LlamaMedusaRunner.create(model, heads if policy.speculation else None)
        self._setup(runner, params, policy, cache_config, options)

    @classmethod
    def from_runner(cls, runner: ModelRunner, params, policy: Policy, cache_config: CacheConfig,
                    options: EngineOptions | None = None, **overrides):
        """An engine for any model behind the `ModelRunner` protocol (runner static and hashable)."""
        engine = cls.__new__(cls)
        engine._setup(runner, params, policy, cache_config, EngineOptions.of(options, overrides))
        return engine

    def _setup(self, runner: ModelRunner, params, policy: Policy, cache: CacheConfig, opt: EngineOptions) -> None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a Policy, got {type(policy).__name__}")
        tree = draft_tree(runner, policy, opt)
        if cache.max_tokens_per_seq > runner.max_positions:
            raise ValueError(f"max_blocks_per_seq * block_size = {cache.max_tokens_per_seq} exceeds the model's "
                             f"{runner.max_positions} positions")
        scfg = sc.SchedulerConfig(
            cache=cache, policy=policy, max_running=opt.max_running or cache.max_seqs,
            token_budget=opt.token_budget, prefill_chunk=opt.prefill_chunk, victim=opt.victim, impl=opt.impl,
            swap_blocks=opt.swap_blocks + opt.disk_blocks,  # the scheduler counts the room of both tiers
            admit_window=min(cache.max_seqs, 32), control_flow=opt.control_flow,
            prefix_sums=opt.prefix_sums,
            reach_of=spec.reach(tree, tuple(range(policy.draft_len + 1))) if tree else ())
        if not isinstance(opt.step_cost, str):
            sc.check_step_cost(opt.step_cost, scfg)
        kv_dtype = policy.kv_dtype() if opt.kv_dtype is None else opt.kv_dtype  # an explicit dtype overrides
        self.options, self.policy, self.knobs, self.mesh = opt, policy, policy.knobs(), opt.mesh
        kv_shardings = None
        if opt.mesh is not None:
            params, kv_shardings = self._shard(runner, params, opt.mesh, opt.impl, cache, kv_dtype,
                                               policy.preemption == "swap" and scfg.swap_blocks > 0)
            self.knobs = jax.device_put(self.knobs, distributed.replicated(opt.mesh))
        self.runner, self.params = runner, params
        prompt_width = max(scfg.chunk, 1 + policy.draft_len)  # scfg.chunk: prefill_chunk 0 = the budget
        cfg = engine_step.EngineConfig(sched=scfg, impl=opt.impl, kv_dtype=kv_dtype, tree=tree,
                                       acceptance=opt.acceptance, sample_drafts=opt.sample_drafts,
                                       posterior_threshold=float(opt.posterior_threshold),
                                       posterior_alpha=float(opt.posterior_alpha), kv_shardings=kv_shardings)
        self.cfg = dataclasses.replace(cfg, split_rows=engine_step.split_rows_for(cfg, prompt_width)
                                       if opt.split_rows is None else int(opt.split_rows))
        self.picker = WidthPicker(policy, prompt_width)
        # The state always carries a StepCost of one shape (a width table up to the prompt width), so a fit at
        # warm-up replaces data and recompiles nothing. Kept on the host: the step donates the state's copy, which
        # a caller's StepCost must outlive.
        self.step_cost_mode = opt.step_cost if isinstance(opt.step_cost, str) else "given"
        self.step_cost = jax.device_get(sc.flat_step_cost(scfg, max_width=prompt_width)
                                        if isinstance(opt.step_cost, str) else opt.step_cost)
        self.step_cost_times: dict[int, float] = {}  # the fit's measured step time per width (us)
        self.split_step_us: float | None = None  # the fit's time of the prompt width's split branch (us)
        # B default sampling rows on the host, built once: eager jnp ops rebuilding them at every admission cost
        # more than the admission (docs/serving.md, "Host costs"); `sampling_rows` copies them.
        self._default_rows = jax.device_get(sampling_mod.default_rows(cache.max_seqs))
        self._host_backend = opt.mesh is None and jax.default_backend() == "cpu"  # `_fetch`
        # Dispatches of many steps admit the requests the host staged on the device themselves (`serve.dispatch`,
        # `Staged`); the host keeps the ids it staged (a prefix of its queue), and forgets them at its own turns.
        self._loop = opt.steps_per_dispatch != 1  # dispatches run `dispatch.run_steps`; 1: the one-step programs
        self._stages = self._loop and not dispatch_mod.swaps_possible(self.cfg)
        self._staged: list[int] = []
        self._restage = True
        self.table = RequestTable(cache.max_seqs, runner.vocab_size, scfg.max_len, opt.tokenizer, opt.detokenize)
        self.state = self._empty_state()
        # What a dispatch stages when nothing is new (most of them): on the device once, so a dispatch does not
        # move B empty prompt rows (B x max_len tokens) and sampling rows to it each time.
        self._nothing_staged = jax.tree.map(self._put, self._incoming([])) if self._stages else None
        self.clock, self.t0 = opt.clock, opt.clock()
        self.step_log: list[dict] = []
        self.compiled: set[tuple[int, bool]] = set()
        steps = opt.steps_per_dispatch
        self._steps = dispatch_mod.AUTO_STEPS if steps == "auto" else steps  # the most steps a dispatch gets
        self._auto = steps == "auto"
        self._bound = 1 if self._auto else steps  # the next dispatch's bound (auto: `_next_bound`)
        self._added = self._added_seen = 0  # requests added, and as many when the last dispatch was sent
        self._flight: _Flight | None = None  # the dispatch sent and not read yet (`advance`)
        self._ready: list[Result] = []  # results read early (an abort drains the dispatch in flight)
        self._last_stop = dispatch_mod.RUNNING  # why the last dispatch read ended
        self._busy_until = 0.0  # engine time at which the device finished the last dispatch read
        # one row per dispatch: start, end, steps, stop (its reason), width, admitted (staged requests it admitted)
        self.dispatch_log: list[dict] = []
        self.tiers = None
        if policy.preemption == "swap" and scfg.swap_blocks:  # host tier (swap_blocks) backed by disk (disk_blocks)
            self.tiers = tiers_mod.SwapSpace(self._kv_pages(), opt.swap_blocks, opt.disk_blocks, opt.disk_dir)
            self.handles: dict[int, tiers_mod.TieredHandle] = {}

    # ------------------------------------------------------------------------------------- the device state

    def _empty_state(self) -> engine_step.EngineState:
        scfg, runner = self.cfg.sched, self.runner
        b = scfg.cache.max_seqs
        make_cache = functools.partial(runner.init_cache, scfg.cache.num_blocks, scfg.cache.block_size,
                                       self.cfg.kv_dtype)
        if self.mesh is None:
            cache = make_cache()
        else:  # created split over tp, never whole on one device
            cache = jax.jit(make_cache, out_shardings=runner.with_kv_pages(jax.eval_shape(make_cache),
                                                                           self.cfg.kv_shardings))()
        state = engine_step.EngineState(
            sched=sc.init(scfg), cache=cache, hidden=jnp.zeros((b, runner.hidden_size), jnp.float32),
            sampling=sampling_mod.default_rows(b), step_cost=self._device_step_cost(),
            prompt_work=jnp.asarray(False), next_want=jnp.asarray(self.policy.draft_len, jnp.int32),
            staged=jax.tree.map(jnp.asarray, self._incoming([])) if self._stages else None,
            padded_us=jnp.zeros((), jnp.float32))
        # init() shares one zeros buffer between fields; donation needs every leaf to own its buffer.
        state = jax.tree.map(lambda x: x.copy(), state)
        if self.mesh is None:
            return state
        # On a mesh: everything but the cache replicated (a few KB; every rank reads the block tables).
        return jax.device_put(state.replace(cache=None), distributed.replicated(self.mesh)).replace(cache=state.cache)

    def _shard(self, runner: ModelRunner, params, mesh, impl: str, cache_config: CacheConfig, kv_dtype,
               swaps: bool):
        """Validate `mesh` and place the weights on it; returns (params, the cache arrays' shardings)."""
        distributed.tp_size(mesh)
        if pk.resolve_impl(impl, None)[0] == "pallas":  # "auto" is the compiled Pallas kernels on a GPU
            raise ValueError(f"mesh: impl={impl!r} (Pallas) does not run sharded yet (its kernels would need "
                             "shard_map); use impl='xla' with a mesh")
        if swaps and jax.process_count() > 1:
            raise ValueError("mesh: swap preemption reads the cache to this host, which holds only part of it "
                             "when the mesh spans several processes; use preemption='recompute'")
        cache = jax.eval_shape(lambda: runner.init_cache(cache_config.num_blocks, cache_config.block_size,
                                                         kv_dtype))
        params_sh, kv_sh = distributed.runner_shardings(runner, params, cache, mesh)
        return jax.device_put(params, params_sh), kv_sh

    def _put(self, x: np.ndarray) -> jax.Array:
        """Host data into the step: replicated over the mesh if there is one (every process passes the same)."""
        return jnp.asarray(x) if self.mesh is None else jax.device_put(x, distributed.replicated(self.mesh))

    def _arg(self, x: np.ndarray) -> np.ndarray | jax.Array:
        """Host data as an argument of a jitted call (not a state leaf, which the step donates): numpy as is off a
        mesh, where the call moves all of them at once (cheaper than separate transfers: docs/serving.md, "Host
        costs"); replicated on a mesh (`_put`)."""
        return x if self.mesh is None else self._put(x)

    def _fetch(self, tree):
        """A step's outputs on the host (numpy leaves). On a CPU backend without a mesh each leaf is read in place
        (`np.asarray`), which skips `jax.device_get`'s per-leaf async-copy bookkeeping (docs/serving.md, "Host
        costs"); elsewhere `device_get` overlaps the copies."""
        return jax.tree.map(np.asarray, tree) if self._host_backend else jax.device_get(tree)

    def _kv_pages(self) -> tuple:
        return self.runner.kv_pages(self.state.cache)

    def _set_kv_pages(self, pages: tuple) -> None:
        if self.mesh is not None:  # the tier's scatter may come back laid out otherwise: split over tp again
            pages = jax.device_put(pages, self.cfg.kv_shardings)
        self.state = self.state.replace(cache=self.runner.with_kv_pages(self.state.cache, pages))

    def _rows(self, logs: list[RequestLog]) -> sampling_mod.SamplingRows:
        """B sampling rows for these requests, as a jitted call's argument."""
        return jax.tree.map(self._arg, sampling_rows(logs, self._default_rows, self.options.seed))

    def _incoming(self, ids: list[int]) -> dispatch_mod.Staged:
        """These queued requests as rows to stage on the device (host arrays; `dispatch.Staged`)."""
        rows = sampling_rows([self.requests[rid] for rid in ids], self._default_rows, self.options.seed)
        return dispatch_mod.staged_from(*self.table.admission_arrays(ids), rows, len(ids))

    # --------------------------------------------------------------------------------------------- requests

    @property
    def requests(self) -> dict[int, RequestLog]:
        """Every request's `RequestLog` by id (`table.requests`)."""
        return self.table.requests

    def add_request(self, prompt_tokens: Sequence[int], sampling: SamplingParams | None = None, *,
                    arrival_time: float | None = None, request_id: int | None = None,
                    cache_salt: str | None = None) -> int:
        """Queue a request; returns its id. A request the cache can never hold, or a bad argument, is refused
        with ValueError / TypeError naming it, and nothing is queued (`serve.requests.RequestTable.add`).

        arrival_time: seconds on the engine's clock, finite (None: now). cache_salt (vLLM's): requests with
        different salts never share a prefix-cache block, so one tenant cannot learn another's prompts from hit
        timing; requests with the same salt share as unsalted ones do (None = no salt). A request without a
        tpot_target takes the engine's (`EngineOptions.tpot_target`)."""
        if self.options.tpot_target is not None and (sampling is None or isinstance(sampling, SamplingParams)):
            sampling = SamplingParams() if sampling is None else sampling  # anything else: refused by the table
            if sampling.tpot_target is None:
                sampling = dataclasses.replace(sampling, tpot_target=self.options.tpot_target)
        rid = self.table.add(prompt_tokens, sampling, arrival_time, request_id, cache_salt, self.now())
        self._added += 1
        return rid

    def completions(self, request_id: int) -> list[list[int]]:
        """The outputs of a request in order: its n outputs (`SamplingParams.n`), each as `RequestLog.output_tokens`."""
        return self.table.completions(request_id)

    def now(self) -> float:
        return self.clock() - self.t0

    def has_work(self) -> bool:
        """Some request is queued or in a slot, or a dispatch's outputs are not read yet."""
        return self.table.has_work() or self._flight is not None or bool(self._ready)

    def _admit_queue(self) -> None:
        """The queued requests that fit into the device's empty slots (slots finished last step are EMPTY only
        after the next schedule, so the step reports the EMPTY count)."""
        take = self.table.admissions()
        if not take:
            return
        arrays = [self._arg(x) for x in self.table.admission_arrays(take)]
        rows = self._rows([self.requests[rid] for rid in take])
        prompts, lens, new, prio, ids, salts, targets = arrays
        self.state, slots = engine_step.add_requests(self.state, prompts, lens, new, prio, ids, rows, salts, targets,
                                                     cfg=self.cfg)
        self.table.placed(take, np.asarray(slots))
        self.picker.prompt_work = True  # the new requests wait to be prefilled

    def abort_request(self, request_id: int) -> bool:
        """End a request wherever it is: still queued (it leaves the queue) or in a slot (`scheduler.abort` releases
        its blocks, and a swapped request's host-tier copy). Its log keeps the tokens it produced and records no
        finish (`finished` stays False). Returns False when the request is unknown or already ended.

        n > 1 (docs/serving.md, "Aborting"): the request's id (output 0's) ends all of its outputs that have not
        ended, before and after they fork; `request_id + j` ends output j alone (one not forked yet gives back
        the slot held for it, and is never forked). True when some output ended."""
        self._ready += self._drain()  # the slot table must be exact before the host writes to the device
        ended, slots = self.table.abort(request_id)
        self._abort_slots(slots)
        return ended

    def _abort_slots(self, slots: list[int]) -> None:
        """Empty these slots on the device now (`scheduler.abort`: blocks and host-tier copies released); no
        dispatch may be in flight."""
        if slots:
            mask = np.zeros(self.cfg.sched.cache.max_seqs, bool)
            mask[slots] = True
            self.state = self.state.replace(sched=sc.abort(self.state.sched, self._arg(mask), cfg=self.cfg.sched))
        for slot in slots:
            if self.tiers is not None and slot in self.handles:
                self.tiers.release(self.handles.pop(slot))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (`kv.manager.reset_prefix`): later requests find no hit in what was cached
        before. Requests in flight keep their blocks."""
        sched = self.state.sched
        self.state = self.state.replace(sched=sched.replace(kv=_reset_prefix(sched.kv, cfg=self.cfg.sched.kv)))

    # ------------------------------------------------------------------------------------------------- steps

    def step(self) -> list[Result]:
        """One dispatch of up to `steps_per_dispatch` engine steps (`serve.dispatch`), read before returning:
        (request_id, new tokens, finished) for every request that produced tokens or finished in its steps (and in
        a dispatch `advance` left in flight, read first). With steps_per_dispatch=1, one engine step."""
        results = self._take_ready() + self._drain()
        turn = self._host_turn()
        if turn is not None:
            return results + turn
        return results + self._read(self._dispatch(*self.picker.pick(self.knobs)))

    def advance(self) -> list[Result]:
        """One turn of the overlapped serving loop (what `stream` and `run` take): dispatch the next program, then
        read the one before it, so the host's bookkeeping of dispatch k runs while dispatch k + 1 computes.

        The next dispatch is sent before k's outputs are known, at k's width: when k ended because the host is
        needed (an admission, a fork, a swap, another width: `serve.dispatch`), the same rule ends k + 1 before its
        first step, and the host acts before the dispatch after it. Nothing the host writes to the device (admissions,
        forks, aborts) is written while a dispatch it has not read is in flight, so the host's slot table is exact.
        Returns what the read dispatch produced (on the first call, nothing is read yet)."""
        if not self._loop:  # one step per dispatch: a blind next step could not end itself, so none is sent
            return self.step()
        results = self._take_ready()
        if self._flight is None:
            turn = self._host_turn()
            if turn is not None:
                return results + turn
            self._flight = self._dispatch(*self.picker.pick(self.knobs))
        k = self._flight
        self._flight = self._dispatch(k.width, None, exact=True)
        results += self._read(k)
        if self._last_stop not in (dispatch_mod.BOUND, dispatch_mod.FIRST_TOKEN) or self.table.host_stopped:
            results += self._drain()  # k + 1 ran no step, or a stop string ended a request: the host acts first
        return results

    def wait(self) -> None:
        """Block until the dispatch in flight (if any) is done, without reading it: a caller timing its own turns
        (`skvs bench` in lockstep) keeps the device's work inside them."""
        if self._flight is not None:
            self._flight.out.steps.block_until_ready()

    def _take_ready(self) -> list[Result]:
        results, self._ready = self._ready, []
        return results

    def _drain(self) -> list[Result]:
        """Read the dispatch in flight, if any."""
        flight, self._flight = self._flight, None
        return [] if flight is None else self._read(flight)

    def _host_turn(self) -> list[Result] | None:
        """The host's work between dispatches, with none in flight: the step the last dispatch left to the host
        (a swap), else admissions. Returns that step's results, [] when there is nothing to dispatch, or None when
        a dispatch should follow."""
        self._abort_slots(self.table.take_host_stops())  # requests a stop string ended leave their slots
        self._staged, self._restage = [], True  # the host admits now; the next dispatch stages the queue afresh
        if self._last_stop == dispatch_mod.SWAP:
            return self._swap_step()
        self._admit_queue()
        return None if self.table.has_work() else []

    def _admit_at(self) -> int:
        """The empty slots at which the host admits its first queued request not staged (`dispatch.ADMIT`): its
        outputs plus the slots held for unforked outputs (`RequestTable.admissions`' rule)."""
        t = self.table
        if len(t.queue) <= len(self._staged):
            return dispatch_mod.NO_ADMISSION
        return 1 + len(t.live_outputs(t.queue[len(self._staged)])) + sum(t.unforked.values())

    def _stage(self) -> dispatch_mod.Staged:
        """The queued requests to stage with the next dispatch: those after the ones staged, in queue order, up to
        B staged in all (the device may have admitted some of those already: never more than B), stopping at the
        first of n > 1 outputs (its slots for unforked outputs are held by the host's rule)."""
        t = self.table
        room = self.cfg.sched.cache.max_seqs - len(self._staged)
        new = []
        for rid in t.queue[len(self._staged):]:
            if len(new) >= room or t.live_outputs(rid):
                break
            new.append(rid)
        self._staged += new
        return self._incoming(new) if new else self._nothing_staged

    def _took_staged(self, slots: np.ndarray) -> None:
        """The dispatch admitted the first staged requests into these slots (int32[B], -1 past them) before a
        step: they leave the queue for their slots, as the host's own admission would have placed them."""
        m = int(np.sum(slots >= 0))
        if m:
            ids, self._staged = self._staged[:m], self._staged[m:]
            self.table.admit_staged(ids, slots[:m])
            self.picker.prompt_work = True

    def _dispatch(self, width: int, bound: int | None, exact: bool = False) -> _Flight:
        """Send one dispatch at `width` (not read here): `dispatch.run_steps`, or with steps_per_dispatch=1 the
        one-step programs (`engine_step.fused_step`; with a swap tier `schedule_only`, the tier copies,
        `model_only`). bound: the draft bound that picked the width (`WidthPicker.pick`); exact: the width was not
        chosen from the last step's outputs (`advance`)."""
        del bound  # the read replays the host's pick per step (`_took_step`)
        start = self.now()
        self.compiled.add((width, self.tiers is not None))
        args = (self.runner, self.params)
        if not self._loop:
            if self.tiers is None:
                self.state, out = engine_step.fused_step(*args, self.state, self.knobs, engine_step.AUTO,
                                                         cfg=self.cfg, width=width)
            else:
                self.state, batch = engine_step.schedule_only(self.state, self.knobs, cfg=self.cfg)
                self._swap(batch)
                self.state, out = engine_step.model_only(*args, self.state, batch, self.knobs, engine_step.AUTO,
                                                         cfg=self.cfg, width=width)
            return _Flight(width=width, start=start, out=out)
        incoming = self._stage() if self._stages else None
        lim = dispatch_mod.limits(self._next_bound(), self._admit_at(), exact, held=sum(self.table.unforked.values()),
                                  restage=self._restage)
        self._restage = False
        put = functools.partial(jax.tree.map, self._arg)
        self.state, out = dispatch_mod.run_steps(*args, self.state, self.knobs, put(lim), engine_step.AUTO,
                                                 None if incoming is None else put(incoming), cfg=self.cfg,
                                                 width=width, capacity=dispatch_mod.CAPACITY)
        return _Flight(width=width, start=start, out=out)

    def _next_bound(self) -> int:
        """The next dispatch's bound on its steps. A fixed steps_per_dispatch is itself. "auto" starts at 1 and
        doubles with every dispatch sent while no request was added, up to `dispatch.AUTO_STEPS`; a request added
        since the last dispatch was sent brings it back to 1. A request that arrives during a dispatch waits for
        its end to be admitted (the device cannot read the host's queue), so while requests keep arriving the
        dispatches stay short; a batch queued at once soon runs at the full bound (docs/serving.md)."""
        if not self._auto:
            return self._steps
        if self._added != self._added_seen:
            self._added_seen, self._bound = self._added, 1
        else:
            self._bound = min(2 * self._bound, self._steps)
        return self._bound

    def _read(self, flight: _Flight) -> list[Result]:
        """A dispatch's outputs into the request table, the width picker and the step log (blocks until it is done).
        Each step's time is the dispatch's wall time (from when the device could start it) spread over its steps
        in proportion to the fitted step cost of the width each ran (equal shares before a fit)."""
        if isinstance(flight.out, engine_step.StepOut):  # one step (steps_per_dispatch=1)
            steps, stop, rows, took = 1, dispatch_mod.BOUND, [self._fetch(flight.out)], None
        else:
            head = self._fetch((flight.out.steps, flight.out.stop))
            steps, stop = int(head[0]), int(head[1])
            out = self._fetch(flight.out.out) if steps else None
            took = self._fetch(flight.out.took) if steps and self._stages else None
            rows = [jax.tree.map(lambda x, i=i: x[i], out) for i in range(steps)]
        end = self.now()
        start = max(flight.start, self._busy_until)
        self._busy_until, self._last_stop = end, stop
        self.dispatch_log.append(dict(start=start, end=end, steps=steps, stop=dispatch_mod.STOP_NAMES[stop],
                                      width=flight.width,
                                      admitted=0 if took is None else int(np.sum(took[:steps] >= 0))))
        if not steps:
            return []
        times = _spread(start, end, [self._priced(r) for r in rows])
        results = []
        for i, row in enumerate(rows):
            if took is not None:
                self._took_staged(took[i])
            results += self._took_step(row, flight.width, times[i], times[i + 1])
        if not self.table.has_work() and rows[-1].finished.any():
            self._release_idle(int(np.sum(rows[-1].finished)))
        return results

    def _priced(self, out: engine_step.StepOut) -> float:
        """A step's share of its dispatch's time: the fitted time of the width it ran (1 without a fit)."""
        if bool(out.split) and self.split_step_us is not None:
            return self.split_step_us
        return self.step_cost_times.get(int(out.width), 1.0) if self.step_cost_times else 1.0

    def _took_step(self, out: engine_step.StepOut, width: int, start: float, end: float) -> list[Result]:
        """One step's outputs (numpy leaves) at `width`: the picker, the request table, the step log and forks."""
        if not out.width_ok:
            raise RuntimeError("engine bug: a query did not fit its bucket or an allocation failed")
        _, bound = self.picker.pick(self.knobs)  # the bound the host's rule would have picked this step with
        self.table.free_slots = int(out.free_slots) - sum(self.table.unforked.values())
        ran = self.picker.observe(out, width, self.knobs)
        forking = self.table.forking()
        results = self.table.collect(out, end)
        self.step_log.append(_step_row(out, start, end))
        self._account_padding(out, ran, bound)
        return results + self._fork(out, forking, end)

    def _swap_step(self) -> list[Result]:
        """The step a dispatch left to the host because its schedule swaps (`dispatch.SWAP`): schedule, the tier
        copies, then the model step, as two programs (the engine's only per-step host loop)."""
        self._last_stop = dispatch_mod.RUNNING
        width, _ = self.picker.pick(self.knobs)
        start = max(self.now(), self._busy_until)
        args = (self.runner, self.params)
        self.state, batch = engine_step.schedule_only(self.state, self.knobs, cfg=self.cfg)
        self._swap(batch)
        self.state, out = engine_step.model_only(*args, self.state, batch, self.knobs, engine_step.AUTO,
                                                 cfg=self.cfg, width=width)
        out = self._fetch(out)
        self._busy_until = end = self.now()
        results = self._took_step(out, width, start, end)
        if not self.table.has_work() and out.finished.any():
            self._release_idle(int(np.sum(out.finished)))
        return results

    def _account_padding(self, out: engine_step.StepOut, width: int, bound: int | None) -> None:
        """The step's padding into its log row (`WidthPicker.account`); re-chosen draft widths are installed.
        bound: what picked the width (None: a prompt-width step, or the widest after the knobs changed)."""
        pad, widths = self.picker.account(out, width, bound)
        b, narrow = self.cfg.sched.cache.max_seqs, engine_step.narrow_width(self.cfg)
        # What the forward computed: query slots of the layout it ran, logits at every row's sampling slots.
        slots = (b + self.cfg.split_rows) * narrow if bool(out.split) else b * width
        self.step_log[-1].update(width=width, bound=-1 if bound is None else bound, padding=pad,
                                 split=bool(out.split), query_slots=slots,
                                 logit_rows=b * engine_step.logit_slots(self.cfg))
        if widths is not None:
            self.set_draft_widths(widths)

    def _fork(self, out: engine_step.StepOut, forking: dict[int, int], end: float) -> list[Result]:
        """Outputs 1.. of the n > 1 requests whose output 0 sampled its first token this step fork off its slot,
        sharing the prompt's blocks (`RequestTable.fork_plan`)."""
        results, forks = self.table.fork_plan(out, forking, end)
        settled = [slot for slot in forking.values() if out.num_new[slot]]
        if settled and not forks:  # nothing forks off them: clear their siblings, so no dispatch waits on them
            mask = np.zeros(self.cfg.sched.cache.max_seqs, bool)
            mask[settled] = True
            self.state = dispatch_mod.settle_forks(self.state, self._arg(mask))
        if not forks:
            return results
        b = self.cfg.sched.cache.max_seqs
        parent, ids, first = (np.full(b, -1, np.int32) for _ in range(3))
        for row, (slot, cid, token) in enumerate(forks):
            parent[row], ids[row], first[row] = slot, cid, token
        put = self._arg
        rows = self._rows([self.requests[cid] for _, cid, _ in forks])
        self.state, slots = engine_step.fork_requests(self.state, put(parent), put(ids), put(first), rows,
                                                      cfg=self.cfg)
        return results + self.table.forked(forks, np.asarray(slots))

    def _release_idle(self, finished: int) -> None:
        """The slots the last step finished give their blocks back now (`scheduler.release_finished`, phase 0 of
        the next `schedule`, run early): an idle engine holds no request's blocks. One small dispatch, only when
        the engine runs dry; while it has work the next step's schedule releases them at no extra cost, and the
        same way, so no schedule changes."""
        sched = _release_finished(self.state.sched, cfg=self.cfg.sched)
        self.state = self.state.replace(sched=sched)
        self.table.free_slots += finished

    def _swap(self, batch) -> None:
        out_rows = np.flatnonzero(np.asarray(batch.swap_out))
        in_rows = np.flatnonzero(np.asarray(batch.swap_in))
        if not len(out_rows) and not len(in_rows):
            return
        blocks = np.asarray(batch.swap_out_blocks)
        for row in out_rows:  # read before anything is written this step
            ids = blocks[row][blocks[row] != NULL_BLOCK]
            handle = self.tiers.swap_out(self._kv_pages(), ids)  # spills older swaps to disk when the host is full
            if not handle.ok:
                raise RuntimeError("swap tiers full although the scheduler counted room (engine bug)")
            self.handles[int(row)] = handle
        table = np.asarray(batch.block_table)
        pages = self._kv_pages()
        for row in in_rows:
            handle = self.handles.pop(int(row))
            pages = self.tiers.swap_in(pages, handle, table[row, : handle.num_blocks])
        self._set_kv_pages(pages)

    def stream(self) -> Iterator[Result]:
        """Serve until every queued request finished, yielding (request_id, new tokens, finished) as each dispatch
        is read (`advance`: the host's work overlaps the device's)."""
        while self.has_work():
            yield from self.advance()

    def run(self) -> dict[int, list[int]]:
        """Step until done; returns every request's output tokens."""
        for _ in self.stream():
            pass
        return {rid: r.output_tokens for rid, r in self.requests.items()}

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None) -> list[list[int]]:
        """Convenience: queue prompts, run, return their outputs in order (one list of tokens per prompt).

        Refuses `sampling.n > 1`, whose n outputs a list of one output per prompt cannot hold: queue such
        requests with `add_request`, `run()`, and read each one's outputs with `completions(request_id)`."""
        if isinstance(sampling, SamplingParams) and sampling.n > 1:
            raise ValueError(f"generate returns one output per prompt, but sampling.n = {sampling.n}: use "
                             "add_request(prompt, sampling), run(), then completions(request_id) for its n outputs")
        ids = [self.add_request(p, sampling) for p in prompts]
        outputs = self.run()
        return [outputs[i] for i in ids]

    # ---------------------------------------------------------------------------------- widths and warm-up

    def set_draft_widths(self, widths) -> None:
        """Replace the draft widths (data in the scheduler's state: nothing compiled is recompiled; a new width
        compiles its program when first run). widths: 1..W draft counts in [0, K], K among them."""
        widths = self.picker.set_draft_widths(widths, compiled_any=bool(self.compiled))
        sched = self.state.sched
        self.state = self.state.replace(sched=sched.replace(
            draft_widths=self._put(sc.buckets.padded(widths, self.policy.width_slots))))
        if self.step_cost_times:  # a fitted cost: new widths priced between the timed ones until refitted
            self._install_step_cost()

    def warmup(self, draft_hist: dict[int, int] | None = None,
               on_compiled: Callable[[int, int, int], None] | None = None) -> list[int]:
        """Compile every query bucket now, hottest first, so no request waits for a compilation.

        draft_hist maps a step's most drafts -> steps (default: this engine's own `picker.draft_hist`, e.g. from
        an earlier run; pass another engine's to warm up in the order a workload needs; `picker.bucket_hist` weighs
        each step by its decode rows, the padding's weight). Under `bucket_budget` a non-empty histogram first
        chooses the draft widths (`scheduler.buckets.choose_widths`). The prompt width comes first (every request
        is prefilled with it), then the draft buckets in order of the observed steps that fall into them
        (`WidthPicker.warmup_order`). Runs each program once on a copy of the state with no requests, so the
        engine's state is unchanged; an engine warmed up before its first request restarts its clock afterwards
        (times are measured from when it was ready to serve). Returns the widths in the order compiled.

        Empty steps execute only the kernels an empty step reaches. XLA:CPU spends time on each kernel's first
        execution (docs/serving.md), so the first preemption, eviction or prefix hit of this process's programs
        runs slower once; a timing should serve its workload once untimed first (`skvs bench --rehearse`).
        Engines of one configuration share programs. on_compiled(width, done, total) is called after each width
        (a progress line).
        """
        hist = self.picker.draft_hist if draft_hist is None else draft_hist
        chosen = self.picker.choose_from(hist)  # choose the programs from the histogram first
        if chosen is not None:
            self.set_draft_widths(chosen)
        order = self.picker.warmup_order(hist)
        empty = self._empty_state()
        b, max_len = self.cfg.sched.cache.max_seqs, self.cfg.sched.max_len
        zeros, put = np.zeros((b,), np.int32), self._arg  # all-padding rows: compiles `add` without adding anything
        jax.block_until_ready(engine_step.add_requests(
            jax.tree.map(lambda x: x.copy(), empty), put(np.zeros((b, max_len), np.int32)), put(zeros), put(zeros + 1),
            put(zeros), put(zeros - 1), self._rows([]), put(zeros), put(zeros), cfg=self.cfg))
        jax.block_until_ready(sampling_mod.stream_keys(zeros.astype(np.uint32), zeros))  # what an admission runs
        for i, w in enumerate(order):
            jax.block_until_ready(self._idle_step(empty, w))
            if self.tiers is not None and self._loop:  # the steps that swap run as two programs
                jax.block_until_ready(self._idle_swap_step(empty, w))
            self.compiled.add((w, self.tiers is not None))
            if on_compiled is not None:
                on_compiled(w, i + 1, len(order))
        if self.step_cost_mode == "fit" and (self.policy.goodput_control or self.policy.priced_drafts):
            self.fit_step_cost()
        if not self.requests:
            self.t0 = self.clock()
        return order

    # ---------------------------------------------------------------------------------------- the step cost

    def fit_step_cost(self, rounds: int = step_cost_mod.MEASURE_ROUNDS) -> sc.StepCost:
        """Time one step of every width the engine runs now on empty slots (`serve.step_cost.measure`), fit the
        step cost from them (`serve.step_cost.fit`) and price the next steps with it; returns it. Its times (us per
        width) stay in `step_cost_times`. Compiles any width not compiled yet; the engine's state is unchanged
        (empty slots: a padded step computes every slot whatever it holds)."""
        empty = self._empty_state()

        def prepare(key):
            state = jax.tree.map(lambda x: x.copy(), empty)  # untimed: the step donates its state
            return lambda: self._idle_step(state, *key, copy=False)

        now = self.picker.runnable()
        keys = [(w, engine_step.WIDE) for w in now]
        if self._splits():
            keys.append((self.picker.prompt_width, engine_step.SPLIT))
        timed = step_cost_mod.measure(prepare, keys, rounds)
        self.step_cost_times = {w: t for (w, branch), t in timed.items() if branch == engine_step.WIDE}
        self.split_step_us = timed.get((self.picker.prompt_width, engine_step.SPLIT))
        self.compiled |= {(w, self.tiers is not None) for w in now}
        self._install_step_cost()
        return self.step_cost

    def _idle_step(self, state: engine_step.EngineState, width: int, branch: int = engine_step.WIDE,
                   copy: bool = True):
        """One step at `width` on a state with no requests (a copy of it unless copy=False: the dispatch donates
        it), through the program serving dispatches at that width run (`dispatch.run_steps`, made to run one step
        on empty slots), its `branch` forced (`engine_step.model_step_at`: WIDE, the whole width, by default);
        returns its outputs. What `warmup` compiles with and `fit_step_cost` times."""
        if copy:
            state = jax.tree.map(lambda x: x.copy(), state)
        if not self._loop:
            if self.tiers is not None:
                state, batch = engine_step.schedule_only(state, self.knobs, cfg=self.cfg)
                return engine_step.model_only(self.runner, self.params, state, batch, self.knobs, branch,
                                              cfg=self.cfg, width=width)
            return engine_step.fused_step(self.runner, self.params, state, self.knobs, branch, cfg=self.cfg,
                                          width=width)
        put = functools.partial(jax.tree.map, self._arg)
        incoming = self._nothing_staged  # the serving call's structure (None without staging): one program
        lim = put(dispatch_mod.limits(1, probe=True))
        return dispatch_mod.run_steps(self.runner, self.params, state, self.knobs, lim, branch, incoming, cfg=self.cfg,
                                      width=width, capacity=dispatch_mod.CAPACITY)

    def _idle_swap_step(self, state: engine_step.EngineState, width: int):
        """`_idle_step` through the two programs of a step the host runs because it swaps (`_swap_step`)."""
        state, batch = engine_step.schedule_only(jax.tree.map(lambda x: x.copy(), state), self.knobs, cfg=self.cfg)
        return engine_step.model_only(self.runner, self.params, state, batch, self.knobs, engine_step.AUTO,
                                      cfg=self.cfg, width=width)

    def _splits(self) -> bool:
        """The prompt width's program has a split branch (`engine_step.model_step_at`)."""
        return self.cfg.split_rows > 0 and self.picker.prompt_width > engine_step.narrow_width(self.cfg)

    def _install_step_cost(self) -> None:
        """The fit of `step_cost_times` over the current widths, into the state (same shapes: no recompile). With
        a split branch, a step with prompt work is priced at the split's time: what it runs unless the chunks
        outgrow the extra rows."""
        times = dict(self.step_cost_times)
        if self.split_step_us is not None:
            times[self.picker.prompt_width] = self.split_step_us
        cost = step_cost_mod.fit(times, self.picker.runnable(), self.cfg.sched.token_budget, self.picker.prompt_width)
        self.step_cost = jax.device_get(cost)
        self.state = self.state.replace(step_cost=self._device_step_cost())

    def _device_step_cost(self) -> sc.StepCost:
        """`step_cost` (host arrays) on the device, each leaf its own buffer (the step donates them)."""
        return jax.tree.map(lambda x: self._put(np.array(x)), self.step_cost)


def _step_row(out: engine_step.StepOut, start: float, end: float) -> dict:
    """A step's row of `Engine.step_log` (`_account_padding` adds its width, bound, padding, split, query slots
    and logit rows)."""
    return dict(
        start=start, duration=end - start, tokens=int(out.num_tokens), blocks_used=int(out.blocks_used),
        spec_blocks=int(out.spec_blocks), oom=bool(out.oom), preempted=int(np.sum(out.preempted)),
        drafted=int(np.sum(out.num_drafts)), accepted=int(np.sum(out.accepted)),
        verifications=int(np.sum(out.num_drafts > 0)), output_tokens=int(np.sum(out.num_new)),
        prefill_tokens=int(out.shape.prefill_tokens), decode_tokens=int(out.shape.decode_tokens),
        kv_tokens_read=int(out.shape.kv_tokens_read), num_seqs=int(out.shape.num_seqs),
        drafting_rows=int(out.shape.drafting_rows),
    )


@dataclasses.dataclass(frozen=True)
class _Flight:
    """A dispatch sent and not read: its width, when it was sent (engine time) and its outputs (device arrays)."""

    width: int
    start: float
    out: dispatch_mod.Dispatched | engine_step.StepOut  # a StepOut: one step (steps_per_dispatch=1)


def _spread(start: float, end: float, weights: list[float]) -> list[float]:
    """The boundaries of len(weights) consecutive steps sharing [start, end] in proportion to the weights."""
    total = sum(weights) or 1.0
    edges, acc = [start], 0.0
    for w in weights:
        acc += w
        edges.append(start + (end - start) * acc / total)
    return edges
