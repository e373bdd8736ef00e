"""The engine's jitted step: schedule, drafts, one paged forward, verification and update, as named phases.

    schedule → _copy_on_write → _penalty_context → _assemble_queries → _forward → _process_targets
    → _verify_drafts → _truncate_at_stop → _emitted_logprobs → _hidden_at_last_accepted → _move_accepted_kv
    → _scrub_rejected_drafts → _keep_kv_sharding → update → _next_width_bounds → _step_out

Sampling is per request (`sampling`): every row's parameters and random stream are data in `EngineState.sampling`,
and verification runs against each row's processed distribution.

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

import pallas_kernels as pk
from skvs_jax import scheduler as sc
from skvs_jax.arrays import i32
from skvs_jax.serve import constraints, sampling
from skvs_jax.serve import speculation as spec
from skvs_jax.serve.acceptance import POSTERIOR_ALPHA, POSTERIOR_THRESHOLD
from skvs_jax.serve.model_runner import DraftSite, ModelRunner

MAX_STOP = sampling.MAX_STOPS  # stop token ids and stop strings together, per request
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
    split_rows: int = 0  # extra query rows of the prompt width's split branch (`model_step_at`); 0: no split

    def __hash__(self) -> int:
        # A static argument of every step program, hashed by jit at each call: computed once (nested configs).
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached


@struct.dataclass
class EngineState:
    sched: sc.SchedState
    cache: Any  # the runner's paged KV cache
    hidden: jax.Array  # float32[B, Dm] base-model hidden state at each slot's last accepted position
    sampling: sampling.SamplingRows  # per-slot sampling parameters and random streams
    step_cost: sc.StepCost | None = None  # what the goodput draft controller prices a step with (None: flat)
    # What picks the next step's width on the device (`serve.dispatch`), as the last step left it: some row has
    # prompt work (bool[]; `add_requests` sets it), and the draft bound were every width compiled (int32[]).
    prompt_work: jax.Array | None = None
    next_want: jax.Array | None = None
    # Queued requests the dispatch loop admits itself when a finish frees a slot (`serve.dispatch.Staged`); None
    # where the host admits every request (one step per dispatch, swap preemption).
    staged: Any = None
    # float32[] the padding (µs, by the fitted step cost) the steps since one last needed its program's whole width
    # paid by running wider than they needed: the dispatch loop's width rule (`serve.dispatch.fits_width`). None:
    # not kept (each dispatch starts from 0).
    padded_us: jax.Array | None = None


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
    width: jax.Array  # int32[] the query width the forward ran: the step's, or `narrow_width` (`model_step_at`)
    free_slots: jax.Array  # int32[] EMPTY slots after the step (what the next `add` can fill)
    prompt_work: jax.Array  # bool[] some row is waiting or prefilling: the next step needs the wide bucket
    next_drafts: jax.Array  # int32[] most drafts any live row may get next step (picks the next draft bucket; K
    # when prompt_work: the next step runs the wide width, so the bound is not computed)
    shape: sc.StepShape  # the step's work (prefill / decode tokens, context read): cost-model calibration
    next_want: jax.Array  # int32[] next_drafts were every width 0..K compiled (the bucket histogram's key)
    token_logprob: jax.Array  # float32[B, K+1] raw logprob of each new token (0 unless some row asks for logprobs)
    top_ids: jax.Array  # int32[B, K+1, MAX_LOGPROBS] the most likely tokens at each new token's position
    top_logprobs: jax.Array  # float32[B, K+1, MAX_LOGPROBS] their raw logprobs
    sibling_tokens: jax.Array  # int32[B, MAX_N - 1] first tokens of a prompt's outputs 1.. (`sampling.siblings`)
    sibling_logprob: jax.Array  # float32[B, MAX_N - 1] their raw logprobs
    split: jax.Array  # bool[] the prompt width's split branch ran (`model_step_at`): narrow rows + extra rows


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
               width: int, split_rows: int = 0):
    """Everything after `schedule`, one phase per call: copy-on-write, the [B, Q] queries (Q = width), the paged
    forward, verification, the stop-token cut, the next hidden state, a tree's accepted K/V moved into place,
    the rejected drafts' K/V scrubbed (when the policy asks), the cache's sharding, `update` (its commit's block
    states through `pallas_kernels.update_block_states`, `cfg.impl`), and what the host needs to pick the next
    width. Returns (state, StepOut)."""
    k = cfg.sched.policy.draft_len
    rows = st.sampling
    cache = _copy_on_write(runner, st.cache, batch)
    context = _penalty_context(st.sched.seqs, batch, rows, runner.vocab_size, skip=cfg.sched.skip)
    # With split rows, `view` is the batch as its [B, Q] home rows see it (each row's last Q tokens; the earlier
    # ones of a long prompt chunk ride in extra rows); everything after the forward reads it, `update` the batch.
    view = _home_view(batch, width) if split_rows else batch
    queries = _assemble_queries(runner, params, st.hidden, rows, context, st.sched.seqs, view, cfg=cfg,
                                width=width)
    at = _sampling_slots(view, cfg)
    if split_rows:
        logits, hidden, cache, fits = _forward_split(runner, params, queries, cache, batch, view,
                                                     st.sched.seqs.tokens, at, rows=split_rows, impl=cfg.impl)
    else:
        logits, hidden, cache = _forward(runner, params, queries, cache, batch, at, impl=cfg.impl)
        fits = _widest_query(batch) <= width
    targets = _process_targets(logits, queries, view, rows, context, st.sched.seqs, cfg=cfg)
    accepted, path, path_tokens, bonus = _verify_drafts(targets, queries, view, rows, cfg=cfg)
    new_tokens, accepted, next_token, stop = _truncate_at_stop(accepted, path_tokens, bonus, rows,
                                                               st.sched.seqs, view, k=k)
    logprobs = _emitted_logprobs(targets.raw, path, new_tokens, rows)
    hidden = _hidden_at_last_accepted(hidden, path, accepted, view, st.hidden)
    cache = _move_accepted_kv(runner, cache, view, path, accepted, cfg=cfg)
    cache = _scrub_rejected_drafts(runner, cache, view, accepted, cfg=cfg)
    cache = _keep_kv_sharding(runner, cache, cfg.kv_shardings)
    view_tokens = None if k == 0 or spec.is_chain(cfg.tree) else queries.nodes  # the drafts in tree-slot order
    sched, res = sc.update_unchecked(st.sched, batch, accepted, next_token, path_tokens, stop, knobs, cfg=cfg.sched,
                                     view_tokens=view_tokens)
    out = _step_out(sched, batch, res, new_tokens, knobs, cfg=cfg.sched, width=width, step_cost=st.step_cost,
                    logprobs=logprobs, fits=fits, split=split_rows > 0)
    st = st.replace(sched=sched, cache=cache, hidden=hidden, prompt_work=out.prompt_work, next_want=out.next_want)
    return st, out.replace(sibling_tokens=targets.siblings[0], sibling_logprob=targets.siblings[1])


def _copy_on_write(runner: ModelRunner, cache, batch: sc.Batch):
    """The cache with block batch.cow_src[b] copied onto batch.cow_dst[b] (int32[B]), before anything writes it.

    Rows without a copy hold NULL_BLOCK pairs, which copy block 0 onto itself."""
    return runner.copy_blocks(cache, batch.cow_src, batch.cow_dst)


@struct.dataclass
class _PenaltyContext:
    """What the penalties read at each row's root (the token after its known ones): token counts so far."""

    seen: jax.Array  # bool[B, V] the token occurs in the prompt or the output so far
    out_counts: jax.Array  # int32[B, V] occurrences in the output so far


