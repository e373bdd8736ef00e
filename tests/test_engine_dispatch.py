"""Many engine steps per dispatch (`serve.dispatch`) change nothing but the time: every request's tokens (and
logprobs, and what the scheduler counted: `testing.engines.assert_same_serving`) equal the one-step engine's
(steps_per_dispatch=1, `engine_step.fused_step` with the host between every two steps), and the host dispatches
k + 1 before it reads k.

Here: per-request sampling (seeded and unseeded, penalties, logprobs, n > 1, stops) under preemption by
recompute with prefix caching, aborts and prefix-cache resets between dispatches, the overlap, the timing. The
other features (swap to host and disk tiers, trees with typical acceptance, the other presets) are
tests/test_engine_dispatch_features.py's. The default run covers each feature once, at one N; `-m slow` runs
every feature at every N in {2, 8, 64} and "auto". tests/test_engine.py's cache, tight on purpose.
"""

import dataclasses

import pytest

from skvs_jax import policies, workloads
from skvs_jax.config import CacheConfig
from skvs_jax.serve import dispatch, engine
from skvs_jax.testing.engines import assert_same_serving, serve_trace

CACHE = CacheConfig(num_blocks=48, block_size=8, max_seqs=8, max_blocks_per_seq=16)
ALL_N = (2, 8, 64, "auto")


@pytest.fixture(scope="module")
def trace():
    return workloads.make("system_prompts", 10, seed=1, system_prompt_len=40, max_prompt_len=80, max_output_len=20)


def _mixed_sampling(i: int, max_tokens: int) -> engine.SamplingParams:
    """Request i's sampling: greedy, seeded and unseeded sampling, penalties, min_p / top-k / top-p, logprobs,
    n > 1 and a stop string, one per request in turn."""
    kinds = [
        dict(),
        dict(temperature=0.8, seed=7),
        dict(temperature=1.0, top_p=0.9, top_k=20, seed=3, logprobs=3),
        dict(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, seed=5),
        dict(logprobs=2),
        dict(temperature=0.9, n=3, seed=11),
        dict(stop=["e "], stop_token_ids=[10]),
        dict(temperature=1.0, min_p=0.1, seed=2),
        dict(temperature=1.0),  # unseeded: its stream comes from the engine's seed and its id
        dict(temperature=0.6, seed=9, n=2, logprobs=1),
    ]
    return engine.SamplingParams(max_tokens=max_tokens, **kinds[i % len(kinds)])


FEATURES = {
    # name: (policy, engine options, sampling of request i with max_tokens m (None: greedy))
    "sampling": (policies.skvs(4), {}, _mixed_sampling),
}
DEFAULT_N = {"sampling": 8}


def _serve(shipped, name, trace, steps, tmp_path=None):
    policy, options, sampling = FEATURES[name]
    # ids 10 apart: an n > 1 request's outputs take the ids after its own
    return serve_trace(*shipped, policy, CACHE, trace.requests, sampling, id_stride=10, token_budget=96,
                       prefill_chunk=32, steps_per_dispatch=steps, seed=5, **options)


@pytest.mark.parametrize("name", list(FEATURES))
def test_many_steps_per_dispatch_give_the_one_step_engines_tokens(shipped, trace, one_step, name, tmp_path):
    steps = DEFAULT_N[name]
    many = _serve(shipped, name, trace, steps, tmp_path)
    assert_same_serving(one_step(name), many)
    runs = [d for d in many.dispatch_log if d["steps"]]
    assert len(runs) < len(many.step_log)  # dispatches really ran several steps
    assert max(d["steps"] for d in runs) <= (dispatch.AUTO_STEPS if steps == "auto" else steps)
    assert {"fork", "first_token", "admit"} <= {d["stop"] for d in many.dispatch_log}  # n > 1 requests: the host's
    assert sum(d["admitted"] for d in many.dispatch_log) > 0  # requests of one output: the loop admitted some itself
    c = many.state.sched.counters
    assert int(c.preempt_recompute) > 0 and int(c.cached_tokens) > 0


@pytest.mark.slow  # the cross product; the default run covers each feature at one N
@pytest.mark.parametrize("steps", ALL_N)
@pytest.mark.parametrize("name", list(FEATURES))
def test_every_feature_at_every_steps_per_dispatch(shipped, trace, one_step, name, steps, tmp_path):
    assert_same_serving(one_step(name), _serve(shipped, name, trace, steps, tmp_path))


