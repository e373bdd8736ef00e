"""Weights in and out: our own save/load round trip (single file and sharded), the Medusa checkpoint layout,
and strict loading (unknown tensors, missing tensors, shape mismatches are named)."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from reference_models import checkpoint
from reference_models.llama import Llama, LlamaConfig
from reference_models.medusa import MedusaConfig, MedusaHeads

CONFIG = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2, num_kv_heads=1)
TOKENS = jnp.asarray([[1, 5, 9, 39, 0, 7]], jnp.int32)


@pytest.fixture(scope="module")
def model():
    return Llama(CONFIG, rngs=nnx.Rngs(1), std=0.3)


@pytest.mark.parametrize("max_shard_params", [None, 700])
def test_llama_round_trip(model, tmp_path, max_shard_params):
    checkpoint.save_llama(model, tmp_path, max_shard_params=max_shard_params)
    if max_shard_params:
        assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) == 2 + 9 * 2 + 1
        assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    loaded = checkpoint.load_llama(tmp_path)
    assert loaded.config == CONFIG
    np.testing.assert_array_equal(loaded.forward_dense(TOKENS)[0], model.forward_dense(TOKENS)[0])


def test_a_later_save_replaces_the_earlier_weights(model, tmp_path):
    """Sharded, then single-file, then sharded again into one directory: each load gives the last model saved,
    in load_llama and in the file layout transformers reads (a stale index or model.safetensors used to win)."""
    other = Llama(CONFIG, rngs=nnx.Rngs(2), std=0.3)
    for saved, shards in ((model, 700), (other, None), (model, 700)):
        checkpoint.save_llama(saved, tmp_path, max_shard_params=shards)
        assert (tmp_path / "model.safetensors").exists() == (shards is None)
        assert (tmp_path / "model.safetensors.index.json").exists() == (shards is not None)
        got = checkpoint.load_llama(tmp_path).forward_dense(TOKENS)[0]
        np.testing.assert_array_equal(got, saved.forward_dense(TOKENS)[0])


def test_a_tied_checkpoint_may_carry_its_lm_head_copy(tmp_path):
    tied = Llama(dataclasses.replace(CONFIG, tie_word_embeddings=True), rngs=nnx.Rngs(3), std=0.3)
    checkpoint.save_llama(tied, tmp_path)
    embed = load_file(str(tmp_path / "model.safetensors"))["model.embed_tokens.weight"]
    _rewrite(tmp_path, lambda t: t.update({"lm_head.weight": embed}))  # as some exporters write it
    np.testing.assert_array_equal(checkpoint.load_llama(tmp_path).forward_dense(TOKENS)[0],
                                  tied.forward_dense(TOKENS)[0])
    _rewrite(tmp_path, lambda t: t.update({"lm_head.weight": embed + 1}))
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        checkpoint.load_llama(tmp_path)


def _rewrite(tmp_path, edit):
    tensors = load_file(str(tmp_path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})


def test_unknown_missing_and_misshapen_tensors_are_named(model, tmp_path):
    checkpoint.save_llama(model, tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(16, np.float32)}))
    with pytest.raises(ValueError, match=r"unknown tensor.*layers\.0\.self_attn\.q_proj\.bias"):
        checkpoint.load_llama(tmp_path)
    checkpoint.save_llama(model, tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor.*layers\.1\.mlp\.up_proj\.weight"):
        checkpoint.load_llama(tmp_path)
    checkpoint.save_llama(model, tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"model.norm.weight": np.ones(17, np.float32)}))
    with pytest.raises(ValueError, match=r"'norm\.weight' has shape \(17,\), expected \(16,\)"):
        checkpoint.load_llama(tmp_path)


def test_medusa_round_trip_and_original_layout(model, tmp_path):
    mcfg = MedusaConfig(hidden_size=16, vocab_size=40, num_heads=3, num_layers=2)
    heads = MedusaHeads(mcfg, model.lm_head_weight())
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 16)).astype(np.float32))
    # Random weights in the FasterDecoding/Medusa layout (prefixed, as saved from the whole MedusaModel).
    raw = {}
    for i in range(3):
        for j in range(2):
            raw[f"medusa_head.{i}.{j}.linear.weight"] = rng.normal(size=(16, 16)).astype(np.float32) * 0.3
            raw[f"medusa_head.{i}.{j}.linear.bias"] = rng.normal(size=16).astype(np.float32) * 0.3
        raw[f"medusa_head.{i}.2.weight"] = rng.normal(size=(40, 16)).astype(np.float32)
    (tmp_path / "orig").mkdir()
    save_file(raw, str(tmp_path / "orig" / checkpoint.MEDUSA_WEIGHTS), metadata={"format": "pt"})
    (tmp_path / "orig" / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2}))
    loaded = checkpoint.load_medusa(tmp_path / "orig")

    # Independent numpy Medusa-1 head: x <- x + SiLU(W x + b) per block, then the head's own LM head.
    silu = lambda x: x / (1.0 + np.exp(-x))  # noqa: E731
    for i in range(3):
        x = np.asarray(hidden, np.float64)
        for j in range(2):
            x = x + silu(x @ raw[f"medusa_head.{i}.{j}.linear.weight"].T + raw[f"medusa_head.{i}.{j}.linear.bias"])
        np.testing.assert_allclose(loaded(hidden)[i], x @ raw[f"medusa_head.{i}.2.weight"].T, rtol=1e-5, atol=1e-5)

    checkpoint.save_medusa(loaded, tmp_path / "ours")
    again = checkpoint.load_medusa(tmp_path / "ours")
    np.testing.assert_array_equal(again(hidden), loaded(hidden))
    assert heads(hidden).shape == (3, 2, 40)

    raw["medusa_head.0.5.linear.weight"] = raw.pop("medusa_head.0.0.linear.weight")
    save_file(raw, str(tmp_path / "orig" / checkpoint.MEDUSA_WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"medusa_head\.0\.5\.linear\.weight"):
        checkpoint.load_medusa(tmp_path / "orig")
    raw["medusa_head.0.0.linear.weight"] = raw.pop("medusa_head.0.5.linear.weight")
    raw["0.0.linear.bias"] = raw["medusa_head.0.0.linear.bias"] + 7.0  # the same parameter, unprefixed
    save_file(raw, str(tmp_path / "orig" / checkpoint.MEDUSA_WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="are the same parameter") as err:
        checkpoint.load_medusa(tmp_path / "orig")
    assert "'medusa_head.0.0.linear.bias'" in str(err.value) and "'0.0.linear.bias'" in str(err.value)


def test_medusa_loads_from_its_file_and_finds_its_base_model(tmp_path):
    """`load_medusa` takes the safetensors file too: its layout from a Medusa config.json beside it, else from the
    tensor names. `medusa_base_model` resolves base_model_name_or_path as a path, else beside the checkpoint;
    a name that is no local directory (a hub id) is an error, none is None."""
    heads = MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=12, num_heads=3, num_layers=2),
                        lm_head_init=jnp.arange(96, dtype=jnp.float32).reshape(12, 8))
    checkpoint.save_llama(Llama(CONFIG, rngs=nnx.Rngs(1)), tmp_path / "base")
    checkpoint.save_medusa(heads, tmp_path / "heads", base_model="base")
    want = checkpoint.param_dict(heads)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "h.safetensors").write_bytes((tmp_path / "heads" / checkpoint.MEDUSA_WEIGHTS).read_bytes())
    for source in (tmp_path / "heads", tmp_path / "heads" / checkpoint.MEDUSA_WEIGHTS, bare / "h.safetensors"):
        loaded = checkpoint.load_medusa(source)
        assert loaded.config == heads.config, source
        for name, value in checkpoint.param_dict(loaded).items():
            np.testing.assert_array_equal(value, want[name])
    assert checkpoint.medusa_base_model(tmp_path / "heads") == tmp_path / "base"
    assert checkpoint.medusa_base_model(tmp_path / "heads" / checkpoint.MEDUSA_WEIGHTS) == tmp_path / "base"
    assert checkpoint.medusa_base_model(bare / "h.safetensors") is None
    checkpoint.save_medusa(heads, tmp_path / "hub", base_model="FasterDecoding/medusa-vicuna-7b-v1.3")
    with pytest.raises(ValueError, match="not a local model directory"):
        checkpoint.medusa_base_model(tmp_path / "hub")
    (bare / "h.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"\.safetensors file"):
        checkpoint.load_medusa(bare / "h.pt")
