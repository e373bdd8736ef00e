"""The simulator against the real engine, at a real model's shape this CPU can serve.

    python -m skvs_jax.sim.fidelity [--model-shape llama-3.2-1b:2] [--profile medusa-1] [--requests 16]
                                    [--fit-seed 1] [--check-seed 2] [--policies vllm_default,naive_spec,skvs]

1. Builds the shape with random float32 weights (`skvs_jax.model_shapes`) and, for a fit trace and a check trace
   (two seeds of the same workload), serves each policy with the oracle drafter at the acceptance profile
   (`serve.oracle_drafter`; its reference pass first), each engine warmed up so no step includes a compilation.
2. Refits the `cpu-measured` device for this shape: `cost_model.fit_cpu_device` over every step of the fit
   trace's runs, with the shape's `ModelSpec` (no Medusa heads: the oracle costs nothing to run), twice: to the
   query slots the engine computed (its padding included: `simulate.EngineLayout`) and to the tokens alone.
3. Simulates each check-trace run: the same trace, KV budget, options and policy, the engine's own step cost as
   the draft controller's (so the simulated controller decides as the engine's did), the acceptance replayed
   from the oracle's hash (`oracle_drafter.accept_runs`: the decisions the engine met), priced by the padded
   refit with the engine's layout ("refit"), by the tokens-only refit ("tokens") and by the preset
   `cpu-measured` (fitted on the shipped tiny model, tokens only). Prints simulated / real of throughput, TPOT
   P50, engine steps, preemptions and hit rate.

Where the schedules are the same (equal steps and counters) the throughput and TPOT ratios measure the cost model
alone; the fit trace and the check trace differ, so the refit is judged out of sample.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reference_models.llama import Llama, LlamaConfig
from reference_models.medusa import untrained_heads
from skvs_jax import metrics, model_shapes, policies, workloads
from skvs_jax.config import CacheConfig
from skvs_jax.serve import engine, engine_step, oracle_drafter
from skvs_jax.sim import acceptance_model, calibrate
from skvs_jax.sim import cost_model as cm
from skvs_jax.sim import simulate as sim

COMPARED = (("throughput", "throughput"), ("tpot_p50", "TPOT P50"))


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every run shares: the model, its simulator spec, the cache, the engine options, the profile."""

    model: Llama
    spec: cm.ModelSpec
    cache: CacheConfig
    options: dict
    probs: tuple[float, ...]
    seed: int
    heads: object = None  # MedusaHeads the oracle runs (their cost), or None: a free oracle