def test_the_gpu_program_serves_the_cpu_programs_tokens(shipped, trace, one_step):
    """The step program a GPU runs by default (control_flow "select": no cond or loop where rare work was skipped;
    prefix_sums "dense": no gather, scan or sort for sums in priority order; tests/test_control_flow.py), traced
    and run here at many steps per dispatch, serves every request as this CPU's one-step program does: penalties
    (applied without a cond), logprobs, n > 1, stops, preemption, prefix hits."""
    policy, options, sampling = FEATURES["sampling"]
    gpu = serve_trace(*shipped, policy, CACHE, trace.requests, sampling, id_stride=10, token_budget=96,
                      prefill_chunk=32, steps_per_dispatch=8, seed=5, control_flow="select", prefix_sums="dense",
                      **options)
    assert gpu.cfg.sched.control_flow == "select" and gpu.cfg.sched.dense
    assert_same_serving(one_step("sampling"), gpu)
    assert sum(d["admitted"] for d in gpu.dispatch_log) > 0  # the dense admission (`dispatch.admit_staged`) ran
    assert int(gpu.state.sched.counters.preempt_recompute) > 0 and int(gpu.state.sched.counters.cached_tokens) > 0


def _drive(e: engine.Engine, trace, actions) -> None:
    """Queue the trace, then serve it dispatch by dispatch (`step`), calling actions(e, i) before dispatch i."""
    for r in trace.requests:
        e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens), request_id=r.request_id)
    i = 0
    while e.has_work():
        actions(e, i)
        e.step()
        i += 1


@pytest.mark.parametrize("steps", [8, pytest.param(64, marks=pytest.mark.slow)])
def test_abort_and_prefix_cache_reset_between_dispatches(shipped, trace, steps):
    """An abort or a prefix-cache reset between dispatches acts where the host is, as between two steps of the
    one-step engine: the other requests' tokens are the one-step engine's and greedy; the aborted request keeps a
    prefix of its tokens and its blocks go back."""
    model, heads = shipped
    policy = policies.skvs(4)
    seen = {}

    def actions(e, i):
        if i == 3:
            e.reset_prefix_cache()
        running = [rid for rid in e.table.slot_of if e.requests[rid].tokens]
        if running and "victim" not in seen:
            seen["victim"] = running[0]
            e.abort_request(running[0])

    runs = {}
    for n in (1, steps):
        e = engine.Engine(model, heads, policy, CACHE, token_budget=96, prefill_chunk=32, steps_per_dispatch=n)
        seen.clear()
        _drive(e, trace, actions)
        runs[n] = (e, seen["victim"])
    (one, v1), (many, vn) = runs[1], runs[steps]
    full = {r.request_id: r for r in trace.requests}
    for rid, r in one.requests.items():
        if rid in (v1, vn):
            continue
        assert many.requests[rid].tokens == r.tokens and len(r.tokens) == full[rid].max_new_tokens, rid
    for e, victim in ((one, v1), (many, vn)):
        assert e.requests[victim].aborted and not e.requests[victim].finished
    assert int(many.state.sched.kv.alloc.seqs.num_blocks.sum()) == 0


def test_a_finish_admits_the_staged_queue_without_ending_the_dispatch(shipped, trace):
    """Greedy requests of one output each, more than the slots: the host stages its queue with each dispatch, the
    loop admits the head where a finish frees a slot, and no dispatch ends for an admission; each request's tokens,
    every step's tokens and the scheduler's counters are the one-step engine's (which admits at every host turn).
    With swap preemption nothing is staged (the host reruns a swapping step)."""
    model, heads = shipped
    policy = policies.skvs(4)
    runs = {n: serve_trace(model, heads, policy, CACHE, trace.requests, token_budget=96, prefill_chunk=32,
                           steps_per_dispatch=n) for n in (1, 8)}
    many = runs[8]
    assert_same_serving(runs[1], many)
    assert "admit" not in {d["stop"] for d in many.dispatch_log}
    assert sum(d["admitted"] for d in many.dispatch_log) == len(trace.requests) - CACHE.max_seqs
    assert int(many.state.staged.count) == 0 and not many.table.queue
    swapping = engine.Engine(model, heads, policy.replace(preemption="swap"), CACHE, token_budget=96, prefill_chunk=32,
                             steps_per_dispatch=8, swap_blocks=8)
    assert swapping.state.staged is None


