"""The API reference (`skvs_jax.api_reference`, pdoc) builds without warnings and documents the public API."""

import re

import pytest

from skvs_jax.api_reference import build, module_names

# page -> the members it must document, each with its docstring (pdoc gives each member a <section id=NAME>)
KEY_MEMBERS = {
    "skvs_jax.html": ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "CacheConfig", "SpecConfig"],
    "skvs_jax/serve/llm.html": ["LLM", "LLM.generate", "LLM.chat", "LLM.stream"],
    "skvs_jax/serve/sampling_params.html": ["SamplingParams", "RequestOutputKind"],
    "skvs_jax/serve/engine.html": ["Engine", "Engine.add_request", "Engine.abort_request", "Engine.generate"],
    "skvs_jax/scheduler.html": ["SchedulerConfig", "init", "add", "schedule", "update"],
    "skvs_jax/kv/allocator.html": ["init", "allocate", "allocate_speculative", "commit", "AllocatorState"],
    "skvs_jax/sim/simulate.html": ["simulate", "summarize", "make_trace"],
    "pallas_kernels.html": ["paged_attention", "paged_attention_reference", "write_kv", "update_block_states"],
    "pallas_kernels/attention.html": ["paged_attention", "paged_attention_reference"],
    "reference_models.html": ["load_shipped"],
}
# The index links every module; a package's own page lists only the submodules its `__all__` names.
INDEX_LINKS = ["skvs_jax/serve.html", "skvs_jax/serve/llm.html", "skvs_jax/sim.html", "skvs_jax/kv/allocator.html",
               "skvs_jax/commands/bench.html", "pallas_kernels/attention.html", "reference_models/llama.html"]


def member_docstring(page: str, member: str) -> str:
    """The docstring HTML of `member`'s entry on `page` ("" when it has no entry or no docstring)."""
    entry = re.search(rf'<(?:section|div) id="{re.escape(member)}"(.*?)(?:</section>|<div id=)', page, re.S)
    doc = entry and re.search(r'<div class="docstring">(.*?)</div>', entry[1], re.S)
    return doc[1].strip() if doc else ""


@pytest.mark.slow  # imports every module and renders ~100 pages: the default run's time budget
def test_api_reference_builds_without_warnings_and_documents_the_api(tmp_path):
    problems = build(tmp_path, show_source=False)  # the highlighted sources are pygments' work, not the docstrings'
    assert not problems, "pdoc warned:\n" + "\n".join(problems)
    pages = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.html")}
    assert pages == {f"{n.replace('.', '/')}.html" for n in module_names()} | {"index.html"}
    for page, members in KEY_MEMBERS.items():
        text = (tmp_path / page).read_text()
        undocumented = [m for m in members if not member_docstring(text, m)]
        assert not undocumented, f"{page}: no entry or no docstring for {undocumented}"
    index = (tmp_path / "index.html").read_text()
    assert not [link for link in INDEX_LINKS if f'href="{link}"' not in index]
    assert "multi-query" in (tmp_path / "pallas_kernels/attention.html").read_text()  # the module docstring
