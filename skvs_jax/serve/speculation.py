"""Speculation inside one engine step: draft trees, the layout of the verification call, verification, and moving
the accepted path's K/V into place.

A chain of K drafts is the tree ((0,), (0, 0), ..., (0,)*K), so the engine has one code path. A `DraftTree` (Medusa's
"choices" format: node (0, 1) is head 1's second-best token after head 0's best) has its nodes sorted by (depth,
ranks), so every prefix of d nodes is itself a tree: a step that grants a row d < K draft slots verifies the first
d nodes. One verification call per step holds, per row, its known tokens (a prompt chunk, or the last committed
token: the root) followed by its d nodes:

  slot   j < qn: known token start + j, causal;          RoPE position start + j
  slot   qn - 1 + u (node u >= 1): the node's token;     RoPE position start + qn - 1 + depth(u);
         sees every known token and its own ancestors;   cache position start + qn - 1 + u.

Verification gives each node a verdict against its parent's distribution and accepts the longest run of accepted
nodes along some root-to-leaf path (which path, when several tie, is each rule's); a node is accepted when
  * "lossless": it equals the target's token at its parent, sampled from p (argmax at temperature 0). The drafts
    are deterministic (q a point mass), and siblings are distinct tokens, so walking the tree along sampled tokens
    emits, position by position, tokens distributed exactly as p (Leviathan et al. 2023's rule for a point-mass q;
    SpecInfer's multi-candidate walk for a tree). With `sample_drafts` (chains only) drafts are sampled from the
    heads' q and `acceptance.lossless` applies the general min(1, p/q) rule with its residual resampling.
  * "typical": Medusa's typical acceptance (`acceptance.typical_ok`): p(node) > min(threshold, alpha * exp(-H(p))).
    Not lossless; at temperature 0 it is greedy. Siblings may both pass, so paths can accept equally long runs of
    different tokens: as in Medusa's `evaluate_posterior`, the one whose accepted nodes have the highest sum of
    log p wins (the first path on exact ties, and path 0 when nothing is accepted).
Under "lossless" (and greedy) one token per parent is accepted, so paths that tie share their accepted run.
After acceptance, node u at depth i of the accepted path holds its K/V at cache position start + qn - 1 + u; it
belongs at start + qn - 1 + i. `move_accepted` copies every accepted node there (sources read before any write),
so the cache holds exactly the validated tokens; what lies past the committed length is overwritten later.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from reference_models.medusa_tree import SMALL_TREE, DraftTree
from skvs_jax.arrays import count_leading, floor_div, floor_mod, i32
from skvs_jax.serve import acceptance

# DraftTree (and SMALL_TREE, Medusa's 15-node tree of depth 4) are defined beside the reference tree decoder
# (`reference_models.medusa_tree`), which cannot import skvs_jax; serving owns them from here.
__all__ = ["RULES", "SMALL_TREE", "DraftTree", "Verified", "chain", "is_chain", "layout", "move_accepted",
           "node_tokens", "parents", "reach", "verify"]

RULES = ("lossless", "typical")


def chain(k: int) -> DraftTree:
    """The tree of a chain of k >= 1 drafts: head i's best token at depth i + 1."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    return DraftTree(tuple((0,) * d for d in range(1, k + 1)))


def is_chain(tree: DraftTree) -> bool:
    return all(c == (0,) * len(c) for c in tree.choices) and len(tree.choices) == int(tree.depth.max())


@functools.lru_cache(maxsize=64)
def parents(tree: DraftTree) -> np.ndarray:
    """int32[K + 1]: the parent of node u (0 = the root; the root's own entry is 0)."""
    slot = {c: i + 1 for i, c in enumerate(tree.choices)}
    return np.array([0] + [slot.get(c[:-1], 0) for c in tree.choices], np.int32)


def reach(tree: DraftTree, counts) -> tuple[int, ...]:
    """Per draft count d in `counts` (nodes granted), the most drafts its subtree can accept: the depth of its
    first d nodes (`SchedulerConfig.reach_of` is this over 0..K)."""
    depth = tree.depth
    return tuple(int(depth[: d + 1].max()) for d in counts)


def node_tokens(draft_logits: jax.Array, tree: DraftTree) -> jax.Array:
    """draft_logits float32[B, heads, V] -> int32[B, K]: node u's token is rank(u) of head depth(u) - 1."""
    head, rank = tree.head_and_rank
    top = jax.lax.top_k(draft_logits, int(rank.max()) + 1)[1].astype(i32)  # [B, heads, ranks]
    return top[:, jnp.asarray(head), jnp.asarray(rank)]


