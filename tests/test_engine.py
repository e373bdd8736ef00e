"""The engine end to end on the shipped tiny model: scheduling and speculation never change greedy outputs."""

import argparse
import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reference_models import greedy_generate
from skvs_jax import policies, workloads
from skvs_jax.commands import bench
from skvs_jax.config import CacheConfig
from skvs_jax.kv import manager
from skvs_jax.serve import dispatch, engine, engine_step
from skvs_jax.serve.model_runner import LlamaMedusaRunner
from skvs_jax.sim import cost_model as cm
from skvs_jax.sim import fidelity
from skvs_jax.sim import simulate as sim

# Tight on purpose: 8 slots of up to 128 tokens against 47 blocks of 8 (376 tokens) forces preemption.
CACHE = CacheConfig(num_blocks=48, block_size=8, max_seqs=8, max_blocks_per_seq=16)


@pytest.fixture(scope="module")
def trace():
    return workloads.make("system_prompts", 10, seed=1, system_prompt_len=40, max_prompt_len=80, max_output_len=20)


@pytest.fixture(scope="module")
def reference(shipped, trace):
    model, _ = shipped
    return {r.request_id: greedy_generate(model, np.asarray([r.prompt]), r.max_new_tokens)[0, len(r.prompt):].tolist()
            for r in trace.requests}


def _serve(shipped, policy, trace, **kw):
    model, heads = shipped
    e = engine.Engine(model, heads, policy, kw.pop("cache", CACHE), token_budget=96, prefill_chunk=32, **kw)
    for r in trace.requests:
        e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens), request_id=r.request_id)
    return e, e.run()


# vllm_default's run is slow-marked for the default run's time budget: the speculating policies are the ones whose
# output must equal plain decoding, and `skvs bench` checks every policy's greedy outputs against each other.
@pytest.mark.parametrize("name", [pytest.param("vllm_default", marks=pytest.mark.slow), "naive_spec", "skvs"])
def test_every_policy_gives_the_greedy_reference_tokens(shipped, trace, reference, name):
    e, out = _serve(shipped, policies.preset(name), trace)
    assert out == reference
    c = e.state.sched.counters
    # The run really exercised the machinery it claims not to disturb.
    assert int(c.cached_tokens) > 0 and int(c.preempt_recompute) > 0 and e.picker.split_steps > 0
    if name != "vllm_default":
        assert int(c.drafted) > 0 and 0 < int(c.accepted) < int(c.drafted)
    assert len(e.compiled) <= len(e.picker.widths)


@pytest.mark.slow  # the default run's time budget (`pytest -m slow`)
def test_warmup_compiles_the_hottest_bucket_first_and_the_run_then_compiles_nothing(shipped, trace, reference):
    """`Engine.warmup` compiles the prompt width first, then the draft buckets by the steps a histogram puts in
    them; a run after it compiles nothing. skvs's configuration of the greedy test: its programs are reused."""
    model, heads = shipped
    e = engine.Engine(model, heads, policies.preset("skvs"), CACHE, token_budget=96, prefill_chunk=32)
    order = e.warmup({4: 1, 2: 50, 0: 3})  # the prompt width, then drafts 2 (width 3), 0 (width 1), 4 (width 5)
    assert order == [e.picker.prompt_width, 3, 1, 5] and sorted(order) == list(e.picker.widths)
    before = dispatch.run_steps._cache_size()
    small = trace.requests[:2]
    for r in small:
        e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens), request_id=r.request_id)
    assert e.run() == {r.request_id: reference[r.request_id] for r in small}
    assert dispatch.run_steps._cache_size() == before
    assert sum(e.picker.draft_hist.values()) == sum(e.picker.width_hist.values()) > 0


def test_a_wide_step_that_memory_kept_every_prompt_row_out_of_runs_the_narrow_width(shipped, trace, reference,
                                                                                    monkeypatch):
    """The host picks the prompt width while a row waits; when `schedule` then admits no prompt token, the program
    runs its narrow branch (`engine_step.model_step_at`). The same run forced to the wide branch (WIDE, what the
    step-cost fit times) makes the same decisions and tokens at the wide width every such step."""
    policy = policies.preset("naive_spec")  # the greedy test's configuration: its programs are reused
    e, out = _serve(shipped, policy, trace)
    narrow = engine_step.narrow_width(e.cfg)
    assert out == reference and narrow == 1 + policy.draft_len < e.picker.prompt_width
    chosen_wide = [s["width"] for s in e.step_log if s["bound"] == -1]  # the host chose the prompt width
    assert chosen_wide.count(narrow) > 0 and chosen_wide.count(e.picker.prompt_width) > 0
    assert set(e.picker.width_hist) <= set(e.picker.widths) and sum(e.picker.width_hist.values()) == len(e.step_log)

    run_steps = dispatch.run_steps

    def always_wide(runner, params, st, knobs, lim, branch=engine_step.AUTO, incoming=None, *, cfg, width, capacity):
        return run_steps(runner, params, st, knobs, lim, engine_step.WIDE, incoming, cfg=cfg, width=width,
                         capacity=capacity)

    monkeypatch.setattr(dispatch, "run_steps", always_wide)
    wide, out_wide = _serve(shipped, policy, trace)
    assert out_wide == reference
    assert jax.tree.map(int, wide.state.sched.counters) == jax.tree.map(int, e.state.sched.counters)
    assert [s["width"] for s in wide.step_log if s["bound"] == -1] == [e.picker.prompt_width] * len(chosen_wide)


