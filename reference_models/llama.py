"""A Llama decoder in Flax NNX, with three ways to run the same weights.

* `forward_dense(tokens, positions, mask)`: the whole sequence at once, no cache. The reference.
* `forward_paged(...)` with Q prompt tokens per sequence: **paged prefill** of a chunk into the paged KV cache.
* `forward_paged(...)` with Q = 1 (decode) or Q = K + 1 / tree nodes (verification): **paged multi-query**
  against the cache, causal (bottom-right aligned) or with a tree mask.

The paged paths write this call's K/V with `pallas_kernels.write_kv`, then attend with
`pallas_kernels.paged_attention` (see that package for the cache layout; block 0 is the null block). The cache
(`KVCache`) holds float32, bfloat16, int8 or float8_e4m3fn pages; the last two carry per-token, per-KV-head
float32 scales and go through the kernels' quantised path.

Conventions follow Hugging Face `LlamaForCausalLM` exactly, so that its checkpoints load by name: linear weights
are stored `[out, in]`; RoPE uses the `rotate_half` layout (first and second halves of the head dim pair up),
`rope_theta`, and optional "linear" or Llama-3 ("llama3") frequency scaling; RMSNorm computes in fp32.
Parameter paths (`layers.0.self_attn.q_proj.weight`, ...) equal HF names without the `model.` prefix.

Dimensions (see `skvs_jax`): B sequences, T tokens (dense), Q query tokens per sequence, N blocks, S block size,
M blocks per sequence, Hq / Hkv heads, D head dim, L layers, V vocab, Dm model width, F MLP width.

Why this module is ~530 lines: one model with its three forward paths over the same weights and its KV cache;
splitting the paths would separate what the tests compare.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import paged_attention, write_kv

Array = jax.Array

# --------------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as in HF `rope_parameters` / `rope_scaling`.

    rope_type "linear": every inverse frequency is divided by `factor`.
    rope_type "llama3": low frequencies (wavelength > original_max / low_freq_factor) are divided by `factor`,
    high frequencies (wavelength < original_max / high_freq_factor) are kept, the band between is interpolated.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(f"unsupported rope_type {self.rope_type!r} (supported: default, linear, llama3)")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):  # NaN gave NaN logits, 0 a ZeroDivision
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
                raise ValueError(f"rope scaling {name} must be a finite number > 0, got {value!r}")
        m = self.original_max_position_embeddings
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 1:
            raise ValueError(f"rope scaling original_max_position_embeddings must be a positive int, got {m!r}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")

    def to_hf(self) -> dict[str, Any]:
        """The HF rope parameters of this scaling: only the keys its type reads."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": float(self.factor)}
        if self.rope_type == "llama3":
            out |= {"low_freq_factor": float(self.low_freq_factor), "high_freq_factor": float(self.high_freq_factor),
                    "original_max_position_embeddings": int(self.original_max_position_embeddings)}
        return out


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Static hyper-parameters (hashable; passed to jitted code as static)."""

    vocab_size: int = 256
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 0  # 0 = hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 0:
            raise ValueError(f"head_dim must be an int >= 0 (0: hidden_size // num_heads), got {self.head_dim!r}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError("hidden_size must be a multiple of num_heads when head_dim is not given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        m = self.max_position_embeddings
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"max_position_embeddings must be a positive int, got {m!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling).__name__}")
        if not isinstance(self.tie_word_embeddings, bool):  # "no" was truthy, so tied
            raise TypeError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")

    @property
    def num_params(self) -> int:
        d, f, hq, hkv, hd = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
        layer = d * hd * (2 * hq + 2 * hkv) + 3 * d * f + 2 * d
        return self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + self.num_layers * layer + d

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` of an equivalent HF `LlamaForCausalLM`: the transformers >= 5 layout
        (`rope_parameters`), plus `rope_theta` and `rope_scaling`, which transformers < 5 reads instead."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        scaling = None if self.rope_scaling is None else self.rope_scaling.to_hf()
        rope |= scaling or {}
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": float(self.rope_theta),  # read by transformers < 5
            "rope_scaling": scaling,  # read by transformers < 5 (without it, a scaled model loaded as unscaled)
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> LlamaConfig:
        """Parse an HF Llama `config.json` (transformers 4 `rope_scaling` or 5 `rope_parameters` layout)."""
        if hf.get("model_type", "llama") != "llama":
            raise ValueError(f"not a Llama config: model_type={hf.get('model_type')!r}")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"{flag}=True is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be silu, got {hf.get('hidden_act')!r}")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise ValueError(f"Llama config is missing {missing}")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        scaling = None
        if rope_type != "default":
            if "factor" not in rope:
                raise ValueError(f"Llama config: {rope_type} rope scaling is missing its 'factor'")
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            scaling = RopeScaling(rope_type=rope_type, **{k: rope[k] for k in keys if k in rope})
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        )


# ----------------------------------------------------------------------------------------------------- RoPE


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies [D/2] float32, computed as HF does (fp32), with optional scaling."""
    dim = config.head_dim
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** (np.arange(0, dim, 2).astype(np.float32) / dim))).astype(
        np.float32
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(config: LlamaConfig, positions: Array) -> tuple[Array, Array]:
    """positions [B, T] int32 -> (cos, sin), each [B, T, D] float32 (frequencies repeated twice, HF layout)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(config))[None, None, :]  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x [B, T, H, D], cos/sin [B, T, D] -> x rotated (HF `rotate_half` convention)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :].astype(x.dtype) + rotated * sin[:, :, None, :].astype(x.dtype)


# --------------------------------------------------------------------------------------------------- layers


class Linear(nnx.Module):
    """Bias-free linear layer; weight [out, in] as in PyTorch / HF."""

    def __init__(self, in_features: int, out_features: int, *, std: float, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        w = std * jax.random.normal(rngs.params(), (out_features, in_features), jnp.float32)
        self.weight = nnx.Param(w.astype(dtype))

    def __call__(self, x: Array) -> Array:  # [..., in] -> [..., out]
        return jnp.einsum("...i,oi->...o", x, self.weight[...])


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: Any = jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: Array) -> Array:  # [..., Dm]
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + jnp.float32(self.eps))
        return jnp.broadcast_to(self.weight[...], normed.shape) * normed.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, *, std: float, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        d, hd = config.hidden_size, config.head_dim
        self.q_proj = Linear(d, config.num_heads * hd, std=std, rngs=rngs, dtype=dtype)
        self.k_proj = Linear(d, config.num_kv_heads * hd, std=std, rngs=rngs, dtype=dtype)
        self.v_proj = Linear(d, config.num_kv_heads * hd, std=std, rngs=rngs, dtype=dtype)
        self.o_proj = Linear(config.num_heads * hd, d, std=std, rngs=rngs, dtype=dtype)
        self.shape = (config.num_heads, config.num_kv_heads, hd)

    def project(self, x: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
        """x [B, T, Dm] -> q [B, T, Hq, D], k [B, T, Hkv, D] (both rotated), v [B, T, Hkv, D]."""
        hq, hkv, hd = self.shape
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, hq, hd)
        k = self.k_proj(x).reshape(b, t, hkv, hd)
        v = self.v_proj(x).reshape(b, t, hkv, hd)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, *, std: float, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(d, f, std=std, rngs=rngs, dtype=dtype)
        self.up_proj = Linear(d, f, std=std, rngs=rngs, dtype=dtype)
        self.down_proj = Linear(f, d, std=std, rngs=rngs, dtype=dtype)

    def __call__(self, x: Array) -> Array:  # SwiGLU: [..., Dm] -> [..., Dm]
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


AttendFn = Callable[[Array, Array, Array, Array, Any], tuple[Array, Any]]
"""attend(layer, q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, D], kv) -> ([B, T, Hq, D], kv): the layer index
(an int32 scalar, traced under the scan) and the KV state the trunk carries through its layers (None: dense)."""


class DecoderLayer(nnx.Module):
    def __init__(self, config: LlamaConfig, *, std: float, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, std=std, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, std=std, rngs=rngs, dtype=dtype)

    def __call__(self, x: Array, cos: Array, sin: Array,
                 attend: Callable[[Array, Array, Array, Any], tuple[Array, Any]], kv: Any) -> tuple[Array, Any]:
        b, t, _ = x.shape
        q, k, v = self.self_attn.project(self.input_layernorm(x), cos, sin)
        out, kv = attend(q, k, v, kv)
        x = x + self.self_attn.o_proj(out.reshape(b, t, -1))
        return x + self.mlp(self.post_attention_layernorm(x)), kv


def dense_attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """q [B, T, Hq, D], k/v [B, T, Hkv, D], mask [B, T, T] bool (query, key) -> [B, T, Hq, D]. Grouped-query.

    A query whose mask row is all False gives 0, as in the paged kernels (softmax over no keys would be NaN)."""
    b, t, hq, hd = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k) * jnp.asarray(1.0 / math.sqrt(hd), q.dtype)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.asarray(-jnp.inf, scores.dtype))
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
    probs = jnp.where(jnp.any(mask, axis=-1)[:, None, None, :, None], probs, jnp.zeros((), v.dtype))
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, hq, hd)


# ----------------------------------------------------------------------------------------------- KV cache


KV_DTYPES = ("float32", "bfloat16", "int8", "float8_e4m3fn")
"""Page dtypes a `KVCache` may hold: float pages store K/V as they are (bfloat16 rounded); int8 / float8_e4m3fn
pages are quantised by `pallas_kernels.write_kv` per token and KV head, with float32 scales beside them."""
_QUANTISED = ("int8", "float8_e4m3fn")


def kv_dtype(dtype: Any) -> jnp.dtype:
    """`dtype` (a name or a dtype) as a jnp dtype in `KV_DTYPES`; anything else raises ValueError naming it."""
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in KV_DTYPES:
        raise ValueError(f"dtype must be one of {KV_DTYPES}, got {dtype!r}")
    return resolved


@flax.struct.dataclass
class KVCache:
    """Paged KV cache: every layer's pages in one array per K / V, block-major. Block 0 is the null block (never
    written by a real token).

    Layout: k, v [N, L, S, Hkv, D]: block n's pages for all L layers lie together, so copying, swapping or
    scrubbing a block is indexing axis 0 of every leaf (the invariant `kv_pages`, `kv.tiers` and copy-on-write
    rely on), and the layers run as one `lax.scan` carrying the whole cache. A layer's pool is a strided view:
    `pages.reshape(N * L, S, Hkv, D)` holds block n of layer l at row n * L + l (`layer_pages`, `layer_tables`),
    which is how the kernels read and write it (no copy: the reshape merges leading axes).

    `k_scales` / `v_scales` [N, L, S, Hkv] are present exactly when the pages are int8 or float8_e4m3fn, and then
    K/V of the token at slot (block, offset), layer l, head h dequantise as
    `k[block, l, offset, h].astype(f32) * k_scales[block, l, offset, h]` (what `paged_attention` does).
    """

    k: Array  # [N, L, S, Hkv, D] float32 | bfloat16 | int8 | float8_e4m3fn
    v: Array  # [N, L, S, Hkv, D] same dtype as k
    k_scales: Array | None = None  # [N, L, S, Hkv] float32 for int8 / fp8 pages, else None
    v_scales: Array | None = None  # [N, L, S, Hkv] float32 for int8 / fp8 pages, else None

    @classmethod
    def zeros(cls, config: LlamaConfig, num_blocks: int, block_size: int, dtype: Any = jnp.float32) -> KVCache:
        """An empty cache of `dtype` (one of `KV_DTYPES`, name or dtype; ValueError otherwise).

        Quantised caches start with scales 0: that is what `quantize_kv` gives an all-zero row, so an empty
        quantised cache dequantises to exactly the zeros of an empty float cache (the null block included).
        Attention never relies on it (it masks every position past `context_lens`), but stale reads are then
        zeros, never NaN or garbage.
        """
        dtype = kv_dtype(dtype)
        shape = (num_blocks, config.num_layers, block_size, config.num_kv_heads, config.head_dim)
        k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)  # separate buffers: each leaf can be donated
        if dtype.name not in _QUANTISED:
            return cls(k=k, v=v)
        return cls(k=k, v=v, k_scales=jnp.zeros(shape[:4], jnp.float32), v_scales=jnp.zeros(shape[:4], jnp.float32))

    @property
    def num_layers(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def dtype(self) -> jnp.dtype:
        """The page dtype."""
        return jnp.dtype(self.k.dtype)

    @property
    def quantised(self) -> bool:
        """True for int8 / float8_e4m3fn pages (scales present)."""
        return self.k_scales is not None

    def layer(self, i: int) -> tuple[Array, Array, Array | None, Array | None]:
        """Layer i as (k_pages, v_pages [N, S, Hkv, D], k_scales, v_scales [N, S, Hkv] float32 or None): a copy,
        for inspection and tests (the model reads layers through `layer_pages` instead)."""
        take = lambda x: None if x is None else x[:, i]  # noqa: E731
        return take(self.k), take(self.v), take(self.k_scales), take(self.v_scales)


def layer_pages(x: Array | None) -> Array | None:
    """[N, L, S, ...] -> [N * L, S, ...]: every layer's pool in one page axis (row n * L + l); None stays None."""
    return None if x is None else x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def layer_tables(block_tables: Array, layer: Array | int, num_layers: int) -> Array:
    """Block ids [B, M] -> rows of `layer_pages` for one layer (the null block 0 maps to layer `layer`'s null page)."""
    return block_tables * num_layers + layer


