"""Load and save weights in the Hugging Face Llama and two Medusa checkpoint layouts (safetensors, no network).

Llama: a directory with `config.json` and `model.safetensors`, or shards listed in `model.safetensors.index.json`
(any `*.safetensors` in the directory otherwise). Names are HF's (`model.layers.0.self_attn.q_proj.weight`, ...);
ours are the same without `model.`, except the embedding (`embed_tokens.embedding`). Our own weights are saved
in this same layout, so `transformers.LlamaForCausalLM.from_pretrained` reads them too.

Medusa, in either layout, which its `config.json` tells apart:
* FasterDecoding/Medusa (`medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`):
  `medusa_lm_head.safetensors` holding `{i}.{j}.linear.weight|bias` (residual block j of head i) and
  `{i}.{num_layers}.weight` (its LM head), optionally prefixed `medusa_head.`.
* vLLM's `MedusaModel` (`"architectures": ["MedusaModel"]`, `num_heads`, `num_hidden_layers` blocks per head,
  `hidden_size`, `vocab_size`), used by the HF-hub checkpoints converted for vLLM: `model.safetensors` (or shards
  with an index) holding `blocks.{i}.layers.{j}.weight|bias` and `lm_heads.{i}.weight`, optionally prefixed
  `medusa_heads.` (vllm/model_executor/models/medusa.py). The biases are there only when `medusa_fc_bias` is set
  (without it they are zero); `original_lm_head` shares `lm_heads.0.weight` between the heads; a truncated head
  vocabulary (`truncated_vocab_size` != `vocab_size`, vLLM's `token_map`) and a `logit_scale` != 1 are refused.
A Medusa checkpoint is the directory or its safetensors file, whose layout is then read from a Medusa `config.json`
beside it or else from its tensor names. `medusa_base_model` finds the base model a Medusa config names, when it is
a local directory. Pickled weights (`medusa_lm_head.pt`, `pytorch_model.bin`) are not read: convert them.

Dtypes: the loaders' `dtype="auto"` keeps the checkpoint's own, that of most of its parameters' elements (float32
or bfloat16; float16 loads as float32, which holds it exactly); "float32" / "bfloat16" cast. The model is built in
that dtype, so nothing is materialised in float32 first. Saves write each parameter in its own dtype, and
`config.json` names it (`torch_dtype`, and `dtype`, which transformers 5 reads).

Loading is strict: an unknown tensor, a missing one or a shape mismatch raises ValueError naming the tensor.
"""

from __future__ import annotations

import collections
import contextlib
import json
import pathlib
import re
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from reference_models.llama import Llama, LlamaConfig
from reference_models.medusa import MedusaConfig, MedusaHeads

MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"  # FasterDecoding/Medusa's file; vLLM's layout uses model.safetensors
MEDUSA_LAYOUTS = ("fasterdecoding", "vllm")
VLLM_MEDUSA = "MedusaModel"  # the architecture name of vLLM's Medusa config
DTYPES = ("auto", "float32", "bfloat16")  # what the loaders' `dtype` takes (or jnp.float32 / jnp.bfloat16)
WEIGHTS_DIR = pathlib.Path(__file__).parent / "weights"  # the shipped weights (`python -m reference_models.train`)
_IGNORED_HF_KEYS = re.compile(r".*rotary_emb\.inv_freq$")  # buffers some old checkpoints carry
_PICKLE_SUFFIXES = (".pt", ".pth", ".bin")


_STACKED = "layers."  # a Llama's decoder layers are one stacked module: each parameter leads with the layer axis L


def _params(module: nnx.Module) -> dict[str, nnx.Param]:
    """Dotted parameter path -> the module's Param variable. A Llama's stacked layers appear once, as
    'layers.mlp.up_proj.weight' [L, ...] (see `_per_layer` for the names checkpoints use)."""
    return {".".join(map(str, p)): v for p, v in nnx.iter_graph(module) if isinstance(v, nnx.Param)}


