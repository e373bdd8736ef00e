"""Named, seeded simulator configurations: the article's regimes, each run for every policy it compares.

A `Scenario` fixes a model, a device, a workload and the scheduler's geometry; `run` simulates it for each of its
policies (one compiled `sweep.run` per policy, the seeds as lanes, every policy on the same requests, arrivals and
acceptance draws) and returns plain dicts: per policy, every seed's metrics (`sweep.summaries`) plus what the
claims need from the per-step log (peak share of draft-only blocks, the bound of speculative blocks and the
largest share of it any step reached, the draft-length histogram, scheduler counters).

With `kv_sweep`, vllm_default first runs at each of those KV budgets (lanes of one call) and the budget whose mean
memory utilisation is nearest `target_utilisation` is the one every policy then runs at: the article's 82%
(its vllm_default column) found by a sweep, which `run` reports.

`SCENARIOS` (full sizes) and `quick(scenario)` (fewer, shorter requests, for `skvs claims --quick`) are what
`skvs claims` runs (docs/claims.md). Policy names are presets (`policies.PRESETS`) or the variants of `VARIANTS`;
"NAME:K" is NAME with the draft-length knob at K, on the same acceptance draws (a fixed draft length). A phased
workload's lanes carry per-phase metrics (`sim.simulate.summarize_groups`, under "phase").
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from skvs_jax import policies, workloads
from skvs_jax import scheduler as sc
from skvs_jax.config import CacheConfig
from skvs_jax.sim import acceptance_model, cost_model, simulate, sweep

CORE = ("vllm_default", "naive_spec", "skvs_article", "skvs")  # every scenario runs these but phased
FIXED_K = ("vllm_default", "naive_spec:1", "naive_spec:2", "naive_spec:3", "naive_spec:4")  # K = 0..4 on the same draws

# Variants: (preset, changes). The three "skvs_article-<group>" turn one group of the article's switches back to
# naive_spec's values, for the +21% decomposition (memory copies / prefix hits / padding).
VARIANTS: dict[str, tuple[str, dict]] = {
    "vllm_default-no_prefix_cache": ("vllm_default", {"prefix_cache": False}),
    "skvs-no_spec_in_prefill": ("skvs", {"spec_in_prefill": False}),
    "skvs_article+spec_in_prefill": ("skvs_article", {"spec_in_prefill": True}),
    "naive_spec-no_spec_in_prefill": ("naive_spec", {"spec_in_prefill": False}),
    "skvs_article-memory": ("skvs_article", {"release": "lazy", "spec_pool": False, "generation_threshold": 0,
                                             "drafts_preempt": True, "max_spec_ratio": 1.0}),
    "skvs_article-hits": ("skvs_article", {"prefix_barrier": False, "insert": "on_fill"}),
    "skvs_article-padding": ("skvs_article", {"adaptive_draft_len": False}),
}


def knob_of(name: str) -> tuple[str, int | None]:
    """("NAME", K) for a policy name "NAME:K" (NAME with the draft-length knob at K); (name, None) otherwise."""
    base, sep, k = name.rpartition(":")
    return (base, int(k)) if sep and k.isdigit() else (name, None)


def policy(name: str, k: int) -> policies.Policy:
    """A preset or a `VARIANTS` entry with draft length K, named `name` ("NAME:K": NAME's, the knob is set by
    `_run_policy`)."""
    base, knob = knob_of(name)
    if knob is not None:
        if not 0 <= knob <= k:
            raise ValueError(f"{name}: the draft-length knob must lie in [0, {k}]")
        return policy(base, k).replace(name=name)
    if name in policies.PRESETS:
        return policies.preset(name, k)
    if name not in VARIANTS:
        raise ValueError(f"unknown policy {name!r}; choose a preset {sorted(policies.PRESETS)} or a variant "
                         f"{sorted(VARIANTS)}")
    base, changes = VARIANTS[name]
    pol = policies.preset(base, k).replace(name=name, **changes)
    if changes.get("adaptive_draft_len") is False:
        pol = pol.replace(draft_buckets=(k,))
    return pol


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One simulated regime. kv_blocks None: what fits beside the weights in 90% of the devices' memory, capped
    at what max_seqs sequences of the longest request hold; kv_sweep: budgets for vllm_default to sweep first
    (the run then uses the one nearest target_utilisation). rate None: every request at t = 0."""

    name: str
    title: str
    model: str
    device: str
    tp: int
    workload: str
    workload_kw: tuple[tuple[str, object], ...]
    requests: int
    rate: float | None
    max_prompt_len: int
    max_output_len: int
    max_seqs: int
    policies: tuple[str, ...] = CORE
    kv_blocks: int | None = None
    kv_sweep: tuple[int, ...] = ()
    target_utilisation: float = 0.82
    token_budget: int = 2048
    prefill_chunk: int = 512
    draft_len: int = 4
    block_size: int = 16
    acceptance: str = "medusa-1"
    seeds: int = 3
    max_steps: int = 400_000

    def cost(self) -> cost_model.CostModel:
        return cost_model.CostModel(cost_model.MODELS[self.model], cost_model.DEVICES[self.device], tp=self.tp)

    def max_blocks_per_seq(self) -> int:
        return -(-(self.max_prompt_len + self.max_output_len + self.draft_len + 1) // self.block_size)

    def fit_blocks(self) -> int:
        """KV blocks beside the weights (`CostModel.max_kv_tokens`), capped at max_seqs whole requests."""
        return min(self.cost().max_kv_tokens() // self.block_size, self.max_seqs * self.max_blocks_per_seq())

    def pool_blocks(self) -> int:
        """The static pool: the largest budget any lane of this scenario uses."""
        return max(self.kv_sweep) if self.kv_sweep else (self.kv_blocks or self.fit_blocks())

    def sched_config(self, pol: policies.Policy) -> sc.SchedulerConfig:
        cache = CacheConfig(num_blocks=self.pool_blocks() + 1, block_size=self.block_size, max_seqs=self.max_seqs,
                            max_blocks_per_seq=self.max_blocks_per_seq())
        return sc.SchedulerConfig(cache=cache, policy=pol, max_running=self.max_seqs, token_budget=self.token_budget,
                                  prefill_chunk=min(self.prefill_chunk, self.token_budget))

    def describe(self) -> dict:
        return dataclasses.asdict(self) | {"workload_kw": dict(self.workload_kw)}


def quick(s: Scenario, requests: int, max_output_len: int | None = None, kv_sweep: tuple[int, ...] | None = None,
          **changes) -> Scenario:
    """The scenario with fewer (and optionally shorter) requests: what `skvs claims --quick` runs."""
    out = s.max_output_len if max_output_len is None else max_output_len
    kw = dict(s.workload_kw)
    if "max_output_len" in kw:
        kw["max_output_len"] = out
    if "mean_output_len" in kw:
        kw["mean_output_len"] = float(out)
    return dataclasses.replace(s, requests=requests, max_output_len=out, workload_kw=tuple(kw.items()),
                               kv_sweep=s.kv_sweep if kv_sweep is None else kv_sweep, **changes)


def _workloads(s: Scenario) -> list[workloads.Trace]:
    kw = dict(s.workload_kw) | {"max_prompt_len": s.max_prompt_len, "max_output_len": s.max_output_len}
    return [workloads.make(s.workload, s.requests, seed=seed, rate=s.rate, **kw) for seed in range(s.seeds)]


def _traces(s: Scenario, cfg: sc.SchedulerConfig) -> simulate.SimTrace:
    alphas = acceptance_model.alphas(s.acceptance, s.draft_len)
    vocab = cost_model.MODELS[s.model].vocab_size
    return sweep.stack([simulate.make_trace(t, cfg, alphas=alphas, seed=seed, vocab_size=vocab)
                        for seed, t in enumerate(_workloads(s))])


def spec_bound(pol: policies.Policy, block_size: int, num_seqs: np.ndarray) -> np.ndarray:
    """int64[steps]: the article's bound on blocks held by drafts, spec_window x batch x max_rejected, per step.

    Read at block level: a sequence's drafts of one step fill at most ceil(K / S) blocks of their own (the
    window); a rejected block can outlive its step for `generation_threshold` more generations in the
    speculative pool (max_rejected = threshold + 1; 1 without a pool, where rejected blocks leave at once or,
    lazily, are reused by the same sequence's next tokens); batch = the most sequences any step of those
    generations ran. 0 without speculation."""
    if not pol.speculation:
        return np.zeros_like(num_seqs, np.int64)
    window = -(-pol.draft_len // block_size)
    gens = (pol.generation_threshold + 1) if pol.spec_pool else 1
    seqs = np.asarray(num_seqs, np.int64)
    batch = np.array([seqs[max(0, t - gens + 1): t + 1].max(initial=0) for t in range(len(seqs))], np.int64)
    return window * batch * gens


def _lane_extras(log, pol: policies.Policy, s: Scenario, kv_blocks: int) -> dict:
    act = np.asarray(log.active)
    spec = np.asarray(log.spec_blocks)[act].astype(np.int64)
    seqs = np.asarray(log.num_seqs)[act]
    bound = spec_bound(pol, s.block_size, seqs)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(bound > 0, spec / np.maximum(bound, 1), np.where(spec > 0, np.inf, 0.0))
    hist = np.asarray(log.draft_hist)[act].sum(axis=0)
    return {
        "kv_blocks": kv_blocks,
        "peak_utilisation": float(np.max(np.asarray(log.blocks_used)[act], initial=0) / kv_blocks),
        "peak_spec_share": float(spec.max(initial=0) / kv_blocks),
        "mean_spec_share": float(spec.mean() / kv_blocks) if spec.size else math.nan,
        "bound_max_share": float(share.max(initial=0.0)),
        "bound_violations": int(np.sum(spec > bound)),
        "steps_checked": int(act.sum()),
        "preemptions": int(np.asarray(log.preempted)[act].sum()),
        "oom_steps": int(np.asarray(log.oom)[act].sum()),
        "draft_hist": hist.astype(int).tolist(),
    }


def _spread(values: list[float]) -> dict:
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], np.float64)
    if not v.size:
        return {"mean": math.nan, "min": math.nan, "max": math.nan}
    return {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max())}


