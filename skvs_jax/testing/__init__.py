"""Plain-Python oracles and property-testing kits, public so that researchers can test their own policies.

  allocator_kit      the allocator's invariant checker, oracle comparison and abstract operations
  strategies         hypothesis strategies over configurations and operation sequences (needs the `test` extra)
  oracle             `OracleAllocator`: the allocator's semantics one block at a time, in plain Python
  oracle_scheduler   `OracleScheduler`: the scheduler's decisions one sequence at a time
  scheduler_harness  `Harness`: runs the jitted scheduler and the oracle in lockstep and compares every step
  hlo                `canonical` / `differing`: two compiled programs compared up to names (is a refactor one?)
  program            `heavy` / `by_source` / `kernels`: what a step program costs a GPU (launches, host round
                     trips), counted on any backend
  engines            `assert_same_serving`: two engines served the same requests alike (tokens, logprobs, counts)
  text_checkpoint    `make_checkpoint`: a tiny random Llama + Medusa with a real byte-level BPE tokenizer

`from skvs_jax import testing` gives the allocator kit's names and the strategies at the top level
(`testing.check_invariants`, `testing.cache_configs`, ...). The strategies are imported on first use, so the
library and the `skvs` commands run without hypothesis installed.
"""

from __future__ import annotations

from skvs_jax.testing.allocator_kit import (
    MAX_EVICT,
    SMALL_CONFIGS,
    SPEC_CONFIGS,
    Allocate,
    AllocateSpeculative,
    AllocateStep,
    Commit,
    Evict,
    Fork,
    Free,
    Operation,
    Reclaim,
    SetCached,
    SharePrefix,
    apply,
    assert_matches_oracle,
    assert_no_leak,
    check_invariants,
    prefix_index_as_dict,
    run_sequence,
)

_STRATEGIES = ("cache_configs", "spec_configs", "operations", "operation_sequences")


def __getattr__(name: str):
    if name in _STRATEGIES:
        from skvs_jax.testing import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module 'skvs_jax.testing' has no attribute {name!r}")


__all__ = ["MAX_EVICT", "SMALL_CONFIGS", "SPEC_CONFIGS", "Allocate", "AllocateSpeculative", "AllocateStep", "Commit",
           "Evict", "Fork", "Free", "Operation", "Reclaim", "SetCached", "SharePrefix", "apply",
           "assert_matches_oracle", "assert_no_leak", "check_invariants", "prefix_index_as_dict", "run_sequence",
           *_STRATEGIES]
