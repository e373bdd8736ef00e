"""`skvs bench`'s serving: one policy's engine over the trace (`Serving`, `serve`), several in lockstep
(`serve_together`, each on its own `TurnClock`), and the rounds of a group of policies (`serve_group`,
`serving_groups`). What the engines are built with (`engine_kwargs`) and the progress bar (`Progress`) live here
too; the flags are `bench`'s and the report is `bench_report`'s.

The client side, as `vllm bench serve` drives a server: a request is added to the engine when it arrives
(`Request.arrival_time` on the engine's clock; all at t = 0 without a rate), and with `--max-concurrency N` only
while fewer than N added requests are unfinished. Such a request's arrival is when it could be sent: the later
of its own arrival and the finish that freed its place (vLLM's benchmark starts a request's clock once its
semaphore lets it go, so TTFT excludes the wait for a place). Each output token's time is the end of the engine
step that produced it (`RequestLog.token_times`), from which `metrics` computes the ITL.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from skvs_jax import metrics
from skvs_jax.commands import policy_flags
from skvs_jax.serve import engine as eng
from skvs_jax.serve import speculation, step_cost

# Compiled engine programs one process keeps at once. XLA:CPU maps ~2,500 memory regions per engine step of the
# shipped model, and Linux's default limit is 65,530 maps a process: the ablation's ~40 programs together abort in
# LLVM ("Cannot allocate memory"). Policies beyond this are served in groups, each group's programs freed after it.
MAX_LIVE_PROGRAMS = 16
# Timed rounds of the rehearsal's refit of the step cost (`Serving.refit`): 3x the engine's default, ~1 s here.
REFIT_ROUNDS = 21


def tree_of(args):
    return None if args.tree == "chain" else speculation.SMALL_TREE


def host_blocks(args) -> int:
    """--host-blocks, default the KV budget's usable blocks (every swapped sequence fits)."""
    return args.kv_blocks - 1 if args.host_blocks is None else args.host_blocks


def engine_kwargs(policy, args) -> dict:
    kwargs = dict(token_budget=args.token_budget, prefill_chunk=args.prefill_chunk, impl=args.impl, seed=args.seed,
                  step_cost=getattr(args, "step_cost", "fit"), split_rows=getattr(args, "split_rows", None),
                  steps_per_dispatch=getattr(args, "steps_per_dispatch", "auto"),
                  tpot_target=policy_flags.tpot_target(args))
    if policy.preemption == "swap":
        kwargs["swap_blocks"] = host_blocks(args)
    if policy.speculation:
        kwargs |= dict(tree=tree_of(args), acceptance=args.acceptance)
    return kwargs


class TurnClock:
    """A wall clock that runs only during its owner's turns (`start` .. `stop`), plus the waits it `skip`s: engines
    served in lockstep (`serve_together`) each see the time of their own steps, not of each other's."""

    def __init__(self) -> None:
        self._spent, self._since = 0.0, None

    def __call__(self) -> float:
        return self._spent if self._since is None else self._spent + time.perf_counter() - self._since

    def start(self) -> None:
        self._since = time.perf_counter()

    def stop(self) -> None:
        self._spent, self._since = self(), None

    def skip(self, seconds: float) -> None:
        """An idle wait for the next arrival, taken on this clock alone instead of slept."""
        self._spent += max(0.0, seconds)