def _run_policy(s: Scenario, name: str, kv_list: list[int], chunk: int) -> tuple[list[dict], float, int]:
    pol = policy(name, s.draft_len)
    cfg = s.sched_config(pol)
    traces = _traces(s, cfg)
    knobs, knob = pol.knobs(), knob_of(name)[1]
    if knob is not None:
        knobs = knobs.replace(draft_len=jnp.asarray(knob, jnp.int32))
    lanes, labels = sweep.grid(knobs, cfg=cfg, kv_blocks=kv_list, traces=list(range(s.seeds)))
    t0 = time.perf_counter()
    states, logs = sweep.run(traces, lanes, cfg=cfg, cost=s.cost(), max_steps=s.max_steps, chunk=chunk,
                             strategy="map")
    jax.block_until_ready(logs)
    wall = time.perf_counter() - t0
    done = sweep.finished(states)
    groups = {"phase": [workloads.phase_of(t) for t in _workloads(s)]} if s.workload == "phased" else None
    ms = sweep.summaries(logs, traces, lanes, cfg, groups)
    host = jax.device_get(logs)
    out = []
    for i, (lab, m) in enumerate(zip(labels, ms, strict=True)):
        m = dict(m) | {"seed": lab["trace"], "finished": int(done[i])}
        m |= _lane_extras(sweep.lane(host, i), pol, s, lab["kv_blocks"])
        ct = states.counters
        for key in ("draft_blocks", "oom_steps_drafts", "preempt_drafts", "preempt_recompute"):
            m[key] = int(np.asarray(getattr(ct, key))[i])
        out.append(m)
    return out, wall, int(np.asarray(logs.active).sum())


