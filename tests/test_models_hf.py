"""Our Llama against an independent implementation: Hugging Face `transformers.LlamaForCausalLM` (CPU torch).

Reference weights are drawn with a large std (0.3) and random norm weights: at the default std 0.02 a wrong RoPE
layout, `rope_theta` or epsilon moves logits by < 1e-2 and never the argmax, so the comparison could not fail.
We compare logits (max |ours - hf| / max |hf| <= 1e-4 in fp32), and check that the test *can* fail by perturbing
rope_theta and the norm epsilon. Positions are checked through paged decode deep into a sequence and through tree
verification, where every node's logits must equal a sequential HF forward over the prefix plus its ancestors.

Needs the test-only extra: `pip install -e ".[test,hf]"` (torch==2.13.0 CPU, transformers).
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch = pytest.importorskip("torch", reason='needs the hf extra: pip install -e ".[test,hf]"')
    transformers = pytest.importorskip("transformers", reason='needs the hf extra: pip install -e ".[test,hf]"')

from flax import nnx  # noqa: E402

from reference_models import checkpoint  # noqa: E402
from reference_models.llama import KVCache, Llama  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning")

VOCAB = 97
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
CONFIGS = {
    "gqa_untied": dict(num_key_value_heads=2, tie_word_embeddings=False, rope={"rope_type": "default"}),
    "mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True, rope={"rope_type": "default"}),
    "gqa_tied_llama3": dict(num_key_value_heads=1, tie_word_embeddings=True, rope=LLAMA3),
    "mha_untied_linear": dict(num_key_value_heads=4, tie_word_embeddings=False,
                              rope={"rope_type": "linear", "factor": 2.5}),
}


def max_rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def make_hf(name: str, seed: int = 0):
    spec = CONFIGS[name]
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=spec["num_key_value_heads"], rms_norm_eps=1e-3, max_position_embeddings=256,
        tie_word_embeddings=spec["tie_word_embeddings"], rope_parameters={"rope_theta": 300.0, **spec["rope"]},
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.3)
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    """tokens [B, T] -> logits [B, T, V] float32."""
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(HF model, our model loaded from its save_pretrained directory); one config is sharded."""
    hf = make_hf(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory, max_shard_size="40KB" if request.param == "gqa_untied" else "50MB")
    return hf, checkpoint.load_llama(directory)


def jitted_paged(model: Llama):
    """model.forward_paged, jitted over the parameters (one compilation per shape)."""
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda s, *args, tree_mask=None: nnx.merge(graphdef, s).forward_paged(*args, tree_mask=tree_mask))
    return lambda *args, **kw: fn(state, *args, **kw)


def test_dense_logits_match_hf(pair):
    hf, ours = pair
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 48)).astype(np.int32)
    ref = hf_logits(hf, tokens)
    got, _ = ours.forward_dense(jnp.asarray(tokens))
    assert max_rel_err(got, ref) <= 1e-4


def test_comparison_is_sensitive_to_rope_theta_and_eps(pair):
    """The parity test can fail: a wrong rope_theta or norm epsilon moves logits far beyond the tolerance."""
    hf, ours = pair
    tokens = np.random.default_rng(2).integers(0, VOCAB, (1, 40)).astype(np.int32)
    ref = hf_logits(hf, tokens)
    changes = [{"rope_theta": ours.config.rope_theta * 1.5}, {"rms_norm_eps": 1e-5}]
    if ours.config.rope_scaling is not None:
        changes.append({"rope_scaling": None})
    for change in changes:
        wrong = Llama(dataclasses.replace(ours.config, **change), rngs=nnx.Rngs(0))
        checkpoint.assign_params(wrong, checkpoint.param_dict(ours), source="perturbed")
        got, _ = wrong.forward_dense(jnp.asarray(tokens))
        assert max_rel_err(got, ref) > 1e-2, change


def test_paged_prefill_then_decode_matches_hf(pair):
    """Prefill a chunk into the paged cache, then decode one token at a time at positions 17..39."""
    hf, ours = pair
    tokens = np.random.default_rng(3).integers(0, VOCAB, (1, 40)).astype(np.int32)
    ref = hf_logits(hf, tokens)[0]
    cache = KVCache.zeros(ours.config, num_blocks=12, block_size=4)
    table = jnp.asarray([[7, 2, 9, 4, 11, 1, 3, 5, 10, 6]], jnp.int32)
    prefill = 17
    paged = jitted_paged(ours)
    logits, _, cache = paged(
        jnp.asarray(tokens[:, :prefill]), jnp.arange(prefill, dtype=jnp.int32)[None], cache, table,
        jnp.asarray([prefill], jnp.int32))
    assert max_rel_err(logits[0], ref[:prefill]) <= 1e-4
    for t in range(prefill, 40):
        logits, _, cache = paged(
            jnp.asarray(tokens[:, t:t + 1]), jnp.asarray([[t]], jnp.int32), cache, table,
            jnp.asarray([t + 1], jnp.int32))
        assert max_rel_err(logits[0, 0], ref[t]) <= 1e-4, t


# A tree of 7 draft nodes after the prefix: parents (-1 = child of the last prefix token).
TREE_PARENTS = [-1, 0, 0, 1, -1, 4, 3]


def test_tree_verification_matches_sequential_hf(pair):
    hf, ours = pair
    rng = np.random.default_rng(4)
    prefix = rng.integers(0, VOCAB, 21).astype(np.int32)
    nodes = rng.integers(0, VOCAB, len(TREE_PARENTS)).astype(np.int32)
    q = len(TREE_PARENTS)
    ancestors = []  # per node: its path from the root (ancestors then itself)
    for i, parent in enumerate(TREE_PARENTS):
        ancestors.append((ancestors[parent] if parent >= 0 else []) + [i])
    mask = np.zeros((1, q, q), bool)
    for i, path in enumerate(ancestors):
        mask[0, i, path] = True
    depth = np.array([len(p) - 1 for p in ancestors], np.int32)

    cache = KVCache.zeros(ours.config, num_blocks=16, block_size=4)
    table = jnp.asarray([[5, 12, 3, 9, 14, 1, 8, 2]], jnp.int32)
    p = len(prefix)
    _, _, cache = ours.forward_paged(jnp.asarray(prefix[None]), jnp.arange(p, dtype=jnp.int32)[None], cache, table,
                                     jnp.asarray([p], jnp.int32))
    logits, _, _ = ours.forward_paged(jnp.asarray(nodes[None]), jnp.asarray(p + depth[None]), cache, table,
                                      jnp.asarray([p + q], jnp.int32), tree_mask=jnp.asarray(mask))
    for i, path in enumerate(ancestors):
        sequence = np.concatenate([prefix, nodes[path]])[None]
        ref = hf_logits(hf, sequence)[0, -1]
        assert max_rel_err(logits[0, i], ref) <= 1e-4, (i, path)


def test_our_saved_checkpoint_loads_in_hf(tmp_path):
    """The other direction: weights we save (here the shipped model's) are a valid HF checkpoint."""
    from reference_models.train import WEIGHTS_DIR

    ours = checkpoint.load_llama(WEIGHTS_DIR / "tiny_llama")
    checkpoint.save_llama(ours, tmp_path, max_shard_params=300_000)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    tokens = np.frombuffer(b"Return the number of items in the sequence.", np.uint8).astype(np.int32)[None]
    got, _ = ours.forward_dense(jnp.asarray(tokens))
    assert max_rel_err(got, hf_logits(hf, tokens)) <= 1e-4
