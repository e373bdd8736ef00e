"""Constraints on a row's next token, inside the jitted step: allowed_token_ids, bad_words, min_tokens and
logit_bias (vLLM's semantics, docs/sampling.md), as one additive float32[B, slots, V] term that `sampling.process`
adds to the raw logits before the penalties: -inf on a banned token, the bias on a biased one, 0 elsewhere.

Lossless under speculation: a slot's term depends only on what plain decoding would know at that position, the
output index of the token it samples and the output tokens before it, the drafts on its path included
(`contexts`). Verification then checks each draft against the constrained target, and a draft the target bans is
never accepted.

  allowed_token_ids  every token outside the row's list is banned (an empty list bans nothing);
  bad_words          a word's last token is banned wherever the output so far ends with the word's other tokens
                     (a one-token word: always); the words are token sequences (`serve.requests` tokenises them);
  min_tokens         the row's stop ids and EOS (`SamplingRows.min_ban`) are banned while fewer than min_tokens
                     output tokens precede the slot (and a stop string ending earlier does not stop the row,
                     `engine_step._truncate_at_stop`);
  logit_bias         added to the token's raw logit.

Per-row index lists, bounded as `sampling.MAX_*`: a dense [B, V] mask per request would cost B * V per step to
ship from the host and to keep in the state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from skvs_jax.arrays import i32
from skvs_jax.serve import sampling
from skvs_jax.serve.speculation import DraftTree

CONTEXT = sampling.MAX_BAD_LEN - 1  # output tokens a bad word's prefix may span


def active(rows: sampling.SamplingRows) -> jax.Array:
    """bool[]: some row has a constraint (else the term is all zeros)."""
    return (jnp.any(rows.min_tokens > 0) | jnp.any(rows.allowed >= 0) | jnp.any(rows.bias_ids >= 0)
            | jnp.any(rows.bad_len > 0))


def _scatter(shape: tuple[int, ...], ids: jax.Array, values, vocab: int, reduce: str = "set") -> jax.Array:
    """zeros(shape + (V,)) with values at ids (ids[..., n], -1 = none: dropped), per leading index."""
    lead = jnp.indices(ids.shape)[:-1]
    where = jnp.where(ids >= 0, ids, vocab)  # out of range: dropped (a negative index would wrap)
    out = jnp.zeros(shape + (vocab,), jnp.asarray(values).dtype)
    return getattr(out.at[(*lead, where)], reduce)(values, mode="drop")


def term(rows: sampling.SamplingRows, out_index: jax.Array, context: jax.Array, context_ok: jax.Array,
         vocab: int) -> jax.Array:
    """float32[B, slots, V]: the additive constraint at each sampling slot.

    out_index int32[B, slots]: the output index of the token the slot samples (0 = the first output token);
    context int32[B, slots, CONTEXT]: the tokens before it, most recent first, with context_ok bool (False before
    the output starts or past what is known)."""
    b, r = out_index.shape
    bias = _scatter((b,), rows.bias_ids, jnp.where(rows.bias_ids >= 0, rows.bias, 0.0), vocab, "add")  # [B, V]
    keep = _scatter((b,), rows.allowed, jnp.ones(rows.allowed.shape, bool), vocab)
    disallowed = jnp.any(rows.allowed >= 0, axis=1)[:, None] & ~keep  # [B, V]
    early = out_index < rows.min_tokens[:, None]  # [B, slots]
    min_ids = jnp.where(early[:, :, None], rows.min_ban[:, None, :], -1)  # [B, slots, stops]
    n = rows.bad.shape[-1]
    prefix = rows.bad[:, None, :, 1:]  # [B, 1, words, n - 1]: the word's other tokens, most recent first
    inside = jnp.arange(n - 1)[None, None, None, :] < (rows.bad_len - 1)[:, None, :, None]
    same = (context[:, :, None, :] == prefix) & context_ok[:, :, None, :]
    match = jnp.all(same | ~inside, axis=-1) & (rows.bad_len > 0)[:, None, :]  # [B, slots, words]
    bad_ids = jnp.where(match, rows.bad[:, None, :, 0], -1)
    ids = jnp.concatenate([min_ids, bad_ids], axis=-1)
    banned = _scatter((b, r), ids, jnp.ones(ids.shape, bool), vocab) | disallowed[:, None]
    return jnp.where(banned, -jnp.inf, bias[:, None])


def path_table(tree: DraftTree | None) -> np.ndarray:
    """int32[slots, max depth + 1]: entry [u, d] is the node at depth d on the root-to-u path (1..K; 0 for the
    root at d = 0), -1 past u's depth. Static: built once per tree."""
    if tree is None:
        return np.zeros((1, 1), np.int32)
    depth, mask = np.asarray(tree.depth), np.asarray(tree.mask)  # mask[u, a]: a is u or an ancestor of u
    slots = len(depth)
    table = np.full((slots, int(depth.max()) + 1), -1, np.int32)
    for u in range(slots):
        for a in range(slots):
            if mask[u, a]:
                table[u, depth[a]] = a
    return table


def contexts(tokens: jax.Array, prompt_len: jax.Array, pos0: jax.Array, nodes: jax.Array | None,
             tree: DraftTree | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What `term` reads at each sampling slot: (out_index int32[B, slots], context int32[B, slots, CONTEXT],
    context_ok bool[B, slots, CONTEXT]).

    tokens int32[B, M * S] the known tokens; prompt_len int32[B]; pos0 int32[B] the position the root's token lands
    at; nodes int32[B, K] the draft-tree node tokens (None without drafts). Slot u samples the token at pos0 +
    depth(u); before it come the known tokens up to pos0 and the nodes on u's path."""
    table = jnp.asarray(path_table(tree))  # [slots, depth + 1]
    depth = jnp.sum(table >= 0, axis=1) - 1  # [slots]
    out_index = pos0[:, None] + depth[None, :] - prompt_len[:, None]
    back = 1 + jnp.arange(CONTEXT, dtype=i32)  # the token `back` places before the slot's
    at = pos0[:, None, None] + depth[None, :, None] - back[None, None, :]  # [B, slots, CONTEXT] positions
    known = jnp.take_along_axis(tokens, jnp.clip(at, 0, tokens.shape[1] - 1).reshape(at.shape[0], -1),
                                axis=1).reshape(at.shape)
    if nodes is not None:  # a position at or past pos0 is the path node at depth at - pos0 + 1
        d = jnp.clip(at - pos0[:, None, None] + 1, 0, table.shape[1] - 1)
        node = table[jnp.arange(table.shape[0])[None, :, None], d]  # [B, slots, CONTEXT]
        drafted = jnp.take_along_axis(nodes, jnp.clip(node - 1, 0, nodes.shape[1] - 1).reshape(node.shape[0], -1),
                                      axis=1).reshape(node.shape)
        known = jnp.where(at >= pos0[:, None, None], drafted, known)
    ok = at >= prompt_len[:, None, None]
    return out_index, known, ok
