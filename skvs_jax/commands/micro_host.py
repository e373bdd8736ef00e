"""`skvs micro host`: how much of the serving loop's wall time is the host's, per policy and steps per dispatch.

Each configuration serves `skvs bench`'s default trace (32 requests of shared system prompts, all at t = 0, the
shipped tiny model, 64 KV blocks of 8, 8 slots, token budget 128, prefill chunk 32) twice on a warm engine with a
flat step cost (so every run makes the same schedule):

  wall    the run as a user runs it (`Engine.run`: on this tree the overlapped loop)
  device  the same run with every program call timed from the call until its outputs are ready, one at a time:
          the programs' own time (the call's argument handling included, a few tens of microseconds)

host share = 1 - device / wall: the part of the wall time in which no program ran. With N > 1 steps per
dispatch the overlapped run can hide host work under the next dispatch, so the share can approach 0.

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
    """Every serving program call blocks until its outputs are ready; its time is appended to `totals`."""
    if _has_dispatch():
        from skvs_jax.serve import dispatch as module

        name = "run_steps"
    else:
        from skvs_jax.serve import engine_step as module

        name = "fused_step"
    original = getattr(module, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = jax.block_until_ready(original(*args, **kwargs))
        totals.append(time.perf_counter() - t0)
        return out

    setattr(module, name, timed)
    try:
        yield
    finally:
        setattr(module, name, original)


def _engine(model, heads, policy, cache, steps):
    from skvs_jax.serve import engine

    kwargs = dict(token_budget=128, prefill_chunk=32, step_cost="flat")
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
    from reference_models import checkpoint, train
    from skvs_jax import policies, workloads
    from skvs_jax.config import CacheConfig

    model = checkpoint.load_llama(train.WEIGHTS_DIR / "tiny_llama")
    heads = checkpoint.load_medusa(train.WEIGHTS_DIR / "tiny_llama_medusa")
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
                _, e_dev = _serve(model, heads, policy, cache, trace, c[1])
            device = sum(totals)
            steps = len(e.step_log)
            tokens = sum(len(x.tokens) for x in e.requests.values())
            dispatches = len([d for d in getattr(e, "dispatch_log", []) if d["steps"]]) or steps
            rows[c].append(dict(wall_s=wall, device_s=device, host_share=1 - device / wall, steps=steps,
                                dispatches=dispatches, per_request=dispatches / len(trace.requests),
                                host_ms_per_step=1e3 * (wall - device) / steps, tok_s=tokens / wall,
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
          f"{args.rounds} rounds (medians); host share = 1 - program time / wall time")
    print(f"{'config':<24}{'wall s':>8}{'prog s':>8}{'host %':>8}{'host ms/step':>14}{'steps':>7}"
          f"{'dispatches':>12}{'/request':>10}{'tok/s':>8}")
    for name, rs in out.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "same_steps"}
        print(f"{name:<24}{med['wall_s']:>8.2f}{med['device_s']:>8.2f}{100 * med['host_share']:>8.1f}"
              f"{med['host_ms_per_step']:>14.2f}{med['steps']:>7.0f}{med['dispatches']:>12.0f}"
              f"{med['per_request']:>10.2f}{med['tok_s']:>8.0f}")
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