def test_an_aborted_staged_request_is_never_admitted(shipped, trace):
    """An abort of a queued request the host staged on the device (between dispatches, where the host is) takes it
    off the device's queue too: it never gets a slot or a token, and the others are served as by the one-step
    engine with the same abort."""
    model, heads = shipped
    policy = policies.skvs(4)
    last = trace.requests[-1].request_id  # queued behind the 8 slots' worth: staged by the first dispatch

    def actions(e, i):
        if i == 1:
            assert last in e.table.queue and (not e._stages or last in e._staged)
            assert e.abort_request(last)

    runs = {}
    for n in (1, 8):
        e = engine.Engine(model, heads, policy, CACHE, token_budget=96, prefill_chunk=32, steps_per_dispatch=n)
        _drive(e, trace, actions)
        runs[n] = e
    one, many = runs[1], runs[8]
    assert many.requests[last].aborted and not many.requests[last].tokens and last not in many.table.slot_of
    for rid, r in one.requests.items():
        assert many.requests[rid].tokens == r.tokens, rid
    assert sum(d["admitted"] for d in many.dispatch_log) > 0
    assert int(many.state.sched.kv.alloc.seqs.num_blocks.sum()) == 0


def test_the_host_dispatches_the_next_program_before_it_reads_the_last(shipped, trace, monkeypatch):
    """`Engine.run` (the overlapped loop, `advance`): every dispatch that ran steps was read after the dispatch
    after it was sent, so the host's bookkeeping of k runs while k + 1 computes. A spy records the order of
    dispatches and reads; the program itself is not touched."""
    model, heads = shipped
    events = []
    run_steps = dispatch.run_steps

    def spy_dispatch(*args, **kwargs):
        st, out = run_steps(*args, **kwargs)
        events.append(("sent", id(out.steps)))
        return st, out

    e = engine.Engine(model, heads, policies.skvs(4), CACHE, token_budget=96, prefill_chunk=32, steps_per_dispatch=8)
    fetch = e._fetch

    def spy_fetch(tree):
        got = fetch(tree)
        if isinstance(tree, tuple) and len(tree) == 2:  # a dispatch's (steps, stop): its read
            events.append(("read", id(tree[0]), int(got[0])))
        return got

    monkeypatch.setattr(dispatch, "run_steps", spy_dispatch)
    monkeypatch.setattr(e, "_fetch", spy_fetch)
    small = dataclasses.replace(trace, requests=trace.requests[:6])
    for r in small.requests:
        e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens), request_id=r.request_id)
    e.run()
    sent = [x[1] for x in events if x[0] == "sent"]
    checked = 0
    for pos, ev in enumerate(events):
        if ev[0] == "read" and ev[2] > 0:  # a dispatch that ran steps
            k = sent.index(ev[1])
            assert k + 1 < len(sent) and ("sent", sent[k + 1]) in events[:pos], (k, events)
            checked += 1
    assert checked >= 3 and len(e.dispatch_log) == len(sent)


def test_each_step_is_timed_inside_its_dispatch(shipped, trace):
    """With many steps per dispatch the host sees a dispatch's time, not its steps': the step log's rows share
    each dispatch's [start, end] in order, and each request's first token and finish fall inside the dispatch
    that produced them, after its arrival."""
    model, heads = shipped
    e = engine.Engine(model, heads, policies.skvs(4), CACHE, token_budget=96, prefill_chunk=32, steps_per_dispatch=8)
    small = dataclasses.replace(trace, requests=trace.requests[:5])
    for r in small.requests:
        e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens), request_id=r.request_id)
    e.run()
    runs = [d for d in e.dispatch_log if d["steps"]]
    rows = iter(e.step_log)
    for d in runs:
        t = d["start"]
        for _ in range(d["steps"]):
            s = next(rows)
            assert s["start"] == pytest.approx(t) and s["duration"] >= 0
            t = s["start"] + s["duration"]
        assert t == pytest.approx(d["end"])
    assert next(rows, None) is None
    ends = [s["start"] + s["duration"] for s in e.step_log]
    for r in e.requests.values():
        assert r.arrival_time <= r.first_token_time <= r.finish_time
        assert any(t == pytest.approx(r.first_token_time) for t in ends)


def test_steps_per_dispatch_is_validated(shipped):
    model, heads = shipped
    for bad, err in ((0, ValueError), (65, ValueError), ("fast", ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(err, match="steps_per_dispatch"):
            engine.Engine(model, heads, policies.skvs(4), CACHE, steps_per_dispatch=bad)
