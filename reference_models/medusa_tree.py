"""Greedy decoding with Medusa *tree* verification on the paged KV cache.

A static `DraftTree` is given, as in Medusa, by `choices`: paths of top-k ranks, one per depth, e.g.
((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)): node (0, 1) is head 1's second-best token following head 0's best.
Each step puts [last committed token (the root), every tree node] through one multi-query call with a tree
mask (node j sees the committed cache and its own ancestors); node j's K/V land at cache position
`n - 1 + j` while its RoPE position is `n - 1 + depth(j)`. Every root-to-leaf path is checked against the base
model's argmax; the longest accepted prefix of the best path is committed together with the base model's next
token, so the output is exactly greedy decoding's. The accepted nodes' K/V are then moved from their tree slots to
their sequence positions; everything after the committed length is garbage the next step overwrites.

Paths shorter than the deepest one are padded; padded slots are masked out of the comparison (the original
code padded with token 0 and could "accept" it when the base model's argmax was 0).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reference_models.generate import (
    MedusaStats,
    accepted_prefix_len,
    check_heads,
    check_num_new,
    check_prompts,
    speculative_loop,
)
from reference_models.llama import KVCache, Llama
from reference_models.medusa import MedusaHeads

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A static draft tree. Slot 0 is the root (the last committed token); slot j >= 1 is node choices[j - 1]
    after sorting by (depth, ranks). Derived arrays are numpy, shapes in the property docstrings."""

    choices: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        paths = [tuple(c) for c in self.choices]
        if any(isinstance(r, bool) or not isinstance(r, numbers.Integral) for c in paths for r in c):
            raise TypeError(f"choices must be paths of int ranks, got {self.choices!r}")  # 0.5 became rank 0
        choices = tuple(sorted({tuple(int(r) for r in c) for c in paths}, key=lambda c: (len(c), c)))
        if not choices or any(len(c) == 0 or min(c) < 0 for c in choices):
            raise ValueError("choices must be non-empty paths of non-negative ranks")
        for c in choices:
            if len(c) > 1 and c[:-1] not in choices:
                raise ValueError(f"tree node {c} has no parent {c[:-1]} in choices")
        object.__setattr__(self, "choices", choices)

    @property
    def num_slots(self) -> int:
        """Q = 1 + number of nodes."""
        return 1 + len(self.choices)

    @property
    def depth(self) -> np.ndarray:
        """[Q] int32: 0 for the root, len(path) for a node."""
        return np.array([0] + [len(c) for c in self.choices], np.int32)

    @property
    def head_and_rank(self) -> tuple[np.ndarray, np.ndarray]:
        """([Q-1], [Q-1]) int32: node j's token is rank `rank` of Medusa head `head` (= depth - 1)."""
        heads = np.array([len(c) - 1 for c in self.choices], np.int32)
        return heads, np.array([c[-1] for c in self.choices], np.int32)

    @property
    def mask(self) -> np.ndarray:
        """[Q, Q] bool: slot i sees slot j iff j is i or one of its ancestors (the root included)."""
        slot = {c: i + 1 for i, c in enumerate(self.choices)}
        m = np.eye(self.num_slots, dtype=bool)
        m[:, 0] = True
        for c, i in slot.items():
            for d in range(1, len(c)):
                m[i, slot[c[:d]]] = True
        return m

    @property
    def paths(self) -> tuple[np.ndarray, np.ndarray]:
        """(slots [paths, depth + 1] int32, valid [paths, depth + 1] bool): root-to-leaf slot paths, padded with 0."""
        slot = {c: i + 1 for i, c in enumerate(self.choices)}
        leaves = [c for c in self.choices if not any(o[: len(c)] == c and len(o) > len(c) for o in self.choices)]
        width = 1 + max(len(c) for c in self.choices)
        slots = np.zeros((len(leaves), width), np.int32)
        valid = np.zeros((len(leaves), width), bool)
        for p, leaf in enumerate(leaves):
            row = [0] + [slot[leaf[:d]] for d in range(1, len(leaf) + 1)]
            slots[p, : len(row)], valid[p, : len(row)] = row, True
        return slots, valid


SMALL_TREE = DraftTree((
    (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0),
))
"""15 nodes, depth 4: the best paths of the 4 heads' top-3 / top-2 tokens (Q = 16 per verification)."""


def _move_kv(cache: KVCache, src: Array, dst: Array) -> KVCache:
    """Copy every layer's K/V (and scales, for a quantised cache) from slots src [T] to slots dst [T] (dst < 0:
    skip). Sources are read first.

    The stored values are moved as they are, not rewritten through `write_kv`: for int8 / fp8 pages that would
    re-quantise already dequantised values, so a moved token could differ (in its scale's last bits) from what
    verification attended to. A plain scatter keeps the move exact for every page dtype.
    """
    n, s = cache.k.shape[0], cache.block_size
    src_blk, src_off = jnp.maximum(src, 0) // s, jnp.maximum(src, 0) % s
    dst_blk, dst_off = jnp.where(dst < 0, n, dst // s), jnp.maximum(dst, 0) % s  # block n: out of range, dropped

    def move(pages: Array) -> Array:  # [N, L, S, ...] -> the same, slots dst of every layer overwritten from src
        return pages.at[dst_blk, :, dst_off].set(pages[src_blk, :, src_off], mode="drop")

    return jax.tree.map(move, cache)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(4, 5))