def _penalty_context(seqs: sc.SeqTable, batch: sc.Batch, rows: sampling.SamplingRows, vocab: int, *,
                     skip: bool = True) -> _PenaltyContext:
    """Counts over each row's known tokens [0, start + num_query) (output: from prompt_len), computed only when
    some row has a penalty (all zeros otherwise: then nothing reads them). skip=False (`SchedulerConfig.skip`):
    computed every step, no cond."""
    known = batch.start + batch.num_query

    def counts(_):
        everything = sampling.token_counts(seqs.tokens, jnp.zeros_like(known), known, vocab)
        return everything > 0, sampling.token_counts(seqs.tokens, seqs.prompt_len, known, vocab)

    b = known.shape[0]
    any_penalty = jnp.any((rows.repetition_penalty != 1) | (rows.presence_penalty != 0) | (rows.frequency_penalty != 0))
    if not skip:  # nothing reads the counts without a penalty (`sampling.process` applies none then)
        seen, out = counts(None)
        return _PenaltyContext(seen=seen, out_counts=out)
    seen, out = jax.lax.cond(any_penalty, counts, lambda _: (jnp.zeros((b, vocab), bool), jnp.zeros((b, vocab), i32)),
                             None)
    return _PenaltyContext(seen=seen, out_counts=out)


