"""Tests of the acceptance rules (skvs_jax.acceptance).

The key claim, that `lossless` is lossless, is tested statistically: a chi-square goodness-of-fit test of the
emitted tokens against the target distribution, on a fixed seed (deterministic), at significance 0.001; and the
same test must reject deliberately wrong rules (p < 1e-6), which shows it has the power to catch a wrong sampler.
Everything else is exact: hypothesis properties of every rule against a plain-Python greedy oracle, and unit tests
of Medusa's typical acceptance.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from skvs_jax.serve import acceptance as acc

i32, f32 = jnp.int32, jnp.float32
ALPHA = 1e-3  # significance of the goodness-of-fit tests of correct rules
POWER = 1e-6  # a wrong rule must give a p-value below this

greedy = jax.jit(acc.greedy)
typical = jax.jit(acc.typical)
lossless = jax.jit(acc.lossless)
sample_drafts = jax.jit(acc.sample_drafts)


# ------------------------------------------------------------------------------------------- chi-square


@pytest.mark.parametrize(("x", "dof", "expected"), [
    (3.84, 1, 0.0500435), (11.07, 5, 0.0500096), (20.0, 10, 0.0292527), (0.0, 3, 1.0), (math.inf, 3, 0.0),
])
def test_chi2_sf_known_values(x, dof, expected):
    assert acc.chi2_sf(x, dof) == pytest.approx(expected, rel=1e-5, abs=1e-12)


@pytest.mark.parametrize("x", [0.01, 0.5, 1.0, 2.0, 3.0, 7.5, 30.0, 200.0, 1000.0])
def test_chi2_sf_closed_forms(x):
    """dof 1 and 2 have closed forms (erfc(sqrt(x/2)) and exp(-x/2)); they cover both branches, tiny tails included."""
    assert acc.chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)
    assert acc.chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)


def test_chi_square_by_hand():
    stat, p = acc.chi_square(np.array([10, 20, 30]), np.full(3, 1 / 3))
    assert stat == pytest.approx(10.0) and p == pytest.approx(math.exp(-5.0))  # dof 2: sf = exp(-x/2)
    # Expected counts 50, 49, 1: the category expecting 1 is pooled with the next smallest, leaving dof 1.
    stat, p = acc.chi_square(np.array([45, 55, 0]), np.array([0.5, 0.49, 0.01]))
    assert stat == pytest.approx(25 / 50 + 25 / 50) and p == pytest.approx(acc.chi2_sf(1.0, 1))
    assert acc.chi_square(np.array([1, 9]), np.array([0.0, 1.0])) == (math.inf, 0.0)
    with pytest.raises(ValueError, match="probs"):
        acc.chi_square(np.array([1, 9]), np.array([0.5, 0.6]))


# ------------------------------------------------------------------------------------------- lossless in distribution

# Context-free target distributions P[j] (position j), draft distributions Q[i] (slot i): they differ a lot, with
# p(x) > q(x) for some tokens and p(x) < q(x) for others at every position.
P = np.array([
    [0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
    [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
    [0.40, 0.05, 0.05, 0.30, 0.10, 0.10],
])
Q = np.array([
    [0.05, 0.10, 0.15, 0.30, 0.25, 0.15],
    [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
])
K, V = Q.shape
ROWS = 150_000


@dataclasses.dataclass(frozen=True)
class Run:
    """One verification step of ROWS independent rows, as numpy arrays."""

    drafts: np.ndarray  # [ROWS, K]
    num_drafts: np.ndarray  # [ROWS]
    accepted: np.ndarray  # [ROWS]
    next_token: np.ndarray  # [ROWS]

    def emitted(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows whose emission reaches position j, i.e. accepted >= j; the token they emit there)."""
        reach = self.accepted >= j
        padded = np.concatenate([self.drafts, np.zeros((ROWS, 1), self.drafts.dtype)], axis=1)
        token = np.where(self.accepted > j, padded[:, j], self.next_token)
        return reach, token[reach]


def _logits(probs: np.ndarray, temperature: np.ndarray) -> jnp.ndarray:
    """Logits whose softmax at temperature T is `probs`, per row: log(probs) * T."""
    return jnp.asarray(np.log(probs)[None] * temperature[:, None, None], f32)


def _case(seed: int):
    """Inputs of the distribution tests: per-row temperatures in {0.5, 1, 2} (softmax(logits / T) is P and Q at
    every one of them) and num_drafts uniform in [0, K], both independent of every other random choice."""
    rng = np.random.default_rng(seed)
    temperature = rng.choice(np.array([0.5, 1.0, 2.0], np.float32), size=ROWS)
    num_drafts = rng.integers(0, K + 1, size=ROWS).astype(np.int32)
    return _logits(P, temperature), _logits(Q, temperature), jnp.asarray(temperature), jnp.asarray(num_drafts)


