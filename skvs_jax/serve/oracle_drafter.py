"""An oracle drafter: drafts whose acceptance follows a chosen profile, for models without trained draft heads.

A model with random weights (a real model's shape, nothing downloaded) has no Medusa heads that accept anything,
so the article's regime cannot be served with real drafts. The oracle knows each request's greedy continuation,
from a reference pass of the same model without speculation (`reference_table`), and proposes it, corrupted depth
by depth: the draft at depth d (the d-th token past the row's next one) is the true token with probability
probs[d], and otherwise a different token. The decision is a hash of (seed, request id, position, depth), so a run
is reproducible and every proposal draws afresh. Because the decisions are independent, the acceptance measured
at depth d among verifications that offered a draft there and accepted every draft before it is probs[d], the
profile's conditional acceptance (`sim.acceptance_model.PRESETS` holds the same numbers for the simulator).

Verification is the real one: the model's own target decides what is accepted, so the output stays the model's
greedy decoding whatever the drafts. Two things can make the measured acceptance fall short of the profile:
a position past the reference continuation (the table holds -1 there, and the draft is a corrupted token), and a
request whose speculative decoding departs from the reference pass (an argmax flipped by the different rounding
of a width-1 and a width-(K+1) forward; rare in float32, a measured rate in bfloat16), after which its table row
no longer predicts it.

`OracleDrafter` is what `Engine(model, drafter, ...)` takes in place of `MedusaHeads`; the engine wraps the model's
runner in an `OracleRunner`, whose params carry the table. The runner sees each row's request id and first draft
position through `model_runner.DraftSite`. With `heads` (Medusa heads, e.g. random ones of the model's shape) the
runner also runs them every drafting step and a rejected draft is the heads' own proposal where that differs from
the true token: the step then pays what Medusa's heads cost (at 8B, four vocabulary projections per row, ~13% of
a token's FLOPs), which a free oracle would leave out of every comparison with speculation off.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from skvs_jax import checks
from skvs_jax.serve.model_runner import DraftSite, ModelRunner

i32, u32 = jnp.int32, jnp.uint32
MISS = -1  # a table entry past the reference continuation (or a request the table does not hold)
_OFF = -1e4  # logit of every token but the drafted one: a point mass after any temperature in [1e-2, 10]


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    """What the engine drafts from: probs[d] the chance that the draft at depth d is the true token (d < K, K =
    len(probs)), table int32[R, P] the reference tokens of request id r at sequence positions 0..P-1 (prompt, then
    greedy output; MISS past them), seed of the corruption hash."""

    probs: tuple[float, ...]
    table: Any  # int32[R, P], device or host array
    seed: int = 0
    heads: Any = None  # MedusaHeads run every drafting step (their cost, and their proposals as rejected drafts)

    def __post_init__(self) -> None:
        probs = tuple(self.probs)
        if not probs or any(isinstance(p, bool) or not isinstance(p, (int, float)) or math.isnan(p) or not 0 <= p <= 1
                            for p in probs):
            raise ValueError(f"probs must be a non-empty sequence of numbers in [0, 1], got {self.probs!r}")
        object.__setattr__(self, "probs", tuple(float(p) for p in probs))
        shape = getattr(self.table, "shape", None)
        if shape is None or len(shape) != 2 or not jnp.issubdtype(self.table.dtype, jnp.integer):
            raise ValueError(f"table must be an int array [requests, positions], got {shape}")
        if not checks.is_int(self.seed):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")

    @property
    def num_heads(self) -> int:
        """K: the deepest draft it proposes."""
        return len(self.probs)


def _mix(x: jax.Array) -> jax.Array:
    """A 32-bit integer finaliser (lowbias32): every input bit moves every output bit."""
    x = x ^ (x >> 16)
    x = x * u32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * u32(0x846CA68B)
    return x ^ (x >> 16)


def draft_tokens(table: jax.Array, site: DraftSite, probs: Sequence[float], seed: int, vocab_size: int,
                 proposals: jax.Array | None = None) -> jax.Array:
    """int32[B, K] drafts for positions site.position + d: the table's token with probability probs[d], else
    another token (never the table's): proposals[b, d] (int32[B, >= K], e.g. the heads' argmax) where that differs
    from the table's, else a hashed shift of it. Pure, jittable; table int32[R, P]."""
    r, p = table.shape
    k = len(probs)
    depth = jnp.arange(k, dtype=i32)[None, :]  # [1, K]
    pos = site.position[:, None] + depth  # [B, K]
    rid = site.request_id[:, None]
    known = (rid >= 0) & (rid < r) & (pos >= 0) & (pos < p)
    true = jnp.where(known, table[jnp.clip(rid, 0, r - 1), jnp.clip(pos, 0, p - 1)], MISS)
    h = _mix(_mix(u32(seed) * u32(0x9E3779B9) ^ rid.astype(u32)) ^ pos.astype(u32) * u32(0x85EBCA6B)
             ^ depth.astype(u32) * u32(0xC2B2AE35))
    u = (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)  # uniform in [0, 1)
    keep = (u < jnp.asarray(probs, jnp.float32)[None, :]) & (true >= 0)
    shift = 1 + (_mix(h) % u32(max(vocab_size - 1, 1))).astype(i32)  # in [1, V - 1]: never the true token
    wrong = (jnp.maximum(true, 0) + shift) % vocab_size
    if proposals is not None:
        wrong = jnp.where(proposals[:, :k] != true, proposals[:, :k], wrong)
    return jnp.where(keep, true, wrong).astype(i32)