def _with_drafts(context: _PenaltyContext, drafted: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(seen bool[B, slots, V], out_counts int32[B, slots, V]) at the K + 1 sampling slots (`slots`) whose paths
    hold drafted int32[B, slots, V] more tokens (drafts are output tokens)."""
    return context.seen[:, None] | (drafted > 0), context.out_counts[:, None] + drafted


def _constraint(rows: sampling.SamplingRows, seqs: sc.SeqTable, pos0: jax.Array, nodes: jax.Array | None,
                tree: spec.DraftTree | None, vocab: int, *, skip: bool = True, slot: int | None = None) -> jax.Array:
    """`constraints.term` at the tree's sampling slots (float32[B, slots, V]; the root alone without a tree; slot:
    that slot alone, float32[B, 1, V], the term being per slot); computed only when some row has a constraint
    (zeros otherwise), or always when skip=False."""
    def compute(_):
        ctx = constraints.contexts(seqs.tokens, seqs.prompt_len, pos0, nodes, tree)
        if slot is not None:
            ctx = tuple(x[:, slot: slot + 1] for x in ctx)
        return constraints.term(rows, *ctx, vocab)

    if not skip:
        return compute(None)
    slots = 1 if tree is None or slot is not None else tree.num_slots
    return jax.lax.cond(constraints.active(rows), compute,
                        lambda _: jnp.zeros((pos0.shape[0], slots, vocab), jnp.float32), None)


def _sample_drafts(head_logits: jax.Array, rows: sampling.SamplingRows, context: _PenaltyContext, seqs: sc.SeqTable,
                   pos0: jax.Array, *, skip: bool = True) -> tuple[jax.Array, jax.Array]:
    """A chain of drafts sampled from the heads' distributions processed like the target's (each draft's
    penalties and constraints count the drafts before it). head_logits float32[B, K, V]; pos0 int32[B] the first
    draft's position. Returns (drafts int32[B, K], processed draft logits float32[B, K, V]: what
    `acceptance.lossless` takes as q, at the effective temperature `sampling.process` gives)."""
    b, k, v = head_logits.shape
    drafts, processed = [], []
    drafted = jnp.zeros((b, v), i32)
    for i in range(k):  # K is static and small; draft i's penalties depend on drafts < i
        seen, out = _with_drafts(context, drafted[:, None])
        so_far = jnp.stack(drafts + [jnp.zeros((b,), i32)] * (k - i), axis=1)  # drafts < i, then padding
        term = _constraint(rows, seqs, pos0, so_far, spec.chain(k), v, skip=skip, slot=i)
        logits_i, temp = sampling.process(head_logits[:, i: i + 1], seen, out, rows, skip=skip, constraint=term)
        keys = sampling.position_keys(rows.stream, (pos0 + i)[:, None], sampling.DRAFT)
        draft = sampling.sample(keys, logits_i, temp)[:, 0]
        drafted = drafted + jax.nn.one_hot(draft, v, dtype=i32)
        drafts.append(draft)
        processed.append(logits_i[:, 0])
    return jnp.stack(drafts, axis=1), jnp.stack(processed, axis=1)


def _assemble_queries(runner: ModelRunner, params, hidden: jax.Array, rows: sampling.SamplingRows,
                      context: _PenaltyContext, seqs, batch: sc.Batch, *, cfg: EngineConfig,
                      width: int) -> _Queries:
    """Row b's query: its known tokens [start, start + num_query), then its first num_drafts draft-tree nodes.

    hidden float32[B, Dm] at each row's last accepted position feeds the draft heads (K > 0 only); rows and
    context are used only for sampled drafts; seqs the scheduler's `SeqTable` (its known tokens int32[B, M * S],
    and the request ids a drafter may key on, `DraftSite`).
    Reads batch.start, num_query, num_drafts, scheduled. Q = width query slots per row.
    """
    scfg = cfg.sched
    k = scfg.policy.draft_len
    num_query, num_drafts = batch.num_query, batch.num_drafts
    slot = jnp.arange(width, dtype=i32)[None, :]  # [1, Q]
    draft_logits = None
    if k > 0:
        site = DraftSite(request_id=seqs.request_id, position=batch.start + num_query)
        head_logits = runner.draft_logits(params, hidden, site)  # [B, draft heads, V] for positions n + 1, n + 2, ...
        if cfg.sample_drafts:
            nodes, draft_logits = _sample_drafts(head_logits[:, :k], rows, context, seqs, batch.start + num_query,
                                                 skip=cfg.sched.skip)
        else:
            nodes = spec.node_tokens(head_logits, cfg.tree)  # [B, K] in slot order
        _, positions, tree_mask = spec.layout(cfg.tree, batch.start, num_query, width)
    else:
        nodes, positions, tree_mask = jnp.zeros((scfg.cache.max_seqs, 1), i32), batch.start[:, None] + slot, None
    known = jnp.take_along_axis(seqs.tokens, jnp.clip(batch.start[:, None] + slot, 0, scfg.max_len - 1), axis=1)
    is_draft = (slot >= num_query[:, None]) & (slot < (num_query + num_drafts)[:, None])
    node_of_slot = jnp.clip(slot - num_query[:, None], 0, nodes.shape[1] - 1)
    tokens = jnp.where(slot < num_query[:, None], known,
                       jnp.where(is_draft, jnp.take_along_axis(nodes, node_of_slot, axis=1), 0))
    query_lens = jnp.where(batch.scheduled, num_query + num_drafts, 0)
    return _Queries(tokens=tokens, positions=jnp.where(slot < query_lens[:, None], positions, 0),
                    query_lens=query_lens, tree_mask=tree_mask, nodes=nodes, draft_logits=draft_logits)


def _home_view(batch: sc.Batch, width: int) -> sc.Batch:
    """The batch as the split branch's home rows see it: a row needing more than `width` query slots (a prompt
    chunk) keeps its last `width` tokens (the sampling slot and any drafts among them) in its own row; its first
    `_chunk_heads` go to extra rows (`_split_rows`). start and num_query move by that many, so start +
    num_query, where the new tokens land, is the batch's."""
    off = _chunk_heads(batch, width)
    return batch.replace(start=batch.start + off, num_query=batch.num_query - off)


def _chunk_heads(batch: sc.Batch, width: int) -> jax.Array:
    """int32[B]: how many of each scheduled row's first query tokens do not fit its home row of `width` slots,
    num_query + num_drafts - width or 0; at most num_query - 1, since drafts never exceed width - 1."""
    need = jnp.where(batch.scheduled, batch.num_query + batch.num_drafts, 0)
    return jnp.maximum(need - width, 0).astype(i32)


@struct.dataclass
class _SplitRows:
    """The split branch's E extra query rows of width Q: row e computes tokens [start, start + length) of batch
    row parent (length 0: an unused row)."""

    parent: jax.Array  # int32[E]
    start: jax.Array  # int32[E]
    length: jax.Array  # int32[E] in [0, Q]
    need: jax.Array  # int32[] extra rows the batch needs (it fits iff need <= E)


