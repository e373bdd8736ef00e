"""The engine's fitted step cost (`serve.step_cost`): the table's arithmetic, and the engine's boundary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from skvs_jax import policies
from skvs_jax import scheduler as sc
from skvs_jax.config import CacheConfig
from skvs_jax.serve import engine
from skvs_jax.serve import step_cost as fit_mod

CACHE = CacheConfig(num_blocks=48, block_size=8, max_seqs=8, max_blocks_per_seq=16)


def test_the_fit_prices_a_step_by_the_program_its_widest_row_needs():
    """Programs at widths 1, 3, 5 (decode) and 32 (prompt): a row of w tokens runs the narrowest program >= w;
    the table is that program's time over the narrowest's, never falling (width 3 timed below width 1 is noise,
    not a cheaper program)."""
    cost = fit_mod.fit({1: 2000.0, 3: 1900.0, 5: 2100.4, 32: 3200.0}, [1, 3, 5, 32], token_budget=16, max_width=32)
    assert np.asarray(cost.token_us).tolist() == [2000] * 17
    w = np.asarray(cost.width_us)
    assert w.shape == (33,) and w[:4].tolist() == [0, 0, 0, 0] and w[4:6].tolist() == [100, 100]
    assert np.all(w[6:] == 1200)
    assert int(cost.row_us) == int(cost.ctx_ns) == int(cost.head_us) == 0 and cost.compute_us is None
    assert int(cost.margin) == fit_mod.FIT_MARGIN  # a fit is an estimate: drafts preempt past its error only


def test_untimed_widths_are_interpolated_and_bad_input_is_refused():
    cost = fit_mod.fit({1: 1000.0, 32: 4100.0}, [1, 5, 32], token_budget=8, max_width=32)
    w = np.asarray(cost.width_us)
    assert w[2:6].tolist() == [400] * 4 and w[6] == 3100  # 5 lies 4/31 of the way: 1000 + 400
    with pytest.raises(ValueError, match="at least one"):
        fit_mod.fit({}, [1, 32], 8, 32)
    with pytest.raises(ValueError, match="widths must be >= 1"):
        fit_mod.fit({1: 1.0}, [0, 1], 8, 32)
    with pytest.raises(ValueError, match="margin must lie in"):
        fit_mod.fit({1: 1.0}, [1, 32], 8, 32, margin=-1)
    assert int(fit_mod.fit({1: 1.0}, [1, 32], 8, 32, margin=0).margin) == 0


@settings(max_examples=40)
@given(times=hs.lists(hs.floats(1.0, 1e5), min_size=1, max_size=5), extra=hs.integers(0, 40))
def test_the_table_is_non_decreasing_and_valid_for_the_scheduler(times, extra):
    widths = sorted({1 + 3 * i for i in range(len(times))})
    top = widths[-1] + extra
    cost = fit_mod.fit(dict(zip(widths, times)), widths + [top], token_budget=16, max_width=top)
    w = np.asarray(cost.width_us)
    assert w[0] == 0 and np.all(np.diff(w) >= 0) and w.shape == (top + 1,)
    cfg = sc.SchedulerConfig(cache=CACHE, policy=policies.skvs(4), max_running=8, token_budget=16)
    sc.check_step_cost(cost, cfg)


def test_the_engine_step_cost_argument(shipped):
    """"fit" (the default) and "flat" start flat with a width table of zeros (the fit's shape: fitting
    recompiles nothing); a StepCost is used as given; anything else is refused by name."""
    model, heads = shipped
    make = lambda **kw: engine.Engine(model, heads, policies.skvs(4), CACHE, token_budget=96,  # noqa: E731
                                      prefill_chunk=32, **kw)
    for mode in ("fit", "flat"):
        e = make(step_cost=mode) if mode == "flat" else make()
        assert e.step_cost_mode == mode and not e.step_cost_times
        assert np.asarray(e.state.step_cost.width_us).tolist() == [0] * (e.picker.prompt_width + 1)
        assert int(e.state.step_cost.margin) == 0  # the fit's structure, so fitting recompiles nothing
    given_cost = fit_mod.fit({1: 900.0, 32: 2000.0}, [1, 32], 96, 32)
    e = make(step_cost=given_cost)
    assert e.step_cost_mode == "given" and np.asarray(e.step_cost.token_us).tolist() == [900] * 97
    # The engine keeps a host copy and gives its state device copies: the step donates those, and the caller's
    # StepCost (another engine's, a bench repeat's) must outlive them.
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(e.step_cost))
    assert not any(x is y for x, y in zip(jax.tree.leaves(given_cost), jax.tree.leaves(e.state.step_cost)))
    assert np.asarray(e.state.step_cost.width_us).tolist() == np.asarray(given_cost.width_us).tolist()
    with pytest.raises(ValueError, match="step_cost must be 'fit', 'flat'"):
        make(step_cost="roofline")
    with pytest.raises(ValueError, match="step_cost.token_us"):
        make(step_cost=given_cost.replace(token_us=jnp.ones((5,), jnp.int32)))
    with pytest.raises(ValueError, match="compute_us, mem_us and overlap go together"):
        make(step_cost=given_cost.replace(mem_us=jnp.asarray(3, jnp.int32)))
    with pytest.raises(ValueError, match="step_cost.margin must lie in"):
        make(step_cost=given_cost.replace(margin=jnp.asarray(2000, jnp.int32)))
