"""Policies: presets match docs/design.md, bad switches are refused, allocator-level switches change behaviour."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skvs_jax import policies
from skvs_jax.config import CacheConfig
from skvs_jax.kv import allocator

i32 = jnp.int32
CFG = CacheConfig(num_blocks=16, block_size=4, max_seqs=2, max_blocks_per_seq=6)


def test_presets_are_the_designed_switch_settings():
    v, n, s = policies.vllm_default(), policies.naive_spec(4), policies.skvs(4)
    assert not v.speculation and v.prefix_cache and v.preemption == "recompute"
    assert n.speculation and n.draft_len == 4 and not n.adaptive_draft_len and n.release == "lazy"
    assert not n.spec_pool and n.spec_in_prefill and not n.prefix_barrier and n.insert == "on_fill"
    assert n.drafts_preempt and not s.drafts_preempt and not v.drafts_preempt
    assert s.speculation and s.adaptive_draft_len and s.release == "immediate" and s.spec_pool
    assert s.generation_threshold > 0 and not s.prefix_barrier and s.insert == "validated"
    assert s.draft_control == "goodput" and s.draft_memory == "priced" and policies.skvs_article(4).prefix_barrier
    assert s.spec_in_prefill and not policies.skvs_article(4).spec_in_prefill
    assert s.max_spec_ratio == pytest.approx(0.3) and s.draft_buckets == (0, 2, 4)
    assert policies.preset("skvs", 6).draft_buckets == (0, 3, 6)
    assert len({hash(p) for p in (v, n, s)}) == 3 and hash(s) == hash(policies.skvs(4))


def test_each_ablation_changes_one_switch_family():
    base = policies.skvs(4)
    abl = policies.ablations(base)
    assert set(abl) == {f"skvs -{f}" for f in ("draft_memory", "draft_control", "tail_guard", "tail_peers",
                                              "adaptive_draft_len", "release", "spec_pool", "insert", "drafts_preempt",
                                              "max_spec_ratio")}
    for name, p in abl.items():
        changed = {f.name for f in dataclasses.fields(p) if getattr(p, f.name) != getattr(base, f.name)}
        switch = name.split(" -")[1]
        assert switch in changed and changed - {switch, "name"} <= {"generation_threshold", "draft_buckets",
                                                                    "draft_control"}
    # skvs is the article's skvs with seven switches changed: the controller and its two tail terms, priced draft
    # blocks, no barrier, no scrub, reservations while prefilling; the article's own ablations leave the first four
    # alone and ablate its barrier and its dropped reservation.
    assert abl["skvs -draft_control"].replace(name="skvs_article", draft_memory="opportunistic",
                                              prefix_barrier=True, scrub_rejected=True, tail_guard=None,
                                              tail_peers=None, spec_in_prefill=False) == policies.skvs_article(4)
    assert set(policies.ablations(policies.skvs_article(4))) == {
        n.replace("skvs", "skvs_article") for n in abl
        if n not in ("skvs -draft_control", "skvs -draft_memory", "skvs -tail_guard", "skvs -tail_peers")
    } | {"skvs_article -prefix_barrier", "skvs_article -spec_in_prefill"}


def test_skvs_is_the_article_with_the_goodput_controller_priced_blocks_no_barrier_and_prefill_reservations():
    a, s = policies.skvs_article(4), policies.skvs(4)
    assert a.draft_control == "histogram" and not a.goodput_control and s.goodput_control
    assert not a.priced_drafts and s.priced_drafts and not s.replace(drafts_preempt=True).priced_drafts
    assert s == a.replace(name="skvs", draft_control="goodput", draft_memory="priced", prefix_barrier=False,
                          scrub_rejected=False, spec_in_prefill=True, tail_guard=0, tail_peers=102)
    assert policies.preset("skvs_article") == a
    with pytest.raises(ValueError, match="draft_control"):
        s.replace(draft_control="magic")
    for bad in (-1, 1025, 0.5, True):
        with pytest.raises(ValueError, match="tail_guard"):
            s.replace(tail_guard=bad)
        with pytest.raises(ValueError, match="tail_peers"):
            s.replace(tail_peers=bad)


@pytest.mark.parametrize(
    "changes, error, match",
    [
        (dict(insert="eager"), ValueError, "insert"),
        (dict(preemption="drop"), ValueError, "preemption"),
        (dict(release="sometimes"), ValueError, "release"),
        (dict(max_spec_ratio=1.5), ValueError, "max_spec_ratio"),
        (dict(draft_len=-1), ValueError, "draft_len"),
        (dict(draft_buckets=(0, 4, 2)), ValueError, "draft_buckets"),
        (dict(draft_buckets=(0, 2)), ValueError, "draft_buckets"),
        (dict(spec_pool=1), TypeError, "spec_pool"),
        (dict(prefix_cache=False, prefix_barrier=True), ValueError, "prefix_barrier"),
        (dict(draft_memory="borrowed"), ValueError, "draft_memory"),
        (dict(speculation=False), ValueError, "without speculation"),
    ],
)
def test_inconsistent_switches_are_refused(changes, error, match):
    with pytest.raises(error, match=match):
        policies.skvs(4).replace(**changes)


def test_unknown_preset_name():
    with pytest.raises(ValueError, match="unknown policy"):
        policies.preset("fastest")


def _reject_all_drafts(policy):
    spec = policy.spec_config()
    st = allocator.init(CFG)
    st, _ = allocator.allocate(st, jnp.asarray([4, 4], i32), cfg=CFG, spec=spec)  # one full block each
    st, _ = allocator.commit(st, jnp.asarray([4, 4], i32), cfg=CFG, spec=spec)
    st, _ = allocator.allocate_speculative(st, jnp.asarray([4, 4], i32), 1, cfg=CFG, spec=spec)
    st, _ = allocator.commit(st, jnp.asarray([0, 0], i32), cfg=CFG, spec=spec)
    return st


def test_release_and_pool_switches_reach_the_allocator():
    skvs_st = _reject_all_drafts(policies.skvs(4))
    np.testing.assert_array_equal(skvs_st.seqs.num_blocks, [1, 1])  # rejected-only blocks left at once...
    assert int(skvs_st.blocks.pool_top) == 2  # ...into the speculative pool
    naive_st = _reject_all_drafts(policies.naive_spec(4))
    np.testing.assert_array_equal(naive_st.seqs.num_blocks, [2, 2])  # held until the sequences end
    assert int(naive_st.blocks.pool_top) == 0
    no_pool = _reject_all_drafts(policies.ablations()["skvs -spec_pool"])
    assert int(no_pool.blocks.pool_top) == 0 and int(no_pool.blocks.free_top) == CFG.num_blocks - 3


def test_knobs_are_data_one_program_serves_a_sweep():
    st = _reject_all_drafts(policies.skvs(4))  # two pool blocks from generation 1
    knobs = jax.tree.map(lambda *x: jnp.stack(x), *[policies.skvs(4).replace(generation_threshold=t).knobs()
                                                     for t in (0, 2, 5)])
    counts = jax.vmap(lambda k: allocator.reclaim_expired(st, 4, k.generation_threshold)[1])(knobs)
    np.testing.assert_array_equal(counts, [2, 2, 0])  # 4 - 1 = 3 > 0 and > 2, not > 5


def test_kv_precision_switch_and_the_articles_draft_length_rule():
    assert policies.skvs(4).kv_dtype() == "float32"  # presets keep the model's precision
    rule = policies.skvs(4).replace(kv_precision="by_draft_len")
    assert rule.kv_dtype() == "float8_e4m3fn"
    assert policies.naive_spec(6).replace(kv_precision="by_draft_len").kv_dtype() == "bfloat16"
    assert policies.skvs(4).replace(kv_precision="int8").kv_dtype() == "int8"
    with pytest.raises(ValueError, match="kv_precision"):
        policies.skvs(4).replace(kv_precision="fp4")


def test_parse_verify_budget_reads_the_command_line_forms():
    assert policies.parse_verify_budget("none") is None
    assert policies.parse_verify_budget("12") == 12
    assert policies.parse_verify_budget("knee", knee=146.9) == 146  # rounded down: never above the knee
    assert policies.parse_verify_budget("knee", knee=0.3) == 1
    with pytest.raises(ValueError, match="none or a positive integer, got 'knee'"):
        policies.parse_verify_budget("knee")  # no knee known (the real engine)
    for bad in ("0", "-4", "1.5", "", str(policies.NO_VERIFY_CAP + 1)):
        with pytest.raises(ValueError, match="--verify-budget must be none, knee or a positive integer"):
            policies.parse_verify_budget(bad, knee=100.0)


def test_the_victim_rule_is_a_policy_switch():
    assert all(p.victim == "lowest_priority" for p in (policies.vllm_default(), policies.naive_spec(), policies.skvs()))
    assert policies.skvs().replace(victim="most_progress").victim == "most_progress"
    with pytest.raises(ValueError, match="victim must be one of"):
        policies.skvs().replace(victim="oldest")


def test_parse_policy_composes_a_preset_with_typed_overrides():
    spec = policies.parse_policy("skvs:preemption=swap,victim=most_progress")
    assert spec.policy == policies.skvs(4).replace(name="skvs[preemption=swap,victim=most_progress]",
                                                   preemption="swap", victim="most_progress")
    assert spec.draft_len_knob is None and spec.overrides == (("preemption", "swap"), ("victim", "most_progress"))
    # Each field type: bool, int, float, int | None, tuple of ints ("/"-separated), str.
    spec = policies.parse_policy("naive_spec:spec_pool=on,generation_threshold=3,max_spec_ratio=0.25,"
                                 "verify_budget=none,draft_buckets=4,insert=validated,name=mine", draft_len=4)
    p = spec.policy
    assert (p.name, p.spec_pool, p.generation_threshold, p.max_spec_ratio, p.verify_budget, p.draft_buckets,
            p.insert) == ("mine", True, 3, 0.25, None, (4,), "validated")
    assert policies.parse_policy("skvs:draft_buckets=0/4").policy.draft_buckets == (0, 4)
    assert policies.parse_policy("skvs:verify_budget=24").policy.verify_budget == 24
    assert policies.parse_policy("skvs:kv_precision=bfloat16").policy.kv_dtype() == "bfloat16"
    # Switches that go together: prefix caching off takes the barrier with it (unless it is written).
    off = policies.parse_policy("skvs:prefix_cache=false").policy
    assert not off.prefix_cache and not off.prefix_barrier
    # The static K rebuilds the preset (its buckets follow); a plain name is the preset itself.
    assert policies.parse_policy("skvs:draft_len=6").policy.draft_buckets == (0, 3, 6)
    assert policies.parse_policy("skvs", draft_len=6).policy == policies.skvs(6)


def test_parse_policy_keeps_the_draft_length_knob_form():
    for text in ("naive_spec:2", "naive_spec:K=2"):
        spec = policies.parse_policy(text)
        assert spec.policy == policies.naive_spec(4).replace(name="naive_spec:2") and spec.draft_len_knob == 2
        assert int(spec.knobs().draft_len) == 2 and spec.policy.draft_len == 4  # data; the static K stays
    assert int(policies.parse_policy("skvs").knobs().draft_len) == 4
    assert policies.parse_policy("skvs:K=1,victim=most_blocks").policy.name == "skvs[K=1,victim=most_blocks]"


def test_parse_policy_defaults_apply_first_and_keep_the_name():
    spec = policies.parse_policy("skvs", defaults={"preemption": "swap", "prefix_cache": False})
    assert spec.policy.name == "skvs" and spec.policy.preemption == "swap" and not spec.policy.prefix_barrier
    assert policies.parse_policy("skvs:preemption=recompute", defaults={"preemption": "swap"}).policy.preemption == (
        "recompute")  # the written override wins


@pytest.mark.parametrize("text, match", [
    ("fastest", "unknown policy 'fastest'"),
    ("skvs:colour=red", "unknown key 'colour'"),
    ("skvs:spec_pool=maybe", "spec_pool='maybe': expected a bool"),
    ("skvs:generation_threshold=soon", "generation_threshold='soon': expected an integer"),
    ("skvs:verify_budget=lots", "verify_budget='lots': expected an integer or none"),
    ("skvs:max_spec_ratio=nan", "max_spec_ratio='nan': expected a finite number"),
    ("skvs:draft_buckets=0,2", "'2' is not KEY=VALUE (a bare draft length K comes first"),  # commas separate items
    ("skvs:x", "'x' is not KEY=VALUE"),
    ("skvs:draft_buckets=0/x", "draft_buckets='0/x': expected integers separated by '/'"),
    ("skvs:preemption=teleport", "preemption must be one of"),
    ("skvs:victim=oldest", "victim must be one of"),
    ("skvs:K=9", "K must lie in [0, 4]"),
    ("skvs:K=1,K=2", "K given twice"),
    ("skvs:name=", "name must not be empty"),
    ("skvs:prefix_cache=false,prefix_barrier=true", "prefix_barrier needs prefix_cache"),
])
def test_parse_policy_names_the_bad_key_or_value(text, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        policies.parse_policy(text)


def test_a_policy_list_splits_at_policy_names():
    assert policies.split_policies("vllm_default, skvs:preemption=swap,victim=most_progress,naive_spec:2,") == [
        "vllm_default", "skvs:preemption=swap,victim=most_progress", "naive_spec:2"]
    specs = policies.parse_policies("skvs,skvs:name=b,naive_spec", preset_defaults={"skvs": {"verify_budget": 8}})
    assert [s.policy.name for s in specs] == ["skvs", "b", "naive_spec"]
    assert [s.policy.verify_budget for s in specs] == [8, 8, None]
    with pytest.raises(ValueError, match="comes before any policy name"):
        policies.split_policies("victim=most_blocks,skvs")
    with pytest.raises(ValueError, match="two policies are named 'skvs'"):
        policies.parse_policies("skvs,skvs")
