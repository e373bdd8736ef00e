"""Acceptance models: how many drafts the target accepts, for simulations of models we cannot run here.

A chain acceptance model is a vector alphas[K] of conditional per-position acceptance probabilities: draft i is
accepted with probability alphas[i] given drafts < i were (`simulate.chain_acceptance` draws accepted runs from
it). With constant alpha the unconditional acceptance of draft i is alpha^(i+1), which falls with depth as Medusa
heads' accuracy does.

Presets, each with the published number it comes from and what is our assumption:

  medusa-1   alpha = 0.60 at every depth. Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with
             Multiple Decoding Heads", arXiv:2401.10774 (2024), sec. 2.1.2: the top-1 accuracy of the first
             Medusa head (Vicuna-7B, predicting the next-next token) is about 60%. Constant conditional
             acceptance at deeper heads is OUR assumption. Check: K = 4 gives 2.31 tokens per verification step,
             next to the paper's "over 2.2x" speedup for Medusa-1 (its abstract).
  medusa-2   alpha = 0.72 at every depth: the smallest alpha (two decimals) for which a K = 4 chain yields at
             least 2.83 tokens per step (it gives 2.88), 2.83x being the wall-clock speedup the same paper measures
             for Medusa-2 on Vicuna-7B (its fig. 1: ~45 -> ~128 tokens/s on an A100). Tokens per step must
             exceed a speedup (a verification step costs more than a plain one), so this is a lower bound; the
             paper gets it with a 64-node tree, we model a chain. OUR derivation from a published speedup, not a
             published acceptance.
  tiny       the shipped tiny model's own heads, measured here (`fit_chain` on `simulate.replay_acceptance` runs
             of greedy decoding on `skvs bench`'s default trace, K = 4, at the positions greedy verification
             visits). Conditional acceptance rises with depth: once a draft is right the text is predictable.

`tokens_per_step(alphas)` is the expected number of tokens one verification of a full chain produces (accepted
drafts plus the target's own token): sum over i of prod_{j<=i} alphas[j], plus 1.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

from skvs_jax import checks

PRESETS: dict[str, tuple[float, ...]] = {
    "medusa-1": (0.60,) * 8,
    "medusa-2": (0.72,) * 8,
    # Measured 2026-11-30 with `python -m skvs_jax.sim.acceptance_model`: greedy decoding of `skvs bench`'s default
    # trace (32 system_prompts requests) replayed through the heads, 320 verifications, mean accepted run 1.97
    # (the engine itself measures 1.93 on that trace). Beyond K = 4 the model has no heads; the last value repeats.
    "tiny": (0.684, 0.762, 0.877, 0.913) + (0.913,) * 4,
}


def alphas(spec: str | Sequence[float], k: int) -> np.ndarray:
    """float32[k] conditional acceptance probabilities from a preset name or explicit values (at least k of
    them, each in [0, 1])."""
    if not checks.is_int(k) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"unknown acceptance model {spec!r}; presets: {sorted(PRESETS)}")
        values = PRESETS[spec]
    else:
        values = tuple(spec)
    if len(values) < k:
        raise ValueError(f"the acceptance model gives {len(values)} probabilities, the draft length is {k}")
    if any(not isinstance(a, numbers.Real) or isinstance(a, bool) or math.isnan(a) or not 0 <= a <= 1
           for a in values):
        raise ValueError(f"acceptance probabilities must be numbers in [0, 1], got {values!r}")
    return np.asarray(values[: int(k)], np.float32)


def parse_profile(text: str, k: int) -> tuple[float, ...]:
    """A profile as a command line writes it, a preset name ("medusa-1") or probabilities ("0.8,0.6,0.5,0.4"),
    as K floats (`alphas`); ValueError naming what is wrong."""
    try:
        values = [float(x) for x in str(text).split(",")]
    except ValueError:
        values = None  # a preset's name
    return tuple(float(a) for a in alphas(text if values is None else values, k))


def tokens_per_step(alphas: Sequence[float]) -> float:
    """Expected tokens from one verification of the full chain: 1 + sum_i prod_{j<=i} alphas[j]."""
    return 1.0 + float(np.sum(np.cumprod(np.asarray(alphas, np.float64))))


def fit_chain(runs: np.ndarray, offered: np.ndarray | int) -> np.ndarray:
    """Maximum-likelihood conditional acceptance per position from observed accepted runs.

    runs int[N] accepted drafts per verification; offered int[N] (or an int) drafts offered. alphas[i] =
    #(run > i) / #(run >= i and offered > i): of the verifications that reached draft i, the share that accepted
    it. NaN where no verification reached position i."""
    runs = np.asarray(runs)
    offered = np.broadcast_to(np.asarray(offered), runs.shape)
    k = int(offered.max(initial=0))
    out = np.full(k, np.nan)
    for i in range(k):
        reached = (runs >= i) & (offered > i)
        if reached.any():
            out[i] = float(np.mean(runs[reached] > i))
    return out


def _measure_tiny(k: int = 4) -> np.ndarray:
    """The `tiny` preset: greedy outputs of the shipped model on the bench trace, replayed through its heads."""
    from reference_models.checkpoint import load_shipped
    from skvs_jax import policies, workloads
    from skvs_jax.config import CacheConfig
    from skvs_jax.serve import engine
    from skvs_jax.serve.model_runner import LlamaMedusaRunner
    from skvs_jax.sim import simulate

    model, heads = load_shipped()
    trace = workloads.tiny_model_trace()  # `skvs bench`'s default trace
    e = engine.Engine(model, heads, policies.vllm_default(), CacheConfig(num_blocks=257, block_size=8, max_seqs=8,
                                                                        max_blocks_per_seq=32))
    ids = {e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens)): r for r in trace.requests}
    outputs = e.run()
    sequences = {i: list(ids[i].prompt) + list(outputs[i]) for i in ids}
    runner, params = LlamaMedusaRunner.create(model, heads)
    runs = simulate.replay_acceptance(runner, params, sequences, k)
    obs_runs, obs_offered = [], []
    for i, r in ids.items():
        t0, t1 = len(r.prompt), len(sequences[i])
        n = t0 + 1  # the first verification: the prompt and the first output token are known
        while n < t1:  # the positions greedy decoding with K drafts verifies at (a rejection sets the next one)
            obs_runs.append(int(runs[i][n]))
            obs_offered.append(min(k, t1 - n))
            n += int(runs[i][n]) + 1
    fitted = fit_chain(np.asarray(obs_runs), np.asarray(obs_offered))
    print(f"{len(obs_runs)} verifications, mean accepted run {np.mean(obs_runs):.3f}")
    return fitted


if __name__ == "__main__":
    fitted = _measure_tiny()
    print("tiny chain acceptance, K = 4:", np.round(fitted, 3).tolist(), "tokens per step",
          round(tokens_per_step(fitted), 3))
