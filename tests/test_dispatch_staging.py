"""The dispatch loop's own admissions (`serve.dispatch`: `Staged`, `stage`, `admissible`, `admit_staged`) against a
plain-Python queue: staging appends after what the device holds (or replaces it), admission takes the head in
order into the slots `add_requests` would give, and pops exactly what it admitted. The engine-level checks (the
one-step engine's tokens and schedules, aborts of staged requests) are tests/test_engine_dispatch.py's."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from skvs_jax import policies
from skvs_jax import scheduler as sc
from skvs_jax.config import CacheConfig
from skvs_jax.serve import dispatch, engine_step, sampling

B, LEN = 4, 16
CACHE = CacheConfig(num_blocks=32, block_size=4, max_seqs=B, max_blocks_per_seq=LEN // 4)
CFG = engine_step.EngineConfig(sched=sc.SchedulerConfig(cache=CACHE, policy=policies.skvs(2), max_running=B,
                                                        token_budget=16))


def _staged(ids: list[int]) -> dispatch.Staged:
    """Rows for requests `ids` (id i: a prompt of i % 5 + 1 tokens, each token i, max_new 2, salt i, target i)."""
    prompts, lens, new, prio, rid, salt, target = (np.zeros((B, LEN), np.int32), *(np.zeros(B, np.int32)
                                                                                    for _ in range(6)))
    rows = jax.device_get(sampling.default_rows(B))
    temps = np.array(rows.temperature)
    for row, i in enumerate(ids):
        lens[row] = i % 5 + 1
        prompts[row, : lens[row]] = i
        new[row], rid[row], salt[row], target[row] = 2, i, i, i
        temps[row] = i / 100
    return dispatch.staged_from(prompts, lens, new, prio, rid, salt, target, rows.replace(temperature=temps),
                                len(ids))


def _ids(q: dispatch.Staged) -> list[int]:
    count = int(q.count)
    got = np.asarray(q.request_id)[:count].tolist()
    # every column of a row moves with it
    assert np.asarray(q.prompt_len)[:count].tolist() == [i % 5 + 1 for i in got]
    assert np.asarray(q.prompts)[:count, 0].tolist() == got
    np.testing.assert_allclose(np.asarray(q.rows.temperature)[:count], np.asarray(got) / 100)
    return got


def _state(queue: dispatch.Staged, live: int) -> engine_step.EngineState:
    """`live` slots hold a request (ids 1000..), the rest are EMPTY; `queue` staged."""
    st = engine_step.EngineState(sched=sc.init(CFG.sched), cache=None, hidden=jnp.zeros((B, 1)),
                                 sampling=sampling.default_rows(B), prompt_work=jnp.asarray(False),
                                 next_want=jnp.asarray(0, jnp.int32), staged=jax.tree.map(jnp.asarray, queue))
    st = jax.tree.map(lambda x: x.copy(), st)  # init() shares buffers between fields; add_requests donates
    if live:
        ids = np.arange(1000, 1000 + B, dtype=np.int32)
        st, _ = engine_step.add_requests(st, jnp.ones((B, LEN), jnp.int32),
                                         jnp.asarray([2 if i < live else 0 for i in range(B)], jnp.int32),
                                         jnp.full((B,), 2, jnp.int32), jnp.zeros((B,), jnp.int32), jnp.asarray(ids),
                                         sampling.default_rows(B), cfg=CFG)
    return st


@given(held=st.integers(0, B), incoming=st.integers(0, B), restage=st.booleans(), live=st.integers(0, B),
       held_slots=st.integers(0, 2))
def test_staging_and_admission_follow_a_fifo_queue(held, incoming, restage, live, held_slots):
    before = list(range(1, held + 1))
    incoming = min(incoming, B - (0 if restage else held))  # the host never sends more than it knows is free
    new = list(range(100, 100 + incoming))
    q = dispatch.stage(jax.tree.map(jnp.asarray, _staged(before)), jax.tree.map(jnp.asarray, _staged(new)),
                       jnp.asarray(int(restage), jnp.int32))
    queue = ([] if restage else before) + new
    assert _ids(q) == queue

    st = _state(q, live)
    lim = jax.tree.map(jnp.asarray, dispatch.limits(1, held=held_slots))
    k = int(dispatch.admissible(st, lim))
    assert k == max(0, min(len(queue), (B - live) - held_slots))

    admitted, slots = dispatch.admit_staged(st, jnp.asarray(k, jnp.int32), cfg=CFG)
    # what the host's own admission of the same k requests would have done, on the same state
    direct, want = engine_step.add_requests(_state(q, live), *(getattr(_staged(queue[:k]), f) for f in (
        "prompts", "prompt_len", "max_new", "priority", "request_id")), _staged(queue[:k]).rows,
        _staged(queue[:k]).cache_salt, _staged(queue[:k]).tpot_target, cfg=CFG)
    np.testing.assert_array_equal(np.asarray(slots)[:k], np.asarray(want)[:k])
    assert (np.asarray(slots)[:k] >= 0).all() and (np.asarray(slots)[k:] == -1).all()
    for a, b in zip(jax.tree.leaves((admitted.sched, admitted.sampling, admitted.prompt_work)),
                    jax.tree.leaves((direct.sched, direct.sampling, direct.prompt_work)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _ids(admitted.staged) == queue[k:]


def test_the_skipping_admission_is_the_selecting_one():
    """The CPU program skips the admission on steps that admit nothing (`dispatch._admit`, `vmap_flow.when`); the
    GPU's always runs it, where k = 0 writes nothing: both give one state, with k = 0 and with k > 0."""
    q = jax.tree.map(jnp.asarray, _staged([3, 4, 5]))
    for k in (0, 2):
        got = [dispatch._admit(_state(q, 1), jnp.asarray(k, jnp.int32), cfg)
               for cfg in (CFG, engine_step.EngineConfig(sched=sc.SchedulerConfig(
                   cache=CACHE, policy=policies.skvs(2), max_running=B, token_budget=16, control_flow="select")))]
        (a, sa), (b, sb) = got
        np.testing.assert_array_equal(np.asarray(sa), np.asarray(sb))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert int(a.staged.count) == 3 - k


@given(n=st.integers(1, 12), m=st.integers(1, 12), trailing=st.lists(st.integers(1, 3), max_size=2),
       seed=st.integers(0, 2**16), scalar=st.booleans())
def test_a_dense_row_write_is_the_scatter(n, m, trailing, seed, scalar):
    """`arrays.rows_into` + `arrays.set_rows_from` (a gather and a select per array, what a program that admits on
    every step writes rows with) equal `x.at[slot].set(value, mode="drop")` for distinct slots, some out of
    range (dropped), with row values or a scalar."""
    from skvs_jax import arrays

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.integers(-50, 50, (n, *trailing)), jnp.int32)
    slot = rng.permutation(n + 3)[:m].astype(np.int32) - 1  # distinct, -1 and >= n: dropped
    slot, m = jnp.asarray(np.where(slot < 0, n + 5, slot)), len(slot)
    value = jnp.asarray(7, jnp.int32) if scalar else jnp.asarray(rng.integers(100, 200, (m, *trailing)), jnp.int32)
    got = arrays.set_rows_from(x, arrays.rows_into(slot, n), value)
    np.testing.assert_array_equal(got, x.at[slot].set(value, mode="drop"))