def _run(drafts, num_drafts, verdict) -> Run:
    return Run(np.asarray(drafts), np.asarray(num_drafts), np.asarray(verdict.accepted), np.asarray(verdict.next_token))


def _fit(tokens: np.ndarray, probs: np.ndarray) -> float:
    return acc.chi_square(np.bincount(tokens, minlength=probs.size), probs)[1]


@pytest.fixture(scope="module")
def sampled():
    """Drafts sampled from Q with `sample_drafts`, verdicts from `lossless`; also what the wrong rules need."""
    target_logits, draft_logits, temperature, num_drafts = _case(0)
    key_drafts, key_verdict, key_wrong = jax.random.split(jax.random.key(0), 3)
    drafts = sample_drafts(draft_logits, key_drafts, temperature)
    run = _run(drafts, num_drafts, lossless(target_logits, draft_logits, drafts, num_drafts, key_verdict, temperature))
    # A fresh sample of P[0] per row, independent of everything else (for the "resample from p" wrong rule).
    fresh = np.asarray(jax.random.categorical(key_wrong, jnp.asarray(np.log(P[0]), f32), shape=(ROWS,)))
    return run, fresh


def test_sample_drafts_follow_q(sampled):
    """Draft slot i is a sample of Q[i] in every row (rows independent): the q that `lossless` is told about."""
    run, _ = sampled
    for i in range(K):
        assert _fit(run.drafts[:, i], Q[i]) > ALPHA, f"slot {i}"


def test_lossless_emits_the_target_distribution(sampled):
    """Every emitted token follows the target distribution of its position.

    Position 0: every row emits a token there (drafts[0] if accepted >= 1, else next_token), and by the lemma of
    speculative sampling (Leviathan et al. 2023, appendix A.1) it follows P[0]. Rows with num_drafts = 0 emit the
    bonus token, a sample of P[0] too, so the mixture over the independent num_drafts is still P[0].

    Position j >= 1: only rows with accepted >= j emit there, and conditioning on that event does NOT bias the
    token: {accepted >= j} is a function of the slots before j alone (their drafts and acceptance coins, and
    num_drafts), while the token at position j is a function of slot j's draft and coin, the final sampling noise
    and num_drafts only (draft j accepted, or the residual sample at j, or the bonus sample of P[j] when
    num_drafts = j); the drafts are independent, the targets do not depend on the context, and the noise is
    independent of everything, so the lemma applies at slot j given the event. (What WOULD be biased is the pair
    (token 0, token 1) over those rows: given acceptance, token 0 follows normalise(min(P[0], Q[0])), not P[0].)
    """
    run, _ = sampled
    for j in range(K + 1):
        reach, tokens = run.emitted(j)
        assert reach.sum() > 10_000, f"position {j}: too few rows to test"
        assert _fit(tokens, P[j]) > ALPHA, f"position {j}"


def test_lossless_accepts_at_the_optimal_rate(sampled):
    """Slot 0 (rows with num_drafts >= 1) is accepted with probability sum_x min(P[0], Q[0]) = 0.55, the most any
    lossless rule can accept (a z-test, 5 standard errors): losslessness alone would not exclude e.g. "sample
    t ~ p, accept iff t == draft", which accepts only sum_x P[0] Q[0]."""
    run, _ = sampled
    rows = run.num_drafts >= 1
    rate, expected = np.mean(run.accepted[rows] >= 1), np.minimum(P[0], Q[0]).sum()
    assert abs(rate - expected) < 5 * math.sqrt(expected * (1 - expected) / rows.sum())


def test_the_distribution_test_detects_wrong_rules(sampled):
    """Power: the test of position 0 must reject (p < 1e-6) the token of two wrong rules on the same rows.

    accept always: emits draft 0 whenever num_drafts >= 1, a sample of Q[0]; rejection is never needed.
    resample from p: the correct acceptances, but a fresh sample of P[0] on rejection instead of the residual, so
    token 0 follows min(P[0], Q[0]) + (1 - sum min(P[0], Q[0])) P[0], which overweights tokens with p < q.
    """
    run, fresh = sampled
    always = np.where(run.num_drafts >= 1, run.drafts[:, 0], run.next_token)
    resample_p = np.where(run.accepted >= 1, run.drafts[:, 0], fresh)
    p_always, p_resample = _fit(always, P[0]), _fit(resample_p, P[0])
    assert p_always < POWER and p_resample < POWER, (p_always, p_resample)


