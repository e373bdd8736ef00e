"""Acceptance rules of speculative decoding: which drafts a row keeps, and which token it emits after them.

One verification step gives, for each row, the target model's logits at K + 1 positions: position i scores the
token that follows query token i, i.e. draft i's position (position 0 follows the last committed token), and the
position right after the last real draft (num_drafts) is the bonus position. A rule returns a `Verdict`: the row
emits drafts[:accepted] and then next_token (the correction at the first rejection, or the bonus token when every
real draft was accepted), so a step emits between 1 and num_drafts + 1 tokens.

  greedy    accept while the draft is the target's argmax; next_token = the argmax after them.
  typical   Medusa's typical acceptance (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework
            with Multiple Decoding Heads", section 2.3.1; `evaluate_posterior` in the Medusa repository): with
            p = softmax(logits / T), a draft x is acceptable iff p(x) > min(posterior_threshold,
            posterior_alpha * exp(-H(p))); keep the longest acceptable prefix, sample next_token from p. It accepts
            more on flat distributions but is NOT lossless: the output no longer follows the target distribution.
  lossless  speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
            Decoding", section 2.3 and appendix A.1; Chen et al. 2023, "Accelerating Large Language Model Decoding
            with Speculative Sampling", algorithm 2 and theorem 1): accept a draft x ~ q with probability
            min(1, p(x) / q(x)); at the first rejection emit a sample of normalise(max(0, p - q)); when every draft
            was accepted, a sample of p. Every emitted token follows the target distribution exactly.

Conventions shared by every rule (dimension names as in `skvs_jax/__init__.py`):
  target_logits  float[B, K+1, V]  any float dtype; all arithmetic is float32
  drafts         int32[B, K]       slots at index >= num_drafts are padding and never accepted, whatever they hold;
                                   a real draft outside [0, V) is never accepted either
  num_drafts     int32[B]          in [0, K]
  temperature    float32[B]        T <= 0 means greedy: every rule then returns exactly `greedy`'s verdict, and no
                                   division by T happens on such rows
  key            one PRNG key for the whole batch, or a typed key array [B] with a key per row (per-request
                 random streams, `sampling`): row b's draws then depend on its key alone
K is static (a shape). Everything is pure and jittable. Shapes and dtypes are checked on every call (at trace time
under jit, so for free); values only when the inputs are concrete, i.e. in eager calls. Under jit, bad values
become rejections (num_drafts is clipped into [0, K]) instead of errors.

`chi2_sf` and `chi_square` (numpy and math only) are the goodness-of-fit test that the tests use to show that a
sampler is lossless and that the test can tell a wrong one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from skvs_jax import checks
from skvs_jax.arrays import count_leading, i32

f32 = jnp.float32

POSTERIOR_THRESHOLD = 0.09  # Medusa's defaults (medusa_generate's posterior_threshold / posterior_alpha)
POSTERIOR_ALPHA = 0.3


@struct.dataclass
class Verdict:
    """A row emits drafts[:accepted], then next_token."""

    accepted: jax.Array  # int32[B] leading drafts accepted, in [0, num_drafts]
    next_token: jax.Array  # int32[B] the correction at the first rejection, or the bonus token; in [0, V)


# ------------------------------------------------------------------------------------------- validation


def _float_array(name: str, x, shape: tuple[int, ...]) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must have a float dtype, got {x.dtype}")


def check_inputs(target_logits, drafts, num_drafts, temperature=None, draft_logits=None) -> tuple[int, int, int]:
    """Checks the shared conventions and returns (B, K, V); every rule calls it.

    Shapes and dtypes always (free at trace time); values only when concrete: num_drafts in [0, K], real drafts in
    [0, V), temperature finite and >= 0. Raises ValueError / TypeError naming the argument.
    """
    if getattr(target_logits, "ndim", None) != 3 or target_logits.shape[1] < 1:
        raise ValueError(f"target_logits must have shape [B, K+1, V], got {getattr(target_logits, 'shape', None)}")
    b, k1, v = target_logits.shape
    k = k1 - 1
    _float_array("target_logits", target_logits, (b, k1, v))
    checks.array("drafts", drafts, (b, k), "i")
    checks.array("num_drafts", num_drafts, (b,), "i")
    if temperature is not None:
        _float_array("temperature", temperature, (b,))
    if draft_logits is not None:
        _float_array("draft_logits", draft_logits, (b, k, v))
    checks.in_range("num_drafts", num_drafts, 0, k)
    if checks.is_concrete(drafts) and checks.is_concrete(num_drafts):
        real = np.arange(k)[None, :] < np.asarray(num_drafts)[:, None]
        d = np.asarray(drafts)[real]
        if d.size and (d.min() < 0 or d.max() >= v):
            raise ValueError(f"drafts at index < num_drafts must lie in [0, {v - 1}], got {d[(d < 0) | (d >= v)][0]}")
    if temperature is not None and checks.is_concrete(temperature):
        t = np.asarray(temperature)
        if not np.all(np.isfinite(t) & (t >= 0)):
            raise ValueError(f"temperature must be finite and >= 0, got {t[~(np.isfinite(t) & (t >= 0))][0]}")
    return b, k, v


# ------------------------------------------------------------------------------------------- shared pieces


def _real_slots(drafts, num_drafts, vocab: int):
    """bool[B, K]: slots that hold a real, in-vocabulary draft (the only ones a rule may accept)."""
    k = drafts.shape[1]
    n = jnp.clip(num_drafts, 0, k)
    return (jnp.arange(k, dtype=i32)[None, :] < n[:, None]) & (drafts >= 0) & (drafts < vocab)


def _at(x, index):
    """x[b, index[b]] for x [B, K, ...] and index int32[B]."""
    index = index.reshape(index.shape + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, index, axis=1)[:, 0]


def _per_row(key) -> bool:
    return getattr(key, "ndim", 0) == 1


def _split(key):
    """Two independent keys: of one key, or row by row of a key per row."""
    if _per_row(key):
        pair = jax.vmap(jax.random.split)(key)
        return pair[:, 0], pair[:, 1]
    return tuple(jax.random.split(key))


def _categorical(key, logits):
    """int32[B, ...]: categorical samples of logits [B, ..., V], with one key, or row b's from key[b]."""
    if _per_row(key):
        return jax.vmap(lambda k, x: jax.random.categorical(k, x, axis=-1))(key, logits).astype(i32)
    return jax.random.categorical(key, logits, axis=-1).astype(i32)


