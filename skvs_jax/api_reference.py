"""The API reference: HTML generated from the docstrings by pdoc (the `docs` extra), one page per public module.

    python -m skvs_jax.api_reference site/api

Why not plain `python -m pdoc skvs_jax pallas_kernels reference_models`: pdoc follows a package's `__all__`, so it
would leave out every submodule a package does not re-export (`skvs_jax.serve`, `skvs_jax.sim`, `attention`, ...),
and it cannot see names a package exports through a lazy module `__getattr__` (`skvs_jax.LLM`, the hypothesis
strategies of `skvs_jax.testing`). `build` hands pdoc every public module by name and resolves the lazy exports
first. The reference documents every module, so its optional dependencies must be installed: the `docs` extra
pulls in `serve` (fastapi, for `skvs_jax.serve.openai_server`) and `testing` (hypothesis, for
`skvs_jax.testing.strategies`). tests/test_api_reference.py builds it and checks the key pages.
"""

from __future__ import annotations

import importlib
import pathlib
import pkgutil
import re
import sys
import time
import warnings

PACKAGES = ("skvs_jax", "pallas_kernels", "reference_models")
# The docstrings are Markdown-ish prose with `backticks`; "google" is pdoc's Markdown plus Google-style sections,
# which turns the dataclasses' "Attributes:" blocks into lists (plain "markdown" runs them into one paragraph).
DOCFORMAT = "google"
# Warnings that are pdoc's limits, not faults of a docstring: a NamedTuple's generated __new__ evaluates the
# postponed annotations (`from __future__ import annotations`) in collections' namespace, where `np` is undefined.
KNOWN_WARNINGS = (re.compile(r"Error parsing type annotation ForwardRef\('np\.ndarray'\) for "
                             r"reference_models\.generate\.MedusaStats\.__init__"),)


def module_names() -> list[str]:
    """Every public module of the three packages: not `__main__` (importing it runs `skvs`), no `_private` ones."""
    names = []
    for package in PACKAGES:
        names.append(package)
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, f"{package}."):
            if not any(part.startswith("_") for part in info.name.split(".")):
                names.append(info.name)
    return names


def resolve_lazy_exports(names: list[str]) -> None:
    """Bind the names that a module's `__all__` lists but its `__getattr__` provides on first use, so pdoc (which
    reads `module.__dict__`) documents them. Imports what they come from (the serving front, hypothesis)."""
    for name in names:
        module = importlib.import_module(name)
        for member in getattr(module, "__all__", ()):
            if member not in vars(module):
                setattr(module, member, getattr(module, member))


def build(out: pathlib.Path, *, show_source: bool = True) -> list[str]:
    """Write the HTML reference (one page per module, index.html, search.js) into `out`; returns pdoc's warnings,
    less KNOWN_WARNINGS. `show_source=False` leaves out each function's highlighted source (about 40% of the time)."""
    import pdoc
    import pdoc.doc
    import pdoc.render

    pdoc.render.configure(docformat=DOCFORMAT, show_source=show_source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = module_names()
        resolve_lazy_exports(names)
        modules = {name: pdoc.doc.Module.from_name(name) for name in names}
        # pdoc.pdoc(...) without its walk over submodules, which would follow `__all__` again.
        for module in modules.values():
            page = out / f"{module.fullname.replace('.', '/')}.html"
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(pdoc.render.html_module(module, modules))
        (out / "index.html").write_text(pdoc.render.html_index(modules))
        (out / "search.js").write_text(pdoc.render.search_index(modules))
    messages = [str(w.message) for w in caught]
    return [m for m in messages if not any(k.search(m) for k in KNOWN_WARNINGS)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m skvs_jax.api_reference OUT_DIR", file=sys.stderr)
        return 2
    start = time.perf_counter()
    found = build(pathlib.Path(argv[0]))
    for message in found:
        print(f"warning: {message}", file=sys.stderr)
    print(f"wrote {argv[0]}/index.html ({len(module_names())} modules, {time.perf_counter() - start:.0f} s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
