"""`skvs_jax.LLM`, the vLLM-shaped front: the engine's tokens through it, text in and out on a checkpoint with a
real BPE tokenizer (`skvs_jax.testing.text_checkpoint`), logprobs against the model's dense forward, streaming
by output_kind, the compile cache, and bad input.

The LLMs use tests/test_engine.py's cache geometry (48 blocks of 8, 8 slots, budget 96, chunk 32), so the shipped
model's programs are the ones the other engine tests compile.
"""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

import skvs_jax
from skvs_jax import compile_cache, policies
from skvs_jax.config import CacheConfig
from skvs_jax.serve import engine
from skvs_jax.serve.sampling_params import RequestOutputKind
from skvs_jax.serve.tokenizer import load_tokenizer
from skvs_jax.testing import text_checkpoint

GEOMETRY = dict(max_model_len=128, max_num_seqs=8, block_size=8, num_blocks=48, token_budget=96, prefill_chunk=32)
PROMPTS = ["def parse(text):\n    ", "import numpy as np\n", "class Engine:\n    "]
SP = skvs_jax.SamplingParams


@pytest.fixture(scope="module")
def llm():
    return skvs_jax.LLM(**GEOMETRY)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return text_checkpoint.make_checkpoint(tmp_path_factory.mktemp("bpe") / "model")


@pytest.fixture(scope="module")
def bpe(bpe_dir):
    return skvs_jax.LLM(bpe_dir, medusa=bpe_dir / "medusa", **GEOMETRY)


def test_greedy_outputs_equal_the_engines_with_and_without_speculation(shipped, llm):
    sp = SP(max_tokens=24)
    outs = llm.generate(PROMPTS, sp)
    cache = CacheConfig(num_blocks=48, block_size=8, max_seqs=8, max_blocks_per_seq=16)
    for policy in (policies.skvs(4), policies.vllm_default()):
        e = engine.Engine(*shipped, policy, cache, token_budget=96, prefill_chunk=32)
        want = e.generate([list(p.encode()) for p in PROMPTS], sp)
        assert [o.outputs[0].token_ids for o in outs] == want
    for o, p in zip(outs, PROMPTS):
        c = o.outputs[0]
        assert o.prompt == p and o.prompt_token_ids == list(p.encode()) and o.finished
        assert c.text == bytes(c.token_ids).decode(errors="replace") and c.finish_reason == "length"
        assert c.cumulative_logprob is None and c.logprobs is None and c.index == 0
        m = o.metrics
        assert m.arrival_time <= m.first_token_time <= m.finished_time and m.drafted >= m.accepted >= 0
    assert [o.request_id for o in outs] == [str(i) for i in range(3)]
    assert sum(o.metrics.accepted for o in outs) > 0  # it speculated


def test_prompt_forms_and_a_list_of_sampling_params(llm):
    ids = list(PROMPTS[0].encode())
    outs = llm.generate([PROMPTS[0], ids, {"prompt_token_ids": ids}, {"prompt": PROMPTS[0]}],
                        [SP(max_tokens=8), SP(max_tokens=8), SP(max_tokens=8), SP(max_tokens=3)])
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[3].outputs[0].token_ids == outs[0].outputs[0].token_ids[:3]
    assert outs[1].prompt is None and outs[3].prompt == PROMPTS[0]
    one = llm.generate(ids, SP(max_tokens=8))  # a flat list of ints is one token prompt
    assert len(one) == 1 and one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    n = llm.generate(PROMPTS[1], SP(max_tokens=6, n=3, temperature=1.0, seed=5))[0]
    assert [c.index for c in n.outputs] == [0, 1, 2] and len({tuple(c.token_ids) for c in n.outputs}) > 1


def _dense_logp(model, ids):
    logits = np.asarray(model.forward_dense(jax.numpy.asarray([ids]))[0][0], np.float64)
    return logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
        - logits.max(-1, keepdims=True)


