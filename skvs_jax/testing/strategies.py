"""Hypothesis strategies for the allocator's property tests: configurations and operation sequences.

Kept apart from `allocator_kit` so that the invariant checker and the oracle comparison need no test framework;
only these strategies import hypothesis (install the `test` extra).
"""

from __future__ import annotations

from hypothesis import strategies as hs

from skvs_jax.config import CacheConfig, SpecConfig
from skvs_jax.testing import allocator_kit as kit


def cache_configs(fixed: bool = True) -> hs.SearchStrategy[CacheConfig]:
    """Small cache geometries. fixed=True samples a few fixed ones (each compiles once per test session);
    fixed=False draws arbitrary ones (more coverage, one compilation per distinct config)."""
    if fixed:
        return hs.sampled_from(kit.SMALL_CONFIGS)
    return hs.builds(
        lambda s, b, m, extra, p: CacheConfig(
            num_blocks=m + 1 + extra, block_size=s, max_seqs=b, max_blocks_per_seq=m, spec_pool_capacity=p
        ),
        hs.sampled_from([1, 2, 4, 8, 16]),
        hs.integers(1, 6),
        hs.integers(1, 10),
        hs.integers(0, 30),
        hs.integers(0, 6),
    )


def spec_configs(fixed: bool = True) -> hs.SearchStrategy[SpecConfig]:
    """Speculation settings covering both release modes with and without the speculative pool."""
    if fixed:
        return hs.sampled_from(kit.SPEC_CONFIGS)
    return hs.builds(
        SpecConfig,
        draft_len=hs.integers(0, 8),
        generation_threshold=hs.integers(0, 6),
        max_spec_ratio=hs.floats(0, 1),
        release=hs.sampled_from(["immediate", "lazy"]),
        use_spec_pool=hs.booleans(),
    )


def operations(cfg: CacheConfig, spec: SpecConfig) -> hs.SearchStrategy[kit.Operation]:
    """One random operation for this config, every transition represented."""
    b = cfg.max_seqs
    slots = hs.integers(0, b - 1)
    order = hs.permutations(range(b)).map(tuple)
    # Prefill-sized and decode-sized requests, sometimes more than a sequence or the pool can hold.
    tokens = hs.one_of(hs.integers(0, 2), hs.integers(0, 3 * cfg.block_size), hs.just(cfg.max_tokens_per_seq))
    vec = lambda elem: hs.lists(elem, min_size=b, max_size=b).map(tuple)  # noqa: E731
    return hs.one_of(
        hs.builds(kit.Allocate, vec(tokens), order),
        hs.builds(kit.AllocateSpeculative, vec(hs.integers(0, spec.draft_len)), order),
        hs.builds(kit.AllocateStep, vec(tokens), vec(hs.integers(0, spec.draft_len)), order,
                  hs.sampled_from([None, 1, 2])),
        hs.builds(kit.Commit, vec(hs.integers(0, spec.draft_len + 2)), hs.sampled_from([None, None, 2])),
        hs.builds(kit.Free, vec(hs.booleans())),
        hs.builds(kit.Fork, vec(hs.integers(-1, b - 1))),
        hs.builds(kit.SharePrefix, slots, vec(hs.booleans()), hs.sampled_from([0, 0, 1])),
        hs.builds(kit.SetCached, slots, hs.booleans()),
        hs.builds(kit.Evict, hs.integers(0, kit.MAX_EVICT)),
        hs.builds(kit.Reclaim, hs.integers(0, 4)),
    )


def operation_sequences(cfg: CacheConfig, spec: SpecConfig, max_size: int = 40) -> hs.SearchStrategy:
    """Lists of operations; a final kit.Free of every slot is appended by `run_sequence`."""
    return hs.lists(operations(cfg, spec), max_size=max_size)