class Progress:
    """The bench's progress bar (tqdm, on stderr): output tokens of the timed runs against their total, what is
    happening (`note`: "compiling skvs: width 5 done (2/4)", "lockstep (1/3)"), and the *served* output-token
    rate: the tokens over the time the engines' own clocks ran while serving them (`served`), so compilation,
    rehearsals and, in lockstep, the other engines' turns stay out of it (tqdm's own rate, tokens per second of
    the bar's wall time, counted all of them)."""

    def __init__(self, total_tokens: int, desc: str = "skvs bench"):
        from tqdm import tqdm

        self.bar = tqdm(total=total_tokens, desc=desc, bar_format="{desc}: {percentage:3.0f}%|{bar}| "
                        "{n_fmt}/{total_fmt} tok [{elapsed}{postfix}]")
        self.tokens, self.seconds, self.text = 0, 0.0, ""

    def served(self, tokens: int, seconds: float) -> None:
        """`tokens` more output tokens served in `seconds` more of one engine's clock."""
        self.tokens += tokens
        self.seconds += max(0.0, seconds)
        self.bar.update(tokens)
        self._show()

    def note(self, text: str) -> None:
        self.text = text
        self._show()

    def rate(self) -> float:
        return metrics.safe_ratio(self.tokens, self.seconds)

    def _show(self) -> None:
        rate = self.rate()
        served = f"served {rate:.0f} tok/s" if rate == rate else ""
        self.bar.set_postfix_str(", ".join(x for x in (self.text, served) if x))

    def close(self) -> None:
        self.bar.close()


