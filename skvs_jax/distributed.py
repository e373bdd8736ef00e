"""Tensor parallelism for the engine: the device mesh, what is sharded over it, and placing arrays on it.

Mesh layout: two axes, `("dp", "tp")`. The engine shards over `tp` only, Megatron-style, with the KV heads as the
unit of parallelism: each `tp` rank holds Hkv / tp KV heads of every layer's cache (the pages `[N, L, S, Hkv, D]`
and scales `[N, L, S, Hkv]` split on their Hkv axis), the query heads that read them, and the matching slices of
the weights. Every other mesh axis (`dp`) holds a full replica of the engine that does the same work: it exists
so that a host with more devices than KV heads (the shipped model has Hkv = 2) still gets a valid layout, and is
the axis a data-parallel use (several engines, or sharded simulator sweeps) would split.

What goes where (weights are stored [out, in], as in HF; a Llama's stacked layers add a leading, replicated L):
  column-parallel, split on out:  q/k/v_proj, gate/up_proj   -> P(None, "tp", None)
  row-parallel, split on in:      o_proj, down_proj           -> P(None, None, "tp")  (XLA all-reduces the output)
  vocab-parallel, split on V:     embed_tokens, lm_head, every Medusa head's lm_head [V, Dm] -> P("tp", None)
  replicated:                     RMSNorm weights, Medusa ResBlocks, scheduler / allocator state, small arrays
The vocabulary-sized matrices are the largest in a real model (V Dm each, one per Medusa head), and splitting
them on V changes no arithmetic: each logit is still one full dot product over Dm, and an embedding row comes
from the one rank that holds it (the others add zeros).
A Medusa ResBlock `x + SiLU(W x + b)` is only Dm^2 and its whole output feeds the next block, so splitting it
would buy a collective per head for little memory. The scheduler state is a few KB and every rank needs the
block tables, so it is replicated; every rank runs the same scheduling arithmetic.

The step stays one jitted program: its inputs are committed to these shardings, jit propagates them, and the
step pins its output cache to the same split with `with_sharding_constraint` (donation keeps working).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from skvs_jax import checks

DP, TP = "dp", "tp"

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")


def make_mesh(tp: int, dp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `("dp", "tp")` mesh of dp * tp devices (the first ones of `devices`, default `jax.devices()`, which on
    several hosts lists every process's devices). Neighbouring devices share a `tp` group."""
    for name, value in (("tp", tp), ("dp", dp)):
        if not checks.is_int(value) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    tp, dp = int(tp), int(dp)
    devices = list(jax.devices() if devices is None else devices)
    if dp * tp > len(devices):
        raise ValueError(f"dp * tp = {dp * tp} devices requested, only {len(devices)} available")
    return Mesh(np.asarray(devices[: dp * tp]).reshape(dp, tp), (DP, TP), axis_types=(AxisType.Auto,) * 2)


def check_mesh(mesh: Any, axis: str) -> Mesh:
    """mesh must be a `Mesh` with `axis` and Auto axis types (the sharding here is placed and propagated by XLA;
    `jax.make_mesh`'s default Explicit axes would ask every op for sharding rules it does not have)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh must have a {axis!r} axis (see distributed.make_mesh), got axes {mesh.axis_names}")
    types = tuple(getattr(mesh, "axis_types", ()) or ())
    if any(t != AxisType.Auto for t in types):
        raise ValueError(f"mesh axes must be AxisType.Auto, got {types}: build it with distributed.make_mesh, or "
                         f"jax.make_mesh(..., axis_types=(AxisType.Auto,) * {len(types)})")
    return mesh


def tp_size(mesh: Any) -> int:
    """The number of devices on the mesh's `tp` axis; TypeError / ValueError naming `mesh` if it has none."""
    return int(check_mesh(mesh, TP).shape[TP])


def _names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def megatron_spec(path, x) -> P:
    """The PartitionSpec of one Llama / Medusa parameter, from its path (HF names) and shape (see the module
    docstring). Anything not named here is replicated."""
    names = _names(path)
    # A Llama's stacked layers lead with the layer axis L, replicated: [L, out, in].
    lead = (None,) if x.ndim == 3 and "layers" in names else ()
    if x.ndim == 2 + len(lead) and any(n in COLUMN_PARALLEL or n in VOCAB_PARALLEL for n in names):
        return P(*lead, TP, None)
    if x.ndim == 2 + len(lead) and any(n in ROW_PARALLEL for n in names):
        return P(*lead, None, TP)
    return P()


def check_llama_dims(config, tp: int) -> None:
    """ValueError naming `mesh` unless tp divides every dimension `megatron_spec` splits."""
    dims = {"num_kv_heads": config.num_kv_heads, "num_heads": config.num_heads,
            "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    for name, value in dims.items():
        if value % tp:
            raise ValueError(f"mesh: its {TP!r} axis has {tp} devices, which does not divide the model's {name} "
                             f"({value}); use tp dividing num_kv_heads = {config.num_kv_heads} and put the other "
                             f"devices on the {DP!r} axis (make_mesh(tp=..., dp=...))")


def megatron_specs(params: Any) -> Any:
    """PartitionSpecs for a Llama (+ Medusa) params pytree, same structure."""
    return jax.tree_util.tree_map_with_path(megatron_spec, params)


def kv_spec(x) -> P:
    """A cache array [N, L, S, Hkv, ...] (pages [N, L, S, Hkv, D] or scales [N, L, S, Hkv]): split on Hkv."""
    return P(None, None, None, TP)


def named(mesh: Mesh, specs: Any) -> Any:
    """PartitionSpecs -> NamedShardings on `mesh` (same pytree)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def place(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """`tree` on `mesh` with PartitionSpecs `specs` (a pytree prefix of `tree`)."""
    return jax.device_put(tree, named(mesh, specs))


def runner_shardings(runner: Any, params: Any, cache: Any, mesh: Mesh) -> tuple[Any, tuple[NamedSharding, ...]]:
    """(shardings of params, shardings of `runner.kv_pages(cache)`) for a runner that can be sharded, i.e. one
    with `param_specs(params, tp)` (a specs pytree like params) and `cache_specs(cache)` (one spec per kv_pages
    array) methods; TypeError for any other runner."""
    tp = tp_size(mesh)
    if not (callable(getattr(runner, "param_specs", None)) and callable(getattr(runner, "cache_specs", None))):
        raise TypeError(f"mesh: {type(runner).__name__} cannot be sharded (it has no param_specs / cache_specs)")
    params_sh = named(mesh, runner.param_specs(params, tp))
    kv_sh = tuple(named(mesh, spec) for spec in runner.cache_specs(cache))
    return params_sh, kv_sh
