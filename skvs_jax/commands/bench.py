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
step cost fits it again after that run, on warm programs (`Serving.refit`), and its timed runs plan with that fit.
Greedy outputs must be identical across policies (checked).

Load, as `vllm bench serve` drives a server: `--request-rate R1,R2,...` serves every policy at each rate in turn
(each rate its report, then a table of the load-dependent metrics per rate; `inf`, the default, puts every request
at t = 0), with Poisson arrivals or, with `--burstiness B`, Gamma gaps of shape B (`workloads.arrival_gaps`);
`--max-concurrency N` keeps at most N requests unfinished (`bench_serving`'s module docstring); `--trace FILE`
serves a JSONL file's requests at its own arrival times (`workloads.read_requests`); `--phases COUNTxMULTIPLE,...`
serves a phased trace whose rate steps (`workloads.phased`) and adds a table of TPOT P50/P99 per phase, with the
best fixed K per phase in hindsight when vllm_default and naive_spec:K are served (`_print_phases`; the flags are
`trace_flags`', shared with `skvs simulate`). With arrivals after t = 0
they follow each engine's clock, so which requests share a step — and the non-timing metrics — depend on timing;
with every request at t = 0 everything but the timings is reproducible from the seed.

A run in which one step takes over a second and over half the run has *stalled* (a program compiled inside the timed
run, or the machine stopped): it is flagged, and left out of the median when the policy has other runs. `--repeats
N` serves every policy N times, in N rounds of every policy (so drift of the machine's load over the run hits every
policy, and policies of one round can be compared pairwise; round r runs the policies rotated by r, so each takes
every place equally often). Within a round the policies are served in lockstep (`--lockstep`, the default: one step
of each in turn, each engine timed on its own `TurnClock`, `serve_together`), so the machine's drift from one second
to the next lands on every policy of the round alike; `--no-lockstep` serves them one after another (each engine
alone on the machine, its own programs warm). Each policy's metrics are those of its run with the median throughput
(the upper median for even N), and its min-max throughput is reported.

More policies than one process holds compiled at once (`MAX_LIVE_PROGRAMS`: the ablation's) are served in
consecutive groups (`serving_groups`), each group's rounds done and its programs freed before the next compiles;
under `--ablation` every later group serves skvs again, so each variant's per-round ratios pair it with a skvs run
of its own group (skvs's reported metrics stay those of the first group's runs). `--ablation` serves naive_spec,
skvs and `policies.ablations(skvs)`: skvs with one switch at a time turned back to naive_spec's value ("skvs
-<switch>"). After the usual table it prints the decomposition: per switch, the metrics with the switch off and
their change vs full skvs measured in the same run, the switch's share of the skvs - naive_spec gap (in engine
steps, which are deterministic, and in throughput), and which switches help, hurt or stay within noise
(`throughput_effect`: engine steps decide where the same tokens took different steps; otherwise the spread of the
ratios within each round, off / skvs; one round with equal steps is no evidence, and only with arrivals after t = 0
does one round fall back to THROUGHPUT_NOISE, the run-to-run spread of a 2-core CPU).

`--policies` (or `--policy`) takes presets with overrides (`policies.parse_policies`), and --preemption, --victim,
--kv-precision, --no-prefix-cache and --host-blocks set a switch for every policy (`policy_flags`).
`--steps-per-dispatch` is the engines' (`EngineOptions.steps_per_dispatch`; a line under the table says how each
policy's steps were dispatched, and bench.json's `policies.*.dispatches` records it).

The metrics are `vllm bench serve`'s (`skvs_jax.metrics`: mean, median, P90, P99 of TTFT, TPOT, ITL and
end-to-end latency, request and output-token throughput) beside the cache's and the speculation's. Under the
table a headline line gives the first ratio column's output throughput (skvs / naive_spec, else skvs /
vllm_default) with, from three rounds of --repeats, the 95% t-interval of its per-round ratios and whether it
holds 1 (`bench_report.headline`; "single reading" with one repeat).