def _per_layer(name: str, var: nnx.Param) -> list[str]:
    """The checkpoint names of one parameter: 'layers.0.mlp.up_proj.weight', 'layers.1...' for a stacked one
    (HF's per-layer names), else the name itself."""
    if not name.startswith(_STACKED):
        return [name]
    rest = name.removeprefix(_STACKED)
    return [f"{_STACKED}{i}.{rest}" for i in range(var.shape[0])]


def param_dict(module: nnx.Module) -> dict[str, jax.Array]:
    """Checkpoint name (HF's, per layer: 'layers.0.mlp.up_proj.weight') -> array."""
    out = {}
    for name, var in _params(module).items():
        names = _per_layer(name, var)
        value = var[...]
        out |= {names[0]: value} if names == [name] else {n: value[i] for i, n in enumerate(names)}
    return out


def assign_params(module: nnx.Module, tensors: dict[str, np.ndarray | jax.Array], source: str) -> None:
    """Replace every parameter of `module` (in place) by `tensors[name]` (checkpoint names, per layer), cast to the
    parameter's dtype; a stacked parameter takes its L per-layer tensors, stacked.

    Raises ValueError naming the tensor on an unknown name, a missing name or a shape mismatch; nothing is
    modified then.
    """
    params = _params(module)
    names = {name: _per_layer(name, var) for name, var in params.items()}
    expected = {n: (name, var) for name, var in params.items() for n in names[name]}
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise ValueError(f"{source}: unknown tensor(s) {unknown[:5]} (expected names like {sorted(expected)[:3]})")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{source}: missing tensor(s) {missing[:5]}")
    for n, (name, var) in expected.items():
        want = tuple(var.shape) if names[name] == [name] else tuple(var.shape[1:])
        if tuple(tensors[n].shape) != want:
            raise ValueError(f"{source}: tensor {n!r} has shape {tuple(tensors[n].shape)}, expected {want}")
    for name, var in params.items():
        if names[name] == [name]:
            var.set_value(jnp.asarray(tensors[name]).astype(var.dtype))
        else:
            var.set_value(jnp.stack([jnp.asarray(tensors[n]).astype(var.dtype) for n in names[name]]))


def load_dtype(dtype: Any) -> jnp.dtype | None:
    """The loaders' `dtype` argument -> the dtype to cast to, or None for "auto" (the checkpoint's own).

    Raises ValueError naming the argument for anything but "auto", "float32", "bfloat16" or those jnp dtypes.
    """
    if isinstance(dtype, str) and dtype == "auto":
        return None
    try:
        resolved = jnp.dtype(dtype)
    except (TypeError, ValueError):
        resolved = None
    if resolved is None or resolved.name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} (or jnp.float32 / jnp.bfloat16), got {dtype!r}")
    return resolved


def majority_dtype(arrays: Iterable[Any]) -> np.dtype | None:
    """The floating dtype that holds most of `arrays`' elements (a tie goes to the wider); None if none is
    floating."""
    counts: collections.Counter = collections.Counter()
    for array in arrays:
        if jnp.issubdtype(array.dtype, jnp.floating):
            counts[jnp.dtype(array.dtype)] += int(array.size)
    return max(counts, key=lambda d: (counts[d], d.itemsize, d.name)) if counts else None


def stored_dtype(tensors: dict[str, Any], source: str) -> jnp.dtype:
    """The dtype `dtype="auto"` loads `tensors` (one checkpoint's parameters) in: float32 or bfloat16.

    A mixed checkpoint (some exporters keep the norms in float32 beside bfloat16 matrices) takes the dtype of most
    of its elements: the model holds one dtype, the matrices are where the memory is, and refusing would make such
    checkpoints need a flag. Raises ValueError naming `source` for any other dtype (float64, float8, ...).
    """
    stored = majority_dtype(tensors.values())
    # float16 (Llama 2, Vicuna and the Medusa heads trained on them) widens to float32, which holds every float16
    # exactly: bfloat16 has 3 fewer mantissa bits, so "auto" would change the weights, and refusing would make the
    # commonest checkpoints need a flag. dtype="bfloat16" is the explicit choice that halves the memory.
    if stored == jnp.float16:
        return jnp.dtype(jnp.float32)
    if stored is None or stored.name not in DTYPES:
        raise ValueError(f"{source}: parameters stored as {stored}, which dtype='auto' does not load; pass "
                         "dtype='float32' or 'bfloat16'")
    return stored


