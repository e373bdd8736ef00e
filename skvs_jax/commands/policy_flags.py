"""The policy switches `skvs bench` and `skvs simulate` both take for every policy of a run.

`--policies` composes one variant at a time (`policies.parse_policy`: `skvs:preemption=swap,victim=most_progress`);
these flags set a switch in every policy, and a variant's own override wins over them. `--tpot-target` is the
run's, for every request (`tpot_target`).
"""

from __future__ import annotations

import argparse

from skvs_jax import policies, victims
from skvs_jax import scheduler as sc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Switches applied to every policy of the run (`--policies` overrides of one policy win over them); shared
    with `skvs simulate`."""
    parser.add_argument("--preemption", default=None, choices=policies.PREEMPTION_MODES,
                        help="preemption mode of every policy (default: each preset's, recompute)")
    parser.add_argument("--victim", default=None, choices=victims.VICTIM_RULE_NAMES,
                        help="victim rule of every policy (default: each preset's, lowest_priority)")
    parser.add_argument("--kv-precision", default=None, choices=policies.KV_PRECISIONS,
                        help="KV cache dtype of every policy: bench's engines hold it (default: each preset's); "
                             "simulate prices the KV bytes in it (default: the model's, bfloat16)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="prefix caching off in every policy (the prefix barrier with it)")
    parser.add_argument("--tpot-target", type=_milliseconds, default=None, metavar="MS",
                        help="every request's TPOT objective in ms: the goodput draft controller drafts first for a "
                             "request decoding slower than it, and the report adds the share of requests that met it "
                             "(TPOT SLO attainment) and the request goodput, as `vllm bench serve --goodput tpot:MS`")


def _milliseconds(text: str) -> float:
    try:
        ms = float(text)
        sc.tpot_target_us(ms / 1e3, "--tpot-target")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be milliseconds in (0, {sc.MAX_TPOT_TARGET_S * 1e3:g}], got {text!r}") from None
    return ms


def tpot_target(args: argparse.Namespace) -> float | None:
    """--tpot-target in seconds (None: no objective)."""
    ms = getattr(args, "tpot_target", None)
    return None if ms is None else ms / 1e3


def defaults(args: argparse.Namespace) -> dict[str, object]:
    """The global policy flags as Policy field values (`policies.parse_policy`'s defaults)."""
    out: dict[str, object] = {}
    for field in ("preemption", "victim", "kv_precision"):
        if getattr(args, field, None) is not None:
            out[field] = getattr(args, field)
    if getattr(args, "no_prefix_cache", False):
        out["prefix_cache"] = False
    return out


def describe(specs: dict[str, policies.PolicySpec], host_blocks: int, kv: str | None = None) -> str:
    """One line: each policy's preemption (with the host tier's blocks), victim rule, KV dtype (`kv` when the run
    fixes one for every policy), prefix caching, and its draft-length knob when given -- the switches these flags
    and overrides set."""
    parts = []
    for name, spec in specs.items():
        p = spec.policy
        swap = f"swap ({host_blocks} host blocks)" if p.preemption == "swap" else p.preemption
        knob = f", K knob {spec.draft_len_knob}" if spec.draft_len_knob is not None else ""
        parts.append(f"{name}: {swap}, victim {p.victim}, KV {kv or p.kv_dtype()}, prefix cache "
                     f"{'on' if p.prefix_cache else 'off'}{knob}")
    return "policies: " + "; ".join(parts)
