"""The engine's jitted step: schedule, drafts, one paged forward, verification and update, as named phases.

    schedule → _copy_on_write → _assemble_queries → _forward → _verify_drafts → _truncate_at_stop
    → _hidden_at_last_accepted → _move_accepted_kv → _keep_kv_sharding → update → _next_width_bounds → _step_out

`fused_step` is the whole step in one program; `schedule_only` and `model_only` are its two halves, for the swap
path (the host copies KV between the tiers between them). `EngineState` is what the step carries; `Engine`
(`serve.engine`) is the host loop around it.
"""


from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from skvs_jax import scheduler as sc
from skvs_jax.arrays import i32
from skvs_jax.serve import acceptance
from skvs_jax.serve import speculation as spec
from skvs_jax.serve.acceptance import POSTERIOR_ALPHA, POSTERIOR_THRESHOLD
from skvs_jax.serve.model_runner import ModelRunner

MAX_STOP = 4
MAX_REQUEST_ID = 2**31 - 2  # ids live in int32 device arrays, and the next free id must fit too


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static configuration: the scheduler's, plus the kernels' implementation and the KV dtype."""

    sched: sc.SchedulerConfig
    impl: str = "xla"  # "xla" | "pallas" (interpret=True off-GPU) | "reference"
    kv_dtype: str = "float32"
    tree: spec.DraftTree | None = None  # the draft tree (a chain of K drafts by default); None without speculation
    acceptance: str = "lossless"  # "lossless" | "typical" (see `speculation`)
    sample_drafts: bool = False  # chains: drafts sampled from the heads' distribution (general lossless rule)
    posterior_threshold: float = POSTERIOR_THRESHOLD  # typical acceptance (Medusa's defaults)
    posterior_alpha: float = POSTERIOR_ALPHA
    kv_shardings: tuple | None = None  # on a mesh: a NamedSharding per `runner.kv_pages` array, else None


@struct.dataclass
class EngineState:
    sched: sc.SchedState
    cache: Any  # the runner's paged KV cache
    hidden: jax.Array  # float32[B, Dm] base-model hidden state at each slot's last accepted position
    temperature: jax.Array  # float32[B]
    stop_ids: jax.Array  # int32[B, MAX_STOP], -1 = none
    rng: jax.Array
    step_cost: sc.StepCost | None = None  # what the goodput draft controller prices a step with (None: flat)


@struct.dataclass
class StepOut:
    """What one step did, for streaming and metrics (small arrays the host reads)."""

    num_new: jax.Array  # int32[B] tokens appended
    new_tokens: jax.Array  # int32[B, K+1] of which the first num_new were appended
    finished: jax.Array  # bool[B]
    scheduled: jax.Array  # bool[B]
    num_drafts: jax.Array  # int32[B]
    accepted: jax.Array  # int32[B]
    admitted: jax.Array  # bool[B]
    hit_tokens: jax.Array  # int32[B]
    preempted: jax.Array  # bool[B] (recompute or swap)
    oom: jax.Array
    num_tokens: jax.Array
    blocks_used: jax.Array
    spec_blocks: jax.Array
    width_ok: jax.Array  # every row's query fit the bucket (False would be an engine bug)
    free_slots: jax.Array  # int32[] EMPTY slots after the step (what the next `add` can fill)
    prompt_work: jax.Array  # bool[] some row is waiting or prefilling: the next step needs the wide bucket
    next_drafts: jax.Array  # int32[] most drafts any live row may get next step (picks the next draft bucket)
    shape: sc.StepShape  # the step's work (prefill / decode tokens, context read): cost-model calibration


# ------------------------------------------------------------------------------------------ the jitted step


@struct.dataclass
class _Queries:
    """One step's query batch over the B slots, Q = the step's bucket width (`_assemble_queries` -> `_forward`)."""

    tokens: jax.Array  # int32[B, Q] known tokens [start, start + num_query), then draft-tree nodes, then 0
    positions: jax.Array  # int32[B, Q] RoPE positions (a tree node's: the root's + its depth); 0 past query_lens
    query_lens: jax.Array  # int32[B] num_query + num_drafts on scheduled rows, else 0
    tree_mask: jax.Array | None  # bool[B, Q, Q] a draft tree's attention mask; None: causal (a chain, or K = 0)
    nodes: jax.Array  # int32[B, K] draft-tree node tokens in slot order (a chain: the drafts); int32[B, 1] 0 if K = 0
    draft_logits: jax.Array | None  # float32[B, K, V] what sampled drafts were drawn from; None: point-mass drafts


def model_step(runner: ModelRunner, params, st: EngineState, batch: sc.Batch, knobs, *, cfg: EngineConfig,
                width: int):
    """Everything after `schedule`, one phase per call: copy-on-write, the [B, Q] queries (Q = width), the paged
    forward, verification, the stop-token cut, the next hidden state, a tree's accepted K/V moved into place,
    the cache's sharding, `update`, and what the host needs to pick the next width. Returns (state, StepOut)."""
    k = cfg.sched.policy.draft_len
    cache = _copy_on_write(runner, st.cache, batch)
    rng, key_draft, key_verify = jax.random.split(st.rng, 3)
    queries = _assemble_queries(runner, params, st.hidden, st.temperature, st.sched.seqs.tokens, batch, key_draft,
                                cfg=cfg, width=width)
    logits, hidden, cache = _forward(runner, params, queries, cache, batch, impl=cfg.impl)
    accepted, path, path_tokens, bonus = _verify_drafts(logits, queries, batch, st.temperature, key_verify, cfg=cfg)
    new_tokens, accepted, next_token, stop = _truncate_at_stop(accepted, path_tokens, bonus, st.stop_ids, k=k)
    hidden = _hidden_at_last_accepted(hidden, path, accepted, batch, st.hidden)
    cache = _move_accepted_kv(runner, cache, batch, path, accepted, cfg=cfg)
    cache = _keep_kv_sharding(runner, cache, cfg.kv_shardings)
    view_tokens = None if k == 0 or spec.is_chain(cfg.tree) else queries.nodes  # the drafts in tree-slot order
    sched, res = sc.update_unchecked(st.sched, batch, accepted, next_token, path_tokens, stop, knobs, cfg=cfg.sched,
                                     view_tokens=view_tokens)
    st = st.replace(sched=sched, cache=cache, hidden=hidden, rng=rng)
    return st, _step_out(sched, batch, res, new_tokens, knobs, cfg=cfg.sched, width=width, step_cost=st.step_cost)


