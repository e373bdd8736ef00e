"""Every Python snippet in README.md and docs/*.md runs as written, in this process (they share the engine
programs they compile: the engine snippets use `skvs_jax.LLM`'s default geometry). A snippet that cannot run
here says why in a `<!-- not run: ... -->` line right above it, and is reported as a skip with that reason; one
marked `<!-- slow: ... -->` runs in the slow set (`pytest -m slow`), to keep the default run under its budget."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- (?P<kind>not run|slow): (?P<why>[^\n]*?) -->\n)?```python\n(?P<code>.*?)\n```", re.S)


def _snippets():
    for f in FILES:
        for i, m in enumerate(BLOCK.finditer(f.read_text())):
            slow = m["kind"] == "slow"
            yield pytest.param(m["code"], None if slow else m["why"], id=f"{f.relative_to(ROOT)}:{i}",
                               marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("code, why", list(_snippets()))
def test_snippet_runs_as_written(code, why, monkeypatch, capsys):
    if why:
        pytest.skip(f"not run: {why}")
    monkeypatch.chdir(ROOT)  # snippets name shipped files by their path in the repository
    exec(compile(code, "<snippet>", "exec"), {"__name__": "__snippet__"})


def test_every_snippet_is_collected():
    count = sum(f.read_text().count("```python") for f in FILES)
    assert count == len(list(_snippets())) >= 10