@contextlib.contextmanager
def _opened(file: pathlib.Path):
    """`safe_open(file)`, with a truncated or corrupt file's `SafetensorError` (which does not name the file) turned
    into a ValueError that does; read the tensors inside the block, where a truncated one fails too."""
    try:
        with safe_open(str(file), framework="flax") as f:
            yield f
    except SafetensorError as err:
        raise ValueError(f"{file}: not a readable safetensors file (truncated or corrupt?): {err}") from None


def _read_safetensors(files: list[pathlib.Path]) -> dict[str, jax.Array]:
    tensors: dict[str, jax.Array] = {}
    for file in files:
        with _opened(file) as f:
            for key in f.keys():
                if key in tensors:
                    raise ValueError(f"{file}: tensor {key!r} appears in more than one shard")
                tensors[key] = f.get_tensor(key)
    return tensors


def _pickle_error(path: pathlib.Path, target: str) -> ValueError:
    return ValueError(f"{path}: pickled PyTorch weights are not read (unpickling can run arbitrary code); convert "
                      f"them to a .safetensors file once, e.g. safetensors.torch.save_file(torch.load('{path.name}', "
                      f"weights_only=True), '{target}')")


def _pickles(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in directory.iterdir() if p.suffix in _PICKLE_SUFFIXES)


def _indexed_files(index: pathlib.Path) -> list[pathlib.Path]:
    """The shards a `*.safetensors.index.json` lists. Raises ValueError naming the index and the shard when one
    is not there (a partial download), or when the index has no `weight_map` of tensor -> file name."""
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if not all(isinstance(name, str) for name in names):
            raise TypeError("its shard names are not all strings")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{index}: not a safetensors index (a 'weight_map' of tensor -> shard file): {err}") from None
    files = [index.parent / name for name in names]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise ValueError(f"{index}: names shard(s) {absent}, not in {index.parent}")
    return files


def _llama_files(directory: pathlib.Path) -> list[pathlib.Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return _indexed_files(index)
    files = sorted(p for p in directory.glob("*.safetensors") if p.name != MEDUSA_WEIGHTS)
    if not files:
        pickled = " (pickled PyTorch weights are not read: convert them to safetensors)" if _pickles(directory) else ""
        raise FileNotFoundError(f"no *.safetensors in {directory}{pickled}")
    return files


def _hf_to_ours(key: str) -> str:
    if key == "model.embed_tokens.weight":
        return "embed_tokens.embedding"
    return key.removeprefix("model.")


def _ours_to_hf(key: str) -> str:
    if key == "embed_tokens.embedding":
        return "model.embed_tokens.weight"
    return key if key.startswith("lm_head.") else "model." + key


def load_llama(directory: str | pathlib.Path, dtype: Any = "auto") -> Llama:
    """An HF Llama checkpoint directory (`config.json` + safetensors, sharded or not) -> `Llama` whose parameters
    are `dtype`: "auto" (the checkpoint's own, `stored_dtype`), "float32" or "bfloat16" (or those jnp dtypes). Its
    logits are float32 either way. ValueError naming `dtype` for another value, before anything is read."""
    cast_to = load_dtype(dtype)
    directory = pathlib.Path(directory)
    config = LlamaConfig.from_hf_dict(json.loads((directory / "config.json").read_text()))
    raw = _read_safetensors(_llama_files(directory))
    if config.tie_word_embeddings and "lm_head.weight" in raw:  # some exporters store the tied copy too
        embed = raw.get("model.embed_tokens.weight")
        if embed is None or not np.array_equal(np.asarray(raw["lm_head.weight"]), np.asarray(embed)):
            raise ValueError(f"{directory}: tie_word_embeddings is set but lm_head.weight differs from "
                             f"model.embed_tokens.weight")
        del raw["lm_head.weight"]
    tensors = {_hf_to_ours(k): v for k, v in raw.items() if not _IGNORED_HF_KEYS.match(k)}
    param_dtype = cast_to or stored_dtype(tensors, str(directory))
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), dtype=param_dtype))
    assign_params(model, tensors, source=str(directory))
    return model


