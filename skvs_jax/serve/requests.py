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
from typing import Any

import jax
import numpy as np

from skvs_jax import checks
from skvs_jax import scheduler as sc
from skvs_jax.serve import engine_step
from skvs_jax.serve import sampling as sampling_mod
from skvs_jax.serve.sampling_params import SamplingParams
from skvs_jax.serve.tokenizer import ByteTokenizer


@dataclasses.dataclass
class RequestLog:
    """Host-side record of a request (times in seconds since the engine started)."""

    request_id: int
    prompt: tuple[int, ...]
    sampling: SamplingParams
    arrival_time: float
    tokens: list[int] = dataclasses.field(default_factory=list)
    token_times: list[float] = dataclasses.field(default_factory=list)  # per token: the end of the step emitting it
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
    plan: Plan | None = None  # the sampling as the device and the host match it (`plan`)
    finish_reason: str | None = None  # "stop" | "length" | "abort" once ended (vLLM's)
    stop_reason: int | str | None = None  # the stop id or stop string that ended it (None: EOS, or no stop)
    stop_cut: int = 0  # tokens of a device-matched stop string at the end of `tokens` (`output_tokens` drops them)
    detokenizer: Any = None  # the text so far (`tokenizer.IncrementalDetokenizer`), when the table keeps text
    text_cut: int | None = None  # a host-matched stop string ended the text here (None: no cut)

    @property
    def output_tokens(self) -> list[int]:
        """The output as a vLLM user reads it: `tokens` without a device-matched stop string that ended it (unless
        include_stop_str_in_output); stop token ids and EOS stay."""
        return list(self.tokens[: len(self.tokens) - self.stop_cut])

    @property
    def text(self) -> str | None:
        """The output's text (None when the table keeps no text): without the stop string that ended it unless
        include_stop_str_in_output, as vLLM cuts it."""
        if self.detokenizer is None:
            return None
        text = self.detokenizer.text
        if self.text_cut is not None:
            return text[: self.text_cut]
        if self.stop_cut and isinstance(self.stop_reason, str) and text.endswith(self.stop_reason):
            return text[: len(text) - len(self.stop_reason)]
        return text


@dataclasses.dataclass(frozen=True)
class Plan:
    """A request's stops and constraints as token ids, given the engine's tokenizer (`plan`)."""

    stop_ids: tuple[int, ...]  # SamplingParams.stop_token_ids
    eos: tuple[int, ...]  # the model's EOS ids that end it (none under ignore_eos)
    device_strings: tuple[tuple[str | bytes, tuple[int, ...]], ...]  # stop strings the device matches, as tokens
    host_strings: tuple[str, ...]  # stop strings matched on the text (no exact token sequence)
    bad_words: tuple[tuple[int, ...], ...]  # bad words as token sequences

    def sequences(self) -> list[tuple[int, ...]]:
        """Every device stop sequence: the stop ids, EOS ids (not already stop ids), the stop strings' tokens."""
        return ([(t,) for t in self.stop_ids] + [(t,) for t in self.eos if t not in self.stop_ids]
                + [seq for _, seq in self.device_strings])

    def banned_early(self) -> tuple[int, ...]:
        """What min_tokens bans (vLLM's): the stop ids and EOS."""
        return self.stop_ids + tuple(t for t in self.eos if t not in self.stop_ids)

    def ends(self, tokens: Sequence[int], min_tokens: int) -> tuple[int | str | bytes | None, int] | None:
        """How a device stop ended `tokens` (the finished output): (stop reason, tokens of a stop string to cut),
        or None when no stop ended it. vLLM's order: EOS (reason None), a stop id, then a stop string."""
        if len(tokens) <= min_tokens or not tokens:
            return None
        last = tokens[-1]
        if last in self.eos and last not in self.stop_ids:
            return None, 0
        if last in self.stop_ids:
            return last, 0
        for text, seq in self.device_strings:
            if len(tokens) >= len(seq) and tuple(tokens[len(tokens) - len(seq):]) == seq:
                return text, len(seq)
        return None


