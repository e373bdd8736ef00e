"""`skvs serve`'s pieces: `AsyncLLM` alone (a fake LLM: cancellation aborts, a failing step reaches every caller,
a refused request fails only its caller) and the OpenAI-compatible server through the official `openai` client
and raw HTTP (completions, chat, streaming, stop strings, n > 1 and batches, concurrent clients, a client that
disconnects, /v1/models, /health, /metrics, bad requests).

One uvicorn server over the shipped tiny model for the module (test_llm.py's geometry, so the programs are the
ones the LLM tests compile), and a second over the same model with a byte tokenizer that has a chat template
(the shipped one has none): the same programs, so it costs no compilation. The expected texts come from a third,
offline `LLM` of the same geometry.
"""

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import re
import socket
import sys
import threading
import time

import httpx2
import jax
import numpy as np
import openai
import pytest
import uvicorn

import skvs_jax
from skvs_jax.serve import outputs as out_mod
from skvs_jax.serve.async_llm import AsyncLLM, EngineDeadError
from skvs_jax.serve.openai_server import build_app
from skvs_jax.serve.sampling_params import RequestOutputKind
from skvs_jax.serve.tokenizer import ByteTokenizer, render_chat_template
from skvs_jax.testing import text_checkpoint

GEOMETRY = dict(max_model_len=128, max_num_seqs=8, block_size=8, num_blocks=48, token_budget=96, prefill_chunk=32)
MODEL = "tiny-llama"
PROMPTS = ["def parse(text):\n    ", "import numpy as np\n", "class Engine:\n    ", "for i in range(",
           "return x + ", "    if not "]
SP = skvs_jax.SamplingParams


class ChatBytes(ByteTokenizer):
    """Bytes, with text_checkpoint's Llama-3-like chat template (no BOS: the byte model has none)."""

    chat_template = text_checkpoint.CHAT_TEMPLATE

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return render_chat_template(self.chat_template, messages, add_generation_prompt, bos_token="")


@dataclasses.dataclass
class Served:
    url: str
    engine: AsyncLLM
    client: openai.OpenAI


@contextlib.contextmanager
def _serve(llm):
    engine = AsyncLLM(llm)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(engine, MODEL), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        yield Served(url, engine, client)
    finally:
        client.close()
        server.should_exit = True
        thread.join(30)
        engine.shutdown()


@pytest.fixture(scope="module")
def served():
    with _serve(skvs_jax.LLM(**GEOMETRY)) as s:
        yield s


@pytest.fixture(scope="module")
def chat_served(served):
    with _serve(skvs_jax.LLM(tokenizer=ChatBytes(), **GEOMETRY)) as s:
        yield s


@pytest.fixture(scope="module")
def offline():
    return skvs_jax.LLM(**GEOMETRY)


def _texts(llm, prompts, sp) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(prompts, sp)]


def _on_engine(s: Served, fn):
    """fn(llm) on the engine thread (the test's own loop)."""
    return asyncio.run(s.engine.call(fn))


def _nothing_held(llm) -> bool:
    e = llm.engine
    blocks = jax.device_get(e.state.sched.kv.alloc.blocks)  # free, pooled or cached (test_engine_constraints.py)
    return (not np.any(blocks.ref_count[1:] > 0) and int(blocks.free_top) + int(blocks.pool_top)
            + int(np.sum(blocks.cached[1:])) == e.cfg.sched.cache.usable_blocks)


# ---------------------------------------------------------------------------------------------- the server


def test_completion_stream_and_stop_match_the_offline_llm(served, offline):
    c, prompt = served.client, PROMPTS[1]  # its greedy output is text, not blanks
    want = _texts(offline, prompt, SP(max_tokens=24))[0]
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length" and r.choices[0].index == 0
    assert r.id.startswith("cmpl-") and r.model == MODEL and r.object == "text_completion" and r.created > 0
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(prompt.encode()), 24, len(prompt.encode()) + 24)
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert len({ch.id for ch in chunks}) == 1
    running = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                        extra_body={"stream_options": {"include_usage": True,
                                                                       "continuous_usage_stats": True}}))
    counts = [ch.usage.completion_tokens for ch in running]  # vLLM's continuous usage: every chunk, so far
    assert counts == sorted(counts) and counts[-1] == 24 and all(ch.usage.prompt_tokens == len(prompt.encode())
                                                                 for ch in running)
    ids = list(prompt.encode())  # a token prompt: the same output
    assert c.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0).choices[0].text == want
    stop = next(want[i:i + 2] for i in range(4, len(want) - 2) if not want[i:i + 2].isspace()
                and " " not in want[i:i + 2] and want.index(want[i:i + 2]) == i)  # a stop that first shows there
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == want[: want.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                    stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == want[: want.index(stop)]


def test_n_and_a_batch_of_prompts(served, offline):
    r = served.client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=8, temperature=0, n=2,
                                         logprobs=2)
    want = _texts(offline, PROMPTS[:2], SP(max_tokens=8))
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in r.choices] == [want[0], want[0], want[1], want[1]]  # greedy: n equal outputs
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == want[0] and all(len(t) <= 2 for t in lp.top_logprobs)
    assert r.usage.completion_tokens == 32
    assert r.usage.prompt_tokens == sum(len(p.encode()) for p in PROMPTS[:2])
    body = {"model": MODEL, "prompt": PROMPTS[:2], "max_tokens": 8, "temperature": 0, "n": 2, "stream": True}
    raw = httpx2.post(f"{served.url}/v1/completions", json=body, timeout=300)
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = raw.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    texts = {}
    for e in events[:-2]:
        (choice,) = json.loads(e[len("data: "):])["choices"]  # one choice per chunk, as OpenAI streams
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: want[0], 1: want[0], 2: want[1], 3: want[1]}


