"""`AsyncLLM`: an asyncio front over one `LLM`, so many coroutines (a server's requests) share one engine.

An `LLM` is not thread-safe and its `step` blocks for a whole dispatch, so the event loop never touches it: one
engine thread owns the LLM and loops

    take the inbox's commands (add, abort, a call such as `stats`, stop) → `LLM.step()` → hand each
    `RequestOutput` to its request's `asyncio.Queue` with `loop.call_soon_threadsafe`

and, with no request left, blocks on the inbox (a `queue.Queue`: no polling, no busy loop). Between two steps it
takes every command waiting, so an abort or a new request waits at most one dispatch.

    async with AsyncLLM(LLM()) as engine:        # or engine = AsyncLLM(...); ...; engine.shutdown()
        async for out in engine.generate("def f(x):", SamplingParams(max_tokens=16), "req-1"):
            print(out.outputs[0].text)

The abort path: a request's `RequestStream` that is closed before its final output (the consumer cancelled,
`aclose`d, broke out of `generate`, or a server saw its client leave) puts an abort in the inbox; the engine
thread runs `LLM.abort_request` (the engine frees the request's blocks at once), and the next step sends the final
output, finish_reason "abort", which ends the stream.

Errors: a request the LLM refuses (ValueError / TypeError naming the field) fails only its own `add_request`.
An exception in a step is fatal: the engine's state is unknown, so the thread stops and every waiting caller, and
every later call, gets `EngineDeadError` with the step's exception as its cause (never a hang).

`stats()` is computed on the engine thread (it reads the device's block table): running and waiting requests,
KV-cache usage, and counters of the requests that ended (prompt and generated tokens, prefix-cache hits, drafted
and accepted tokens, outputs by finish reason).
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import jax
import numpy as np

from skvs_jax.serve.outputs import RequestOutput
from skvs_jax.serve.sampling_params import RequestOutputKind, SamplingParams

FINISH_REASONS = ("stop", "length", "abort")
_STOP = ("stop",)
_ACCEPTED = object()  # the first item of a stream whose request the LLM took


class EngineDeadError(RuntimeError):
    """The engine thread has stopped: a step raised (the cause is chained) or `shutdown` was called."""


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot taken on the engine thread. running: outputs in sequence slots (an n > 1 request holds n);
    waiting: requests queued for a slot; kv_usage in [0, 1]: blocks held by requests / usable blocks (idle cached
    prefix blocks, which the allocator may evict, count as free, as vLLM counts them). The rest count the requests
    that have ended (finished or aborted), when they end: prompt_tokens, cached_prompt_tokens (found in the prefix
    cache at admission), generation_tokens (over all n outputs), drafted / accepted (draft tokens), finished
    (outputs by finish reason)."""

    running: int
    waiting: int
    kv_usage: float
    prompt_tokens: int
    cached_prompt_tokens: int
    generation_tokens: int
    drafted: int
    accepted: int
    finished: dict[str, int]

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / prompt tokens (0 before any request ended)."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclasses.dataclass
class _Route:
    """Where the engine thread sends a request's outputs, and what it counts of them (engine thread only)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    delta: bool  # DELTA outputs carry new tokens only: add them up
    tokens: dict[int, int] = dataclasses.field(default_factory=dict)  # output index -> tokens generated


class RequestStream:
    """A request's outputs as an async iterator (from `AsyncLLM.add_request`): `RequestOutput`s shaped by its
    output_kind, ending after the finished one. `close()` aborts the request unless it has finished; call it (or
    `aclose`) when leaving early: `generate` and the server do."""

    def __init__(self, owner: AsyncLLM, request_id: str, items: asyncio.Queue):
        self.request_id = request_id
        self._owner, self._items = owner, items
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._items.get()
        if isinstance(item, BaseException):
            self.finished = True  # the engine is dead: nothing left to abort
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request if it has not finished (idempotent; safe from a `finally` after cancellation: it
        only puts the abort in the inbox)."""
        if not self.finished:
            self.finished = True
            self._owner.abort_nowait(self.request_id)

    async def aclose(self) -> None:
        self.close()