def _split_rows(start: jax.Array, off: jax.Array, width: int, rows: int) -> _SplitRows:
    """Row b's head tokens [start, start + off) (int32[B] each), cut into ceil(off / width) extra rows of
    `width` slots, numbered after the rows of the rows before b; `rows` extra rows in all (need says how many
    the batch wanted)."""
    need = (off + width - 1) // width
    end = jnp.cumsum(need)  # extra rows [end - need, end) are row b's
    e = jnp.arange(rows, dtype=i32)
    parent = jnp.clip(jnp.searchsorted(end, e, side="right").astype(i32), 0, off.shape[0] - 1)
    j = e - (end - need)[parent]  # which of its parent's extra rows
    length = jnp.where(e < end[-1], jnp.clip(off[parent] - j * width, 0, width), 0)
    return _SplitRows(parent=parent, start=start[parent] + j * width, length=length.astype(i32),
                      need=end[-1].astype(i32))


def _sampling_slots(batch: sc.Batch, cfg: EngineConfig) -> jax.Array:
    """int32[B, slots]: the query slot of each row's sampling slots, num_query - 1 + u for node u of the draft tree
    (a chain: u = 0..K; no speculation: the last query token alone). The forward computes logits there only."""
    return jnp.maximum(batch.num_query[:, None] - 1 + jnp.arange(logit_slots(cfg), dtype=i32)[None, :], 0)


def logit_slots(cfg: EngineConfig) -> int:
    """The sampling slots per row, where the forward computes logits: the tree's slots, K + 1 for a chain."""
    k = cfg.sched.policy.draft_len
    return cfg.tree.num_slots if k > 0 and cfg.tree is not None else k + 1


def _forward_split(runner: ModelRunner, params, queries: _Queries, cache, batch: sc.Batch, view: sc.Batch,
                   seq_tokens: jax.Array, at: jax.Array, *, rows: int, impl: str):
    """The paged forward of the split branch: the B home rows (`_home_view`'s queries) and `rows` extra rows
    holding the head of every long prompt chunk, in one [B + rows, Q] call. Exact: each layer writes every row's
    K/V before any row attends (`ModelRunner.forward`), so a home row sees its chunk's head in the extra rows
    through the shared block table, and an extra row the extra rows before it. at int32[B, slots]: the home rows'
    sampling slots (`_sampling_slots`; the extra rows sample nothing). Returns (logits float[B, slots, V] and
    hidden float[B, Q, Dm] of the home rows, cache, fits bool[]: every row fit, i.e. the extra rows sufficed)."""
    b, width = queries.tokens.shape
    ex = _split_rows(batch.start, view.start - batch.start, width, rows)
    slot = jnp.arange(width, dtype=i32)[None, :]
    live = slot < ex.length[:, None]  # [E, Q]
    pos = ex.start[:, None] + slot
    known = jnp.take_along_axis(seq_tokens[ex.parent], jnp.clip(pos, 0, seq_tokens.shape[1] - 1), axis=1)
    tokens = jnp.concatenate([queries.tokens, jnp.where(live, known, 0)])
    positions = jnp.concatenate([queries.positions, jnp.where(live, pos, 0)])
    query_lens = jnp.concatenate([queries.query_lens, ex.length])
    context_lens = jnp.concatenate([view.start + queries.query_lens,
                                    jnp.where(ex.length > 0, ex.start + ex.length, 0)])
    tables = jnp.concatenate([batch.block_table, batch.block_table[ex.parent]])
    tree_mask = queries.tree_mask
    if tree_mask is not None:  # extra rows hold known tokens only: causal
        causal = jnp.broadcast_to(slot.T >= slot, (rows, width, width))
        tree_mask = jnp.concatenate([tree_mask, causal])
    # Logits at the home rows only (at's B rows): the extra rows carry prompt heads and sample nothing; asking
    # for theirs cost the LM head on every extra row, ~a third of a split step on this CPU at a 128k vocabulary.
    logits, hidden, cache = runner.forward(params, tokens, positions, cache, tables, context_lens, query_lens,
                                           impl=impl, tree_mask=tree_mask, logits_at=at)
    fits = (ex.need <= rows) & (_widest_query(view) <= width)
    return logits, hidden[:b], cache, fits


def _forward(runner: ModelRunner, params, queries: _Queries, cache, batch: sc.Batch, at: jax.Array, *,
             impl: str):
    """The paged forward over all B rows at once: prefill chunks and decode / verification rows in one [B, Q] call.

    Row b's query_lens[b] tokens go into the cache at positions start[b] + j through batch.block_table
    (int32[B, M]); rows with query_lens 0 write nothing. Returns (logits float[B, slots, V] at the sampling slots
    `at` int32[B, slots], hidden float[B, Q, Dm], cache)."""
    return runner.forward(params, queries.tokens, queries.positions, cache, batch.block_table,
                          batch.start + queries.query_lens, queries.query_lens, impl=impl,
                          tree_mask=queries.tree_mask, logits_at=at)