@dataclasses.dataclass(frozen=True)
class OracleRunner:
    """A `ModelRunner` that serves `base`'s model and drafts with the oracle; params = (base params, table)."""

    base: ModelRunner
    probs: tuple[float, ...]
    seed: int

    @property
    def num_draft_heads(self) -> int:
        return len(self.probs)

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.base.hidden_size

    @property
    def max_positions(self) -> int:
        return self.base.max_positions

    def init_cache(self, num_blocks: int, block_size: int, dtype: Any):
        return self.base.init_cache(num_blocks, block_size, dtype)

    def forward(self, params, tokens, positions, cache, block_tables, context_lens, query_lens, *, impl: str,
                tree_mask=None, logits_at=None):
        return self.base.forward(params[0], tokens, positions, cache, block_tables, context_lens, query_lens,
                                 impl=impl, tree_mask=tree_mask, logits_at=logits_at)

    def draft(self, params, hidden: jax.Array, site: DraftSite | None = None) -> jax.Array:
        if site is None:
            raise ValueError("the oracle drafter needs each row's DraftSite (request id and first draft position)")
        proposals = self.base.draft(params[0], hidden) if self.base.num_draft_heads else None
        return draft_tokens(params[1], site, self.probs, self.seed, self.vocab_size, proposals)

    def draft_logits(self, params, hidden: jax.Array, site: DraftSite | None = None) -> jax.Array:
        """A point mass on each draft (0 there, -1e4 elsewhere): float32[B, K, V]."""
        drafts = self.draft(params, hidden, site)
        hit = drafts[:, :, None] == jnp.arange(self.vocab_size, dtype=i32)[None, None, :]
        return jnp.where(hit, jnp.float32(0.0), jnp.float32(_OFF))

    def copy_blocks(self, cache, src, dst):
        return self.base.copy_blocks(cache, src, dst)

    def kv_pages(self, cache):
        return self.base.kv_pages(cache)

    def with_kv_pages(self, cache, pages):
        return self.base.with_kv_pages(cache, pages)


def wrap(runner: ModelRunner, params, drafter: OracleDrafter) -> tuple[OracleRunner, Any]:
    """`runner` (with `drafter.heads` as its draft heads, or none) drafting with `drafter`: (OracleRunner, (params,
    table))."""
    if drafter.table.shape[1] < 1:
        raise ValueError("the oracle table must hold at least one position")
    if runner.num_draft_heads and runner.num_draft_heads < drafter.num_heads:
        raise ValueError(f"the oracle drafts {drafter.num_heads} deep but its heads are {runner.num_draft_heads}")
    return OracleRunner(runner, drafter.probs, int(drafter.seed)), (params, jnp.asarray(drafter.table, i32))


def table_from_outputs(prompts: dict[int, Sequence[int]], outputs: dict[int, Sequence[int]],
                       max_len: int) -> np.ndarray:
    """int32[max id + 1, max_len]: row r = request r's prompt then its output, MISS past them (and for ids absent)."""
    if not prompts:
        raise ValueError("prompts must name at least one request")
    if min(prompts) < 0:
        raise ValueError(f"request ids must be >= 0 to index the table, got {min(prompts)}")
    table = np.full((max(prompts) + 1, max_len), MISS, np.int32)
    for rid, prompt in prompts.items():
        seq = list(prompt) + list(outputs.get(rid, ()))
        table[rid, : min(len(seq), max_len)] = seq[:max_len]
    return table


def reference_table(engine, requests: Sequence[tuple[int, Sequence[int], int]]) -> np.ndarray:
    """Serve `requests` ((request id, prompt tokens, max new tokens), ...) greedily on `engine` (a fresh engine
    that does not speculate: the reference pass) and tabulate prompt + output per id (`table_from_outputs`)."""
    from skvs_jax.serve.sampling_params import SamplingParams

    if engine.policy.speculation:
        raise ValueError("the reference pass must not speculate: build its engine with a non-speculating policy")
    prompts = {}
    for rid, prompt, max_new in requests:
        engine.add_request(prompt, SamplingParams(max_tokens=max_new), request_id=rid, arrival_time=0.0)
        prompts[rid] = prompt
    outputs = engine.run()
    return table_from_outputs(prompts, outputs, engine.cfg.sched.max_len)


def accept_runs(table: np.ndarray, probs: Sequence[float], seed: int, vocab_size: int,
                request_ids: Sequence[int], width: int) -> dict[int, np.ndarray]:
    """What greedy verification accepts of the oracle's drafts: request id -> int32[width], entry n = the leading
    drafts of a row with n known tokens (its drafts at positions n, n + 1, ...) that equal the table. The engine
    accepts exactly this much (capped by the drafts it offers) while its outputs equal the table, so a simulated
    schedule replayed with these runs (`sim.simulate.make_trace(accept_runs=...)`) meets the same acceptance."""
    ids = np.asarray(list(request_ids), np.int32)
    k = len(probs)
    rid = np.repeat(ids, width)
    pos = np.tile(np.arange(width, dtype=np.int32), len(ids))
    drafts = np.asarray(draft_tokens(jnp.asarray(table, i32), DraftSite(jnp.asarray(rid), jnp.asarray(pos)), probs,
                                     seed, vocab_size))  # [R * width, K]
    r, p = table.shape
    cols = pos[:, None] + np.arange(k)[None, :]
    truth = np.where((cols < p) & (rid[:, None] >= 0) & (rid[:, None] < r),
                     table[np.clip(rid, 0, r - 1)[:, None], np.clip(cols, 0, p - 1)], MISS)
    match = (drafts == truth) & (truth >= 0)
    runs = np.cumprod(match, axis=1).sum(axis=1).astype(np.int32).reshape(len(ids), width)
    return {int(i): runs[j] for j, i in enumerate(ids)}
