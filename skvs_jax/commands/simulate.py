"""`skvs simulate`: vllm_default vs naive_spec vs skvs on one trace, simulated for a large model on a GPU.

Each policy is one compiled simulation (`sweep.run`); its lanes are the seeds (and with `--sweep` the arrival
rates), all in one call. Every policy sees the same requests, the same arrival times and the same acceptance
draws (the acceptance table depends on the seed only), so differences between columns come from scheduling.
The model priced is `--model-shape NAME[:LAYERS]` (a shape of `skvs_jax.model_shapes`, as `skvs bench
--model-shape` serves it); `--model`, a checkpoint folder in the other commands, is refused with that advice.
Arrivals: Poisson at `--rate`, or Gamma gaps of shape `--burstiness` (`workloads.arrival_gaps`); `--trace FILE`
simulates a JSONL file's requests at its own arrival times instead (`workloads.read_requests`: only lengths and
arrivals matter here, prompt text counts one token per UTF-8 byte).

Output: the table of `skvs bench` (rows = the metrics of docs/design.md, columns = policies, ratios to the
baselines), in simulated time, averaged over seeds; with `--sweep`, a table per load of throughput, TPOT and mean
batch with each speculating policy's speedup over vllm_default, and where naive speculation stops paying. The
simulator knows each request's first and last token times, not those between, so TTFT, TPOT and end-to-end
latency are exact and ITL is not computed (null). A plot of metric vs load goes to `--out` beside the JSON.

simulate.json (SCHEMA_VERSION 2; 1 had unitless keys: "throughput", "tpot_p50" in s, a lane's "rate"): units in the
keys as bench.json's (`metrics.with_units`: `_ms`, `_s`, `_per_s`).
  config       every flag (vars of the parsed arguments) plus kv_blocks, max_blocks_per_seq, alphas, versions,
               host_blocks, kv_dtype_bytes, policy_fields.
  lanes        policy -> one dict per lane: the reported metrics, mean_batch, request_rate_per_s, seed, the draft
               and preemption counters, and per phase / acceptance class ("phase", "class") a list of the
               group's metrics (median_tpot_ms, p99_tpot_ms, ..., requests, drafts_per_step).
  by_rate      str(rate) -> policy -> the mean over its seeds.
  hindsight    "phase" / "class" -> str(rate) -> `group_report.hindsight`'s rows.

Breakdowns: a phased workload (`--phases`, `workloads.phased`) gets a table of TPOT P50/P99 per phase, and an
acceptance of several classes (`--acceptance A/B`: request i draws from class i mod classes) one per class.
`--oracle` adds the fixed draft lengths K = 0 (vllm_default) .. --draft-len (`naive_spec:K`) and reports, per phase
or class and per seed, the best of them in hindsight beside each adaptive policy (`group_report.hindsight`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from skvs_jax import metrics, policies, workloads
from skvs_jax import scheduler as sc
from skvs_jax.commands import group_report, policy_flags, startup, trace_flags
from skvs_jax.config import CacheConfig
from skvs_jax.sim import acceptance_model, cost_model, simulate, sweep
from skvs_jax.sim.specs import HOST_LINKS

SCHEMA_VERSION = 2
DEFAULT_SHAPE = "llama-3.1-8b"
# Reported keys (`metrics.with_units`) the tables and the hindsight oracle read.
THROUGHPUT, MEDIAN_TPOT, P99_TPOT = "output_tokens_per_s", "median_tpot_ms", "p99_tpot_ms"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-shape", metavar="NAME[:LAYERS]", default=DEFAULT_SHAPE,
                        help=f"the model priced, as `skvs bench --model-shape` serves it: a shape of "
                             f"skvs_jax.model_shapes ({', '.join(sorted(cost_model.MODELS))}; default "
                             f"{DEFAULT_SHAPE}), optionally its first LAYERS layers (bf16, 4 Medusa heads)")
    # --model is a checkpoint folder in `skvs bench` and `skvs generate`; here it only says where the shape went.
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="a100-80gb", choices=sorted(cost_model.DEVICES))
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (devices per replica)")
    parser.add_argument("--cost-mode", default="auto", choices=cost_model.COST_MODES,
                        help="how steps are priced (cost_model.COST_MODES): auto = measured kernels where profiled "
                             "(llama-3.1-8b on a100-80gb), else the roofline")
    parser.add_argument("--host-link", default=None, choices=sorted(HOST_LINKS),
                        help="the link swapped KV crosses to host memory, priced per swapped block (specs.HOST_LINKS: "
                             "effective bandwidths from the PCIe / GH200 specifications); default: the device's "
                             "(a100-80gb: pcie-gen4-x16, h100-sxm and h200: pcie-gen5-x16)")
    parser.add_argument("--workload", default=None, choices=sorted(workloads.GENERATORS),
                        help="default: sharegpt, or phased with --phases")
    parser.add_argument("--oracle", action="store_true",
                        help="also run every fixed draft length (vllm_default, naive_spec:1..K) and report the best "
                             "of them per phase or class in hindsight beside each other policy")
    parser.add_argument("--policies", "--policy", dest="policies", default="vllm_default,naive_spec,skvs",
                        help="comma-separated presets, each with optional overrides of its fields "
                             "(policies.parse_policy): skvs:preemption=swap,victim=most_progress; NAME:K (or "
                             "NAME:K=K) runs the preset with the draft-length knob at K (<= --draft-len: naive_spec:2 "
                             "is a fixed chain of 2), on the same acceptance draws; name=LABEL names the variant")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second (inf: all at t = 0)")
    trace_flags.add_arguments(parser, verb="simulate", rate_flag="--rate")
    parser.add_argument("--seeds", type=int, default=2, help="traces (seeds 0..N-1), one lane each")
    parser.add_argument("--scale", type=float, default=1.0, help="length scale of the workload (1: published means)")
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--acceptance", default="medusa-1",
                        help=f"chain acceptance model: a preset ({', '.join(sorted(acceptance_model.PRESETS))}) "
                             "or comma-separated conditional probabilities, one per draft position; several "
                             "separated by / are classes (request i draws from class i mod classes)")
    parser.add_argument("--verify-budget", default="none",
                        help="skvs's compute-aware drafting (Policy.verify_budget): none, knee (the cost model's "
                             "compute knee, tokens per step) or a number of tokens")
    parser.add_argument("--max-seqs", type=int, default=256, help="sequence slots = most running sequences")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="KV budget in blocks (default: what fits beside the weights in 90%% of device memory, "
                             "capped at what max-seqs sequences of the longest request can hold)")
    parser.add_argument("--token-budget", type=int, default=2048, help="most tokens computed per step")
    parser.add_argument("--prefill-chunk", type=int, default=512)
    policy_flags.add_arguments(parser)
    parser.add_argument("--host-blocks", type=int, default=None,
                        help="host-tier blocks for policies that preempt by swap (default: the KV budget's blocks; 0: "
                             "no host tier, so a swap policy recomputes)")
    parser.add_argument("--sweep", action="store_true", help="sweep arrival rates (--rates) in one call per policy")
    parser.add_argument("--rates", default="1,2,4,8,16,32,64", help="arrival rates of --sweep, requests/s")
    parser.add_argument("--chunk", type=int, default=512, help="simulated steps per compiled call")
    parser.add_argument("--strategy", default="map", choices=sweep.STRATEGIES,
                        help="how a device runs its lanes: one after another (map; fastest on a CPU) or vectorised "
                             "(vmap); with several devices visible the lanes are also split over them")
    parser.add_argument("--max-steps", type=int, default=200_000)
    parser.add_argument("--out", default="skvs-sim-results", help="output folder")
    parser.add_argument("--no-plot", action="store_true")
    startup.add_arguments(parser)


def acceptance(spec: str, k: int) -> np.ndarray:
    """float[K] the chain acceptance model `spec` names (a preset or comma-separated probabilities)."""
    values = spec if spec in acceptance_model.PRESETS else [float(x) for x in spec.split(",") if x.strip()]
    return acceptance_model.alphas(values, k)


def acceptance_classes(spec: str, k: int) -> np.ndarray:
    """float[classes, K] one chain acceptance model per /-separated part of `spec` (`acceptance`)."""
    return np.stack([acceptance(part, k) for part in spec.split("/")])


def workload_kwargs(args) -> dict:
    """The workload's arguments besides count, seed and rate."""
    kw = dict(max_prompt_len=args.max_prompt_len, max_output_len=args.max_output_len, scale=args.scale,
              burstiness=trace_flags.burstiness(args))
    return kw | (trace_flags.phases(args) if args.workload == "phased" else {})


