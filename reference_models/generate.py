"""Greedy decoding, plain and with Medusa chain verification, on the paged KV cache (trees: `medusa_tree`).

* `greedy_reference`: recomputes the dense forward over the whole sequence for every token (no cache).
  Quadratic, obviously right; tests compare the paged paths with it.
* `greedy_generate`: paged prefill of the prompt, then one paged decode call per token.
* `medusa_generate`: paged prefill, then per step the Medusa heads draft a chain of K tokens from the last
  committed hidden state and one multi-query call verifies [last token, d_1..d_K] (Q = K + 1). The longest
  prefix of drafts equal to the base model's argmax is accepted, plus the base model's own next token, so the
  output is exactly greedy decoding's. Rejected drafts' K/V stay in the cache past the committed length and are
  overwritten by the next step (the kernel never reads past `context_lens`).

Each sequence gets its own contiguous run of blocks (block 0 is the null block). Prompts in a batch share one
length. Dimensions: B sequences, `prompt_len` the prompt length, K drafts, V vocab, Dm width.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reference_models.llama import KVCache, Llama, check_token_ids
from reference_models.medusa import MedusaHeads

Array = jax.Array


def accepted_prefix_len(drafts: Array, targets: Array, valid: Array | None = None) -> Array:
    """Number of leading drafts equal to the base model's targets: drafts/targets/valid [..., K] -> [...] int32.

    `valid` marks real draft slots. Padded slots must never be accepted, even when their filler token (0 in the
    original Medusa code) happens to equal the base model's argmax there.
    """
    match = drafts == targets
    if valid is not None:
        match = match & valid
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def _dense_next(graphdef, state, tokens, t):
    """tokens [B, T] (valid up to t) -> greedy token [B] for position t, from a dense causal forward."""
    logits, _ = nnx.merge(graphdef, state).forward_dense(tokens)
    return jnp.argmax(logits[:, t - 1], axis=-1).astype(jnp.int32)


def greedy_reference(model: Llama, prompts: np.ndarray, num_new: int) -> np.ndarray:
    """prompts [B, prompt_len] -> [B, prompt_len + num_new]: one full dense forward over the sequence per generated
    token.

    The sequence sits in a fixed buffer of length prompt_len + num_new; causal masking keeps the not-yet-generated tail
    (zeros) from influencing earlier positions, so one compilation serves every step.
    """
    prompts = check_prompts(model, prompts)
    num_new = check_num_new(num_new)
    b, p = prompts.shape
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((b, p + num_new), jnp.int32).at[:, :p].set(jnp.asarray(prompts))
    for t in range(p, p + num_new):
        tokens = tokens.at[:, t].set(_dense_next(graphdef, state, tokens, jnp.int32(t)))
    return np.asarray(tokens)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def paged_forward(graphdef, state, tokens, positions, cache, block_tables, context_lens):
    """`Llama.forward_paged` jitted over (graphdef static, parameters), the cache donated."""
    model = nnx.merge(graphdef, state)
    return model.forward_paged(tokens, positions, cache, block_tables, context_lens)


def contiguous_layout(model: Llama, batch: int, max_len: int, block_size: int) -> tuple[KVCache, Array]:
    """A cache and block tables [B, M] giving sequence b the blocks 1 + b*M .. (b+1)*M."""
    block_size = check_int("block_size", block_size, 1)  # 0 divided by zero below
    m = -(-max_len // block_size)
    tables = 1 + jnp.arange(batch * m, dtype=jnp.int32).reshape(batch, m)
    return KVCache.zeros(model.config, 1 + batch * m, block_size), tables


def check_prompts(model: Llama, prompts: np.ndarray) -> np.ndarray:
    """Validate prompts [B, prompt_len] at the API boundary (shape, vocabulary); returns them as int32."""
    prompts = np.asarray(prompts)
    if prompts.ndim != 2 or prompts.shape[1] < 1:
        raise ValueError(f"prompts must be [B, P] (P = prompt_len) with P >= 1, got shape {prompts.shape}")
    check_token_ids(prompts, model.config.vocab_size)
    return prompts.astype(np.int32)


def check_int(name: str, value, minimum: int) -> int:
    """value as a Python int; TypeError naming it if it is not an integer (bool included), ValueError if below
    minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_num_new(num_new) -> int:
    """num_new: the tokens to generate per row, an int >= 0 (0 returns the prompts)."""
    return check_int("num_new", num_new, 0)


def check_heads(model: Llama, heads) -> None:
    """Medusa heads must read the base model's hidden states and predict over its vocabulary."""
    if not isinstance(heads, MedusaHeads):
        raise TypeError(f"heads must be MedusaHeads, got {type(heads).__name__}")
    if heads.config.hidden_size != model.config.hidden_size or heads.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"heads (hidden {heads.config.hidden_size}, vocab {heads.config.vocab_size}) do not match "
                         f"the base model (hidden {model.config.hidden_size}, vocab {model.config.vocab_size})")