@struct.dataclass
class _Targets:
    """The target's distributions at each row's K + 1 sampling slots (`slots`) (the root, then node u at query slot
    num_query - 1 + u), processed per row: what verification reads, slot u of each array standing for query slot
    num_query - 1 + u (the forward computed logits there only, `_sampling_slots`)."""

    raw: jax.Array  # float32[B, slots, V] raw logits at the sampling slots (logprobs read these)
    logits: jax.Array  # float32[B, slots, V] the processed logits at the sampling slots
    temperature: jax.Array  # float32[B] effective temperature of the processed logits: 1 sampled, 0 greedy
    target: jax.Array  # int32[B, slots] the target's token after each sampling slot, from the row's stream
    rule_keys: jax.Array  # typed keys [B] for the acceptance rule's own draws (the row's stream at its root)
    siblings: tuple  # `sampling.sibling_tokens` at the root: (int32[B, MAX_N - 1], float32[B, MAX_N - 1])


def _process_targets(logits: jax.Array, queries: _Queries, batch: sc.Batch, rows: sampling.SamplingRows,
                     context: _PenaltyContext, seqs: sc.SeqTable, *, cfg: EngineConfig) -> _Targets:
    """Process the target's logits at every sampling slot (logits float[B, slots, V], `_sampling_slots`) with its
    row's parameters (`sampling.process`; node u's penalties count the drafts on its path) and draw its token from
    the row's stream at the position it lands at (start + num_query + depth(u))."""
    b, _, vocab = logits.shape
    k = cfg.sched.policy.draft_len
    tree = cfg.tree if k > 0 else None
    depth = jnp.asarray(tree.depth if tree is not None else [0], i32)  # [slots]
    raw = logits.astype(jnp.float32)
    if tree is not None:
        drafted = sampling.path_counts(queries.nodes, jnp.asarray(tree.mask), vocab)
    else:
        drafted = jnp.zeros((b, 1, vocab), i32)
    pos0 = batch.start + batch.num_query  # where the root's token lands
    term = _constraint(rows, seqs, pos0, queries.nodes if tree is not None else None, tree, vocab,
                       skip=cfg.sched.skip)
    processed, temp = sampling.process(raw, *_with_drafts(context, drafted), rows, skip=cfg.sched.skip,
                                       constraint=term)
    drawn = sampling.sample(sampling.position_keys(rows.stream, pos0[:, None] + depth[None, :], sampling.TARGET),
                            processed, temp)
    rule_keys = sampling.position_keys(rows.stream, pos0[:, None], sampling.RULE)[:, 0]
    siblings = sampling.sibling_tokens(processed[:, 0], temp, raw[:, 0], rows, pos0)
    return _Targets(raw=raw, logits=processed, temperature=temp, target=drawn, rule_keys=rule_keys,
                    siblings=siblings)


def _verify_drafts(targets: _Targets, queries: _Queries, batch: sc.Batch, rows: sampling.SamplingRows, *,
                   cfg: EngineConfig) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Accept the longest run of drafts along one tree path; the target's token after them is the bonus token.

    Verification reads the processed distributions and tokens of `_process_targets` (lossless against what each
    row samples from). Returns (accepted int32[B] drafts; path int32[B, depth + 1] node indices of the chosen
    root-to-leaf path; path_tokens int32[B, K] its tokens, the accepted ones first; bonus int32[B] the token
    after them). With K = 0 nothing was drafted: accepted is 0, path and path_tokens are int32[B, 1] zeros, and
    bonus is the target's token after the row's last query token.
    """
    k = cfg.sched.policy.draft_len
    if k > 0:  # the targets hold the sampling slots alone: the root (query slot num_query - 1) is slot 0
        root = jnp.ones_like(batch.num_query)
        v = spec.verify(cfg.tree, targets.logits, queries.nodes, root, batch.num_drafts, targets.rule_keys,
                        targets.temperature, rule=cfg.acceptance, draft_logits=queries.draft_logits,
                        posterior_threshold=cfg.posterior_threshold, posterior_alpha=cfg.posterior_alpha,
                        target=targets.target)
        return v.accepted, v.path_nodes, v.path_tokens, v.next_token
    b = targets.target.shape[0]
    return jnp.zeros((b,), i32), jnp.zeros((b, 1), i32), jnp.zeros((b, 1), i32), targets.target[:, 0]


def _truncate_at_stop(accepted: jax.Array, path_tokens: jax.Array, bonus: jax.Array, rows: sampling.SamplingRows,
                      seqs: sc.SeqTable, batch: sc.Batch, *, k: int
                      ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The step's new tokens (path_tokens[:accepted], then bonus), cut at the first one that ends a stop sequence
    (a stop token id, or a stop string's last token; matched on output tokens, the earlier ones included) once
    the output holds min_tokens tokens (vLLM's rule: a stop ending earlier is ignored).

    accepted int32[B]; path_tokens int32[B, K] (int32[B, 1] if K = 0); bonus int32[B]. Returns (new_tokens
    int32[B, K + 1], of which the first accepted + 1 are new; accepted int32[B], lowered to the index of the
    first stop; next_token int32[B] = new_tokens[accepted], the last new one; stop bool[B]: a stop ends the row).
    """
    kk = jnp.arange(k + 1, dtype=i32)[None, :]  # [1, K + 1]
    new = jnp.where(kk < accepted[:, None], jnp.pad(path_tokens[:, :k], ((0, 0), (0, 1))) if k else 0, 0)
    new = jnp.where(kk == accepted[:, None], bonus[:, None], new)
    w = rows.stops.shape[-1]
    pos0 = batch.start + batch.num_query  # the first new token's position
    before = pos0[:, None] - (w - 1) + jnp.arange(w - 1, dtype=i32)[None, :]  # [B, stop_len - 1]
    history = jnp.take_along_axis(seqs.tokens, jnp.clip(before, 0, seqs.tokens.shape[1] - 1), axis=1)
    history_ok = (before >= seqs.prompt_len[:, None]) & (before >= 0)
    counts = pos0[:, None] + kk + 1 - seqs.prompt_len[:, None]  # output tokens once new token i is emitted
    is_stop = (sampling.stop_hits(history, history_ok, new, kk <= accepted[:, None], rows)
               & (counts > rows.min_tokens[:, None]))  # vLLM: no stop until the output holds more than min_tokens
    first_stop = jnp.argmax(is_stop, axis=1).astype(i32)
    stop = jnp.any(is_stop, axis=1)
    accepted = jnp.where(stop, first_stop, accepted)
    next_token = jnp.take_along_axis(new, accepted[:, None], axis=1)[:, 0]
    return new, accepted, next_token, stop


