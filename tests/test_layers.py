"""The package's layers, read off its imports: lower layers never import higher ones.

    state (config, arrays, checks, vmap_flow, victims, policies) → kv/ → scheduler → serve/ | sim/ → commands/

Every import counts, also one inside a function (a lazy import is still a dependency). The test parses the
source, so it sees what a reader sees, without importing anything.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
HIGHER = ("skvs_jax.serve", "skvs_jax.sim", "skvs_jax.commands", "skvs_jax.testing")

# (files, prefixes they must not import)
RULES = [
    ("skvs_jax/kv/*.py", HIGHER + ("skvs_jax.scheduler",)),
    ("skvs_jax/scheduler/*.py", HIGHER),
    ("skvs_jax/policies.py", HIGHER + ("skvs_jax.scheduler", "skvs_jax.kv")),
    ("skvs_jax/victims.py", HIGHER + ("skvs_jax.scheduler", "skvs_jax.kv", "skvs_jax.policies")),
    ("skvs_jax/config.py", HIGHER + ("skvs_jax.scheduler", "skvs_jax.kv", "skvs_jax.policies")),
    ("skvs_jax/arrays.py", HIGHER + ("skvs_jax.scheduler", "skvs_jax.kv", "skvs_jax.policies")),
    ("skvs_jax/vmap_flow.py", HIGHER + ("skvs_jax.scheduler", "skvs_jax.kv", "skvs_jax.policies")),
    ("skvs_jax/sim/*.py", ("skvs_jax.commands", "skvs_jax.testing")),
    ("skvs_jax/serve/*.py", ("skvs_jax.commands", "skvs_jax.testing", "skvs_jax.sim")),
    ("skvs_jax/metrics.py", HIGHER),
    ("skvs_jax/workloads.py", HIGHER),
    ("pallas_kernels/*.py", ("skvs_jax", "reference_models")),
    ("reference_models/*.py", ("skvs_jax",)),
]


def imported_modules(path: pathlib.Path) -> set[str]:
    """Dotted names a file imports: `import a.b` gives a.b; `from a import b` gives a and a.b (b may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _violations(pattern: str, forbidden: tuple[str, ...]) -> list[str]:
    files = sorted(ROOT.glob(pattern))
    assert files, f"no file matches {pattern}: update RULES to the layout"
    bad = []
    for f in files:
        for name in sorted(imported_modules(f)):
            if any(name == p or name.startswith(p + ".") for p in forbidden):
                bad.append(f"{f.relative_to(ROOT)} imports {name}")
    return bad


@pytest.mark.parametrize("pattern, forbidden", RULES, ids=[r[0] for r in RULES])
def test_lower_layers_never_import_higher_ones(pattern, forbidden):
    assert _violations(pattern, forbidden) == []


def test_only_commands_import_commands():
    bad = [f"{f.relative_to(ROOT)}" for f in sorted(ROOT.glob("skvs_jax/**/*.py"))
           if "commands" not in f.relative_to(ROOT).parts
           and any(n == "skvs_jax.commands" or n.startswith("skvs_jax.commands.") for n in imported_modules(f))]
    assert bad == []


def test_the_checker_sees_lazy_and_from_imports(tmp_path):
    """The parser is the test's only instrument: it must see every form of import the package uses."""
    f = tmp_path / "m.py"
    f.write_text("import skvs_jax.kv.allocator\nfrom skvs_jax import sim\n\n"
                 "def g():\n    from skvs_jax.serve import engine\n")
    assert {"skvs_jax.kv.allocator", "skvs_jax.sim", "skvs_jax.serve.engine"} <= imported_modules(f)


PACKAGES = sorted(p.parent for p in [*ROOT.glob("skvs_jax/**/__init__.py"), ROOT / "pallas_kernels/__init__.py",
                                     ROOT / "reference_models/__init__.py"])


@pytest.mark.parametrize("package", PACKAGES, ids=[str(p.relative_to(ROOT)) for p in PACKAGES])
def test_every_module_is_on_its_packages_map(package):
    """A package's docstring is its map: it names every module and subpackage in it (a new module that is not on
    the map is a module no reader finds)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    modules = [p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")]
    modules += [p.name for p in package.iterdir() if (p / "__init__.py").is_file()]
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", doc))
    assert sorted(m for m in modules if m not in words) == []

