"""Workloads: deterministic per seed, lengths match the published statistics, Zipf popularity, multi-turn
prefixes, Poisson and Gamma (bursty) arrivals, exact JSONL round trip, request files, and clear errors at the
boundary."""

import itertools
import json
import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from skvs_jax import workloads
from skvs_jax.workloads import Request, Trace

KINDS = sorted(workloads.GENERATORS)


@pytest.fixture(scope="module")
def big_sharegpt() -> Trace:
    """20k unscaled, uncapped ShareGPT requests at 4 requests/s, shared by the statistics tests."""
    return workloads.sharegpt(20_000, seed=0, rate=4.0, scale=1.0, max_prompt_len=None, max_output_len=None)


def _lengths(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([len(r.prompt) for r in trace.requests]), np.array([r.max_new_tokens for r in trace.requests]))


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_trace_other_seed_other_trace(kind):
    a, b = workloads.make(kind, 40, seed=7, rate=2.0), workloads.make(kind, 40, seed=7, rate=2.0)
    assert a == b
    c = workloads.make(kind, 40, seed=8, rate=2.0)
    assert [r.prompt for r in a.requests] != [r.prompt for r in c.requests]
    assert [r.arrival_time for r in a.requests] != [r.arrival_time for r in c.requests]


@pytest.mark.parametrize("kind", KINDS)
def test_params_regenerate_the_trace_and_global_rng_is_untouched(kind):
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    trace = workloads.make(kind, 30, seed=3, rate=5.0)
    assert np.array_equal(np.random.get_state()[1], before)
    assert workloads.make(trace.kind, seed=trace.seed, **trace.params) == trace


def test_rate_does_not_change_prompts_or_lengths():
    # Separate streams per purpose: arrivals never shift the text or length draws.
    a = workloads.sharegpt(50, seed=1, rate=None)
    b = workloads.sharegpt(50, seed=1, rate=3.0)
    assert [(r.prompt, r.max_new_tokens) for r in a.requests] == [(r.prompt, r.max_new_tokens) for r in b.requests]
    assert all(r.arrival_time == 0.0 for r in a.requests)
    assert a.params["rate"] is None and workloads.sharegpt(5, seed=1, rate=math.inf).params["rate"] is None


def test_unscaled_lengths_match_the_published_means(big_sharegpt):
    prompts, outputs = _lengths(big_sharegpt)
    # Tolerance: 4%. The standard error of a mean of 20k log-normal draws is CV / sqrt(20k) of the mean:
    # 1.31 / 141 = 0.93% for prompts (sigma 1.0), 0.95 / 141 = 0.67% for outputs (sigma 0.8), so 4% is over
    # 4 standard errors; rounding to integers and max(1, .) shift the mean by far less (P(x < 0.5) < 1e-6).
    assert prompts.mean() == pytest.approx(workloads.SHAREGPT_MEAN_PROMPT_LEN, rel=0.04)
    assert outputs.mean() == pytest.approx(workloads.SHAREGPT_MEAN_OUTPUT_LEN, rel=0.04)
    # The shape is our sigma: median = mean * exp(-sigma^2 / 2) for a log-normal.
    for lengths, mean, sigma in ((prompts, workloads.SHAREGPT_MEAN_PROMPT_LEN, workloads.SHAREGPT_PROMPT_SIGMA),
                                 (outputs, workloads.SHAREGPT_MEAN_OUTPUT_LEN, workloads.SHAREGPT_OUTPUT_SIGMA)):
        assert np.median(lengths) == pytest.approx(mean * math.exp(-(sigma**2) / 2), rel=0.04)
        assert np.std(np.log(lengths)) == pytest.approx(sigma, rel=0.04)


def test_alpaca_means_and_scaling_keeps_the_ratio():
    trace = workloads.sharegpt(20_000, seed=2, scale=1.0, max_prompt_len=None, max_output_len=None,
                               mean_prompt_len=workloads.ALPACA_MEAN_PROMPT_LEN,
                               mean_output_len=workloads.ALPACA_MEAN_OUTPUT_LEN)
    prompts, outputs = _lengths(trace)
    # Same 4% as above; the rounding of short lengths adds at most ~0.5% here (P(x < 0.5) ~ 1e-3).
    assert prompts.mean() == pytest.approx(workloads.ALPACA_MEAN_PROMPT_LEN, rel=0.04)
    assert outputs.mean() == pytest.approx(workloads.ALPACA_MEAN_OUTPUT_LEN, rel=0.04)
    scaled = workloads.sharegpt(20_000, seed=2, scale=0.25, max_prompt_len=None, max_output_len=None)
    prompts, outputs = _lengths(scaled)
    assert prompts.mean() == pytest.approx(0.25 * workloads.SHAREGPT_MEAN_PROMPT_LEN, rel=0.04)
    published_ratio = workloads.SHAREGPT_MEAN_OUTPUT_LEN / workloads.SHAREGPT_MEAN_PROMPT_LEN
    assert outputs.mean() / prompts.mean() == pytest.approx(published_ratio, rel=0.06)


