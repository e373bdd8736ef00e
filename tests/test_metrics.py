"""Metrics: hand-built logs whose answers are worked out by hand below, empty inputs, bad logs, the table."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from skvs_jax import metrics
from skvs_jax.metrics import RequestRecord, StepLog, StepRecord

NAN = math.nan


def _requests() -> list[RequestRecord]:
    """Three finished requests and one aborted before admission; the answers are in the tests."""
    return [
        # TTFT 0.1, TPOT (1.1 - 0.1) / 10 = 0.1, e2e 1.1; preempted once, re-admitted by hitting its own blocks.
        RequestRecord(request_id=0, arrival_time=0.0, first_token_time=0.1, finish_time=1.1, num_prompt_tokens=100,
                      num_output_tokens=11, num_cached_prompt_tokens=64, num_preemptions=1),
        # TTFT 0.2, TPOT 2.0 / 4 = 0.5, e2e 2.2; preempted after 3 tokens and recomputed: admissions look up
        # 50 + (50 + 3) = 103 tokens, of which 48 were cached on the second admission (none on the first).
        RequestRecord(request_id=1, arrival_time=0.5, first_token_time=0.7, finish_time=2.7, num_prompt_tokens=50,
                      num_output_tokens=5, num_cached_prompt_tokens=48, num_admitted_prompt_tokens=103,
                      num_preemptions=1, num_drafted=8, num_accepted=5, num_first_cached_prompt_tokens=0),
        # TTFT 0.4, one output token so no TPOT, e2e 0.4.
        RequestRecord(request_id=2, arrival_time=1.0, first_token_time=1.4, finish_time=1.4, num_prompt_tokens=20,
                      num_output_tokens=1, num_cached_prompt_tokens=16, token_times=(1.4,)),
        # Aborted while waiting: no latency, no tokens, never admitted; it ends the run at t = 3.0.
        RequestRecord(request_id=3, arrival_time=0.2, first_token_time=NAN, finish_time=3.0, num_prompt_tokens=10,
                      num_output_tokens=0, num_admitted_prompt_tokens=0, aborted=True),
    ]


def _steps() -> StepRecord:
    log = StepLog()
    rows = [  # used, waste, oom, drafted, accepted, verifications, scheduler_time, duration
        (2, 0, False, 0, 0, 0, 0.01, 0.1),
        (5, 1, False, 8, 5, 2, 0.02, 0.2),
        (10, 2, True, 8, 3, 2, 0.01, 0.1),
        (3, 0, False, 4, 2, 1, 0.02, 0.1),
    ]
    t = 0.0
    for used, waste, oom, drafted, accepted, verifications, sched, duration in rows:
        log.append(start_time=t, duration=duration, blocks_used=used, blocks_total=10, scheduler_time=sched,
                   spec_waste_blocks=waste, oom=oom, num_preempted=int(oom), num_drafted=drafted,
                   num_accepted=accepted, num_verifications=verifications, num_output_tokens=1)
        t += duration
    assert len(log) == 4
    return log.freeze()


def test_latency_percentiles_by_hand():
    m = metrics.summarize(_requests(), _steps())
    # numpy "linear": the value at position q/100 * (n - 1) of the sorted sample, interpolated.
    # TTFT (0.1, 0.2, 0.4): P50 at position 1 -> 0.2; P99 at 1.98 -> 0.2 + 0.98 * 0.2 = 0.396.
    assert m["ttft_p50"] == pytest.approx(0.2) and m["ttft_p99"] == pytest.approx(0.396)
    # TPOT (0.1, 0.5): P50 at 0.5 -> 0.3; P99 at 0.99 -> 0.1 + 0.99 * 0.4 = 0.496. Request 2 has 1 token.
    assert m["tpot_p50"] == pytest.approx(0.3) and m["tpot_p99"] == pytest.approx(0.496)
    # E2E (0.4, 1.1, 2.2): P50 1.1; P99 1.1 + 0.98 * 1.1 = 2.178. The aborted request is excluded.
    assert m["e2e_p50"] == pytest.approx(1.1) and m["e2e_p99"] == pytest.approx(2.178)


def test_throughput_hit_rate_and_preemptions_by_hand():
    m = metrics.summarize(_requests(), _steps())
    # Wall time = last finish (3.0, the aborted one) - first arrival (0.0); tokens of finished requests only.
    assert m["wall_time"] == pytest.approx(3.0) and m["output_tokens"] == 17
    assert m["throughput"] == pytest.approx(17 / 3.0)
    assert metrics.summarize(_requests(), _steps(), wall_time=2.0)["throughput"] == pytest.approx(8.5)
    # Every admission counts: (64 + 48 + 16 + 0) / (100 + 103 + 20 + 0).
    assert m["kv_hit_rate"] == pytest.approx(128 / 223)
    # First admissions only: request 1's re-admission hit (48) and its second look-up are out; request 3 was
    # never admitted: (64 + 0 + 16) / (100 + 50 + 20).
    assert m["kv_hit_rate_first"] == pytest.approx(80 / 170)
    assert m["preemptions_per_request"] == pytest.approx(2 / 4)
    assert (m["num_requests"], m["num_aborted"], m["num_steps"]) == (4, 1, 4)


def test_step_metrics_by_hand():
    m = metrics.summarize(_requests(), _steps())
    assert m["memory_utilisation"] == pytest.approx(np.mean([0.2, 0.5, 1.0, 0.3]))  # 0.5
    assert m["spec_kv_waste"] == pytest.approx(np.mean([0.0, 0.1, 0.2, 0.0]))  # 0.075
    assert m["oom_rate"] == pytest.approx(0.25)
    # 20 drafted, 10 accepted over 5 verifications.
    assert m["acceptance_rate"] == pytest.approx(0.5) and m["spec_token_waste"] == pytest.approx(0.5)
    assert m["mean_accepted_length"] == pytest.approx(2.0)
    assert m["scheduler_time_per_step"] == pytest.approx(0.015)
    assert m["scheduler_time_share"] == pytest.approx(0.06 / 0.5)
    assert list(m) == list(metrics.SUMMARY_KEYS)


def test_empty_inputs_give_nan_not_exceptions():
    for steps in (None, StepRecord.empty(), StepLog().freeze()):
        m = metrics.summarize([], steps)
        assert all(math.isnan(metrics.with_units(m)[key]) for key, _, _ in metrics.METRICS)
        assert m["num_requests"] == 0 and m["num_steps"] == 0
    # Steps without any drafts: the speculative ratios are undefined, the rest are not.
    no_spec = StepRecord(start_time=[0.0, 1.0], duration=[1.0, 1.0], blocks_used=[1, 3], blocks_total=[4, 4])
    m = metrics.summarize(_requests()[:1], no_spec)
    for key in ("acceptance_rate", "spec_token_waste", "mean_accepted_length"):
        assert math.isnan(m[key])
    assert m["memory_utilisation"] == pytest.approx(0.5) and m["spec_kv_waste"] == 0.0 and m["oom_rate"] == 0.0
    assert m["scheduler_time_share"] == 0.0 and m["tpot_p99"] == pytest.approx(0.1)
    only_aborted = metrics.summarize(_requests()[3:], None)
    assert math.isnan(only_aborted["ttft_p50"]) and math.isnan(only_aborted["kv_hit_rate"])
    assert only_aborted["throughput"] == 0.0


@pytest.mark.parametrize(
    "changes, error, match",
    [
        ({"duration": [0.1, 0.1, 0.1]}, ValueError, "duration"),
        ({"num_accepted": [1, 1]}, ValueError, "num_accepted has 2 entries"),
        ({"blocks_used": [[1, 2, 3, 4]]}, ValueError, "blocks_used must be 1-D"),
        ({"blocks_used": [1.5, 2, 3, 4]}, TypeError, "blocks_used"),
        ({"blocks_total": [10, 10, 0, 10]}, ValueError, "blocks_total"),
        ({"blocks_used": [2, 5, 11, 3]}, ValueError, "blocks_used exceeds blocks_total at step 2"),
        ({"num_accepted": [0, 9, 3, 2]}, ValueError, "num_accepted exceeds num_drafted at step 1"),
        ({"spec_waste_blocks": [3, 0, 0, 0]}, ValueError, "spec_waste_blocks exceeds blocks_used"),
        ({"num_preempted": [0, -1, 0, 0]}, ValueError, "num_preempted"),
        ({"start_time": None}, ValueError, "start_time is required"),
    ],
)
def test_inconsistent_step_logs_name_the_field(changes, error, match):
    steps = _steps()
    fields = {f.name: getattr(steps, f.name) for f in dataclasses.fields(StepRecord)}
    with pytest.raises(error, match=match):
        StepRecord(**(fields | changes))


def test_first_admission_hit_rate_ignores_what_preemption_finds_again():
    """A trace that shares no prefix: the only hits are re-admissions finding their own blocks. The hit rate of
    every admission credits them; the first-admission rate stays 0."""
    records = [RequestRecord(request_id=i, arrival_time=0.0, first_token_time=0.5, finish_time=1.0,
                             num_prompt_tokens=32, num_output_tokens=4, num_preemptions=1,
                             num_admitted_prompt_tokens=32 + 34, num_cached_prompt_tokens=24,
                             num_first_cached_prompt_tokens=0) for i in range(3)]
    m = metrics.summarize(records, None)
    assert m["kv_hit_rate"] == pytest.approx(72 / 198) and m["kv_hit_rate_first"] == 0.0
    # Admitted once, the two agree, and the default needs no new field.
    once = RequestRecord(request_id=0, arrival_time=0.0, first_token_time=0.5, finish_time=1.0, num_prompt_tokens=32,
                         num_output_tokens=4, num_cached_prompt_tokens=16)
    m = metrics.summarize([once], None)
    assert m["kv_hit_rate"] == m["kv_hit_rate_first"] == 0.5
    assert metrics.summarize([], None)["kv_hit_rate_first"] != metrics.summarize([], None)["kv_hit_rate_first"]  # NaN
    assert "| KV hit rate, first admissions (%) | 50.0 |" in metrics.format_table({"skvs": metrics.with_units(m)})
    base = dict(request_id=0, arrival_time=0.0, first_token_time=0.5, finish_time=1.0, num_prompt_tokens=32,
                num_output_tokens=4, num_cached_prompt_tokens=40, num_admitted_prompt_tokens=68)
    with pytest.raises(ValueError, match="num_first_cached_prompt_tokens is required"):
        RequestRecord(**base)  # admitted twice: which hits were the first admission's cannot be guessed
    for first in (41, 33):  # more than the hits, more than the prompt
        with pytest.raises(ValueError, match="num_first_cached_prompt_tokens"):
            RequestRecord(**base, num_first_cached_prompt_tokens=first)
    with pytest.raises(TypeError, match="num_first_cached_prompt_tokens must be an int"):
        RequestRecord(**base, num_first_cached_prompt_tokens=1.5)


def test_records_are_frozen_and_checked():
    steps = _steps()
    with pytest.raises(ValueError):
        steps.blocks_used[0] = 7  # read-only arrays
    base = {"request_id": 0, "arrival_time": 1.0, "first_token_time": 1.5, "finish_time": 2.0,
            "num_prompt_tokens": 10, "num_output_tokens": 2}
    assert RequestRecord(**base).num_admitted_prompt_tokens == 10
    for changes, match in [({"num_cached_prompt_tokens": 11}, "num_cached_prompt_tokens"),
                           ({"num_drafted": 1, "num_accepted": 2}, "num_accepted"),
                           ({"token_times": (1.5,)}, "token_times"),
                           ({"finish_time": 0.5}, "finish_time"),
                           ({"finish_time": NAN}, "a finished request needs finite"),
                           ({"first_token_time": 0.5}, "first_token_time"),  # before arrival
                           ({"first_token_time": 2.5}, "first_token_time"),  # after finish
                           ({"num_output_tokens": -1}, "num_output_tokens")]:
        with pytest.raises(ValueError, match=match):
            RequestRecord(**(base | changes))
    with pytest.raises(TypeError, match="num_output_tokens must be an int"):
        RequestRecord(**(base | {"num_output_tokens": 2.5}))
    # An aborted request may have no finish time; it stays out of every latency, TPOT included.
    aborted = RequestRecord(**(base | {"finish_time": NAN, "aborted": True}))
    summary = metrics.summarize([RequestRecord(**base), aborted], None)
    assert summary["tpot_p50"] == 0.5 and summary["num_aborted"] == 1
    with pytest.raises(ValueError, match="wall_time"):
        metrics.summarize([RequestRecord(**base)], None, wall_time=0.0)
    with pytest.raises(TypeError, match="steps"):
        metrics.summarize([RequestRecord(**base)], {"duration": [1.0]})


@given(data=st.lists(st.tuples(st.floats(0, 100), st.floats(0, 10), st.floats(0, 10), st.integers(1, 50)),
                     min_size=1, max_size=20),
       permutation_seed=st.integers(0, 2**32 - 1))
def test_summary_ignores_request_order_and_percentiles_are_ordered(data, permutation_seed):
    records = [RequestRecord(request_id=i, arrival_time=a, first_token_time=a + w, finish_time=a + w + d,
                             num_prompt_tokens=8, num_output_tokens=n, num_cached_prompt_tokens=i % 9)
               for i, (a, w, d, n) in enumerate(data)]
    shuffled = [records[i] for i in np.random.default_rng(permutation_seed).permutation(len(records))]
    a, b = metrics.summarize(records, None), metrics.summarize(shuffled, None)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key], nan_ok=True)
    for name in ("ttft", "e2e"):
        assert a[f"{name}_p50"] <= a[f"{name}_p99"] + 1e-12
    assert a["ttft_p99"] <= a["e2e_p99"] + 1e-9


def test_format_table_rows_columns_and_ratios():
    base = metrics.with_units(metrics.summarize(_requests(), _steps()))
    results = {
        "vllm_default": base | {"output_tokens_per_s": 100.0, "acceptance_rate": NAN},
        "naive_spec": base | {"output_tokens_per_s": 80.0},
        "skvs": base | {"output_tokens_per_s": 160.0},
    }
    table = metrics.format_table(results)
    lines = table.splitlines()
    assert lines[0] == "| metric | vllm_default | naive_spec | skvs | skvs / naive_spec | skvs / vllm_default |"
    assert len(lines) == 2 + len(metrics.METRICS) - len(metrics.OPTIONAL_ROWS)  # no TPOT targets: no SLO rows
    throughput = next(line for line in lines if line.startswith("| output throughput (tok/s)"))
    assert throughput.split(" | ")[1:] == ["100", "80.0", "160", "2.00x", "1.60x |"]
    ttft = next(line for line in lines if line.startswith("| TTFT median (ms)"))
    assert " 200 " in ttft and "1.00x" in ttft  # 0.2 s shown in ms
    acceptance = next(line for line in lines if line.startswith("| acceptance rate (%)"))
    assert acceptance.split(" | ")[1] == "n/a" and acceptance.endswith("| n/a |")  # NaN baseline: no ratio
    for label in ("KV hit rate (%)", "OOM rate (% of steps)", "speculative KV waste (%)", "TPOT P99 (ms)"):
        assert f"| {label} |" in table
    # Ratio columns only for pairs whose policies are both present.
    only_two = metrics.format_table({"skvs": base, "naive_spec": base})
    assert "skvs / naive_spec" in only_two and "vllm_default" not in only_two
    with pytest.raises(ValueError, match="results"):
        metrics.format_table({})


def test_attribution_reads_the_draft_counters_and_checks_they_are_there():
    from skvs_jax.metrics import attribution

    got = attribution({"draft_blocks": 12, "oom_steps_drafts": 2, "preempt_drafts": 3, "steps": 9}, 6)
    assert got == {"draft_blocks": 12.0, "oom_steps_drafts": 2.0, "preempt_drafts": 3.0,
                   "draft_preemptions_per_request": 0.5}
    with pytest.raises(ValueError, match="preempt_drafts"):
        attribution({"draft_blocks": 1, "oom_steps_drafts": 0}, 1)


# ------------------------------------------------------------------------ serving statistics, ITL and units


def _timed_requests() -> list[RequestRecord]:
    """Four finished requests with every token's time (tokens of one engine step share a time) and one aborted."""
    spec = [  # (arrival, token times)
        (0.0, (0.3, 0.3, 0.3, 0.5, 0.9)),  # a first step of 3 tokens (2 accepted drafts), then single tokens
        (0.1, (0.4, 0.6, 0.6, 0.7)),
        (0.2, (0.25,)),  # one token: a TTFT and an end-to-end latency, no TPOT, no gap
        (1.0, (1.5, 1.6, 1.8, 2.4, 2.4, 2.4, 2.5)),
    ]
    records = [RequestRecord(request_id=i, arrival_time=a, first_token_time=t[0], finish_time=t[-1],
                             num_prompt_tokens=10, num_output_tokens=len(t), token_times=t)
               for i, (a, t) in enumerate(spec)]
    return records + [RequestRecord(request_id=9, arrival_time=0.0, first_token_time=0.2, finish_time=0.5,
                                    num_prompt_tokens=10, num_output_tokens=2, token_times=(0.2, 0.4), aborted=True)]


