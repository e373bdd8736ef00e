"""Seeded synthetic request traces for the benchmarks: ShareGPT-like lengths, shared system prompts, multi-turn.

Nothing is downloaded (docs/design.md, "Benchmarks"): lengths come from distributions fitted to published summary
statistics, and prompt text is taken from the *held-out* part of the tiny model's corpus
(`reference_models.corpus`, never trained on), so Medusa acceptance on a trace behaves as on unseen text. The
shipped model is byte-level (vocabulary 256): a token is one byte of ASCII text, an int in [0, 256).

Kinds (`make(kind, ...)` dispatches by name):
  sharegpt        independent requests with log-normal prompt and output lengths.
  system_prompts  N shared system prompts with Zipf popularity, each followed by a per-request user suffix:
                  the prefix-cache workload.
  multi_turn      conversations; turn t's prompt is turn t-1's prompt + a previous answer + new user text, so
                  later turns extend earlier ones exactly, token for token.
  phased          ShareGPT requests whose arrival rate steps over time (low → high → low by default): the
                  workload a draft controller must follow; `phase_of(trace)` says which phase each request is in.

Arrivals are Poisson at `rate` requests per second (exponential gaps, first arrival after one gap); `rate=None`
or `inf` puts every arrival at t = 0 (the offline setting, as vLLM's benchmark_serving with its default
request rate of inf). `burstiness` B makes the gaps Gamma(shape B, mean 1 / rate), as vLLM's benchmark_serving
does: B = 1 is Poisson (the same draws as without it), B < 1 burstier (gaps with coefficient of variation
1 / sqrt(B)), B > 1 more even. Every generator is a pure function of its arguments: it draws from
`np.random.default_rng` children of `SeedSequence(seed)`, one independent stream per purpose (arrivals,
lengths, text, choices), so e.g. changing `rate` leaves the prompts unchanged, and the global numpy RNG is never
touched. `Trace.params` holds every argument, so `make(t.kind, seed=t.seed, **t.params) == t`.

Traces from files: `save_jsonl` / `load_jsonl` round-trip a trace exactly; `read_requests` reads a user's request
file (JSONL, one request per line: a prompt as text or a length, an output length, an arrival time), which
`skvs bench --trace` and `skvs simulate --trace` serve.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import numbers
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from skvs_jax import checks

VOCAB_SIZE = 256

# Published means, in tokens (LLaMA tokenizer), from Kwon et al., "Efficient Memory Management for Large
# Language Model Serving with PagedAttention" (vLLM), SOSP 2023, Fig. 11: ShareGPT mean input 161.31 and mean
# output 337.99 tokens; Alpaca 19.31 and 58.45 (the paper's text: ShareGPT has 8.4x longer inputs and 5.8x
# longer outputs than Alpaca, "with higher variance").
SHAREGPT_MEAN_PROMPT_LEN = 161.31
SHAREGPT_MEAN_OUTPUT_LEN = 337.99
ALPACA_MEAN_PROMPT_LEN = 19.31
ALPACA_MEAN_OUTPUT_LEN = 58.45
# OUR CHOICE, not published numbers: the log-normal shape parameters. The paper shows right-skewed histograms
# but gives no spread; sigma = 1.0 (coefficient of variation 1.31) for prompts, which range from one-line
# questions to pasted documents, and 0.8 (CV 0.95) for answers. mu is then fixed by the published mean:
# mu = ln(mean) - sigma^2 / 2, since E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2).
SHAREGPT_PROMPT_SIGMA = 1.0
SHAREGPT_OUTPUT_SIGMA = 0.8

# Defaults sized for a CPU benchmark of the tiny model (1024 positions). One `scale` multiplies both lengths,
# keeping the distribution's shape (input/output ratio, coefficient of variation) but not its absolute size:
# 0.25 gives mean lengths of ~40 prompt and ~84 output tokens before capping (~69 after the output cap of 128).
DEFAULT_SCALE = 0.25
DEFAULT_MAX_PROMPT_LEN = 512
DEFAULT_MAX_OUTPUT_LEN = 128


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of a trace.

    Attributes:
      request_id: position in arrival order, 0..n-1.
      arrival_time: seconds since the start of the trace.
      prompt: token ids (bytes of text), each in [0, VOCAB_SIZE).
      max_new_tokens: output tokens to generate (the trace's output length).
      priority: lower is more important (as in vLLM).
      conversation_id: which conversation a multi-turn request belongs to; -1 for single requests.
      turn: 0-based turn within its conversation.
    """

    request_id: int
    arrival_time: float
    prompt: tuple[int, ...]
    max_new_tokens: int
    priority: int = 0
    conversation_id: int = -1
    turn: int = 0

    def __post_init__(self) -> None:
        prompt = tuple(self.prompt)  # e.g. a list from JSON
        for t in prompt:  # make_trace writes them to int32 arrays: 1.5 would silently become 1
            if not checks.is_int(t):
                raise TypeError(f"prompt tokens must be ints, got {t!r}")
            if not 0 <= t < VOCAB_SIZE:
                raise ValueError(f"prompt tokens must lie in [0, {VOCAB_SIZE}), got {t}")
        object.__setattr__(self, "prompt", tuple(int(t) for t in prompt))
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        if not checks.is_int(self.max_new_tokens):
            raise TypeError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.arrival_time) and self.arrival_time >= 0):
            raise ValueError(f"arrival_time must be finite and >= 0, got {self.arrival_time}")


