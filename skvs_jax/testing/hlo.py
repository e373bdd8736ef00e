"""Is a refactor really a refactor? Compare two compiled programs up to names.

XLA's optimised HLO text (`jax.jit(f).lower(...).compile().as_text()`) names instructions and computations by
counters that change from one compilation to the next, carries source paths and line numbers, and may print
computations in another order. `canonical` removes all of that: the metadata, the file and stack-frame tables,
every instruction and parameter name (renamed by first use within its computation), every reference to another
computation, and the order of computations. Two programs with the same canonical text run the same operations
on the same shapes in the same order; `differing` lists the computations that are not shared.

    before = canonical(fused_step.lower(...).compile().as_text())   # on the old tree
    after = canonical(fused_step.lower(...).compile().as_text())    # on the new one
    assert before == after, differing(before, after)[:1]

It compares text, so it is exact where it says "the same" and says nothing about programs that differ only in
an order XLA would not change (a permuted output tuple, commuted operands): those show as differing.
"""

from __future__ import annotations

import re

_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def canonical(hlo_text: str) -> str:
    """The program's text up to names, source locations and computation order (see the module docstring)."""
    text = re.sub(r", metadata=\{[^}]*\}", "", hlo_text)
    text = re.sub(r"^HloModule .*$", "HloModule M", text, flags=re.M)
    blocks = [b for b in text.split("\n\n") if not b.strip().startswith(_TABLES)]
    computations = set(re.findall(r"^(?:ENTRY )?(%[\w.\-]+) ", text, flags=re.M))
    out = []
    for block in blocks:
        names: dict[str, str] = {}

        def rename(match: re.Match, names=names) -> str:
            name = match.group(0)
            return "%C" if name in computations else names.setdefault(name, f"%n{len(names)}")

        block = re.sub(r"%[\w.\-]+", rename, block.strip())
        out.append(re.sub(r"[A-Za-z_][\w\-]*(?:\.\d+)?(?=: )", "p", block))  # parameter names in signatures
    return "\n\n".join(sorted(out))


def differing(a: str, b: str) -> list[tuple[str, str]]:
    """The computations of canonical texts a and b that the other lacks, paired in sorted order (a's, b's); one
    side is "" where the counts differ."""
    only_a = sorted(set(a.split("\n\n")) - set(b.split("\n\n")))
    only_b = sorted(set(b.split("\n\n")) - set(a.split("\n\n")))
    n = max(len(only_a), len(only_b))
    return [(only_a[i] if i < len(only_a) else "", only_b[i] if i < len(only_b) else "") for i in range(n)]
