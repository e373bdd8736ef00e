"""The prompt width's split branch (`engine_step.model_step_at`): how a long prompt chunk is cut into extra rows,
against a plain-Python oracle. The branch's exactness on the shipped model is in test_engine (which reuses its
compiled programs)."""

import types

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings

from skvs_jax.serve import engine_step


def _oracle(start, num_query, num_drafts, scheduled, width):
    """Per row, the head tokens that do not fit a home row of `width` slots, and the extra rows they fill in
    order: (parent, start, length) each, rows of earlier parents first."""
    heads, rows = [], []
    for b, (s, q, d, on) in enumerate(zip(start, num_query, num_drafts, scheduled)):
        off = max(q + d - width, 0) if on else 0
        heads.append(off)
        rows += [(b, s + j, min(width, off - j)) for j in range(0, off, width)]
    return heads, rows


@st.composite
def _batches(draw):
    width = draw(st.integers(1, 6))
    b = draw(st.integers(1, 6))
    rows = draw(st.integers(1, 12))
    num_query = draw(st.lists(st.integers(0, 40), min_size=b, max_size=b))
    # a row's drafts fit its home row (at most width - 1), and a row with drafts computes its last token
    num_drafts = [draw(st.integers(0, width - 1)) if q > 0 else 0 for q in num_query]
    start = draw(st.lists(st.integers(0, 100), min_size=b, max_size=b))
    scheduled = [q > 0 and draw(st.booleans()) for q in num_query]
    return width, rows, start, num_query, num_drafts, scheduled


@settings(max_examples=150, deadline=None)
@given(_batches())
def test_extra_rows_cut_every_long_chunk_as_the_oracle_does_and_cover_it_exactly(case):
    width, rows, start, num_query, num_drafts, scheduled = case
    arr = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    batch = types.SimpleNamespace(start=arr(start), num_query=arr(num_query), num_drafts=arr(num_drafts),
                                  scheduled=jnp.asarray(scheduled))
    off = engine_step._chunk_heads(batch, width)
    ex = engine_step._split_rows(batch.start, off, width, rows)
    want_heads, want_rows = _oracle(start, num_query, num_drafts, scheduled, width)
    assert np.asarray(off).tolist() == want_heads
    assert int(ex.need) == len(want_rows)
    got = [(int(p), int(s), int(n)) for p, s, n in zip(ex.parent, ex.start, ex.length)]
    assert [r for r in got if r[2] > 0] == want_rows[:rows]  # the first `rows` of them, in order
    assert all(n == 0 for _, _, n in got[len(want_rows):])  # the rest unused
    # When they fit, the extra rows and the home rows [start + off, start + num_query + num_drafts) hold each
    # scheduled row's query tokens exactly once; the home row keeps its last known token (its sampling slot).
    if len(want_rows) <= rows:
        for b in range(len(start)):
            if not scheduled[b]:
                continue
            covered = [t for p, s, n in got if p == b and n > 0 for t in range(s, s + n)]
            covered += list(range(start[b] + want_heads[b], start[b] + num_query[b] + num_drafts[b]))
            assert covered == list(range(start[b], start[b] + num_query[b] + num_drafts[b]))
            assert want_heads[b] <= num_query[b] - 1