def slot_mapping(
    block_tables: Array, context_lens: Array, query_lens: Array, num_queries: int, block_size: int
) -> Array:
    """Cache slot of every query token, [B * Q] int32; -1 (dropped by `write_kv`) for padding rows.

    Query j of sequence b lives at cache position p = context_lens[b] - query_lens[b] + j, i.e. at slot
    block_tables[b, p // S] * S + p % S. Positions past the block table are dropped too.
    """
    j = jnp.arange(num_queries, dtype=jnp.int32)[None, :]  # [1, Q]
    pos = (context_lens - query_lens)[:, None] + j  # [B, Q]
    col = pos // block_size
    valid = (j < query_lens[:, None]) & (pos >= 0) & (col < block_tables.shape[1])
    block = jnp.take_along_axis(block_tables, jnp.clip(col, 0, block_tables.shape[1] - 1), axis=1)
    slots = block * block_size + pos % block_size
    return jnp.where(valid, slots, -1).reshape(-1).astype(jnp.int32)


# ------------------------------------------------------------------------------------------------- model


def check_token_ids(tokens: Any, vocab_size: int) -> None:
    """Raise ValueError if concrete token ids fall outside [0, vocab_size). Tracers are not checked."""
    try:
        arr = np.asarray(tokens)
    except jax.errors.TracerArrayConversionError:  # inside a caller's jit: values unknown, nothing to check
        return
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = arr[(arr < 0) | (arr >= vocab_size)]
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got {bad[:8].tolist()}")


