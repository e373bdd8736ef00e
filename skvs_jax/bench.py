"""`skvs bench`: vllm_default, naive_spec and skvs on the same trace, the shipped tiny model, one process.

Every policy serves the same seeded trace (default: shared system prompts with Zipf popularity and ShareGPT-like
user parts, all arriving at t = 0) with the same KV budget, chosen small enough that memory pressure occurs. The
table has the article's shape (rows = metrics, columns = policies) plus skvs/naive_spec and skvs/vllm_default
ratios measured in this run. It writes `bench.json` (every metric, the config, versions, the trace seed) and
`bench.png` (throughput and memory over time per policy) to the output folder.

Timings are wall clock on this machine, compile time excluded: each policy first serves a short warm-up trace
that compiles both of its query buckets. Greedy outputs must be identical across policies (checked). With
`--rate`, arrivals follow the wall clock, so which requests share a step — and the non-timing metrics — depend
on timing; with the default (all at t = 0) everything but the timings is reproducible from the seed.
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
from skvs_jax import engine as eng
from skvs_jax import metrics, policies, workloads
from skvs_jax.config import CacheConfig

SCHEMA_VERSION = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="system_prompts", choices=sorted(workloads.GENERATORS))
    parser.add_argument("--requests", type=int, default=32, help="requests in the trace")
    parser.add_argument("--policies", default="vllm_default,naive_spec,skvs", help="comma-separated presets")
    parser.add_argument("--kv-blocks", type=int, default=65, help="KV budget in blocks (incl. the null block)")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--max-seqs", type=int, default=8, help="sequence slots = max batch size")
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--token-budget", type=int, default=128)
    parser.add_argument("--prefill-chunk", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=32, help="cap on output tokens per request")
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default: all at 0)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--impl", default="xla", choices=("xla", "pallas", "reference"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="skvs-results", help="output folder")
    parser.add_argument("--no-plot", action="store_true", help="skip bench.png")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def load_shipped():
    from reference_models import checkpoint, train

    return (checkpoint.load_llama(train.WEIGHTS_DIR / "tiny_llama"),
            checkpoint.load_medusa(train.WEIGHTS_DIR / "tiny_llama_medusa"))


def make_trace(args) -> workloads.Trace:
    kw = dict(rate=args.rate, max_output_len=args.max_output, max_prompt_len=96)
    if args.workload == "system_prompts":
        kw |= dict(system_prompt_len=48)
    return workloads.make(args.workload, args.requests, seed=args.seed, **kw)


def serve(model, heads, policy, cache, trace, args, progress=None) -> dict:
    """Run one policy over the trace; returns its metrics, outputs and per-step series."""
    kwargs = dict(token_budget=args.token_budget, prefill_chunk=args.prefill_chunk, impl=args.impl, seed=args.seed)
    # Warm-up: compile both query buckets on a throwaway engine with the same static configuration.
    warm = eng.Engine(model, heads, policy, cache, **kwargs)
    for r in trace.requests[:2]:
        warm.add_request(r.prompt, eng.SamplingParams(max_tokens=2))
    warm.run()
    e = eng.Engine(model, heads, policy, cache, **kwargs)
    pending = sorted(trace.requests, key=lambda r: r.arrival_time)
    sched_snapshot = None
    while pending or e.has_work():
        now = e.now()
        while pending and (args.rate is None or pending[0].arrival_time <= now):
            r = pending.pop(0)
            e.add_request(r.prompt, eng.SamplingParams(max_tokens=r.max_new_tokens, temperature=args.temperature),
                          arrival_time=r.arrival_time if args.rate is not None else 0.0, request_id=r.request_id)
        if not e.has_work():
            time.sleep(max(0.0, pending[0].arrival_time - e.now()))
            continue
        new = e.step()
        if len(e.step_log) == 4:
            sched_snapshot = jax.tree.map(lambda x: x.copy(), e.state.sched)
        if progress is not None:
            progress(sum(len(t) for _, t, _ in new))
    sched_time = _scheduler_time(e, sched_snapshot)

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
    ) for r in e.requests.values()]
    result = metrics.summarize(records, log.freeze())
    series = {"time": [s["start"] + s["duration"] for s in e.step_log],
              "output_tokens": [s["output_tokens"] for s in e.step_log],
              "blocks_used": [s["blocks_used"] for s in e.step_log],
              "spec_blocks": [s["spec_blocks"] for s in e.step_log]}
    outputs = {rid: list(r.tokens) for rid, r in e.requests.items()}
    counters = {k: int(v) for k, v in dataclasses.asdict(e.state.sched.counters).items()}
    return {"metrics": result, "outputs": outputs, "series": series, "counters": counters,
            "compiled": sorted(e.compiled | warm.compiled)}


def _scheduler_time(e: eng.Engine, snapshot) -> float:
    """Median wall time of the jitted `schedule` alone on a snapshot of the run's state (the fused step cannot
    be split by a clock); 0 when the run was too short to snapshot."""
    if snapshot is None:
        return 0.0
    from skvs_jax import scheduler as sc

    fn = jax.jit(lambda st, k: sc._schedule(st, k, cfg=e.cfg.sched))
    jax.block_until_ready(fn(snapshot, e.knobs))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(snapshot, e.knobs))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    for n in names:
        if n not in policies.PRESETS:
            raise SystemExit(f"skvs bench: unknown policy {n!r}; choose from {sorted(policies.PRESETS)}")
    model, heads = load_shipped()
    trace = make_trace(args)
    max_len = min(1024, -(-(96 + args.max_output) // args.block_size) * args.block_size)
    cache = CacheConfig(num_blocks=args.kv_blocks, block_size=args.block_size, max_seqs=args.max_seqs,
                        max_blocks_per_seq=max_len // args.block_size)
    total_tokens = sum(r.max_new_tokens for r in trace.requests) * len(names)
    bar = None
    if not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=total_tokens, unit="tok", desc="skvs bench")
    results = {}
    t_start = time.perf_counter()
    for name in names:
        policy = policies.preset(name, args.draft_len)
        if bar is not None:
            bar.set_postfix_str(name)
        results[name] = serve(model, heads, policy, cache, trace, args, progress=bar.update if bar else None)
    if bar is not None:
        bar.close()

    same = None
    if args.temperature == 0 and len(names) > 1:
        first = results[names[0]]["outputs"]
        same = all(results[n]["outputs"] == first for n in names[1:])
    table = metrics.format_table({n: results[n]["metrics"] for n in names})
    print(f"skvs bench: {len(trace.requests)} requests ({trace.kind}, seed {trace.seed}), shipped tiny Llama + "
          f"Medusa (K={args.draft_len}), KV budget {cache.usable_blocks} blocks x {cache.block_size} tokens, "
          f"{cache.max_seqs} slots, token budget {args.token_budget}, impl {args.impl}, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}; wall time {time.perf_counter() - t_start:.0f} s")
    print(table)
    if same is not None:
        print(f"greedy outputs identical across policies: {same}")

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema_version": SCHEMA_VERSION,
        "command": "skvs bench",
        "config": {k: getattr(args, k) for k in ("workload", "requests", "policies", "kv_blocks", "block_size",
                                                 "max_seqs", "draft_len", "token_budget", "prefill_chunk",
                                                 "max_output", "rate", "temperature", "impl", "seed")},
        "trace": {"kind": trace.kind, "seed": trace.seed, "params": trace.params, "requests": len(trace.requests)},
        "versions": {"skvs_jax": skvs_jax.__version__, "jax": jax.__version__, "python": platform.python_version(),
                     "platform": jax.devices()[0].platform, "machine": platform.machine()},
        "identical_greedy_outputs": same,
        "policies": {n: {"metrics": results[n]["metrics"], "counters": results[n]["counters"],
                         "compiled_buckets": results[n]["compiled"], "series": results[n]["series"]}
                     for n in names},
    }
    (out / "bench.json").write_text(json.dumps(_finite(doc), indent=1, allow_nan=False) + "\n")
    if not args.no_plot:
        _plot(results, out / "bench.png", cache.usable_blocks)
    print(f"wrote {out / 'bench.json'}" + ("" if args.no_plot else f" and {out / 'bench.png'}"))
    return 0 if same in (None, True) else 1


def _finite(x):
    """JSON has no NaN: undefined metrics (e.g. waste without drafts) become null."""
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x
