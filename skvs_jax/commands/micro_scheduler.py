"""`skvs micro scheduler`: one scheduler step (schedule + update, no model) for a full decode batch, two ways.

The step is everything an engine does per step besides running the model: free finished slots, grant tokens,
check memory and preempt, size drafts, admit, allocate, then commit a random accepted prefix, append tokens,
index whole validated blocks in the prefix cache and reclaim expired pool blocks. It is timed for

  1. the jitted scheduler (`skvs_jax.scheduler`): in-graph, several steps under one `lax.scan` per call (the
     cost inside an engine's jitted step or the simulator), and one jitted call per step (dispatch included);
  2. the plain-Python oracle scheduler (`skvs_jax.oracle_scheduler`): the same decisions one sequence at a time.

Both start empty, admit the same requests (half of them share a system prompt), prefill them, and then decode
with the same accept counts and tokens; at the end they must hold exactly the same allocator state and prefix
index (checked). Times are medians over steps after warm-up.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from skvs_jax import policies, testing
from skvs_jax import scheduler as sc
from skvs_jax.commands.micro_common import (
    add_pool_arguments,
    check_minimums,
    decode_requests,
    median_us,
    step_draws,
)
from skvs_jax.config import CacheConfig
from skvs_jax.testing.oracle_scheduler import OracleScheduler


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pool_arguments(parser, seqs_help="running sequences (B)", max_blocks_per_seq=128)
    parser.add_argument("--policy", default="skvs", choices=sorted(policies.PRESETS), help="scheduling policy")
    parser.add_argument("--prompt-len", type=int, default=512, help="mean prompt length (tokens)")
    parser.add_argument("--steps-per-call", type=int, default=10, help="steps run under one lax.scan per call")
    parser.add_argument("--calls", type=int, default=5, help="timed calls (the oracle repeats every step)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    """The benchmark as one procedure, read top to bottom: the checks, a pool filled to decode, the oracle
    scheduler's steps and the jitted ones (compared), the timed loops and the report. It runs over 100 lines
    because each timing's setup sits beside the loop it times, so what a figure measures is read in one place."""
    check_minimums(args, "micro scheduler", (("seqs", 1), ("blocks", 1), ("block_size", 1), ("max_blocks_per_seq", 1),
                                             ("prompt_len", 1), ("steps_per_call", 1), ("calls", 1), ("draft_len", 0)))
    b, k = args.seqs, args.draft_len
    try:
        cache = CacheConfig(num_blocks=args.blocks, block_size=args.block_size, max_seqs=b,
                            max_blocks_per_seq=args.max_blocks_per_seq)
        policy = policies.preset(args.policy, k)
    except ValueError as err:
        raise SystemExit(f"skvs micro scheduler: {err}") from None
    k = policy.draft_len
    budget = max(b * (1 + k), 4 * args.prompt_len)
    cfg = sc.SchedulerConfig(cache=cache, policy=policy, max_running=b, token_budget=budget, admit_window=32)
    knobs = policy.knobs()
    rng = np.random.default_rng(args.seed)
    max_len = cfg.max_len

    # Requests: half share a system prompt of a quarter of the mean prompt; all decode for longer than the run.
    prompts, lens, max_new = decode_requests(rng, b, args.prompt_len, max_len)

    st = sc.init(cfg)
    oracle = OracleScheduler(cfg)
    st, slots = sc.add(st, jnp.asarray(prompts), jnp.asarray(lens), jnp.asarray(max_new), cfg=cfg)
    oracle.add([list(p[:n]) for p, n in zip(prompts, lens)], max_new)

    def draw(t: int):
        return step_draws(args.seed, t, b, k, args.accept_prob)

    def jax_step(st, xs):
        acc, nxt, drafts = xs
        st, batch = sc.schedule_unchecked(st, knobs, cfg=cfg)
        st, _ = sc.update_unchecked(st, batch, acc, nxt, drafts, jnp.zeros((b,), bool), knobs, cfg=cfg)
        return st, batch.alloc_ok

    step_jit = jax.jit(jax_step, donate_argnums=0)
    scan_jit = jax.jit(lambda st, xs: jax.lax.scan(jax_step, st, xs), donate_argnums=0)

    def oracle_step(t: int) -> None:
        acc, nxt, drafts = draw(t)
        ob = oracle.schedule(knobs)
        oracle.update(ob, acc, nxt, drafts, np.zeros(b, bool), knobs)

    # Prefill everyone (both implementations, same inputs), until every sequence decodes.
    t = 0
    ok = True
    # A generous bound on the prefill steps (prompt tokens over the budget, plus preemption churn); a batch that
    # has not reached decode by then never will.
    limit = 4 * -(-int(lens.sum()) // budget) + 2 * b + 10
    while True:
        decoding = np.asarray(sc.decoding_rows(st.seqs.status, st.seqs.num_tokens, st.kv.alloc.seqs.num_committed,
                                               st.seqs.prompt_len))
        if decoding.all() or t > limit:
            break
        st, good = step_jit(st, tuple(jnp.asarray(x) for x in draw(t)))
        ok &= bool(good)
        oracle_step(t)
        t += 1
    if not decoding.all():  # the timings would describe a smaller batch than the one they name
        raise SystemExit(f"skvs micro scheduler: after {t} prefill steps only {int(decoding.sum())} of {b} sequences "
                         f"decode (the pool or the table is too small): raise --blocks or --max-blocks-per-seq, or "
                         f"lower --seqs or --prompt-len")
    prefill_steps = t
    in_use = cache.usable_blocks - int(st.kv.alloc.blocks.free_top)

    # 1a. In-graph: steps_per_call steps under one scan, median over calls (the first call compiles).
    n = args.steps_per_call
    times = []
    for call in range(args.calls + 1):
        draws = [draw(t + i) for i in range(n)]
        xs = tuple(jnp.asarray(np.stack([d[j] for d in draws])) for j in range(3))
        t0 = time.perf_counter()
        st, good = scan_jit(st, xs)
        jax.block_until_ready(st)
        if call:
            times.append((time.perf_counter() - t0) / n)
        ok &= bool(np.all(np.asarray(good)))
        t += n
    jax_us = median_us(times)

    # 1b. One jitted call per step (the first of these compiles the unscanned step).
    times = []
    for i in range(args.calls + 1):
        xs = tuple(jnp.asarray(x) for x in draw(t))
        t0 = time.perf_counter()
        st, good = step_jit(st, xs)
        jax.block_until_ready(st)
        if i:
            times.append(time.perf_counter() - t0)
        ok &= bool(good)
        t += 1
    jax_call_us = median_us(times)

    # 2. The oracle does the same steps, each timed; then both must hold the same state.
    times = []
    for i in range(prefill_steps, t):
        t0 = time.perf_counter()
        oracle_step(i)
        times.append(time.perf_counter() - t0)
    oracle_us = median_us(times)
    testing.assert_matches_oracle(st.kv.alloc, oracle.alloc)
    same_index = testing.prefix_index_as_dict(st.kv.prefix, cfg.prefix, salted=True) == oracle.index.index
    ok &= same_index

    running = int(np.sum(np.asarray(st.seqs.status) == sc.RUNNING))
    if running < b:
        raise SystemExit(f"skvs micro scheduler: only {running} of {b} sequences still ran at the end (they reached "
                         f"their output limit or were preempted): raise --max-blocks-per-seq, or lower --calls or "
                         f"--steps-per-call")
    c = st.counters
    print("skvs micro scheduler: schedule + update (no model) per step, full decode batch")
    print(f"  setup: B={b} running sequences, N={cache.num_blocks:,} blocks x S={cache.block_size} tokens, "
          f"M={cache.max_blocks_per_seq}, K={k}, policy {policy.name}, token budget {budget}, accept p="
          f"{args.accept_prob}; {in_use:,} blocks in use after {prefill_steps} prefill steps; "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")
    print(f"  run: {int(c.steps)} steps, {int(c.output_tokens):,} tokens, {int(c.drafted):,} drafted, "
          f"{int(c.accepted):,} accepted, {int(c.cached_tokens):,} prompt tokens from the prefix cache, "
          f"allocation always ok: {ok}; jitted and python schedulers end in identical states: {same_index}")
    print(f"  jitted scheduler, in-graph ({n} steps per lax.scan)  median {jax_us:10.1f} us/step "
          f"({args.calls} calls)")
    print(f"  jitted scheduler, one call per step (dispatch incl.) median {jax_call_us:10.1f} us/step")
    print(f"  plain-python oracle scheduler                       median {oracle_us:10.1f} us/step "
          f"({t - prefill_steps} steps)")
    print(f"  one call per step: {oracle_us / jax_call_us:.1f}x vs oracle")
    print(f"scheduler speedup vs python oracle: {oracle_us / jax_us:.1f}x")
    return 0 if ok else 1