def test_logprobs_top_n_all_and_prompt_against_the_dense_forward(llm):
    prompt = PROMPTS[2]
    top = llm.generate(prompt, SP(max_tokens=10, logprobs=3, prompt_logprobs=2))[0]
    every = llm.generate(prompt, SP(max_tokens=10, logprobs=-1, prompt_logprobs=-1))[0]
    c, a = top.outputs[0], every.outputs[0]
    assert c.token_ids == a.token_ids and len(c.logprobs) == len(a.logprobs) == 10
    ids = top.prompt_token_ids + c.token_ids
    logp = _dense_logp(llm.model, ids)
    n = len(top.prompt_token_ids)
    for i, token in enumerate(c.token_ids):
        row = logp[n + i - 1]
        assert len(a.logprobs[i]) == 256 and token in c.logprobs[i]
        best = np.argsort(-row, kind="stable")[:3]
        assert set(c.logprobs[i]) == set(best.tolist()) | {token}
        for t, lp in c.logprobs[i].items():
            assert lp.logprob == pytest.approx(row[t], abs=2e-4) == a.logprobs[i][t].logprob
        assert a.logprobs[i][token].rank == 1 + int(np.sum(row > row[token]))
        assert [c.logprobs[i][t].rank for t in best] == [1, 2, 3]
    assert c.cumulative_logprob == pytest.approx(sum(logp[n + i - 1, t] for i, t in enumerate(c.token_ids)),
                                                 abs=1e-3)
    assert a.cumulative_logprob == pytest.approx(c.cumulative_logprob, abs=1e-3)
    assert top.prompt_logprobs[0] is None and len(top.prompt_logprobs) == n
    for i in range(1, n):
        entry = top.prompt_logprobs[i]
        assert top.prompt_token_ids[i] in entry and len(entry) <= 3 and len(every.prompt_logprobs[i]) == 256
        assert entry[top.prompt_token_ids[i]].logprob == pytest.approx(logp[i - 1, top.prompt_token_ids[i]],
                                                                       abs=1e-4)


def test_streams_by_output_kind(llm):
    """DELTA pieces concatenate to the final output; CUMULATIVE's last is the final output; FINAL_ONLY comes
    once; no streamed text ever shows a stop string (held back until cut)."""
    final = {o.prompt: o for o in llm.generate(PROMPTS, SP(max_tokens=20, stop=["se"]))}
    kinds = [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]
    seen = {p: [] for p in PROMPTS}
    for o in llm.stream(PROMPTS, [SP(max_tokens=20, stop=["se"], output_kind=k) for k in kinds]):
        seen[o.prompt].append(o)
        assert all("se" not in c.text for c in o.outputs)
    delta, cumulative, final_only = (seen[p] for p in PROMPTS)
    assert "".join(o.outputs[0].text for o in delta if o.outputs) == final[PROMPTS[0]].outputs[0].text
    assert sum((o.outputs[0].token_ids for o in delta if o.outputs), []) == final[PROMPTS[0]].outputs[0].token_ids
    assert len(delta) > 1 and delta[-1].finished and not delta[0].finished
    assert cumulative[-1].outputs[0].text == final[PROMPTS[1]].outputs[0].text and len(cumulative) > 1
    assert len(final_only) == 1 and final_only[0].outputs[0].token_ids == final[PROMPTS[2]].outputs[0].token_ids


