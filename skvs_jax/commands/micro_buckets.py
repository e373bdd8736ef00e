"""`skvs micro buckets`: padding with the draft widths chosen from the histogram vs the fixed {0, K/2, K}.

Padding = draft slots a decode-only step verifies without a draft: rows * (width - 1) - drafts (`scheduler.buckets`).

1. Engine, fixed widths: `skvs bench`'s trace (same flags and defaults) served by the shipped tiny model with the
   policy's {0, K/2, K}; the engine logs each decode step's width, bound, rows and drafts, and per row the drafts
   and accepted drafts. From the log: the bucket histogram H, the widths `choose_widths(H, --budget, K)`, and the
   padding those widths would give (exact when the widths do not change the schedule: the goodput controller
   ignores them), and, for the other rounding, cutting every row down to the largest chosen width <= its
   drafts: the padding it leaves and the accepted drafts it would lose (first order: same schedule).
2. Engine, chosen widths: a fresh engine with `bucket_budget=--budget` warmed up with H (so it compiles the chosen
   widths only) serves the same trace; measured padding, programs compiled, re-choices, and whether its greedy
   outputs equal run 1's.
3. Simulator: `skvs simulate`'s cost model (Llama-3.1-8B, A100, medusa-1 acceptance) on a ShareGPT trace, for
   skvs, skvs with the verify budget at the device's compute knee (drafts shrink as the batch grows, so the bounds
   vary) and skvs_article: padding with {0, K/2, K} and with the widths chosen from the run's histogram; for
   skvs_article (whose histogram rule drafts from the widths) the chosen widths are simulated again.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from reference_models.checkpoint import load_shipped
from skvs_jax import policies, workloads
from skvs_jax import scheduler as sc
from skvs_jax.commands import bench, bench_serving
from skvs_jax.commands import simulate as sim_command
from skvs_jax.config import CacheConfig
from skvs_jax.scheduler import buckets
from skvs_jax.serve import engine as eng
from skvs_jax.sim import cost_model
from skvs_jax.sim import simulate as sim


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bench.add_arguments(parser)
    parser.set_defaults(policies="skvs")
    parser.add_argument("--budget", type=int, default=3, help="draft widths to choose (the fixed set has 3)")
    parser.add_argument("--sim-requests", type=int, default=128, help="requests of the simulated trace")
    parser.add_argument("--sim-rate", type=float, default=8.0, help="their Poisson arrival rate, requests/s")
    parser.add_argument("--sim-max-seqs", type=int, default=64, help="sequence slots of the simulated engine")


class _Recorder(eng.Engine):
    """The engine, keeping each decode-only step's per-row drafts, accepted drafts and scheduled flags."""

    def _account_padding(self, out, width, bound):
        if bound is not None:
            self.per_row.append((np.asarray(out.num_drafts), np.asarray(out.accepted), np.asarray(out.scheduled)))
        super()._account_padding(out, width, bound)


def _serve(policy, cache, trace, args, draft_hist=None):
    e = _Recorder(*load_shipped(), policy, cache, **bench_serving.engine_kwargs(policy, args))
    e.per_row = []
    before = eng.engine_step.fused_step._cache_size()
    e.warmup(draft_hist)
    for r in trace.requests:
        e.add_request(r.prompt, eng.SamplingParams(max_tokens=r.max_new_tokens), arrival_time=0.0,
                      request_id=r.request_id)
    e.run()
    return e, e.per_row, eng.engine_step.fused_step._cache_size() - before