def test_the_split_branch_computes_what_the_wide_one_does(shipped, trace, reference, monkeypatch):
    """Every prompt-width step of a run, from the same state through the split branch (narrow rows, each long
    chunk's head in extra rows) and the wide one: where the split fits, the same tokens, hidden states and K/V.
    The run goes on from the wide branch's state and still gives the greedy reference; split_rows < 0 is
    refused."""
    policy = policies.preset("naive_spec")  # the greedy test's configuration: its programs are reused
    run_steps, compared = dispatch.run_steps, []

    def both(runner, params, st, knobs, lim, branch=engine_step.AUTO, incoming=None, *, cfg, width, capacity):
        if width <= engine_step.narrow_width(cfg):
            return run_steps(runner, params, st, knobs, lim, branch, incoming, cfg=cfg, width=width,
                             capacity=capacity)
        # One step at a time, so each is compared from the same state (each stages the same incoming rows).
        one = lim.replace(n=np.int32(1))
        s_split, split = run_steps(runner, params, jax.tree.map(lambda x: x.copy(), st), knobs, one,
                                   engine_step.SPLIT, incoming, cfg=cfg, width=width, capacity=capacity)
        st, wide = run_steps(runner, params, st, knobs, one, engine_step.WIDE, incoming, cfg=cfg, width=width,
                             capacity=capacity)
        if int(wide.steps) and bool(split.out.width_ok[0]):  # the chunks fit the extra rows (else AUTO runs WIDE)
            for field in ("num_new", "new_tokens", "accepted", "num_drafts", "scheduled", "finished"):
                assert (np.asarray(getattr(split.out, field))[0].tolist()
                        == np.asarray(getattr(wide.out, field))[0].tolist())
            np.testing.assert_allclose(np.asarray(s_split.hidden), np.asarray(st.hidden), atol=1e-5)
            for a, b in zip(runner.kv_pages(s_split.cache), runner.kv_pages(st.cache)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
            compared.append(int(wide.out.num_tokens[0]))  # tokens the step computed
        return st, wide

    monkeypatch.setattr(dispatch, "run_steps", both)
    e, out = _serve(shipped, policy, trace)
    assert out == reference
    # Among the compared steps, ones whose chunks needed extra rows (more tokens than the narrow rows hold).
    assert len(compared) >= 5 and max(compared) > engine_step.narrow_width(e.cfg) * e.cfg.sched.cache.max_seqs
    model, heads = shipped
    with pytest.raises(ValueError, match="split_rows"):
        engine.Engine(model, heads, policy, CACHE, split_rows=-1)


@pytest.mark.slow  # the run's time budget; test_kv_precision swaps an int8 cache through the engine by default
def test_swap_preemption_gives_the_same_tokens(shipped, trace, reference):
    e, out = _serve(shipped, policies.skvs(4).replace(preemption="swap"), trace, swap_blocks=64)
    assert out == reference
    assert int(e.state.sched.counters.preempt_swap) > 0 and int(e.state.sched.counters.swap_ins) > 0


@pytest.mark.slow  # ~45 s of Pallas interpret mode; the kernels are checked against their references elsewhere
def test_the_pallas_kernels_inside_the_real_step_give_the_same_tokens(shipped, trace, reference):
    small = dataclasses.replace(trace, requests=trace.requests[:3])
    e, out = _serve(shipped, policies.skvs(4), small, impl="pallas")  # interpret=True on CPU
    assert out == {r.request_id: reference[r.request_id] for r in small.requests}
    assert e.cfg.impl == "pallas"


def test_a_model_runner_plugs_in(shipped, trace, reference):
    """The engine reaches the model only through `ModelRunner`; building it from one gives the same tokens."""
    runner, params = LlamaMedusaRunner.create(*shipped)
    e = engine.Engine.from_runner(runner, params, policies.skvs(4), CACHE, token_budget=96, prefill_chunk=32)
    r = trace.requests[2]
    assert e.generate([r.prompt], engine.SamplingParams(max_tokens=r.max_new_tokens))[0] == reference[r.request_id]
    with pytest.raises(ValueError, match="draft heads"):
        engine.Engine.from_runner(runner, params, policies.skvs(8), CACHE)


def test_temperature_sampling_is_seeded(shipped, trace):
    model, heads = shipped
    outs = []
    for seed in (0, 0, 1):
        e = engine.Engine(model, heads, policies.skvs(4), CACHE, token_budget=96, prefill_chunk=32, seed=seed)
        outs.append(e.generate([r.prompt for r in trace.requests[:3]], engine.SamplingParams(max_tokens=12,
                                                                                            temperature=1.0)))
    assert outs[0] == outs[1] and outs[0] != outs[2]
    assert all(len(o) == 12 for o in outs[0])


def test_stop_tokens_end_a_request(shipped, reference, trace):
    model, heads = shipped
    r = trace.requests[0]
    stop = reference[r.request_id][5]
    e = engine.Engine(model, heads, policies.skvs(4), CACHE, token_budget=96, prefill_chunk=32)
    out = e.generate([r.prompt], engine.SamplingParams(max_tokens=20, stop_token_ids=(stop,)))[0]
    first = reference[r.request_id].index(stop)
    assert out == reference[r.request_id][: first + 1]


def test_bad_requests_are_refused_and_the_engine_keeps_serving(shipped, trace, reference):
    model, heads = shipped
    e = engine.Engine(model, heads, policies.skvs(4), CACHE, token_budget=96, prefill_chunk=32)
    with pytest.raises(ValueError, match="empty"):
        e.add_request([])
    with pytest.raises(ValueError, match="exceeds"):
        e.add_request([1] * 120, engine.SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        e.add_request([300])
    with pytest.raises(ValueError, match="unknown policy"):
        policies.preset("fastest")
    # Each of these used to pass add_request and then fail every later step (or, for -1, lose the output).
    with pytest.raises(ValueError, match="stop_token_ids must be ints >= 0"):
        engine.SamplingParams(stop_token_ids=("a",))
    with pytest.raises(ValueError, match="stop_token_ids must be ints >= 0"):
        engine.SamplingParams(stop_token_ids=(-1,))
    with pytest.raises(ValueError, match="stop_token_ids must lie in"):
        e.add_request([1, 2], engine.SamplingParams(stop_token_ids=(2**40,)))
    for rid in (-1, 2**31):
        with pytest.raises(ValueError, match="request_id must lie in"):
            e.add_request([1, 2], request_id=rid)
    with pytest.raises(TypeError, match="request_id must be an int"):
        e.add_request([1, 2], request_id=1.5)
    with pytest.raises(TypeError, match="prompt_tokens must be ints"):
        e.add_request([1.7, 2.2])
    with pytest.raises(TypeError, match="prompt_tokens must be a sequence"):
        e.add_request("abc")
    with pytest.raises(ValueError, match="temperature must be a finite"):
        engine.SamplingParams(temperature=float("inf"))
    sp = engine.SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5), stop_token_ids=[np.int32(7)])
    assert (sp.max_tokens, sp.temperature, sp.stop_token_ids) == (3, 0.5, (7,))
    assert all(type(v) in (int, float, tuple) for v in (sp.max_tokens, sp.temperature, sp.stop_token_ids))
    with pytest.raises(ValueError, match="impl must be one of"):
        engine.Engine(model, heads, policies.skvs(4), CACHE, impl="bogus")
    for seed, error in ((1.5, TypeError), ("a", TypeError), (None, TypeError), (-1, ValueError), (2**64, ValueError)):
        with pytest.raises(error, match="seed must"):  # JAX errors that did not name it, or an OverflowError
            engine.Engine(model, heads, policies.skvs(4), CACHE, seed=seed)
    assert not e.table.queue and not e.requests  # nothing refused was queued
    r = trace.requests[1]
    assert e.generate([r.prompt], engine.SamplingParams(max_tokens=r.max_new_tokens))[0] == reference[r.request_id]
    with pytest.raises(TypeError, match="heads"):
        engine.Engine(model, None, policies.skvs(4), CACHE)
    # prefill_chunk 0 means "the token budget" to the scheduler; the engine's prompt width must cover it.
    e0 = engine.Engine(model, heads, policies.skvs(4), CACHE, token_budget=96, prefill_chunk=0)
    assert e0.cfg.sched.chunk == 96 and e0.picker.prompt_width == 96