def _uniform(key, shape):
    if _per_row(key):
        return jax.vmap(lambda k: jax.random.uniform(k, shape[1:], f32))(key)
    return jax.random.uniform(key, shape, f32)


def _sample(key, logits, temperature):
    """int32[...]: a sample of softmax(logits / T) per row, the argmax where T <= 0. logits [..., V], T [...]."""
    t = temperature.astype(f32)[..., None]
    scaled = logits.astype(f32) / jnp.where(t > 0, t, 1.0)
    sampled = _categorical(key, scaled)
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1).astype(i32))


# ------------------------------------------------------------------------------------------- the rules


def greedy(target_logits, drafts, num_drafts) -> Verdict:
    """Accept while draft == argmax of the target; next_token = the argmax at position `accepted`.

    target_logits float[B, K+1, V], drafts int32[B, K], num_drafts int32[B]. Ties go to the lowest token id.
    """
    check_inputs(target_logits, drafts, num_drafts)
    return _greedy(target_logits, drafts, num_drafts)


def _greedy(target_logits, drafts, num_drafts) -> Verdict:
    k, v = drafts.shape[1], target_logits.shape[2]
    top = jnp.argmax(target_logits, axis=-1).astype(i32)  # [B, K+1]
    accepted = count_leading((drafts == top[:, :k]) & _real_slots(drafts, num_drafts, v))
    return Verdict(accepted=accepted, next_token=_at(top, accepted))


def typical_ok(logits, tokens, temperature, *, posterior_threshold: float = POSTERIOR_THRESHOLD,
               posterior_alpha: float = POSTERIOR_ALPHA):
    """bool[...]: Medusa's typical test, p(token) > min(posterior_threshold, posterior_alpha * exp(-H(p))).

    logits float[..., V], tokens int32[...] (in [0, V)), temperature float32[...]; p = softmax(logits / T).
    T <= 0 uses the greedy test token == argmax(logits): p is a point mass on the argmax in the limit T -> 0, where
    the typical test accepts exactly the argmax, and this way no row divides by 0. For alpha < 1 the argmax always
    passes (p_max >= exp(-H) > alpha * exp(-H)), so typical accepts at least what greedy accepts.
    """
    return typical_scores(logits, tokens, temperature, posterior_threshold=posterior_threshold,
                          posterior_alpha=posterior_alpha)[0]


def typical_scores(logits, tokens, temperature, *, posterior_threshold: float = POSTERIOR_THRESHOLD,
                   posterior_alpha: float = POSTERIOR_ALPHA):
    """(`typical_ok`'s bool[...], log p(token) float32[...]): the test and the token's log-likelihood under the
    same p = softmax(logits / T) (logits / 1 where T <= 0), which a tree needs to choose between equally long
    accepted runs (`speculation.verify`)."""
    t = temperature.astype(f32)[..., None]
    logp = jax.nn.log_softmax(logits.astype(f32) / jnp.where(t > 0, t, 1.0), axis=-1)
    p = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)  # 0 * log 0 = 0, not NaN
    logp_token = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    passes = jnp.exp(logp_token) > jnp.minimum(posterior_threshold, posterior_alpha * jnp.exp(-entropy))
    return jnp.where(temperature > 0, passes, tokens == jnp.argmax(logits, axis=-1)), logp_token


