"""The dispatch loop's width rule (`serve.dispatch.fits_width`): a ski rental between running padded and a host turn.

A step that needs a narrower width than the running program runs on, paying the padding (the fitted cost of the
program's width minus the needed one's), until the padding paid in a row reaches the price of a host turn
(`HOST_TURN_STEPS` steps of the running program); then the dispatch ends for the host to pick the narrower
program. The property tests drive the rule over random fitted costs and runs of needs, against a plain-Python
statement of it."""

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as hs

from skvs_jax import scheduler as sc
from skvs_jax.serve import dispatch

K = 4
CFG = SimpleNamespace(sched=SimpleNamespace(policy=SimpleNamespace(draft_len=K)))  # what narrow_width reads
PROMPT = 32


def _state(width_us, token_us=1000):
    cost = sc.StepCost(token_us=jnp.full((PROMPT + 1,), token_us, jnp.int32), row_us=jnp.int32(0),
                       ctx_ns=jnp.int32(0), head_us=jnp.int32(0),
                       width_us=None if width_us is None else jnp.asarray(width_us, jnp.int32))
    return SimpleNamespace(step_cost=cost)


def _run(st, width, needs):
    """Drive the rule over a run of needs from padded = 0: the steps that ran before the dispatch ended (or all)
    and the padding the rule carried at the end."""
    padded = jnp.zeros((), jnp.float32)
    for i, need in enumerate(needs):
        fits, after = dispatch.fits_width(st, jnp.int32(need), padded, cfg=CFG, width=width)
        if not bool(fits):
            return i, float(padded)
        padded = after
    return len(needs), float(padded)


tables = hs.lists(hs.integers(0, 3000), min_size=PROMPT + 1, max_size=PROMPT + 1).map(sorted)


@given(table=tables, width=hs.sampled_from([3, 5, PROMPT]), needs=hs.lists(hs.integers(1, PROMPT), max_size=40))
def test_a_run_of_narrower_needs_ends_once_its_padding_costs_a_host_turn(table, width, needs):
    st = _state(table)
    runs_at = lambda need: 1 + K if width > 1 + K and need <= 1 + K else width  # noqa: E731  (model_step_at's branch)
    ran, _ = _run(st, width, needs)
    paid = 0.0
    for i, need in enumerate(needs[:ran + 1]):
        pad = max(table[runs_at(need)] - table[need], 0) if need <= width else 0
        turn = dispatch.HOST_TURN_STEPS * (1000 + table[runs_at(need)])
        if i == ran:  # where the dispatch ended: the need is wider, or the run's padding has reached a turn
            assert need > width or (pad > 0 and paid >= turn)
            break
        assert need <= width and (pad == 0 or paid < turn)  # every step that ran was allowed to
        paid = paid + pad if pad > 0 else 0.0  # a step with nothing to pad ends the run
    else:
        assert ran == len(needs)
    # Never more padding paid in a row than a host turn and one step's padding: the rental's bound.
    top = dispatch.HOST_TURN_STEPS * (1000 + max(table)) + max(table)
    assert paid <= top


@given(width=hs.sampled_from([3, 5, PROMPT]), needs=hs.lists(hs.integers(1, PROMPT), max_size=20))
def test_without_a_width_table_every_need_the_program_holds_runs_on(width, needs):
    ran, padded = _run(_state(None), width, needs)
    assert ran == next((i for i, need in enumerate(needs) if need > width), len(needs)) and padded == 0


def test_a_short_run_stays_and_a_long_one_switches():
    """The CPU's shape: width 5 a fifth dearer than 3. One or two steps needing 3 run on at 5 (the host turn would
    cost more than their padding); a long run ends once its padding has cost a turn, here after four steps."""
    table = np.zeros(PROMPT + 1, np.int64)
    table[3], table[5], table[PROMPT] = 2000, 2800, 5000
    st = _state(table.tolist(), token_us=0)
    assert _run(st, 5, [3, 3, 5, 3, 3])[0] == 5  # a step needing 5 ends each short run
    ran, padded = _run(st, 5, [3] * 20)
    assert ran == 4 and padded == 4 * 800  # 3,200 us paid; the fifth step would pass the 2,800 us turn
