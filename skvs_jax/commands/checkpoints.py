"""The model a command serves: `--model DIR` (a Hugging Face Llama directory) and `--medusa DIR_OR_FILE` (Medusa
heads), or `--model-shape NAME[:LAYERS]` (a real model's shape from `skvs_jax.model_shapes` with random weights
initialised from `--weight-seed`, nothing downloaded), or the shipped tiny Llama and its heads when none is given;
shared by `skvs generate` and `skvs bench`. `--dtype` is the weights' dtype: auto (a checkpoint's own; float32 for
--model-shape and the shipped model, which are float32), float32 or bfloat16.

`--drafter oracle:PROFILE` (bench) drafts with `serve.oracle_drafter` instead of Medusa heads: PROFILE is a preset of
`sim.acceptance_model.PRESETS` or per-depth probabilities "0.8,0.6,..."; the oracle's reference pass (the trace
served without speculation) is cached on disk by the model and the trace (`oracle_table`).

A Medusa checkpoint alone brings its base model when its config.json's `base_model_name_or_path` is a local
directory (`reference_models.checkpoint.medusa_base_model`). `skvs generate` encodes text with the checkpoint's
tokenizer (bytes without one); `skvs bench` serves byte prompts, so it needs a vocabulary of 256 tokens
(`BYTE_VOCAB`). The draft length defaults to the heads' count, and the longest sequence to the model's
`max_position_embeddings`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
from typing import Any

import numpy as np

from reference_models import checkpoint
from reference_models.llama import Llama
from reference_models.medusa import MedusaHeads
from skvs_jax import model_shapes

ORACLE_CACHE_ENV = "SKVS_ORACLE_CACHE"  # where reference passes are kept (default ~/.cache/skvs_jax/oracle; "off")

BYTE_VOCAB = 256  # `skvs bench`'s prompts are bytes (text of the shipped corpus)


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What a command serves, and how to name it in its report."""

    model: Llama
    heads: Any  # MedusaHeads (random ones for --model-shape), an OracleDrafter (bench builds it), or None
    name: str  # "shipped tiny Llama + Medusa", the directories, or the shape
    oracle: tuple[float, ...] | None = None  # --drafter oracle:PROFILE's probabilities (K of them), before the table
    key: str = ""  # what identifies the weights (the oracle cache's key): the shape, dtype and seed, or the paths
    dtype: str = "float32"  # the weights' dtype as loaded (what --dtype auto resolved to)

    @property
    def num_heads(self) -> int:
        if self.oracle is not None:
            return len(self.oracle)
        return 0 if self.heads is None else self.heads.config.num_heads

    @property
    def max_positions(self) -> int:
        return self.model.config.max_position_embeddings


def add_arguments(parser: argparse.ArgumentParser, *, drafter: bool = False) -> None:
    parser.add_argument("--model-shape", metavar="NAME[:LAYERS]", default=None,
                        help=f"serve a real model's shape with random weights (nothing downloaded): one of "
                             f"{sorted(model_shapes.SHAPES)}, optionally cut to its first LAYERS layers")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="the weights' dtype: auto is a --model / --medusa checkpoint's own (float16 loads as "
                             "float32), and float32 for --model-shape and the shipped model; float32 or bfloat16 "
                             "casts (the KV cache's dtype is its own switch)")
    parser.add_argument("--weight-seed", type=int, default=0, help="seed of --model-shape's random weights")
    if drafter:
        parser.add_argument("--drafter", default="heads", metavar="heads|oracle:PROFILE",
                            help="what drafts: the Medusa heads, or the oracle drafter at an acceptance PROFILE (a "
                                 "preset: medusa-1, medusa-2, tiny; or per-depth probabilities 0.8,0.6,...), "
                                 "needed by --model-shape, whose random weights have no heads")
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="a Hugging Face Llama checkpoint directory (config.json + safetensors); default: the "
                             "shipped tiny Llama, or the base model the --medusa config names")
    parser.add_argument("--medusa", metavar="DIR_OR_FILE", default=None,
                        help="Medusa heads: a directory (config.json + medusa_lm_head.safetensors, or vLLM's "
                             "model.safetensors) or the safetensors file; default: the shipped heads when --model "
                             "is not given either")


def load(args: argparse.Namespace) -> Loaded:
    """The model and heads `args.model` / `args.medusa` / `args.model_shape` name, in `args.dtype`, with
    `args.drafter`'s oracle probabilities when it names one. Raises ValueError (or OSError for a missing file) with a
    message that names the flag."""
    import jax
    from flax import nnx

    loaded = _load_model(args)
    dtype = checkpoint.majority_dtype(jax.tree.leaves(nnx.state(loaded.model, nnx.Param))).name
    loaded = dataclasses.replace(loaded, dtype=dtype)
    if dtype != "float32":  # the weights differ from the float32 ones the key names
        loaded = dataclasses.replace(loaded, key=f"{loaded.key} {dtype}")
    drafter = getattr(args, "drafter", "heads")
    if drafter == "heads":
        return loaded
    kind, _, profile = drafter.partition(":")
    if kind != "oracle" or not profile:
        raise ValueError(f"--drafter must be heads or oracle:PROFILE, got {drafter!r}")
    from skvs_jax.sim import acceptance_model

    k = draft_len(args, loaded)
    try:
        probs = acceptance_model.parse_profile(profile, k)
    except ValueError as err:
        raise ValueError(f"--drafter {drafter}: {err}") from None
    return dataclasses.replace(loaded, oracle=probs, name=f"{loaded.name}, oracle drafter {profile} (K = {k})")


