"""What the cost model prices: a model (`ModelSpec`) and a device (`DeviceSpec`), and their presets.

`MODELS` are Llama-architecture decoders with Medusa-1 heads (Llama-3.2-1B / 3B, Llama-3.1-8B, Llama-3-70B and the
shipped tiny model, built from the shapes the engine serves too: `skvs_jax.model_shapes`), `DEVICES` GPUs from their
datasheets (A100, H100, H200) and this CPU fitted to the real engine (`cpu-measured`). Every number names its source
beside it; efficiencies and latencies are assumptions, each stated at its constant. `cost_model.CostModel` turns a
pair into step times.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from skvs_jax import model_shapes

DTYPE_BYTES = (1, 2, 4)  # fp8/int8, bf16/fp16, fp32


def check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_float(name: str, value: object, low: float, high: float = math.inf, *, open_low: bool = False) -> None:
    """low <= value <= high (low < value with open_low); +inf is allowed when high is inf."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < low or (open_low and value == low) or value > high:
        bound = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise ValueError(f"{name} must lie in {bound}, got {value!r}")


# ------------------------------------------------------------------------------------------------------ model


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A Llama-architecture decoder (GQA attention, SwiGLU MLP, RMSNorm) with optional Medusa-1 heads.

    Attributes:
      name: label for tables.
      num_layers: L.  hidden_size: Dm.  num_heads: Hq.  num_kv_heads: Hkv (divides Hq).  head_dim: D.
      intermediate_size: F, the MLP width.  vocab_size: V.
      num_medusa_heads: Medusa heads (0: none).  medusa_layers: residual blocks `x + SiLU(W x + b)` per head,
        each head ending in its own [V, Dm] vocab projection (FasterDecoding/Medusa; `reference_models/medusa.py`).
      tie_word_embeddings: the LM head is the embedding matrix (counted once in the parameters).
      weight_dtype_bytes: bytes per weight (and per activation element): 2 for bf16, 4 for fp32.
      kv_dtype_bytes: bytes per cached K or V element.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_medusa_heads: int = 0
    medusa_layers: int = 1
    tie_word_embeddings: bool = False
    weight_dtype_bytes: int = 2
    kv_dtype_bytes: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                      "vocab_size"):
            check_int(field, getattr(self, field), 1)
        check_int("num_medusa_heads", self.num_medusa_heads, 0)
        check_int("medusa_layers", self.medusa_layers, 0)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        for field in ("weight_dtype_bytes", "kv_dtype_bytes"):
            if getattr(self, field) not in DTYPE_BYTES or isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} must be one of {DTYPE_BYTES}, got {getattr(self, field)!r}")

    @classmethod
    def from_hf_config(cls, name: str, config: dict[str, Any], medusa: dict[str, Any] | None = None, *,
                       weight_dtype_bytes: int = 2, kv_dtype_bytes: int = 2) -> ModelSpec:
        """From an HF Llama `config.json` dict and, optionally, a Medusa `config.json` dict."""
        heads = config["num_attention_heads"]
        return cls(
            name=name,
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            num_medusa_heads=medusa["medusa_num_heads"] if medusa else 0,
            medusa_layers=medusa["medusa_num_layers"] if medusa else 1,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            weight_dtype_bytes=weight_dtype_bytes,
            kv_dtype_bytes=kv_dtype_bytes,
        )

    # Parameters ------------------------------------------------------------------------------------------
    @property
    def _layer_matmul_params(self) -> int:
        """q, k, v, o projections + gate, up, down: the weights a token is multiplied by in one layer."""
        dm, d = self.hidden_size, self.head_dim
        return dm * d * (2 * self.num_heads + 2 * self.num_kv_heads) + 3 * dm * self.intermediate_size

    @property
    def param_count(self) -> int:
        """Base model parameters: embedding (+ LM head unless tied), L layers (with two norms each), final norm."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * (self._layer_matmul_params + 2 * self.hidden_size) + self.hidden_size

    @property
    def matmul_params(self) -> int:
        """Weights multiplied per token: all decoder projections and the LM head (the embedding is a gather)."""
        return self.num_layers * self._layer_matmul_params + self.vocab_size * self.hidden_size

    @property
    def medusa_param_count(self) -> int:
        """All Medusa heads: per head, `medusa_layers` blocks of [Dm, Dm] + bias, and a [V, Dm] projection."""
        dm = self.hidden_size
        return self.num_medusa_heads * (self.medusa_layers * (dm * dm + dm) + self.vocab_size * dm)

    @property
    def weight_bytes(self) -> int:
        return self.param_count * self.weight_dtype_bytes

    @property
    def medusa_weight_bytes(self) -> int:
        return self.medusa_param_count * self.weight_dtype_bytes

    # Per-token costs -------------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer: 2 * L * Hkv * D * kv_dtype_bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one query token against one key token, all layers: 4 * L * Hq * D (QK^T and PV)."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def flops_per_token(self, context_len: int = 0) -> int:
        """Forward FLOPs of one token attending to `context_len` tokens: 2 * matmul_params + attention."""
        return 2 * self.matmul_params + self.attention_flops_per_pair * context_len

    @property
    def medusa_flops_per_row(self) -> int:
        """FLOPs of all Medusa heads on one hidden state (bias adds ignored); a real cost at 128k vocab."""
        dm = self.hidden_size
        return 2 * self.num_medusa_heads * (self.medusa_layers * dm * dm + self.vocab_size * dm)


# The article's drafter is Medusa with K = 4 heads (the article's section 2, scenario 1); one residual block per head is
# the FasterDecoding/Medusa default (medusa_num_layers=1) and what the shipped tiny heads use.
MEDUSA_HEADS = 4
MEDUSA_LAYERS = 1

def _spec(name: str, bytes_per_element: int) -> ModelSpec:
    """The simulator's view of shape `name` from the registry the engine uses too (`skvs_jax.model_shapes`), with
    the article's Medusa heads."""
    return ModelSpec.from_hf_config(name, model_shapes.hf_config(name),
                                    {"medusa_num_heads": MEDUSA_HEADS, "medusa_num_layers": MEDUSA_LAYERS},
                                    weight_dtype_bytes=bytes_per_element, kv_dtype_bytes=bytes_per_element)