def _save(tensors: dict[str, jax.Array], file: pathlib.Path) -> None:
    # np.asarray of a bfloat16 jax array is an ml_dtypes bfloat16 array, which safetensors.numpy writes as BF16.
    save_file({k: np.asarray(v) for k, v in tensors.items()}, str(file), metadata={"format": "pt"})


def save_llama(model: Llama, directory: str | pathlib.Path, max_shard_params: int | None = None) -> None:
    """Write `config.json` + `model.safetensors` (or shards + index when `max_shard_params` is given), replacing
    the weights of any earlier save in `directory`. Each parameter keeps its dtype; config.json's `torch_dtype` and
    `dtype` name that of most of their elements (`majority_dtype`), which `load_llama(dtype="auto")` loads in."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # An earlier save's weights would outlive this one: a stale index wins in load_llama, a stale
    # model.safetensors in transformers. Either way the directory would load as a different model.
    for stale in [directory / "model.safetensors", directory / "model.safetensors.index.json",
                  *directory.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    tensors = {_ours_to_hf(k): v for k, v in param_dict(model).items()}
    dtype = majority_dtype(tensors.values()).name  # LlamaConfig.to_hf_dict says float32 whatever the parameters are
    hf = model.config.to_hf_dict() | {"torch_dtype": dtype, "dtype": dtype}
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if max_shard_params is None:
        _save(tensors, directory / "model.safetensors")
        return
    shards: list[dict[str, jax.Array]] = [{}]
    for key in sorted(tensors):
        if shards[-1] and sum(v.size for v in shards[-1].values()) + tensors[key].size > max_shard_params:
            shards.append({})
        shards[-1][key] = tensors[key]
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save(shard, directory / name)
        weight_map.update({k: name for k in shard})
    total = sum(v.nbytes for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


_FD_KEY = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")
_VLLM_KEY = re.compile(r"^(?:medusa_heads\.)?(?:blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)|lm_heads\.(\d+)\.weight)$")


def _medusa_kind(hf: dict) -> str | None:
    """The Medusa layout (`MEDUSA_LAYOUTS`) a config.json describes, or None when it is no Medusa config."""
    architectures = hf.get("architectures")
    if (isinstance(architectures, list) and VLLM_MEDUSA in architectures) or hf.get("model_type") == "medusa":
        return "vllm"
    return "fasterdecoding" if "medusa_num_heads" in hf else None


def _medusa_layout(path: pathlib.Path) -> tuple[list[pathlib.Path], dict, str]:
    """(weights files, Medusa config, layout) of a checkpoint directory or of its safetensors file."""
    if path.is_dir():
        config = path / "config.json"
        hf = json.loads(config.read_text())
        layout = _medusa_kind(hf)
        if layout is None:
            raise ValueError(f"{config}: not a Medusa config (no 'medusa_num_heads', no architectures "
                             f"['{VLLM_MEDUSA}'])")
        index = path / "model.safetensors.index.json"
        if layout == "vllm" and index.exists():
            return _indexed_files(index), hf, layout
        weights = path / (MEDUSA_WEIGHTS if layout == "fasterdecoding" else "model.safetensors")
        if not weights.exists():
            pickles = _pickles(path)
            if pickles:
                raise _pickle_error(pickles[0], weights.name)
            raise FileNotFoundError(f"{weights}: no such file")
        return [weights], hf, layout
    if path.suffix in _PICKLE_SUFFIXES:
        raise _pickle_error(path, path.with_suffix(".safetensors").name)
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: a Medusa checkpoint is a directory or a .safetensors file")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    beside = path.parent / "config.json"
    hf = json.loads(beside.read_text()) if beside.exists() else {}
    layout = _medusa_kind(hf)
    if layout is not None:
        return [path], hf, layout
    # No Medusa config beside it (a base model's config.json may lie beside heads saved into its directory).
    return [path], *_layout_from_names(path)


def _layout_from_names(path: pathlib.Path) -> tuple[dict, str]:
    """(config, layout) of a Medusa safetensors file without its config.json, from its tensor names."""
    names = _tensor_names(path)
    fd = [_FD_KEY.match(name) for name in names]
    if names and None not in fd:
        lm_layers = {int(m[2]) for m in fd if m[3] == "weight"}
        if len(lm_layers) != 1:
            raise ValueError(f"{path}: cannot tell medusa_num_layers from its tensors (LM heads at layers "
                             f"{sorted(lm_layers)}); put a Medusa config.json beside it")
        return {"medusa_num_heads": 1 + max(int(m[1]) for m in fd), "medusa_num_layers": lm_layers.pop()}, \
            "fasterdecoding"
    vllm = [_VLLM_KEY.match(name) for name in names]
    if names and None not in vllm:
        blocks = [m for m in vllm if m[1] is not None]
        return {"architectures": [VLLM_MEDUSA], "num_heads": 1 + max(int(m[1] or m[4]) for m in vllm),
                "num_hidden_layers": 1 + max((int(m[2]) for m in blocks), default=-1),
                "medusa_fc_bias": any(m[3] == "bias" for m in blocks)}, "vllm"
    raise ValueError(f"{path}: not a Medusa head file (its tensors are named neither like '0.0.linear.weight' nor "
                     "like 'blocks.0.layers.0.weight')")


def _tensor_names(file: pathlib.Path) -> list[str]:
    with _opened(file) as f:
        return list(f.keys())


def _put(tensors: dict, keys: dict, name: str, key: str, value: Any, source: str) -> None:
    """tensors[name] = value, read from checkpoint tensor `key` (kept in keys[name] for error messages)."""
    if name in tensors:  # the same parameter with and without the prefix
        raise ValueError(f"{source}: tensors {keys[name]!r} and {key!r} are the same parameter")
    tensors[name], keys[name] = value, key


def _fasterdecoding_tensors(raw: dict, hf: dict, source: str) -> tuple[dict, dict, int, int]:
    """FasterDecoding/Medusa's tensors -> (our names -> tensor, our names -> theirs, heads, layers)."""
    num_heads, num_layers = int(hf["medusa_num_heads"]), int(hf.get("medusa_num_layers", 1))
    tensors: dict = {}
    keys: dict = {}
    for key, value in raw.items():
        match = _FD_KEY.match(key)
        if match is None:
            raise ValueError(f"{source}: unknown tensor {key!r}")
        head, layer, kind = int(match[1]), int(match[2]), match[3]
        if kind == "weight" and layer == num_layers:
            name = f"heads.{head}.lm_head.weight"
        elif kind != "weight" and layer < num_layers:
            name = f"heads.{head}.blocks.{layer}.{kind}"
        else:
            raise ValueError(f"{source}: unknown tensor {key!r} for medusa_num_layers={num_layers}")
        _put(tensors, keys, name, key, value, source)
    return tensors, keys, num_heads, num_layers


