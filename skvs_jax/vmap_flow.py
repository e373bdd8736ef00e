"""Control flow for the scheduler: `cond`, `when` and `while_loop`, with batched forms that skip work no lane needs.

The scheduler skips rare, expensive work (evicting, prefix lookups, a second full-table allocation pass) and
the simulator stops a run once its trace is done. `jax.lax` gets two things wrong for this code:

* **Under `jax.vmap`** (a policy sweep, `sim.sweep`) a `lax.cond` with a batched predicate becomes a select:
  both branches run for every lane, every step, and the select copies whatever state the cond carries (block
  arrays, the prefix table). A batched `lax.while_loop` selects every lane's whole carry on every iteration.
* **A cond whose false branch returns its operand** ("update x if p") makes XLA copy the operand whenever it
  cannot alias the branch's output to it, which in the simulator's loop it often cannot: a copy of the prefix
  table per step. A loop carry is updated in place, so `when` is a loop of 0 or 1 trips.

Meanings are exactly `jax.lax`'s. Batched (`custom_vmap` rules), each switches on how many lanes need the work:

  cond(pred, t, f, *ops)   none -> f alone, vectorised; all -> t alone; some -> both, then a select per lane.
  when(pred, fun, x)       fun(x) if pred else x. none -> nothing; all -> fun on every lane; some -> fun on every
                           lane, then a select per lane. identity_when_false=True: the caller promises fun(x) == x
                           in a lane whose pred is False while another lane's holds (work that masks itself, e.g.
                           an insert of no rows); then some -> fun on every lane and no select, which would copy
                           all of x once more.
  while_loop(c, body, x)   iterates while some lane's c holds, each lane stepped by `when(c, body, x)`: no select
                           while the lanes agree. identity_when_done=True: the caller promises body(x) == x
                           wherever c(x) is False (a loop that masks its own updates); then no select at all.
  all_lanes(pred)          pred unbatched: True only if it holds in every lane. For picking one of two equivalent
                           computations (a cheap one valid on small inputs, a general one) the same way in every
                           lane, so that a sweep whose lanes disagree runs one of them, not both.

**Skip or select**: on XLA:GPU every `while` trip and every `cond` copies its predicate or branch index to the
host and waits for it (unless the program runs in a command buffer that supports them), so a skip costs a host
round trip whether or not the work runs. `cond(..., skip=False)` computes both branches and selects;
`select_when` computes fun(x) and selects (no select with identity_when_false); neither has control flow left.
Callers pick with `SchedulerConfig.skip` (its `control_flow` field: "skip" on a CPU, "select" on a GPU or TPU),
`cond(..., skip=cfg.skip)` and `when_for(cfg.skip)(pred, fun, x)`, and keep the skip only for work that costs
more than a round trip (an eviction sort over N blocks).

Branches and bodies may close over traced arrays: each is traced once to a jaxpr and every traced constant
becomes an explicit operand, so the rules see batched ones. (`jax.closure_convert` would not do: it hoists only
values that could carry float tangents, and the scheduler is integers.) Not differentiable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import custom_batching


def cond(pred: jax.Array, true_fun: Callable, false_fun: Callable, *operands: Any, skip: bool = True) -> Any:
    """`jax.lax.cond(pred, true_fun, false_fun, *operands)`; pred: bool[] (one per lane under vmap). skip=False:
    both branches run and the result is selected (no control flow; see the module docstring)."""
    if not skip:
        return _select(jnp.asarray(pred, bool), true_fun(*operands), false_fun(*operands))
    true_c, true_consts = _hoisted(true_fun, operands)
    false_c, false_consts = _hoisted(false_fun, operands)

    @custom_batching.custom_vmap
    def run(pred, tc, fc, ops):
        return jax.lax.cond(pred, lambda ops: true_c(ops, tc), lambda ops: false_c(ops, fc), ops)

    @run.def_vmap
    def run_batched(axis_size, in_batched, pred, tc, fc, ops):
        pred_b, *args_b = in_batched
        axes = _axes(args_b)
        on_true = lambda: jax.vmap(lambda tc, fc, ops: true_c(ops, tc), in_axes=axes, axis_size=axis_size)(  # noqa: E731
            tc, fc, ops)
        on_false = lambda: jax.vmap(lambda tc, fc, ops: false_c(ops, fc), in_axes=axes, axis_size=axis_size)(  # noqa: E731
            tc, fc, ops)
        if not pred_b:
            out = jax.lax.cond(pred, on_true, on_false)
        else:
            which = jnp.where(jnp.all(pred), 2, jnp.where(jnp.any(pred), 1, 0))
            out = jax.lax.switch(which, (on_false, lambda: _select(pred, on_true(), on_false()), on_true))
        return out, _all_batched(out)

    return run(pred, true_consts, false_consts, operands)


def when(pred: jax.Array, fun: Callable, x: Any, *, identity_when_false: bool = False) -> Any:
    """fun(x) if pred else x, with x updated in place; fun must return x's structure, shapes and dtypes.
    identity_when_false: fun(x) == x in a lane whose pred is False while another lane's is True (then a batched
    `when` whose lanes disagree runs fun on every lane without selecting). Only that case matters: a pred with a
    lane-uniform part (`all_lanes`) may make fun meaningless where that part is False. Unbatched, it changes
    nothing. tests/test_sim_sweep.py checks every use of it in the scheduler on a sweep."""
    fun_c, consts = _hoisted(fun, (x,))

    @custom_batching.custom_vmap
    def run(pred, fc, x):
        return _once(pred, lambda x: fun_c((x,), fc), x)

    @run.def_vmap
    def run_batched(axis_size, in_batched, pred, fc, x):
        pred_b, fc_b, x_b = in_batched
        x = _broadcast(x, x_b, axis_size)
        step = lambda x: jax.vmap(lambda fc, x: fun_c((x,), fc), in_axes=(_axes(fc_b), 0))(fc, x)  # noqa: E731
        if not pred_b:
            return _once(pred, step, x), _all_batched(x)
        if identity_when_false:
            return _once(jnp.any(pred), step, x), _all_batched(x)
        every, some = jnp.all(pred), jnp.any(pred)
        x = _once(every, step, x)
        x = _once(some & ~every, lambda x: _select(pred, step(x), x), x)
        return x, _all_batched(x)

    return run(pred, consts, x)


def select_when(pred: jax.Array, fun: Callable, x: Any, *, identity_when_false: bool = False) -> Any:
    """`when` without control flow: fun(x) runs unconditionally and is selected by pred, or kept as it is with
    identity_when_false (then fun(x) must equal x wherever pred is False, unbatched too)."""
    return fun(x) if identity_when_false else _select(jnp.asarray(pred, bool), fun(x), x)


def when_for(skip: bool) -> Callable:
    """`when` (skip: the work runs only where needed, behind a loop of 0 or 1 trips) or `select_when` (no
    control flow), called as either: `vmap_flow.when_for(cfg.skip)(pred, fun, x, ...)`."""
    return when if skip else select_when


def while_loop(cond_fun: Callable, body_fun: Callable, init: Any, *, identity_when_done: bool = False) -> Any:
    """`jax.lax.while_loop(cond_fun, body_fun, init)`. identity_when_done: body_fun(x) == x for every x with
    cond_fun(x) False (then the batched loop steps finished lanes without selecting their carry)."""
    cond_c, cond_consts = _hoisted(cond_fun, (init,))
    body_c, body_consts = _hoisted(body_fun, (init,))

    @custom_batching.custom_vmap
    def run(cc, bc, init):
        return jax.lax.while_loop(lambda x: cond_c((x,), cc), lambda x: body_c((x,), bc), init)

    @run.def_vmap
    def run_batched(axis_size, in_batched, cc, bc, init):
        cc_b, bc_b, init_b = in_batched
        c_axes, b_axes = _axes(cc_b), _axes(bc_b)
        init = _broadcast(init, init_b, axis_size)  # a lane's carry changes on its own once the loop runs
        preds = jax.vmap(lambda cc, x: cond_c((x,), cc), in_axes=(c_axes, 0))

        def lane(cc, bc, x):
            if identity_when_done:
                return body_c((x,), bc)
            return when(cond_c((x,), cc), lambda x: body_c((x,), bc), x)

        step = jax.vmap(lane, in_axes=(c_axes, b_axes, 0))
        out = jax.lax.while_loop(lambda x: jnp.any(preds(cc, x)), lambda x: step(cc, bc, x), init)
        return out, _all_batched(out)

    return run(cond_consts, body_consts, init)


# ---------------------------------------------------------------------------------------------- helpers


def all_lanes(pred: jax.Array) -> jax.Array:
    """bool[] pred; under vmap, `jnp.all` over the lanes, unbatched (every lane sees the same value)."""

    @custom_batching.custom_vmap
    def run(pred):
        return pred

    @run.def_vmap
    def run_batched(axis_size, in_batched, pred):
        return (jnp.all(pred) if in_batched[0] else pred), False

    return run(jnp.asarray(pred, bool))


def _once(pred: jax.Array, fun: Callable, x: Any) -> Any:
    """fun(x) if pred else x, as a loop of 0 or 1 trips (the carry is updated in place; a cond would copy x)."""
    return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.zeros((), bool), fun(c[1])), (pred, x))[1]


def _hoisted(fun: Callable, operands: tuple) -> tuple[Callable, tuple]:
    """fun as converted(operands, consts) with every traced constant of its jaxpr in consts."""
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*operands)
    out_tree = jax.tree.structure(out_shape)

    def converted(ops, consts):
        return jax.tree.unflatten(out_tree, jax.core.eval_jaxpr(closed.jaxpr, consts, *jax.tree.leaves(ops)))

    return converted, tuple(closed.consts)


def _axes(batched: Any) -> Any:
    return jax.tree.map(lambda b: 0 if b else None, tuple(batched) if isinstance(batched, list) else batched)


def _broadcast(x: Any, batched: Any, axis_size: int) -> Any:
    return jax.tree.map(lambda v, b: v if b else jnp.broadcast_to(v, (axis_size, *jnp.shape(v))), x, batched)


def _select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Per lane: pred[lane] ? on_true : on_false (leaves with a leading lane axis); a scalar pred selects whole
    leaves."""
    return jax.tree.map(lambda t, f: jnp.where(pred.reshape(pred.shape + (1,) * (t.ndim - 1)), t, f),
                        on_true, on_false)


def _all_batched(tree: Any) -> Any:
    return jax.tree.map(lambda _: True, tree)