def _copy_on_write(runner: ModelRunner, cache, batch: sc.Batch):
    """The cache with block batch.cow_src[b] copied onto batch.cow_dst[b] (int32[B]), before anything writes it.

    Rows without a copy hold NULL_BLOCK pairs, which copy block 0 onto itself."""
    return runner.copy_blocks(cache, batch.cow_src, batch.cow_dst)


def _assemble_queries(runner: ModelRunner, params, hidden: jax.Array, temperature: jax.Array, seq_tokens: jax.Array,
                      batch: sc.Batch, key: jax.Array, *, cfg: EngineConfig, width: int) -> _Queries:
    """Row b's query: its known tokens [start, start + num_query), then its first num_drafts draft-tree nodes.

    hidden float32[B, Dm] at each row's last accepted position feeds the draft heads (K > 0 only); temperature
    float32[B] and key are used only for sampled drafts; seq_tokens int32[B, M * S] the scheduler's known tokens.
    Reads batch.start, num_query, num_drafts, scheduled. Q = width query slots per row.
    """
    scfg = cfg.sched
    k = scfg.policy.draft_len
    num_query, num_drafts = batch.num_query, batch.num_drafts
    slot = jnp.arange(width, dtype=i32)[None, :]  # [1, Q]
    draft_logits = None
    if k > 0:
        head_logits = runner.draft_logits(params, hidden)  # [B, draft heads, V] for positions n + 1, n + 2, ...
        if cfg.sample_drafts:
            draft_logits = head_logits[:, :k]
            nodes = acceptance.sample_drafts(draft_logits, key, temperature)
        else:
            nodes = spec.node_tokens(head_logits, cfg.tree)  # [B, K] in slot order
        _, positions, tree_mask = spec.layout(cfg.tree, batch.start, num_query, width)
    else:
        nodes, positions, tree_mask = jnp.zeros((scfg.cache.max_seqs, 1), i32), batch.start[:, None] + slot, None
    known = jnp.take_along_axis(seq_tokens, jnp.clip(batch.start[:, None] + slot, 0, scfg.max_len - 1), axis=1)
    is_draft = (slot >= num_query[:, None]) & (slot < (num_query + num_drafts)[:, None])
    node_of_slot = jnp.clip(slot - num_query[:, None], 0, nodes.shape[1] - 1)
    tokens = jnp.where(slot < num_query[:, None], known,
                       jnp.where(is_draft, jnp.take_along_axis(nodes, node_of_slot, axis=1), 0))
    query_lens = jnp.where(batch.scheduled, num_query + num_drafts, 0)
    return _Queries(tokens=tokens, positions=jnp.where(slot < query_lens[:, None], positions, 0),
                    query_lens=query_lens, tree_mask=tree_mask, nodes=nodes, draft_logits=draft_logits)


