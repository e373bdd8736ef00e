"""Sweeps: many simulations of one policy in one compiled call, lanes vmapped or mapped, and split over devices.

A lane is one simulation. Everything that differs between lanes is data, so all lanes share one program:

  knobs          the policy's numeric knobs (draft length, max_spec_ratio, generation threshold)
  kv_blocks      the KV budget in blocks (`kv.manager.with_budget`)
  arrival_scale  arrival times are multiplied by it: a Poisson trace at rate r becomes one at rate r / scale with
                 the same requests in the same order (exponential gaps scale with their mean). Every gap scales,
                 so a multi-turn trace's think times would shrink too: `skvs simulate --sweep` stacks a trace
                 per rate for such workloads instead
  trace          which of the stacked traces to run (traces of different seeds, or workloads, stacked by
                 `stack`; they must share the request count and the table widths)

What is static (and so needs its own compiled program): the policy's switches, the cache geometry and the
batch-size bound (`SchedulerConfig`), the cost model, and the number of steps. Comparing policies is therefore
one call per policy; sweeping load, memory, knobs and seeds within a policy is one call.

A device runs its lanes vectorised (`strategy="vmap"`) or one after another in the same program (`"map"`).
Under vmap the scheduler's skips (`skvs_jax.vmap_flow`) run a branch when some lane needs it and select only when
lanes disagree (never, for updates that mask themselves), but every gather and scatter gains a batch axis, and a
skip that some lanes take and others do not runs for all: on a CPU vmap costs ~1.2-1.5x what separate runs cost,
while map costs about what they cost (docs/simulator.md). `run(..., mesh=mesh)` splits the lanes over the mesh's
`dp` axis with `jax.shard_map`: each device runs its own lanes and no data crosses devices. Lanes are padded to a
multiple of the axis size by repeating the last lane.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from skvs_jax import distributed
from skvs_jax import scheduler as sc
from skvs_jax.policies import NO_VERIFY_CAP, Knobs
from skvs_jax.sim import simulate
from skvs_jax.sim.cost_model import CostModel
from skvs_jax.sim.simulate import SimLog, SimTrace, summarize, summarize_groups

DP = distributed.DP  # the mesh axis lanes are sharded over


@struct.dataclass
class Lane:
    """One simulation's data; batch every leaf along a leading axis [lanes] for a sweep."""

    knobs: Knobs
    kv_blocks: jax.Array  # int32[]
    arrival_scale: jax.Array  # float32[]
    trace: jax.Array  # int32[] index into the stacked traces


def stack(traces: Sequence[SimTrace]) -> SimTrace:
    """Stack traces of equal shapes (same request count and `SchedulerConfig`) along a new leading axis [traces]."""
    if not traces:
        raise ValueError("traces must hold at least one SimTrace")
    shapes = {tuple(x.shape for x in jax.tree.leaves(t)) for t in traces}
    if len(shapes) != 1:
        raise ValueError("traces must have equal shapes: the same number of requests and the same SchedulerConfig")
    return jax.tree.map(lambda *xs: jnp.stack(xs), *traces)


def grid(base: Knobs, *, cfg: sc.SchedulerConfig, draft_len: Sequence[int] | None = None,
         max_spec_ratio: Sequence[float] | None = None, kv_blocks: Sequence[int] | None = None,
         arrival_scale: Sequence[float] = (1.0,), traces: Sequence[int] = (0,),
         verify_budget: Sequence[int] | None = None) -> tuple[Lane, list[dict]]:
    """The Cartesian product of the given values as batched lanes [lanes], and one label dict per lane (same order).
    Omitted knobs keep `base`'s value; kv_blocks defaults to the whole pool."""
    axes = {
        "draft_len": list(draft_len) if draft_len is not None else [int(base.draft_len)],
        "max_spec_ratio": list(max_spec_ratio) if max_spec_ratio is not None else [float(base.max_spec_ratio)],
        "kv_blocks": list(kv_blocks) if kv_blocks is not None else [cfg.cache.usable_blocks],
        "arrival_scale": list(arrival_scale),
        "trace": list(traces),
        "verify_budget": list(verify_budget) if verify_budget is not None else [int(base.verify_budget)],
    }
    for name, values in axes.items():
        if not values:
            raise ValueError(f"{name} must hold at least one value")
    labels = [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]
    col = lambda name, dtype: jnp.asarray(np.asarray([lab[name] for lab in labels], dtype))  # noqa: E731
    lanes = Lane(
        knobs=Knobs(draft_len=col("draft_len", np.int32), max_spec_ratio=col("max_spec_ratio", np.float32),
                    generation_threshold=jnp.full((len(labels),), base.generation_threshold, jnp.int32),
                    verify_budget=col("verify_budget", np.int32)),
        kv_blocks=col("kv_blocks", np.int32), arrival_scale=col("arrival_scale", np.float32),
        trace=col("trace", np.int32))
    _check_lanes(lanes, cfg)
    return lanes, labels


