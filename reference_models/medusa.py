"""Medusa-1 heads: extra decoding heads on the frozen base model's last hidden state.

Head i (0-based) reads the hidden state h_t at position t (after the base model's final norm) and predicts the
token at position t + 2 + i (the base LM head predicts t + 1). Each head is `num_layers` residual blocks
`x + SiLU(W x + b)` followed by its own bias-free LM head, as in Cai et al. 2024 (FasterDecoding/Medusa).
Parameter paths map one-to-one to that repository's `medusa_head.{i}.{j}.linear.{weight,bias}` and
`medusa_head.{i}.{num_layers}.weight` (see `checkpoint.py`).

Dimensions: Dm model width, V vocab, `heads` the Medusa heads (K of them draft a chain of K tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


class ResBlock(nnx.Module):
    """x + SiLU(W x + b); W [Dm, Dm] stored [out, in], b [Dm], both `dtype`. Zero-initialised, so a fresh block is
    the identity."""

    def __init__(self, hidden_size: int, dtype: Any = jnp.float32):
        self.linear = nnx.Module()
        self.linear.weight = nnx.Param(jnp.zeros((hidden_size, hidden_size), dtype))
        self.linear.bias = nnx.Param(jnp.zeros((hidden_size,), dtype))

    def __call__(self, x: Array) -> Array:  # [..., Dm] -> [..., Dm]
        y = jnp.einsum("...i,oi->...o", x, self.linear.weight[...])
        return x + jax.nn.silu(y + jnp.broadcast_to(self.linear.bias[...], y.shape))


class MedusaHead(nnx.Module):
    def __init__(self, config: MedusaConfig, lm_head_init: Array, dtype: Any = jnp.float32):
        self.blocks = nnx.List([ResBlock(config.hidden_size, dtype) for _ in range(config.num_layers)])
        self.lm_head = nnx.Module()
        self.lm_head.weight = nnx.Param(jnp.array(lm_head_init, dtype, copy=True))  # [V, Dm], own buffer

    def __call__(self, hidden: Array) -> Array:  # [..., Dm] -> [..., V]
        for block in self.blocks:
            hidden = block(hidden)
        return jnp.einsum("...d,vd->...v", hidden, self.lm_head.weight[...])


class MedusaHeads(nnx.Module):
    """All heads. `lm_head_init` [V, Dm] (usually the base model's LM head, as Medusa does) or None (zeros).
    `dtype` is the parameters' dtype (float32 or bfloat16; `lm_head_init` is cast to it); the logits follow the
    parameters' and the hidden state's dtypes."""

    def __init__(self, config: MedusaConfig, lm_head_init: Array | None = None, dtype: Any = jnp.float32):
        self.config = config
        if lm_head_init is None:
            lm_head_init = jnp.zeros((config.vocab_size, config.hidden_size), dtype)
        if tuple(lm_head_init.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(f"lm_head_init must be [V, Dm] = {(config.vocab_size, config.hidden_size)}, "
                             f"got {tuple(lm_head_init.shape)}")
        self.heads = nnx.List([MedusaHead(config, lm_head_init, dtype) for _ in range(config.num_heads)])

    def __call__(self, hidden: Array) -> Array:
        """hidden [..., Dm] (base model, after the final norm) -> logits [heads, ..., V]; head i predicts t + 2 + i."""
        return jnp.stack([head(hidden) for head in self.heads])

    def draft(self, hidden: Array) -> Array:
        """Greedy chain of drafts: hidden [B, Dm] at the last committed position t -> tokens [B, heads] int32,
        draft j for position t + 2 + j."""
        return jnp.argmax(self(hidden), axis=-1).T.astype(jnp.int32)


def untrained_heads(lm_head: Array, num_heads: int = 4, dtype=jnp.float32) -> MedusaHeads:
    """Heads as Medusa initialises them before training: identity blocks and copies of the base model's LM head
    `lm_head` [V, Dm], in `dtype` (float32 or bfloat16). For a model of a real shape with random weights: they
    accept next to nothing, but a step that runs them pays what trained heads cost."""
    v, d = lm_head.shape
    config = MedusaConfig(hidden_size=int(d), vocab_size=int(v), num_heads=num_heads)
    return MedusaHeads(config, lm_head_init=lm_head, dtype=dtype)