def cast(model, dtype: str):
    """`model` with every parameter cast to `dtype` (in place; returned for chaining)."""
    import jax
    from flax import nnx

    nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), nnx.state(model, nnx.Param)))
    return model


def _load_model(args: argparse.Namespace) -> Loaded:
    shape = getattr(args, "model_shape", None)
    dtype = getattr(args, "dtype", "auto")
    if shape is not None:
        if args.model is not None or args.medusa is not None:
            raise ValueError("--model-shape serves random weights of a named shape: pass it without --model / --medusa")
        return random_model(shape, args.weight_seed, "float32" if dtype == "auto" else dtype)
    if args.model is None and args.medusa is None:
        model, heads = checkpoint.load_shipped(dtype)
        return Loaded(model, heads, "shipped tiny Llama + Medusa", key="shipped")
    heads = None
    model_dir = args.model
    if args.medusa is not None:
        heads = checkpoint.load_medusa(args.medusa, dtype)
        if model_dir is None:
            model_dir = checkpoint.medusa_base_model(args.medusa)
            if model_dir is None:
                raise ValueError(f"--medusa {args.medusa}: its config names no base model "
                                 "(base_model_name_or_path); pass --model DIR")
    if not pathlib.Path(model_dir).is_dir():
        raise ValueError(f"--model {model_dir}: not a directory")
    model = checkpoint.load_llama(model_dir, dtype)
    cfg = model.config
    if heads is not None and (heads.config.hidden_size, heads.config.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
        raise ValueError(f"--medusa {args.medusa}: heads for hidden size {heads.config.hidden_size} and vocabulary "
                         f"{heads.config.vocab_size}, but the model has {cfg.hidden_size} and {cfg.vocab_size}")
    name = f"{model_dir}" + ("" if heads is None else f" + Medusa {args.medusa} ({heads.config.num_heads} heads)")
    return Loaded(model, heads, name, key=f"{pathlib.Path(model_dir).absolute()}")


def random_model(spec: str, seed: int, dtype: str = "float32") -> Loaded:
    """--model-shape: the named shape (NAME or NAME:LAYERS) with random weights from `seed`, created in `dtype` on
    the default device (no float32 copy of a bfloat16 model is made)."""
    import jax.numpy as jnp
    from flax import nnx

    from reference_models.llama import LlamaConfig

    try:
        name, layers = model_shapes.parse(spec)
    except ValueError as err:
        raise ValueError(f"--model-shape: {err}") from None
    config = LlamaConfig.from_hf_dict(model_shapes.hf_config(name, layers))
    model = Llama(config, rngs=nnx.Rngs(seed), dtype=jnp.dtype(dtype))
    cut = "" if layers is None else f", {layers} of {model_shapes.SHAPES[name]['num_hidden_layers']} layers"
    return Loaded(model, random_heads(model, dtype), f"{name}{cut} ({config.num_params / 1e9:.2f}B parameters, random "
                  f"weights, seed {seed}, {dtype}; 4 Medusa heads to match)", key=f"shape {spec} seed {seed} {dtype}")


def random_heads(model: Llama, dtype: str = "float32", num_heads: int = 4) -> MedusaHeads:
    """Medusa heads of the model's shape (`reference_models.medusa.untrained_heads`). They accept next to nothing;
    the oracle drafter runs them so a drafting step pays their cost (`serve.oracle_drafter`)."""
    from reference_models.medusa import untrained_heads

    return untrained_heads(model.lm_head_weight(), num_heads, dtype)


def oracle_table(loaded: Loaded, requests: list[tuple[int, list[int], int]], make_engine,
                 environ=os.environ) -> tuple[np.ndarray, str]:
    """The oracle's reference table for `requests` ((id, prompt, max new tokens), ...): read from the cache, or made
    by serving them greedily on `make_engine()` (an engine without speculation) and stored. Returns (table, where it
    came from). The cache key is the weights' key and the requests; SKVS_ORACLE_CACHE=off (or a directory) sets
    where it lives."""
    from skvs_jax.serve import oracle_drafter

    where = environ.get(ORACLE_CACHE_ENV, str(pathlib.Path("~/.cache/skvs_jax/oracle").expanduser()))
    digest = hashlib.sha256(json.dumps([loaded.key, requests]).encode()).hexdigest()[:24]
    path = None if where.strip().lower() == "off" else pathlib.Path(where) / f"{digest}.npy"
    if path is not None and path.exists():
        return np.load(path), f"reference pass read from {path}"
    table = oracle_drafter.reference_table(make_engine(), requests)
    if path is None:
        return table, "reference pass served now (cache off)"
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, table)
    return table, f"reference pass served now, kept in {path}"


def draft_len(args: argparse.Namespace, loaded: Loaded, default_without_heads: int = 4) -> int:
    """--draft-len, or by default the heads' count (every head drafts)."""
    if args.draft_len is not None:
        return args.draft_len
    return loaded.num_heads or default_without_heads


def check_speculation(policy, loaded: Loaded, flag: str = "--policy") -> None:
    """A speculating policy needs heads: say so by the flags, before an engine refuses it."""
    if policy.speculation and loaded.heads is None and loaded.oracle is None:
        raise ValueError(f"{flag} {policy.name} speculates, which needs Medusa heads: pass --medusa DIR_OR_FILE "
                         "(or serve vllm_default only)")