def build(shape: str, profile: str, *, k: int = 4, weight_seed: int = 0, dtype: str = "float32", max_seqs: int = 8,
          kv_blocks: int = 65, block_size: int = 8, max_output: int = 32, token_budget: int = 128,
          prefill_chunk: int = 32, impl: str = "auto", heads: bool = False,
          steps_per_dispatch: int | str = 1) -> Setup:
    """The shape (NAME or NAME:LAYERS) with random weights of `dtype` (the KV cache too), its ModelSpec, a cache of
    `kv_blocks` blocks (tight enough by default that vllm_default preempts), and the profile's K probabilities.
    heads: the oracle runs K untrained Medusa heads (priced in the spec too), else it drafts for free.
    steps_per_dispatch: the engines' (1 by default, so every step is timed alone: see `Setup`'s options)."""
    name, layers = model_shapes.parse(shape)
    hf = model_shapes.hf_config(name, layers)
    model = Llama(LlamaConfig.from_hf_dict(hf), rngs=nnx.Rngs(weight_seed), dtype=jnp.dtype(dtype))
    width = jnp.dtype(dtype).itemsize
    medusa = {"medusa_num_heads": k, "medusa_num_layers": 1} if heads else None
    spec = cm.ModelSpec.from_hf_config(shape, hf, medusa, weight_dtype_bytes=width, kv_dtype_bytes=width)
    max_len = -(-(workloads.TINY_PROMPT_LEN + max_output) // block_size) * block_size
    cache = CacheConfig(num_blocks=kv_blocks, block_size=block_size, max_seqs=max_seqs,
                        max_blocks_per_seq=max_len // block_size)
    probs = acceptance_model.parse_profile(profile, k)
    # One step per dispatch by default: a dispatch of several steps is timed as a whole and its time spread over
    # its steps in proportion to the step cost's guess (`Engine`'s step log), which would fit the device to that
    # guess. The GPU script serves with the engine's default instead: it compares request-level metrics only.
    return Setup(model, spec, cache, dict(token_budget=token_budget, prefill_chunk=prefill_chunk, impl=impl,
                                          kv_dtype=dtype, steps_per_dispatch=steps_per_dispatch), probs, weight_seed,
                 untrained_heads(model.lm_head_weight(), k, dtype) if heads else None)


def requests_of(trace: workloads.Trace) -> list[tuple[int, list[int], int]]:
    return [(r.request_id, list(r.prompt), r.max_new_tokens) for r in trace.requests]


def serve(s: Setup, policy: policies.Policy, trace: workloads.Trace, drafter) -> engine.Engine:
    """`trace` served on a warmed-up engine (every request at t = 0)."""
    e = engine.Engine(s.model, drafter if policy.speculation else None, policy, s.cache, **s.options)
    e.warmup()
    for rid, prompt, max_new in requests_of(trace):
        e.add_request(prompt, engine.SamplingParams(max_tokens=max_new), request_id=rid, arrival_time=0.0)
    e.run()
    return e


def engine_summary(e: engine.Engine) -> dict[str, float]:
    """The engine's run as `metrics.summarize` reads it (the simulator's summary has the same keys), plus steps."""
    log = e.step_log
    steps = metrics.StepRecord(
        start_time=np.asarray([s["start"] for s in log]), duration=np.asarray([s["duration"] for s in log]),
        blocks_used=np.asarray([s["blocks_used"] for s in log]),
        blocks_total=np.full(len(log), e.cfg.sched.cache.usable_blocks),
        num_preempted=np.asarray([s["preempted"] for s in log]))
    records = [metrics.RequestRecord(
        request_id=r.request_id, arrival_time=r.arrival_time, first_token_time=r.first_token_time,
        finish_time=r.finish_time, num_prompt_tokens=len(r.prompt), num_output_tokens=len(r.tokens),
        num_cached_prompt_tokens=r.cached_tokens, num_admitted_prompt_tokens=r.admitted_tokens,
        num_preemptions=r.preemptions, aborted=not r.finished, num_first_cached_prompt_tokens=r.first_cached_tokens,
        tpot_target=r.sampling.tpot_target,
    ) for r in e.requests.values()]
    return metrics.summarize(records, steps) | {"steps": len(log),
                                                "query_slots": sum(s["query_slots"] for s in log),
                                                "preemptions": int(e.state.sched.counters.preempt_recompute)
                                                + int(e.state.sched.counters.preempt_swap)}


def layout_of(e: engine.Engine) -> sim.EngineLayout:
    """The engine's query layout, for a simulator that prices its padding."""
    return sim.EngineLayout(prompt_width=e.picker.prompt_width, split_rows=e.cfg.split_rows,
                            logit_slots=engine_step.logit_slots(e.cfg))


def simulated(e: engine.Engine, trace: workloads.Trace, s: Setup, table: np.ndarray | None,
              device: cm.DeviceSpec, padded: bool = False) -> tuple[dict[str, float], dict[str, tuple[int, int]]]:
    """The engine's run simulated: (summary with steps and preemptions, counters that differ engine vs sim).
    padded: the clock prices the engine's padded query (`layout_of`), else the tokens alone."""
    cfg = e.cfg.sched
    outputs = {rid: list(r.tokens) for rid, r in e.requests.items()}
    runs = None
    if cfg.policy.speculation:
        width = cfg.max_len + cfg.policy.draft_len + 1
        runs = oracle_drafter.accept_runs(table, s.probs, s.seed, s.spec.vocab_size,
                                          [r.request_id for r in trace.requests], width)
    st_trace = sim.make_trace(trace, cfg, outputs=outputs, accept_runs=runs, vocab_size=s.spec.vocab_size)
    st, log = sim.simulate(st_trace, e.knobs, cfg=cfg, cost=cm.CostModel(s.spec, device),
                           max_steps=4 * len(e.step_log) + 16, controller_cost=e.step_cost,
                           layout=layout_of(e) if padded else None)
    ce, cs = jax.device_get((e.state.sched.counters, st.counters))
    differ = {f: (int(getattr(ce, f)), int(getattr(cs, f))) for f in ce.__dataclass_fields__
              if int(getattr(ce, f)) != int(getattr(cs, f))}
    summary = sim.summarize(log, st_trace, cfg) | {
        "steps": int(np.asarray(log.active).sum()),
        "query_slots": int(np.asarray(log.query_slots)[np.asarray(log.active)].sum()),
        "preemptions": int(cs.preempt_recompute) + int(cs.preempt_swap)}
    return summary, differ


def serve_all(s: Setup, names: list[str], trace: workloads.Trace, say=None) -> tuple[np.ndarray, dict]:
    """The reference pass of `trace`, then every policy served with the oracle drafter: (table, name -> engine)."""
    ref = engine.Engine(s.model, None, policies.vllm_default(), s.cache, **s.options)
    table = oracle_drafter.reference_table(ref, requests_of(trace))
    drafter = oracle_drafter.OracleDrafter(s.probs, table, seed=s.seed, heads=s.heads)
    served = {}
    for n in names:
        served[n] = serve(s, policies.preset(n, len(s.probs)), trace, drafter)
        if say is not None:
            say(f"served {n}: {len(served[n].step_log)} steps", flush=True)
    return table, served


def compare(s: Setup, served: dict, table: np.ndarray, trace: workloads.Trace,
            devices: dict[str, tuple[cm.DeviceSpec, bool]]) -> dict[str, dict]:
    """Per policy: the engine's summary ("real"), the simulation priced by each of `devices` (label -> (device,
    padded: price the engine's padding)), the counters that differ engine vs simulator, and how many outputs
    equal the reference pass."""
    rows = {}
    for n, e in served.items():
        row = {"real": engine_summary(e)}
        for label, (dev, padded) in devices.items():
            row[label], row["differs"] = simulated(e, trace, s, table, dev, padded)
        row["outputs_as_reference"] = sum(
            list(r.tokens) == [t for t in table[r.request_id, len(r.prompt):].tolist() if t >= 0]
            for r in e.requests.values())
        rows[n] = row
    return rows


def fidelity(s: Setup, names: list[str], fit_trace: workloads.Trace, check_trace: workloads.Trace,
             verbose: bool = True) -> dict:
    """Serve both traces, refit the device on the fit trace's steps (padded and tokens only), simulate the check
    trace's runs with both refits and the preset `cpu-measured` (the module docstring). Returns {"device" (the
    padded refit), "tokens_device", "samples", "rows"}."""
    say = print if verbose else None
    _, fit_runs = serve_all(s, names, fit_trace, say)
    table, served = serve_all(s, names, check_trace, say)
    fit = {padded: cm.fit_cpu_device([x for n in names for x in calibrate.samples(fit_runs[n], padded)], s.spec,
                                     name=f"cpu-measured {s.spec.name}") for padded in (True, False)}
    rows = compare(s, served, table, check_trace, {"refit": (fit[True], True), "tokens": (fit[False], False),
                                                   "preset": (cm.DEVICES["cpu-measured"], False)})
    return {"device": fit[True], "tokens_device": fit[False], "rows": rows,
            "samples": sum(len(fit_runs[n].step_log) for n in names)}


def format_rows(rows: dict[str, dict], labels: list[str], num_requests: int) -> str:
    """One line per policy: engine / simulated steps, preemptions and hit rate (under the first label's device:
    the schedule does not depend on the device), then simulated / real throughput and TPOT P50 per device label."""
    head = (f"{'policy':<14}{'steps e/s':>11}{'preempt e/s':>13}{'hit % e/s':>13}"
            + "".join(f"{f'{title} sim/real ({label})':>30}" for label in labels for _, title in COMPARED)
            + f"{'outputs = ref':>15}  counters differ")
    lines = [head]
    for n, row in rows.items():
        real, sim_ = row["real"], row[labels[0]]
        ratios = "".join(f"{metrics.safe_ratio(row[label][k], real[k]):>30.3f}"
                         for label in labels for k, _ in COMPARED)
        lines.append(f"{n:<14}{real['steps']:>5}/{sim_['steps']:<5}{real['preemptions']:>6}/{sim_['preemptions']:<6}"
                     f"{100 * real['kv_hit_rate']:>6.1f}/{100 * sim_['kv_hit_rate']:<6.1f}{ratios}"
                     f"{row['outputs_as_reference']:>9}/{num_requests:<5}  {', '.join(row['differs']) or 'none'}")
    return "\n".join(lines)


def _device_line(label: str, d: cm.DeviceSpec) -> str:
    return (f"{label}: {d.host_overhead_s * 1e3:.2f} ms/step + {d.peak_flops_per_s / 1e9:.1f} GFLOP/s + "
            f"{d.hbm_bytes_per_s / 1e9:.2f} GB/s + {d.logit_elements_per_s / 1e9:.2f} G logit elements/s")


def format_report(result: dict, s: Setup, check_trace: workloads.Trace) -> str:
    return "\n".join([
        f"devices refit on {result['samples']} steps of the fit trace (inf: the fit found no separate cost):",
        "  " + _device_line("refit (the query slots computed, padding included)", result["device"]),
        "  " + _device_line("tokens (the tokens scheduled alone)", result["tokens_device"]),
        format_rows(result["rows"], ["refit", "tokens", "preset"], len(check_trace.requests)),
        "real: the engine on this CPU, the check trace; sim: the simulator of the same runs priced by the padded "
        "refit and the engine's layout (refit), by the tokens-only refit (tokens), and by the preset cpu-measured "
        "(fitted on the shipped tiny model, tokens only)"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m skvs_jax.sim.fidelity", description=__doc__.split("\n")[0])
    parser.add_argument("--model-shape", default="llama-3.2-1b:2", help="NAME or NAME:LAYERS (skvs_jax.model_shapes)")
    parser.add_argument("--profile", default="medusa-1", help="the oracle's acceptance: a preset or 0.8,0.6,...")
    parser.add_argument("--policies", default="vllm_default,naive_spec,skvs")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--kv-blocks", type=int, default=65)
    parser.add_argument("--fit-seed", type=int, default=1)
    parser.add_argument("--check-seed", type=int, default=2)
    args = parser.parse_args(argv)
    names = [n for n in args.policies.split(",") if n]
    if not names or any(n not in policies.PRESETS for n in names):
        raise SystemExit(f"skvs_jax.sim.fidelity: --policies must name presets of {sorted(policies.PRESETS)}")
    for flag in ("requests", "max_output", "kv_blocks"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"skvs_jax.sim.fidelity: --{flag.replace('_', '-')} must be >= 1")
    try:
        s = build(args.model_shape, args.profile, max_output=args.max_output, kv_blocks=args.kv_blocks)
    except ValueError as err:
        raise SystemExit(f"skvs_jax.sim.fidelity: {err}") from None
    traces = [workloads.tiny_model_trace("system_prompts", args.requests, seed=seed, max_output_len=args.max_output)
              for seed in (args.fit_seed, args.check_seed)]
    print(f"simulator vs engine: {args.model_shape} ({s.model.config.num_params / 1e9:.2f}B parameters, random "
          f"float32 weights), oracle drafter {args.profile} (K = {len(s.probs)}), {args.requests} requests "
          f"(system_prompts, fit seed {args.fit_seed}, check seed {args.check_seed}), KV budget "
          f"{s.cache.usable_blocks} blocks x {s.cache.block_size}, {s.cache.max_seqs} slots; jax {jax.__version__} "
          f"on {jax.devices()[0].platform}", flush=True)
    result = fidelity(s, names, *traces)
    print(format_report(result, s, traces[1]))
    return 0 if all(math.isfinite(r["refit"]["throughput"]) for r in result["rows"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
