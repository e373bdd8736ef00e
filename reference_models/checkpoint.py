"""Load and save weights in the Hugging Face Llama and the Medusa checkpoint layouts (safetensors, no network).

Llama: a directory with `config.json` and `model.safetensors`, or shards listed in `model.safetensors.index.json`
(any `*.safetensors` in the directory otherwise). Names are HF's (`model.layers.0.self_attn.q_proj.weight`, ...);
ours are the same without `model.`, except the embedding (`embed_tokens.embedding`). Our own weights are saved
in this same layout, so `transformers.LlamaForCausalLM.from_pretrained` reads them too.

Medusa: a directory with `config.json` (`medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`) and
`medusa_lm_head.safetensors` holding `{i}.{j}.linear.weight|bias` (residual block j of head i) and
`{i}.{num_layers}.weight` (its LM head), optionally prefixed `medusa_head.` (FasterDecoding/Medusa); or the
safetensors file itself, whose heads and layers are read from a Medusa `config.json` beside it or else from its
tensor names. `medusa_base_model` finds the base model a Medusa config names, when it is a local directory.

Loading is strict: an unknown tensor, a missing one or a shape mismatch raises ValueError naming the tensor.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from reference_models.llama import Llama, LlamaConfig
from reference_models.medusa import MedusaConfig, MedusaHeads

MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"
WEIGHTS_DIR = pathlib.Path(__file__).parent / "weights"  # the shipped weights (`python -m reference_models.train`)
_IGNORED_HF_KEYS = re.compile(r".*rotary_emb\.inv_freq$")  # buffers some old checkpoints carry


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


def _llama_files(directory: pathlib.Path) -> list[pathlib.Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(p for p in directory.glob("*.safetensors") if p.name != MEDUSA_WEIGHTS)
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    return files


def _hf_to_ours(key: str) -> str:
    if key == "model.embed_tokens.weight":
        return "embed_tokens.embedding"
    return key.removeprefix("model.")


def _ours_to_hf(key: str) -> str:
    if key == "embed_tokens.embedding":
        return "model.embed_tokens.weight"
    return key if key.startswith("lm_head.") else "model." + key


def load_llama(directory: str | pathlib.Path) -> Llama:
    """An HF Llama checkpoint directory (`config.json` + safetensors, sharded or not) -> `Llama` in fp32."""
    directory = pathlib.Path(directory)
    config = LlamaConfig.from_hf_dict(json.loads((directory / "config.json").read_text()))
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    raw = _read_safetensors(_llama_files(directory))
    if config.tie_word_embeddings and "lm_head.weight" in raw:  # some exporters store the tied copy too
        embed = raw.get("model.embed_tokens.weight")
        if embed is None or not np.array_equal(np.asarray(raw["lm_head.weight"]), np.asarray(embed)):
            raise ValueError(f"{directory}: tie_word_embeddings is set but lm_head.weight differs from "
                             f"model.embed_tokens.weight")
        del raw["lm_head.weight"]
    tensors = {_hf_to_ours(k): v for k, v in raw.items() if not _IGNORED_HF_KEYS.match(k)}
    assign_params(model, tensors, source=str(directory))
    return model


def _save(tensors: dict[str, jax.Array], file: pathlib.Path) -> None:
    save_file({k: np.asarray(v) for k, v in tensors.items()}, str(file), metadata={"format": "pt"})


def save_llama(model: Llama, directory: str | pathlib.Path, max_shard_params: int | None = None) -> None:
    """Write `config.json` + `model.safetensors` (or shards + index when `max_shard_params` is given), replacing
    the weights of any earlier save in `directory`."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # An earlier save's weights would outlive this one: a stale index wins in load_llama, a stale
    # model.safetensors in transformers. Either way the directory would load as a different model.
    for stale in [directory / "model.safetensors", directory / "model.safetensors.index.json",
                  *directory.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    tensors = {_ours_to_hf(k): v for k, v in param_dict(model).items()}
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
    total = sum(4 * v.size for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


_MEDUSA_KEY = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def _medusa_layout(path: pathlib.Path) -> tuple[pathlib.Path, dict]:
    """(weights file, Medusa config) of a checkpoint directory or of its safetensors file."""
    if path.is_dir():
        config = path / "config.json"
        hf = json.loads(config.read_text())
        if "medusa_num_heads" not in hf:
            raise ValueError(f"{path}/config.json: missing 'medusa_num_heads'")
        return path / MEDUSA_WEIGHTS, hf
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: a Medusa checkpoint is a directory or a .safetensors file (pickled .pt files "
                         "are not read: convert them with safetensors)")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    beside = path.parent / "config.json"
    hf = json.loads(beside.read_text()) if beside.exists() else {}
    if "medusa_num_heads" in hf:  # a base model's config.json may lie beside heads saved into its directory
        return path, hf
    keys = [_MEDUSA_KEY.match(key) for key in _tensor_names(path)]
    if not keys or None in keys:
        raise ValueError(f"{path}: not a Medusa head file (its tensors are not named like '0.0.linear.weight')")
    lm_layers = {int(m[2]) for m in keys if m[3] == "weight"}
    if len(lm_layers) != 1:
        raise ValueError(f"{path}: cannot tell medusa_num_layers from its tensors (LM heads at layers "
                         f"{sorted(lm_layers)}); put a Medusa config.json beside it")
    return path, {"medusa_num_heads": 1 + max(int(m[1]) for m in keys), "medusa_num_layers": lm_layers.pop()}


def _tensor_names(file: pathlib.Path) -> list[str]:
    with _opened(file) as f:
        return list(f.keys())


def medusa_base_model(path: str | pathlib.Path) -> pathlib.Path | None:
    """The base model a Medusa checkpoint's config.json names (`base_model_name_or_path`), as a local directory:
    the name as given (absolute, or relative to the working directory), else relative to the directory holding
    the Medusa checkpoint (the shipped heads name their sibling "tiny_llama"). None when it names none; ValueError
    when it names something that is not a local directory (a hub id: nothing is downloaded)."""
    path = pathlib.Path(path)
    config = (path if path.is_dir() else path.parent) / "config.json"
    hf = json.loads(config.read_text()) if config.exists() else {}
    name = hf.get("base_model_name_or_path") if "medusa_num_heads" in hf else None
    if not name:
        return None
    root = path.parent if path.is_dir() else path.parent.parent
    for candidate in (pathlib.Path(name).expanduser(), root / name):
        if (candidate / "config.json").is_file():
            return candidate
    raise ValueError(f"{config}: base_model_name_or_path {name!r} is not a local model directory (nothing is "
                     "downloaded); give the base model's directory explicitly")


def load_medusa(path: str | pathlib.Path) -> MedusaHeads:
    """A Medusa checkpoint -> `MedusaHeads` in fp32: a directory (`config.json` + `medusa_lm_head.safetensors`)
    or the safetensors file itself (heads and layers from a Medusa `config.json` beside it, else from the tensor
    names)."""
    directory = pathlib.Path(path)
    weights, hf = _medusa_layout(directory)
    num_heads, num_layers = int(hf["medusa_num_heads"]), int(hf.get("medusa_num_layers", 1))
    raw = _read_safetensors([weights])
    tensors, source = {}, {}
    for key, value in raw.items():
        match = _MEDUSA_KEY.match(key)
        if match is None:
            raise ValueError(f"{directory}: unknown tensor {key!r} in {weights.name}")
        head, layer, kind = int(match[1]), int(match[2]), match[3]
        if kind == "weight" and layer == num_layers:
            name = f"heads.{head}.lm_head.weight"
        elif kind != "weight" and layer < num_layers:
            name = f"heads.{head}.blocks.{layer}.{kind}"
        else:
            raise ValueError(f"{directory}: unknown tensor {key!r} for medusa_num_layers={num_layers}")
        if name in tensors:  # the same parameter with and without the "medusa_head." prefix
            raise ValueError(f"{directory}: tensors {source[name]!r} and {key!r} are the same parameter")
        tensors[name], source[name] = value, key
    lm_key = "heads.0.lm_head.weight"
    if lm_key not in tensors:
        raise ValueError(f"{directory}: missing tensor '0.{num_layers}.weight' (head 0's LM head)")
    if len(tensors[lm_key].shape) != 2:
        raise ValueError(f"{directory}: tensor {source[lm_key]!r} (head 0's LM head) must be [vocab, hidden], got "
                         f"shape {tuple(tensors[lm_key].shape)}")
    vocab, hidden = tensors[lm_key].shape
    config = MedusaConfig(hidden_size=int(hidden), vocab_size=int(vocab), num_heads=num_heads, num_layers=num_layers)
    heads = nnx.eval_shape(lambda: MedusaHeads(config))
    assign_params(heads, tensors, source=str(directory))
    return heads


def save_medusa(heads: MedusaHeads, directory: str | pathlib.Path, base_model: str = "") -> None:
    """Write `config.json` + `medusa_lm_head.safetensors` in the FasterDecoding/Medusa layout."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = heads.config
    meta = {
        "medusa_num_heads": cfg.num_heads,
        "medusa_num_layers": cfg.num_layers,
        "base_model_name_or_path": base_model,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
    }
    (directory / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    tensors = {}
    for key, value in param_dict(heads).items():
        parts = key.split(".")  # heads.{i}.blocks.{j}.linear.{weight|bias} | heads.{i}.lm_head.weight
        if parts[2] == "blocks":
            tensors[f"{parts[1]}.{parts[3]}.linear.{parts[5]}"] = value
        else:
            tensors[f"{parts[1]}.{cfg.num_layers}.weight"] = value
    _save(tensors, directory / MEDUSA_WEIGHTS)


def load_shipped() -> tuple[Llama, MedusaHeads]:
    """The shipped tiny Llama and its Medusa heads (trained here on the shipped corpus: docs/models.md)."""
    return load_llama(WEIGHTS_DIR / "tiny_llama"), load_medusa(WEIGHTS_DIR / "tiny_llama_medusa")