def _engine_part(args, k: int) -> dict:
    chosen_policies, _, _, _, trace, cache = bench.setup(args)
    if len(chosen_policies) != 1:
        raise SystemExit(f"skvs micro buckets: --policies must name one policy, got {args.policies!r}")
    (name, policy), = chosen_policies.items()
    fixed = policy.replace(bucket_budget=0)
    try:
        policy = policy.replace(bucket_budget=args.budget)
    except ValueError as err:
        raise SystemExit(f"skvs micro buckets: --budget {args.budget}: {err}") from None
    t0 = time.perf_counter()
    e, per_row, compiled = _serve(fixed, cache, trace, args)
    steps = [s for s in e.step_log if s["bound"] >= 0]
    hist = buckets.as_hist({}, k)
    for s in steps:
        hist[s["bound"]] += s["num_seqs"]
    fixed_widths = fixed.draft_buckets or (k,)
    chosen = buckets.choose_widths(hist, args.budget, k) if any(hist) else fixed_widths
    drafted = sum(s["drafted"] for s in steps)
    predicted = buckets.cost(hist, chosen) - drafted
    floor = buckets.cost(hist, range(k + 1)) - drafted
    # The other rounding: every row cut down to the largest chosen width <= its drafts, the step run at the largest
    # chosen width <= its bound.
    lost, cut_padding = 0, 0
    down = np.asarray(sorted(chosen))
    for s, (nd, acc, on) in zip(steps, per_row, strict=True):
        cut = np.asarray([down[down <= d].max(initial=0) for d in nd[on]])
        lost += int(np.sum(acc[on] - np.minimum(acc[on], cut)))
        width = down[down <= s["bound"]].max(initial=0)
        cut_padding += int(on.sum()) * int(width) - int(cut.sum())
    accepted = int(sum(int(np.sum(a[o])) for _, a, o in per_row))
    e2, _, compiled2 = _serve(policy, cache, trace, args,
                              draft_hist={d: w for d, w in enumerate(hist) if w})
    same = {r: x.tokens for r, x in e.requests.items()} == {r: x.tokens for r, x in e2.requests.items()}
    print(f"engine ({name}, K={k}, {len(trace.requests)} requests of skvs bench's trace, {len(e.step_log)} steps, "
          f"{len(steps)} decode-only, {time.perf_counter() - t0:.0f} s):")
    print(f"  bucket histogram (decode rows by step bound 0..K): {hist}")
    print(f"  fixed widths {tuple(fixed_widths)}: padding {e.picker.padding} slots ({compiled} programs compiled)")
    print(f"  chosen widths {chosen}: predicted padding {predicted}; served: padding {e2.picker.padding}, widths "
          f"{tuple(w - 1 for w in e2.picker.decode_widths)}, {compiled2} programs compiled, "
          f"{e2.picker.chooser.rechoices} re-choices, greedy outputs identical: {same}")
    print(f"  ratio chosen / fixed padding: {e2.picker.padding / max(e.picker.padding, 1):.2f} "
          f"(every width 0..K: {floor})")
    print(f"  cut down instead of rounding up: padding {cut_padding}, accepted drafts lost {lost} of {accepted}")
    return dict(hist=hist, fixed=e.picker.padding, chosen=chosen, served=e2.picker.padding, predicted=predicted,
                same=same)


def _sim_part(args, k: int) -> None:
    ns = argparse.Namespace(max_prompt_len=512, max_output_len=512, block_size=16, kv_blocks=None,
                            max_seqs=args.sim_max_seqs, model="llama-3.1-8b", device="a100-80gb", tp=1)
    cost = cost_model.CostModel(cost_model.MODELS[ns.model], cost_model.DEVICES[ns.device])
    cache: CacheConfig = sim_command.geometry(ns, cost, k)
    alphas = sim_command.acceptance("medusa-1", k)
    trace = workloads.make("sharegpt", args.sim_requests, seed=args.seed, rate=args.sim_rate, max_prompt_len=512,
                           max_output_len=512)
    print(f"simulator (llama-3.1-8b on a100-80gb, medusa-1, ShareGPT {args.sim_requests} requests at "
          f"{args.sim_rate}/s, {cache.max_seqs} slots):")
    knee = sim_command.verify_budget_of("knee", cost)
    variants = {"skvs": policies.skvs(k), f"skvs verify_budget={knee} (the knee)": policies.skvs(k).replace(
        verify_budget=knee), "skvs_article": policies.skvs_article(k)}
    for name, policy in variants.items():
        cfg = sc.SchedulerConfig(cache=cache, policy=policy, max_running=cache.max_seqs, token_budget=2048,
                                 prefill_chunk=512)
        st_trace = sim.make_trace(trace, cfg, alphas=alphas, seed=args.seed,
                                  vocab_size=cost_model.MODELS[ns.model].vocab_size)
        t0 = time.perf_counter()
        _, log = sim.simulate(st_trace, policy.knobs(), cfg=cfg, cost=cost, max_steps=20_000)
        hist = sim.bucket_hist(log, k)
        chosen = buckets.choose_widths(hist, len(policy.draft_buckets), k) if any(hist) else policy.draft_buckets
        fixed = sim.padding(log, policy.draft_buckets)
        line = (f"  {name}: {int(np.sum(log.active))} steps, {int(np.sum(log.active & log.decode_step))} decode-only; "
                f"histogram {hist}; padding with {policy.draft_buckets}: {fixed}; with {chosen}: "
                f"{sim.padding(log, chosen)}")
        if not policy.goodput_control:  # the histogram rule drafts from the widths: simulate them
            _, log2 = sim.simulate(st_trace, policy.knobs(), cfg=cfg, cost=cost, max_steps=20_000,
                                   draft_widths=buckets.padded(chosen, policy.width_slots))
            line += (f" (simulated with them: {sim.padding(log2, chosen)}, {int(np.sum(log2.active))} steps, "
                     f"accepted {int(np.sum(log2.accepted))} vs {int(np.sum(log.accepted))})")
        print(line + f" [{time.perf_counter() - t0:.0f} s]")


def run(args: argparse.Namespace) -> int:
    k = args.draft_len
    print(f"skvs micro buckets: jax {jax.__version__} on {jax.devices()[0].platform}")
    _engine_part(args, k)
    _sim_part(args, k)
    return 0
