"""The request table: what the host knows of each request, and which slot holds it (vLLM's Processor and
OutputProcessor, in one small class).

The device holds the sequences (`scheduler.SeqTable`); the table holds the rest: each request's `RequestLog`
(prompt, sampling, tokens, times, counts), the queue of requests not yet in a slot, the slot of each one that is,
the empty slots the device will have after the next `schedule`, and the n > 1 requests not forked yet with the
slots held for their outputs 1... It reads a step's outputs (`collect`, `fork_plan`) and says what to write
(`admissions`, `abort`), but never touches the device: `Engine` does, so that the host loop's one question,
"what does the next dispatch need", stays in one place.

Ids: output j of an n > 1 request `rid` is `rid + j` (output 0 is the request itself).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from skvs_jax import checks
from skvs_jax.serve import engine_step
from skvs_jax.serve import sampling as sampling_mod
from skvs_jax.serve.sampling_params import SamplingParams, stop_bytes


@dataclasses.dataclass
class RequestLog:
    """Host-side record of a request (times in seconds since the engine started)."""

    request_id: int
    prompt: tuple[int, ...]
    sampling: SamplingParams
    arrival_time: float
    tokens: list[int] = dataclasses.field(default_factory=list)
    first_token_time: float = float("nan")
    finish_time: float = float("nan")
    admissions: int = 0
    admitted_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    drafted: int = 0
    accepted: int = 0
    finished: bool = False
    aborted: bool = False  # ended by `Engine.abort_request` before it finished
    error: str | None = None
    first_cached_tokens: int = 0  # of cached_tokens, those of the first admission (metrics' kv_hit_rate_first)
    logprobs: list[dict[int, float]] | None = None  # per token: raw logprobs of the token and the top-N (if asked)
    sample_index: int = 0  # which of the prompt's n outputs this is (output 0: the request itself)
    sample_ids: tuple[int, ...] = ()  # output 0 of n > 1: the ids of the n outputs in order (consecutive)
    cache_salt: str | None = None  # the tenant's salt: its prompt shares cached blocks only with this salt

    @property
    def output_tokens(self) -> list[int]:
        """The output as a vLLM user reads it: `tokens` without a stop string that ended it (unless
        include_stop_str_in_output); stop token ids stay."""
        tail = self.tokens
        if self.finished and not self.sampling.include_stop_str_in_output:
            for stop in self.sampling.stop:
                seq = list(stop_bytes(stop))
                if len(tail) >= len(seq) and tail[len(tail) - len(seq):] == seq:
                    return tail[: len(tail) - len(seq)]
        return list(tail)


def salt_id(cache_salt: str | None) -> int:
    """The int32 the scheduler stores for a cache salt: 0 for None (no salt), else 31 bits of the salt's BLAKE2b
    digest, never 0. Two different salts share cached blocks only if these collide (p = 2^-31 per pair)."""
    if cache_salt is None:
        return 0
    digest = int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF
    return digest or 1


Result = tuple[int, list[int], bool]  # (request id, new tokens, finished): what a step streams per request


class RequestTable:
    """Requests by id; the queue; slot <-> request; the empty slots after the next `schedule` (`free_slots`); the
    n > 1 requests not forked yet (`unforked`: id -> empty slots held for its outputs 1..)."""

    def __init__(self, max_seqs: int, vocab_size: int, max_len: int):
        self.max_seqs, self.vocab_size, self.max_len = max_seqs, vocab_size, max_len
        self.requests: dict[int, RequestLog] = {}
        self.queue: list[int] = []  # arrived, not yet in a slot
        self.slot_of: dict[int, int] = {}
        self.request_in: list[int] = [-1] * max_seqs
        self.free_slots = max_seqs  # what the last step reported, less the slots held for unforked outputs
        self.unforked: dict[int, int] = {}
        self.next_id = 0

    # ------------------------------------------------------------------------------------------------ adding

    def add(self, prompt_tokens: Sequence[int], sampling: SamplingParams | None, arrival_time: float | None,
            request_id: int | None, cache_salt: str | None, now: float) -> int:
        """Validate and queue a request (`Engine.add_request`); returns its id. Nothing is queued when it is
        refused."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise TypeError(f"cache_salt must be a non-empty str or None, got {cache_salt!r}")
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        prompt = self._check_prompt(prompt_tokens, sampling)
        if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, numbers.Real)):
            raise TypeError(f"arrival_time must be a number (seconds on the engine's clock) or None, got "
                            f"{type(arrival_time).__name__} {arrival_time!r}")
        if arrival_time is not None and not math.isfinite(arrival_time):
            raise ValueError(f"arrival_time must be finite, got {arrival_time!r}")
        if request_id is not None and not checks.is_int(request_id):
            raise TypeError(f"request_id must be an int, got {type(request_id).__name__}")
        rid = self.next_id if request_id is None else int(request_id)
        if not 0 <= rid <= engine_step.MAX_REQUEST_ID:  # -1 marks an empty slot on the device
            raise ValueError(f"request_id must lie in [0, {engine_step.MAX_REQUEST_ID}], got {rid}")
        if rid in self.requests:
            raise ValueError(f"request_id {rid} is already in use")
        n = sampling.n
        if n > self.max_seqs:
            raise ValueError(f"sampling.n ({n}) exceeds the cache's {self.max_seqs} slots (each output takes one)")
        ids = tuple(range(rid, rid + n))
        if n > 1 and (ids[-1] > engine_step.MAX_REQUEST_ID or any(i in self.requests for i in ids)):
            raise ValueError(f"n = {n} outputs take the request ids {rid} .. {ids[-1]}; some are in use or too large")
        self.next_id = max(self.next_id, rid + n)
        arrival = now if arrival_time is None else float(arrival_time)
        self.requests[rid] = RequestLog(rid, prompt, sampling, arrival, sample_ids=ids if n > 1 else (),
                                        cache_salt=cache_salt)
        for i in range(1, n):  # forked off output 0 once it has sampled its first token
            self.requests[rid + i] = RequestLog(rid + i, prompt, sampling, arrival, sample_index=i,
                                                cache_salt=cache_salt)
        if n > 1:
            self.unforked[rid] = 0  # slots held for its outputs 1.. (set at admission)
        self.queue.append(rid)
        return rid

    def _check_prompt(self, prompt_tokens: Sequence[int], sampling: SamplingParams) -> tuple[int, ...]:
        if isinstance(prompt_tokens, (str, bytes)) or not isinstance(prompt_tokens, Iterable):
            raise TypeError(f"prompt_tokens must be a sequence of ints, got {type(prompt_tokens).__name__}")
        prompt = tuple(prompt_tokens)
        if not all(checks.is_int(t) for t in prompt):
            bad = next(t for t in prompt if not checks.is_int(t))
            raise TypeError(f"prompt_tokens must be ints, got {type(bad).__name__} {bad!r}")
        prompt = tuple(int(t) for t in prompt)
        if not prompt:
            raise ValueError("prompt_tokens must not be empty")
        vocab = self.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt_tokens must lie in [0, {vocab})")
        if any(t >= vocab for t in sampling.stop_token_ids):
            raise ValueError(f"sampling.stop_token_ids must lie in [0, {vocab}), got {sampling.stop_token_ids}")
        if any(t >= vocab for seq in sampling.stop_sequences() for t in seq):
            raise ValueError(f"sampling.stop strings are UTF-8 bytes, which must lie in this model's vocabulary "
                             f"[0, {vocab})")
        if len(prompt) + sampling.max_tokens > self.max_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                             f"{self.max_len} tokens a sequence can hold (max_blocks_per_seq * block_size)")
        return prompt

    def completions(self, request_id: int) -> list[list[int]]:
        """The outputs of a request in order: its n outputs (`SamplingParams.n`), each as `RequestLog.output_tokens`."""
        r = self.requests[request_id]
        return [self.requests[i].output_tokens for i in (r.sample_ids or (request_id,))]

    def has_work(self) -> bool:
        return bool(self.queue) or any(r >= 0 for r in self.request_in)

    def live_outputs(self, rid: int) -> list[int]:
        """The ids of outputs 1.. of request `rid` (n > 1) that have not been aborted: the ones to fork."""
        return [cid for cid in self.requests[rid].sample_ids[1:] if not self.requests[cid].aborted]

    # ------------------------------------------------------------------------------------------- admission

    def admissions(self) -> list[int]:
        """The queued requests that fit the empty slots now, in order (a request whose n outputs do not fit yet
        waits, and so do later ones); the slots for their unforked outputs are held from here on."""
        take, need = [], 0
        for rid in self.queue:
            n = 1 + len(self.live_outputs(rid))  # outputs aborted before admission hold no slot
            if need + n > self.free_slots:
                break
            take.append(rid)
            need += n
            if rid in self.unforked:
                self.unforked[rid] = n - 1  # empty slots held until it forks
        self.queue = self.queue[len(take):]
        self.free_slots -= need
        return take

    def placed(self, ids: Sequence[int], slots: np.ndarray) -> None:
        """`ids[i]` now lives in `slots[i]` (what the device's `add` or `fork` returned)."""
        for row, rid in enumerate(ids):
            if slots[row] < 0:
                raise RuntimeError("engine bug: a request found no empty slot")
            self.slot_of[rid], self.request_in[int(slots[row])] = int(slots[row]), rid

    def admission_arrays(self, ids: Sequence[int]) -> tuple[np.ndarray, ...]:
        """`engine_step.add_requests`'s host arrays for these requests in rows 0..: (prompts int32[B, max_len],
        prompt_len, max_new, priority, request_id, cache_salt int32[B]); rows past them are padding."""
        b = self.max_seqs
        prompts = np.zeros((b, self.max_len), np.int32)
        lens, new, prio, ids_, salts = (np.zeros(b, np.int32) for _ in range(5))
        new[:] = 1
        for row, rid in enumerate(ids):
            r = self.requests[rid]
            prompts[row, : len(r.prompt)], lens[row], new[row], ids_[row] = (r.prompt, len(r.prompt),
                                                                             r.sampling.max_tokens, rid)
            salts[row] = salt_id(r.cache_salt)
        return prompts, lens, new, prio, ids_, salts

    # --------------------------------------------------------------------------------------- a step's outputs

    def forking(self) -> dict[int, int]:
        """The unforked n > 1 requests in a slot, by id -> slot: read before `collect`, which may end them."""
        return {rid: self.slot_of[rid] for rid in self.unforked if rid in self.slot_of}

    def collect(self, out: engine_step.StepOut, end: float) -> list[Result]:
        """A step's outputs (numpy leaves) into the logs; finished requests leave their slots. Returns what each
        request produced."""
        results = []
        for slot, rid in enumerate(self.request_in):
            if rid < 0:
                continue
            r = self.requests[rid]
            if out.admitted[slot]:  # looked up: the prompt and, after a recompute, the output so far
                if not r.admissions:
                    r.first_cached_tokens = int(out.hit_tokens[slot])
                r.admissions += 1
                r.admitted_tokens += len(r.prompt) + len(r.tokens)
                r.cached_tokens += int(out.hit_tokens[slot])
            r.preemptions += int(out.preempted[slot])
            r.drafted += int(out.num_drafts[slot])
            r.accepted += int(out.accepted[slot])
            n = int(out.num_new[slot])
            if n:
                new = out.new_tokens[slot, :n].tolist()
                if not r.tokens:
                    r.first_token_time = end
                r.tokens.extend(new)
                if r.sampling.logprobs is not None:
                    _record_logprobs(r, out, slot, new)
            if out.finished[slot]:
                r.finished, r.finish_time = True, end
                self.request_in[slot] = -1
                del self.slot_of[rid]
            if n or out.finished[slot]:
                results.append((rid, r.tokens[len(r.tokens) - n:], bool(out.finished[slot])))
        return results

    def fork_plan(self, out: engine_step.StepOut, forking: dict[int, int], end: float
                  ) -> tuple[list[Result], list[tuple[int, int, int]]]:
        """Outputs 1.. of the n > 1 requests whose output 0 sampled its first token this step: each takes the
        token its own stream drew there (`StepOut.sibling_tokens`). One that ends with that token (max_tokens 1,
        a stop) finishes without a slot; the others are returned as (parent slot, id, first token), to fork off
        output 0's slot (`forked` once placed). Their held slots are released here."""
        results, forks = [], []
        for rid, slot in forking.items():
            if not out.num_new[slot]:
                continue
            for cid in self.live_outputs(rid):
                r = self.requests[cid]
                token = int(out.sibling_tokens[slot, r.sample_index - 1])
                r.tokens, r.first_token_time = [token], end
                if r.sampling.logprobs is not None:
                    top = r.sampling.logprobs
                    entry = {int(t): float(lp) for t, lp in zip(out.top_ids[slot, 0, :top],
                                                                out.top_logprobs[slot, 0, :top])}
                    entry[token] = float(out.sibling_logprob[slot, r.sample_index - 1])
                    r.logprobs = [entry]
                stops = {seq[0] for seq in r.sampling.stop_sequences() if len(seq) == 1}
                if r.sampling.max_tokens == 1 or token in stops:
                    r.finished, r.finish_time = True, end
                    results.append((cid, [token], True))
                else:
                    forks.append((slot, cid, token))
            self.free_slots += self.unforked.pop(rid)
        return results, forks

    def forked(self, forks: list[tuple[int, int, int]], slots: np.ndarray) -> list[Result]:
        """The forks of `fork_plan` placed in `slots` (what `engine_step.fork_requests` returned)."""
        self.placed([cid for _, cid, _ in forks], slots)
        self.free_slots -= len(forks)
        return [(cid, [token], False) for _, cid, token in forks]

    # ------------------------------------------------------------------------------------------------ abort

    def abort(self, request_id: int) -> tuple[bool, list[int]]:
        """End a request (`Engine.abort_request`): the request's own id ends every output of an n > 1 request,
        `request_id + j` output j alone. Returns (whether some output ended, the slots the device must abort)."""
        if isinstance(request_id, bool) or not checks.is_int(request_id):
            raise TypeError(f"request_id must be an int, got {type(request_id).__name__}")
        rid = int(request_id)
        r = self.requests.get(rid)
        if r is None:
            return False, []
        ended, slots = False, []
        for i in r.sample_ids or (rid,):
            ok, slot = self._abort_one(i)
            ended |= ok
            slots += [] if slot is None else [slot]
        return ended, slots

    def _abort_one(self, rid: int) -> tuple[bool, int | None]:
        """End one output; returns (whether it ended now, the slot it held)."""
        r = self.requests[rid]
        if r.finished or r.aborted:
            return False, None
        r.aborted = True
        parent = rid - r.sample_index
        if r.sample_index == 0:  # output 0: slots still held for its unforked outputs go back
            self.free_slots += self.unforked.pop(rid, 0)
        elif parent in self.unforked:  # not forked yet: it never will be, and its held slot (if any) goes back
            if self.unforked[parent]:
                self.unforked[parent] -= 1
                self.free_slots += 1
            return True, None
        if rid in self.queue:
            self.queue.remove(rid)
            return True, None
        slot = self.slot_of.pop(rid, None)
        if slot is None:  # an unforked output whose output 0 ended first: it holds nothing
            return True, None
        self.request_in[slot] = -1
        self.free_slots += 1  # `scheduler.abort` empties the slot at once
        return True, slot


