"""`skvs bench`: vllm_default, naive_spec and skvs on the same trace, the shipped tiny model, one process.

Every policy serves the same seeded trace (default: shared system prompts with Zipf popularity and ShareGPT-like
user parts, all arriving at t = 0) with the same KV budget, chosen small enough that memory pressure occurs. The
table has the article's shape (rows = metrics, columns = policies) plus skvs/naive_spec and skvs/vllm_default
ratios measured in this run. It writes `bench.json` (every metric, the config, versions, the trace seed) and
`bench.png` (throughput and memory over time per policy) to the output folder.

Timings are wall clock on this machine, compile time excluded: each policy's engine first compiles every one of its
query buckets (`Engine.warmup`: the prompt width and one width per draft bucket), and each policy serves the trace
once untimed before its timed runs (`--rehearse`, on by default: XLA:CPU runs a kernel slowly the first time it
executes, and an empty warm-up step does not reach the kernels of preemption or eviction); a policy that fits its
step cost fits it again after that run, on warm programs (`_Serving.refit`), and its timed runs plan with that fit.
Greedy outputs must be identical across policies (checked). With `--rate`, arrivals follow each engine's clock, so
which requests share a step — and the non-timing metrics — depend on timing; with the default (all at t = 0)
everything but the timings is reproducible from the seed. A run in which one step takes over a second and over half
the run has *stalled* (a program compiled inside the timed run, or the machine stopped): it is flagged, and left out
of the median when the policy has other runs. `--repeats N` serves every policy N times, in N rounds of every policy
(so drift of the machine's load over the run hits every policy, and policies of one round can be compared pairwise;
round r runs the policies rotated by r, so each takes every place equally often). Within a round the policies are
served in lockstep (`--lockstep`, the default: one step of each in turn, each engine timed on its own `TurnClock`,
`serve_together`), so the machine's drift from one second to the next lands on every policy of the round alike;
`--no-lockstep` serves them one after another (each engine alone on the machine, its own programs warm). Each
policy's metrics are those of its run with the median throughput (the upper median for even N), and its min-max
throughput is reported.
More policies than one process holds compiled at once (`MAX_LIVE_PROGRAMS`: the ablation's) are served in
consecutive groups (`serving_groups`), each group's rounds done and its programs freed before the next compiles;
under `--ablation` every later group serves skvs again, so each variant's per-round ratios pair it with a skvs run
of its own group (skvs's reported metrics stay those of the first group's runs). `--ablation` serves naive_spec,
skvs and `policies.ablations(skvs)`: skvs with one switch at a time turned back to naive_spec's value
("skvs -<switch>").
After the usual table it prints the decomposition: per switch, the metrics with the switch off and their change vs
full skvs measured in the same run, the switch's share of the skvs - naive_spec gap (in engine steps, which are
deterministic, and in throughput), and which switches help, hurt or stay within noise (`throughput_effect`: engine
steps decide where the same tokens took different steps; otherwise the spread of the ratios within each round, off /
skvs; one round with equal steps is no evidence, and only with --rate does one round fall back to THROUGHPUT_NOISE,
the run-to-run spread of a 2-core CPU). `--policies` takes presets with overrides (`policies.parse_policies`), and
--preemption, --victim, --kv-precision, --no-prefix-cache and --host-blocks set a switch for every policy
(`policy_flags`). bench.json (SCHEMA_VERSION 2): the version-1 keys, unchanged, plus with --repeats > 1 or
--ablation "runs" ({"throughput": policy -> tok/s of each repeat, "stalled": policy -> a flag per repeat, and
without --ablation "paired_to_naive_spec": policy -> its throughput over naive_spec's in each round, stalled rounds
left out, and "paired_to_naive_spec_ci95": policy -> [low, high], the 95% bootstrap interval of that ratio's median,
`bootstrap_median_ci`}) and with --ablation "ablation" (see `_ablation`); its config also records the policy flags
and every policy's fields ("policy_fields"). A plain run has the version-1 shape.

Why this module is ~620 lines: the main job's whole report (serving, the table, the ablation and its verdicts, the
plot) reads as one command; the engine and the metrics it calls live elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import platform
import statistics
import time

import jax
import numpy as np

import skvs_jax
from skvs_jax import metrics, policies, workloads
from skvs_jax.commands import checkpoints, policy_flags, startup
from skvs_jax.config import CacheConfig
from skvs_jax.serve import engine as eng
from skvs_jax.serve import speculation

SCHEMA_VERSION = 2
# Run-to-run spread of throughput on a 2-core CPU (docs/benchmarks.md): with one repeat, a smaller change is noise.
THROUGHPUT_NOISE = 0.20
REFERENCE = "naive_spec"  # the policy the table's and the paired ratios divide by
# Metrics that depend on the clock; with all arrivals at t = 0 every other metric is reproducible from the seed.
TIMING_METRICS = ("throughput", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50", "e2e_p99",
                  "scheduler_time_per_step", "scheduler_time_share", "wall_time")
# Compiled engine programs one process keeps at once. XLA:CPU maps ~2,500 memory regions per engine step of the
# shipped model, and Linux's default limit is 65,530 maps a process: the ablation's ~40 programs together abort in
# LLVM ("Cannot allocate memory"). Policies beyond this are served in groups, each group's programs freed after it.
MAX_LIVE_PROGRAMS = 16
# Timed rounds of the rehearsal's refit of the step cost (`_Serving.refit`): 3x the engine's default, ~1 s here.
REFIT_ROUNDS = 21
# The decomposition's metrics: (key, higher is better). Engine steps for the same output tokens are the
# noise-free side of throughput: on a CPU, where a step costs about the same whatever it carries, fewer is faster.
ABLATION_METRICS = (("throughput", True), ("num_steps", False), ("spec_token_waste", False), ("spec_kv_waste", False),
                    ("kv_hit_rate", True), ("kv_hit_rate_first", True), ("oom_rate", False),
                    ("preemptions_per_request", False), ("mean_accepted_length", True))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="system_prompts", choices=sorted(workloads.GENERATORS))
    parser.add_argument("--requests", type=int, default=32, help="requests in the trace")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--policies", default="vllm_default,naive_spec,skvs",
                       help="comma-separated presets, each with optional overrides of its fields "
                            "(policies.parse_policy): skvs:preemption=swap,victim=most_progress; skvs:K=2 (or skvs:2) "
                            "sets the draft-length knob; name=LABEL names the variant")
    which.add_argument("--ablation", action="store_true",
                       help="naive_spec, skvs and skvs with each switch off in turn, then what each switch buys")
    parser.add_argument("--repeats", type=int, default=1,
                        help="serve each policy this many times; report median and min-max throughput")
    parser.add_argument("--kv-blocks", type=int, default=65, help="KV budget in blocks (incl. the null block)")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--max-seqs", type=int, default=8, help="sequence slots = max batch size")
    parser.add_argument("--draft-len", type=int, default=None,
                        help="drafts per step (default: the Medusa heads' count; 15 with --tree small)")
    parser.add_argument("--verify-budget", default="none",
                        help="skvs's compute-aware drafting (Policy.verify_budget): none, or the most tokens a decode "
                             "step verifies (R decode rows then draft at most budget // R - 1 each)")
    parser.add_argument("--token-budget", type=int, default=128)
    parser.add_argument("--prefill-chunk", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=32, help="cap on output tokens per request")
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default: all at 0)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--tree", default="chain", choices=("chain", "small"),
                        help="draft tree of the speculating policies: a chain of --draft-len drafts, or the 15-node "
                             "SMALL_TREE (then --draft-len must be 15)")
    parser.add_argument("--acceptance", default="lossless", choices=("lossless", "typical"),
                        help="verification rule at temperature > 0 (both are greedy at 0)")
    policy_flags.add_arguments(parser)
    parser.add_argument("--host-blocks", type=int, default=None,
                        help="host-tier blocks for policies that preempt by swap (default: the KV budget's usable "
                             "blocks; 0: no host tier, so a swap policy recomputes)")
    parser.add_argument("--step-cost", default="fit", choices=("fit", "flat"),
                        help="what the goodput controller and priced draft blocks price a step with: fit = the "
                             "policy's programs timed at its first warm-up (serve.step_cost; later repeats reuse "
                             "it), flat = every step the same (schedules reproducible across runs)")
    parser.add_argument("--split-rows", type=int, default=None,
                        help="extra query rows of the prompt width's split branch (default: the engine's; 0: no split)")
    parser.add_argument("--impl", default="xla", choices=("xla", "pallas", "reference"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="skvs-results", help="output folder")
    parser.add_argument("--no-plot", action="store_true", help="skip bench.png")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    checkpoints.add_arguments(parser)
    startup.add_arguments(parser, warmup=True)
    parser.add_argument("--lockstep", action=argparse.BooleanOptionalAction, default=True,
                        help="serve a round's policies in lockstep, one step of each in turn, each timed on its own "
                             "clock (default: on): this CPU's speed drifts between runs of a second, and in lockstep "
                             "the drift hits every policy alike; --no-lockstep serves them one after another")
    parser.add_argument("--rehearse", action=argparse.BooleanOptionalAction, default=True,
                        help="serve the trace once untimed per policy before its timed runs, and refit a fitting "
                             "policy's step cost after it (default: on): XLA:CPU runs each kernel of a compiled "
                             "program slowly the first time it executes, and warm-up's empty steps never execute a "
                             "step's preemption, eviction or prefix-hit kernels")


def _tree(args):
    return None if args.tree == "chain" else speculation.SMALL_TREE


def make_trace(args) -> workloads.Trace:
    return workloads.tiny_model_trace(args.workload, args.requests, seed=args.seed, rate=args.rate,
                                      max_output_len=args.max_output)


def _host_blocks(args) -> int:
    """--host-blocks, default the KV budget's usable blocks (every swapped sequence fits)."""
    return args.kv_blocks - 1 if args.host_blocks is None else args.host_blocks


