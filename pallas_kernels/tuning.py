"""Launch parameters of the compiled paged-attention kernel, and the table of those tuned on real GPUs.

`AttentionConfig` names the four parameters `paged_attention(config=...)` accepts; a field left None takes the
kernel's default (`attention.resolve_config`). `TUNED` maps (device kind, `ShapeKey`) to the configuration that
measured fastest there; `paged_attention` consults it through `lookup` only when no config is given and the kernel
runs compiled on a GPU, so on a CPU (interpreted kernels, the XLA path) the table never changes anything.

How the table is filled: on the GPU, run `skvs gpu-check --only tune --out tune.json` (the sweep,
`pallas_kernels.gpu_check.tune`). Each row of `sections["tune"]` in that file holds the device kind, the shape key,
the default's time and the best configuration's; its `table_entry` is the line to paste below. Add an entry by
hand only where the best beats the default by more than the run-to-run spread (a few percent; rerun to see it),
with the device, the date and the two times in a comment on the entry. Nothing is ever written here
automatically, and no number goes in without a GPU run behind it.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple

import jax.numpy as jnp

CONTEXT_BUCKETS = (512, 2048, 8192)  # upper bounds of the context buckets; past the last: ">8192"


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of the compiled Pallas paged-attention kernel (None: the kernel's default).

    pages_per_step: blocks gathered per loop step, a power of two (a step is pages_per_step * S tokens).
    num_splits: split-K programs per (sequence, KV head), flash-decoding style; capped at the steps a row has.
    num_warps, num_stages: Triton's launch parameters (warps per program, software-pipelining depth).
    Interpreted (off a GPU) only pages_per_step and num_splits change the program; the results agree for every
    valid config up to float rounding of the reduction order.
    """

    pages_per_step: int | None = None
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


def check_config(config) -> None:
    """Raise TypeError / ValueError naming the field if `config` is not None or a valid `AttentionConfig`."""
    if config is None:
        return
    if not isinstance(config, AttentionConfig):
        raise TypeError(f"config must be an AttentionConfig or None, got {type(config).__name__}")
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"config.{field.name} must be an int or None, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"config.{field.name} must be >= 1 (or None for the default), got {value}")
    # The kernel's tiles are powers of two (Triton); a pages_per_step of 3 would silently run as 4.
    for name in ("pages_per_step", "num_warps"):
        value = getattr(config, name)
        if value is not None and value & (value - 1):
            raise ValueError(f"config.{name} must be a power of two, got {value}")


class ShapeKey(NamedTuple):
    """What a tuned configuration depends on, besides the device."""

    dtype: str  # the KV pages' dtype name, e.g. "bfloat16"
    q_bucket: int  # 1, or the next power of two of Q (the query rows the kernel pads to)
    group: int  # G = Hq // Hkv
    head_dim: int  # D
    block_size: int  # S
    context: str  # "<=512" | "<=2048" | "<=8192" | ">8192": of M * S, the longest context the table holds


def context_bucket(context: int) -> str:
    """The bucket of a context length (tokens): "<=512", "<=2048", "<=8192" or ">8192"."""
    for bound in CONTEXT_BUCKETS:
        if context <= bound:
            return f"<={bound}"
    return f">{CONTEXT_BUCKETS[-1]}"


def shape_key(*, dtype, Q: int, G: int, D: int, S: int, context: int) -> ShapeKey:
    """The table key of one paged_attention call: dtype the pages' dtype, Q query tokens per sequence, G query
    heads per KV head, D head dim, S block size, context = M * S (static, so one compiled program per key)."""
    for name, value in (("Q", Q), ("G", G), ("D", D), ("S", S), ("context", context)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    q_bucket = 1 << (Q - 1).bit_length()  # 1 -> 1, 5 -> 8
    return ShapeKey(jnp.dtype(dtype).name, q_bucket, G, D, S, context_bucket(context))


# (jax.devices()[0].device_kind, ShapeKey) -> AttentionConfig. Empty: no GPU has run the sweep yet. An entry reads
#   (<device kind>, ShapeKey(<dtype>, <q_bucket>, <G>, <D>, <S>, <context>)):
#       AttentionConfig(<pages_per_step>, <num_splits>, <num_warps>, <num_stages>),
#       # <device>, <date>, skvs gpu-check --only tune: <best> ms vs <default> ms default
TUNED: dict[tuple[str, ShapeKey], AttentionConfig] = {}


def lookup(device_kind: str, *, dtype, Q: int, G: int, D: int, S: int, context: int) -> AttentionConfig | None:
    """The tuned configuration for this device kind and shape (see `shape_key`), or None if there is none."""
    return TUNED.get((device_kind, shape_key(dtype=dtype, Q=Q, G=G, D=D, S=S, context=context)))