@dataclasses.dataclass(frozen=True)
class Trace:
    """A workload: requests sorted by arrival time, and what generated them (kind, seed, every argument)."""

    requests: tuple[Request, ...]
    seed: int
    kind: str
    params: dict[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", tuple(self.requests))
        times = [r.arrival_time for r in self.requests]
        if any(later < earlier for earlier, later in itertools.pairwise(times)):
            raise ValueError("requests must be sorted by arrival_time")

    def __len__(self) -> int:
        return len(self.requests)


# ---------------------------------------------------------------------------------------------- validation


def _check_float(name: str, value: object, minimum: float, *, strict: bool) -> float:
    """A finite real >= minimum (> minimum when strict)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        raise ValueError(f"{name} must be finite and {'>' if strict else '>='} {minimum}, got {value}")
    return value


def _check_rate(rate: object) -> float | None:
    """None for "all at t = 0" (from None or inf), else a finite rate > 0."""
    if rate is None or (isinstance(rate, numbers.Real) and not isinstance(rate, bool) and rate == math.inf):
        return None
    return _check_float("rate", rate, 0.0, strict=True)


def _check_burstiness(burstiness: object) -> float:
    return _check_float("burstiness", burstiness, 0.0, strict=True)


def _check_cap(name: str, value: object) -> int | None:
    return None if value is None else checks.at_least(name, value, 1)


# -------------------------------------------------------------------------------------------------- drawing


@functools.cache
def corpus_text() -> np.ndarray:
    """The held-out bytes of the tiny model's corpus, [n] uint8, read-only."""
    # Imported here rather than at the top: skvs_jax's core must not depend on reference_models (docs/design.md,
    # "Packages"); only trace generation reads its text.
    from reference_models.corpus import train_heldout_split

    text = np.array(train_heldout_split()[1], dtype=np.uint8)
    text.setflags(write=False)
    return text


@functools.cache
def _word_starts() -> np.ndarray:
    """Positions of corpus_text() that begin a word, so prompts start like text rather than mid-word."""
    text = corpus_text()
    space = np.isin(text, np.frombuffer(b" \n\t", dtype=np.uint8))
    starts = np.flatnonzero(~space & np.concatenate([[True], space[:-1]]))
    starts.setflags(write=False)
    return starts


def _streams(seed: int, count: int) -> list[np.random.Generator]:
    """Independent generators, one per purpose, so that one knob's draws never shift another's."""
    return [np.random.default_rng(child) for child in np.random.SeedSequence(seed).spawn(count)]


def _spans(rng: np.random.Generator, lengths: np.ndarray) -> list[tuple[int, ...]]:
    """One span of corpus text per length, each starting at a random word start (wrapping at the end)."""
    text, starts = corpus_text(), _word_starts()
    begins = starts[rng.integers(starts.size, size=len(lengths))]
    return [tuple(np.take(text, np.arange(b, b + n), mode="wrap").tolist()) for b, n in zip(begins, lengths)]


def _lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float, scale: float,
                       cap: int | None) -> np.ndarray:
    """[n] int64 lengths >= 1: round(scale * LogNormal with the given mean and sigma), then capped."""
    mu = math.log(mean) - sigma**2 / 2  # keeps E[length] = mean for any sigma
    lengths = np.maximum(1, np.rint(scale * rng.lognormal(mu, sigma, size=n))).astype(np.int64)
    return lengths if cap is None else np.minimum(lengths, cap)


