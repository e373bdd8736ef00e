"""Per-group reports (a phased trace's phases, acceptance classes) that `skvs simulate` and `skvs bench` share.

Each run (a simulated lane, a served run) carries, under its group's name ("phase", "class"), one dict per group
of the request metrics over that group's requests (`metrics.summarize_groups`, with units: `metrics.with_units`).
`hindsight` picks, per group and per run, the best fixed draft length (vllm_default is K = 0, naive_spec:K the
others) for TPOT P50 and P99 and gives every policy's ratio to it and to no speculation; `group_table` prints it.
"""

from __future__ import annotations

import math

import numpy as np

MEDIAN_TPOT, P99_TPOT = "median_tpot_ms", "p99_tpot_ms"


def fixed_names(names: list[str], k: int) -> dict[int, str]:
    """The fixed draft lengths among the policies: K -> name (0: vllm_default, K >= 1: naive_spec:K; naive_spec
    itself is K = --draft-len)."""
    out = {0: "vllm_default"} if "vllm_default" in names else {}
    for j in range(1, k + 1):
        for name in (f"naive_spec:{j}",) + (("naive_spec",) if j == k else ()):
            if name in names:
                out.setdefault(j, name)
    return out


def hindsight(lanes: dict[str, list[dict]], names: list[str], group: str, fixed: dict[int, str]) -> list[dict]:
    """Per group (phase or class), per run (a seed): the best fixed draft length in hindsight for TPOT median and P99
    (MEDIAN_TPOT, P99_TPOT: the smallest value over `fixed`, and its K), and every other policy's ratio to it and to
    vllm_default (no speculation). lanes: name -> its lanes at one rate, one per seed, in the same seed order, with
    the reported keys (`metrics.with_units`)."""
    seeds = [m["seed"] for m in lanes[names[0]]]
    out = []
    for g in range(len(lanes[names[0]][0][group])):
        row: dict = {"requests": lanes[names[0]][0][group][g].get("requests", 0.0), "seeds": seeds}
        for key in (MEDIAN_TPOT, P99_TPOT):
            per_k = {k: [lanes[n][i][group][g].get(key, math.nan) for i in range(len(seeds))] for k, n in fixed.items()}
            best_k = [min(per_k, key=lambda k: (np.nan_to_num(per_k[k][i], nan=math.inf), k)) if per_k else None
                      for i in range(len(seeds))]
            best = [per_k[k][i] if k is not None else math.nan for i, k in enumerate(best_k)]
            row[key] = {"best": best, "best_k": best_k}
            for n in names:
                mine = [lanes[n][i][group][g].get(key, math.nan) for i in range(len(seeds))]
                none = [lanes["vllm_default"][i][group][g].get(key, math.nan) if "vllm_default" in lanes else math.nan
                        for i in range(len(seeds))]
                row[key][n] = {"value": mine, "over_best": [a / b for a, b in zip(mine, best)],
                               "over_no_spec": [a / b for a, b in zip(mine, none)]}
        out.append(row)
    return out


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(finite)) if finite else math.nan


def _span(values: list[float], fmt: str = "{:.2f}") -> str:
    v = [x for x in values if math.isfinite(x)]
    if not v:
        return "n/a"
    lo, hi = min(v), max(v)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def group_table(lanes: dict[str, list[dict]], names: list[str], group: str, labels: list[str],
                fixed: dict[int, str]) -> str:
    """Markdown: per phase or class, each policy's TPOT P50 / P99 (ms, mean over seeds), drafts per decode step and,
    with --tpot-target, the share of requests that met it;
    with fixed draft lengths, the best of them in hindsight (per seed) and each adaptive policy's ratio to it and
    to no speculation (the range over seeds)."""
    rows = hindsight(lanes, names, group, fixed)
    adaptive = [n for n in names if n not in fixed.values()]
    head = [group] + [f"{n} P50 / P99 ms (drafts/step)" for n in names]
    if fixed:
        head += ["best fixed K: P50 / P99 ms (K)"]
        head += [f"{n} / best: P50, P99" for n in adaptive]
        head += [f"{n} / no spec.: P99" for n in adaptive if "vllm_default" in names]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for g, row in enumerate(rows):
        cells = [labels[g] if g < len(labels) else str(g)]
        for n in names:
            ms = [m[group][g] for m in lanes[n]]
            mean = {key: _nanmean([m.get(key, math.nan) for m in ms])
                    for key in (MEDIAN_TPOT, P99_TPOT, "drafts_per_step", "tpot_slo_attainment")}
            slo = mean["tpot_slo_attainment"]  # with --tpot-target: the share of the group's requests that met it
            cells.append(f"{mean[MEDIAN_TPOT]:.1f} / {mean[P99_TPOT]:.1f} "
                         f"({mean['drafts_per_step']:.2f}){f'; SLO {100 * slo:.0f}%' if math.isfinite(slo) else ''}")
        if fixed:
            p50, p99 = row[MEDIAN_TPOT], row[P99_TPOT]
            cells.append(f"{np.nanmean(p50['best']):.1f} / {np.nanmean(p99['best']):.1f} "
                         f"({','.join(map(str, p50['best_k']))} / {','.join(map(str, p99['best_k']))})")
            cells += [f"{_span(p50[n]['over_best'])}x, {_span(p99[n]['over_best'])}x" for n in adaptive]
            if "vllm_default" in names:
                cells += [f"{_span(p99[n]['over_no_spec'])}x" for n in adaptive]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
