"""`skvs bench`'s report: what a policy reports over its repeats (`upper_median` of the `unstalled` runs,
`stall`), the paired ratios and their bootstrap interval, the headline ratio and its t-interval (`headline`), the
steps priced by one fit (`priced_schedules`), the plot, and the ablation's decomposition and verdicts
(`ablation_report`, `throughput_effect`, `format_ablation`). Pure functions of the served runs' results: nothing
here serves. Metrics are read by their reported keys (`metrics.with_units`).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

import numpy as np

from skvs_jax import metrics, policies

# Run-to-run spread of throughput on a 2-core CPU (docs/benchmarks.md): with one repeat, a smaller change is noise.
THROUGHPUT_NOISE = 0.20
REFERENCE = "naive_spec"  # the policy the table's and the paired ratios divide by
THROUGHPUT = "output_tokens_per_s"  # the throughput every ratio, median and verdict here is of
# Metrics that depend on the clock; with all arrivals at t = 0 every other metric is reproducible from the seed.
TIMING_METRICS = metrics.TIMING_KEYS
# The decomposition's metrics: (key, higher is better). Engine steps for the same output tokens are the
# noise-free side of throughput: on a CPU, where a step costs about the same whatever it carries, fewer is faster.
ABLATION_METRICS = ((THROUGHPUT, True), ("num_steps", False), ("spec_token_waste", False), ("spec_kv_waste", False),
                    ("kv_hit_rate", True), ("kv_hit_rate_first", True), ("oom_rate", False),
                    ("preemptions_per_request", False), ("mean_accepted_length", True))


def priced_schedules(results: dict, names: list[str]) -> dict | None:
    """Each policy's reported run priced by one fitted step cost, the first policy's that has one: sum over its
    steps of that fit's time at the step's query width (`serve.step_cost.fit`, widths it did not time
    interpolated), a step that ran the prompt width's split branch at the fit's split time. What each schedule
    costs on this machine's compiled programs, free of the wall clock's noise (the scheduler's own work per step
    is in the fit only as it is on empty slots). A policy whose split branch has another shape (narrow width,
    extra rows: another draft length) than the fit's is left out ("unpriced"): its split steps cost what no
    fit measured. None when no policy fitted."""
    from skvs_jax.serve import step_cost

    fit_of = next((n for n in names if results[n].get("step_cost_us")), None)
    if fit_of is None or not all(results[n].get("width_hist") for n in names):
        return None
    times = {int(w): float(t) for w, t in results[fit_of]["step_cost_us"].items()}
    widths = sorted(set(times) | {int(w) for n in names for w in results[n]["width_hist"]})
    cost = step_cost.fit(times, widths, token_budget=1, max_width=widths[-1])
    base, table = int(np.asarray(cost.token_us)[0]), np.asarray(cost.width_us)
    split_us, shape = results[fit_of].get("split_step_us"), _split_shape(results[fit_of])
    ms, unpriced = {}, []
    for n in names:
        split = results[n].get("split") or {}
        wide = sum(k * (base + int(table[int(w)])) for w, k in results[n]["width_hist"].items())
        steps = split.get("steps", 0)
        if steps and (split_us is None or _split_shape(results[n]) != shape):
            unpriced.append(n)
            continue
        prompt = max(int(w) for w in results[n]["width_hist"])  # split steps are counted at the prompt width
        ms[n] = (wide - steps * (base + int(table[prompt]) - (split_us or 0))) / 1e3
    if not ms:
        return None
    return {"fit_of": fit_of, "step_cost_us": results[fit_of]["step_cost_us"], "split_step_us": split_us,
            "ms": ms, "unpriced": unpriced}


def _split_shape(result: dict) -> tuple:
    split = result.get("split") or {}
    return split.get("narrow_width"), split.get("rows")


# The plot's colours: the three presets always in these, every other policy (a variant, an ablation) in the next
# free colour of PALETTE in the order it is served. Matplotlib's default cycle, minus the presets' three.
POLICY_COLOURS = {"vllm_default": "tab:blue", "naive_spec": "tab:orange", "skvs": "tab:green"}
PALETTE = ("tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")


def policy_colours(names: list[str]) -> dict[str, str]:
    """A colour per policy: POLICY_COLOURS for the presets, PALETTE in order for the rest (cycling past its end)."""
    others = [n for n in names if n not in POLICY_COLOURS]
    return {n: POLICY_COLOURS.get(n) or PALETTE[others.index(n) % len(PALETTE)] for n in names}


def plot(results: dict, path: pathlib.Path, blocks_total: int, *, run: str = "") -> None:
    """bench.png: per policy (`results`: name -> served run), output tokens over wall time and KV blocks in use
    over wall time (solid: every used block; dotted: blocks holding drafts), as % of the `blocks_total` usable
    blocks. A policy has the same colour in both panels (`policy_colours`). `run` names the run in the title
    (e.g. "workload sharegpt, seed 0, 64 requests")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = policy_colours(list(results))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for name, r in results.items():
        t = np.asarray(r["series"]["time_s"])
        tokens = np.cumsum(r["series"]["output_tokens"])
        ax1.plot(t, tokens, color=colours[name], label=name)
        ax2.plot(t, np.asarray(r["series"]["blocks_used"]) / blocks_total * 100, color=colours[name],
                 label=f"{name} used")
        ax2.plot(t, np.asarray(r["series"]["spec_blocks"]) / blocks_total * 100, color=colours[name],
                 linestyle=":", label=f"{name} drafts")
    ax1.set_title("Output tokens served (steeper is faster)", fontsize=10)
    ax1.set_ylabel("output tokens (cumulative)")
    ax2.set_title(f"KV blocks in use (solid) and holding drafts (dotted), % of {blocks_total} usable blocks",
                  fontsize=10)
    ax2.set_ylabel("KV blocks (% of budget)")
    ax2.set_xlabel("wall time (s)")
    ax1.legend()
    ax2.legend(fontsize=7, ncol=2)
    fig.suptitle("skvs bench: throughput and KV memory per policy" + (f"\n{run}" if run else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def unstalled(items: list, stalled: list[bool]) -> list:
    """The items (one per repeat) of the runs without a stalled step; all of them if every run stalled."""
    return [x for x, st in zip(items, stalled, strict=True) if not st] or list(items)


def upper_median(items: list, stalled: list[bool], key=None):
    """What a policy reports (its run, or its throughput): the median by `key` of its `unstalled` repeats, the
    upper one for an even count (on a shared machine interference only ever slows a run down)."""
    valid = sorted(unstalled(items, stalled), key=key)
    return valid[len(valid) // 2]


def _round_ratios(tp: list[float], base_tp: list[float], stalled: list[bool],
                  base_stalled: list[bool]) -> list[float | None]:
    """tp / base_tp within each round of repeats; None in a round where either run had a stalled step."""
    return [None if s or bs else t / b for t, b, s, bs in zip(tp, base_tp, stalled, base_stalled, strict=True)]


def paired_ratios(throughputs: dict[str, list[float]], stalled: dict[str, list[bool]],
                   names: list[str]) -> dict[str, list[float]]:
    """Each policy's throughput over REFERENCE's in the same round of repeats (`_round_ratios`, stalled rounds
    left out), for every policy but REFERENCE; {} when REFERENCE was not run."""
    if REFERENCE not in names:
        return {}
    ref, ref_stalled = throughputs[REFERENCE], stalled[REFERENCE]
    return {n: [x for x in _round_ratios(throughputs[n], ref, stalled[n], ref_stalled) if x is not None]
            for n in names if n != REFERENCE}


def bootstrap_median_ci(values: list[float], level: float = 0.95, resamples: int = 10_000,
                        seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of the median of values (at least one): resamples draws of len(values)
    with replacement from a seeded generator, so the same values give the same interval. With few rounds it is
    coarse (five rounds: the interval's ends are among the five values), and it assumes rounds are independent
    draws, which drift within a run only approximates; it says whether a difference is resolved, not more."""
    if not values:
        raise ValueError("values must hold at least one number")
    x = np.asarray(values, np.float64)
    draws = np.random.default_rng(seed).choice(x, size=(resamples, len(x)), replace=True)
    medians = np.median(draws, axis=1)
    tail = (1.0 - level) / 2
    return float(np.quantile(medians, tail)), float(np.quantile(medians, 1.0 - tail))


# Two-sided 95% quantiles of Student's t, 1..30 degrees of freedom (t_{0.975, df}; any table, e.g. NIST/SEMATECH
# e-Handbook 1.3.6.7.2): no scipy among the dependencies for one column of numbers.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """t_{0.975, df}: the table up to 30 degrees of freedom, beyond it the Cornish-Fisher expansion around the
    normal quantile (within 1e-3 of the exact value there)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_interval(ratios: list[float]) -> tuple[float, float]:
    """The 95% t-interval of the geometric mean of ratios (at least two, all > 0): mean(log r) +- t975(n - 1) *
    sd(log r) / sqrt(n), back through exp. On the log scale a / b and b / a give mirrored intervals. Chosen over
    the bootstrap for the headline because repeats are few: with three rounds a bootstrap interval cannot reach
    beyond the three values, while the t-interval widens as few readings should (t975(2) = 4.3)."""
    if len(ratios) < 2 or min(ratios) <= 0:
        raise ValueError(f"ratios must hold at least two numbers > 0, got {ratios}")
    logs = np.log(np.asarray(ratios, np.float64))
    half = t975(len(logs) - 1) * float(np.std(logs, ddof=1)) / math.sqrt(len(logs))
    centre = float(np.mean(logs))
    return math.exp(centre - half), math.exp(centre + half)


HEADLINE_MIN_ROUNDS = 3  # paired rounds below which the headline is reported without an interval


def headline(results: dict, throughputs: dict[str, list[float]], stalled: dict[str, list[bool]],
             names: list[str]) -> dict | None:
    """The run's headline: the output throughput of the table's first ratio column (`metrics.ratio_pairs`: skvs /
    naive_spec, else skvs / vllm_default) as the table prints it (the reported runs' values), and with
    HEADLINE_MIN_ROUNDS or more unstalled rounds of both the `t_interval` of the per-round ratios and whether it
    holds 1 (the difference is not resolved). None when the table has no ratio column."""
    pairs = metrics.ratio_pairs(names)
    if not pairs:
        return None
    a, b = pairs[0]
    ratio = metrics.safe_ratio(results[a]["metrics"][THROUGHPUT], results[b]["metrics"][THROUGHPUT])
    rounds = [x for x in _round_ratios(throughputs[a], throughputs[b], stalled[a], stalled[b]) if x is not None]
    out = {"pair": [a, b], "metric": THROUGHPUT, "ratio": ratio, "rounds": len(rounds), "ci95": None,
           "contains_1": None, "method": f"95% t-interval of the geometric mean of the per-round ratios (log scale), "
                                         f"from {HEADLINE_MIN_ROUNDS} rounds"}
    if len(rounds) >= HEADLINE_MIN_ROUNDS:
        lo, hi = t_interval(rounds)
        out |= {"ci95": [lo, hi], "contains_1": lo <= 1.0 <= hi, "geometric_mean": float(np.exp(np.mean(np.log(
            rounds))))}
    return out


def format_headline(h: dict) -> str:
    """The headline as one line: the ratio, then its interval or why there is none."""
    a, b = h["pair"]
    line = f"headline: {a} / {b} output throughput {h['ratio']:.3f}x"
    if h["ci95"] is None:
        why = "single reading" if h["rounds"] <= 1 else f"{h['rounds']} rounds, too few for an interval"
        return f"{line} ({why}; --repeats {HEADLINE_MIN_ROUNDS} or more gives its 95% interval)"
    lo, hi = h["ci95"]
    verdict = "contains 1: no difference resolved" if h["contains_1"] else "excludes 1: the difference is resolved"
    return (f"{line}; over {h['rounds']} rounds, per-round ratios' geometric mean {h['geometric_mean']:.3f}x, 95% "
            f"t-interval {lo:.3f}-{hi:.3f}x ({verdict})")


def stall(result: dict) -> tuple[float, float] | tuple[()]:
    """(longest step, wall time) [s] when one step took over a second and over half the run, which is a
    compilation or the machine stopping, not the policy; () otherwise. Steps end at `series["time_s"]`."""
    ends = np.asarray(result["series"]["time_s"], np.float64)
    if not ends.size:
        return ()
    longest = float(np.diff(ends, prepend=0.0).max())
    return (longest, float(ends[-1])) if longest > max(1.0, 0.5 * ends[-1]) else ()


def reproducible(runs: dict[str, list[dict]]) -> bool:
    """Whether every repeat of every policy gave the same non-timing metrics."""
    def non_timing(r):
        return {k: v for k, v in r["metrics"].items() if k not in TIMING_METRICS}

    return all(_same_value(non_timing(r), non_timing(rs[0])) for rs in runs.values() for r in rs[1:])


def _same_value(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def throughput_effect(*, steps: tuple[float, float], tokens: tuple[float, float], ratio: float,
                      paired: list[float | None], deterministic: bool, identical: bool = False,
                      measured: bool = True) -> tuple[str, str]:
    """The ablation's verdict on one switch's throughput, as (effect, basis). A pure function of the evidence:

    steps, tokens: (switch off, base) engine steps and output tokens; ratio: off / base throughput of the
    reported runs; paired: off / base within each round of repeats (None where either run stalled);
    deterministic: the non-timing counters are reproducible (all arrivals at t = 0); identical: same counters and
    non-timing metrics; measured: some run of each was timed without a stall.

    effect: "none" (identical schedules: any difference is noise), "not measured", "helps" (base, with the
    switch, is faster), "hurts", or "within noise". Decided, in this order:
      1. the engine steps, when deterministic and both produced the same output tokens in different numbers of
         steps: fewer steps is faster (on a CPU a step costs about the same whatever it carries), unless two or
         more paired ratios all lie on the other side of 1 (the measurement, repeated, beats the proxy);
      2. the spread of two or more paired ratios: "helps" if all < 1, "hurts" if all > 1, else within noise;
      3. one pair and the same steps (deterministic): within noise -- the schedules are as long, and one run
         has no spread to tell a per-step cost from the machine's noise (--repeats measures it);
      4. one pair, non-deterministic (--rate): within noise when |ratio - 1| <= THROUGHPUT_NOISE.
    """
    if identical:
        return "none", "schedule identical"
    if not measured:
        return "not measured", "every run stalled"
    pairs = [x for x in paired if x is not None]
    spread = None
    if len(pairs) > 1:
        spread = "helps" if max(pairs) < 1 else "hurts" if min(pairs) > 1 else "within noise"
    if deterministic and tokens[0] == tokens[1] and steps[0] != steps[1]:
        by_steps = "helps" if steps[0] > steps[1] else "hurts"
        if spread is not None and spread not in (by_steps, "within noise"):
            return spread, "repeats' spread (against the engine steps)"
        return by_steps, "engine steps"
    if spread is not None:
        return spread, "repeats' spread"
    if deterministic:
        return "within noise", "same engine steps, one repeat (no spread)"
    if abs(ratio - 1.0) <= THROUGHPUT_NOISE:
        return "within noise", f"one repeat, within {THROUGHPUT_NOISE:.0%}"
    return ("hurts" if ratio > 1 else "helps"), f"one repeat, beyond {THROUGHPUT_NOISE:.0%}"


def ablation_report(chosen: dict[str, policies.Policy], results: dict, throughputs: dict[str, list[float]],
              stalled: dict[str, list[bool]], args, paired_runs: dict | None = None) -> dict:
    """The decomposition as data (bench.json's "ablation" section).

    rows: one per ablated switch in `policies.ablations` order, then "naive_spec" (every switch off at once);
      each has the policy name, the fields that differ from skvs, and per metric of ABLATION_METRICS
      {"off": value with the switch off, "skvs": full skvs's value, "change": off - skvs}. For throughput,
      "change" is off / skvs (reported runs: skvs's of the variant's own serving group) and "paired" the ratios
      off / skvs within each round of repeats (both ran under the same load: with serving groups, the skvs runs
      of the variant's own group, paired_runs: name -> (throughputs, stalled flags); null where either run
      stalled), "ratio_min"/"ratio_max" their range.
      "throughput_effect": "helps" (skvs is faster with the switch), "hurts", "within noise", "none" (the
      schedule is identical to skvs's: same counters and non-timing metrics, so any difference is noise), "not
      measured" (every run of either policy stalled), decided by `throughput_effect`; "verdict_basis" says by
      which evidence (engine steps, the repeats' spread, or one repeat). "share_of_gap": (skvs - off) / (skvs -
      naive_spec) throughput, NaN when that gap is within noise; "steps_share_of_gap" the same with engine
      steps, which are deterministic.
      "better"/"worse": the non-throughput metrics the switch improves / worsens.
    """
    base = chosen["skvs"]
    skvs_metrics = results["skvs"]["metrics"]
    skvs_valid = unstalled(throughputs["skvs"], stalled["skvs"])

    def non_timing(name):
        return {k: v for k, v in results[name]["metrics"].items() if k not in TIMING_METRICS}

    rows = {}
    for name in [n for n in chosen if n not in ("skvs", "naive_spec")] + ["naive_spec"]:
        off = results[name]["metrics"]
        base_tp, base_stalled = (paired_runs or {}).get(name, (throughputs["skvs"], stalled["skvs"]))
        # Against the skvs runs of the variant's own serving group, chosen as the reported runs are: a later
        # group's medians against the first group's compared two stretches of the machine, not two policies.
        ratio = off[THROUGHPUT] / upper_median(base_tp, base_stalled)
        paired = _round_ratios(throughputs[name], base_tp, stalled[name], base_stalled)
        pairs = [x for x in paired if x is not None]
        lo, hi = (min(pairs), max(pairs)) if len(pairs) > 1 else (ratio, ratio)
        row = {"policy": name,
               "changes": {f.name: getattr(chosen[name], f.name) for f in dataclasses.fields(base)
                           if f.name != "name" and getattr(chosen[name], f.name) != getattr(base, f.name)},
               "metrics": {}, "better": [], "worse": []}
        for key, higher_is_better in ABLATION_METRICS:
            row["metrics"][key] = {"off": off[key], "skvs": skvs_metrics[key], "change": off[key] - skvs_metrics[key]}
            if key == THROUGHPUT:
                row["metrics"][key] |= {"change": ratio, "paired": paired, "ratio_min": lo, "ratio_max": hi}
            elif not _same_value(off[key], skvs_metrics[key]) and math.isfinite(off[key] - skvs_metrics[key]):
                # The switch improves a metric when skvs (switch on) is better than the ablation (switch off).
                improves = (skvs_metrics[key] > off[key]) == higher_is_better
                row["better" if improves else "worse"].append(key)
        row["identical_schedule"] = (results[name]["counters"] == results["skvs"]["counters"]
                                     and _same_value(non_timing(name), non_timing("skvs")))
        row["throughput_effect"], row["verdict_basis"] = throughput_effect(
            steps=(off["num_steps"], skvs_metrics["num_steps"]), tokens=(off["output_tokens"],
                                                                         skvs_metrics["output_tokens"]),
            ratio=ratio, paired=paired, deterministic=args.rate is None, identical=row["identical_schedule"],
            measured=not (all(stalled[name]) or all(base_stalled)))
        rows[name.removeprefix(f"{base.name} -")] = row
    gap_within_noise = rows["naive_spec"]["throughput_effect"] not in ("helps", "hurts")
    gap = skvs_metrics[THROUGHPUT] - results["naive_spec"]["metrics"][THROUGHPUT]
    step_gap = skvs_metrics["num_steps"] - results["naive_spec"]["metrics"]["num_steps"]
    for row in rows.values():
        off = results[row["policy"]]["metrics"]
        row["share_of_gap"] = math.nan if gap_within_noise else (skvs_metrics[THROUGHPUT] - off[THROUGHPUT]) / gap
        row["steps_share_of_gap"] = (skvs_metrics["num_steps"] - off["num_steps"]) / step_gap if step_gap else math.nan
    return {"base": "skvs", "reference": "naive_spec", "repeats": args.repeats,
            "noise_rule": ("bench_report.throughput_effect: engine steps decide where the same output tokens took "
                           "different steps (deterministic runs); else two or more paired per-round ratios decide "
                           "(noise when they hold 1); one repeat with equal steps is within noise; with --rate and one "
                           f"repeat, |ratio - 1| <= {THROUGHPUT_NOISE}"),
            "non_timing_deterministic": args.rate is None, "gap_within_noise": gap_within_noise,
            "skvs_ratio_min": min(skvs_valid) / skvs_metrics[THROUGHPUT],
            "skvs_ratio_max": max(skvs_valid) / skvs_metrics[THROUGHPUT], "rows": rows}


def fmt(value: float, key: str = "") -> str:
    """As the table prints values; counts (engine steps) as whole numbers."""
    return f"{value:.0f}" if key == "num_steps" and math.isfinite(value) else metrics.format_value(value)


def format_ablation(a: dict) -> str:
    """The decomposition table and a plain reading of it."""
    label = {key: (text, factor) for key, text, factor in metrics.METRICS} | {"num_steps": ("engine steps", 1.0)}
    keys = [key for key, _ in ABLATION_METRICS]
    header = ["switch off", "throughput vs skvs", *(label[k][0] for k in keys[1:]), "share of gap: steps",
              "share of gap: throughput"]
    lines = ["Ablation: skvs with one switch at a time set back to naive_spec's value. Each cell: the value with "
             "the switch off (change vs full skvs in brackets); throughput as a ratio to full skvs in this run"
             + (f" [min-max of the ratios within each of the {a['repeats']} rounds]" if a["repeats"] > 1 else "")
             + "; share of gap = (skvs - switch off) / (skvs - naive_spec), in engine steps and in throughput.",
             "", "| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    any_row = next(iter(a["rows"].values()))["metrics"]
    skvs_range = f" [{a['skvs_ratio_min']:.2f}-{a['skvs_ratio_max']:.2f}]" if a["repeats"] > 1 else ""
    cells = ["(none: skvs)", f"1.00x{skvs_range} = {fmt(any_row[THROUGHPUT]['skvs'])} tok/s"]
    cells += [fmt(any_row[k]["skvs"] * label[k][1], k) for k in keys[1:]] + ["", ""]
    lines.append("| " + " | ".join(cells) + " |")
    for switch, row in a["rows"].items():
        m = row["metrics"]
        t = m[THROUGHPUT]
        paired = sum(x is not None for x in t["paired"]) > 1
        cells = ["all (naive_spec)" if switch == "naive_spec" else switch,
                 f"{t['change']:.2f}x" + (f" [{t['ratio_min']:.2f}-{t['ratio_max']:.2f}]" if paired else "")]
        for k in keys[1:]:
            factor = label[k][1]
            change = float(f"{m[k]['change'] * factor:.10g}")  # 50.0 - 40.0 prints as +10.0, not +10.00
            signed = "n/a" if not math.isfinite(change) else ("±0" if change == 0 else
                                                               ("+" if change > 0 else "") + fmt(change, k))
            cells.append(f"{fmt(m[k]['off'] * factor, k)} ({signed})")
        for share in (row["steps_share_of_gap"], row["share_of_gap"]):
            cells.append(f"{share * 100:.0f}%" if math.isfinite(share) else "n/a")
        lines.append("| " + " | ".join(cells) + " |")

    naive = a["rows"]["naive_spec"]
    t = naive["metrics"][THROUGHPUT]
    overall = metrics.safe_ratio(t["skvs"], t["off"])
    lines += ["", f"skvs vs naive_spec overall: skvs throughput {overall:.2f}x naive_spec's ("
              + ("beyond noise" if not a["gap_within_noise"] else naive["throughput_effect"]) + "); skvs is better on "
              + (", ".join(naive["better"]) or "nothing") + "; worse on " + (", ".join(naive["worse"]) or "nothing")
              + ("; the gap is within noise, so the shares of it are not meaningful" if a["gap_within_noise"] else
                 "") + "."]
    switches = {s: r for s, r in a["rows"].items() if s != "naive_spec"}
    for effect, verb in (("helps", "help throughput (skvs is faster with them)"),
                         ("hurts", "hurt throughput (skvs is faster without them)"),
                         ("within noise", "change throughput within noise"),
                         ("none", "change nothing on this trace (schedule identical to skvs's; any throughput "
                                  "difference is noise)"),
                         ("not measured", "could not be timed (every run stalled, see the warning above)")):
        members = [s for s, r in switches.items() if r["throughput_effect"] == effect]
        if members or effect in ("helps", "hurts", "within noise"):
            lines.append(f"switches that {verb}: {', '.join(members) or 'none'}")
    for s, r in switches.items():
        if r["identical_schedule"]:
            continue
        lines.append(f"  {s}: with it skvs is better on {', '.join(r['better']) or 'nothing'}; "
                     f"worse on {', '.join(r['worse']) or 'nothing'}; throughput {r['throughput_effect']} "
                     f"(by {r['verdict_basis']})")
    rule = ("the range of its per-round ratios holds 1" if a["repeats"] > 1 else
            "it ran as many engine steps (one run has no spread; use --repeats N to measure it)"
            if a["non_timing_deterministic"] else
            f"it is within {THROUGHPUT_NOISE:.0%}, this CPU's run-to-run spread (use --repeats N to measure it)")
    lines.append("Verdicts: where the same output tokens took a different number of engine steps (deterministic), "
                 "the steps decide (fewer is faster) unless the repeats agree on the opposite; otherwise a throughput "
                 f"change counts as noise when {rule} (with --rate and one repeat: within {THROUGHPUT_NOISE:.0%}). "
                 + ("Non-timing metrics are deterministic for this seed (all arrivals at t = 0): any change in them "
                    "is real for this trace, though it is one trace." if a["non_timing_deterministic"] else
                    "With --rate, non-timing metrics depend on timing too."))
    return "\n".join(lines)
