"""The constraints (allowed_token_ids, bad_words, min_tokens, logit_bias), EOS and ignore_eos, finish reasons and
stop strings matched on the host, in the real engine on the shipped tiny model, under speculation.

The expectation is vLLM's semantics written in numpy over the model's own dense forward (teacher forcing): every
greedy token is the argmax of the constrained logits at its position, and the output ends where vLLM's rules end
it. Lossless: the speculating engine emits what the engine without speculation emits, greedy and sampled.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skvs_jax import policies
from skvs_jax.config import CacheConfig
from skvs_jax.serve import engine, engine_step, sampling
from skvs_jax.serve import speculation as spec
from skvs_jax.serve.tokenizer import ByteTokenizer

# The engine runs of this file are in the slow set (`pytest -m slow`, README): their compilations would push the
# default run past its 20-minute budget. The refusals of bad input stay in the default run.
slow = pytest.mark.slow

CACHE = CacheConfig(num_blocks=48, block_size=8, max_seqs=8, max_blocks_per_seq=16)
PROMPT = list(b"Return the number of ")
SP = engine.SamplingParams

CASES = {
    "allowed": SP(max_tokens=16, allowed_token_ids=list(b"aeiou tnrs\n")),
    "bad_words": SP(max_tokens=20, bad_words=["return", "e", "if "]),
    "bias": SP(max_tokens=16, logit_bias={ord("x"): 9.0, ord(" "): -3.0}),
    "min_tokens": SP(max_tokens=16, min_tokens=6, stop_token_ids=[ord(" ")], stop=["ma"]),
    "everything": SP(max_tokens=20, min_tokens=3, allowed_token_ids=list(b"abcdefghij ()\n"), bad_words=["de"],
                     logit_bias={ord("j"): 2.5}, stop_token_ids=[ord(")")]),
}


class EosBytes(ByteTokenizer):
    """Bytes with the space as EOS (a tokenizer the engine takes EOS ids from)."""

    eos_token_ids = (ord(" "),)


class TextStops(ByteTokenizer):
    """Bytes whose stop strings are never matched on the device: the host matches them on the text."""

    def exact_stop(self, stop):
        return None


def _engine(shipped, policy=None, **options):
    model, heads = shipped
    return engine.Engine(model, heads, policy or policies.skvs(4), CACHE, token_budget=96, prefill_chunk=32,
                         **options)


def _serve(e, cases):
    ids = {name: e.add_request(PROMPT, sp) for name, sp in cases.items()}
    e.run()
    return {name: e.requests[i] for name, i in ids.items()}


def _constrained(logits, out, sp, eos=()):
    """vLLM's logits processors at output index len(out), in numpy."""
    x = np.asarray(logits, np.float64).copy()
    if sp.allowed_token_ids is not None:
        keep = np.zeros(x.size, bool)
        keep[list(sp.allowed_token_ids)] = True
        x[~keep] = -np.inf
    for word in sp.bad_words:
        seq = list(word.lstrip().encode())
        if out[len(out) - len(seq) + 1:] == seq[:-1] or len(seq) == 1:
            x[seq[-1]] = -np.inf
    if len(out) < sp.min_tokens:
        x[list(sp.stop_token_ids) + [t for t in eos if not sp.ignore_eos]] = -np.inf
    for token, bias in (sp.logit_bias or {}).items():
        x[token] += bias
    return x


def _expected_end(out, sp, eos=()):
    """(finish_reason, stop_reason) by vLLM's rules for the finished output (stop strings: their text cut)."""
    if len(out) >= sp.max_tokens:
        return "length", None
    assert len(out) > sp.min_tokens
    if out[-1] in eos and not sp.ignore_eos:
        return "stop", None
    if out[-1] in sp.stop_token_ids:
        return "stop", out[-1]
    return "stop", "string"


def _check_greedy(model, log, eos=()):
    sp = log.sampling
    out = log.tokens
    seq = np.asarray(PROMPT + out)
    logits = np.asarray(model.forward_dense(jax.numpy.asarray(seq[None, :-1]))[0][0], np.float64)
    for i, token in enumerate(out):
        assert int(np.argmax(_constrained(logits[len(PROMPT) + i - 1], out[:i], sp, eos))) == token, i
        if i + 1 < len(out) and i + 1 > sp.min_tokens:  # no stop ended it earlier
            assert out[i] not in sp.stop_token_ids and out[i] not in (() if sp.ignore_eos else eos), i
            assert not any(bytes(out[: i + 1]).endswith(s.encode()) for s in sp.stop), i
    reason, stop = _expected_end(out, sp, eos)
    assert log.finish_reason == reason
    if stop == "string":
        assert isinstance(log.stop_reason, str) and bytes(out).endswith(log.stop_reason.encode())
        assert log.output_tokens == out[: len(out) - len(log.stop_reason.encode())]
    else:
        assert log.stop_reason == stop


