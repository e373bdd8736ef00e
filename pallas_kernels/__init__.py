"""Pallas kernels for paged attention and speculative block-state updates, each with a pure-jnp reference.

Every op takes `impl="auto" | "pallas" | "xla" | "reference"` and `interpret=` (None = interpret the Pallas
kernel when not on a GPU). "auto" is the compiled Pallas kernel on GPU and the fastest XLA path elsewhere.
Contracts, tolerances and figures: docs/kernels.md.

Modules: `attention` (paged decode and multi-query verification attention), `tuning` (the attention kernel's
launch parameters, `AttentionConfig`, and the table of those tuned on GPUs), `kv_write` (scatter of new K/V into
the pages), `block_states` (the commit's block-state update and the draft invalidation), `_common` (block-state
codes, KV quantisation, `resolve_impl`), `gpu_check` (the kernels checked, timed and tuned on a GPU).
"""

from pallas_kernels._common import (
    BLOCK_STATE_DTYPE,
    FREE,
    IMPLS,
    RESERVED,
    SPECULATIVE,
    STALE,
    VALIDATED,
    dequantize_kv,
    quantize_kv,
    resolve_impl,
)
from pallas_kernels.attention import paged_attention, paged_attention_reference
from pallas_kernels.block_states import (
    invalidate_drafts,
    invalidate_drafts_reference,
    update_block_states,
    update_block_states_reference,
    update_states_by_scatter,
)
from pallas_kernels.kv_write import write_kv, write_kv_reference
from pallas_kernels.tuning import AttentionConfig

__all__ = [
    "AttentionConfig",
    "BLOCK_STATE_DTYPE",
    "FREE",
    "IMPLS",
    "RESERVED",
    "SPECULATIVE",
    "STALE",
    "VALIDATED",
    "dequantize_kv",
    "invalidate_drafts",
    "invalidate_drafts_reference",
    "paged_attention",
    "paged_attention_reference",
    "quantize_kv",
    "resolve_impl",
    "update_block_states",
    "update_block_states_reference",
    "update_states_by_scatter",
    "write_kv",
    "write_kv_reference",
]