def _check_lanes(lanes: Lane, cfg: sc.SchedulerConfig) -> None:
    """The lanes' values must be ones the static configuration can run (out of range, data would run anyway)."""
    k, usable = cfg.policy.draft_len, cfg.cache.usable_blocks
    for name, values, lo, hi, why in (
            ("draft_len", lanes.knobs.draft_len, 0, k, " (the policy's static K)"),
            ("max_spec_ratio", lanes.knobs.max_spec_ratio, 0, 1, ""),
            ("kv_blocks", lanes.kv_blocks, 1, usable, " (the static pool)"),
            ("verify_budget", lanes.knobs.verify_budget, 1, NO_VERIFY_CAP, "")):
        v = np.asarray(values)
        if np.any(~((v >= lo) & (v <= hi))):  # NaN is outside
            raise ValueError(f"{name} values must lie in [{lo}, {hi}]{why}, got {v.tolist()}")
    if not np.all(np.asarray(lanes.arrival_scale) > 0):
        raise ValueError(f"arrival_scale values must be > 0, got {np.asarray(lanes.arrival_scale).tolist()}")


def _lane_trace(traces: SimTrace, ln: Lane) -> SimTrace:
    trace = jax.tree.map(lambda x: x[ln.trace], traces)
    return trace.replace(arrival=trace.arrival * ln.arrival_scale)


STRATEGIES = ("vmap", "map")


def _over_lanes(fn, strategy: str):
    """fn over the leading lane axis of its arguments: vectorised (vmap) or one lane after another (lax.map)."""
    if strategy == "vmap":
        return jax.vmap(fn)
    return lambda *args: jax.lax.map(lambda a: fn(*a), args)


def _start(traces, lanes, *, cfg, strategy):
    return _over_lanes(lambda ln: simulate.start(_lane_trace(traces, ln), cfg, ln.kv_blocks), strategy)(lanes)


def _advance(carry, traces, lanes, *, cfg, cost, steps, strategy):
    def one(c, ln):
        c, rows = simulate.advance(c, _lane_trace(traces, ln), ln.knobs, cfg=cfg, cost=cost, steps=steps)
        return c, rows, simulate.done(c)

    return _over_lanes(one, strategy)(carry, lanes)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "strategy"))
def _start_jit(traces, lanes, *, cfg, mesh, strategy):
    body = functools.partial(_start, cfg=cfg, strategy=strategy)
    if mesh is None:
        return body(traces, lanes)
    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(DP)), out_specs=P(DP), check_vma=False)(traces, lanes)


@functools.partial(jax.jit, static_argnames=("cfg", "cost", "steps", "mesh", "strategy"), donate_argnums=(0,))
def _advance_jit(carry, traces, lanes, *, cfg, cost, steps, mesh, strategy):
    body = functools.partial(_advance, cfg=cfg, cost=cost, steps=steps, strategy=strategy)
    if mesh is None:
        return body(carry, traces, lanes)
    return jax.shard_map(body, mesh=mesh, in_specs=(P(DP), P(), P(DP)), out_specs=(P(DP), P(DP), P(DP)),
                         check_vma=False)(carry, traces, lanes)