@pytest.mark.slow  # compiles the BPE checkpoint's model: the default run's time budget
def test_text_round_trip_chat_and_stops_on_a_bpe_checkpoint(bpe, bpe_dir):
    tok = load_tokenizer(bpe_dir)
    assert bpe.tokenizer.vocab_size == tok.vocab_size and bpe.engine.runner.num_draft_heads == 2
    out = bpe.generate("Return the list of", SP(max_tokens=24, ignore_eos=True))[0]
    c = out.outputs[0]
    assert out.prompt_token_ids == tok.encode("Return the list of") and out.prompt_token_ids[0] == tok.bos_token_id
    assert c.text == tok.decode(c.token_ids) and len(c.token_ids) == 24
    # a stop string cut from the output's own text: the output ends where vLLM's text rule ends it
    text = c.text
    stop = next(text[i: i + 3] for i in range(4, len(text) - 3) if text[i: i + 3].strip() and text[i] != "\ufffd")
    cut = bpe.generate("Return the list of", SP(max_tokens=24, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop and cut.text == text[: text.index(stop)]
    assert c.token_ids[: len(cut.token_ids)] == cut.token_ids
    # chat: the template rendered, encoded without adding BOS again
    msgs = [{"role": "user", "content": "hello"}]
    chat = bpe.chat(msgs, SP(max_tokens=4))[0]
    rendered = tok.apply_chat_template(msgs)
    assert chat.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert rendered.startswith("<|begin_of_text|>") and chat.prompt_token_ids.count(tok.bos_token_id) == 1


@pytest.mark.slow  # compiles the BPE checkpoint's model: the default run's time budget
def test_eos_from_generation_config_ends_a_request(bpe, bpe_dir, tmp_path):
    """A checkpoint whose generation_config names as EOS a token the model emits early (and not before): the request
    ends there with finish_reason "stop" (stop_reason None), not under ignore_eos, and not before min_tokens."""
    free = bpe.generate("The value", SP(max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    at = next(i for i in range(1, len(free)) if free[i] not in free[:i])  # its first new token after the first
    eos = free[at]
    copy = tmp_path / "eos"
    shutil.copytree(bpe_dir, copy, ignore=shutil.ignore_patterns("medusa"))
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"eos_token_id": eos}))
    llm = skvs_jax.LLM(copy, medusa=bpe_dir / "medusa", **GEOMETRY)
    assert eos in llm.tokenizer.eos_token_ids
    stopped, ignored, late = (o.outputs[0] for o in llm.generate(
        ["The value"] * 3, [SP(max_tokens=12), SP(max_tokens=12, ignore_eos=True), SP(max_tokens=12, min_tokens=4)]))
    assert stopped.token_ids == free[: at + 1] and stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert ignored.token_ids == free and ignored.finish_reason == "length"
    assert eos not in late.token_ids[:4] and len(late.token_ids) > 4


def test_request_ids_step_and_abort(llm):
    rid = llm.add_request(PROMPTS[0], SP(max_tokens=30), request_id="alpha")
    with pytest.raises(ValueError, match="request_id"):
        llm.add_request(PROMPTS[0], request_id="alpha")
    outs = llm.step()
    while not outs:
        outs = llm.step()
    assert outs[0].request_id == "alpha" and not outs[0].finished
    assert llm.abort_request(rid) and not llm.abort_request("unknown") and not llm.abort_request(rid)
    last = []
    while llm.has_unfinished_requests():
        last += llm.step()
    assert [o.request_id for o in last] == ["alpha"] and last[0].finished
    assert last[0].outputs[0].finish_reason == "abort"


def test_the_compile_cache_keeps_a_directory_the_user_set(tmp_path, monkeypatch):
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
        assert compile_cache.use_default({}) == str(tmp_path / "mine")
        jax.config.update("jax_compilation_cache_dir", None)
        assert compile_cache.use_default({"SKVS_COMPILE_CACHE": str(tmp_path / "env")}) == str(tmp_path / "env")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        compile_cache.configure(before, {}) if before else None


def test_bad_input_is_refused_naming_the_argument(llm, bpe_dir, tmp_path):
    with pytest.raises(ValueError, match="model="):
        skvs_jax.LLM(tmp_path / "nothing")
    with pytest.raises(ValueError, match="speculates"):
        skvs_jax.LLM(bpe_dir, policy="skvs")
    with pytest.raises(TypeError, match="policy"):
        skvs_jax.LLM(policy=3)
    with pytest.raises(ValueError, match="max_model_len"):
        skvs_jax.LLM(max_model_len=5000)
    with pytest.raises(TypeError, match="compile_cache"):
        skvs_jax.LLM(compile_cache=3)
    with pytest.raises(TypeError, match="unknown engine option"):
        skvs_jax.LLM(tokens_budget=3)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(PROMPTS, [SP()])
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([])
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([b"bytes"])
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "x"}])
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate(PROMPTS[0], dataclasses.asdict(SP()))
