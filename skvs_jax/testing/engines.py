"""`assert_same_serving(a, b)`: two engines that served the same requests produced the same thing; `serve_trace`:
an engine that served a trace, to compare.

What "a change that changes nothing but the time" must keep (many steps per dispatch against one, a refactor of
the host loop): every output's tokens, finish, abort, preemptions, prefix-cache hits and logprobs, the
scheduler's counters, and the tokens each engine step computed.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np


def serve_trace(model, heads, policy, cache, requests, sampling: Callable | None = None, id_stride: int = 1,
                **options):
    """An `Engine(model, heads, policy, cache, **options)` that served `requests` (`workloads.Request`s, all queued
    at once) to completion through `run()`. sampling(i, max_tokens) gives request i's `SamplingParams` (None:
    greedy); request i gets the id id_stride * its request_id (room for the ids of its n > 1 outputs)."""
    from skvs_jax.serve import engine

    e = engine.Engine(model, heads, policy, cache, **options)
    for i, r in enumerate(requests):
        sp = sampling(i, r.max_new_tokens) if sampling else engine.SamplingParams(max_tokens=r.max_new_tokens)
        e.add_request(r.prompt, sp, request_id=id_stride * r.request_id)
    e.run()
    return e


def assert_same_serving(a, b, *, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Raise AssertionError naming the first difference between engines `a` and `b` (`serve.engine.Engine`,
    each run to completion on the same requests). Logprobs compare within rtol / atol (the same program, but
    another batch around a row may change the last bits)."""
    assert a.requests.keys() == b.requests.keys(), "the engines served different request ids"
    for rid, x in a.requests.items():
        y = b.requests[rid]
        assert x.tokens == y.tokens, f"request {rid}: tokens differ\n{x.tokens}\n{y.tokens}"
        fields = ("finished", "aborted", "preemptions", "cached_tokens", "drafted", "accepted")
        got = [(f, getattr(x, f), getattr(y, f)) for f in fields if getattr(x, f) != getattr(y, f)]
        assert not got, f"request {rid}: {got}"
        assert (x.logprobs is None) == (y.logprobs is None), f"request {rid}: logprobs in one engine only"
        for i, (p, q) in enumerate(zip(x.logprobs or [], y.logprobs or [])):
            assert p.keys() == q.keys(), f"request {rid}, token {i}: top logprob ids differ"
            np.testing.assert_allclose([p[t] for t in p], [q[t] for t in p], rtol=rtol, atol=atol,
                                       err_msg=f"request {rid}, token {i}")
    ca, cb = jax.tree.map(int, a.state.sched.counters), jax.tree.map(int, b.state.sched.counters)
    assert ca == cb, f"scheduler counters differ:\n{ca}\n{cb}"
    ta, tb = [s["tokens"] for s in a.step_log], [s["tokens"] for s in b.step_log]
    assert ta == tb, f"the engine steps computed different tokens:\n{ta}\n{tb}"
