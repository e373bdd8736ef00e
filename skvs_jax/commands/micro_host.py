"""`skvs micro host`: how much of the serving loop's wall time is the host's, per policy and steps per dispatch.

Each configuration serves `skvs bench`'s default trace (32 requests of shared system prompts, all at t = 0, the
shipped tiny model, 64 KV blocks of 8, 8 slots, token budget 128, prefill chunk 32) twice on a warm engine with a
flat step cost (so every run makes the same schedule):

  wall     the run as a user runs it (`Engine.run`: on this tree the overlapped loop)
  serial   the same run with every program call waited for, one at a time, and timed from the call until its
           outputs are ready: `prog`, the programs' own time (the call's argument handling included)

host % = 1 - prog / serial: the host's own share of a run in which nothing overlaps (per step: host ms/step);
visible % = (wall - prog) / wall: the share of the served run in which no program ran, the device's idle time
(0 when the host's work hides under the next dispatch; a negative difference, from the call overheads `prog`
counts, is shown as 0).

The file runs on its own too (`python skvs_jax/commands/micro_host.py`), so that the same measurement can be
taken on an older tree (`PYTHONPATH=<old tree>`), whose engine has no steps per dispatch: there only N = 1 runs,
timing `engine_step.fused_step`. Rounds alternate configurations, so the machine's drift hits each alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import jax


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default="vllm_default,naive_spec,skvs")
    parser.add_argument("--steps-per-dispatch", default="1,8,auto",
                        help="comma-separated values of the engine's steps_per_dispatch (an older tree: 1 only)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds; medians are reported")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--json", default=None, help="write the per-round figures here")


def _has_dispatch() -> bool:
    try:
        from skvs_jax.serve import dispatch  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _timed_programs(totals: list[float]):
    """Every serving program call (`engine_step.fused_step`, and `dispatch.run_steps` where the tree has it) blocks
    until its outputs are ready; its time from the call is appended to `totals`."""
    from skvs_jax.serve import engine_step

    targets = [(engine_step, "fused_step")]
    if _has_dispatch():
        from skvs_jax.serve import dispatch

        targets.append((dispatch, "run_steps"))
    originals = [getattr(m, n) for m, n in targets]

    def timed(original):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = jax.block_until_ready(original(*args, **kwargs))
            totals.append(time.perf_counter() - t0)
            return out

        return call

    for (m, n), original in zip(targets, originals):
        setattr(m, n, timed(original))
    try:
        yield
    finally:
        for (m, n), original in zip(targets, originals):
            setattr(m, n, original)


def _engine(model, heads, policy, cache, steps):
    from skvs_jax.serve import engine

    kwargs = dict(token_budget=128, prefill_chunk=32, step_cost="flat", impl="auto")  # Pallas on a GPU
    if steps != "legacy":
        kwargs["steps_per_dispatch"] = steps
    return engine.Engine(model, heads, policy, cache, **kwargs)


def _serve(model, heads, policy, cache, trace, steps) -> tuple[float, object]:
    from skvs_jax.serve import engine

    e = _engine(model, heads, policy, cache, steps)
    e.warmup()
    for r in trace.requests:
        e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens), request_id=r.request_id)
    t0 = time.perf_counter()
    e.run()
    return time.perf_counter() - t0, e


def measure(policy_names, steps_values, rounds: int, requests: int) -> dict:
    from reference_models import checkpoint
    from skvs_jax import policies, workloads
    from skvs_jax.config import CacheConfig

    model, heads = checkpoint.load_shipped()
    cache = CacheConfig(num_blocks=65, block_size=8, max_seqs=8, max_blocks_per_seq=16)
    trace = workloads.tiny_model_trace("system_prompts", requests, seed=0, rate=None, max_output_len=32)
    configs = [(p, s) for p in policy_names for s in steps_values]
    rows = {c: [] for c in configs}
    for c in configs:  # rehearsal: compiles, and runs every kernel once
        _serve(model, heads, policies.preset(c[0]), cache, trace, c[1])
    for r in range(rounds):
        for c in configs[r % len(configs):] + configs[: r % len(configs)]:
            policy = policies.preset(c[0])
            wall, e = _serve(model, heads, policy, cache, trace, c[1])
            totals: list[float] = []
            with _timed_programs(totals):
                serial, e_dev = _serve(model, heads, policy, cache, trace, c[1])
            device = sum(totals)
            steps = len(e.step_log)
            tokens = sum(len(x.tokens) for x in e.requests.values())
            log = getattr(e, "dispatch_log", [])
            dispatches = len([d for d in log if d["steps"]]) or steps
            rows[c].append(dict(wall_s=wall, serial_s=serial, device_s=device, host_share=1 - device / serial,
                                visible=max(0.0, wall - device) / wall, steps=steps, dispatches=dispatches,
                                sent=len(log) or steps, per_request=dispatches / len(trace.requests),
                                admitted=sum(d.get("admitted", 0) for d in log),
                                host_ms_per_step=1e3 * (serial - device) / steps, tok_s=tokens / wall,
                                same_steps=len(e_dev.step_log) == steps))
    return {f"{p} N={s}": v for (p, s), v in rows.items()}


def run(args: argparse.Namespace) -> int:
    names = [n for n in args.policies.split(",") if n]
    if _has_dispatch():
        steps = [s if s == "auto" else int(s) for s in args.steps_per_dispatch.split(",")]
    else:
        steps = ["legacy"]
    if args.rounds < 1:
        raise SystemExit("skvs micro host: --rounds must be >= 1")
    out = measure(names, steps, args.rounds, args.requests)
    print(f"skvs micro host: {args.requests} requests, jax {jax.__version__} on {jax.devices()[0].platform}, "
          f"{args.rounds} rounds (medians). serial: the run with each program waited for; host % = 1 - program "
          "time / serial wall; visible % = (wall - program time) / wall, the device's idle share as served (0: "
          "the host's work is hidden)")
    print(f"{'config':<20}{'wall s':>8}{'serial s':>9}{'prog s':>8}{'host %':>8}{'visible %':>10}"
          f"{'host ms/step':>13}{'steps':>7}{'dispatches':>11}{'sent':>6}{'/request':>9}{'admitted':>9}{'tok/s':>8}")
    for name, rs in out.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "same_steps"}
        print(f"{name:<20}{med['wall_s']:>8.3f}{med['serial_s']:>9.3f}{med['device_s']:>8.3f}"
              f"{100 * med['host_share']:>8.1f}{100 * med['visible']:>10.1f}{med['host_ms_per_step']:>13.2f}"
              f"{med['steps']:>7.0f}{med['dispatches']:>11.0f}{med['sent']:>6.0f}{med['per_request']:>9.2f}"
              f"{med['admitted']:>9.0f}{med['tok_s']:>8.0f}")
        if not all(r["same_steps"] for r in rs):
            print(f"  warning: {name}: the timed and untimed runs took different steps")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="micro_host", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