def engine_kwargs(policy, args) -> dict:
    kwargs = dict(token_budget=args.token_budget, prefill_chunk=args.prefill_chunk, impl=args.impl, seed=args.seed,
                  step_cost=getattr(args, "step_cost", "fit"), split_rows=getattr(args, "split_rows", None))
    if policy.preemption == "swap":
        kwargs["swap_blocks"] = _host_blocks(args)
    if policy.speculation:
        kwargs |= dict(tree=_tree(args), acceptance=args.acceptance)
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


class _Serving:
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
            e.warmup(bucket_hist or None)  # every query bucket, so no compilation lands inside the timed run
        if e.step_cost_times:  # this engine fitted its step cost: what later repeats plan with (host arrays)
            fitted = (e.step_cost, e.step_cost_times, e.split_step_us)
        self.cache, self.args, self.progress, self.rehearsal, self.clock = cache, args, progress, rehearsal, clock
        self.fitted = fitted
        self.pending = sorted(trace.requests, key=lambda r: r.arrival_time)
        self.sched_snapshot = None

    def busy(self) -> bool:
        return bool(self.pending) or self.e.has_work()

    def turn(self) -> None:
        """Admit what has arrived, then one engine step, or (nothing to run) wait for the next arrival."""
        e, args = self.e, self.args
        now = e.now()
        while self.pending and (args.rate is None or self.pending[0].arrival_time <= now):
            r = self.pending.pop(0)
            e.add_request(r.prompt, eng.SamplingParams(max_tokens=r.max_new_tokens, temperature=args.temperature),
                          arrival_time=r.arrival_time if args.rate is not None else 0.0, request_id=r.request_id)
        if not e.has_work():
            wait = self.pending[0].arrival_time - e.now()
            if self.clock is not None:
                self.clock.skip(wait)
            else:
                time.sleep(max(0.0, wait))
            return
        new = e.step()
        if len(e.step_log) == 4 and not self.rehearsal:
            self.sched_snapshot = jax.tree.map(lambda x: x.copy(), e.state.sched)
        if self.progress is not None:
            self.progress(sum(len(t) for _, t, _ in new))

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
        ) for r in e.requests.values()]
        result = metrics.summarize(records, log.freeze())
        series = {"time": [s["start"] + s["duration"] for s in e.step_log],
                  "output_tokens": [s["output_tokens"] for s in e.step_log],
                  "blocks_used": [s["blocks_used"] for s in e.step_log],
                  "spec_blocks": [s["spec_blocks"] for s in e.step_log]}
        outputs = {rid: list(r.tokens) for rid, r in e.requests.items()}
        counters = {k: int(v) for k, v in dataclasses.asdict(e.state.sched.counters).items()}
        result |= metrics.attribution(counters, len(records))  # what the drafts cost in memory
        fitted = self.fitted
        return {"metrics": result, "outputs": outputs, "series": series, "counters": counters,
                "compiled": sorted(e.compiled), "bucket_hist": e.picker.bucket_hist, "padding": e.picker.padding,
                "fitted": fitted,
                "step_cost_us": {str(w): round(t, 1) for w, t in sorted(fitted[1].items())} if fitted else {},
                "split_step_us": round(fitted[2], 1) if fitted and fitted[2] is not None else None,
                "split": {"steps": e.picker.split_steps, "narrow_width": eng.engine_step.narrow_width(e.cfg),
                          "rows": e.cfg.split_rows},
                "width_hist": {str(w): n for w, n in sorted(e.picker.width_hist.items())}}


