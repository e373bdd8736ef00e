"""An OpenAI-compatible HTTP server over one `AsyncLLM`: `build_app(async_llm, model_name)` is a FastAPI app that
uvicorn runs (`skvs serve`).

  POST /v1/completions        prompt: text, token ids, or a batch of either (choice index = prompt * n + output)
  POST /v1/chat/completions   messages rendered by the tokenizer's chat template
  GET  /v1/models, /health (200 while the engine thread runs), /metrics (Prometheus text)

Requests are pydantic models that forbid unknown fields: a misspelt field is an error, not a default silently
used. Values are checked once, where they are defined (`SamplingParams`, the engine), whose errors name the
field; every bad request gets HTTP 400 with OpenAI's error body {"error": {"message", "type":
"invalid_request_error", "param", "code"}}, an unknown model 404, a dead engine 503. Streams are server-sent
events as OpenAI sends them: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`.

A client that leaves is noticed between chunks, and every POLL_S while none comes, by
`request.is_disconnected()`; then (or when the response's task is cancelled) the requests' streams are closed,
which aborts them on the engine thread, and the engine frees their blocks at once.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict

from skvs_jax.serve import sampling as sampling_mod
from skvs_jax.serve.async_llm import FINISH_REASONS, AsyncLLM, EngineDeadError, EngineStats, RequestStream
from skvs_jax.serve.outputs import CompletionOutput, RequestOutput
from skvs_jax.serve.sampling_params import RequestOutputKind, SamplingParams

POLL_S = 0.5  # how often a request waiting for its next output checks that its client is still there
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: what the sequence has room for)


# ------------------------------------------------------------------------------------------------- requests


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far (load generators ask)


class _Sampling(_Body):
    """The fields both endpoints share. None means the default (clients send null for "not given")."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # OpenAI's default, 1
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids as strings
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    cache_salt: str | None = None
    user: str | None = None  # accepted and ignored
    stream: bool | None = None
    stream_options: StreamOptions | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: the template may read them

    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ApiError(Exception):
    """An OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


_FIELDS = set(CompletionRequest.model_fields) | set(ChatRequest.model_fields)
_ALL_FIELDS = _FIELDS | set(StreamOptions.model_fields) | set(ChatMessage.model_fields) | set(ContentPart.model_fields)
_ALIASES = {"prompt_tokens": "prompt", "sampling_params": None}


def param_of(message: str, prompt_field: str = "prompt") -> str | None:
    """The request field an engine or SamplingParams message names: its first word that is a field."""
    for word in re.findall(r"[A-Za-z_]+", message):
        name = _ALIASES.get(word, word)
        if name in _FIELDS:
            return prompt_field if name == "prompt" else name
    return None


def _refused(err: Exception, prompt_field: str = "prompt") -> ApiError:
    if isinstance(err, EngineDeadError):
        return ApiError(503, str(err), kind="service_unavailable")
    return ApiError(400, str(err), param_of(str(err), prompt_field))


def sampling_params(body: _Sampling, *, max_tokens: int, logprobs: int | None, stream: bool,
                    logprobs_field: str = "logprobs") -> SamplingParams:
    """The request's `SamplingParams` (what each field maps to: docs/serving.md); its errors become 400."""
    if logprobs is not None and not 0 <= logprobs <= sampling_mod.MAX_LOGPROBS:  # -1 (all V) is LLM's, not ours
        raise ApiError(400, f"{logprobs_field} must be an int in [0, {sampling_mod.MAX_LOGPROBS}], got {logprobs}",
                       logprobs_field)
    given = {name: getattr(body, name) for name in (
        "top_p", "top_k", "min_p", "n", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "min_tokens", "ignore_eos", "allowed_token_ids", "include_stop_str_in_output",
        "skip_special_tokens") if getattr(body, name) is not None}
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            stop=tuple(stop), stop_token_ids=tuple(body.stop_token_ids or ()), bad_words=tuple(body.bad_words or ()),
            logprobs=logprobs, output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            **given)
    except (ValueError, TypeError) as err:
        raise _refused(err) from None


