"""The model side of the engine, as a small protocol, and its implementation for the tiny Llama + Medusa heads.

The engine knows nothing about a model's layers: it needs a paged forward pass, a draft proposal and a KV cache
it can copy blocks of and hand to the KV tiers. A runner is a static (hashable) object, passed to jitted
functions as a static argument; everything that changes (weights, cache) goes in and out as pytrees. To serve
another model, implement `ModelRunner` and build the engine with `Engine.from_runner`.

This module is the one place in the serving path that imports `reference_models`' model code (docs/design.md: the
engine reaches the models only through this protocol). The commands and the simulator's calibration load the
shipped weights with `reference_models.load_shipped`; the core never imports `reference_models`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx, struct

from reference_models.llama import KVCache, Llama, LlamaConfig
from reference_models.medusa import MedusaHeads
from skvs_jax import distributed


@struct.dataclass
class DraftSite:
    """Where each row drafts: what a drafter that is not a function of the hidden state alone needs (the oracle
    drafter, `oracle_drafter`)."""

    request_id: jax.Array  # int32[B] the row's request id (-1: an empty row)
    position: jax.Array  # int32[B] the sequence position of the row's first draft (its last known token's + 1)


class ModelRunner(Protocol):
    """What the engine needs of a model. Attributes are static ints; methods are pure and jittable."""

    vocab_size: int
    hidden_size: int
    max_positions: int
    num_draft_heads: int  # 0: the model cannot propose drafts

    def init_cache(self, num_blocks: int, block_size: int, dtype: Any) -> Any:
        """An empty paged KV cache pytree whose arrays lead with the block axis N (block 0 = null block)."""

    def forward(self, params: Any, tokens: jax.Array, positions: jax.Array, cache: Any, block_tables: jax.Array,
                context_lens: jax.Array, query_lens: jax.Array, *, impl: str, tree_mask: jax.Array | None = None,
                logits_at: jax.Array | None = None) -> tuple[jax.Array, jax.Array, Any]:
        """tokens, positions int32[B, Q]; block_tables int32[B, M]; context_lens, query_lens int32[B] (the Q
        query tokens of row b are stored at cache positions context_lens - query_lens + j, j < query_lens; rows
        with query_lens 0 write nothing); tree_mask bool[B, Q, Q] or None (causal): with a mask, query i sees
        the cache before the Q query slots plus slot j iff tree_mask[b, i, j] (positions carry each node's
        depth); logits_at int32[B', R] or None: the query slots whose logits are wanted, in the first B' <= B rows
        (the engine asks for each home row's sampling slots; a split step's extra rows want none). Returns (logits
        float[B, Q, V], or float[B', R, V] with logits_at; hidden float[B, Q, Dm]; cache)."""

    def draft(self, params: Any, hidden: jax.Array, site: DraftSite | None = None) -> jax.Array:
        """hidden float[B, Dm] at a row's last accepted position t -> int32[B, num_draft_heads] drafts for
        positions t + 2, t + 3, ... (each head's most likely token). site: the rows' request ids and first draft
        positions (t + 2), for drafters that need them; Medusa heads do not."""

    def draft_logits(self, params: Any, hidden: jax.Array, site: DraftSite | None = None) -> jax.Array:
        """hidden float[B, Dm] -> float32[B, num_draft_heads, V]: head h's logits for position t + 2 + h (what
        sampled drafts, tree candidates and lossless verification's draft distribution q are made from)."""

    def copy_blocks(self, cache: Any, src: jax.Array, dst: jax.Array) -> Any:
        """Copy whole blocks src[X] -> dst[X] (copy-on-write)."""

    def kv_pages(self, cache: Any) -> tuple[jax.Array, ...]:
        """The cache as a tuple of arrays [N, L, S, ...] (block, layer, token in block, ...): K/V pages and any
        quantisation scales (L = 1 for a cache that is not per layer). `tiers` swaps them by block; the engine's
        tree verification moves tokens within them and its draft scrub zeroes token slots of every layer."""

    def with_kv_pages(self, cache: Any, pages: tuple[jax.Array, ...]) -> Any:
        """The inverse of `kv_pages`."""


@dataclasses.dataclass(frozen=True)
class LlamaMedusaRunner:
    """`reference_models.Llama` with optional `MedusaHeads`; params = (llama state, heads state or None)."""

    graphdef: Any
    heads_graphdef: Any
    config: LlamaConfig
    num_draft_heads: int

    @classmethod
    def create(cls, model: Llama, heads: MedusaHeads | None = None) -> tuple[LlamaMedusaRunner, Any]:
        """The runner (static) and its params (a pytree) for a model and its heads."""
        if not isinstance(model, Llama):
            raise TypeError(f"model must be a reference_models.Llama, got {type(model).__name__}")
        graphdef, state = nnx.split(model)
        if heads is None:
            return _interned(cls(graphdef, None, model.config, 0)), (state, None)
        if not isinstance(heads, MedusaHeads):
            raise TypeError(f"heads must be MedusaHeads or None, got {type(heads).__name__}")
        if heads.config.hidden_size != model.config.hidden_size or heads.config.vocab_size != model.config.vocab_size:
            raise ValueError("the Medusa heads do not match the base model's hidden size / vocabulary")
        heads_graphdef, heads_state = nnx.split(heads)
        return _interned(cls(graphdef, heads_graphdef, model.config, heads.config.num_heads)), (state, heads_state)

    def __hash__(self) -> int:
        # jit hashes its static arguments at every call, and a GraphDef's hash walks the whole module tree: ~2 ms a
        # call on the shipped model, more than the host's other work per dispatch. Computed once per runner.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.graphdef, self.heads_graphdef, self.config, self.num_draft_heads))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def init_cache(self, num_blocks: int, block_size: int, dtype: Any) -> KVCache:
        """An empty `KVCache` with pages of `dtype` ("float32", "bfloat16", "int8", "float8_e4m3fn" or the dtype
        itself; ValueError otherwise); int8 / fp8 pages come with float32 scales [N, L, S, Hkv]."""
        return KVCache.zeros(self.config, num_blocks, block_size, dtype)

    def forward(self, params, tokens, positions, cache, block_tables, context_lens, query_lens, *, impl: str,
                tree_mask=None, logits_at=None):
        model = nnx.merge(self.graphdef, params[0])
        return model.forward_paged(tokens, positions, cache, block_tables, context_lens, query_lens=query_lens,
                                   tree_mask=tree_mask, impl=impl, logits_at=logits_at)

    def draft(self, params, hidden: jax.Array, site: DraftSite | None = None) -> jax.Array:
        return jnp.argmax(self.draft_logits(params, hidden), axis=-1).astype(jnp.int32)

    def draft_logits(self, params, hidden: jax.Array, site: DraftSite | None = None) -> jax.Array:
        if self.heads_graphdef is None:
            raise ValueError("this runner has no draft heads")
        logits = nnx.merge(self.heads_graphdef, params[1])(hidden)  # [H, B, V]
        return jnp.moveaxis(logits, 0, 1).astype(jnp.float32)

    def copy_blocks(self, cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
        """Copy whole blocks src[X] -> dst[X] of every layer's pages and, when quantised, scales (a block's
        values are meaningless without its scales)."""
        return jax.tree.map(lambda x: x.at[dst].set(x[src]), cache)

    def kv_pages(self, cache: KVCache) -> tuple[jax.Array, ...]:
        """Every cache array, each leading with the block axis N: K and V pages [N, L, S, Hkv, D], then for
        int8 / fp8 caches K and V scales [N, L, S, Hkv] float32 (so a swap moves a block's scales with its
        values)."""
        return tuple(jax.tree.leaves(cache))

    def with_kv_pages(self, cache: KVCache, pages: tuple[jax.Array, ...]) -> KVCache:
        """The inverse of `kv_pages`: `cache`'s structure (dtype, quantised or not) with `pages` as its arrays."""
        treedef = jax.tree.structure(cache)
        if len(pages) != treedef.num_leaves:
            raise ValueError(f"pages must hold {treedef.num_leaves} arrays for this cache, got {len(pages)}")
        return jax.tree.unflatten(treedef, pages)

    # Optional hooks (not in `ModelRunner`): a runner with them can be sharded over a mesh (see `distributed`).

    def param_specs(self, params, tp: int):
        """PartitionSpecs of `params` for a mesh whose "tp" axis has `tp` devices (Megatron column / row / vocab
        parallel, see `distributed`); ValueError naming the mesh when tp does not divide the heads."""
        distributed.check_llama_dims(self.config, tp)
        return distributed.megatron_specs(params)

    def cache_specs(self, cache: KVCache) -> tuple:
        """One PartitionSpec per `kv_pages` array: every page and scale array split on its Hkv axis."""
        return tuple(distributed.kv_spec(x) for x in self.kv_pages(cache))


_RUNNERS: dict[LlamaMedusaRunner, LlamaMedusaRunner] = {}


def _interned(runner: LlamaMedusaRunner) -> LlamaMedusaRunner:
    """One runner object per model structure: jit matches a static argument by hash, then by `==`, which for
    another but equal runner compares the GraphDefs node by node at every call; the same object compares at once."""
    return _RUNNERS.setdefault(runner, runner)