class Serving:
    """One policy's engine serving the trace one `turn` at a time: `serve` takes its turns back to back,
    `serve_together` takes several policies' turns in lockstep. Arguments as `serve`'s; clock: the engine's clock
    (a `TurnClock` in lockstep; default the wall clock, and an idle engine sleeps until the next arrival)."""

    def __init__(self, model, heads, policy, cache, trace, args, progress=None, knobs=None, bucket_hist=None,
                 fitted=None, rehearsal=False, clock: TurnClock | None = None):
        kwargs = engine_kwargs(policy, args)
        if fitted is not None:
            kwargs["step_cost"] = fitted[0]
        if clock is not None:
            kwargs["clock"] = clock
        self.e = e = eng.Engine(model, heads, policy, cache, **kwargs)
        if knobs is not None:
            e.knobs = knobs  # the engine reads its knobs every step (and widens its next query width when they change)
        if getattr(args, "warmup", True):
            note = None
            if progress is not None:
                progress.note(f"compiling {policy.name}: {len(e.picker.widths)} widths")

                def note(width, done, total, name=policy.name):
                    progress.note(f"compiling {name}: width {width} done ({done}/{total})")
            e.warmup(bucket_hist or None, on_compiled=note)  # every query bucket: no compilation in the timed run
        if e.step_cost_times:  # this engine fitted its step cost: what later repeats plan with (host arrays)
            fitted = (e.step_cost, e.step_cost_times, e.split_step_us)
        self.cache, self.args, self.progress, self.rehearsal, self.clock = cache, args, progress, rehearsal, clock
        self.fitted = fitted
        self.pending = sorted(trace.requests, key=lambda r: r.arrival_time)
        self.sched_snapshot = None
        self.max_concurrency = getattr(args, "max_concurrency", None)
        self.clock_seen = e.now()

    def busy(self) -> bool:
        return bool(self.pending) or self.e.has_work()

    def _admit(self) -> None:
        """Add the requests that have arrived, up to --max-concurrency unfinished (the module docstring)."""
        e, args = self.e, self.args
        now = e.now()
        cap = self.max_concurrency
        while self.pending and self.pending[0].arrival_time <= now:
            arrival = self.pending[0].arrival_time
            if cap is not None:
                added = len(e.requests)
                finished = sorted(r.finish_time for r in e.requests.values() if r.finished or r.aborted)
                if added - len(finished) >= cap:
                    return
                if added >= cap:  # the k-th request's place is the one the (k - cap)-th finish freed
                    arrival = max(arrival, finished[added - cap])
            r = self.pending.pop(0)
            e.add_request(r.prompt, eng.SamplingParams(max_tokens=r.max_new_tokens, temperature=args.temperature),
                          arrival_time=arrival, request_id=r.request_id)

    def turn(self) -> None:
        """Admit what has arrived (`_admit`), then one turn of the engine's overlapped loop (`Engine.advance`:
        dispatch the next program, read the last), or (nothing to run) wait for the next arrival. In lockstep the
        turn ends when the dispatch it sent is done, so no engine's program runs during another engine's turn."""
        e = self.e
        self._admit()
        if not e.has_work():
            wait = self.pending[0].arrival_time - e.now()
            if self.clock is not None:
                self.clock.skip(wait)
            else:
                time.sleep(max(0.0, wait))
            return
        new = e.advance()
        if self.clock is not None:
            e.wait()
        if len(e.step_log) >= 4 and self.sched_snapshot is None and not self.rehearsal:
            self.sched_snapshot = jax.tree.map(lambda x: x.copy(), e.state.sched)
        if self.progress is not None and not self.rehearsal:
            now = e.now()
            self.progress.served(sum(len(t) for _, t, _ in new), now - self.clock_seen)
            self.clock_seen = now

    def refit(self, rounds: int | None = None) -> None:
        """Fit the step cost again, now that the trace has run every kernel of the engine's programs once, with
        more rounds (default `REFIT_ROUNDS`): what the timed runs plan with. The warm-up's fit times programs
        fresh from compilation; measured on the default trace, its ratio of the width-5 to the width-1 step
        ranged 0.88-1.41 over nine bench runs (below 1, the fit makes every draft free), against 1.08-1.25 for
        fits taken after a served trace."""
        e = self.e
        e.fit_step_cost(REFIT_ROUNDS if rounds is None else rounds)
        self.fitted = (e.step_cost, e.step_cost_times, e.split_step_us)

    def result(self) -> dict:
        """The run's metrics, outputs, per-step series, counters and fit (after the last turn)."""
        e, cache = self.e, self.cache
        sched_time = _scheduler_time(e, self.sched_snapshot)
        log = metrics.StepLog()
        blocks_total = cache.usable_blocks
        for s in e.step_log:
            log.append(start_time=s["start"], duration=s["duration"], blocks_used=s["blocks_used"],
                       blocks_total=blocks_total, scheduler_time=min(sched_time, s["duration"]),
                       spec_waste_blocks=s["spec_blocks"], oom=s["oom"], num_preempted=s["preempted"],
                       num_drafted=s["drafted"], num_accepted=s["accepted"], num_verifications=s["verifications"],
                       num_output_tokens=s["output_tokens"])
        records = [metrics.RequestRecord(
            request_id=r.request_id, arrival_time=r.arrival_time, first_token_time=r.first_token_time,
            finish_time=r.finish_time, num_prompt_tokens=len(r.prompt), num_output_tokens=len(r.tokens),
            num_cached_prompt_tokens=r.cached_tokens, num_admitted_prompt_tokens=r.admitted_tokens,
            num_preemptions=r.preemptions, num_drafted=r.drafted, num_accepted=r.accepted, aborted=not r.finished,
            num_first_cached_prompt_tokens=r.first_cached_tokens,
            token_times=r.token_times, tpot_target=r.sampling.tpot_target,
        ) for r in e.requests.values()]
        result = metrics.with_units(metrics.summarize(records, log.freeze()))
        series = {"time_s": [s["start"] + s["duration"] for s in e.step_log],
                  "output_tokens": [s["output_tokens"] for s in e.step_log],
                  "blocks_used": [s["blocks_used"] for s in e.step_log],
                  "spec_blocks": [s["spec_blocks"] for s in e.step_log]}
        outputs = {rid: list(r.tokens) for rid, r in e.requests.items()}
        counters = {k: int(v) for k, v in dataclasses.asdict(e.state.sched.counters).items()}
        result |= metrics.attribution(counters, len(records))  # what the drafts cost in memory
        fitted = self.fitted
        return {"metrics": result, "requests": metrics.request_rows(records), "records": records,
                "outputs": outputs, "series": series,
                "counters": counters,
                "compiled": sorted(e.compiled), "bucket_hist": e.picker.bucket_hist, "padding": e.picker.padding,
                "fitted": fitted,
                "step_cost_us": {str(w): round(t, 1) for w, t in sorted(fitted[1].items())} if fitted else {},
                "split_step_us": round(fitted[2], 1) if fitted and fitted[2] is not None else None,
                "split": {"steps": e.picker.split_steps, "narrow_width": eng.engine_step.narrow_width(e.cfg),
                          "rows": e.cfg.split_rows},
                "width_hist": {str(w): n for w, n in sorted(e.picker.width_hist.items())},
                "dispatches": dispatch_summary(e),
                # per depth, verifications that offered a draft there after accepting every earlier one, and of
                # those the ones that accepted it (population totals; they halve together past POP_HALVE_AT)
                "acceptance_by_depth": {"tried": np.asarray(e.state.sched.pop_tried).tolist(),
                                        "passed": np.asarray(e.state.sched.pop_passed).tolist()}}


