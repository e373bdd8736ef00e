"""skvs_jax: a speculation-aware KV-cache scheduler in JAX.

Glossary of dimension names, used in every annotation and docstring of the project. Each letter means one
thing everywhere; a dimension that is none of these is written as a word (`[B, ways]`, `[paths, depth]`), for
example `slots` (a row's K + 1 sampling slots), `stops` and `stop_len` (a row's stop sequences and their
length), `top` (logprobs returned per token), `widths` (the compiled draft widths), `max_width` (the widest
query), `caps` (the draft controller's caps), `ways` (a prefix-index bucket's entries).

  B    sequence slots (rows of a block table), or sequences in a batch
  N    physical KV blocks in the pool (block 0 is the null block)
  S    block size, tokens per block
  M    max blocks per sequence (columns of a block table); M * S is a request's most tokens (`max_len`)
  P    capacity of the speculative pool
  T    tokens in one engine step
  Q    query tokens per sequence in one attention call (1 for decode, K + 1 for verification)
  K    draft length (max draft tokens per sequence between commits)
  Hq   query heads;  Hkv  key/value heads;  D  head dim
  L    layers;  V  vocabulary size

and, in the scheduler and the KV manager:

  A    waiting sequences examined for admission per step (the admission window: `SchedulerConfig.admit_window`,
       resolved in `SchedulerConfig.admit_rows`)
  R    rows offered to the prefix index per step
  C    slots of the prefix index
  W    table columns one transition touches (its window; a decode step's is `KVConfig.window`)
  J    full blocks in a row of tokens, min(len // S, M)
  X    a flat list of block ids of any length

Modules (the layers, lowest first; docs/design.md): `config`, `arrays`, `checks`, `vmap_flow`, `victims`,
`policies`; `kv` (the allocator, prefix cache, tiers and their facade); `scheduler`; `serve` (the engine and its
`LLM` front) and `sim` (the simulator), beside `metrics`, `workloads`, `distributed`, `model_shapes` (the named
model shapes the engine serves and the simulator prices) and `compile_cache` (the persistent XLA cache the
commands and `LLM` use); `testing` (oracles and strategies); `commands` (the `skvs` command line);
`api_reference` (the HTML reference of every module, built by pdoc).

State is data (pytrees of fixed-shape arrays); capacities and switches are static config
(`skvs_jax.config`); every transition is a pure function `new_state, result = op(state, ...)`. The design, the
layers and the invariants are in docs/design.md.
"""

from skvs_jax import config, metrics, policies, scheduler, workloads
from skvs_jax.config import NULL_BLOCK, CacheConfig, SpecConfig
from skvs_jax.kv import allocator, manager, prefix_cache, tiers

__version__ = "0.1.0"

# The serving front, imported on first use: `import skvs_jax` stays light (no model, no tokenizer, no cache set).
_FRONT = {"LLM": "skvs_jax.serve.llm", "SamplingParams": "skvs_jax.serve.sampling_params",
          "RequestOutputKind": "skvs_jax.serve.sampling_params", "RequestOutput": "skvs_jax.serve.outputs",
          "CompletionOutput": "skvs_jax.serve.outputs", "Logprob": "skvs_jax.serve.outputs"}


def __getattr__(name: str):
    if name in _FRONT:
        import importlib

        return getattr(importlib.import_module(_FRONT[name]), name)
    raise AttributeError(f"module 'skvs_jax' has no attribute {name!r}")


__all__ = ["allocator", "config", "manager", "metrics", "policies", "prefix_cache", "scheduler", "tiers", "workloads",
           "CacheConfig", "SpecConfig", "NULL_BLOCK", "__version__", *_FRONT]
