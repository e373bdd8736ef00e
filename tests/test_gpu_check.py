"""`skvs gpu-check`, the project's one GPU script, exercised on this CPU (`--cpu-smoke`); never a GPU figure."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import attention
from pallas_kernels import gpu_check as kernel_check
from skvs_jax import commands
from skvs_jax.commands import gpu_check, micro_host


def test_without_a_gpu_it_says_so_and_checks_nothing(capsys):
    assert commands.main(["gpu-check"]) == 2
    assert "no GPU visible" in capsys.readouterr().out


def test_it_refuses_an_unknown_section():
    with pytest.raises(SystemExit, match="unknown section"):
        commands.main(["gpu-check", "--cpu-smoke", "--only", "kernels,bogus"])


def test_the_kernels_section_runs_end_to_end_on_the_cpu(capsys, tmp_path):
    out_file = tmp_path / "check.json"
    assert commands.main(["gpu-check", "--cpu-smoke", "--only", "kernels", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "== kernels: ok" in out and "FAIL" not in out and "all sections passed" in out
    rows = json.loads(out_file.read_text())["sections"]["kernels"]
    assert [r["case"] for r in rows] == ["decode Q=1 ctx 256", "verify Q=5 (K=4) ctx 256"]
    assert all(r["skvs_pallas_ms"] > 0 for r in rows)


def test_the_tune_section_sweeps_and_writes_its_rows(capsys, tmp_path):
    """The sweep end to end (interpreted, tiny sizes): a row per shape with the default and the best config, every
    config checked against the reference, and the rows in the --out file; the timings mean nothing here."""
    out_file = tmp_path / "check.json"
    assert commands.main(["gpu-check", "--cpu-smoke", "--only", "tune", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "== tune: ok" in out and "verification / decode at ctx 64" in out and f"written to {out_file}" in out
    doc = json.loads(out_file.read_text())
    assert doc["device"] == "cpu" and doc["jax"] and list(doc["sections"]) == ["tune"]
    rows = doc["sections"]["tune"]
    assert [(r["Q"], r["ctx"]) for r in rows] == [(1, 64), (5, 64)]
    for r in rows:
        assert r["complete"] and r["best"]["ms"] > 0 and r["default"] == r["configs"][0]
        assert r["default"]["pages_per_step"] == 4 and r["default"]["num_warps"] == 4  # today's defaults at S=16
        assert all(e["correct"] for e in r["configs"]) and r["hbm_fraction"] is None  # no peak known for a CPU
        assert r["shape_key"]["context"] == "<=512" and r["table_entry"].startswith("('cpu', ShapeKey(")
    assert rows[0]["verify_over_decode"] is None and rows[1]["verify_over_decode"] > 0


@pytest.mark.slow  # the default run's time budget (docs: `pytest -m slow`); tests/test_sim_fidelity.py covers its parts
def test_the_engine_section_serves_the_three_presets_and_the_simulators_prediction(capsys, tmp_path):
    """The 8B-shape section at its smoke size (the tiny shape cut to 2 layers, 6 requests): every preset served
    with the oracle drafter, its outputs those of the reference pass, the simulated schedule the engine's (same
    steps, no counter differs), and the rows in the --out file."""
    out_file = tmp_path / "check.json"
    assert commands.main(["gpu-check", "--cpu-smoke", "--only", "engine", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "== engine: ok" in out and "skvs / naive_spec" in out and "simulator priced as cpu-measured" in out
    rows = json.loads(out_file.read_text())["sections"]["engine"]
    assert [r["policy"] for r in rows] == ["vllm_default", "naive_spec", "skvs"]
    for r in rows:
        assert r["outputs_as_reference"] == r["requests"] == 6 and r["counters_differ"] == {}
        assert r["real"]["steps"] == r["simulated"]["steps"] > 0 and r["simulated"]["throughput"] > 0


def test_the_sweep_times_at_most_24_configs_per_gpu_shape_with_the_default_first():
    for ctx in kernel_check.TUNE_CONTEXTS:
        d = kernel_check.TUNE_DIMS
        first = kernel_check.tilings(B=d["B"], Hkv=d["Hkv"], S=d["S"], M=ctx // d["S"], interpret=False, small=False)
        assert first[0] == attention.resolve_config(None, B=d["B"], Hkv=d["Hkv"], S=d["S"], M=ctx // d["S"],
                                                    interpret=False)
        assert len(set(first)) == len(first)
        second = kernel_check.launch_variants(first, small=False)
        assert len(first) + len(second) <= kernel_check.MAX_TUNE_CONFIGS


def test_a_wrong_config_cannot_win_and_the_budget_is_respected(capsys):
    """A config whose output disagrees with the reference is recorded as wrong and never timed; a spent budget
    stops the sweep before any shape (what was measured, nothing, is returned)."""
    d = kernel_check.TUNE_DIMS_SMALL
    q, kp, vp, tables, lens = kernel_check._tune_pool(jax.random.key(0), np.random.default_rng(0), Q=1, ctx=32,
                                                      copies=1, dtype=jnp.dtype(jnp.float32), **d)
    args = [(q, kp, vp, tables[0], lens)]
    want = pk.paged_attention_reference(*args[0]) + 1.0  # not what the kernel computes
    entry = kernel_check._measure(pk.AttentionConfig(1, 1), args, want, 1e-5, interpret=True, repeats=1)
    assert entry["correct"] is False and entry["ms"] is None and entry["error"].startswith("WRONG")
    assert kernel_check.tune(np.random.default_rng(0), True, True, 1, budget_s=0.0) == []
    assert "budget of 0 s spent" in capsys.readouterr().out


def test_hbm_peak_by_device_kind():
    assert kernel_check.hbm_peak("NVIDIA H100 80GB HBM3") == 3.35e12
    assert kernel_check.hbm_peak("NVIDIA H200") == 4.8e12
    assert kernel_check.hbm_peak("cpu") is None


def test_the_serving_section_prints_every_figure_from_the_measurement(capsys, monkeypatch):
    """The section's report from `micro_host.measure`'s rows (stubbed here: the real run is the slow test below):
    per configuration throughput, dispatches per request, requests the loop admitted, idle per step; the N / 1 and
    skvs / naive_spec ratios."""
    def rows(r):
        return [dict(wall_s=1.0, device_s=0.9, host_share=0.1, visible=0.1, serial_s=1.1, sent=r, steps=100,
                     dispatches=r, per_request=r / 32, host_ms_per_step=1.0, tok_s=1000.0 * (2 if r < 50 else 1),
                     admitted=0 if r > 50 else 24, same_steps=True)]

    fake = {f"{p} N={n}": rows(100 if n == 1 else 20) for p in ("naive_spec", "skvs") for n in (1, "auto")}
    monkeypatch.setattr(micro_host, "measure", lambda *a, **k: fake)
    monkeypatch.setattr(gpu_check, "_round_trips", lambda name, smoke: f"{name}: width 5: 3 while, 2 cond")
    monkeypatch.setattr(gpu_check.jax, "default_backend", lambda: "gpu")
    assert commands.main(["gpu-check", "--only", "serving"]) == 0
    out = capsys.readouterr().out
    assert "skvs N=auto" in out and "1000" in out and "naive_spec: N=auto / N=1 throughput 2.000x" in out
    assert "admitted" in out and any(line.startswith("skvs N=auto") and " 24 " in line for line in out.splitlines())
    assert "skvs / naive_spec at N=1: 1.000x" in out and "skvs: width 5: 3 while, 2 cond" in out


def test_control_flow_counts_every_while_and_cond_inside_a_program():
    import jax
    import jax.numpy as jnp

    def f(x):
        def body(c):
            return jax.lax.cond(c[0] > 2, lambda v: (v[0] + 1, v[1] * 2), lambda v: (v[0] + 1, v[1]), c)

        y = jax.lax.while_loop(lambda c: c[0] < 5, body, (x, x))[1]
        return jax.jit(lambda z: jax.lax.cond(z > 0, jnp.sin, jnp.cos, z))(y)

    assert gpu_check.control_flow(jax.make_jaxpr(f)(1.0)) == {"while": 1, "cond": 2}


@pytest.mark.slow  # compiles the engine at two steps per dispatch (~3 min here)
def test_the_whole_script_runs_end_to_end_on_the_cpu(capsys, tmp_path):
    assert commands.main(["gpu-check", "--cpu-smoke", "--out", str(tmp_path / "check.json")]) == 0
    out = capsys.readouterr().out
    assert "== serving: ok" in out and "skvs: N=auto / N=1 throughput" in out
    assert "== engine: ok" in out and "real throughput:" in out
    # The sections whose rows go to --out (the engine's since 4d1080b added it; this test still asked for two).
    assert sorted(json.loads((tmp_path / "check.json").read_text())["sections"]) == ["engine", "kernels", "tune"]


def test_micro_program_prints_the_counts_of_each_target(capsys):
    """`skvs micro program` (what the program section's counts come from), traced only: one policy, the small size."""
    assert commands.main(["micro", "program", "--policies", "skvs", "--sizes", "small", "--no-compile",
                          "--no-step"]) == 0
    out = capsys.readouterr().out
    assert "skvs / cpu" in out and "skvs / gpu" in out and "skvs: gpu / cpu heavy primitives" in out
    with pytest.raises(SystemExit, match="--sizes"):
        commands.main(["micro", "program", "--sizes", "huge"])