def dispatch_summary(e: eng.Engine) -> dict:
    """How the run's steps were dispatched: dispatches (those that ran a step, and all), steps, dispatches per
    request, the dispatches by why they ended (`serve.dispatch.STOP_NAMES`), and the requests the dispatch loop
    admitted itself (staged by the host, `serve.dispatch.Staged`)."""
    log = e.dispatch_log
    ran = [d for d in log if d["steps"]]
    stops = collections.Counter(d["stop"] for d in ran)
    requests = max(1, len(e.requests))
    return {"dispatches": len(ran), "sent": len(log), "steps": sum(d["steps"] for d in log),
            "per_request": round(len(ran) / requests, 3), "stops": dict(sorted(stops.items())),
            "admitted": sum(d.get("admitted", 0) for d in log)}


def serve(model, heads, policy, cache, trace, args, progress=None, knobs=None, bucket_hist=None,
          fitted=None, rehearsal=False) -> dict:
    """Run one policy over the trace; returns its metrics, outputs and per-step series. knobs: the policy's
    knobs with a `--policies` draft-length knob (default `policy.knobs()`). bucket_hist: the previous repeat's
    `WidthPicker.bucket_hist`, from which a policy with `bucket_budget` chooses its draft widths at warm-up (the
    result's "bucket_hist" is this run's). fitted: an earlier repeat's result["fitted"] (its fitted step cost
    and times), used as given so every repeat plans with the same cost (the first run fits it). rehearsal: an
    untimed run (`--rehearse`), so the scheduler's own time is not measured after it, nor its tokens counted
    on the progress bar (a `Progress`, which also shows the compilation)."""
    run = Serving(model, heads, policy, cache, trace, args, progress=progress, knobs=knobs, bucket_hist=bucket_hist,
                   fitted=fitted, rehearsal=rehearsal)
    while run.busy():
        run.turn()
    if rehearsal and run.e.step_cost_times:
        run.refit()
    return run.result()


def serve_together(calls: list[dict], equal_widths: bool = False) -> list[dict]:
    """Serve several policies in lockstep: one step of each in the order given, round after round, each engine on
    a `TurnClock` that runs only during its own steps. calls: `serve`'s keyword arguments, one dict per policy;
    returns `serve`'s results in the same order. Every engine is warmed up (and fits its step cost) before the
    first step. Why: this CPU's speed drifts by 8% or more between runs of a second (docs/benchmarks.md), so
    policies served one after another see different machines; stepped in turn, each policy's steps are spread
    over the same seconds as the others', and the drift cancels out of their ratios. Each step runs right after
    another policy's program, not its own (cold caches for all alike). equal_widths: first time every engine's
    step at the widths all of them compile (`equal_width_steps`), into each result's "equal_width_us"."""
    runs = [Serving(**call, clock=TurnClock()) for call in calls]
    timed = equal_width_steps([r.e for r in runs]) if equal_widths and len(runs) > 1 else None
    while any(r.busy() for r in runs):
        for r in runs:
            if r.busy():
                r.clock.start()
                r.turn()
                r.clock.stop()
    results = [r.result() for r in runs]
    if timed is not None:
        for result, by_width in zip(results, timed, strict=True):
            result["equal_width_us"] = by_width
    return results


