"""Per-request sampling in the real engine on the shipped tiny model: seeds, penalties, logprobs, stop strings.

The expectations are plain: the model's own dense forward over the finished sequence (teacher forcing) with the
penalties applied in numpy, and the greedy reference tokens. The engines use tests/test_engine.py's
configuration, so a run of both files compiles their programs once.
"""

import jax
import numpy as np
import pytest

from reference_models import greedy_generate
from skvs_jax import policies
from skvs_jax.config import CacheConfig
from skvs_jax.serve import engine

CACHE = CacheConfig(num_blocks=48, block_size=8, max_seqs=8, max_blocks_per_seq=16)
PROMPT = list(b"def parse(text):\n    ")
OTHERS = [list(b"import numpy as np\n"), list(b"class Engine:\n    "), list(b"    return x")]


def _engine(shipped, policy=None, **options):
    model, heads = shipped
    return engine.Engine(model, heads, policy or policies.skvs(4), CACHE, token_budget=96, prefill_chunk=32,
                         **options)


@pytest.fixture(scope="module")
def reference(shipped):
    model, _ = shipped
    return greedy_generate(model, np.asarray([PROMPT]), 24)[0, len(PROMPT):].tolist()


@pytest.mark.slow  # the default run's time budget (docs: `pytest -m slow`)
def test_a_seeded_request_ignores_its_slot_its_neighbours_and_speculation(shipped):
    """vLLM's per-request seed: the same tokens alone, behind three other requests (another slot, other
    parameters, other seeds), and without speculation (point-mass drafts emit exactly what plain sampling with
    the same stream emits)."""
    sp = engine.SamplingParams(max_tokens=16, temperature=1.0, seed=7, top_p=0.9, top_k=50, repetition_penalty=1.2)
    alone = _engine(shipped)
    rid = alone.add_request(PROMPT, sp)
    out_alone = alone.run()[rid]
    crowded = _engine(shipped)
    for i, p in enumerate(OTHERS):
        crowded.add_request(p, engine.SamplingParams(max_tokens=12, temperature=0.8, seed=i, presence_penalty=1.0))
    rid = crowded.add_request(PROMPT, sp)
    crowded.step()
    assert crowded.table.slot_of[rid] == 3 and alone.requests[0].tokens == out_alone  # alone, it had slot 0
    out_crowded = crowded.run()[rid]
    assert len(out_alone) == 16
    plain = _engine(shipped, policies.vllm_default())
    rid = plain.add_request(PROMPT, sp)
    assert out_alone == out_crowded == plain.run()[rid]
    other = _engine(shipped)
    rid = other.add_request(PROMPT, engine.SamplingParams(max_tokens=16, temperature=1.0, seed=8, top_p=0.9,
                                                          top_k=50, repetition_penalty=1.2))
    assert other.run()[rid] != out_alone


def _np_penalised(logits, context, prompt_len, sp):
    x = np.asarray(logits, np.float64).copy()
    seen = np.zeros(x.size, bool)
    seen[context] = True
    counts = np.bincount(context[prompt_len:], minlength=x.size)
    x = np.where(seen, np.where(x > 0, x / sp.repetition_penalty, x * sp.repetition_penalty), x)
    return x - sp.presence_penalty * (counts > 0) - sp.frequency_penalty * counts


def test_penalties_and_logprobs_against_the_models_own_forward(shipped, reference):
    """Greedy with every penalty: each token is the argmax of numpy's penalised logits of the model at its
    position; the logprobs are the raw log-softmax's token and top-5 entries there."""
    model, _ = shipped
    sp = engine.SamplingParams(max_tokens=20, repetition_penalty=1.6, presence_penalty=0.6, frequency_penalty=0.4,
                               logprobs=5)
    e = _engine(shipped)
    rid = e.add_request(PROMPT, sp)
    out = e.run()[rid]
    assert out != reference[:20]  # the penalties changed the output
    seq = np.asarray(PROMPT + out)
    logits = np.asarray(model.forward_dense(jax.numpy.asarray(seq[None, :-1]))[0][0], np.float64)
    logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    entries = e.requests[rid].logprobs
    assert len(entries) == len(out)
    for i, token in enumerate(out):
        at = len(PROMPT) + i - 1
        assert int(np.argmax(_np_penalised(logits[at], seq[: at + 1], len(PROMPT), sp))) == token, i
        top = np.argsort(-logp[at], kind="stable")[:5]
        want = {int(t): logp[at, t] for t in top} | {token: logp[at, token]}
        assert set(entries[i]) == set(want), i
        np.testing.assert_allclose([entries[i][t] for t in want], list(want.values()), atol=2e-4)


