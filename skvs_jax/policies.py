"""Scheduling policies: independent switches, numeric knobs, and the three presets the benchmarks compare.

A policy is a set of independent choices so that every claim can be ablated one switch at a time. Switches
that change the traced program (speculation on/off, release mode, pool on/off, barrier, insert mode,
speculation during prefill, preemption mode, draft-length buckets) are static: `Policy` is frozen and hashable
and goes to jitted functions as a static argument. Numeric knobs (draft length up to the static maximum,
`max_spec_ratio`, generation threshold) are data: `Policy.knobs()` returns them as a pytree of scalars, so one
compiled program can `vmap` over them (docs/design.md, "Policies").

Presets (docs/design.md):
  vllm_default  no speculation, prefix caching, preemption by recompute.
  naive_spec    K drafts every step in ordinary blocks held until the sequence ends (lazy release, no pool),
                speculation also during prefill, no prefix barrier, blocks indexed as soon as they fill.
  skvs_article  speculative block states and pool, immediate release of rejected-only blocks, generation
                reclaim, prefix barrier and insert-after-validation, no speculation during prefill,
                opportunistic drafts bounded by max_spec_ratio, adaptive draft length (the histogram rule),
                draft-length buckets: the article's section 5 exactly.
  skvs          skvs_article with the goodput draft controller (`draft_control="goodput"`).

Which module reads which switch: the allocator reads `spec_config()`'s release mode, pool switch and K. The
engine reads `kv_precision`, and `speculation`, `draft_len`, `draft_buckets` for its compiled widths; the
scheduler reads the rest. The prefix cache sees none of them, only what the scheduler passes it through the KV
manager per call: a lookup window (K under `prefix_barrier`, else 0) and the `max_spec_ratio` knob; `insert`
decides which of the manager's indexing calls the scheduler makes. `generation_threshold` reaches
`reclaim_expired` as a knob.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from flax import struct

from skvs_jax.config import SpecConfig

INSERT_MODES = ("validated", "on_fill")
PREEMPTION_MODES = ("recompute", "swap")
DRAFT_CONTROLS = ("histogram", "goodput")
KV_PRECISIONS = ("float32", "bfloat16", "float8_e4m3fn", "int8", "by_draft_len")
NO_VERIFY_CAP = 2**30  # Knobs.verify_budget meaning "no cap" (no step verifies that many tokens)
# The article's rule (its section 7.3; docs/speculation.md): bf16 KV from this draft length, fp8 below.
BF16_FROM_DRAFT_LEN = 6


@struct.dataclass
class Knobs:
    """The numeric part of a policy, as data (int32 / float32 scalars; batch them to vmap a sweep)."""

    draft_len: jnp.ndarray  # drafts per step, <= Policy.draft_len (the static maximum K)
    max_spec_ratio: jnp.ndarray  # share of free blocks speculation may take
    generation_threshold: jnp.ndarray  # speculative-pool blocks older than this are reclaimed
    verify_budget: jnp.ndarray  # tokens decode rows may verify per step (1 + drafts each); NO_VERIFY_CAP: none


@dataclasses.dataclass(frozen=True)
class Policy:
    """A scheduling policy. Every field is an independent switch or the static bound of a knob.

    Attributes:
      name: label for tables and plots.
      speculation: propose and verify drafts at all.
      draft_len: K, the static maximum number of drafts per sequence and step (0 without speculation).
      adaptive_draft_len: choose each request's draft length from its acceptance histogram and memory
        pressure (bounded by K); off = always K.
      draft_buckets: draft lengths that get their own compiled program; requests are padded up to the next
        bucket (the article's CUDA-graph pitfall). Must include K when speculating; empty means (K,).
      release: "immediate" (rejected-only blocks leave the sequence at commit) or "lazy" (held until it ends).
      spec_pool: released draft blocks go to the speculative pool and are reused first.
      generation_threshold: pool blocks older than this many steps return to the free stack.
      prefix_cache: share equal prompt prefixes by reference.
      prefix_barrier: shrink prefix hits by the article's speculative barrier.
      insert: "validated" (only whole blocks of accepted tokens enter the index) or "on_fill" (a block is
        indexed as soon as it is full, drafts included, as a naive integration does).
      spec_in_prefill: reserve draft slots while a request still has prompt chunks to prefill (an engine that
        gives every running sequence the same verification shape); they are rolled back unused.
      drafts_preempt: draft slots are mandatory, like ordinary slots: when blocks run out the scheduler
        preempts other sequences to make room for them (vLLM V0's lookahead slots). Off: drafts are
        opportunistic, granted only from free memory within `max_spec_ratio`, never at another's expense.
      max_spec_ratio: bound on the share of free blocks that speculative blocks may take, in [0, 1].
      preemption: "recompute" (blocks released, request back to waiting) or "swap" (KV moved to a host tier).
      verify_budget: compute-aware drafting. Decode rows verify 1 + drafts tokens each; with R decode rows in
        a step every row drafts at most floor(verify_budget / R) - 1, so drafts shrink evenly as the batch grows
        and stop once the rows alone fill the budget. Scale it from the device's compute knee (the tokens per
        step past which a decode step stops being memory-bound, `sim.cost_model.CostModel.knee_tokens`): well
        past it, verifying drafts costs more time than the accepted tokens save (docs/simulator.md measures
        which multiple of the knee pays). None: no cap (vLLM's `speculative_disable_by_batch_size` is the
        all-or-nothing form).
      draft_control: how adaptive draft length decides (read only with `adaptive_draft_len`): "histogram", the
        article's rule (the smallest bucket reaching 1.5x the request's mean accepted count), or "goodput": per
        step, the drafts that maximise the whole step's expected accepted tokens per second, from per-depth acceptance
        estimates and a step-cost table (`scheduler.draft_control`, docs/speculation.md "Draft control").
      kv_precision: the KV cache's dtype ("float32", "bfloat16", "float8_e4m3fn", "int8"), or "by_draft_len",
        the article's rule: bf16 when the maximum draft length K >= 6 (quantisation error compounds over long
        drafts), fp8 otherwise. The cache holds one dtype for its lifetime, so the rule reads the static K.
      bucket_budget: 0: the draft widths compiled are `draft_buckets`, fixed. n >= 1: at most n draft widths,
        K among them, chosen by the engine from the observed draft-length histogram to minimise padding and
        re-chosen when it drifts (`scheduler.buckets`; `draft_buckets` is the set it starts from, so n must be
        >= its length). The widths reach the scheduler as data (`SchedState.draft_widths`).
    """

    name: str
    speculation: bool
    draft_len: int
    adaptive_draft_len: bool
    draft_buckets: tuple[int, ...]
    release: str
    spec_pool: bool
    generation_threshold: int
    prefix_cache: bool
    prefix_barrier: bool
    insert: str
    spec_in_prefill: bool
    drafts_preempt: bool
    max_spec_ratio: float
    preemption: str
    kv_precision: str = "float32"
    verify_budget: int | None = None
    draft_control: str = "histogram"
    bucket_budget: int = 0

    def __post_init__(self) -> None:
        for field in ("speculation", "adaptive_draft_len", "spec_pool", "prefix_cache", "prefix_barrier",
                      "spec_in_prefill", "drafts_preempt"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"{field} must be a bool, got {type(getattr(self, field)).__name__}")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("name must be a non-empty string")
        if self.insert not in INSERT_MODES:
            raise ValueError(f"insert must be one of {INSERT_MODES}, got {self.insert!r}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {self.preemption!r}")
        if self.draft_control not in DRAFT_CONTROLS:
            raise ValueError(f"draft_control must be one of {DRAFT_CONTROLS}, got {self.draft_control!r}")
        if self.kv_precision not in KV_PRECISIONS:
            raise ValueError(f"kv_precision must be one of {KV_PRECISIONS}, got {self.kv_precision!r}")
        vb = self.verify_budget
        if vb is not None and (isinstance(vb, bool) or not isinstance(vb, int) or not 1 <= vb <= NO_VERIFY_CAP):
            raise ValueError(f"verify_budget must be None or an int in [1, {NO_VERIFY_CAP}], got {vb!r}")
        # SpecConfig validates draft_len, generation_threshold, max_spec_ratio and release, naming the field.
        self.spec_config()
        if self.speculation and self.draft_len < 1:
            raise ValueError(f"draft_len must be >= 1 when speculation is on, got {self.draft_len}")
        if not self.speculation and (self.draft_len or self.draft_buckets or self.adaptive_draft_len):
            raise ValueError("without speculation, draft_len must be 0, draft_buckets empty and "
                             "adaptive_draft_len off")
        if not isinstance(self.draft_buckets, tuple) or any(
            isinstance(k, bool) or not isinstance(k, int) for k in self.draft_buckets
        ):
            raise TypeError(f"draft_buckets must be a tuple of ints, got {self.draft_buckets!r}")
        if list(self.draft_buckets) != sorted(set(self.draft_buckets)):
            raise ValueError(f"draft_buckets must be strictly increasing, got {self.draft_buckets}")
        if self.draft_buckets and (self.draft_buckets[0] < 0 or self.draft_buckets[-1] != self.draft_len):
            raise ValueError(f"draft_buckets must lie in [0, draft_len] and end at draft_len = {self.draft_len}, "
                             f"got {self.draft_buckets}")
        if self.prefix_barrier and not self.prefix_cache:
            raise ValueError("prefix_barrier needs prefix_cache")
        nb = self.bucket_budget
        if isinstance(nb, bool) or not isinstance(nb, int) or nb < 0:
            raise ValueError(f"bucket_budget must be an int >= 0, got {nb!r}")
        if nb and (not self.speculation or nb < len(self.draft_buckets or (self.draft_len,))):
            raise ValueError(f"bucket_budget must be 0 without speculation and otherwise >= the "
                             f"{len(self.draft_buckets or (self.draft_len,))} draft buckets it starts from, got {nb}")

    @property
    def width_slots(self) -> int:
        """W: the draft widths the engine may have at once (`bucket_budget`, or the fixed buckets' count)."""
        return self.bucket_budget or len(self.draft_buckets or (self.draft_len,))

    @property
    def goodput_control(self) -> bool:
        """The goodput draft controller decides the drafts (speculation, adaptive length, draft_control)."""
        return self.speculation and self.adaptive_draft_len and self.draft_control == "goodput"

    def spec_config(self) -> SpecConfig:
        """What the allocator needs to know of this policy."""
        return SpecConfig(
            draft_len=self.draft_len,
            generation_threshold=self.generation_threshold,
            max_spec_ratio=self.max_spec_ratio,
            release=self.release,
            use_spec_pool=self.spec_pool,
        )

    def kv_dtype(self) -> str:
        """The KV cache dtype this policy asks for (`kv_precision`, with "by_draft_len" resolved)."""
        if self.kv_precision != "by_draft_len":
            return self.kv_precision
        return "bfloat16" if self.draft_len >= BF16_FROM_DRAFT_LEN else "float8_e4m3fn"

    def knobs(self) -> Knobs:
        """The numeric knobs at their preset values, as data."""
        return Knobs(
            draft_len=jnp.asarray(self.draft_len, jnp.int32),
            max_spec_ratio=jnp.asarray(self.max_spec_ratio, jnp.float32),
            generation_threshold=jnp.asarray(self.generation_threshold, jnp.int32),
            verify_budget=jnp.asarray(NO_VERIFY_CAP if self.verify_budget is None else self.verify_budget, jnp.int32),
        )

    def replace(self, **changes) -> Policy:
        return dataclasses.replace(self, **changes)


def vllm_default(draft_len: int = 0) -> Policy:
    """vLLM's default scheduling: no speculation, prefix caching, preemption by recompute."""
    del draft_len  # accepted so that every preset has the same signature
    return Policy(
        name="vllm_default", speculation=False, draft_len=0, adaptive_draft_len=False, draft_buckets=(),
        release="immediate", spec_pool=False, generation_threshold=0, prefix_cache=True, prefix_barrier=False,
        insert="on_fill", spec_in_prefill=False, drafts_preempt=False, max_spec_ratio=1.0, preemption="recompute",
    )


def naive_spec(draft_len: int = 4) -> Policy:
    """Speculation bolted on: K drafts every step in ordinary, lazily released blocks; no barrier."""
    return Policy(
        name="naive_spec", speculation=True, draft_len=draft_len, adaptive_draft_len=False,
        draft_buckets=(draft_len,), release="lazy", spec_pool=False, generation_threshold=0, prefix_cache=True,
        prefix_barrier=False, insert="on_fill", spec_in_prefill=True, drafts_preempt=True, max_spec_ratio=1.0,
        preemption="recompute",
    )


def skvs_article(draft_len: int = 4) -> Policy:
    """The speculation-aware KV scheduler of the article (section 5) exactly, every switch on: the histogram
    rule for adaptive draft length."""
    return Policy(
        name="skvs_article", speculation=True, draft_len=draft_len, adaptive_draft_len=True,
        draft_buckets=tuple(sorted({0, draft_len // 2, draft_len})), release="immediate", spec_pool=True,
        generation_threshold=8, prefix_cache=True, prefix_barrier=True, insert="validated",
        spec_in_prefill=False, drafts_preempt=False, max_spec_ratio=0.3, preemption="recompute",
    )


def skvs(draft_len: int = 4) -> Policy:
    """The best speculation-aware scheduler we have measured: the article's (`skvs_article`) with the goodput
    draft controller in place of the histogram rule (docs/speculation.md, "Draft control")."""
    return skvs_article(draft_len).replace(name="skvs", draft_control="goodput")


PRESETS = {"vllm_default": vllm_default, "naive_spec": naive_spec, "skvs": skvs, "skvs_article": skvs_article}


def preset(name: str, draft_len: int = 4) -> Policy:
    """A preset by name (`vllm_default`, `naive_spec`, `skvs`, `skvs_article`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name](draft_len)


def parse_verify_budget(text: str, knee: float | None = None) -> int | None:
    """A verify budget written on a command line: "none" -> None (no cap), a positive integer -> that many
    tokens, and, when the caller knows the device's compute knee (tokens per step), "knee" -> int(knee) (None
    when the knee is infinite: such a device is never compute-bound).
    Raises ValueError naming the forms accepted."""
    if text == "none":
        return None
    if text == "knee" and knee is not None:
        if not math.isfinite(knee):  # a device with unbounded compute is never compute-bound: no cap
            return None
        return min(max(int(knee), 1), NO_VERIFY_CAP)
    try:
        tokens = int(text)
    except ValueError:
        tokens = 0
    if not 1 <= tokens <= NO_VERIFY_CAP:
        forms = "none, knee or a positive integer" if knee is not None else "none or a positive integer"
        raise ValueError(f"--verify-budget must be {forms}, got {text!r}")
    return tokens


# Switches (and knobs) on which skvs and naive_spec differ, with naive's value: one ablation each. verify_budget
# differs only when the base sets one (both presets default to no cap).
_ABLATABLE = ("draft_control", "adaptive_draft_len", "release", "spec_pool", "prefix_barrier", "insert",
              "spec_in_prefill", "drafts_preempt", "max_spec_ratio", "verify_budget")


def ablations(base: Policy | None = None) -> dict[str, Policy]:
    """`base` (default skvs) with each of its speculation-aware switches turned back to naive_spec's value,
    one at a time, named "<base> -<switch>". Switches that must change together stay consistent (turning
    the pool off also turns the generation threshold off; dropping adaptive length keeps only bucket K)."""
    base = base or skvs()
    naive = naive_spec(base.draft_len)
    out = {}
    for field in _ABLATABLE:
        if getattr(base, field) == getattr(naive, field):
            continue
        changes = {field: getattr(naive, field), "name": f"{base.name} -{field}"}
        if field == "spec_pool":
            changes["generation_threshold"] = naive.generation_threshold
        if field == "adaptive_draft_len":
            changes["draft_buckets"] = naive.draft_buckets
            changes["draft_control"] = naive.draft_control
        out[changes["name"]] = base.replace(**changes)
    return out