@pytest.mark.parametrize("drafts_from", ["fixed", "sampled"])
def test_lossless_point_mass_emits_the_target_distribution(drafts_from):
    """draft_logits=None (q a point mass on the draft): tokens at position 0, and at position 1 over rows with
    accepted >= 1 (unbiased as in the test above), follow P. Fixed drafts (token 1, then 3) are the Medusa case;
    drafts sampled from Q show that the point-mass rule ("sample t ~ p, accept iff t == draft") is lossless for
    any drafts. Fixed drafts are accepted with probability P[0][1] (z-test)."""
    target_logits, draft_logits, temperature, num_drafts = _case(1)
    key_drafts, key_verdict = jax.random.split(jax.random.key(1))
    if drafts_from == "fixed":
        drafts = jnp.broadcast_to(jnp.asarray([1, 3], i32), (ROWS, K))
    else:
        drafts = sample_drafts(draft_logits, key_drafts, temperature)
    run = _run(drafts, num_drafts, lossless(target_logits, None, drafts, num_drafts, key_verdict, temperature))
    for j in range(K + 1):
        assert _fit(run.emitted(j)[1], P[j]) > ALPHA, f"position {j}"
    if drafts_from == "fixed":
        rows = run.num_drafts >= 1
        rate, expected = np.mean(run.accepted[rows] >= 1), P[0][1]
        assert abs(rate - expected) < 5 * math.sqrt(expected * (1 - expected) / rows.sum())


def test_typical_next_token_follows_p_at_temperature():
    """Without drafts, typical emits a sample of softmax(logits / T) (per-row temperatures)."""
    target_logits, _, temperature, _ = _case(2)
    no_drafts = jnp.zeros((ROWS,), i32)
    drafts = jnp.zeros((ROWS, K), i32)
    verdict = typical(target_logits, drafts, no_drafts, jax.random.key(2), temperature)
    assert np.all(np.asarray(verdict.accepted) == 0)
    assert _fit(np.asarray(verdict.next_token), P[0]) > ALPHA


# ------------------------------------------------------------------------------------------- properties of every rule


@dataclasses.dataclass(frozen=True)
class Case:
    target_logits: jnp.ndarray  # float32[B, K+1, V]
    draft_logits: jnp.ndarray  # float32[B, K, V]
    drafts: jnp.ndarray  # int32[B, K], padding slots hold anything, the argmax included
    num_drafts: jnp.ndarray  # int32[B]
    temperature: jnp.ndarray  # float32[B], some rows 0
    key: jax.Array


SHAPES = [(8, 3, 5), (3, 0, 4)]  # (B, K, V): two, as each compiles the rules once (slow on CPU); K = 0 too


@st.composite
def cases(draw) -> Case:
    b, k, v = draw(st.sampled_from(SHAPES))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    target = rng.normal(scale=3.0, size=(b, k + 1, v)).astype(np.float32)
    if draw(st.booleans()):
        target = np.round(target)  # integer logits tie often: the lowest id must win everywhere
    same = rng.random((b, 1, 1)) < 0.3  # some rows draft from exactly the target
    draft = np.where(same, target[:, :k], target[:, :k] + rng.normal(size=(b, k, v)).astype(np.float32))
    top = np.argmax(target, axis=-1)[:, :k]
    drafts = np.where(rng.random((b, k)) < 0.7, top, rng.integers(0, v, size=(b, k)))
    num_drafts = rng.integers(0, k + 1, size=b)
    padding = np.arange(k)[None, :] >= num_drafts[:, None]
    drafts = np.where(padding & (rng.random((b, k)) < 0.5), rng.integers(-3, v + 3, size=(b, k)), drafts)
    temperature = rng.choice(np.array([0.0, 0.0, 0.3, 1.0, 2.5], np.float32), size=b)
    return Case(jnp.asarray(target), jnp.asarray(draft), jnp.asarray(drafts, i32), jnp.asarray(num_drafts, i32),
                jnp.asarray(temperature), jax.random.key(seed))


@jax.jit
def _rules(target_logits, draft_logits, drafts, num_drafts, key, temperature) -> dict[str, acc.Verdict]:
    """Every rule on one case, as one compiled program (one compilation per shape instead of four)."""
    args = (drafts, num_drafts, key, temperature)
    return {
        "greedy": acc.greedy(target_logits, drafts, num_drafts),
        "typical": acc.typical(target_logits, *args),
        "lossless": acc.lossless(target_logits, draft_logits, *args),
        "lossless_point_mass": acc.lossless(target_logits, None, *args),
    }