def _record_logprobs(r: RequestLog, out: engine_step.StepOut, slot: int, new: list[int]) -> None:
    top = r.sampling.logprobs
    r.logprobs = [] if r.logprobs is None else r.logprobs
    for i, token in enumerate(new):
        entry = {int(t): float(lp) for t, lp in zip(out.top_ids[slot, i, :top], out.top_logprobs[slot, i, :top])}
        entry[int(token)] = float(out.token_logprob[slot, i])
        r.logprobs.append(entry)


# -------------------------------------------------------------------------------------------- sampling rows


def sampling_rows(logs: Sequence[RequestLog], defaults: sampling_mod.SamplingRows, engine_seed: int
                  ) -> sampling_mod.SamplingRows:
    """B sampling rows (numpy) for these requests in order, `defaults` (host arrays, B rows) past them. A
    request's stream: its seed's (without one: a seed mixed from the engine's and the request id), folded with
    its sample index."""
    rows = jax.tree.map(np.array, defaults)  # copies: the rows are written below
    b = rows.temperature.shape[0]
    seeds, index = np.zeros(b, np.uint32), np.zeros(b, np.int32)
    for row, r in enumerate(logs):
        sp = r.sampling
        for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            getattr(rows, name)[row] = getattr(sp, name)
        rows.logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        for x, seq in enumerate(sp.stop_sequences()):
            rows.stops[row, x, : len(seq)], rows.stop_len[row, x] = seq[::-1], len(seq)
        seeds[row] = sp.seed if sp.seed is not None else unseeded(engine_seed, r.request_id - r.sample_index)
        index[row] = r.sample_index
        rows.siblings[row] = sp.n - 1 if r.sample_index == 0 else 0
    if logs:
        rows = rows.replace(stream=np.asarray(sampling_mod.stream_keys(seeds, index)), seed=seeds)
    return rows


def unseeded(engine_seed: int, request_id: int) -> int:
    """A seed for a request without one: the engine's seed and the request id, mixed (splitmix32)."""
    x = (engine_seed * 0x9E3779B9 + request_id + 1) & 0xFFFFFFFF
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x = ((x ^ (x >> shift)) * mult) & 0xFFFFFFFF
    return x ^ (x >> 16)