def run(traces: SimTrace, lanes: Lane, *, cfg: sc.SchedulerConfig, cost: CostModel, max_steps: int,
        chunk: int | None = None, mesh: Mesh | None = None, strategy: str = "vmap") -> tuple[sc.SchedState, SimLog]:
    """Simulate every lane: final states and logs batched [lanes, ...] in lane order. traces: stacked [traces, ...].

    The lanes advance together `chunk` steps per compiled call (default: max_steps in one call) until every lane
    is done or max_steps (rounded up to a whole chunk) have run; the log has one row per step run, inactive
    rows (active False) after a lane is done. Under vmap a done lane still costs a select of its state while
    others run, so a chunk near the expected run length wastes the least. `finished(states)` says which lanes
    completed their trace.

    mesh: a `jax.sharding.Mesh` with a `dp` axis; lanes are split over it (padded to a multiple of its size,
    the padding dropped from the result). Any other mesh axes see replicated work.
    strategy: how a device runs its lanes: "vmap" (vectorised: a skipped branch runs when some lane needs it,
    with a select where lanes disagree, and gathers/scatters gain a batch axis; meant for wide hardware) or
    "map" (`lax.map`: one lane after another inside the same program; on a CPU the faster one, see
    docs/simulator.md). Results are identical."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
    chunk = max_steps if chunk is None else chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    if not isinstance(lanes, Lane) or not isinstance(traces, SimTrace) or traces.arrival.ndim != 2:
        raise TypeError("lanes must be a Lane (sweep.grid) and traces a stacked SimTrace (sweep.stack)")
    num = int(lanes.kv_blocks.shape[0])
    bad = [int(t) for t in np.asarray(lanes.trace) if not 0 <= int(t) < traces.arrival.shape[0]]
    if bad:
        raise ValueError(f"lane trace indices {bad} out of range for {traces.arrival.shape[0]} stacked traces")
    _check_lanes(lanes, cfg)  # lanes built by hand get grid's checks
    pad = 0
    if mesh is not None:
        distributed.check_mesh(mesh, DP)
        pad = -num % mesh.shape[DP]
        if pad:
            lanes = jax.tree.map(lambda x: jnp.concatenate([x, jnp.repeat(x[-1:], pad, axis=0)]), lanes)
        lanes = jax.device_put(lanes, NamedSharding(mesh, P(DP)))
        traces = jax.device_put(traces, NamedSharding(mesh, P()))
    carry = _start_jit(traces, lanes, cfg=cfg, mesh=mesh, strategy=strategy)
    parts, steps = [], 0
    while steps < max_steps:
        carry, rows, lane_done = _advance_jit(carry, traces, lanes, cfg=cfg, cost=cost, steps=chunk, mesh=mesh,
                                              strategy=strategy)
        parts.append(rows)
        steps += chunk
        if bool(np.all(np.asarray(lane_done))):
            break
    rows = parts[0] if len(parts) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *parts)
    out = carry.st, simulate.finish(carry, rows)
    return jax.tree.map(lambda x: x[:num], out) if pad else out


def lane(tree, i: int):
    """Lane i of a batched pytree (a state, log or `Lane`)."""
    return jax.tree.map(lambda x: x[i], tree)


def summaries(logs: SimLog, traces: SimTrace, lanes: Lane, cfg: sc.SchedulerConfig,
              breakdowns: dict[str, Sequence[np.ndarray]] | None = None) -> list[dict]:
    """`simulate.summarize` of every lane (host side), its trace's arrival times scaled as simulated, plus
    `mean_batch`: sequences per step, averaged over the lane's steps. breakdowns: name -> per trace (the lanes'
    `trace` index), the group of each request id (`simulate.summarize_groups`); each lane's dict then holds, under
    that name, the list of its groups' metrics."""
    logs, traces, lanes = jax.device_get((logs, traces, lanes))
    out = []
    for i in range(len(lanes.kv_blocks)):
        t = int(lanes.trace[i])
        trace = lane(traces, t)
        trace = trace.replace(arrival=trace.arrival * lanes.arrival_scale[i])
        log = lane(logs, i)
        m = summarize(log, trace, cfg)
        m["mean_batch"] = float(np.mean(log.num_seqs[log.active])) if log.active.any() else float("nan")
        for name, group_of in (breakdowns or {}).items():
            m[name] = summarize_groups(log, trace, group_of[t])
        out.append(m)
    return out


def finished(states: sc.SchedState) -> np.ndarray:
    """int[lanes] requests each lane finished (compare with the trace's request count: a lane short of it ran out
    of steps)."""
    return np.asarray(states.counters.finished)
