"""Medusa heads and verification: greedy decoding with Medusa chain or tree verification gives exactly plain
greedy decoding's tokens; padded draft slots are never accepted (the "token 0" trap of the original code)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from reference_models import checkpoint
from reference_models.generate import accepted_prefix_len, greedy_generate, greedy_reference, medusa_generate
from reference_models.llama import Llama, LlamaConfig
from reference_models.medusa import MedusaConfig, MedusaHeads
from reference_models.medusa_tree import DraftTree, medusa_tree_generate

CONFIG = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)


def test_padded_draft_slots_are_never_accepted():
    """Original Medusa pads short tree paths with token 0 and compares them with the base model's argmax, so a
    padded slot is 'accepted' whenever that argmax happens to be 0. With the validity mask it never is."""
    drafts = jnp.asarray([[5, 0, 0], [5, 7, 0]], jnp.int32)  # path 0 has 1 real draft, path 1 has 2
    valid = jnp.asarray([[True, False, False], [True, True, False]])
    targets = jnp.asarray([[5, 0, 0], [5, 7, 0]], jnp.int32)  # the base model's argmax is 0 after the real drafts
    assert accepted_prefix_len(drafts, targets).tolist() == [3, 3]  # the trap
    assert accepted_prefix_len(drafts, targets, valid).tolist() == [1, 2]
    assert accepted_prefix_len(drafts, jnp.asarray([[4, 0, 0], [5, 6, 0]], jnp.int32), valid).tolist() == [0, 1]


def test_heads_predict_from_hidden_with_zero_init_as_identity():
    rng = np.random.default_rng(0)
    lm = jnp.asarray(rng.normal(size=(32, 16)).astype(np.float32))
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=32, num_heads=3), lm)
    hidden = jnp.asarray(rng.normal(size=(4, 5, 16)).astype(np.float32))
    logits = heads(hidden)
    assert logits.shape == (3, 4, 5, 32)
    np.testing.assert_allclose(logits[2], hidden @ lm.T, rtol=1e-5, atol=1e-5)  # a fresh head = the base LM head
    assert heads.draft(hidden[:, 0]).shape == (4, 3)


def _model_heads_prompts(head_std):
    """A random base model; heads fresh (copies of the base LM head) when head_std == 0, else random."""
    model = Llama(CONFIG, rngs=nnx.Rngs(3), std=0.3)
    heads = MedusaHeads(MedusaConfig(32, 32, num_heads=3), model.lm_head_weight())
    if head_std:
        params = checkpoint.param_dict(heads)
        keys = jax.random.split(jax.random.key(1), len(params))
        checkpoint.assign_params(heads, {name: head_std * jax.random.normal(key, value.shape, jnp.float32)
                                         for key, (name, value) in zip(keys, params.items())}, source="random")
    prompts = np.random.default_rng(2).integers(0, 32, (4, 7)).astype(np.int32)
    return model, heads, prompts


@pytest.mark.parametrize("head_std", [0.0, 0.5])
def test_medusa_chain_generation_equals_greedy(head_std):
    """Random base model; heads either fresh (they copy the base LM head, so repetitive continuations get
    accepted) or random (mostly rejected). Both must reproduce plain greedy decoding exactly."""
    model, heads, prompts = _model_heads_prompts(head_std)
    reference = greedy_reference(model, prompts, 30)
    np.testing.assert_array_equal(greedy_generate(model, prompts, 30, block_size=4), reference)
    tokens, stats = medusa_generate(model, heads, prompts, 30, block_size=4)
    np.testing.assert_array_equal(tokens, reference)
    assert stats.steps <= 30 and stats.accepted.max() <= 3
    if head_std == 0.0:
        assert stats.accepted[stats.running].sum() > 0  # the accept path was exercised


def test_bad_prompts_raise():
    model = Llama(CONFIG, rngs=nnx.Rngs(0))
    heads = MedusaHeads(MedusaConfig(32, 32, num_heads=2))
    with pytest.raises(ValueError, match="token ids must lie in"):
        medusa_generate(model, heads, np.array([[1, 32]]), 4)
    with pytest.raises(ValueError, match="token ids must lie in"):
        greedy_generate(model, np.array([[-3, 1]]), 4)
    with pytest.raises(ValueError, match=r"\[B, P\]"):
        greedy_generate(model, np.array([1, 2]), 4)
    with pytest.raises(ValueError, match="do not match"):
        medusa_generate(model, MedusaHeads(MedusaConfig(16, 32, num_heads=2)), np.array([[1, 2]]), 4)
    with pytest.raises(ValueError, match="do not match"):  # the tree path checks the heads too
        medusa_tree_generate(model, MedusaHeads(MedusaConfig(16, 32, num_heads=3)), np.array([[1, 2]]), 4, TREE)
    with pytest.raises(ValueError, match="rank 40 of a 32-token vocabulary"):
        medusa_tree_generate(model, heads, np.array([[1, 2]]), 4, DraftTree(((0,), (40,))))
    for size, error in ((0, ValueError), (-4, ValueError), (2.5, TypeError)):  # ZeroDivisionError, shape errors
        with pytest.raises(error, match="block_size"):
            greedy_generate(model, np.array([[1, 2]]), 4, block_size=size)
    with pytest.raises(TypeError, match="tree must be a DraftTree"):
        medusa_tree_generate(model, heads, np.array([[1, 2]]), 4, ((0,), (1,)))
    with pytest.raises(TypeError, match="heads must be MedusaHeads"):
        medusa_generate(model, None, np.array([[1, 2]]), 4)
    for ranks in (((0.5,),), ((True,),), (("a",),)):  # 0.5 silently became rank 0
        with pytest.raises(TypeError, match="int ranks"):
            DraftTree(ranks)
    assert DraftTree(((np.int64(1),),)).choices == ((1,),)
    for generate in (greedy_generate, greedy_reference):
        with pytest.raises(ValueError, match="num_new must be >= 0"):
            generate(model, np.array([[1, 2]]), -1)
        with pytest.raises(TypeError, match="num_new must be an int"):
            generate(model, np.array([[1, 2]]), 2.0)
        np.testing.assert_array_equal(generate(model, np.array([[1, 2]]), 0), [[1, 2]])  # nothing to generate


TREE = DraftTree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)))


def test_draft_tree_structure():
    assert TREE.num_slots == 8 and TREE.depth.tolist() == [0, 1, 1, 2, 2, 2, 3, 3]
    slots, valid = TREE.paths
    assert slots.tolist() == [[0, 1, 4, 0], [0, 2, 5, 0], [0, 1, 3, 6], [0, 1, 3, 7]]
    assert valid.sum(axis=1).tolist() == [3, 3, 4, 4]  # the padded slots are marked invalid
    assert TREE.mask[7].tolist() == [True, True, False, True, False, False, False, True]
    with pytest.raises(ValueError, match="no parent"):
        DraftTree(((0,), (1, 0)))


@pytest.mark.parametrize("head_std", [0.0, 0.5])
def test_medusa_tree_generation_equals_greedy(head_std):
    """Tree verification (tree mask, per-node RoPE positions, K/V moved from tree slots to sequence positions)
    reproduces plain greedy decoding exactly."""
    model, heads, prompts = _model_heads_prompts(head_std)
    tokens, stats = medusa_tree_generate(model, heads, prompts, 30, TREE, block_size=4)
    np.testing.assert_array_equal(tokens, greedy_reference(model, prompts, 30))
    if head_std == 0.0:
        assert stats.accepted[stats.running].sum() > 0