def arrival_gaps(rng: np.random.Generator, n: int, rate: float, burstiness: float = 1.0) -> np.ndarray:
    """[n] float64 gaps between arrivals: Gamma(shape burstiness, scale 1 / (rate * burstiness)), so their mean is
    1 / rate whatever the burstiness, and their coefficient of variation 1 / sqrt(burstiness) (vLLM's
    benchmark_serving `--burstiness`). numpy's Gamma of shape 1 draws its exponential from the same stream, so
    burstiness 1 gives exactly the Poisson gaps `rng.exponential(1 / rate)` gives."""
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)


def _arrivals(rng: np.random.Generator, n: int, rate: float | None, burstiness: float = 1.0) -> np.ndarray:
    """[n] float64 arrival times (cumulated `arrival_gaps`, the first after one gap); zeros if rate is None."""
    return np.zeros(n) if rate is None else np.cumsum(arrival_gaps(rng, n, rate, burstiness))


def _check_lengths(scale: object, max_prompt_len: object, max_output_len: object) -> tuple:
    return (_check_float("scale", scale, 0.0, strict=True), _check_cap("max_prompt_len", max_prompt_len),
            _check_cap("max_output_len", max_output_len))


# ----------------------------------------------------------------------------------------------- generators


def sharegpt(num_requests: int, *, seed: int, rate: float | None = None, burstiness: float = 1.0,
             mean_prompt_len: float = SHAREGPT_MEAN_PROMPT_LEN, mean_output_len: float = SHAREGPT_MEAN_OUTPUT_LEN,
             prompt_sigma: float = SHAREGPT_PROMPT_SIGMA, output_sigma: float = SHAREGPT_OUTPUT_SIGMA,
             scale: float = DEFAULT_SCALE, max_prompt_len: int | None = DEFAULT_MAX_PROMPT_LEN,
             max_output_len: int | None = DEFAULT_MAX_OUTPUT_LEN) -> Trace:
    """Independent requests with ShareGPT-like prompt and output lengths.

    Lengths are log-normal with the published means (Kwon et al., SOSP 2023, Fig. 11: ShareGPT 161.31 input /
    337.99 output tokens; pass `ALPACA_MEAN_*` for Alpaca's 19.31 / 58.45) and sigmas of our choice (see
    `SHAREGPT_PROMPT_SIGMA`); prompt and output lengths are drawn independently (also our choice). Each length
    is `max(1, round(scale * x))`, then capped; `scale=1` with no caps (None) reproduces the published means.
    Scaling keeps the distribution's shape (ratio of the means, spread relative to the mean), not its size.
    """
    num_requests = checks.at_least("num_requests", num_requests, 1)
    seed = checks.at_least("seed", seed, 0)
    rate = _check_rate(rate)
    means = [_check_float(k, v, 0.0, strict=True)
             for k, v in (("mean_prompt_len", mean_prompt_len), ("mean_output_len", mean_output_len))]
    sigmas = [_check_float(k, v, 0.0, strict=False)
              for k, v in (("prompt_sigma", prompt_sigma), ("output_sigma", output_sigma))]
    scale, max_prompt_len, max_output_len = _check_lengths(scale, max_prompt_len, max_output_len)
    params = {"num_requests": num_requests, "rate": rate, "burstiness": _check_burstiness(burstiness),
              "mean_prompt_len": means[0], "mean_output_len": means[1],
              "prompt_sigma": sigmas[0], "output_sigma": sigmas[1], "scale": scale, "max_prompt_len": max_prompt_len,
              "max_output_len": max_output_len}

    arrival_rng, length_rng, text_rng = _streams(seed, 3)
    prompt_lens = _lognormal_lengths(length_rng, num_requests, means[0], sigmas[0], scale, max_prompt_len)
    output_lens = _lognormal_lengths(length_rng, num_requests, means[1], sigmas[1], scale, max_output_len)
    prompts = _spans(text_rng, prompt_lens)
    times = _arrivals(arrival_rng, num_requests, rate, params["burstiness"])
    requests = [Request(i, t, p, o) for i, (t, p, o) in enumerate(zip(times.tolist(), prompts, output_lens.tolist()))]
    return Trace(tuple(requests), seed, "sharegpt", params)


