"""The engine's own step cost, fitted at warm-up from timed steps of its compiled programs (vLLM's start-up
profiling, for the goodput draft controller).

An engine computes every slot at the step's query width Q (one compiled program per width:
`serve.widths.WidthPicker`), so a step's time is set by Q, not by how many tokens the rows carry: on this
project's CPU a decode step costs about the same at Q = 1, 3 or 5 and a prompt-width step about twice that. A
token-priced `scheduler.StepCost` cannot say that; its width table can (`StepCost.width_us`, the extra time of a
step whose widest row computes w tokens):

    measure(prepare, keys)   median time of one step per compiled width, {Q: us}, on empty slots (the engine
                             also times its prompt width's split branch: priced for steps with prompt work)
    fit(times, widths, ...)  token_us = the narrowest program's time; width_us[w] = time(the narrowest compiled
                             width >= w) - that, non-decreasing in w (noise cannot make a wider program look
                             cheaper); widths compiled but not timed are interpolated between timed ones

A fit is an estimate, and carries how far it may be off (`StepCost.margin` = `FIT_MARGIN`): drafts preempt a row
only when that beats keeping it by more than the margin.

The fit is a table, so the controller evaluates it in-graph like the simulator's cost model; `Engine(...,
step_cost=...)` takes one instead (docs/speculation.md, "The engine's step cost").
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from skvs_jax import scheduler as sc

K = TypeVar("K", bound=Hashable)
MEASURE_ROUNDS = 7  # timed runs per width, interleaved across widths so a slow moment hits every width alike
# A fit's uncertainty (`StepCost.margin`, in 1/1024): 64 = 6.25%. Six `skvs bench` runs on the 2-core CPU fitted
# the prompt width's split step at 1.49-1.66x the width-1 step, and skvs's memory-starved schedule flipped with
# it: below ~1.53 the fit priced one early draft preemption ~5% better than keeping its victim, and taking it led
# to 11 preemptions and 69 steps instead of 6 and 67. With this margin the schedule held at 66-67 steps under
# every fit from 1.3x to 1.9x (docs/speculation.md, "A fitted cost's margin").
FIT_MARGIN = 64


def fit(times_us: Mapping[int, float], widths: Sequence[int], token_budget: int, max_width: int,
        margin: int = FIT_MARGIN) -> sc.StepCost:
    """The `StepCost` of a padded engine whose programs have query widths `widths` (each >= 1: the ones a step
    can run now), from measured step times (times_us: width -> microseconds, at least one; a width of `widths`
    not among them is interpolated linearly between the nearest timed ones, clamped at the ends).

    Returns token_us int32[token_budget + 1] (every entry the narrowest program's time), row_us = ctx_ns =
    head_us = 0 (the program computes every slot and its heads whatever the rows hold), width_us
    int32[max_width + 1]: width_us[w] = time(the smallest width >= w, max_width's program past the last) minus the
    narrowest's, made non-decreasing; margin (in 1/1024, `StepCost.margin`) how far the fit may be off."""
    if not times_us:
        raise ValueError("times_us must hold at least one measured width")
    if not 0 <= margin <= 1024:
        raise ValueError(f"margin must lie in [0, 1024] (1/1024 units), got {margin}")
    widths = sorted(set(int(w) for w in widths))
    if not widths or widths[0] < 1 or max_width < widths[0]:
        raise ValueError(f"widths must be >= 1 and max_width >= the narrowest, got {widths}, {max_width}")
    timed = sorted(times_us)
    at = np.interp(widths, timed, [float(times_us[w]) for w in timed])  # untimed widths: between timed ones
    cost = np.maximum.accumulate(np.maximum(at, 1.0))
    base = cost[0]
    program = np.searchsorted(widths, np.maximum(np.arange(max_width + 1), 1))  # the narrowest width >= w
    table = cost[np.minimum(program, len(widths) - 1)] - base  # non-decreasing: cost is, and so is program
    token_us = jnp.full((token_budget + 1,), int(round(base)), jnp.int32)
    zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731  (one buffer each: the engine's step donates them)
    return sc.StepCost(token_us=token_us, row_us=zero(), ctx_ns=zero(), head_us=zero(),
                       width_us=jnp.asarray(np.clip(np.round(table), 0, 2**24), jnp.int32),
                       margin=jnp.asarray(margin, jnp.int32))


def measure(prepare: Callable[[K], Callable[[], object]], keys: Sequence[K], rounds: int = MEASURE_ROUNDS
            ) -> dict[K, float]:
    """Median wall time in microseconds of one step per key (a width, or the engine's (width, branch)):
    `prepare(key)` (untimed: e.g. copying the state a step donates) returns a call that runs the compiled step
    and returns what to block on. One untimed run per key, then `rounds` rounds interleaved across the keys."""
    for key in keys:
        jax.block_until_ready(prepare(key)())
    samples: dict[K, list[float]] = {key: [] for key in keys}
    for _ in range(rounds):
        for key in keys:
            go = prepare(key)
            t0 = time.perf_counter()
            jax.block_until_ready(go())
            samples[key].append((time.perf_counter() - t0) * 1e6)
    return {key: statistics.median(v) for key, v in samples.items()}