def test_engine_options_are_one_validated_dataclass(shipped):
    """`EngineOptions` holds every option: keywords and an options object give the same engine; an unknown
    keyword, a bad field or a wrong type is refused naming it, when the options are made."""
    model, heads = shipped
    opts = engine.EngineOptions(token_budget=96, prefill_chunk=32, seed=7)
    a = engine.Engine(model, heads, policies.preset("naive_spec"), CACHE, opts)
    b = engine.Engine(model, heads, policies.preset("naive_spec"), CACHE, token_budget=96, prefill_chunk=32, seed=7)
    c = engine.Engine(model, heads, policies.preset("naive_spec"), CACHE, opts, seed=8)  # a keyword overrides
    assert a.options == b.options == opts and a.cfg == b.cfg and c.options.seed == 8 and c.options.token_budget == 96
    with pytest.raises(TypeError, match=r"unknown engine option\(s\) \['token_budgte'\]"):
        engine.Engine(model, heads, policies.preset("naive_spec"), CACHE, token_budgte=96)
    with pytest.raises(TypeError, match="options must be an EngineOptions"):
        engine.Engine(model, heads, policies.preset("naive_spec"), CACHE, {"token_budget": 96})
    for kw, error, says in ((dict(impl="cuda"), ValueError, "impl must be one of"),
                            (dict(swap_blocks=-1), ValueError, "swap_blocks must be >= 0"),
                            (dict(split_rows=1.5), TypeError, "split_rows must be an int"),
                            (dict(step_cost="exact"), ValueError, "step_cost must be 'fit', 'flat'"),
                            (dict(step_cost=1.0), TypeError, "step_cost must be 'fit', 'flat'"),
                            (dict(acceptance="any"), ValueError, "acceptance must be one of"),
                            (dict(sample_drafts=1), TypeError, "sample_drafts must be a bool"),
                            (dict(posterior_alpha=-1), ValueError, "posterior_alpha must be a number"),
                            (dict(tree="chain"), TypeError, "tree must be a DraftTree"),
                            (dict(disk_dir=3), TypeError, "disk_dir must be"),
                            (dict(clock=1.0), TypeError, "clock must be a callable"),
                            (dict(seed=-1), ValueError, "seed must lie in"),
                            (dict(tpot_target=0.0), ValueError, "tpot_target must be None or seconds"),
                            (dict(tpot_target=2000.0), ValueError, "tpot_target must be None or seconds")):
        with pytest.raises(error, match=says):
            engine.EngineOptions(**kw)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.seed = 1


def test_a_tpot_target_reaches_the_scheduler_and_the_records(shipped):
    """SamplingParams.tpot_target (seconds) reaches the request's slot as microseconds; a request without one takes
    the engine's default; bad targets are refused naming the field, before anything is queued."""
    model, heads = shipped
    e = engine.Engine(model, heads, policies.skvs(4), CACHE, token_budget=96, prefill_chunk=32, tpot_target=0.05)
    own = e.add_request([1, 2, 3], engine.SamplingParams(max_tokens=2, tpot_target=0.0125))
    default = e.add_request([1, 2, 4], engine.SamplingParams(max_tokens=2))
    assert e.requests[own].sampling.tpot_target == 0.0125 and e.requests[default].sampling.tpot_target == 0.05
    arrays = e.table.admission_arrays([own, default])
    assert arrays[-1][:2].tolist() == [12_500, 50_000]
    for bad in (0, -0.1, math.nan, "fast", 1e4):
        with pytest.raises(ValueError, match="tpot_target"):
            engine.SamplingParams(tpot_target=bad)


def test_arrival_time_is_validated_and_the_engine_keeps_serving(shipped, trace, reference):
    """A non-numeric or non-finite arrival time is refused naming `arrival_time`; nothing is queued for it, and the
    requests around it are served. A number (an int, a numpy float) is taken as given."""
    model, heads = shipped
    e = engine.Engine(model, heads, policies.skvs(4), CACHE, token_budget=96, prefill_chunk=32)
    r = trace.requests[1]
    good = e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens), arrival_time=np.float64(0.5))
    for bad, error in (("soon", TypeError), ([1.0], TypeError), (True, TypeError), (float("nan"), ValueError),
                       (float("inf"), ValueError), (-math.inf, ValueError)):
        with pytest.raises(error, match="arrival_time"):
            e.add_request(r.prompt, arrival_time=bad)
    assert list(e.requests) == e.table.queue == [good] and e.requests[good].arrival_time == 0.5
    assert e.run()[good] == reference[r.request_id]


def test_an_idle_engine_holds_no_requests_blocks(shipped, trace, reference):
    """After `run()`, `generate()` or the last `step()`, no slot holds a block: what is still in use is only idle
    cached prefix blocks (`kv.manager.usage`), which `reset_prefix_cache` then frees too. Before, the finished
    slots kept theirs until one more step's schedule released them."""
    model, heads = shipped
    cfg = None
    for drive in ("run", "generate", "step"):
        # naive_spec: the greedy test's engine configuration, whose programs are compiled already.
        e = engine.Engine(model, heads, policies.preset("naive_spec"), CACHE, token_budget=96, prefill_chunk=32)
        cfg = e.cfg.sched
        reqs = trace.requests[:2]
        if drive == "generate":
            outs = e.generate([q.prompt for q in reqs], engine.SamplingParams(max_tokens=10))
        else:
            ids = [e.add_request(q.prompt, engine.SamplingParams(max_tokens=10)) for q in reqs]
            if drive == "run":
                got = e.run()
            else:
                got = {}
                while e.has_work():
                    for rid, new, _ in e.step():
                        got.setdefault(rid, []).extend(new)
            outs = [got[i] for i in ids]
        assert outs == [reference[q.request_id][:10] for q in reqs], drive
        alloc = jax.device_get(e.state.sched.kv.alloc)
        usage = jax.device_get(manager.usage(e.state.sched.kv, cfg.kv))
        assert int(usage.blocks_used) > 0 and int(usage.blocks_used) - int(usage.cached_idle) == 0, drive
        assert (alloc.seqs.num_blocks == 0).all() and (alloc.blocks.ref_count == 0).all(), drive
        assert (np.asarray(e.state.sched.seqs.status) == engine.sc.EMPTY).all(), drive
        e.reset_prefix_cache()
        assert int(manager.usage(e.state.sched.kv, cfg.kv).blocks_used) == 0, drive
        e.add_request(reqs[0].prompt, engine.SamplingParams(max_tokens=3))  # the freed slots serve again
        assert e.run() and e.table.free_slots == CACHE.max_seqs


# ------------------------------------------------------------------------------------------- skvs bench


def _bench_args(tmp_path, **kw):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--requests", "6", "--policies", "vllm_default,skvs", "--out", str(tmp_path),
                              "--no-plot", "--quiet", "--max-output", "12"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


NON_TIMING = ("kv_hit_rate", "memory_utilisation", "spec_token_waste", "spec_kv_waste", "oom_rate",
              "preemptions_per_request", "acceptance_rate", "mean_accepted_length", "num_steps", "output_tokens")


@pytest.mark.slow  # the default run's time budget (docs: `pytest -m slow`)
def test_bench_json_matches_its_schema_and_the_same_seed_repeats(tmp_path, capsys):
    """bench.json's keys; the same seed gives the same non-timing metrics under the flat step cost (a fitted one
    plans with this run's timings; its repeats share the first repeat's fit)."""
    assert bench.run(_bench_args(tmp_path, step_cost="flat")) == 0
    out = capsys.readouterr().out
    assert "greedy outputs identical across policies: True" in out and "skvs / vllm_default" in out
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["schema_version"] == bench.SCHEMA_VERSION
    assert set(doc) == {"schema_version", "command", "config", "trace", "versions", "identical_greedy_outputs",
                        "policies", "headline"}
    assert doc["trace"]["seed"] == 0 and doc["config"]["seed"] == 0 and doc["identical_greedy_outputs"] is True
    assert set(doc["versions"]) >= {"skvs_jax", "jax", "python", "platform"}
    assert set(doc["policies"]) == {"vllm_default", "skvs"}
    from skvs_jax.metrics import METRICS

    for p in doc["policies"].values():
        assert set(p) == {"metrics", "counters", "compiled_buckets", "series", "step_cost_us", "steps_by_width",
                          "split_step_us", "split", "dispatches", "requests"}
        assert p["step_cost_us"] == {} and sum(p["steps_by_width"].values()) == p["metrics"]["num_steps"]
        assert p["dispatches"]["steps"] == p["metrics"]["num_steps"] >= p["dispatches"]["dispatches"] > 0
        assert set(p["metrics"]) >= {key for key, _, _ in METRICS}
        for v in p["metrics"].values():
            assert v is None or isinstance(v, (int, float))
        assert len(p["series"]["time_s"]) == len(p["series"]["blocks_used"]) == p["metrics"]["num_steps"]
    # Same seed, same non-timing metrics.
    first = {n: {k: p["metrics"][k] for k in NON_TIMING} for n, p in doc["policies"].items()}
    assert bench.run(_bench_args(tmp_path, step_cost="flat")) == 0
    again = json.loads((tmp_path / "bench.json").read_text())
    assert {n: {k: p["metrics"][k] for k in NON_TIMING} for n, p in again["policies"].items()} == first


# --------------------------------------------------------------- the simulator replays the engine


@pytest.fixture(scope="module")
def served(shipped, trace):
    """The real engine (skvs, greedy; the configuration of the greedy test above) on the trace, warmed up, every
    request arriving at t = 0, one step per dispatch: within a dispatch of several, a step that needs a narrower
    width runs on at the wider one when the fitted step cost says its padding is cheap (`dispatch.fits_width`),
    which depends on the warm-up's timings; one step per dispatch runs every step at the host's pick, the layout
    the simulator's `EngineLayout` reproduces (as `sim.fidelity` serves)."""
    model, heads = shipped
    e = engine.Engine(model, heads, policies.skvs(4), CACHE, token_budget=96, prefill_chunk=32, steps_per_dispatch=1)
    e.warmup()
    for r in trace.requests:
        e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens), request_id=r.request_id,
                      arrival_time=0.0)
    out = e.run()
    runner, params = LlamaMedusaRunner.create(model, heads)
    runs = sim.replay_acceptance(runner, params, {r.request_id: list(r.prompt) + out[r.request_id]
                                                  for r in trace.requests}, e.policy.draft_len)
    return e, out, runs


def test_warm_up_fits_the_step_cost_of_the_programs_it_runs(served, reference):
    """`warmup` timed every width the engine runs and priced steps with the fit (`serve.step_cost`), compiling
    nothing more; the run it then served is still the greedy reference."""
    from skvs_jax.serve import step_cost

    e, out, _ = served
    assert out == reference
    widths = sorted(set(e.picker.decode_widths) | {e.picker.prompt_width})
    assert e.step_cost_mode == "fit" and sorted(e.step_cost_times) == widths == [1, 3, 5, 32]
    assert all(t > 0 for t in e.step_cost_times.values()) and e.split_step_us > 0
    # A step with prompt work is priced at the split branch's time (what it runs while the chunks fit it).
    want = step_cost.fit(e.step_cost_times | {e.picker.prompt_width: e.split_step_us}, widths, e.cfg.sched.token_budget,
                         e.picker.prompt_width)
    for field in ("token_us", "width_us"):
        assert np.asarray(getattr(e.state.step_cost, field)).tolist() == np.asarray(getattr(want, field)).tolist()
    assert sorted(w for w, _ in e.compiled) == widths


def _cpu_cost(e: engine.Engine) -> cm.CostModel:
    log = e.step_log
    gaps = [b["start"] - a["start"] for a, b in zip(log, log[1:])] + [log[-1]["duration"]]
    samples = [cm.StepSample(s["prefill_tokens"], s["decode_tokens"], s["kv_tokens_read"], g, s["num_seqs"],
                             s["drafting_rows"]) for s, g in zip(log, gaps)]
    return cm.CostModel(cm.MODELS["tiny"], cm.fit_cpu_device(samples))


def test_replaying_a_real_run_reproduces_its_schedule_exactly(served, trace):
    e, out, runs = served
    st_trace = sim.make_trace(trace, e.cfg.sched, outputs=out, accept_runs=runs)
    st, log = sim.simulate(st_trace, e.knobs, cfg=e.cfg.sched, cost=_cpu_cost(e), max_steps=200,
                           controller_cost=_engine_controller_cost(e), layout=fidelity.layout_of(e))
    real, simulated = jax.device_get(e.state.sched.counters), jax.device_get(st.counters)
    for field in real.__dataclass_fields__:  # preemptions, prefix hits, drafts, acceptance, steps: all equal
        assert int(getattr(real, field)) == int(getattr(simulated, field)), field
    active = np.asarray(log.active)
    assert int(active.sum()) == len(e.step_log) and not active[len(e.step_log):].any()
    for key, col in (("blocks_used", log.blocks_used), ("spec_blocks", log.spec_blocks), ("oom", log.oom),
                     ("drafted", log.drafted), ("output_tokens", log.output_tokens),
                     ("query_slots", log.query_slots)):  # every step laid out as the engine did, padding included
        assert np.asarray(col)[active].tolist() == [s[key] for s in e.step_log], key
    assert len({s["query_slots"] for s in e.step_log}) > 2  # narrow, split or wide, and decode widths all ran
    assert int(real.preempt_recompute) > 0 and int(real.cached_tokens) > 0 and int(real.accepted) > 0
    # The simulated tokens are the engine's: the final token table matches row by row.
    m = sim.summarize(log, st_trace, e.cfg.sched)
    assert m["num_requests"] == len(trace.requests) and m["num_aborted"] == 0
    assert m["output_tokens"] == sum(len(v) for v in out.values())
    # First admissions: the engine's per-request count, the simulator's and the scheduler's counters agree, and
    # the recompute re-admissions' hits are what separates the two hit rates.
    first = dict(zip(np.asarray(st_trace.request_id).tolist(), np.asarray(log.first_cached_tokens).tolist()))
    assert first == {rid: r.first_cached_tokens for rid, r in e.requests.items()}
    assert sum(first.values()) == int(real.first_cached_tokens) < int(real.cached_tokens)
    assert int(real.first_prompt_tokens) == sum(len(r.prompt) for r in trace.requests) < int(real.prompt_tokens)
    assert m["kv_hit_rate_first"] == pytest.approx(int(real.first_cached_tokens) / int(real.first_prompt_tokens))
    assert m["kv_hit_rate"] == pytest.approx(int(real.cached_tokens) / int(real.prompt_tokens))


def _engine_controller_cost(e):
    """The step cost the engine's draft controller planned with: a replay that plans with the same costs makes the
    same decisions, whatever cost model prices its clock."""
    return e.state.step_cost


@pytest.mark.slow  # the default run's time budget; tests/test_sim_cost_model.py checks the pricing itself
def test_the_cost_model_prices_the_schedule_a_large_model_would_run(served, trace):
    """The same schedule on Llama-3.1-8B / A100: memory-bound steps of ~10 ms; nothing about the schedule moves."""
    e, out, runs = served
    st_trace = sim.make_trace(trace, e.cfg.sched, outputs=out, accept_runs=runs)
    cost = cm.CostModel(cm.MODELS["llama-3.1-8b"], cm.DEVICES["a100-80gb"])
    st, log = sim.simulate(st_trace, e.knobs, cfg=e.cfg.sched, cost=cost, max_steps=200,
                           controller_cost=_engine_controller_cost(e))
    dur = np.asarray(log.duration)[np.asarray(log.active)]
    assert len(dur) == len(e.step_log) and np.all(dur > 0.009) and np.all(dur < 0.2)
    assert int(st.counters.steps) == int(e.state.sched.counters.steps)


def _no_block_leaks(e):
    """Every usable block is free, in the speculative pool, held by a live slot, or cached (evictable)."""
    blocks = jax.device_get(e.state.sched.kv.alloc.blocks)
    held = (blocks.ref_count > 0) | blocks.cached
    free = int(blocks.free_top) + int(blocks.pool_top)
    assert free + int(np.sum(held[1:])) == e.cfg.sched.cache.usable_blocks


def test_abort_request_ends_a_queued_or_running_request_and_the_others_are_unchanged(shipped, trace, reference):
    """vLLM's `abort_request`: the aborted requests stop where they were (a running one's blocks go back), the
    rest still give the greedy reference tokens, and an aborted or finished request cannot be aborted again."""
    model, heads = shipped
    e = engine.Engine(model, heads, policies.skvs(4), CACHE, token_budget=96, prefill_chunk=32)
    for r in trace.requests:
        e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens), request_id=r.request_id)
    queued = e.table.queue[-1]  # 10 requests for 8 slots: the last two wait in the queue at first
    while not any(e.requests[rid].tokens for rid in e.table.slot_of):
        e.step()
    running = next(rid for rid in e.table.slot_of if e.requests[rid].tokens)
    partial = list(e.requests[running].tokens)
    assert e.abort_request(running) and e.abort_request(queued)
    assert not e.abort_request(running) and not e.abort_request(10_000)
    out = e.run()
    assert out[running] == partial and out[queued] == []
    assert e.requests[running].aborted and not e.requests[running].finished
    for rid, tokens in out.items():
        if rid not in (running, queued):
            assert tokens == reference[rid], rid
            assert not e.abort_request(rid)  # finished
    assert int(e.state.sched.counters.aborted) == 1  # the queued one never reached a slot
    _no_block_leaks(e)
    with pytest.raises(TypeError, match="request_id"):
        e.abort_request("1")


def test_reset_prefix_cache_forgets_cached_prefixes(shipped, trace, reference):
    """After `reset_prefix_cache` the same prompt finds no hit; without it, it does. Outputs are unchanged."""
    model, heads = shipped
    r = trace.requests[0]
    hits = {}
    for reset in (False, True):
        # naive_spec: the greedy test's engine configuration, whose programs are compiled already.
        e = engine.Engine(model, heads, policies.preset("naive_spec"), CACHE, token_budget=96, prefill_chunk=32)
        first = e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens))
        e.run()
        if reset:
            e.reset_prefix_cache()
            assert not np.any(np.asarray(e.state.sched.kv.alloc.blocks.cached))
            assert int(np.sum(np.asarray(e.state.sched.kv.prefix.block) > 0)) == 0
        again = e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens))
        out = e.run()
        assert out[first] == out[again] == reference[r.request_id]
        hits[reset] = e.requests[again].cached_tokens
        _no_block_leaks(e)
    assert hits[False] > 0 and hits[True] == 0, hits


# ------------------------------------------------- speculative-validation kernels, scrubbing, poison, disk tier

GARBAGE = 1e4  # large and finite: a read of it moves the logits; NaN would leak through a correct additive mask


def _record_batches(monkeypatch) -> list:
    """Make `Engine.step` (of an engine with steps_per_dispatch=1) run its fused step as its two halves (the same
    program, split) and keep every step's batch on the host with each row's committed length right after the step
    (int32[B]: read from the step's own state, since the engine's last step then releases the finished slots), so
    a test can see which slots held which drafts."""
    seen = []

    def fused_with_batch(runner, params, st, knobs, branch=engine_step.AUTO, *, cfg, width):
        st, batch = engine_step.schedule_only(st, knobs, cfg=cfg)
        batch_host = jax.device_get(batch)
        st, out = engine_step.model_only(runner, params, st, batch, knobs, branch, cfg=cfg, width=width)
        seen.append((batch_host, np.asarray(jax.device_get(st.sched.kv.alloc.seqs.num_committed))))
        return st, out

    monkeypatch.setattr(engine_step, "fused_step", fused_with_batch)
    return seen


def _rejected_slots(batch, committed, block_size) -> list[tuple[int, int]]:
    """(block, offset) of every draft slot the step rejected: positions from the row's committed length after the
    step (committed int32[B]) up to the end of what the forward wrote (start + num_query + num_drafts)."""
    out = []
    for b in np.flatnonzero(np.asarray(batch.scheduled) & (np.asarray(batch.num_drafts) > 0)):
        end = int(batch.start[b] + batch.num_query[b] + batch.num_drafts[b])
        for p in range(int(committed[b]), end):
            out.append((int(batch.block_table[b, p // block_size]), p % block_size))
    return out


def _dead_slots(alloc, cfg) -> np.ndarray:
    """bool[N, S]: slots no sequence may read: everything but the committed tokens of the blocks sequences hold
    and the cached (validated, full) blocks. Free and speculative-pool blocks, the null block, and the slots past
    each holder's committed length (rejected drafts, stale lazily-held blocks) are dead."""
    s = cfg.block_size
    live = np.zeros((cfg.num_blocks, s), bool)
    live[np.asarray(alloc.blocks.cached)] = True
    table, nb, committed = (np.asarray(x) for x in (alloc.seqs.block_table, alloc.seqs.num_blocks,
                                                    alloc.seqs.num_committed))
    for b in range(table.shape[0]):
        for col in range(nb[b]):
            live[table[b, col]] |= col * s + np.arange(s) < committed[b]
    live[0] = False
    return ~live


def _serve_checked(e, requests, *, poison: bool) -> tuple[dict, int, int]:
    """Run to completion; after every step count the step's rejected draft slots and those of them holding
    anything but zeros in some cache array, and, with poison, fill every dead slot with GARBAGE. Returns (tokens,
    rejected slots, rejected slots not zero)."""
    for r in requests:
        e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens), request_id=r.request_id)
    seen, rejected_n, dirty_n = e._test_batches, 0, 0
    s = e.cfg.sched.cache.block_size
    while e.has_work():
        e.step()
        alloc = jax.device_get(e.state.sched.kv.alloc)
        pages = e._kv_pages()
        rejected = _rejected_slots(*seen[-1], s)
        if rejected:
            blk, off = np.asarray(rejected).T
            dirty = np.zeros(len(rejected), bool)
            for x in pages:
                dirty |= np.asarray(x)[blk, :, off].reshape(len(rejected), -1).any(axis=1)  # [N, L, S, ...]: all layers
            rejected_n, dirty_n = rejected_n + len(rejected), dirty_n + int(dirty.sum())
        if poison:
            dead = jnp.asarray(_dead_slots(alloc, e.cfg.sched.cache))
            dead = dead[:, None, :]  # [N, 1, S]: every layer's slot (block, offset)
            e._set_kv_pages(tuple(jnp.where(dead.reshape(dead.shape + (1,) * (x.ndim - 3)), GARBAGE, x).astype(x.dtype)
                                  for x in pages))
    return {r.request_id: list(e.requests[r.request_id].tokens) for r in requests}, rejected_n, dirty_n


def _engine(shipped, policy, monkeypatch, **kw):
    model, heads = shipped
    e = engine.Engine(model, heads, policy, kw.pop("cache", CACHE), token_budget=96, prefill_chunk=32,
                      steps_per_dispatch=1, **kw)  # one step per dispatch: the test reads every step's batch
    e._test_batches = _record_batches(monkeypatch)
    return e


def test_freed_and_rejected_slots_are_never_read_and_rejected_drafts_are_scrubbed(shipped, trace, reference,
                                                                                   monkeypatch):
    """After every step every dead slot (free and pool blocks, the null block, slots past a holder's committed
    length) is overwritten with garbage: the outputs stay the greedy reference, so no sequence reads a freed or
    rejected slot. Under skvs with scrub_rejected (the preset leaves it off) every slot of a rejected draft holds
    zeros right after its step."""
    # One draft bucket (widths 5 and the prompt's): each width is a program of ~20 s to compile here.
    e = _engine(shipped, policies.skvs(4).replace(draft_buckets=(4,), scrub_rejected=True), monkeypatch)
    requests = trace.requests[:6]
    out, rejected, dirty = _serve_checked(e, requests, poison=True)
    assert out == {r.request_id: reference[r.request_id] for r in requests}
    assert rejected > 0 and dirty == 0, "a rejected draft's K/V was not scrubbed"
    c, ac = e.state.sched.counters, e.state.sched.kv.alloc.counters
    # Blocks changed hands under pressure: preempted sequences' blocks and evicted cached ones were reused.
    assert int(c.preempt_recompute) > 0 and int(ac.evictions) > 0 and int(c.accepted) < int(c.drafted)


@pytest.mark.slow  # the default run's time budget (docs: `pytest -m slow`)
def test_pallas_validation_kernels_in_the_step_give_the_xla_paths_states_and_tokens(shipped, trace, reference,
                                                                                    monkeypatch):
    """impl="pallas" (interpreted here) runs the commit's block-state update and the scrub through the Pallas
    kernels: allocator state, scheduler counters and tokens equal the xla path's; without the scrub the same run
    leaves rejected drafts' K/V in place (the check above can fail) and schedules identically."""
    small = [dataclasses.replace(r, max_new_tokens=8) for r in trace.requests[:2]]  # greedy: a prefix of the reference
    # Two programs (prompt, decode): interpret mode is slow. skvs leaves the scrub off; this test turns it on.
    policy = policies.skvs(4).replace(draft_buckets=(4,), scrub_rejected=True)
    cache = CacheConfig(num_blocks=24, block_size=8, max_seqs=2, max_blocks_per_seq=16)
    runs = {}
    for impl, pol in (("xla", policy), ("pallas", policy), ("xla-noscrub", policy.replace(scrub_rejected=False))):
        e = _engine(shipped, pol, monkeypatch, impl=impl.split("-")[0], cache=cache)
        out, rejected, dirty = _serve_checked(e, small, poison=False)
        assert out == {r.request_id: reference[r.request_id][:8] for r in small}, impl
        runs[impl] = (jax.device_get(e.state.sched.kv.alloc), jax.device_get(e.state.sched.counters),
                      (rejected, dirty), e)
    for impl in ("pallas", "xla-noscrub"):
        same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), runs["xla"][:2], runs[impl][:2])
        assert all(jax.tree.leaves(same)), impl
    rejected = runs["xla"][2][0]
    assert rejected > 0 and runs["xla"][2] == runs["pallas"][2] == (rejected, 0)
    assert runs["xla-noscrub"][2] == (rejected, rejected)  # unscrubbed, every rejected slot still holds its draft
    assert runs["pallas"][3].cfg.sched.kv.impl == "pallas"
    # The kernels are in the traced step: the commit's block states and the scrub lower to pallas_call.
    e = runs["pallas"][3]
    commit = jax.make_jaxpr(lambda kv, n: manager.commit(kv, n, e.cfg.sched.kv))(
        e.state.sched.kv, jnp.zeros((cache.max_seqs,), jnp.int32))
    assert "pallas_call" in str(commit)
    assert "pallas_call" not in str(jax.make_jaxpr(lambda kv, n: manager.commit(kv, n, runs["xla"][3].cfg.sched.kv))(
        e.state.sched.kv, jnp.zeros((cache.max_seqs,), jnp.int32)))


@pytest.mark.slow  # the default run's time budget (docs: `pytest -m slow`)
def test_swaps_spill_to_a_bounded_disk_tier_and_come_back(shipped, trace, reference, tmp_path):
    """A host tier too small for the swaps: older swaps spill to the disk tier (in disk_dir) and come back from
    it; the outputs are still the greedy reference, and every tier slot is free at the end. When host and disk are
    both full the scheduler recomputes instead, as it does without a disk tier."""
    # The article's preset: its swaps overlap on this trace (skvs's three do not, so nothing needs to spill).
    swap = policies.skvs_article(4).replace(preemption="swap")
    e, out = _serve(shipped, swap, trace, swap_blocks=4, disk_blocks=12, disk_dir=str(tmp_path))
    assert out == reference
    t, c = e.tiers, e.state.sched.counters
    assert e.cfg.sched.swap_blocks == 16 and t.capacity == 16
    assert int(c.preempt_swap) > 0 and int(c.swap_ins) == int(c.preempt_swap) and int(c.preempt_recompute) == 0
    assert t.spilled_blocks > 0 and t.disk_in_blocks > 0, (t.spilled_blocks, t.disk_in_blocks)
    assert t.free_blocks == t.capacity and list(tmp_path.iterdir())
    # Smaller tiers: some victims fit neither, and are recomputed.
    e, out = _serve(shipped, swap, trace, swap_blocks=2, disk_blocks=4)
    assert out == reference
    c = e.state.sched.counters
    assert int(c.preempt_swap) > 0 and int(c.preempt_recompute) > 0 and e.tiers.disk_in_blocks > 0
    e.tiers.close()


def test_cache_salt_isolates_tenants_and_equal_salts_share(shipped, trace, reference):
    """vLLM's `cache_salt`: a prompt served under salt "a" gives no hit to the same prompt under salt "b" or
    unsalted, and the hit an unsalted repeat gets to the same prompt under "a" again. Outputs never change."""
    model, heads = shipped
    r = trace.requests[0]
    e = engine.Engine(model, heads, policies.preset("naive_spec"), CACHE, token_budget=96, prefill_chunk=32)
    hits = {}
    for name, salt in (("first", "a"), ("other", "b"), ("unsalted", None), ("same", "a"), ("unsalted again", None)):
        rid = e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens), cache_salt=salt)
        assert e.run()[rid] == reference[r.request_id]
        hits[name] = e.requests[rid].cached_tokens
    assert hits["same"] > 0 and hits["same"] == hits["unsalted again"], hits  # as an unsalted repeat hits
    assert hits["first"] == hits["other"] == hits["unsalted"] == 0, hits
    _no_block_leaks(e)
    for bad in ("", 3):
        with pytest.raises(TypeError, match="cache_salt"):
            e.add_request(r.prompt, cache_salt=bad)
    assert engine.salt_id(None) == 0 and engine.salt_id("a") != engine.salt_id("b") and engine.salt_id("a") > 0