def _emitted_logprobs(raw: jax.Array, path: jax.Array, new_tokens: jax.Array, rows: sampling.SamplingRows
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`sampling.top_logprobs` of each new token (new token i is scored at path node min(i, depth)'s sampling
    slot), computed only when some row asks for logprobs (zeros otherwise). raw float32[B, slots, V]; path
    int32[B, depth + 1]; new_tokens int32[B, K + 1]."""
    b, r1 = new_tokens.shape
    n = sampling.MAX_LOGPROBS

    def compute(_):
        node = path[:, jnp.minimum(jnp.arange(r1), path.shape[1] - 1)]  # [B, K + 1]
        scored = jnp.take_along_axis(raw, jnp.clip(node, 0, raw.shape[1] - 1)[:, :, None], axis=1)
        return sampling.top_logprobs(scored, new_tokens, min(n, raw.shape[-1]))

    def nothing(_):
        m = min(n, raw.shape[-1])
        return jnp.zeros((b, r1), jnp.float32), jnp.zeros((b, r1, m), i32), jnp.zeros((b, r1, m), jnp.float32)

    return jax.lax.cond(jnp.any(rows.logprobs >= 0), compute, nothing, None)


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


def _scrub_rejected_drafts(runner: ModelRunner, cache, batch: sc.Batch, accepted: jax.Array, *, cfg: EngineConfig):
    """The cache with every rejected draft's K/V slot zeroed (`pallas_kernels.invalidate_drafts` with cfg.impl),
    when the policy asks for it (`Policy.scrub_rejected`); otherwise, or with K = 0, the cache untouched.

    accepted int32[B] after the stop-token cut; a row that samples no token keeps none of its drafts (what `update`
    commits). Draft slot k of row b sits at position start + num_query + k; the slots k >= accepted are rejected:
    for a draft tree, after `_move_accepted_kv` the accepted path occupies the first `accepted` slots and every
    other slot (rejected nodes and the accepted ones' old places) is dead. The runner's `kv_pages` are K and V
    pages [N, L, S, Hkv, D] (any even count, pair-wise) and, when quantised, their scales [N, L, S, Hkv] in the
    same order. Each pair goes through the kernel in one call for all L layers: the pages viewed as N * L rows
    (block n of layer l at row n * L + l), the batch as B * L rows with tables `block * L + l`. Runs before
    `update`, whose commit gives the blocks of rejected drafts back: a block is scrubbed before anyone else can
    own it."""
    pol = cfg.sched.policy
    if pol.draft_len == 0 or not pol.scrub_rejected:
        return cache
    kept = jnp.where(batch.samples, jnp.clip(accepted, 0, batch.num_drafts), 0)
    accept_mask = jnp.arange(pol.draft_len, dtype=i32)[None, :] < kept[:, None]  # [B, K]
    lens = jnp.where(batch.scheduled, batch.num_drafts, 0)
    start = batch.start + batch.num_query
    pages = list(runner.kv_pages(cache))
    data = [i for i, x in enumerate(pages) if x.ndim == 5]
    scales = [i for i, x in enumerate(pages) if x.ndim == 4]
    if len(data) % 2 or (scales and len(scales) != len(data)):
        raise ValueError(f"runner.kv_pages must be pairs of [N, L, S, Hkv, D] pages (and as many [N, L, S, Hkv] "
                         f"scales), got {len(data)} pages and {len(scales)} scales")
    for j in range(0, len(data), 2):
        idx = data[j:j + 2] + scales[j:j + 2]
        n, num_layers = pages[idx[0]].shape[:2]
        flat = [pages[i].reshape((n * num_layers,) + pages[i].shape[2:]) for i in idx]
        layer = jnp.arange(num_layers, dtype=i32)[None, :, None]
        tables = (batch.block_table[:, None, :] * num_layers + layer).reshape(-1, batch.block_table.shape[1])
        sc_kw = dict(k_scales=flat[2], v_scales=flat[3]) if scales else {}
        start_l, accept_l, lens_l = (jnp.repeat(x, num_layers, axis=0) for x in (start, accept_mask, lens))
        out = pk.invalidate_drafts(flat[0], flat[1], tables, start_l, accept_l, draft_lens=lens_l, impl=cfg.impl,
                                   **sc_kw)
        for i, x in zip(idx, out):
            pages[i] = x.reshape(pages[i].shape)
    return runner.with_kv_pages(cache, tuple(pages))


def _keep_kv_sharding(runner: ModelRunner, cache, kv_shardings: tuple | None):
    """On a mesh, the cache's pages constrained to kv_shardings (split over tp), so they leave the step laid out
    as they came in; off a mesh (None), the cache unchanged."""
    if kv_shardings is None:
        return cache
    return runner.with_kv_pages(cache, tuple(jax.lax.with_sharding_constraint(x, s) for x, s in
                                             zip(runner.kv_pages(cache), kv_shardings)))


def _next_width_bounds(sched: sc.SchedState, knobs, scfg: sc.SchedulerConfig, step_cost=None
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What the host needs to pick the next step's width Q without reading state back (`serve.widths.WidthPicker.pick`):
    `scheduler.width_bounds` of the state after `update` (prompt_work, next_drafts, next_want). When some row
    has prompt work the next step runs the wide width whatever the bounds say, so they are not computed (K):
    most of a busy engine's steps, and the goodput controller's plan is most of the bounds' cost."""
    wide = sc.prompt_work(sched)
    k = jnp.asarray(scfg.policy.draft_len, i32)
    if not scfg.skip:  # computed every step and selected: no cond (`SchedulerConfig.skip`)
        bounds = sc.width_bounds(sched, knobs, scfg, step_cost)[1:]
        return wide, jnp.where(wide, k, bounds[0]), jnp.where(wide, k, bounds[1])
    next_drafts, next_want = jax.lax.cond(wide, lambda: (k, k),
                                          lambda: sc.width_bounds(sched, knobs, scfg, step_cost)[1:])
    return wide, next_drafts, next_want


def _step_out(sched: sc.SchedState, batch: sc.Batch, res: sc.StepResult, new_tokens: jax.Array, knobs, *,
              cfg: sc.SchedulerConfig, width: int, step_cost=None, logprobs: tuple, fits: jax.Array,
              split: bool) -> StepOut:
    """The step's report to the host (`StepOut`), from the state after `update`, the batch, update's result,
    new_tokens int32[B, K + 1], `_emitted_logprobs`, fits (bool[]: every row's query fit the program) and split
    (static: the split branch ran)."""
    prompt_work, next_drafts, next_want = _next_width_bounds(sched, knobs, cfg, step_cost)
    return StepOut(
        num_new=res.num_new, new_tokens=new_tokens, finished=res.finished, scheduled=batch.scheduled,
        num_drafts=batch.num_drafts,
        accepted=res.accepted, admitted=batch.admitted, hit_tokens=batch.hit_tokens,
        preempted=batch.preempted | batch.swap_out, oom=batch.oom, num_tokens=batch.num_tokens,
        blocks_used=batch.blocks_used, spec_blocks=batch.spec_blocks,
        width_ok=fits & batch.alloc_ok,
        width=jnp.asarray(width, i32),
        free_slots=jnp.sum(sched.seqs.status == sc.EMPTY, dtype=i32),
        prompt_work=prompt_work, next_drafts=next_drafts, shape=sc.step_shape(batch), next_want=next_want,
        token_logprob=logprobs[0], top_ids=logprobs[1], top_logprobs=logprobs[2],
        sibling_tokens=jnp.zeros((cfg.cache.max_seqs, sampling.MAX_N - 1), i32),
        sibling_logprob=jnp.zeros((cfg.cache.max_seqs, sampling.MAX_N - 1), jnp.float32),
        split=jnp.asarray(split),
    )


def _widest_query(batch: sc.Batch) -> jax.Array:
    """int32[] the most query slots (known tokens + drafts) any scheduled row of the batch needs."""
    return jnp.max(jnp.where(batch.scheduled, batch.num_query + batch.num_drafts, 0))


def narrow_width(cfg: EngineConfig) -> int:
    """1 + K: the widest decode width, which every decode-only batch fits (a row's 1 token + its drafts)."""
    return 1 + cfg.sched.policy.draft_len


AUTO, NARROW, SPLIT, WIDE = -1, 0, 1, 2  # `model_step_at`'s branch: picked by the batch, or forced


def model_step_at(runner: ModelRunner, params, st: EngineState, batch: sc.Batch, knobs, branch=AUTO, *,
                  cfg: EngineConfig, width: int):
    """`model_step` at `width` when it is wider than `narrow_width`, through the cheapest of three branches of
    one program (a `lax.switch`: no program more than the buckets, no host sync):

        NARROW  the batch fits narrow_width: memory can keep every prompt row out of a step the host gave the
                wide width (it picks the width before `schedule` runs); computing empty prompt slots was a fifth
                of a busy engine's time
        SPLIT   (cfg.split_rows > 0) [B + split_rows, narrow] rows: every row's last narrow tokens in its own
                row, the head of each long prompt chunk in extra rows (`_forward_split`); one row's 32-token
                chunk no longer pads all B rows to 32 slots
        WIDE    [B, width], every row padded to the widest (what the chunks need when they do not fit SPLIT)

    branch (int32[]): AUTO picks the first that fits; NARROW, SPLIT or WIDE forces one (the step-cost fit times
    each on empty slots; a forced SPLIT without split rows runs WIDE). At `width` <= narrow_width there is one
    branch."""
    narrow = narrow_width(cfg)
    if width <= narrow:
        return model_step(runner, params, st, batch, knobs, cfg=cfg, width=width)
    step = functools.partial(model_step, runner, cfg=cfg)
    branches = [functools.partial(step, width=narrow)]
    if cfg.split_rows:
        branches.append(functools.partial(step, width=narrow, split_rows=cfg.split_rows))
    branches.append(functools.partial(step, width=width))
    # Without split rows there is no SPLIT branch (the layout is then never SPLIT) and WIDE is index 1.
    pick = jnp.minimum(sc.buckets.query_layout(batch, narrow, cfg.split_rows), len(branches) - 1)
    forced = jnp.minimum(jnp.asarray(branch, i32), len(branches) - 1)  # without a split, SPLIT and WIDE: WIDE
    return jax.lax.switch(jnp.where(forced >= 0, forced, pick), branches, params, st, batch, knobs)


def split_rows_for(cfg: EngineConfig, width: int, chunks: int = 2) -> int:
    """Extra rows enough for `chunks` full prompt chunks of `width` tokens beside narrow rows: chunks *
    ceil((width - narrow) / narrow), 0 when width <= narrow (the default `EngineOptions.split_rows=None`). Two
    chunks, because past two the larger split step costs more than the rarer wide steps it avoids (measured:
    docs/speculation.md, "A step with prompt work runs split")."""
    narrow = narrow_width(cfg)
    return chunks * max(0, -(-(width - narrow) // narrow))


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("cfg", "width"), donate_argnums=(2,))
def fused_step(runner, params, st, knobs, branch=AUTO, *, cfg, width):
    sched, batch = sc.schedule_unchecked(st.sched, knobs, st.step_cost, cfg=cfg.sched)
    return model_step_at(runner, params, st.replace(sched=sched), batch, knobs, branch, cfg=cfg, width=width)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnums=(0,))
def schedule_only(st, knobs, *, cfg):
    sched, batch = sc.schedule_unchecked(st.sched, knobs, st.step_cost, cfg=cfg.sched)
    return st.replace(sched=sched), batch


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("cfg", "width"), donate_argnums=(2,))
def model_only(runner, params, st, batch, knobs, branch=AUTO, *, cfg, width):
    return model_step_at(runner, params, st, batch, knobs, branch, cfg=cfg, width=width)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnums=(0,))