def system_prompts(num_requests: int, *, seed: int, rate: float | None = None, burstiness: float = 1.0,
                   num_system_prompts: int = 8,
                   system_prompt_len: int = 128, zipf_exponent: float = 1.1, scale: float = DEFAULT_SCALE,
                   max_prompt_len: int | None = DEFAULT_MAX_PROMPT_LEN,
                   max_output_len: int | None = DEFAULT_MAX_OUTPUT_LEN) -> Trace:
    """Requests sharing a few system prompts: the prefix-cache workload.

    `num_system_prompts` fixed token sequences of `system_prompt_len` tokens (distinct spans of held-out text);
    request i uses prompt k (0-based) with Zipf probability proportional to (k + 1) ** -zipf_exponent (0 gives
    uniform popularity), followed by a user suffix whose length follows the ShareGPT prompt fit (scaled,
    capped so that the whole prompt fits `max_prompt_len`); output lengths follow the ShareGPT output fit.
    """
    num_requests = checks.at_least("num_requests", num_requests, 1)
    seed = checks.at_least("seed", seed, 0)
    rate = _check_rate(rate)
    num_system_prompts = checks.at_least("num_system_prompts", num_system_prompts, 1)
    system_prompt_len = checks.at_least("system_prompt_len", system_prompt_len, 1)
    zipf_exponent = _check_float("zipf_exponent", zipf_exponent, 0.0, strict=False)
    scale, max_prompt_len, max_output_len = _check_lengths(scale, max_prompt_len, max_output_len)
    if max_prompt_len is not None and system_prompt_len >= max_prompt_len:
        raise ValueError(f"system_prompt_len ({system_prompt_len}) must be < max_prompt_len ({max_prompt_len}) "
                         "to leave room for a user suffix")
    params = {"num_requests": num_requests, "rate": rate, "burstiness": _check_burstiness(burstiness),
              "num_system_prompts": num_system_prompts,
              "system_prompt_len": system_prompt_len, "zipf_exponent": zipf_exponent, "scale": scale,
              "max_prompt_len": max_prompt_len, "max_output_len": max_output_len}

    arrival_rng, length_rng, text_rng, choice_rng = _streams(seed, 4)
    # Distinct start positions, so no two system prompts are the same text shifted by zero.
    starts = _word_starts()
    begins = text_rng.choice(starts.size, size=num_system_prompts, replace=starts.size < num_system_prompts)
    text = corpus_text()
    systems = [tuple(np.take(text, np.arange(starts[b], starts[b] + system_prompt_len), mode="wrap").tolist())
               for b in begins]
    popularity = np.arange(1, num_system_prompts + 1, dtype=np.float64) ** -zipf_exponent
    which = choice_rng.choice(num_system_prompts, size=num_requests, p=popularity / popularity.sum())
    suffix_cap = None if max_prompt_len is None else max_prompt_len - system_prompt_len
    suffix_lens = _lognormal_lengths(length_rng, num_requests, SHAREGPT_MEAN_PROMPT_LEN, SHAREGPT_PROMPT_SIGMA,
                                     scale, suffix_cap)
    output_lens = _lognormal_lengths(length_rng, num_requests, SHAREGPT_MEAN_OUTPUT_LEN, SHAREGPT_OUTPUT_SIGMA,
                                     scale, max_output_len)
    suffixes = _spans(text_rng, suffix_lens)
    times = _arrivals(arrival_rng, num_requests, rate, params["burstiness"])
    requests = [Request(i, t, systems[k] + s, o)
                for i, (t, k, s, o) in enumerate(zip(times.tolist(), which.tolist(), suffixes, output_lens.tolist()))]
    return Trace(tuple(requests), seed, "system_prompts", params)


