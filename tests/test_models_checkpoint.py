"""Weights in and out: our own save/load round trip (single file and sharded, float32 and bfloat16), the loaders'
dtype ("auto" keeps the checkpoint's, or a cast), the two Medusa layouts (FasterDecoding's and vLLM's), and strict
loading (unknown tensors, missing tensors or shards, shape mismatches, pickles and bad arguments are named)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
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
    with pytest.raises(ValueError, match=r"h\.pt: pickled PyTorch weights are not read.*\.safetensors file"):
        checkpoint.load_medusa(bare / "h.pt")


# ------------------------------------------------------------------------------------------------------- dtypes


def _bits(x) -> np.ndarray:
    """The raw bits of an array (bitwise comparison, bfloat16 included)."""
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _assert_params_bitwise_equal(got, want) -> None:
    want = checkpoint.param_dict(want)
    got = checkpoint.param_dict(got)
    assert got.keys() == want.keys()
    for name, value in got.items():
        assert value.dtype == want[name].dtype, name
        np.testing.assert_array_equal(_bits(value), _bits(want[name]), err_msg=name)


@pytest.fixture(scope="module")
def bf16_model():
    return Llama(CONFIG, rngs=nnx.Rngs(4), std=0.3, dtype=jnp.bfloat16)


@pytest.mark.parametrize("max_shard_params", [None, 700])
def test_a_bfloat16_save_loads_back_bitwise_in_its_own_dtype(bf16_model, tmp_path, max_shard_params):
    """bf16 parameters are written as BF16, config.json says so, and dtype="auto" gives them back bit for bit;
    dtype="float32" (or jnp.float32) gives their exact upcast."""
    checkpoint.save_llama(bf16_model, tmp_path, max_shard_params=max_shard_params)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["torch_dtype"] == hf["dtype"] == "bfloat16"
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 1 if max_shard_params is None else len(files) > 2
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"BF16"}, file
    if max_shard_params:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == 2 * CONFIG.num_params  # bytes
    loaded = checkpoint.load_llama(tmp_path)
    _assert_params_bitwise_equal(loaded, bf16_model)
    np.testing.assert_array_equal(loaded.forward_dense(TOKENS)[0], bf16_model.forward_dense(TOKENS)[0])
    for dtype in ("float32", jnp.float32):
        upcast = checkpoint.param_dict(checkpoint.load_llama(tmp_path, dtype=dtype))
        for name, value in checkpoint.param_dict(bf16_model).items():
            assert upcast[name].dtype == jnp.float32, name
            np.testing.assert_array_equal(upcast[name], np.asarray(value).astype(np.float32), err_msg=name)


def test_a_float32_checkpoint_loads_cast_to_bfloat16(model, tmp_path):
    """dtype="bfloat16" rounds each float32 parameter once; the logits stay float32, near the float32 model's,
    with the same greedy tokens."""
    checkpoint.save_llama(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"
    assert checkpoint.param_dict(checkpoint.load_llama(tmp_path))["norm.weight"].dtype == jnp.float32
    for dtype in ("bfloat16", jnp.bfloat16):
        cast = checkpoint.load_llama(tmp_path, dtype=dtype)
        want = checkpoint.param_dict(model)
        for name, value in checkpoint.param_dict(cast).items():
            assert value.dtype == jnp.bfloat16, name
            np.testing.assert_array_equal(_bits(value), _bits(want[name].astype(jnp.bfloat16)), err_msg=name)
    got, ref = np.asarray(cast.forward_dense(TOKENS)[0]), np.asarray(model.forward_dense(TOKENS)[0])
    assert got.dtype == np.float32
    assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max()
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def test_auto_takes_float16_as_float32_and_a_mixed_checkpoint_by_its_majority(model, tmp_path):
    checkpoint.save_llama(model, tmp_path)
    want = checkpoint.param_dict(model)
    _rewrite(tmp_path, lambda t: t.update({k: v.astype(np.float16) for k, v in t.items()}))
    loaded = checkpoint.param_dict(checkpoint.load_llama(tmp_path))  # float16 widens exactly
    for name, value in loaded.items():
        assert value.dtype == jnp.float32, name
        np.testing.assert_array_equal(value, np.asarray(want[name]).astype(np.float16).astype(np.float32))
    # Norms in float32 beside bfloat16 matrices (most of the elements): bfloat16.
    _rewrite(tmp_path, lambda t: t.update({k: v.astype(np.float32 if "norm" in k else jnp.bfloat16)
                                           for k, v in t.items()}))
    loaded = checkpoint.param_dict(checkpoint.load_llama(tmp_path))
    assert {v.dtype for v in loaded.values()} == {jnp.dtype(jnp.bfloat16)}
    # Another dtype (jax reads float64 as float32 unless x64 is on; safetensors' flax reader lacks float8).
    with pytest.raises(ValueError, match=r"ckpt: parameters stored as float64.*dtype='float32'"):
        checkpoint.stored_dtype({"w": np.zeros(3, np.float64), "b": np.zeros(2, np.float32)}, "ckpt")


@pytest.mark.parametrize("dtype", ["float16", "fp32", "bf16 ", None, jnp.int32, jnp.float16, 32])
def test_a_bad_dtype_is_refused_naming_the_argument(model, tmp_path, dtype):
    checkpoint.save_llama(model, tmp_path / "llama")
    checkpoint.save_medusa(MedusaHeads(MedusaConfig(16, 40, num_heads=2)), tmp_path / "medusa")
    with pytest.raises(ValueError, match=r"dtype must be one of \('auto', 'float32', 'bfloat16'\)"):
        checkpoint.load_llama(tmp_path / "llama", dtype=dtype)
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        checkpoint.load_medusa(tmp_path / "medusa", dtype=dtype)


def test_an_index_naming_a_missing_shard_is_refused_naming_it(model, tmp_path):
    checkpoint.save_llama(model, tmp_path, max_shard_params=700)
    index = tmp_path / "model.safetensors.index.json"
    shard = sorted(tmp_path.glob("model-*-of-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=rf"{index}: names shard\(s\) \['{shard.name}'\]"):
        checkpoint.load_llama(tmp_path)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=rf"{index}: not a safetensors index"):
        checkpoint.load_llama(tmp_path)


# ------------------------------------------------------------------------------------------------ Medusa layouts


def _random_heads(dtype=jnp.float32, num_heads=3, num_layers=2) -> MedusaHeads:
    heads = MedusaHeads(MedusaConfig(16, 40, num_heads=num_heads, num_layers=num_layers), dtype=dtype)
    rng = np.random.default_rng(5)
    params = nnx.state(heads, nnx.Param)
    nnx.update(heads, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.3, dtype), params))
    return heads


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_vllm_medusa_layout_loads_the_same_heads(tmp_path, dtype):
    """Heads saved in both layouts load to the same parameters (bit for bit, in their own dtype) and outputs;
    the vLLM save holds vLLM's names, and its file alone (no config.json) or prefixed names load too."""
    heads = _random_heads(dtype)
    checkpoint.save_medusa(heads, tmp_path / "fd")
    checkpoint.save_medusa(heads, tmp_path / "vllm", layout="vllm")
    hf = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert hf["architectures"] == ["MedusaModel"] and (hf["num_heads"], hf["num_hidden_layers"]) == (3, 2)
    assert hf["truncated_vocab_size"] == hf["vocab_size"] == 40 and hf["dtype"] == jnp.dtype(dtype).name
    names = set(load_file(str(tmp_path / "vllm" / "model.safetensors")))
    assert names == ({f"blocks.{i}.layers.{j}.{k}" for i in range(3) for j in range(2) for k in ("weight", "bias")}
                     | {f"lm_heads.{i}.weight" for i in range(3)})
    fd, vllm = checkpoint.load_medusa(tmp_path / "fd"), checkpoint.load_medusa(tmp_path / "vllm")
    assert fd.config == vllm.config == heads.config
    _assert_params_bitwise_equal(fd, heads)
    _assert_params_bitwise_equal(vllm, heads)
    hidden = jnp.asarray(np.random.default_rng(6).normal(size=(2, 16)), dtype)
    np.testing.assert_array_equal(vllm(hidden), fd(hidden))
    np.testing.assert_array_equal(vllm(hidden), heads(hidden))

    bare = tmp_path / "bare"
    bare.mkdir()
    tensors = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    save_file({f"medusa_heads.{k}": v for k, v in tensors.items()}, str(bare / "heads.safetensors"))
    _assert_params_bitwise_equal(checkpoint.load_medusa(bare / "heads.safetensors"), heads)
    up = checkpoint.load_medusa(tmp_path / "vllm", dtype="float32")
    assert {v.dtype for v in checkpoint.param_dict(up).values()} == {jnp.dtype(jnp.float32)}


def test_vllm_medusa_without_biases_and_with_one_shared_lm_head(tmp_path):
    """medusa_fc_bias unset: vLLM's layers have no bias (zero here); original_lm_head: lm_heads.0 serves every head.
    Shards with an index load too."""
    heads = _random_heads()
    checkpoint.save_medusa(heads, tmp_path, layout="vllm")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    lm = tensors["lm_heads.0.weight"]
    kept = {k: v for k, v in tensors.items() if not k.endswith(".bias") and k.startswith("blocks.")}
    (tmp_path / "model.safetensors").unlink()
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({"lm_heads.0.weight": lm}, str(tmp_path / first))
    save_file(kept, str(tmp_path / second))
    weight_map = {k: second for k in kept} | {"lm_heads.0.weight": first}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(hf | {"medusa_fc_bias": False, "original_lm_head": True}))
    loaded = checkpoint.param_dict(checkpoint.load_medusa(tmp_path))
    for i in range(3):
        np.testing.assert_array_equal(loaded[f"heads.{i}.lm_head.weight"], lm)
        for j in range(2):
            np.testing.assert_array_equal(loaded[f"heads.{i}.blocks.{j}.linear.weight"],
                                          tensors[f"blocks.{i}.layers.{j}.weight"])
            np.testing.assert_array_equal(loaded[f"heads.{i}.blocks.{j}.linear.bias"], np.zeros(16, np.float32))