@pytest.fixture(scope="module")
def greedy(shipped):
    spec = _serve(_engine(shipped), CASES)
    plain = _serve(_engine(shipped, policies.vllm_default()), CASES)
    return spec, plain


@slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_constraint_is_vllms_and_lossless_under_speculation(shipped, greedy, name):
    spec, plain = greedy
    assert spec[name].tokens == plain[name].tokens
    assert spec[name].finish_reason == plain[name].finish_reason and spec[name].stop_reason == plain[name].stop_reason
    _check_greedy(shipped[0], spec[name])


@slow
def test_the_constraints_changed_something_and_speculation_drafted(shipped, greedy):
    spec, _ = greedy
    free = _serve(_engine(shipped, policies.vllm_default()), {"free": SP(max_tokens=20)})["free"].tokens
    for name, log in spec.items():
        assert log.tokens != free[: len(log.tokens)], name
    assert sum(log.drafted for log in spec.values()) > 0
    assert set(spec["allowed"].tokens) <= set(b"aeiou tnrs\n")
    assert b"return" not in bytes(spec["bad_words"].tokens) and ord("e") not in spec["bad_words"].tokens


@slow
def test_sampled_constraints_are_lossless_and_hold(shipped):
    """Sampled rows: the speculating engine emits what plain sampling with the same streams emits, and every
    constraint holds on what it emits."""
    cases = {name: SP(**{**{f: getattr(sp, f) for f in ("max_tokens", "min_tokens", "allowed_token_ids",
                                                          "bad_words", "logit_bias", "stop_token_ids", "stop")},
                         "temperature": 1.0, "seed": 11 + i})
             for i, (name, sp) in enumerate(CASES.items())}
    spec = _serve(_engine(shipped), cases)
    plain = _serve(_engine(shipped, policies.vllm_default()), cases)
    for name in cases:
        out = spec[name].tokens
        assert out == plain[name].tokens, name
        sp = cases[name]
        if sp.allowed_token_ids is not None:
            assert set(out) <= set(sp.allowed_token_ids), name
        for word in sp.bad_words:
            assert word.encode() not in bytes(out), name
        assert not set(out[: sp.min_tokens]) & set(sp.stop_token_ids), name


@slow
def test_eos_ends_a_request_unless_ignore_eos_and_min_tokens_bans_it(shipped):
    """The tokenizer's EOS ids (here the space) end a request with finish_reason "stop" and no stop_reason, and
    stay in its tokens; ignore_eos makes EOS an ordinary token; min_tokens bans EOS until then."""
    cases = {"eos": SP(max_tokens=16), "ignore": SP(max_tokens=16, ignore_eos=True),
             "min": SP(max_tokens=16, min_tokens=7)}
    logs = _serve(_engine(shipped, tokenizer=EosBytes()), cases)
    eos = EosBytes.eos_token_ids
    assert logs["eos"].tokens[-1] == ord(" ") and logs["eos"].finish_reason == "stop"
    assert logs["eos"].stop_reason is None and len(logs["eos"].tokens) < 16
    assert ord(" ") in logs["ignore"].tokens and logs["ignore"].finish_reason == "length"
    assert ord(" ") not in logs["min"].tokens[:7]
    for log in logs.values():
        _check_greedy(shipped[0], log, eos)


@slow
def test_stop_strings_matched_on_the_host_end_requests_like_the_device(shipped):
    """A tokenizer that cannot match a stop string on token ids leaves it to the host, which ends the request
    at the token that completed it (vLLM's text rule, min_tokens honoured): the same output and text as the
    device's match, the text cut unless include_stop_str_in_output, and every block back once all are done."""
    cases = {"cut": SP(max_tokens=24, stop=["xq", "mm"]), "kept": SP(max_tokens=24, stop=["in"],
                                                                        include_stop_str_in_output=True),
             "late": SP(max_tokens=24, stop=["e"], min_tokens=4), "n": SP(max_tokens=24, stop=["t"], n=2,
                                                                          temperature=1.0, seed=3)}
    device = _serve(_engine(shipped, detokenize=True), cases)
    e = _engine(shipped, tokenizer=TextStops())
    host = _serve(e, cases)
    assert all(r.plan.device_strings for r in device.values()) and not any(r.plan.device_strings for r in
                                                                          host.values())
    for name in cases:
        d, h = device[name], host[name]
        assert h.finish_reason == d.finish_reason == "stop", name
        assert h.stop_reason == d.stop_reason and h.tokens == d.tokens, name
        assert h.text == d.text == bytes(d.output_tokens).decode(errors="replace"), name
    assert host["cut"].text + host["cut"].stop_reason == bytes(host["cut"].tokens).decode()
    assert host["kept"].text.endswith("in")
    for j in e.requests[host["n"].request_id].sample_ids[1:]:
        assert e.requests[j].finish_reason in ("stop", "length")
    assert not e.has_work() and e.table.free_slots == CACHE.max_seqs
    blocks = jax.device_get(e.state.sched.kv.alloc.blocks)  # nothing held: free, in the pool, or cached
    assert not np.any(blocks.ref_count[1:] > 0)
    assert int(blocks.free_top) + int(blocks.pool_top) + int(np.sum(blocks.cached[1:])) == CACHE.usable_blocks


