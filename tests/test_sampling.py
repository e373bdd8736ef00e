"""Tests of per-request sampling (skvs_jax.serve.sampling) without a model.

`process` against a plain-numpy statement of vLLM's semantics; then the claim that matters: speculative
verification against the processed distribution stays lossless under every option, shown as
tests/test_acceptance.py shows it for the raw distribution, by a chi-square goodness-of-fit test (fixed seeds,
significance 0.001) of the emitted tokens against numpy's processed distribution, with point-mass drafts (Medusa)
and with drafts sampled from a processed draft distribution (the general rule). Every option runs through one
compiled program: the parameters are data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skvs_jax.serve import acceptance as acc
from skvs_jax.serve import sampling
from skvs_jax.serve import speculation as spec

i32, f32 = jnp.int32, jnp.float32
ALPHA = 1e-3


def np_process(logits, seen, out_counts, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition=1.0,
               presence=0.0, frequency=0.0):
    """vLLM's pipeline for one row, in numpy: the processed probabilities (greedy: one-hot on the argmax)."""
    x = np.asarray(logits, np.float64).copy()
    if repetition != 1:
        x = np.where(seen, np.where(x > 0, x / repetition, x * repetition), x)
    x = x - presence * (out_counts > 0) - frequency * out_counts
    if temperature == 0:
        return np.eye(x.size)[np.argmax(x)]
    x = x / temperature
    if min_p > 0:  # vLLM V1: min_p first, then top_k, then top_p
        p = np.exp(x - np.max(x))
        p /= p.sum()
        x = np.where(p < min_p * p.max(), -np.inf, x)
    if 0 < top_k < x.size:
        x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
    if top_p < 1:
        order = np.argsort(x, kind="stable")
        p = np.exp(x[order] - np.max(x))
        cum = np.cumsum(p / p.sum())
        drop = cum <= 1 - top_p
        drop[-1] = False
        x[order[drop]] = -np.inf
    p = np.exp(x - np.max(x))
    return p / p.sum()


def _rows(b, **kw) -> sampling.SamplingRows:
    rows = sampling.default_rows(b)
    names = {"repetition": "repetition_penalty", "presence": "presence_penalty", "frequency": "frequency_penalty"}
    for name, value in kw.items():
        field = names.get(name, name)
        rows = rows.replace(**{field: jnp.full((b,), value, getattr(rows, field).dtype)})
    return rows


OPTIONS = {  # every option alone, then all of them at once
    "top_k": dict(top_k=3),
    "top_p": dict(top_p=0.7),
    "min_p": dict(min_p=0.3),
    "repetition": dict(repetition=1.8),
    "presence": dict(presence=0.9),
    "frequency": dict(frequency=0.6),
    "all": dict(top_k=4, top_p=0.9, min_p=0.1, repetition=1.3, presence=0.4, frequency=0.3),
}


def test_process_matches_numpy():
    rng = np.random.default_rng(0)
    b, v = 16, 12
    logits = rng.normal(scale=2.0, size=(b, 1, v)).astype(np.float32)
    counts = rng.integers(0, 3, size=(b, 1, v)) * (rng.random((b, 1, v)) < 0.4)
    seen = (counts > 0) | (rng.random((b, 1, v)) < 0.2)
    for kw in [dict(o) for o in OPTIONS.values()] + [dict(temperature=0.0, repetition=1.5, frequency=0.5), dict()]:
        t = kw.pop("temperature", 0.7)
        rows = _rows(b, temperature=t, **kw)
        processed, temp = sampling.process(jnp.asarray(logits), jnp.asarray(seen), jnp.asarray(counts, i32), rows)
        got = np.exp(np.asarray(sampling.log_probs(processed, jnp.broadcast_to(temp[:, None], (b, 1)))))[:, 0]
        for row in range(b):
            want = np_process(logits[row, 0], seen[row, 0], counts[row, 0], temperature=t, **kw)
            np.testing.assert_allclose(got[row], want, atol=1e-5, err_msg=str(kw))


def test_min_p_comes_before_top_p_as_in_vllm_v1():
    """docs/sampling.md's example: p = [0.5, 0.3, 0.2], top_p 0.6, min_p 0.5. min_p first (vLLM V1) leaves
    [0.625, 0.375], of which top_p keeps one token; top_p first would keep two."""
    logits = jnp.log(jnp.asarray([0.5, 0.3, 0.2], f32))[None, None, :]
    rows = _rows(1, temperature=1.0, top_p=0.6, min_p=0.5)
    processed, _ = sampling.process(logits, jnp.zeros(logits.shape, bool), jnp.zeros(logits.shape, i32), rows)
    assert np.isfinite(np.asarray(processed)[0, 0]).tolist() == [True, False, False]


def test_top_p_drops_the_lowest_ids_first_at_a_tie():
    """The documented tie order (docs/sampling.md): on a uniform distribution top_p keeps the highest ids."""
    v = 1000
    rows = _rows(1, temperature=1.0, top_p=0.683)
    logits = jnp.zeros((1, 1, v), f32)
    processed, _ = sampling.process(logits, jnp.zeros(logits.shape, bool), jnp.zeros(logits.shape, i32), rows)
    kept = np.flatnonzero(np.isfinite(np.asarray(processed)[0, 0]))
    assert kept.tolist() == list(range(316, v))


def test_every_option_off_is_the_identity():
    """Default rows: sampled rows get logits / T, greedy rows the logits, exactly (the old pipeline)."""
    logits = jax.random.normal(jax.random.key(0), (4, 3, 50)) * 3
    rows = _rows(4).replace(temperature=jnp.asarray([0.0, 0.5, 1.0, 2.0], f32))
    processed, temp = sampling.process(logits, jnp.zeros(logits.shape, bool), jnp.zeros(logits.shape, i32), rows)
    t = np.asarray([1.0, 0.5, 1.0, 2.0], np.float32)[:, None, None]
    np.testing.assert_array_equal(np.asarray(processed), np.asarray(logits) / t)
    assert np.asarray(temp).tolist() == [0.0, 1.0, 1.0, 1.0]


def test_stop_hits_match_on_output_tokens_across_steps():
    rows = sampling.default_rows(3)
    stops = np.full(rows.stops.shape, -1, np.int32)
    lens = np.zeros(rows.stop_len.shape, np.int32)
    stops[:, 0, :3], lens[:, 0] = [7, 6, 5], 3  # the sequence 5 6 7, reversed
    stops[:, 1, :1], lens[:, 1] = [9], 1
    rows = rows.replace(stops=jnp.asarray(stops), stop_len=jnp.asarray(lens))
    w = sampling.MAX_STOP_LEN
    history = np.zeros((3, w - 1), np.int32)
    history[:, -2:] = [5, 6]
    ok = np.ones((3, w - 1), bool)
    ok[1, -2:] = False  # row 1: 5 6 were prompt tokens, so "5 6 7" is not in the output
    new = np.asarray([[7, 1, 2], [7, 9, 2], [1, 5, 6]], np.int32)
    new_ok = np.asarray([[1, 1, 1], [1, 1, 1], [1, 1, 0]], bool)
    hits = sampling.stop_hits(jnp.asarray(history), jnp.asarray(ok), jnp.asarray(new), jnp.asarray(new_ok), rows)
    assert np.asarray(hits).tolist() == [[True, False, False], [False, True, False], [False, False, False]]


# ------------------------------------------------------------------------------------------- lossless, per option

# Context-free raw distributions of the target at positions 0, 1, 2 and of the draft heads: test_acceptance's (one
# copy); the penalties make them depend on the history (a fixed prompt + output) and on the drafts before each slot.
from test_acceptance import P, Q  # noqa: E402  (pytest puts tests/ on sys.path)

K, V = Q.shape
ROWS = 60_000
SEEN = np.array([1, 0, 1, 0, 0, 1], bool)  # tokens of the prompt + output so far
OUT = np.array([2, 0, 1, 0, 0, 0])  # output counts so far
FIXED = np.array([1, 3])  # the point-mass drafts
TEMPERATURE = 0.8


@jax.jit
def _speculate(rows, key, sampled_drafts):
    """One verification step of ROWS rows, composed as the engine composes it (`engine_step._process_targets`):
    drafts (fixed, or sampled from the processed heads), the processed target at the root and after each node
    (penalties counting the drafts on the path), tokens from each row's stream, then the lossless rule."""
    b = ROWS
    raw_target = jnp.broadcast_to(jnp.asarray(np.log(P) * TEMPERATURE, f32), (b, K + 1, V))
    raw_draft = jnp.broadcast_to(jnp.asarray(np.log(Q) * TEMPERATURE, f32), (b, K, V))
    seen0 = jnp.broadcast_to(jnp.asarray(SEEN), (b, V))
    out0 = jnp.broadcast_to(jnp.asarray(OUT, i32), (b, V))
    pos0 = jnp.full((b,), 10, i32)
    # Drafts: sampled one by one from the processed draft distribution (penalties count the drafts before).
    drafts, q_logits, drafted = [], [], jnp.zeros((b, V), i32)
    for i in range(K):
        logits_i, temp = sampling.process(raw_draft[:, i: i + 1], (seen0 | (drafted > 0))[:, None],
                                          (out0 + drafted)[:, None], rows)
        d = sampling.sample(sampling.position_keys(rows.stream, (pos0 + i)[:, None], sampling.DRAFT), logits_i,
                            temp)[:, 0]
        d = jnp.where(sampled_drafts, d, FIXED[i])
        drafted = drafted + jax.nn.one_hot(d, V, dtype=i32)
        drafts.append(d)
        q_logits.append(logits_i[:, 0])
    drafts, q_logits = jnp.stack(drafts, 1), jnp.stack(q_logits, 1)
    ancestors = jnp.asarray(spec.chain(K).mask)
    on_path = sampling.path_counts(drafts, ancestors, V)
    processed, temp = sampling.process(raw_target, seen0[:, None] | (on_path > 0), out0[:, None] + on_path, rows)
    num_drafts = jnp.full((b,), K, i32)
    depth = jnp.arange(K + 1, dtype=i32)
    rule_keys = sampling.position_keys(rows.stream, pos0[:, None], sampling.RULE)[:, 0]
    sampled = acc.lossless(processed, q_logits, drafts, num_drafts, rule_keys, temp)
    keys = sampling.position_keys(rows.stream, pos0[:, None] + depth[None, :], sampling.TARGET)
    target = sampling.sample(keys, processed, temp)
    point = spec.verify(spec.chain(K), processed, drafts, jnp.ones((b,), i32), num_drafts, rule_keys, temp,
                        target=target)
    accepted = jnp.where(sampled_drafts, sampled.accepted, point.accepted)
    next_token = jnp.where(sampled_drafts, sampled.next_token, point.next_token)
    return drafts, accepted, next_token


def _streams(seed: int) -> jax.Array:
    return sampling.stream_keys(jnp.full((ROWS,), seed, jnp.uint32), jnp.arange(ROWS, dtype=i32))


