"""What `skvs_jax.LLM` returns, shaped as vLLM's outputs: a `RequestOutput` per prompt holding its n
`CompletionOutput`s (text, token ids, finish and stop reason, logprobs) and its `RequestMetrics`.

Field names and meanings follow vLLM (`vllm.outputs`), so code written against vLLM's offline API reads these
unchanged; what vLLM leaves out and a speculation study needs (drafted and accepted tokens, preemptions) is in
`RequestMetrics`. Times are wall-clock seconds since the epoch (`time.time()`), as vLLM's are.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's log probability under the model's raw logits (vLLM's "raw_logprobs"); rank 1 = the most likely
    token (None where it is unknown: a sampled token outside the top N asked for); decoded_token its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the sampled or prompt token, and the top N).
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass
class CompletionOutput:
    """One of a request's n outputs.

    index: which of the n; text: the output's text (a stop string cut unless include_stop_str_in_output);
    token_ids: its tokens (a stop id and EOS kept; a stop string the device matched cut like the text);
    cumulative_logprob: the sum of the emitted tokens' logprobs (None unless logprobs were asked for);
    logprobs: per token, when asked for; finish_reason: "stop" | "length" | "abort" (None while running);
    stop_reason: the stop id or stop string that ended it (None for EOS or no stop)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """A request's times (epoch seconds) and counts. first_token_time and finished_time are None until they
    happen; num_cached_tokens: prompt tokens found in the prefix cache at the first admission; drafted and
    accepted: draft tokens proposed for and accepted into its outputs, over all n; preemptions likewise."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    preemptions: int = 0


@dataclasses.dataclass
class RequestOutput:
    """A request as it stands: prompt (its text, None for a token prompt), prompt_token_ids, prompt_logprobs (per
    prompt token, the first None, when asked for), its outputs, whether every output has finished, metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens
