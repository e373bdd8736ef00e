"""Speculation in the engine: draft trees, acceptance rules and compile buckets, on the shipped tiny model."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from reference_models import greedy_generate
from reference_models.medusa_tree import SMALL_TREE
from skvs_jax import policies, workloads
from skvs_jax.config import CacheConfig
from skvs_jax.serve import dispatch, engine, engine_step, speculation
from skvs_jax.serve.speculation import DraftTree

# Tight enough that preemption and prefix hits happen (as in test_engine).
CACHE = CacheConfig(num_blocks=48, block_size=8, max_seqs=8, max_blocks_per_seq=16)


@pytest.fixture(scope="module")
def trace():
    return workloads.make("system_prompts", 8, seed=1, system_prompt_len=40, max_prompt_len=80, max_output_len=20)


@pytest.fixture(scope="module")
def reference(shipped, trace):
    model, _ = shipped
    return {r.request_id: greedy_generate(model, np.asarray([r.prompt]), r.max_new_tokens)[0, len(r.prompt):].tolist()
            for r in trace.requests}


def _engine(shipped, policy, trace, **kw):
    model, heads = shipped
    temperature = kw.pop("temperature", 0.0)
    e = engine.Engine(model, heads, policy, kw.pop("cache", CACHE), token_budget=96, prefill_chunk=32, **kw)
    for r in trace.requests:
        e.add_request(r.prompt, engine.SamplingParams(max_tokens=r.max_new_tokens, temperature=temperature),
                      request_id=r.request_id)
    return e


# ------------------------------------------------------------------------------------------ tree structure


def test_every_prefix_of_a_tree_is_a_tree_and_reach_is_its_depth():
    tree = SMALL_TREE
    par = speculation.parents(tree)
    assert all(par[u] < u for u in range(1, tree.num_slots))  # parents come first: any prefix is closed
    assert speculation.reach(tree, (0, 3, 7, 15)) == (0, 1, 3, 4)
    chain = speculation.chain(3)
    assert speculation.is_chain(chain) and not speculation.is_chain(tree)
    assert speculation.reach(chain, (0, 2, 3)) == (0, 2, 3)
    with pytest.raises(ValueError, match="k must be"):
        speculation.chain(0)


def test_the_tree_layout_gives_known_tokens_causal_and_nodes_their_ancestors():
    tree = DraftTree(((0,), (1,), (0, 0)))  # nodes 1: (0,), 2: (1,), 3: (0, 0)
    start, qn = jnp.asarray([10, 0], jnp.int32), jnp.asarray([1, 3], jnp.int32)
    node, pos, mask = speculation.layout(tree, start, qn, 6)
    # Row 0: the root (last token, position 10), then nodes at depths 1, 1, 2.
    assert pos[0, :4].tolist() == [10, 11, 11, 12] and node[0, :4].tolist() == [0, 1, 2, 3]
    assert mask[0, 3, :4].tolist() == [True, True, False, True]  # (0, 0) sees the root and (0,), not (1,)
    assert mask[0, 2, :4].tolist() == [True, False, True, False]
    # Row 1: three known tokens (causal), the last of them the root of the tree.
    assert pos[1, :6].tolist() == [0, 1, 2, 3, 3, 4]
    assert mask[1, 1, :6].tolist() == [True, True, False, False, False, False]
    assert mask[1, 5, :6].tolist() == [True, True, True, True, False, True]


# ------------------------------------------------------------------------------------------ the real step


def _cache_holds_exactly(e: engine.Engine) -> int:
    """Every running row's committed positions hold the K/V a fresh prefill of its tokens computes. Returns the
    number of rows checked."""
    sched, runner = e.state.sched, e.runner
    s, m = e.cfg.sched.cache.block_size, e.cfg.sched.cache.max_blocks_per_seq
    committed = np.asarray(sched.kv.alloc.seqs.num_committed)
    table = np.asarray(sched.kv.alloc.seqs.block_table)
    rows = [b for b in range(len(committed)) if committed[b] > 0]
    if not rows:
        return 0
    width = m * s
    tokens = np.asarray(sched.seqs.tokens)[rows, :width]
    fresh = runner.init_cache(1 + len(rows) * m, s, "float32")
    fresh_table = (1 + np.arange(len(rows) * m, dtype=np.int32)).reshape(len(rows), m)
    lens = jnp.asarray(committed[rows], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :], (len(rows), width))
    _, _, fresh = runner.forward(e.params, jnp.asarray(tokens), pos, fresh, jnp.asarray(fresh_table), lens, lens,
                                 impl="xla")
    for got_pages, want_pages in zip(runner.kv_pages(e.state.cache), runner.kv_pages(fresh)):
        for r, b in enumerate(rows):
            c = committed[b]
            # [M, L, S, ...] -> [M * S, L * ...]: token positions first (the layer axis sits before the token's)
            got = np.moveaxis(np.asarray(got_pages)[table[b]], 1, 2).reshape(width, -1)[:c]
            want = np.moveaxis(np.asarray(want_pages)[fresh_table[r]], 1, 2).reshape(width, -1)[:c]
            np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)
    return len(rows)



# ------------------------------------------------------------------------------------------ choosing the path


def _verify_root(tree, root_logits, nodes, num_drafts, temperature, rule="typical", node_logits=None):
    """verify() for rows whose query is the root alone (qn = 1): root_logits float32[B, V] score the first-level
    nodes; node_logits float32[B, K, V] (default: uniform) score each node's children."""
    b, v = root_logits.shape
    k = tree.num_slots - 1
    if node_logits is None:
        node_logits = np.zeros((b, k, v), np.float32)
    logits = jnp.asarray(np.concatenate([root_logits[:, None], node_logits], axis=1))  # [B, 1 + K, V]
    return speculation.verify(tree, logits, jnp.asarray(nodes, jnp.int32), jnp.ones((b,), jnp.int32),
                              jnp.asarray(num_drafts, jnp.int32), jax.random.key(0),
                              jnp.asarray(temperature, jnp.float32), rule=rule)