@pytest.mark.parametrize("drafts", ["point_mass", "sampled"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_speculative_sampling_emits_the_processed_distribution(option, drafts):
    """Position 0 (every row) follows processed(P[0] | history); position 1, over rows that accepted draft 0,
    follows processed(P[1] | history + draft 0) for each value of draft 0 with enough rows (given the draft,
    acceptance at slot 0 does not bias slot 1: the targets are context-free but for the penalties, which
    depend on the draft alone)."""
    rows = _rows(ROWS, temperature=TEMPERATURE, **OPTIONS[option]).replace(stream=_streams(7))
    sampled = drafts == "sampled"
    d, accepted, next_token = (np.asarray(x) for x in _speculate(rows, jax.random.key(0), sampled))
    kw = dict(OPTIONS[option])
    first = np.where(accepted >= 1, d[:, 0], next_token)
    want0 = np_process(np.log(P[0]) * TEMPERATURE, SEEN, OUT, temperature=TEMPERATURE, **kw)
    assert acc.chi_square(np.bincount(first, minlength=V), want0)[1] > ALPHA
    second = np.where(accepted >= 2, d[:, 1], next_token)
    tested = 0
    for x0 in range(V):
        sel = (accepted >= 1) & (d[:, 0] == x0)
        if sel.sum() < 2_000:
            continue
        seen, out = SEEN.copy(), OUT.copy()
        seen[x0], out[x0] = True, out[x0] + 1
        want1 = np_process(np.log(P[1]) * TEMPERATURE, seen, out, temperature=TEMPERATURE, **kw)
        assert acc.chi_square(np.bincount(second[sel], minlength=V), want1)[1] > ALPHA, x0
        tested += 1
    # Point-mass draft 0 (token 1) survives every option's filter; sampled drafts may not (top_p keeps tokens 3-5
    # of the processed Q but 0-2 of the processed P: nothing is ever accepted, and the rule is still lossless).
    assert tested >= 1 or sampled


def test_the_test_detects_unprocessed_verification():
    """Power: verifying against the raw target instead of the processed one is caught (p < 1e-6)."""
    rows = _rows(ROWS, temperature=TEMPERATURE).replace(stream=_streams(7))
    d, accepted, next_token = (np.asarray(x) for x in _speculate(rows, jax.random.key(0), True))
    first = np.where(accepted >= 1, d[:, 0], next_token)
    want = np_process(np.log(P[0]) * TEMPERATURE, SEEN, OUT, temperature=TEMPERATURE, **OPTIONS["all"])
    assert acc.chi_square(np.bincount(first, minlength=V), want)[1] < 1e-6


def test_one_program_serves_every_option():
    """Parameters are data: all the runs above reuse one compilation per draft kind."""
    size = _speculate._cache_size()
    rows = _rows(ROWS, temperature=0.5, top_k=2, repetition=1.1).replace(stream=_streams(3))
    _speculate(rows, jax.random.key(0), True)
    _speculate(rows.replace(top_p=jnp.full((ROWS,), 0.5, f32)), jax.random.key(0), False)
    assert _speculate._cache_size() == max(size, 1)


def test_a_rows_samples_depend_on_its_stream_and_position_only():
    """The same stream and position give the same token whatever the other rows hold; another stream, another."""
    logits = jnp.asarray(np.log(np.full((4, 1, 50), 1 / 50)), f32)
    streams = sampling.stream_keys(jnp.asarray([5, 5, 6, 5], jnp.uint32), jnp.zeros((4,), i32))
    pos = jnp.asarray([[3], [3], [3], [4]], i32)
    a = np.asarray(sampling.sample(sampling.position_keys(streams, pos, sampling.TARGET), logits, jnp.ones((4,))))
    b = np.asarray(sampling.sample(sampling.position_keys(streams[::-1], pos[::-1], sampling.TARGET), logits,
                                   jnp.ones((4,))))[::-1]
    assert a.tolist() == b.tolist() and a[0] == a[1]
    many = sampling.stream_keys(jnp.arange(64, dtype=jnp.uint32), jnp.zeros((64,), i32))
    draws = sampling.sample(sampling.position_keys(many, jnp.full((64, 1), 3, i32), sampling.TARGET),
                            jnp.zeros((64, 1, 50)), jnp.ones((64,)))
    assert len(set(np.asarray(draws)[:, 0].tolist())) > 20
