"""Calibrate the `cpu-measured` device on the real engine, then check the simulator's fidelity against it.

    python -m skvs_jax.sim.calibrate [--policies vllm_default,naive_spec,skvs] [--requests 10] [--repeats 3]

1. Serves one trace with the shipped tiny model under each policy, `--repeats` times round-robin (each engine
   warmed up first, so no step includes a compilation), and logs every step's shape and wall time.
2. Fits one device to the steps of all runs together (`cost_model.fit_cpu_device`): a per-step overhead, a
   per-FLOP and a per-byte cost. Printed as the `DeviceSpec` literal that `cost_model.DEVICES["cpu-measured"]`
   holds (paste it there to re-calibrate).
3. Replays each run in the simulator (the engine's outputs as the token table, `replay_acceptance` for the
   accepted runs) with the fitted device, and prints, per policy: whether every scheduler counter and the
   per-step block / draft / token series are equal, and the P50 end-to-end latency, engine (median over the
   repeats, since a shared machine's wall clock is noisy: docs/simulator.md shows the spread) vs simulator.

The step time fitted is the start-to-start interval of consecutive steps (what a request waits), so host-side
work between steps is included.
"""

from __future__ import annotations

import argparse
import math

import jax
import numpy as np

from reference_models.checkpoint import load_shipped
from skvs_jax import policies, workloads
from skvs_jax.config import CacheConfig
from skvs_jax.serve import engine
from skvs_jax.serve.model_runner import LlamaMedusaRunner
from skvs_jax.sim import cost_model as cm
from skvs_jax.sim import simulate as sim

# Tight enough that recompute preemptions and prefix hits happen (as in tests/test_engine.py).
CACHE = CacheConfig(num_blocks=48, block_size=8, max_seqs=8, max_blocks_per_seq=16)


def serve(model, heads, policy: policies.Policy, trace: workloads.Trace) -> engine.Engine:
    e = engine.Engine(model, heads, policy, CACHE, token_budget=96, prefill_chunk=32)
    e.warmup()
    for r in trace.requests:
        e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens), request_id=r.request_id,
                      arrival_time=0.0)
    e.run()
    return e


def samples(e: engine.Engine, padded: bool = False) -> list[cm.StepSample]:
    """Every step of `e` as a `cost_model.StepSample`: its shape and its start-to-start time. padded: with the query
    slots and logit rows the engine computed (to fit a device the simulator prices with `simulate.EngineLayout`)."""
    log = e.step_log
    gaps = [b["start"] - a["start"] for a, b in zip(log, log[1:])] + [log[-1]["duration"]]
    return [cm.StepSample(s["prefill_tokens"], s["decode_tokens"], s["kv_tokens_read"], g, s["num_seqs"],
                          s["drafting_rows"], s["query_slots"] if padded else 0, s["logit_rows"] if padded else 0)
            for s, g in zip(log, gaps)]