def serve(model, heads, policy, cache, trace, args, progress=None, knobs=None, bucket_hist=None,
          fitted=None, rehearsal=False) -> dict:
    """Run one policy over the trace; returns its metrics, outputs and per-step series. knobs: the policy's
    knobs with a `--policies` draft-length knob (default `policy.knobs()`). bucket_hist: the previous repeat's
    `WidthPicker.bucket_hist`, from which a policy with `bucket_budget` chooses its draft widths at warm-up (the
    result's "bucket_hist" is this run's). fitted: an earlier repeat's result["fitted"] (its fitted step cost
    and times), used as given so every repeat plans with the same cost (the first run fits it). rehearsal: an
    untimed run (`--rehearse`), so the scheduler's own time is not measured after it."""
    run = _Serving(model, heads, policy, cache, trace, args, progress=progress, knobs=knobs, bucket_hist=bucket_hist,
                   fitted=fitted, rehearsal=rehearsal)
    while run.busy():
        run.turn()
    if rehearsal and run.e.step_cost_times:
        run.refit()
    return run.result()


def serve_together(calls: list[dict]) -> list[dict]:
    """Serve several policies in lockstep: one step of each in the order given, round after round, each engine on
    a `TurnClock` that runs only during its own steps. calls: `serve`'s keyword arguments, one dict per policy;
    returns `serve`'s results in the same order. Every engine is warmed up (and fits its step cost) before the
    first step. Why: this CPU's speed drifts by 8% or more between runs of a second (docs/benchmarks.md), so
    policies served one after another see different machines; stepped in turn, each policy's steps are spread
    over the same seconds as the others', and the drift cancels out of their ratios. Each step runs right after
    another policy's program, not its own (cold caches for all alike)."""
    runs = [_Serving(**call, clock=TurnClock()) for call in calls]
    while any(r.busy() for r in runs):
        for r in runs:
            if r.busy():
                r.clock.start()
                r.turn()
                r.clock.stop()
    return [r.result() for r in runs]


def _priced_schedules(results: dict, names: list[str]) -> dict | None:
    """Each policy's reported run priced by one fitted step cost, the first policy's that has one: sum over its
    steps of that fit's time at the step's query width (`serve.step_cost.fit`, widths it did not time
    interpolated), a step that ran the prompt width's split branch at the fit's split time. What each schedule
    costs on this machine's compiled programs, free of the wall clock's noise (the scheduler's own work per step
    is in the fit only as it is on empty slots). A policy whose split branch has another shape (narrow width,
    extra rows: another draft length) than the fit's is left out ("unpriced"): its split steps cost what no
    fit measured. None when no policy fitted."""
    from skvs_jax.serve import step_cost

    fit_of = next((n for n in names if results[n].get("step_cost_us")), None)
    if fit_of is None or not all(results[n].get("width_hist") for n in names):
        return None
    times = {int(w): float(t) for w, t in results[fit_of]["step_cost_us"].items()}
    widths = sorted(set(times) | {int(w) for n in names for w in results[n]["width_hist"]})
    cost = step_cost.fit(times, widths, token_budget=1, max_width=widths[-1])
    base, table = int(np.asarray(cost.token_us)[0]), np.asarray(cost.width_us)
    split_us, shape = results[fit_of].get("split_step_us"), _split_shape(results[fit_of])
    ms, unpriced = {}, []
    for n in names:
        split = results[n].get("split") or {}
        wide = sum(k * (base + int(table[int(w)])) for w, k in results[n]["width_hist"].items())
        steps = split.get("steps", 0)
        if steps and (split_us is None or _split_shape(results[n]) != shape):
            unpriced.append(n)
            continue
        prompt = max(int(w) for w in results[n]["width_hist"])  # split steps are counted at the prompt width
        ms[n] = (wide - steps * (base + int(table[prompt]) - (split_us or 0))) / 1e3
    if not ms:
        return None
    return {"fit_of": fit_of, "step_cost_us": results[fit_of]["step_cost_us"], "split_step_us": split_us,
            "ms": ms, "unpriced": unpriced}


def _split_shape(result: dict) -> tuple:
    split = result.get("split") or {}
    return split.get("narrow_width"), split.get("rows")


def _scheduler_time(e: eng.Engine, snapshot) -> float:
    """Median wall time of the jitted `schedule` alone on a snapshot of the run's state (the fused step cannot
    be split by a clock), priced with the step cost the engine plans with (its fit: a width table makes the
    goodput controller search caps too); 0 when the run was too short to snapshot."""
    if snapshot is None:
        return 0.0
    fn = _jitted_schedule(e.cfg.sched)
    cost = jax.device_put(e.step_cost)  # on the device once: a host copy would time its transfer on every call
    jax.block_until_ready(fn(snapshot, e.knobs, cost))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(snapshot, e.knobs, cost))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@functools.cache
def _jitted_schedule(cfg):
    """`schedule` alone, jitted once per scheduler configuration (repeats of a policy reuse the program)."""
    from skvs_jax import scheduler as sc

    return jax.jit(functools.partial(sc.schedule_unchecked, cfg=cfg))


