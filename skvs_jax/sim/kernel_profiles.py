"""Measured kernel profiles: per-layer operator times of a model on a device, as the measured cost mode uses them.

A profile is a JSON file in `skvs_jax/sim/profiles/` derived from Vidur's measured profiles (microsoft/vidur, MIT
licence, commit 7d47513, data/profiling; `derive_vidur.py` beside it made it, and its "source" and "derivation"
keys say where every number comes from). `load_profile` turns it into the tables `CostModel` interpolates; the
attention kernels, of which only a sample was measured, become small non-negative least-squares fits.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import pathlib
from typing import Any

import numpy as np

PROFILE_DIR = pathlib.Path(__file__).resolve().parent / "profiles"
# Vidur's predictor prices a step's GEMMs at its token count rounded up to 8 (its profile's grid up to 1024
# tokens), which is also where GEMM tiling steps: 129 tokens cost what 136 do.
TOKEN_ROUNDING = 8
# Vidur's `attention_decode_batching_overhead_fraction` (0.1, its default): a batch of decodes of unequal
# contexts runs 10% slower than the profiled batch of equal ones. Charged when more than one row decodes.
DECODE_BATCHING_OVERHEAD = 0.1
VIDUR_KV_GRANULARITY = 64


@dataclasses.dataclass(frozen=True)
class KernelProfile:
    """Measured per-layer operator times of one model on one device: a JSON file in `skvs_jax/sim/profiles/`
    (its "source" and "derivation" keys say where every number comes from).

    Attributes:
      file: the file's name.  model, device: the `MODELS` / `DEVICES` keys it was measured on.
    """

    file: str
    model: str
    device: str


# Vidur (microsoft/vidur, MIT licence, commit 7d47513, data/profiling/compute/a100/meta-llama/Meta-Llama-3-8B):
# Meta-Llama-3-8B has Llama-3.1-8B's shapes (32 layers, 4096 wide, 32 / 8 heads, 14336, 128256 vocab).
PROFILES: dict[tuple[str, str], KernelProfile] = {
    ("llama-3.1-8b", "a100-80gb"): KernelProfile("llama-3-8b_a100.json", "llama-3.1-8b", "a100-80gb"),
}
REFERENCE_PROFILE = PROFILES[("llama-3.1-8b", "a100-80gb")]  # what extrapolated costs are scaled from


@functools.cache
def load_profile(file: str) -> dict[str, Any]:
    """The tables of a profile file, as `CostModel` uses them (numpy float32, milliseconds per layer).

    Keys: tokens [n] (the linear operators' grid); per tensor-parallel degree t, linear[t] / up_proj[t] / emb[t]
    [n] (the layer's non-attention operators, the MLP up-projection alone, the embedding gather), each made
    non-decreasing in tokens (a running maximum: a dip of a few microseconds between neighbouring counts is
    noise, and a larger step never costs less); kv_save_tokens, kv_save [m]; decode = (a, b, c, floor): decode
    attention a + b B + c B ctx ms for B rows of mean context ctx, at least floor (the batch-1 time), fitted by
    non-negative least squares in relative error to the measured rows; prefill = (a, b, c, d, floor):
    a + b chunk ctx + c chunk^2 + d chunk ms, fitted the same way.
    """
    doc = json.loads((PROFILE_DIR / file).read_text())
    out: dict[str, Any] = {"linear": {}, "up_proj": {}, "emb": {}}
    grid = None
    for tp, table in doc["linear_per_tp"].items():
        tokens = np.asarray(table["num_tokens"], np.float32)
        if grid is None:
            grid = tokens
        elif not np.array_equal(grid, tokens):
            raise ValueError(f"{file}: every tensor-parallel degree must share one token grid")
        for key, col in (("linear", "layer_ms"), ("up_proj", "up_proj_ms"), ("emb", "emb_ms")):
            out[key][int(tp)] = np.maximum.accumulate(np.asarray(table[col], np.float32))
    out["tokens"] = grid
    save = np.asarray(doc["kv_save_tokens_ms"], np.float64)
    out["kv_save_tokens"] = save[:, 0].astype(np.float32)
    out["kv_save"] = np.maximum.accumulate(save[:, 1]).astype(np.float32)
    kv, batch, ms = np.asarray(doc["decode_kv_batch_ms"], np.float64).T
    coef = weighted_nnls(np.stack([np.ones_like(batch), batch, batch * kv], axis=1), ms)
    out["decode"] = (*map(float, coef), float(np.median(ms[batch == 1])))
    chunk, ctx, ms = np.asarray(doc["prefill_chunk_kv_ms"], np.float64).T
    coef = weighted_nnls(np.stack([np.ones_like(chunk), chunk * ctx, chunk * chunk, chunk], axis=1), ms)
    out["prefill"] = (*map(float, coef), float(ms.min()))
    return out


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns, exactly: the best least-squares fit over every support set
    whose solution is non-negative (the optimum's support is one of them)."""
    best, best_residual = np.zeros(a.shape[1]), float(np.sum(y * y))
    for k in range(1, a.shape[1] + 1):
        for support in itertools.combinations(range(a.shape[1]), k):
            cols = list(support)
            coef = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
            if np.all(coef >= 0):
                residual = float(np.sum((a[:, cols] @ coef - y) ** 2))
                if residual < best_residual:
                    best, best_residual = np.zeros(a.shape[1]), residual
                    best[cols] = coef
    return best



def weighted_nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares in relative error (rows weighted 1 / y): short and long kernels count alike."""
    w = 1.0 / y
    scale = np.linalg.norm(a * w[:, None], axis=0)
    return nnls(a * w[:, None] / scale, y * w) / scale