def plan(sampling: SamplingParams, tokenizer, vocab: int) -> Plan:
    """`sampling`'s stops and bad words as token ids under `tokenizer` (`serve.tokenizer`); ValueError naming the
    field when they exceed the device's bounds (`sampling.MAX_*`) or the vocabulary.

    A stop string the tokenizer spells one way only (`exact_stop`) is matched on the device, where speculation
    cuts the output at it losslessly; any other is matched on the text by the host (`RequestTable.collect`). Bad
    words are tokenised as vLLM does: the word, and the word after a space where that is a different sequence
    of the same length."""
    eos = () if sampling.ignore_eos else tuple(tokenizer.eos_token_ids)
    device, host = [], []
    for stop in sampling.stop:
        if isinstance(stop, bytes):
            if not isinstance(tokenizer, ByteTokenizer):
                raise ValueError(f"sampling.stop: a bytes stop {stop!r} needs the byte tokenizer; give a str")
            seq: tuple[int, ...] | None = tuple(stop)
        else:
            seq = tokenizer.exact_stop(stop)
            if seq is not None and len(seq) > 1 and sampling.skip_special_tokens and tokenizer.special_ids:
                seq = None  # a special token emitted inside it would vanish from the text but break the id match
        if seq is not None and len(seq) <= sampling_mod.MAX_STOP_LEN:
            device.append((stop, tuple(seq)))
        elif isinstance(stop, bytes):
            raise ValueError(f"sampling.stop: a bytes stop holds at most {sampling_mod.MAX_STOP_LEN} bytes")
        else:
            host.append(stop)
    bad: list[tuple[int, ...]] = []
    for word in sampling.bad_words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        bad.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            bad.append(spaced)
    if len(bad) > sampling_mod.MAX_BAD_WORDS:
        raise ValueError(f"sampling.bad_words: {len(bad)} token sequences, at most {sampling_mod.MAX_BAD_WORDS}")
    if any(len(b) > sampling_mod.MAX_BAD_LEN for b in bad):
        raise ValueError(f"sampling.bad_words: a word spans more than {sampling_mod.MAX_BAD_LEN} tokens")
    result = Plan(stop_ids=sampling.stop_token_ids, eos=eos, device_strings=tuple(device), host_strings=tuple(host),
                  bad_words=tuple(bad))
    if len(result.sequences()) > sampling_mod.MAX_STOPS:
        raise ValueError(f"sampling: stop_token_ids, the model's EOS ids ({len(eos)}) and the stop strings matched on "
                         f"the device make {len(result.sequences())} stops, at most {sampling_mod.MAX_STOPS}")
    for name, ids in (("stop_token_ids", sampling.stop_token_ids),
                      ("stop", [t for _, seq in device for t in seq]),
                      ("allowed_token_ids", sampling.allowed_token_ids or ()),
                      ("logit_bias", sampling.logit_bias or ())):
        if any(t >= vocab for t in ids):
            raise ValueError(f"sampling.{name} must lie in this model's vocabulary [0, {vocab}), got "
                             f"{max(ids)}")
    return result


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

    def __init__(self, max_seqs: int, vocab_size: int, max_len: int, tokenizer=None, keep_text: bool = False):
        self.max_seqs, self.vocab_size, self.max_len = max_seqs, vocab_size, max_len
        self.tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
        self.keep_text = keep_text  # every request keeps its text (else only those with stops matched on text)
        self.host_stopped: dict[int, int] = {}  # id -> slot: ended by a stop string on the host, slot not freed yet
        self.forgetting: set[int] = set()  # ended ids to forget once their slots are freed (`forget`)
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
        if sampling.prompt_logprobs is not None or sampling.logprobs == -1:
            raise ValueError("sampling: prompt_logprobs and logprobs=-1 come from a scoring pass that skvs_jax.LLM "
                             "runs; the engine returns the top logprobs.logprobs <= "
                             f"{sampling_mod.MAX_LOGPROBS} of each emitted token")
        prompt = self._check_prompt(prompt_tokens, sampling)
        request_plan = plan(sampling, self.tokenizer, self.vocab_size)
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
                                        cache_salt=cache_salt, plan=request_plan)
        for i in range(1, n):  # forked off output 0 once it has sampled its first token
            self.requests[rid + i] = RequestLog(rid + i, prompt, sampling, arrival, sample_index=i,
                                                cache_salt=cache_salt, plan=request_plan)
        for i in ids:
            if self.keep_text or request_plan.host_strings:
                self.requests[i].detokenizer = self.tokenizer.detokenizer(sampling.skip_special_tokens)
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
        if len(prompt) + sampling.max_tokens > self.max_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                             f"{self.max_len} tokens a sequence can hold (max_blocks_per_seq * block_size)")
        return prompt

    def completions(self, request_id: int) -> list[list[int]]:
        """The outputs of a request in order: its n outputs (`SamplingParams.n`), each as `RequestLog.output_tokens`."""
        r = self.requests[request_id]
        return [self.requests[i].output_tokens for i in (r.sample_ids or (request_id,))]

    def forget(self, request_id: int) -> None:
        """Drop an ended request's logs (all n outputs), so a long-running front does not keep every request;
        one a stop string ended whose slot the device still holds goes when it leaves (`take_host_stops`).
        ValueError when some output has not ended."""
        ids = self.requests[request_id].sample_ids or (request_id,)
        if not all(self.requests[i].finished or self.requests[i].aborted for i in ids):
            raise ValueError(f"request {request_id} has not ended: it cannot be forgotten")
        if any(i in self.slot_of or i in self.host_stopped for i in ids):
            self.forgetting.add(request_id)
            return
        for i in ids:
            del self.requests[i]

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

    def admit_staged(self, ids: Sequence[int], slots: np.ndarray) -> None:
        """The dispatch loop admitted `ids`, the head of the queue (requests of one output each), into `slots`:
        what `admissions` and `placed` would have done (the next step's `free_slots` counts them)."""
        if list(self.queue[: len(ids)]) != list(ids):
            raise RuntimeError("engine bug: the device admitted staged requests that are not the queue's head")
        self.queue = self.queue[len(ids):]
        self.placed(ids, slots)

    def placed(self, ids: Sequence[int], slots: np.ndarray) -> None:
        """`ids[i]` now lives in `slots[i]` (what the device's `add` or `fork` returned)."""
        for row, rid in enumerate(ids):
            if slots[row] < 0:
                raise RuntimeError("engine bug: a request found no empty slot")
            self.slot_of[rid], self.request_in[int(slots[row])] = int(slots[row]), rid

    def admission_arrays(self, ids: Sequence[int]) -> tuple[np.ndarray, ...]:
        """`engine_step.add_requests`'s host arrays for these requests in rows 0..: (prompts int32[B, max_len],
        prompt_len, max_new, priority, request_id, cache_salt, tpot_target int32[B]); rows past them are padding."""
        b = self.max_seqs
        prompts = np.zeros((b, self.max_len), np.int32)
        lens, new, prio, ids_, salts, targets = (np.zeros(b, np.int32) for _ in range(6))
        new[:] = 1
        for row, rid in enumerate(ids):
            r = self.requests[rid]
            prompts[row, : len(r.prompt)], lens[row], new[row], ids_[row] = (r.prompt, len(r.prompt),
                                                                             r.sampling.max_tokens, rid)
            salts[row] = salt_id(r.cache_salt)
            targets[row] = sc.tpot_target_us(r.sampling.tpot_target)
        return prompts, lens, new, prio, ids_, salts, targets

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
            if rid in self.host_stopped:  # ended on the host; the device runs it until the engine aborts it
                if out.finished[slot]:
                    self._leave(rid, slot)
                continue
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
            new = out.new_tokens[slot, :n].tolist()
            finished = bool(out.finished[slot])
            if r.detokenizer is not None:  # text, and stop strings matched on it: the output may end earlier
                new, stopped = self._extend_text(r, new)
                if stopped and not finished:
                    self.host_stopped[rid] = slot
                finished |= stopped
            if new:
                if not r.tokens:
                    r.first_token_time = end
                r.tokens.extend(new)
                r.token_times.extend([end] * len(new))
                if r.sampling.logprobs is not None:
                    _record_logprobs(r, out, slot, new)
            if finished:
                self._finish(r, end)
                if rid not in self.host_stopped:
                    self._leave(rid, slot)
            if new or finished:
                results.append((rid, list(new), finished))
        return results

    def _leave(self, rid: int, slot: int) -> None:
        self.request_in[slot] = -1
        del self.slot_of[rid]
        self.host_stopped.pop(rid, None)

    def _extend_text(self, r: RequestLog, new: list[int]) -> tuple[list[int], bool]:
        """Detokenise `new` one token at a time, matching the host's stop strings on the text as vLLM does (after
        min_tokens; the stops in order, each searched in the new text and the stop's length before it). Returns
        (the tokens kept: up to the one that completed a stop, whether one did)."""
        stops = r.plan.host_strings
        for i, token in enumerate(new):
            before = len(r.detokenizer.text)
            r.detokenizer.add([token])
            if not stops or len(r.tokens) + i + 1 <= r.sampling.min_tokens:
                continue
            hit = check_stop_strings(r.detokenizer.text, len(r.detokenizer.text) - before, stops,
                                     r.sampling.include_stop_str_in_output)
            if hit is not None:
                r.finish_reason, r.stop_reason = "stop", hit[0]
                r.text_cut = None if hit[1] == -1 else hit[1]
                return new[: i + 1], True
        return new, False

    def _finish(self, r: RequestLog, end: float) -> None:
        r.finished, r.finish_time = True, end
        if r.finish_reason is None:
            self._finish_reason(r)
        if r.detokenizer is not None:
            r.detokenizer.flush()  # the held-back end of the text (an unfinished character as U+FFFD)

    def _finish_reason(self, r: RequestLog) -> None:
        """Why the device ended `r` (vLLM's order: the length cap first, then EOS, a stop id, a stop string)."""
        if len(r.tokens) >= r.sampling.max_tokens:
            r.finish_reason = "length"
            ended = r.plan.ends(r.tokens, r.sampling.min_tokens)  # a stop string at the cap is still cut
            if ended is not None and isinstance(ended[0], (str, bytes)) and not r.sampling.include_stop_str_in_output:
                r.stop_cut = ended[1]
            return
        ended = r.plan.ends(r.tokens, r.sampling.min_tokens)
        if ended is None:
            r.finish_reason = "length"  # the sequence's capacity (`RequestTable.add` keeps it above max_tokens)
            return
        r.finish_reason, r.stop_reason = "stop", ended[0]
        if isinstance(ended[0], (str, bytes)) and not r.sampling.include_stop_str_in_output:
            r.stop_cut = ended[1]

    def take_host_stops(self) -> list[int]:
        """The slots of requests a host-matched stop string ended, to abort on the device now (no dispatch in
        flight); their slots are free from here on."""
        slots = []
        for rid, slot in list(self.host_stopped.items()):
            self._leave(rid, slot)
            self.free_slots += 1
            slots.append(slot)
        for rid in list(self.forgetting):
            self.forgetting.discard(rid)
            self.forget(rid)
        return slots

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
                r.tokens, r.token_times, r.first_token_time = [token], [end], end
                if r.sampling.logprobs is not None:
                    top = r.sampling.logprobs
                    entry = {int(t): float(lp) for t, lp in zip(out.top_ids[slot, 0, :top],
                                                                out.top_logprobs[slot, 0, :top])}
                    entry[token] = float(out.sibling_logprob[slot, r.sample_index - 1])
                    r.logprobs = [entry]
                ended = r.sampling.max_tokens == 1 or r.plan.ends([token], r.sampling.min_tokens) is not None
                if r.detokenizer is not None:
                    ended |= self._extend_text(r, [token])[1]
                if ended:
                    self._finish(r, end)
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
        r.aborted, r.finish_reason = True, "abort"
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
        for x, seq in enumerate(r.plan.sequences()):
            rows.stops[row, x, : len(seq)], rows.stop_len[row, x] = seq[::-1], len(seq)
        rows.min_tokens[row] = sp.min_tokens
        early = r.plan.banned_early()
        rows.min_ban[row, : len(early)] = early
        if sp.allowed_token_ids is not None:
            rows.allowed[row, : len(sp.allowed_token_ids)] = sp.allowed_token_ids
        for x, (token, bias) in enumerate((sp.logit_bias or {}).items()):
            rows.bias_ids[row, x], rows.bias[row, x] = token, bias
        for x, word in enumerate(r.plan.bad_words):
            rows.bad[row, x, : len(word)], rows.bad_len[row, x] = word[::-1], len(word)
        seeds[row] = sp.seed if sp.seed is not None else unseeded(engine_seed, r.request_id - r.sample_index)
        index[row] = r.sample_index
        rows.siblings[row] = sp.n - 1 if r.sample_index == 0 else 0
    if logs:
        rows = rows.replace(stream=np.asarray(sampling_mod.stream_keys(seeds, index)), seed=seeds)
    return rows


def check_stop_strings(text: str, new_chars: int, stops: Sequence[str], include: bool) -> tuple[str, int] | None:
    """vLLM's stop-string check: the first of `stops` (in order) found in the last new_chars characters of text
    (or straddling them). Returns (the stop, where the text ends now: -1 for no cut), or None."""
    if not new_chars:
        return None
    for stop in stops:
        at = text.find(stop, max(0, len(text) + 1 - new_chars - len(stop)))
        if at == -1:
            continue
        if include:
            at += len(stop)
            if at >= len(text):
                return stop, -1
        return stop, at
    return None


def unseeded(engine_seed: int, request_id: int) -> int:
    """A seed for a request without one: the engine's seed and the request id, mixed (splitmix32)."""
    x = (engine_seed * 0x9E3779B9 + request_id + 1) & 0xFFFFFFFF
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x = ((x ^ (x >> shift)) * mult) & 0xFFFFFFFF
    return x ^ (x >> 16)