def _vllm_tensors(raw: dict, hf: dict, source: str) -> tuple[dict, dict, int, int]:
    """vLLM's `MedusaModel` tensors -> (our names -> tensor, our names -> theirs, heads, layers). The biases that
    `medusa_fc_bias` leaves out and the LM heads that `original_lm_head` shares are filled in by `_vllm_defaults`."""
    # vLLM's MedusaConfig.from_pretrained renames any key holding "num" and "heads" to num_heads ("layers":
    # num_hidden_layers), so FasterDecoding's key names serve there too; its default is 1 layer.
    num_heads = hf.get("num_heads", hf.get("medusa_num_heads"))
    num_layers = hf.get("num_hidden_layers", hf.get("medusa_num_layers", 1))
    if num_heads is None:
        raise ValueError(f"{source}: its {VLLM_MEDUSA} config.json has no 'num_heads'")
    truncated, vocab = hf.get("truncated_vocab_size"), hf.get("vocab_size")
    if truncated is not None and truncated != vocab:
        raise ValueError(f"{source}: truncated_vocab_size {truncated} differs from vocab_size {vocab}; a truncated "
                         "head vocabulary (vLLM's token_map) is not supported")
    if hf.get("logit_scale", 1.0) != 1.0:
        raise ValueError(f"{source}: logit_scale {hf['logit_scale']!r} is not supported (heads' logits are unscaled)")
    bias, shared = bool(hf.get("medusa_fc_bias", False)), bool(hf.get("original_lm_head", False))
    tensors: dict = {}
    keys: dict = {}
    for key, value in raw.items():
        match = _VLLM_KEY.match(key)
        if match is None:
            raise ValueError(f"{source}: unknown tensor {key!r}")
        if match[4] is not None:
            if shared and int(match[4]) != 0:  # vLLM would ignore it: the heads share lm_heads.0
                raise ValueError(f"{source}: tensor {key!r}, but original_lm_head shares lm_heads.0.weight")
            name = f"heads.{int(match[4])}.lm_head.weight"
        else:
            if match[3] == "bias" and not bias:  # vLLM's layers have no bias then: it would ignore this one
                raise ValueError(f"{source}: tensor {key!r} is a bias, but medusa_fc_bias is not set")
            name = f"heads.{int(match[1])}.blocks.{int(match[2])}.linear.{match[3]}"
        _put(tensors, keys, name, key, value, source)
    return tensors, keys, int(num_heads), int(num_layers)