SUMMARY_KEYS = ("throughput", "tpot_p50", "tpot_p99", "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99", "kv_hit_rate",
                "memory_utilisation", "peak_utilisation", "spec_token_waste", "oom_rate", "preemptions",
                "preemptions_per_request", "peak_spec_share", "mean_spec_share", "bound_max_share", "acceptance_rate",
                "mean_accepted_length", "mean_batch", "draft_blocks")


def run(s: Scenario, *, chunk: int = 2048, log=print, kv_blocks: int | None = None,
        only: tuple[str, ...] | None = None) -> dict:
    """Simulate the scenario for each of its policies. Returns {"scenario", "kv_blocks", "sweep", "policies":
    {name: {"lanes": [per-seed metrics], "summary": {key: {mean, min, max}}, "draft_hist": [...]}}, "wall_s"}.
    kv_blocks: run at this budget, no sweep (the static pool stays the sweep's, so the lanes are those a sweep
    choosing it runs); only: a subset of the policies (runs of disjoint subsets merge: `skvs claims --from-json`).

    The sweep's choice: among the budgets where vllm_default preempts in every seed (memory really under
    pressure, not in one unlucky trace), the one whose mean utilisation is nearest target_utilisation; failing
    that, among those where it preempts in some seed; if it never preempts, the nearest of all."""
    t_start = time.perf_counter()
    result: dict = {"scenario": s.describe(), "sweep": [], "policies": {}}
    kv = kv_blocks or s.kv_blocks or s.fit_blocks()
    if s.kv_sweep and kv_blocks is None:
        lanes, wall, steps = _run_policy(s, "vllm_default", list(s.kv_sweep), chunk)
        for b in s.kv_sweep:
            mine = [m for m in lanes if m["kv_blocks"] == b]
            result["sweep"].append({"kv_blocks": b} | {k: _spread([m[k] for m in mine])["mean"] for k in (
                "memory_utilisation", "peak_utilisation", "preemptions", "oom_rate", "kv_hit_rate", "throughput")}
                | {"min_preemptions": min(m["preemptions"] for m in mine)})
        pressed = ([r for r in result["sweep"] if r["min_preemptions"] > 0]
                   or [r for r in result["sweep"] if r["preemptions"] > 0] or result["sweep"])
        kv = min(pressed, key=lambda r: (abs(r["memory_utilisation"] - s.target_utilisation), -r["kv_blocks"]))[
            "kv_blocks"]
        log(f"  {s.name}: vllm_default KV sweep {list(s.kv_sweep)} -> {kv} blocks "
            f"({steps} steps, {wall:.0f} s)")
        found = [m for m in lanes if m["kv_blocks"] == kv]
        result["policies"]["vllm_default"] = {"lanes": found}
    result["kv_blocks"] = kv
    for name in s.policies if only is None else only:
        if name in result["policies"]:
            continue
        lanes, wall, steps = _run_policy(s, name, [kv], chunk)
        result["policies"][name] = {"lanes": lanes}
        log(f"  {s.name}: {name}: {len(lanes)} seeds, {steps} simulated steps in {wall:.0f} s")
    for res in result["policies"].values():
        ls = res["lanes"]
        res["summary"] = {k: _spread([m.get(k, math.nan) for m in ls]) for k in SUMMARY_KEYS}
        res["draft_hist"] = np.sum([m["draft_hist"] for m in ls], axis=0).astype(int).tolist()
        res["unfinished_lanes"] = int(sum(m["finished"] < s.requests for m in ls))
    result["wall_s"] = time.perf_counter() - t_start
    return result


