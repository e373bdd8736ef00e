"""Cost model of one engine step: how long a step of a given shape takes on a given device.

The trace simulator runs the real scheduler in a `while_loop` and asks this module, once per step, how many
seconds the model forward of that step would take for a large model on a GPU. It is pure `jnp` arithmetic on
the step's token counts, so it traces, jits and vmaps with the simulator.

Two ways to price a step (`CostModel.mode`, see `COST_MODES`): **measured** operator times, interpolated in
Vidur's kernel profiles of Llama-3-8B on an A100 (the default for `llama-3.1-8b` on `a100-80gb`; other models and
devices scaled from it by the roofline's ratio, labelled extrapolated; the `cpu-measured` device's fit), and the
**roofline** below (the default elsewhere). The measured mode is described at `CostModel._measured_terms`. The
models and devices it prices are in `specs`, the measured tables in `kernel_profiles`.

Inputs of a step (int32 or float32 scalars, or arrays of one common shape [...]):
  prefill_tokens  P, prompt tokens computed this step (chunked prefill included)
  decode_tokens   D, decode and verification query tokens (a sequence verifying K drafts contributes K + 1)
  kv_tokens_read  C, cached tokens whose K/V the attention reads, summed over sequences (each sequence's context
                  is read once per step, whatever its number of query tokens)
  num_seqs        B, sequences in the step (used only to share the query tokens among sequences)
  medusa_rows     R, hidden states the Medusa heads draft from (typically one per speculating sequence)

Roofline formula, with T = P + D, t the tensor-parallel degree, and everything per device:
  flops   = T * 2 * W_mm / t                                    (weight matmuls, LM head included)
          + (T / B) * C * 4 L Hq D / t + T (T / B + 1) / 2 * 4 L Hq D / t       (attention scores and values)
          + R * 2 * W_medusa_mm / t                              (Medusa heads: residual blocks + vocab projection)
  bytes   = W_bytes / t + [R > 0] * W_medusa_bytes / t           (all weights read once per step)
          + (C + T) * kv_bytes_per_token / min(t, Hkv)            (KV read, and KV written for the T new tokens)
  compute = flops / (peak_flops * compute_efficiency);  memory = bytes / (hbm_bandwidth * bandwidth_efficiency)
  step    = compute + memory - overlap * min(compute, memory)   (overlap = 1: the roofline max(compute, memory))
          + [t > 1] * 2 L * (allreduce_latency + 2 (t - 1) / t * T * Dm * act_bytes / link_bandwidth)
          + host_overhead
and a step with T = R = 0 takes 0 seconds (the simulator advances its clock to the next arrival itself).
Swaps (`CostModel.swap_time`, added to the step by the simulator): X blocks of S tokens moved over the host link
take X * S * kv_bytes_per_token / min(t, Hkv) / link bytes/s (presets `specs.HOST_LINKS`: PCIe Gen4 / Gen5 x16,
NVLink-C2C), plus, for blocks that reach the disk tier, X * S * kv_bytes_per_token / disk bytes/s.

Assumptions (each one a simplification a reader should know about):
- The attention term uses mean-field sharing of query tokens: sum_i q_i * ctx_i ~ (T / B) * C, exact for decode
  (q_i = 1) and for equal query counts; the new tokens attend causally to each other, T (T / B + 1) / 2 pairs for
  equal chunks. One (query, key) pair costs 4 Hq D FLOPs per layer (QK^T and PV, 2 FLOPs per multiply-add).
- All weights count as read once per step, the embedding table included, though a step really gathers only T
  of its rows. This is the convention of the issue's 7.9 ms roofline (16.06 GB / 2.039 TB/s) and of the bandwidth
  efficiency fitted to it; for Llama-3.1-8B it charges 1.05 GB (6.5%) that a gather does not read.
- The LM head runs on the step's logit rows only, as the engine computes them: every decode / verification
  token and one row per prefilling sequence (mean-field: one, when the step has prefill tokens; the measured
  mode counts the same rows). A device with a finite `logit_elements_per_s` (the fitted CPU) also pays for the
  vocabulary-sized work around them, (logit rows + R * Medusa heads) * V elements, added to the step.
- Padding: by default a step computes only its tokens, as a ragged engine (vLLM's flattened batch) does. This
  engine computes a padded [rows, Q] query (`scheduler.buckets.query_slots`) and logits at every row's sampling
  slots; pass `query_slots` and `logit_rows` to price that instead (the simulator's `EngineLayout`). The weight
  matmuls then run on the padded slots (never fewer than the tokens) and the LM head on exactly the logit rows
  given (a padding engine's count is at least its sampling rows; without one, the sampling rows are bounded by
  the decode tokens plus one for a prefill, which counts a row's whole last prompt chunk); attention and the KV
  traffic stay the real tokens' (an empty slot attends to nothing and writes nothing).
- Activations, logits, norms, rotary embeddings and sampling move bytes and FLOPs we ignore: at small T they
  are tiny next to the weights, at large T the step is compute-bound and the matmuls dominate.
- Tensor parallelism (Megatron-style) splits weights, FLOPs and Medusa heads t ways and KV heads min(t, Hkv)
  ways (beyond Hkv the KV heads are replicated); each decoder layer all-reduces its [T, Dm] activations twice
  (after attention and after the MLP), as a ring: 2 (t - 1) / t of the bytes cross the link, plus a fixed
  latency per call. Communication is not overlapped with compute. The embedding's and LM head's collectives
  (two of 2 L + 2 calls) are ignored.
- Efficiencies are constant: they do not vary with T or the context length.
- Medusa weights are read once per step when any row drafts; Medusa FLOPs scale with the drafting rows.

Sources: model shapes from the `config.json` of the Hugging Face repositories named at each preset; device
numbers from NVIDIA datasheets; efficiencies and latencies are assumptions, each stated at its constant; the
measured tables from microsoft/vidur (MIT licence, commit 7d47513, data/profiling), as `profiles/*.json` state. The
`cpu-measured` device is fitted by `fit_cpu_device` to the real engine's logged step times on this machine
(`python -m skvs_jax.sim.calibrate` re-fits it and checks the simulator against the engine).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from skvs_jax.sim.kernel_profiles import (
    DECODE_BATCHING_OVERHEAD,
    PROFILES,
    REFERENCE_PROFILE,
    TOKEN_ROUNDING,
    VIDUR_KV_GRANULARITY,
    load_profile,
    nnls,
)
from skvs_jax.sim.specs import (
    DEVICES,
    DISK_BYTES_PER_S,
    HOST_LINKS,
    MODELS,
    DeviceSpec,
    HostLink,  # noqa: F401  (re-exported with the presets)
    ModelSpec,
    check_float,
    check_int,
)

# How a `CostModel` prices a step (its `mode`):
#   "roofline": the formula of the module docstring, from datasheet peaks and assumed efficiencies.
#   "measured": measured operator times. For a model and device with a `KernelProfile` (Llama-3.1-8B on an A100),
#     Vidur's kernel profiles, interpolated; for other models and devices the same profile scaled per operator by
#     the roofline's ratio between them ("extrapolated", see `CostModel.extrapolated`). On a device fitted by
#     `fit_cpu_device` (`cpu-measured`), that fit.
#   "measured-vidur": the measured mode with Vidur's own accounting, to compare with Vidur's results: no
#     embedding, LM head, Medusa heads or sampling (Vidur's `ExecutionTime.model_time` leaves them out), and a
#     prefill's attention priced with its own chunk already in the KV cache, contexts rounded up to 64 tokens
#     (Vidur's `kv_cache_prediction_granularity`). Not a model of a GPU: a model of Vidur.
#   "auto" (the default): "measured" where a measurement exists (a profiled preset pair, exactly; a fitted
#     device), else "roofline".
COST_MODES = ("auto", "roofline", "measured", "measured-vidur")
def _base_shape(m: ModelSpec) -> tuple:
    """What the base model's costs depend on (Medusa heads are priced separately)."""
    return (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.intermediate_size,
            m.vocab_size, m.weight_dtype_bytes, m.kv_dtype_bytes)