def test_serving_statistics_match_numpy_on_hand_made_records():
    """Mean, median, P90 and P99 of TTFT, TPOT, ITL and end-to-end latency are numpy's over the samples written
    out here; request and output-token throughput over first arrival to last finish; aborted requests are out."""
    m = metrics.summarize(_timed_requests(), None)
    samples = {
        "ttft": [0.3, 0.3, 0.05, 0.5],
        "tpot": [(0.9 - 0.3) / 4, (0.7 - 0.4) / 3, (2.5 - 1.5) / 6],
        "e2e": [0.9, 0.6, 0.05, 1.5],
        # per chunk: request 0 steps at 0.3, 0.5, 0.9; request 1 at 0.4, 0.6, 0.7; request 3 at 1.5 .. 2.5
        "itl": [0.2, 0.4, 0.2, 0.1, 0.1, 0.2, 0.6, 0.1],
    }
    for name, values in samples.items():
        assert m[f"{name}_mean"] == pytest.approx(np.mean(values)), name
        for q in (50, 90, 99):
            assert m[f"{name}_p{q}"] == pytest.approx(np.percentile(values, q)), (name, q)
    assert m["wall_time"] == pytest.approx(2.5)
    assert m["request_throughput"] == pytest.approx(4 / 2.5) and m["throughput"] == pytest.approx(17 / 2.5)


