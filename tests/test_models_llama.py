"""The three ways to run our Llama agree: dense forward vs paged prefill + paged decode / multi-query.

Also: rollback safety (large finite garbage past the committed length and in free blocks must not change the
next logits), config parsing, and bad input at the API boundary.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_models.llama import KVCache, Llama, LlamaConfig, RopeScaling, dense_attention, slot_mapping

CONFIG = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                     rms_norm_eps=1e-5, rope_theta=500.0)
GARBAGE = 1e4  # large and finite: NaN would leak through an additive mask even when the masking is right


@functools.cache
def model_and_fns(config: LlamaConfig = CONFIG):
    model = Llama(config, rngs=nnx.Rngs(0), std=0.3)
    graphdef, state = nnx.split(model)
    dense = jax.jit(lambda s, t: nnx.merge(graphdef, s).forward_dense(t)[0])
    paged = jax.jit(lambda s, *a, tree_mask=None: nnx.merge(graphdef, s).forward_paged(*a, tree_mask=tree_mask))
    return model, functools.partial(dense, state), functools.partial(paged, state)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def random_tables(rng, batch: int, max_blocks: int, num_blocks: int) -> np.ndarray:
    """[B, M] distinct random blocks in 1..N-1 (block 0 is the null block)."""
    return (1 + rng.permutation(num_blocks - 1)[: batch * max_blocks]).reshape(batch, max_blocks).astype(np.int32)


@settings(max_examples=4 if settings.default.max_examples <= 30 else 40)  # each example compiles new shapes
@given(seed=st.integers(0, 2**16), block_size=st.sampled_from([1, 2, 4, 8]),
       cuts=st.lists(st.integers(1, 23), max_size=4))
def test_paged_prefill_chunks_then_decode_equal_dense(seed, block_size, cuts):
    """Random block tables, block sizes and prefill chunkings; two sequences of different lengths per call."""
    _, dense, paged = model_and_fns()
    rng = np.random.default_rng(seed)
    total = 24
    tokens = rng.integers(0, CONFIG.vocab_size, (2, total)).astype(np.int32)
    ref = dense(jnp.asarray(tokens))
    m = -(-total // block_size)
    tables = jnp.asarray(random_tables(rng, 2, m, 2 * m + 3))
    cache = KVCache.zeros(CONFIG, 2 * m + 3, block_size)
    # Sequence 0 prefills in the chunks given by `cuts`, sequence 1 in one chunk shorter by 3 (padded rows).
    bounds = sorted({0, *[c for c in cuts if c < 20], 20})
    got = np.zeros((2, total, CONFIG.vocab_size), np.float32)
    for start, end in zip(bounds[:-1], bounds[1:]):
        q = end - start
        qlens = np.array([q, q], np.int32)
        ctx = np.array([end, end], np.int32)
        positions = np.broadcast_to(np.arange(start, end, dtype=np.int32), (2, q))
        logits, _, cache = paged(jnp.asarray(tokens[:, start:end]), jnp.asarray(positions), cache, tables,
                                 jnp.asarray(ctx), jnp.asarray(qlens))
        got[:, start:end] = np.asarray(logits)
    for t in range(20, total):  # decode
        logits, _, cache = paged(jnp.asarray(tokens[:, t:t + 1]), jnp.full((2, 1), t, jnp.int32), cache, tables,
                                 jnp.full((2,), t + 1, jnp.int32), jnp.ones((2,), jnp.int32))
        got[:, t] = np.asarray(logits[:, 0])
    assert rel_err(got, ref) <= 1e-5


def test_prefill_with_padded_query_rows():
    """query_lens < Q: padding rows write nothing and the real rows match the dense forward."""
    _, dense, paged = model_and_fns()
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, CONFIG.vocab_size, (2, 12)).astype(np.int32)
    ref = np.asarray(dense(jnp.asarray(tokens)))
    tables = jnp.asarray(random_tables(rng, 2, 3, 9))
    cache = KVCache.zeros(CONFIG, 9, 4)
    qlens = np.array([12, 7], np.int32)
    padded = tokens.copy()
    padded[1, 7:] = 0
    logits, _, cache = paged(jnp.asarray(padded), jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12)), cache,
                             tables, jnp.asarray(qlens), jnp.asarray(qlens))
    assert rel_err(logits[0], ref[0]) <= 1e-5
    ref1 = np.asarray(dense(jnp.asarray(tokens[1:, :7])))
    assert rel_err(logits[1, :7], ref1[0]) <= 1e-5
    # Nothing was written for the padding rows: sequence 1's slots 7..11 are still zero.
    k = np.asarray(cache.layer(0)[0]).reshape(-1, CONFIG.num_kv_heads, CONFIG.head_dim)
    slots = np.asarray(slot_mapping(tables, jnp.asarray([12, 12], jnp.int32), jnp.asarray([12, 12], jnp.int32), 12, 4))
    assert np.all(k[slots[12 + 7:]] == 0.0)


def test_logits_at_selected_slots_of_the_leading_rows():
    """logits_at int32[B', R]: the LM head at those query slots of the first B' rows only (a split step's extra
    rows sample nothing), equal to the full logits there."""
    model, _, paged = model_and_fns()
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (3, 6)).astype(np.int32))
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (3, 6))
    tables, lens = jnp.asarray(random_tables(rng, 3, 2, 9)), jnp.asarray([6, 6, 6], jnp.int32)
    full, _, _ = paged(tokens, positions, KVCache.zeros(CONFIG, 9, 4), tables, lens, lens)
    at = jnp.asarray([[5, 2], [0, 4]], jnp.int32)
    graphdef, state = nnx.split(model)
    some, _, _ = jax.jit(lambda s, *a: nnx.merge(graphdef, s).forward_paged(*a, logits_at=at))(
        state, tokens, positions, KVCache.zeros(CONFIG, 9, 4), tables, lens, lens)
    assert some.shape == (2, 2, CONFIG.vocab_size)
    np.testing.assert_allclose(np.asarray(some), np.asarray(full)[[[0], [1]], np.asarray(at)], rtol=1e-5, atol=1e-5)


def test_rollback_garbage_past_committed_length_and_in_free_blocks_is_invisible():
    """Verify K drafts, reject them all, poison every slot past the committed length (and every free block,
    including the null block 0) with large finite values: the next decode's logits must not change."""
    _, dense, paged = model_and_fns()
    rng = np.random.default_rng(3)
    block_size, num_blocks = 4, 16
    tables_np = random_tables(rng, 1, 5, num_blocks)
    tables = jnp.asarray(tables_np)
    prompt = rng.integers(0, CONFIG.vocab_size, (1, 9)).astype(np.int32)
    cache = KVCache.zeros(CONFIG, num_blocks, block_size)
    _, _, cache = paged(jnp.asarray(prompt), jnp.arange(9, dtype=jnp.int32)[None], cache, tables,
                        jnp.asarray([9], jnp.int32), None)
    drafts = rng.integers(0, CONFIG.vocab_size, (1, 5)).astype(np.int32)  # verify 5 tokens at positions 9..13
    _, _, cache = paged(jnp.asarray(drafts), jnp.arange(9, 14, dtype=jnp.int32)[None], cache, tables,
                        jnp.asarray([14], jnp.int32), None)
    committed = 10  # accept the first query token only: 4 drafts' K/V (positions 10..13) are now stale
    used = {int(tables_np[0, p // block_size]) * block_size + p % block_size for p in range(committed)}
    poison = np.ones(num_blocks * block_size, bool)
    poison[list(used)] = False
    garbage = lambda pages: jnp.where(  # noqa: E731
        jnp.asarray(poison).reshape(num_blocks, 1, block_size, 1, 1), jnp.float32(GARBAGE), pages)  # every layer
    dirty = KVCache(k=garbage(cache.k), v=garbage(cache.v))

    nxt = rng.integers(0, CONFIG.vocab_size, (1, 1)).astype(np.int32)
    args = (jnp.asarray(nxt), jnp.asarray([[committed]], jnp.int32))
    clean_logits, _, _ = paged(*args, cache, tables, jnp.asarray([committed + 1], jnp.int32), None)
    dirty_logits, _, _ = paged(*args, dirty, tables, jnp.asarray([committed + 1], jnp.int32), None)
    np.testing.assert_allclose(np.asarray(dirty_logits), np.asarray(clean_logits), rtol=0, atol=1e-6)
    seq = np.concatenate([prompt, drafts[:, :1], nxt], axis=1)
    assert rel_err(dirty_logits[0, 0], dense(jnp.asarray(seq))[0, -1]) <= 1e-5


def test_tree_mask_with_chain_equals_causal():
    """A tree that is a single chain is the causal mask: both give the same logits."""
    _, _, paged = model_and_fns()
    rng = np.random.default_rng(5)
    tables = jnp.asarray(random_tables(rng, 1, 4, 8))
    cache = KVCache.zeros(CONFIG, 8, 4)
    prompt = rng.integers(0, CONFIG.vocab_size, (1, 6)).astype(np.int32)
    _, _, cache = paged(jnp.asarray(prompt), jnp.arange(6, dtype=jnp.int32)[None], cache, tables,
                        jnp.asarray([6], jnp.int32), None)
    q = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (1, 5)).astype(np.int32))
    pos = jnp.arange(6, 11, dtype=jnp.int32)[None]
    causal, _, _ = paged(q, pos, cache, tables, jnp.asarray([11], jnp.int32), None)
    tree, _, _ = paged(q, pos, cache, tables, jnp.asarray([11], jnp.int32), None,
                       tree_mask=jnp.tril(jnp.ones((5, 5), jnp.bool_))[None])
    np.testing.assert_allclose(np.asarray(tree), np.asarray(causal), rtol=0, atol=1e-5)


def test_dense_attention_gives_zero_for_a_query_that_sees_nothing():
    """As the paged kernels do (softmax over no keys was NaN); the other queries are untouched."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 5, h, 8)), jnp.float32) for h in (4, 2, 2))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((5, 5), jnp.bool_)), (2, 5, 5))
    mask = causal.at[1, 2].set(False)
    want, got = np.asarray(dense_attention(q, k, v, causal)), np.array(dense_attention(q, k, v, mask))
    assert np.isfinite(got).all() and (got[1, 2] == 0).all()
    got[1, 2] = want[1, 2]
    np.testing.assert_array_equal(got, want)


def test_token_ids_out_of_vocabulary_raise():
    model, _, _ = model_and_fns()
    for bad in ([[0, 50]], [[-1, 3]]):
        with pytest.raises(ValueError, match="token ids must lie in"):
            model.forward_dense(jnp.asarray(bad, jnp.int32))
    with pytest.raises(ValueError, match="token ids must lie in"):
        model.forward_paged(jnp.asarray([[99]], jnp.int32), jnp.zeros((1, 1), jnp.int32), KVCache.zeros(CONFIG, 2, 4),
                            jnp.ones((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))


def test_config_round_trips_through_hf_dict_and_validates():
    config = dataclasses.replace(CONFIG, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64),
                                 tie_word_embeddings=True)
    assert LlamaConfig.from_hf_dict(config.to_hf_dict()) == config
    old_style = {**CONFIG.to_hf_dict(), "rope_scaling": {"type": "linear", "factor": 2.0}}
    del old_style["rope_parameters"]
    assert LlamaConfig.from_hf_dict(old_style).rope_scaling == RopeScaling("linear", 2.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        LlamaConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="unsupported rope_type"):
        RopeScaling("yarn", 2.0)
    # transformers < 5 reads rope_scaling, not rope_parameters (a scaled model loaded there as unscaled), and
    # each type gets only the keys it reads.
    assert config.to_hf_dict()["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    linear = dataclasses.replace(CONFIG, rope_scaling=RopeScaling("linear", 2.0))
    assert linear.to_hf_dict()["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert LlamaConfig.from_hf_dict(linear.to_hf_dict()) == linear and CONFIG.to_hf_dict()["rope_scaling"] is None
    for args in (("linear", math.nan), ("linear", math.inf), ("llama3", 8.0, 0.0, 4.0), ("llama3", 8.0, -2.0, -1.0),
                 ("llama3", 8.0, 1.0, 4.0, 0)):  # NaN logits, a ZeroDivisionError, or silently accepted
        with pytest.raises(ValueError, match="rope scaling"):
            RopeScaling(*args)
    with pytest.raises(TypeError, match="rope_scaling must be a RopeScaling"):
        dataclasses.replace(CONFIG, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(TypeError, match="tie_word_embeddings must be a bool"):
        dataclasses.replace(CONFIG, tie_word_embeddings="no")
    with pytest.raises(ValueError, match="missing its 'factor'"):
        LlamaConfig.from_hf_dict({**CONFIG.to_hf_dict(), "rope_parameters": {"rope_type": "llama3"}})
    with pytest.raises(ValueError, match="attention_bias"):
        LlamaConfig.from_hf_dict({**CONFIG.to_hf_dict(), "attention_bias": True})
    with pytest.raises(ValueError, match=r"missing \['vocab_size'\]"):
        LlamaConfig.from_hf_dict({k: v for k, v in CONFIG.to_hf_dict().items() if k != "vocab_size"})
    for kwargs, match in ((dict(head_dim=-2), "head_dim"), (dict(head_dim=8.0), "head_dim"),
                          (dict(rms_norm_eps=-1.0), "rms_norm_eps"), (dict(rope_theta=0.0), "rope_theta"),
                          (dict(max_position_embeddings=0), "max_position_embeddings")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(CONFIG, **kwargs)
    assert Llama(CONFIG, rngs=nnx.Rngs(0)).config.num_params == sum(
        x.size for x in jax.tree.leaves(nnx.state(Llama(CONFIG, rngs=nnx.Rngs(0)), nnx.Param)))


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_every_kernel_implementation_gives_the_dense_logits(impl):
    """The model on each `pallas_kernels` implementation (Pallas in interpret mode off-GPU): prefill + decode."""
    model, dense, _ = model_and_fns()
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, CONFIG.vocab_size, (2, 10)).astype(np.int32)
    ref = np.asarray(dense(jnp.asarray(tokens)))
    tables = jnp.asarray(random_tables(rng, 2, 3, 8))
    cache = KVCache.zeros(CONFIG, 8, 4)
    logits, _, cache = model.forward_paged(jnp.asarray(tokens[:, :8]), jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32),
                                           (2, 8)), cache, tables, jnp.full((2,), 8, jnp.int32), impl=impl)
    assert rel_err(logits, ref[:, :8]) <= 1e-5
    for t in (8, 9):
        logits, _, cache = model.forward_paged(jnp.asarray(tokens[:, t:t + 1]), jnp.full((2, 1), t, jnp.int32), cache,
                                               tables, jnp.full((2,), t + 1, jnp.int32), impl=impl)
        assert rel_err(logits[:, 0], ref[:, t]) <= 1e-5


def test_scanned_layers_match_the_unrolled_ones():
    """The layers run by `lax.scan` (the model's program) and the same stacked weights run layer by layer in
    Python agree to float tolerance, dense and paged (logits, hidden states and every written cache slot)."""
    config = dataclasses.replace(CONFIG, num_layers=3)
    model = Llama(config, rngs=nnx.Rngs(1), std=0.3)
    assert model.layers.self_attn.q_proj.weight.shape == (3, config.num_heads * config.head_dim, config.hidden_size)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 9)), jnp.int32)
    scanned, unrolled = model.forward_dense(tokens), model.forward_dense(tokens, scan=False)
    for a, b in zip(scanned, unrolled):
        assert rel_err(a, b) <= 1e-5
    tables = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    lens = jnp.asarray([9, 9], jnp.int32)
    outs = [model.forward_paged(tokens, positions, KVCache.zeros(config, 8, 4), tables, lens, scan=scan)
            for scan in (True, False)]
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        assert rel_err(a, b) <= 1e-5
    assert rel_err(outs[0][0], scanned[0]) <= 1e-5  # and the paged prefill is the dense forward


def test_bfloat16_parameters_keep_their_dtype_and_give_float32_logits():
    model = Llama(CONFIG, rngs=nnx.Rngs(0), std=0.3, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    logits, hidden = model.forward_dense(jnp.asarray([[1, 2, 3]], jnp.int32))
    assert logits.dtype == jnp.float32 and hidden.dtype == jnp.bfloat16
    f32 = Llama(CONFIG, rngs=nnx.Rngs(0), std=0.3)
    nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(f32, nnx.Param)))
    logits = model.forward_dense(jnp.asarray([[1, 2, 3]], jnp.int32))[0]
    ref = f32.forward_dense(jnp.asarray([[1, 2, 3]], jnp.int32))[0]
    assert rel_err(logits, ref) <= 0.05  # the same weights rounded to bf16, run in bf16
