"""The named model shapes (`skvs_jax.model_shapes`): the published parameter counts, one registry for the engine's
`LlamaConfig` and the simulator's `ModelSpec`, and bad names refused by the argument's name."""

import pytest

from reference_models.llama import LlamaConfig
from skvs_jax import model_shapes
from skvs_jax.sim import specs

PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
             "llama-3-70b": 70_553_706_496, "tiny": 771_200}


@pytest.mark.parametrize("name", sorted(model_shapes.SHAPES))
def test_engine_and_simulator_read_the_same_shape_with_its_published_size(name):
    config, spec = LlamaConfig.from_hf_dict(model_shapes.hf_config(name)), specs.MODELS[name]
    assert config.num_params == spec.param_count == PUBLISHED[name]
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.intermediate_size, config.vocab_size) == (
        spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size,
        spec.vocab_size)


def test_a_shape_cut_to_fewer_layers_and_bad_specs():
    assert model_shapes.parse("llama-3.2-1b:2") == ("llama-3.2-1b", 2)
    assert model_shapes.parse("llama-3.1-8b") == ("llama-3.1-8b", None)
    cut = model_shapes.hf_config("llama-3.2-1b", 2)
    assert cut["num_hidden_layers"] == 2 and model_shapes.SHAPES["llama-3.2-1b"]["num_hidden_layers"] == 16
    cut["hidden_size"] = 1  # a copy: the registry is untouched
    assert model_shapes.SHAPES["llama-3.2-1b"]["hidden_size"] == 2048
    for bad, says in (("llama-9", "model shape"), ("llama-3.2-1b:0", "num_layers"), ("llama-3.2-1b:17", "num_layers"),
                      ("llama-3.2-1b:x", "NAME:LAYERS")):
        with pytest.raises(ValueError, match=says):
            model_shapes.parse(bad)


def test_skvs_simulate_prices_the_shape_bench_serves():
    import argparse

    from skvs_jax.commands import simulate

    spec = simulate.model_spec(argparse.Namespace(model="llama-3.1-8b", model_shape="llama-3.2-1b:2"))
    assert (spec.name, spec.num_layers, spec.hidden_size, spec.num_medusa_heads) == ("llama-3.2-1b:2", 2, 2048, 4)
    assert simulate.model_spec(argparse.Namespace(model="tiny", model_shape="llama-3.1-8b")) is specs.MODELS[
        "llama-3.1-8b"]
    with pytest.raises(SystemExit, match="skvs simulate: --model-shape: model shape must be one of"):
        simulate.model_spec(argparse.Namespace(model="tiny", model_shape="gpt-9"))