def multi_turn(num_requests: int, *, seed: int, rate: float | None = None, burstiness: float = 1.0,
               mean_turns: float = 3.0,
               max_turns: int = 8, think_time: float = 5.0, scale: float = DEFAULT_SCALE,
               max_prompt_len: int | None = DEFAULT_MAX_PROMPT_LEN,
               max_output_len: int | None = DEFAULT_MAX_OUTPUT_LEN) -> Trace:
    """Multi-turn conversations whose later prompts extend earlier ones exactly.

    Conversations start as a Poisson process at `rate` *conversations* per second (Gamma gaps with `burstiness`
    other than 1; think times stay exponential); each has
    `min(max_turns, 1 + Poisson(mean_turns - 1))` turns. Turn 0's prompt is user text; turn t's prompt is turn
    t-1's prompt + a previous answer (held-out text of turn t-1's `max_new_tokens` length, standing in for the
    recorded answer of a chat log) + new user text. User-text and output lengths follow the ShareGPT fits
    (scaled, capped). A conversation ends early when its next prompt would exceed `max_prompt_len`.
    Turn t arrives an exponential think time (mean `think_time` seconds) after turn t-1's *arrival*: the trace
    is open-loop, so a replay driver that wants closed-loop behaviour holds a turn until the previous turn of
    its `conversation_id` has finished. Conversations are generated until `num_requests` requests exist.
    """
    num_requests = checks.at_least("num_requests", num_requests, 1)
    seed = checks.at_least("seed", seed, 0)
    rate = _check_rate(rate)
    mean_turns = _check_float("mean_turns", mean_turns, 1.0, strict=False)
    max_turns = checks.at_least("max_turns", max_turns, 1)
    think_time = _check_float("think_time", think_time, 0.0, strict=False)
    scale, max_prompt_len, max_output_len = _check_lengths(scale, max_prompt_len, max_output_len)
    params = {"num_requests": num_requests, "rate": rate, "burstiness": _check_burstiness(burstiness),
              "mean_turns": mean_turns, "max_turns": max_turns,
              "think_time": think_time, "scale": scale, "max_prompt_len": max_prompt_len,
              "max_output_len": max_output_len}

    arrival_rng, length_rng, text_rng, turn_rng = _streams(seed, 4)
    made: list[tuple[float, int, int, tuple[int, ...], int]] = []  # (arrival, conversation, turn, prompt, output)
    conversation, start = 0, 0.0
    while len(made) < num_requests:
        start = 0.0 if rate is None else start + float(arrival_gaps(arrival_rng, 1, rate, params["burstiness"])[0])
        turns = min(max_turns, 1 + int(turn_rng.poisson(mean_turns - 1)), num_requests - len(made))
        user_lens = _lognormal_lengths(length_rng, turns, SHAREGPT_MEAN_PROMPT_LEN, SHAREGPT_PROMPT_SIGMA, scale,
                                       max_prompt_len)
        output_lens = _lognormal_lengths(length_rng, turns, SHAREGPT_MEAN_OUTPUT_LEN, SHAREGPT_OUTPUT_SIGMA,
                                         scale, max_output_len).tolist()
        gaps = arrival_rng.exponential(think_time, size=turns) if think_time > 0 else np.zeros(turns)
        prompt: tuple[int, ...] = ()
        when = start
        for turn in range(turns):
            answer = _spans(text_rng, [output_lens[turn - 1]])[0] if turn else ()
            extended = prompt + answer + _spans(text_rng, [int(user_lens[turn])])[0]
            if max_prompt_len is not None and len(extended) > max_prompt_len:
                break
            when = when + float(gaps[turn]) if turn else when
            prompt = extended
            made.append((when, conversation, turn, prompt, output_lens[turn]))
        conversation += 1
    made.sort(key=lambda m: (m[0], m[1], m[2]))  # arrival order; ties broken by conversation, then turn
    requests = [Request(i, t, p, o, conversation_id=c, turn=k) for i, (t, c, k, p, o) in enumerate(made)]
    return Trace(tuple(requests), seed, "multi_turn", params)