def layout(tree: DraftTree, start: jax.Array, qn: jax.Array, width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The verification call's Q = width slots. start, qn int32[B] (first query position, known tokens in the
    query).

    Returns (node int32[B, Q]: node index of each slot, 0 for the root and for known slots, -1 past the tree;
    positions int32[B, Q] RoPE positions; mask bool[B, Q, Q] the tree mask, or None for a chain: causal).
    """
    k = tree.num_slots - 1
    j = jnp.arange(width, dtype=i32)[None, :]
    u = j - (qn[:, None] - 1)  # node index of slot j when j >= qn - 1
    node = jnp.where(j < qn[:, None], 0, jnp.where(u <= k, u, -1))
    depth = jnp.asarray(tree.depth)[jnp.clip(u, 0, k)]
    positions = jnp.where(j < qn[:, None], start[:, None] + j, start[:, None] + qn[:, None] - 1 + depth)
    if is_chain(tree):
        return node, positions, None
    tmask = jnp.asarray(tree.mask)  # [K + 1, K + 1]
    ui, uj = jnp.clip(u, 0, k)[:, :, None], jnp.clip(u, 0, k)[:, None, :]
    row_node = (j >= qn[:, None])[:, :, None]  # query slot i is a tree node
    col_known = (j < qn[:, None])[:, None, :]
    ji = jnp.arange(width, dtype=i32)
    causal = (ji[None, :] <= ji[:, None])[None]  # [1, Q, Q]: key slot j <= query slot i
    mask = jnp.where(col_known, causal | row_node, row_node & tmask[ui, uj])
    return node, positions, mask


@struct.dataclass
class Verified:
    """What verification decided, per row (B rows, K nodes, `depth` = the tree's depth)."""

    accepted: jax.Array  # int32[B] accepted drafts (<= num_drafts, <= depth)
    path_nodes: jax.Array  # int32[B, depth + 1] node indices of the chosen root-to-leaf path (path_nodes[:, 0] = 0)
    path_tokens: jax.Array  # int32[B, K] the chosen path's tokens first (accepted ones are [:accepted]), then 0
    target: jax.Array  # int32[B, Q] the target's token after each query slot (sampled, or argmax at temperature 0)
    next_token: jax.Array  # int32[B] the token after the accepted drafts


def verify(tree: DraftTree, logits: jax.Array, nodes: jax.Array, qn: jax.Array, num_drafts: jax.Array,
           key: jax.Array, temperature: jax.Array, *, rule: str = "lossless", draft_logits: jax.Array | None = None,
           posterior_threshold: float = acceptance.POSTERIOR_THRESHOLD,
           posterior_alpha: float = acceptance.POSTERIOR_ALPHA, target: jax.Array | None = None) -> Verified:
    """Accept the longest run of drafts along one path of the (first num_drafts nodes of the) tree.

    logits float[B, Q, V] the target's logits after each query slot; nodes int32[B, K] node tokens in slot order;
    qn, num_drafts int32[B]; temperature float32[B] (0 = greedy); draft_logits float32[B, K, V]: the distribution
    the drafts were sampled from (a chain with sampled drafts: the general lossless rule), or None (point masses).
    target int32[B, Q]: the target's token after each query slot, drawn by the caller (per-request streams,
    `sampling`; then `key` is the rule's alone, one key or a key per row); None: drawn here from `key`.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    b, w, _ = logits.shape
    k = tree.num_slots - 1
    temp = temperature.astype(jnp.float32)
    if target is None:
        key_target, key_rule = jax.random.split(key)
        scaled = logits.astype(jnp.float32) / jnp.maximum(temp, 1e-6)[:, None, None]
        sampled = jax.random.categorical(key_target, scaled, axis=-1).astype(i32)
        target = jnp.where(temp[:, None] > 0, sampled, jnp.argmax(logits, axis=-1).astype(i32))  # [B, Q]
    else:
        key_rule = key
    b_idx = jnp.arange(b, dtype=i32)[:, None]
    slot_of = lambda u: jnp.clip(qn[:, None] - 1 + u, 0, w - 1)  # noqa: E731  node index -> query slot

    if draft_logits is not None:  # a chain of sampled drafts: the general speculative-sampling rule
        if not is_chain(tree):
            raise ValueError("sampled drafts (draft_logits) need a chain; a tree verifies point-mass drafts")
        at = slot_of(jnp.arange(k + 1, dtype=i32)[None, :])  # [B, K + 1]
        v = acceptance.lossless(logits[b_idx, at], draft_logits, nodes, num_drafts, key_rule, temp)
        path = jnp.broadcast_to(jnp.arange(k + 1, dtype=i32)[None, :], (b, k + 1))
        return Verified(accepted=v.accepted, path_nodes=path, path_tokens=nodes, target=target,
                        next_token=v.next_token)

    u = jnp.arange(1, k + 1, dtype=i32)[None, :]  # [1, K]
    parent_slot = slot_of(jnp.asarray(parents(tree))[1:][None, :])  # [B, K]
    if rule == "lossless":
        ok = nodes == target[b_idx, parent_slot]
    else:
        ok, logp = acceptance.typical_scores(logits[b_idx, parent_slot], nodes,
                                             jnp.broadcast_to(temp[:, None], nodes.shape),
                                             posterior_threshold=posterior_threshold, posterior_alpha=posterior_alpha)
    ok = ok & (u <= num_drafts[:, None])
    slots, valid = (jnp.asarray(x) for x in tree.paths)  # [paths, depth + 1]
    path_node = jnp.clip(slots[:, 1:] - 1, 0, k - 1)  # [paths, depth]
    along = ok[:, path_node] & valid[None, :, 1:]  # [B, paths, depth]
    per_path = count_leading(along, axis=2)  # [B, paths]
    accepted = jnp.max(per_path, axis=1)
    if rule == "lossless":
        best = jnp.argmax(per_path, axis=1)
    else:
        # Medusa's `evaluate_posterior`: among the paths with the longest accepted run, the one whose accepted
        # nodes have the highest sum of log p (the first on ties, so path 0 when nothing is accepted).
        depth_col = jnp.arange(path_node.shape[1], dtype=i32)[None, None, :]
        likelihood = jnp.sum(jnp.where(depth_col < accepted[:, None, None], logp[:, path_node], 0.0), axis=2)
        best = jnp.argmax(jnp.where(per_path == accepted[:, None], likelihood, -jnp.inf), axis=1)
    path = slots[best]  # [B, depth + 1]
    d = path.shape[1] - 1
    path_tokens = jnp.pad(jnp.take_along_axis(nodes, jnp.clip(path[:, 1:] - 1, 0, k - 1), axis=1),
                          ((0, 0), (0, k - d)))
    next_node = jnp.take_along_axis(path, accepted[:, None], axis=1)  # [B, 1]
    next_token = jnp.take_along_axis(target, slot_of(next_node), axis=1)[:, 0]
    return Verified(accepted=accepted, path_nodes=path, path_tokens=path_tokens, target=target,
                    next_token=next_token)


def move_accepted(pages: tuple[jax.Array, ...], tree: DraftTree, block_table: jax.Array, start: jax.Array,
                  qn: jax.Array, path_nodes: jax.Array, accepted: jax.Array) -> tuple[jax.Array, ...]:
    """Copy the K/V of the accepted path's nodes from their tree slots to their sequence positions.

    pages: the runner's `kv_pages`, arrays [N, L, S, ...] (K, V and any scales); block_table int32[B, M];
    start, qn, accepted int32[B]; path_nodes int32[B, depth + 1]. A chain is already in place: returned unchanged.
    """
    if is_chain(tree):
        return pages
    n, s = pages[0].shape[0], pages[0].shape[2]
    depth = jnp.arange(path_nodes.shape[1], dtype=i32)[None, :]
    base = (start + qn - 1)[:, None]
    src_pos, dst_pos = base + path_nodes, base + depth  # [B, depth + 1]
    m = block_table.shape[1]
    block_of = lambda pos: jnp.take_along_axis(block_table, jnp.clip(floor_div(pos, s), 0, m - 1), axis=1)  # noqa: E731
    move = (depth >= 1) & (depth <= accepted[:, None]) & (src_pos != dst_pos)
    src_blk, src_off = block_of(src_pos).reshape(-1), floor_mod(src_pos, s).reshape(-1)
    dst_blk = jnp.where(move, block_of(dst_pos), n).reshape(-1)  # block n: out of range, dropped
    dst_off = floor_mod(dst_pos, s).reshape(-1)
    # pages[blk, :, off] is one token of every layer: [T, L, ...]; one gather and one scatter per array.
    return tuple(p.at[dst_blk, :, dst_off].set(p[src_blk, :, src_off], mode="drop") for p in pages)