def greedy_generate(model: Llama, prompts: np.ndarray, num_new: int, *, block_size: int = 16) -> np.ndarray:
    """prompts [B, prompt_len] -> tokens [B, prompt_len + num_new]: paged prefill, then paged decode (Q = 1) per
    token."""
    prompts = check_prompts(model, prompts)
    if check_num_new(num_new) == 0:
        return prompts
    b, p = prompts.shape
    graphdef, state = nnx.split(model)
    cache, tables = contiguous_layout(model, b, p + num_new, block_size)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, _, cache = paged_forward(graphdef, state, jnp.asarray(prompts), positions, cache, tables,
                                      jnp.full((b,), p, jnp.int32))
    out = [jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)]
    for t in range(p, p + num_new - 1):
        logits, _, cache = paged_forward(graphdef, state, out[-1][:, None], jnp.full((b, 1), t, jnp.int32), cache,
                                          tables, jnp.full((b,), t + 1, jnp.int32))
        out.append(jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32))
    return np.concatenate([prompts, np.asarray(jnp.stack(out[:num_new], axis=1))], axis=1)


class MedusaStats(NamedTuple):
    steps: int  # verification calls
    accepted: np.ndarray  # [steps, B] drafts accepted per step (0..K) for sequences still running
    running: np.ndarray  # [steps, B] bool: the sequence was still generating at that step


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(3, 4))
def _medusa_step(graphdef, state, heads_state, cache, tokens, n, hidden, tables, limit):
    """One draft + verify step for all sequences.

    tokens [B, Lbuf] committed tokens (valid up to n [B]); the cache holds K/V of tokens[:, :n-1]; hidden [B, Dm]
    is the base model's hidden state at position n - 2 (the last one computed).
    """
    model, heads = nnx.merge(graphdef[0], state), nnx.merge(graphdef[1], heads_state)
    drafts = heads.draft(hidden)  # [B, K]: for positions n .. n+K-1
    b, k = drafts.shape
    last = jnp.take_along_axis(tokens, (n - 1)[:, None], axis=1)  # [B, 1]
    query = jnp.concatenate([last, drafts], axis=1)  # [B, K+1] at positions n-1 .. n-1+K
    positions = (n - 1)[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    logits, hiddens, cache = model.forward_paged(query, positions, cache, tables, n + k)
    targets = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, K+1]: greedy token for position n + j
    accepted = accepted_prefix_len(drafts, targets[:, :k])  # [B]
    running = n < limit
    # Commit targets[:, :a+1] at positions n .. n+a (equal to the accepted drafts, then the bonus token).
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    write = running[:, None] & (j <= accepted[:, None])
    cols = jnp.where(write, n[:, None] + j, tokens.shape[1])  # out of range -> dropped
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], cols.shape)
    tokens = tokens.at[rows, cols].set(targets, mode="drop")
    new_hidden = jnp.take_along_axis(hiddens, accepted[:, None, None], axis=1)[:, 0]  # at position n-1+a
    hidden = jnp.where(running[:, None], new_hidden, hidden)
    n = jnp.where(running, n + accepted + 1, n)
    return cache, tokens, n, hidden, accepted, running


def medusa_generate(
    model: Llama, heads: MedusaHeads, prompts: np.ndarray, num_new: int, *, block_size: int = 16
) -> tuple[np.ndarray, MedusaStats]:
    """prompts [B, prompt_len] -> (tokens [B, prompt_len + num_new] identical to greedy decoding, acceptance
    statistics)."""
    prompts = check_prompts(model, prompts)
    check_num_new(num_new)
    check_heads(model, heads)
    k = heads.config.num_heads
    return speculative_loop(model, heads, prompts, num_new, _medusa_step, lookahead=k, slots=k + 1,
                            block_size=block_size)


def speculative_loop(
    model: Llama, heads: MedusaHeads, prompts: np.ndarray, num_new: int, step: Callable, *, lookahead: int,
    slots: int, block_size: int,
) -> tuple[np.ndarray, MedusaStats]:
    """Prefill, then call `step` (one jitted propose-verify-commit, chain or tree) until every row has num_new
    tokens. `lookahead` bounds the tokens one step may commit past the limit; `slots` the query slots a step
    writes past the committed length. Shared by `medusa_generate` and `medusa_tree_generate`."""
    b, p = prompts.shape
    limit = p + num_new
    buf = limit + lookahead + 1
    graphdef, state = nnx.split(model)
    heads_graphdef, heads_state = nnx.split(heads)
    cache, tables = contiguous_layout(model, b, buf + slots, block_size)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, hiddens, cache = paged_forward(graphdef, state, jnp.asarray(prompts), positions, cache, tables,
                                            jnp.full((b,), p, jnp.int32))
    tokens = jnp.zeros((b, buf), jnp.int32).at[:, :p].set(jnp.asarray(prompts))
    tokens = tokens.at[:, p].set(jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32))
    n = jnp.full((b,), p + 1, jnp.int32)
    hidden = hiddens[:, -1]
    accepted_log, running_log = [], []
    while int(jnp.min(n)) < limit:
        cache, tokens, n, hidden, accepted, running = step(
            (graphdef, heads_graphdef), state, heads_state, cache, tokens, n, hidden, tables, jnp.int32(limit))
        accepted_log.append(np.asarray(accepted))
        running_log.append(np.asarray(running))
    stats = MedusaStats(len(accepted_log), np.array(accepted_log).reshape(-1, b), np.array(running_log).reshape(-1, b))
    return np.asarray(tokens[:, :limit]), stats