# ------------------------------------------------------------------------------------------------- cost model


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Step time of `model` on `device` with tensor parallelism `tp` (None: `device.tp_degree`), priced in `mode`
    (one of `COST_MODES`: "auto" measures where a measurement exists, see `resolved_mode`).

    Static (hashable): close over it, or pass it to jitted functions as a static argument.
    """

    model: ModelSpec
    device: DeviceSpec
    tp: int | None = None
    mode: str = "auto"
    host_link: str | None = None  # a name in HOST_LINKS; None: the device's (`DeviceSpec.host_link`)
    disk_bytes_per_s: float = DISK_BYTES_PER_S  # the disk tier's bandwidth (specs.DISK_BYTES_PER_S: an NVMe SSD)

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelSpec):
            raise ValueError(f"model must be a ModelSpec, got {type(self.model).__name__}")
        if not isinstance(self.device, DeviceSpec):
            raise ValueError(f"device must be a DeviceSpec, got {type(self.device).__name__}")
        if self.tp is None:
            object.__setattr__(self, "tp", self.device.tp_degree)
        if isinstance(self.tp, np.integer):  # a static field: a plain int hashes and prints like the presets
            object.__setattr__(self, "tp", int(self.tp))
        check_int("tp", self.tp, 1)
        m, t = self.model, self.tp
        if m.num_heads % t or m.intermediate_size % t:
            raise ValueError(f"tp ({t}) must divide num_heads ({m.num_heads}) and intermediate_size "
                             f"({m.intermediate_size})")
        if m.num_kv_heads % t and t % m.num_kv_heads:
            raise ValueError(f"tp ({t}) must divide num_kv_heads ({m.num_kv_heads}) or be a multiple of it")
        if self.mode not in COST_MODES:
            raise ValueError(f"mode must be one of {COST_MODES}, got {self.mode!r}")
        if self.host_link is None:
            object.__setattr__(self, "host_link", self.device.host_link)
        if self.host_link not in HOST_LINKS:
            raise ValueError(f"host_link must be one of {sorted(HOST_LINKS)}, got {self.host_link!r}")
        check_float("disk_bytes_per_s", self.disk_bytes_per_s, 0.0, open_low=True)
        if self.device.fitted and self.mode in ("roofline", "measured-vidur"):
            raise ValueError(f"mode {self.mode!r} needs datasheet peaks or a kernel profile; device "
                             f"{self.device.name!r} is fitted to measured steps (use mode 'auto' or 'measured')")
        if self.mode in ("measured", "measured-vidur") and not self.device.fitted:
            tps = sorted(load_profile(REFERENCE_PROFILE.file)["linear"])
            if t not in tps:
                raise ValueError(f"mode {self.mode!r}: the kernel profile has tp in {tps}, got tp={t}")

    # Which cost model (Python values: static) ------------------------------------------------------------
    @property
    def resolved_mode(self) -> str:
        """"roofline", "measured" or "measured-vidur": what `mode` means for this model and device. "auto" is
        "measured" on a fitted device and on a `PROFILES` pair exactly as preset (same base shapes, same device
        spec) at a profiled tp; "roofline" elsewhere."""
        if self.mode != "auto":
            return self.mode
        if self.device.fitted:
            return "measured"
        profile = PROFILES.get((self.model.name, self.device.name))
        if (profile is not None and self.device == DEVICES[profile.device]
                and _base_shape(self.model) == _base_shape(MODELS[profile.model])
                and self.tp in load_profile(profile.file)["linear"]):
            return "measured"
        return "roofline"

    @property
    def extrapolated(self) -> bool:
        """Measured costs scaled from another model or device by the roofline's ratio (not measured here)."""
        if self.resolved_mode == "roofline" or self.device.fitted:
            return False
        return not (self.device == DEVICES[REFERENCE_PROFILE.device]
                    and _base_shape(self.model) == _base_shape(MODELS[REFERENCE_PROFILE.model]))

    @property
    def label(self) -> str:
        """The mode and the source of its numbers, for tables."""
        mode = self.resolved_mode
        if mode == "roofline":
            return "roofline (datasheet peaks x assumed efficiencies)"
        if self.device.fitted:
            return f"measured (fitted to engine steps: {self.device.name})"
        ref = f"Vidur's profiles of {REFERENCE_PROFILE.model} on {REFERENCE_PROFILE.device}"
        how = ", Vidur's accounting" if mode == "measured-vidur" else ""
        return f"{mode} (extrapolated by the roofline from {ref}{how})" if self.extrapolated else f"{mode} ({ref})"

    # Rates (Python floats: static) -----------------------------------------------------------------------
    @property
    def _flops_per_s(self) -> float:
        return self.device.peak_flops_per_s * self.device.compute_efficiency

    @property
    def _bytes_per_s(self) -> float:
        return self.device.hbm_bytes_per_s * self.device.bandwidth_efficiency

    @property
    def kv_bytes_per_token_per_device(self) -> float:
        return self.model.kv_bytes_per_token / min(self.tp, self.model.num_kv_heads)

    def breakdown(self, prefill_tokens: jax.Array, decode_tokens: jax.Array, kv_tokens_read: jax.Array,
                  num_seqs: jax.Array, medusa_rows: jax.Array | int = 0, query_slots: jax.Array | int = 0,
                  logit_rows: jax.Array | int = 0) -> dict[str, jax.Array]:
        """The terms of `step_time`, each float32 of the inputs' broadcast shape [...]. query_slots and logit_rows:
        what a padding engine computes (module docstring, "Padding"); 0 prices the tokens alone (query slots below
        the step's tokens count as the tokens).

        Keys, roofline mode and a fitted device: flops and bytes (per device), compute_s, memory_s, roofline_s
        (compute and memory combined), allreduce_s, host_overhead_s, step_s (the total; 0 where the step has no
        tokens). Measured modes (a kernel profile): linear_s (the layers' non-attention operators), attention_s
        (decode and prefill kernels, KV writes), head_s (embedding, LM head, Medusa heads; 0 in measured-vidur),
        allreduce_s, host_overhead_s, step_s.
        """
        inputs = jnp.broadcast_arrays(*(jnp.asarray(x, dtype=jnp.float32) for x in (
            prefill_tokens, decode_tokens, kv_tokens_read, num_seqs, medusa_rows, query_slots, logit_rows)))
        terms = (self._roofline_terms(*inputs) if self.resolved_mode == "roofline" or self.device.fitted
                 else self._measured_terms(*inputs))
        p, d, _, _, r, _, _ = inputs
        active = (p + d + r) > 0.0
        terms["allreduce_s"] = self._allreduce_s(p + d, active)
        terms["host_overhead_s"] = jnp.where(active, self.device.host_overhead_s, 0.0)
        compute = terms["roofline_s"] if "roofline_s" in terms else terms["linear_s"] + terms["attention_s"] + \
            terms["head_s"]
        terms["step_s"] = jnp.where(active, compute + terms["allreduce_s"] + terms["host_overhead_s"], 0.0)
        return terms

    def _allreduce_s(self, tokens: jax.Array, active: jax.Array) -> jax.Array:
        """2 L ring all-reduces of [T, Dm] activations per step (tp > 1), as in the module docstring; the
        measured modes use the same term (the profile's all-reduce rows are not shipped)."""
        m, t = self.model, self.tp
        if t == 1:
            return jnp.zeros_like(tokens)
        ring_s_per_token = 2.0 * (t - 1) / t * m.hidden_size * m.weight_dtype_bytes / self.device.link_bytes_per_s
        per_call_s = self.device.allreduce_latency_s + tokens * ring_s_per_token
        return jnp.where(active, 2 * m.num_layers * per_call_s, 0.0)

    def _roofline_terms(self, p, d, c, b, r, q, lr) -> dict[str, jax.Array]:
        m, t = self.model, self.tp
        tokens = p + d  # T
        queries_per_seq = tokens / jnp.maximum(b, 1.0)  # T / B
        attention_pairs = queries_per_seq * c + tokens * (queries_per_seq + 1.0) / 2.0
        drafting = r > 0.0
        head_params = m.vocab_size * m.hidden_size
        matmul_rows = jnp.maximum(tokens, q)  # padded query slots, where the engine computes them
        # The engine's logit rows when given (its padding: at least its sampling rows), else the sampling rows as
        # the shape bounds them (module docstring, "Padding").
        logit_rows = jnp.where(lr > 0.0, lr, d + jnp.where(p > 0.0, 1.0, 0.0))
        flops = (matmul_rows * (2.0 * (m.matmul_params - head_params) / t) + logit_rows * (2.0 * head_params / t)
                 + attention_pairs * (m.attention_flops_per_pair / t)
                 + r * (m.medusa_flops_per_row / t))
        logit_elements = (logit_rows + r * m.num_medusa_heads) * float(m.vocab_size)
        nbytes = (m.weight_bytes / t
                  + jnp.where(drafting, m.medusa_weight_bytes / t, 0.0)
                  + (c + tokens) * self.kv_bytes_per_token_per_device)
        compute_s = flops / self._flops_per_s
        memory_s = nbytes / self._bytes_per_s
        roofline_s = compute_s + memory_s - self.device.compute_memory_overlap * jnp.minimum(compute_s, memory_s)
        roofline_s = roofline_s + logit_elements / self.device.logit_elements_per_s  # 0 for an unpriced inf
        return {"flops": flops, "bytes": nbytes, "logit_elements": logit_elements, "compute_s": compute_s,
                "memory_s": memory_s, "roofline_s": roofline_s}

    def _measured_terms(self, p, d, c, b, r, q, lr) -> dict[str, jax.Array]:
        """Vidur's composition of a step (`ExecutionTime`): per layer, the non-attention operators at the step's
        token count, the KV write, decode attention over the decoding rows, prefill attention over the chunk; all
        layers; plus, outside Vidur, the embedding, the LM head and the Medusa heads.

        What the step shape does not say is filled in mean-field, as the roofline does: a step with prefill
        tokens has one prefilling row (its chunk P), the other rows decode (at most D of them); the decoding rows
        share the context read C equally and the prefill reads none (a fresh prompt), unless no row decodes.
        The LM head runs on the D decode tokens and the prefill's last token; its time, and
        the Medusa heads', is the measured up-projection GEMM (the same inner dimension Dm, at the same rows)
        scaled by the weights' ratio (V Dm vs 2 F Dm; both limits of a GEMM, weight-bound and compute-bound,
        scale with it). Sampling is not charged. Where the model or device differs from the profile's, every
        operator is scaled by the roofline's ratio between them (`extrapolated`): the linear operators by
        `_per_param_s`, attention and KV writes by the KV bytes per device over bandwidth, prefill attention by
        its FLOPs per device over compute.
        """
        m, t, dev = self.model, self.tp, self.device
        ref_m, ref_d = MODELS[REFERENCE_PROFILE.model], DEVICES[REFERENCE_PROFILE.device]
        tab = load_profile(REFERENCE_PROFILE.file)
        vidur = self.resolved_mode == "measured-vidur"
        grid = tab["tokens"]
        ceil8 = lambda x: jnp.ceil(x / TOKEN_ROUNDING) * TOKEN_ROUNDING  # noqa: E731

        def gemm_ms(table: np.ndarray, rows: jax.Array, params_ratio: float) -> jax.Array:
            """A measured GEMM-bound table at `rows`, scaled to this model and device."""
            rows = ceil8(rows)
            ms = jnp.interp(rows, grid, table) * params_ratio
            if self.extrapolated:
                ms = ms * self._per_param_s(rows, m, dev) / self._per_param_s(rows, ref_m, ref_d)
            return ms

        tokens = p + d
        linear_ms = gemm_ms(tab["linear"][t], jnp.maximum(tokens, q),
                            m._layer_matmul_params / ref_m._layer_matmul_params)
        # Attention kernels, measured at tp = 1: KV heads split min(t, Hkv) ways, query heads t ways.
        kv_ratio = ((m.num_kv_heads * m.head_dim * m.kv_dtype_bytes / min(t, m.num_kv_heads))
                    / (ref_m.num_kv_heads * ref_m.head_dim * ref_m.kv_dtype_bytes)
                    * (ref_d.hbm_bytes_per_s * ref_d.bandwidth_efficiency)
                    / (dev.hbm_bytes_per_s * dev.bandwidth_efficiency))
        flop_ratio = ((m.num_heads * m.head_dim / t) / (ref_m.num_heads * ref_m.head_dim)
                      * (ref_d.peak_flops_per_s * ref_d.compute_efficiency)
                      / (dev.peak_flops_per_s * dev.compute_efficiency))
        save_ms = jnp.where(tokens > 0, jnp.interp(tokens, tab["kv_save_tokens"], tab["kv_save"]), 0.0) * kv_ratio
        prefilling = (p > 0).astype(jnp.float32)
        decoding = jnp.clip(b - prefilling, jnp.minimum(d, 1.0), d)  # rows decoding (1 token each, or verifying)
        # The context read belongs to the decoding rows when there are any (a fresh prefill reads none), else to
        # the prefilling rows.
        ctx = c / jnp.maximum(jnp.where(decoding > 0, decoding, b), 1.0)
        a0, a1, a2, floor = tab["decode"]
        dec_ctx = jnp.ceil(ctx / VIDUR_KV_GRANULARITY) * VIDUR_KV_GRANULARITY if vidur else ctx
        decode_ms = jnp.maximum(a0 + a1 * decoding + a2 * decoding * dec_ctx, floor)
        ragged = jnp.where(decoding > 1, 1.0 + DECODE_BATCHING_OVERHEAD, 1.0)
        decode_ms = jnp.where(decoding > 0, decode_ms * ragged, 0.0)
        # Vidur prices a chunk's attention with the chunk already counted as cached context (+0.15 ms a layer at
        # 1024 fresh tokens); a real prefill reads only the context before it.
        pre_ctx = jnp.where(decoding > 0, 0.0, ctx)
        pre_ctx = jnp.ceil((pre_ctx + p) / VIDUR_KV_GRANULARITY) * VIDUR_KV_GRANULARITY if vidur else pre_ctx
        b0, b1, b2, b3, floor = tab["prefill"]
        prefill_ms = jnp.where(p > 0, jnp.maximum(b0 + b1 * p * pre_ctx + b2 * p * p + b3 * p, floor), 0.0)
        attention_ms = save_ms + decode_ms * kv_ratio + prefill_ms * flop_ratio
        if vidur:
            head_ms = jnp.zeros_like(tokens)
        else:
            dm_ref, f_ref = ref_m.hidden_size, ref_m.intermediate_size
            up = tab["up_proj"][t]
            bandwidth_ratio = ((ref_d.hbm_bytes_per_s * ref_d.bandwidth_efficiency)
                               / (dev.hbm_bytes_per_s * dev.bandwidth_efficiency))
            emb_ms = jnp.where(tokens > 0, jnp.interp(tokens, grid, tab["emb"][t]), 0.0) * (
                m.hidden_size * m.weight_dtype_bytes / (dm_ref * ref_m.weight_dtype_bytes) * bandwidth_ratio)
            logit_rows = jnp.where(lr > 0.0, lr, d + prefilling)
            lm_ms = jnp.where(logit_rows > 0, gemm_ms(up, logit_rows, m.vocab_size * m.hidden_size
                                                      / (2 * f_ref * dm_ref)), 0.0)
            medusa_params = m.num_medusa_heads * (m.medusa_layers * m.hidden_size ** 2 + m.vocab_size * m.hidden_size)
            medusa_ms = jnp.where(r > 0, gemm_ms(up, r, medusa_params / (2 * f_ref * dm_ref)), 0.0)
            head_ms = emb_ms + lm_ms + medusa_ms
        layers = m.num_layers
        return {"linear_s": linear_ms * (layers * 1e-3), "attention_s": attention_ms * (layers * 1e-3),
                "head_s": head_ms * 1e-3}

    @staticmethod
    def _per_param_s(rows: jax.Array, m: ModelSpec, dev: DeviceSpec) -> jax.Array:
        """Roofline seconds per weight of a GEMM over `rows` tokens: max(2 rows / FLOP/s, weight bytes / bytes/s)
        (tp cancels in a ratio). The rule by which measured GEMM times move to another model or device."""
        return jnp.maximum(2.0 * rows / (dev.peak_flops_per_s * dev.compute_efficiency),
                           m.weight_dtype_bytes / (dev.hbm_bytes_per_s * dev.bandwidth_efficiency))

    def step_time(self, prefill_tokens: jax.Array, decode_tokens: jax.Array, kv_tokens_read: jax.Array,
                  num_seqs: jax.Array, medusa_rows: jax.Array | int = 0, query_slots: jax.Array | int = 0,
                  logit_rows: jax.Array | int = 0) -> jax.Array:
        """Seconds for one step: float32 [...] from int32/float32 inputs of one broadcastable shape [...].
        query_slots, logit_rows: a padding engine's (`breakdown`), 0 for the tokens alone.

        Pure `jnp` arithmetic without data-dependent Python branches: works under jit, vmap and loops.
        Non-decreasing in prefill_tokens, decode_tokens, kv_tokens_read and medusa_rows; non-increasing in
        num_seqs (the same query tokens spread over more sequences attend to less context each).
        """
        return self.breakdown(prefill_tokens, decode_tokens, kv_tokens_read, num_seqs, medusa_rows, query_slots,
                              logit_rows)["step_s"]

    def swap_time(self, blocks_out: jax.Array, blocks_in: jax.Array, block_size: int,
                  disk_blocks: jax.Array | int = 0) -> jax.Array:
        """Seconds a step spends moving swapped KV, float32 of the inputs' broadcast shape [...].

        blocks_out, blocks_in: KV blocks of block_size tokens swapped out to / in from the host tier this step;
        each device moves its share (`kv_bytes_per_token_per_device`) over its own host link (`host_link`),
        out and in one after the other and not overlapped with the forward (vLLM swaps before it runs the model).
        disk_blocks: of those, blocks that also go to or come from the disk tier (a spill host -> disk, or a
        swap-in from disk): the whole model's KV of each such block, through the host's one disk at
        `disk_bytes_per_s`. Zero blocks cost zero; linear in the bytes.
        """
        link = HOST_LINKS[self.host_link].bytes_per_s
        per_device = block_size * self.kv_bytes_per_token_per_device
        blocks_out, blocks_in, disk_blocks = (jnp.asarray(x, jnp.float32) for x in (blocks_out, blocks_in,
                                                                                   disk_blocks))
        return ((blocks_out + blocks_in) * (per_device / link)
                + disk_blocks * (block_size * self.model.kv_bytes_per_token / self.disk_bytes_per_s))

    def knee_tokens(self) -> float:
        """Tokens per step at which matmul compute time equals weight-read time (efficiencies included).

        Below it a step is memory-bound (time ~ flat in T), above it compute-bound (time ~ linear in T). Equal
        to (peak_flops * compute_eff) / (hbm_bw * bandwidth_eff) * weight_bytes / (2 * matmul_params); the
        tensor-parallel degree cancels.
        """
        weight_read_s = self.model.weight_bytes / self._bytes_per_s
        compute_per_token_s = 2.0 * self.model.matmul_params / self._flops_per_s
        if compute_per_token_s == 0:  # infinite compute (a fitted device can have it): never compute-bound
            return math.inf
        return weight_read_s / compute_per_token_s

    def max_kv_tokens(self, memory_utilization: float = 0.9) -> int:
        """KV tokens that fit beside the weights (Medusa's included) in `memory_utilization` of each device's
        memory (vLLM's default `gpu_memory_utilization` is 0.9); 0 when the weights alone do not fit.
        Activation memory is ignored."""
        check_float("memory_utilization", memory_utilization, 0.0, 1.0, open_low=True)
        weights = (self.model.weight_bytes + self.model.medusa_weight_bytes) / self.tp
        free = self.device.hbm_capacity_bytes * memory_utilization - weights
        if free <= 0:
            return 0
        if math.isinf(free):
            raise ValueError(f"device {self.device.name!r} has unbounded memory; no KV capacity to derive")
        return int(free // self.kv_bytes_per_token_per_device)


# ------------------------------------------------------------------------------------------ CPU calibration


class StepSample(NamedTuple):
    """One logged engine step. A plain 4-tuple (prefill, decode, kv_read, seconds) is read as one sequence."""

    prefill_tokens: int
    decode_tokens: int
    kv_tokens_read: int
    seconds: float
    num_seqs: int = 1
    medusa_rows: int = 0
    query_slots: int = 0  # what a padding engine computed (`CostModel.breakdown`); 0: the tokens alone
    logit_rows: int = 0


def fit_cpu_device(samples: Iterable[Sequence[float]], model: ModelSpec = MODELS["tiny"], *,
                   name: str = "cpu-measured", memory_bytes: float = math.inf) -> DeviceSpec:
    """Fit a device to measured engine steps of `model`: the `cpu-measured` device.

    Model fitted, per step (additive: on the CPU engine compute and memory traffic do not overlap):
        seconds ~ host_overhead + flops / flops_per_s + bytes / bytes_per_s + logit_elements / logit_elements_per_s
    where flops, bytes and logit elements are exactly what `CostModel` computes for the step (matmuls, attention
    pairs and Medusa rows; weights, KV read and KV written; the vocabulary-sized work of its logit rows). It is
    affine in the step's tokens, KV bytes and logit rows: a per-step overhead, a per-token cost, a per-KV-byte cost
    and a per-logit-element cost. The four constants are fitted by least squares under the constraint that each
    is >= 0 (a zero rate maps to an infinite speed). The returned device has both efficiencies
    1, `compute_memory_overlap` 0 and tp 1, so `CostModel(model, fit_cpu_device(samples, model))` reproduces the
    fit. Steps with no tokens are skipped (the cost model gives them 0).

    Args:
      samples: `StepSample`s, or tuples (prefill_tokens, decode_tokens, kv_tokens_read, seconds[, num_seqs
        [, medusa_rows[, query_slots, logit_rows]]]), e.g. the engine's per-step log. Needs steps of varied size
        and context to separate the per-token from the per-KV-byte cost. With query_slots and logit_rows (what
        the engine computed, padding included) the per-token cost is fitted to the slots computed.
      model: the model the engine ran (the shipped tiny model by default).
      name: the device's name.  memory_bytes: its memory, for `max_kv_tokens` (unbounded by default).
    """
    rows = [StepSample(*s) for s in samples]
    for s in rows:
        counts = (s.prefill_tokens, s.decode_tokens, s.kv_tokens_read, s.num_seqs, s.medusa_rows, s.query_slots,
                  s.logit_rows)
        if not all(math.isfinite(c) and c >= 0 for c in counts):
            raise ValueError(f"samples' token and sequence counts must be finite and >= 0, got {s}")
    rows = [s for s in rows if s.prefill_tokens + s.decode_tokens + s.medusa_rows > 0]
    if len(rows) < 3:
        raise ValueError(f"samples must hold at least 3 steps with tokens, got {len(rows)}")
    unit = DeviceSpec("unit", peak_flops_per_s=1.0, hbm_bytes_per_s=1.0, hbm_capacity_bytes=math.inf,
                      compute_efficiency=1.0, bandwidth_efficiency=1.0, link_bytes_per_s=math.inf,
                      allreduce_latency_s=0.0, compute_memory_overlap=0.0)
    columns = [np.asarray([getattr(s, f) for s in rows]) for f in StepSample._fields]
    terms = CostModel(model, unit, tp=1).breakdown(*(columns[i] for i in (0, 1, 2, 4, 5, 6, 7)))
    a = np.stack([np.ones(len(rows)), np.asarray(terms["flops"], np.float64), np.asarray(terms["bytes"], np.float64),
                  np.asarray(terms["logit_elements"], np.float64)], axis=1)
    y = np.asarray(columns[3], np.float64)
    if not np.all(np.isfinite(y)) or np.any(y < 0):
        raise ValueError("samples' seconds must be finite and >= 0")
    scale = np.linalg.norm(a, axis=0)  # equilibrate columns (1, ~1e9 FLOPs, ~1e6 bytes) before solving
    overhead, s_per_flop, s_per_byte, s_per_logit = nnls(a / np.where(scale > 0, scale, 1.0), y) / np.where(
        scale > 0, scale, 1.0)
    return DeviceSpec(name, peak_flops_per_s=1.0 / s_per_flop if s_per_flop > 0 else math.inf,
                      logit_elements_per_s=1.0 / s_per_logit if s_per_logit > 0 else math.inf,
                      hbm_bytes_per_s=1.0 / s_per_byte if s_per_byte > 0 else math.inf,
                      hbm_capacity_bytes=memory_bytes, compute_efficiency=1.0, bandwidth_efficiency=1.0,
                      link_bytes_per_s=math.inf, allreduce_latency_s=0.0, tp_degree=1,
                      host_overhead_s=float(overhead), compute_memory_overlap=0.0, fitted=True, host_link="unpriced")


# ------------------------------------------------------------------------------- the scheduler's step cost

STEP_COST_ROWS = 64  # the batch at which the per-row and per-context terms are read off (finite differences)
STEP_COST_CTX = 512  # context tokens per row there


@functools.lru_cache(maxsize=64)
def _step_cost_tables(cost: CostModel, t_max: int) -> tuple[np.ndarray, int, int, int]:
    with jax.ensure_compile_time_eval():
        t = np.arange(t_max + 1, dtype=np.float32)
        one_row = np.asarray(cost.step_time(np.zeros_like(t), t, np.zeros_like(t), np.ones_like(t), 0.0),
                             np.float64)
        r, c = float(STEP_COST_ROWS), float(STEP_COST_ROWS * STEP_COST_CTX)
        at = lambda kv, rows, heads=0.0: float(cost.step_time(0.0, r, kv, rows, heads))  # noqa: E731
        row_s = max(at(0.0, r) - at(0.0, 1.0), 0.0) / (r - 1)
        ctx_s = max(at(c, r) - at(0.0, r), 0.0) / c
        head_s = max(at(0.0, r, r) - at(0.0, r), 0.0)
    token_us = np.clip(np.round(one_row * 1e6), 1, 2**31 - 1).astype(np.int32)
    return (token_us, int(min(round(row_s * 1e6), 2**20)), int(min(round(ctx_s * 1e9), 2**12)),
            int(min(round(head_s * 1e6), 2**24)))


@functools.lru_cache(maxsize=64)
def _roofline_tables(cost: CostModel, t_max: int) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """The roofline's terms of a one-row step computing t tokens, no context: (token_us: what does not overlap,
    host overhead and all-reduces; compute_us: the compute time; mem_us: the weights' read; ctx_ns: a context
    token's KV read; overlap in 1/1024)."""
    with jax.ensure_compile_time_eval():
        t = np.arange(t_max + 1, dtype=np.float32)
        z = np.zeros_like(t)
        terms = cost.breakdown(z, t, z, np.ones_like(t), 0.0)
        extra = np.asarray(terms["allreduce_s"], np.float64) + np.asarray(terms["host_overhead_s"], np.float64)
        compute = np.asarray(terms["compute_s"], np.float64)
    mem_s = cost.model.weight_bytes / cost.tp / cost._bytes_per_s
    ctx_s = cost.kv_bytes_per_token_per_device / cost._bytes_per_s
    token_us = np.clip(np.round(extra * 1e6), 1, 2**31 - 1).astype(np.int32)
    compute_us = np.clip(np.round(compute * 1e6), 0, 2**21).astype(np.int32)
    return (token_us, compute_us, int(min(round(mem_s * 1e6), 2**24)), int(min(round(ctx_s * 1e9), 2**12)),
            int(round(1024 * cost.device.compute_memory_overlap)))


def step_cost(cost: CostModel, t_max: int):
    """The `scheduler.StepCost` of `cost` for steps of up to t_max tokens: token_us[t] the time of a one-row
    step computing t tokens (its drafts' GEMMs, KV writes and logits), row_us and ctx_ns the time per further
    running row and per context token read, and head_us the draft heads' time when some row drafts, from
    finite differences at 64 rows of 512 tokens. In the roofline mode (a device whose compute and memory
    overlap) the step keeps the roofline's shape instead: compute_us[t] (the compute), mem_us + ctx_ns per
    context token (the weights' and KV's reads) overlapped as the clock does, token_us only the all-reduces and
    host overhead; a sum of terms would charge a memory-bound step's drafts the compute that hides under its KV
    read. What the goodput
    draft controller prices a candidate step with; the simulator passes it so its controller and its clock agree
    (the measured mode's tile steps and knee included in token_us)."""
    from skvs_jax.scheduler import StepCost  # the scheduler's pytree; sim sits above the scheduler

    token_us, row_us, ctx_ns, head_us = _step_cost_tables(cost, int(t_max))
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    if cost.resolved_mode != "roofline" or cost.device.fitted or cost.device.compute_memory_overlap == 0:
        return StepCost(token_us=jnp.asarray(token_us), row_us=i32(row_us), ctx_ns=i32(ctx_ns), head_us=i32(head_us))
    extra_us, compute_us, mem_us, ctx_ns, overlap = _roofline_tables(cost, int(t_max))
    return StepCost(token_us=jnp.asarray(extra_us), row_us=i32(row_us), ctx_ns=i32(ctx_ns), head_us=i32(head_us),
                    compute_us=jnp.asarray(compute_us), mem_us=i32(mem_us), overlap=i32(overlap))
