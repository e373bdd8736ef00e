"""`skvs micro program`: what one engine step's program holds, counted as a GPU would run it, on any backend.

A GPU pays a launch per kernel and, on XLA:GPU without command buffers, a host round trip per `while` trip and
per `cond`; this CPU hides both (docs/scheduler.md, "The step program as a GPU runs it"). The per-backend choices
are static config fields (`SchedulerConfig.control_flow`, `prefix_sums`), so this CPU traces the GPU's program
exactly. For each size, policy and target:

  schedule     `scheduler.schedule_unchecked`'s jaxpr: gathers, scatters, sorts, cumulative ops, `while`, `cond`
               (`testing.program.heavy`), and its optimised XLA:CPU program's kernel-like instructions
               (`testing.program.kernels`, the counting rule printed); XLA:GPU fuses differently, so the jaxpr
               counts are the portable figure
  step         the engine's fused step (`engine_step.fused_step`: schedule, model, sampling, verification,
               update) outside the model (reference_models/, pallas_kernels/ and the runner: interpreted Pallas is
               not what a GPU runs), and its data-dependent `while` / `cond` by source: each is a host round trip
               per trip on XLA:GPU

Targets: cpu = control_flow "skip" + prefix_sums "scan" (this CPU's defaults), gpu = "select" + "dense" (a GPU's),
mixed = "mixed" + "dense" (a GPU's program that keeps the skips of the passes over [B, M], [N] or [C]).
Sizes: small = `skvs bench`'s geometry (8 slots, 64 blocks of 8, M 16, token budget 128, chunk 32); 256 = `skvs
micro scheduler`'s (256 slots, 65,536 blocks of 16, M 128, budget 2048, admission window 32). The step at 256
slots is traced with 2,048 blocks of 16 and M 8 (the shipped model's positions; the counts do not depend on N).
"""

from __future__ import annotations

import argparse
import json

import jax

TARGETS = {"cpu": dict(control_flow="skip", prefix_sums="scan"),
           "gpu": dict(control_flow="select", prefix_sums="dense"),
           "mixed": dict(control_flow="mixed", prefix_sums="dense")}
SIZES = ("small", "256")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default="vllm_default,naive_spec,skvs", help="comma-separated presets")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {SIZES}")
    parser.add_argument("--targets", default="cpu,gpu,mixed", help="comma-separated, of cpu,gpu,mixed (see the module "
                                                                   "doc)")
    parser.add_argument("--no-compile", action="store_true", help="skip the XLA:CPU kernel counts (compilation)")
    parser.add_argument("--no-step", action="store_true", help="skip the fused step (loads the shipped model)")
    parser.add_argument("--json", default=None, help="write every count here")


def _sched_config(name: str, size: str, target: str):
    from skvs_jax import policies
    from skvs_jax import scheduler as sc
    from skvs_jax.config import CacheConfig

    if size == "small":
        cache = CacheConfig(num_blocks=65, block_size=8, max_seqs=8, max_blocks_per_seq=16)
        return sc.SchedulerConfig(cache=cache, policy=policies.preset(name), max_running=8, token_budget=128,
                                  prefill_chunk=32, **TARGETS[target])
    cache = CacheConfig(num_blocks=65_536, block_size=16, max_seqs=256, max_blocks_per_seq=128)
    return sc.SchedulerConfig(cache=cache, policy=policies.preset(name), max_running=256, token_budget=2048,
                              admit_window=32, **TARGETS[target])


def count_schedule(name: str, size: str, target: str, compile_it: bool) -> dict:
    """{"heavy": {kind: n}, "per_step": n, "kernels": {opcode: n, "total": n} or None} for `schedule` of one
    policy; per_step: the heavy primitives outside the bodies of its skips (every `while` / `cond` in `schedule`
    is one), what a step that needs none of the rare work runs."""
    from skvs_jax import scheduler as sc
    from skvs_jax.testing import program

    cfg = _sched_config(name, size, target)
    st = jax.eval_shape(lambda: sc.init(cfg))
    fn = jax.jit(lambda st, k: sc.schedule_unchecked(st, k, cfg=cfg))
    jaxpr = jax.make_jaxpr(fn)(st, cfg.policy.knobs())
    out = {"heavy": program.heavy(jaxpr), "kernels": None,
           "per_step": sum(program.heavy(jaxpr, skipped=tuple(program.by_source(jaxpr, ("while", "cond")))).values())}
    if compile_it:
        out["kernels"] = program.kernels(fn.lower(st, cfg.policy.knobs()).compile().as_text())
    return out


def count_step(shipped, name: str, size: str, target: str) -> dict:
    """{"width": Q, "heavy": {kind: n}, "flow": {source: {kind: n}}} for the fused step outside the model, at
    the narrow (decode) width."""
    from skvs_jax import policies
    from skvs_jax.config import CacheConfig
    from skvs_jax.serve import engine, engine_step
    from skvs_jax.testing import program

    if size == "small":
        cache, budget, chunk = CacheConfig(num_blocks=65, block_size=8, max_seqs=8, max_blocks_per_seq=16), 128, 32
    else:
        cache, budget, chunk = CacheConfig(num_blocks=2049, block_size=16, max_seqs=256, max_blocks_per_seq=8), 2048, 64
    e = engine.Engine(*shipped, policies.preset(name), cache, token_budget=budget, prefill_chunk=chunk,
                      step_cost="flat", steps_per_dispatch=1, **TARGETS[target])
    width = engine_step.narrow_width(e.cfg)
    jaxpr = jax.make_jaxpr(lambda p, st, k: engine_step.fused_step(e.runner, p, st, k, cfg=e.cfg, width=width))(
        e.params, e.state, e.knobs)
    return {"width": width, "heavy": program.heavy(jaxpr, exclude=program.MODEL_SOURCES),
            "flow": program.by_source(jaxpr, ("while", "cond"), exclude=program.MODEL_SOURCES)}


def time_step(name: str, size: str, target: str, steps: int = 10, calls: int = 5, seed: int = 0) -> dict:
    """The scheduler's step (schedule + update, no model) in-graph: `steps` steps under one `lax.scan` per call,
    a full decode batch (as `skvs micro scheduler`, without its oracle), median over `calls` calls after the
    first. Returns {"us_per_step", "seqs", "steps"}."""
    import time

    import jax.numpy as jnp
    import numpy as np

    from skvs_jax import scheduler as sc
    from skvs_jax.commands.micro_common import decode_requests, step_draws

    cfg = _sched_config(name, size, target)
    b, k = cfg.cache.max_seqs, cfg.policy.draft_len
    knobs = cfg.policy.knobs()
    prompts, lens, max_new = decode_requests(np.random.default_rng(seed), b, 40 if size == "small" else 512,
                                             cfg.max_len)
    st, _ = sc.add(sc.init(cfg), jnp.asarray(prompts), jnp.asarray(lens), jnp.asarray(max_new), cfg=cfg)

    def one(st, xs):
        acc, nxt, drafts = xs
        st, batch = sc.schedule_unchecked(st, knobs, cfg=cfg)
        st, _ = sc.update_unchecked(st, batch, acc, nxt, drafts, jnp.zeros((b,), bool), knobs, cfg=cfg)
        return st, batch.alloc_ok

    scan = jax.jit(lambda st, xs: jax.lax.scan(one, st, xs), donate_argnums=0)

    def draws(t):
        return tuple(jnp.asarray(x) for x in step_draws(seed, t, b, k, 0.7, lead=(steps,)))

    t, times = 0, []
    for _ in range(64):  # prefill (the first call compiles), until every row decodes
        st, ok = scan(st, draws(t))
        t += 1
        decoding = sc.decoding_rows(st.seqs.status, st.seqs.num_tokens, st.kv.alloc.seqs.num_committed,
                                    st.seqs.prompt_len)
        if bool(jnp.all(decoding)):
            break
    for _ in range(calls):
        xs = draws(t)
        t += 1
        t0 = time.perf_counter()
        st, ok = scan(st, xs)
        jax.block_until_ready(st)
        times.append((time.perf_counter() - t0) / steps)
    return {"us_per_step": 1e6 * float(np.median(times)), "seqs": b, "steps": steps * calls,
            "all_ok": bool(np.all(np.asarray(ok)))}


def time_engine_step(shipped, name: str, target: str, calls: int = 10) -> dict:
    """The engine's decode step on the shipped model at the bench's geometry, eight rows decoding: the fused step
    (`engine_step.fused_step`) against its two halves run apart, `schedule_only` and `model_only` (the forward,
    sampling, verification and `update`), each call waited for; medians in microseconds over `calls` calls."""
    import time

    import numpy as np

    from skvs_jax import policies
    from skvs_jax import scheduler as sc
    from skvs_jax.config import CacheConfig
    from skvs_jax.serve import engine, engine_step

    cache = CacheConfig(num_blocks=65, block_size=8, max_seqs=8, max_blocks_per_seq=16)
    e = engine.Engine(*shipped, policies.preset(name), cache, token_budget=128, prefill_chunk=32, step_cost="flat",
                      steps_per_dispatch=1, **TARGETS[target])
    rng = np.random.default_rng(0)
    for i in range(8):
        e.add_request(rng.integers(32, 120, 16).tolist(), engine.SamplingParams(max_tokens=100), request_id=i)
    for _ in range(16):  # admit and prefill everyone
        e.step()
        if not bool(sc.prompt_work(e.state.sched)):
            break
    width = engine_step.narrow_width(e.cfg)
    st, fused, sched, model = e.state, [], [], []
    for i in range(calls + 1):  # the first call of each compiles
        t0 = time.perf_counter()
        st, _ = engine_step.fused_step(e.runner, e.params, st, e.knobs, cfg=e.cfg, width=width)
        jax.block_until_ready(st)
        t1 = time.perf_counter()
        st, batch = engine_step.schedule_only(st, e.knobs, cfg=e.cfg)
        jax.block_until_ready((st, batch))
        t2 = time.perf_counter()
        st, _ = engine_step.model_only(e.runner, e.params, st, batch, e.knobs, cfg=e.cfg, width=width)
        jax.block_until_ready(st)
        t3 = time.perf_counter()
        if i:
            fused.append(t1 - t0), sched.append(t2 - t1), model.append(t3 - t2)
    e.state = st  # the engine's state was donated to the calls above
    return {k: 1e6 * float(np.median(v)) for k, v in (("fused_us", fused), ("schedule_us", sched),
                                                       ("model_us", model))}


def _row(label: str, heavy: dict, extra: str = "") -> str:
    from skvs_jax.testing import program

    cells = "".join(f"{heavy[k]:>8}" for k in program.KINDS)
    return f"  {label:<26}{cells}{sum(heavy.values()):>8}{extra}"


def run(args: argparse.Namespace) -> int:
    from skvs_jax import policies
    from skvs_jax.testing import program

    names = [n for n in args.policies.split(",") if n]
    sizes = [s for s in args.sizes.split(",") if s]
    targets = [t for t in args.targets.split(",") if t]
    for flag, got, allowed in (("--policies", names, sorted(policies.PRESETS)), ("--sizes", sizes, SIZES),
                               ("--targets", targets, tuple(TARGETS))):
        bad = sorted(set(got) - set(allowed))
        if bad or not got:
            raise SystemExit(f"skvs micro program: {flag}: unknown or empty {bad}; choose from {list(allowed)}")
    shipped = None
    if not args.no_step:
        from reference_models import checkpoint

        shipped = checkpoint.load_shipped()
    print(f"skvs micro program: one step's program as a GPU runs it, traced on {jax.default_backend()} "
          f"(jax {jax.__version__})")
    for t in targets:
        print(f"  target {t}: " + ", ".join(f"{k} {v!r}" for k, v in TARGETS[t].items()))
    print("  heavy: jaxpr equations of each kind, nested jaxprs included (a jaxpr does not depend on the backend); "
          "step: the heavy total outside the bodies of the program's skips, what a step that needs none of the rare "
          "work launches")
    if not args.no_compile:
        print(f"  kernels: XLA:CPU's optimised program, {program.KERNEL_RULE}")
    head = "".join(f"{k:>8}" for k in program.KINDS) + f"{'total':>8}"
    results: dict = {}
    for size in sizes:
        print(f"\nschedule, size {size}")
        print(f"  {'policy / target':<26}{head}{'step':>7}" + ("" if args.no_compile else f"{'kernels':>10}"))
        for name in names:
            for t in targets:
                r = count_schedule(name, size, t, not args.no_compile)
                results[f"schedule/{size}/{name}/{t}"] = r
                extra = f"{r['per_step']:>7}" + ("" if r["kernels"] is None else f"{r['kernels']['total']:>10}")
                print(_row(f"{name} / {t}", r["heavy"], extra))
        if {"cpu", "gpu"} <= set(targets):
            for name in names:
                c, g = (sum(results[f"schedule/{size}/{name}/{t}"]["heavy"].values()) for t in ("cpu", "gpu"))
                print(f"  {name}: gpu / cpu heavy primitives {g / c:.2f}x ({g} vs {c})")
        if shipped is None:
            continue
        print(f"\nfused step outside the model, size {size} (narrow width)")
        print(f"  {'policy / target':<26}{head}")
        for name in names:
            for t in targets:
                r = count_step(shipped, name, size, t)
                results[f"step/{size}/{name}/{t}"] = r
                print(_row(f"{name} / {t} (Q {r['width']})", r["heavy"]))
        print("  data-dependent while / cond by source (a host round trip per trip on XLA:GPU):")
        for name in names:
            for t in targets:
                flow = results[f"step/{size}/{name}/{t}"]["flow"]
                total = sum(sum(c.values()) for c in flow.values())
                parts = ", ".join(f"{src} {'+'.join(f'{n} {k}' for k, n in c.items())}" for src, c in flow.items())
                print(f"    {name} / {t}: {total}: {parts}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "backend": jax.default_backend(), "targets": TARGETS,
                       "counts": results}, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


def main() -> int:  # the file runs on its own too: `python skvs_jax/commands/micro_program.py`
    parser = argparse.ArgumentParser(prog="micro_program")
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())

