"""`skvs micro allocator`: one batched allocator step, three implementations, one run.

The step is what an engine does per decode step with speculation: allocate one decode slot per sequence,
allocate K draft slots (generation = step), commit a random accepted prefix (1 + leading accepted drafts of a
random accept mask), reclaim expired speculative-pool blocks. It is timed for

  1. the batched JAX allocator (`skvs_jax.allocator`), jitted with the state donated: the two allocations as two
     calls (`allocate`, `allocate_speculative`) and as the scheduler makes them, one `allocate_step` (one pass,
     one scatter per table), calls of the two alternated; both must end in the same state;
  2. a JAX page manager that searches one free block at a time in `lax.fori_loop` (the way MaxText's former
     page manager worked), doing the same block work without a speculative pool;
  3. the plain-Python oracle (`skvs_jax.oracle`), the same semantics one block at a time.

Every implementation starts from the same state and sees the same accept masks; the batched allocator and the
oracle must end in exactly the same state (checked and printed). Times are medians over steps after warm-up.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from skvs_jax import testing
from skvs_jax.arrays import i32
from skvs_jax.commands.micro_common import add_pool_arguments, check_minimums, median_us
from skvs_jax.config import CacheConfig, SpecConfig
from skvs_jax.kv import allocator
from skvs_jax.testing.oracle import OracleAllocator


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pool_arguments(parser, seqs_help="sequences in the batch (B)", max_blocks_per_seq=256)
    parser.add_argument("--steps", type=int, default=200, help="timed steps of the batched allocator")
    parser.add_argument("--steps-per-call", type=int, default=20, help="steps run under one lax.scan per call")
    parser.add_argument("--dispatch-steps", type=int, default=30, help="steps timed one jitted call each")
    parser.add_argument("--seed", type=int, default=0)


# ------------------------------------------------------------------------ the sequential-search baseline


def _sequential_init(cfg: CacheConfig, table: np.ndarray, num_blocks: np.ndarray, lengths: np.ndarray):
    used = np.zeros(cfg.num_blocks, np.int32)
    used[0] = 1  # the null block
    used[table[table > 0]] = 1
    return dict(
        used=jnp.asarray(used), table=jnp.asarray(table), num_blocks=jnp.asarray(num_blocks),
        lengths=jnp.asarray(lengths),
    )


def _sequential_step(pm, accepted, *, cfg: CacheConfig, draft_len: int):
    """Grow each sequence by 1 + K slots, one sequence and one block at a time; then roll back rejections."""
    s, max_new = cfg.block_size, -(-(1 + draft_len) // cfg.block_size) + 1

    def grow(b, pm):
        need = (pm["lengths"][b] + 1 + draft_len + s - 1) // s - pm["num_blocks"][b]

        def take_one(j, pm):
            def take(pm):
                blk = jnp.argmin(pm["used"]).astype(i32)  # linear search for the first free block
                col = pm["num_blocks"][b]
                return dict(
                    pm,
                    used=pm["used"].at[blk].set(1),
                    table=pm["table"].at[b, col].set(blk),
                    num_blocks=pm["num_blocks"].at[b].add(1),
                )

            return jax.lax.cond(j < need, take, lambda pm: pm, pm)

        return jax.lax.fori_loop(0, max_new, take_one, pm)

    pm = jax.lax.fori_loop(0, pm["lengths"].shape[0], grow, pm)

    def settle(b, pm):
        new_len = pm["lengths"][b] + accepted[b]
        keep = (new_len + s - 1) // s

        def drop_one(j, pm):
            col = keep + j
            live = col < pm["num_blocks"][b]
            blk = pm["table"][b, jnp.minimum(col, cfg.max_blocks_per_seq - 1)]
            return dict(
                pm,
                used=pm["used"].at[jnp.where(live, blk, cfg.num_blocks)].set(0, mode="drop"),
                table=pm["table"].at[b, jnp.where(live, col, cfg.max_blocks_per_seq)].set(0, mode="drop"),
            )

        pm = jax.lax.fori_loop(0, max_new, drop_one, pm)
        return dict(
            pm,
            num_blocks=pm["num_blocks"].at[b].min(keep),
            lengths=pm["lengths"].at[b].set(new_len),
        )

    return jax.lax.fori_loop(0, pm["lengths"].shape[0], settle, pm)


# ------------------------------------------------------------------------------------------------ run


def run(args: argparse.Namespace) -> int:
    """The benchmark as one procedure, read top to bottom: the checks, the oracle's run and the batched step's
    (results compared), then each timed variant and the report. It runs over 100 lines because each timing's
    setup sits beside the loop it times, so what a figure measures is read in one place."""
    # --dispatch-steps >= 2: one untimed call, then at least one timed.
    check_minimums(args, "micro allocator", (("seqs", 1), ("blocks", 2), ("block_size", 1), ("max_blocks_per_seq", 1),
                                             ("steps", 1), ("steps_per_call", 1), ("dispatch_steps", 2),
                                             ("draft_len", 0)))
    b, k = args.seqs, args.draft_len
    try:
        cfg = CacheConfig(num_blocks=args.blocks, block_size=args.block_size, max_seqs=b,
                          max_blocks_per_seq=args.max_blocks_per_seq)
    except ValueError as err:
        raise SystemExit(f"skvs micro allocator: {err}") from None
    spec = SpecConfig(draft_len=k, generation_threshold=8)
    rng = np.random.default_rng(args.seed)
    chunk = args.steps_per_call
    calls = max(1, args.steps // chunk)
    total = (calls + 1) * chunk + args.dispatch_steps  # warm-up call + timed calls + per-call steps
    headroom = total * (1 + k) + 2 * cfg.block_size
    if headroom >= cfg.max_tokens_per_seq:
        raise SystemExit("skvs micro allocator: --steps too large for --max-blocks-per-seq: sequences would outgrow "
                         "their tables")
    prompt = rng.integers(1, cfg.max_tokens_per_seq - headroom, size=b).astype(np.int32)
    masks = rng.random((total, b, k)) < args.accept_prob
    accepted = (1 + np.cumprod(masks, axis=-1).sum(-1)).astype(np.int32)  # decode token + accepted drafts

    # Common starting point: every sequence prefilled with its prompt.
    st = allocator.init(cfg)
    st, res = allocator.allocate(st, jnp.asarray(prompt), cfg=cfg, spec=spec)
    if not bool(np.all(res.ok)):
        raise SystemExit("skvs micro allocator: the pool cannot hold the prompts: raise --blocks")
    st, _ = allocator.commit(st, jnp.asarray(prompt), cfg=cfg, spec=spec)
    oracle = OracleAllocator(cfg, spec)
    oracle.allocate(prompt)
    oracle.commit(prompt)
    in_use = int(np.asarray(st.seqs.num_blocks).sum())

    ones, drafts = jnp.ones((b,), i32), jnp.full((b,), k, i32)
    # A decode step touches at most the partial last block plus the blocks of 1 + K new slots; the engine
    # passes the same static window for decode steps (commit falls back to the full table if it must).
    window = -(-(1 + k) // cfg.block_size) + 1

    def settle(st, r1, r2, accepted, gen):
        st, _ = allocator.commit(st, accepted, cfg=cfg, spec=spec, window=window)
        st, _ = allocator.reclaim_expired(st, gen, spec.generation_threshold)
        # Two reductions, not one `sums`: stacking r1.ok with r2.ok keeps r1 alive across the second call, which
        # made the two-call program ~8 us a step slower, measured.
        return st, jnp.sum(~r1.ok, dtype=i32) + jnp.sum(~r2.ok, dtype=i32)

    def floor_step(st, accepted, gen):  # the scan's own cost: carry the state, count two [B] masks, allocate nothing
        return st, jnp.sum(accepted < 0, dtype=i32) + jnp.sum(accepted > 1 + k, dtype=i32)

    def step(st, accepted, gen):
        st, r1 = allocator.allocate(st, ones, cfg=cfg, spec=spec, window=window)
        st, r2 = allocator.allocate_speculative(st, drafts, gen, cfg=cfg, spec=spec, window=window)
        return settle(st, r1, r2, accepted, gen)

    def step_one_pass(st, accepted, gen):
        st, r1, r2 = allocator.allocate_step(st, ones, drafts, gen, cfg=cfg, spec=spec, window=window)
        return settle(st, r1, r2, accepted, gen)

    def steps(st, accepted, gens):  # `chunk` steps in one program: the in-graph cost, no per-call dispatch
        return jax.lax.scan(lambda st, xs: step(st, *xs), st, (accepted, gens))

    def steps_one_pass(st, accepted, gens):
        return jax.lax.scan(lambda st, xs: step_one_pass(st, *xs), st, (accepted, gens))

    def steps_floor(st, accepted, gens):
        return jax.lax.scan(lambda st, xs: floor_step(st, *xs), st, (accepted, gens))

    steps_jit = jax.jit(steps, donate_argnums=0)
    steps_one_pass_jit = jax.jit(steps_one_pass, donate_argnums=0)
    steps_floor_jit = jax.jit(steps_floor, donate_argnums=0)
    step_jit = jax.jit(step, donate_argnums=0)
    acc_dev = jnp.asarray(accepted)
    gens = jnp.arange(total, dtype=i32)

    def oracle_step(t: int) -> None:
        oracle.allocate([1] * b)
        oracle.allocate_speculative([k] * b, t)
        oracle.commit(accepted[t])
        oracle.reclaim_expired(t, spec.generation_threshold)

    # 1. batched JAX allocator: warm-up call, then timed calls of `chunk` steps each, the two allocations as two
    # calls and as one pass alternated, each on its own copy of the state, with the scan's floor (the same scan
    # and state, a step that allocates nothing) between them. Each timed call follows an untimed one of the same
    # program on the same state (its next steps), so each is timed with its state in cache, as a lone allocator
    # would be, rather than after another's program evicted it.
    failures, times, one_pass_times, floor_times = 0, [], [], []
    st_one_pass, st_floor = jax.tree.map(jnp.copy, st), jax.tree.map(jnp.copy, st)
    chunks = [(acc_dev[c * chunk : (c + 1) * chunk], gens[c * chunk : (c + 1) * chunk]) for c in range(calls + 1)]

    def timed(fn, st, acc_c, gens_c):
        t0 = time.perf_counter()
        st, fails = fn(st, acc_c, gens_c)
        jax.block_until_ready(st)
        return st, int(fails.sum()), (time.perf_counter() - t0) / chunk

    states = {"two calls": st, "one pass": st_one_pass, "floor": st_floor}
    programs = {"two calls": steps_jit, "one pass": steps_one_pass_jit, "floor": steps_floor_jit}
    timings = {"two calls": times, "one pass": one_pass_times, "floor": floor_times}
    for c in range(0, len(chunks), 2):  # per variant, a pair of calls: the first warms, the second is timed
        pair = chunks[c : c + 2]
        refused = {}
        for variant in rng.permutation(list(states)):  # which goes first, drawn per round: noise lands on both
            for acc_c, gens_c in pair:
                states[variant], f, dt = timed(programs[variant], states[variant], acc_c, gens_c)
                refused[variant] = refused.get(variant, 0) + f
            timings[variant] += [dt] if len(pair) == 2 else []
        if refused["two calls"] != refused["one pass"]:
            raise AssertionError("allocate_step and the two calls refused different requests")
        failures += refused["two calls"]
    st, st_one_pass = states["two calls"], states["one pass"]
    jax_us, one_pass_us, timed_calls = median_us(times), median_us(one_pass_times), len(times)
    floor_us = median_us(floor_times)
    jax.tree.map(np.testing.assert_array_equal, st_one_pass, st)  # the same state, block for block
    # ... and one jitted call per step, dispatch included.
    first = (calls + 1) * chunk
    st, fails = step_jit(st, acc_dev[first], gens[first])
    times = []
    per_step = [(acc_dev[t], gens[t]) for t in range(first + 1, total)]  # sliced before timing
    for acc_t, gen_t in per_step:
        t0 = time.perf_counter()
        st, fails = step_jit(st, acc_t, gen_t)
        jax.block_until_ready(st)
        times.append(time.perf_counter() - t0)
        failures += int(fails)
    jax_call_us = median_us(times)

    # 3. plain-Python oracle on exactly the same work, then the two states must agree block for block.
    times = []
    for t in range(total):
        t0 = time.perf_counter()
        oracle_step(t)
        times.append(time.perf_counter() - t0)
    oracle_us = median_us(times)
    testing.assert_matches_oracle(st, oracle)

    # 2. sequential fori_loop search on the same prompts and accept counts, timed the same way.
    table = np.zeros((b, cfg.max_blocks_per_seq), np.int32)
    nb = -(-prompt // cfg.block_size)
    for i in range(b):  # any layout will do: the baseline's cost does not depend on which ids it holds
        table[i, : nb[i]] = 1 + np.arange(nb[:i].sum(), nb[: i + 1].sum())
    pm = _sequential_init(cfg, table, nb, prompt)

    def seq_steps(pm, accepted):
        return jax.lax.scan(lambda pm, a: (_sequential_step(pm, a, cfg=cfg, draft_len=k), None), pm, accepted)[0]

    seq_jit = jax.jit(seq_steps, donate_argnums=0)
    seq_calls = min(max(2, calls // 4), calls)  # chunks[1..calls] exist
    times = []
    for c in range(seq_calls + 1):
        acc_c = chunks[c][0]
        t0 = time.perf_counter()
        pm = jax.block_until_ready(seq_jit(pm, acc_c))
        if c:
            times.append((time.perf_counter() - t0) / chunk)
    seq_us = median_us(times)
    assert int(np.asarray(pm["num_blocks"]).sum()) == int(np.sum(-(-np.asarray(pm["lengths"]) // cfg.block_size)))

    print("skvs micro allocator: allocate(1) + allocate_speculative(K) + commit(random accept) + reclaim, per step")
    print(
        f"  setup: B={b} sequences, N={cfg.num_blocks:,} blocks x S={cfg.block_size} tokens, "
        f"M={cfg.max_blocks_per_seq} blocks/seq, K={k}, accept p={args.accept_prob}, window={window} columns, "
        f"{in_use:,} blocks in use at start; jax {jax.__version__} on {jax.devices()[0].platform}"
    )
    print(f"  allocation failures during the run: {failures}; batched jax (both forms) and python oracle end in "
          f"identical states")
    print(f"  timing: median over calls of {chunk} steps under one lax.scan (in-graph cost, as inside an engine step)")
    print(f"  batched jax allocator (jit, state donated)  median {jax_us:10.1f} us/step  ({timed_calls} calls)")
    print(f"  ... allocate_step: slots + drafts one pass  median {one_pass_us:10.1f} us/step  ({timed_calls} calls, "
          f"alternated in pairs; {one_pass_us / jax_us:.2f}x the two calls)")
    print(f"  ... the scan's floor: a step that allocates nothing  {floor_us:5.1f} us/step (the same scan, state and "
          f"refusal count; net of it: two calls {jax_us - floor_us:.1f}, allocate_step {one_pass_us - floor_us:.1f})")
    print(f"  sequential jax search (fori_loop, argmin)   median {seq_us:10.1f} us/step  ({seq_calls} calls)")
    print(f"  plain-python oracle                         median {oracle_us:10.1f} us/step  ({total} steps)")
    print(f"  batched jax, one jitted call per step (dispatch included): median {jax_call_us:.1f} us/step, "
          f"{oracle_us / jax_call_us:.1f}x vs oracle")
    print(f"allocator speedup vs sequential jax search: {seq_us / jax_us:.1f}x")
    print(f"allocator speedup vs python oracle: {oracle_us / jax_us:.1f}x")
    return 0