def _all_rules(c: Case) -> dict[str, acc.Verdict]:
    return _rules(c.target_logits, c.draft_logits, c.drafts, c.num_drafts, c.key, c.temperature)


@jax.jit
def _lossless_with_q_equal_p(target_logits, num_drafts, key, temperature):
    k = target_logits.shape[1] - 1
    key_drafts, key_verdict = jax.random.split(key)
    drafts = acc.sample_drafts(target_logits[:, :k], key_drafts, temperature)
    return acc.lossless(target_logits, target_logits[:, :k], drafts, num_drafts, key_verdict, temperature)


def _greedy_oracle(target: np.ndarray, drafts: np.ndarray, num_drafts: np.ndarray) -> tuple[list[int], list[int]]:
    accepted, next_token = [], []
    for row in range(target.shape[0]):
        a = 0
        while a < num_drafts[row] and drafts[row, a] == int(np.argmax(target[row, a])):
            a += 1
        accepted.append(a)
        next_token.append(int(np.argmax(target[row, a])))
    return accepted, next_token


@given(cases())
def test_greedy_matches_python_oracle(c: Case):
    verdict = _all_rules(c)["greedy"]
    expected = _greedy_oracle(np.asarray(c.target_logits), np.asarray(c.drafts), np.asarray(c.num_drafts))
    assert (np.asarray(verdict.accepted).tolist(), np.asarray(verdict.next_token).tolist()) == expected


@given(cases())
def test_verdicts_are_in_range(c: Case):
    b, v = c.target_logits.shape[0], c.target_logits.shape[2]
    for name, verdict in _all_rules(c).items():
        for field in (verdict.accepted, verdict.next_token):
            assert field.shape == (b,) and field.dtype == i32, name
        accepted, next_token = np.asarray(verdict.accepted), np.asarray(verdict.next_token)
        assert np.all((accepted >= 0) & (accepted <= np.asarray(c.num_drafts))), name
        assert np.all((next_token >= 0) & (next_token < v)), name


@given(cases())
def test_every_rule_is_greedy_at_temperature_zero(c: Case):
    rules = _all_rules(c)
    exact, cold = rules["greedy"], np.asarray(c.temperature) == 0
    for name, verdict in rules.items():
        for got, want in ((verdict.accepted, exact.accepted), (verdict.next_token, exact.next_token)):
            np.testing.assert_array_equal(np.asarray(got)[cold], np.asarray(want)[cold], err_msg=name)


@given(cases())
def test_typical_accepts_at_least_what_greedy_accepts(c: Case):
    """With posterior_alpha < 1 the argmax always passes the typical test (p_max >= exp(-H))."""
    rules = _all_rules(c)
    assert np.all(np.asarray(rules["typical"].accepted) >= np.asarray(rules["greedy"].accepted))


@given(cases())
def test_lossless_accepts_every_draft_when_q_is_p(c: Case):
    """Drafts sampled from the target itself are all accepted (p / q = 1), at every temperature."""
    verdict = _lossless_with_q_equal_p(c.target_logits, c.num_drafts, c.key, c.temperature)
    np.testing.assert_array_equal(np.asarray(verdict.accepted), np.asarray(c.num_drafts))


# ------------------------------------------------------------------------------------------- padding and bad drafts


def _sure_case(num_drafts, drafts=None) -> Case:
    """Shape SHAPES[0]: the target's argmax is token 2 at every position with p = 1 in float32, q = p, and every
    slot drafts 2 unless `drafts` says otherwise; temperatures cycle through 0, 1, 0.5, 2."""
    b, k, v = SHAPES[0]
    logits = jnp.zeros((b, k + 1, v), f32).at[:, :, 2].set(100.0)
    drafts = jnp.full((b, k), 2, i32) if drafts is None else jnp.asarray(drafts, i32)
    temperature = jnp.asarray(np.resize(np.array([0.0, 1.0, 0.5, 2.0], np.float32), b))
    return Case(logits, logits[:, :k], drafts, jnp.asarray(num_drafts, i32), temperature, jax.random.key(0))


def test_padding_is_never_accepted():
    """Every slot holds the target's certain argmax, yet exactly num_drafts are accepted, by every rule."""
    num_drafts = [0, 1, 2, 3, 3, 2, 1, 0]
    for name, verdict in _all_rules(_sure_case(num_drafts)).items():
        np.testing.assert_array_equal(np.asarray(verdict.accepted), num_drafts, err_msg=name)
        np.testing.assert_array_equal(np.asarray(verdict.next_token), np.full(8, 2), err_msg=name)