def class_of(alphas: np.ndarray, requests: int) -> np.ndarray:
    """int[requests] each request id's acceptance class (id mod classes)."""
    return np.arange(requests) % np.asarray(alphas).reshape(-1, np.shape(alphas)[-1]).shape[0]


# Workloads whose later requests follow earlier ones by a think time: scaling arrival times would shrink the think
# times too, so `--sweep` generates their traces at each rate instead of scaling one.
_THINK_TIME_WORKLOADS = ("multi_turn",)


def geometry(args, cost: cost_model.CostModel, k: int) -> CacheConfig:
    s = args.block_size
    m = -(-(args.max_prompt_len + args.max_output_len + k + 1) // s)
    blocks = args.kv_blocks
    if blocks is None:
        try:
            blocks = min(cost.max_kv_tokens() // s, args.max_seqs * m)
        except ValueError as err:
            raise SystemExit(f"skvs simulate: --device {args.device}: {err}; pass --kv-blocks") from None
        if blocks < m:
            raise SystemExit(f"skvs simulate: {cost.model.name} on {args.tp} x {args.device} leaves room for {blocks} "
                             f"KV blocks, fewer than one request needs ({m})")
    if blocks < m:
        raise SystemExit(f"skvs simulate: --kv-blocks {blocks} holds fewer blocks than one request can need ({m} "
                         f"of {s} tokens for --max-prompt-len + --max-output-len + drafts)")
    return CacheConfig(num_blocks=blocks + 1, block_size=s, max_seqs=args.max_seqs, max_blocks_per_seq=m)


def _traces(args, cfg: sc.SchedulerConfig, alphas: np.ndarray, rates: list[float]) -> simulate.SimTrace:
    """One trace per (rate, seed), rate-major, stacked. alphas: float[K], or float[classes, K] (request i draws
    from class i mod classes)."""
    sims = []
    alphas = np.asarray(alphas)
    per_request = alphas if alphas.ndim == 1 else alphas[class_of(alphas, args.requests)]
    for rate in rates:
        kw = dict(rate=None if math.isinf(rate) else rate) | workload_kwargs(args)
        for seed in range(args.seeds):
            trace = (_file_trace(args) if getattr(args, "trace", None) is not None else
                     workloads.make(args.workload or "sharegpt", args.requests, seed=seed, **kw))
            # The acceptance draws depend on the seed (and K) only: every speculating policy meets the same ones.
            sims.append(simulate.make_trace(trace, cfg, alphas=per_request, seed=seed,
                                            vocab_size=model_spec(args).vocab_size,
                                            tpot_target=policy_flags.tpot_target(args)))
    return sweep.stack(sims)


def _breakdowns(args, alphas: np.ndarray, trace_rates: list[float]) -> dict[str, list[np.ndarray]]:
    """Per trace (rate-major, as `_traces`), each request id's phase and acceptance class, where there are several."""
    out = {}
    lanes = len(trace_rates) * args.seeds
    if args.workload == "phased":  # the split over phases depends on the counts only: one array for every trace
        phase = workloads.phase_of(workloads.make("phased", args.requests, seed=0, rate=None, **workload_kwargs(args)))
        out["phase"] = [phase] * lanes
    if np.asarray(alphas).ndim == 2 and np.asarray(alphas).shape[0] > 1:
        out["class"] = [class_of(alphas, args.requests)] * lanes
    return out


def _parse_rates(args) -> list[float]:
    if not args.sweep:
        rates = [args.rate]
    else:
        try:
            rates = [float(r) for r in args.rates.split(",")]
        except ValueError:
            raise SystemExit(f"skvs simulate: --rates must be comma-separated numbers, got {args.rates!r}") from None
    if any(not r > 0 for r in rates):  # also refuses NaN
        raise SystemExit(f"skvs simulate: --rate{'s' if args.sweep else ''} must be > 0, got {rates}")
    return rates


def _specs(args, verify_budget: int | None) -> dict[str, policies.PolicySpec]:
    """--policies as `policies.PolicySpec`s by name (presets with overrides, `policies.parse_policies`), with the
    global switches (--preemption, --victim, --no-prefix-cache) on every policy and --verify-budget on skvs.
    The KV dtype is the cost model's (--kv-precision, the same for every column): a policy's own kv_precision
    would price its steps with another cost model, so it is refused."""
    defaults = {k: v for k, v in policy_flags.defaults(args).items() if k != "kv_precision"}
    try:
        specs = policies.parse_policies(args.policies, args.draft_len, defaults,
                                        {"skvs": {"verify_budget": verify_budget}})
    except ValueError as err:
        raise SystemExit(f"skvs simulate: --policies: {err}") from None
    for spec in specs:
        if "kv_precision" in dict(spec.overrides):
            raise SystemExit(f"skvs simulate: --policies: {spec.policy.name}: kv_precision is not a per-policy switch "
                             "here (the cost model prices one KV dtype for every column): use --kv-precision")
    return {s.policy.name: s for s in specs}


# Bytes per cached K or V element of each KV dtype (int8's per-block scales are left out: < 1% at 16-token blocks).
KV_BYTES = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}


def model_spec(args) -> cost_model.ModelSpec:
    """--model-shape's spec (the registry's config, cut to its layers; bf16; the article's 4 Medusa heads;
    default DEFAULT_SHAPE)."""
    from skvs_jax import model_shapes

    shape = getattr(args, "model_shape", None) or DEFAULT_SHAPE
    try:
        name, layers = model_shapes.parse(shape)
    except ValueError as err:
        raise SystemExit(f"skvs simulate: --model-shape: {err}") from None
    if layers is None:
        return cost_model.MODELS[name]
    return cost_model.ModelSpec.from_hf_config(shape, model_shapes.hf_config(name, layers),
                                               {"medusa_num_heads": 4, "medusa_num_layers": 1})


def _cost(args) -> cost_model.CostModel:
    """The cost model; --kv-precision prices the KV cache in that dtype ("by_draft_len": bf16 for --draft-len >= 6,
    fp8 below) for every policy, and sizes the default KV budget with it."""
    model = model_spec(args)
    if args.kv_precision is not None:
        dtype = policies.resolve_kv_dtype(args.kv_precision, args.draft_len)
        model = dataclasses.replace(model, kv_dtype_bytes=KV_BYTES[dtype])
    return cost_model.CostModel(model, cost_model.DEVICES[args.device], tp=args.tp, mode=args.cost_mode,
                                host_link=args.host_link)


def _lanes(args, cfg, rates: list[float], draft_len: int | None = None):
    """(traces, lanes, where): where[i] = (rate, seed) of lane i. A sweep over a Poisson workload scales one
    trace per seed (the same requests at every rate); a think-time workload gets a trace per rate and seed."""
    per_rate = args.sweep and (args.workload or "sharegpt") in _THINK_TIME_WORKLOADS
    trace_rates = rates if per_rate else [args.rate]
    scales = [1.0] if per_rate or not args.sweep else [args.rate / r for r in rates]
    knobs = cfg.policy.knobs()
    if draft_len is not None:
        knobs = knobs.replace(draft_len=jnp.asarray(draft_len, jnp.int32))
    lanes, labels = sweep.grid(knobs, cfg=cfg, arrival_scale=scales,
                               traces=list(range(len(trace_rates) * args.seeds)))
    rate_of_scale = {} if per_rate else dict(zip(scales, rates, strict=True))
    where = []
    for lab in labels:
        t = lab["trace"]
        rate = trace_rates[t // args.seeds] if per_rate else rate_of_scale[lab["arrival_scale"]]
        where.append((rate, t % args.seeds))
    return trace_rates, lanes, where


def verify_budget_of(value: str, cost: cost_model.CostModel) -> int | None:
    """--verify-budget as a Policy.verify_budget: None, the cost model's knee (rounded down), or tokens."""
    try:
        return policies.parse_verify_budget(value, knee=cost.knee_tokens())
    except ValueError as err:
        raise SystemExit(f"skvs simulate: {err}") from None


def _with_units(lane: dict) -> dict:
    """A lane's summary (`sweep.summaries`) with the reported keys, its breakdowns' groups too."""
    return {k: [metrics.with_units(g) for g in v] if isinstance(v, list) else v
            for k, v in metrics.with_units(lane).items()}


def _mean(ms: list[dict]) -> dict[str, float]:
    keys = [k for k, v in ms[0].items() if not isinstance(v, list)]  # breakdowns (lists of groups) stay per lane
    return {k: float(np.nanmean([m[k] for m in ms])) if any(np.isfinite(m[k]) for m in ms) else math.nan
            for k in keys}


def _file_trace(args) -> workloads.Trace:
    """--trace's requests, read once per run (`workloads.read_requests`; its prompt_len lines drawn with seed 0):
    every lane simulates them, its seed choosing the acceptance draws only."""
    if getattr(args, "loaded_trace", None) is None:
        try:
            args.loaded_trace = workloads.read_requests(args.trace)
        except (ValueError, OSError) as err:
            raise SystemExit(f"skvs simulate: --trace: {err}") from None
    return args.loaded_trace


def _check_trace(args) -> None:
    """--trace FILE: it replaces the workload, --requests and the arrivals (--rate becomes its rate: its requests
    over its last arrival, inf when all arrive at t = 0), and its requests must fit the length caps."""
    for flag, given in (("--workload", args.workload is not None), ("--sweep", args.sweep)):
        if given:
            raise SystemExit(f"skvs simulate: --trace gives the requests and their arrival times: leave out {flag}")
    trace = _file_trace(args)
    for flag, longest, cap in (("--max-prompt-len", max(len(r.prompt) for r in trace.requests), args.max_prompt_len),
                               ("--max-output-len", max(r.max_new_tokens for r in trace.requests),
                                args.max_output_len)):
        if longest > cap:
            raise SystemExit(f"skvs simulate: --trace {args.trace} has a request of {longest} tokens, more than {flag} "
                             f"{cap}: raise {flag}")
    args.requests = len(trace.requests)
    last = max(r.arrival_time for r in trace.requests)
    args.rate = len(trace.requests) / last if last > 0 else math.inf


def run(args: argparse.Namespace) -> int:
    if args.model is not None:
        raise SystemExit(f"skvs simulate: --model is a checkpoint folder in skvs bench and skvs generate; the "
                         f"simulator prices a model shape: use --model-shape NAME[:LAYERS] "
                         f"({', '.join(sorted(cost_model.MODELS))}), got --model {args.model}")
    trace_flags.check(args, "skvs simulate")
    if args.trace is not None:
        _check_trace(args)
    if args.oracle:  # every fixed draft length beside the policies asked for, each on the same draws
        have = policies.split_policies(args.policies)
        extra = [n for n in ["vllm_default"] + [f"naive_spec:{k}" for k in range(1, args.draft_len + 1)]
                 if n not in have]
        args.policies = ",".join(have + extra)
    if not policies.split_policies(args.policies):
        raise SystemExit(f"skvs simulate: --policies names no policy; choose from {sorted(policies.PRESETS)}")
    if args.host_blocks is not None and args.host_blocks < 0:
        raise SystemExit(f"skvs simulate: --host-blocks must be >= 0, got {args.host_blocks}")
    for flag in ("requests", "seeds", "max_seqs", "block_size", "chunk", "max_steps", "draft_len", "token_budget",
                 "max_prompt_len", "max_output_len"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"skvs simulate: --{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.prefill_chunk < 0:
        raise SystemExit(f"skvs simulate: --prefill-chunk must be >= 0 (0: the token budget), got "
                         f"{args.prefill_chunk}")
    if not (math.isfinite(args.scale) and args.scale > 0):
        raise SystemExit(f"skvs simulate: --scale must be a finite number > 0, got {args.scale}")
    if not args.rate > 0:  # NaN fails this too
        raise SystemExit(f"skvs simulate: --rate must be > 0 (inf: every request at t = 0), got {args.rate}")
    if args.sweep and math.isinf(args.rate):
        raise SystemExit("skvs simulate: --sweep scales arrival times, so it needs a finite --rate")
    if args.workload == "phased":
        try:
            workloads.make("phased", args.requests, seed=0, rate=None, **workload_kwargs(args))
        except (TypeError, ValueError) as err:
            raise SystemExit(f"skvs simulate: {err}") from None
    system_len = workloads.system_prompts.__kwdefaults__["system_prompt_len"]
    if args.workload == "system_prompts" and args.max_prompt_len <= system_len:
        raise SystemExit(f"skvs simulate: --workload system_prompts shares {system_len}-token system prompts, so "
                         f"--max-prompt-len must be > {system_len}, got {args.max_prompt_len}")
    rates = _parse_rates(args)
    try:
        alphas = acceptance_classes(args.acceptance, args.draft_len)
        cost = _cost(args)
    except ValueError as err:
        raise SystemExit(f"skvs simulate: {err}") from None
    if alphas.shape[0] == 1:
        alphas = alphas[0]
    cache = geometry(args, cost, args.draft_len)
    verify_budget = verify_budget_of(args.verify_budget, cost)
    specs = _specs(args, verify_budget)
    names = list(specs)
    host_blocks = cache.usable_blocks if args.host_blocks is None else args.host_blocks
    out_dir = startup.output_dir(args.out, "simulate")

    # Several devices (GPUs, or CPU devices forced with XLA_FLAGS): the lanes are split over all of them.
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), (sweep.DP,)) if jax.device_count() > 1 else None
    t_start = time.perf_counter()
    per_policy: dict[str, list[dict]] = {}
    steps_run = 0
    for name in names:
        policy, knob_k = specs[name].policy, specs[name].draft_len_knob
        cfg = sc.SchedulerConfig(cache=cache, policy=policy, max_running=args.max_seqs, token_budget=args.token_budget,
                                 prefill_chunk=min(args.prefill_chunk, args.token_budget),
                                 swap_blocks=host_blocks if policy.preemption == "swap" else 0)
        trace_rates, lanes, where = _lanes(args, cfg, rates, knob_k)
        traces = _traces(args, cfg, alphas, trace_rates)
        breakdowns = _breakdowns(args, alphas, trace_rates)
        t0 = time.perf_counter()
        states, logs = sweep.run(traces, lanes, cfg=cfg, cost=cost, max_steps=args.max_steps, chunk=args.chunk,
                                 mesh=mesh, strategy=args.strategy)
        jax.block_until_ready(logs)
        elapsed = time.perf_counter() - t0
        done = sweep.finished(states)
        if np.any(done < args.requests):
            print(f"warning: {name}: {int(np.sum(done < args.requests))} of {len(done)} lanes did not finish in "
                  f"{args.max_steps} steps (raise --max-steps); their metrics cover what ran")
        ms = [_with_units(m) for m in sweep.summaries(logs, traces, lanes, cfg, breakdowns)]
        ct = states.counters  # attribution: what the drafts cost in memory, per lane
        for i, ((rate, seed), m) in enumerate(zip(where, ms, strict=True)):
            m["request_rate_per_s"], m["seed"] = rate, seed
            for key in ("draft_blocks", "oom_steps_drafts", "preempt_drafts", "oom_steps", "preempt_recompute",
                        "preempt_swap", "swap_ins", "first_prompt_tokens", "first_cached_tokens"):
                m[key] = float(np.asarray(getattr(ct, key))[i])
        per_policy[name] = ms
        steps = int(np.asarray(logs.active).sum())
        steps_run += steps
        print(f"  {name}: {len(ms)} lanes, {steps} simulated steps in {elapsed:.1f} s (compilation included)")

    by_rate = {r: {n: _mean([m for m in per_policy[n] if m["request_rate_per_s"] == r]) for n in names}
               for r in rates}
    spec = cost.model
    print(f"skvs simulate: {args.requests} requests ({args.workload or 'sharegpt'}, seeds 0..{args.seeds - 1}, "
          f"scale {args.scale}), "
          f"{spec.name} on {args.tp} x {args.device} (cost: {cost.label}; swaps over {cost.host_link}), "
          f"acceptance {args.acceptance} "
          f"(K={args.draft_len}, "
          f"{' / '.join(f'{acceptance_model.tokens_per_step(a):.2f}' for a in np.atleast_2d(alphas))} tokens per "
          f"full verification), KV budget "
          f"{cache.usable_blocks} blocks x {cache.block_size} tokens, {args.max_seqs} slots, token budget "
          f"{args.token_budget}, skvs verify budget {verify_budget or 'none'}; {steps_run} simulated steps in "
          f"{time.perf_counter() - t_start:.0f} s wall on "
          f"{jax.device_count()} {jax.devices()[0].platform} device(s)")
    print(policy_flags.describe(specs, host_blocks, kv=f"{cost.model.kv_dtype_bytes} bytes/element (cost model)"))
    if not args.sweep:
        # The simulator knows each request's first and last token times, not the ones between: no ITL (null in JSON).
        print(metrics.format_table({n: {k: v for k, v in m.items() if "_itl_" not in k}
                                    for n, m in by_rate[rates[0]].items()}))
        print("ITL: not simulated (the simulator records each request's first and last token times only; TTFT, TPOT "
              "and end-to-end latency are exact)")
    else:
        print(_sweep_table(by_rate, names))
        for line in _verdicts(by_rate, names):
            print(line)
    groups = {}
    for group in ("phase", "class"):
        if group in per_policy[names[0]][0]:
            for r in rates:
                lanes_at = {n: [m for m in per_policy[n] if m["request_rate_per_s"] == r] for n in names}
                labels = _group_labels(args, group, r, alphas)
                fixed = group_report.fixed_names(names, args.draft_len)
                print(group_report.group_table(lanes_at, names, group, labels, fixed))
                groups.setdefault(group, {})[str(r)] = group_report.hindsight(lanes_at, names, group, fixed)
    fixed = group_report.fixed_names(names, args.draft_len)
    for r in rates if fixed else []:
        for n in [n for n in names if n not in fixed.values()]:
            best = [max(per_policy[f][i][THROUGHPUT] for f in fixed.values())
                    for i, m in enumerate(per_policy[n]) if m["request_rate_per_s"] == r]
            mine = [m[THROUGHPUT] for m in per_policy[n] if m["request_rate_per_s"] == r]
            print(f"{n} throughput / the best fixed K's at {r:g} req/s, per seed: "
                  + ", ".join(f"{a / b:.3f}x" for a, b in zip(mine, best)))
    config = {k: v for k, v in vars(args).items() if k not in ("loaded_trace", "model")}
    doc = {"schema_version": SCHEMA_VERSION, "command": "skvs simulate", "config": config | {
        "kv_blocks": cache.usable_blocks, "max_blocks_per_seq": cache.max_blocks_per_seq,
        "alphas": alphas.tolist(), "versions": {"jax": jax.__version__}, "host_blocks": host_blocks,
        "kv_dtype_bytes": cost.model.kv_dtype_bytes,
        "policy_fields": {n: dataclasses.asdict(specs[n].policy) | {"draft_len_knob": specs[n].draft_len_knob}
                          for n in names}},
        "lanes": {n: per_policy[n] for n in names},
        "by_rate": {str(r): by_rate[r] for r in rates}, "hindsight": groups}
    # Strict JSON: an undefined metric (NaN, e.g. TPOT when no request made two tokens) is written as null.
    (out_dir / "simulate.json").write_text(json.dumps(metrics.json_safe(doc), indent=1, default=float, allow_nan=False))
    if not args.no_plot:
        _plot(by_rate, names, out_dir / "simulate.png")
    print(f"wrote {out_dir / 'simulate.json'}" + ("" if args.no_plot else f" and {out_dir / 'simulate.png'}"))
    return 0


def _speedup(by_rate, rate, name, key=MEDIAN_TPOT) -> float:
    """vllm_default's value over the policy's (latency: > 1 means the policy is faster)."""
    base, mine = by_rate[rate].get("vllm_default", {}).get(key, math.nan), by_rate[rate][name].get(key, math.nan)
    return base / mine if mine > 0 else math.nan


def _sweep_table(by_rate, names) -> str:
    head = ["rate (req/s)"] + [f"{n} {c}" for n in names for c in ("tok/s", "TPOT P50 ms", "batch")]
    spec_names = [n for n in names if n != "vllm_default" and "vllm_default" in names]
    head += [f"{n} TPOT speedup" for n in spec_names]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for r, res in by_rate.items():
        cells = [f"{r:g}"]
        for n in names:
            m = res[n]
            cells += [f"{m[THROUGHPUT]:.0f}", f"{m[MEDIAN_TPOT]:.1f}", f"{m['mean_batch']:.1f}"]
        cells += [f"{_speedup(by_rate, r, n):.2f}x" for n in spec_names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _verdicts(by_rate, names) -> list[str]:
    if "vllm_default" not in names:
        return []
    out = []
    for n in names:
        if n == "vllm_default":
            continue
        ups = {r: _speedup(by_rate, r, n) for r in by_rate}
        below = [r for r, u in ups.items() if u < 1.0]
        undefined = [r for r, u in ups.items() if math.isnan(u)]
        if undefined:  # no conclusion from a rate without a TPOT (e.g. no request made two tokens)
            out.append(f"{n}: TPOT speedup over vllm_default undefined at rate(s) "
                       f"{', '.join(f'{r:g}' for r in undefined)} req/s (no TPOT measured)")
        if below:
            r = min(below)
            out.append(f"{n}: TPOT speedup over vllm_default falls below 1.0x from rate {r:g} req/s "
                       f"(mean batch {by_rate[r][n]['mean_batch']:.1f}): speculation stops paying there")
        elif len(undefined) < len(ups):
            out.append(f"{n}: TPOT speedup over vllm_default >= 1.0x at every rate swept"
                       f"{' with a TPOT' if undefined else ''} (min {min(u for u in ups.values() if u == u):.2f}x)")
    return out


def _plot(by_rate, names, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(by_rate)
    panels = ((THROUGHPUT, "output throughput (tok/s)", 1.0), (MEDIAN_TPOT, "TPOT median (ms)", 1.0),
              ("median_e2e_ms", "end-to-end median (s)", 1e-3), ("mean_batch", "mean batch (sequences)", 1.0))
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, label, factor) in zip(axes.flat, panels, strict=True):
        for n in names:
            ax.plot(rates, [by_rate[r][n][key] * factor for r in rates], marker="o", label=n)
        ax.set_xscale("log")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(label)
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------ breakdowns and the hindsight oracle


def _group_labels(args, group: str, rate: float, alphas: np.ndarray) -> list[str]:
    if group == "class":
        return [f"class {c} ({acceptance_model.tokens_per_step(a):.2f} tok/verif.)" for c, a in enumerate(alphas)]
    phases = workloads.make("phased", args.requests, seed=0, rate=None, **workload_kwargs(args)).params["phases"]
    return [f"phase {p}: {n} @ {rate * m:g} req/s" for p, (n, m) in enumerate(phases)]
