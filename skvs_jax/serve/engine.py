"""The engine: the scheduler driving a real model, one jitted step at a time.

One step is one jitted program, with no host round trip inside:

  schedule → copy-on-write copies → query tokens (prompt chunks; last token + Medusa drafts) → paged forward
  (prefill chunks and decode/verification rows in one [B, Q] batch) → verify (greedy or sampled; accept the
  longest prefix of drafts the target agrees with) → update (commit / roll back, append tokens, index blocks,
  reclaim) → per-step statistics.

The host loop around it admits arrived requests into free slots, picks the query width Q from a small ladder of
buckets (decode-only steps use Q = 1 + K, steps with prompt work use Q = the prefill chunk), calls the step, and
streams the new tokens. Q is an upper bound computed from state the host already read, so the scheduler's
decisions never depend on it; the number of compiled programs is (number of buckets) per engine.

Verification is lossless for both greedy and temperature sampling: Medusa's drafts are deterministic (a point
mass q = δ(draft)), for which the rule "accept with probability min(1, p/q), else resample from the normalised
max(0, p − q)" is the same as sampling t ~ p at each position and accepting while t equals the draft; the token
sampled at the first mismatch (or after the last draft) is the bonus token. Greedy is the temperature-0 limit.

Preemption by swap needs host I/O between the scheduler's decision and the model, so with `preemption="swap"`
the step runs as two jitted programs (schedule; then model + update) with the tier copies between them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import math
import numbers
import time
from collections.abc import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from skvs_jax import checks, distributed
from skvs_jax import scheduler as sc
from skvs_jax.arrays import i32
from skvs_jax.config import NULL_BLOCK, CacheConfig
from skvs_jax.kv import manager
from skvs_jax.kv import tiers as tiers_mod
from skvs_jax.policies import Policy
from skvs_jax.serve import engine_step
from skvs_jax.serve import speculation as spec
from skvs_jax.serve.acceptance import POSTERIOR_ALPHA, POSTERIOR_THRESHOLD
from skvs_jax.serve.model_runner import LlamaMedusaRunner, ModelRunner


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """max_tokens >= 1 new tokens; temperature 0 = greedy; generation stops after any of stop_token_ids.

    Fields are normalised to Python types (numpy scalars are accepted); stop ids are checked against the
    model's vocabulary when the request is added.
    """

    max_tokens: int = 32
    temperature: float = 0.0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not checks.is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real)
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise ValueError(f"temperature must be a finite float >= 0, got {self.temperature!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Iterable):
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {type(self.stop_token_ids).__name__}")
        stops = tuple(self.stop_token_ids)
        if not all(checks.is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {stops!r}")
        if len(stops) > engine_step.MAX_STOP:
            raise ValueError(f"stop_token_ids holds at most {engine_step.MAX_STOP} ids, got {len(stops)}")
        object.__setattr__(self, "max_tokens", int(self.max_tokens))  # frozen: normalise once, here
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))


# ------------------------------------------------------------------------------------------------ the host

_reset_prefix = jax.jit(manager.reset_prefix, static_argnames=("cfg",))


@dataclasses.dataclass
class RequestLog:
    """Host-side record of a request (times in seconds since the engine started)."""

    request_id: int
    prompt: tuple[int, ...]
    sampling: SamplingParams
    arrival_time: float
    tokens: list[int] = dataclasses.field(default_factory=list)
    first_token_time: float = float("nan")
    finish_time: float = float("nan")
    admissions: int = 0
    admitted_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    drafted: int = 0
    accepted: int = 0
    finished: bool = False
    aborted: bool = False  # ended by `Engine.abort_request` before it finished
    error: str | None = None
    cache_salt: str | None = None  # the tenant's salt: its prompt shares cached blocks only with this salt


def salt_id(cache_salt: str | None) -> int:
    """The int32 the scheduler stores for a cache salt: 0 for None (no salt), else 31 bits of the salt's BLAKE2b
    digest, never 0. Two different salts share cached blocks only if these collide (p = 2^-31 per pair)."""
    if cache_salt is None:
        return 0
    digest = int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF
    return digest or 1


class Engine:
    """`Engine(model, heads, policy, cache_config, ...)`: add requests, `step()` or `run()`, read outputs.

    model: the base `reference_models.Llama`; heads: its `MedusaHeads` (required when the policy speculates;
    the first K heads draft); cache_config: the paged cache (its max_seqs slots hold waiting, running and
    swapped requests). Any other model: `Engine.from_runner(runner, params, policy, cache_config, ...)` with a
    `model_runner.ModelRunner`. mesh: a `jax.sharding.Mesh` with a "tp" axis (`distributed.make_mesh`) shards
    the weights and the KV cache over KV heads (tensor parallelism; docs/distributed.md); None: one device.
    step_cost: a `scheduler.StepCost` the goodput draft controller prices steps with (`draft_control="goodput"`);
    None: every step costs the same (drafts are free, only acceptance decides), the default on this CPU, where a
    step costs about the same at any width (docs/speculation.md, "Draft control").
    """

    def __init__(self, model, heads, policy: Policy, cache_config: CacheConfig, **kwargs):
        if policy.speculation and heads is None:
            raise TypeError("heads must be MedusaHeads when the policy speculates")
        runner, params = LlamaMedusaRunner.create(model, heads if policy.speculation else None)
        self._setup(runner, params, policy, cache_config, **kwargs)

    @classmethod
    def from_runner(cls, runner: ModelRunner, params, policy: Policy, cache_config: CacheConfig, **kwargs):
        """An engine for any model behind the `ModelRunner` protocol (runner static and hashable)."""
        engine = cls.__new__(cls)
        engine._setup(runner, params, policy, cache_config, **kwargs)
        return engine

    def _setup(self, runner: ModelRunner, params, policy: Policy, cache_config: CacheConfig, *,
               max_running: int | None = None, token_budget: int = 256, prefill_chunk: int = 64,
               impl: str = "xla", kv_dtype: str | None = None, swap_blocks: int = 0, seed: int = 0,
               victim: str = "lowest_priority", tree: spec.DraftTree | None = None, acceptance: str = "lossless",
               sample_drafts: bool = False, posterior_threshold: float = POSTERIOR_THRESHOLD,
               posterior_alpha: float = POSTERIOR_ALPHA,
               clock=time.perf_counter, mesh: jax.sharding.Mesh | None = None,
               step_cost: sc.StepCost | None = None) -> None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a Policy, got {type(policy).__name__}")
        if impl not in pk.IMPLS:
            raise ValueError(f"impl must be one of {pk.IMPLS}, got {impl!r}")
        if not checks.is_int(seed):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
        if not 0 <= seed < 2**32:
            raise ValueError(f"seed must lie in [0, 2**32), got {seed}")
        tree = self._check_speculation(runner, policy, tree, acceptance, sample_drafts, posterior_threshold,
                                       posterior_alpha)
        max_len = cache_config.max_tokens_per_seq
        if max_len > runner.max_positions:
            raise ValueError(f"max_blocks_per_seq * block_size = {max_len} exceeds the model's "
                             f"{runner.max_positions} positions")
        scfg = sc.SchedulerConfig(
            cache=cache_config, policy=policy, max_running=max_running or cache_config.max_seqs,
            token_budget=token_budget, prefill_chunk=prefill_chunk, swap_blocks=swap_blocks, victim=victim,
            admit_window=min(cache_config.max_seqs, 32),
            draft_reach=spec.reach(tree, policy.draft_buckets) if tree and policy.draft_buckets else ())
        kv_dtype = policy.kv_dtype() if kv_dtype is None else kv_dtype  # an explicit dtype overrides the policy's
        kv_shardings, self.mesh = None, mesh
        self.policy, self.knobs = policy, policy.knobs()
        if mesh is not None:
            params, kv_shardings = self._shard(runner, params, mesh, impl, cache_config, kv_dtype,
                                               policy.preemption == "swap" and swap_blocks > 0)
            self.knobs = jax.device_put(self.knobs, distributed.replicated(mesh))
        self.cfg = engine_step.EngineConfig(sched=scfg, impl=impl, kv_dtype=kv_dtype, tree=tree, acceptance=acceptance,
                                sample_drafts=sample_drafts, posterior_threshold=float(posterior_threshold),
                                posterior_alpha=float(posterior_alpha), kv_shardings=kv_shardings)
        self.runner, self.params = runner, params
        b = cache_config.max_seqs
        self._seed = seed
        if step_cost is not None:
            sc.check_step_cost(step_cost, scfg)
        if policy.goodput_control and tree is not None and not spec.is_chain(tree):
            raise ValueError("draft_control='goodput' prices d drafts as reaching depth d (a chain); with a draft "
                             "tree use draft_control='histogram' (e.g. the skvs_article preset)")
        self.step_cost = step_cost
        self.state = self._empty_state()
        # Compile buckets: one decode width per draft bucket (1 + drafts), one wide width for steps with prompt work.
        buckets = (policy.draft_buckets or (policy.draft_len,)) if policy.speculation else (0,)
        self.decode_widths = tuple(1 + x for x in buckets)
        self.prompt_width = max(scfg.chunk, 1 + policy.draft_len)  # scfg.chunk: prefill_chunk 0 = the budget
        self.widths = tuple(sorted(set(self.decode_widths) | {self.prompt_width}))
        self.draft_hist: collections.Counter[int] = collections.Counter()  # steps by most drafts in the step
        self.width_hist: collections.Counter[int] = collections.Counter()  # steps by query width
        self._next_drafts, self._drafts_knobs = policy.draft_len, None  # the bound, and the knobs it was made with
        self.clock, self.t0 = clock, clock()
        self.requests: dict[int, RequestLog] = {}
        self.queue: list[int] = []  # arrived, not yet in a slot
        self.slot_of: dict[int, int] = {}
        self.request_in: list[int] = [-1] * b
        self.step_log: list[dict] = []
        self._free_slots, self._prompt_work = b, False  # what the last step reported (see `_width`)
        self.compiled: set[tuple[int, bool]] = set()
        self._next_id = 0
        self.tiers = None
        if policy.preemption == "swap" and swap_blocks:
            self.tiers = tiers_mod.Tier(self._kv_pages(), swap_blocks)
            self.handles: dict[int, tiers_mod.SwapHandle] = {}

    def _empty_state(self) -> engine_step.EngineState:
        scfg, runner = self.cfg.sched, self.runner
        b = scfg.cache.max_seqs
        make_cache = functools.partial(runner.init_cache, scfg.cache.num_blocks, scfg.cache.block_size,
                                       self.cfg.kv_dtype)
        if self.mesh is None:
            cache = make_cache()
        else:  # created split over tp, never whole on one device
            cache = jax.jit(make_cache, out_shardings=runner.with_kv_pages(jax.eval_shape(make_cache),
                                                                           self.cfg.kv_shardings))()
        state = engine_step.EngineState(
            sched=sc.init(scfg), cache=cache, hidden=jnp.zeros((b, runner.hidden_size), jnp.float32),
            temperature=jnp.zeros((b,), jnp.float32), stop_ids=jnp.full((b, engine_step.MAX_STOP), -1, i32),
            rng=jax.random.key(self._seed), step_cost=self.step_cost)
        # init() shares one zeros buffer between fields; donation needs every leaf to own its buffer.
        state = jax.tree.map(lambda x: x.copy(), state)
        if self.mesh is None:
            return state
        # On a mesh: everything but the cache replicated (a few KB; every rank reads the block tables).
        return jax.device_put(state.replace(cache=None), distributed.replicated(self.mesh)).replace(cache=state.cache)

    def _shard(self, runner: ModelRunner, params, mesh, impl: str, cache_config: CacheConfig, kv_dtype,
               swaps: bool):
        """Validate `mesh` and place the weights on it; returns (params, the cache arrays' shardings)."""
        distributed.tp_size(mesh)
        if pk.resolve_impl(impl, None)[0] == "pallas":  # "auto" is the compiled Pallas kernels on a GPU
            raise ValueError(f"mesh: impl={impl!r} (Pallas) does not run sharded yet (its kernels would need "
                             "shard_map); use impl='xla' with a mesh")
        if swaps and jax.process_count() > 1:
            raise ValueError("mesh: swap preemption reads the cache to this host, which holds only part of it "
                             "when the mesh spans several processes; use preemption='recompute'")
        cache = jax.eval_shape(lambda: runner.init_cache(cache_config.num_blocks, cache_config.block_size,
                                                         kv_dtype))
        params_sh, kv_sh = distributed.runner_shardings(runner, params, cache, mesh)
        return jax.device_put(params, params_sh), kv_sh

    def _put(self, x: np.ndarray) -> jax.Array:
        """Host data into the step: replicated over the mesh if there is one (every process passes the same)."""
        return jnp.asarray(x) if self.mesh is None else jax.device_put(x, distributed.replicated(self.mesh))

    @staticmethod
    def _check_speculation(runner: ModelRunner, policy: Policy, tree, acceptance_rule: str, sample_drafts: bool,
                           posterior_threshold: float, posterior_alpha: float) -> spec.DraftTree | None:
        """The draft tree the policy's K draft slots verify (a chain of K by default), validated."""
        if acceptance_rule not in spec.RULES:
            raise ValueError(f"acceptance must be one of {spec.RULES}, got {acceptance_rule!r}")
        if not isinstance(sample_drafts, bool):
            raise TypeError(f"sample_drafts must be a bool, got {type(sample_drafts).__name__}")
        for name, value in (("posterior_threshold", posterior_threshold), ("posterior_alpha", posterior_alpha)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if not policy.speculation:
            if tree is not None or sample_drafts:
                raise ValueError("tree and sample_drafts need a policy that speculates")
            return None
        if tree is None:
            tree = spec.chain(policy.draft_len)
        if not isinstance(tree, spec.DraftTree):
            raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
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
        if sample_drafts and not spec.is_chain(tree):
            raise ValueError("sample_drafts needs a chain: a tree verifies point-mass (top-k) drafts")
        return tree

    # --------------------------------------------------------------------------------------------- requests

    def add_request(self, prompt_tokens: Sequence[int], sampling: SamplingParams | None = None, *,
                    arrival_time: float | None = None, request_id: int | None = None,
                    cache_salt: str | None = None) -> int:
        """Queue a request; returns its id. A request the cache can never hold is rejected with ValueError.

        cache_salt (vLLM's): requests with different salts never share a prefix-cache block, so one tenant cannot
        learn another's prompts from hit timing; requests with the same salt share as unsalted ones do (None = no
        salt, shared with every other unsalted request)."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise TypeError(f"cache_salt must be a non-empty str or None, got {cache_salt!r}")
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if isinstance(prompt_tokens, (str, bytes)) or not isinstance(prompt_tokens, Iterable):
            raise TypeError(f"prompt_tokens must be a sequence of ints, got {type(prompt_tokens).__name__}")
        prompt = tuple(prompt_tokens)
        if not all(checks.is_int(t) for t in prompt):
            bad = next(t for t in prompt if not checks.is_int(t))
            raise TypeError(f"prompt_tokens must be ints, got {type(bad).__name__} {bad!r}")
        prompt = tuple(int(t) for t in prompt)
        if not prompt:
            raise ValueError("prompt_tokens must not be empty")
        vocab = self.runner.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt_tokens must lie in [0, {vocab})")
        if any(t >= vocab for t in sampling.stop_token_ids):
            raise ValueError(f"sampling.stop_token_ids must lie in [0, {vocab}), got {sampling.stop_token_ids}")
        max_len = self.cfg.sched.max_len
        if len(prompt) + sampling.max_tokens > max_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                             f"{max_len} tokens a sequence can hold (max_blocks_per_seq * block_size)")
        if request_id is not None and not checks.is_int(request_id):
            raise TypeError(f"request_id must be an int, got {type(request_id).__name__}")
        rid = self._next_id if request_id is None else int(request_id)
        if not 0 <= rid <= engine_step.MAX_REQUEST_ID:  # -1 marks an empty slot on the device
            raise ValueError(f"request_id must lie in [0, {engine_step.MAX_REQUEST_ID}], got {rid}")
        if rid in self.requests:
            raise ValueError(f"request_id {rid} is already in use")
        self._next_id = max(self._next_id, rid + 1)
        now = self.now() if arrival_time is None else float(arrival_time)
        self.requests[rid] = RequestLog(rid, prompt, sampling, now, cache_salt=cache_salt)
        self.queue.append(rid)
        return rid

    def now(self) -> float:
        return self.clock() - self.t0

    def has_work(self) -> bool:
        return bool(self.queue) or any(r >= 0 for r in self.request_in)

    def _admit_queue(self) -> None:
        # Slots finished last step are EMPTY only after the next schedule, so the step reports the EMPTY count.
        take = self.queue[: self._free_slots]
        if not take:
            return
        b, max_len = self.cfg.sched.cache.max_seqs, self.cfg.sched.max_len
        prompts = np.zeros((b, max_len), np.int32)
        lens, new, prio, ids, salts = (np.zeros(b, np.int32) for _ in range(5))
        new[:] = 1
        temp = np.zeros(b, np.float32)
        stops = np.full((b, engine_step.MAX_STOP), -1, np.int32)
        for row, rid in enumerate(take):
            r = self.requests[rid]
            prompts[row, : len(r.prompt)], lens[row], new[row], ids[row] = r.prompt, len(r.prompt), \
                r.sampling.max_tokens, rid
            temp[row], salts[row] = r.sampling.temperature, salt_id(r.cache_salt)
            stops[row, : len(r.sampling.stop_token_ids)] = r.sampling.stop_token_ids
        put = self._put
        self.state, slots = engine_step.add_requests(self.state, put(prompts), put(lens), put(new), put(prio), put(ids),
                                              put(temp), put(stops), put(salts), cfg=self.cfg)
        slots = np.asarray(slots)
        for row, rid in enumerate(take):
            assert slots[row] >= 0, "a free slot was expected"
            self.slot_of[rid], self.request_in[int(slots[row])] = int(slots[row]), rid
        self.queue = self.queue[len(take):]
        self._free_slots -= len(take)
        self._prompt_work = True  # the new requests wait to be prefilled

    def _width(self) -> int:
        """The query bucket, from what the previous step reported (no state is read back between steps): the wide
        width when some row has prompt work (or requests were just added); otherwise 1 + the smallest draft
        bucket holding the most drafts any live row may get (an upper bound: memory and room only lower it). The
        bound was made with the knobs of the previous step; if `knobs` was replaced since, the widest bucket."""
        if self._prompt_work:
            return self.prompt_width
        if self.knobs is not self._drafts_knobs:
            return self.decode_widths[-1]
        return next((w for w in self.decode_widths if w - 1 >= self._next_drafts), self.decode_widths[-1])

    def warmup(self, draft_hist: dict[int, int] | None = None) -> list[int]:
        """Compile every query bucket now, hottest first, so no request waits for a compilation.

        draft_hist maps a step's most drafts -> steps (default: this engine's own `draft_hist`, e.g. from an
        earlier run; pass another engine's to warm up in the order a workload needs). The prompt width comes
        first (every request is prefilled with it), then the draft buckets in order of the observed steps that
        fall into them. Runs each program once on a copy of the state with no requests, so the engine's state is
        unchanged; an engine warmed up before its first request restarts its clock afterwards (times are measured
        from when it was ready to serve). Returns the widths in the order compiled.
        """
        hist = self.draft_hist if draft_hist is None else draft_hist
        heat: collections.Counter[int] = collections.Counter()
        for drafts, steps in hist.items():
            heat[next((w for w in self.decode_widths if w - 1 >= drafts), self.decode_widths[-1])] += steps
        decode = sorted(set(self.widths) - {self.prompt_width}, key=lambda w: (-heat[w], w))
        order = [self.prompt_width] + decode
        empty = self._empty_state()
        b, max_len = self.cfg.sched.cache.max_seqs, self.cfg.sched.max_len
        zeros, put = np.zeros((b,), np.int32), self._put  # all-padding rows: compiles `add` without adding anything
        jax.block_until_ready(engine_step.add_requests(
            jax.tree.map(lambda x: x.copy(), empty), put(np.zeros((b, max_len), np.int32)), put(zeros), put(zeros + 1),
            put(zeros), put(zeros - 1), put(np.zeros((b,), np.float32)),
            put(np.full((b, engine_step.MAX_STOP), -1, np.int32)), cfg=self.cfg))
        for w in order:
            state = jax.tree.map(lambda x: x.copy(), empty)
            if self.tiers is None:
                jax.block_until_ready(engine_step.fused_step(self.runner, self.params, state, self.knobs, cfg=self.cfg,
                                                  width=w))
            else:
                state, batch = engine_step.schedule_only(state, self.knobs, cfg=self.cfg)
                jax.block_until_ready(engine_step.model_only(self.runner, self.params, state, batch, self.knobs,
                                                             cfg=self.cfg, width=w))
            self.compiled.add((w, self.tiers is not None))
        if not self.requests:
            self.t0 = self.clock()
        return order

    # ------------------------------------------------------------------------------------------------- step

    def _kv_pages(self) -> tuple:
        return self.runner.kv_pages(self.state.cache)

    def _set_kv_pages(self, pages: tuple) -> None:
        if self.mesh is not None:  # the tier's scatter may come back laid out otherwise: split over tp again
            pages = jax.device_put(pages, self.cfg.kv_shardings)
        self.state = self.state.replace(cache=self.runner.with_kv_pages(self.state.cache, pages))

    def step(self) -> list[tuple[int, list[int], bool]]:
        """One engine step. Returns (request_id, new tokens, finished) for every request that produced tokens."""
        self._admit_queue()
        width = self._width()
        start = self.now()
        args = (self.runner, self.params)
        if self.tiers is None:
            self.state, out = engine_step.fused_step(*args, self.state, self.knobs, cfg=self.cfg, width=width)
        else:
            self.state, batch = engine_step.schedule_only(self.state, self.knobs, cfg=self.cfg)
            self._swap(batch)
            self.state, out = engine_step.model_only(*args, self.state, batch, self.knobs, cfg=self.cfg, width=width)
        out = jax.device_get(out)
        if not out.width_ok:
            raise RuntimeError("engine bug: a query did not fit its bucket or an allocation failed")
        self.compiled.add((width, self.tiers is not None))
        self._free_slots, self._prompt_work = int(out.free_slots), bool(out.prompt_work)
        self._next_drafts, self._drafts_knobs = int(out.next_drafts), self.knobs
        self.width_hist[width] += 1
        self.draft_hist[int(np.max(out.num_drafts))] += 1
        end = self.now()
        return self._collect(out, start, end)

    def _swap(self, batch) -> None:
        out_rows = np.flatnonzero(np.asarray(batch.swap_out))
        in_rows = np.flatnonzero(np.asarray(batch.swap_in))
        if not len(out_rows) and not len(in_rows):
            return
        blocks = np.asarray(batch.swap_out_blocks)
        for row in out_rows:  # read before anything is written this step
            ids = blocks[row][blocks[row] != NULL_BLOCK]
            handle = tiers_mod.swap_out(self._kv_pages(), ids, self.tiers)
            if not handle.ok:
                raise RuntimeError("host tier full although the scheduler counted room (engine bug)")
            self.handles[int(row)] = handle
        table = np.asarray(batch.block_table)
        pages = self._kv_pages()
        for row in in_rows:
            handle = self.handles.pop(int(row))
            pages = tiers_mod.swap_in(pages, handle, table[row, : handle.num_blocks])
        self._set_kv_pages(pages)

    def _collect(self, out: engine_step.StepOut, start: float, end: float) -> list[tuple[int, list[int], bool]]:
        results = []
        for slot, rid in enumerate(self.request_in):
            if rid < 0:
                continue
            r = self.requests[rid]
            if out.admitted[slot]:  # looked up: the prompt and, after a recompute, the output so far
                r.admissions += 1
                r.admitted_tokens += len(r.prompt) + len(r.tokens)
                r.cached_tokens += int(out.hit_tokens[slot])
            r.preemptions += int(out.preempted[slot])
            r.drafted += int(out.num_drafts[slot])
            r.accepted += int(out.accepted[slot])
            n = int(out.num_new[slot])
            if n:
                new = out.new_tokens[slot, :n].tolist()
                if not r.tokens:
                    r.first_token_time = end
                r.tokens.extend(new)
            if out.finished[slot]:
                r.finished, r.finish_time = True, end
                self.request_in[slot] = -1
                del self.slot_of[rid]
            if n or out.finished[slot]:
                results.append((rid, r.tokens[len(r.tokens) - n:], bool(out.finished[slot])))
        self.step_log.append(dict(
            start=start, duration=end - start, tokens=int(out.num_tokens), blocks_used=int(out.blocks_used),
            spec_blocks=int(out.spec_blocks), oom=bool(out.oom), preempted=int(np.sum(out.preempted)),
            drafted=int(np.sum(out.num_drafts)), accepted=int(np.sum(out.accepted)),
            verifications=int(np.sum(out.num_drafts > 0)), output_tokens=int(np.sum(out.num_new)),
            prefill_tokens=int(out.shape.prefill_tokens), decode_tokens=int(out.shape.decode_tokens),
            kv_tokens_read=int(out.shape.kv_tokens_read), num_seqs=int(out.shape.num_seqs),
            drafting_rows=int(out.shape.drafting_rows),
        ))
        return results

    def stream(self) -> Iterator[tuple[int, list[int], bool]]:
        """Step until every queued request finished, yielding (request_id, new tokens, finished)."""
        while self.has_work():
            yield from self.step()

    def run(self) -> dict[int, list[int]]:
        """Step until done; returns every request's output tokens."""
        for _ in self.stream():
            pass
        return {rid: list(r.tokens) for rid, r in self.requests.items()}

    def abort_request(self, request_id: int) -> bool:
        """End a request wherever it is: still queued (it leaves the queue) or in a slot (`scheduler.abort` releases
        its blocks, and a swapped request's host-tier copy). Its log keeps the tokens it produced and records no
        finish (`finished` stays False). Returns False when the request is unknown or already finished."""
        if isinstance(request_id, bool) or not checks.is_int(request_id):
            raise TypeError(f"request_id must be an int, got {type(request_id).__name__}")
        rid = int(request_id)
        r = self.requests.get(rid)
        if r is None or r.finished or r.aborted:
            return False
        r.aborted = True
        if rid in self.queue:
            self.queue.remove(rid)
            return True
        slot = self.slot_of.pop(rid)
        mask = np.zeros(self.cfg.sched.cache.max_seqs, bool)
        mask[slot] = True
        self.state = self.state.replace(sched=sc.abort(self.state.sched, self._put(mask), cfg=self.cfg.sched))
        if self.tiers is not None and slot in self.handles:
            tiers_mod.release(self.handles.pop(slot))
        self.request_in[slot] = -1
        self._free_slots += 1  # `abort` empties the slot at once
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (`kv.manager.reset_prefix`): later requests find no hit in what was cached
        before. Requests in flight keep their blocks."""
        sched = self.state.sched
        self.state = self.state.replace(sched=sched.replace(kv=_reset_prefix(sched.kv, cfg=self.cfg.sched.kv)))

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None) -> list[list[int]]:
        """Convenience: queue prompts, run, return their outputs in order."""
        ids = [self.add_request(p, sampling) for p in prompts]
        outputs = self.run()
        return [outputs[i] for i in ids]