def test_out_of_vocabulary_drafts_are_rejected_under_jit_and_refused_eagerly():
    drafts = np.full((8, 3), 2)
    drafts[:, 1] = [-1, 5, 99, -7, -1, 5, 99, -7]
    c = _sure_case(np.full(8, 3), drafts)
    for name, verdict in _all_rules(c).items():
        np.testing.assert_array_equal(np.asarray(verdict.accepted), np.ones(8), err_msg=name)
    with pytest.raises(ValueError, match="drafts"):
        acc.lossless(c.target_logits, None, c.drafts, c.num_drafts, c.key, c.temperature)


def test_check_inputs_names_the_argument():
    c = _sure_case(np.full(8, 3))
    logits, drafts, n, t, key = c.target_logits, c.drafts, c.num_drafts, c.temperature, c.key
    with pytest.raises(ValueError, match="target_logits"):
        acc.greedy(logits[0], drafts, n)
    with pytest.raises(ValueError, match="drafts"):
        acc.greedy(logits, drafts[:, :2], n)
    with pytest.raises(ValueError, match="num_drafts"):
        acc.greedy(logits, drafts, n.at[0].set(4))
    with pytest.raises(ValueError, match="temperature"):
        acc.typical(logits, drafts, n, key, t.at[0].set(-1.0))
    with pytest.raises(ValueError, match="draft_logits"):
        acc.lossless(logits, logits, drafts, n, key, t)
    with pytest.raises(TypeError, match="drafts"):
        acc.greedy(logits, drafts.astype(f32), n)


# ------------------------------------------------------------------------------------------- typical acceptance

typical_ok = jax.jit(acc.typical_ok)


def _typical_ok(logits: np.ndarray, token: int, temperature: float) -> bool:
    """The test in plain numpy, float64."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    entropy = -np.sum(p * np.log(p))
    return bool(p[token] > min(acc.POSTERIOR_THRESHOLD, acc.POSTERIOR_ALPHA * np.exp(-entropy)))


def test_typical_ok_matches_the_formula():
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=2.0, size=(200, 7)).astype(np.float32)
    tokens = rng.integers(0, 7, size=200)
    temperature = rng.choice(np.array([0.5, 1.0, 3.0], np.float32), size=200)
    got = typical_ok(jnp.asarray(logits), jnp.asarray(tokens, i32), jnp.asarray(temperature))
    want = [_typical_ok(logits[r].astype(np.float64), tokens[r], temperature[r]) for r in range(200)]
    # float32 vs float64 could disagree only right at the threshold; these random inputs are far from it.
    assert np.asarray(got).tolist() == want


def test_typical_accepts_the_mode_and_rejects_improbable_drafts():
    """Peaked p = (0.9, 0.05, 0.03, 0.01, 0.01) at every position, T = 1 (H = 0.43, so the threshold is
    min(0.09, 0.3 exp(-H)) = 0.09): drafts of the mode are accepted, a draft with p = 0.03 or 0.01 stops the row."""
    b, k, v = SHAPES[0]
    logits = jnp.asarray(np.broadcast_to(np.log([0.9, 0.05, 0.03, 0.01, 0.01]), (b, k + 1, v)), f32)
    drafts = np.zeros((b, k), np.int32)
    drafts[1, 0], drafts[2, 1], drafts[3, 2], drafts[4, 0] = 2, 3, 4, 1
    c = Case(logits, logits[:, :k], jnp.asarray(drafts), jnp.full((b,), k, i32), jnp.ones((b,), f32),
             jax.random.key(0))
    accepted = np.asarray(_all_rules(c)["typical"].accepted)
    np.testing.assert_array_equal(accepted, [3, 0, 1, 2, 0, 3, 3, 3])


def test_typical_threshold_adapts_to_entropy():
    """The same p(x) = 0.01 passes in a flat distribution (100 equal tokens: threshold 0.3 / 100 = 0.003) and fails
    in a peaked one (0.9, then ten tokens of 0.01, the rest -inf: threshold 0.09), Medusa's reason for the entropy
    term; greedy rows (T = 0) judge by the argmax alone. Masked (-inf) logits must not give NaN."""
    flat = np.zeros(100)
    peaked = np.full(100, -np.inf)
    peaked[:11] = np.log(np.r_[0.9, np.full(10, 0.01)])
    logits = jnp.asarray(np.stack([flat, peaked, peaked, peaked]), f32)
    got = typical_ok(logits, jnp.asarray([1, 1, 1, 0], i32), jnp.asarray([1.0, 1.0, 0.0, 0.0], f32))
    assert np.asarray(got).tolist() == [True, False, False, True]