class Llama(nnx.Module):
    """Llama decoder with an LM head (tied to the embedding when `config.tie_word_embeddings`).

    The L decoder layers are one stacked module (every parameter leads with L, created by `nnx.vmap`) run by a
    `lax.scan`, so the compiled program holds one layer whatever the depth (docs/models.md, "Stacked layers").
    `scan=False` on the forward methods runs the same stacked weights layer by layer in Python (the unrolled
    program, kept to check the scan against). Checkpoints keep HF's per-layer names (`checkpoint` stacks them).
    `dtype` is the parameters' dtype (float32 or bfloat16); activations follow it, logits come out in float32.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, std: float = 0.02, dtype: Any = jnp.float32):
        self.config = config
        d = config.hidden_size
        self.embed_tokens = nnx.Embed(config.vocab_size, d, embedding_init=nnx.initializers.normal(std), rngs=rngs,
                                      param_dtype=dtype)

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(config, std=std, rngs=rngs, dtype=dtype)

        self.layers = stacked(rngs)
        self.norm = RMSNorm(d, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else Linear(d, config.vocab_size, std=std, rngs=rngs,
                                                                      dtype=dtype)

    def lm_head_weight(self) -> Array:
        """[V, Dm]: the output projection (the embedding when tied)."""
        return self.embed_tokens.embedding[...] if self.lm_head is None else self.lm_head.weight[...]

    def logits(self, hidden: Array) -> Array:
        """hidden [..., Dm] (after the final norm) -> logits [..., V] float32."""
        return jnp.einsum("...d,vd->...v", hidden, self.lm_head_weight(), preferred_element_type=jnp.float32)

    def _trunk(self, tokens: Array, positions: Array, attend: AttendFn, kv: Any, scan: bool,
               logits_at: Array | None = None) -> tuple[Array, Array, Any]:
        check_token_ids(tokens, self.config.vocab_size)
        cos, sin = rope_cos_sin(self.config, positions)
        x = self.embed_tokens(tokens)
        graphdef, stacked = nnx.split(self.layers)

        def body(carry, xs):
            x, kv = carry
            i, state = xs
            return nnx.merge(graphdef, state)(x, cos, sin, lambda q, k, v, kv: attend(i, q, k, v, kv), kv), None

        index = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        if scan:
            (x, kv), _ = jax.lax.scan(body, (x, kv), (index, stacked))
        else:
            for i in range(self.config.num_layers):
                (x, kv), _ = body((x, kv), (index[i], jax.tree.map(lambda w, i=i: w[i], stacked)))
        hidden = self.norm(x)
        if logits_at is None:
            return self.logits(hidden), hidden, kv
        at = jnp.clip(logits_at, 0, hidden.shape[1] - 1)
        rows = hidden[: at.shape[0]]  # the rows asked for: a split step's extra rows sample nothing
        return self.logits(jnp.take_along_axis(rows, at[:, :, None], axis=1)), hidden, kv

    def forward_dense(
        self, tokens: Array, positions: Array | None = None, mask: Array | None = None, *, scan: bool = True
    ) -> tuple[Array, Array]:
        """The reference: tokens [B, T] -> (logits [B, T, V] float32, hidden [B, T, Dm] after the final norm).

        positions [B, T] int32 default to 0..T-1; mask [B, T, T] bool (query, key) defaults to causal.
        """
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if mask is None:
            mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), jnp.bool_)), (b, t, t))
        logits, hidden, _ = self._trunk(tokens, positions, lambda _, q, k, v, kv: (dense_attention(q, k, v, mask), kv),
                                        None, scan)
        return logits, hidden

    def forward_paged(
        self,
        tokens: Array,
        positions: Array,
        cache: KVCache,
        block_tables: Array,
        context_lens: Array,
        query_lens: Array | None = None,
        tree_mask: Array | None = None,
        *,
        impl: str = "auto",
        scan: bool = True,
        logits_at: Array | None = None,
    ) -> tuple[Array, Array, KVCache]:
        """Paged prefill (a prompt chunk) or multi-query decode / verification.

        tokens, positions [B, Q] int32 (RoPE positions: per tree node prefix_len + depth with a tree);
        block_tables [B, M]; context_lens [B]: tokens in the cache *including* these Q (query j is stored at
        cache position context_lens - query_lens + j); query_lens [B] or None (all Q real; padding rows are not
        written and give undefined logits); tree_mask [B, Q, Q] bool or None (causal); impl selects the
        kernels' implementation ("auto", "pallas", "xla", "reference"). The cache may hold any of `KV_DTYPES`:
        bfloat16 pages store the rounded K/V; int8 / float8_e4m3fn pages are written through the kernels' quantised
        path (per token and KV head, new scales kept in the returned cache) and dequantised when attended.
        Each layer writes and reads its pool through `layer_pages` / `layer_tables`: the kernels see one page
        axis of N * L rows, and the scan carries the cache, so the writes stay in place.
        logits_at int32[B', R] (query slots, clipped to [0, Q)) or None: the LM head runs only at those slots of the
        first B' <= B rows, and logits are [B', R, V] (a serving step samples at K + 1 slots per row, not at every
        prompt token, and not in the rows that only carry a prompt chunk's head: at a 128k vocabulary the head is
        most of a small model's FLOPs).
        Returns (logits [B, Q, V] or [B, R, V] float32, hidden [B, Q, Dm], new cache of the same dtype and
        structure).
        """
        b, q_len = tokens.shape
        qlens = jnp.full((b,), q_len, jnp.int32) if query_lens is None else query_lens
        n, num_layers, s = cache.k.shape[:3]

        def attend(i: Array, q: Array, k: Array, v: Array, kv: KVCache) -> tuple[Array, KVCache]:
            hkv, hd = k.shape[2], k.shape[3]
            tables = layer_tables(block_tables, i, num_layers)
            slots = slot_mapping(tables, context_lens, qlens, q_len, s)
            pools = [layer_pages(x) for x in (kv.k, kv.v, kv.k_scales, kv.v_scales)]
            # Quantised pages: write_kv quantises the new rows per token and KV head and returns the new scales.
            written = tuple(write_kv(
                pools[0], pools[1], k.reshape(b * q_len, hkv, hd), v.reshape(b * q_len, hkv, hd), slots,
                k_scales=pools[2], v_scales=pools[3], impl=impl,
            ))
            k_pages, v_pages, k_scales, v_scales = written if kv.quantised else written + (None, None)
            out = paged_attention(
                q, k_pages, v_pages, tables, context_lens, query_lens=query_lens, tree_mask=tree_mask,
                k_scales=k_scales, v_scales=v_scales, impl=impl,
            )
            unflat = lambda x: None if x is None else x.reshape((n, num_layers) + x.shape[1:])  # noqa: E731
            return out, KVCache(unflat(k_pages), unflat(v_pages), unflat(k_scales), unflat(v_scales))

        logits, hidden, cache = self._trunk(tokens, positions, attend, cache, scan, logits_at)
        return logits, hidden, cache