def test_concurrent_clients_get_the_offline_texts(served, offline):
    want = _texts(offline, PROMPTS, SP(max_tokens=16))

    def one(prompt):
        return served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(one, PROMPTS))
    assert [r.choices[0].text for r in got] == want


def test_a_client_that_disconnects_mid_stream_aborts_its_request(served):
    before = asyncio.run(served.engine.stats()).finished["abort"]
    longest = GEOMETRY["max_model_len"] - len(PROMPTS[1])  # ~20 tokens are out when the abort lands (measured)
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": longest, "temperature": 0, "stream": True}
    with httpx2.Client(timeout=300) as http, http.stream("POST", f"{served.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line)
        assert first.startswith("data: {")
    deadline = time.time() + 60
    while (stats := asyncio.run(served.engine.stats())).finished["abort"] == before:
        assert time.time() < deadline, "the request was not aborted"
        time.sleep(0.1)
    assert stats.running == stats.waiting == 0 and stats.kv_usage == 0
    assert _on_engine(served, _nothing_held)
    assert stats.finished["abort"] == before + 1
    assert _on_engine(served, lambda llm: len(llm.engine.requests)) == 0  # ended requests are forgotten


def test_models_health_and_metrics(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].owned_by == "skvs_jax"
    assert httpx2.get(f"{served.url}/health").status_code == 200

    def metrics() -> dict[str, float]:
        """Sample name (with its labels other than model_name) -> value."""
        r = httpx2.get(f"{served.url}/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        values = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                name, labels, value = re.fullmatch(r"(\w+)\{(.*)\} (\S+)", line).groups()
                labels = dict(re.findall(r'(\w+)="([^"]*)"', labels))
                assert labels.pop("model_name") == MODEL
                values[name + "".join(f"{{{k}={v}}}" for k, v in labels.items())] = float(value)
        return values

    m0, s0 = metrics(), asyncio.run(served.engine.stats())
    prompt = "def serve(app, host, port):\n    import uvicorn\n"  # 6 blocks: the repeat hits the prefix cache
    for _ in range(2):
        served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    m1, s1 = metrics(), asyncio.run(served.engine.stats())
    assert m1["skvs_num_requests_running"] == m1["skvs_num_requests_waiting"] == 0
    assert m1["skvs_kv_cache_usage_perc"] == 0
    assert m1["skvs_prompt_tokens_total"] - m0["skvs_prompt_tokens_total"] == 2 * len(prompt)
    assert m1["skvs_generation_tokens_total"] - m0["skvs_generation_tokens_total"] == 16
    done = "skvs_request_success_total{finished_reason=length}"
    assert m1[done] - m0[done] == 2
    assert s1.cached_prompt_tokens - s0.cached_prompt_tokens >= 5 * 8  # the repeat's hit
    assert m1["skvs_prefix_cache_hit_rate"] == s1.prefix_hit_rate > 0
    assert 0 < m1["skvs_spec_decode_acceptance_rate"] <= 1


BAD = [  # (what the body changes, the field the 400 must name)
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"n": 0}, "n"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"top_k": [1]}, "top_k"),
    ({"logit_bias": {"the": 5}}, "logit_bias"),
    ({"logit_bias": {"100000": 5}}, "logit_bias"),
    ({"prompt": None}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [300]}, "prompt"),
    ({"max_tokens": 200}, "prompt"),
    ({"stop": [str(i) for i in range(17)]}, "stop"),
    ({"echo": True}, "echo"),
    ({"best_of": 2}, "best_of"),
    ({"top_p": 0}, "top_p"),
    ({"min_tokens": 99}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"stream_options": {"include_usage": "maybe"}}, "stream_options"),
]