def _tree_step(graphdefs, tree: DraftTree, state, heads_state, cache, tokens, n, hidden, tables, limit):
    """One tree draft + verify step; arguments as in `generate._medusa_step`."""
    model, heads = nnx.merge(graphdefs[0], state), nnx.merge(graphdefs[1], heads_state)
    b, q = tokens.shape[0], tree.num_slots
    head, rank = tree.head_and_rank
    top = jax.lax.top_k(heads(hidden), int(rank.max()) + 1)[1].astype(jnp.int32)  # [heads, B, ranks]
    nodes = top[jnp.asarray(head), :, jnp.asarray(rank)].T  # [B, Q-1]
    last = jnp.take_along_axis(tokens, (n - 1)[:, None], axis=1)  # [B, 1]
    query = jnp.concatenate([last, nodes], axis=1)  # [B, Q]
    positions = (n - 1)[:, None] + jnp.asarray(tree.depth)[None, :]
    mask = jnp.broadcast_to(jnp.asarray(tree.mask)[None], (b, q, q))
    logits, hiddens, cache = model.forward_paged(query, positions, cache, tables, n - 1 + q, tree_mask=mask)
    targets = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, Q]: greedy token after each slot
    path_slots, path_valid = (jnp.asarray(x) for x in tree.paths)  # [paths, depth + 1]
    candidates, expected = query[:, path_slots], targets[:, path_slots]  # [B, paths, depth + 1]
    accepted_per_path = accepted_prefix_len(candidates[:, :, 1:], expected[:, :, :-1], path_valid[None, :, 1:])
    best = jnp.argmax(accepted_per_path, axis=1)  # [B]
    accepted = jnp.take_along_axis(accepted_per_path, best[:, None], axis=1)[:, 0]  # [B]
    best_slots = path_slots[best]  # [B, depth + 1]
    running = n < limit
    # Commit targets along the best path: accepted drafts, then the bonus token, at positions n .. n + a.
    w = best_slots.shape[1]
    j = jnp.arange(w, dtype=jnp.int32)[None, :]
    write = running[:, None] & (j <= accepted[:, None])
    cols = jnp.where(write, n[:, None] + j, tokens.shape[1])
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], cols.shape)
    tokens = tokens.at[rows, cols].set(jnp.take_along_axis(targets, best_slots, axis=1), mode="drop")
    # Move the accepted nodes' K/V from cache position n-1+slot to n-1+depth (the root is already in place).
    s = cache.block_size
    src_pos, dst_pos = (n - 1)[:, None] + best_slots, (n - 1)[:, None] + j  # [B, depth + 1]
    to_slot = lambda pos: (jnp.take_along_axis(tables, pos // s, axis=1) * s + pos % s)  # noqa: E731
    move = write & (j >= 1)
    cache = _move_kv(cache, to_slot(src_pos).reshape(-1), jnp.where(move, to_slot(dst_pos), -1).reshape(-1))
    new_hidden = jnp.take_along_axis(hiddens, jnp.take_along_axis(best_slots, accepted[:, None], axis=1)[:, :, None],
                                     axis=1)[:, 0]
    hidden = jnp.where(running[:, None], new_hidden, hidden)
    n = jnp.where(running, n + accepted + 1, n)
    return cache, tokens, n, hidden, accepted, running


def medusa_tree_generate(
    model: Llama, heads: MedusaHeads, prompts: np.ndarray, num_new: int, tree: DraftTree, *, block_size: int = 16
) -> tuple[np.ndarray, MedusaStats]:
    """prompts [B, prompt_len] -> (tokens [B, prompt_len + num_new] identical to greedy decoding, acceptance
    statistics)."""
    prompts = check_prompts(model, prompts)
    check_num_new(num_new)
    check_heads(model, heads)
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    depth = int(tree.depth.max())
    if depth > heads.config.num_heads:
        raise ValueError(f"tree depth {depth} exceeds the {heads.config.num_heads} Medusa heads")
    top = max(c[-1] for c in tree.choices)
    if top >= model.config.vocab_size:
        raise ValueError(f"tree asks for rank {top} of a {model.config.vocab_size}-token vocabulary")
    step = functools.partial(_tree_step_with, tree)
    return speculative_loop(model, heads, prompts, num_new, step, lookahead=depth, slots=tree.num_slots,
                            block_size=block_size)


def _tree_step_with(tree: DraftTree, graphdefs, *args):
    return _tree_step(graphdefs, tree, *args)