def test_itl_is_one_gap_per_chunk_and_undefined_without_token_times():
    """A step that emits k tokens (accepted drafts) gives one gap, as vLLM's per-chunk ITL, so with speculation
    the mean ITL exceeds the TPOT; records without token times (the simulator's) add no gap."""
    np.testing.assert_allclose(metrics.inter_token_latencies((1.0, 1.0, 1.0, 1.5, 2.0, 2.0)), [0.5, 0.5])
    assert metrics.inter_token_latencies((1.0,)).size == 0 and metrics.inter_token_latencies(()).size == 0
    spec = RequestRecord(request_id=0, arrival_time=0.0, first_token_time=1.0, finish_time=2.0, num_prompt_tokens=4,
                         num_output_tokens=6, token_times=(1.0, 1.0, 1.0, 1.5, 2.0, 2.0))
    m = metrics.summarize([spec], None)
    assert m["itl_mean"] == pytest.approx(0.5) and m["tpot_mean"] == pytest.approx(0.2)
    untimed = dataclasses.replace(spec, token_times=())
    assert all(math.isnan(metrics.summarize([untimed], None)[f"itl_{s}"]) for s in ("mean", "p50", "p90", "p99"))
    assert metrics.summarize([untimed, spec], None)["itl_p50"] == pytest.approx(0.5)
    assert metrics.summarize([untimed], None)["tpot_p50"] == pytest.approx(0.2)  # first and last times suffice
    with pytest.raises(ValueError, match="token_times must be non-decreasing"):
        dataclasses.replace(spec, token_times=(1.0, 1.5, 1.2, 1.6, 1.8, 2.0))


