"""Many engine steps per dispatch change nothing but the time, feature by feature (tests/test_engine_dispatch.py
has per-request sampling, aborts, the overlap and the timing): preemption by swap to a host tier spilling to a
disk tier (a step that swaps ends its dispatch and runs on the host's two-program path), a draft tree with
typical acceptance at temperature > 0, and the other presets. Each against the one-step engine
(steps_per_dispatch=1); the default run takes each feature at one N, `-m slow` at every N in {2, 8, 64, auto}.
For a greedy feature the default run compares with the greedy reference instead, which the one-step engine gives
(tests/test_engine.py): the same tokens, without compiling the one-step programs too.
"""

import numpy as np
import pytest

from reference_models import greedy_generate
from skvs_jax import policies, workloads
from skvs_jax.config import CacheConfig
from skvs_jax.serve import dispatch, engine, speculation
from skvs_jax.testing.engines import assert_same_serving, serve_trace

CACHE = CacheConfig(num_blocks=48, block_size=8, max_seqs=8, max_blocks_per_seq=16)
ALL_N = (2, 8, 64, "auto")

FEATURES = {
    # name: (policy, engine options, sampling of request i with max_tokens m (None: greedy))
    "swap_tiers": (policies.skvs_article(4).replace(preemption="swap"), dict(swap_blocks=4, disk_blocks=12), None),
    "tree_typical": (policies.naive_spec(15), dict(tree=speculation.SMALL_TREE, acceptance="typical"),
                     lambda i, m: engine.SamplingParams(max_tokens=m, temperature=0.7, seed=i)),
    "vllm_default": (policies.vllm_default(), {}, None),
    "skvs_article": (policies.skvs_article(4), {}, None),
}
DEFAULT_N = {"swap_tiers": 2, "tree_typical": 64, "vllm_default": "auto", "skvs_article": 8}
# In the default run: every preset once (skvs: tests/test_engine_dispatch.py; skvs_article: its swap here; naive_spec:
# the tree); skvs_article alone again (~100 s) only under `-m slow`.
SLOW = {"skvs_article", "tree_typical"}  # the default run's time budget (`pytest -m slow`)


@pytest.fixture(scope="module")
def trace():
    return workloads.make("system_prompts", 10, seed=1, system_prompt_len=40, max_prompt_len=80, max_output_len=20)


def _serve(shipped, name, trace, steps, tmp_path):
    policy, options, sampling = FEATURES[name]
    if "disk_blocks" in options:
        options = dict(options, disk_dir=str(tmp_path))
    return serve_trace(*shipped, policy, CACHE, trace.requests, sampling, token_budget=96, prefill_chunk=32,
                       steps_per_dispatch=steps, **options)


@pytest.fixture(scope="module")
def reference(shipped, trace):
    model, _ = shipped
    return {r.request_id: greedy_generate(model, np.asarray([r.prompt]), r.max_new_tokens)[0, len(r.prompt):].tolist()
            for r in trace.requests}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in FEATURES])
def test_each_feature_at_one_steps_per_dispatch(shipped, trace, one_step, reference, name, tmp_path):
    steps = DEFAULT_N[name]
    many = _serve(shipped, name, trace, steps, tmp_path)
    if FEATURES[name][2] is None:  # greedy: the one-step engine's tokens are the reference's
        assert {rid: r.tokens for rid, r in many.requests.items()} == reference
    else:
        assert_same_serving(one_step(name), many)
    assert len([d for d in many.dispatch_log if d["steps"]]) < len(many.step_log)
    c = many.state.sched.counters
    if name == "swap_tiers":  # swaps happened, spilled to disk and came back; each ended its dispatch
        assert int(c.preempt_swap) > 0 and int(c.swap_ins) == int(c.preempt_swap)
        assert many.tiers.spilled_blocks > 0 and many.tiers.free_blocks == many.tiers.capacity
        assert any(d["stop"] == "swap" for d in many.dispatch_log)
    if name == "tree_typical":
        assert int(c.accepted) > int(c.verifications) > 0  # the tree accepted more than one draft per verification
    assert int(c.preempt_recompute) + int(c.preempt_swap) > 0


@pytest.mark.slow  # the cross product; the default run covers each feature at one N
@pytest.mark.parametrize("steps", ALL_N)
@pytest.mark.parametrize("name", list(FEATURES))
def test_every_feature_at_every_steps_per_dispatch(shipped, trace, one_step, name, steps, tmp_path):
    many = _serve(shipped, name, trace, steps, tmp_path)
    assert_same_serving(one_step(name), many)
    assert max(d["steps"] for d in many.dispatch_log) <= (dispatch.AUTO_STEPS if steps == "auto" else steps)