def _forward(runner: ModelRunner, params, queries: _Queries, cache, batch: sc.Batch, *, impl: str):
    """The paged forward over all B rows at once: prefill chunks and decode / verification rows in one [B, Q] call.

    Row b's query_lens[b] tokens go into the cache at positions start[b] + j through batch.block_table
    (int32[B, M]); rows with query_lens 0 write nothing. Returns (logits float[B, Q, V], hidden float[B, Q, Dm],
    cache)."""
    return runner.forward(params, queries.tokens, queries.positions, cache, batch.block_table,
                          batch.start + queries.query_lens, queries.query_lens, impl=impl,
                          tree_mask=queries.tree_mask)


def _verify_drafts(logits: jax.Array, queries: _Queries, batch: sc.Batch, temperature: jax.Array, key: jax.Array, *,
                   cfg: EngineConfig) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Accept the longest run of drafts along one tree path; the target's token after them is the bonus token.

    logits float[B, Q, V] after each query slot; temperature float32[B] (0 = greedy). Returns (accepted int32[B]
    drafts; path int32[B, depth + 1] node indices of the chosen root-to-leaf path; path_tokens int32[B, K] its
    tokens, the accepted ones first; bonus int32[B] the token after them). With K = 0 nothing was drafted:
    accepted is 0, path and path_tokens are int32[B, 1] zeros, and bonus is sampled (argmax at temperature 0)
    from the logits after the row's last query token.
    """
    k = cfg.sched.policy.draft_len
    num_query = batch.num_query
    if k > 0:
        v = spec.verify(cfg.tree, logits, queries.nodes, num_query, batch.num_drafts, key, temperature,
                        rule=cfg.acceptance, draft_logits=queries.draft_logits,
                        posterior_threshold=cfg.posterior_threshold, posterior_alpha=cfg.posterior_alpha)
        return v.accepted, v.path_nodes, v.path_tokens, v.next_token
    b, width = logits.shape[:2]
    last = jnp.clip(num_query - 1, 0, width - 1)[:, None]
    row_logits = jnp.take_along_axis(logits, last[:, :, None], axis=1)[:, 0]  # [B, V]
    temp = temperature[:, None]
    sampled = jax.random.categorical(key, row_logits / jnp.maximum(temp, 1e-6), axis=-1).astype(i32)
    bonus = jnp.where(temperature > 0, sampled, jnp.argmax(row_logits, axis=-1).astype(i32))
    return jnp.zeros((b,), i32), jnp.zeros((b, 1), i32), jnp.zeros((b, 1), i32), bonus


def _truncate_at_stop(accepted: jax.Array, path_tokens: jax.Array, bonus: jax.Array, stop_ids: jax.Array, *,
                      k: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The step's new tokens (path_tokens[:accepted], then bonus), cut at the first stop token among them.

    accepted int32[B]; path_tokens int32[B, K] (int32[B, 1] if K = 0); bonus int32[B]; stop_ids int32[B, MAX_STOP]
    (-1 = none). Returns (new_tokens int32[B, K + 1], of which the first accepted + 1 are new; accepted int32[B],
    lowered to the index of the first stop token; next_token int32[B] = new_tokens[accepted], the last new one;
    stop bool[B]: a stop token ends the row).
    """
    kk = jnp.arange(k + 1, dtype=i32)[None, :]  # [1, K + 1]
    new = jnp.where(kk < accepted[:, None], jnp.pad(path_tokens[:, :k], ((0, 0), (0, 1))) if k else 0, 0)
    new = jnp.where(kk == accepted[:, None], bonus[:, None], new)
    is_stop = jnp.any(new[:, :, None] == stop_ids[:, None, :], axis=-1) & (kk <= accepted[:, None])
    first_stop = jnp.argmax(is_stop, axis=1).astype(i32)
    stop = jnp.any(is_stop, axis=1)
    accepted = jnp.where(stop, first_stop, accepted)
    next_token = jnp.take_along_axis(new, accepted[:, None], axis=1)[:, 0]
    return new, accepted, next_token, stop