def _plot(results: dict, path: pathlib.Path, blocks_total: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, r in results.items():
        t = np.asarray(r["series"]["time"])
        tokens = np.cumsum(r["series"]["output_tokens"])
        ax1.plot(t, tokens, label=name)
        ax2.plot(t, np.asarray(r["series"]["blocks_used"]) / blocks_total * 100, label=f"{name} used")
        ax2.plot(t, np.asarray(r["series"]["spec_blocks"]) / blocks_total * 100, linestyle=":",
                 label=f"{name} speculative")
    ax1.set_ylabel("output tokens (cumulative)")
    ax2.set_ylabel("KV blocks (% of budget)")
    ax2.set_xlabel("wall time (s)")
    ax1.legend()
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _verify_budget(value: str) -> int | None:
    try:
        return policies.parse_verify_budget(value)
    except ValueError as err:
        raise SystemExit(f"skvs bench: {err}") from None


def _specs(args: argparse.Namespace) -> dict[str, policies.PolicySpec]:
    """The policies to serve, by name: `--policies` (`policies.parse_policies`: presets with overrides), or with
    `--ablation` naive_spec, skvs and its ablations ("skvs -draft_control" is the article's skvs, `skvs_article`).
    The global switches (--preemption, --victim, --kv-precision, --no-prefix-cache) apply to every policy, and
    `--verify-budget` to the skvs preset (and so to its ablations), as in `skvs simulate`; a policy's own
    overrides win over both."""
    budget = _verify_budget(args.verify_budget)

    draft_len = 4 if args.draft_len is None else args.draft_len  # `setup` sets it from the heads first

    try:
        if args.ablation:
            named = {n: policies.parse_policy(n, draft_len, policy_flags.defaults(args)
                                              | ({"verify_budget": budget} if n == "skvs" else {}))
                     for n in ("naive_spec", "skvs")}
            return named | {n: policies.PolicySpec(p) for n, p in policies.ablations(named["skvs"].policy).items()}
        specs = policies.parse_policies(args.policies, draft_len, policy_flags.defaults(args),
                                        {"skvs": {"verify_budget": budget}})
    except ValueError as err:
        raise SystemExit(f"skvs bench: --policies: {err}") from None
    return {s.policy.name: s for s in specs}


def _policies(args: argparse.Namespace) -> dict[str, policies.Policy]:
    """`_specs`'s policies, by name."""
    return {n: s.policy for n, s in _specs(args).items()}


def setup(args: argparse.Namespace):
    """Everything a run needs, checked before anything is served: (policies, budget, model, heads, trace, cache).

    Bad flags end in `SystemExit("skvs bench: ...")` naming the flag, not in a traceback minutes into the run.
    """
    if args.block_size > 1024:  # one block would outgrow the longest sequence (96 + --max-output <= 1024 tokens)
        raise SystemExit(f"skvs bench: --block-size must be <= 1024, got {args.block_size}")
    for flag, value, low in (("--repeats", args.repeats, 1), ("--requests", args.requests, 1),
                             ("--block-size", args.block_size, 1), ("--max-seqs", args.max_seqs, 1),
                             ("--max-output", args.max_output, 1), ("--token-budget", args.token_budget, 1),
                             ("--prefill-chunk", args.prefill_chunk, 0), ("--kv-blocks", args.kv_blocks, 2)):
        if value < low:
            raise SystemExit(f"skvs bench: {flag} must be >= {low}, got {value}")
    if args.host_blocks is not None and args.host_blocks < 0:
        raise SystemExit(f"skvs bench: --host-blocks must be >= 0, got {args.host_blocks}")
    try:
        loaded = checkpoints.load(args)
    except (ValueError, OSError) as err:
        raise SystemExit(f"skvs bench: {err}") from None
    nodes = speculation.SMALL_TREE.num_slots - 1
    if args.draft_len is None:
        args.draft_len = nodes if args.tree == "small" else checkpoints.draft_len(args, loaded)
    if args.tree == "small" and args.draft_len != nodes:
        raise SystemExit(f"skvs bench: --tree small has {nodes} nodes, one draft slot each: pass --draft-len {nodes}")
    try:
        eng.SamplingParams(temperature=args.temperature)
        specs = _specs(args)
        chosen = {n: s.policy for n, s in specs.items()}
    except ValueError as err:
        raise SystemExit(f"skvs bench: {err}") from None
    if not chosen:
        raise SystemExit(f"skvs bench: --policies names no policy; choose from {sorted(policies.PRESETS)}")
    if 96 + args.max_output > loaded.max_positions:
        raise SystemExit(f"skvs bench: a prompt of up to 96 tokens + --max-output {args.max_output} exceeds the "
                         f"model's max_position_embeddings ({loaded.max_positions}): lower --max-output")
    max_len = min(loaded.max_positions, -(-(96 + args.max_output) // args.block_size) * args.block_size)
    blocks_per_seq = max_len // args.block_size  # the longest prompt (96) + --max-output, in whole blocks
    if blocks_per_seq > args.kv_blocks - 1:
        raise SystemExit(f"skvs bench: one sequence (a prompt of up to 96 tokens + --max-output {args.max_output}) "
                         f"can need {blocks_per_seq} blocks of {args.block_size} tokens, more than --kv-blocks "
                         f"{args.kv_blocks} holds ({args.kv_blocks - 1} usable): raise --kv-blocks or --block-size, "
                         f"or lower --max-output")
    model, heads = loaded.model, loaded.heads
    args.model_name = loaded.name
    try:
        for policy in chosen.values():
            checkpoints.check_speculation(policy, loaded, flag="--policies")
        cache = CacheConfig(num_blocks=args.kv_blocks, block_size=args.block_size, max_seqs=args.max_seqs,
                            max_blocks_per_seq=blocks_per_seq)
        # The engines' own checks (budgets, trees, widths), before any is served; each policy's compiled programs
        # (its widths + `schedule`) decide the serving groups (`serving_groups`).
        args.programs = {n: len(eng.Engine(model, heads, p, cache, **engine_kwargs(p, args)).picker.widths) + 1
                         for n, p in chosen.items()}
        trace = make_trace(args)
    except ValueError as err:
        raise SystemExit(f"skvs bench: {err}") from None
    return specs, _verify_budget(args.verify_budget), model, heads, trace, cache


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


def _serve_group(group: list[str], out: dict, history: dict, model, heads, chosen: dict, specs: dict, cache, trace,
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
                bar.set_postfix_str(f"{name} (rehearsal)")
            hist, fitted = carried(name)
            fits[name] = serve(model, heads, chosen[name], cache, trace, args, knobs=specs[name].knobs(),
                               bucket_hist=hist, fitted=fitted, rehearsal=True).get("fitted")
    for repeat in range(args.repeats):
        shift = repeat % len(group)
        order = group[shift:] + group[:shift]
        calls = []
        for name in order:
            hist, fitted = carried(name)
            calls.append(dict(model=model, heads=heads, policy=chosen[name], cache=cache, trace=trace, args=args,
                              progress=bar.update if bar else None, knobs=specs[name].knobs(), bucket_hist=hist,
                              fitted=fitted))
        rnd = "" if args.repeats == 1 else f" ({repeat + 1}/{args.repeats})"
        if getattr(args, "lockstep", False):
            if bar is not None:
                bar.set_postfix_str(f"lockstep{rnd}")
            for name, result in zip(order, serve_together(calls), strict=True):
                out[name].append(result)
            continue
        for name, call in zip(order, calls, strict=True):
            if bar is not None:
                bar.set_postfix_str(name + rnd)
            out[name].append(serve(**call))


def run(args: argparse.Namespace) -> int:
    specs, budget, model, heads, trace, cache = setup(args)
    startup.output_dir(args.out, "bench")  # before serving: a folder that cannot be made would lose the results
    chosen = {n: s.policy for n, s in specs.items()}
    names = list(chosen)
    anchor = "skvs" if args.ablation else None
    groups = serving_groups(names, args.programs, anchor=anchor)
    total_tokens = sum(r.max_new_tokens for r in trace.requests) * sum(map(len, groups)) * args.repeats
    bar = None
    if not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=total_tokens, unit="tok", desc="skvs bench")
    runs = {n: [] for n in names}
    t_start = time.perf_counter()
    paired_with = {}  # the ablation: per policy, the skvs runs of its own group (its per-round pairs)
    for g, group in enumerate(groups):
        if g:  # the previous group's programs, freed before this group compiles its own
            jax.clear_caches()
        out = {n: [] if g and n == anchor else runs[n] for n in group}  # a later group's skvs: pairs only
        _serve_group(group, out, runs, model, heads, chosen, specs, cache, trace, args, bar)
        paired_with |= {n: out[anchor] for n in group if anchor in out and n != anchor}
    if bar is not None:
        bar.close()
    stalls = {n: [_stall(r) for r in rs] for n, rs in runs.items()}
    stalled = {n: [bool(st) for st in sts] for n, sts in stalls.items()}
    valid = {n: _unstalled(rs, stalled[n]) for n, rs in runs.items()}
    results = {n: _upper_median(rs, stalled[n], key=lambda r: r["metrics"]["throughput"]) for n, rs in runs.items()}
    throughputs = {n: [r["metrics"]["throughput"] for r in rs] for n, rs in runs.items()}

    same = None
    if args.temperature == 0 and len(names) * args.repeats > 1:
        first = runs[names[0]][0]["outputs"]
        same = all(r["outputs"] == first for rs in runs.values() for r in rs)
    table = metrics.format_table({n: results[n]["metrics"] for n in names})
    vb = f", skvs verify budget {budget}" if budget else ""
    print(f"skvs bench: {len(trace.requests)} requests ({trace.kind}, seed {trace.seed}), {args.model_name} "
          f"(K={args.draft_len}{vb}), KV budget {cache.usable_blocks} blocks x {cache.block_size} tokens, "
          f"{cache.max_seqs} slots, token budget {args.token_budget}, impl {args.impl}, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}; wall time {time.perf_counter() - t_start:.0f} s")
    print(policy_flags.describe(specs, _host_blocks(args)))
    print(table)
    if args.repeats > 1:
        spread = {n: [r["metrics"]["throughput"] for r in rs] for n, rs in valid.items()}
        print(f"throughput over {args.repeats} repeats, median [min-max] tok/s: " + ", ".join(
            f"{n} {_fmt(results[n]['metrics']['throughput'])} [{_fmt(min(t))}-{_fmt(max(t))}]"
            for n, t in spread.items()))
        if args.rate is None:
            print(f"non-timing metrics identical across repeats: {_reproducible(runs)}")
    paired = _paired_ratios(throughputs, stalled, names) if args.repeats > 1 and not args.ablation else {}
    paired_ci = {n: bootstrap_median_ci(r) for n, r in paired.items() if r}
    if paired:
        # Load drift moves every policy of a round together, so a ratio within a round is steadier than the ratio
        # of two medians taken from different rounds.
        print(f"throughput / {REFERENCE}'s within each round, median [min-max] (95% bootstrap interval of the "
              "median; rounds above 1): " + ", ".join(
                  f"{n} {statistics.median(r):.3f}x [{min(r):.3f}-{max(r):.3f}] "
                  f"({paired_ci[n][0]:.3f}-{paired_ci[n][1]:.3f}; {sum(v > 1 for v in r)} of {len(r)})"
                  for n, r in paired.items() if r))
    for n, st in stalls.items():
        if any(st):
            worst = max(x for x in st if x)
            print(f"warning: {sum(map(bool, st))} of {len(st)} runs of {n} had one step of up to {worst[0]:.1f} s "
                  f"(of {worst[1]:.1f} s in all: a compilation inside the timed run?); "
                  + ("excluded from its median and range" if not all(st) else
                     "its timing rows measure that, not the policy; with --repeats 2 or more the later runs reuse "
                     "the compiled programs"))
    for n in names:
        if results[n].get("step_cost_us"):
            print(f"{n}: step cost fitted at warm-up (us per step by query width): "
                  + ", ".join(f"{w}: {t:.0f}" for w, t in results[n]["step_cost_us"].items())
                  + (f"; its prompt width's split branch: {results[n]['split_step_us']:.0f}"
                     if results[n].get("split_step_us") is not None else ""))
    priced = _priced_schedules(results, names)
    if priced is not None:
        base = next(iter(priced["ms"]))
        print(f"steps priced by {priced['fit_of']}'s fit (each reported run's steps by width, without the clock's "
              "noise): " + ", ".join(f"{n} {ms:.1f} ms" + ("" if n == base else f" ({ms / priced['ms'][base]:.2f}x "
                                                                                 f"{base})")
                                    for n, ms in priced["ms"].items())
              + "".join(f"; {n} unpriced (its split steps have a shape the fit did not time)"
                        for n in priced["unpriced"]))
    if same is not None:
        print(f"greedy outputs identical across policies: {same} ({len(names)} policies"
              + (f" x {args.repeats} repeats" if args.repeats > 1 else "") + " checked)")
    ablation = None
    if args.ablation:
        paired_runs = {n: ([r["metrics"]["throughput"] for r in rs], [bool(_stall(r)) for r in rs])
                       for n, rs in paired_with.items()}
        ablation = _ablation(chosen, results, throughputs, stalled, args, paired_runs)
        print()
        print(_format_ablation(ablation))

    out = pathlib.Path(args.out)  # made by `setup`
    config = {k: getattr(args, k) for k in ("workload", "requests", "policies", "kv_blocks", "block_size", "max_seqs",
                                            "draft_len", "token_budget", "prefill_chunk", "max_output", "rate",
                                            "temperature", "tree", "acceptance", "impl", "seed", "ablation", "repeats",
                                            "step_cost")}
    config["verify_budget"] = budget
    config |= {"model": args.model, "medusa": args.medusa}
    config["policies"] = ",".join(names)
    config |= {k: getattr(args, k) for k in ("preemption", "victim", "kv_precision", "no_prefix_cache")}
    config["host_blocks"] = _host_blocks(args)
    config["policy_fields"] = {n: dataclasses.asdict(chosen[n]) | {"draft_len_knob": specs[n].draft_len_knob}
                               for n in names}
    doc = {
        "schema_version": SCHEMA_VERSION,
        "command": "skvs bench" + (" --ablation" if args.ablation else ""),
        "config": config,
        "trace": {"kind": trace.kind, "seed": trace.seed, "params": trace.params, "requests": len(trace.requests)},
        "versions": {"skvs_jax": skvs_jax.__version__, "jax": jax.__version__, "python": platform.python_version(),
                     "platform": jax.devices()[0].platform, "machine": platform.machine()},
        "identical_greedy_outputs": same,
        "policies": {n: {"metrics": results[n]["metrics"], "counters": results[n]["counters"],
                         "compiled_buckets": results[n]["compiled"], "series": results[n]["series"],
                         "step_cost_us": results[n].get("step_cost_us", {}),
                         "steps_by_width": results[n].get("width_hist", {}),
                         "split_step_us": results[n].get("split_step_us"), "split": results[n].get("split", {})}
                     for n in names},
    }
    if args.repeats > 1 or args.ablation:
        doc["runs"] = {"throughput": throughputs, "stalled": stalled}
        if paired:
            doc["runs"][f"paired_to_{REFERENCE}"] = paired
            doc["runs"][f"paired_to_{REFERENCE}_ci95"] = {n: list(ci) for n, ci in paired_ci.items()}
    if ablation is not None:
        doc["ablation"] = ablation
    if priced is not None:
        doc["priced_schedules"] = priced
    (out / "bench.json").write_text(json.dumps(metrics.json_safe(doc), indent=1, allow_nan=False) + "\n")
    if not args.no_plot:
        _plot(results, out / "bench.png", cache.usable_blocks)
    print(f"wrote {out / 'bench.json'}" + ("" if args.no_plot else f" and {out / 'bench.png'}"))
    return 0 if same in (None, True) else 1


def _unstalled(items: list, stalled: list[bool]) -> list:
    """The items (one per repeat) of the runs without a stalled step; all of them if every run stalled."""
    return [x for x, st in zip(items, stalled, strict=True) if not st] or list(items)


def _upper_median(items: list, stalled: list[bool], key=None):
    """What a policy reports (its run, or its throughput): the median by `key` of its `_unstalled` repeats, the
    upper one for an even count (on a shared machine interference only ever slows a run down)."""
    valid = sorted(_unstalled(items, stalled), key=key)
    return valid[len(valid) // 2]


def _round_ratios(tp: list[float], base_tp: list[float], stalled: list[bool],
                  base_stalled: list[bool]) -> list[float | None]:
    """tp / base_tp within each round of repeats; None in a round where either run had a stalled step."""
    return [None if s or bs else t / b for t, b, s, bs in zip(tp, base_tp, stalled, base_stalled, strict=True)]


def _paired_ratios(throughputs: dict[str, list[float]], stalled: dict[str, list[bool]],
                   names: list[str]) -> dict[str, list[float]]:
    """Each policy's throughput over REFERENCE's in the same round of repeats (`_round_ratios`, stalled rounds
    left out), for every policy but REFERENCE; {} when REFERENCE was not run."""
    if REFERENCE not in names:
        return {}
    ref, ref_stalled = throughputs[REFERENCE], stalled[REFERENCE]
    return {n: [x for x in _round_ratios(throughputs[n], ref, stalled[n], ref_stalled) if x is not None]
            for n in names if n != REFERENCE}


def bootstrap_median_ci(values: list[float], level: float = 0.95, resamples: int = 10_000,
                        seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of the median of values (at least one): resamples draws of len(values)
    with replacement from a seeded generator, so the same values give the same interval. With few rounds it is
    coarse (five rounds: the interval's ends are among the five values), and it assumes rounds are independent
    draws, which drift within a run only approximates; it says whether a difference is resolved, not more."""
    if not values:
        raise ValueError("values must hold at least one number")
    x = np.asarray(values, np.float64)
    draws = np.random.default_rng(seed).choice(x, size=(resamples, len(x)), replace=True)
    medians = np.median(draws, axis=1)
    tail = (1.0 - level) / 2
    return float(np.quantile(medians, tail)), float(np.quantile(medians, 1.0 - tail))


def _stall(result: dict) -> tuple[float, float] | tuple[()]:
    """(longest step, wall time) [s] when one step took over a second and over half the run, which is a
    compilation or the machine stopping, not the policy; () otherwise. Steps end at `series["time"]`."""
    ends = np.asarray(result["series"]["time"], np.float64)
    if not ends.size:
        return ()
    longest = float(np.diff(ends, prepend=0.0).max())
    return (longest, float(ends[-1])) if longest > max(1.0, 0.5 * ends[-1]) else ()


def _reproducible(runs: dict[str, list[dict]]) -> bool:
    """Whether every repeat of every policy gave the same non-timing metrics."""
    def non_timing(r):
        return {k: v for k, v in r["metrics"].items() if k not in TIMING_METRICS}

    return all(_same_value(non_timing(r), non_timing(rs[0])) for rs in runs.values() for r in rs[1:])


def _same_value(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


# ------------------------------------------------------------------------------------------------ ablation


def throughput_effect(*, steps: tuple[float, float], tokens: tuple[float, float], ratio: float,
                      paired: list[float | None], deterministic: bool, identical: bool = False,
                      measured: bool = True) -> tuple[str, str]:
    """The ablation's verdict on one switch's throughput, as (effect, basis). A pure function of the evidence:

    steps, tokens: (switch off, base) engine steps and output tokens; ratio: off / base throughput of the
    reported runs; paired: off / base within each round of repeats (None where either run stalled);
    deterministic: the non-timing counters are reproducible (all arrivals at t = 0); identical: same counters and
    non-timing metrics; measured: some run of each was timed without a stall.

    effect: "none" (identical schedules: any difference is noise), "not measured", "helps" (base, with the
    switch, is faster), "hurts", or "within noise". Decided, in this order:
      1. the engine steps, when deterministic and both produced the same output tokens in different numbers of
         steps: fewer steps is faster (on a CPU a step costs about the same whatever it carries), unless two or
         more paired ratios all lie on the other side of 1 (the measurement, repeated, beats the proxy);
      2. the spread of two or more paired ratios: "helps" if all < 1, "hurts" if all > 1, else within noise;
      3. one pair and the same steps (deterministic): within noise -- the schedules are as long, and one run
         has no spread to tell a per-step cost from the machine's noise (--repeats measures it);
      4. one pair, non-deterministic (--rate): within noise when |ratio - 1| <= THROUGHPUT_NOISE.
    """
    if identical:
        return "none", "schedule identical"
    if not measured:
        return "not measured", "every run stalled"
    pairs = [x for x in paired if x is not None]
    spread = None
    if len(pairs) > 1:
        spread = "helps" if max(pairs) < 1 else "hurts" if min(pairs) > 1 else "within noise"
    if deterministic and tokens[0] == tokens[1] and steps[0] != steps[1]:
        by_steps = "helps" if steps[0] > steps[1] else "hurts"
        if spread is not None and spread not in (by_steps, "within noise"):
            return spread, "repeats' spread (against the engine steps)"
        return by_steps, "engine steps"
    if spread is not None:
        return spread, "repeats' spread"
    if deterministic:
        return "within noise", "same engine steps, one repeat (no spread)"
    if abs(ratio - 1.0) <= THROUGHPUT_NOISE:
        return "within noise", f"one repeat, within {THROUGHPUT_NOISE:.0%}"
    return ("hurts" if ratio > 1 else "helps"), f"one repeat, beyond {THROUGHPUT_NOISE:.0%}"


def _ablation(chosen: dict[str, policies.Policy], results: dict, throughputs: dict[str, list[float]],
              stalled: dict[str, list[bool]], args, paired_runs: dict | None = None) -> dict:
    """The decomposition as data (bench.json's "ablation" section).

    rows: one per ablated switch in `policies.ablations` order, then "naive_spec" (every switch off at once);
      each has the policy name, the fields that differ from skvs, and per metric of ABLATION_METRICS
      {"off": value with the switch off, "skvs": full skvs's value, "change": off - skvs}. For throughput,
      "change" is off / skvs (reported runs: skvs's of the variant's own serving group) and "paired" the ratios
      off / skvs within each round of repeats (both ran under the same load: with serving groups, the skvs runs
      of the variant's own group, paired_runs: name -> (throughputs, stalled flags); null where either run
      stalled), "ratio_min"/"ratio_max" their range.
      "throughput_effect": "helps" (skvs is faster with the switch), "hurts", "within noise", "none" (the
      schedule is identical to skvs's: same counters and non-timing metrics, so any difference is noise), "not
      measured" (every run of either policy stalled), decided by `throughput_effect`; "verdict_basis" says by
      which evidence (engine steps, the repeats' spread, or one repeat). "share_of_gap": (skvs - off) / (skvs -
      naive_spec) throughput, NaN when that gap is within noise; "steps_share_of_gap" the same with engine
      steps, which are deterministic.
      "better"/"worse": the non-throughput metrics the switch improves / worsens.
    """
    base = chosen["skvs"]
    skvs_metrics = results["skvs"]["metrics"]
    skvs_valid = _unstalled(throughputs["skvs"], stalled["skvs"])

    def non_timing(name):
        return {k: v for k, v in results[name]["metrics"].items() if k not in TIMING_METRICS}

    rows = {}
    for name in [n for n in chosen if n not in ("skvs", "naive_spec")] + ["naive_spec"]:
        off = results[name]["metrics"]
        base_tp, base_stalled = (paired_runs or {}).get(name, (throughputs["skvs"], stalled["skvs"]))
        # Against the skvs runs of the variant's own serving group, chosen as the reported runs are: a later
        # group's medians against the first group's compared two stretches of the machine, not two policies.
        ratio = off["throughput"] / _upper_median(base_tp, base_stalled)
        paired = _round_ratios(throughputs[name], base_tp, stalled[name], base_stalled)
        pairs = [x for x in paired if x is not None]
        lo, hi = (min(pairs), max(pairs)) if len(pairs) > 1 else (ratio, ratio)
        row = {"policy": name,
               "changes": {f.name: getattr(chosen[name], f.name) for f in dataclasses.fields(base)
                           if f.name != "name" and getattr(chosen[name], f.name) != getattr(base, f.name)},
               "metrics": {}, "better": [], "worse": []}
        for key, higher_is_better in ABLATION_METRICS:
            row["metrics"][key] = {"off": off[key], "skvs": skvs_metrics[key], "change": off[key] - skvs_metrics[key]}
            if key == "throughput":
                row["metrics"][key] |= {"change": ratio, "paired": paired, "ratio_min": lo, "ratio_max": hi}
            elif not _same_value(off[key], skvs_metrics[key]) and math.isfinite(off[key] - skvs_metrics[key]):
                # The switch improves a metric when skvs (switch on) is better than the ablation (switch off).
                improves = (skvs_metrics[key] > off[key]) == higher_is_better
                row["better" if improves else "worse"].append(key)
        row["identical_schedule"] = (results[name]["counters"] == results["skvs"]["counters"]
                                     and _same_value(non_timing(name), non_timing("skvs")))
        row["throughput_effect"], row["verdict_basis"] = throughput_effect(
            steps=(off["num_steps"], skvs_metrics["num_steps"]), tokens=(off["output_tokens"],
                                                                         skvs_metrics["output_tokens"]),
            ratio=ratio, paired=paired, deterministic=args.rate is None, identical=row["identical_schedule"],
            measured=not (all(stalled[name]) or all(base_stalled)))
        rows[name.removeprefix(f"{base.name} -")] = row
    gap_within_noise = rows["naive_spec"]["throughput_effect"] not in ("helps", "hurts")
    gap = skvs_metrics["throughput"] - results["naive_spec"]["metrics"]["throughput"]
    step_gap = skvs_metrics["num_steps"] - results["naive_spec"]["metrics"]["num_steps"]
    for row in rows.values():
        off = results[row["policy"]]["metrics"]
        row["share_of_gap"] = math.nan if gap_within_noise else (skvs_metrics["throughput"] - off["throughput"]) / gap
        row["steps_share_of_gap"] = (skvs_metrics["num_steps"] - off["num_steps"]) / step_gap if step_gap else math.nan
    return {"base": "skvs", "reference": "naive_spec", "repeats": args.repeats,
            "noise_rule": ("bench.throughput_effect: engine steps decide where the same output tokens took different "
                           "steps (deterministic runs); else two or more paired per-round ratios decide (noise when "
                           "they hold 1); one repeat with equal steps is within noise; with --rate and one repeat, "
                           f"|ratio - 1| <= {THROUGHPUT_NOISE}"),
            "non_timing_deterministic": args.rate is None, "gap_within_noise": gap_within_noise,
            "skvs_ratio_min": min(skvs_valid) / skvs_metrics["throughput"],
            "skvs_ratio_max": max(skvs_valid) / skvs_metrics["throughput"], "rows": rows}


def _fmt(value: float, key: str = "") -> str:
    """As the table prints values; counts (engine steps) as whole numbers."""
    return f"{value:.0f}" if key == "num_steps" and math.isfinite(value) else metrics.format_value(value)


def _format_ablation(a: dict) -> str:
    """The decomposition table and a plain reading of it."""
    label = {key: (text, factor) for key, text, factor in metrics.METRICS} | {"num_steps": ("engine steps", 1.0)}
    keys = [key for key, _ in ABLATION_METRICS]
    header = ["switch off", "throughput vs skvs", *(label[k][0] for k in keys[1:]), "share of gap: steps",
              "share of gap: throughput"]
    lines = ["Ablation: skvs with one switch at a time set back to naive_spec's value. Each cell: the value with "
             "the switch off (change vs full skvs in brackets); throughput as a ratio to full skvs in this run"
             + (f" [min-max of the ratios within each of the {a['repeats']} rounds]" if a["repeats"] > 1 else "")
             + "; share of gap = (skvs - switch off) / (skvs - naive_spec), in engine steps and in throughput.",
             "", "| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    any_row = next(iter(a["rows"].values()))["metrics"]
    skvs_range = f" [{a['skvs_ratio_min']:.2f}-{a['skvs_ratio_max']:.2f}]" if a["repeats"] > 1 else ""
    cells = ["(none: skvs)", f"1.00x{skvs_range} = {_fmt(any_row['throughput']['skvs'])} tok/s"]
    cells += [_fmt(any_row[k]["skvs"] * label[k][1], k) for k in keys[1:]] + ["", ""]
    lines.append("| " + " | ".join(cells) + " |")
    for switch, row in a["rows"].items():
        m = row["metrics"]
        t = m["throughput"]
        paired = sum(x is not None for x in t["paired"]) > 1
        cells = ["all (naive_spec)" if switch == "naive_spec" else switch,
                 f"{t['change']:.2f}x" + (f" [{t['ratio_min']:.2f}-{t['ratio_max']:.2f}]" if paired else "")]
        for k in keys[1:]:
            factor = label[k][1]
            change = float(f"{m[k]['change'] * factor:.10g}")  # 50.0 - 40.0 prints as +10.0, not +10.00
            signed = "n/a" if not math.isfinite(change) else ("±0" if change == 0 else
                                                               ("+" if change > 0 else "") + _fmt(change, k))
            cells.append(f"{_fmt(m[k]['off'] * factor, k)} ({signed})")
        for share in (row["steps_share_of_gap"], row["share_of_gap"]):
            cells.append(f"{share * 100:.0f}%" if math.isfinite(share) else "n/a")
        lines.append("| " + " | ".join(cells) + " |")

    naive = a["rows"]["naive_spec"]
    t = naive["metrics"]["throughput"]
    overall = metrics.safe_ratio(t["skvs"], t["off"])
    lines += ["", f"skvs vs naive_spec overall: skvs throughput {overall:.2f}x naive_spec's ("
              + ("beyond noise" if not a["gap_within_noise"] else naive["throughput_effect"]) + "); skvs is better on "
              + (", ".join(naive["better"]) or "nothing") + "; worse on " + (", ".join(naive["worse"]) or "nothing")
              + ("; the gap is within noise, so the shares of it are not meaningful" if a["gap_within_noise"] else
                 "") + "."]
    switches = {s: r for s, r in a["rows"].items() if s != "naive_spec"}
    for effect, verb in (("helps", "help throughput (skvs is faster with them)"),
                         ("hurts", "hurt throughput (skvs is faster without them)"),
                         ("within noise", "change throughput within noise"),
                         ("none", "change nothing on this trace (schedule identical to skvs's; any throughput "
                                  "difference is noise)"),
                         ("not measured", "could not be timed (every run stalled, see the warning above)")):
        members = [s for s, r in switches.items() if r["throughput_effect"] == effect]
        if members or effect in ("helps", "hurts", "within noise"):
            lines.append(f"switches that {verb}: {', '.join(members) or 'none'}")
    for s, r in switches.items():
        if r["identical_schedule"]:
            continue
        lines.append(f"  {s}: with it skvs is better on {', '.join(r['better']) or 'nothing'}; "
                     f"worse on {', '.join(r['worse']) or 'nothing'}; throughput {r['throughput_effect']} "
                     f"(by {r['verdict_basis']})")
    rule = ("the range of its per-round ratios holds 1" if a["repeats"] > 1 else
            "it ran as many engine steps (one run has no spread; use --repeats N to measure it)"
            if a["non_timing_deterministic"] else
            f"it is within {THROUGHPUT_NOISE:.0%}, this CPU's run-to-run spread (use --repeats N to measure it)")
    lines.append("Verdicts: where the same output tokens took a different number of engine steps (deterministic), "
                 "the steps decide (fewer is faster) unless the repeats agree on the opposite; otherwise a throughput "
                 f"change counts as noise when {rule} (with --rate and one repeat: within {THROUGHPUT_NOISE:.0%}). "
                 + ("Non-timing metrics are deterministic for this seed (all arrivals at t = 0): any change in them "
                    "is real for this trace, though it is one trace." if a["non_timing_deterministic"] else
                    "With --rate, non-timing metrics depend on timing too."))
    return "\n".join(lines)
