"""What a request asks of the sampler: `SamplingParams` (vLLM's fields, validated and normalised once, at the
API boundary) and `stop_bytes`. The semantics are in docs/sampling.md; the device side is `serve.sampling`."""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Iterable, Mapping

from skvs_jax import checks
from skvs_jax import scheduler as sc
from skvs_jax.serve import engine_step
from skvs_jax.serve import sampling as sampling_mod


def _real(name: str, value, lo: float, hi: float, *, open_lo: bool = False) -> float:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value < lo or value > hi or (open_lo and value == lo)):
        raise ValueError(f"{name} must be a finite float in {'(' if open_lo else '['}{lo}, {hi}], got {value!r}")
    return float(value)


def check_tpot_target(name: str, value) -> float:
    """A TPOT target in seconds (`scheduler.tpot_target_us`'s range); ValueError naming `name` otherwise."""
    sc.tpot_target_us(value, name)
    return float(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """max_tokens >= 1 new tokens; temperature 0 = greedy; generation stops after any of stop_token_ids.

    The other fields follow vLLM (docs/sampling.md): seed (a request's own random stream; None: one derived from
    the engine's seed and the request id), top_k (0 or -1 = off), top_p in (0, 1], min_p in [0, 1], repetition
    penalty > 0 (over prompt and output), presence / frequency penalties in [-2, 2] (over the output), stop
    strings (UTF-8 bytes of a byte-level model's text; the output ends before them unless
    include_stop_str_in_output), logprobs (None, or the top-N raw logprobs of every emitted token, N <=
    `sampling.MAX_LOGPROBS`), and n outputs of the prompt (1 <= n <= `sampling.MAX_N`; outputs 1.. fork off
    output 0 once it has its first token, sharing the prompt's blocks, each with its own stream). At most
    `engine_step.MAX_STOP` stop ids and strings together (a stop string longer than `sampling.MAX_STOP_LEN` tokens
    is matched on the text by the host).

    Constraints (`serve.constraints`, lossless under speculation): ignore_eos (the model's EOS ids do not end the
    output), min_tokens (no stop, EOS included, ends the output before it holds min_tokens tokens; stop ids and EOS
    are banned until then), logit_bias ({token id: bias} added to the raw logits, at most `sampling.MAX_BIAS`),
    allowed_token_ids (the only ids sampled, at most `sampling.MAX_ALLOWED`), bad_words (words never emitted:
    each word's tokens, with and without a leading space, at most `sampling.MAX_BAD_WORDS` sequences of
    `sampling.MAX_BAD_LEN` tokens once tokenised).

    Text (`skvs_jax.LLM`): logprobs=-1 asks for every token's logprob over the whole vocabulary, prompt_logprobs
    (None, N, or -1) for the prompt's; both come from a scoring pass of the finished sequence (docs/sampling.md),
    so only `LLM` serves them. skip_special_tokens: special tokens are left out of the text. output_kind
    (`RequestOutputKind`): what a streamed `RequestOutput` holds, everything so far (CUMULATIVE), the new part
    (DELTA), or nothing until the end (FINAL_ONLY).

    tpot_target (not vLLM's): the request's time per output token objective in seconds (None: the engine's
    `EngineOptions.tpot_target`). Under the goodput draft controller a row whose decode steps run slower per
    token than it is drafted first (`scheduler.draft_control.over_target`); the benchmarks report the share of
    requests that met theirs (`metrics`: tpot_slo_attainment, goodput).

    Fields are normalised to Python types (numpy scalars are accepted); token ids are checked against the
    model's vocabulary when the request is added.
    """

    max_tokens: int = 32
    temperature: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = None  # type: ignore[assignment]  # None: CUMULATIVE (set in __post_init__)
    tpot_target: float | None = None

    def __post_init__(self) -> None:
        if not checks.is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real)
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise ValueError(f"temperature must be a finite float >= 0, got {self.temperature!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Iterable):
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {type(self.stop_token_ids).__name__}")
        stops = tuple(self.stop_token_ids)
        if not all(checks.is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {stops!r}")
        if len(stops) > engine_step.MAX_STOP:
            raise ValueError(f"stop_token_ids holds at most {engine_step.MAX_STOP} ids, got {len(stops)}")
        object.__setattr__(self, "max_tokens", int(self.max_tokens))  # frozen: normalise once, here
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        self._check_sampling()

    def _check_sampling(self) -> None:
        if self.seed is not None and (not checks.is_int(self.seed) or not 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be None or an int in [0, 2**32), got {self.seed!r}")
        if not checks.is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1: off), got {self.top_k!r}")
        top_p = _real("top_p", self.top_p, 0.0, 1.0, open_lo=True)
        min_p = _real("min_p", self.min_p, 0.0, 1.0)
        repetition = _real("repetition_penalty", self.repetition_penalty, 0.0, math.inf, open_lo=True)
        presence = _real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        frequency = _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        stop = (self.stop,) if isinstance(self.stop, (str, bytes)) else self.stop
        if not isinstance(stop, Iterable):
            raise TypeError(f"stop must be a string or a sequence of non-empty strings, got {self.stop!r}")
        stop = tuple(stop)  # once: a generator is consumed by reading it
        if not all(isinstance(x, (str, bytes)) and x for x in stop):
            raise TypeError(f"stop must be a string or a sequence of non-empty strings, got {stop!r}")
        for x in stop:  # a longer str is matched on the text (`serve.requests.plan`); bytes only on the device
            if isinstance(x, bytes) and len(x) > sampling_mod.MAX_STOP_LEN:
                raise ValueError(f"bytes stop strings hold at most {sampling_mod.MAX_STOP_LEN} bytes, got {x!r}")
        if len(stop) + len(self.stop_token_ids) > engine_step.MAX_STOP:
            raise ValueError(f"stop and stop_token_ids hold at most {engine_step.MAX_STOP} entries together, got "
                             f"{len(stop) + len(self.stop_token_ids)}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise TypeError("include_stop_str_in_output must be a bool")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not checks.is_int(value) or not -1 <= value <= sampling_mod.MAX_LOGPROBS):
                raise ValueError(f"{name} must be None, -1 (the whole vocabulary) or an int in "
                                 f"[0, {sampling_mod.MAX_LOGPROBS}], got {value!r}")
        if not checks.is_int(self.n) or not 1 <= self.n <= sampling_mod.MAX_N:
            raise ValueError(f"n must be an int in [1, {sampling_mod.MAX_N}], got {self.n!r}")
        if self.tpot_target is not None:
            object.__setattr__(self, "tpot_target", check_tpot_target("tpot_target", self.tpot_target))
        self._check_constraints()
        for name, value in (("n", int(self.n)), ("seed", None if self.seed is None else int(self.seed)),
                            ("top_k", max(int(self.top_k), 0)), ("top_p", top_p), ("min_p", min_p),
                            ("repetition_penalty", repetition),
                            ("presence_penalty", presence), ("frequency_penalty", frequency), ("stop", stop),
                            ("logprobs", None if self.logprobs is None else int(self.logprobs))):
            object.__setattr__(self, name, value)

    def _check_constraints(self) -> None:
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if not checks.is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens = {self.max_tokens}], got "
                             f"{self.min_tokens!r}")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, Mapping):
                raise TypeError(f"logit_bias must be a dict {{token id: bias}} or None, got {type(bias).__name__}")
            if len(bias) > sampling_mod.MAX_BIAS:
                raise ValueError(f"logit_bias holds at most {sampling_mod.MAX_BIAS} entries, got {len(bias)}")
            keys = [int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k for k in bias]  # JSON keys
            if not all(checks.is_int(k) and k >= 0 for k in keys):
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {sorted(map(str, bias))[:5]}")
            bias = {int(k): _real(f"logit_bias[{k}]", v, -math.inf, math.inf) for k, v in zip(keys, bias.values())}
        allowed = self.allowed_token_ids
        if allowed is not None:
            if isinstance(allowed, (str, bytes)) or not isinstance(allowed, Iterable):
                raise TypeError(f"allowed_token_ids must be a sequence of ints or None, got {type(allowed).__name__}")
            allowed = tuple(allowed)
            if not allowed or not all(checks.is_int(t) and t >= 0 for t in allowed):
                raise ValueError(f"allowed_token_ids must be a non-empty sequence of ids >= 0, got {allowed[:8]!r}")
            if len(set(allowed)) > sampling_mod.MAX_ALLOWED:
                raise ValueError(f"allowed_token_ids holds at most {sampling_mod.MAX_ALLOWED} ids, got "
                                 f"{len(set(allowed))}")
            allowed = tuple(sorted({int(t) for t in allowed}))
        words = (self.bad_words,) if isinstance(self.bad_words, str) else self.bad_words
        if not isinstance(words, Iterable) or isinstance(words, bytes):
            raise TypeError(f"bad_words must be a sequence of non-empty strings, got {self.bad_words!r}")
        words = tuple(words)
        if not all(isinstance(w, str) and w.strip() for w in words):
            raise TypeError(f"bad_words must be a sequence of non-empty strings, got {words!r}")
        kind = RequestOutputKind.CUMULATIVE if self.output_kind is None else self.output_kind
        if not isinstance(kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        for name, value in (("min_tokens", int(self.min_tokens)), ("logit_bias", bias), ("allowed_token_ids", allowed),
                            ("bad_words", words), ("output_kind", kind)):
            object.__setattr__(self, name, value)

    def __hash__(self) -> int:  # logit_bias is a dict: hash its items
        fields = dataclasses.astuple(dataclasses.replace(self, logit_bias=None))
        return hash((fields, None if self.logit_bias is None else tuple(sorted(self.logit_bias.items()))))

    def stop_sequences(self) -> list[tuple[int, ...]]:
        """Every stop as token ids: each stop id alone, then each stop string's UTF-8 bytes."""
        return [(t,) for t in self.stop_token_ids] + [tuple(stop_bytes(x)) for x in self.stop]


class RequestOutputKind(enum.Enum):
    """What each streamed `RequestOutput` of a request holds (vLLM's): everything so far, only what is new since
    the last one, or nothing until the request finishes."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def stop_bytes(stop: str | bytes) -> bytes:
    """A stop string as the byte-level model's tokens: its UTF-8 bytes."""
    return stop if isinstance(stop, bytes) else stop.encode("utf-8")