@pytest.mark.parametrize("change, param", BAD, ids=[f"{next(iter(c))}={next(iter(c.values()))!r}" for c, _ in BAD])
def test_a_bad_request_gets_400_naming_the_field(served, change, param):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4} | change
    if change.get("prompt", "") is None:
        del body["prompt"]
    r = httpx2.post(f"{served.url}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert param in err["message"] or param == "prompt"


def test_bad_requests_leave_the_server_serving(served):
    r = httpx2.post(f"{served.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["param"] is None
    r = httpx2.post(f"{served.url}/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError) as err:  # the shipped tokenizer has no chat template
        served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["param"] == "messages" and "chat template" in err.value.body["message"]
    r = served.client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert httpx2.get(f"{served.url}/health").status_code == 200 and served.engine.is_running


def test_chat_with_a_template(chat_served, offline):
    c = chat_served.client
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def f(x):"}]
    ids = list(ChatBytes().apply_chat_template(messages).encode())
    want = _texts(offline, [ids], SP(max_tokens=12))[0]
    r = c.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0,
                                  logprobs=True, top_logprobs=2)
    ch = r.choices[0]
    assert ch.message.content == want and ch.message.role == "assistant" and ch.finish_reason == "length"
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    assert len(ch.logprobs.content) == 12 and all(len(t.top_logprobs) == 2 for t in ch.logprobs.content)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].object == "chat.completion.chunk"
    with pytest.raises(openai.BadRequestError) as err:  # the template refuses the role
        c.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
    assert err.value.body["param"] == "messages"


# ------------------------------------------------------------------------------------------------ skvs serve


def test_skvs_serve_builds_the_app_and_runs_uvicorn(monkeypatch, capsys, offline):
    from skvs_jax import commands
    from skvs_jax.serve import llm as llm_mod

    ran = {}

    def fake_run(app, host, port, log_level):  # what uvicorn would serve
        ran.update(host=host, port=port, paths={r.path for r in app.routes})

    def fake_llm(*args, **kwargs):  # the module's offline LLM: nothing to compile
        ran["llm"] = (args, kwargs)
        return offline

    monkeypatch.setattr(uvicorn, "run", fake_run)
    monkeypatch.setattr(llm_mod, "LLM", fake_llm)
    argv = ["serve", "--port", "8123", "--no-warmup", "--served-model-name", "m", "--max-num-seqs", "2"]
    assert commands.main(argv) == 0
    assert (ran["host"], ran["port"]) == ("127.0.0.1", 8123) and ran["llm"][1]["max_num_seqs"] == 2
    assert ran["llm"][1]["policy"] == "skvs"
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= ran["paths"]
    assert commands.main(["serve", "--port", "-1"]) == 2 and "--port" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # the extra is not installed
    assert commands.main(["serve"]) == 2
    assert capsys.readouterr().err.strip() == "skvs serve: uvicorn is not installed: pip install 'skvs-jax[serve]'"


# -------------------------------------------------------------------------------------------- AsyncLLM alone


class FakeLLM:
    """The engine-shaped API AsyncLLM drives: each step gives every request one more token ("a"), forever, until
    it is aborted (its final output then says "abort"); a step raises when `fail` is set."""

    tokenizer = ByteTokenizer()

    def __init__(self):
        self.live: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.fail = False

    def add_request(self, prompt, sampling_params, request_id, *, cache_salt=None):
        if not prompt:
            raise ValueError("prompt must not be empty")
        self.live[request_id] = []

    def has_unfinished_requests(self):
        return bool(self.live)

    def abort_request(self, request_id):
        if request_id not in self.live:
            return False
        self.aborted.append(request_id)
        return True

    def step(self):
        time.sleep(0.005)
        if self.fail:
            raise RuntimeError("the device fell over")
        outs = []
        for rid, tokens in list(self.live.items()):
            done = rid in self.aborted
            if done:
                del self.live[rid]
            else:
                tokens.append(97)
            c = out_mod.CompletionOutput(0, "a" * len(tokens), list(tokens), finish_reason="abort" if done else None)
            outs.append(out_mod.RequestOutput(rid, None, [1], None, [c], done, out_mod.RequestMetrics(0.0)))
        return outs


SP_DELTA = SP(max_tokens=8, output_kind=RequestOutputKind.DELTA)


def test_cancelling_the_consumer_aborts_the_request():
    llm = FakeLLM()

    async def main(engine):
        got = []

        async def consume():
            async for out in engine.generate("p", SP_DELTA, "r1"):
                got.append(out)

        task = asyncio.create_task(consume())
        while len(got) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async for _ in engine.generate("q", SP_DELTA, "r2"):  # `break`: the dropped generator closes, aborting
            break
        for _ in range(200):
            if not llm.live:
                break
            await asyncio.sleep(0.01)
        assert llm.aborted == ["r1", "r2"] and not llm.live
        assert await engine.abort("r1") is False  # ended already
        with pytest.raises(ValueError, match="prompt"):  # refused: only this caller hears of it
            await engine.add_request("", SP_DELTA, "r3")
        assert engine.is_running

    engine = AsyncLLM(llm)
    try:
        asyncio.run(main(engine))
    finally:
        engine.shutdown()
    assert not engine.is_running


def test_a_failing_step_reaches_every_caller():
    llm = FakeLLM()

    async def main(engine):
        streams = [await engine.add_request("p", SP_DELTA, f"r{i}") for i in range(3)]
        await streams[0].__anext__()
        llm.fail = True

        async def drain(stream):
            async for _ in stream:
                pass

        results = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams), return_exceptions=True), 30)
        assert all(isinstance(r, EngineDeadError) for r in results)
        assert isinstance(results[0].__cause__, RuntimeError) and "fell over" in str(results[0])
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.add_request("p", SP_DELTA, "late")
        with pytest.raises(EngineDeadError):
            await engine.stats()

    engine = AsyncLLM(llm)
    asyncio.run(main(engine))
    engine.shutdown()