# OUR CHOICE: the default phases of `phased`, (share of the requests, multiple of `rate`): a quiet phase, a burst at
# 12x the rate, and a quiet phase again. At rate 4 and 448 requests this is 96 requests at 4 req/s, 256 at 48 and
# 96 at 4: on Llama-3.1-8B / A100 with 64 slots the burst fills every slot and queues, and the quiet phases do not.
DEFAULT_PHASES = ((96, 1.0), (256, 12.0), (96, 1.0))


def _check_phases(phases: object) -> list[list]:
    """phases as [[weight int >= 0, rate multiple float > 0], ...], at least one weight > 0."""
    try:
        pairs = [tuple(p) for p in phases]  # type: ignore[union-attr]
    except TypeError:
        raise TypeError(f"phases must be a sequence of (requests, rate multiple) pairs, got {phases!r}") from None
    if not pairs or any(len(p) != 2 for p in pairs):
        raise ValueError(f"phases must be a non-empty sequence of (requests, rate multiple) pairs, got {phases!r}")
    out = [[checks.at_least("phases' request counts", n, 0),
            _check_float("phases' rate multiples", m, 0.0, strict=True)] for n, m in pairs]
    if sum(n for n, _ in out) < 1:
        raise ValueError(f"phases must hold at least one request, got {phases!r}")
    return out


def _split(num_requests: int, weights: list[int]) -> list[int]:
    """num_requests split in proportion to weights by largest remainder (exact when they sum to num_requests)."""
    total = sum(weights)
    quota = [num_requests * w / total for w in weights]
    counts = [int(math.floor(q)) for q in quota]
    for i in sorted(range(len(weights)), key=lambda i: (counts[i] - quota[i], i))[: num_requests - sum(counts)]:
        counts[i] += 1
    return counts


def phased(num_requests: int, *, seed: int, rate: float | None = 4.0, burstiness: float = 1.0, phases=DEFAULT_PHASES,
           scale: float = DEFAULT_SCALE, max_prompt_len: int | None = DEFAULT_MAX_PROMPT_LEN,
           max_output_len: int | None = DEFAULT_MAX_OUTPUT_LEN) -> Trace:
    """ShareGPT requests (`sharegpt`'s lengths and text, the same for the same seed) whose arrival rate changes in
    phases. phases: (requests, rate multiple) pairs in order; `num_requests` is split over them in proportion to
    their request counts (exactly those counts when they sum to it), and phase p's requests arrive as a Poisson
    process at `rate` * its multiple, starting where the previous phase's last arrival left off. Rates are
    multiples of one `rate` so that scaling arrival times (a sweep's `arrival_scale`) scales every phase alike;
    rate None or inf puts every arrival at t = 0. `phase_of(trace)` gives each request's phase."""
    num_requests = checks.at_least("num_requests", num_requests, 1)
    seed = checks.at_least("seed", seed, 0)
    rate = _check_rate(rate)
    pairs = _check_phases(phases)
    counts = _split(num_requests, [n for n, _ in pairs])
    base = sharegpt(num_requests, seed=seed, rate=None, scale=scale, max_prompt_len=max_prompt_len,
                    max_output_len=max_output_len)
    params = {"num_requests": num_requests, "rate": rate, "burstiness": _check_burstiness(burstiness),
              "phases": [[c, m] for c, (_, m) in zip(counts, pairs)],
              "scale": base.params["scale"], "max_prompt_len": base.params["max_prompt_len"],
              "max_output_len": base.params["max_output_len"]}
    if rate is None:
        times = np.zeros(num_requests)
    else:  # the arrival stream sharegpt leaves unused at rate None: unit gaps, each divided by its phase's rate
        multiple = np.repeat([m for _, m in pairs], counts)
        unit = arrival_gaps(_streams(seed, 3)[0], num_requests, 1.0, params["burstiness"])
        times = np.cumsum(unit / (rate * multiple))
    requests = [dataclasses.replace(r, arrival_time=t) for r, t in zip(base.requests, times.tolist())]
    return Trace(tuple(requests), seed, "phased", params)