def test_reported_keys_carry_their_units():
    """`with_units`: latencies in ms as `{stat}_{name}_ms` (vLLM's names), durations `_s`, rates `_per_s`;
    fractions and counts unchanged; every table row is a reported key."""
    m = metrics.summarize(_timed_requests(), _steps())
    shown = metrics.with_units(m)
    assert shown["median_ttft_ms"] == pytest.approx(1e3 * m["ttft_p50"])
    assert shown["p90_itl_ms"] == pytest.approx(1e3 * m["itl_p90"])
    assert shown["mean_e2e_ms"] == pytest.approx(1e3 * m["e2e_mean"])
    assert shown["output_tokens_per_s"] == m["throughput"] and shown["requests_per_s"] == m["request_throughput"]
    assert shown["wall_time_s"] == m["wall_time"]
    assert shown["scheduler_time_per_step_ms"] == pytest.approx(15.0)
    assert shown["kv_hit_rate"] == m["kv_hit_rate"] and shown["num_steps"] == 4
    assert len(shown) == len(m) and not set(metrics.UNITS) & set(shown)
    assert all(name.endswith(("_ms", "_s", "_per_s")) for name, _ in metrics.UNITS.values())
    assert {key for key, _, _ in metrics.METRICS} <= set(shown)
    assert set(metrics.TIMING_KEYS) <= set(shown)
    assert metrics.with_units({"rate": 4.0, "ttft_p50": None}) == {"rate": 4.0, "median_ttft_ms": None}


