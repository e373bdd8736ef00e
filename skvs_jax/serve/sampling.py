"""Per-request sampling inside the jitted step: logits processing, per-request random streams, stop sequences and
logprobs, for the whole batch at once with every parameter a per-row array (data, never a static argument, so
any mix of requests runs in one compiled program).

The processed distribution of a row (vLLM's order and semantics, docs/sampling.md):

  0. constraints on the raw logits (`serve.constraints`): allowed_token_ids, bad_words and min_tokens ban tokens
     (-inf), logit_bias adds to them;
  1. penalties on the raw logits: repetition r over every token of prompt + output (a seen token's logit is
     divided by r when positive, multiplied by r otherwise), then presence a and frequency f over the output
     tokens (logit -= a * [count > 0] + f * count);
  2. temperature T: T = 0 is greedy, the argmax of the penalised logits, and nothing below applies;
  3. min_p (0 = off: drop tokens with p < min_p * max p), top_k (0 = off: keep the k largest, ties kept), top_p
     (1 = off: drop the smallest tokens whose cumulative probability is <= 1 - top_p, never the largest; at a tie
     the lowest ids go first), each on the distribution the previous one left (renormalised).

`process` returns log p of that distribution on sampled rows and the penalised logits on greedy rows, with an
effective temperature of 1 or 0, so the acceptance rules (`acceptance`, `speculation.verify`) verify drafts
against the *processed* target exactly as they would a raw one, and stay lossless.

Random streams: a request's stream is a PRNG key (`stream_keys`: its seed, or the engine's seed and its id, and
its sample index for n > 1); the sample of the token at sequence position t is drawn with fold_in(stream, t), and
each other use (a sampled draft, the lossless rule's coins) folds in a purpose as well. A request's samples
depend on nothing but its own stream and positions, never on its batch slot, its neighbours, how many drafts were
accepted or a preemption. With point-mass drafts (Medusa's top-k) the emitted tokens are then exactly the tokens
plain sampling with the same stream emits.

Dimensions as in `skvs_jax/__init__.py`; the local ones are words: `slots` is the number of sampling slots per row
(K + 1: the root, then the draft nodes), `stops` = MAX_STOPS stop sequences of up to `stop_len` = MAX_STOP_LEN
tokens, and `top` = MAX_LOGPROBS.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from skvs_jax import arrays
from skvs_jax.arrays import i32

f32 = jnp.float32
MAX_STOPS = 16  # stop sequences per request: stop token ids (length 1) and stop strings together
MAX_STOP_LEN = 32  # tokens per stop sequence
MAX_LOGPROBS = 20  # top-N logprobs per emitted token (vLLM's default cap)
MAX_N = 8  # outputs per prompt (n); each takes a slot
# Per-request bounds of the constraints (`serve.constraints`): per-row index lists, not dense [B, V] masks, which
# would cost B * V per step to ship and to build (V = 128K for Llama 3).
MAX_ALLOWED = 128  # allowed_token_ids
MAX_BIAS = 64  # logit_bias entries
MAX_BAD_WORDS = 16  # bad word token sequences (a word may take two: with and without a leading space)
MAX_BAD_LEN = 8  # tokens per bad word sequence
TARGET, DRAFT, RULE = 0, 1, 2  # purposes folded into a position's key


@struct.dataclass
class SamplingRows:
    """Per-slot sampling parameters, all data (B slots)."""

    temperature: jax.Array  # float32[B] 0 = greedy
    top_k: jax.Array  # int32[B] 0 = off
    top_p: jax.Array  # float32[B] 1 = off
    min_p: jax.Array  # float32[B] 0 = off
    repetition_penalty: jax.Array  # float32[B] 1 = off
    presence_penalty: jax.Array  # float32[B] 0 = off
    frequency_penalty: jax.Array  # float32[B] 0 = off
    stream: jax.Array  # uint32[B, key words] the request's random stream (`stream_keys`)
    stops: jax.Array  # int32[B, stops, stop_len] stop sequences, each reversed (last token first), -1 past its length
    stop_len: jax.Array  # int32[B, stops] tokens in each stop sequence, 0 = unused
    logprobs: jax.Array  # int32[B] top-N logprobs wanted per emitted token, -1 = none
    seed: jax.Array  # uint32[B] the request's seed (stream = `stream_keys(seed, sample index)`)
    siblings: jax.Array  # int32[B] outputs 1 .. siblings of the prompt still to fork off this row (n > 1), else 0
    min_tokens: jax.Array  # int32[B] output tokens before a stop may end the row; 0 = off
    min_ban: jax.Array  # int32[B, stops] the ids banned until min_tokens (stop ids and EOS), -1 = unused
    allowed: jax.Array  # int32[B, MAX_ALLOWED] the only ids the row may sample, -1 = unused (all unused: any id)
    bias_ids: jax.Array  # int32[B, MAX_BIAS] logit_bias token ids, -1 = unused
    bias: jax.Array  # float32[B, MAX_BIAS] their biases, added to the raw logits
    bad: jax.Array  # int32[B, MAX_BAD_WORDS, MAX_BAD_LEN] bad word sequences reversed (last token first), -1 past
    bad_len: jax.Array  # int32[B, MAX_BAD_WORDS] tokens in each, 0 = unused


def key_words() -> int:
    return int(jax.random.key_data(jax.random.key(0)).shape[-1])


def default_rows(b: int) -> SamplingRows:
    """B rows of greedy, unpenalised, unfiltered sampling without stops or logprobs."""
    return SamplingRows(
        temperature=jnp.zeros((b,), f32), top_k=jnp.zeros((b,), i32), top_p=jnp.ones((b,), f32),
        min_p=jnp.zeros((b,), f32), repetition_penalty=jnp.ones((b,), f32), presence_penalty=jnp.zeros((b,), f32),
        frequency_penalty=jnp.zeros((b,), f32), stream=jnp.zeros((b, key_words()), jnp.uint32),
        stops=jnp.full((b, MAX_STOPS, MAX_STOP_LEN), -1, i32), stop_len=jnp.zeros((b, MAX_STOPS), i32),
        logprobs=jnp.full((b,), -1, i32), seed=jnp.zeros((b,), jnp.uint32), siblings=jnp.zeros((b,), i32),
        min_tokens=jnp.zeros((b,), i32), min_ban=jnp.full((b, MAX_STOPS), -1, i32),
        allowed=jnp.full((b, MAX_ALLOWED), -1, i32), bias_ids=jnp.full((b, MAX_BIAS), -1, i32),
        bias=jnp.zeros((b, MAX_BIAS), f32), bad=jnp.full((b, MAX_BAD_WORDS, MAX_BAD_LEN), -1, i32),
        bad_len=jnp.zeros((b, MAX_BAD_WORDS), i32))


def set_rows(rows: SamplingRows, dst: jax.Array, new: SamplingRows, dense: bool = False) -> SamplingRows:
    """rows with row dst[i] set to new's row i (dst int32[B'], distinct; out of range: dropped). dense (static):
    gathers and selects instead of a scatter per leaf (`arrays.set_rows_from`), the same rows."""
    if dense:
        src = arrays.rows_into(dst, rows.temperature.shape[0])
        return jax.tree.map(lambda old, x: arrays.set_rows_from(old, src, x), rows, new)
    return jax.tree.map(lambda old, x: old.at[dst].set(x, mode="drop"), rows, new)


@jax.jit
def stream_keys(seed: jax.Array, index: jax.Array) -> jax.Array:
    """uint32[B, key words]: the stream of sample `index` (int32[B]) of a request with `seed` (uint32[B])."""
    return jax.vmap(lambda s, i: jax.random.key_data(jax.random.fold_in(jax.random.key(s), i)))(seed, index)


def position_keys(stream: jax.Array, positions: jax.Array, purpose: int) -> jax.Array:
    """Typed keys [B, ...]: fold_in(fold_in(stream[b], positions[b, ...]), purpose). stream uint32[B, words]."""
    def one(words, pos):
        key = jax.random.wrap_key_data(words)
        return jax.vmap(lambda p: jax.random.fold_in(jax.random.fold_in(key, p), purpose))(pos.reshape(-1)).reshape(
            pos.shape)
    return jax.vmap(one)(stream, positions)


def sample(keys: jax.Array, logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """int32[B, ...]: a sample of softmax(logits) with its own key per entry, the argmax where temperature[b] <= 0.

    keys: typed keys [B, ...]; logits float[B, ..., V] (already processed: temperature applied)."""
    flat_keys = keys.reshape(-1)
    flat = logits.reshape((flat_keys.shape[0], logits.shape[-1]))
    drawn = jax.vmap(lambda k, x: jax.random.categorical(k, x))(flat_keys, flat).reshape(keys.shape).astype(i32)
    hot = (temperature > 0).reshape((-1,) + (1,) * (keys.ndim - 1))
    return jnp.where(hot, drawn, jnp.argmax(logits, axis=-1).astype(i32))


# ------------------------------------------------------------------------------------------- token counts


def token_counts(tokens: jax.Array, lo: jax.Array, hi: jax.Array, vocab: int) -> jax.Array:
    """int32[B, V]: how often each token occurs in tokens[b, lo[b]:hi[b]] (tokens int32[B, n]; a scatter, O(B n))."""
    b, n = tokens.shape
    col = jnp.arange(n, dtype=i32)[None, :]
    inside = (col >= lo[:, None]) & (col < hi[:, None])
    rows = jnp.broadcast_to(jnp.arange(b, dtype=i32)[:, None], (b, n))
    return jnp.zeros((b, vocab), i32).at[rows, jnp.clip(tokens, 0, vocab - 1)].add(inside.astype(i32))


def path_counts(nodes: jax.Array, ancestors: jax.Array, vocab: int) -> jax.Array:
    """int32[B, K + 1, V]: at each sampling slot (the root, then node u), how often each token occurs among the
    drafts on its path (node u's own token and its ancestors'; nothing at the root).

    nodes int32[B, K] node tokens; ancestors bool[K + 1, K + 1]: ancestors[u, a] iff node a is u or an ancestor of
    u (the tree's attention mask; the root is column 0 and holds no draft)."""
    hot = jax.nn.one_hot(nodes, vocab, dtype=i32)  # [B, K, V]
    return jnp.einsum("ua,bav->buv", ancestors[:, 1:].astype(i32), hot)


# ------------------------------------------------------------------------------------------- processing


def penalise(logits: jax.Array, seen: jax.Array, out_counts: jax.Array, rows: SamplingRows) -> jax.Array:
    """Step 1: logits float32[B, slots, V]; seen bool[B, slots, V] (in prompt + output so far); out_counts
    int32[B, slots, V] (occurrences in the output so far)."""
    r = rows.repetition_penalty[:, None, None]
    repeated = jnp.where(logits > 0, logits / r, logits * r)
    logits = jnp.where(seen & (r != 1), repeated, logits)
    counts = out_counts.astype(f32)
    return (logits - rows.presence_penalty[:, None, None] * (counts > 0).astype(f32)
            - rows.frequency_penalty[:, None, None] * counts)


def _masked(x: jax.Array, drop: jax.Array) -> jax.Array:
    return jnp.where(drop, -jnp.inf, x)


def filter_logits(scaled: jax.Array, rows: SamplingRows) -> jax.Array:
    """Step 3: scaled float32[B, slots, V] (logits / T) with the tokens min_p, top_k and top_p drop set to -inf, in
    that order (vLLM V1's: min_p is an argmax-invariant logits processor, applied before top-k/top-p)."""
    v = scaled.shape[-1]
    probs = jax.nn.softmax(scaled, axis=-1)
    m = rows.min_p[:, None, None]
    scaled = _masked(scaled, (m > 0) & (probs < m * jnp.max(probs, axis=-1, keepdims=True)))
    k = rows.top_k[:, None, None]
    kth = jnp.take_along_axis(-jnp.sort(-scaled, axis=-1), jnp.clip(k - 1, 0, v - 1), axis=-1)
    scaled = _masked(scaled, (k > 0) & (k < v) & (scaled < kth))
    # top_p as vLLM: ascending order, drop while the cumulative probability is <= 1 - top_p, keep the largest.
    order = jnp.argsort(scaled, axis=-1, stable=True)
    asc = jnp.take_along_axis(scaled, order, axis=-1)
    cum = jnp.cumsum(jax.nn.softmax(asc, axis=-1), axis=-1)
    p = rows.top_p[:, None, None]
    drop_sorted = (cum <= 1 - p) & (jnp.arange(v)[None, None, :] < v - 1) & (p < 1)
    drop = jnp.zeros_like(drop_sorted).at[
        jnp.arange(scaled.shape[0])[:, None, None], jnp.arange(scaled.shape[1])[None, :, None], order].set(drop_sorted)
    return _masked(scaled, drop)


def process(logits: jax.Array, seen: jax.Array, out_counts: jax.Array, rows: SamplingRows, *, skip: bool = True,
            constraint: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(processed float32[B, slots, V], effective temperature float32[B]): log p of the processed distribution where
    temperature > 0 (effective temperature 1), the penalised logits where it is 0 (greedy, effective 0).

    logits float[B, slots, V] raw; seen, out_counts as `penalise`. With every option off this is exactly the old
    pipeline (logits / T on sampled rows, the logits themselves on greedy ones): each step is skipped per row.
    skip (`SchedulerConfig.skip`): penalties are skipped by a `cond` when no row has one; False: they are applied
    (an identity without penalties) with no cond. Filtering (a sort over the vocabulary) keeps its cond either way.
    constraint: float32[B, slots, V] added to the raw logits first (`serve.constraints`: -inf bans, logit biases),
    before the penalties, as vLLM's logits processors run before them."""
    logits = logits.astype(f32)
    if constraint is not None:
        logits = logits + constraint
    any_penalty = jnp.any((rows.repetition_penalty != 1) | (rows.presence_penalty != 0)
                          | (rows.frequency_penalty != 0))
    if skip:
        logits = jax.lax.cond(any_penalty, lambda x: penalise(x, seen, out_counts, rows), lambda x: x, logits)
    else:
        logits = jnp.where(any_penalty, penalise(logits, seen, out_counts, rows), logits)
    hot = rows.temperature > 0
    scaled = logits / jnp.where(hot, rows.temperature, 1.0)[:, None, None]
    any_filter = jnp.any(hot & ((rows.top_k > 0) | (rows.top_p < 1) | (rows.min_p > 0)))
    scaled = jax.lax.cond(any_filter, lambda x: filter_logits(x, rows), lambda x: x, scaled)
    processed = jnp.where(hot[:, None, None], scaled, logits)
    return processed, hot.astype(f32)


def log_probs(processed: jax.Array, temperature: jax.Array) -> jax.Array:
    """float32[..., V] the processed distribution's log p (`process`'s output on sampled rows; on greedy rows, a
    point mass on the argmax). temperature: `process`'s effective temperature, broadcast to processed[..., 0]."""
    greedy = jnp.log(jax.nn.one_hot(jnp.argmax(processed, axis=-1), processed.shape[-1], dtype=f32))
    return jnp.where((temperature > 0)[..., None], jax.nn.log_softmax(processed, axis=-1), greedy)


# ------------------------------------------------------------------------------------------- stops and logprobs


def stop_hits(history: jax.Array, history_ok: jax.Array, new: jax.Array, new_ok: jax.Array, rows: SamplingRows
              ) -> jax.Array:
    """bool[B, slots]: some stop sequence ends at new token i, matched on output tokens only.

    history int32[B, stop_len - 1] the output tokens right before the step's (oldest first) with history_ok
    bool[B, stop_len - 1] (False before the output starts); new int32[B, slots] the step's tokens, new_ok
    bool[B, slots] those emitted."""
    w = rows.stops.shape[-1]
    window = jnp.concatenate([history, new], axis=1)  # [B, stop_len - 1 + slots]
    ok = jnp.concatenate([history_ok, new_ok], axis=1)
    r = new.shape[1]
    back = (w - 1 + jnp.arange(r))[:, None] - jnp.arange(w)[None, :]  # [slots, stop_len]: token l places before the end
    tok, good = window[:, back], ok[:, back]  # [B, slots, stop_len]
    lengths = rows.stop_len[:, None, :, None]  # [B, 1, stops, 1]
    inside = jnp.arange(w)[None, None, None, :] < lengths
    match = (tok[:, :, None, :] == rows.stops[:, None, :, :]) & good[:, :, None, :]
    return jnp.any(jnp.all(match | ~inside, axis=-1) & (lengths[..., 0] > 0), axis=-1) & new_ok


def sibling_tokens(processed: jax.Array, temperature: jax.Array, raw: jax.Array, rows: SamplingRows,
                   pos0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The first tokens of outputs 1 .. MAX_N - 1 of each row's prompt, drawn from the row's processed root
    distribution with each output's own stream (`stream_keys(seed, j)`) at position pos0 int32[B], as if each
    were a request of its own; and their raw logprobs. processed, raw float32[B, V] at the root; temperature
    float32[B] effective. Computed only when some row has siblings (zeros otherwise). Returns (int32[B, MAX_N -
    1], float32[B, MAX_N - 1])."""
    b, v = processed.shape

    def draw(_):
        j = jnp.arange(1, MAX_N, dtype=i32)
        streams = jax.vmap(lambda s: stream_keys(jnp.broadcast_to(s, j.shape), j))(rows.seed)  # [B, N-1, words]
        keys = jax.vmap(lambda words, pos: jax.vmap(
            lambda w: jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(w), pos), TARGET))(words))(
            streams, pos0)
        tokens = sample(keys, jnp.broadcast_to(processed[:, None], (b, MAX_N - 1, v)), temperature)
        logp = jax.nn.log_softmax(raw, axis=-1)
        return tokens, jnp.take_along_axis(logp, tokens, axis=1)

    def nothing(_):
        return jnp.zeros((b, MAX_N - 1), i32), jnp.zeros((b, MAX_N - 1), f32)

    return jax.lax.cond(jnp.any(rows.siblings > 0), draw, nothing, None)


def top_logprobs(raw: jax.Array, tokens: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(token's logprob float32[B, slots], top-n ids int32[B, slots, n], their logprobs float32[B, slots, n]) under
    log_softmax of the raw logits float[B, slots, V] (vLLM's default "raw_logprobs"); tokens int32[B, slots]."""
    logp = jax.nn.log_softmax(raw.astype(f32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(logp, n)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0], top_ids.astype(i32), top_lp
