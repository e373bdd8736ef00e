"""The simulator against the real engine (`sim.fidelity`): with the oracle drafter's acceptance replayed from its
hash and the engine's own step cost as the controller's, the simulated schedule is the engine's, step for step
(equal steps, preemptions, hit rate and every scheduler counter), so what is left to compare is the cost model."""

import math

import pytest

from skvs_jax import workloads
from skvs_jax.sim import fidelity


# the default run's time budget (`pytest -m slow`); test_engine's replay keeps the schedule and the layout
@pytest.mark.slow
def test_the_simulated_schedule_is_the_engines_on_a_named_shape():
    s = fidelity.build("tiny", "0.9,0.6,0.3,0.1", max_output=8, kv_blocks=33)
    fit, check = (workloads.tiny_model_trace("system_prompts", 5, seed=seed, max_output_len=8) for seed in (1, 2))
    result = fidelity.fidelity(s, ["vllm_default", "skvs"], fit, check, verbose=False)
    assert result["device"].fitted and result["samples"] > 3
    for name, row in result["rows"].items():
        assert row["differs"] == {}, (name, row["differs"])
        assert row["outputs_as_reference"] == 5
        # query_slots: the simulator lays every step out as the engine did (`simulate.EngineLayout`)
        for key in ("steps", "preemptions", "kv_hit_rate", "query_slots"):
            assert row["real"][key] == row["refit"][key], (name, key)
        assert row["tokens"]["query_slots"] < row["refit"]["query_slots"]  # the padding the tokens leave out
        assert math.isfinite(row["refit"]["throughput"]) and row["refit"]["throughput"] > 0
    assert result["rows"]["vllm_default"]["real"]["preemptions"] > 0  # the budget is tight enough to preempt
    report = fidelity.format_report(result, s, check)
    assert "counters differ" in report and "skvs" in report
