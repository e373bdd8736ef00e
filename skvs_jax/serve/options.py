"""`EngineOptions`: everything an `Engine` takes besides its model, policy and cache, in one frozen, validated
dataclass (field docs, defaults, and a clear error naming the field at construction).

    Engine(model, heads, policy, cache, EngineOptions(token_budget=96, prefill_chunk=32))
    Engine(model, heads, policy, cache, token_budget=96, prefill_chunk=32)   # the same, as keywords

What can be checked without the model and the policy is checked here; `draft_tree` checks the rest (the draft
tree against the policy's K and the model's heads) when the engine is built.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax

import pallas_kernels as pk
from skvs_jax import checks
from skvs_jax import scheduler as sc
from skvs_jax.policies import Policy
from skvs_jax.serve import speculation as spec
from skvs_jax.serve.acceptance import POSTERIOR_ALPHA, POSTERIOR_THRESHOLD
from skvs_jax.serve.model_runner import ModelRunner
from skvs_jax.serve.sampling_params import check_tpot_target
from skvs_jax.victims import VictimRule, check_custom_rule

STEP_COSTS = ("fit", "flat")


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The engine's options (docs/serving.md). Every field is validated at construction: a bad value raises
    ValueError or TypeError naming the field.

    Scheduling:
      max_running: the batch's bound on running sequences (None: every slot).
      token_budget: tokens a step computes, prompt chunks and drafts together.
      prefill_chunk: a prompt's tokens a step computes at most (0: the token budget); the prompt width.
      victim: a custom preemption victim rule, a function (rank, computed, held) -> int32[B] key
        (`skvs_jax.victims`); None: the policy's rule (`Policy.victim` names one).
      step_cost: what the goodput controller and priced drafts price a step with: "fit" (timed at `warmup`;
        flat until then), "flat", or a `scheduler.StepCost` used as given.
      split_rows: extra query rows of the prompt width's split branch (None: two full prompt chunks' worth;
        0: no split, every step with prompt work pads all rows to the chunk).
    Speculation:
      tree: the draft tree the K draft slots verify (None: a chain of K).
      acceptance: the acceptance rule (`speculation.RULES`; "lossless" by default).
      sample_drafts: draw drafts from the heads' distribution (a chain only) instead of their top-k.
      posterior_threshold, posterior_alpha: the typical-acceptance rule's parameters.
    Memory and kernels:
      impl: the step's kernels, "xla" | "pallas" | "reference" | "auto" (Pallas on a GPU, XLA elsewhere).
      control_flow: how the step skips rare work, "skip" | "select" | "" (the backend's: "skip" on a CPU,
        "select" on a GPU; `scheduler.SchedulerConfig.control_flow`). The served tokens are the same either way.
      prefix_sums: how the scheduler sums in priority order, "scan" | "dense" | "" (the backend's: "scan" on a
        CPU, "dense" on a GPU; `scheduler.SchedulerConfig.prefix_sums`). The same decisions either way.
      kv_dtype: the KV cache's dtype (None: the policy's `kv_precision`).
      swap_blocks, disk_blocks, disk_dir: the host tier's blocks, the disk tier's behind it, and its folder (None:
        a temporary one), for `preemption="swap"`.
      mesh: a `jax.sharding.Mesh` with a "tp" axis: weights and KV cache sharded over KV heads (None: one device).
    Text:
      tokenizer: what stop strings and bad words are tokenised with, and whose EOS ids end a request unless
        ignore_eos (`serve.tokenizer`: an `HFTokenizer`, or None for bytes, the shipped model's).
      detokenize: every request keeps its text (`RequestLog.text`, incrementally); without it only requests with
        stop strings matched on text do.
    The host:
      steps_per_dispatch: engine steps one jitted program runs before the host reads its outputs (an int in
        [1, 64], or "auto": from 1, doubling with each dispatch sent while no request arrives, up to
        `dispatch.AUTO_STEPS`); a dispatch also ends where the host is needed: an admission, a fork, a swap, a
        width change, a first token (`serve.dispatch`). 1: the one-step programs with the host between every
        two steps (the engine before dispatches of many steps).
      seed: the engine's seed, from which requests without one get theirs; in [0, 2**32).
      tpot_target: the TPOT objective [s] of a request whose SamplingParams.tpot_target is None (None: no
        objective): what the goodput draft controller drafts first for, and what SLO attainment counts.
      clock: the engine's clock (seconds); `time.perf_counter` by default.
    """

    max_running: int | None = None
    token_budget: int = 256
    prefill_chunk: int = 64
    victim: VictimRule | None = None
    step_cost: sc.StepCost | str = "fit"
    split_rows: int | None = None
    tree: spec.DraftTree | None = None
    acceptance: str = "lossless"
    sample_drafts: bool = False
    posterior_threshold: float = POSTERIOR_THRESHOLD
    posterior_alpha: float = POSTERIOR_ALPHA
    impl: str = "xla"
    control_flow: str = ""
    prefix_sums: str = ""
    kv_dtype: str | None = None
    swap_blocks: int = 0
    disk_blocks: int = 0
    disk_dir: str | None = None
    mesh: jax.sharding.Mesh | None = None
    tokenizer: Any = None
    detokenize: bool = False
    steps_per_dispatch: int | str = "auto"
    seed: int = 0
    tpot_target: float | None = None
    clock: Callable[[], float] = time.perf_counter

    def __post_init__(self) -> None:
        if self.impl not in pk.IMPLS:
            raise ValueError(f"impl must be one of {pk.IMPLS}, got {self.impl!r}")
        checks.at_least("swap_blocks", self.swap_blocks, 0)
        checks.at_least("disk_blocks", self.disk_blocks, 0)
        if self.split_rows is not None:
            checks.at_least("split_rows", self.split_rows, 0)
        if self.disk_dir is not None and not isinstance(self.disk_dir, str):
            raise TypeError(f"disk_dir must be a directory path (str) or None, got {type(self.disk_dir).__name__}")
        if isinstance(self.steps_per_dispatch, str):
            if self.steps_per_dispatch != "auto":
                raise ValueError(f"steps_per_dispatch must be an int >= 1 or 'auto', got {self.steps_per_dispatch!r}")
        else:
            checks.at_least("steps_per_dispatch", self.steps_per_dispatch, 1)
            if self.steps_per_dispatch > 64:  # `serve.dispatch.CAPACITY`
                raise ValueError(f"steps_per_dispatch must be <= 64 (the dispatch's output buffers), got "
                                 f"{self.steps_per_dispatch}")
        if not checks.is_int(self.seed):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__} {self.seed!r}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must lie in [0, 2**32), got {self.seed}")
        if isinstance(self.step_cost, str) and self.step_cost not in STEP_COSTS:
            raise ValueError(f"step_cost must be 'fit', 'flat' or a scheduler.StepCost, got {self.step_cost!r}")
        if not isinstance(self.step_cost, (str, sc.StepCost)):
            raise TypeError(f"step_cost must be 'fit', 'flat' or a scheduler.StepCost, got "
                            f"{type(self.step_cost).__name__}")
        if self.acceptance not in spec.RULES:
            raise ValueError(f"acceptance must be one of {spec.RULES}, got {self.acceptance!r}")
        if not isinstance(self.sample_drafts, bool):
            raise TypeError(f"sample_drafts must be a bool, got {type(self.sample_drafts).__name__}")
        for name in ("posterior_threshold", "posterior_alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.tree is not None and not isinstance(self.tree, spec.DraftTree):
            raise TypeError(f"tree must be a DraftTree, got {type(self.tree).__name__}")
        check_custom_rule(self.victim)
        if self.tokenizer is not None and not all(hasattr(self.tokenizer, a) for a in
                                                  ("encode", "decode", "exact_stop", "eos_token_ids", "detokenizer")):
            raise TypeError(f"tokenizer must be a serve.tokenizer.Tokenizer (ByteTokenizer, HFTokenizer) or None, got "
                            f"{type(self.tokenizer).__name__}")
        if not isinstance(self.detokenize, bool):
            raise TypeError(f"detokenize must be a bool, got {type(self.detokenize).__name__}")
        if self.tpot_target is not None:
            object.__setattr__(self, "tpot_target", check_tpot_target("tpot_target", self.tpot_target))
        if not callable(self.clock):
            raise TypeError(f"clock must be a callable returning seconds, got {type(self.clock).__name__}")

    @classmethod
    def of(cls, options: EngineOptions | None, overrides: dict) -> EngineOptions:
        """`options` (default: the defaults) with keyword `overrides`; an unknown keyword is a TypeError that
        lists the options."""
        options = cls() if options is None else options
        if not isinstance(options, cls):
            raise TypeError(f"options must be an EngineOptions, got {type(options).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; EngineOptions has {sorted(names)}")
        return dataclasses.replace(options, **overrides) if overrides else options


def draft_tree(runner: ModelRunner, policy: Policy, options: EngineOptions) -> spec.DraftTree | None:
    """The draft tree the policy's K draft slots verify (a chain of K by default), checked against the policy and
    the model's draft heads; None when the policy does not speculate."""
    tree = options.tree
    if not policy.speculation:
        if tree is not None or options.sample_drafts:
            raise ValueError("tree and sample_drafts need a policy that speculates")
        return None
    if tree is None:
        tree = spec.chain(policy.draft_len)
    if tree.num_slots - 1 != policy.draft_len:
        raise ValueError(f"the tree has {tree.num_slots - 1} nodes but policy.draft_len is {policy.draft_len}: "
                         "the scheduler grants one draft slot per node")
    depth = int(tree.depth.max())
    if depth > runner.num_draft_heads:
        raise ValueError(f"the drafts reach depth {depth} but the model has {runner.num_draft_heads} draft heads"
                         " (policy.draft_len or the tree's depth exceeds the model's draft heads)")
    top = max(c[-1] for c in tree.choices)
    if top >= runner.vocab_size:
        raise ValueError(f"the tree asks for rank {top} of a {runner.vocab_size}-token vocabulary")
    if options.sample_drafts and not spec.is_chain(tree):
        raise ValueError("sample_drafts needs a chain: a tree verifies point-mass (top-k) drafts")
    return tree