bench.json (SCHEMA_VERSION 3). Units are in the keys: `_ms` latencies, `_s` durations and times, `_per_s` rates;
fractions and counts have none. Version 2 had unitless keys ("throughput" tok/s, "ttft_p50" s, series "time", runs
"throughput", config "rate"), no per-request records and no headline; its shape otherwise is version 3's at one rate.
  schema_version, command, versions; config: every flag (request_rate_per_s: the rates, "inf" for t = 0;
    burstiness, phases, max_concurrency, trace), the policy flags and every policy's fields ("policy_fields").
  Per rate: at the top level with one --request-rate, else in "by_rate", a list in the flag's order whose entries
  also hold their "request_rate_per_s" (`sections_of(doc)` gives the list either way):
    trace                     kind, seed, params, requests (count).
    identical_greedy_outputs  true / false (null when there was nothing to compare).
    policies                  per policy: "metrics" (`metrics.with_units` of the summary, plus the draft
                              attribution's counts), "requests" (`metrics.request_rows`: id, prompt_tokens,
                              output_tokens, arrival_s, ttft_ms, tpot_ms, e2e_ms, itl_ms, cached_tokens, drafted,
                              accepted, aborted), "counters", "compiled_buckets", "series" (per step: time_s, the
                              step's end; output_tokens, blocks_used, spec_blocks), "step_cost_us", "steps_by_width",
                              "dispatches", "split_step_us", "split". The reported run's, with --repeats.
    headline                  `bench_report.headline` (absent when no ratio column): pair, metric, ratio,
                              rounds, ci95 ([low, high] or null), contains_1, method.
    runs                      with --repeats > 1 or --ablation: output_tokens_per_s (policy -> each repeat's),
                              stalled (policy -> a flag per repeat), and without --ablation
                              paired_to_naive_spec (policy -> its throughput over naive_spec's in each round,
                              stalled rounds left out) and paired_to_naive_spec_ci95 (policy -> [low, high], the
                              95% bootstrap interval of that ratio's median, `bootstrap_median_ci`).
    ablation                  with --ablation (one rate only): `ablation_report`.
    priced_schedules          `bench_report.priced_schedules`, when a policy fitted its step cost.
    phases                    a phased trace's: by_policy (policy -> per phase, `metrics.summarize_groups` with
                              units) and hindsight (`group_report.hindsight`'s rows, null without fixed K policies).
    equal_width_us            in lockstep with two or more policies: policy -> width -> the median us of one
                              step on empty slots, the engines alternated (`bench_serving.equal_width_steps`).

The command is three modules: this one (the flags, `setup`, and `run`: `serve_all` -> `print_report` ->
`write_outputs`), `bench_serving` (the engines, lockstep, the rounds and groups) and `bench_report` (what a
policy reports over its repeats, the paired ratios, the ablation's verdicts, the plot).
"""

from __future__ import annotations

import argparse
import dataclasses
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
from skvs_jax.commands import bench_report as report
from skvs_jax.commands import bench_serving as serving
from skvs_jax.commands import checkpoints, group_report, policy_flags, startup, trace_flags
from skvs_jax.config import CacheConfig
from skvs_jax.serve import engine as eng
from skvs_jax.serve import speculation

SCHEMA_VERSION = 3


DEFAULT_WORKLOAD = "system_prompts"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default=None, choices=sorted(workloads.GENERATORS),
                        help="default: system_prompts, or phased with --phases")
    parser.add_argument("--requests", type=int, default=32, help="requests in the trace")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--policies", "--policy", dest="policies", default="vllm_default,naive_spec,skvs",
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
    parser.add_argument("--request-rate", "--rate", dest="request_rate", default=None, metavar="R[,R...]",
                        help="arrival rates, requests/s, comma-separated: every policy serves the trace at each, and "
                             "each gets its report (inf: every request at t = 0, the default)")
    parser.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                        help="at most N requests in flight: an arrived request is added to the engine only while "
                             "fewer than N are unfinished (default: no limit)")
    trace_flags.add_arguments(parser, verb="serve", rate_flag="--request-rate")
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
    parser.add_argument("--steps-per-dispatch", default="auto", type=_steps_per_dispatch,
                        help="engine steps one jitted program runs before the host reads it (an int >= 1, or auto: "
                             "up to 32; a dispatch also ends where the host is needed); 1: the host between steps")
    parser.add_argument("--impl", default="xla", choices=("xla", "pallas", "reference"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="skvs-results", help="output folder")
    parser.add_argument("--no-plot", action="store_true", help="skip bench.png")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    checkpoints.add_arguments(parser, drafter=True)
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


def _steps_per_dispatch(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1 or 'auto', got {value!r}")
    return n


def arrival_rates(args: argparse.Namespace) -> list[float | None]:
    """--request-rate as the rates to serve at, in order, None for inf (every request at t = 0; the default)."""
    spec = getattr(args, "request_rate", None)
    if spec is None:
        return [None]
    try:
        rates = [float(part) for part in str(spec).split(",")]
    except ValueError:
        raise SystemExit(f"skvs bench: --request-rate must be comma-separated numbers or inf, got {spec!r}") from None
    if any(not r > 0 for r in rates):  # NaN fails this too
        raise SystemExit(f"skvs bench: --request-rate must be > 0 (inf: every request at t = 0), got {spec!r}")
    rates = [None if math.isinf(r) else r for r in rates]
    if len(set(rates)) < len(rates):
        raise SystemExit(f"skvs bench: --request-rate names a rate twice: {spec!r}")
    return rates


def make_trace(args: argparse.Namespace, rate: float | None | str = "first") -> workloads.Trace:
    """The trace served at `rate` (default: --request-rate's first): --trace's requests, else --workload's,
    whose prompts and lengths are the same at every rate (`workloads`: one random stream per purpose)."""
    if getattr(args, "trace", None) is not None:
        try:
            return workloads.read_requests(args.trace, seed=args.seed)
        except (ValueError, OSError) as err:
            raise SystemExit(f"skvs bench: --trace: {err}") from None
    if rate == "first":
        rate = arrival_rates(args)[0]
    return workloads.tiny_model_trace(args.workload or DEFAULT_WORKLOAD, args.requests, seed=args.seed, rate=rate,
                                      max_output_len=args.max_output, burstiness=trace_flags.burstiness(args),
                                      **(trace_flags.phases(args) if args.workload == "phased" else {}))


def trace_rate(trace: workloads.Trace) -> float | None:
    """A trace's arrival rate, requests/s: its requests over its last arrival; None when all arrive at t = 0."""
    last = max(r.arrival_time for r in trace.requests)
    return len(trace.requests) / last if last > 0 else None


def _check_load_flags(args: argparse.Namespace) -> list[float | None]:
    """--request-rate, --burstiness, --phases, --max-concurrency and --trace, checked; returns the rates."""
    rates = arrival_rates(args)
    trace_flags.check(args, "skvs bench")
    args.workload = args.workload or DEFAULT_WORKLOAD
    concurrency = getattr(args, "max_concurrency", None)
    if concurrency is not None and concurrency < 1:
        raise SystemExit(f"skvs bench: --max-concurrency must be >= 1, got {concurrency}")
    if getattr(args, "trace", None) is not None and args.request_rate is not None:
        raise SystemExit("skvs bench: --trace gives every request its arrival time: leave out --request-rate")
    if getattr(args, "ablation", False) and len(rates) > 1:
        raise SystemExit("skvs bench: --ablation serves one --request-rate (the decomposition is per load)")
    return rates


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
    args.rates = _check_load_flags(args)
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
    args.dtype = loaded.dtype  # what "auto" resolved to, for the report
    if loaded.model.config.vocab_size < checkpoints.BYTE_VOCAB:
        raise SystemExit(f"skvs bench: the model's vocabulary has {loaded.model.config.vocab_size} tokens; the "
                         f"bench's prompts are bytes, which need {checkpoints.BYTE_VOCAB}")
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
    trace = make_trace(args)
    # --trace's requests are as long as the file says; the geometry holds them and the workloads' longest (the
    # same programs as without --trace when the file's requests are no longer).
    longest = max(len(r.prompt) + r.max_new_tokens for r in trace.requests) if args.trace is not None else 0
    if longest > loaded.max_positions:
        raise SystemExit(f"skvs bench: --trace {args.trace}: a request of {longest} tokens (prompt + output_len) "
                         f"exceeds the model's max_position_embeddings ({loaded.max_positions})")
    max_len = min(loaded.max_positions,
                  -(-max(96 + args.max_output, longest) // args.block_size) * args.block_size)
    blocks_per_seq = max_len // args.block_size  # the longest prompt (96) + --max-output, in whole blocks
    if blocks_per_seq > args.kv_blocks - 1:
        what = (f"--trace's longest request, {longest} tokens" if longest > 96 + args.max_output else
                f"a prompt of up to 96 tokens + --max-output {args.max_output}")
        raise SystemExit(f"skvs bench: one sequence ({what}) can need {blocks_per_seq} blocks of {args.block_size} "
                         f"tokens, more than --kv-blocks {args.kv_blocks} holds ({args.kv_blocks - 1} usable): raise "
                         f"--kv-blocks or --block-size, or lower --max-output")
    model, heads = loaded.model, loaded.heads
    args.model_name = loaded.name
    args.oracle_table = None
    try:
        for policy in chosen.values():
            checkpoints.check_speculation(policy, loaded, flag="--policies")
        cache = CacheConfig(num_blocks=args.kv_blocks, block_size=args.block_size, max_seqs=args.max_seqs,
                            max_blocks_per_seq=blocks_per_seq)
        if loaded.oracle is not None:
            heads = _oracle_drafter(loaded, model, heads, trace, cache, args)
        # The engines' own checks (budgets, trees, widths), before any is served; each policy's compiled programs
        # (its widths + `schedule`) decide the serving groups (`bench_serving.serving_groups`).
        args.programs = {n: len(eng.Engine(model, heads, p, cache, **serving.engine_kwargs(p, args)).picker.widths) + 1
                         for n, p in chosen.items()}
    except ValueError as err:
        raise SystemExit(f"skvs bench: {err}") from None
    return specs, _verify_budget(args.verify_budget), model, heads, trace, cache


def _oracle_drafter(loaded, model, heads, trace, cache, args):
    """--drafter oracle:PROFILE: the reference pass (the trace served greedily by vllm_default on the same engine
    options; cached, `checkpoints.oracle_table`) and the drafter made from it, running `heads` (their cost, and
    their proposals as its rejected drafts). Keeps the table in args.oracle_table,
    against which every policy's outputs are checked."""
    from skvs_jax.serve import oracle_drafter

    requests = [(r.request_id, list(r.prompt), r.max_new_tokens) for r in trace.requests]
    ref = policies.vllm_default()
    table, where = checkpoints.oracle_table(
        loaded, requests, lambda: eng.Engine(model, None, ref, cache, **serving.engine_kwargs(ref, args)))
    print(f"oracle drafter: {where}")
    args.oracle_table, args.oracle_probs = table, loaded.oracle
    return oracle_drafter.OracleDrafter(loaded.oracle, table, seed=args.seed, heads=heads)


def run(args: argparse.Namespace) -> int:
    """Serve every policy at each --request-rate (`serve_all`), print each rate's report (`print_report`) and,
    with several rates, the sweep's table; write bench.json and the plot (`write_outputs`). Exit 0 unless greedy
    outputs differ across policies."""
    specs, budget, model, heads, trace, cache = setup(args)
    startup.output_dir(args.out, "bench")  # before serving: a folder that cannot be made would lose the results
    names = list(specs)
    groups = serving.serving_groups(names, args.programs, anchor="skvs" if args.ablation else None)
    # The trace's requests are the same at every rate: one run of every policy serves the same tokens.
    tokens = sum(r.max_new_tokens for r in trace.requests) * sum(map(len, groups)) * args.repeats
    bar = None if args.quiet else serving.Progress(tokens * len(args.rates))
    sections = []
    for i, rate in enumerate(args.rates):
        at = trace if i == 0 else make_trace(args, rate)
        at_args = argparse.Namespace(**vars(args))
        # args.rate is what serving and the report read: None when every request arrives at t = 0 (non-timing
        # metrics then reproducible from the seed), else the arrivals' rate.
        at_args.rate = trace_rate(at) if args.trace is not None else rate
        if len(args.rates) > 1:
            print(f"\n== request rate {_rate_label(rate)} ({i + 1}/{len(args.rates)}) ==")
        t_start = time.perf_counter()
        runs, paired_with = serve_all(specs, model, heads, at, cache, at_args, bar)
        reported = print_report(runs, paired_with, specs, budget, at, cache, at_args, time.perf_counter() - t_start)
        sections.append(dict(rate=rate, trace=at, reported=reported))
    if bar is not None:
        bar.close()
    if len(sections) > 1:
        print()
        print(format_sweep(sections, names))
    write_outputs(sections, specs, budget, cache, args)
    return 0 if all(s["reported"]["same"] in (None, True) for s in sections) else 1


def _rate_label(rate: float | None) -> str:
    return "inf (every request at t = 0)" if rate is None else f"{rate:g} req/s"


# The sweep table's columns: (reported key, header).
SWEEP_COLUMNS = (("requests_per_s", "req/s"), ("output_tokens_per_s", "output tok/s"),
                 ("median_ttft_ms", "TTFT median ms"), ("p99_ttft_ms", "TTFT P99 ms"),
                 ("median_tpot_ms", "TPOT median ms"), ("median_itl_ms", "ITL median ms"),
                 ("median_e2e_ms", "end-to-end median ms"), ("p99_e2e_ms", "end-to-end P99 ms"))


def format_sweep(sections: list[dict], names: list[str]) -> str:
    """The sweep's table: a group of rows per request rate, one row per policy, the load-dependent metrics."""
    head = ["request rate", "policy", *(h for _, h in SWEEP_COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|---|---" + "|---:" * (len(head) - 2) + "|"]
    for s in sections:
        for j, n in enumerate(names):
            m = s["reported"]["results"][n]["metrics"]
            rate = ("inf" if s["rate"] is None else f"{s['rate']:g}") if j == 0 else ""
            lines.append("| " + " | ".join([rate, n, *(metrics.format_value(m.get(k, math.nan))
                                                      for k, _ in SWEEP_COLUMNS)]) + " |")
    return "\n".join(lines) + "\n"


def serve_all(specs: dict, model, heads, trace, cache, args,
              bar: serving.Progress | None = None) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """Every policy's runs, in groups of at most `MAX_LIVE_PROGRAMS` compiled programs (`serving_groups`), each
    group's programs freed before the next compiles. Returns (policy -> its runs' results, and for the ablation:
    policy -> the skvs runs of its own group, its per-round pairs)."""
    chosen = {n: s.policy for n, s in specs.items()}
    names = list(chosen)
    anchor = "skvs" if args.ablation else None
    groups = serving.serving_groups(names, args.programs, anchor=anchor)
    runs = {n: [] for n in names}
    paired_with = {}
    for g, group in enumerate(groups):
        if g:  # the previous group's programs, freed before this group compiles its own
            jax.clear_caches()
        out = {n: [] if g and n == anchor else runs[n] for n in group}  # a later group's skvs: pairs only
        serving.serve_group(group, out, runs, model, heads, chosen, specs, cache, trace, args, bar)
        paired_with |= {n: out[anchor] for n in group if anchor in out and n != anchor}
    return runs, paired_with


def print_report(runs: dict, paired_with: dict, specs: dict, budget, trace, cache, args, wall: float) -> dict:
    """Print the table and what the runs say beside it; returns what bench.json records of them."""
    chosen = {n: s.policy for n, s in specs.items()}
    names = list(chosen)
    stalls = {n: [report.stall(r) for r in rs] for n, rs in runs.items()}
    stalled = {n: [bool(st) for st in sts] for n, sts in stalls.items()}
    valid = {n: report.unstalled(rs, stalled[n]) for n, rs in runs.items()}
    results = {n: report.upper_median(rs, stalled[n], key=lambda r: r["metrics"][report.THROUGHPUT])
               for n, rs in runs.items()}
    throughputs = {n: [r["metrics"][report.THROUGHPUT] for r in rs] for n, rs in runs.items()}

    same = None
    if args.temperature == 0 and len(names) * args.repeats > 1:
        first = runs[names[0]][0]["outputs"]
        same = all(r["outputs"] == first for rs in runs.values() for r in rs)
    table = metrics.format_table({n: results[n]["metrics"] for n in names})
    vb = f", skvs verify budget {budget}" if budget else ""
    print(f"skvs bench: {len(trace.requests)} requests ({trace.kind}, seed {trace.seed}), {args.model_name} "
          f"(K={args.draft_len}{vb}), KV budget {cache.usable_blocks} blocks x {cache.block_size} tokens, "
          f"{cache.max_seqs} slots, token budget {args.token_budget}, impl {args.impl}, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}; wall time {wall:.0f} s")
    print(f"arrivals: {describe_arrivals(trace, args)}")
    print(policy_flags.describe(specs, serving.host_blocks(args)))
    print(table)
    head = report.headline(results, throughputs, stalled, names)
    if head is not None:
        print(report.format_headline(head))
    if args.repeats > 1:
        spread = {n: [r["metrics"][report.THROUGHPUT] for r in rs] for n, rs in valid.items()}
        print(f"output throughput over {args.repeats} repeats, median [min-max] tok/s: " + ", ".join(
            f"{n} {report.fmt(results[n]['metrics'][report.THROUGHPUT])} [{report.fmt(min(t))}-{report.fmt(max(t))}]"
            for n, t in spread.items()))
        if args.rate is None:
            print(f"non-timing metrics identical across repeats: {report.reproducible(runs)}")
    paired = report.paired_ratios(throughputs, stalled, names) if args.repeats > 1 and not args.ablation else {}
    paired_ci = {n: report.bootstrap_median_ci(r) for n, r in paired.items() if r}
    if paired:
        # Load drift moves every policy of a round together, so a ratio within a round is steadier than the ratio
        # of two medians taken from different rounds.
        print(f"throughput / {report.REFERENCE}'s within each round, median [min-max] (95% bootstrap interval of "
              "the median; rounds above 1): " + ", ".join(
                  f"{n} {statistics.median(r):.3f}x [{min(r):.3f}-{max(r):.3f}] "
                  f"({paired_ci[n][0]:.3f}-{paired_ci[n][1]:.3f}; {sum(v > 1 for v in r)} of {len(r)})"
                  for n, r in paired.items() if r))
    _print_stalls(stalls)
    _print_dispatches(results, names, args)
    priced = _print_fits(results, names)
    equal = _print_equal_widths(runs, names)
    if same is not None:
        print(f"greedy outputs identical across policies: {same} ({len(names)} policies"
              + (f" x {args.repeats} repeats" if args.repeats > 1 else "") + " checked)")
    _print_acceptance(results, names, trace, args)
    phases = _print_phases(results, names, trace, args)
    ablation = None
    if args.ablation:
        paired_runs = {n: ([r["metrics"][report.THROUGHPUT] for r in rs], [bool(report.stall(r)) for r in rs])
                       for n, rs in paired_with.items()}
        ablation = report.ablation_report(chosen, results, throughputs, stalled, args, paired_runs)
        print()
        print(report.format_ablation(ablation))
    return dict(results=results, throughputs=throughputs, stalled=stalled, paired=paired, paired_ci=paired_ci,
                same=same, ablation=ablation, priced=priced, headline=head, phases=phases, equal_widths=equal)


def _print_phases(results: dict, names: list[str], trace, args) -> dict | None:
    """A phased trace's table of TPOT P50/P99 per phase (`group_report.group_table`, as `skvs simulate` prints it;
    each policy's reported run; with vllm_default and naive_spec:K policies, the best fixed K per phase in
    hindsight); returns what bench.json records of it ("by_policy": per policy, per phase, the metrics; "hindsight":
    `group_report.hindsight`'s rows), None for a trace without phases."""
    if "phases" not in trace.params:
        return None
    ids = [r.request_id for r in trace.requests]
    by_id = np.zeros(max(ids) + 1, np.int64)  # summarize_groups indexes by request id
    by_id[ids] = workloads.phase_of(trace)
    lanes = {n: [{"seed": trace.seed, "phase": [metrics.with_units(g) for g in
                                               metrics.summarize_groups(results[n]["records"], by_id)]}]
             for n in names}
    rate = args.rate or 0.0
    labels = [f"phase {p}: {c} @ {rate * m:g} req/s" if rate else f"phase {p}: {c} requests"
              for p, (c, m) in enumerate(trace.params["phases"])]
    fixed = group_report.fixed_names(names, args.draft_len)
    print(f"per phase (TPOT in ms; each policy's reported run; trace seed {trace.seed}):")
    print(group_report.group_table(lanes, names, "phase", labels, fixed))
    return {"by_policy": {n: lanes[n][0]["phase"] for n in names},
            "hindsight": group_report.hindsight(lanes, names, "phase", fixed) if fixed else None}


def describe_arrivals(trace, args) -> str:
    """How the requests arrive, in words: the rate and its process (or the file), and --max-concurrency."""
    if getattr(args, "trace", None) is not None:
        rate = trace_rate(trace)
        what = f"as --trace {args.trace} says (" + ("all at t = 0" if rate is None else f"{rate:.3g} req/s") + ")"
    elif args.rate is None:
        what = "every request at t = 0"
    else:
        b = trace_flags.burstiness(args)
        what = (f"{args.rate:g} req/s, " + ("Poisson" if b == 1.0 else f"Gamma gaps of shape {b:g} (burstiness)")
                + ", on each engine's clock")
    cap = getattr(args, "max_concurrency", None)
    return what + ("" if cap is None else f"; at most {cap} requests in flight (--max-concurrency)")


def _print_acceptance(results: dict, names: list[str], trace, args) -> None:
    """Each speculating policy's acceptance per depth, among verifications that offered a draft there and accepted
    every draft before it (the scheduler's population counts); with the oracle drafter, its profile beside it, and
    the requests whose output departed from the reference pass (after which the oracle no longer predicts them)."""
    for n in names:
        acc = results[n].get("acceptance_by_depth")
        if acc and acc["tried"] and acc["tried"][0]:
            print(f"{n}: acceptance by depth (accepted / offered) "
                  + ", ".join(f"{p / t:.3f} ({p}/{t})" if t else "-" for p, t in zip(acc["passed"], acc["tried"])))
    table = getattr(args, "oracle_table", None)
    if table is None:
        return
    print(f"oracle profile by depth: {', '.join(f'{p:.3f}' for p in args.oracle_probs)}")
    for n in names:
        out = results[n]["outputs"]
        differ = [r.request_id for r in trace.requests
                  if list(out[r.request_id]) != [t for t in table[r.request_id, len(r.prompt):].tolist() if t >= 0]]
        print(f"{n}: {len(differ)} of {len(trace.requests)} requests' outputs differ from the reference pass"
              + (f" (ids {differ[:8]})" if differ else ""))


def _print_stalls(stalls: dict) -> None:
    for n, st in stalls.items():
        if any(st):
            worst = max(x for x in st if x)
            print(f"warning: {sum(map(bool, st))} of {len(st)} runs of {n} had one step of up to {worst[0]:.1f} s "
                  f"(of {worst[1]:.1f} s in all: a compilation inside the timed run?); "
                  + ("excluded from its median and range" if not all(st) else
                     "its timing rows measure that, not the policy; with --repeats 2 or more the later runs reuse "
                     "the compiled programs"))


def _print_dispatches(results: dict, names: list[str], args) -> None:
    """How each policy's steps were dispatched (`bench_serving.dispatch_summary`)."""
    parts = []
    for n in names:
        d = results[n].get("dispatches")
        if d:
            stops = ", ".join(f"{k} {v}" for k, v in d["stops"].items())
            staged = f"; {d['admitted']} admitted by the loop" if d.get("admitted") else ""
            parts.append(f"{n} {d['steps']} steps in {d['dispatches']} ({d['per_request']:.2f} a request; {stops}"
                         f"{staged})")
    if parts:
        print(f"dispatches (--steps-per-dispatch {getattr(args, 'steps_per_dispatch', 'auto')}), by why each ended: "
              + "; ".join(parts))


def _print_fits(results: dict, names: list[str]) -> dict | None:
    """Each policy's fitted step cost, and every schedule priced by one fit (`priced_schedules`, returned)."""
    for n in names:
        if results[n].get("step_cost_us"):
            print(f"{n}: step cost fitted at warm-up (us per step by query width): "
                  + ", ".join(f"{w}: {t:.0f}" for w, t in results[n]["step_cost_us"].items())
                  + (f"; its prompt width's split branch: {results[n]['split_step_us']:.0f}"
                     if results[n].get("split_step_us") is not None else ""))
    priced = report.priced_schedules(results, names)
    if priced is not None:
        base = next(iter(priced["ms"]))
        print(f"steps priced by {priced['fit_of']}'s fit (each reported run's steps by width, without the clock's "
              "noise): " + ", ".join(f"{n} {ms:.1f} ms" + ("" if n == base else f" ({ms / priced['ms'][base]:.2f}x "
                                                                                 f"{base})")
                                    for n, ms in priced["ms"].items())
              + "".join(f"; {n} unpriced (its split steps have a shape the fit did not time)"
                        for n in priced["unpriced"]))
    return priced


def _print_equal_widths(runs: dict, names: list[str]) -> dict | None:
    """Each policy's step at the widths every policy compiles, timed in the first round with the engines
    alternated (`bench_serving.equal_width_steps`), with its ratio to the first policy's; None when not timed."""
    timed = {n: runs[n][0].get("equal_width_us") for n in names if runs[n]}
    if not timed or any(t is None for t in timed.values()):
        return None
    base = names[0]
    def entry(n, w):
        return f"{n} {timed[n][w]:.0f}" + ("" if n == base else f" ({timed[n][w] / timed[base][w]:.2f}x)")

    print("one step at each width every policy compiles (empty slots, engines alternated, median us): "
          + "; ".join(f"width {w}: " + ", ".join(entry(n, w) for n in names) for w in timed[base]))
    return timed


def _rate_json(rate: float | None) -> float | str:
    return "inf" if rate is None else rate


def section(reported: dict, names: list[str], trace, args) -> dict:
    """What bench.json records of one rate's runs (the module docstring's per-rate keys)."""
    results = reported["results"]
    doc = {
        "trace": {"kind": trace.kind, "seed": trace.seed, "params": trace.params, "requests": len(trace.requests)},
        "identical_greedy_outputs": reported["same"],
        "policies": {n: {"metrics": results[n]["metrics"], "counters": results[n]["counters"],
                         "compiled_buckets": results[n]["compiled"], "series": results[n]["series"],
                         "step_cost_us": results[n].get("step_cost_us", {}),
                         "steps_by_width": results[n].get("width_hist", {}),
                         "dispatches": results[n].get("dispatches", {}),
                         "split_step_us": results[n].get("split_step_us"), "split": results[n].get("split", {}),
                         "requests": results[n].get("requests", [])}
                     for n in names},
    }
    if reported["headline"] is not None:
        doc["headline"] = reported["headline"]
    if args.repeats > 1 or args.ablation:
        doc["runs"] = {report.THROUGHPUT: reported["throughputs"], "stalled": reported["stalled"]}
        if reported["paired"]:
            doc["runs"][f"paired_to_{report.REFERENCE}"] = reported["paired"]
            doc["runs"][f"paired_to_{report.REFERENCE}_ci95"] = {n: list(ci) for n, ci in reported["paired_ci"].items()}
    if reported["ablation"] is not None:
        doc["ablation"] = reported["ablation"]
    if reported["priced"] is not None:
        doc["priced_schedules"] = reported["priced"]
    if reported.get("phases") is not None:
        doc["phases"] = reported["phases"]
    if reported.get("equal_widths") is not None:
        doc["equal_width_us"] = reported["equal_widths"]
    return doc


def sections_of(doc: dict) -> list[dict]:
    """bench.json's per-rate sections, for a reader: `by_rate` with several rates, else the document itself."""
    return doc.get("by_rate") or [doc]


def write_outputs(sections: list[dict], specs: dict, budget, cache, args) -> None:
    """bench.json (SCHEMA_VERSION; the module docstring) and, unless --no-plot, bench.png (the first rate's
    runs), into --out. sections: per rate, dict(rate, trace, reported) in --request-rate's order."""
    chosen = {n: s.policy for n, s in specs.items()}
    names = list(chosen)
    out = pathlib.Path(args.out)  # made by `run` before serving
    config = {k: getattr(args, k) for k in ("workload", "requests", "policies", "kv_blocks", "block_size", "max_seqs",
                                            "draft_len", "token_budget", "prefill_chunk", "max_output",
                                            "temperature", "tree", "acceptance", "impl", "seed", "ablation", "repeats",
                                            "step_cost", "burstiness", "phases", "max_concurrency", "trace")}
    config["request_rate_per_s"] = [_rate_json(r) for r in args.rates]
    config["verify_budget"] = budget
    config |= {"model": args.model, "medusa": args.medusa, "model_shape": args.model_shape, "dtype": args.dtype,
               "weight_seed": args.weight_seed, "drafter": args.drafter}
    config["policies"] = ",".join(names)
    config |= {k: getattr(args, k) for k in ("preemption", "victim", "kv_precision", "no_prefix_cache")}
    config["host_blocks"] = serving.host_blocks(args)
    config["policy_fields"] = {n: dataclasses.asdict(chosen[n]) | {"draft_len_knob": specs[n].draft_len_knob}
                               for n in names}
    doc = {
        "schema_version": SCHEMA_VERSION,
        "command": "skvs bench" + (" --ablation" if args.ablation else ""),
        "config": config,
        "versions": {"skvs_jax": skvs_jax.__version__, "jax": jax.__version__, "python": platform.python_version(),
                     "platform": jax.devices()[0].platform, "machine": platform.machine()},
    }
    per_rate = [{"request_rate_per_s": _rate_json(s["rate"])} | section(s["reported"], names, s["trace"], args)
                for s in sections]
    if len(per_rate) == 1:
        doc |= {k: v for k, v in per_rate[0].items() if k != "request_rate_per_s"}
    else:
        doc["by_rate"] = per_rate
    (out / "bench.json").write_text(json.dumps(metrics.json_safe(doc), indent=1, allow_nan=False) + "\n")
    if not args.no_plot:
        report.plot(sections[0]["reported"]["results"], out / "bench.png", cache.usable_blocks,
                    run=f"trace {args.trace}" if args.trace else f"workload {args.workload}, seed {args.seed}")
    print(f"wrote {out / 'bench.json'}" + ("" if args.no_plot else f" and {out / 'bench.png'}"))