def test_medusa_checkpoints_we_cannot_serve_are_refused_naming_why(tmp_path):
    heads = _random_heads()
    vllm = tmp_path / "vllm"
    checkpoint.save_medusa(heads, vllm, layout="vllm")
    hf = json.loads((vllm / "config.json").read_text())
    (vllm / "config.json").write_text(json.dumps(hf | {"truncated_vocab_size": 32}))
    with pytest.raises(ValueError, match=r"truncated_vocab_size 32 differs from vocab_size 40.*not supported"):
        checkpoint.load_medusa(vllm)
    (vllm / "config.json").write_text(json.dumps(hf | {"medusa_fc_bias": False}))
    with pytest.raises(ValueError, match=r"'blocks\.0\.layers\.0\.bias' is a bias, but medusa_fc_bias is not set"):
        checkpoint.load_medusa(vllm)
    (vllm / "config.json").write_text(json.dumps(hf | {"num_heads": 2}))
    with pytest.raises(ValueError, match=r"unknown tensor\(s\) \['blocks\.2\.layers\.0\.bias'"):
        checkpoint.load_medusa(vllm)
    (vllm / "config.json").write_text(json.dumps(hf | {"hidden_size": 32}))
    with pytest.raises(ValueError, match=r"hidden_size is 32, but tensor 'lm_heads\.0\.weight'"):
        checkpoint.load_medusa(vllm)
    with pytest.raises(ValueError, match=r"layout must be one of \('fasterdecoding', 'vllm'\), got 'hf'"):
        checkpoint.save_medusa(heads, tmp_path / "x", layout="hf")

    # Pickles: the file itself, or a checkpoint directory holding one instead of its safetensors.
    (vllm / "model.safetensors").rename(vllm / "pytorch_model.bin")
    with pytest.raises(ValueError, match=rf"{vllm / 'pytorch_model.bin'}: pickled PyTorch weights are not read"):
        checkpoint.load_medusa(vllm)
    fd = tmp_path / "fd"
    checkpoint.save_medusa(heads, fd)
    (fd / checkpoint.MEDUSA_WEIGHTS).rename(fd / "medusa_lm_head.pt")
    for path in (fd, fd / "medusa_lm_head.pt"):
        with pytest.raises(ValueError, match=r"medusa_lm_head\.pt: pickled .* safetensors\.torch\.save_file"):
            checkpoint.load_medusa(path)


def test_the_cli_loads_a_checkpoint_in_its_own_dtype_or_the_one_asked(tmp_path):
    """`--dtype auto` (the default) serves a --model / --medusa checkpoint in its own dtype, float32 or bfloat16
    cast; the oracle cache's key names a dtype other than float32."""
    import argparse

    from skvs_jax.commands import checkpoints

    byte_config = dataclasses.replace(CONFIG, vocab_size=256)
    checkpoint.save_llama(Llama(byte_config, rngs=nnx.Rngs(7), dtype=jnp.bfloat16), tmp_path / "llama")
    checkpoint.save_medusa(MedusaHeads(MedusaConfig(16, 256, num_heads=2)), tmp_path / "medusa", layout="vllm")
    parser = argparse.ArgumentParser()
    checkpoints.add_arguments(parser)
    for flags, model_dtype, heads_dtype in (([], "bfloat16", "float32"), (["--dtype", "float32"], "float32", "float32"),
                                            (["--dtype", "bfloat16"], "bfloat16", "bfloat16")):
        args = parser.parse_args(["--model", str(tmp_path / "llama"), "--medusa", str(tmp_path / "medusa"), *flags])
        loaded = checkpoints.load(args)
        assert loaded.model.embed_tokens.embedding.dtype == model_dtype, flags
        assert loaded.heads.heads[0].lm_head.weight.dtype == heads_dtype, flags
        assert loaded.key.endswith(" bfloat16") == (model_dtype == "bfloat16"), flags
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float16"])