def typical(target_logits, drafts, num_drafts, key, temperature, *, posterior_threshold: float = POSTERIOR_THRESHOLD,
            posterior_alpha: float = POSTERIOR_ALPHA) -> Verdict:
    """Medusa's typical acceptance: the longest prefix of drafts that pass `typical_ok`; next_token ~ p at position
    `accepted` (the argmax where T <= 0, so T <= 0 rows get exactly `greedy`'s verdict).

    target_logits float[B, K+1, V], drafts int32[B, K], num_drafts int32[B], temperature float32[B].
    """
    _, k, v = check_inputs(target_logits, drafts, num_drafts, temperature)
    real = _real_slots(drafts, num_drafts, v)
    t = jnp.broadcast_to(temperature[:, None], drafts.shape)
    ok = typical_ok(target_logits[:, :k], jnp.clip(drafts, 0, v - 1), t, posterior_threshold=posterior_threshold,
                    posterior_alpha=posterior_alpha)
    accepted = count_leading(ok & real)
    return Verdict(accepted=accepted, next_token=_sample(key, _at(target_logits, accepted), temperature))


def lossless(target_logits, draft_logits, drafts, num_drafts, key, temperature) -> Verdict:
    """Speculative sampling: every emitted token follows p = softmax(target_logits / T) exactly.

    target_logits float[B, K+1, V]; draft_logits float[B, K, V], the logits each draft was sampled from at the same
    temperature (q_i = softmax(draft_logits[:, i] / T); see `sample_drafts`), or None for deterministic drafts (q a
    point mass on the draft: accept with probability p(x), else resample p with x removed; this equals "sample
    t ~ p, accept iff t == x", so it is lossless for any draft, sampled or not); drafts int32[B, K];
    num_drafts int32[B]; key: one PRNG key; temperature float32[B] (T <= 0: exactly `greedy`).

    For i < num_drafts in order, draft x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)) (taken as
    u * q < p with u ~ U[0, 1), so q(x) = 0 accepts iff p(x) > 0 and nothing divides); at the first rejection i,
    next_token ~ normalise(max(0, p_i - q_i)) (p_i if that is all zeros, i.e. p_i == q_i up to rounding); when
    all num_drafts drafts are accepted, next_token ~ p_{num_drafts} (likewise at a real slot whose draft is outside
    [0, V), which cannot be a sample of q: the row stops there as if the drafts ended). Vectorised over K: the
    acceptance coins of all slots are drawn at once and the accepted count is their leading run, which is the
    sequential rule because a slot's coin only matters once every earlier slot was accepted.
    """
    b, k, v = check_inputs(target_logits, drafts, num_drafts, temperature, draft_logits)
    key_accept, key_next = _split(key)
    hot = temperature > 0
    t = jnp.where(hot, temperature.astype(f32), 1.0)[:, None, None]  # greedy rows divide by 1, their result unused
    scaled = target_logits.astype(f32) / t  # [B, K+1, V]
    p = jax.nn.softmax(scaled, axis=-1)
    real = _real_slots(drafts, num_drafts, v)
    x = jnp.clip(drafts, 0, v - 1)[:, :, None]  # real slots are in range; the clip only keeps padding gathers valid
    p_x = jnp.take_along_axis(p[:, :k], x, axis=-1)[:, :, 0]  # [B, K]
    if draft_logits is None:
        q_x = jnp.ones((b, k), f32)
    else:
        q = jax.nn.softmax(draft_logits.astype(f32) / t, axis=-1)  # [B, K, V]
        q_x = jnp.take_along_axis(q, x, axis=-1)[:, :, 0]
    u = _uniform(key_accept, (b, k))
    accepted = count_leading((u * q_x < p_x) & real)

    # Slot `accepted` (padded so that K is a valid index) either lost its coin, and the row needs the residual
    # there, or holds no real draft (padding, or out of vocabulary: not a sample of q), and p itself is next.
    rejected = _at(jnp.pad(real, ((0, 0), (0, 1))), accepted)
    p_a = _at(p, accepted)  # [B, V]
    if draft_logits is None:
        x_a = _at(jnp.pad(drafts, ((0, 0), (0, 1)), constant_values=-1), accepted)
        q_a = jax.nn.one_hot(x_a, v, dtype=f32)
    else:
        q_a = _at(jnp.pad(q, ((0, 0), (0, 1), (0, 0))), accepted)
    residual = jnp.maximum(p_a - q_a, 0.0)
    use_residual = rejected & (jnp.sum(residual, axis=-1) > 0)
    logits_next = jnp.where(use_residual[:, None], jnp.log(residual), _at(scaled, accepted))  # log 0 = -inf: never
    sampled = _categorical(key_next, logits_next)

    exact = _greedy(target_logits, drafts, num_drafts)
    return Verdict(accepted=jnp.where(hot, accepted, exact.accepted),
                   next_token=jnp.where(hot, sampled, exact.next_token))