def test_request_rows_record_each_request_in_reported_units():
    rows = metrics.request_rows(_timed_requests())
    first = rows[0]
    assert set(first) == {"id", "prompt_tokens", "output_tokens", "arrival_s", "ttft_ms", "tpot_ms", "e2e_ms",
                          "itl_ms", "cached_tokens", "drafted", "accepted", "aborted"}
    assert first["ttft_ms"] == pytest.approx(300) and first["tpot_ms"] == pytest.approx(150)
    assert first["e2e_ms"] == pytest.approx(900) and first["itl_ms"] == pytest.approx([200, 400])
    assert math.isnan(rows[2]["tpot_ms"]) and rows[2]["itl_ms"] == []
    assert rows[-1]["aborted"] and math.isnan(rows[-1]["ttft_ms"])


def test_tpot_slo_attainment_and_goodput_by_hand():
    """Attainment over the finished requests with a target (one output token: no TPOT to miss); goodput counts
    every finished request that met its target (one without a target meets it) per second; both NaN when no
    request has a target, and the table shows their rows only then."""
    def rec(i, first, finish, n, target, aborted=False):
        return RequestRecord(request_id=i, arrival_time=0.0, first_token_time=first, finish_time=finish,
                             num_prompt_tokens=4, num_output_tokens=n, tpot_target=target, aborted=aborted)

    records = [rec(0, 0.1, 1.1, 11, 0.1),   # TPOT 0.1 <= 0.1: met
               rec(1, 0.1, 2.1, 11, 0.1),   # TPOT 0.2: missed
               rec(2, 0.5, 0.5, 1, 0.01),   # one token: met
               rec(3, 0.1, 3.1, 11, None),  # no target: counts in goodput only
               rec(4, NAN, 4.0, 0, 0.1, aborted=True)]  # aborted: neither
    m = metrics.summarize(records, None)
    assert m["tpot_slo_attainment"] == pytest.approx(2 / 3)
    assert m["goodput"] == pytest.approx(3 / 4.0)  # three met of the finished, over the run's 4 s
    plain = metrics.summarize([dataclasses.replace(r, tpot_target=None) for r in records], None)
    assert math.isnan(plain["tpot_slo_attainment"]) and math.isnan(plain["goodput"])
    assert "SLO" not in metrics.format_table({"a": metrics.with_units(plain)})
    table = metrics.format_table({"a": metrics.with_units(m)})
    assert "| TPOT SLO attainment (%) | 66.7 |" in table and "request goodput (req/s)" in table
    for bad in (0.0, -1.0, math.inf, NAN, True):
        with pytest.raises(ValueError, match="tpot_target"):
            rec(9, 0.1, 1.1, 11, bad)
