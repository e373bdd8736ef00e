"""Draft widths: which query programs to have, chosen from the observed draft-length histogram.

Each draft width w is one compiled program (a query of 1 + w slots per row). A step whose rows may get at most
d drafts runs at the smallest chosen width >= d (`snap_up`, the one snapping rule: the engine's width, the
histogram rule's draft count and the warm-up order all call it), and every row of the step verifies that many
slots whether or not it drafted them. The draft slots computed without a draft are the step's **padding**:

    padding(step) = decode rows * snap_up(bound) - drafts of those rows

where bound is the most drafts any row may get (`WidthPicker.pick`'s upper bound). With the histogram
H[d] = decode rows of the steps whose bound was d, the padding of a set of widths is

    cost(H, widths) - drafted,   cost(H, widths) = sum_d H[d] * snap_up(d, widths)

so choosing the widths minimises `cost`. `choose_widths(H, budget, K)` does it exactly (a DP over 0..K), with K always
chosen: the widest program serves a bound that is unknown (knobs replaced between steps) and any request the
histogram has not seen, so no request is ever cut down to fit.

Why round up, not cut down to the largest chosen width <= d: a padded slot costs compute only, and only past the
device's compute knee (a decode step below it is memory-bound, docs/simulator.md); a draft cut off costs its
expected accepted tokens, each one a row-step saved. docs/speculation.md ("Chosen buckets") measures both on the
bench trace.

`BucketChooser` re-chooses as the histogram drifts: every `every` decode steps it compares the last window's
best set with the current one and switches only when that removes at least `HYSTERESIS` of the window's padding,
at most `max_rechoices` times. Widths reach the scheduler as data (`SchedState.draft_widths`, int32[widths] padded
with K), so a re-choice recompiles nothing that exists; the engine compiles a program per new width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

HYSTERESIS = 0.25  # a re-choice must remove at least this share of the last window's padding
RECHOOSE_EVERY = 64  # decode steps per window
MAX_RECHOICES = 4  # re-choices over an engine's life (each compiles at most `budget` programs)


def snap_up(need, widths, reach=None):
    """The smallest of `widths` whose reach is >= `need`; the largest width where none is.

    need int32[...]; widths int32[widths] (any order, repeats allowed); reach int32[widths] what each width
    reaches (a draft tree of w nodes reaches its depth; default: the width itself, a chain). Traced arrays give a jax
    array, anything else a numpy one (the host's width pick and cost sums use the same rule as the jitted scheduler)."""
    xp = jnp if any(isinstance(x, jax.Array) for x in (need, widths, reach)) else np
    widths = xp.asarray(widths, xp.int32)
    reach = widths if reach is None else xp.asarray(reach, xp.int32)
    need = xp.asarray(need, xp.int32)
    lead = (1,) * need.ndim
    fits = reach.reshape(lead + reach.shape) >= need[..., None]  # [..., widths]
    return xp.min(xp.where(fits, widths.reshape(lead + widths.shape), xp.max(widths)), axis=-1).astype(xp.int32)


def cost(hist: Sequence[int], widths: Sequence[int]) -> int:
    """sum_d hist[d] * snap_up(d, widths): the draft slots the steps of `hist` verify with these widths."""
    h = np.asarray(hist, np.int64)
    return int(np.sum(h * snap_up(np.arange(len(h)), widths).astype(np.int64)))


def as_hist(counts: Mapping[int, int], k: int) -> list[int]:
    """A {drafts: weight} mapping as a list over 0..K (drafts above K count at K)."""
    hist = [0] * (k + 1)
    for d, w in counts.items():
        hist[min(max(int(d), 0), k)] += int(w)
    return hist


def choose_widths(hist: Sequence[int], budget: int, k: int) -> tuple[int, ...]:
    """The widths, at most `budget` of 0..K and K among them, that minimise `cost(hist, widths)`; among optimal
    sets the fewest widths (ties after that: the smallest earlier width, deterministically).

    hist: K + 1 non-negative ints (weight of each bound d). A DP over the largest width so far: f[j][i] is the
    least cost of the bounds 0..i served by j widths the largest of which is i; O(budget * K^2)."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an int >= 1, got {budget!r}")
    if len(hist) != k + 1 or any(int(h) < 0 for h in hist):
        raise ValueError(f"hist must hold K + 1 = {k + 1} non-negative weights, got {list(hist)}")
    prefix = np.concatenate([[0], np.cumsum(np.asarray(hist, np.int64))]).tolist()  # prefix[i + 1] = sum h[0..i]
    inf = float("inf")
    f = [[prefix[i + 1] * i for i in range(k + 1)]]
    back: list[list[int]] = [[-1] * (k + 1)]
    for _ in range(1, min(budget, k + 1)):
        row, arg = [inf] * (k + 1), [-1] * (k + 1)
        for i in range(k + 1):
            for p in range(i):
                c = f[-1][p] + (prefix[i + 1] - prefix[p + 1]) * i
                if c < row[i]:
                    row[i], arg[i] = c, p
        f.append(row)
        back.append(arg)
    best = min(range(len(f)), key=lambda j: (f[j][k], j))
    widths, i = [], k
    for j in range(best, -1, -1):
        widths.append(i)
        i = back[j][i]
    return tuple(sorted(widths))


def padded(widths: Sequence[int], slots: int) -> np.ndarray:
    """int32[slots] the widths sorted, padded with the largest (a repeat snaps like the width it repeats)."""
    w = sorted(set(int(x) for x in widths))
    if not w or len(w) > slots:
        raise ValueError(f"widths must hold 1..{slots} values, got {list(widths)}")
    return np.asarray(w + [w[-1]] * (slots - len(w)), np.int32)


NARROW, SPLIT, WIDE = 0, 1, 2  # `query_layout`'s answer: the engine's three layouts of a prompt-width step


def query_layout(batch, narrow: int, split_rows: int) -> jax.Array:
    """int32[] how the engine lays out a step it runs at a prompt width wider than `narrow` (1 + K), the first
    that fits (`serve.engine_step.model_step_at` branches on it):

        NARROW  every scheduled row's query tokens and drafts fit `narrow` slots: [B, narrow]
        SPLIT   split_rows > 0 and the heads of the longer rows (what does not fit their home row) fit
                `split_rows` extra rows of `narrow` slots: [B + split_rows, narrow]
        WIDE    [B, width]

    batch: a `scheduler.Batch` (scheduled, num_query, num_drafts bool/int32[B])."""
    need = jnp.where(batch.scheduled, batch.num_query + batch.num_drafts, 0)
    extra = jnp.sum((jnp.maximum(need - narrow, 0) + narrow - 1) // narrow)
    split = (split_rows > 0) & (extra <= split_rows)
    return jnp.where(jnp.max(need) <= narrow, NARROW, jnp.where(split, SPLIT, WIDE)).astype(jnp.int32)


def query_slots(batch, width, narrow: int, split_rows: int) -> jax.Array:
    """int32[] the query slots (rows x width) the engine's forward computes for `batch` at the host's `width`
    (int or int32[]): B * width at a decode width (<= narrow), else by `query_layout`. What a step costs where
    padding is compute (a compute-bound device), against the tokens scheduled (`StepShape`)."""
    b = batch.scheduled.shape[0]
    width = jnp.asarray(width, jnp.int32)
    layout = query_layout(batch, narrow, split_rows)
    prompt = jnp.where(layout == NARROW, b * narrow,
                       jnp.where(layout == SPLIT, (b + split_rows) * narrow, b * width))
    return jnp.where(width <= narrow, b * width, prompt).astype(jnp.int32)


@dataclasses.dataclass
class BucketChooser:
    """The engine's bucket choice as a small state machine (host side, plain Python).

    `observe(bound, rows, drafted)` once per decode-only step; `rechoose()` after it returns the new widths
    when the window is full and a switch pays (see the module docstring), else None. `hist` accumulates every
    observation (for `Engine.warmup` of a later engine); the window restarts after each evaluation."""

    k: int
    budget: int
    widths: tuple[int, ...]
    every: int = RECHOOSE_EVERY
    max_rechoices: int = MAX_RECHOICES
    hysteresis: float = HYSTERESIS
    rechoices: int = 0
    hist: list[int] = dataclasses.field(default_factory=list)
    window: list[int] = dataclasses.field(default_factory=list)
    window_drafted: int = 0
    window_steps: int = 0

    def __post_init__(self) -> None:
        self.hist = self.hist or [0] * (self.k + 1)
        self.window = self.window or [0] * (self.k + 1)

    def observe(self, bound: int, rows: int, drafted: int) -> None:
        d = min(max(int(bound), 0), self.k)
        self.hist[d] += int(rows)
        self.window[d] += int(rows)
        self.window_drafted += int(drafted)
        self.window_steps += 1

    def rechoose(self) -> tuple[int, ...] | None:
        if self.window_steps < self.every:
            return None
        window, drafted = self.window, self.window_drafted
        self.window, self.window_drafted, self.window_steps = [0] * (self.k + 1), 0, 0
        if self.rechoices >= self.max_rechoices:
            return None
        best = choose_widths(window, self.budget, self.k)
        now, then = cost(window, self.widths), cost(window, best)
        if best == self.widths or now - then < self.hysteresis * max(now - drafted, 0) or now == then:
            return None
        self.widths, self.rechoices = best, self.rechoices + 1
        return best