def _hidden_at_last_accepted(hidden: jax.Array, path: jax.Array, accepted: jax.Array, batch: sc.Batch,
                             previous: jax.Array) -> jax.Array:
    """float32[B, Dm]: each row's base-model hidden state at its last accepted position (the draft heads' input).

    hidden float[B, Q, Dm] from the forward; path int32[B, depth + 1] and accepted int32[B] after the stop-token
    cut. Rows that sampled no token this step (batch.samples False: a prefill chunk short of the prompt's end,
    or not scheduled) keep `previous` float32[B, Dm]."""
    width = hidden.shape[1]
    last_node = jnp.take_along_axis(path, jnp.minimum(accepted, path.shape[1] - 1)[:, None], axis=1)[:, 0]
    rows = jnp.arange(hidden.shape[0], dtype=i32)
    hidden_now = hidden[rows, jnp.clip(batch.num_query - 1 + last_node, 0, width - 1)]
    return jnp.where(batch.samples[:, None], hidden_now, previous)


def _move_accepted_kv(runner: ModelRunner, cache, batch: sc.Batch, path: jax.Array, accepted: jax.Array, *,
                      cfg: EngineConfig):
    """A draft tree's accepted nodes' K/V, copied from their tree slots to their sequence positions.

    path int32[B, depth + 1], accepted int32[B] after the stop-token cut; rows that sampled no token move
    nothing. A chain (or K = 0) is already in place: the cache comes back untouched and nothing is traced."""
    if cfg.sched.policy.draft_len == 0 or spec.is_chain(cfg.tree):
        return cache
    moved = spec.move_accepted(runner.kv_pages(cache), cfg.tree, batch.block_table, batch.start, batch.num_query,
                               path, jnp.where(batch.samples, accepted, 0))
    return runner.with_kv_pages(cache, moved)


def _keep_kv_sharding(runner: ModelRunner, cache, kv_shardings: tuple | None):
    """On a mesh, the cache's pages constrained to kv_shardings (split over tp), so they leave the step laid out
    as they came in; off a mesh (None), the cache unchanged."""
    if kv_shardings is None:
        return cache
    return runner.with_kv_pages(cache, tuple(jax.lax.with_sharding_constraint(x, s) for x, s in
                                             zip(runner.kv_pages(cache), kv_shardings)))