MODELS: dict[str, ModelSpec] = {
    # Published configs (see model_shapes for the sources), bf16 weights and KV, 4 Medusa heads of 1 block:
    # llama-3.1-8b 8,030,261,248 parameters; llama-3-70b 70,553,706,496; llama-3.2-1b / -3b (tied) 1.24B / 3.21B.
    **{name: _spec(name, 2) for name in ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-3-70b")},
    # The shipped model (reference_models/weights: tiny_llama and tiny_llama_medusa, 4 heads of 1 block). The engine
    # keeps weights and KV in float32.
    "tiny": _spec("tiny", 4),
}


# -------------------------------------------------------------------------------------------- host link, disk


@dataclasses.dataclass(frozen=True)
class HostLink:
    """The link a device's swapped KV crosses to host memory: effective bytes/s per direction, per device (each
    GPU has its own link in the systems below)."""

    name: str
    bytes_per_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        check_float("bytes_per_s", self.bytes_per_s, 0.0, open_low=True)


# Effective = the specification's raw per-direction rate x HOST_LINK_EFFICIENCY. The efficiency is an assumption
# (not measured here): pinned-memory cudaMemcpy of MB-sized buffers typically reaches ~80% of a PCIe link's raw
# rate (the rest is TLP/DLLP packet overhead and flow control); GPU runs should refine it.
HOST_LINK_EFFICIENCY = 0.8
HOST_LINKS: dict[str, HostLink] = {
    # PCI Express Base Specification 4.0: 16 GT/s per lane, 128b/130b encoding -> 15.75 GB/s x 16 lanes = 31.5 GB/s
    # per direction (NVIDIA A100 datasheet: "PCIe Gen4: 64 GB/s", both directions). x 0.8 = 25.2 GB/s.
    "pcie-gen4-x16": HostLink("pcie-gen4-x16", 31.5e9 * HOST_LINK_EFFICIENCY),
    # PCI Express Base Specification 5.0: 32 GT/s per lane -> 63 GB/s per direction at x16 (NVIDIA H100 datasheet:
    # "PCIe Gen5: 128 GB/s", both directions). x 0.8 = 50.4 GB/s.
    "pcie-gen5-x16": HostLink("pcie-gen5-x16", 63e9 * HOST_LINK_EFFICIENCY),
    # NVIDIA GH200 Grace Hopper Superchip datasheet: NVLink-C2C 900 GB/s between Grace and Hopper, both directions
    # (450 GB/s each way). x 0.8 = 360 GB/s (the same assumed efficiency; not measured).
    "nvlink-c2c": HostLink("nvlink-c2c", 450e9 * HOST_LINK_EFFICIENCY),
    # Swaps cost nothing: what the simulator charged before swaps were priced; the fitted CPU device's default (its
    # fit has no swap steps, and its "host link" is a memcpy inside one memory).
    "unpriced": HostLink("unpriced", math.inf),
}
# The disk tier: one NVMe PCIe Gen4 x4 SSD per host. Samsung 990 PRO datasheet: sequential read 7,450 MB/s,
# sequential write 6,900 MB/s; the lower, since a spill writes what a swap-in reads back. Shared by the host's
# devices (the whole model's KV goes through it, not one device's share).
DISK_BYTES_PER_S = 6.9e9


# ----------------------------------------------------------------------------------------------------- device


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (and its link to its tensor-parallel peers).

    Attributes:
      name: label for tables.
      peak_flops_per_s: dense (not 2:4-sparse) peak of the matmul dtype, FLOP/s.
      hbm_bytes_per_s: peak memory bandwidth, bytes/s.
      hbm_capacity_bytes: memory per device, bytes (for `CostModel.max_kv_tokens`).
      compute_efficiency: achieved / peak FLOP/s on the step's matmuls, in (0, 1].
      bandwidth_efficiency: achieved / peak bytes/s on the step's weight and KV reads, in (0, 1].
      link_bytes_per_s: per-direction bandwidth of the link a ring all-reduce uses (NVLink), bytes/s.
      allreduce_latency_s: fixed time of one small all-reduce call, seconds.
      tp_degree: default tensor-parallel degree (a `CostModel` may override it).
      host_overhead_s: fixed time per step spent outside the forward pass (scheduling, launch, sync), seconds.
      compute_memory_overlap: in [0, 1]; 1 = the roofline max(compute, memory) (GPU: loads overlap math), 0 = their
        sum (what `fit_cpu_device` fits: the CPU engine's time is additive in its terms).
      fitted: the constants are fitted to measured step times (`fit_cpu_device`), not datasheet peaks times
        assumed efficiencies: a `CostModel` on it is in the "measured" mode (see `COST_MODES`).
      host_link: the link its swaps cross to host memory, a name in `HOST_LINKS` (a `CostModel` may override it).
      logit_elements_per_s: the vocabulary-sized work of a step outside its matmuls (processing, sampling and
        verifying the target's logits, the drafts' logits), in logit elements per second; inf: not priced (the
        datasheet devices: at 8B it is a small share of a GPU step); `fit_cpu_device` fits it on this CPU, where
        at a 128k vocabulary it is a large one.
    """

    name: str
    peak_flops_per_s: float
    hbm_bytes_per_s: float
    hbm_capacity_bytes: float
    compute_efficiency: float
    bandwidth_efficiency: float
    link_bytes_per_s: float
    allreduce_latency_s: float
    tp_degree: int = 1
    host_overhead_s: float = 0.0
    compute_memory_overlap: float = 1.0
    fitted: bool = False
    host_link: str = "pcie-gen4-x16"
    logit_elements_per_s: float = math.inf

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        for field in ("peak_flops_per_s", "hbm_bytes_per_s", "hbm_capacity_bytes", "link_bytes_per_s"):
            check_float(field, getattr(self, field), 0.0, open_low=True)
        for field in ("compute_efficiency", "bandwidth_efficiency"):
            check_float(field, getattr(self, field), 0.0, 1.0, open_low=True)
        check_float("allreduce_latency_s", self.allreduce_latency_s, 0.0, 1.0)
        check_float("host_overhead_s", self.host_overhead_s, 0.0, 1e3)
        check_float("compute_memory_overlap", self.compute_memory_overlap, 0.0, 1.0)
        check_float("logit_elements_per_s", self.logit_elements_per_s, 0.0, open_low=True)
        check_int("tp_degree", self.tp_degree, 1)
        if not isinstance(self.fitted, bool):
            raise ValueError(f"fitted must be a bool, got {self.fitted!r}")
        if self.host_link not in HOST_LINKS:
            raise ValueError(f"host_link must be one of {sorted(HOST_LINKS)}, got {self.host_link!r}")


# Efficiency assumptions shared by the GPU presets (none of them measured here; GPU runs should refine them).
# BANDWIDTH_EFFICIENCY: the check, a Llama-3.1-8B batch-1 decode on A100 takes ~10 ms against a 7.9 ms
# roofline (16.06 GB / 2.039 TB/s), i.e. ~78% of peak bandwidth end to end. The same figure is used for H100/H200
# for want of a measurement. It is an end-to-end figure (kernel gaps included), hence host_overhead_s = 0 below.
BANDWIDTH_EFFICIENCY = 0.78
# COMPUTE_EFFICIENCY: large bf16 GEMMs at a forward pass's shapes (T x 4096 x 14336, T >= 256) reach roughly
# 70-80% of dense peak in cuBLAS on A100/H100; whole-model training utilisation is lower (Megatron-LM: 52% of A100
# peak, Narayanan et al., SC'21) because it includes attention, norms and communication, which this model charges
# separately or ignores. We take 0.7. Prefill time and the compute knee scale with it.
COMPUTE_EFFICIENCY = 0.7
# ALLREDUCE_LATENCY_S: sgl-project/sglang PR #2904 measured vLLM's custom all-reduce on H100 at tp = 2 at
# 8.7-9.5 us for 512 B - 32 KB messages (NCCL is no faster for small messages). Assumed equal on A100.
ALLREDUCE_LATENCY_S = 9e-6
# HOST_OVERHEAD_S: 0 for the GPU presets because BANDWIDTH_EFFICIENCY is fitted end to end (a CUDA-graph engine's
# per-step host time is inside the 10 ms). Set it to model an engine whose CPU-side scheduling is not hidden.
HOST_OVERHEAD_S = 0.0
# Memory capacities: `memory.total` as nvidia-smi reports it (A100-SXM4-80GB 81920 MiB, H100 80GB HBM3 81559 MiB,
# H200 143771 MiB); the datasheets' "80GB" and "141GB" are these, rounded.
MIB = 2**20

DEVICES: dict[str, DeviceSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 312 TFLOPS BF16 dense (624 with sparsity), 2,039 GB/s HBM2e,
    # 80GB, NVLink 600 GB/s (total of both directions: 300 GB/s each way, what a ring all-reduce can use).
    "a100-80gb": DeviceSpec("a100-80gb", peak_flops_per_s=312e12, hbm_bytes_per_s=2.039e12,
                            hbm_capacity_bytes=81920 * MIB, compute_efficiency=COMPUTE_EFFICIENCY,
                            bandwidth_efficiency=BANDWIDTH_EFFICIENCY, link_bytes_per_s=300e9,
                            allreduce_latency_s=ALLREDUCE_LATENCY_S, host_overhead_s=HOST_OVERHEAD_S),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): 989 TFLOPS BF16 dense (1,979 with sparsity), 3.35 TB/s HBM3,
    # 80GB, NVLink 900 GB/s (450 GB/s each way).
    "h100-sxm": DeviceSpec("h100-sxm", peak_flops_per_s=989e12, hbm_bytes_per_s=3.35e12,
                           hbm_capacity_bytes=81559 * MIB, compute_efficiency=COMPUTE_EFFICIENCY,
                           bandwidth_efficiency=BANDWIDTH_EFFICIENCY, link_bytes_per_s=450e9,
                           allreduce_latency_s=ALLREDUCE_LATENCY_S, host_overhead_s=HOST_OVERHEAD_S,
                           host_link="pcie-gen5-x16"),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOPS BF16 dense, 4.8 TB/s HBM3e, 141GB,
    # NVLink 900 GB/s (450 GB/s each way).
    "h200": DeviceSpec("h200", peak_flops_per_s=989e12, hbm_bytes_per_s=4.8e12,
                       hbm_capacity_bytes=143771 * MIB, compute_efficiency=COMPUTE_EFFICIENCY,
                       bandwidth_efficiency=BANDWIDTH_EFFICIENCY, link_bytes_per_s=450e9,
                       allreduce_latency_s=ALLREDUCE_LATENCY_S, host_overhead_s=HOST_OVERHEAD_S,
                       host_link="pcie-gen5-x16"),
    # This machine's CPU running the real engine on the shipped tiny model (2 cores, jax 0.10.2, XLA defaults),
    # fitted 2026-11-30 by `python -m skvs_jax.sim.calibrate --repeats 3` on a quiet machine: 309 steps of
    # vllm_default, naive_spec and skvs, three runs each (each engine warmed up first): 2.2 ms per step (the host
    # loop, dispatch and the scheduler) + 20.9 GFLOP/s + 0.89 GB/s. Only meaningful with MODELS["tiny"]; re-run
    # the command on another machine to re-calibrate.
    "cpu-measured": DeviceSpec("cpu-measured", peak_flops_per_s=2.095e10, hbm_bytes_per_s=8.949e8,
                               hbm_capacity_bytes=math.inf, compute_efficiency=1.0, bandwidth_efficiency=1.0,
                               link_bytes_per_s=math.inf, allreduce_latency_s=0.0, host_overhead_s=2.206e-3,
                               compute_memory_overlap=0.0, fitted=True, host_link="unpriced"),
}