def _vllm_defaults(tensors: dict, hf: dict, config: MedusaConfig, dtype: Any) -> None:
    """Fill in (in place) what vLLM's layout leaves out: zero biases without `medusa_fc_bias` (its layers have
    none) and, with `original_lm_head`, head 0's LM head for every head."""
    for i in range(config.num_heads):
        if hf.get("original_lm_head") and i > 0:
            tensors[f"heads.{i}.lm_head.weight"] = tensors["heads.0.lm_head.weight"]
        if not hf.get("medusa_fc_bias"):
            for j in range(config.num_layers):
                tensors[f"heads.{i}.blocks.{j}.linear.bias"] = jnp.zeros((config.hidden_size,), dtype)


def medusa_base_model(path: str | pathlib.Path) -> pathlib.Path | None:
    """The base model a Medusa checkpoint's config.json names (`base_model_name_or_path`), as a local directory:
    the name as given (absolute, or relative to the working directory), else relative to the directory holding
    the Medusa checkpoint (the shipped heads name their sibling "tiny_llama"). None when it names none; ValueError
    when it names something that is not a local directory (a hub id: nothing is downloaded)."""
    path = pathlib.Path(path)
    config = (path if path.is_dir() else path.parent) / "config.json"
    hf = json.loads(config.read_text()) if config.exists() else {}
    name = hf.get("base_model_name_or_path") if _medusa_kind(hf) else None
    if not name:
        return None
    root = path.parent if path.is_dir() else path.parent.parent
    for candidate in (pathlib.Path(name).expanduser(), root / name):
        if (candidate / "config.json").is_file():
            return candidate
    raise ValueError(f"{config}: base_model_name_or_path {name!r} is not a local model directory (nothing is "
                     "downloaded); give the base model's directory explicitly")