def sample_drafts(draft_logits, key, temperature):
    """int32[B, K]: drafts sampled from softmax(draft_logits / T) per row (the argmax where T <= 0), i.e. from the
    q that `lossless(target_logits, draft_logits, ...)` assumes. draft_logits float[B, K, V], temperature
    float32[B]. Give it a key of its own: the verdict's randomness must be independent of the drafts'."""
    if getattr(draft_logits, "ndim", None) != 3:
        raise ValueError(f"draft_logits must have shape [B, K, V], got {getattr(draft_logits, 'shape', None)}")
    b, k, v = draft_logits.shape
    _float_array("draft_logits", draft_logits, (b, k, v))
    _float_array("temperature", temperature, (b,))
    return _sample(key, draft_logits, jnp.broadcast_to(temperature[:, None], (b, k)))


# ------------------------------------------------------------------------------------------- checking a sampler


def _log_gamma_prefactor(a: float, x: float) -> float:
    return math.exp(-x + a * math.log(x) - math.lgamma(a))


def _gamma_p_series(a: float, x: float) -> float:
    """Regularised lower incomplete gamma P(a, x) by its series; converges fast for x < a + 1."""
    term = total = 1.0 / a
    ap = a
    for _ in range(10_000):
        ap += 1.0
        term *= x / ap
        total += term
        if abs(term) < abs(total) * 1e-16:
            break
    return total * _log_gamma_prefactor(a, x)


def _gamma_q_fraction(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x) by its continued fraction (modified Lentz); for x >= a + 1."""
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return h * _log_gamma_prefactor(a, x)


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square with `dof` degrees of freedom: Q(dof / 2, x / 2) (Numerical Recipes' gammq)."""
    if dof < 1:
        raise ValueError(f"dof must be >= 1, got {dof}")
    if math.isnan(x):
        raise ValueError("x must not be NaN")
    if x <= 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    a, h = dof / 2.0, x / 2.0
    # Each branch where it converges; Q from the fraction directly keeps tiny p-values accurate.
    return 1.0 - _gamma_p_series(a, h) if h < a + 1.0 else _gamma_q_fraction(a, h)


def chi_square(counts, probs, *, min_expected: float = 5.0) -> tuple[float, float]:
    """Pearson's goodness-of-fit test of observed `counts` int[V] against `probs` float[V] (summing to 1).

    Returns (statistic, p_value), p_value = chi2_sf(statistic, categories - 1). Categories whose expected count is
    below `min_expected` are pooled (smallest first, until the pool reaches it) so that the chi-square
    approximation holds; an observation in a category of probability 0 gives (inf, 0.0).
    """
    counts = np.asarray(counts)
    probs = np.asarray(probs, np.float64)
    if counts.ndim != 1 or counts.shape != probs.shape:
        raise ValueError(f"counts and probs must be 1-D of one shape, got {counts.shape} and {probs.shape}")
    if counts.dtype.kind not in "iu" or np.any(counts < 0):
        raise ValueError("counts must be non-negative integers")
    if np.any(probs < 0) or not math.isclose(float(probs.sum()), 1.0, abs_tol=1e-6):
        raise ValueError(f"probs must be non-negative and sum to 1, got sum {probs.sum()}")
    n = int(counts.sum())
    if n == 0:
        raise ValueError("counts must hold at least one observation")
    if np.any(counts[probs == 0] > 0):
        return math.inf, 0.0
    observed = counts[probs > 0].astype(np.float64)
    expected = n * probs[probs > 0]
    order = np.argsort(expected, kind="stable")
    pool_o = pool_e = 0.0
    start = 0
    while start < order.size and (expected[order[start]] < min_expected or 0 < pool_e < min_expected):
        pool_o += observed[order[start]]
        pool_e += expected[order[start]]
        start += 1
    observed = np.append(observed[order[start:]], [pool_o] if pool_e > 0 else [])
    expected = np.append(expected[order[start:]], [pool_e] if pool_e > 0 else [])
    if observed.size < 2:
        return 0.0, 1.0
    statistic = float(np.sum((observed - expected) ** 2 / expected))
    return statistic, chi2_sf(statistic, observed.size - 1)