def test_poisson_interarrival_mean_is_one_over_rate(big_sharegpt):
    times = np.array([r.arrival_time for r in big_sharegpt.requests])
    gaps = np.diff(np.concatenate([[0.0], times]))
    # Exponential gaps: standard error of the mean is (1 / rate) / sqrt(20k) = 0.7%; 3% is over 4 of them.
    assert gaps.mean() == pytest.approx(1 / 4.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # CV of an exponential is 1
    assert np.all(gaps >= 0) and [r.request_id for r in big_sharegpt.requests] == list(range(20_000))


def test_zipf_popularity_of_system_prompts():
    n, num_prompts, length, s = 5000, 8, 32, 1.1
    trace = workloads.system_prompts(n, seed=4, num_system_prompts=num_prompts, system_prompt_len=length,
                                     zipf_exponent=s)
    counts = {}
    for r in trace.requests:
        counts[r.prompt[:length]] = counts.get(r.prompt[:length], 0) + 1
        assert len(r.prompt) > length  # a non-empty user suffix
    assert len(counts) == num_prompts
    p = np.arange(1, num_prompts + 1) ** -s
    p /= p.sum()
    observed = np.sort(list(counts.values()))[::-1]
    # Sorted counts against sorted expectations, within 5 binomial standard deviations each.
    assert np.all(np.abs(observed - n * p) < 5 * np.sqrt(n * p * (1 - p)))
    assert observed[0] > 1.5 * observed[1]  # p1 / p2 = 2 ** 1.1 = 2.14: the most popular is clearly first


def test_multi_turn_later_turns_extend_earlier_ones_exactly():
    trace = workloads.multi_turn(300, seed=5, rate=1.0, think_time=2.0)
    assert len(trace) == 300
    conversations: dict[int, list[Request]] = {}
    for r in trace.requests:
        conversations.setdefault(r.conversation_id, []).append(r)
    assert len(conversations) > 1 and any(len(c) > 1 for c in conversations.values())
    for turns in conversations.values():
        assert [r.turn for r in turns] == list(range(len(turns)))  # arrival order is turn order
        for prev, cur in itertools.pairwise(turns):
            assert cur.prompt[: len(prev.prompt)] == prev.prompt
            # previous answer (prev.max_new_tokens tokens) plus at least one token of new user text
            assert len(cur.prompt) >= len(prev.prompt) + prev.max_new_tokens + 1
            assert cur.arrival_time >= prev.arrival_time
    assert all(r.conversation_id >= 0 for r in trace.requests)


@given(kind=st.sampled_from(KINDS), seed=st.integers(0, 2**32), n=st.integers(1, 40),
       max_prompt_len=st.integers(40, 300), max_output_len=st.integers(1, 200),
       rate=st.one_of(st.none(), st.floats(0.1, 100.0)))
def test_every_trace_is_well_formed(kind, seed, n, max_prompt_len, max_output_len, rate):
    kw = {"system_prompt_len": 32} if kind == "system_prompts" else {}
    trace = workloads.make(kind, n, seed=seed, rate=rate, max_prompt_len=max_prompt_len,
                           max_output_len=max_output_len, **kw)
    assert len(trace) == n and trace.kind == kind and trace.seed == seed
    assert [r.request_id for r in trace.requests] == list(range(n))
    times = [r.arrival_time for r in trace.requests]
    assert times == sorted(times)
    for r in trace.requests:
        assert 1 <= len(r.prompt) <= max_prompt_len and 1 <= r.max_new_tokens <= max_output_len
        assert all(type(t) is int and 0 <= t < workloads.VOCAB_SIZE for t in r.prompt)


@pytest.mark.parametrize("kind", KINDS)
def test_jsonl_round_trip_is_exact(kind, tmp_path):
    trace = workloads.make(kind, 25, seed=9, rate=3.0)
    path = tmp_path / f"{kind}.jsonl"
    workloads.save_jsonl(trace, path)
    header = json.loads(path.read_text().splitlines()[0])
    assert header["seed"] == 9 and header["kind"] == kind and header["params"] == trace.params
    assert workloads.load_jsonl(path) == trace
    offline = workloads.make(kind, 5, seed=9)  # rate None is stored as null in strict JSON
    workloads.save_jsonl(offline, path)
    assert workloads.load_jsonl(path) == offline


def test_load_rejects_foreign_and_truncated_files(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match="header"):
        workloads.load_jsonl(path)
    workloads.save_jsonl(workloads.sharegpt(3, seed=0), path)
    path.write_text("\n".join(path.read_text().splitlines()[:-1]) + "\n")
    with pytest.raises(ValueError, match="3 requests"):
        workloads.load_jsonl(path)


@pytest.mark.parametrize(
    "kind, kwargs, error, match",
    [
        ("sharegpt", {"num_requests": 0}, ValueError, "num_requests"),
        ("sharegpt", {"num_requests": 2.0}, TypeError, "num_requests"),
        ("sharegpt", {"seed": -1}, ValueError, "seed"),
        ("sharegpt", {"seed": "1"}, TypeError, "seed"),
        ("sharegpt", {"rate": 0.0}, ValueError, "rate"),
        ("sharegpt", {"rate": -2.0}, ValueError, "rate"),
        ("sharegpt", {"rate": math.nan}, ValueError, "rate"),
        ("sharegpt", {"scale": 0.0}, ValueError, "scale"),
        ("sharegpt", {"max_prompt_len": 0}, ValueError, "max_prompt_len"),
        ("sharegpt", {"max_output_len": True}, TypeError, "max_output_len"),
        ("sharegpt", {"mean_prompt_len": -1.0}, ValueError, "mean_prompt_len"),
        ("sharegpt", {"output_sigma": -0.1}, ValueError, "output_sigma"),
        ("system_prompts", {"num_system_prompts": 0}, ValueError, "num_system_prompts"),
        ("system_prompts", {"zipf_exponent": -1.0}, ValueError, "zipf_exponent"),
        ("system_prompts", {"system_prompt_len": 64, "max_prompt_len": 64}, ValueError, "system_prompt_len"),
        ("multi_turn", {"mean_turns": 0.5}, ValueError, "mean_turns"),
        ("multi_turn", {"max_turns": 0}, ValueError, "max_turns"),
        ("multi_turn", {"think_time": -1.0}, ValueError, "think_time"),
        ("sharegpt", {"burstiness": 0.0}, ValueError, "burstiness"),
        ("phased", {"burstiness": math.inf}, ValueError, "burstiness"),
        ("nope", {}, ValueError, "kind"),
    ],
)
def test_bad_arguments_name_the_argument(kind, kwargs, error, match):
    kwargs = {"num_requests": 4, "seed": 0} | kwargs
    with pytest.raises(error, match=match):
        workloads.make(kind, kwargs.pop("num_requests"), **kwargs)


def test_request_and_trace_invariants():
    with pytest.raises(ValueError, match="prompt"):
        Request(0, 0.0, (), 1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request(0, 0.0, (1,), 0)
    with pytest.raises(ValueError, match="arrival_time"):
        Request(0, math.inf, (1,), 1)
    assert Request(0, 0.0, [1, 2], 1).prompt == (1, 2)
    assert Request(0, 0.0, (np.int64(3),), np.int32(2)).prompt == (3,)
    with pytest.raises(TypeError, match="prompt tokens must be ints"):  # make_trace truncated 1.5 to 1
        Request(0, 0.0, (1.5, 2), 1)
    with pytest.raises(ValueError, match="prompt tokens must lie in"):
        Request(0, 0.0, (1, 300), 1)
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        Request(0, 0.0, (1,), 2.5)
    with pytest.raises(ValueError, match="sorted"):
        Trace((Request(0, 1.0, (1,), 1), Request(1, 0.5, (1,), 1)), 0, "sharegpt", {})


def test_phased_arrivals_step_by_phase_and_phase_of_names_them():
    trace = workloads.phased(448, seed=2, rate=4.0)
    phase = workloads.phase_of(trace)
    assert np.bincount(phase).tolist() == [96, 256, 96]
    times = np.array([r.arrival_time for r in trace.requests])
    rates = [(np.sum(phase == p) - 1) / np.ptp(times[phase == p]) for p in range(3)]
    assert 3.0 < rates[0] < 5.3 and 36 < rates[1] < 64 and 3.0 < rates[2] < 5.3, rates
    # Lengths and text are sharegpt's for the same seed; a trace split over other counts keeps their proportion.
    plain = workloads.sharegpt(448, seed=2)
    assert [(r.prompt, r.max_new_tokens) for r in trace.requests] == [(r.prompt, r.max_new_tokens)
                                                                      for r in plain.requests]
    assert trace.params["phases"] == [[96, 1.0], [256, 12.0], [96, 1.0]]
    assert workloads.phased(44, seed=2, rate=4.0).params["phases"] == [[10, 1.0], [25, 12.0], [9, 1.0]]
    with pytest.raises(ValueError, match="phases"):
        workloads.phased(10, seed=0, phases=[[0, 1.0]])
    with pytest.raises(ValueError, match="rate multiples"):
        workloads.phased(10, seed=0, phases=[[5, 0.0]])


# ------------------------------------------------------------------------------------ bursty arrivals


def test_gamma_gaps_keep_the_mean_and_burstiness_sets_the_spread():
    """Gamma(shape B, mean 1 / rate) gaps, as vLLM's --burstiness: the mean stays 1 / rate, the coefficient of
    variation is 1 / sqrt(B) (1 at B = 1, Poisson; 2 at B = 0.25); seeded; B = 1 draws exactly the exponential gaps
    that the traces drew before burstiness existed."""
    n, rate = 20_000, 4.0
    for b, cv in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):
        gaps = workloads.arrival_gaps(np.random.default_rng(3), n, rate, b)
        # Standard error of the mean: cv / rate / sqrt(n), at most 1.4% here; 5% is over 3.5 of them.
        assert gaps.mean() == pytest.approx(1 / rate, rel=0.05), b
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08), b
    np.testing.assert_array_equal(workloads.arrival_gaps(np.random.default_rng(3), 50, rate, 1.0),
                                  np.random.default_rng(3).exponential(1 / rate, size=50))
    bursty = workloads.sharegpt(400, seed=1, rate=rate, burstiness=0.25)
    assert bursty == workloads.sharegpt(400, seed=1, rate=rate, burstiness=0.25)  # seeded
    assert bursty.params["burstiness"] == 0.25
    assert workloads.make(bursty.kind, seed=bursty.seed, **bursty.params) == bursty
    plain = workloads.sharegpt(400, seed=1, rate=rate)
    assert [r.prompt for r in bursty.requests] == [r.prompt for r in plain.requests]  # only arrivals change
    spread = [np.std(np.diff([r.arrival_time for r in t.requests])) for t in (plain, bursty)]
    assert spread[1] > 1.5 * spread[0]