def load_medusa(path: str | pathlib.Path, dtype: Any = "auto") -> MedusaHeads:
    """A Medusa checkpoint, in either layout (the module docstring) -> `MedusaHeads` whose parameters are `dtype`:
    "auto" (the checkpoint's own, `stored_dtype`), "float32" or "bfloat16" (or those jnp dtypes). `path` is the
    directory or the safetensors file itself (heads and layers from a Medusa `config.json` beside it, else from the
    tensor names). ValueError naming `dtype` for another value, before anything is read."""
    cast_to = load_dtype(dtype)
    path = pathlib.Path(path)
    files, hf, layout = _medusa_layout(path)
    source = str(path)
    raw = _read_safetensors(files)
    if layout == "fasterdecoding":
        tensors, keys, num_heads, num_layers = _fasterdecoding_tensors(raw, hf, source)
        lm_key = f"0.{num_layers}.weight"
    else:
        tensors, keys, num_heads, num_layers = _vllm_tensors(raw, hf, source)
        lm_key = "lm_heads.0.weight"
    lm = tensors.get("heads.0.lm_head.weight")
    if lm is None:
        raise ValueError(f"{source}: missing tensor {lm_key!r} (head 0's LM head)")
    if len(lm.shape) != 2:
        raise ValueError(f"{source}: tensor {keys['heads.0.lm_head.weight']!r} (head 0's LM head) must be "
                         f"[vocab, hidden], got shape {tuple(lm.shape)}")
    vocab, hidden = map(int, lm.shape)
    for name, got in (("vocab_size", vocab), ("hidden_size", hidden)):
        if hf.get(name, got) != got:
            raise ValueError(f"{source}: config.json's {name} is {hf[name]!r}, but tensor "
                             f"{keys['heads.0.lm_head.weight']!r} is [vocab, hidden] = {tuple(lm.shape)}")
    param_dtype = cast_to or stored_dtype(tensors, source)
    try:
        config = MedusaConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads, num_layers=num_layers)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    if layout == "vllm":
        _vllm_defaults(tensors, hf, config, param_dtype)
    heads = nnx.eval_shape(lambda: MedusaHeads(config, dtype=param_dtype))
    expected = _params(heads)
    unknown = sorted(keys[name] for name in tensors if name not in expected)
    if unknown:
        raise ValueError(f"{source}: unknown tensor(s) {unknown[:5]} for {num_heads} heads of {num_layers} layers")
    assign_params(heads, tensors, source=source)
    return heads


def save_medusa(heads: MedusaHeads, directory: str | pathlib.Path, base_model: str = "",
                layout: str = "fasterdecoding") -> None:
    """Write `config.json` + the weights in `layout`: "fasterdecoding" (`medusa_lm_head.safetensors`) or "vllm"
    (`model.safetensors`, vLLM's `MedusaModel` with `medusa_fc_bias` set: our blocks have biases). Each parameter
    keeps its dtype; config.json's `torch_dtype` and `dtype` name that of most of their elements."""
    if layout not in MEDUSA_LAYOUTS:
        raise ValueError(f"layout must be one of {MEDUSA_LAYOUTS}, got {layout!r}")
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = heads.config
    params = param_dict(heads)
    dtype = majority_dtype(params.values()).name
    tensors = {}
    for key, value in params.items():
        parts = key.split(".")  # heads.{i}.blocks.{j}.linear.{weight|bias} | heads.{i}.lm_head.weight
        i = parts[1]
        if layout == "fasterdecoding":
            name = f"{i}.{parts[3]}.linear.{parts[5]}" if parts[2] == "blocks" else f"{i}.{cfg.num_layers}.weight"
        else:
            name = f"blocks.{i}.layers.{parts[3]}.{parts[5]}" if parts[2] == "blocks" else f"lm_heads.{i}.weight"
        tensors[name] = value
    common = {"base_model_name_or_path": base_model, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}
    if layout == "fasterdecoding":
        meta = {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers} | common
        weights = directory / MEDUSA_WEIGHTS
    else:
        meta = {"architectures": [VLLM_MEDUSA], "model_type": "medusa", "num_heads": cfg.num_heads,
                "num_hidden_layers": cfg.num_layers} | common | {
            "truncated_vocab_size": cfg.vocab_size, "medusa_fc_bias": True, "original_lm_head": False}
        weights = directory / "model.safetensors"
        # An earlier sharded save's index would win over this file in load_medusa.
        (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    meta |= {"torch_dtype": dtype, "dtype": dtype}
    (directory / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    _save(tensors, weights)


def load_shipped(dtype: Any = "auto") -> tuple[Llama, MedusaHeads]:
    """The shipped tiny Llama and its Medusa heads (trained here on the shipped corpus: docs/models.md), stored in
    float32, in `dtype` (as `load_llama`'s)."""
    return load_llama(WEIGHTS_DIR / "tiny_llama", dtype), load_medusa(WEIGHTS_DIR / "tiny_llama_medusa", dtype)
