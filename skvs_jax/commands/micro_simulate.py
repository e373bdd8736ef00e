"""`skvs micro simulate`: how fast the simulator runs here, and what one-call sweeps buy over separate runs.

On one ShareGPT trace with 256 sequence slots (Llama-3.1-8B on an A100 as the cost model, skvs with K = 4 and
the medusa-1 acceptance model), every run cut at `--steps` simulated steps:

1. one simulation (compiled beforehand): simulated engine steps per second of wall time;
2. a sweep of P points (arrival rate x max_spec_ratio) as one compiled call (`sweep.run`), with the lanes
   vectorised (`strategy="vmap"`) or run one after another inside the call (`"map"`), and, when jax sees more
   than one device (e.g. `XLA_FLAGS=--xla_force_host_platform_device_count=2` on a CPU), both again split over a
   `dp` mesh of all devices; against the same P points run as P separate calls of the
   single-run program. Every variant's per-step output is checked equal to the separate runs'.

Last line: `sweep speedup vs sequential: <ratio>x`, for the fastest one-call variant (named on the line before).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from skvs_jax import policies, workloads
from skvs_jax import scheduler as sc
from skvs_jax.config import CacheConfig
from skvs_jax.sim import acceptance_model, cost_model, simulate, sweep


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-seqs", type=int, default=256, help="sequence slots")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--points", type=int, default=64, help="sweep points (a multiple of 8)")
    parser.add_argument("--steps", type=int, default=256, help="simulated steps per run")
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--rate", type=float, default=16.0)
    parser.add_argument("--skip-vmap", action="store_true", help="leave out the vectorised sweeps")
    parser.add_argument("--cost-mode", default="auto", choices=cost_model.COST_MODES,
                        help="how the cost model prices steps (as `skvs simulate --cost-mode`)")


def _setup(args):
    policy = policies.skvs(4)
    s = 16
    m = -(-(args.max_prompt_len + args.max_output_len + 5) // s)
    cache = CacheConfig(num_blocks=args.max_seqs * m + 1, block_size=s, max_seqs=args.max_seqs,
                        max_blocks_per_seq=m)
    cfg = sc.SchedulerConfig(cache=cache, policy=policy, max_running=args.max_seqs, token_budget=2048,
                             prefill_chunk=512)
    cost = cost_model.CostModel(cost_model.MODELS["llama-3.1-8b"], cost_model.DEVICES["a100-80gb"], mode=args.cost_mode)
    trace = workloads.make("sharegpt", args.requests, seed=0, rate=args.rate, scale=1.0,
                           max_prompt_len=args.max_prompt_len, max_output_len=args.max_output_len)
    sim_trace = simulate.make_trace(trace, cfg, alphas=acceptance_model.alphas("medusa-1", 4), seed=0)
    return policy, cfg, cost, sim_trace


def _timed(fn):
    out = fn()
    jax.block_until_ready(out)  # compile (and a first run)
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return out, time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    if args.points < 1 or args.points % 8:
        raise SystemExit("skvs micro simulate: --points must be a positive multiple of 8")
    for flag in ("max_seqs", "requests", "steps", "max_output_len", "max_prompt_len"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"skvs micro simulate: --{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.rate > 0:
        raise SystemExit(f"skvs micro simulate: --rate must be > 0, got {args.rate}")
    policy, cfg, cost, trace = _setup(args)
    knobs, steps = policy.knobs(), args.steps
    traces = sweep.stack([trace])
    rate_scales = np.geomspace(4.0, 0.5, args.points // 8)  # 1/4 .. 2x the base rate
    lanes, labels = sweep.grid(knobs, cfg=cfg, arrival_scale=rate_scales.tolist(),
                               max_spec_ratio=np.linspace(0.1, 1.0, 8).tolist())
    print(f"skvs micro simulate: {args.requests} ShareGPT requests at {args.rate:g}/s, {args.max_seqs} slots, "
          f"{cfg.cache.usable_blocks} KV blocks, skvs K=4 (medusa-1 acceptance), Llama-3.1-8B / A100 cost model "
          f"({cost.label}), "
          f"{steps} steps per run; jax {jax.__version__} on {jax.devices()[0].platform} "
          f"({jax.device_count()} device(s))", flush=True)

    # 1. One run: steps per second (a run cut at `steps` steps; idle steps after the trace ends are not counted).
    one = lambda kn, tr: simulate.simulate(tr, kn, cfg=cfg, cost=cost, max_steps=steps)  # noqa: E731
    (st, log), t_one = _timed(lambda: one(knobs, trace))
    n_one = int(np.asarray(log.active).sum())
    print(f"  one run: {n_one} simulated steps in {t_one:.3f} s = {n_one / t_one:,.0f} steps/s", flush=True)

    # 2. The P points one by one (the single-run program, compiled above).
    def sequential():
        out = []
        for i in range(len(labels)):
            ln = sweep.lane(lanes, i)
            out.append(one(ln.knobs, trace.replace(arrival=trace.arrival * ln.arrival_scale))[1])
        return out

    seq_logs, t_seq = _timed(sequential)
    lane_steps = sum(int(np.asarray(x.active).sum()) for x in seq_logs)
    print(f"  {len(labels)} points as {len(labels)} separate calls: {t_seq:.2f} s "
          f"({lane_steps / t_seq:,.0f} simulated steps/s over all points)", flush=True)
    expected = np.stack([np.asarray(x.output_tokens) for x in seq_logs])

    strategies = ["map"] + ([] if args.skip_vmap else ["vmap"])
    variants = [(s, None) for s in strategies]
    if jax.device_count() > 1:
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()), (sweep.DP,))
        variants += [(s, mesh) for s in strategies]
    best = None
    for strategy, mesh in variants:
        (_, logs), t = _timed(lambda s=strategy, m=mesh: sweep.run(traces, lanes, cfg=cfg, cost=cost, max_steps=steps,
                                                                   mesh=m, strategy=s))
        same = np.array_equal(np.asarray(logs.output_tokens), expected)
        where = f"split over {jax.device_count()} devices" if mesh is not None else "one device"
        name = f"strategy {strategy!r}, {where}"
        print(f"  {len(labels)}-point sweep in one call, {name}: {t:.2f} s ({lane_steps / t:,.0f} simulated "
              f"steps/s), {t_seq / t:.2f}x the separate calls; per-step output identical: {same}", flush=True)
        if same and (best is None or t < best[1]):  # a variant that computes something else is no speedup
            best = (name, t)
    if best is None:
        print("no one-call variant reproduced the separate runs")
        return 1
    print(f"fastest one-call sweep: {best[0]}")
    print(f"sweep speedup vs sequential: {t_seq / best[1]:.2f}x")
    return 0
