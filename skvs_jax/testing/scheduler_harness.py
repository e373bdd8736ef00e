"""Property-testing kit for the scheduler: a lockstep harness with a ground-truth KV shadow.

`Harness` drives the jitted scheduler and the plain-Python `OracleScheduler` with the same requests, accept
counts and tokens, and plays the model's part on a *shadow KV cache*: an int32[N, S] array holding, for every
physical slot, the token whose KV it holds (and whether that token is validated). After every transition it
checks:

  * exact agreement with the oracle: batch, block tables, stacks, ref counts, index, sequence table, counters;
  * the allocator's structural invariants (`testing.check_invariants`) and `batch.alloc_ok`;
  * every live sequence's block table holds exactly its tokens' KV for its committed prefix (so a prefix hit
    never returned a block whose content differs from the request's);
  * every entry of the prefix index names a block that holds exactly the entry's tokens, all validated (no
    block holding an unvalidated token is ever left in the index once a step is settled);
  * no block is held by sequences of two cache salts, nor indexed under a salt other than its holders';
  * a swapped sequence holds no device blocks and its host copy is exactly its committed KV;
  * host-tier accounting (`swap_used`) equals the blocks the swapped sequences hold there.

Use it from hypothesis: draw a config and a list of `("add", ...)`, `("step", seed)`, `("abort", seed)`
operations, then `Harness(cfg).run(ops)`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from skvs_jax import scheduler as sc
from skvs_jax import testing
from skvs_jax.config import NULL_BLOCK
from skvs_jax.testing.oracle_scheduler import OracleScheduler

_BATCH_FIELDS = ("scheduled", "start", "num_query", "num_drafts", "num_reserved", "samples", "swap_out", "swap_in",
                 "restore", "preempted", "admitted", "hit_tokens", "cow_src", "cow_dst")
UNWRITTEN = -1  # shadow value of a slot nothing has written


class Harness:
    """The jitted scheduler, the oracle and a shadow KV cache in lockstep (see the module docstring)."""

    def __init__(self, cfg: sc.SchedulerConfig, vocab: int = 3, knobs=None, step_cost=None):
        self.cfg, self.vocab, self.step_cost = cfg, vocab, step_cost
        self.knobs = cfg.policy.knobs() if knobs is None else knobs
        self.st, self.oracle = sc.init(cfg), OracleScheduler(cfg)
        n, s = cfg.cache.num_blocks, cfg.cache.block_size
        self.kv = np.full((n, s), UNWRITTEN, np.int64)  # token whose KV each slot holds
        self.valid = np.zeros((n, s), bool)  # that token was validated (committed)
        self.host: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # slot -> its swapped-out blocks
        self.batches = 0

    # ------------------------------------------------------------------------------------------ operations

    def set_draft_widths(self, widths: list[int]) -> None:
        """Both schedulers' draft widths replaced (data; what the engine's bucket re-choice does)."""
        self.st = self.st.replace(draft_widths=jnp.asarray(widths, jnp.int32))
        self.oracle.draft_widths = list(widths)

    def add(self, prompts: list[list[int]], max_new: list[int], priority: list[int] | None = None,
            salts: list[int] | None = None, targets: list[int] | None = None):
        # Padded to a fixed shape (rows of length 0 are ignored), so that `add` compiles once per config.
        a = len(prompts)
        rows = max(4, a)
        arr = np.zeros((rows, self.cfg.max_len), np.int32)
        lens, new, prio = (np.zeros(rows, np.int32), np.ones(rows, np.int32), np.zeros(rows, np.int32))
        salt, target = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        for r, p in enumerate(prompts):
            arr[r, : len(p)], lens[r], new[r] = p, len(p), max_new[r]
            prio[r] = 0 if priority is None else priority[r]
            salt[r] = 0 if salts is None else salts[r]
            target[r] = 0 if targets is None else targets[r]
        self.st, slots = sc.add(self.st, jnp.asarray(arr), jnp.asarray(lens), jnp.asarray(new), jnp.asarray(prio),
                                cache_salt=jnp.asarray(salt), tpot_target=jnp.asarray(target), cfg=self.cfg)
        want = self.oracle.add(prompts, max_new, prio[:a], cache_salt=salt[:a], tpot_target=target[:a])
        got = np.asarray(slots)[:a].tolist()
        assert got == want, f"add placed {got}, oracle {want}"
        self.check()
        return want

    def abort(self, mask, check: bool = True) -> None:
        mask = np.asarray(mask, bool)
        status = np.asarray(self.st.seqs.status)
        for b in np.flatnonzero(mask & (status == sc.SWAPPED)):
            self.host.pop(int(b), None)
        self.st = sc.abort(self.st, jnp.asarray(mask), cfg=self.cfg)
        self.oracle.abort(mask)
        if check:  # mid-step, the index may name blocks whose drafts update has yet to roll back
            self.check()

    def step(self, rng: np.random.Generator, accept: str = "random", abort_mid: bool = False) -> sc.Batch:
        """schedule → shadow model → update, with drafts accepted at random ("random"), all, or none.

        abort_mid: abort a random ~30% of the slots after the model ran, before update (which drops them)."""
        cfg, s = self.cfg, self.cfg.cache.block_size
        b_seqs, k = cfg.cache.max_seqs, max(cfg.policy.draft_len, 1)
        self.st, batch = sc.schedule(self.st, self.knobs, cfg=cfg, step_cost=self.step_cost)
        ob = self.oracle.schedule(self.knobs, self.step_cost)
        self._compare_batch(batch, ob)
        assert bool(batch.alloc_ok), "the scheduler granted more than the allocator could give"

        # The model's part, on the shadow: copies and swaps before any write, then the step's writes.
        table = np.asarray(batch.block_table)
        tokens = np.asarray(self.st.seqs.tokens)
        for src, dst in zip(np.asarray(batch.cow_src), np.asarray(batch.cow_dst)):
            if dst != NULL_BLOCK:
                self.kv[dst], self.valid[dst] = self.kv[src], self.valid[src]
        for b in np.flatnonzero(np.asarray(batch.swap_out)):
            ids = np.asarray(batch.swap_out_blocks)[b]
            ids = ids[ids != NULL_BLOCK]
            self.host[int(b)] = (self.kv[ids].copy(), self.valid[ids].copy())
        for b in np.flatnonzero(np.asarray(batch.swap_in)):
            kv, valid = self.host.pop(int(b))
            ids = table[b, : kv.shape[0]]
            self.kv[ids], self.valid[ids] = kv, valid
        drafts = rng.integers(0, self.vocab, (b_seqs, k)).astype(np.int32)
        start, q = np.asarray(batch.start), np.asarray(batch.num_query)
        d, r = np.asarray(batch.num_drafts), np.asarray(batch.num_reserved)
        for b in np.flatnonzero(np.asarray(batch.scheduled)):
            row = list(tokens[b, start[b]: start[b] + q[b]]) + list(drafts[b, : d[b]]) + [UNWRITTEN] * r[b]
            for i, tok in enumerate(row):
                p = start[b] + i
                self.kv[table[b, p // s], p % s] = tok
                self.valid[table[b, p // s], p % s] = False

        reach = np.asarray(cfg.reach_of)[d]  # a draft tree's slots accept at most their depth (a chain: d)
        if accept == "all":
            accepted = reach.astype(np.int32)
        elif accept == "none":
            accepted = np.zeros_like(d)
        else:
            accepted = rng.integers(0, reach + 1).astype(np.int32)
        next_tokens = rng.integers(0, self.vocab, b_seqs).astype(np.int32)
        stop = rng.random(b_seqs) < 0.02
        if abort_mid:
            self.abort(rng.random(b_seqs) < 0.3, check=False)
        self.st, _ = sc.update(self.st, batch, jnp.asarray(accepted, jnp.int32), jnp.asarray(next_tokens),
                               jnp.asarray(drafts), jnp.asarray(stop), self.knobs, cfg=cfg)
        self.oracle.update(ob, accepted, next_tokens, drafts, stop, self.knobs)
        committed = np.asarray(self.st.kv.alloc.seqs.num_committed)
        table = np.asarray(self.st.kv.alloc.seqs.block_table)
        for b in np.flatnonzero(np.asarray(batch.scheduled) | np.asarray(batch.swap_in)):
            for p in range(committed[b]):
                self.valid[table[b, p // s], p % s] = True
        self.batches += 1
        self.check()
        return batch

    def run(self, ops, rng_seed: int = 0) -> None:
        rng = np.random.default_rng(rng_seed)
        for op in ops:
            kind = op[0]
            if kind == "add":
                self.add(*op[1:])
            elif kind == "step":
                self.step(np.random.default_rng(op[1]), *op[2:])
            elif kind == "step_abort":  # an abort between schedule and update
                self.step(np.random.default_rng(op[1]), abort_mid=True)
            elif kind == "abort":
                self.abort(np.random.default_rng(op[1]).random(self.cfg.cache.max_seqs) < 0.3)
            elif kind == "widths":  # a bucket re-choice: draft widths as data
                self.set_draft_widths(list(op[1]))
            else:
                raise ValueError(f"unknown operation {kind!r}")
        del rng

    # ---------------------------------------------------------------------------------------------- checks

    def _compare_batch(self, batch: sc.Batch, ob) -> None:
        for name in _BATCH_FIELDS:
            got, want = np.asarray(getattr(batch, name)), np.asarray(getattr(ob, name))
            np.testing.assert_array_equal(got, want, err_msg=f"batch.{name}")
        assert bool(batch.oom) == ob.oom, "batch.oom"
        assert int(batch.num_tokens) == ob.num_tokens, "batch.num_tokens"
        out = np.asarray(batch.swap_out_blocks)
        for b, ids in enumerate(ob.swap_out_blocks):
            assert out[b, : len(ids)].tolist() == ids and (out[b, len(ids):] == NULL_BLOCK).all(), "swap_out_blocks"

    def check(self) -> None:
        cfg, st, o = self.cfg, self.st, self.oracle
        s = cfg.cache.block_size
        testing.check_invariants(st.kv.alloc, cfg.cache, cfg.policy.spec_config())
        testing.assert_matches_oracle(st.kv.alloc, o.alloc)
        assert testing.prefix_index_as_dict(st.kv.prefix, cfg.prefix, salted=True) == o.index.index, "prefix index"
        status = np.asarray(st.seqs.status)
        np.testing.assert_array_equal(status, o.status, err_msg="status")
        live = status != sc.EMPTY
        num_tokens = np.asarray(st.seqs.num_tokens)
        tokens = np.asarray(st.seqs.tokens)
        for b in np.flatnonzero(live):
            assert tokens[b, : num_tokens[b]].tolist() == o.tokens[b], f"tokens of slot {b}"
        for name, want in (("swapped_len", o.swapped_len), ("num_preemptions", o.num_preemptions),
                           ("num_cached", o.num_cached), ("accept_hist", o.hist), ("index_pending", o.pending),
                           ("draft_tried", o.draft_tried), ("draft_passed", o.draft_passed),
                           ("lag", o.lag), ("elapsed", o.elapsed), ("undrafted", o.undrafted),
                           ("cache_salt", o.cache_salt), ("tpot_target", o.tpot_target)):
            got = np.asarray(getattr(st.seqs, name))
            np.testing.assert_array_equal(got[live], np.asarray(want)[live], err_msg=name)
        got = {k: int(v) for k, v in dataclasses.asdict(st.counters).items()}
        assert got == o.counters, f"counters differ: jax {got} vs oracle {o.counters}"
        assert int(st.swap_used) == o.swap_used, "swap_used"
        assert np.asarray(st.pop_tried).tolist() == o.pop_tried, "pop_tried"
        assert np.asarray(st.pop_passed).tolist() == o.pop_passed, "pop_passed"
        assert np.asarray(st.priced).tolist() == o.priced, "priced"
        assert int(st.step) == o.step and int(st.next_arrival) == o.next_arrival
        assert np.asarray(st.draft_widths).tolist() == o.draft_widths, "draft_widths"

        # Ground truth: tables hold the sequences' tokens; the index holds validated content only.
        committed = np.asarray(st.kv.alloc.seqs.num_committed)
        held = np.asarray(st.kv.alloc.seqs.num_blocks)
        table = np.asarray(st.kv.alloc.seqs.block_table)
        for b in np.flatnonzero(live):
            p = np.arange(committed[b])
            ids = table[b, p // s]
            assert (self.kv[ids, p % s] == tokens[b, p]).all(), f"slot {b}: table does not hold its tokens' KV"
            assert self.valid[ids, p % s].all(), f"slot {b}: committed KV not validated"
            if status[b] == sc.SWAPPED:
                assert held[b] == 0, f"swapped slot {b} still holds device blocks"
                kv, valid = self.host[int(b)]
                sl = int(np.asarray(st.seqs.swapped_len)[b])
                q = np.arange(sl)
                assert (kv[q // s, q % s] == tokens[b, q]).all() and valid[q // s, q % s].all(), "host copy"
        assert set(self.host) == set(np.flatnonzero(status == sc.SWAPPED).tolist()), "swapped <-> host copies"
        salt_of: dict[int, int] = {}  # block -> the cache salt of the live sequences holding it
        salts = np.asarray(st.seqs.cache_salt)
        for b in np.flatnonzero(live):
            for blk in table[b, : held[b]].tolist():
                assert salt_of.setdefault(blk, int(salts[b])) == salts[b], f"block {blk} is shared across salts"
        for prefix, blk in o.index.index.items():
            assert self.kv[blk].tolist() == list(prefix[-s:]), f"index entry {blk} holds other tokens"
            assert self.valid[blk].all(), f"index entry {blk} holds an unvalidated token"
            assert salt_of.get(blk, prefix[0]) == prefix[0], f"index entry {blk} is held under another salt"
