"""What a step program costs a GPU, counted on any backend: heavy primitives, kernel-like instructions, and
the control flow that waits on the host.

A GPU pays per kernel launch (a few microseconds each) and, on XLA:GPU without command buffers, a host round trip
for every `while` trip (its predicate is copied to the host) and every `cond` (its branch index). This CPU hides
both. Three counts make them visible without a GPU:

  heavy(jaxpr)          the jaxpr's gathers, scatters (scatter-add/min/max included), sorts, cumulative ops
                        (cumsum/cumprod/cummax/cummin), `while` and `cond`, in the jaxpr and every jaxpr inside it.
                        A jaxpr does not depend on the backend, so these counts are the GPU's, given the GPU's
                        static choices (`SchedulerConfig.control_flow`, `SchedulerConfig.prefix_sums`).
  heavy(jaxpr, skipped=sources)  the same, leaving out the bodies of the `while` / `cond` of those sources (e.g.
                        every skip of the program, `tuple(by_source(jaxpr, ("while", "cond")))`): what a step
                        that needs none of the skipped work launches
  by_source(jaxpr)      the same, per source function (the innermost frame in skvs_jax, reference_models or
                        pallas_kernels; an equation jax adds inside a library call is charged to its caller).
  kernels(hlo_text)     the compiled program's kernel-like instructions: every instruction of the entry
                        computation, and of the computations it runs as control flow (`while` bodies and
                        conditions, `conditional` branches, `call`s), except those that launch nothing
                        (parameter, constant, tuple, get-tuple-element, bitcast, ...). Fusion bodies and reducers
                        are not entered: a fusion is one kernel. Exact figures change with XLA's version and
                        backend, so tests bound the jaxpr counts and only report these.

    jaxpr = jax.make_jaxpr(lambda st, k: scheduler.schedule_unchecked(st, k, cfg=cfg))(state, knobs)
    heavy(jaxpr)     # skvs, 8 slots, CPU program: {'gather': 105, 'scatter': 83, 'sort': 3, 'cumsum': 29, ...}
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator

KINDS = ("gather", "scatter", "sort", "cumsum", "while", "cond")
_KIND = {"gather": "gather", "sort": "sort", "while": "while", "cond": "cond",
         **{p: "scatter" for p in ("scatter", "scatter-add", "scatter_add", "scatter-min", "scatter_min",
                                   "scatter-max", "scatter_max", "scatter-mul", "scatter_mul")},
         **{p: "cumsum" for p in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")}}
_OURS = ("/skvs_jax/", "/reference_models/", "/pallas_kernels/")
_PLUMBING = ("/skvs_jax/vmap_flow.py", "/skvs_jax/arrays.py")  # charged to their caller
MODEL_SOURCES = ("reference_models/", "pallas_kernels/", "serve/model_runner.py")


def _frame(eqn, parent: str) -> str:
    tb = eqn.source_info.traceback
    for f in (tb.frames if tb is not None else ()):
        if any(p in f.file_name for p in _OURS) and not any(p in f.file_name for p in _PLUMBING):
            root = next(p for p in _OURS if p in f.file_name)
            path = root.lstrip("/") + f.file_name.split(root, 1)[1]
            return f"{path.removeprefix('skvs_jax/')}:{f.function_name.split('.<locals>')[0]}"
    return parent


def _eqns(jaxpr, parent: str = "?", skipped: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """(primitive kind, source) of every heavy equation in a (closed) jaxpr and the jaxprs inside it, except
    inside a `while` / `cond` whose source is in `skipped` (the equation itself is yielded)."""
    jp = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jp.eqns:
        src = _frame(eqn, parent)
        kind = _KIND.get(eqn.primitive.name)
        if kind is not None:
            yield kind, src
        if kind in ("while", "cond") and src in skipped:
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _eqns(inner, src, skipped)


def heavy(jaxpr, *, exclude: tuple[str, ...] = (), skipped: tuple[str, ...] = ()) -> dict[str, int]:
    """{kind: count} over `KINDS` (all present, zeros included), leaving out equations whose source starts with
    one of `exclude` (e.g. `MODEL_SOURCES`) and those inside the `while` / `cond` of the sources in `skipped`
    (skips: work that runs only in the steps that need it, so a common step launches the rest alone)."""
    counts = dict.fromkeys(KINDS, 0)
    for kind, src in _eqns(jaxpr, skipped=skipped):
        if not src.startswith(exclude):
            counts[kind] += 1
    return counts


def by_source(jaxpr, kinds: tuple[str, ...] = KINDS, *, exclude: tuple[str, ...] = ()) -> dict[str, dict[str, int]]:
    """{source: {kind: count}} for the kinds asked, sources sorted; see the module docstring for what a source is."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for kind, src in _eqns(jaxpr):
        if kind in kinds and not src.startswith(exclude):
            out[src][kind] += 1
    return {src: dict(c) for src, c in sorted(out.items())}


# ------------------------------------------------------------------------------------------ compiled HLO

_SILENT = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
           "replica-id", "opt-barrier", "add-dependency"}
_COMP = re.compile(r"^(ENTRY )?(%?[\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(r"\b(condition|body|to_apply|true_computation|false_computation)=(%?[\w.\-]+)"
                     r"|branch_computations=\{([^}]*)\}")

KERNEL_RULE = ("instructions of the entry computation and of the while bodies/conditions, conditional branches "
               "and calls it runs, not inside fusions or reducers; parameters, constants, tuples, "
               "get-tuple-element and bitcasts excluded")


def kernels(hlo_text: str) -> dict[str, int]:
    """{opcode: count} of the kernel-like instructions of an optimised HLO module (`KERNEL_RULE`), with "total"."""
    comps: dict[str, list[str]] = {}
    entry, name = None, None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("{")[0].split("(")[0]:
            name = m.group(2).lstrip("%")
            comps[name] = []
            entry = name if m.group(1) else entry
        elif name is not None and line.strip() == "}":
            name = None
        elif name is not None:
            comps[name].append(line)
    counts: collections.Counter = collections.Counter()
    seen: set[str] = set()

    def visit(comp: str) -> None:
        if comp in seen or comp not in comps:
            return
        seen.add(comp)
        for line in comps[comp]:
            m = _INSTR.match(line)
            if not m:
                continue
            op = m.group(1)
            if op not in _SILENT:
                counts[op] += 1
            if op in ("while", "conditional", "call"):
                for g in _CALLED.finditer(line):
                    if g.group(1) == "to_apply" and op != "call":
                        continue
                    for c in ([g.group(2)] if g.group(2) else g.group(3).split(",")):
                        visit(c.strip().lstrip("%"))

    if entry is not None:
        visit(entry)
    return {**dict(counts.most_common()), "total": sum(counts.values())}
