"""`skvs simulate`: vllm_default vs naive_spec vs skvs on one trace, simulated for a large model on a GPU.

Each policy is one compiled simulation (`sweep.run`); its lanes are the seeds (and with `--sweep` the arrival
rates), all in one call. Every policy sees the same requests, the same arrival times and the same acceptance
draws (the acceptance table depends on the seed only), so differences between columns come from scheduling.

Output: the table of `skvs bench` (rows = the metrics of docs/design.md, columns = policies, ratios to the
baselines), in simulated time, averaged over seeds; with `--sweep`, a table per load of throughput, TPOT and mean
batch with each speculating policy's speedup over vllm_default, and where naive speculation stops paying. JSON
(every lane's metrics, the configuration) and a plot of metric vs load go to `--out`.
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
from skvs_jax.commands import policy_flags, startup
from skvs_jax.config import CacheConfig
from skvs_jax.sim import acceptance_model, cost_model, simulate, sweep
from skvs_jax.sim.specs import HOST_LINKS

SCHEMA_VERSION = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3.1-8b", choices=sorted(cost_model.MODELS))
    parser.add_argument("--device", default="a100-80gb", choices=sorted(cost_model.DEVICES))
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (devices per replica)")
    parser.add_argument("--cost-mode", default="auto", choices=cost_model.COST_MODES,
                        help="how steps are priced (cost_model.COST_MODES): auto = measured kernels where profiled "
                             "(llama-3.1-8b on a100-80gb), else the roofline")
    parser.add_argument("--host-link", default=None, choices=sorted(HOST_LINKS),
                        help="the link swapped KV crosses to host memory, priced per swapped block (specs.HOST_LINKS: "
                             "effective bandwidths from the PCIe / GH200 specifications); default: the device's "
                             "(a100-80gb: pcie-gen4-x16, h100-sxm and h200: pcie-gen5-x16)")
    parser.add_argument("--workload", default="sharegpt", choices=sorted(workloads.GENERATORS))
    parser.add_argument("--policies", default="vllm_default,naive_spec,skvs",
                        help="comma-separated presets, each with optional overrides of its fields "
                             "(policies.parse_policy): skvs:preemption=swap,victim=most_progress; NAME:K (or "
                             "NAME:K=K) runs the preset with the draft-length knob at K (<= --draft-len: naive_spec:2 "
                             "is a fixed chain of 2), on the same acceptance draws; name=LABEL names the variant")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second (inf: all at t = 0)")
    parser.add_argument("--seeds", type=int, default=2, help="traces (seeds 0..N-1), one lane each")
    parser.add_argument("--scale", type=float, default=1.0, help="length scale of the workload (1: published means)")
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--acceptance", default="medusa-1",
                        help=f"chain acceptance model: a preset ({', '.join(sorted(acceptance_model.PRESETS))}) "
                             "or comma-separated conditional probabilities, one per draft position")
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
    values = spec if spec in acceptance_model.PRESETS else [float(x) for x in spec.split(",") if x.strip()]
    return acceptance_model.alphas(values, k)


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
            raise SystemExit(f"skvs simulate: {args.model} on {args.tp} x {args.device} leaves room for {blocks} KV "
                             f"blocks, fewer than one request needs ({m})")
    if blocks < m:
        raise SystemExit(f"skvs simulate: --kv-blocks {blocks} holds fewer blocks than one request can need ({m} "
                         f"of {s} tokens for --max-prompt-len + --max-output-len + drafts)")
    return CacheConfig(num_blocks=blocks + 1, block_size=s, max_seqs=args.max_seqs, max_blocks_per_seq=m)


def _traces(args, cfg: sc.SchedulerConfig, alphas: np.ndarray, rates: list[float]) -> simulate.SimTrace:
    """One trace per (rate, seed), rate-major, stacked."""
    sims = []
    for rate in rates:
        kw = dict(rate=None if math.isinf(rate) else rate, max_prompt_len=args.max_prompt_len,
                  max_output_len=args.max_output_len, scale=args.scale)
        for seed in range(args.seeds):
            trace = workloads.make(args.workload, args.requests, seed=seed, **kw)
            # The acceptance draws depend on the seed (and K) only: every speculating policy meets the same ones.
            sims.append(simulate.make_trace(trace, cfg, alphas=alphas, seed=seed,
                                            vocab_size=cost_model.MODELS[args.model].vocab_size))
    return sweep.stack(sims)


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


def _cost(args) -> cost_model.CostModel:
    """The cost model; --kv-precision prices the KV cache in that dtype ("by_draft_len": bf16 for --draft-len >= 6,
    fp8 below) for every policy, and sizes the default KV budget with it."""
    model = cost_model.MODELS[args.model]
    if args.kv_precision is not None:
        dtype = policies.resolve_kv_dtype(args.kv_precision, args.draft_len)
        model = dataclasses.replace(model, kv_dtype_bytes=KV_BYTES[dtype])
    return cost_model.CostModel(model, cost_model.DEVICES[args.device], tp=args.tp, mode=args.cost_mode,
                                host_link=args.host_link)


def _lanes(args, cfg, rates: list[float], draft_len: int | None = None):
    """(traces, lanes, where): where[i] = (rate, seed) of lane i. A sweep over a Poisson workload scales one
    trace per seed (the same requests at every rate); a think-time workload gets a trace per rate and seed."""
    per_rate = args.sweep and args.workload in _THINK_TIME_WORKLOADS
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


def _mean(ms: list[dict]) -> dict[str, float]:
    keys = ms[0].keys()
    return {k: float(np.nanmean([m[k] for m in ms])) if any(np.isfinite(m[k]) for m in ms) else math.nan
            for k in keys}


def run(args: argparse.Namespace) -> int:
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
    system_len = workloads.system_prompts.__kwdefaults__["system_prompt_len"]
    if args.workload == "system_prompts" and args.max_prompt_len <= system_len:
        raise SystemExit(f"skvs simulate: --workload system_prompts shares {system_len}-token system prompts, so "
                         f"--max-prompt-len must be > {system_len}, got {args.max_prompt_len}")
    rates = _parse_rates(args)
    try:
        alphas = acceptance(args.acceptance, args.draft_len)
        cost = _cost(args)
    except ValueError as err:
        raise SystemExit(f"skvs simulate: {err}") from None
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
        t0 = time.perf_counter()
        states, logs = sweep.run(traces, lanes, cfg=cfg, cost=cost, max_steps=args.max_steps, chunk=args.chunk,
                                 mesh=mesh, strategy=args.strategy)
        jax.block_until_ready(logs)
        elapsed = time.perf_counter() - t0
        done = sweep.finished(states)
        if np.any(done < args.requests):
            print(f"warning: {name}: {int(np.sum(done < args.requests))} of {len(done)} lanes did not finish in "
                  f"{args.max_steps} steps (raise --max-steps); their metrics cover what ran")
        ms = sweep.summaries(logs, traces, lanes, cfg)
        ct = states.counters  # attribution: what the drafts cost in memory, per lane
        for i, ((rate, seed), m) in enumerate(zip(where, ms, strict=True)):
            m["rate"], m["seed"] = rate, seed
            for key in ("draft_blocks", "oom_steps_drafts", "preempt_drafts", "oom_steps", "preempt_recompute",
                        "preempt_swap", "swap_ins", "first_prompt_tokens", "first_cached_tokens"):
                m[key] = float(np.asarray(getattr(ct, key))[i])
        per_policy[name] = ms
        steps = int(np.asarray(logs.active).sum())
        steps_run += steps
        print(f"  {name}: {len(ms)} lanes, {steps} simulated steps in {elapsed:.1f} s (compilation included)")

    by_rate = {r: {n: _mean([m for m in per_policy[n] if m["rate"] == r]) for n in names} for r in rates}
    spec = cost.model
    print(f"skvs simulate: {args.requests} requests ({args.workload}, seeds 0..{args.seeds - 1}, scale {args.scale}), "
          f"{spec.name} on {args.tp} x {args.device} (cost: {cost.label}; swaps over {cost.host_link}), "
          f"acceptance {args.acceptance} "
          f"(K={args.draft_len}, "
          f"{acceptance_model.tokens_per_step(alphas):.2f} tokens per full verification), KV budget "
          f"{cache.usable_blocks} blocks x {cache.block_size} tokens, {args.max_seqs} slots, token budget "
          f"{args.token_budget}, skvs verify budget {verify_budget or 'none'}; {steps_run} simulated steps in "
          f"{time.perf_counter() - t_start:.0f} s wall on "
          f"{jax.device_count()} {jax.devices()[0].platform} device(s)")
    print(policy_flags.describe(specs, host_blocks, kv=f"{cost.model.kv_dtype_bytes} bytes/element (cost model)"))
    if not args.sweep:
        print(metrics.format_table(by_rate[rates[0]]))
    else:
        print(_sweep_table(by_rate, names))
        for line in _verdicts(by_rate, names):
            print(line)
    doc = {"schema_version": SCHEMA_VERSION, "command": "skvs simulate", "config": vars(args) | {
        "kv_blocks": cache.usable_blocks, "max_blocks_per_seq": cache.max_blocks_per_seq,
        "alphas": alphas.tolist(), "versions": {"jax": jax.__version__}, "host_blocks": host_blocks,
        "kv_dtype_bytes": cost.model.kv_dtype_bytes,
        "policy_fields": {n: dataclasses.asdict(specs[n].policy) | {"draft_len_knob": specs[n].draft_len_knob}
                          for n in names}},
        "lanes": {n: per_policy[n] for n in names},
        "by_rate": {str(r): by_rate[r] for r in rates}}
    # Strict JSON: an undefined metric (NaN, e.g. TPOT when no request made two tokens) is written as null.
    (out_dir / "simulate.json").write_text(json.dumps(metrics.json_safe(doc), indent=1, default=float, allow_nan=False))
    if not args.no_plot:
        _plot(by_rate, names, out_dir / "simulate.png")
    print(f"wrote {out_dir / 'simulate.json'}" + ("" if args.no_plot else f" and {out_dir / 'simulate.png'}"))
    return 0


def _speedup(by_rate, rate, name, key="tpot_p50") -> float:
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
            cells += [f"{m['throughput']:.0f}", f"{m['tpot_p50'] * 1e3:.1f}", f"{m['mean_batch']:.1f}"]
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
    panels = (("throughput", "throughput (tok/s)", 1.0), ("tpot_p50", "TPOT P50 (ms)", 1e3),
              ("e2e_p50", "end-to-end P50 (s)", 1.0), ("mean_batch", "mean batch (sequences)", 1.0))
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