class AsyncLLM:
    """An asyncio front over one `LLM` (module docstring). llm: an `LLM`, or anything with its engine-shaped API
    (`add_request(prompt, sampling_params, request_id, cache_salt=)`, `step`, `abort_request`,
    `has_unfinished_requests`); from here on only the engine thread may touch it. Start-up is the caller's:
    compile first (`llm.engine.warmup()`) if the first request must not wait for it."""

    def __init__(self, llm, *, name: str = "skvs-engine"):
        self.llm = llm
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # orders "the engine died" against new commands: none is left unanswered
        self._error: EngineDeadError | None = None
        self._routes: dict[str, _Route] = {}  # request id -> route (engine thread only)
        self._counts = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "generation_tokens": 0, "drafted": 0,
                        "accepted": 0}
        self._finished = dict.fromkeys(FINISH_REASONS, 0)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ the event loop

    @property
    def tokenizer(self):
        """The LLM's tokenizer (encoding and chat templates are pure: safe to call from the event loop)."""
        return self.llm.tokenizer

    @property
    def is_running(self) -> bool:
        """The engine thread is alive and no step has failed."""
        return self._error is None and self._thread.is_alive()

    async def add_request(self, prompt, sampling_params: SamplingParams, request_id: str, *,
                          cache_salt: str | None = None) -> RequestStream:
        """Queue a request (as `LLM.add_request` takes it) and wait until the engine thread has taken it; returns
        its `RequestStream`. Raises the LLM's ValueError / TypeError when it refuses the request, and
        EngineDeadError when the engine has stopped."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        route = _Route(loop, items, sampling_params.output_kind is RequestOutputKind.DELTA)
        self._submit(("add", request_id, prompt, sampling_params, cache_salt, route))
        try:
            first = await items.get()
        except BaseException:  # cancelled while waiting: the request may have been added
            self.abort_nowait(request_id)
            raise
        if first is not _ACCEPTED:
            raise first
        return RequestStream(self, request_id, items)

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str, *,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """vLLM's `AsyncLLM.generate`: the request's outputs as its output_kind shapes them, ending after the
        finished one. Leaving early (cancellation, `aclose`, `break`) aborts the request."""
        stream = await self.add_request(prompt, sampling_params, request_id, cache_salt=cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> bool:
        """Abort a request (all of its outputs); False when it is unknown or has ended. Its stream still receives
        the final output (finish_reason "abort")."""
        return await self.call(lambda llm: llm.abort_request(request_id))

    def abort_nowait(self, request_id: str) -> None:
        """Abort without waiting for the engine thread (from any thread; nothing to do once the engine died)."""
        try:
            self._submit(("abort", request_id))
        except EngineDeadError:
            pass

    async def stats(self) -> EngineStats:
        """An `EngineStats` snapshot, taken on the engine thread between two steps."""
        return await self.call(lambda llm: self._snapshot())

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(llm) on the engine thread between two steps and return its result (its exception is raised
        here; it does not stop the engine)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._submit(("call", fn, loop, future))
        return await future

    def shutdown(self, timeout: float | None = 60.0) -> None:
        """Stop the engine thread after its current step; waiting callers get EngineDeadError. Idempotent."""
        try:
            self._submit(_STOP)
        except EngineDeadError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.shutdown)

    def _submit(self, command: tuple) -> None:
        with self._lock:
            if self._error is not None:
                raise _dead(self._error)
            self._inbox.put(command)

    # -------------------------------------------------------------------------------------- the engine thread

    def _run(self) -> None:
        try:
            while True:
                for command in self._commands(block=not self.llm.has_unfinished_requests()):
                    if command is _STOP:
                        self._stop(EngineDeadError("the engine was shut down"))
                        return
                    self._handle(command)
                if self.llm.has_unfinished_requests():
                    for out in self.llm.step():
                        self._deliver(out)
        except BaseException as err:  # the engine's state is unknown: fail everyone, stop
            dead = EngineDeadError(f"the engine thread stopped: {type(err).__name__}: {err}")
            dead.__cause__ = err
            self._stop(dead)

    def _commands(self, block: bool) -> list[tuple]:
        """Every command waiting; with block, wait for the first (the engine is idle)."""
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, rid, prompt, sp, salt, route = command
            try:
                self.llm.add_request(prompt, sp, rid, cache_salt=salt)
            except Exception as err:  # refused: nothing was queued, the engine goes on
                _post(route.loop, route.queue, err)
                return
            self._routes[rid] = route
            _post(route.loop, route.queue, _ACCEPTED)
        elif kind == "abort":
            self.llm.abort_request(command[1])  # False when it has ended: nothing to do
        elif kind == "call":
            _, fn, loop, future = command
            try:
                result, error = fn(self.llm), None
            except Exception as err:
                result, error = None, err
            _settle(loop, future, result, error)

    def _deliver(self, out: RequestOutput) -> None:
        route = self._routes.get(out.request_id)
        if route is None:
            return
        for c in out.outputs:  # DELTA: the new tokens; CUMULATIVE and FINAL_ONLY: all of them
            before = route.tokens.get(c.index, 0) if route.delta else 0
            route.tokens[c.index] = before + len(c.token_ids)
        if out.finished:
            del self._routes[out.request_id]
            self._count(out, route)
        _post(route.loop, route.queue, out)

    def _count(self, out: RequestOutput, route: _Route) -> None:
        c = self._counts
        c["prompt_tokens"] += len(out.prompt_token_ids)
        c["cached_prompt_tokens"] += out.metrics.num_cached_tokens
        c["generation_tokens"] += sum(route.tokens.values())
        c["drafted"] += out.metrics.drafted
        c["accepted"] += out.metrics.accepted
        for o in out.outputs:  # the final output holds every output (a DELTA one, those that just ended)
            if o.finish_reason in self._finished:
                self._finished[o.finish_reason] += 1

    def _snapshot(self) -> EngineStats:
        engine = self.llm.engine
        table = engine.table
        blocks = jax.device_get(engine.state.sched.kv.alloc.blocks)
        held = int(np.sum(np.asarray(blocks.ref_count)[1:] > 0))  # block 0 is the null block
        usable = engine.cfg.sched.cache.usable_blocks
        return EngineStats(running=sum(r >= 0 for r in table.request_in), waiting=len(table.queue),
                           kv_usage=held / usable, finished=dict(self._finished), **self._counts)

    def _stop(self, error: EngineDeadError) -> None:
        """Fail every waiting caller and every command still queued; later calls raise at once."""
        with self._lock:
            self._error = error
            routes, self._routes = list(self._routes.values()), {}
            pending = self._commands(block=False)
        for r in routes:
            _post(r.loop, r.queue, _dead(error))
        for command in pending:
            if command[0] == "add":
                route = command[-1]
                _post(route.loop, route.queue, _dead(error))
            elif command[0] == "call":
                _settle(command[2], command[3], None, _dead(error))


def _dead(error: EngineDeadError) -> EngineDeadError:
    """A fresh copy per caller: one exception object raised in many tasks would share (and grow) a traceback."""
    copy = EngineDeadError(*error.args)
    copy.__cause__ = error.__cause__
    return copy


def _post(loop: asyncio.AbstractEventLoop, items: asyncio.Queue, item) -> None:
    try:
        loop.call_soon_threadsafe(items.put_nowait, item)
    except RuntimeError:  # the caller's loop has closed: nobody is listening
        pass


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result, error) -> None:
    def settle():
        if not future.done():
            future.set_result(result) if error is None else future.set_exception(error)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass
