"""The `skvs` command line: version, help, and the allocator and scheduler micro-benchmarks at a tiny size."""

import argparse
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import types

import jax.numpy as jnp
import numpy as np
import pytest

from skvs_jax import __version__, commands, metrics, policies, workloads
from skvs_jax.commands import bench, bench_report, bench_serving
from skvs_jax.config import CacheConfig
from skvs_jax.sim import cost_model


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exc:
        commands.main(["--version"])
    assert exc.value.code == 0 and __version__ in capsys.readouterr().out
    assert commands.main([]) == 0
    out = capsys.readouterr().out
    assert __version__ in out and "micro" in out


def test_micro_allocator_small_run_prints_its_ratios(capsys):
    argv = "micro allocator --seqs 8 --blocks 512 --max-blocks-per-seq 64 --steps 4 --steps-per-call 2"
    assert commands.main(argv.split() + ["--dispatch-steps", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "identical states" in "\n".join(lines)  # the run checks the batched allocator against the oracle
    # ... and the scheduler's one-pass form against the two calls, timed beside them
    assert re.search(r"allocate_step: slots \+ drafts one pass +median +[0-9.]+ us/step .* [0-9.]+x the two calls",
                     "\n".join(lines))
    # ... and the scan's own per-step cost, timed in the same rounds, with both figures net of it
    assert re.search(r"the scan's floor: a step that allocates nothing +[0-9.]+ us/step .*net of it: two calls "
                     r"-?[0-9.]+, allocate_step -?[0-9.]+\)", "\n".join(lines))
    assert re.fullmatch(r"allocator speedup vs sequential jax search: [0-9.]+x", lines[-2])
    assert re.fullmatch(r"allocator speedup vs python oracle: [0-9.]+x", lines[-1])


# Slow-marked for the default run's time budget: a benchmark's report; the refusal test below runs its checks.
@pytest.mark.slow
def test_micro_scheduler_small_run_prints_its_ratio(capsys):
    argv = ("micro scheduler --seqs 8 --blocks 512 --max-blocks-per-seq 16 --prompt-len 24 --calls 1 "
            "--steps-per-call 2")
    assert commands.main(argv.split()) == 0
    out = capsys.readouterr().out
    assert "identical states: True" in out and "allocation always ok: True" in out
    assert re.fullmatch(r"scheduler speedup vs python oracle: [0-9.]+x", out.strip().splitlines()[-1])


@pytest.mark.slow  # the default run's time budget (docs: `pytest -m slow`)
def test_simulate_sweeps_load_per_policy_and_writes_json_and_plot(tmp_path, capsys):
    """`skvs simulate --sweep` on a small configuration: one compiled call per policy over rates x seeds, the
    per-load table with each speculating policy's speedup and a verdict line, JSON with every lane, the plot."""
    argv = (f"simulate --requests 6 --seeds 2 --max-seqs 4 --max-prompt-len 32 --max-output-len 16 --verify-budget "
            f"knee --policies vllm_default,skvs --sweep --rates 2,64 --chunk 64 --out {tmp_path}").split()
    assert commands.main(argv) == 0
    out = capsys.readouterr().out
    assert "llama-3.1-8b on 1 x a100-80gb" in out and "skvs TPOT speedup" in out
    knee = int(cost_model.CostModel(cost_model.MODELS["llama-3.1-8b"], cost_model.DEVICES["a100-80gb"]).knee_tokens())
    assert f"skvs verify budget {knee};" in out and 128 <= knee <= 256
    assert re.search(r"^skvs: TPOT speedup over vllm_default (falls below 1\.0x from rate|>= 1\.0x at every)", out,
                     re.MULTILINE)
    doc = json.loads((tmp_path / "simulate.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert set(doc["lanes"]) == {"vllm_default", "skvs"} and len(doc["lanes"]["skvs"]) == 4  # 2 rates x 2 seeds
    assert {lane["request_rate_per_s"] for lane in doc["lanes"]["skvs"]} == {2.0, 64.0}
    assert all(lane["num_aborted"] == 0 for lanes in doc["lanes"].values() for lane in lanes)
    assert set(doc["by_rate"]) == {"2.0", "64.0"} and (tmp_path / "simulate.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="unknown policy"):
        commands.main(["simulate", "--policies", "nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--verify-budget"):
        commands.main(["simulate", "--verify-budget", "0", "--out", str(tmp_path)])


@pytest.mark.parametrize("flags, says", [
    ("--sweep --rates abc", "--rates must be comma-separated numbers"),
    ("--sweep --rates 4,,8", "--rates must be comma-separated numbers"),
    ("--sweep --rates 0,4", "--rates must be > 0"),
    ("--rate nan", "--rate must be > 0"),
    ("--sweep --rate 0", "--rate must be > 0"),  # crashed in sweep's lane checks
    ("--workload system_prompts --max-prompt-len 100", "--max-prompt-len must be > 128"),
    ("--scale 0", "--scale must be a finite number > 0"),
    ("--token-budget 0", "--token-budget must be >= 1"),
    ("--max-output-len 0", "--max-output-len must be >= 1"),
    ("--prefill-chunk -1", "--prefill-chunk must be >= 0"),
    ("--kv-blocks 2", "--kv-blocks 2 holds fewer blocks than one request can need"),
    ("--policies ,", "--policies names no policy"),
    ("--device cpu-measured", "pass --kv-blocks"),
    ("--host-blocks -1", "--host-blocks must be >= 0"),
    ("--policies skvs:colour=red", "unknown key 'colour'"),
    ("--policies vllm_default:kv_precision=int8", "kv_precision is not a per-policy switch here"),
    ("--policies skvs,skvs", "two policies are named 'skvs'"),
])
def test_simulate_refuses_bad_flags_before_simulating(flags, says, tmp_path, monkeypatch):
    from skvs_jax.sim import sweep

    monkeypatch.setattr(sweep, "run", lambda *a, **k: pytest.fail("a bad flag must be refused before simulating"))
    with pytest.raises(SystemExit, match=re.escape(says)):
        commands.main(["simulate", "--out", str(tmp_path), *flags.split()])


def test_simulate_host_link_flag_reaches_the_cost_model(tmp_path, monkeypatch):
    """--host-link picks the link swaps are priced over; without it the device's own (PCIe Gen5 on an H100)."""
    from skvs_jax.sim import sweep

    class Stop(Exception):
        pass

    seen = []

    def record(*args, cost, **kwargs):
        seen.append(cost.host_link)
        raise Stop

    monkeypatch.setattr(sweep, "run", record)
    base = ["simulate", "--out", str(tmp_path), "--device", "h100-sxm", "--requests", "4", "--max-seqs", "4",
            "--max-prompt-len", "32", "--max-output-len", "16", "--policies", "vllm_default"]
    for flags in ([], ["--host-link", "nvlink-c2c"], ["--host-link", "pcie-gen4-x16"]):
        with pytest.raises(Stop):
            commands.main(base + flags)
    assert seen == ["pcie-gen5-x16", "nvlink-c2c", "pcie-gen4-x16"]
    with pytest.raises(SystemExit):
        commands.main(base + ["--host-link", "usb-2"])


def _sim_args(*flags):
    from skvs_jax.commands import simulate

    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    return parser.parse_args(["--requests", "8", "--seeds", "2", "--max-prompt-len", "32", "--max-output-len", "16",
                              *flags])


def test_simulate_lanes_know_their_rate_and_seed_and_think_times_are_not_scaled():
    from skvs_jax import scheduler as sc
    from skvs_jax.commands import simulate

    cfg = sc.SchedulerConfig(cache=CacheConfig(num_blocks=65, block_size=16, max_seqs=4, max_blocks_per_seq=4),
                             policy=policies.skvs(4), max_running=4, token_budget=64)
    alphas = np.full(4, 0.5)
    # A Poisson workload is swept by scaling one trace per seed; 8 / (8 / 0.9) != 0.9 in floats, so a lane's rate
    # must come from its label, not from dividing back.
    args = _sim_args("--sweep", "--rates", "0.9,4")
    trace_rates, lanes, where = simulate._lanes(args, cfg, [0.9, 4.0])
    assert trace_rates == [8.0] and sorted(where) == [(0.9, 0), (0.9, 1), (4.0, 0), (4.0, 1)]
    # A multi-turn trace's later turns follow think times: one trace per rate and seed, none scaled.
    args = _sim_args("--workload", "multi_turn", "--sweep", "--rates", "2,64")
    trace_rates, lanes, where = simulate._lanes(args, cfg, [2.0, 64.0])
    assert trace_rates == [2.0, 64.0] and np.all(np.asarray(lanes.arrival_scale) == 1.0)
    traces = simulate._traces(args, cfg, alphas, trace_rates)
    for i, (rate, seed) in enumerate(where):
        direct = workloads.make("multi_turn", 8, seed=seed, rate=rate, scale=1.0, max_prompt_len=32, max_output_len=16)
        lane_arrivals = np.asarray(traces.arrival)[int(lanes.trace[i])]
        np.testing.assert_allclose(np.sort(lane_arrivals), np.sort([r.arrival_time for r in direct.requests]),
                                   rtol=1e-6)
    # --rate inf (all at t = 0) without --sweep: one lane per seed, unscaled.
    args = _sim_args("--rate", "inf")
    trace_rates, lanes, where = simulate._lanes(args, cfg, [math.inf])
    assert where == [(math.inf, 0), (math.inf, 1)] and np.all(np.asarray(lanes.arrival_scale) == 1.0)
    assert np.all(np.asarray(simulate._traces(args, cfg, alphas, trace_rates).arrival) == 0)


def test_simulate_verdict_makes_no_claim_where_tpot_is_undefined():
    from skvs_jax.commands import simulate

    nan = math.nan
    by_rate = {4.0: {"vllm_default": {"median_tpot_ms": nan, "mean_batch": 1.0},
                     "naive_spec": {"median_tpot_ms": nan, "mean_batch": 1.0}}}
    (line,) = simulate._verdicts(by_rate, ["vllm_default", "naive_spec"])
    assert "undefined at rate(s) 4" in line and ">= 1.0x" not in line
    by_rate[8.0] = {"vllm_default": {"median_tpot_ms": 20.0, "mean_batch": 4.0},
                    "naive_spec": {"median_tpot_ms": 10.0, "mean_batch": 4.0}}
    lines = simulate._verdicts(by_rate, ["vllm_default", "naive_spec"])
    assert lines[1] == "naive_spec: TPOT speedup over vllm_default >= 1.0x at every rate swept with a TPOT (min 2.00x)"


@pytest.mark.parametrize("argv, says", [
    ("micro allocator --dispatch-steps 1", "skvs micro allocator: --dispatch-steps must be >= 2"),
    ("micro allocator --steps-per-call 0", "skvs micro allocator: --steps-per-call must be >= 1"),
    ("micro precision --new-tokens 1", "--new-tokens >= --max-draft-len + 2"),
    ("micro precision --new-tokens 3 --max-draft-len 2", "--new-tokens >= --max-draft-len + 2"),  # NaN acceptance
    ("micro scheduler --seqs 2 --blocks 64", "skvs micro scheduler: max_blocks_per_seq"),  # tracebacks
    ("micro allocator --seqs 2 --blocks 64", "skvs micro allocator: max_blocks_per_seq"),
    ("micro scheduler --draft-len -1", "skvs micro scheduler: --draft-len must be >= 0"),
    ("micro simulate --steps 0", "skvs micro simulate: --steps must be >= 1"),
    ("micro simulate --max-seqs 0", "skvs micro simulate: --max-seqs must be >= 1"),
    ("micro scheduler --calls 0", "skvs micro scheduler: --calls must be >= 1"),
    # a pool that cannot hold the batch in decode: timing it would describe an empty batch
    ("micro scheduler --seqs 8 --blocks 12 --max-blocks-per-seq 8 --block-size 8 --prompt-len 24",
     "of 8 sequences decode (the pool or the table is too small)"),
    # --accept-prob is a probability (it used to accept 2 and -0.5)
    ("micro allocator --accept-prob 2", "skvs micro allocator: --accept-prob must lie in [0, 1], got 2.0"),
    ("micro scheduler --accept-prob -0.5", "skvs micro scheduler: --accept-prob must lie in [0, 1], got -0.5"),
    ("micro scheduler --accept-prob nan", "skvs micro scheduler: --accept-prob must lie in [0, 1], got nan"),
])
def test_micro_benchmarks_refuse_what_they_cannot_measure(argv, says):
    with pytest.raises(SystemExit, match=re.escape(says)):
        commands.main(argv.split())


def test_micro_attention_takes_its_flags(capsys):
    argv = ("micro attention --batch 2 --context 64 --heads 4 --kv-heads 2 --head-dim 16 --block-size 16 --repeats 2 "
            "--warmup 0 --with-reference")
    assert commands.main(argv.split()) == 0  # the flags reach the benchmark (argparse.REMAINDER refused every one)
    out = capsys.readouterr().out
    assert "paged (gather-then-dense)" in out and re.fullmatch(r"paged/dense time ratio: [0-9.]+",
                                                               out.strip().splitlines()[-1])
    with pytest.raises(SystemExit, match="skvs micro attention: --kv-heads must be >= 1"):
        commands.main(["micro", "attention", "--kv-heads", "0"])


def test_micro_compile_times_a_cut_shape_scanned_and_unrolled(capsys):
    argv = "micro compile --shapes tiny:2 --widths 1 --batch 2 --blocks 8 --max-blocks-per-seq 4 --dtype float32"
    assert commands.main(argv.split()) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("tiny")]
    assert [(r[0], r[1], r[3], r[4]) for r in rows] == [("tiny", "2", "scan", "1"), ("tiny", "2", "unrolled", "1")]
    assert rows[1][-1].endswith("x")  # unrolled / scan
    for bad, says in (("--shapes llama-9", "model shape must be one of"), ("--programs loop", "--programs"),
                      ("--widths 0", "--widths")):
        with pytest.raises(SystemExit, match=re.escape("skvs micro compile: ") + ".*" + re.escape(says)):
            commands.main(["micro", "compile", *bad.split()])


@pytest.mark.slow  # the default run's time budget (docs: `pytest -m slow`)
def test_micro_simulate_small_run_prints_its_ratio(capsys):
    argv = "micro simulate --max-seqs 4 --requests 6 --points 8 --steps 32 --max-prompt-len 32 --max-output-len 16"
    assert commands.main(argv.split()) == 0
    out = capsys.readouterr().out
    assert out.count("per-step output identical: True") == 2  # map and vmap agree with the separate runs
    assert re.fullmatch(r"sweep speedup vs sequential: [0-9.]+x", out.strip().splitlines()[-1])


@pytest.mark.slow  # the default run's time budget (docs: `pytest -m slow`)
def test_generate_streams_a_continuation(capsys):
    assert commands.main(["generate", "Return the number of ", "--max-tokens", "12", "--plain"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Return the number of ") and "-- 12 tokens in" in out and "policy skvs" in out
    assert commands.main(["generate", ""]) == 2
    assert commands.main(["generate", "hi", "--draft-len", "0"]) == 2  # a bad flag is an error line, not a traceback
    assert "draft_len must be >= 1" in capsys.readouterr().err
    # An argument that is not UTF-8 reaches Python as surrogate escapes: its bytes are the prompt, and the echo
    # (one incremental decoder over the prompt and the continuation) replaces what does not decode.
    assert commands.main(["generate", "Return \udcff", "--max-tokens", "2", "--plain"]) == 0
    assert capsys.readouterr().out.startswith("Return \ufffd")


@pytest.mark.slow  # compiles a second model; tests/test_llm.py serves the same checkpoint's text in the default run
def test_generate_speaks_a_checkpoints_text(tmp_path, capsys):
    """`skvs generate --model DIR` on a checkpoint with a BPE tokenizer.json: the prompt is encoded by it and the
    stream decoded by it (the printed continuation is the tokenizer's decode of the greedy tokens); `--chat` renders
    the text through the checkpoint's template; a checkpoint with neither a tokenizer nor 256 tokens is refused."""
    from reference_models import checkpoint, greedy_generate
    from skvs_jax.serve.tokenizer import load_tokenizer
    from skvs_jax.testing import text_checkpoint

    folder = text_checkpoint.make_checkpoint(tmp_path / "bpe")
    tok = load_tokenizer(folder)
    model = checkpoint.load_llama(folder)
    prompt = "Return the list of"
    ids = tok.encode(prompt)
    want = greedy_generate(model, np.asarray([ids]), 6)[0, len(ids):].tolist()
    argv = ["generate", prompt, "--max-tokens", "6", "--plain", "--ignore-eos", "--model", str(folder), "--medusa",
            str(folder / "medusa")]
    assert commands.main(argv) == 0
    body, summary = capsys.readouterr().out.rsplit("\n-- ", 1)
    assert body.replace("[", "").replace("]", "") == prompt + tok.decode(want)
    assert summary.startswith("6 tokens in") and "finished: length" in summary
    assert commands.main([*argv[:-4], "--chat", "--policy", "vllm_default", "--model", str(folder)]) == 0
    assert capsys.readouterr().out.startswith(prompt + "\n")
    import dataclasses

    from flax import nnx

    from reference_models.llama import Llama

    small = Llama(dataclasses.replace(model.config, vocab_size=100), rngs=nnx.Rngs(0))  # no tokenizer.json
    checkpoint.save_llama(small, tmp_path / "bare")
    assert commands.main(["generate", "hi", "--policy", "vllm_default", "--model", str(tmp_path / "bare")]) == 2
    assert "no tokenizer.json, and its 100-token vocabulary cannot hold bytes" in capsys.readouterr().err


def test_console_script_entry_point_is_installed():
    out = subprocess.run([sys.executable, "-m", "skvs_jax.commands", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and __version__ in out.stdout


# ------------------------------------------------------------------------------------------ bench --ablation

# Throughput (tok/s) per policy in the stub below: without the release switch skvs gets faster (the switch
# hurts), without the pool slower (it helps); the pool also costs hit rate; the insert mode changes
# nothing (same counters and non-timing metrics), so its 10% is noise.
_STUB_THROUGHPUT = {"naive_spec": 120.0, "skvs": 100.0, "skvs -release": 150.0, "skvs -spec_pool": 60.0,
                    "skvs -insert": 90.0, "vllm_default": 70.0}


def _stub_serve(differ: str | None = None, stall: dict[str, set[int]] | None = None):
    """A stand-in for `bench_serving.serve` that returns fixed metrics per policy (and +-1 tok/s per repeat), so that
    the decomposition logic is tested without compiling an engine. `differ` names a policy whose outputs differ;
    `stall` maps a policy to the repeats in which one step takes 2 s (as when a program compiles in the timed
    run), at 5 tok/s."""
    repeats = {}

    def serve(model, heads, policy, cache, trace, args, progress=None, knobs=None, bucket_hist=None, fitted=None,
              rehearsal=False):
        if rehearsal:  # `--rehearse`: its result is dropped, its fit reused
            return {"fitted": None}
        i = repeats[policy.name] = repeats.get(policy.name, -1) + 1
        stalled = i in (stall or {}).get(policy.name, ())
        m = {key: 0.5 for key, _, _ in metrics.METRICS}
        m |= {"output_tokens_per_s": 5.0 if stalled else _STUB_THROUGHPUT[policy.name] + (-1.0, 1.0, 0.0)[i % 3],
              "kv_hit_rate": 0.5 if policy.name == "skvs -spec_pool" else 0.4,
              "spec_kv_waste": 0.1 if policy.name == "naive_spec" else 0.01}
        m |= {"num_requests": 3.0, "num_aborted": 0.0, "num_steps": 4.0, "output_tokens": 12.0, "wall_time_s": 0.1}
        outputs = {0: [1, 2, 3], 1: [4, 5] + ([9] if policy.name == differ else [6])}
        series = {"time_s": [0.02, 0.04, 2.06, 2.1] if stalled else [0.02, 0.04, 0.06, 0.1],
                  "output_tokens": [3] * 4, "blocks_used": [1] * 4,
                  "spec_blocks": [0] * 4}
        counters = {"drafted": 8 if policy.name in ("skvs", "skvs -insert") else 9}
        fit = {"1": 1000.0, "5": 1500.0, "32": 3000.0} if policy.name == "skvs" else {}
        widths = {"5": 1, "32": 3} if policy.name == "naive_spec" else {"3": 2, "32": 2}
        return {"metrics": m, "outputs": outputs, "series": series, "counters": counters, "compiled": [[5, False]],
                "step_cost_us": fit, "width_hist": widths}

    return serve


_STUB_STEP_US = {"naive_spec": {"5": 1000.0, "32": 2000.0}, "skvs": {"5": 1050.0, "32": 2200.0}}


def _patch_serve(monkeypatch, serve):
    """`serve` stands in for `bench_serving.serve`, and for each run of `bench_serving.serve_together` (lockstep
    rounds, the default), called in the order the round gives; a round asked for equal-width step times gets
    `_STUB_STEP_US`'s (1000 us a step where a policy has none)."""
    monkeypatch.setattr(bench_serving, "serve", serve)

    def together(calls, equal_widths=False):
        results = [serve(**call) for call in calls]
        if equal_widths:
            for call, result in zip(calls, results, strict=True):
                result["equal_width_us"] = _STUB_STEP_US.get(call["policy"].name, {"5": 1000.0, "32": 1000.0})
        return results

    monkeypatch.setattr(bench_serving, "serve_together", together)


def _keep_ablations(monkeypatch, *names):
    """`policies.ablations` reduced to the named switches."""
    full = policies.ablations
    monkeypatch.setattr(policies, "ablations", lambda base=None: {
        n: p for n, p in full(base).items() if n.removeprefix("skvs -") in names})


@pytest.fixture
def two_ablations(monkeypatch):
    _keep_ablations(monkeypatch, "release", "spec_pool")


def test_bench_ablation_decomposes_by_switch(tmp_path, capsys, monkeypatch):
    _keep_ablations(monkeypatch, "release", "spec_pool", "insert")
    _patch_serve(monkeypatch, _stub_serve(stall={"skvs -spec_pool": {0}}))
    argv = ["bench", "--ablation", "--requests", "3", "--max-output", "6", "--repeats", "3", "--quiet", "--no-plot",
            "--out", str(tmp_path)]
    assert commands.main(argv) == 0
    out = capsys.readouterr().out
    assert "greedy outputs identical across policies: True (5 policies x 3 repeats checked)" in out
    assert "non-timing metrics identical across repeats: True" in out
    assert "naive_spec 120 [119-121]" in out  # median [min-max]
    # Every run's steps priced by skvs's fit (width 3 interpolated between 1 and 5: 1250 us): naive_spec
    # 1500 + 3 x 3000 us, the others 2 x 1250 + 2 x 3000.
    assert ("steps priced by skvs's fit (each reported run's steps by width, without the clock's noise): naive_spec "
            "10.5 ms, skvs 8.5 ms (0.81x naive_spec)") in out
    priced = json.loads((tmp_path / "bench.json").read_text())["priced_schedules"]
    assert priced["fit_of"] == "skvs" and priced["ms"]["skvs -release"] == pytest.approx(8.5)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert {"(none: skvs)", "release", "spec_pool", "insert", "all (naive_spec)"} <= set(rows)
    # 150 / 100, [151 / 101 .. 149 / 99] within rounds; engine steps
    assert rows["release"].split(" | ")[1:3] == ["1.50x [1.50-1.51]", "4 (±0)"]
    # The stalled first run is left out: 61 / 100, [60 / 100 .. 61 / 101]; hit rate off, change vs skvs.
    assert rows["spec_pool"].split(" | ")[1] == "0.61x [0.60-0.60]"
    assert "| 50.0 (+10.0) |" in rows["spec_pool"]
    assert "warning: 1 of 3 runs of skvs -spec_pool had one step of up to 2.0 s" in out
    assert "excluded from its median and range" in out
    assert "switches that help throughput (skvs is faster with them): spec_pool" in out
    assert "switches that hurt throughput (skvs is faster without them): release" in out
    assert "switches that change nothing on this trace (schedule identical to skvs's" in out
    assert "skvs vs naive_spec overall: skvs throughput 0.83x naive_spec's (beyond noise)" in out
    # The headline: the table's skvs / naive_spec throughput, its 95% t-interval over the three rounds' ratios.
    lo, hi = bench_report.t_interval([99 / 119, 101 / 121, 100 / 120])
    assert (f"headline: skvs / naive_spec output throughput {100 / 120:.3f}x; over 3 rounds, per-round ratios' "
            f"geometric mean 0.833x, 95% t-interval {lo:.3f}-{hi:.3f}x (excludes 1: the difference is resolved)") in out

    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["schema_version"] == bench.SCHEMA_VERSION == 3 and doc["identical_greedy_outputs"] is True
    assert list(doc["policies"]) == ["naive_spec", "skvs", "skvs -release", "skvs -spec_pool", "skvs -insert"]
    assert doc["config"]["policies"] == "naive_spec,skvs,skvs -release,skvs -spec_pool,skvs -insert"
    assert doc["runs"]["output_tokens_per_s"]["skvs"] == [99.0, 101.0, 100.0]
    assert doc["headline"]["ci95"] == pytest.approx([lo, hi]) and doc["headline"]["contains_1"] is False
    a = doc["ablation"]
    assert list(a["rows"]) == ["release", "spec_pool", "insert", "naive_spec"] and a["repeats"] == 3
    release, barrier = a["rows"]["release"], a["rows"]["spec_pool"]
    assert release["changes"] == {"release": "lazy"} and release["throughput_effect"] == "hurts"
    assert barrier["throughput_effect"] == "helps" and barrier["worse"] == ["kv_hit_rate"] and not barrier["better"]
    assert barrier["metrics"]["kv_hit_rate"] == {"off": 0.5, "skvs": 0.4, "change": pytest.approx(0.1)}
    assert release["share_of_gap"] == pytest.approx((100 - 150) / (100 - 120))
    assert barrier["metrics"]["output_tokens_per_s"]["paired"][0] is None
    assert doc["runs"]["stalled"]["skvs -spec_pool"] == [True, False, False]
    assert not any(doc["runs"]["stalled"]["skvs"])
    assert a["rows"]["naive_spec"]["better"] == ["spec_kv_waste"]
    assert a["rows"]["insert"]["identical_schedule"] and a["rows"]["insert"]["throughput_effect"] == "none"


def test_bench_repeats_report_each_policys_throughput_over_naive_spec_within_each_round(tmp_path, capsys,
                                                                                        monkeypatch):
    _patch_serve(monkeypatch, _stub_serve(stall={"skvs": {1}}))
    argv = ["bench", "--policies", "naive_spec,skvs", "--requests", "3", "--repeats", "3", "--quiet", "--no-plot",
            "--out", str(tmp_path)]
    assert commands.main(argv) == 0
    out = capsys.readouterr().out
    # Rounds: skvs 99 / 119 and 100 / 120; the second round (skvs stalled) is left out.
    lo, hi = bench_report.bootstrap_median_ci([99 / 119, 100 / 120])
    assert "throughput / naive_spec's within each round, median [min-max] (95% bootstrap interval of the median; " \
           f"rounds above 1): skvs {(99 / 119 + 100 / 120) / 2:.3f}x [{99 / 119:.3f}-{100 / 120:.3f}] " \
           f"({lo:.3f}-{hi:.3f}; 0 of 2)" in out
    assert ("headline: skvs / naive_spec output throughput 0.833x (2 rounds, too few for an interval; --repeats 3 "
            "or more gives its 95% interval)") in out  # the stalled round is left out
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["runs"]["paired_to_naive_spec"] == {"skvs": pytest.approx([99 / 119, 100 / 120])}
    assert doc["runs"]["paired_to_naive_spec_ci95"] == {"skvs": pytest.approx([lo, hi])}
    # ... and each policy's step at the widths both compile, timed in the first round, beside the first policy's
    assert ("one step at each width every policy compiles (empty slots, engines alternated, median us): width 5: "
            "naive_spec 1000, skvs 1050 (1.05x); width 32: naive_spec 2000, skvs 2200 (1.10x)") in out
    assert doc["equal_width_us"] == _STUB_STEP_US


def test_equal_width_steps_times_every_engine_at_the_widths_all_compile(monkeypatch):
    """`bench_serving.equal_width_steps`: the widths every engine compiles, one untimed step each, then each
    engine's median over the rounds of one step at each width on a fresh copy of its empty state
    (`serve.step_cost.measure`)."""
    class Fake:
        def __init__(self, name, widths, us):
            self.name, self.picker, self.us, self.calls = name, types.SimpleNamespace(widths=widths), us, []

        def _empty_state(self):
            return {"x": jnp.zeros(())}

        def _idle_step(self, state, width, branch, copy=True):
            self.calls.append((width, copy))
            clock[0] += self.us[width]  # the step's time, on the clock the function reads
            return state

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0] * 1e-6)
    a, b = Fake("a", (1, 5, 32), {1: 7.0, 5: 10.0, 32: 30.0}), Fake("b", (5, 32), {5: 12.0, 32: 33.0})
    got = bench_serving.equal_width_steps([a, b], rounds=3)
    assert got == [{"5": 10.0, "32": 30.0}, {"5": 12.0, "32": 33.0}]
    assert a.calls == [(5, False), (32, False)] * 4  # one untimed run each, then one timed a round


def test_bench_rounds_rotate_the_policies_order(tmp_path, monkeypatch):
    """Round r serves the policies rotated by r: each takes every place once in three rounds, and none runs right
    after itself (reversing every other round would put the end policies back to back at each seam)."""
    calls, stub = [], _stub_serve()

    def serve(model, heads, policy, *args, rehearsal=False, **kwargs):
        calls.append(policy.name + " (rehearsal)" * rehearsal)
        return stub(model, heads, policy, *args, rehearsal=rehearsal, **kwargs)

    _patch_serve(monkeypatch, serve)
    argv = ["bench", "--policies", "naive_spec,skvs,vllm_default", "--requests", "3", "--repeats", "3", "--quiet",
            "--no-plot", "--out", str(tmp_path)]
    assert commands.main(argv) == 0
    rehearsals, timed = calls[:3], calls[3:]  # every policy serves the trace once untimed first
    assert rehearsals == ["naive_spec (rehearsal)", "skvs (rehearsal)", "vllm_default (rehearsal)"]
    assert timed == ["naive_spec", "skvs", "vllm_default", "skvs", "vllm_default", "naive_spec",
                     "vllm_default", "naive_spec", "skvs"]
    assert all(a != b for a, b in zip(timed, timed[1:]))
    calls.clear()
    assert commands.main([*argv, "--no-rehearse"]) == 0
    assert calls == timed
    calls.clear()
    monkeypatch.setattr(bench_serving, "serve_together",
                        lambda _: pytest.fail("--no-lockstep serves one after another"))
    assert commands.main([*argv, "--no-lockstep"]) == 0
    assert calls[3:] == timed


def test_turn_clock_runs_only_during_turns_and_skips_waits():
    clock = bench_serving.TurnClock()
    assert clock() == 0.0
    clock.start()
    time.sleep(0.02)
    clock.stop()
    spent = clock()
    assert 0.02 <= spent < 0.5
    time.sleep(0.02)  # another engine's turn: not on this clock
    assert clock() == spent
    clock.skip(1.5)
    clock.skip(-1.0)  # an arrival already past: no time
    assert clock() == spent + 1.5
    clock.start()
    assert clock() >= spent + 1.5
    clock.stop()


def test_serve_together_steps_the_policies_in_turn_each_on_its_own_clock(monkeypatch):
    """One step of each busy policy in the order given, round after round; a policy's clock holds its own
    steps' time and none of the others' (on one shared wall clock each would be charged all of them)."""
    turns = []

    class Fake:
        def __init__(self, name, steps, clock):
            self.name, self.left, self.clock, self.seen, self.own = name, steps, clock, [], 0.0

        def busy(self):
            return self.left > 0

        def turn(self):
            self.seen.append(self.clock())
            t0 = time.perf_counter()
            time.sleep(0.01)
            self.own += time.perf_counter() - t0
            self.left -= 1
            turns.append(self.name)

        def result(self):
            return {"name": self.name, "clock": self.clock(), "seen": self.seen, "own": self.own}

    monkeypatch.setattr(bench_serving, "Serving", Fake)
    results = bench_serving.serve_together([dict(name="a", steps=3), dict(name="b", steps=1), dict(name="c", steps=2)])
    assert turns == ["a", "b", "c", "a", "c", "a"]
    assert [r["name"] for r in results] == ["a", "b", "c"]
    for r, steps in zip(results, (3, 1, 2), strict=True):
        assert r["own"] <= r["clock"] < r["own"] + 0.005  # its own turns; the other five or so took >= 0.03 s
        assert r["seen"] == sorted(r["seen"]) and len(r["seen"]) == steps


def test_bench_timed_runs_plan_with_the_rehearsals_step_cost_fit(tmp_path, monkeypatch):
    """The rehearsal fits the step cost (a fresh engine's warm-up); every timed run is handed that fit."""
    handed, stub = [], _stub_serve()

    def serve(model, heads, policy, *args, rehearsal=False, fitted=None, **kwargs):
        if rehearsal:
            return {"fitted": ("fit of the rehearsal", policy.name)}
        handed.append(fitted)
        return stub(model, heads, policy, *args, fitted=fitted, **kwargs) | {"fitted": fitted}  # as serve does

    _patch_serve(monkeypatch, serve)
    argv = ["bench", "--policies", "naive_spec,skvs", "--requests", "3", "--repeats", "2", "--quiet", "--no-plot",
            "--out", str(tmp_path)]
    assert commands.main(argv) == 0
    assert handed == [("fit of the rehearsal", "naive_spec"), ("fit of the rehearsal", "skvs"),
                      ("fit of the rehearsal", "skvs"), ("fit of the rehearsal", "naive_spec")]


def test_bootstrap_interval_of_the_median_is_seeded_and_brackets_it():
    values = [0.91, 1.05, 0.97, 1.12, 0.99, 1.01, 0.88]
    lo, hi = bench_report.bootstrap_median_ci(values)
    assert (lo, hi) == bench_report.bootstrap_median_ci(values)  # seeded: the same rounds, the same interval
    assert min(values) <= lo <= statistics.median(values) <= hi <= max(values)
    assert lo in values and hi in values  # an odd count: every resampled median is one of the values
    narrow = bench_report.bootstrap_median_ci(values, level=0.5)
    assert lo <= narrow[0] <= narrow[1] <= hi
    assert bench_report.bootstrap_median_ci([1.03]) == (1.03, 1.03)
    with pytest.raises(ValueError, match="values"):
        bench_report.bootstrap_median_ci([])


def test_serving_groups_keep_order_and_the_program_limit():
    programs = {"a": 3, "b": 5, "c": 9, "d": 20, "e": 1}
    assert bench_serving.serving_groups(list(programs), programs, limit=16) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert bench_serving.serving_groups(list(programs), programs, limit=100) == [list(programs)]
    groups = bench_serving.serving_groups
    assert groups(["e", "a"], programs, limit=4) == [["e", "a"]]  # exactly at the limit: one group
    assert bench_serving.serving_groups([], programs) == []
    # The ablation's anchor (skvs) starts every later group again, so each variant pairs with a skvs run of its time.
    assert groups(list(programs), programs, limit=16, anchor="b") == [["a", "b"], ["b", "c"], ["b", "d"],
                                                                                     ["b", "e"]]
    assert groups(list(programs), programs, limit=16, anchor="c") == [["a", "b"], ["c"], ["d"], ["e"]]


def test_bench_serves_groups_one_after_another_freeing_programs(tmp_path, capsys, monkeypatch, two_ablations):
    """More programs than one process holds (the ablation's ~40 once aborted XLA:CPU at Linux's 65,530 memory
    maps): each group's rounds finish, then its compiled programs are freed before the next group compiles."""
    served, cleared = [], []
    stub = _stub_serve()

    def serve(model, heads, policy, *args, rehearsal=False, **kwargs):
        served.append((policy.name + " (rehearsal)" * rehearsal, len(cleared)))
        return stub(model, heads, policy, *args, rehearsal=rehearsal, **kwargs)

    _patch_serve(monkeypatch, serve)
    monkeypatch.setattr(bench_serving, "MAX_LIVE_PROGRAMS", 10)  # naive_spec 3 + skvs 5; skvs again + each ablation 5
    monkeypatch.setattr(bench.jax, "clear_caches", lambda: cleared.append(True))
    argv = ["bench", "--ablation", "--requests", "3", "--repeats", "2", "--quiet", "--no-plot", "--out", str(tmp_path)]
    assert commands.main(argv) == 0
    # Each group rehearses its policies after the previous group's programs were freed (its own are new).
    assert served == [("naive_spec (rehearsal)", 0), ("skvs (rehearsal)", 0),
                      ("naive_spec", 0), ("skvs", 0), ("skvs", 0), ("naive_spec", 0),  # the second round rotated
                      ("skvs (rehearsal)", 1), ("skvs -release (rehearsal)", 1),
                      ("skvs", 1), ("skvs -release", 1), ("skvs -release", 1), ("skvs", 1),
                      ("skvs (rehearsal)", 2), ("skvs -spec_pool (rehearsal)", 2),
                      ("skvs", 2), ("skvs -spec_pool", 2), ("skvs -spec_pool", 2), ("skvs", 2)]
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert list(doc["policies"]) == ["naive_spec", "skvs", "skvs -release", "skvs -spec_pool"]
    # skvs's own runs are the first group's; each variant's rounds pair with the skvs runs of its own group (the
    # stub's skvs: 99, 101, then 100, 99 beside -release, then 101, 100 beside -spec_pool).
    assert doc["runs"]["output_tokens_per_s"]["skvs"] == [99.0, 101.0]
    assert doc["runs"]["output_tokens_per_s"]["skvs -release"] == [149.0, 151.0]
    rows = doc["ablation"]["rows"]
    assert rows["release"]["metrics"]["output_tokens_per_s"]["paired"] == pytest.approx([149 / 100, 151 / 99])
    assert rows["spec_pool"]["metrics"]["output_tokens_per_s"]["paired"] == pytest.approx([59 / 101, 61 / 100])
    assert rows["naive_spec"]["metrics"]["output_tokens_per_s"]["paired"] == pytest.approx([119 / 99, 121 / 101])
    # The reported ratio too: each reported (upper-median) run against that of the skvs runs of its own group.
    release_change = rows["release"]["metrics"]["output_tokens_per_s"]["change"]
    assert release_change == pytest.approx(151 / 100)  # not the first's 101
    assert rows["spec_pool"]["metrics"]["output_tokens_per_s"]["change"] == pytest.approx(61 / 101)
    assert rows["naive_spec"]["metrics"]["output_tokens_per_s"]["change"] == pytest.approx(121 / 101)


def test_bench_ablation_checks_every_variant_and_refuses_policies(tmp_path, capsys, monkeypatch, two_ablations):
    _patch_serve(monkeypatch, _stub_serve(differ="skvs -spec_pool", stall={"skvs -release": {0}}))
    argv = ["bench", "--ablation", "--requests", "3", "--quiet", "--no-plot", "--out", str(tmp_path)]
    assert commands.main(argv) == 1  # an ablation variant whose greedy outputs differ fails the run
    out = capsys.readouterr().out
    assert "greedy outputs identical across policies: False (4 policies checked)" in out
    assert f"within {bench_report.THROUGHPUT_NOISE:.0%}" in out  # one repeat: the noise band is stated
    assert f"headline: skvs / naive_spec output throughput {99 / 119:.3f}x (single reading;" in out
    assert "warning: 1 of 1 runs of skvs -release had one step of up to 2.0 s (of 2.1 s in all" in out
    assert "switches that could not be timed (every run stalled, see the warning above): release" in out
    with pytest.raises(SystemExit) as exc:
        commands.main(argv + ["--policies", "skvs"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    ("--max-output 500", "raise --kv-blocks or --block-size, or lower --max-output"),
    ("--kv-blocks 10", "more than --kv-blocks 10 holds"),
    ("--block-size 0", "--block-size must be >= 1"),
    ("--block-size 1025", "--block-size must be <= 1024"),  # named an internal field
    ("--max-seqs 0", "--max-seqs must be >= 1"),
    ("--requests 0", "--requests must be >= 1"),
    ("--draft-len 0", "draft_len must be >= 1"),
    ("--policies ,", "--policies names no policy"),
    ("--temperature -1", "temperature must be a finite float >= 0"),
    ("--host-blocks -1", "--host-blocks must be >= 0"),
    ("--policies skvs:victim=oldest", "victim must be one of"),
    ("--policies skvs:colour=red", "unknown key 'colour'"),
    ("--policies skvs:K=7", "K must lie in [0, 4]"),
    ("--draft-len 5", "the model has 4 draft heads"),  # from the engine, before vllm_default is served
    ("--drafter oracle", "--drafter must be heads or oracle:PROFILE"),
    ("--drafter oracle:medusa-9", "--drafter oracle:medusa-9: unknown acceptance model"),
    ("--drafter oracle:0.5,2 --draft-len 2", "acceptance probabilities must be numbers in [0, 1]"),
    ("--drafter oracle:0.5 --draft-len 2", "the acceptance model gives 1 probabilities, the draft length is 2"),
    ("--model-shape llama-9", "--model-shape: model shape must be one of"),
    ("--model-shape tiny:9", "num_layers must be an int in [1, 4]"),
    ("--model-shape tiny --model x", "pass it without --model / --medusa"),
    ("--request-rate 0", "--request-rate must be > 0"),
    ("--request-rate 2,x", "--request-rate must be comma-separated numbers or inf"),
    ("--request-rate 2,2", "--request-rate names a rate twice"),
    ("--burstiness 0", "--burstiness must be a finite number > 0"),
    ("--max-concurrency 0", "--max-concurrency must be >= 1"),
    ("--trace t.jsonl --request-rate 2", "--trace gives every request its arrival time"),
    ("--trace t.jsonl --burstiness 2", "leave out --burstiness"),
    ("--trace t.jsonl --phases 2x1,2x4", "leave out --phases"),
    ("--phases 2x1,2@4", "--phases must be COUNTxMULTIPLE"),
    ("--workload sharegpt --phases 2x1,2x4", "--phases sets a phased workload, not --workload sharegpt"),
    ("--ablation --request-rate 1,2", "--ablation serves one --request-rate"),
    ("--trace /nonexistent/t.jsonl", "--trace: [Errno 2] No such file"),
])
def test_bench_refuses_bad_flags_before_serving(flags, says, monkeypatch):
    def no_serve(*args, **kwargs):
        raise AssertionError("a bad flag must be refused before anything is served")

    _patch_serve(monkeypatch, no_serve)
    with pytest.raises(SystemExit, match=re.escape(says)) as exc:
        commands.main(["bench", "--quiet", "--no-plot", *flags.split()])
    assert str(exc.value.code).startswith("skvs bench: ")


def test_bench_reports_a_phased_trace_per_phase_with_the_best_fixed_k(capsys):
    """--phases: the report adds TPOT P50/P99 per phase for each policy (its reported run's requests, grouped by
    `workloads.phase_of`), the best fixed K per phase in hindsight and each adaptive policy's ratio to it, as
    `skvs simulate` prints them; bench.json records the same. A trace without phases gets none."""
    trace = workloads.tiny_model_trace("phased", 6, seed=0, rate=10.0, max_output_len=4, phases=[[2, 1.0], [4, 4.0]])
    assert workloads.phase_of(trace).tolist() == [0, 0, 1, 1, 1, 1]

    def records(tpot_of_phase):  # 5 tokens each: TPOT = (finish - first) / 4
        return [metrics.RequestRecord(request_id=r.request_id, arrival_time=0.0, first_token_time=1.0,
                                      finish_time=1.0 + 4 * tpot_of_phase[p], num_prompt_tokens=3,
                                      num_output_tokens=5, num_drafted=4 * p, num_accepted=p)
                for r, p in zip(trace.requests, workloads.phase_of(trace).tolist())]

    results = {"vllm_default": {"records": records([0.010, 0.020])},
               "naive_spec:1": {"records": records([0.008, 0.030])},
               "skvs": {"records": records([0.009, 0.018])}}
    args = argparse.Namespace(rate=10.0, draft_len=4)
    doc = bench._print_phases(results, list(results), trace, args)
    out = capsys.readouterr().out
    assert "| phase 0: 2 @ 10 req/s |" in out and "| phase 1: 4 @ 40 req/s |" in out
    assert "skvs / best: P50, P99" in out
    p99 = [row["p99_tpot_ms"] for row in doc["hindsight"]]
    assert [r["best_k"] for r in p99] == [[1], [0]]  # naive_spec:1 in phase 0, no speculation in phase 1
    assert p99[0]["skvs"]["over_best"] == pytest.approx([9 / 8]) and p99[1]["skvs"]["over_best"] == pytest.approx([0.9])
    assert doc["by_policy"]["skvs"][1]["requests"] == 4.0
    assert doc["by_policy"]["skvs"][1]["drafts_per_step"] == pytest.approx(4 / 4)  # 4 drafted / (5 - 1) steps
    plain = workloads.tiny_model_trace("sharegpt", 6, seed=0)
    assert bench._print_phases(results, list(results), plain, args) is None


def test_bench_refuses_an_out_folder_it_cannot_make_before_serving(tmp_path, monkeypatch):
    """--out under a regular file cannot be made: refused naming --out before anything is served (it used to
    fail after the whole run, losing the results)."""
    def no_serve(*args, **kwargs):
        raise AssertionError("a bad --out must be refused before anything is served")

    _patch_serve(monkeypatch, no_serve)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match=re.escape(f"skvs bench: --out {blocker / 'sub'}: cannot create")):
        commands.main(["bench", "--quiet", "--no-plot", "--requests", "2", "--out", str(blocker / "sub")])


def test_a_corrupt_checkpoint_is_refused_naming_its_file(tmp_path, capsys):
    """A truncated or corrupt `model.safetensors` under --model ends in a message naming the file, not in a
    SafetensorError traceback; a corrupt Medusa file too."""
    from reference_models import checkpoint

    model, heads = checkpoint.load_shipped()
    checkpoint.save_llama(model, tmp_path / "llama")
    checkpoint.save_medusa(heads, tmp_path / "medusa", base_model=str(tmp_path / "llama"))
    weights = tmp_path / "llama" / "model.safetensors"
    whole = weights.read_bytes()
    for broken in (whole[: len(whole) // 2], b"not a safetensors file"):
        weights.write_bytes(broken)
        with pytest.raises(SystemExit, match=re.escape(f"skvs bench: {weights}: not a readable safetensors file")):
            commands.main(["bench", "--quiet", "--no-plot", "--policies", "vllm_default", "--model",
                           str(tmp_path / "llama"), "--out", str(tmp_path / "out")])
        assert commands.main(["generate", "hi", "--policy", "vllm_default", "--model", str(tmp_path / "llama")]) == 2
        assert f"{weights}: not a readable safetensors file" in capsys.readouterr().err
    weights.write_bytes(whole)
    heads_file = tmp_path / "medusa" / checkpoint.MEDUSA_WEIGHTS
    heads_file.write_bytes(heads_file.read_bytes()[:100])
    with pytest.raises(ValueError, match=re.escape(f"{heads_file}: not a readable safetensors file")):
        checkpoint.load_medusa(tmp_path / "medusa")


# the default run's time budget (`pytest -m slow`); test_oracle_drafter keeps the drafter on the engine
@pytest.mark.slow
def test_bench_with_the_oracle_drafter_on_a_named_shape(tmp_path, capsys, monkeypatch):
    """--model-shape tiny (random weights) with --drafter oracle:PROFILE: the reference pass is served once and
    cached, every policy's greedy output equals it, and the acceptance by depth is printed beside the profile.
    The second run (the programs compiled by the first: ~1 s) sweeps two request rates under --max-concurrency 2:
    a report per rate, the sweep's table, bench.json's per-rate sections with every request's record, and never
    more than two requests in flight."""
    monkeypatch.setenv("SKVS_ORACLE_CACHE", str(tmp_path / "oracle"))
    argv = ["bench", "--quiet", "--no-plot", "--requests", "4", "--max-output", "8", "--model-shape", "tiny",
            "--drafter", "oracle:0.9,0.6,0.3,0.1", "--policies", "naive_spec", "--step-cost", "flat",
            "--no-rehearse", "--out", str(tmp_path / "out")]
    assert commands.main(argv) == 0
    out = capsys.readouterr().out
    assert "oracle drafter: reference pass served now, kept in" in out
    assert "naive_spec: 0 of 4 requests' outputs differ from the reference pass" in out
    assert "oracle profile by depth: 0.900, 0.600, 0.300, 0.100" in out
    assert re.search(r"naive_spec: acceptance by depth \(accepted / offered\) [0-9.]+ \(\d+/\d+\)", out)
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert doc["config"]["model_shape"] == "tiny" and doc["config"]["drafter"] == "oracle:0.9,0.6,0.3,0.1"
    loaded = [a for a in argv if a != "--quiet"] + ["--request-rate", "inf,200", "--max-concurrency", "2"]
    assert commands.main(loaded) == 0  # the second run reads the reference pass back
    out, err = capsys.readouterr()
    assert "oracle drafter: reference pass read from" in out
    assert "== request rate inf (every request at t = 0) (1/2) ==" in out
    assert "== request rate 200 req/s (2/2) ==" in out
    assert "arrivals: 200 req/s, Poisson, on each engine's clock; at most 2 requests in flight" in out
    assert re.search(r"^\| 200 \| naive_spec \| [0-9.]+ \| [0-9.]+ \|", out, re.MULTILINE)  # the sweep's table
    assert "compiling naive_spec: width" in err and "served " in err  # the progress bar's words
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert doc["schema_version"] == bench.SCHEMA_VERSION == 3 and "policies" not in doc
    assert doc["config"]["request_rate_per_s"] == ["inf", 200.0] and doc["config"]["max_concurrency"] == 2
    sections = bench.sections_of(doc)
    assert [s["request_rate_per_s"] for s in sections] == ["inf", 200.0]
    for s in sections:
        p = s["policies"]["naive_spec"]
        m, records = p["metrics"], p["requests"]
        assert {key for key, _, _ in metrics.METRICS} <= set(m) and m["median_itl_ms"] > 0 and m["p99_e2e_ms"] > 0
        assert [r["id"] for r in records] == [0, 1, 2, 3] and all(r["output_tokens"] == 8 for r in records)
        gaps = [g for r in records for g in r["itl_ms"]]
        assert m["mean_itl_ms"] == pytest.approx(np.mean(gaps), abs=1e-3)  # pooled over the requests
        assert all(1 <= len(r["itl_ms"]) <= 7 for r in records)  # one gap per step that produced tokens
        spans = [(r["arrival_s"], r["arrival_s"] + r["e2e_ms"] / 1e3) for r in records]
        assert max(sum(a <= t < b - 1e-9 for a, b in spans) for t, _ in spans) <= 2


def test_bench_verify_budget_applies_to_skvs_and_is_ablated():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    chosen = bench._policies(parser.parse_args(["--verify-budget", "12"]))
    assert chosen["skvs"].verify_budget == 12
    assert chosen["naive_spec"].verify_budget is None and chosen["vllm_default"].verify_budget is None
    chosen = bench._policies(parser.parse_args(["--ablation", "--verify-budget", "12"]))
    assert chosen["skvs -verify_budget"].verify_budget is None  # what the budget buys gets its own row
    assert all(p.verify_budget == 12 for n, p in chosen.items() if n.startswith("skvs") and n != "skvs -verify_budget")
    assert "skvs -verify_budget" not in bench._policies(parser.parse_args(["--ablation"]))
    for bad in ("0", "-3", "knee", "1.5"):
        with pytest.raises(SystemExit, match="--verify-budget must be none or a positive integer"):
            bench._policies(parser.parse_args(["--verify-budget", bad]))


@pytest.mark.slow
@pytest.mark.many_programs
def test_bench_ablation_real_engines(tmp_path, capsys, two_ablations):
    """The real thing at a tiny size: four policies compiled and served, outputs identical."""
    argv = ["bench", "--ablation", "--requests", "3", "--max-output", "6", "--quiet", "--no-plot",
            "--out", str(tmp_path)]
    assert commands.main(argv) == 0
    out = capsys.readouterr().out
    assert "greedy outputs identical across policies: True (4 policies checked)" in out
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert list(doc["ablation"]["rows"]) == ["release", "spec_pool", "naive_spec"]
    assert all(r["metrics"]["output_tokens_per_s"]["off"] > 0 for r in doc["ablation"]["rows"].values())


def test_every_package_ships_in_a_non_editable_install():
    """pyproject's package patterns must cover every package on disk: an explicit list once left out
    skvs_jax.sim, so an installed wheel failed every `skvs` command but --help (the editable install hid it)."""
    import fnmatch
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    setuptools_cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    include = setuptools_cfg["packages"]["find"]["include"]
    tops = ("skvs_jax", "pallas_kernels", "reference_models")
    inits = [init for top in tops for init in (root / top).rglob("__init__.py")]
    packages = [".".join(init.parent.relative_to(root).parts) for init in inits]
    assert "skvs_jax.sim" in packages
    assert all(any(fnmatch.fnmatch(p, pattern) for pattern in include) for p in packages), (packages, include)


# ------------------------------------------------------------------------------ policy flags and overrides


def _bench_args(*flags):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(flags))


def test_bench_policy_flags_and_overrides_reach_the_policies_and_engines():
    args = _bench_args("--policies", "vllm_default,skvs:preemption=swap,victim=most_progress,naive_spec:K=2",
                       "--kv-precision", "bfloat16", "--no-prefix-cache", "--victim", "least_progress")
    specs = bench._specs(args)
    assert list(specs) == ["vllm_default", "skvs[preemption=swap,victim=most_progress]", "naive_spec:2"]
    v, s, n = (spec.policy for spec in specs.values())
    assert all(p.kv_dtype() == "bfloat16" and not p.prefix_cache and not p.prefix_barrier for p in (v, s, n))
    assert (v.victim, s.victim, n.victim) == ("least_progress", "most_progress", "least_progress")  # written wins
    assert s.preemption == "swap" and v.preemption == n.preemption == "recompute"
    assert specs["naive_spec:2"].draft_len_knob == 2 and n.draft_len == 4
    # The host tier: the KV budget's usable blocks by default, for swap policies only.
    assert bench_serving.engine_kwargs(s, args)["swap_blocks"] == args.kv_blocks - 1
    assert "swap_blocks" not in bench_serving.engine_kwargs(v, args)
    assert bench_serving.engine_kwargs(s, _bench_args("--host-blocks", "7"))["swap_blocks"] == 7
    # --preemption swap puts every policy on the host tier; --verify-budget still reaches skvs only.
    specs = bench._specs(_bench_args("--preemption", "swap", "--verify-budget", "9"))
    assert all(spec.policy.preemption == "swap" for spec in specs.values())
    assert [spec.policy.verify_budget for spec in specs.values()] == [None, None, 9]
    ablated = bench._specs(_bench_args("--ablation", "--victim", "most_blocks"))
    assert all(spec.policy.victim == "most_blocks" for spec in ablated.values())  # ablations keep the flag


def test_bench_run_with_overrides_records_them_and_both_hit_rates(tmp_path, capsys, monkeypatch):
    seen = {}

    def serve(model, heads, policy, cache, trace, args, progress=None, knobs=None, bucket_hist=None, fitted=None,
              rehearsal=False):
        seen[policy.name] = (policy, int(knobs.draft_len))
        m = {key: 0.25 for key, _, _ in metrics.METRICS} | {"kv_hit_rate": 0.3, "kv_hit_rate_first": 0.1}
        m |= {"num_requests": 2.0, "num_aborted": 0.0, "num_steps": 3.0, "output_tokens": 6.0, "wall_time_s": 0.1}
        return {"metrics": m, "outputs": {0: [1, 2]}, "series": {"time_s": [0.1], "output_tokens": [6],
                                                                 "blocks_used": [1], "spec_blocks": [0]},
                "counters": {}, "compiled": []}

    _patch_serve(monkeypatch, serve)
    argv = ["bench", "--requests", "2", "--max-output", "4", "--quiet", "--no-plot", "--out", str(tmp_path),
            "--policies", "skvs:preemption=swap,name=swapper,skvs:1", "--host-blocks", "5"]
    assert commands.main(argv) == 0
    out = capsys.readouterr().out
    assert seen["swapper"][0].preemption == "swap" and seen["swapper"][1] == 4 and seen["skvs:1"][1] == 1
    assert "swapper: swap (5 host blocks), victim lowest_priority, KV float32, prefix cache on" in out
    assert "skvs:1: recompute" in out and "K knob 1" in out
    rows = {line.split(" | ")[0].lstrip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert rows["KV hit rate (%)"].endswith("| 30.0 | 30.0 |")
    assert rows["KV hit rate, first admissions (%)"].endswith("| 10.0 | 10.0 |")
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["config"]["host_blocks"] == 5 and doc["config"]["policies"] == "swapper,skvs:1"
    assert doc["config"]["policy_fields"]["swapper"]["preemption"] == "swap"
    assert doc["config"]["policy_fields"]["skvs:1"]["draft_len_knob"] == 1
    assert doc["policies"]["swapper"]["metrics"]["kv_hit_rate_first"] == 0.1


def test_simulate_policy_flags_reach_the_scheduler_config_and_the_cost_model(tmp_path, monkeypatch):
    from skvs_jax import scheduler as sc
    from skvs_jax.commands import simulate
    from skvs_jax.sim import sweep

    cfgs = []

    def run(traces, lanes, *, cfg, **kw):
        cfgs.append((cfg, int(np.asarray(lanes.knobs.draft_len).ravel()[0])))
        raise _Reached

    monkeypatch.setattr(sweep, "run", run)
    argv = ["simulate", "--requests", "4", "--seeds", "1", "--max-seqs", "4", "--max-prompt-len", "32",
            "--max-output-len", "16", "--out", str(tmp_path), "--no-plot", "--kv-blocks", "40",
            "--policies", "naive_spec:preemption=swap,victim=most_progress,K=2", "--no-prefix-cache"]
    with pytest.raises(_Reached):
        commands.main(argv)
    cfg, knob = cfgs[0]
    assert cfg.policy.preemption == "swap" and cfg.swap_blocks == 40 and knob == 2
    assert cfg.victim_rule is sc.most_progress
    assert not cfg.policy.prefix_cache
    with pytest.raises(_Reached):
        commands.main(argv[:-3] + ["--policies", "vllm_default", "--host-blocks", "3", "--preemption", "swap"])
    assert cfgs[1][0].swap_blocks == 3 and cfgs[1][0].policy.name == "vllm_default"
    with pytest.raises(_Reached):
        commands.main(argv[:-3] + ["--policies", "vllm_default"])
    assert cfgs[2][0].swap_blocks == 0  # recompute: no host tier
    # --kv-precision prices the KV bytes for every policy (the model's bf16 otherwise).
    assert simulate._cost(_sim_args()).model.kv_dtype_bytes == 2
    assert simulate._cost(_sim_args("--kv-precision", "float8_e4m3fn")).model.kv_dtype_bytes == 1
    assert simulate._cost(_sim_args("--kv-precision", "by_draft_len", "--draft-len", "6")).model.kv_dtype_bytes == 2
    assert simulate._cost(_sim_args("--kv-precision", "by_draft_len")).model.kv_dtype_bytes == 1
    assert simulate._cost(_sim_args("--kv-precision", "float32")).model.kv_dtype_bytes == 4


def test_the_ablation_verdict_rule():
    """bench_report.throughput_effect: the deterministic engine steps decide where they differ for the same output
    tokens; the repeats' spread otherwise; one repeat with the same steps is no evidence."""
    effect = functools.partial(bench_report.throughput_effect, tokens=(100, 100), deterministic=True)
    # The schedule ran longer without the switch: it helps, though one timed run says 25% faster (the old ±20%
    # rule called that "hurts").
    assert effect(steps=(60, 50), ratio=1.25, paired=[1.25]) == ("helps", "engine steps")
    assert effect(steps=(40, 50), ratio=0.9, paired=[0.9, 1.1]) == ("hurts", "engine steps")
    # Repeats that agree against the steps win: the per-step cost, measured, beats the proxy.
    assert effect(steps=(60, 50), ratio=1.2, paired=[1.1, 1.3]) == ("hurts", "repeats' spread (against the engine "
                                                                              "steps)")
    # Same steps: the spread decides; one run is within noise whatever its ratio.
    assert effect(steps=(50, 50), ratio=0.7, paired=[0.7, 0.75]) == ("helps", "repeats' spread")
    assert effect(steps=(50, 50), ratio=0.9, paired=[0.9, 1.05])[0] == "within noise"
    assert effect(steps=(50, 50), ratio=1.3, paired=[1.3]) == ("within noise", "same engine steps, one repeat "
                                                                                "(no spread)")
    assert effect(steps=(50, 50), ratio=1.3, paired=[None, 1.2, 1.4])[0] == "hurts"  # a stalled round left out
    # Different output tokens, or arrivals on the clock: steps say nothing; one repeat keeps the CPU's band.
    assert effect(steps=(60, 50), ratio=1.25, paired=[1.25], tokens=(90, 100)) == ("within noise", "same engine "
                                                                                    "steps, one repeat (no spread)")
    loose = functools.partial(effect, steps=(60, 50), deterministic=False)
    assert loose(ratio=1.1, paired=[1.1]) == ("within noise", f"one repeat, within {bench_report.THROUGHPUT_NOISE:.0%}")
    assert loose(ratio=1.3, paired=[1.3]) == ("hurts", f"one repeat, beyond {bench_report.THROUGHPUT_NOISE:.0%}")
    assert effect(steps=(60, 50), ratio=1.0, paired=[1.0], identical=True) == ("none", "schedule identical")
    assert effect(steps=(60, 50), ratio=1.0, paired=[None], measured=False)[0] == "not measured"


# ------------------------------------------------------------------------- real checkpoints and the compile cache


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny Llama written by transformers' `save_pretrained` (byte vocabulary, 128 positions) and 3 Medusa heads
    saved by our own code, side by side: (llama dir, medusa dir, the Llama as we load it)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch = pytest.importorskip("torch", reason='needs the hf extra: pip install -e ".[test,hf]"')
        transformers = pytest.importorskip("transformers", reason='needs the hf extra: pip install -e ".[test,hf]"')
    from reference_models import checkpoint
    from reference_models.medusa import MedusaConfig, MedusaHeads

    root = tmp_path_factory.mktemp("checkpoints")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.LlamaForCausalLM(config).save_pretrained(root / "llama")
    model = checkpoint.load_llama(root / "llama")
    lm_head = checkpoint.param_dict(model)["lm_head.weight"]
    heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=256, num_heads=3), lm_head_init=lm_head)
    checkpoint.save_medusa(heads, root / "medusa", base_model="llama")  # a sibling: found without --model
    return root / "llama", root / "medusa", model


@pytest.mark.slow  # the default run's time budget (docs: `pytest -m slow`)
def test_generate_serves_a_transformers_checkpoint_with_our_medusa_heads(hf_checkpoint, capsys):
    """`skvs generate --model DIR --medusa DIR`: skvs drafts with all 3 heads by default (K = 3, not the 4 that
    the heads could not serve), the cache spans the model's 128 positions, and the greedy continuation is the base
    model's own (reference_models.greedy_generate), however the heads are given."""
    import jax

    from reference_models import checkpoint, greedy_generate

    llama, medusa, model = hf_checkpoint
    prompt = b"Once upon "
    want = greedy_generate(model, np.asarray([list(prompt)]), 8)[0].tolist()
    text = bytes(want).decode("utf-8", errors="replace").replace("[", "").replace("]", "")
    argv = ["generate", prompt.decode(), "--max-tokens", "8", "--plain", "--model", str(llama), "--medusa", str(medusa)]
    assert commands.main(argv) == 0
    body, summary = capsys.readouterr().out.rsplit("\n-- ", 1)
    assert body.replace("[", "").replace("]", "") == text
    assert summary.startswith("8 tokens in") and "policy skvs" in summary
    from skvs_jax.commands import checkpoints

    parser = argparse.ArgumentParser()
    checkpoints.add_arguments(parser)
    both = checkpoints.load(parser.parse_args(["--model", str(llama), "--medusa", str(medusa)]))
    for flags in (["--medusa", str(medusa)],  # the heads' config names the base model
                  ["--medusa", str(medusa / "medusa_lm_head.safetensors")]):  # the weights file itself
        got = checkpoints.load(parser.parse_args(flags))
        assert got.model.config == both.model.config and got.num_heads == 3, flags
        for a, b in ((got.model, both.model), (got.heads, both.heads)):
            jax.tree.map(np.testing.assert_array_equal, checkpoint.param_dict(a), checkpoint.param_dict(b))
    for flags, says in ((["--draft-len", "4"], "the model has 3 draft heads"),
                        (["--max-model-len", "129"], "--max-model-len must lie in [1, 128]"),
                        (["--max-tokens", "200"], "exceeds the 128 tokens a sequence can hold")):
        assert commands.main(["generate", "hi", "--medusa", str(medusa), *flags]) == 2
        assert says in capsys.readouterr().err
    assert commands.main(["generate", "hi", "--model", str(llama)]) == 2  # skvs without heads
    assert "needs Medusa heads: pass --medusa" in capsys.readouterr().err
    assert commands.main(["generate", "hi", "--model", str(llama / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err


@pytest.mark.slow  # the default run's time budget (docs: `pytest -m slow`)
def test_the_commands_cache_compilations_where_told_and_never_in_home(hf_checkpoint, tmp_path):
    """A `skvs generate` process with --compile-cache DIR fills DIR and writes nothing under $HOME; the choice
    of directory follows flag > SKVS_COMPILE_CACHE > JAX_COMPILATION_CACHE_DIR > ~/.cache/skvs_jax/xla."""
    from skvs_jax.commands import startup

    llama, medusa, _ = hf_checkpoint
    home, cache = tmp_path / "home", tmp_path / "xla"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in (startup.ENV, "JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME")}
    env |= {"HOME": str(home), "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-m", "skvs_jax.commands", "generate", "hi", "--max-tokens", "3", "--policy",
            "vllm_default", "--model", str(llama), "--compile-cache", str(cache)]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    assert any(cache.iterdir()) and not any(home.iterdir())

    assert startup.resolve("off", {startup.ENV: "/x"}) is None
    assert startup.resolve("/a", {startup.ENV: "/x"}) == "/a"
    assert startup.resolve(None, {startup.ENV: "OFF", "JAX_COMPILATION_CACHE_DIR": "/j"}) is None
    assert startup.resolve(None, {startup.ENV: "/x", "JAX_COMPILATION_CACHE_DIR": "/j"}) == "/x"
    assert startup.resolve(None, {"JAX_COMPILATION_CACHE_DIR": "/j"}) == "/j"
    assert startup.resolve(None, {"XDG_CACHE_HOME": "/c"}) == "/c/skvs_jax/xla"
    with pytest.raises(ValueError, match="--compile-cache must be a directory or 'off'"):
        startup.resolve(" ", {})


def test_simulate_hindsight_picks_the_best_fixed_k_per_group_and_seed():
    from skvs_jax.commands import group_report, trace_flags

    def lane(seed, *p99):
        return {"seed": seed, "phase": [{"median_tpot_ms": x / 2, "p99_tpot_ms": x, "drafts_per_step": 0.0,
                                         "requests": 4.0} for x in p99]}

    lanes = {"vllm_default": [lane(0, 2.0, 3.0), lane(1, 2.0, 3.0)],
             "naive_spec:1": [lane(0, 1.0, 4.0), lane(1, 3.0, 4.0)],
             "skvs": [lane(0, 1.5, 3.0), lane(1, 1.5, 3.3)]}
    names = list(lanes)
    fixed = group_report.fixed_names(names, 4)
    assert fixed == {0: "vllm_default", 1: "naive_spec:1"}
    rows = group_report.hindsight(lanes, names, "phase", fixed)
    assert rows[0]["p99_tpot_ms"]["best_k"] == [1, 0] and rows[1]["p99_tpot_ms"]["best_k"] == [0, 0]
    assert rows[0]["p99_tpot_ms"]["skvs"]["over_best"] == [1.5, 0.75]
    assert rows[1]["p99_tpot_ms"]["skvs"]["over_no_spec"] == pytest.approx([1.0, 1.1])
    table = group_report.group_table(lanes, names, "phase", ["a", "b"], fixed)
    assert "| a |" in table and "1.50x" in table.replace("0.75-1.50x", "1.50x")
    assert trace_flags.parse_phases("96x1,256x12") == [[96, 1.0], [256, 12.0]]
    with pytest.raises(ValueError, match="phases"):
        trace_flags.parse_phases("96@1")


# ------------------------------------------------------------------------------ load controls and one vocabulary


def test_bench_serves_a_request_file_at_its_arrivals(tmp_path, capsys, monkeypatch):
    """--trace FILE: its requests (text as bytes) reach every policy's runs, arriving when the file says; bench.json
    says so; a bad line and a request longer than the model are refused before anything is served."""
    served = []

    def serve(model, heads, policy, cache, trace, args, **kwargs):
        served.append((trace, args.rate))
        return _stub_serve()(model, heads, policy, cache, trace, args, **kwargs)

    _patch_serve(monkeypatch, serve)
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "Return the", "output_len": 3, "arrival_s": 0.0}\n'
                    '{"prompt_len": 12, "output_len": 2, "arrival_s": 0.5}\n')
    argv = ["bench", "--trace", str(path), "--policy", "naive_spec,skvs", "--quiet", "--no-plot", "--out",
            str(tmp_path / "out")]
    assert commands.main(argv) == 0
    out = capsys.readouterr().out
    assert f"arrivals: as --trace {path} says (4 req/s)" in out
    trace, rate = served[0]
    assert [r.prompt for r in trace.requests][0] == tuple(b"Return the") and rate == 4.0
    assert [r.arrival_time for r in trace.requests] == [0.0, 0.5] and len(trace.requests[1].prompt) == 12
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert doc["trace"]["kind"] == "file" and doc["config"]["trace"] == str(path)
    assert doc["config"]["request_rate_per_s"] == ["inf"]
    path.write_text('{"prompt": "a", "output_len": 3}\n')
    with pytest.raises(SystemExit, match=re.escape(f"skvs bench: --trace: {path}: line 1: field 'arrival_s' is "
                                                   "missing")):
        commands.main(argv)
    path.write_text('{"prompt_len": 2000, "output_len": 3, "arrival_s": 0}\n')
    with pytest.raises(SystemExit, match="a request of 2003 tokens .* exceeds the model's max_position_embeddings"):
        commands.main(argv)


def test_bench_serving_admits_at_most_max_concurrency_requests(monkeypatch):
    """`Serving._admit`: arrived requests are added while fewer than --max-concurrency are unfinished; a held-back
    request arrives when the finish that freed its place happened (vLLM's benchmark starts its clock then)."""
    class Log:
        def __init__(self, finish=None):
            self.finished, self.aborted, self.finish_time = finish is not None, False, finish

    class Engine:
        def __init__(self):
            self.requests, self.clock = {}, 1.0

        def now(self):
            return self.clock

        def add_request(self, prompt, sampling, arrival_time, request_id):
            self.requests[request_id] = Log()
            self.added = getattr(self, "added", []) + [(request_id, arrival_time)]

    run = object.__new__(bench_serving.Serving)
    run.e, run.max_concurrency = Engine(), 2
    run.args = argparse.Namespace(temperature=0.0)
    run.pending = [workloads.Request(i, 0.1 * i, (1,), 1) for i in range(4)]
    run._admit()
    assert run.e.added == [(0, 0.0), (1, 0.1)] and len(run.pending) == 2  # two in flight: the rest wait
    run.e.requests[1].finished, run.e.requests[1].finish_time = True, 0.6
    run.e.clock = 0.8
    run._admit()
    assert run.e.added[2:] == [(2, 0.6)]  # sent when request 1's finish freed a place, not when admitted
    run.e.requests[0] = Log(finish=0.7)
    run.e.clock = 2.0
    run._admit()
    assert run.e.added[3:] == [(3, 0.7)] and not run.pending


def test_progress_shows_the_served_token_rate_and_what_compiles():
    bar = bench_serving.Progress(100)
    bar.note("compiling skvs: width 5 done (2/4)")
    bar.served(30, 0.5)
    bar.served(10, 0.5)  # 40 tokens over 1 s of the engines' own clocks, however long the bar's wall time
    assert bar.rate() == 40.0 and bar.bar.n == 40
    assert bar.bar.postfix == "compiling skvs: width 5 done (2/4), served 40 tok/s"
    bar.close()


def test_headline_interval_is_students_t_on_the_log_ratios():
    # scipy.stats.t.ppf(0.975, df) (importing scipy costs seconds a run): the table's ends, then the expansion.
    for df, want in ((1, 12.7062), (2, 4.3027), (30, 2.0423), (31, 2.0395), (60, 2.0003), (500, 1.9647)):
        assert bench_report.t975(df) == pytest.approx(want, abs=1e-3)
    ratios = [1.1, 1.2, 1.15]
    # exp(mean(log r) -+ t975(2) * sd(log r) / sqrt(3)), computed with scipy
    assert bench_report.t_interval(ratios) == pytest.approx((1.0315356, 1.2804529), rel=1e-4)
    lo, hi = bench_report.t_interval([1 / r for r in ratios])  # b / a mirrors a / b
    assert (lo, hi) == pytest.approx((1 / 1.2804529, 1 / 1.0315356), rel=1e-4)
    with pytest.raises(ValueError, match="at least two"):
        bench_report.t_interval([1.0])


def test_one_policy_vocabulary_across_the_commands():
    """--policy and --policies in every command: bench and simulate take several under either spelling, generate
    one under either."""
    assert _bench_args("--policy", "skvs,naive_spec").policies == "skvs,naive_spec"
    assert _sim_args("--policy", "skvs").policies == "skvs"
    parser = commands._build_parser()
    assert parser.parse_args(["generate", "hi", "--policies", "vllm_default"]).policy == "vllm_default"
    assert parser.parse_args(["generate", "hi", "--policy", "naive_spec"]).policy == "naive_spec"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--policies", "skvs,naive_spec"])


def test_simulate_prices_model_shape_and_refuses_model(tmp_path, monkeypatch):
    from skvs_jax.commands import simulate
    from skvs_jax.sim import sweep

    with pytest.raises(SystemExit, match="--model is a checkpoint folder in skvs bench and skvs generate; the "
                                         "simulator prices a model shape: use --model-shape"):
        commands.main(["simulate", "--model", "llama-3.1-8b", "--out", str(tmp_path)])
    assert simulate.model_spec(_sim_args()) is cost_model.MODELS["llama-3.1-8b"]  # the default shape
    assert simulate.model_spec(_sim_args("--model-shape", "llama-3.2-1b")) is cost_model.MODELS["llama-3.2-1b"]
    cut = simulate.model_spec(_sim_args("--model-shape", "llama-3.2-1b:2"))
    assert cut.num_layers == 2 and cut.hidden_size == cost_model.MODELS["llama-3.2-1b"].hidden_size

    seen = []

    def run(traces, lanes, *, cfg, cost, **kw):
        seen.append((cost.model.name, traces))
        raise _Reached

    monkeypatch.setattr(sweep, "run", run)
    with pytest.raises(_Reached):
        commands.main(["simulate", "--model-shape", "llama-3.2-3b", "--requests", "4", "--seeds", "1",
                       "--max-seqs", "4", "--max-prompt-len", "32", "--max-output-len", "16", "--out", str(tmp_path)])
    assert seen[-1][0] == cost_model.MODELS["llama-3.2-3b"].name


class _Reached(Exception):
    pass


def _capture_simulated_traces(monkeypatch) -> list:
    """`skvs simulate` stops where it would simulate: each call's stacked traces are appended to the list returned,
    then _Reached is raised."""
    from skvs_jax.sim import sweep

    seen = []

    def run(traces, lanes, **kw):
        seen.append(traces)
        raise _Reached

    monkeypatch.setattr(sweep, "run", run)
    return seen


def test_simulate_takes_a_request_file_and_burstiness(tmp_path, monkeypatch):
    """--trace FILE: every lane simulates its requests at its arrivals (--requests and --rate follow the file);
    --burstiness shapes the workload's gaps; both are refused where they cannot apply."""
    seen = _capture_simulated_traces(monkeypatch)
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "hello", "output_len": 3, "arrival_s": 0.0}\n'
                    '{"prompt_len": 20, "output_len": 9, "arrival_s": 2.0}\n'
                    '{"prompt_len": 7, "output_len": 1, "arrival_s": 1.0}\n')
    base = ["simulate", "--seeds", "2", "--max-seqs", "4", "--max-prompt-len", "32", "--max-output-len", "16",
            "--policies", "vllm_default", "--out", str(tmp_path), "--no-plot"]
    with pytest.raises(_Reached):
        commands.main(base + ["--trace", str(path)])
    traces = seen[-1]
    assert np.asarray(traces.arrival).shape[0] == 2  # one lane per seed, the same requests
    np.testing.assert_allclose(np.asarray(traces.arrival)[0][:3], [0.0, 1.0, 2.0])
    assert np.asarray(traces.prompt_len)[0][:3].tolist() == [5, 7, 20]
    for flags, says in ((["--sweep"], "leave out --sweep"), (["--workload", "sharegpt"], "leave out --workload"),
                        (["--burstiness", "0.5"], "leave out --burstiness"),
                        (["--phases", "2x1,2x4"], "leave out --phases"),
                        (["--max-output-len", "8"], "has a request of 9 tokens, more than --max-output-len 8")):
        with pytest.raises(SystemExit, match=re.escape(says)):
            commands.main(base + ["--trace", str(path)] + flags)
    with pytest.raises(_Reached):
        commands.main(base + ["--requests", "6", "--rate", "4", "--burstiness", "0.25"])
    bursty = np.asarray(seen[-1].arrival)[0][:6]
    with pytest.raises(_Reached):
        commands.main(base + ["--requests", "6", "--rate", "4"])
    assert not np.allclose(bursty, np.asarray(seen[-1].arrival)[0][:6])
    with pytest.raises(SystemExit, match="--burstiness must be a finite number > 0"):
        commands.main(base + ["--burstiness", "0"])


def test_simulate_tpot_target_reaches_every_request_of_the_trace(tmp_path, monkeypatch, capsys):
    """--tpot-target MS: every simulated request carries it (microseconds, what the controller reads); a target
    that is not a positive number of milliseconds is refused by the parser."""
    seen = _capture_simulated_traces(monkeypatch)
    base = ["simulate", "--requests", "4", "--seeds", "1", "--max-seqs", "4", "--max-prompt-len", "32",
            "--max-output-len", "16", "--policies", "skvs", "--out", str(tmp_path), "--no-plot"]
    with pytest.raises(_Reached):
        commands.main(base + ["--tpot-target", "30"])
    assert np.asarray(seen[-1].tpot_target).tolist() == [[30_000] * 4]
    with pytest.raises(_Reached):
        commands.main(base)
    assert not np.asarray(seen[-1].tpot_target).any()
    for bad in ("0", "-5", "nan", "soon"):
        with pytest.raises(SystemExit):
            commands.main(base + ["--tpot-target", bad])
        assert "--tpot-target: must be milliseconds" in capsys.readouterr().err