EQUAL_WIDTH_ROUNDS = 10  # `equal_width_steps`: rounds, one step of each engine at each width per round


def equal_width_steps(engines: list, rounds: int = EQUAL_WIDTH_ROUNDS) -> list[dict[str, float]]:
    """Per engine, the median microseconds of one step at each query width every engine compiles (its WIDE
    branch, on empty slots: `Engine._idle_step`, which computes every slot of the width), timed as the step-cost
    fit times one engine's widths (`serve.step_cost.measure`: one untimed run each, then rounds interleaved across
    every engine's widths, so the machine's drift lands on all alike). What each policy's program costs at one
    width, beside the others': the bench prices every policy's steps with one policy's fit
    (`bench_report.priced_schedules`), which cannot show that one program is dearer than another at the same width
    (docs/benchmarks.md, "Twenty rounds, and where the last percent goes")."""
    widths = sorted(set.intersection(*(set(e.picker.widths) for e in engines)))
    empties = [e._empty_state() for e in engines]

    def prepare(key):
        i, w = key
        state = jax.tree.map(lambda x: x.copy(), empties[i])  # untimed: the step donates its state
        return lambda: engines[i]._idle_step(state, w, eng.engine_step.WIDE, copy=False)

    timed = step_cost.measure(prepare, [(i, w) for i in range(len(engines)) for w in widths], rounds)
    return [{str(w): round(timed[i, w], 1) for w in widths} for i in range(len(engines))]


SCHED_LOOP = 21  # `_scheduler_time`: schedules per timed call (one call of 1 is subtracted)


def _scheduler_time(e: eng.Engine, snapshot) -> float:
    """What the fused step spends in `schedule` [s]: its time in-graph on a snapshot of the run's state, priced
    with the step cost the engine plans with (its fit: a width table makes the goodput controller search caps
    too); 0 when the run was too short to snapshot. The fused step cannot be split by a clock, and a call of the
    jitted `schedule` alone would add its own dispatch (about 0.3 ms on this project's CPU, more than the
    schedule), which the engine does not pay: so one program schedules the snapshot n times in a loop, and the
    median over five calls of (time at n = SCHED_LOOP - time at n = 1) / (SCHED_LOOP - 1) is the figure."""
    if snapshot is None:
        return 0.0
    fn = _looped_schedule(e.cfg.sched)
    cost = jax.device_put(e.step_cost)  # on the device once: a host copy would time its transfer on every call
    one, many = np.int32(1), np.int32(SCHED_LOOP)
    jax.block_until_ready(fn(snapshot, e.knobs, cost, many))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(snapshot, e.knobs, cost, one))
        t1 = time.perf_counter()
        jax.block_until_ready(fn(snapshot, e.knobs, cost, many))
        t2 = time.perf_counter()
        times.append(((t2 - t1) - (t1 - t0)) / (SCHED_LOOP - 1))
    return max(statistics.median(times), 0.0)


@functools.cache
def _looped_schedule(cfg):
    """`schedule` of one state n (int32[], data) times in one jitted program, once per scheduler configuration
    (repeats of a policy reuse it). Each trip reads the state through an optimisation barrier that also takes the
    loop's carry, so XLA cannot hoist the loop-invariant schedule out of the loop; the carry sums outputs of the
    schedule, so it cannot be dropped either."""
    from skvs_jax import scheduler as sc

    def looped(snapshot, knobs, cost, n):
        def body(_, acc):
            st, acc = jax.lax.optimization_barrier((snapshot, acc))
            new, batch = sc.schedule_unchecked(st, knobs, cost, cfg=cfg)
            return acc + jnp.sum(batch.num_tokens) + jnp.sum(new.kv.alloc.blocks.ref_count)

        return jax.lax.fori_loop(0, n, body, jnp.zeros((), jnp.int32))

    return jax.jit(looped)