# ---------------------------------------------------------------------------------------------- the scenarios

_SHARED_PROMPTS = (("num_system_prompts", 16), ("system_prompt_len", 512), ("zipf_exponent", 1.1), ("scale", 1.0))
_ALL = CORE + ("naive_spec_vllm",)

SCENARIOS: dict[str, Scenario] = {
    # The article's benchmark under pressure: Llama-3.1-8B on 2 x A100-80GB, ShareGPT lengths behind shared
    # system prompts (its "API traffic with many repeated system prompts"), offered faster than it is served,
    # at the KV budget where vllm_default's mean utilisation is nearest the article's 82%. Also scenario 2's
    # table (no prefix cache / prefix cache / + Medusa / co-design) and the +21% decomposition.
    "pressure": Scenario(
        name="pressure", title="the article's benchmark under memory pressure (Llama-3.1-8B, 2 x A100-80GB)",
        model="llama-3.1-8b", device="a100-80gb", tp=2, workload="system_prompts", workload_kw=_SHARED_PROMPTS,
        requests=256, rate=48.0, max_prompt_len=1536, max_output_len=512, max_seqs=256,
        policies=_ALL + ("vllm_default-no_prefix_cache", "skvs_article-memory", "skvs_article-hits",
                         "skvs_article-padding"),
        kv_sweep=(2048, 3072, 3584, 4096, 4608, 5120, 6144)),
    # Scenario 1: 8K-token prompts, 2K-token outputs, Medusa K = 4 (medusa-1: 2.3 tokens per verification),
    # batch 32, every request at t = 0; the share of memory held by draft-only blocks. Also the chunked-prefill
    # rule (speculation during prefill on and off) on these long prompts.
    "long_prompts": Scenario(
        name="long_prompts", title="scenario 1: 8K prompts, 2K outputs, Medusa K=4, batch 32 (Llama-3.1-8B, 2 x A100)",
        model="llama-3.1-8b", device="a100-80gb", tp=2, workload="sharegpt",
        workload_kw=(("mean_prompt_len", 8192.0), ("mean_output_len", 2048.0), ("prompt_sigma", 0.0),
                     ("output_sigma", 0.0), ("scale", 1.0)),
        requests=32, rate=None, max_prompt_len=8192, max_output_len=2048, max_seqs=32,
        policies=_ALL + ("skvs_article+spec_in_prefill", "skvs-no_spec_in_prefill",
                         "naive_spec-no_spec_in_prefill")),
    # KV-starved: Llama-3-70B over 2 x H100-80GB: at 90% of memory, beside the weights and the 4 Medusa heads
    # (8.6 GB: each head has its own 128k-vocab projection), `CostModel.max_kv_tokens` leaves 741 blocks (11.9k
    # tokens, the issue said ~28k; without the heads 39k); the same on 2 x H200 (141 GB each).
    "starved_h100": Scenario(
        name="starved_h100", title="KV-starved: Llama-3-70B + Medusa heads on 2 x H100-SXM (~12k tokens of KV)",
        model="llama-3-70b", device="h100-sxm", tp=2, workload="system_prompts", workload_kw=_SHARED_PROMPTS,
        requests=128, rate=8.0, max_prompt_len=1536, max_output_len=512, max_seqs=128, policies=_ALL),
    "starved_h200": Scenario(
        name="starved_h200", title="Llama-3-70B on 2 x H200 (the same model with 141 GB a device)",
        model="llama-3-70b", device="h200", tp=2, workload="system_prompts", workload_kw=_SHARED_PROMPTS,
        requests=128, rate=8.0, max_prompt_len=1536, max_output_len=512, max_seqs=128, policies=_ALL),
    # Load that steps, low -> high -> low (96 requests at 4 req/s, 256 at 48, 96 at 4; ShareGPT at full length):
    # skvs's draft control against every fixed draft length, the best of which per phase is the hindsight oracle
    # (docs/design.md, "Draft control's tail").
    "phased": Scenario(
        name="phased", title="load that steps: 96 requests at 4 req/s, 256 at 48, 96 at 4 (Llama-3.1-8B, 1 x A100)",
        model="llama-3.1-8b", device="a100-80gb", tp=1, workload="phased",
        workload_kw=(("phases", ((96, 1.0), (256, 12.0), (96, 1.0))), ("scale", 1.0)), requests=448, rate=4.0,
        max_prompt_len=1024, max_output_len=1024, max_seqs=64, kv_blocks=8192,
        policies=FIXED_K + ("skvs",)),
}


def quick_scenarios() -> dict[str, Scenario]:
    """`skvs claims --quick`: the same regimes with fewer, shorter requests and fewer policy variants (each
    policy is one compilation, most of a small run's time): no decomposition ablations, one chunked-prefill pair,
    and the H200 run for vllm_default and skvs only."""
    p, lp = SCENARIOS["pressure"], SCENARIOS["long_prompts"]
    return {
        "pressure": quick(p, 128, 256, kv_sweep=(1536, 2048, 2560, 3072),
                          policies=_ALL + ("vllm_default-no_prefix_cache",)),
        "long_prompts": quick(lp, 32, 256, policies=CORE + ("naive_spec-no_spec_in_prefill",)),
        "starved_h100": quick(SCENARIOS["starved_h100"], 64, 256, rate=4.0, policies=CORE),
        "starved_h200": quick(SCENARIOS["starved_h200"], 64, 256, rate=4.0, policies=("vllm_default", "skvs")),
        "phased": quick(SCENARIOS["phased"], 112, 256, seeds=2),
    }