def phase_of(trace: Trace) -> np.ndarray:
    """int64[len(trace)] each request's phase (by request id; 0 for every request of a trace without phases)."""
    counts = [c for c, _ in trace.params.get("phases", [[len(trace), 1.0]])]
    by_id = np.repeat(np.arange(len(counts)), counts)
    return by_id[[r.request_id for r in trace.requests]]


GENERATORS: dict[str, Callable[..., Trace]] = {
    "sharegpt": sharegpt,
    "system_prompts": system_prompts,
    "multi_turn": multi_turn,
    "phased": phased,
}


def make(kind: str, num_requests: int, *, seed: int, **kwargs: Any) -> Trace:
    """The trace of the named kind ("sharegpt", "system_prompts", "multi_turn", "phased"); kwargs go to its
    generator."""
    if kind not in GENERATORS:
        raise ValueError(f"kind must be one of {sorted(GENERATORS)}, got {kind!r}")
    return GENERATORS[kind](num_requests, seed=seed, **kwargs)



TINY_PROMPT_LEN = 96  # the shipped tiny model's traces: prompts it was trained to continue fit in this
TINY_SYSTEM_PROMPT_LEN = 48


def tiny_model_trace(kind: str = "system_prompts", num_requests: int = 32, *, seed: int = 0,
                     rate: float | None = None, max_output_len: int = 32, burstiness: float = 1.0,
                     **kwargs: Any) -> Trace:
    """The trace `skvs bench` serves the shipped tiny model by default: prompts capped at 96 bytes (system prompts
    of 48), outputs at `max_output_len`; kwargs go to the generator (a phased trace's `phases`). One builder, so
    the bench and the acceptance model read the same trace."""
    kw: dict[str, Any] = dict(rate=rate, burstiness=burstiness, max_output_len=max_output_len,
                              max_prompt_len=TINY_PROMPT_LEN, **kwargs)
    if kind == "system_prompts":
        kw |= dict(system_prompt_len=TINY_SYSTEM_PROMPT_LEN)
    return make(kind, num_requests, seed=seed, **kw)

# -------------------------------------------------------------------------------------------------- JSONL I/O

_FORMAT = "skvs_jax.trace"
_VERSION = 1


def save_jsonl(trace: Trace, path: str | os.PathLike) -> None:
    """Writes a header line {format, version, seed, kind, params, num_requests}, then one request per line."""
    header = {"format": _FORMAT, "version": _VERSION, "seed": trace.seed, "kind": trace.kind,
              "params": trace.params, "num_requests": len(trace.requests)}
    with open(path, "w", encoding="ascii") as f:
        # allow_nan=False: strict JSON (rate=inf is stored as null); floats round-trip exactly via repr.
        f.write(json.dumps(header, allow_nan=False) + "\n")
        f.writelines(json.dumps(dataclasses.asdict(r), allow_nan=False, separators=(",", ":")) + "\n"
                     for r in trace.requests)