# --------------------------------------------------------------------------------------------- the engine side


async def _add_all(engine: AsyncLLM, prompts: list, sp: SamplingParams, base_id: str, salt: str | None,
                   prompt_field: str) -> list[RequestStream]:
    """Add every prompt at once; if the engine refuses one, abort the others and raise its 400."""
    results = await asyncio.gather(*(engine.add_request(p, sp, f"{base_id}-{i}", cache_salt=salt)
                                     for i, p in enumerate(prompts)), return_exceptions=True)
    streams = [r for r in results if isinstance(r, RequestStream)]
    errors = [r for r in results if not isinstance(r, RequestStream)]
    if errors:
        for s in streams:
            s.close()
        if not isinstance(errors[0], Exception):
            raise errors[0]  # cancellation
        raise _refused(errors[0], prompt_field)
    return streams


class _ClientGone(Exception):
    pass


async def _merge(request: Request, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come. Stops early when the client disconnects; however it
    ends (done, error, cancellation), every unfinished stream is closed, aborting its request."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                merged.put_nowait((i, out))
            merged.put_nowait((i, None))
        except Exception as err:  # the engine died: the consumer raises it
            merged.put_nowait((i, err))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            try:
                i, item = await asyncio.wait_for(merged.get(), POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    raise _ClientGone() from None
                continue
            if item is None:
                left -= 1
                continue
            if isinstance(item, Exception):
                raise item
            yield i, item
            if await request.is_disconnected():
                raise _ClientGone()
    finally:
        for s in streams:  # synchronous: runs even where a cancelled task can await nothing more
            s.close()
        for t in tasks:
            t.cancel()


# ----------------------------------------------------------------------------------------------- responses


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _ranked(entry: dict, top: int) -> list:
    """The top `top` Logprobs of a position, most likely first."""
    return sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= top), key=lambda lp: lp.rank)