def test_typical_acceptance_on_a_tree_keeps_the_likeliest_of_the_longest_runs():
    """Issue 23, defect 3: two siblings pass the typical test at the root; Medusa's `evaluate_posterior` keeps,
    among the paths with the longest accepted run, the one of highest likelihood, so the 0.6 token is emitted,
    not the first path's 0.35 one."""
    tree = DraftTree(((0,), (1,)))
    p = np.array([[0.35, 0.6, 0.05]], np.float32)
    v = _verify_root(tree, np.log(p), [[0, 1]], [2], [1.0])
    assert int(v.accepted[0]) == 1
    assert int(v.path_tokens[0, 0]) == 1, "the likelier path (p = 0.6) must win the tie in accepted length"
    assert v.path_nodes[0].tolist() == [0, 2]
    # Where the siblings stand does not matter: with the likelier token first, the first path wins.
    v = _verify_root(tree, np.log(p), [[1, 0]], [2], [1.0])
    assert int(v.path_tokens[0, 0]) == 1 and v.path_nodes[0].tolist() == [0, 1]
    # Lossless is unchanged: one token per parent can be accepted (here the sampled one), never a choice.
    v = _verify_root(tree, np.log(p), [[0, 1]], [2], [0.0], rule="lossless")
    assert int(v.accepted[0]) == 1 and int(v.path_tokens[0, 0]) == 1


def _medusa_evaluate_posterior(tree, logits, nodes, num_drafts, temperature, threshold=0.09, alpha=0.3):
    """FasterDecoding/Medusa `evaluate_posterior` (typical branch) for one row, in numpy: candidates are the
    tree's root-to-leaf paths; accept_length = leading nodes with p(x) > min(threshold, alpha exp(-H(p))); the
    best candidate is path 0 when nothing is accepted, else the first path of highest sum of log p over the
    accepted nodes among those with the longest run. Returns (accept_length, the accepted tokens)."""
    slots, valid = tree.paths
    par = speculation.parents(tree)
    z = logits.astype(np.float64) / temperature
    prob = np.exp(z - z.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    entropy = -np.sum(prob * np.log(prob + 1e-30), -1)
    lengths, likelihood = [], []
    for path, ok in zip(slots, valid):
        run, ll = 0, 0.0
        for u in path[1:][ok[1:]]:
            pu = prob[par[u], nodes[u - 1]]
            if u > num_drafts or not pu > min(threshold, alpha * np.exp(-entropy[par[u]])):
                break
            run, ll = run + 1, ll + np.log(pu)
        lengths.append(run)
        likelihood.append(ll)
    best_len = max(lengths)
    best = 0 if best_len == 0 else max((p for p in range(len(lengths)) if lengths[p] == best_len),
                                       key=lambda p: (likelihood[p], -p))
    return best_len, [int(nodes[u - 1]) for u in slots[best][1: best_len + 1]]


@settings(max_examples=40)
@given(seed=hs.integers(0, 2**31 - 1), sharp=hs.floats(0.2, 3.0))
def test_typical_tree_verification_matches_medusas_evaluate_posterior(seed, sharp):
    """On SMALL_TREE with random logits (per node: its own distribution, so siblings often both pass), the
    accepted count and tokens are those of Medusa's candidate selection."""
    tree, rng, v = SMALL_TREE, np.random.default_rng(seed), 5
    k, rows = tree.num_slots - 1, 8
    logits = (rng.normal(size=(rows, 1 + k, v)) * sharp).astype(np.float32)
    # Node u's token is rank(u) of a random permutation drawn per (row, parent): siblings are distinct tokens.
    par, (_, rank) = speculation.parents(tree), tree.head_and_rank
    perms = np.stack([[rng.permutation(v) for _ in range(1 + k)] for _ in range(rows)])  # [rows, 1 + K, V]
    nodes = perms[:, par[1:], rank].astype(np.int32)  # [rows, K]
    num_drafts = rng.integers(0, k + 1, rows)
    temperature = rng.choice([0.5, 1.0, 2.0], rows).astype(np.float32)
    got = _verify_root(tree, logits[:, 0], nodes, num_drafts, temperature, node_logits=logits[:, 1:])
    for r in range(rows):
        want_len, want_tokens = _medusa_evaluate_posterior(tree, logits[r], nodes[r], num_drafts[r], temperature[r])
        assert int(got.accepted[r]) == want_len
        assert np.asarray(got.path_tokens[r, :want_len]).tolist() == want_tokens


@pytest.mark.slow  # the default run's time budget (docs: `pytest -m slow`)
def test_tree_decoding_is_greedy_and_the_cache_holds_exactly_the_validated_path(shipped, trace, reference):
    # naive_spec verifies all 15 nodes every step and indexes blocks as they fill (the slot-order view).
    e = _engine(shipped, policies.naive_spec(15), trace, tree=SMALL_TREE)
    checked = 0
    while e.has_work():
        e.step()
        checked += _cache_holds_exactly(e)
    assert {rid: r.tokens for rid, r in e.requests.items()} == reference
    c = e.state.sched.counters
    assert checked > 20 and int(c.verifications) > 0
    # A tree accepts more than one draft per verification on this model (a chain of 4 gets ~1).
    assert int(c.accepted) > int(c.verifications)
    assert int(c.cached_tokens) > 0 and int(c.preempt_recompute) > 0


@pytest.mark.slow  # the run's time budget; the goodput controller's tree test below serves a tree by default
def test_skvs_with_a_tree_and_typical_acceptance_at_temperature_zero_is_greedy(shipped, trace, reference):
    e = _engine(shipped, policies.skvs_article(15), trace, tree=SMALL_TREE, acceptance="typical")
    assert e.run() == reference
    assert tuple(e.cfg.sched.reach_of[b] for b in (0, 7, 15)) == (0, 3, 4)  # buckets {0, 7, 15} reach {0, 3, 4}
    assert int(e.state.sched.counters.accepted) > 0


@pytest.mark.slow  # the default run's time budget; the scheduler's lockstep tests run the controller on a tree
# (skvs-tree), and tests/test_models_hf.py checks tree verification against HF
def test_the_goodput_controller_on_a_tree_is_greedy_and_drafts_to_depths(shipped, trace, reference):
    """skvs (the goodput controller) on SMALL_TREE: it prices a row's slots by the depth they reach, so the
    output is still greedy, and the per-depth counts it learns from are the depths the tree's slots reached."""
    small = dataclasses.replace(trace, requests=trace.requests[:4])
    e = _engine(shipped, policies.skvs(15), small, tree=SMALL_TREE)
    assert e.run() == {r.request_id: reference[r.request_id] for r in small.requests}
    c, seqs = e.state.sched.counters, e.state.sched
    assert e.cfg.sched.reach_of[15] == 4 and int(c.accepted) > int(c.verifications) > 0
    tried = np.asarray(seqs.pop_tried)
    assert tried[0] > 0 and not tried[4:].any()  # no depth beyond the tree's 4 is ever tried


@pytest.mark.slow  # the default run's time budget (docs: `pytest -m slow`)
def test_compilations_over_a_long_varied_run_are_bounded_by_the_buckets(shipped):
    """2,000 steps, arrivals in bursts (the batch grows and shrinks), adaptive draft lengths: the number of
    programs compiled is counted from jax's cache, and stays <= buckets x batch buckets (the batch is one
    bucket: the state has a fixed B rows, idle rows are masked)."""
    model, heads = shipped
    # The configuration the sampled-drafts and warm-up tests below reuse (their programs are compiled here).
    e = engine.Engine(model, heads, policies.skvs(4), CACHE, token_budget=96, prefill_chunk=32, seed=3,
                      sample_drafts=True, steps_per_dispatch=1)
    rng = np.random.default_rng(0)
    before, steps = _compilations(), 0
    drafts_seen = set()
    while steps < 2000:
        if steps % 40 == 0:  # a burst of 1..5 requests
            for _ in range(int(rng.integers(1, 6))):
                prompt = rng.integers(32, 127, size=int(rng.integers(4, 24))).tolist()
                e.add_request(prompt, engine.SamplingParams(max_tokens=int(rng.integers(4, 30))))
        e.step()
        steps += 1
        drafts_seen.add(e.step_log[-1]["drafted"])
    compiled = _compilations() - before
    batch_buckets = 1
    assert compiled <= len(e.picker.widths) * batch_buckets, (compiled, e.picker.widths)
    assert len(e.picker.width_hist) >= 3 and len(drafts_seen) >= 5  # draft lengths and widths really varied
    # every step the engine ran is in the histogram (a call with nothing to serve runs no step)
    assert sum(e.picker.width_hist.values()) == len(e.step_log) > 500


@pytest.mark.slow  # the default run's time budget (`pytest -m slow`); test_scheduler checks the budget's shares
def test_a_verify_budget_narrows_the_query_width_the_engine_compiles_and_runs(shipped, trace, reference):
    """The engine picks each decode step's width from a bound on the next step's drafts; with a verify budget the
    bound includes the budget's cap, so R decode rows run a width of at most 1 + the smallest bucket holding
    floor(budget / R) - 1 drafts (never a query that does not fit: the engine raises on one)."""
    budget = 8  # 2 decode rows: up to 3 drafts, 3 rows: 1, 4 or more: none
    # One step per dispatch: the test reads each step's width.
    e = _engine(shipped, policies.skvs(4).replace(verify_budget=budget), trace, steps_per_dispatch=1)
    buckets = sorted(e.picker.decode_widths)
    steps = []
    while e.has_work():
        before = collections.Counter(e.picker.width_hist)
        e.step()
        (width,) = (e.picker.width_hist - before).keys()
        steps.append((width, e.step_log[-1]))
    assert {rid: r.tokens for rid, r in e.requests.items()} == reference
    # Decode steps whose width the host chose from the bound; a step it chose wide (some row waited) that memory
    # left without a prompt token ran the widest decode width instead (`engine_step.model_step_at`).
    decode = [(w, log) for w, log in steps if log["bound"] >= 0 and log["num_seqs"] > 0]
    assert all(w in (e.picker.prompt_width, buckets[-1]) for w, log in steps if log["bound"] < 0)
    assert len(decode) > 10
    for w, log in decode:
        cap = max(budget // log["num_seqs"] - 1, 0)  # num_seqs <= the step's decode rows: a cap at least as high
        assert w <= next(x for x in buckets if x - 1 >= min(cap, 4)), (w, log)
        assert log["decode_tokens"] <= max(budget, log["num_seqs"])
    assert any(w < buckets[-1] for w, _ in decode)


def test_knobs_replaced_between_steps_take_effect_without_a_query_outgrowing_its_width(shipped, trace, reference):
    """Knobs are data: a run may change them between steps (no recompile). The width bound of the step before
    was made with the old knobs, so the first step after a change must not trust it."""
    small = dataclasses.replace(trace, requests=trace.requests[:4])
    e = _engine(shipped, policies.skvs(4).replace(verify_budget=8), small)
    low, high = e.knobs.replace(draft_len=jnp.asarray(1, jnp.int32)), e.knobs.replace(verify_budget=jnp.asarray(
        policies.NO_VERIFY_CAP, jnp.int32))
    i = 0
    while e.has_work():  # raise the cap and lower it again, step after step
        e.knobs = (low, high)[i % 2]
        e.step()
        i += 1
    assert {rid: r.tokens for rid, r in e.requests.items()} == {r.request_id: reference[r.request_id]
                                                                for r in small.requests}
    assert max(e.picker.draft_hist) == 4 and e.picker.draft_hist[1] > 0


# Slow-marked for the default run's time budget: tests/test_acceptance.py checks the rule itself, and
# test_sampled_drafts_at_temperature_zero_give_the_greedy_tokens below serves sample_drafts.
@pytest.mark.slow
def test_sampled_drafts_with_the_general_lossless_rule(shipped, trace, reference):
    small = dataclasses.replace(trace, requests=trace.requests[:3])
    e = _engine(shipped, policies.skvs(4), small, sample_drafts=True)  # temperature 0: argmax drafts, greedy rule
    assert e.run() == {r.request_id: reference[r.request_id] for r in small.requests}
    outs = []
    for seed in (0, 0):
        e = _engine(shipped, policies.skvs(4), small, sample_drafts=True, seed=seed, temperature=1.0)
        outs.append(e.run())
        c = e.state.sched.counters
        assert int(c.drafted) > 0 and 0 < int(c.accepted) < int(c.drafted)
    assert outs[0] == outs[1]


def test_bad_speculation_arguments_are_refused(shipped):
    model, heads = shipped
    with pytest.raises(ValueError, match="nodes but policy.draft_len"):
        engine.Engine(model, heads, policies.skvs(4), CACHE, tree=SMALL_TREE)
    with pytest.raises(ValueError, match="draft heads"):
        engine.Engine(model, heads, policies.naive_spec(5), CACHE, tree=DraftTree(tuple((0,) * d for d in
                                                                                        range(1, 6))))
    with pytest.raises(ValueError, match="acceptance"):
        engine.Engine(model, heads, policies.skvs(4), CACHE, acceptance="always")
    with pytest.raises(ValueError, match="sample_drafts needs a chain"):
        engine.Engine(model, heads, policies.skvs_article(15), CACHE, tree=SMALL_TREE, sample_drafts=True)
    with pytest.raises(ValueError, match="need a policy that speculates"):
        engine.Engine(model, None, policies.vllm_default(), CACHE, tree=SMALL_TREE)
    with pytest.raises(TypeError, match="tree must be a DraftTree"):
        engine.Engine(model, heads, policies.skvs(2), CACHE, tree=((0,), (0, 0)))


# ------------------------------------------------------------------------------------------ compile buckets


def _compilations() -> int:
    """Programs of the step compiled so far: one step (`fused_step`) and many (`dispatch.run_steps`)."""
    return engine_step.fused_step._cache_size() + dispatch.run_steps._cache_size()


@pytest.mark.slow  # the default run's time budget (`pytest -m slow`); test_engine_sampling keeps sampled verification
def test_sampled_drafts_at_temperature_zero_give_the_greedy_tokens(shipped, trace, reference):
    """sample_drafts at temperature 0 draws the argmax drafts and verifies them by the greedy rule: the engine's
    sampled-draft program gives the greedy reference. One draft bucket (two programs: each ~30 s to compile
    here); the seeded temperature-1 runs are test_sampled_drafts_with_the_general_lossless_rule's (`-m slow`)."""
    small = dataclasses.replace(trace, requests=trace.requests[:2])
    e = _engine(shipped, policies.skvs(4).replace(draft_buckets=(4,)), small, sample_drafts=True)
    assert e.run() == {r.request_id: reference[r.request_id] for r in small.requests}
    c = e.state.sched.counters
    assert int(c.drafted) > 0 and 0 < int(c.accepted) < int(c.drafted)


def test_adaptive_draft_length_compares_the_expected_acceptance_with_each_buckets_reach():
    """A tree's bucket of d nodes reaches only the depth of those nodes: with buckets {0, 7, 15} (reach {0, 3, 4})
    a request that accepts ~1.3 drafts per step wants reach 2 -> 7 nodes, not the 2 nodes a chain would get."""
    from skvs_jax import scheduler as sc

    policy = policies.skvs_article(15)
    cfg = sc.SchedulerConfig(cache=CACHE, policy=policy, max_running=8, token_budget=96,
                             reach_of=speculation.reach(SMALL_TREE, range(policy.draft_len + 1)))
    seqs = sc.init(cfg).seqs
    hist = np.zeros((8, 16), np.int32)
    hist[0, 4] = 3  # always the full depth: the largest bucket
    hist[1, 1], hist[1, 2] = 70, 20  # mean ~1.3: round(1.95) = 2 -> the 7-node bucket (reach 3)
    hist[2, 0] = 200  # drafts keep failing: bucket 0, no speculation
    seqs = seqs.replace(accept_hist=jnp.asarray(hist))
    want = np.asarray(sc.draft_lengths(seqs, policy.knobs(), policy, reach_of=cfg.reach_of))
    assert want[0] == 15 and want[1] == 7 and want[2] == 0
    assert want[3] == 15  # a new request: only the prior (full depth 4 accepted once)
    with pytest.raises(ValueError, match="reach_of"):
        sc.SchedulerConfig(cache=CACHE, policy=policy, max_running=8, token_budget=96, reach_of=(0, 8, 4))


def test_the_policys_kv_precision_builds_the_cache(shipped):
    model, heads = shipped
    e = engine.Engine(model, heads, policies.skvs(4).replace(kv_precision="by_draft_len"), CACHE)
    assert e.cfg.kv_dtype == "float8_e4m3fn" and e.state.cache.k.dtype == jnp.float8_e4m3fn
    assert e.state.cache.k_scales is not None
    e = engine.Engine(model, heads, policies.skvs(4).replace(kv_precision="int8"), CACHE, kv_dtype="bfloat16")
    assert e.state.cache.k.dtype == jnp.bfloat16  # an explicit kv_dtype overrides the policy
