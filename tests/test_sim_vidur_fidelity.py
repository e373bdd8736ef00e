"""Fidelity against Vidur (microsoft/vidur 0.0.26, MLSys'24): the same trace, the same scheduler configuration,
the same measured A100 kernels; within 5% of Vidur's own results.

Vidur's results (its chunked-prefill `sarathi` scheduler, 2048 tokens per batch, 128 sequences, its random-forest
predictor on the profiles `skvs_jax/sim/profiles/llama-3-8b_a100.json` are derived from; Llama-3-8B on one A100,
prefix caching off) on the 256 ShareGPT requests `workloads.make("sharegpt", 256, seed=0, rate=R, scale=1,
max_prompt_len=1024, max_output_len=1024)` draws.

The adjustment: Vidur's step time leaves out the embedding, the LM head (~0.65 ms a step) and sampling, and
prices a fresh prefill's attention as if its chunk were already cached (~+5 ms a step at 1024 tokens). The cost
model's "measured-vidur" mode is the measured mode with exactly that accounting (see `cost_model.COST_MODES`);
the default "measured" mode charges the embedding and LM head and prices prefills as computed, so it sits 3-8%
above Vidur (docs/simulator.md, "Fidelity against Vidur").
"""

import numpy as np
import pytest

from skvs_jax import policies, workloads
from skvs_jax import scheduler as sc
from skvs_jax.config import CacheConfig
from skvs_jax.sim import cost_model as cm
from skvs_jax.sim import simulate, sweep

# rate (req/s): throughput (tok/s), TPOT P50 (s), end-to-end P50 (s), from Vidur's run.
VIDUR = {4.0: (1216.0, 12.07e-3, 3.17), 16.0: (2984.0, 19.37e-3, 5.16), 64.0: (3482.0, 23.64e-3, 8.95)}
TOLERANCE = 0.05


def matched_config(cost: cm.CostModel) -> sc.SchedulerConfig:
    """128 slots, a budget of 2048 tokens per step, chunks of 2048, no prefix cache, no speculation."""
    block = 16
    per_seq = -(-(1024 + 1024 + 1) // block)
    cache = CacheConfig(num_blocks=min(cost.max_kv_tokens() // block, 128 * per_seq) + 1, block_size=block,
                        max_seqs=128, max_blocks_per_seq=per_seq)
    policy = policies.vllm_default().replace(prefix_cache=False)
    return sc.SchedulerConfig(cache=cache, policy=policy, max_running=128, token_budget=2048, prefill_chunk=2048)


def simulate_rates(mode: str, rates: list[float]) -> list[dict[str, float]]:
    cost = cm.CostModel(cm.MODELS["llama-3.1-8b"], cm.DEVICES["a100-80gb"], mode=mode)
    cfg = matched_config(cost)
    traces = sweep.stack([simulate.make_trace(workloads.make("sharegpt", 256, seed=0, rate=r, scale=1,
                                                             max_prompt_len=1024, max_output_len=1024), cfg,
                                              vocab_size=cost.model.vocab_size) for r in rates])
    lanes, _ = sweep.grid(cfg.policy.knobs(), cfg=cfg, traces=list(range(len(rates))))
    states, logs = sweep.run(traces, lanes, cfg=cfg, cost=cost, max_steps=100_000, chunk=2048, strategy="map")
    assert np.all(sweep.finished(states) == 256)
    return sweep.summaries(logs, traces, lanes, cfg)


@pytest.mark.slow  # the default run's time budget; a fidelity figure (docs/simulator.md), not a unit check
def test_measured_mode_reproduces_vidur_within_5_percent():
    rates = sorted(VIDUR)
    for rate, got in zip(rates, simulate_rates("measured-vidur", rates), strict=True):
        want = dict(zip(("throughput", "tpot_p50", "e2e_p50"), VIDUR[rate], strict=True))
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=TOLERANCE), (rate, key, got[key], value)


@pytest.mark.slow  # the default run's time budget; the contrast to the fidelity figure above
def test_the_roofline_does_not():
    """The gap the issue found, from the cost model alone: the roofline's TPOT is 1.46x below Vidur's at 16 req/s."""
    (got,) = simulate_rates("roofline", [16.0])
    assert VIDUR[16.0][1] / got["tpot_p50"] > 1.3
