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
                draft-length buckets, rejected drafts' KV scrubbed: the article's section 5 exactly.
  skvs          skvs_article with the goodput draft controller (`draft_control="goodput"`), priced draft blocks
                (`draft_memory="priced"`), no prefix barrier, no scrub of rejected drafts, and draft slots
                reserved during prefill (`spec_in_prefill`, as naive_spec).
  naive_spec_vllm  naive_spec with vLLM's EAGLE/MTP prefix-cache path (`spec_hit_trim`): not a design choice,
                a model of a shipped integration, for the claims report (docs/claims.md).

Which module reads which switch: the allocator reads `spec_config()`'s release mode, pool switch and K. The
engine reads `kv_precision`, `scrub_rejected`, and `speculation`, `draft_len`, `draft_buckets` for its compiled
widths; the scheduler reads the rest. The prefix cache sees none of them, only what the scheduler passes it
through the KV manager per call: a lookup window (K under `prefix_barrier`, else 0) and the `max_spec_ratio`
knob; `insert` decides which of the manager's indexing calls the scheduler makes. `generation_threshold` reaches
`reclaim_expired` as a knob.

Written as text (the commands' `--policies`): `parse_policy("skvs:preemption=swap,victim=most_progress")` is a
preset with typed field overrides, `parse_policies` a comma-separated list of them (docs/design.md, "Policies").
"""

from __future__ import annotations

import dataclasses
import math
import typing

import jax.numpy as jnp
from flax import struct

from skvs_jax.config import SpecConfig
from skvs_jax.victims import VICTIM_RULE_NAMES

INSERT_MODES = ("validated", "on_fill")
PREEMPTION_MODES = ("recompute", "swap")
DRAFT_CONTROLS = ("histogram", "goodput")
DRAFT_MEMORY = ("opportunistic", "priced")
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
      tail_guard: under the goodput controller, None (off) or a slack in 1/1024ths: a row that speculation has
        slowed (behind, `scheduler.draft_control`) bounds the step's time by what it hopes to gain from it, times
        1 + tail_guard / 1024, so drafting slows it by at most that share a step (0: not at all). Off, such a row
        is only selected by an optimistic estimate. A row that cannot gain vetoes the batch's drafts while it is
        behind, unless the slack covers them (docs/design.md "Draft control's tail": what it costs, measured).
      tail_peers: under the goodput controller, None (off) or a slack in 1/1024ths: a decoding row whose TPOT so
        far is more than that share above its decoding peers' mean (`scheduler.draft_control.over_peers`) counts as
        behind, like a row over its own target: drafted first and, under the guard, bounding the step. It protects
        the requests a busy batch makes slowest whether or not speculation caused it (short requests that decode
        through a burst's longest steps), which a row's own lag does not see (docs/design.md "Draft control's tail").
      tpot_targets: under the goodput controller, a row over its request's TPOT target (`SamplingParams.tpot_target`,
        `scheduler.draft_control.over_target`) counts as behind, so it is drafted first and, under the guard,
        bounds the step; False ignores targets (the ablation: the same requests, measured against the same targets).
      kv_precision: the KV cache's dtype ("float32", "bfloat16", "float8_e4m3fn", "int8"), or "by_draft_len",
        the article's rule: bf16 when the maximum draft length K >= 6 (quantisation error compounds over long
        drafts), fp8 otherwise. The cache holds one dtype for its lifetime, so the rule reads the static K.
      victim: which running sequences preemption takes first, a name in `victims.VICTIM_RULE_NAMES` (the rules
        live in `skvs_jax.victims`). `SchedulerConfig.victim`, a function, overrides it with a custom rule.
      draft_memory: how drafts that are not mandatory (`drafts_preempt` off; ignored when it is on) get blocks:
        "opportunistic", only from free blocks within `max_spec_ratio`, never at another's expense; or "priced":
        a draft block costs nothing while blocks are available (free, speculative pool or evictable), and drafts
        preempt further rows only when the step's expected accepted tokens per second, with the victims' output
        lost and their recompute's time added (from the step cost), beat not preempting for them
        (`scheduler.draft_control.preemption_pays`, docs/speculation.md "Draft control").
      scrub_rejected: after verification the engine zeroes the KV slots of rejected drafts
        (`pallas_kernels.invalidate_drafts`, the article's spec_validate_kernel), so a block that goes back to the
        pool or the free stack never carries a rejected draft's K/V to its next owner. Attention never reads past
        a sequence's length either way; this is the scrub that makes a stale read impossible, not just masked.
        Only the engine reads it (the simulator has no KV).
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
    tail_guard: int | None = None
    tail_peers: int | None = None
    tpot_targets: bool = True
    victim: str = "lowest_priority"
    draft_memory: str = "opportunistic"
    spec_hit_trim: bool = False
    scrub_rejected: bool = False
    bucket_budget: int = 0

    def __post_init__(self) -> None:
        for field in ("speculation", "adaptive_draft_len", "spec_pool", "prefix_cache", "prefix_barrier",
                      "spec_in_prefill", "drafts_preempt", "spec_hit_trim", "scrub_rejected", "tpot_targets"):
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
        if self.draft_memory not in DRAFT_MEMORY:
            raise ValueError(f"draft_memory must be one of {DRAFT_MEMORY}, got {self.draft_memory!r}")
        if self.kv_precision not in KV_PRECISIONS:
            raise ValueError(f"kv_precision must be one of {KV_PRECISIONS}, got {self.kv_precision!r}")
        if self.victim not in VICTIM_RULE_NAMES:
            raise ValueError(f"victim must be one of {VICTIM_RULE_NAMES}, got {self.victim!r}")
        tg = self.tail_guard
        if tg is not None and (isinstance(tg, bool) or not isinstance(tg, int) or not 0 <= tg <= 1024):
            raise ValueError(f"tail_guard must be None or an int in [0, 1024] (1/1024ths of a step), got {tg!r}")
        tp = self.tail_peers
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or not 0 <= tp <= 1024):
            raise ValueError(f"tail_peers must be None or an int in [0, 1024] (1/1024ths of the peers' TPOT), "
                             f"got {tp!r}")
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
        """The draft widths the engine may have at once (`bucket_budget`, or the fixed buckets' count)."""
        return self.bucket_budget or len(self.draft_buckets or (self.draft_len,))

    @property
    def goodput_control(self) -> bool:
        """The goodput draft controller decides the drafts (speculation, adaptive length, draft_control)."""
        return self.speculation and self.adaptive_draft_len and self.draft_control == "goodput"

    @property
    def priced_drafts(self) -> bool:
        """Draft blocks are priced (`draft_memory="priced"`, speculation on, drafts not mandatory)."""
        return self.speculation and not self.drafts_preempt and self.draft_memory == "priced"

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
        return resolve_kv_dtype(self.kv_precision, self.draft_len)

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


def resolve_kv_dtype(kv_precision: str, draft_len: int) -> str:
    """A `kv_precision` as a dtype name: "by_draft_len" is the article's rule for static K = draft_len (bf16 from
    BF16_FROM_DRAFT_LEN drafts, fp8 below); any other is itself."""
    if kv_precision != "by_draft_len":
        return kv_precision
    return "bfloat16" if draft_len >= BF16_FROM_DRAFT_LEN else "float8_e4m3fn"


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
        scrub_rejected=True,
    )


def skvs(draft_len: int = 4) -> Policy:
    """The best speculation-aware scheduler we have measured: the article's (`skvs_article`) with the goodput
    draft controller in place of the histogram rule, priced draft blocks (drafts preempt only when that pays),
    no prefix barrier (the index holds only validated blocks, so the barrier only loses hits), and draft slots
    reserved while a row prefills (`spec_in_prefill`, which the article drops as waste: it spares preemptions
    where memory binds). It does not scrub rejected drafts' K/V (`scrub_rejected`): attention never reads past a
    sequence's length, so the scrub buys hygiene, not correctness, at a cost in throughput;
    `skvs:scrub_rejected=true` turns it back on. Its controller's tail guard is on with no slack (`tail_guard=0`:
    drafts do not slow a row that has fallen behind drafting-off and can gain), and a row more than a tenth
    slower per token than its decoding peers counts as behind too (`tail_peers=102`; docs/design.md "Draft
    control's tail"). The measurements behind each choice: docs/speculation.md, "Draft control"."""
    return skvs_article(draft_len).replace(name="skvs", draft_control="goodput", draft_memory="priced",
                                           prefix_barrier=False, scrub_rejected=False, spec_in_prefill=True,
                                           tail_guard=0, tail_peers=102)


PRESETS = {"vllm_default": vllm_default, "naive_spec": naive_spec, "skvs": skvs, "skvs_article": skvs_article}


def naive_spec_vllm(draft_len: int = 4) -> Policy:
    """naive_spec with vLLM's EAGLE/MTP prefix-cache behaviour (`spec_hit_trim`): every hit loses the blocks the
    drafts could reach. Not a default preset: it models a shipped engine's integration, not a design choice."""
    return naive_spec(draft_len).replace(name="naive_spec_vllm", spec_hit_trim=True)


PRESETS["naive_spec_vllm"] = naive_spec_vllm


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
_ABLATABLE = ("draft_memory", "draft_control", "tail_guard", "tail_peers", "adaptive_draft_len", "release", "spec_pool",
              "prefix_barrier", "insert", "spec_in_prefill", "drafts_preempt", "max_spec_ratio", "verify_budget")


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


# ------------------------------------------------------------------------------ policies written as text

# The keys of a written policy that are not Policy fields: the draft-length knob K (data: the static K stays the
# preset's, so variants meet the same acceptance draws in the simulator) and the variant's name.
KNOB_KEY, NAME_KEY = "K", "name"
_TRUE, _FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """A policy written as text (`parse_policy`): the policy, the draft-length knob it asks for (None: the
    policy's K) and the overrides it was given, (key, value) in the order written."""

    policy: Policy
    draft_len_knob: int | None = None
    overrides: tuple[tuple[str, object], ...] = ()

    def knobs(self) -> Knobs:
        """The policy's knobs, with the draft-length knob at `draft_len_knob` when given."""
        knobs = self.policy.knobs()
        if self.draft_len_knob is None:
            return knobs
        return knobs.replace(draft_len=jnp.asarray(self.draft_len_knob, jnp.int32))


def _field_value(key: str, text: str, kind) -> object:
    """text converted to the Policy field's annotated type, or ValueError naming the key and the value."""
    low = text.strip().lower()
    bad = f"policy override {key}={text!r}: "
    if kind is bool:
        if low not in _TRUE + _FALSE:
            raise ValueError(bad + f"expected a bool ({'/'.join(_TRUE)} or {'/'.join(_FALSE)})")
        return low in _TRUE
    if kind is int or kind == (int | None):
        optional = kind is not int
        if optional and low == "none":
            return None
        try:
            return int(low)
        except ValueError:
            raise ValueError(bad + "expected an integer" + (" or none" if optional else "")) from None
    if kind is float:
        try:
            value = float(low)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ValueError(bad + "expected a finite number")
        return value
    if kind == tuple[int, ...]:  # the commas separate overrides, so the items are separated by "/"
        try:
            return tuple(int(x) for x in low.split("/")) if low not in ("", "()") else ()
        except ValueError:
            raise ValueError(bad + "expected integers separated by '/' (e.g. 0/2/4)") from None
    return text.strip()


def split_policies(text: str) -> list[str]:
    """A `--policies` list into its policies: items are comma-separated, and an item KEY=VALUE (an "=" before
    any ":") continues the policy before it, so "vllm_default,skvs:preemption=swap,victim=most_progress" is two."""
    out: list[str] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        eq, colon = item.find("="), item.find(":")
        if eq >= 0 and (colon < 0 or eq < colon):
            if not out:
                raise ValueError(f"policy override {item!r} comes before any policy name")
            out[-1] += "," + item
        else:
            out.append(item)
    return out


def parse_policy(text: str, draft_len: int = 4, defaults: dict[str, object] | None = None) -> PolicySpec:
    """A policy written as text: "PRESET" or "PRESET:ITEM,ITEM,...", each ITEM a Policy field override
    KEY=VALUE, "K=N" (or a bare N as the first item) for the draft-length knob, or "name=LABEL".

    Values convert to the field's annotated type: bools as true/false (on/off, yes/no, 1/0), ints, floats,
    `int | None` with "none", tuples of ints as "0/2/4" (commas separate items). "draft_len=N" rebuilds the
    preset with static K = N (its draft buckets follow); K=N is data, at most the static K. Switches that must
    change together do: prefix_cache=false also turns the barrier off unless prefix_barrier is given.
    `defaults`: field values applied to the preset before the written overrides (the command line's global
    flags); they do not change the name. The name: name=LABEL, else the preset's name with a K-only form
    written "PRESET:N", and any other override "PRESET[KEY=VALUE,...]" as written.
    Raises ValueError naming the bad preset, key or value (and the Policy's own errors for bad combinations)."""
    preset_name, _, rest = text.strip().partition(":")
    if preset_name not in PRESETS:
        raise ValueError(f"unknown policy {preset_name!r}; choose one of {sorted(PRESETS)}")
    kinds = typing.get_type_hints(Policy)
    items: list[tuple[str, str]] = []
    for i, item in enumerate(x.strip() for x in rest.split(",") if rest):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:  # the bare draft-length knob comes first ("naive_spec:2"): "draft_buckets=0,2" is a mistake
            if not (item.isdigit() and i == 0):
                raise ValueError(f"policy {text!r}: {item!r} is not KEY=VALUE (a bare draft length K comes "
                                 f"first, as in {preset_name}:2; tuples are written 0/2/4)")
            key, value = KNOB_KEY, item
        if key == NAME_KEY and not value.strip():
            raise ValueError(f"policy {text!r}: name must not be empty")
        if key not in kinds and key != KNOB_KEY:
            fields = sorted(set(kinds) - {"name"})
            raise ValueError(f"policy {text!r}: unknown key {key!r}; keys: {KNOB_KEY}, {NAME_KEY}, {', '.join(fields)}")
        if any(k == key for k, _ in items):
            raise ValueError(f"policy {text!r}: {key} given twice")
        items.append((key, value))
    given = dict(items)
    static_k = _field_value("draft_len", given["draft_len"], int) if "draft_len" in given else draft_len
    policy = preset(preset_name, static_k)
    changes = dict(defaults or {})
    overrides = []
    for key, value in items:
        if key in (KNOB_KEY, NAME_KEY):
            continue
        changes[key] = _field_value(key, value, kinds[key])
        overrides.append((key, changes[key]))
    if changes.get("prefix_cache") is False and "prefix_barrier" not in given:
        changes["prefix_barrier"] = False
    changes.pop("draft_len", None)
    knob = None
    if KNOB_KEY in given:
        knob = _field_value(KNOB_KEY, given[KNOB_KEY], int)
        if not 0 <= knob <= policy.draft_len:
            raise ValueError(f"policy {text!r}: the draft-length knob K must lie in [0, {policy.draft_len}] (the "
                             f"static K), got {knob}")
        overrides.append((KNOB_KEY, knob))
    if NAME_KEY in given:
        name = given[NAME_KEY].strip()
    elif list(given) == [KNOB_KEY]:
        name = f"{preset_name}:{knob}"
    elif items:
        name = f"{preset_name}[{','.join(f'{k}={v.strip()}' for k, v in items)}]"
    else:
        name = preset_name
    try:
        policy = policy.replace(name=name, **changes)
    except (TypeError, ValueError) as err:
        raise ValueError(f"policy {text!r}: {err}") from None
    return PolicySpec(policy=policy, draft_len_knob=knob, overrides=tuple(overrides))


def parse_policies(text: str, draft_len: int = 4, defaults: dict[str, object] | None = None,
                   preset_defaults: dict[str, dict[str, object]] | None = None) -> list[PolicySpec]:
    """A comma-separated `--policies` list (`split_policies`), each item read by `parse_policy` with `defaults`
    and, for items of preset P, `preset_defaults[P]` on top (e.g. a flag that applies to skvs only); ValueError
    when two policies get one name."""
    specs = []
    for item in split_policies(text):
        extra = (preset_defaults or {}).get(item.partition(":")[0].strip(), {})
        specs.append(parse_policy(item, draft_len, dict(defaults or {}) | extra))
    names = [s.policy.name for s in specs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"two policies are named {dup!r}; give one a name=... override")
    return specs