def _next_width_bounds(sched: sc.SchedState, knobs, scfg: sc.SchedulerConfig, step_cost=None
                       ) -> tuple[jax.Array, jax.Array]:
    """What the host needs to pick the next step's width Q without reading state back (`Engine._width`).

    Returns (prompt_work bool[]: some row is waiting or has more than its last token to compute, so the next
    step needs the wide bucket; next_drafts int32[]: the most drafts any live row may get next step)."""
    status = sched.seqs.status
    remaining = sched.seqs.num_tokens - sched.kv.alloc.seqs.num_committed
    live = (status == sc.RUNNING) | (status == sc.SWAPPED) | (status == sc.WAITING)
    if scfg.policy.goodput_control:  # the controller's own choice: a pure function of the state, known now
        return (jnp.any((status == sc.WAITING) | ((status == sc.RUNNING) & (remaining > 1))),
                jnp.max(sc.plan_drafts(sched, knobs, scfg, step_cost).decode))
    want = sc.draft_lengths(sched.seqs, knobs, scfg.policy, scfg.reach)
    # The next schedule caps drafts by its decode rows (`sc.verify_cap` of `sc.decoding_rows`), known now.
    # Between steps only `add` writes, and only to empty rows, so the count cannot change before it is used.
    cap = sc.verify_cap(sc.decoding_rows(status, sched.seqs.num_tokens, sched.kv.alloc.seqs.num_committed,
                                         sched.seqs.prompt_len), knobs)
    prompt_work = jnp.any((status == sc.WAITING) | ((status == sc.RUNNING) & (remaining > 1)))
    return prompt_work, jnp.minimum(jnp.max(jnp.where(live, want, 0)), cap)


def _step_out(sched: sc.SchedState, batch: sc.Batch, res: sc.StepResult, new_tokens: jax.Array, knobs, *,
              cfg: sc.SchedulerConfig, width: int, step_cost=None) -> StepOut:
    """The step's report to the host (`StepOut`), from the state after `update`, the batch, update's result and
    new_tokens int32[B, K + 1]."""
    prompt_work, next_drafts = _next_width_bounds(sched, knobs, cfg, step_cost)
    return StepOut(
        num_new=res.num_new, new_tokens=new_tokens, finished=res.finished, scheduled=batch.scheduled,
        num_drafts=batch.num_drafts,
        accepted=res.accepted, admitted=batch.admitted, hit_tokens=batch.hit_tokens,
        preempted=batch.preempted | batch.swap_out, oom=batch.oom, num_tokens=batch.num_tokens,
        blocks_used=batch.blocks_used, spec_blocks=batch.spec_blocks,
        width_ok=jnp.all(jnp.where(batch.scheduled, batch.num_query + batch.num_drafts, 0) <= width) & batch.alloc_ok,
        free_slots=jnp.sum(sched.seqs.status == sc.EMPTY, dtype=i32),
        prompt_work=prompt_work, next_drafts=next_drafts, shape=sc.step_shape(batch),
    )


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("cfg", "width"), donate_argnums=(2,))
def fused_step(runner, params, st, knobs, *, cfg, width):
    sched, batch = sc.schedule_unchecked(st.sched, knobs, st.step_cost, cfg=cfg.sched)
    return model_step(runner, params, st.replace(sched=sched), batch, knobs, cfg=cfg, width=width)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnums=(0,))
def schedule_only(st, knobs, *, cfg):
    sched, batch = sc.schedule_unchecked(st.sched, knobs, st.step_cost, cfg=cfg.sched)
    return st.replace(sched=sched), batch


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("cfg", "width"), donate_argnums=(2,))
def model_only(runner, params, st, batch, knobs, *, cfg, width):
    return model_step(runner, params, st, batch, knobs, cfg=cfg, width=width)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnums=(0,))
def add_requests(st: EngineState, prompts, prompt_len, max_new, priority, request_id, temperature, stop_ids,
                 cache_salt=None, *, cfg):
    sched, slots = sc.add_unchecked(st.sched, prompts, prompt_len, max_new, priority, request_id, cache_salt,
                                    cfg=cfg.sched)
    dst = jnp.where(slots >= 0, slots, cfg.sched.cache.max_seqs)
    return st.replace(
        sched=sched,
        temperature=st.temperature.at[dst].set(temperature, mode="drop"),
        stop_ids=st.stop_ids.at[dst].set(stop_ids, mode="drop"),
    ), slots