@pytest.mark.parametrize("kind", KINDS)
def test_every_workload_takes_burstiness(kind):
    trace = workloads.make(kind, 20, seed=2, rate=3.0, burstiness=0.5)
    assert trace.params["burstiness"] == 0.5 and trace != workloads.make(kind, 20, seed=2, rate=3.0)
    # Without a rate (every start at t = 0) there are no gaps for the burstiness to shape.
    at_once = workloads.make(kind, 20, seed=2, rate=None, burstiness=0.5)
    assert at_once.requests == workloads.make(kind, 20, seed=2, rate=None).requests


# ------------------------------------------------------------------------------------ request files


def test_request_files_give_text_as_bytes_lengths_as_corpus_text_and_sort_by_arrival(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "héllo", "output_len": 4, "arrival_s": 0.5}\n\n'
                    '{"prompt_len": 7, "output_len": 2, "arrival_s": 0}\n'
                    '{"prompt": "b", "output_len": 1, "arrival_s": 0.5}\n')
    trace = workloads.read_requests(path, seed=3)
    assert trace.kind == "file" and trace.params == {"path": str(path), "num_requests": 3}
    first, hello, b = trace.requests
    assert [r.request_id for r in trace.requests] == [0, 1, 2] and (first.arrival_time, hello.arrival_time) == (0, 0.5)
    assert hello.prompt == tuple("héllo".encode()) and hello.max_new_tokens == 4  # UTF-8 bytes: 6 tokens
    assert b.prompt == (ord("b"),)  # equal arrivals keep the file's order
    assert len(first.prompt) == 7 and first.max_new_tokens == 2
    assert workloads.read_requests(path, seed=3) == trace  # seeded
    assert workloads.read_requests(path, seed=4).requests[0].prompt != first.prompt


