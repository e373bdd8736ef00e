"""`LLM`: vLLM's offline front on this engine: a checkpoint folder in, text and `RequestOutput`s out.

    from skvs_jax import LLM, SamplingParams
    llm = LLM()                                   # the shipped tiny Llama and its Medusa heads, bytes as tokens
    out = llm.generate("The", SamplingParams(max_tokens=16))
    print(out[0].outputs[0].text)

`LLM(model_dir, medusa=..., policy=..., **engine_options)` loads a Hugging Face Llama folder (its tokenizer.json,
EOS ids and chat template: `serve.tokenizer`), optional Medusa heads, and builds an `Engine` with the given
`EngineOptions` fields. `generate` takes a prompt or a list of prompts (text, token ids, or vLLM's
{"prompt": ...} / {"prompt_token_ids": ...} dicts) and one SamplingParams or one per prompt; `chat` renders
messages through the checkpoint's template; `stream` yields `RequestOutput`s as the engine produces tokens,
shaped by each request's `output_kind`; `add_request` / `step` / `abort_request` are the engine-shaped API with
string request ids.

Two fields are served here rather than in the step: prompt_logprobs and logprobs=-1 (the whole vocabulary). They
come from a scoring pass, one dense forward of the prompt (at admission) or of prompt + output (at the end),
because shipping [slots, V] floats per token out of every step would cost every request for the few that ask.

The persistent compile cache is on by default (`compile_cache.use_default`: a directory the user set in jax's
config, SKVS_COMPILE_CACHE or JAX_COMPILATION_CACHE_DIR is kept); `LLM(compile_cache=False)` turns it off.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time
from collections.abc import Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reference_models import checkpoint
from skvs_jax import checks, compile_cache, policies
from skvs_jax.config import CacheConfig
from skvs_jax.serve import outputs as out_mod
from skvs_jax.serve.engine import Engine
from skvs_jax.serve.options import EngineOptions
from skvs_jax.serve.requests import RequestLog
from skvs_jax.serve.sampling_params import RequestOutputKind, SamplingParams
from skvs_jax.serve.tokenizer import ByteTokenizer, load_tokenizer

DEFAULT_MAX_MODEL_LEN = 2048  # the longest sequence by default, when the model's own limit is longer


@dataclasses.dataclass
class _Request:
    """What the front keeps of a request: its engine id, its prompt and how much of each output it has sent."""

    request_id: str
    engine_id: int
    prompt: str | None
    prompt_ids: list[int]
    sampling: SamplingParams
    prompt_logprobs: list | None = None
    sent_tokens: list[int] = dataclasses.field(default_factory=list)  # per output: tokens sent (DELTA)
    sent_text: list[int] = dataclasses.field(default_factory=list)  # per output: characters sent (DELTA)
    done: bool = False


class LLM:
    """A model served by an `Engine`, with text in and out (module docstring).

    model: a Hugging Face Llama folder (config.json + safetensors; tokenizer.json beside it is used), or None for
    the shipped tiny Llama (with its heads unless medusa is given). medusa: Medusa heads (a folder or a
    safetensors file); alone, the base model its config names. policy: a preset name (`policies.PRESETS`) or a
    `Policy`; a speculating one needs heads. dtype: the weights' ("auto": the checkpoint's). tokenizer: a folder
    holding tokenizer.json, or a `serve.tokenizer` object (default: the model folder's, else bytes).
    max_model_len: longest prompt + output (default: the model's limit, at most 2048); max_num_seqs: sequence
    slots; block_size and num_blocks: the paged cache (default: room for every slot's longest sequence).
    compile_cache: True (the default rules), False (off), or a directory. options and **engine_options:
    `EngineOptions` (docs/serving.md)."""

    def __init__(self, model: str | pathlib.Path | None = None, *, medusa: str | pathlib.Path | None = None,
                 policy: str | policies.Policy = "skvs", dtype: str = "auto", tokenizer=None,
                 max_model_len: int | None = None, max_num_seqs: int = 8, block_size: int = 16,
                 num_blocks: int | None = None, draft_len: int | None = None,
                 compile_cache: bool | str = True, options: EngineOptions | None = None, **engine_options):
        self.compile_cache_dir = _compile_cache(compile_cache)
        self.model, heads, model_dir = _load(model, medusa, dtype)
        self.tokenizer = _tokenizer(tokenizer, model_dir, self.model.config.vocab_size)
        if isinstance(policy, str):
            k = draft_len if draft_len is not None else (heads.config.num_heads if heads is not None else 4)
            policy = policies.preset(policy, k)
        if not isinstance(policy, policies.Policy):
            raise TypeError(f"policy must be a preset name or a Policy, got {type(policy).__name__}")
        if policy.speculation and heads is None:
            raise ValueError(f"policy {policy.name!r} speculates, which needs Medusa heads: pass medusa=... or "
                             "policy='vllm_default'")
        cache = self._cache(max_model_len, max_num_seqs, block_size, num_blocks)
        opts = EngineOptions.of(options, {"tokenizer": self.tokenizer, "detokenize": True,
                                          "token_budget": 256, "prefill_chunk": 64} | engine_options)
        self.engine = Engine(self.model, heads, policy, cache, opts)
        self._requests: dict[str, _Request] = {}
        self._by_engine_id: dict[int, str] = {}
        self._next_id = 0
        self._aborted: list[str] = []  # aborted since the last `step`
        self._collect: set[str] = set()  # ids `generate` waits for: their final output is kept in `_finals`
        self._finals: dict[str, out_mod.RequestOutput] = {}
        self._scorer = None

    def _cache(self, max_model_len, max_num_seqs, block_size, num_blocks) -> CacheConfig:
        limit = self.model.config.max_position_embeddings
        max_len = min(limit, DEFAULT_MAX_MODEL_LEN) if max_model_len is None else max_model_len
        if not checks.is_int(max_len) or not 1 <= max_len <= limit:
            raise ValueError(f"max_model_len must be an int in [1, {limit}] (the model's max_position_embeddings), "
                             f"got {max_model_len!r}")
        checks.at_least("max_num_seqs", max_num_seqs, 1)
        checks.at_least("block_size", block_size, 1)
        per_seq = -(-max_len // block_size)
        blocks = max_num_seqs * per_seq + 1 if num_blocks is None else num_blocks
        return CacheConfig(num_blocks=blocks, block_size=block_size, max_seqs=max_num_seqs,
                           max_blocks_per_seq=per_seq)

    # ---------------------------------------------------------------------------------------------- requests

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                    *, cache_salt: str | None = None) -> str:
        """Queue one prompt (text, token ids, or a {"prompt"} / {"prompt_token_ids"} dict); returns its id.
        cache_salt: the tenant's prefix-cache salt (`Engine.add_request`; None: unsalted)."""
        sp = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._prompt(prompt)
        engine_sp = dataclasses.replace(sp, logprobs=None if sp.logprobs == -1 else sp.logprobs, prompt_logprobs=None)
        eid = self.engine.add_request(ids, engine_sp, cache_salt=cache_salt)
        req = _Request(request_id, eid, text, ids, sp, sent_tokens=[0] * sp.n, sent_text=[0] * sp.n)
        if sp.prompt_logprobs is not None:
            req.prompt_logprobs = self._prompt_logprobs(ids, sp.prompt_logprobs)
        self._requests[request_id], self._by_engine_id[eid] = req, request_id
        return request_id

    def _prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return None, list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict holds 'prompt' (text) or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            return None, list(prompt)  # token ids: the engine checks them
        raise TypeError(f"prompt must be a str, a sequence of token ids or a prompt dict, got {type(prompt).__name__}")

    def abort_request(self, request_id: str) -> bool:
        """End a request (all of its outputs); False when it is unknown or already finished."""
        req = self._requests.get(request_id)
        if req is None or not self.engine.abort_request(req.engine_id):
            return False
        self._aborted.append(request_id)  # the next `step` sends its final output
        return True

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_work() or bool(self._aborted)

    def step(self) -> list[out_mod.RequestOutput]:
        """One engine dispatch; the outputs of every request it advanced, each as its output_kind asks."""
        touched, self._aborted = self._aborted, []
        for eid, _, _ in self.engine.advance() if self.engine.has_work() else []:
            rid = self._by_engine_id.get(self._parent(eid))
            if rid is not None and rid not in touched:
                touched.append(rid)
        outs = []
        for rid in touched:
            req = self._requests[rid]
            o = self._output(req, delta=True)
            if o is not None:
                outs.append(o)
            if req.done:  # its last output is out: forget it, so a long-running front does not grow
                if rid in self._collect:
                    self._finals[rid] = self._output(req, final=True)
                del self._requests[rid], self._by_engine_id[req.engine_id]
                self.engine.table.forget(req.engine_id)
        return outs

    def _parent(self, eid: int) -> int:
        r = self.engine.requests[eid]
        return eid - r.sample_index

    # ---------------------------------------------------------------------------------------------- front

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[out_mod.RequestOutput]:
        """Serve the prompts to the end; one finished `RequestOutput` per prompt, in order (vLLM's
        `LLM.generate`). prompts: one prompt or a list (a flat list of ints is one token prompt)."""
        ids = self._add_all(prompts, sampling_params)
        self._collect.update(ids)
        try:
            for _ in self._drive():
                pass
        finally:
            self._collect.difference_update(ids)
        return [self._finals.pop(i) for i in ids]

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True) -> list[out_mod.RequestOutput]:
        """`generate` on conversations ([{"role", "content"}, ...], or a list of them) rendered by the
        tokenizer's chat template (which holds BOS: encoded without special tokens)."""
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [{"prompt_token_ids": self.tokenizer.encode(
            self.tokenizer.apply_chat_template(list(c), add_generation_prompt), add_special_tokens=False)}
            for c in convs]
        return self.generate(prompts, sampling_params)

    def stream(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[out_mod.RequestOutput]:
        """Serve the prompts, yielding `RequestOutput`s as tokens arrive, each shaped by its request's output_kind
        (CUMULATIVE: everything so far; DELTA: the new tokens and text; FINAL_ONLY: once, at the end). Text is
        held back by the longest stop string's length less one while the output runs, so no stop string is
        streamed before it is cut."""
        self._add_all(prompts, sampling_params)
        yield from self._drive()

    def _add_all(self, prompts, sampling_params) -> list[str]:
        single = isinstance(prompts, (str, Mapping)) or (isinstance(prompts, Sequence) and prompts
                                                        and checks.is_int(prompts[0]))
        prompts = [prompts] if single else list(prompts)
        if not prompts:
            raise ValueError("prompts must not be empty")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif not isinstance(sampling_params, Sequence) or isinstance(sampling_params, str):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}")
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params holds {len(params)} entries for {len(prompts)} prompts")
        return [self.add_request(p, sp) for p, sp in zip(prompts, params)]

    def _drive(self) -> Iterator[out_mod.RequestOutput]:
        while self.engine.has_work():
            yield from self.step()

    # --------------------------------------------------------------------------------------------- outputs

    def _output(self, req: _Request, *, delta: bool = False, final: bool = False) -> out_mod.RequestOutput | None:
        """The request as a RequestOutput: final (everything), or what its output_kind streams now (None:
        nothing to send)."""
        logs = [self.engine.requests[req.engine_id + j] for j in range(req.sampling.n)]
        finished = all(r.finished or r.aborted for r in logs)
        kind = req.sampling.output_kind
        if not final:
            if req.done or (kind is RequestOutputKind.FINAL_ONLY and not finished):
                return None
        req.done = finished
        completions = []
        for j, r in enumerate(logs):
            c = self._completion(req, j, r)
            if not final and kind is RequestOutputKind.DELTA:
                if not self._delta(req, j, c, r.finished or r.aborted):
                    continue
            completions.append(c)
        if not completions and not final:
            return None
        return out_mod.RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_ids,
                                     prompt_logprobs=req.prompt_logprobs, outputs=completions, finished=finished,
                                     metrics=self._metrics(logs))

    def _completion(self, req: _Request, index: int, r: RequestLog) -> out_mod.CompletionOutput:
        tokens = r.output_tokens
        text = r.text or ""
        ended = r.finished or r.aborted
        if not ended:
            text = text[: max(0, len(text) - _hold_back(req.sampling))]
        logprobs, cumulative = None, None
        if req.sampling.logprobs is not None:
            if req.sampling.logprobs == -1:
                logprobs = self._output_logprobs(req.prompt_ids, tokens) if ended else []
            else:
                logprobs = [self._entry(e, t, req.sampling.logprobs) for e, t in zip(r.logprobs or [], tokens)]
            cumulative = float(sum(e[t].logprob for e, t in zip(logprobs, tokens)))
        return out_mod.CompletionOutput(index=index, text=text, token_ids=list(tokens), cumulative_logprob=cumulative,
                                        logprobs=logprobs, finish_reason=r.finish_reason, stop_reason=r.stop_reason)

    @staticmethod
    def _delta(req: _Request, j: int, c: out_mod.CompletionOutput, ended: bool) -> bool:
        """Cut `c` to what output j has not sent yet; False when that is nothing and it has not just ended."""
        t0, x0 = req.sent_tokens[j], req.sent_text[j]
        if len(c.token_ids) == t0 and len(c.text) == x0 and not ended:
            return False
        if t0 == -1:
            return False  # its end was sent
        req.sent_tokens[j], req.sent_text[j] = (-1, -1) if ended else (len(c.token_ids), len(c.text))
        c.token_ids, c.text = c.token_ids[t0:], c.text[x0:]
        if c.logprobs is not None:
            c.logprobs = c.logprobs[t0:]
        return True

    def _metrics(self, logs: list[RequestLog]) -> out_mod.RequestMetrics:
        epoch = time.time() - self.engine.now()  # the engine's clock is seconds since it started

        def wall(t: float) -> float | None:
            return None if t != t else epoch + t  # NaN: not yet

        first = [r.first_token_time for r in logs if r.first_token_time == r.first_token_time]
        ends = [r.finish_time for r in logs]
        return out_mod.RequestMetrics(
            arrival_time=epoch + logs[0].arrival_time, first_token_time=wall(min(first)) if first else None,
            finished_time=wall(max(ends)) if all(e == e for e in ends) else None,
            num_cached_tokens=logs[0].first_cached_tokens, drafted=sum(r.drafted for r in logs),
            accepted=sum(r.accepted for r in logs), preemptions=sum(r.preemptions for r in logs))

    # -------------------------------------------------------------------------------------------- logprobs

    def _decoded(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _entry(self, entry: dict[int, float], token: int, top: int) -> out_mod.PositionLogprobs:
        """The engine's per-token record (the token and its top N) as Logprobs with ranks."""
        order = sorted(entry.items(), key=lambda kv: -kv[1])[:top]  # the top N first; the token may be outside
        rank = {t: i + 1 for i, (t, _) in enumerate(order)}
        return {t: out_mod.Logprob(lp, rank.get(t), self._decoded(t)) for t, lp in entry.items()}

    def _score(self, ids: list[int]) -> np.ndarray:
        """float32[len(ids), V]: log p of the token after each position (the model's raw logits), one dense
        forward padded to a power of two (few compiled shapes)."""
        if self._scorer is None:
            graphdef, state = nnx.split(self.model)
            self._scorer = (graphdef, state)
        graphdef, state = self._scorer
        n = len(ids)
        padded = np.zeros((1, max(16, 1 << (n - 1).bit_length())), np.int32)
        padded[0, :n] = ids
        return np.asarray(_log_softmax_dense(graphdef, state, jnp.asarray(padded)))[0, :n]

    def _positions(self, logp: np.ndarray, tokens: list[int], top: int) -> list[out_mod.PositionLogprobs]:
        """Per token: its logprob (and rank), plus the top N (-1: the whole vocabulary). logp[i] scores tokens[i]."""
        result = []
        for row, token in zip(logp, tokens):
            order = np.argsort(-row, kind="stable")
            keep = order if top == -1 else order[:top]
            rank = int(np.sum(row > row[token])) + 1
            entry = {int(t): out_mod.Logprob(float(row[t]), i + 1, self._decoded(int(t))) for i, t in enumerate(keep)}
            entry[int(token)] = out_mod.Logprob(float(row[token]), rank, self._decoded(int(token)))
            result.append(entry)
        return result

    def _prompt_logprobs(self, ids: list[int], top: int) -> list:
        logp = self._score(ids)
        return [None] + self._positions(logp[:-1], ids[1:], top)

    def _output_logprobs(self, prompt: list[int], tokens: list[int]) -> list:
        if not tokens:
            return []
        logp = self._score(prompt + tokens)
        return self._positions(logp[len(prompt) - 1: len(prompt) - 1 + len(tokens)], tokens, -1)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _log_softmax_dense(graphdef, state, tokens: jax.Array) -> jax.Array:
    logits, _ = nnx.merge(graphdef, state).forward_dense(tokens)
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def _hold_back(sp: SamplingParams) -> int:
    """Characters a running output's text keeps back (vLLM's stop buffer): a stop string may be forming there."""
    if not sp.stop or sp.include_stop_str_in_output:
        return 0
    return max(len(s) for s in sp.stop) - 1


def _compile_cache(setting: bool | str) -> str | None:
    if setting is True:
        return compile_cache.use_default()
    if setting is False:
        return compile_cache.configure(compile_cache.OFF, {})
    if isinstance(setting, (str, pathlib.Path)) and str(setting).strip():
        return compile_cache.configure(str(setting), {})
    raise TypeError(f"compile_cache must be True, False or a directory, got {setting!r}")


def _load(model, medusa, dtype: str):
    """(model, heads or None, the model's folder or None) as `LLM` documents."""
    if model is None and medusa is None:
        base, heads = checkpoint.load_shipped()
        if dtype not in ("auto", "float32"):
            base = checkpoint.load_llama(checkpoint.WEIGHTS_DIR / "tiny_llama", dtype=dtype)
            heads = checkpoint.load_medusa(checkpoint.WEIGHTS_DIR / "tiny_llama_medusa", dtype=dtype)
        return base, heads, None
    heads = None
    if medusa is not None:
        heads = checkpoint.load_medusa(medusa, dtype=dtype)
        if model is None:
            model = checkpoint.medusa_base_model(medusa)
            if model is None:
                raise ValueError(f"medusa={medusa}: its config.json names no base model (base_model_name_or_path);"
                                 " pass model=DIR")
    folder = pathlib.Path(model)
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise ValueError(f"model={model}: not a checkpoint folder (no config.json)")
    base = checkpoint.load_llama(folder, dtype=dtype)
    if heads is not None and heads.config.vocab_size != base.config.vocab_size:
        raise ValueError(f"medusa={medusa}: heads for a {heads.config.vocab_size}-token vocabulary, but the model "
                         f"has {base.config.vocab_size}")
    return base, heads, folder


def _tokenizer(tokenizer, model_dir: pathlib.Path | None, vocab: int):
    if tokenizer is None:
        tok = load_tokenizer(model_dir) if model_dir is not None else None
        if tok is None:
            if vocab < ByteTokenizer.vocab_size:
                raise ValueError(f"the model has no tokenizer.json and a {vocab}-token vocabulary, too small for "
                                 "bytes: pass tokenizer=DIR")
            tok = ByteTokenizer()
    elif isinstance(tokenizer, (str, pathlib.Path)):
        tok = load_tokenizer(tokenizer)
        if tok is None:
            raise ValueError(f"tokenizer={tokenizer}: no tokenizer.json there")
    else:
        tok = tokenizer
    if tok.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary only {vocab}")
    return tok
