"""`skvs gpu-check`: the project's one GPU script. Every GPU figure in docs/ comes from it.

Sections (`--only a,b`), each with a time budget (`BUDGET_S`: 290 s in all, compilation included, so the whole
script is one device call of under five minutes):

  kernels   the Pallas kernels against their references, then timed against jax's own Pallas paged attention,
            the XLA path and the device's copy bandwidth (`pallas_kernels.gpu_check`)
  serving   the engine on the shipped tiny model (impl "auto": the compiled Pallas kernels on a GPU) at one step per
            dispatch and at the chosen steps per dispatch (`skvs micro host`'s measurement): throughput,
            dispatches per request, the device's idle time between dispatches per step (wall time minus the
            programs' own time), skvs / naive_spec; then the `while` and `cond` inside the dispatch program
            (`control_flow`: host round trips on XLA:GPU)
  program   the step program as a GPU runs it (`skvs micro program`): the scheduler's step (schedule + update, no
            model) in-graph per step at the bench's geometry and at 256 slots, skvs with the GPU's choices
            (control_flow "select", prefix_sums "dense"), the CPU's ("skip", "scan") and "mixed" (select the cheap
            skips, keep the skips of the passes over [B, M], [N] or [C]; timed last, the first left out when the
            budget runs short) on the same device, so the choice is measured where it matters; schedule's heavy
            primitives per program; the engine's decode step (fused) against its halves (schedule_only,
            model_only) with the step's data-dependent while/cond count (host round trips, counted in the
            program: the floor a profile would show); then the simulator (`skvs micro simulate`: one run's steps
            per second and a vmapped sweep of 64 lanes)
  tune      the paged-attention kernel's launch parameters swept (`pallas_kernels.gpu_check.tune`: pages per step,
            splits, Triton warps and stages, at most 24 configs per shape, each checked against the reference) for
            decode and verification at the Llama-3.1-8B shape, contexts 512 / 2,048 / 8,192: default vs best time,
            KV GB/s against the HBM peak and the copy bandwidth, verification / decode; its rows are what
            `pallas_kernels.tuning.TUNED` is filled from, by hand
  engine    the article's regime on the real engine: Llama-3.1-8B's shape (bf16, random weights) serving a trace of
            48 requests of up to 64 output tokens on 32 slots under memory pressure (160 KV blocks of 16:
            vllm_default preempts), the three
            presets with the oracle drafter at medusa-1 running 4 untrained Medusa heads (so drafting pays their
            cost; `sim.fidelity`); then the simulator's prediction of the same runs priced by the device's
            datasheet (h100-sxm / h200), simulated / real per policy, and the real skvs / naive_spec and
            skvs / vllm_default throughput (the headline)

A budget is a deadline, not only a label: the tune sweep and the program section stop starting new measurements
when theirs is spent and print what they left out; every section prints OVER BUDGET when it ran past its own.
The budgets are estimates for one H100/H200 (no GPU has run this version yet): the first run's times replace them.

A section returns ok, or (ok, rows) with rows a list of JSON-serialisable dicts (kernels and tune do): every
section's rows go into one file, `--out` (default gpu-check.json here), as {"device", "jax", "sections": {name:
rows}}, written after the last section when any section returned rows.

XLA's GPU command buffers can run `while` and `cond` on the device: `--command-buffers` sets
XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL before the
backend starts; run the program section with and without it to see whether they remove the round trips (the
CPU's "skip" program is the one with control flow left to remove).

Without a GPU it says so and exits 2; `--cpu-smoke` runs every section end to end on this CPU at tiny sizes
(interpreted kernels, a few requests): a check of the script, not of a GPU. Record what it prints in docs/ with
the device and the versions it prints first.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import numpy as np

SECTIONS = ("kernels", "serving", "program", "tune", "engine")
BUDGET_S = {"kernels": 40.0, "serving": 45.0, "program": 60.0, "tune": 45.0, "engine": 100.0}
COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    parser.add_argument("--cpu-smoke", action="store_true", help="run on this CPU at tiny sizes (checks the script)")
    parser.add_argument("--steps-per-dispatch", default="auto", help="the chosen N the serving section compares "
                                                                      "with N = 1 (an int, or auto)")
    parser.add_argument("--command-buffers", action="store_true",
                        help=f"set XLA_FLAGS={COMMAND_BUFFERS} before the backend starts")
    parser.add_argument("--out", default="gpu-check.json",
                        help="JSON file for the sections' rows (kernels, tune), default gpu-check.json")


def _kernels(smoke: bool) -> tuple[bool, list[dict]]:
    from pallas_kernels import gpu_check as kernel_check

    rng = np.random.default_rng(0)
    ok = kernel_check.check_correctness(rng, interpret=smoke, small=smoke)
    return ok, kernel_check.benchmark(rng, smoke, smoke, 2 if smoke else 20)


ENGINE_NAMES = ("vllm_default", "naive_spec", "skvs")


def _engine(smoke: bool) -> tuple[bool, list[dict]]:
    from skvs_jax import workloads
    from skvs_jax.sim import fidelity, specs

    if smoke:
        s = fidelity.build("tiny:2", "medusa-1", max_seqs=4, kv_blocks=33, block_size=8, max_output=8, heads=True)
        trace = workloads.tiny_model_trace("system_prompts", 6, seed=0, max_output_len=8)
    else:
        s = fidelity.build("llama-3.1-8b", "medusa-1", dtype="bfloat16", max_seqs=32, kv_blocks=161, block_size=16,
                           max_output=64, token_budget=512, prefill_chunk=128, heads=True,
                           steps_per_dispatch="auto")
        trace = workloads.tiny_model_trace("system_prompts", 48, seed=0, max_output_len=64)
    kind = jax.devices()[0].device_kind
    label = "h200" if "H200" in kind else "h100-sxm" if "H100" in kind else "cpu-measured"
    print(f"{s.spec.name} ({s.model.config.num_params / 1e9:.2f}B, random {s.options['kv_dtype']} weights and KV), "
          f"oracle drafter medusa-1, {len(trace.requests)} requests, {s.cache.max_seqs} slots, KV "
          f"{s.cache.usable_blocks} blocks x {s.cache.block_size}; simulator priced as {label}", flush=True)
    table, served = fidelity.serve_all(s, list(ENGINE_NAMES), trace, print)
    # The engine computes its padded query: price that (padded=True), as the CPU's fidelity check does.
    rows = fidelity.compare(s, served, table, trace, {label: (specs.DEVICES[label], True)})
    print(fidelity.format_rows(rows, [label], len(trace.requests)))
    real = {n: r["real"]["throughput"] for n, r in rows.items()}
    print("real throughput: " + ", ".join(f"{n} {t:.0f} tok/s" for n, t in real.items())
          + f"; skvs / naive_spec {real['skvs'] / real['naive_spec']:.3f}x, skvs / vllm_default "
          f"{real['skvs'] / real['vllm_default']:.3f}x")
    out = [{"policy": n, "real": r["real"], "simulated": r[label], "device": label, "counters_differ": r["differs"],
            "outputs_as_reference": r["outputs_as_reference"], "requests": len(trace.requests)}
           for n, r in rows.items()]
    return all(r["real"]["steps"] > 0 for r in rows.values()), out


def _tune(smoke: bool) -> tuple[bool, list[dict]]:
    """The sweep within the section's budget; fails if a configuration gave a wrong result (a kernel bug, not a
    slow config) or a shape has no configuration that ran."""
    from pallas_kernels import gpu_check as kernel_check

    rows = kernel_check.tune(np.random.default_rng(0), interpret=smoke, small=smoke, repeats=2 if smoke else 20,
                             budget_s=math.inf if smoke else BUDGET_S["tune"])
    wrong = any(e["correct"] is False for r in rows for e in r["configs"])
    return bool(rows) and not wrong and all(r["best"] is not None for r in rows), rows


def control_flow(jaxpr) -> dict[str, int]:
    """`while` and `cond` equations in a (closed) jaxpr and every jaxpr inside it (`testing.program.heavy`): on
    XLA:GPU each evaluates its predicate or branch index on the host, once per trip, unless the program runs in a
    command buffer."""
    from skvs_jax.testing import program

    counts = program.heavy(jaxpr)
    return {"while": counts["while"], "cond": counts["cond"]}


def _round_trips(name: str, smoke: bool) -> str:
    """The dispatch program's control flow at its narrow and prompt widths, for one policy (traced, not run)."""
    from reference_models import checkpoint
    from skvs_jax import policies
    from skvs_jax.config import CacheConfig
    from skvs_jax.serve import dispatch, engine, engine_step

    cache = CacheConfig(num_blocks=65, block_size=8, max_seqs=8, max_blocks_per_seq=16)
    e = engine.Engine(*checkpoint.load_shipped(), policies.preset(name), cache, token_budget=128, prefill_chunk=32,
                      step_cost="flat", steps_per_dispatch="auto", impl="auto")
    parts = []
    for width in sorted({engine_step.narrow_width(e.cfg), e.picker.prompt_width}):
        fn = jax.make_jaxpr(lambda p, st, k, lim, new, w=width: dispatch.run_steps(
            e.runner, p, st, k, lim, engine_step.AUTO, new, cfg=e.cfg, width=w, capacity=dispatch.CAPACITY))
        c = control_flow(fn(e.params, e.state, e.knobs, dispatch.limits(1), e._incoming([])))
        parts.append(f"width {width}: {c['while']} while, {c['cond']} cond")
    return f"{name}: " + "; ".join(parts)


def _serving(smoke: bool, chosen) -> bool:
    from skvs_jax.commands import micro_host

    names = ["skvs"] if smoke else ["naive_spec", "skvs"]
    steps = [1, chosen]
    rows = micro_host.measure(names, steps, rounds=1, requests=4 if smoke else 16)
    print("idle us/step: (wall - the programs' own time) / steps, the device's idle time between dispatches as served")
    print("admitted: requests the dispatch loop admitted itself (staged by the host, serve.dispatch.Staged)")
    print(f"{'config':<24}{'tok/s':>9}{'steps':>7}{'dispatches':>12}{'/request':>10}{'admitted':>10}"
          f"{'idle us/step':>14}{'idle %':>8}")
    for name, rs in rows.items():
        r = rs[0]
        idle_us = 1e6 * max(0.0, r["wall_s"] - r["device_s"]) / r["steps"]
        print(f"{name:<24}{r['tok_s']:>9.0f}{r['steps']:>7}{r['dispatches']:>12}{r['per_request']:>10.2f}"
              f"{r['admitted']:>10}{idle_us:>14.0f}{100 * r['visible']:>8.1f}")
    for name in names:
        one, many = rows[f"{name} N=1"][0], rows[f"{name} N={chosen}"][0]
        print(f"{name}: N={chosen} / N=1 throughput {many['tok_s'] / one['tok_s']:.3f}x")
    if len(names) > 1:
        for n in steps:
            ratio = rows[f"skvs N={n}"][0]["tok_s"] / rows[f"naive_spec N={n}"][0]["tok_s"]
            print(f"skvs / naive_spec at N={n}: {ratio:.3f}x")
    print("control flow inside the dispatch program (each a host round trip per trip on XLA:GPU without command "
          "buffers; the lean-step issue owns them; the dispatch loop itself is one while):")
    for name in names:
        print("  " + _round_trips(name, smoke))
    return True


def _spent(deadline: float, what: str) -> bool:
    """Past the section's deadline: say what is left out (the budget is one device call's share)."""
    if time.perf_counter() < deadline:
        return False
    print(f"  budget spent: {what} not measured")
    return True


def _program(smoke: bool) -> bool:
    from skvs_jax.commands import micro_program, micro_simulate

    deadline = math.inf if smoke else time.perf_counter() + BUDGET_S["program"]  # the smoke checks every path
    names, targets = ["skvs"], ("gpu", "cpu", "mixed")  # mixed last: the first left out when the budget runs short
    sizes = ["small"] if smoke else ["small", "256"]
    print("scheduler step (schedule + update, no model), in-graph, a full decode batch; targets: gpu = control_flow "
          "'select' + prefix_sums 'dense' (a GPU's defaults), cpu = 'skip' + 'scan', mixed = 'mixed' + 'dense' (the "
          "passes over [B, M], [N] or [C] keep their skips)")
    print(f"{'size':<7}{'policy':<12}{'target':<8}{'us/step':>10}{'heavy':>8}{'while+cond':>12}")
    ok, times = True, {}
    for size in sizes:
        for name in names:
            for target in targets:
                if _spent(deadline, f"{size} {name} {target}"):
                    continue
                r = micro_program.time_step(name, size, target, steps=2 if smoke else 10, calls=1 if smoke else 5)
                heavy = micro_program.count_schedule(name, size, target, compile_it=False)["heavy"]
                times[size, name, target] = r["us_per_step"]
                ok &= r["all_ok"]
                print(f"{size:<7}{name:<12}{target:<8}{r['us_per_step']:>10.1f}{sum(heavy.values()):>8}"
                      f"{heavy['while'] + heavy['cond']:>12}")
            cpu = times.get((size, name, "cpu"))
            ratios = [f"{t} / cpu target: {times[size, name, t] / cpu:.3f}x" for t in ("gpu", "mixed")
                      if cpu and (size, name, t) in times]
            if ratios:
                print(f"{size:<7}{name:<12}" + ", ".join(ratios))
    from reference_models import checkpoint

    shipped = checkpoint.load_shipped()
    print("\nthe engine's decode step (shipped model, 8 rows decoding, each call waited for): the fused step against "
          "its halves run apart, schedule_only and model_only (forward, sampling, verification, update)")
    print(f"{'policy':<12}{'target':<8}{'fused us':>10}{'schedule us':>13}{'model us':>10}{'round trips':>13}")
    for name in names:
        for target in targets:
            if _spent(deadline, f"the engine step, {name} {target}"):
                continue
            r = micro_program.time_engine_step(shipped, name, target, calls=2 if smoke else 10)
            flow = micro_program.count_step(shipped, name, "small", target)["flow"]
            trips = sum(sum(c.values()) for c in flow.values())
            print(f"{name:<12}{target:<8}{r['fused_us']:>10.0f}{r['schedule_us']:>13.0f}{r['model_us']:>10.0f}"
                  f"{trips:>13}")
    sim = argparse.Namespace(max_seqs=256, requests=128, points=64, steps=256, max_output_len=128,
                             max_prompt_len=256, rate=16.0, skip_vmap=False, cost_mode="auto")
    if smoke:
        sim = argparse.Namespace(**{**vars(sim), "max_seqs": 8, "requests": 8, "points": 8, "steps": 16,
                                    "max_output_len": 16, "max_prompt_len": 16})
    print("\nthe simulator on this device (skvs micro simulate, its default run: the GPU's choices apply by default)")
    if _spent(deadline, "the simulator"):
        return ok
    return ok & (micro_simulate.run(sim) == 0)


def _json_safe(x):
    """x with NaN / inf floats as None (strict JSON has neither) and numpy scalars as Python numbers."""
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    return None if isinstance(x, float) and not math.isfinite(x) else x


def write_rows(path: str, sections: dict[str, list[dict]]) -> None:
    """The sections' rows, with the device kind and jax version, as one JSON file at `path`."""
    doc = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "sections": _json_safe(sections)}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")


def run(args: argparse.Namespace) -> int:
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"skvs gpu-check: --only: unknown section(s) {unknown}; choose from {SECTIONS}")
    chosen = args.steps_per_dispatch if args.steps_per_dispatch == "auto" else int(args.steps_per_dispatch)
    if args.command_buffers:  # read when the backend starts, which is on the first device call below
        import os

        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {COMMAND_BUFFERS}".strip()
        print(f"XLA_FLAGS={os.environ['XLA_FLAGS']}")
    on_gpu = jax.default_backend() == "gpu"
    import skvs_jax

    print(f"skvs gpu-check: skvs_jax {skvs_jax.__version__}, jax {jax.__version__}, backend "
          f"{jax.default_backend()}, devices {jax.devices()}")
    if not on_gpu and not args.cpu_smoke:
        print("no GPU visible: nothing checked (--cpu-smoke exercises this script on the CPU)")
        return 2
    ok, t_all, rows = True, time.perf_counter(), {}
    for section in only:
        t0 = time.perf_counter()
        print(f"\n== {section} (budget {BUDGET_S[section]:.0f} s)")
        run_section = {"kernels": lambda: _kernels(args.cpu_smoke), "serving": lambda: _serving(args.cpu_smoke, chosen),
                       "program": lambda: _program(args.cpu_smoke), "tune": lambda: _tune(args.cpu_smoke),
                       "engine": lambda: _engine(args.cpu_smoke)}[section]
        good = run_section()
        if isinstance(good, tuple):  # (ok, rows): the rows go to --out
            good, rows[section] = good
        took = time.perf_counter() - t0
        over = "" if took <= BUDGET_S[section] or args.cpu_smoke else f"  OVER BUDGET ({BUDGET_S[section]:.0f} s)"
        print(f"== {section}: {'ok' if good else 'FAILED'} in {took:.0f} s{over}")
        ok &= good
    if rows:
        write_rows(args.out, rows)
        print(f"\nrows of {sorted(rows)} written to {args.out}")
    print(f"\nskvs gpu-check: {'all sections passed' if ok else 'SOME SECTIONS FAILED'} in "
          f"{time.perf_counter() - t_all:.0f} s")
    return 0 if ok else 1