@slow
def test_finish_reasons_length_and_abort(shipped):
    e = _engine(shipped)
    a = e.add_request(PROMPT, SP(max_tokens=5))
    b = e.add_request(PROMPT, SP(max_tokens=40))
    e.step()
    e.abort_request(b)
    e.run()
    assert e.requests[a].finish_reason == "length" and e.requests[b].finish_reason == "abort"


def test_constraint_bounds_and_types_are_refused_naming_the_field(shipped):
    e = _engine(shipped)
    for kwargs, word in [({"allowed_token_ids": list(range(200))}, "allowed_token_ids"),
                         ({"allowed_token_ids": []}, "allowed_token_ids"),
                         ({"logit_bias": {i: 1.0 for i in range(65)}}, "logit_bias"),
                         ({"logit_bias": {1: float("nan")}}, "logit_bias"),
                         ({"logit_bias": [1]}, "logit_bias"), ({"min_tokens": 50}, "min_tokens"),
                         ({"bad_words": [""]}, "bad_words"), ({"ignore_eos": 1}, "ignore_eos"),
                         ({"output_kind": "delta"}, "output_kind"), ({"prompt_logprobs": 21}, "prompt_logprobs")]:
        with pytest.raises((ValueError, TypeError), match=word):
            SP(**kwargs)
    for sp, word in [(SP(bad_words=["x" * 9]), "bad_words"), (SP(bad_words=[str(i) for i in range(17)]), "bad_words"),
                     (SP(logit_bias={300: 1.0}), "logit_bias"), (SP(allowed_token_ids=[256]), "allowed_token_ids"),
                     (SP(logprobs=-1), "logprobs"), (SP(prompt_logprobs=2), "prompt_logprobs")]:
        with pytest.raises(ValueError, match=word):
            e.add_request(PROMPT, sp)
    assert not e.requests


def test_a_sampled_drafts_constraint_at_one_slot_is_that_slot_of_the_whole_term():
    """`engine_step._constraint(slot=i)` (each sampled draft computes its own slot's term, not the whole chain's)
    equals slot i of the term at every slot, with every kind of constraint on some row, skipped or not."""
    rng = np.random.default_rng(0)
    b, k, v = 3, 4, 50
    rows = sampling.default_rows(b)
    rows = rows.replace(min_tokens=jnp.asarray([3, 0, 5], jnp.int32),
                        min_ban=rows.min_ban.at[:, 0].set(jnp.asarray([7, 8, 9], jnp.int32)),
                        allowed=rows.allowed.at[1, :3].set(jnp.asarray([1, 2, 3], jnp.int32)),
                        bias_ids=rows.bias_ids.at[0, 0].set(4), bias=rows.bias.at[0, 0].set(2.5),
                        bad=rows.bad.at[2, 0, :2].set(jnp.asarray([5, 6], jnp.int32)),
                        bad_len=rows.bad_len.at[2, 0].set(2))
    seqs = types.SimpleNamespace(tokens=jnp.asarray(rng.integers(0, 10, (b, 64)), jnp.int32),
                                 prompt_len=jnp.asarray([10, 12, 8], jnp.int32))
    pos0 = jnp.asarray([15, 20, 9], jnp.int32)
    for _ in range(3):
        nodes = jnp.asarray(rng.integers(0, 10, (b, k)), jnp.int32)
        for skip in (True, False):
            full = np.asarray(engine_step._constraint(rows, seqs, pos0, nodes, spec.chain(k), v, skip=skip))
            assert np.isinf(full).any() and np.isfinite(full).any()
            for i in range(k):
                one = engine_step._constraint(rows, seqs, pos0, nodes, spec.chain(k), v, skip=skip, slot=i)
                np.testing.assert_array_equal(np.asarray(one), full[:, i: i + 1])