def test_stop_strings_end_the_output_before_them(shipped, reference):
    """A stop string of the greedy output's bytes ends the request at its first occurrence (which may straddle
    two steps); the output drops it unless include_stop_str_in_output. More than four stop ids are fine."""
    text = bytes(reference)
    stop = text[6:9].decode("utf-8")
    end = text.index(stop.encode()) + 3
    for include in (False, True):
        e = _engine(shipped)
        rid = e.add_request(PROMPT, engine.SamplingParams(max_tokens=24, stop=[stop, "\x00\x01"],
                                                          include_stop_str_in_output=include))
        out = e.run()[rid]
        assert e.requests[rid].tokens == reference[:end]
        assert out == reference[: end if include else end - 3]
    ids = tuple(t for t in range(200, 206)) + (reference[10],)  # seven ids; only the last occurs
    e = _engine(shipped)
    rid = e.add_request(PROMPT, engine.SamplingParams(max_tokens=24, stop_token_ids=ids))
    assert e.run()[rid] == reference[: reference.index(reference[10]) + 1]


def test_bad_sampling_params_are_refused(shipped):
    for kw, match in ((dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"),
                      (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(presence_penalty=3.0), "presence"),
                      (dict(frequency_penalty=float("nan")), "frequency"), (dict(seed=-1), "seed"),
                      (dict(logprobs=21), "logprobs"), (dict(stop=[b"x" * 33]), "bytes stop strings"),
                      (dict(stop=["a"] * 10, stop_token_ids=tuple(range(7))), "together")):
        with pytest.raises(ValueError, match=match):
            engine.SamplingParams(**kw)
    with pytest.raises(TypeError, match="stop must be"):
        engine.SamplingParams(stop=[""])
    sp = engine.SamplingParams(stop="ab", top_k=-1, seed=np.int64(3))
    assert sp.stop == ("ab",) and sp.top_k == 0 and sp.seed == 3 and sp.stop_sequences() == [(97, 98)]


def test_generate_refuses_n_above_one_and_points_to_completions(shipped):
    """`generate` returns one output per prompt, so it refuses n > 1 (it used to drop outputs 1..) and says where
    the n outputs are; nothing is queued."""
    e = _engine(shipped)
    with pytest.raises(ValueError, match=r"sampling.n = 3: use add_request.*completions\(request_id\)"):
        e.generate([PROMPT, OTHERS[0]], engine.SamplingParams(n=3))
    assert not e.requests and not e.table.queue


def test_aborting_one_output_before_its_fork_ends_that_output_alone(shipped):
    """`abort_request(rid + j)` before output j forks (queued, or admitted with its slot held) ends output j only:
    it never forks, its held slot goes back, and the others run to the end; nothing leaks and nothing stays held.
    It used to raise KeyError, and the output later forked and ended both finished and aborted."""
    e = _engine(shipped)
    long_prompt = PROMPT * 2  # longer than the prefill chunk: admitted one step before it forks
    queued = e.add_request(PROMPT, engine.SamplingParams(max_tokens=6, n=3))
    assert e.abort_request(queued + 1) and not e.abort_request(queued + 1)
    admitted = e.add_request(long_prompt, engine.SamplingParams(max_tokens=6, n=3))
    e.step()
    assert admitted in e.table.slot_of and admitted + 2 not in e.table.slot_of  # admitted, not forked yet
    free = e.table.free_slots
    assert e.abort_request(admitted + 2)
    assert e.table.free_slots == free + 1  # the slot held for it
    e.run()
    for rid, gone in ((queued, 1), (admitted, 2)):
        outs = e.completions(rid)
        r = e.requests[rid + gone]
        assert r.aborted and not r.finished and outs[gone] == [] and rid + gone not in e.table.slot_of
        kept = [o for j, o in enumerate(outs) if j != gone]
        assert kept[0] == kept[1] and len(kept[0]) == 6  # greedy: the two others alike, to the end
        assert all(e.requests[rid + j].finished for j in range(3) if j != gone)
    _no_block_leaks(e)
    assert not e.state.sched.kv.alloc.seqs.num_blocks.any() and e.table.free_slots == CACHE.max_seqs


def test_aborting_an_n_request_ends_every_output_before_and_after_the_fork(shipped):
    """`abort_request(rid)` on an n = 3 request ends all three outputs, whether they have forked or not (after
    the fork it used to end output 0 only, and outputs 1 and 2 ran on to max_tokens)."""
    e = _engine(shipped, steps_per_dispatch=1)  # one step at a time: abort between admission and fork
    before = e.add_request(PROMPT * 2, engine.SamplingParams(max_tokens=12, n=3))
    e.step()  # admitted, not forked
    assert before in e.table.slot_of and len(e.table.slot_of) == 1
    assert e.abort_request(before)
    after = e.add_request(PROMPT, engine.SamplingParams(max_tokens=12, n=3))
    while len(e.table.slot_of) < 3:
        e.step()
    assert e.abort_request(after) and not e.abort_request(after) and not e.table.slot_of
    e.run()
    for rid in (before, after):
        for j in range(3):
            r = e.requests[rid + j]
            assert r.aborted and not r.finished and len(r.tokens) < 12, (rid, j)
            assert not e.abort_request(rid + j)
    _no_block_leaks(e)
    assert not e.state.sched.kv.alloc.seqs.num_blocks.any() and e.table.free_slots == CACHE.max_seqs


def test_a_stop_generator_is_read_once(shipped):
    """`stop` as a generator (any iterable) is materialised once: it used to be consumed by validation and lost."""
    sp = engine.SamplingParams(stop=(s for s in ["the", b"\n"]))
    assert sp.stop == ("the", b"\n") and sp.stop_sequences() == [tuple(b"the"), (10,)]
    with pytest.raises(TypeError, match="stop must be"):
        engine.SamplingParams(stop=(s for s in ["ok", 3]))
    with pytest.raises(TypeError, match="stop must be"):
        engine.SamplingParams(stop=5)


def _no_block_leaks(e):
    """Every usable block is free, in the speculative pool, held by a live slot, or cached (evictable)."""
    blocks = jax.device_get(e.state.sched.kv.alloc.blocks)
    held = (blocks.ref_count > 0) | blocks.cached
    free = int(blocks.free_top) + int(blocks.pool_top)
    assert free + int(np.sum(held[1:])) == e.cfg.sched.cache.usable_blocks


def test_n_outputs_fork_off_the_prompt_and_share_its_blocks(shipped, reference):
    """n = 3 greedy: the outputs fork off output 0 after its first token, hold the prompt's blocks by reference
    (each prompt block referenced three times, the partial last one copied on write), and all three give the
    greedy reference; nothing leaks. Sampled: output 0 is the n = 1 request with the same seed, and the outputs
    follow streams of their own."""
    e = _engine(shipped)
    rid = e.add_request(PROMPT, engine.SamplingParams(max_tokens=12, n=3))
    assert e.requests[rid].sample_ids == (rid, rid + 1, rid + 2)
    while len(e.table.slot_of) < 3:
        e.step()
    alloc = jax.device_get(e.state.sched.kv.alloc)
    slots = [e.table.slot_of[i] for i in e.requests[rid].sample_ids]
    nb = -(-len(PROMPT) // CACHE.block_size)
    tables = alloc.seqs.block_table[slots, :nb]
    assert (tables == tables[0]).all() and (alloc.blocks.ref_count[tables[0]] == 3).all()
    assert (alloc.seqs.num_committed[slots] == len(PROMPT)).all()
    e.run()
    assert e.completions(rid) == [reference[:12]] * 3
    _no_block_leaks(e)

    sampled = engine.SamplingParams(max_tokens=12, n=3, temperature=1.0, seed=11, top_k=40)
    e = _engine(shipped)
    rid = e.add_request(PROMPT, sampled)
    e.add_request(OTHERS[0], engine.SamplingParams(max_tokens=8, temperature=1.0))
    outs = (e.run(), e.completions(rid))[1]
    single = _engine(shipped)
    one = single.add_request(PROMPT, engine.SamplingParams(max_tokens=12, temperature=1.0, seed=11, top_k=40))
    assert outs[0] == single.run()[one]
    assert len({tuple(o) for o in outs}) == 3 and all(len(o) == 12 for o in outs)
    _no_block_leaks(e)
    with pytest.raises(ValueError, match="request ids"):
        e.add_request(PROMPT, engine.SamplingParams(n=3), request_id=2**31 - 3)
    with pytest.raises(ValueError, match="n must be"):
        engine.SamplingParams(n=9)
