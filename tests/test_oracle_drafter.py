"""The oracle drafter (`serve.oracle_drafter`): its drafts follow the chosen acceptance profile, and serving with
them stays the model's greedy decoding.

Property tests check `draft_tokens` against a plain-numpy reading of its contract; the engine test serves the
shipped model's reference pass, then every profile of `sim.acceptance_model.PRESETS` (and a list of per-depth
probabilities) with the oracle drafting, and checks (a) every output equals the reference pass's, (b) the
acceptance measured per depth, among verifications that offered a draft there and accepted every draft before it,
matches the profile within a binomial bound.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from skvs_jax import policies, workloads
from skvs_jax.config import CacheConfig
from skvs_jax.serve import engine, oracle_drafter
from skvs_jax.serve.model_runner import DraftSite
from skvs_jax.sim import acceptance_model

V = 256


def _site(rid, pos):
    return DraftSite(request_id=jnp.asarray(rid, jnp.int32), position=jnp.asarray(pos, jnp.int32))


@given(st.integers(0, 2**31 - 1), st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=6))
def test_certain_profiles_draft_the_table_or_never_do(seed, probs):
    """probs 1 gives the table's token, 0 a token that is never it; MISS positions are never the table's
    (there is none) and always a valid token."""
    rng = np.random.default_rng(seed)
    table = rng.integers(0, V, (5, 40)).astype(np.int32)
    table[:, 30:] = oracle_drafter.MISS
    rid, pos = rng.integers(-1, 6, 16), rng.integers(0, 40, 16)
    out = np.asarray(oracle_drafter.draft_tokens(jnp.asarray(table), _site(rid, pos), probs, seed, V))
    assert out.shape == (16, len(probs)) and out.min() >= 0 and out.max() < V
    for b in range(16):
        for d, p in enumerate(probs):
            q = pos[b] + d
            known = 0 <= rid[b] < 5 and q < 40 and table[rid[b], q] >= 0
            if known:
                assert (out[b, d] == table[rid[b], q]) == (p == 1.0)


def test_the_draw_is_fresh_per_position_and_frequencies_match_the_profile():
    """Over many (request, position) pairs the share of true drafts at depth d is probs[d] (4.5 sigma), and the
    depths draw independently (the joint share of depths 0 and 1 is the product)."""
    probs = (0.8, 0.5, 0.3)
    r, p = 64, 512
    table = np.random.default_rng(0).integers(0, V, (r, p)).astype(np.int32)
    rid, pos = np.meshgrid(np.arange(r), np.arange(0, p - 3), indexing="ij")
    out = np.asarray(oracle_drafter.draft_tokens(jnp.asarray(table), _site(rid.ravel(), pos.ravel()), probs, 7, V))
    truth = np.stack([table[rid.ravel(), pos.ravel() + d] for d in range(3)], axis=1)
    hit = out == truth
    n = hit.shape[0]
    for d, q in enumerate(probs):
        assert abs(hit[:, d].mean() - q) <= 4.5 * math.sqrt(q * (1 - q) / n)
    joint = probs[0] * probs[1]
    assert abs((hit[:, 0] & hit[:, 1]).mean() - joint) <= 4.5 * math.sqrt(joint * (1 - joint) / n)
    other = np.asarray(oracle_drafter.draft_tokens(jnp.asarray(table), _site(rid.ravel(), pos.ravel()), probs, 8, V))
    assert (other != out).mean() > 0.1  # another seed, other draws


def test_rejected_drafts_are_the_proposals_where_they_differ_from_the_truth():
    table = np.arange(40, dtype=np.int32).reshape(2, 20)
    site = _site([0, 1], [3, 5])
    proposals = jnp.asarray([[3, 99, 5, 98], [7, 8, 9, 10]], jnp.int32)  # row 0: depths 0 and 2 propose the truth
    out = np.asarray(oracle_drafter.draft_tokens(jnp.asarray(table), site, (0.0,) * 4, 0, V, proposals))
    assert out[0, 1] == 99 and out[0, 3] == 98
    assert out[0, 0] != 3 and out[0, 2] != 5  # the truth is never a rejected draft
    assert out[1].tolist() == [7, 8, 9, 10]


def test_bad_drafters_are_refused_by_name():
    table = np.zeros((2, 4), np.int32)
    with pytest.raises(ValueError, match="probs"):
        oracle_drafter.OracleDrafter((), table)
    with pytest.raises(ValueError, match="probs"):
        oracle_drafter.OracleDrafter((0.5, 1.5), table)
    with pytest.raises(ValueError, match="table"):
        oracle_drafter.OracleDrafter((0.5,), np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="request ids"):
        oracle_drafter.table_from_outputs({-1: [1]}, {}, 8)


@pytest.fixture(scope="module")
def served(shipped):
    """The reference pass of a small trace on the shipped model, and what it needs to serve the trace again."""
    model, _ = shipped
    cache = CacheConfig(num_blocks=129, block_size=8, max_seqs=8, max_blocks_per_seq=16)
    trace = workloads.tiny_model_trace("system_prompts", 24, seed=3, max_output_len=28)
    requests = [(r.request_id, list(r.prompt), r.max_new_tokens) for r in trace.requests]
    ref = engine.Engine(model, None, policies.vllm_default(), cache, token_budget=128, prefill_chunk=32)
    table = oracle_drafter.reference_table(ref, requests)
    return model, cache, requests, table


# medusa-1 in the default run, the other profiles under `pytest -m slow` (the default run's time budget)
SLOW_PROFILES = ("medusa-2", "tiny", "0.95,0.2,0.9,0.5", "medusa-1+heads")


@pytest.mark.parametrize("profile", ["medusa-1", *(pytest.param(p, marks=pytest.mark.slow) for p in SLOW_PROFILES)])
def test_oracle_drafts_keep_greedy_output_and_follow_the_profile(served, shipped, profile):
    """Every profile; "+heads" runs the shipped Medusa heads beside the oracle (their cost; their proposals are the
    rejected drafts where they differ from the truth), which changes no acceptance decision."""
    model, cache, requests, table = served
    profile, _, with_heads = profile.partition("+")
    probs = (tuple(float(x) for x in profile.split(",")) if "," in profile
             else tuple(acceptance_model.alphas(profile, 4).tolist()))
    drafter = oracle_drafter.OracleDrafter(probs, table, seed=11, heads=shipped[1] if with_heads else None)
    e = engine.Engine(model, drafter, policies.naive_spec(4), cache, token_budget=128, prefill_chunk=32)
    for rid, prompt, max_new in requests:
        e.add_request(prompt, engine.SamplingParams(max_tokens=max_new), request_id=rid, arrival_time=0.0)
    out = e.run()
    for rid, prompt, _ in requests:
        want = table[rid, len(prompt):]
        assert out[rid] == want[want >= 0].tolist(), f"request {rid}: speculative output differs from the reference"
    tried, passed = np.asarray(e.state.sched.pop_tried), np.asarray(e.state.sched.pop_passed)
    assert tried[0] >= 100
    for d, q in enumerate(probs):
        if tried[d] >= 20:  # a depth reached this often is measured; the bound is 4.5 binomial sigmas
            sigma = math.sqrt(max(q * (1 - q), 1e-3) / tried[d])
            assert abs(passed[d] / tried[d] - q) <= 4.5 * sigma, (d, passed[d], tried[d], q)