def serving_groups(names: list[str], programs: dict[str, int], limit: int | None = None,
                   anchor: str | None = None) -> list[list[str]]:
    """`names` in order, cut into consecutive groups whose compiled programs (programs[name] each) stay within
    `limit` (default `MAX_LIVE_PROGRAMS`; a policy with more is a group of its own): what `run` serves
    round-robin before freeing them. anchor: a name of the first group that every later group starts with too
    (the ablation's skvs, so each variant is paired with a skvs run of its own time)."""
    limit = MAX_LIVE_PROGRAMS if limit is None else limit
    groups: list[list[str]] = []
    held = 0
    for name in names:
        if not groups or held + programs[name] > limit:
            again = [anchor] if groups and anchor in groups[0] else []
            groups.append(again)
            held = sum(programs[n] for n in again)
        groups[-1].append(name)
        held += programs[name]
    return groups


def serve_group(group: list[str], out: dict, history: dict, model, heads, chosen: dict, specs: dict, cache, trace,
                 args, bar) -> None:
    """Every repeat of the group's policies into out[name], round-robin: load drift over the run shows in every
    policy's spread, and the policies of one round can be compared pairwise. Round r serves the group rotated by
    r (a Latin square): every policy takes every place in the round equally often, and with three or more none
    ever runs right after itself. Measured (2026-12-02): reversing every other round (ABBA) instead made the end
    policies run twice in a row at each round's seam, and the middle one of three came out ~4% slower paired,
    whichever policy it was. A policy with runs in `history` (an earlier group's) warms up from and plans with
    those, as its later repeats do.

    With `--rehearse` every policy of the group first serves the trace once untimed (its result is dropped; its
    step-cost fit is what the timed runs plan with): the group's programs were compiled for it alone (`run` frees
    the previous group's), and XLA:CPU spends ~1 ms on each kernel's first execution, which an empty warm-up step
    reaches only for the kernels an empty step runs (measured on a 2-core CPU: the first timed run of a policy was
    ~0.3 s slower, its first preemption's steps 150 ms each instead of 10-20)."""
    fits = {}  # the rehearsals' step-cost fits: what a policy's timed runs plan with when it has no earlier run

    def carried(name):  # (bucket histogram, fit) a run starts from: the last run's histogram, the first run's fit
        prior = out[name] or history.get(name, [])
        return (prior[-1].get("bucket_hist"), prior[0].get("fitted")) if prior else (None, fits.get(name))

    if getattr(args, "rehearse", False):
        for name in group:
            if bar is not None:
                bar.note(f"{name} (rehearsal)")
            hist, fitted = carried(name)
            fits[name] = serve(model, heads, chosen[name], cache, trace, args, progress=bar,
                               knobs=specs[name].knobs(), bucket_hist=hist, fitted=fitted, rehearsal=True).get("fitted")
    for repeat in range(args.repeats):
        shift = repeat % len(group)
        order = group[shift:] + group[:shift]
        calls = []
        for name in order:
            hist, fitted = carried(name)
            calls.append(dict(model=model, heads=heads, policy=chosen[name], cache=cache, trace=trace, args=args,
                              progress=bar, knobs=specs[name].knobs(), bucket_hist=hist, fitted=fitted))
        rnd = "" if args.repeats == 1 else f" ({repeat + 1}/{args.repeats})"
        if getattr(args, "lockstep", False):
            if bar is not None:
                bar.note(f"lockstep{rnd}")
            for name, result in zip(order, serve_together(calls, equal_widths=repeat == 0), strict=True):
                out[name].append(result)
            continue
        for name, call in zip(order, calls, strict=True):
            if bar is not None:
                bar.note(name + rnd)
            out[name].append(serve(**call))