def replay(e: engine.Engine, trace: workloads.Trace, device: cm.DeviceSpec, runner, params) -> dict:
    """Simulate the engine's run; compare schedules and latency."""
    outputs = {i: e.requests[i].tokens for i in e.requests}
    cfg = e.cfg.sched
    runs = None
    if cfg.policy.speculation:
        seqs = {r.request_id: list(r.prompt) + outputs[r.request_id] for r in trace.requests}
        runs = sim.replay_acceptance(runner, params, seqs, cfg.policy.draft_len)
    st_trace = sim.make_trace(trace, cfg, outputs=outputs, accept_runs=runs)
    st, log = sim.simulate(st_trace, e.knobs, cfg=cfg, cost=cm.CostModel(cm.MODELS["tiny"], device),
                           max_steps=4 * len(e.step_log) + 16)
    ce, cs = jax.device_get((e.state.sched.counters, st.counters))
    differ = {f: (int(getattr(ce, f)), int(getattr(cs, f))) for f in ce.__dataclass_fields__
              if int(getattr(ce, f)) != int(getattr(cs, f))}
    act = np.asarray(log.active)
    series = {k: (np.asarray(getattr(log, k))[act].tolist(), [s[key] for s in e.step_log])
              for k, key in (("blocks_used", "blocks_used"), ("spec_blocks", "spec_blocks"))}
    e2e_engine = float(np.median([r.finish_time - r.arrival_time for r in e.requests.values()]))
    e2e_sim = sim.summarize(log, st_trace, cfg)["e2e_p50"]
    return {"steps": (len(e.step_log), int(act.sum())), "counters_differ": differ,
            "series_equal": all(a == b for a, b in series.values()), "e2e_p50": (e2e_engine, e2e_sim)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m skvs_jax.sim.calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--policies", default="vllm_default,naive_spec,skvs")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3,
                        help="serve each policy this many times (round-robin); the engine's latency is the median "
                             "over repeats, and the fit uses every run's steps")
    args = parser.parse_args(argv)
    for flag, low in (("repeats", 1), ("requests", 1), ("seed", 0)):
        if getattr(args, flag) < low:
            raise SystemExit(f"skvs_jax.sim.calibrate: --{flag} must be >= {low}, got {getattr(args, flag)}")
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in policies.PRESETS]
    if not names or unknown:
        raise SystemExit(f"skvs_jax.sim.calibrate: --policies must name presets from {sorted(policies.PRESETS)}, "
                         f"got {args.policies!r}")
    model, heads = load_shipped()
    runner, params = LlamaMedusaRunner.create(model, heads)
    trace = workloads.make("system_prompts", args.requests, seed=args.seed, system_prompt_len=40, max_prompt_len=80,
                           max_output_len=20)
    runs = {n: [] for n in names}
    for _ in range(args.repeats):  # round-robin, so a slow spell of the machine touches every policy
        for n in names:
            runs[n].append(serve(model, heads, policies.preset(n), trace))
    try:
        device = cm.fit_cpu_device([s for es in runs.values() for e in es for s in samples(e)])
    except ValueError as err:  # e.g. too few steps to fit three constants
        raise SystemExit(f"skvs_jax.sim.calibrate: {err}; serve more --requests") from None
    print(f"fitted on {sum(len(e.step_log) for es in runs.values() for e in es)} steps of {', '.join(names)}, "
          f"{args.repeats} run(s) each (jax {jax.__version__}, {jax.devices()[0].platform}):")
    rate = lambda x: "math.inf" if math.isinf(x) else f"{x:.4g}"  # noqa: E731  (a literal that pastes)
    print(f'    "cpu-measured": DeviceSpec("cpu-measured", peak_flops_per_s={rate(device.peak_flops_per_s)}, '
          f'hbm_bytes_per_s={rate(device.hbm_bytes_per_s)}, hbm_capacity_bytes=math.inf, compute_efficiency=1.0, '
          f'bandwidth_efficiency=1.0, link_bytes_per_s=math.inf, allreduce_latency_s=0.0, '
          f'host_overhead_s={device.host_overhead_s:.4g}, compute_memory_overlap=0.0, fitted=True, '
          f'host_link="unpriced"),')
    for name, es in runs.items():
        p50s = [float(np.median([r.finish_time - r.arrival_time for r in e.requests.values()])) for e in es]
        eng = float(np.median(p50s))
        spread = f" (runs {min(p50s) * 1e3:.0f}-{max(p50s) * 1e3:.0f} ms)" if len(es) > 1 else ""
        preset = cm.DEVICES.get("cpu-measured")
        for dev_name, dev in (("fitted now", device), ("preset", preset)) if preset else (("fitted now", device),):
            r = replay(es[0], trace, dev, runner, params)  # greedy: every repeat has the same outputs and schedule
            simulated = r["e2e_p50"][1]
            print(f"{name} ({dev_name}): steps engine/sim {r['steps']}, counters differ: "
                  f"{r['counters_differ'] or 'none'}, series equal: {r['series_equal']}, e2e P50 engine "
                  f"{eng * 1e3:.0f} ms{spread} vs sim {simulated * 1e3:.0f} ms ({(simulated - eng) / eng:+.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
