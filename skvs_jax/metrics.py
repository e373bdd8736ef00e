"""Benchmark metrics, computed exactly as docs/design.md ("Metrics") defines them, from plain event logs.

Users compare our numbers with vLLM, SGLang and TensorRT-LLM, so every metric is one formula over two logs that
the engine (wall-clock seconds) and the simulator (simulated seconds) both fill; numpy only, no framework. The
serving metrics are those `vllm bench serve` prints (mean, median, P90, P99 of TTFT, TPOT, ITL and end-to-end
latency; request and output-token throughput), with its definitions.

Logs:
  RequestRecord  one per finished or aborted request (times in seconds, token counts).
  StepRecord     equal-length arrays, one entry per engine step; `StepLog` appends a step at a time and
                 freezes into a StepRecord.

Two vocabularies of the same numbers:
  `summarize`   the summary in SI units, keys without units (times in seconds, rates as fractions in [0, 1]):
                what the library and the simulator (`sim.simulate.summarize`, `sim.scenarios`, `skvs claims`)
                read.
  `with_units`  the same summary as the commands report it (bench.json, simulate.json, the tables): every key
                of a quantity with a unit says it, `_ms` for latencies, `_s` for durations, `_per_s` for rates
                (`UNITS` maps one to the other); fractions and counts keep their names.

Metrics of `summarize` (key [unit] -> reported key). "finished" means records with `aborted=False`; STAT is mean,
p50, p90 and p99 (reported as mean, median, p90, p99, vLLM's names: `median_ttft_ms`); sums over steps run over
every step of the StepRecord:
  throughput           sum(num_output_tokens of finished) / wall_time [tok/s]           -> output_tokens_per_s
  request_throughput   finished requests / wall_time [req/s]                              -> requests_per_s
                       wall_time = max(finish_time) - min(arrival_time) over all records unless passed;
                       aborted requests' tokens are not counted (as vLLM's benchmark_serving does).
  ttft_STAT [s]        first_token_time - arrival_time, finished with a first token    -> STAT_ttft_ms
  tpot_STAT [s]        (finish_time - first_token_time) / (num_output_tokens - 1), one value per finished
                       request with >= 2 output tokens (so the mean is vLLM's mean TPOT) -> STAT_tpot_ms
  itl_STAT [s]         inter-token latency, over every gap of every finished request with token_times, pooled
                       (as vLLM pools them): see "ITL" below                           -> STAT_itl_ms
  e2e_STAT [s]         finish_time - arrival_time, finished (vLLM's "e2el")             -> STAT_e2e_ms
  tpot_slo_attainment  of the finished requests with a tpot_target, the share whose TPOT <= it (a request with
                       one output token has no TPOT to miss: it meets it); NaN when none has a target
  goodput              finished requests that met their tpot_target (one without a target meets it) / wall_time
                       [req/s], `vllm bench serve --goodput tpot:X`'s request goodput when every request has
                       target X; NaN when none has a target                           -> goodput_requests_per_s
  kv_hit_rate          sum(num_cached_prompt_tokens) / sum(num_admitted_prompt_tokens), all records
  kv_hit_rate_first    sum(num_first_cached_prompt_tokens) / sum(num_prompt_tokens), over records admitted
                       at least once (num_admitted_prompt_tokens > 0): first admissions only
  memory_utilisation   mean over steps of blocks_used / blocks_total
  spec_token_waste     (sum(num_drafted) - sum(num_accepted)) / sum(num_drafted), over steps
  spec_kv_waste        mean over steps of spec_waste_blocks / blocks_total
  oom_rate             steps with oom / steps
  preemptions_per_request  sum(num_preemptions) / records
  acceptance_rate      sum(num_accepted) / sum(num_drafted), over steps
  mean_accepted_length sum(num_accepted) / sum(num_verifications), over steps: accepted drafts per
                       (sequence, step) verification, *excluding* the bonus token, so greedy decoding
                       emits mean_accepted_length + 1 tokens per verification (Medusa's "acceleration")
  scheduler_time_per_step  mean over steps of scheduler_time [s]                         -> scheduler_time_per_step_ms
  scheduler_time_share sum(scheduler_time) / sum(duration), over steps
Context keys, not metrics: num_requests, num_aborted, num_steps, output_tokens, wall_time [s] (-> wall_time_s).

ITL: the gaps between the times at which a request's consecutive output tokens were produced, one gap per
*chunk*: tokens with the same time in `token_times` came out of one engine step, so a step that emits an
accepted draft run of k tokens gives one gap, not k - 1 gaps of 0. This is vLLM's per-chunk ITL (`vllm bench
serve` appends one gap per streamed chunk), chosen so that our ITL compares with what vLLM users read. Per-token
gaps with zeros would put the median ITL at 0 as soon as half the tokens are accepted drafts; SGLang's
bench_serving instead spreads a chunk's gap evenly over its tokens (which makes the mean ITL equal the TPOT).
With speculation the mean ITL exceeds the mean TPOT: ITL is the time between steps, TPOT the time per token.
A record without `token_times` (the simulator knows only each request's first and last token times) adds no
gap; with none anywhere every itl_STAT is NaN, while TTFT, TPOT and end-to-end latency need only those two
times and stay exact.

Conventions:
  - Percentiles are numpy's default "linear" method (Hyndman & Fan type 7), the one vLLM's benchmark_serving
    uses via np.percentile: P50 of (1, 2, 3, 4) is 2.5, not a sample; the median is P50.
  - Aborted requests are excluded from throughput and latency (their latency is undefined or truncated) but
    count in hit rate and preemptions, which describe the cache and scheduler, not the client.
  - KV hit rate counts *every admission*: a request re-admitted after preemption looks up its tokens again
    (with recompute, its prompt plus the output so far), and those lookups enter numerator and denominator, so
    a cache that keeps a preempted sequence's blocks gets credit for the prefill it saves.
    `num_admitted_prompt_tokens` defaults to `num_prompt_tokens` (one admission). Under memory pressure that
    credit is large and says nothing about shared prefixes (a trace that shares none scores a hit rate from its
    preemptions alone), so `kv_hit_rate_first` counts each request once, at its first admission: the prefix
    sharing the cache found. `num_first_cached_prompt_tokens` defaults to `num_cached_prompt_tokens`.
  - Any ratio with a zero denominator and any statistic of an empty set is NaN, never an exception; a log
    that contradicts itself (arrays of different lengths, accepted > drafted) raises ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from skvs_jax import checks

# --------------------------------------------------------------------------------------------- request log


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestRecord:
    """What happened to one request, finished or aborted.

    Attributes:
      request_id: the trace's request id.
      arrival_time: when the request arrived [s].
      first_token_time: when its first output token was produced [s]; NaN if none was.
      finish_time: when it finished or was aborted [s].
      num_prompt_tokens: prompt length.
      num_output_tokens: output tokens produced (and kept).
      num_cached_prompt_tokens: prompt tokens served from the prefix cache, summed over every admission.
      num_admitted_prompt_tokens: tokens looked up in the prefix cache, summed over every admission (the
        prompt, plus for a recompute re-admission the output so far); None means num_prompt_tokens (admitted
        once); 0 for a request aborted before admission.
      token_times: optional time of each output token [s] (len == num_output_tokens when given).
      num_preemptions: times the request was preempted.
      num_drafted, num_accepted: draft tokens proposed for / accepted into this request.
      aborted: whether the request ended without finishing.
      num_first_cached_prompt_tokens: of num_cached_prompt_tokens, those served at the first admission (<=
        num_prompt_tokens); None means num_cached_prompt_tokens, which needs a request admitted at most once
        (num_admitted_prompt_tokens <= num_prompt_tokens; ValueError otherwise).
      tpot_target: the request's TPOT objective [s] (SamplingParams.tpot_target, or the run's), or None.
    """

    request_id: int
    arrival_time: float
    first_token_time: float
    finish_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_prompt_tokens: int = 0
    num_admitted_prompt_tokens: int | None = None
    token_times: tuple[float, ...] = ()
    num_preemptions: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    aborted: bool = False
    num_first_cached_prompt_tokens: int | None = None
    tpot_target: float | None = None

    def __post_init__(self) -> None:
        if self.num_admitted_prompt_tokens is None:
            object.__setattr__(self, "num_admitted_prompt_tokens", self.num_prompt_tokens)
        if self.num_first_cached_prompt_tokens is None:
            if checks.is_int(self.num_admitted_prompt_tokens) and checks.is_int(self.num_prompt_tokens) and (
                    self.num_admitted_prompt_tokens > self.num_prompt_tokens):
                # Every re-admission looks up the prompt again, so more tokens than the prompt means several.
                raise ValueError(f"num_first_cached_prompt_tokens is required for a request admitted more than "
                                 f"once (num_admitted_prompt_tokens {self.num_admitted_prompt_tokens} > "
                                 f"num_prompt_tokens {self.num_prompt_tokens}) (request {self.request_id})")
            object.__setattr__(self, "num_first_cached_prompt_tokens", self.num_cached_prompt_tokens)
        object.__setattr__(self, "token_times", tuple(float(t) for t in self.token_times))
        for name in ("num_prompt_tokens", "num_output_tokens", "num_cached_prompt_tokens",
                     "num_admitted_prompt_tokens", "num_preemptions", "num_drafted", "num_accepted",
                     "num_first_cached_prompt_tokens"):
            value = getattr(self, name)
            if not checks.is_int(value):  # 2.5 tokens gave a TPOT
                raise TypeError(f"{name} must be an int, got {value!r} (request {self.request_id})")
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)} (request {self.request_id})")
        if self.num_cached_prompt_tokens > self.num_admitted_prompt_tokens:
            raise ValueError(f"num_cached_prompt_tokens ({self.num_cached_prompt_tokens}) exceeds "
                             f"num_admitted_prompt_tokens ({self.num_admitted_prompt_tokens}) "
                             f"(request {self.request_id})")
        first = self.num_first_cached_prompt_tokens
        if first > min(self.num_cached_prompt_tokens, self.num_prompt_tokens):
            raise ValueError(f"num_first_cached_prompt_tokens ({first}) exceeds num_cached_prompt_tokens "
                             f"({self.num_cached_prompt_tokens}) or num_prompt_tokens ({self.num_prompt_tokens}) "
                             f"(request {self.request_id})")
        if self.num_accepted > self.num_drafted:
            raise ValueError(f"num_accepted ({self.num_accepted}) exceeds num_drafted ({self.num_drafted}) "
                             f"(request {self.request_id})")
        if self.token_times and len(self.token_times) != self.num_output_tokens:
            raise ValueError(f"token_times has {len(self.token_times)} entries, num_output_tokens is "
                             f"{self.num_output_tokens} (request {self.request_id})")
        if any(later < earlier for earlier, later in zip(self.token_times, self.token_times[1:])):
            raise ValueError(f"token_times must be non-decreasing (request {self.request_id})")
        if self.finish_time < self.arrival_time:  # False when either is NaN
            raise ValueError(f"finish_time ({self.finish_time}) precedes arrival_time ({self.arrival_time}) "
                             f"(request {self.request_id})")
        if not self.aborted and not (math.isfinite(self.arrival_time) and math.isfinite(self.finish_time)):
            raise ValueError(f"a finished request needs finite arrival_time and finish_time, got "
                             f"{self.arrival_time} and {self.finish_time} (request {self.request_id})")
        target = self.tpot_target
        if target is not None and (isinstance(target, bool) or not isinstance(target, numbers.Real)
                                   or not (math.isfinite(target) and target > 0)):
            raise ValueError(f"tpot_target must be a finite number > 0 [s] or None, got {target!r} "
                             f"(request {self.request_id})")
        first = self.first_token_time
        if first < self.arrival_time or first > self.finish_time:  # False for a NaN on either side
            raise ValueError(f"first_token_time ({first}) must lie between arrival_time ({self.arrival_time}) and "
                             f"finish_time ({self.finish_time}), or be NaN (request {self.request_id})")


# ------------------------------------------------------------------------------------------------ step log

# field -> dtype; the first four are required, the rest default to zeros (e.g. a run without speculation).
STEP_FIELDS: dict[str, type] = {
    "start_time": np.float64,  # when the step began [s]
    "duration": np.float64,  # step wall (or simulated) time [s]
    # Non-free blocks at the step's peak (after its allocations, before its commit returns rejected drafts'
    # blocks; `scheduler.Batch.blocks_used`): every usable block off the free stack (held by sequences, in the
    # speculative pool, or cached with ref_count 0). vLLM's KV-usage gauge instead counts the last as free.
    "blocks_used": np.int64,
    "blocks_total": np.int64,  # usable blocks of the pool (N - 1: the null block excluded), >= 1
    "scheduler_time": np.float64,  # part of duration spent scheduling and allocating [s]
    "spec_waste_blocks": np.int64,  # blocks holding only unvalidated or rejected drafts
    "oom": np.bool_,  # some sequence could not get its blocks without preemption
    "num_preempted": np.int64,  # sequences preempted in the step
    "num_drafted": np.int64,  # draft tokens proposed, summed over the batch
    "num_accepted": np.int64,  # draft tokens accepted, summed over the batch
    "num_verifications": np.int64,  # sequences whose drafts were verified in the step
    "num_output_tokens": np.int64,  # output tokens committed in the step
}
_REQUIRED_STEP_FIELDS = ("start_time", "duration", "blocks_used", "blocks_total")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class StepRecord:
    """One entry per engine step, as read-only numpy arrays of equal length [steps] (see STEP_FIELDS)."""

    start_time: np.ndarray
    duration: np.ndarray
    blocks_used: np.ndarray
    blocks_total: np.ndarray
    scheduler_time: np.ndarray | None = None
    spec_waste_blocks: np.ndarray | None = None
    oom: np.ndarray | None = None
    num_preempted: np.ndarray | None = None
    num_drafted: np.ndarray | None = None
    num_accepted: np.ndarray | None = None
    num_verifications: np.ndarray | None = None
    num_output_tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        steps = np.shape(self.start_time)[0] if np.ndim(self.start_time) == 1 else None
        for name, dtype in STEP_FIELDS.items():
            value = getattr(self, name)
            object.__setattr__(self, name, _step_array(name, dtype, value, steps))
        for name in STEP_FIELDS:
            if name not in ("start_time", "oom") and np.any(getattr(self, name) < 0):
                raise ValueError(f"{name} must be >= 0")
        if np.any(self.blocks_total < 1):
            raise ValueError("blocks_total must be >= 1")
        for name, bound in (("blocks_used", "blocks_total"), ("spec_waste_blocks", "blocks_used"),
                            ("num_accepted", "num_drafted"), ("scheduler_time", "duration")):
            over = getattr(self, name) > getattr(self, bound)
            if np.any(over):
                raise ValueError(f"{name} exceeds {bound} at step {int(np.argmax(over))}")

    def __len__(self) -> int:
        return self.start_time.shape[0]

    @classmethod
    def empty(cls) -> StepRecord:
        return StepLog().freeze()


def _step_array(name: str, dtype: type, value: object, steps: int | None) -> np.ndarray:
    """value as a read-only 1-D array of `dtype` with `steps` entries (zeros when an optional field is None)."""
    if value is None:
        if name in _REQUIRED_STEP_FIELDS:
            raise ValueError(f"{name} is required")
        value = np.zeros(steps or 0, dtype)
    array = np.asarray(value)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if steps is not None and array.shape[0] != steps:
        raise ValueError(f"{name} has {array.shape[0]} entries, start_time has {steps}")
    integral = np.issubdtype(array.dtype, np.integer) or array.dtype == bool
    if dtype is not np.float64 and array.size and not integral:  # no silent truncation of 2.5 blocks
        raise TypeError(f"{name} must hold {'bools' if dtype is np.bool_ else 'integers'}, got {array.dtype}")
    array = array.astype(dtype)  # a copy: the caller's buffer can't change the record afterwards
    array.setflags(write=False)
    return array


class StepLog:
    """Host-side builder: `append` one engine step at a time, then `freeze()` into a StepRecord."""

    def __init__(self) -> None:
        self._columns: dict[str, list] = {name: [] for name in STEP_FIELDS}

    def append(self, *, start_time: float, duration: float, blocks_used: int, blocks_total: int,
               scheduler_time: float = 0.0, spec_waste_blocks: int = 0, oom: bool = False, num_preempted: int = 0,
               num_drafted: int = 0, num_accepted: int = 0, num_verifications: int = 0,
               num_output_tokens: int = 0) -> None:
        values = (start_time, duration, blocks_used, blocks_total, scheduler_time, spec_waste_blocks, oom,
                  num_preempted, num_drafted, num_accepted, num_verifications, num_output_tokens)  # STEP_FIELDS order
        for column, value in zip(self._columns.values(), values, strict=True):
            column.append(value)

    def __len__(self) -> int:
        return len(self._columns["start_time"])

    def freeze(self) -> StepRecord:
        return StepRecord(**{name: np.asarray(values, dtype) for (name, values), dtype
                             in zip(self._columns.items(), STEP_FIELDS.values())})


# ------------------------------------------------------------------------------------------------- summary

PERCENTILE_METHOD = "linear"

LATENCIES = ("ttft", "tpot", "itl", "e2e")  # the per-request latencies, each summarised by every STAT
STATS = (("mean", "mean"), ("p50", "median"), ("p90", "p90"), ("p99", "p99"))  # (summary, reported) names
_LATENCY_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "end-to-end"}
_STAT_LABELS = {"mean": "mean", "median": "median", "p90": "P90", "p99": "P99"}

# summary key -> (reported key, factor from the summary's unit to the reported one): `with_units`.
UNITS: dict[str, tuple[str, float]] = {
    "request_throughput": ("requests_per_s", 1.0),
    "throughput": ("output_tokens_per_s", 1.0),
    **{f"{name}_{stat}": (f"{shown}_{name}_ms", 1e3) for name in LATENCIES for stat, shown in STATS},
    "scheduler_time_per_step": ("scheduler_time_per_step_ms", 1e3),
    "wall_time": ("wall_time_s", 1.0),
    "goodput": ("goodput_requests_per_s", 1.0),
}

# (reported key, table label, factor from the reported unit to the table's), in table order.
METRICS: tuple[tuple[str, str, float], ...] = (
    ("requests_per_s", "request throughput (req/s)", 1.0),
    ("output_tokens_per_s", "output throughput (tok/s)", 1.0),
    *((f"{shown}_{name}_ms", f"{_LATENCY_LABELS[name]} {_STAT_LABELS[shown]} (ms)", 1.0)
      for name in LATENCIES for _, shown in STATS),
    ("tpot_slo_attainment", "TPOT SLO attainment (%)", 100.0),
    ("goodput_requests_per_s", "request goodput (req/s)", 1.0),
    ("kv_hit_rate", "KV hit rate (%)", 100.0),
    ("kv_hit_rate_first", "KV hit rate, first admissions (%)", 100.0),
    ("memory_utilisation", "memory utilisation (%)", 100.0),
    ("spec_token_waste", "speculative token waste (%)", 100.0),
    ("spec_kv_waste", "speculative KV waste (%)", 100.0),
    ("oom_rate", "OOM rate (% of steps)", 100.0),
    ("preemptions_per_request", "preemptions per request", 1.0),
    ("acceptance_rate", "acceptance rate (%)", 100.0),
    ("mean_accepted_length", "mean accepted length (tok/verification)", 1.0),
    ("scheduler_time_per_step_ms", "scheduler time per step (ms)", 1.0),
    ("scheduler_time_share", "scheduler time share (%)", 100.0),
)
# Rows `format_table` leaves out when no policy has a value (a run without TPOT targets).
OPTIONAL_ROWS = ("tpot_slo_attainment", "goodput_requests_per_s")
# The reported keys that depend on the clock; with every arrival at t = 0 the others are reproducible.
TIMING_KEYS = ("requests_per_s", "output_tokens_per_s", *(f"{shown}_{name}_ms" for name in LATENCIES
                                                           for _, shown in STATS),
               "tpot_slo_attainment", "goodput_requests_per_s", "scheduler_time_per_step_ms", "scheduler_time_share",
               "wall_time_s")


def safe_ratio(numerator: float, denominator: float) -> float:
    return float(numerator) / float(denominator) if denominator > 0 else math.nan


def _mean(values: np.ndarray) -> float:
    return float(np.mean(values)) if values.size else math.nan


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q, method=PERCENTILE_METHOD)) if values.size else math.nan


def _request_columns(requests: Sequence[RequestRecord]) -> dict[str, np.ndarray]:
    names = ("arrival_time", "first_token_time", "finish_time", "num_output_tokens", "num_cached_prompt_tokens",
             "num_admitted_prompt_tokens", "num_preemptions", "aborted", "num_prompt_tokens",
             "num_first_cached_prompt_tokens")
    return {name: np.array([getattr(r, name) for r in requests], dtype=bool if name == "aborted" else np.float64)
            for name in names}


def _wall_time(columns: dict[str, np.ndarray], wall_time: float | None) -> float:
    if wall_time is not None:
        if isinstance(wall_time, bool) or not isinstance(wall_time, numbers.Real):
            raise TypeError(f"wall_time must be a real number, got {type(wall_time).__name__}")
        if not (math.isfinite(wall_time) and wall_time > 0):
            raise ValueError(f"wall_time must be a finite number > 0, got {wall_time!r}")
        return float(wall_time)
    finish, arrival = columns["finish_time"], columns["arrival_time"]
    finish, arrival = finish[np.isfinite(finish)], arrival[np.isfinite(arrival)]
    return float(finish.max() - arrival.min()) if finish.size and arrival.size else math.nan


def inter_token_latencies(token_times: Sequence[float]) -> np.ndarray:
    """[chunks - 1] the ITL gaps of one request [s]: between consecutive distinct token times, one per chunk of
    tokens produced together (the module docstring's "ITL"); empty for fewer than two chunks."""
    gaps = np.diff(np.asarray(token_times, np.float64))
    return gaps[gaps > 0]


def request_latencies(r: RequestRecord) -> dict[str, float]:
    """One request's TTFT, TPOT and end-to-end latency [s] (NaN where undefined: aborted, no first token, fewer
    than two output tokens for TPOT), as `summarize` counts them."""
    done = not r.aborted
    has_first = done and math.isfinite(r.first_token_time)
    tpot = ((r.finish_time - r.first_token_time) / (r.num_output_tokens - 1)
            if has_first and math.isfinite(r.finish_time) and r.num_output_tokens >= 2 else math.nan)
    return {"ttft": r.first_token_time - r.arrival_time if has_first else math.nan, "tpot": tpot,
            "e2e": r.finish_time - r.arrival_time if done and math.isfinite(r.finish_time) else math.nan}


def _latency_metrics(requests: Sequence[RequestRecord]) -> dict[str, float]:
    per_request = [request_latencies(r) for r in requests]
    samples = {name: np.array([x[name] for x in per_request], np.float64) for name in ("ttft", "tpot", "e2e")}
    samples = {name: v[np.isfinite(v)] for name, v in samples.items()}
    gaps = [inter_token_latencies(r.token_times) for r in requests if not r.aborted and r.token_times]
    samples["itl"] = np.concatenate(gaps) if gaps else np.zeros(0)  # pooled over requests, as vLLM's bench
    out = {}
    for name in LATENCIES:
        out[f"{name}_mean"] = _mean(samples[name])
        out |= {f"{name}_p{q}": _percentile(samples[name], q) for q in (50, 90, 99)}
    return out


def _slo_metrics(requests: Sequence[RequestRecord], wall: float) -> dict[str, float]:
    """tpot_slo_attainment and goodput (the module docstring)."""
    met, judged, good = 0, 0, 0
    for r in requests:
        if r.aborted:
            continue
        tpot = request_latencies(r)["tpot"]
        ok = r.tpot_target is None or not math.isfinite(tpot) or tpot <= r.tpot_target
        good += ok
        if r.tpot_target is not None:
            judged += 1
            met += ok
    return {"tpot_slo_attainment": safe_ratio(met, judged), "goodput": safe_ratio(good, wall) if judged else math.nan}


def _step_metrics(s: StepRecord) -> dict[str, float]:
    drafted, accepted = s.num_drafted.sum(), s.num_accepted.sum()
    return {
        "memory_utilisation": _mean(s.blocks_used / s.blocks_total),
        "spec_token_waste": safe_ratio(drafted - accepted, drafted),
        "spec_kv_waste": _mean(s.spec_waste_blocks / s.blocks_total),
        "oom_rate": _mean(s.oom.astype(np.float64)),
        "acceptance_rate": safe_ratio(accepted, drafted),
        "mean_accepted_length": safe_ratio(accepted, s.num_verifications.sum()),
        "scheduler_time_per_step": _mean(s.scheduler_time),
        "scheduler_time_share": safe_ratio(s.scheduler_time.sum(), s.duration.sum()),
    }


# summarize's keys in order: each metric of the module docstring, then the context keys.
SUMMARY_KEYS = (
    "request_throughput", "throughput", *(f"{name}_{stat}" for name in LATENCIES for stat, _ in STATS),
    "tpot_slo_attainment", "goodput", "kv_hit_rate", "kv_hit_rate_first", "memory_utilisation", "spec_token_waste",
    "spec_kv_waste", "oom_rate",
    "preemptions_per_request", "acceptance_rate", "mean_accepted_length", "scheduler_time_per_step",
    "scheduler_time_share", "num_requests", "num_aborted", "num_steps", "output_tokens", "wall_time")


def summarize(requests: Iterable[RequestRecord], steps: StepRecord | None, *,
              wall_time: float | None = None) -> dict[str, float]:
    """Every metric of the module docstring plus context counts (`SUMMARY_KEYS`, in that order), as Python
    floats in SI units; `with_units` gives the keys the commands report."""
    requests = tuple(requests)
    for i, r in enumerate(requests):
        if not isinstance(r, RequestRecord):
            raise TypeError(f"requests[{i}] must be a RequestRecord, got {type(r).__name__}")
    if steps is None:
        steps = StepRecord.empty()
    elif not isinstance(steps, StepRecord):
        raise TypeError(f"steps must be a StepRecord or None, got {type(steps).__name__}")
    c = _request_columns(requests)
    wall = _wall_time(c, wall_time)
    done = ~c["aborted"]
    output_tokens = float(c["num_output_tokens"][done].sum())
    # NaN when the wall time is 0 or unknown
    out = {"request_throughput": safe_ratio(float(done.sum()), wall), "throughput": safe_ratio(output_tokens, wall)}
    out |= _latency_metrics(requests)
    out |= _slo_metrics(requests, wall)
    out["kv_hit_rate"] = safe_ratio(c["num_cached_prompt_tokens"].sum(), c["num_admitted_prompt_tokens"].sum())
    admitted = c["num_admitted_prompt_tokens"] > 0
    out["kv_hit_rate_first"] = safe_ratio(c["num_first_cached_prompt_tokens"][admitted].sum(),
                                          c["num_prompt_tokens"][admitted].sum())
    out["preemptions_per_request"] = safe_ratio(c["num_preemptions"].sum(), len(requests))
    out |= _step_metrics(steps)
    out |= {"num_requests": float(len(requests)), "num_aborted": float(c["aborted"].sum()),
            "num_steps": float(len(steps)), "output_tokens": output_tokens, "wall_time": wall}
    return {key: out[key] for key in SUMMARY_KEYS}


GROUP_METRICS = ("tpot_p50", "tpot_p99", "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99", "throughput",
                 "tpot_slo_attainment")


def summarize_groups(requests: Sequence[RequestRecord], group_of: np.ndarray) -> list[dict[str, float]]:
    """Per group of requests (a workload's phases, `workloads.phase_of`; acceptance classes), the request metrics
    of `GROUP_METRICS` over its requests alone (`summarize`; throughput over the group's own span, first
    arrival to last finish), with `requests` and `drafts_per_step` (draft tokens verified per decode step of its
    requests: drafted / (output tokens - accepted drafts)).
    group_of: int[ids] the group of each request id. One dict per group 0..max(group_of), in order; a group with
    no request among `requests` has only requests = 0."""
    records = list(requests)
    group_of = np.asarray(group_of)
    out = []
    for g in range(int(group_of.max()) + 1 if group_of.size else 0):
        mine = [r for r in records if group_of[r.request_id] == g]
        if not mine:
            out.append({"requests": 0.0})
            continue
        m = summarize(mine, None)
        out.append({k: m[k] for k in GROUP_METRICS} | {
            "requests": float(len(mine)),
            # a decode step emits 1 + its accepted drafts, so a request took about output - accepted of them
            "drafts_per_step": safe_ratio(sum(r.num_drafted for r in mine),
                                          sum(r.num_output_tokens - r.num_accepted for r in mine))})
    return out


def with_units(summary: Mapping[str, object]) -> dict[str, object]:
    """A summary (`summarize`'s, or a subset, or one with extra keys) as the commands report it: each key of
    `UNITS` renamed to its reported key, its value scaled to that unit; every other key (fractions, counts,
    a lane's rate and seed) as it is."""
    out = {}
    for key, value in summary.items():
        if key in UNITS:
            name, factor = UNITS[key]
            out[name] = value * factor if value is not None else None
        else:
            out[key] = value
    return out


def request_rows(requests: Iterable[RequestRecord]) -> list[dict[str, object]]:
    """Per request, what bench.json's `requests` records (units in the keys): id, prompt_tokens, output_tokens,
    arrival_s, ttft_ms, tpot_ms, e2e_ms (NaN where `request_latencies` leaves it undefined), itl_ms (its chunk
    gaps, `inter_token_latencies`, rounded to 0.1 us; empty without token_times), cached_tokens (every
    admission's), drafted and accepted, and aborted."""
    rows = []
    for r in requests:
        lat = request_latencies(r)
        rows.append({"id": r.request_id, "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
                     "arrival_s": r.arrival_time, "ttft_ms": lat["ttft"] * 1e3, "tpot_ms": lat["tpot"] * 1e3,
                     "e2e_ms": lat["e2e"] * 1e3,
                     "itl_ms": [round(g * 1e3, 4) for g in inter_token_latencies(r.token_times).tolist()],
                     "cached_tokens": r.num_cached_prompt_tokens, "drafted": r.num_drafted,
                     "accepted": r.num_accepted, "aborted": r.aborted})
    return rows


ATTRIBUTION = ("draft_blocks", "oom_steps_drafts", "preempt_drafts")  # `scheduler.SchedCounters` fields


def attribution(counters: Mapping[str, float], num_requests: int) -> dict[str, float]:
    """What drafts cost in memory, from a run's scheduler counters (`SchedCounters` as a mapping): the new blocks
    granted to draft slots, the OOM steps the drafts caused and their preemptions, and those preemptions per
    request (`draft_preemptions_per_request`; part of `preemptions_per_request`)."""
    missing = [k for k in ATTRIBUTION if k not in counters]
    if missing:
        raise ValueError(f"counters lacks {missing}")
    out = {k: float(counters[k]) for k in ATTRIBUTION}
    out["draft_preemptions_per_request"] = safe_ratio(out["preempt_drafts"], num_requests)
    return out


# --------------------------------------------------------------------------------------------------- table


def format_value(value: float) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 0.01 or value == 0:
        return f"{value:.2f}"
    return f"{value:.2e}"


# The table's ratio columns (a / b), in order; the first whose policies both ran is the run's headline.
BASELINE_RATIOS: tuple[tuple[str, str], ...] = (("skvs", "naive_spec"), ("skvs", "vllm_default"))


def ratio_pairs(names: Iterable[str], baseline_ratios: Sequence[tuple[str, str]] = BASELINE_RATIOS
                ) -> list[tuple[str, str]]:
    """The pairs of `baseline_ratios` whose policies are both among `names`, in order (the first: the headline)."""
    names = set(names)
    return [(a, b) for a, b in baseline_ratios if a in names and b in names]


def format_table(results: Mapping[str, Mapping[str, float]],
                 baseline_ratios: Sequence[tuple[str, str]] = BASELINE_RATIOS) -> str:
    """A Markdown table of reported metrics (`with_units`' keys): one row per metric of METRICS that some policy
    has (units in the label), one column per policy, in `results` order, then a column "a / b" (the plain ratio
    of the two values, whichever direction is better) for each of `ratio_pairs`. Missing or NaN values print as
    "n/a"; the rows of OPTIONAL_ROWS only when some policy has a value."""
    if not results:
        raise ValueError("results must hold at least one policy")
    policies = list(results)
    pairs = ratio_pairs(policies, baseline_ratios)
    header = ["metric", *policies, *(f"{a} / {b}" for a, b in pairs)]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for key, label, factor in METRICS:
        if not any(key in results[p] for p in policies):
            continue
        if key in OPTIONAL_ROWS and not any(_finite(results[p].get(key)) for p in policies):
            continue
        cells = [label]
        cells += [format_value(results[p][key] * factor) if key in results[p] else "n/a" for p in policies]
        for a, b in pairs:
            ratio = safe_ratio(results[a].get(key, math.nan), results[b].get(key, math.nan))
            cells.append(f"{ratio:.2f}x" if math.isfinite(ratio) else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _finite(x) -> bool:
    return isinstance(x, numbers.Real) and math.isfinite(x)


def json_safe(x):
    """x with NaN / inf turned into None and numpy scalars into Python ones, for strict JSON (which has no NaN:
    an undefined metric, e.g. waste without drafts, becomes null). Dict keys become strings."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x
