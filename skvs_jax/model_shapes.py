"""Named model shapes: the one registry the engine and the simulator share.

Each entry is the architecture part of a published Hugging Face `config.json`, copied by hand (nothing is
downloaded): the engine builds a `reference_models.LlamaConfig` from it (`LlamaConfig.from_hf_dict`) and
initialises random weights on the device (`serve.model_runner.LlamaMedusaRunner.from_shape`); the simulator builds
its `sim.specs.ModelSpec` from the same dict (`ModelSpec.from_hf_config`). One dict per model, so a shape the
engine serves and the shape the simulator prices cannot drift apart.

`hf_config(name, num_layers=...)` returns a copy, optionally cut to fewer layers: a Llama-3.2-1B with 2 of its
16 layers has every per-layer cost of the real one at an eighth of the weights, which is what a CPU can serve.
"""

from __future__ import annotations

import copy
from typing import Any

from skvs_jax import checks

_LLAMA3_VOCAB = 128256


def _llama3(hidden: int, intermediate: int, layers: int, heads: int, head_dim: int, *, tie: bool,
            rope_factor: float | None, max_positions: int) -> dict[str, Any]:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": _LLAMA3_VOCAB, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": head_dim,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": None, "tie_word_embeddings": tie,
        "max_position_embeddings": max_positions, "bos_token_id": 128000, "eos_token_id": 128001,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
    }
    if rope_factor is not None:
        config["rope_scaling"] = {"rope_type": "llama3", "factor": rope_factor, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return config


SHAPES: dict[str, dict[str, Any]] = {
    # huggingface.co/meta-llama/Llama-3.2-1B, config.json (1,235,814,400 parameters; tied embeddings).
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, 64, tie=True, rope_factor=32.0, max_positions=131072),
    # huggingface.co/meta-llama/Llama-3.2-3B, config.json (3,212,749,824 parameters; tied embeddings).
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, 128, tie=True, rope_factor=32.0, max_positions=131072),
    # huggingface.co/meta-llama/Llama-3.1-8B, config.json (8,030,261,248 parameters).
    "llama-3.1-8b": _llama3(4096, 14336, 32, 32, 128, tie=False, rope_factor=8.0, max_positions=131072),
    # huggingface.co/meta-llama/Meta-Llama-3-70B, config.json (70,553,706,496 parameters; no RoPE scaling).
    "llama-3-70b": _llama3(8192, 28672, 80, 64, 128, tie=False, rope_factor=None, max_positions=8192),
    # The shipped model: reference_models/weights/tiny_llama/config.json (float32, byte vocabulary).
    "tiny": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": 256, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": True, "max_position_embeddings": 1024,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    },
}


def hf_config(name: str, num_layers: int | None = None) -> dict[str, Any]:
    """A copy of shape `name`'s config dict, with `num_hidden_layers` cut to `num_layers` when given (1 ..
    the model's own). ValueError naming the argument for an unknown shape or a bad layer count."""
    if name not in SHAPES:
        raise ValueError(f"model shape must be one of {sorted(SHAPES)}, got {name!r}")
    config = copy.deepcopy(SHAPES[name])
    if num_layers is not None:
        full = config["num_hidden_layers"]
        if not checks.is_int(num_layers) or not 1 <= num_layers <= full:
            raise ValueError(f"num_layers must be an int in [1, {full}] for {name}, got {num_layers!r}")
        config["num_hidden_layers"] = int(num_layers)
    return config


def parse(spec: str) -> tuple[str, int | None]:
    """'llama-3.2-1b' or 'llama-3.2-1b:2' (the first 2 layers) -> (name, num_layers or None); ValueError naming
    the spec otherwise."""
    name, _, layers = str(spec).partition(":")
    if layers and not layers.isdigit():
        raise ValueError(f"model shape must be NAME or NAME:LAYERS, got {spec!r}")
    num_layers = int(layers) if layers else None
    hf_config(name, num_layers)  # validates
    return name, num_layers
