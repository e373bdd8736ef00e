"""Static configuration: frozen, hashable dataclasses validated at construction.

Everything here is a *capacity* or a *structural switch*: it fixes array shapes or the traced program, so it
is hashable and passed to jitted functions as a static argument. Occupancy (which blocks are used, how long
each sequence is) is data and lives in the state pytrees of `allocator.py`.
"""

from __future__ import annotations

import dataclasses
import math

from skvs_jax import checks

NULL_BLOCK = 0
"""Block id that dead block-table entries point to. Never handed out, never written by a real token."""


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Geometry of the paged KV cache.

    Attributes:
      num_blocks: N, physical blocks in the pool *including* the null block 0, so N - 1 are usable.
      block_size: S, tokens per block.
      max_seqs: B, sequence slots (rows of the block table).
      max_blocks_per_seq: M, columns of the block table; a sequence holds at most M * S tokens.
      spec_pool_capacity: P, most blocks the speculative pool may hold; released draft blocks beyond it go
        straight to the free stack. 0 means 4 * max_seqs (capped at N - 1): a decode step with K <= 2 * S
        releases at most 3 blocks per sequence, so the pool can hold a step's rejects with room to spare,
        while `reclaim_expired` stays O(P) instead of O(N).
    """

    num_blocks: int
    block_size: int
    max_seqs: int
    max_blocks_per_seq: int
    spec_pool_capacity: int = 0

    def __post_init__(self) -> None:
        checks.at_least("num_blocks", self.num_blocks, 2)
        checks.at_least("block_size", self.block_size, 1)
        checks.at_least("max_seqs", self.max_seqs, 1)
        checks.at_least("max_blocks_per_seq", self.max_blocks_per_seq, 1)
        checks.at_least("spec_pool_capacity", self.spec_pool_capacity, 0)
        if self.max_blocks_per_seq > self.num_blocks - 1:
            raise ValueError(
                f"max_blocks_per_seq ({self.max_blocks_per_seq}) cannot exceed the usable blocks "
                f"num_blocks - 1 ({self.num_blocks - 1}): one sequence could never fill its table"
            )
        if self.num_blocks >= 2**31 - 1 or self.max_blocks_per_seq * self.block_size >= 2**31 - 1:
            raise ValueError("num_blocks and max_blocks_per_seq * block_size must fit in int32")

    @property
    def usable_blocks(self) -> int:
        """N - 1: every block but the null block."""
        return self.num_blocks - 1

    @property
    def max_tokens_per_seq(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    @property
    def pool_capacity(self) -> int:
        """P, the resolved capacity of the speculative pool (>= 1)."""
        if self.spec_pool_capacity:
            return min(self.spec_pool_capacity, self.usable_blocks)
        return max(1, min(4 * self.max_seqs, self.usable_blocks))


RELEASE_MODES = ("immediate", "lazy")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding as the allocator sees it.

    Attributes:
      draft_len: K, the most draft tokens a sequence may hold between two commits.
      generation_threshold: the default of the generation-reclaim knob (`Knobs.generation_threshold`): a block
        in the speculative pool more than this many generations old goes back to the free stack. The allocator
        does not read it; `reclaim_expired` takes its threshold as an argument.
      max_spec_ratio: the default of the `Knobs.max_spec_ratio` knob, the share of the free blocks left that
        opportunistic drafts may take; in [0, 1]. The allocator does not read it; the scheduler does.
      release: what `commit` does with blocks that hold only rejected drafts: "immediate" returns them at
        once (to the speculative pool if enabled), "lazy" leaves them held by the sequence until it is freed
        (the naive baseline; the sequence reuses them for its next drafts).
      use_spec_pool: whether released draft blocks go to the speculative pool (reused first by the next
        drafts) or straight to the free stack.
    """

    draft_len: int = 4
    generation_threshold: int = 8
    max_spec_ratio: float = 0.3
    release: str = "immediate"
    use_spec_pool: bool = True

    def __post_init__(self) -> None:
        checks.at_least("draft_len", self.draft_len, 0)
        checks.at_least("generation_threshold", self.generation_threshold, 0)
        if isinstance(self.max_spec_ratio, bool) or not isinstance(self.max_spec_ratio, (int, float)):
            raise TypeError(f"max_spec_ratio must be a float, got {type(self.max_spec_ratio).__name__}")
        if not (0.0 <= float(self.max_spec_ratio) <= 1.0) or math.isnan(self.max_spec_ratio):
            raise ValueError(f"max_spec_ratio must lie in [0, 1], got {self.max_spec_ratio}")
        if self.release not in RELEASE_MODES:
            raise ValueError(f"release must be one of {RELEASE_MODES}, got {self.release!r}")
        if not isinstance(self.use_spec_pool, bool):
            raise TypeError(f"use_spec_pool must be a bool, got {type(self.use_spec_pool).__name__}")

    def max_spec_blocks_per_seq(self, block_size: int) -> int:
        """ceil(K / S): the most blocks one sequence's drafts can newly occupy."""
        return -(-self.draft_len // block_size)