def load_jsonl(path: str | os.PathLike) -> Trace:
    """Reads a trace written by `save_jsonl`; `load_jsonl(p) == trace` after `save_jsonl(trace, p)`."""
    with open(path, encoding="ascii") as f:
        lines = [line for line in f if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty file, expected a trace header")
    header = json.loads(lines[0])
    if not isinstance(header, dict) or header.get("format") != _FORMAT or header.get("version") != _VERSION:
        raise ValueError(f"{path}: not a {_FORMAT} v{_VERSION} file (bad header)")
    requests = [Request(**json.loads(line)) for line in lines[1:]]
    if len(requests) != header["num_requests"]:
        raise ValueError(f"{path}: header says {header['num_requests']} requests, found {len(requests)}")
    return Trace(tuple(requests), header["seed"], header["kind"], header["params"])


# ---------------------------------------------------------------------------------------------- request files

REQUEST_FIELDS = ("prompt", "prompt_len", "output_len", "arrival_s")


def read_requests(path: str | os.PathLike, *, seed: int = 0) -> Trace:
    """A user's request file as a Trace of kind "file": JSONL, one request per non-blank line,
    `{"prompt": str | "prompt_len": int, "output_len": int, "arrival_s": float}`.

    prompt: text, whose UTF-8 bytes are the prompt's tokens (the shipped model is byte-level); prompt_len instead
    asks for that many tokens of held-out corpus text (`_spans`, drawn from `seed`, so the same file and seed give
    the same prompts). output_len: output tokens to generate (>= 1). arrival_s: seconds from the start (finite,
    >= 0); requests are served in arrival order (a stable sort, so ties keep the file's order), numbered 0..n-1
    in that order. A line that breaks a rule raises ValueError naming the file, the line number and the field.
    `Trace.params` holds the path and the seed (a file's trace is not regenerated by `make`)."""
    seed = checks.at_least("seed", seed, 0)
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                rows.append((number, _request_line(path, number, line)))
    if not rows:
        raise ValueError(f"{path}: no requests (expected one JSON object per line)")
    lengths = [row["prompt_len"] for _, row in rows if "prompt" not in row]
    drawn = iter(_spans(_streams(seed, 1)[0], np.asarray(lengths, np.int64)))
    made = []
    for number, row in rows:
        prompt = tuple(row["prompt"].encode("utf-8")) if "prompt" in row else next(drawn)
        made.append((row["arrival_s"], number, prompt, row["output_len"]))
    made.sort(key=lambda m: m[0])  # stable: equal arrivals keep the file's order
    requests = [Request(i, t, p, o) for i, (t, _, p, o) in enumerate(made)]
    return Trace(tuple(requests), seed, "file", {"path": os.fspath(path), "num_requests": len(requests)})


def _request_line(path, number: int, line: str) -> dict[str, Any]:
    """One line of a request file, checked (`read_requests`' rules)."""
    where = f"{path}: line {number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON ({err.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    unknown = sorted(set(row) - set(REQUEST_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; a request has {list(REQUEST_FIELDS)}")
    if ("prompt" in row) == ("prompt_len" in row):
        raise ValueError(f"{where}: give exactly one of 'prompt' (text) and 'prompt_len' (tokens)")
    if "prompt" in row and not (isinstance(row["prompt"], str) and row["prompt"]):
        raise ValueError(f"{where}: field 'prompt' must be a non-empty string, got {row['prompt']!r}")
    for name in ("prompt_len", "output_len"):
        if name in row and not (checks.is_int(row[name]) and row[name] >= 1):
            raise ValueError(f"{where}: field '{name}' must be an int >= 1, got {row[name]!r}")
    if "output_len" not in row:
        raise ValueError(f"{where}: field 'output_len' is missing")
    if "arrival_s" not in row:
        raise ValueError(f"{where}: field 'arrival_s' is missing (0 for every request at the start)")
    arrival = row["arrival_s"]
    if isinstance(arrival, bool) or not isinstance(arrival, numbers.Real) or not (
            math.isfinite(arrival) and arrival >= 0):
        raise ValueError(f"{where}: field 'arrival_s' must be a finite number >= 0, got {arrival!r}")
    return row | {"arrival_s": float(arrival)}
