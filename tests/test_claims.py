"""`skvs claims`: the report's structure, and every verdict follows from its numbers by its rule."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np
import pytest

from skvs_jax import metrics
from skvs_jax.commands import claims
from skvs_jax.sim import scenarios as scn

# A tiny pressure scenario: few short requests, a small KV sweep, three policies (each is one compilation).
TINY = dataclasses.replace(
    scn.SCENARIOS["pressure"], requests=12, rate=64.0, max_prompt_len=96, max_output_len=24, max_seqs=8,
    workload_kw=(("num_system_prompts", 2), ("system_prompt_len", 48), ("scale", 0.25)),
    policies=("vllm_default", "naive_spec", "skvs_article"), kv_sweep=(12, 24, 48), seeds=3, max_steps=4000)


@pytest.fixture(scope="module")
def doc():
    res = {"pressure": scn.run(TINY, chunk=512, log=lambda *_: None)}
    return claims.build(res, None, "skvs claims --test", 1.0)


def test_the_report_has_a_row_per_claim_and_each_verdict_follows_from_its_inputs(doc):
    ids = [r["id"] for r in doc["claims"]]
    assert len(ids) == len(set(ids))
    for want in ("s6_throughput", "s6_latency_p50", "s6_latency_p99", "s6_hit_rate", "s6_memory", "s6_waste",
                 "s6_oom", "s3_scenario2", "s6_decomposition", "s6_bound", "s3_ghost", "s7_chunked_prefill",
                 "s7_buckets", "s1_starved", "engines_hit_trim", "tail_phased", "s7_fp8", "s4_invalidation"):
        assert want in ids
    for r in doc["claims"]:
        assert set(r) >= {"id", "section", "claim", "article", "ours", "verdict", "conditions", "command", "cases"}
        assert r["verdict"] == claims.verdict_of(r)
        assert r["verdict"].startswith(claims.VERDICTS), r["verdict"]
        for c in r["cases"]:
            assert c["rule"] in claims.RULES
    by_id = {r["id"]: r for r in doc["claims"]}
    assert by_id["s4_invalidation"]["verdict"] == "untested here"
    assert by_id["s7_fp8"]["verdict"] == "untested here"  # precision not run here
    # Rows with data: the ones the pressure scenario feeds, with the three policies it ran.
    assert by_id["s6_throughput"]["cases"] and by_id["s6_bound"]["cases"]
    # The bound is checked at every step: its inputs are the largest observed share of it.
    lanes = doc["scenarios"]["pressure"]["policies"]["skvs_article"]["lanes"]
    assert all(m["steps_checked"] > 0 and m["bound_violations"] == 0 for m in lanes)
    bound_case = next(c for c in by_id["s6_bound"]["cases"] if c["condition"] == "pressure/skvs_article")
    assert bound_case["inputs"][0] == max(m["bound_max_share"] for m in lanes)
    # Seeds >= 3 with the spread; the sweep is reported and the chosen budget is one of its points.
    p = doc["scenarios"]["pressure"]
    assert len(p["policies"]["naive_spec"]["lanes"]) == 3 and p["kv_blocks"] in TINY.kv_sweep
    assert [w["kv_blocks"] for w in p["sweep"]] == list(TINY.kv_sweep)
    s = p["policies"]["naive_spec"]["summary"]["throughput"]
    assert s["min"] <= s["mean"] <= s["max"]


def test_the_report_renders_and_serialises(doc, tmp_path):
    text = claims.render(doc)
    for r in doc["claims"]:
        assert f"**{r['verdict']}**" in text
    assert "KV sweep of vllm_default" in text and "## Memory pressure" in text
    path = tmp_path / "claims.json"
    path.write_text(json.dumps(metrics.json_safe(doc), default=float, allow_nan=False))
    assert json.loads(path.read_text())["claims"][0]["id"] == "s6_throughput"


def test_from_json_re_renders_a_run_and_takes_the_fp8_row_from_precision_json(doc, tmp_path):
    """A report merged from earlier runs (`--from-json`, which simulates nothing) gets its FP8 row from a separate
    `skvs micro precision --json` result when one is passed."""
    run = tmp_path / "run" / "claims.json"
    run.parent.mkdir()
    run.write_text(json.dumps(metrics.json_safe(doc), default=float, allow_nan=False))
    k4 = lambda acc: {"4": {"acceptance": acc, "drafted": 400, "acceptance_vs_fp32_same_text": acc / 0.8,  # noqa: E731
                            "acceptance_vs_fp32": acc / 0.8}}
    precision = tmp_path / "precision.json"
    precision.write_text(json.dumps({"results": {"float32": k4(0.8), "float8_e4m3fn": k4(0.78),
                                                 "bfloat16": k4(0.79)}}))
    out, report = tmp_path / "out", tmp_path / "claims.md"
    base = ["--from-json", str(run), "--out", str(out), "--doc", str(report), "--no-plot", "--note", "merged"]
    parser = argparse.ArgumentParser()
    claims.add_arguments(parser)
    assert claims.run(parser.parse_args(base)) == 0
    assert "untested here" in [r for r in report.read_text().splitlines() if "FP8 KV" in r][0]
    assert claims.run(parser.parse_args(base + ["--precision-json", str(precision)])) == 0
    row = [r for r in report.read_text().splitlines() if "FP8 KV" in r][0]
    assert "fp8/fp32 acceptance 0.975" in row and "untested here" not in row
    assert (out / "claims.md").read_text() == report.read_text()


def test_the_rules_turn_on_the_numbers():
    """No hard-coded verdicts: the same rule gives each verdict for the numbers that call for it."""
    assert claims.rule_effect(0.21, 0.15, 0.3, 0.21) == "holds"
    assert claims.rule_effect(0.08, 0.06, 0.1, 0.21) == "direction only"
    assert claims.rule_effect(-0.05, -0.1, 0.0, 0.21) == "refuted"
    assert claims.rule_effect(-0.3, -0.35, -0.25, -0.26) == "holds"
    assert claims.rule_effect(math.nan, 0, 0, 0.2) == "inconclusive"
    assert claims.rule_at_most(0.9, 1.0) == "holds" and claims.rule_at_most(1.1, 1.0) == "refuted"
    assert claims.rule_share(0.1, 0.15) == "holds" and claims.rule_share(0.003, 0.15) == "refuted"
    assert claims.rule_noise(0.08, 0.02, 0.07) == "holds" and claims.rule_noise(0.01, 0.02, 0.07) == "inconclusive"
    assert claims.combine([("a", "holds"), ("b", "refuted")]) == "holds only when a"
    assert claims.combine([("a", "holds"), ("b", "holds")]) == "holds"


def test_the_bound_counts_generations_and_the_widest_recent_batch():
    pol = scn.policy("skvs_article", 4)  # pool, generation threshold 8: 9 generations
    seqs = np.asarray([2, 5, 1, 0] + [0] * 10)
    b = scn.spec_bound(pol, 16, seqs)
    assert b[0] == 1 * 2 * 9 and b[3] == 5 * 9 and b[-1] == 0
    assert scn.spec_bound(scn.policy("naive_spec", 4), 2, seqs)[1] == 2 * 5  # ceil(4 / 2) blocks, no pool
    assert not scn.spec_bound(scn.policy("vllm_default", 4), 16, seqs).any()


def test_the_phased_row_compares_skvs_with_the_best_fixed_k_per_phase_and_seed():
    """Synthetic lanes: the best fixed K differs by phase and seed; the row's cases take the worst seed."""
    def lanes(p99, p50=None, thr=100.0):
        return {"lanes": [{"throughput": thr, "phase": [{"tpot_p99": v, "tpot_p50": (p50 or v) / 2} for v in seed]}
                          for seed in p99]}

    pols = {name: lanes([[2.0, 3.0], [2.0, 3.0]]) for name in scn.FIXED_K}
    pols["naive_spec:1"] = lanes([[1.0, 4.0], [3.0, 4.0]])
    pols["skvs"] = lanes([[1.0, 3.0], [1.5, 3.3]], thr=101.0)
    row, = claims.claim_tail_phased({"phased": {"policies": pols}}, None, "x {}")
    inputs = {c["condition"]: c["inputs"][0] for c in row["cases"]}
    assert inputs["phase 0: P99 / best fixed K"] == 1.0  # seed 0: 1.0 / 1.0; seed 1: 1.5 / 2.0
    assert inputs["phase 1: P99 / best fixed K"] == pytest.approx(1.1)
    assert inputs["phase 1: P99 / no speculation"] == pytest.approx(1.1)
    assert row["verdict"] == claims.verdict_of(row) and row["verdict"].startswith("holds only when")
    assert "throughput / best fixed K 1.010-1.010x" in row["ours"]
    missing, = claims.claim_tail_phased({}, None, "x {}")
    assert missing["ours"] == "not run" and not missing["cases"]