def add_requests(st: EngineState, prompts, prompt_len, max_new, priority, request_id, rows, cache_salt=None,
                 tpot_target=None, *, cfg):
    """Add requests (`sc.add_unchecked`) with their sampling rows (`sampling.SamplingRows`, one per request),
    cache salts (int32[B], `engine.salt_id`; None: no salt) and TPOT targets (int32[B] microseconds; None: none).
    Returns (state, slots int32[B']: each request's slot, -1 where it was not placed)."""
    return add_requests_unchecked(st, prompts, prompt_len, max_new, priority, request_id, rows, cache_salt,
                                  tpot_target, cfg=cfg)


def add_requests_unchecked(st: EngineState, prompts, prompt_len, max_new, priority, request_id, rows, cache_salt=None,
                           tpot_target=None, *, cfg, dense: bool = False):
    """`add_requests`' body, traced into a caller's program (the dispatch loop's own admissions). dense (static):
    rows written as gathers and selects, not scatters (`scheduler.add_unchecked`), for a program that runs it on
    every step."""
    sched, slots = sc.add_unchecked(st.sched, prompts, prompt_len, max_new, priority, request_id, cache_salt,
                                    tpot_target, cfg=cfg.sched, dense=dense)
    dst = jnp.where(slots >= 0, slots, cfg.sched.cache.max_seqs)
    prompt_work = st.prompt_work | jnp.any(slots >= 0)  # the new requests wait to be prefilled
    rows = sampling.set_rows(st.sampling, dst, rows, dense=dense)
    return st.replace(sched=sched, sampling=rows, prompt_work=prompt_work), slots


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnums=(0,))
def fork_requests(st: EngineState, parent, request_id, first_token, rows, *, cfg):
    """Fork outputs 1.. of n > 1 requests off their parents' slots (`sc.fork_unchecked`: the prompt's blocks
    shared) with their sampling rows (`sampling.SamplingRows`, one per fork); a child starts from its parent's
    hidden state, and a parent that forked has no siblings left. Returns (state, slots int32[B'], -1 = not
    placed)."""
    sched, slots = sc.fork_unchecked(st.sched, parent, request_id, first_token, cfg=cfg.sched)
    b = cfg.sched.cache.max_seqs
    dst = jnp.where(slots >= 0, slots, b)
    p = jnp.clip(parent, 0, b - 1)
    rows_all = sampling.set_rows(st.sampling, dst, rows)
    rows_all = rows_all.replace(siblings=rows_all.siblings.at[jnp.where(parent >= 0, p, b)].set(0, mode="drop"))
    return st.replace(sched=sched, sampling=rows_all, hidden=st.hidden.at[dst].set(st.hidden[p], mode="drop")), slots