@pytest.mark.parametrize("line, says", [
    ('{"prompt": "a", "output_len": 2, "arrival_s": 0', "line 2: not JSON"),
    ('[1, 2]', "line 2: expected a JSON object"),
    ('{"prompt": "a", "output_len": 2, "arrival_s": 0, "arrival": 1}', "line 2: unknown field(s) ['arrival']"),
    ('{"output_len": 2, "arrival_s": 0}', "line 2: give exactly one of 'prompt' (text) and 'prompt_len'"),
    ('{"prompt": "a", "prompt_len": 3, "output_len": 2, "arrival_s": 0}', "line 2: give exactly one of"),
    ('{"prompt": "", "output_len": 2, "arrival_s": 0}', "line 2: field 'prompt' must be a non-empty string"),
    ('{"prompt_len": 0, "output_len": 2, "arrival_s": 0}', "line 2: field 'prompt_len' must be an int >= 1"),
    ('{"prompt": "a", "output_len": 2.5, "arrival_s": 0}', "line 2: field 'output_len' must be an int >= 1"),
    ('{"prompt": "a", "arrival_s": 0}', "line 2: field 'output_len' is missing"),
    ('{"prompt": "a", "output_len": 2}', "line 2: field 'arrival_s' is missing"),
    ('{"prompt": "a", "output_len": 2, "arrival_s": -1}', "line 2: field 'arrival_s' must be a finite number >= 0"),
    ('{"prompt": "a", "output_len": 2, "arrival_s": NaN}', "line 2: field 'arrival_s' must be a finite number"),
])
def test_request_file_errors_name_the_line_and_field(tmp_path, line, says):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "output_len": 1, "arrival_s": 0}\n' + line + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}: {says}")):
        workloads.read_requests(path)
    path.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        workloads.read_requests(path)