def completion_logprobs(c: CompletionOutput, top: int, offset: int) -> dict:
    """OpenAI's legacy logprobs object for c's tokens; offset: characters of the output before them."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for token, entry in zip(c.token_ids, c.logprobs or []):
        lp = entry[token]
        tokens.append(lp.decoded_token)
        logprobs.append(lp.logprob)
        tops.append({x.decoded_token: x.logprob for x in _ranked(entry, top)})
        offsets.append(offset)
        offset += len(lp.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, top: int) -> dict:
    """OpenAI's chat logprobs object ({"content": [...]}) for c's tokens."""

    def item(lp) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [item(entry[t]) | {"top_logprobs": [item(x) for x in _ranked(entry, top)]}
                        for t, entry in zip(c.token_ids, c.logprobs or [])]}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Stream:
    """What one streamed response tracks: ids, usage, and per choice the characters sent (logprobs' offsets)."""

    def __init__(self, rid: str, model: str, obj: str, n: int, options: StreamOptions):
        self.rid, self.model, self.obj, self.n = rid, model, obj, n
        self.created = int(time.time())
        self.include_usage, self.continuous = options.include_usage, options.continuous_usage_stats
        self.prompt_tokens = self.completion_tokens = 0
        self.prompted: set[int] = set()  # the prompts whose tokens are counted
        self.offsets: dict[int, int] = {}

    def count(self, i: int, out) -> None:
        """Usage: prompt i's tokens once, and the output tokens `out` (a DELTA output) brings."""
        if i not in self.prompted:
            self.prompted.add(i)
            self.prompt_tokens += len(out.prompt_token_ids)
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def chunk(self, choice: dict) -> str:
        body = {"id": self.rid, "object": self.obj, "created": self.created, "model": self.model, "choices": [choice]}
        if self.continuous:
            return _sse(body | {"usage": _usage(self.prompt_tokens, self.completion_tokens)})
        return _sse(body | ({"usage": None} if self.include_usage else {}))

    def tail(self) -> str:
        usage = ""
        if self.include_usage:
            usage = _sse({"id": self.rid, "object": self.obj, "created": self.created, "model": self.model,
                          "choices": [], "usage": _usage(self.prompt_tokens, self.completion_tokens)})
        return usage + "data: [DONE]\n\n"


def _error_event(err: Exception) -> str:
    return _sse({"error": {"message": str(err), "type": "internal_server_error", "param": None, "code": None}})


async def _completion_events(request: Request, streams, s: _Stream, top: int | None) -> AsyncIterator[str]:
    try:
        async for i, out in _merge(request, streams):
            s.count(i, out)
            for c in out.outputs:
                if not (c.text or c.finish_reason or (top is not None and c.token_ids)):
                    continue
                k = i * s.n + c.index
                choice = {"index": k, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                if top is not None:
                    choice["logprobs"] = completion_logprobs(c, top, s.offsets.get(k, 0))
                s.offsets[k] = s.offsets.get(k, 0) + len(c.text)
                yield s.chunk(choice)
    except _ClientGone:
        return
    except EngineDeadError as err:
        yield _error_event(err)
    yield s.tail()


async def _chat_events(request: Request, streams, s: _Stream, top: int | None) -> AsyncIterator[str]:
    try:
        for j in range(s.n):  # OpenAI's first chunk of each choice: the role, no content
            yield s.chunk({"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None})
        async for i, out in _merge(request, streams):
            s.count(i, out)
            for c in out.outputs:
                if c.text or (top is not None and c.token_ids):
                    logprobs = chat_logprobs(c, top) if top is not None else None
                    yield s.chunk({"index": c.index, "delta": {"content": c.text}, "logprobs": logprobs,
                                   "finish_reason": None})
                if c.finish_reason is not None:
                    yield s.chunk({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason})
    except _ClientGone:
        return
    except EngineDeadError as err:
        yield _error_event(err)
    yield s.tail()


async def _finals(request: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
    """Every request's final output, in prompt order (None: the client left, the requests were aborted)."""
    finals: list = [None] * len(streams)
    try:
        async for i, out in _merge(request, streams):
            if out.finished:
                finals[i] = out
    except _ClientGone:
        return None
    return finals


# ------------------------------------------------------------------------------------------------- metrics


class _Collector:
    """Prometheus families from the `EngineStats` fetched for the scrape (`stats`)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def describe(self) -> list:
        return []  # no fixed description: the registry collects only when scraped

    def collect(self):
        s, label = self.stats, [self.model_name]
        if s is None:
            return

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, value)
            return c

        yield gauge("skvs_num_requests_running", "Request outputs in sequence slots.", s.running)
        yield gauge("skvs_num_requests_waiting", "Requests queued for a slot.", s.waiting)
        yield gauge("skvs_kv_cache_usage_perc", "KV-cache blocks held by requests / usable blocks (0-1).", s.kv_usage)
        yield gauge("skvs_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens, over "
                    "ended requests.", s.prefix_hit_rate)
        yield gauge("skvs_spec_decode_acceptance_rate", "Accepted / drafted tokens, over ended requests.",
                    s.acceptance_rate)
        yield counter("skvs_prompt_tokens", "Prompt tokens of ended requests.", s.prompt_tokens)
        yield counter("skvs_generation_tokens", "Tokens generated by ended requests.", s.generation_tokens)
        done = CounterMetricFamily("skvs_request_success", "Ended outputs by finish reason.",
                                   labels=["model_name", "finished_reason"])
        for reason in FINISH_REASONS:
            done.add_metric([self.model_name, reason], s.finished.get(reason, 0))
        yield done


# ------------------------------------------------------------------------------------------------- the app


def _prompts(prompt) -> list:
    """A completion request's prompts: one text, one token list, or a batch of either."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(not p for p in prompts):
        raise ApiError(400, "prompt must be a non-empty string, token list, or batch of them", "prompt")
    return prompts


def _message_text(m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"messages: content parts of type {part.type!r} are not supported (text only)",
                           "messages")
        parts.append(part.text)
    return "\n".join(parts)


def build_app(async_llm: AsyncLLM, model_name: str) -> FastAPI:
    """The FastAPI app serving `async_llm` as `model_name` (module docstring)."""
    app = FastAPI(title="skvs_jax", docs_url=None, redoc_url=None)
    started = int(time.time())
    max_len = async_llm.llm.engine.table.max_len
    collector = _Collector(model_name)
    registry = CollectorRegistry()
    registry.register(collector)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0]
        loc = list(first.get("loc", ()))[1:]  # after "body"
        if first.get("type") == "json_invalid" or not loc:
            return ApiError(400, f"the request body: {first.get('msg', 'invalid')}").response()
        path = [str(loc[0])]  # then nested fields, up to a union member's tag ("prompt.str" reads as "prompt")
        for part in loc[1:]:
            if not (isinstance(part, int) or part in _ALL_FIELDS):
                break
            path.append(str(part))
        detail = "unknown field" if first.get("type") == "extra_forbidden" else first.get("msg", "invalid")
        message = f"{'.'.join(path)}: {detail}"
        param = path[0]
        return ApiError(400, message, param).response()

    @app.exception_handler(EngineDeadError)
    async def dead(request: Request, err: EngineDeadError):
        return _refused(err).response()

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(404, f"The model `{name}` does not exist.", "model", code="model_not_found")

    @app.get("/health")
    async def health():
        if not async_llm.is_running:
            return ApiError(503, "the engine thread has stopped", kind="service_unavailable").response()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "skvs_jax", "max_model_len": max_len}]}

    @app.get("/metrics")
    async def metrics():
        try:
            collector.stats = await async_llm.stats()
        except EngineDeadError as err:
            return ApiError(503, str(err), kind="service_unavailable").response()
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if body.echo:
            raise ApiError(400, "echo: only false is supported (the prompt is not returned)", "echo")
        prompts = _prompts(body.prompt)
        max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        sp = sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs, stream=bool(body.stream))
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await _add_all(async_llm, prompts, sp, rid, body.cache_salt, "prompt")
        if body.stream:
            s = _Stream(rid, model_name, "text_completion", sp.n, body.stream_options or StreamOptions())
            return StreamingResponse(_completion_events(request, streams, s, body.logprobs),
                                     media_type="text/event-stream")
        finals = await _finals(request, streams)
        if finals is None:
            return Response(status_code=499)  # nobody reads it
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                logprobs = None if body.logprobs is None else completion_logprobs(c, body.logprobs, 0)
                choices.append({"index": i * sp.n + c.index, "text": c.text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason})
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": _usage(sum(len(o.prompt_token_ids) for o in finals),
                                                    sum(len(c.token_ids) for o in finals for c in o.outputs))}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_model(body.model)
        if not body.messages:
            raise ApiError(400, "messages must hold at least one message", "messages")
        conversation = [m.model_dump(exclude_none=True) | {"content": _message_text(m)} for m in body.messages]
        tok = async_llm.tokenizer
        try:
            ids = tok.encode(tok.apply_chat_template(conversation, True), add_special_tokens=False)
        except (ValueError, TypeError) as err:
            raise ApiError(400, f"messages: {err}", "messages") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = max_len - len(ids)
            if max_tokens < 1:
                raise ApiError(400, f"messages: the conversation's {len(ids)} tokens leave no room in the "
                                    f"{max_len}-token sequence", "messages")
        top = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        sp = sampling_params(body, max_tokens=max_tokens, logprobs=top, stream=bool(body.stream),
                             logprobs_field="top_logprobs")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await _add_all(async_llm, [ids], sp, rid, body.cache_salt, "messages")
        if body.stream:
            s = _Stream(rid, model_name, "chat.completion.chunk", sp.n, body.stream_options or StreamOptions())
            return StreamingResponse(_chat_events(request, streams, s, top), media_type="text/event-stream")
        finals = await _finals(request, streams)
        if finals is None:
            return Response(status_code=499)
        out = finals[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": None if top is None else chat_logprobs(c, top), "finish_reason": c.finish_reason}
                   for c in out.outputs]
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": _usage(len(out.prompt_token_ids),
                                                    sum(len(c.token_ids) for c in out.outputs))}

    return app
