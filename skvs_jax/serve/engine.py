"""The engine: the scheduler driving a real model, one jitted step at a time.

One step is one jitted program, with no host round trip inside:

  schedule → copy-on-write copies → query tokens (prompt chunks; last token + Medusa drafts) → paged forward
  (prefill chunks and decode/verification rows in one [B, Q] batch) → verify (greedy or sampled; accept the
  longest prefix of drafts the target agrees with) → update (commit / roll back, append tokens, index blocks,
  reclaim) → per-step statistics.

The host loop around it admits arrived requests into free slots, picks the query width Q from a small ladder of
buckets (decode-only steps use Q = 1 + K, steps with prompt work use Q = the prefill chunk), calls the step, and
streams the new tokens. Q is an upper bound computed from state the host already read, so the scheduler's
decisions never depend on it; the number of compiled programs is (number of buckets) per engine. The prompt
width's program also holds the 1 + K width, which it runs when memory left the step without a prompt token,
and a split of it: the rows at 1 + K slots plus extra rows carrying the head of each long prompt chunk, so one
row's chunk does not pad every row to the chunk's width (`engine_step.model_step_at`). Under the
policy's `bucket_budget` the draft widths are chosen from the observed histogram (`warmup(draft_hist)`, and
re-chosen as it drifts, `scheduler.buckets`): at most 1 + budget * (1 + re-choices) programs over its life.

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
from skvs_jax.config import NULL_BLOCK, CacheConfig
from skvs_jax.kv import manager
from skvs_jax.kv import tiers as tiers_mod
from skvs_jax.policies import Policy
from skvs_jax.serve import engine_step
from skvs_jax.serve import sampling as sampling_mod
from skvs_jax.serve import speculation as spec
from skvs_jax.serve import step_cost as step_cost_mod
from skvs_jax.serve.acceptance import POSTERIOR_ALPHA, POSTERIOR_THRESHOLD
from skvs_jax.serve.model_runner import LlamaMedusaRunner, ModelRunner


def _real(name: str, value, lo: float, hi: float, *, open_lo: bool = False) -> float:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value < lo or value > hi or (open_lo and value == lo)):
        raise ValueError(f"{name} must be a finite float in {'(' if open_lo else '['}{lo}, {hi}], got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """max_tokens >= 1 new tokens; temperature 0 = greedy; generation stops after any of stop_token_ids.

    The other fields follow vLLM (docs/sampling.md): seed (a request's own random stream; None: one derived from
    the engine's seed and the request id), top_k (0 or -1 = off), top_p in (0, 1], min_p in [0, 1], repetition
    penalty > 0 (over prompt and output), presence / frequency penalties in [-2, 2] (over the output), stop
    strings (UTF-8 bytes of a byte-level model's text; the output ends before them unless
    include_stop_str_in_output), logprobs (None, or the top-N raw logprobs of every emitted token, N <=
    `sampling.MAX_LOGPROBS`), and n outputs of the prompt (1 <= n <= `sampling.MAX_N`; outputs 1.. fork off
    output 0 once it has its first token, sharing the prompt's blocks, each with its own stream). At most
    `engine_step.MAX_STOP` stop ids and strings together, each string of at most `sampling.MAX_STOP_LEN` bytes.

    Fields are normalised to Python types (numpy scalars are accepted); stop ids are checked against the
    model's vocabulary when the request is added.
    """

    max_tokens: int = 32
    temperature: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    n: int = 1

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
        self._check_sampling()

    def _check_sampling(self) -> None:
        if self.seed is not None and (not checks.is_int(self.seed) or not 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be None or an int in [0, 2**32), got {self.seed!r}")
        if not checks.is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1: off), got {self.top_k!r}")
        top_p = _real("top_p", self.top_p, 0.0, 1.0, open_lo=True)
        min_p = _real("min_p", self.min_p, 0.0, 1.0)
        repetition = _real("repetition_penalty", self.repetition_penalty, 0.0, math.inf, open_lo=True)
        presence = _real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        frequency = _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        stop = (self.stop,) if isinstance(self.stop, (str, bytes)) else self.stop
        if not isinstance(stop, Iterable):
            raise TypeError(f"stop must be a string or a sequence of non-empty strings, got {self.stop!r}")
        stop = tuple(stop)  # once: a generator is consumed by reading it
        if not all(isinstance(x, (str, bytes)) and x for x in stop):
            raise TypeError(f"stop must be a string or a sequence of non-empty strings, got {stop!r}")
        for x in stop:
            if len(stop_bytes(x)) > sampling_mod.MAX_STOP_LEN:
                raise ValueError(f"stop strings hold at most {sampling_mod.MAX_STOP_LEN} UTF-8 bytes, got {x!r}")
        if len(stop) + len(self.stop_token_ids) > engine_step.MAX_STOP:
            raise ValueError(f"stop and stop_token_ids hold at most {engine_step.MAX_STOP} entries together, got "
                             f"{len(stop) + len(self.stop_token_ids)}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise TypeError("include_stop_str_in_output must be a bool")
        if self.logprobs is not None and (not checks.is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= sampling_mod.MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {sampling_mod.MAX_LOGPROBS}], got "
                             f"{self.logprobs!r}")
        if not checks.is_int(self.n) or not 1 <= self.n <= sampling_mod.MAX_N:
            raise ValueError(f"n must be an int in [1, {sampling_mod.MAX_N}], got {self.n!r}")
        for name, value in (("n", int(self.n)), ("seed", None if self.seed is None else int(self.seed)),
                            ("top_k", max(int(self.top_k), 0)), ("top_p", top_p), ("min_p", min_p),
                            ("repetition_penalty", repetition),
                            ("presence_penalty", presence), ("frequency_penalty", frequency), ("stop", stop),
                            ("logprobs", None if self.logprobs is None else int(self.logprobs))):
            object.__setattr__(self, name, value)

    def stop_sequences(self) -> list[tuple[int, ...]]:
        """Every stop as token ids: each stop id alone, then each stop string's UTF-8 bytes."""
        return [(t,) for t in self.stop_token_ids] + [tuple(stop_bytes(x)) for x in self.stop]


def stop_bytes(stop: str | bytes) -> bytes:
    """A stop string as the byte-level model's tokens: its UTF-8 bytes."""
    return stop if isinstance(stop, bytes) else stop.encode("utf-8")


# ------------------------------------------------------------------------------------------------ the host

_reset_prefix = jax.jit(manager.reset_prefix, static_argnames=("cfg",))
_release_finished = jax.jit(sc.release_finished, static_argnames=("cfg",))


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
    first_cached_tokens: int = 0  # of cached_tokens, those of the first admission (metrics' kv_hit_rate_first)
    logprobs: list[dict[int, float]] | None = None  # per token: raw logprobs of the token and the top-N (if asked)
    sample_index: int = 0  # which of the prompt's n outputs this is (output 0: the request itself)
    sample_ids: tuple[int, ...] = ()  # output 0 of n > 1: the ids of the n outputs in order (consecutive)
    cache_salt: str | None = None  # the tenant's salt: its prompt shares cached blocks only with this salt

    @property
    def output_tokens(self) -> list[int]:
        """The output as a vLLM user reads it: `tokens` without a stop string that ended it (unless
        include_stop_str_in_output); stop token ids stay."""
        tail = self.tokens
        if self.finished and not self.sampling.include_stop_str_in_output:
            for stop in self.sampling.stop:
                seq = list(stop_bytes(stop))
                if len(tail) >= len(seq) and tail[len(tail) - len(seq):] == seq:
                    return tail[: len(tail) - len(seq)]
        return list(tail)


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
    step_cost: what the goodput draft controller (`draft_control="goodput"`) and priced draft blocks
    (`draft_memory="priced"`) price a step with: "fit" (default) measures this engine's compiled programs at
    `warmup` (`serve.step_cost`: the step's time by its widest row; flat until then, so an engine never warmed
    up schedules reproducibly), "flat" every step the same (drafts free, a recompute free: only acceptance
    decides), or a `scheduler.StepCost` to use as given (docs/speculation.md, "The engine's step cost").
    split_rows: extra query rows of the prompt width's split branch (`engine_step.model_step_at`): None (default)
    enough for two full prompt chunks beside the narrow rows (`engine_step.split_rows_for`), 0 no split (every
    step with prompt work pads all rows to the chunk).
    Swap tiers (`preemption="swap"`): swap_blocks host-tier blocks, backed by disk_blocks blocks of a disk tier in
    disk_dir (None: a temporary directory); a swap that does not fit the host spills the least recently swapped
    sequences to disk (`kv.tiers.SwapSpace`), and the scheduler counts both tiers' room, recomputing when both are
    full. impl ("xla" | "pallas" | "reference" | "auto"): the kernels of the step, the paged attention and the
    speculative-validation kernels (the commit's `update_block_states`, and `invalidate_drafts` when the policy
    scrubs rejected drafts); "pallas" is interpreted off-GPU, "auto" is Pallas on a GPU and XLA elsewhere.
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
               victim: str | None = None, tree: spec.DraftTree | None = None, acceptance: str = "lossless",
               sample_drafts: bool = False, posterior_threshold: float = POSTERIOR_THRESHOLD,
               posterior_alpha: float = POSTERIOR_ALPHA,
               clock=time.perf_counter, mesh: jax.sharding.Mesh | None = None,
               step_cost: sc.StepCost | str = "fit", disk_blocks: int = 0, disk_dir: str | None = None,
               split_rows: int | None = None) -> None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a Policy, got {type(policy).__name__}")
        if impl not in pk.IMPLS:
            raise ValueError(f"impl must be one of {pk.IMPLS}, got {impl!r}")
        checks.at_least("swap_blocks", swap_blocks, 0)
        checks.at_least("disk_blocks", disk_blocks, 0)
        if split_rows is not None:
            checks.at_least("split_rows", split_rows, 0)
        if disk_dir is not None and not isinstance(disk_dir, str):
            raise TypeError(f"disk_dir must be a directory path (str) or None, got {type(disk_dir).__name__}")
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
            token_budget=token_budget, prefill_chunk=prefill_chunk, victim=victim, impl=impl,
            swap_blocks=swap_blocks + disk_blocks,  # the scheduler counts the room of both tiers
            admit_window=min(cache_config.max_seqs, 32),
            draft_reach=spec.reach(tree, policy.draft_buckets) if tree and policy.draft_buckets else (),
            reach_table=spec.reach(tree, tuple(range(policy.draft_len + 1))) if tree else ())
        kv_dtype = policy.kv_dtype() if kv_dtype is None else kv_dtype  # an explicit dtype overrides the policy's
        kv_shardings, self.mesh = None, mesh
        self.policy, self.knobs = policy, policy.knobs()
        if mesh is not None:
            params, kv_shardings = self._shard(runner, params, mesh, impl, cache_config, kv_dtype,
                                               policy.preemption == "swap" and swap_blocks + disk_blocks > 0)
            self.knobs = jax.device_put(self.knobs, distributed.replicated(mesh))
        self.cfg = engine_step.EngineConfig(sched=scfg, impl=impl, kv_dtype=kv_dtype, tree=tree, acceptance=acceptance,
                                sample_drafts=sample_drafts, posterior_threshold=float(posterior_threshold),
                                posterior_alpha=float(posterior_alpha), kv_shardings=kv_shardings)
        self.runner, self.params = runner, params
        b = cache_config.max_seqs
        prompt_width = max(scfg.chunk, 1 + policy.draft_len)  # scfg.chunk: prefill_chunk 0 = the budget
        self.cfg = dataclasses.replace(self.cfg, split_rows=engine_step.split_rows_for(self.cfg, prompt_width)
                                       if split_rows is None else int(split_rows))
        self._seed = seed
        if isinstance(step_cost, str):
            if step_cost not in ("fit", "flat"):
                raise ValueError(f"step_cost must be 'fit', 'flat' or a scheduler.StepCost, got {step_cost!r}")
        else:
            sc.check_step_cost(step_cost, scfg)
        # Compile buckets: one decode width per draft width (1 + drafts; the state's `draft_widths`, chosen from
        # the histogram under `bucket_budget`), one wide width for steps with prompt work.
        buckets = (policy.draft_buckets or (policy.draft_len,)) if policy.speculation else (0,)
        self.decode_widths = tuple(1 + x for x in buckets)
        self.prompt_width = prompt_width
        self.widths = tuple(sorted(set(self.decode_widths) | {self.prompt_width}))  # every width had so far
        # The state always carries a StepCost of one shape (a width table up to the prompt width), so a fit at
        # warm-up replaces data and recompiles nothing.
        self.step_cost_mode = step_cost if isinstance(step_cost, str) else "given"
        # Kept on the host: the step donates the state's copy, which a caller's StepCost must outlive.
        self.step_cost = jax.device_get(sc.flat_step_cost(scfg, max_width=self.prompt_width)
                                        if isinstance(step_cost, str) else step_cost)
        self.step_cost_times: dict[int, float] = {}  # the fit's measured step time per width (us)
        self.split_step_us: float | None = None  # the fit's time of the prompt width's split branch (us)
        self.split_steps = 0  # steps that ran the split branch (counted at the prompt width in `width_hist`)
        # B default sampling rows on the host, built once: eager jnp ops rebuilding them cost ~2.5 ms an admission
        # on a CPU host (`_sampling_rows` copies them).
        self._default_rows = jax.device_get(sampling_mod.default_rows(b))
        self._host_backend = mesh is None and jax.default_backend() == "cpu"  # `_fetch`
        self.state = self._empty_state()
        self.chooser = (sc.buckets.BucketChooser(policy.draft_len, policy.bucket_budget, tuple(buckets))
                        if policy.bucket_budget else None)
        self.padding = 0  # draft slots verified without a draft, over decode steps (`scheduler.buckets`)
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
        self._unforked: dict[int, int] = {}  # n > 1 requests not forked yet -> empty slots held for their outputs 1..
        self.tiers = None
        if policy.preemption == "swap" and scfg.swap_blocks:  # host tier (swap_blocks) backed by disk (disk_blocks)
            self.tiers = tiers_mod.SwapSpace(self._kv_pages(), swap_blocks, disk_blocks, disk_dir)
            self.handles: dict[int, tiers_mod.TieredHandle] = {}

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
            sampling=sampling_mod.default_rows(b), step_cost=self._device_step_cost())
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

    def _arg(self, x: np.ndarray) -> np.ndarray | jax.Array:
        """Host data as an argument of a jitted call (not a state leaf, which the step donates): numpy as is off a
        mesh, where the call moves all of them at once (half the time of an admission's separate transfers,
        measured on a 2-core CPU); replicated on a mesh (`_put`)."""
        return x if self.mesh is None else self._put(x)

    def _fetch(self, tree):
        """A step's outputs on the host (numpy leaves). On a CPU backend without a mesh each leaf is read in place
        (`np.asarray`): `jax.device_get` costs ~14 us a leaf there in its async-copy bookkeeping, ~1.2 ms of a
        ~12 ms step for StepOut's leaves (measured on a 2-core CPU); elsewhere `device_get` overlaps the copies."""
        return jax.tree.map(np.asarray, tree) if self._host_backend else jax.device_get(tree)

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
        if any(t >= vocab for seq in sampling.stop_sequences() for t in seq):
            raise ValueError(f"sampling.stop strings are UTF-8 bytes, which must lie in this model's vocabulary "
                             f"[0, {vocab})")
        max_len = self.cfg.sched.max_len
        if len(prompt) + sampling.max_tokens > max_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                             f"{max_len} tokens a sequence can hold (max_blocks_per_seq * block_size)")
        if request_id is not None and not checks.is_int(request_id):
            raise TypeError(f"request_id must be an int, got {type(request_id).__name__}")
        if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, numbers.Real)):
            raise TypeError(f"arrival_time must be a number (seconds on the engine's clock) or None, got "
                            f"{type(arrival_time).__name__} {arrival_time!r}")
        if arrival_time is not None and not math.isfinite(arrival_time):
            raise ValueError(f"arrival_time must be finite, got {arrival_time!r}")
        rid = self._next_id if request_id is None else int(request_id)
        if not 0 <= rid <= engine_step.MAX_REQUEST_ID:  # -1 marks an empty slot on the device
            raise ValueError(f"request_id must lie in [0, {engine_step.MAX_REQUEST_ID}], got {rid}")
        if rid in self.requests:
            raise ValueError(f"request_id {rid} is already in use")
        n = sampling.n
        if n > self.cfg.sched.cache.max_seqs:
            raise ValueError(f"sampling.n ({n}) exceeds the cache's {self.cfg.sched.cache.max_seqs} slots (each output "
                             "takes one)")
        ids = tuple(range(rid, rid + n))
        if n > 1 and (ids[-1] > engine_step.MAX_REQUEST_ID or any(i in self.requests for i in ids)):
            raise ValueError(f"n = {n} outputs take the request ids {rid} .. {ids[-1]}; some are in use or too large")
        self._next_id = max(self._next_id, rid + n)
        now = self.now() if arrival_time is None else float(arrival_time)
        self.requests[rid] = RequestLog(rid, prompt, sampling, now, sample_ids=ids if n > 1 else (),
                                       cache_salt=cache_salt)
        for i in range(1, n):  # forked off output 0 once it has sampled its first token
            self.requests[rid + i] = RequestLog(rid + i, prompt, sampling, now, sample_index=i,
                                               cache_salt=cache_salt)
        if n > 1:
            self._unforked[rid] = 0  # slots held for its outputs 1.. (set at admission)
        self.queue.append(rid)
        return rid

    def completions(self, request_id: int) -> list[list[int]]:
        """The outputs of a request in order: its n outputs (`SamplingParams.n`), each as `RequestLog.output_tokens`."""
        r = self.requests[request_id]
        return [self.requests[i].output_tokens for i in (r.sample_ids or (request_id,))]

    def now(self) -> float:
        return self.clock() - self.t0

    def has_work(self) -> bool:
        return bool(self.queue) or any(r >= 0 for r in self.request_in)

    def _admit_queue(self) -> None:
        # Slots finished last step are EMPTY only after the next schedule, so the step reports the EMPTY count.
        take, need = [], 0
        for rid in self.queue:  # in order: a request whose n outputs do not fit yet waits, and so do later ones
            n = 1 + len(self._live_outputs(rid))  # outputs aborted before admission hold no slot
            if need + n > self._free_slots:
                break
            take.append(rid)
            need += n
            if rid in self._unforked:
                self._unforked[rid] = n - 1  # empty slots held until it forks
        if not take:
            return
        b, max_len = self.cfg.sched.cache.max_seqs, self.cfg.sched.max_len
        prompts = np.zeros((b, max_len), np.int32)
        lens, new, prio, ids, salts = (np.zeros(b, np.int32) for _ in range(5))
        new[:] = 1
        for row, rid in enumerate(take):
            r = self.requests[rid]
            prompts[row, : len(r.prompt)], lens[row], new[row], ids[row] = r.prompt, len(r.prompt), \
                r.sampling.max_tokens, rid
            salts[row] = salt_id(r.cache_salt)
        put = self._arg
        rows = jax.tree.map(put, self._sampling_rows([self.requests[rid] for rid in take]))
        self.state, slots = engine_step.add_requests(self.state, put(prompts), put(lens), put(new), put(prio), put(ids),
                                                     rows, put(salts), cfg=self.cfg)
        slots = np.asarray(slots)
        for row, rid in enumerate(take):
            assert slots[row] >= 0, "a free slot was expected"
            self.slot_of[rid], self.request_in[int(slots[row])] = int(slots[row]), rid
        self.queue = self.queue[len(take):]
        self._free_slots -= need
        self._prompt_work = True  # the new requests wait to be prefilled

    def _sampling_rows(self, logs: list[RequestLog]) -> sampling_mod.SamplingRows:
        """B sampling rows (numpy) for these requests in order, defaults past them. A request's stream: its seed's
        (without one: a seed mixed from the engine's and the request id), folded with sample index 0."""
        b = self.cfg.sched.cache.max_seqs
        rows = jax.tree.map(np.array, self._default_rows)  # copies: the rows are written below
        seeds, index = np.zeros(b, np.uint32), np.zeros(b, np.int32)
        for row, r in enumerate(logs):
            sp = r.sampling
            for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                         "frequency_penalty"):
                getattr(rows, name)[row] = getattr(sp, name)
            rows.logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
            for x, seq in enumerate(sp.stop_sequences()):
                rows.stops[row, x, : len(seq)], rows.stop_len[row, x] = seq[::-1], len(seq)
            seeds[row] = sp.seed if sp.seed is not None else self._unseeded(r.request_id - r.sample_index)
            index[row] = r.sample_index
            rows.siblings[row] = sp.n - 1 if r.sample_index == 0 else 0
        if logs:
            rows = rows.replace(stream=np.asarray(sampling_mod.stream_keys(seeds, index)), seed=seeds)
        return rows

    def _unseeded(self, request_id: int) -> int:
        """A seed for a request without one: the engine's seed and the request id, mixed (splitmix32)."""
        x = (self._seed * 0x9E3779B9 + request_id + 1) & 0xFFFFFFFF
        for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
            x = ((x ^ (x >> shift)) * mult) & 0xFFFFFFFF
        return x ^ (x >> 16)

    def _width(self) -> int:
        """The query bucket, from what the previous step reported (no state is read back between steps): the wide
        width when some row has prompt work (or requests were just added); otherwise 1 + the smallest draft
        width holding the most drafts any live row may get (an upper bound: memory and room only lower it;
        `scheduler.buckets.snap_up` of the bound were every width compiled, which is the bound under the current
        widths, even just after a re-choice). The bound was made with the knobs of the previous step; if `knobs`
        was replaced since, the widest bucket."""
        if self._prompt_work:
            return self.prompt_width
        if self.knobs is not self._drafts_knobs:
            return self.decode_widths[-1]
        return 1 + int(sc.buckets.snap_up(self._next_drafts, [w - 1 for w in self.decode_widths]))

    def set_draft_widths(self, widths) -> None:
        """Replace the draft widths (data in the scheduler's state: nothing compiled is recompiled; a new width
        compiles its program when first run). widths: 1..W draft counts in [0, K], K among them."""
        k, slots = self.policy.draft_len, self.policy.width_slots
        widths = tuple(sorted(set(int(w) for w in widths)))
        if not widths or widths[-1] != k or widths[0] < 0 or len(widths) > slots:
            raise ValueError(f"widths must hold 1..{slots} draft counts in [0, {k}], {k} among them, got {widths}")
        self.decode_widths = tuple(1 + w for w in widths)
        had = set(self.widths) if self.compiled else {self.prompt_width}  # before any program: a fresh choice
        self.widths = tuple(sorted(had | set(self.decode_widths)))
        if self.chooser is not None:
            self.chooser.widths = widths
        sched = self.state.sched
        self.state = self.state.replace(sched=sched.replace(
            draft_widths=self._put(sc.buckets.padded(widths, slots))))
        if self.step_cost_times:  # a fitted cost: new widths priced between the timed ones until refitted
            self._install_step_cost()

    def warmup(self, draft_hist: dict[int, int] | None = None) -> list[int]:
        """Compile every query bucket now, hottest first, so no request waits for a compilation.

        draft_hist maps a step's most drafts -> steps (default: this engine's own `draft_hist`, e.g. from an
        earlier run; pass another engine's to warm up in the order a workload needs; `bucket_hist` weighs each
        step by its decode rows, the padding's weight). Under `bucket_budget` a non-empty histogram first
        chooses the draft widths (`scheduler.buckets.choose_widths`). The prompt width comes
        first (every request is prefilled with it), then the draft buckets in order of the observed steps that
        fall into them. Runs each program once on a copy of the state with no requests, so the engine's state is
        unchanged; an engine warmed up before its first request restarts its clock afterwards (times are measured
        from when it was ready to serve). Returns the widths in the order compiled.

        Empty steps execute only the kernels an empty step reaches. XLA:CPU spends ~1 ms on each kernel's first
        execution (measured on a 2-core CPU), so the first preemption, eviction or prefix hit of this process's
        programs runs slower once (two steps of 150 ms instead of 10-20 on the bench trace); a timing should serve
        its workload once untimed first (`skvs bench --rehearse`). Engines of one configuration share programs.
        """
        hist = self.draft_hist if draft_hist is None else draft_hist
        if self.chooser is not None and any(hist.values()):  # choose the programs from the histogram first
            self.set_draft_widths(sc.buckets.choose_widths(sc.buckets.as_hist(hist, self.policy.draft_len),
                                                           self.policy.bucket_budget, self.policy.draft_len))
        heat: collections.Counter[int] = collections.Counter()
        for drafts, steps in hist.items():
            heat[1 + int(sc.buckets.snap_up(drafts, [w - 1 for w in self.decode_widths]))] += steps
        decode = sorted(set(self.decode_widths) - {self.prompt_width}, key=lambda w: (-heat[w], w))
        order = [self.prompt_width] + decode
        empty = self._empty_state()
        b, max_len = self.cfg.sched.cache.max_seqs, self.cfg.sched.max_len
        zeros, put = np.zeros((b,), np.int32), self._arg  # all-padding rows: compiles `add` without adding anything
        jax.block_until_ready(engine_step.add_requests(
            jax.tree.map(lambda x: x.copy(), empty), put(np.zeros((b, max_len), np.int32)), put(zeros), put(zeros + 1),
            put(zeros), put(zeros - 1), jax.tree.map(put, self._sampling_rows([])), put(zeros), cfg=self.cfg))
        jax.block_until_ready(sampling_mod.stream_keys(zeros.astype(np.uint32), zeros))  # what an admission runs
        for w in order:
            jax.block_until_ready(self._idle_step(empty, w))
            self.compiled.add((w, self.tiers is not None))
        if self.step_cost_mode == "fit" and (self.policy.goodput_control or self.policy.priced_drafts):
            self.fit_step_cost()
        if not self.requests:
            self.t0 = self.clock()
        return order

    def fit_step_cost(self, rounds: int = step_cost_mod.MEASURE_ROUNDS) -> sc.StepCost:
        """Time one step of every width the engine runs now on empty slots (`serve.step_cost.measure`), fit the
        step cost from them (`serve.step_cost.fit`) and price the next steps with it; returns it. Its times (us per
        width) stay in `step_cost_times`. Compiles any width not compiled yet; the engine's state is unchanged
        (empty slots: a padded step computes every slot whatever it holds)."""
        empty = self._empty_state()

        def prepare(key):
            state = jax.tree.map(lambda x: x.copy(), empty)  # untimed: the step donates its state
            return lambda: self._idle_step(state, *key, copy=False)

        now = self._runnable_widths()
        keys = [(w, engine_step.WIDE) for w in now]
        if self._splits():
            keys.append((self.prompt_width, engine_step.SPLIT))
        timed = step_cost_mod.measure(prepare, keys, rounds)
        self.step_cost_times = {w: t for (w, branch), t in timed.items() if branch == engine_step.WIDE}
        self.split_step_us = timed.get((self.prompt_width, engine_step.SPLIT))
        self.compiled |= {(w, self.tiers is not None) for w in now}
        self._install_step_cost()
        return self.step_cost

    def _idle_step(self, state: engine_step.EngineState, width: int, branch: int = engine_step.WIDE,
                   copy: bool = True):
        """One step at `width` on a state with no requests (a copy of it unless copy=False: the step donates it),
        through the program a serving step at that width runs, its `branch` forced (`engine_step.model_step_at`:
        WIDE, the whole width, by default); returns its outputs. What `warmup` compiles with and `fit_step_cost`
        times."""
        if copy:
            state = jax.tree.map(lambda x: x.copy(), state)
        if self.tiers is None:
            return engine_step.fused_step(self.runner, self.params, state, self.knobs, branch, cfg=self.cfg,
                                          width=width)
        state, batch = engine_step.schedule_only(state, self.knobs, cfg=self.cfg)
        return engine_step.model_only(self.runner, self.params, state, batch, self.knobs, branch, cfg=self.cfg,
                                      width=width)

    def _splits(self) -> bool:
        """The prompt width's program has a split branch (`engine_step.model_step_at`)."""
        return self.cfg.split_rows > 0 and self.prompt_width > engine_step.narrow_width(self.cfg)

    def _runnable_widths(self) -> list[int]:
        """The query widths a step can run now: the decode widths and the prompt width."""
        return sorted(set(self.decode_widths) | {self.prompt_width})

    def _install_step_cost(self) -> None:
        """The fit of `step_cost_times` over the current widths, into the state (same shapes: no recompile). With
        a split branch, a step with prompt work is priced at the split's time: what it runs unless the chunks
        outgrow the extra rows."""
        times = dict(self.step_cost_times)
        if self.split_step_us is not None:
            times[self.prompt_width] = self.split_step_us
        cost = step_cost_mod.fit(times, self._runnable_widths(), self.cfg.sched.token_budget, self.prompt_width)
        self.step_cost = jax.device_get(cost)
        self.state = self.state.replace(step_cost=self._device_step_cost())

    def _device_step_cost(self) -> sc.StepCost:
        """`step_cost` (host arrays) on the device, each leaf its own buffer (the step donates them)."""
        return jax.tree.map(lambda x: self._put(np.array(x)), self.step_cost)

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
        bound = self._next_drafts if not self._prompt_work and self.knobs is self._drafts_knobs else None
        start = self.now()
        args = (self.runner, self.params)
        if self.tiers is None:
            self.state, out = engine_step.fused_step(*args, self.state, self.knobs, engine_step.AUTO, cfg=self.cfg,
                                                     width=width)
        else:
            self.state, batch = engine_step.schedule_only(self.state, self.knobs, cfg=self.cfg)
            self._swap(batch)
            self.state, out = engine_step.model_only(*args, self.state, batch, self.knobs, engine_step.AUTO,
                                                     cfg=self.cfg, width=width)
        out = self._fetch(out)
        if not out.width_ok:
            raise RuntimeError("engine bug: a query did not fit its bucket or an allocation failed")
        self.compiled.add((width, self.tiers is not None))
        self._free_slots = int(out.free_slots) - sum(self._unforked.values())
        self._prompt_work = bool(out.prompt_work)
        self._next_drafts, self._drafts_knobs = int(out.next_want), self.knobs
        ran = int(out.width)  # narrower than `width` when memory kept every prompt row out (`model_step_at`)
        if bool(out.split):  # the prompt width's split branch: counted at the width the host chose
            ran = width
            self.split_steps += 1
        self.width_hist[ran] += 1
        self.draft_hist[int(np.max(out.num_drafts))] += 1
        end = self.now()
        forking = {rid: self.slot_of[rid] for rid in self._unforked if rid in self.slot_of}
        results = self._collect(out, start, end)
        self._account_padding(out, ran, bound)
        results += self._fork(out, forking, end)
        if not self.has_work() and out.finished.any():
            self._release_idle(int(np.sum(out.finished)))
        return results

    def _release_idle(self, finished: int) -> None:
        """The slots the last step finished give their blocks back now (`scheduler.release_finished`, phase 0 of
        the next `schedule`, run early): an idle engine holds no request's blocks. One small dispatch, only when
        the engine runs dry; while it has work the next step's schedule releases them at no extra cost, and the
        same way, so no schedule changes."""
        sched = _release_finished(self.state.sched, cfg=self.cfg.sched)
        self.state = self.state.replace(sched=sched)
        self._free_slots += finished

    def _account_padding(self, out: engine_step.StepOut, width: int, bound: int | None) -> None:
        """A decode-only step's padding (its rows' draft slots without a draft) into the step log and the
        engine's total; with `bucket_budget`, its bound into the bucket chooser, which may re-choose the widths.
        bound: what picked the width (None: a prompt-width step, or the widest after the knobs changed)."""
        rows, drafted = int(np.sum(out.scheduled)), int(np.sum(out.num_drafts))
        pad = rows * (width - 1) - drafted if bound is not None else 0
        self.padding += pad
        self.step_log[-1].update(width=width, bound=-1 if bound is None else bound, padding=pad,
                                 split=bool(out.split))
        if bound is None or self.chooser is None or not rows:
            return
        self.chooser.observe(bound, rows, drafted)
        widths = self.chooser.rechoose()
        if widths is not None:
            self.set_draft_widths(widths)

    @property
    def bucket_hist(self) -> dict[int, int]:
        """Decode rows by their step's draft bound, over this engine's decode-only steps (with `bucket_budget`;
        empty otherwise): what `warmup` of a later engine chooses its widths from."""
        if self.chooser is None:
            return {}
        return {d: w for d, w in enumerate(self.chooser.hist) if w}

    def _fork(self, out: engine_step.StepOut, forking: dict[int, int], end: float) -> list[tuple[int, list[int], bool]]:
        """Outputs 1.. of the n > 1 requests whose output 0 sampled its first token this step: each takes the
        token its own stream drew there (`StepOut.sibling_tokens`) and forks off output 0's slot, sharing the
        prompt's blocks; one that ends with that token (max_tokens 1, a stop) finishes without a slot."""
        results, forks = [], []
        for rid, slot in forking.items():
            if not out.num_new[slot]:
                continue
            parent = self.requests[rid]
            for cid in self._live_outputs(rid):
                r = self.requests[cid]
                token = int(out.sibling_tokens[slot, r.sample_index - 1])
                r.tokens, r.first_token_time = [token], end
                if r.sampling.logprobs is not None:
                    top = r.sampling.logprobs
                    entry = {int(t): float(lp) for t, lp in zip(out.top_ids[slot, 0, :top],
                                                                out.top_logprobs[slot, 0, :top])}
                    entry[token] = float(out.sibling_logprob[slot, r.sample_index - 1])
                    r.logprobs = [entry]
                stops = {seq[0] for seq in r.sampling.stop_sequences() if len(seq) == 1}
                if r.sampling.max_tokens == 1 or token in stops:
                    r.finished, r.finish_time = True, end
                    results.append((cid, [token], True))
                else:
                    forks.append((slot, cid, token))
            self._free_slots += self._unforked.pop(rid)
        if forks:
            b = self.cfg.sched.cache.max_seqs
            parent, ids, first = (np.full(b, -1, np.int32) for _ in range(3))
            for row, (slot, cid, token) in enumerate(forks):
                parent[row], ids[row], first[row] = slot, cid, token
            put = self._arg
            rows = jax.tree.map(put, self._sampling_rows([self.requests[cid] for _, cid, _ in forks]))
            self.state, slots = engine_step.fork_requests(self.state, put(parent), put(ids), put(first), rows,
                                                          cfg=self.cfg)
            slots = np.asarray(slots)
            for row, (_, cid, token) in enumerate(forks):
                if slots[row] < 0:
                    raise RuntimeError("engine bug: a fork found no empty slot or an unsettled parent")
                self.slot_of[cid], self.request_in[int(slots[row])] = int(slots[row]), cid
                results.append((cid, [token], False))
            self._free_slots -= len(forks)
        return results

    def _swap(self, batch) -> None:
        out_rows = np.flatnonzero(np.asarray(batch.swap_out))
        in_rows = np.flatnonzero(np.asarray(batch.swap_in))
        if not len(out_rows) and not len(in_rows):
            return
        blocks = np.asarray(batch.swap_out_blocks)
        for row in out_rows:  # read before anything is written this step
            ids = blocks[row][blocks[row] != NULL_BLOCK]
            handle = self.tiers.swap_out(self._kv_pages(), ids)  # spills older swaps to disk when the host is full
            if not handle.ok:
                raise RuntimeError("swap tiers full although the scheduler counted room (engine bug)")
            self.handles[int(row)] = handle
        table = np.asarray(batch.block_table)
        pages = self._kv_pages()
        for row in in_rows:
            handle = self.handles.pop(int(row))
            pages = self.tiers.swap_in(pages, handle, table[row, : handle.num_blocks])
        self._set_kv_pages(pages)

    def _collect(self, out: engine_step.StepOut, start: float, end: float) -> list[tuple[int, list[int], bool]]:
        results = []
        for slot, rid in enumerate(self.request_in):
            if rid < 0:
                continue
            r = self.requests[rid]
            if out.admitted[slot]:  # looked up: the prompt and, after a recompute, the output so far
                if not r.admissions:
                    r.first_cached_tokens = int(out.hit_tokens[slot])
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
                if r.sampling.logprobs is not None:
                    self._record_logprobs(r, out, slot, new)
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

    @staticmethod
    def _record_logprobs(r: RequestLog, out: engine_step.StepOut, slot: int, new: list[int]) -> None:
        top = r.sampling.logprobs
        r.logprobs = [] if r.logprobs is None else r.logprobs
        for i, token in enumerate(new):
            entry = {int(t): float(lp) for t, lp in zip(out.top_ids[slot, i, :top], out.top_logprobs[slot, i, :top])}
            entry[int(token)] = float(out.token_logprob[slot, i])
            r.logprobs.append(entry)

    def stream(self) -> Iterator[tuple[int, list[int], bool]]:
        """Step until every queued request finished, yielding (request_id, new tokens, finished)."""
        while self.has_work():
            yield from self.step()

    def run(self) -> dict[int, list[int]]:
        """Step until done; returns every request's output tokens."""
        for _ in self.stream():
            pass
        return {rid: r.output_tokens for rid, r in self.requests.items()}

    def abort_request(self, request_id: int) -> bool:
        """End a request wherever it is: still queued (it leaves the queue) or in a slot (`scheduler.abort` releases
        its blocks, and a swapped request's host-tier copy). Its log keeps the tokens it produced and records no
        finish (`finished` stays False). Returns False when the request is unknown or already ended.

        n > 1 (docs/serving.md, "Aborting"): the request's id (output 0's) ends all of its outputs that have not
        ended, before and after they fork; `request_id + j` ends output j alone (one not forked yet gives back
        the slot held for it, and is never forked). True when some output ended."""
        if isinstance(request_id, bool) or not checks.is_int(request_id):
            raise TypeError(f"request_id must be an int, got {type(request_id).__name__}")
        rid = int(request_id)
        r = self.requests.get(rid)
        if r is None:
            return False
        outputs = r.sample_ids if r.sample_ids else (rid,)  # the parent's id: every output
        ended = [self._abort_one(i) for i in outputs]
        return any(ended)

    def _abort_one(self, rid: int) -> bool:
        """End one output (see `abort_request`); False when it had ended already."""
        r = self.requests[rid]
        if r.finished or r.aborted:
            return False
        r.aborted = True
        parent = rid - r.sample_index
        if r.sample_index == 0:  # output 0: slots still held for its unforked outputs go back
            self._free_slots += self._unforked.pop(rid, 0)
        elif parent in self._unforked:  # not forked yet: it never will be, and its held slot (if any) goes back
            if self._unforked[parent]:
                self._unforked[parent] -= 1
                self._free_slots += 1
            return True
        if rid in self.queue:
            self.queue.remove(rid)
            return True
        slot = self.slot_of.pop(rid, None)
        if slot is None:  # an unforked output whose output 0 ended first: it holds nothing
            return True
        mask = np.zeros(self.cfg.sched.cache.max_seqs, bool)
        mask[slot] = True
        self.state = self.state.replace(sched=sc.abort(self.state.sched, self._arg(mask), cfg=self.cfg.sched))
        if self.tiers is not None and slot in self.handles:
            self.tiers.release(self.handles.pop(slot))
        self.request_in[slot] = -1
        self._free_slots += 1  # `abort` empties the slot at once
        return True

    def _live_outputs(self, rid: int) -> list[int]:
        """The ids of outputs 1.. of request `rid` (n > 1) that have not been aborted: the ones to fork."""
        return [cid for cid in self.requests[rid].sample_ids[1:] if not self.requests[cid].aborted]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (`kv.manager.reset_prefix`): later requests find no hit in what was cached
        before. Requests in flight keep their blocks."""
        sched = self.state.sched
        self.state = self.state.replace(sched=sched.replace(kv=_reset_prefix(sched.kv, cfg=self.cfg.sched.kv)))

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None) -> list[list[int]]:
        """Convenience: queue prompts, run, return their outputs in order (one list of tokens per prompt).

        Refuses `sampling.n > 1`, whose n outputs a list of one output per prompt cannot hold: queue such
        requests with `add_request`, `run()`, and read each one's outputs with `completions(request_id)`."""
        if sampling is not None and isinstance(sampling, SamplingParams) and sampling.n > 1:
            raise ValueError(f"generate returns one output per prompt, but sampling.n = {sampling.n}: use "
                             "add_request(prompt, sampling), run(), then completions(request_id) for its n outputs")
        ids = [self.add_request(p, sampling) for p in prompts]
        outputs = self.run()
        return [outputs[i] for i in ids]
