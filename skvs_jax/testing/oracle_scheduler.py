"""A plain-Python scheduler with exactly the semantics of `scheduler.py`, one sequence at a time.

It is the specification the jitted scheduler is tested against (block id for block id, counter for counter)
and the baseline of `skvs micro scheduler`. It composes the plain-Python allocator (`oracle.OracleAllocator`)
with an ideal prefix index (a dict from token prefixes to block ids), and walks sequences in priority order
with ordinary loops, the way a vLLM-style scheduler is written. Read `scheduler.py`'s docstring for the step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from skvs_jax.arrays import cdiv
from skvs_jax.config import NULL_BLOCK
from skvs_jax.policies import Knobs
from skvs_jax.scheduler import EMPTY, FINISHED, RUNNING, SWAPPED, WAITING
from skvs_jax.testing.oracle import OracleAllocator


class OraclePrefixIndex:
    """The ideal prefix index: a prefix (a whole number of blocks of tokens) -> block id, prefix-closed.

    Agrees with `prefix_cache` whenever the table refuses nothing (no key collision, no full bucket), which a
    64-bit key and a table at most half full make the practical case.
    """

    def __init__(self, block_size: int, max_blocks: int):
        self.s, self.m = block_size, max_blocks
        self.index: dict[tuple[int, ...], int] = {}

    def matched(self, row) -> int:
        j = 0
        while j < min(len(row) // self.s, self.m) and tuple(row[: (j + 1) * self.s]) in self.index:
            j += 1
        return j

    def lookup(self, row, length: int, window: int, ratio: float) -> tuple[int, list[int]]:
        """(shared blocks after the barrier, their ids)."""
        s = self.s
        matched = min(self.matched(row), max(length - 1, 0) // s)
        buffer = max(1, int(np.floor(np.float32(ratio) * np.float32(window))) // s) if window > 0 else 0
        shared = max(0, matched - buffer)
        return shared, [self.index[tuple(row[: (j + 1) * s])] for j in range(shared)]

    def insert(self, rows, num_validated, tables) -> list[list[int]]:
        """Index every whole validated block not indexed yet; returns each row's newly indexed ids."""
        new = []
        for row, nv, table in zip(rows, num_validated, tables):
            ids = []
            for j in range(min(nv // self.s, len(row) // self.s, self.m)):
                prefix = tuple(row[: (j + 1) * self.s])
                if prefix not in self.index:
                    self.index[prefix] = int(table[j])
                    ids.append((j, int(table[j])))
            new.append(ids)
        return new

    def remove(self, ids) -> list[int]:
        """Drop the entries of ids and every entry below them; returns the descendants' ids, sorted."""
        ids = {int(i) for i in ids if i > 0}
        gone = {p for p, blk in self.index.items() if blk in ids}
        for p in sorted(self.index, key=len):
            if len(p) > self.s and p[: -self.s] in gone:
                gone.add(p)
        descendants = sorted(self.index[p] for p in gone if self.index[p] not in ids)
        for p in gone:
            del self.index[p]
        return descendants


@dataclasses.dataclass
class OracleBatch:
    """The same fields as `scheduler.Batch`, as Python lists (per slot) and ints."""

    scheduled: list
    start: list
    num_query: list
    num_drafts: list
    num_reserved: list
    samples: list
    swap_out: list
    swap_out_blocks: list
    swap_in: list
    restore: list
    preempted: list
    admitted: list
    hit_tokens: list
    cow_src: list
    cow_dst: list
    oom: bool
    num_tokens: int
    alloc_ok: bool


class OracleScheduler:
    """`scheduler.init/add/schedule/update/abort` as a mutable Python object."""

    def __init__(self, cfg):
        self.cfg, self.pol = cfg, cfg.policy
        c = cfg.cache
        self.alloc = OracleAllocator(c, self.pol.spec_config())
        self.index = OraclePrefixIndex(c.block_size, c.max_blocks_per_seq)
        b = c.max_seqs
        self.status = [EMPTY] * b
        self.tokens = [[] for _ in range(b)]
        self.prompt_len = [0] * b
        self.max_new = [0] * b
        self.priority = [0] * b
        self.arrival = [0] * b
        self.request_id = [-1] * b
        self.swapped_len = [0] * b
        self.num_preemptions = [0] * b
        self.num_cached = [0] * b
        self.hist = [[0] * (self.pol.draft_len + 1) for _ in range(b)]
        self.pending = [False] * b
        self.step = 0
        self.next_arrival = 0
        self.swap_used = 0
        names = ("steps", "oom_steps", "preempt_recompute", "preempt_swap", "swap_ins", "admitted", "finished",
                 "aborted", "prompt_tokens", "cached_tokens", "drafted", "accepted", "verifications", "output_tokens")
        self.counters = dict.fromkeys(names, 0)

    # ------------------------------------------------------------------------------------------ helpers

    def _order(self) -> list[int]:
        return sorted(range(self.cfg.cache.max_seqs), key=lambda b: (self.priority[b], self.arrival[b], b))

    def _draft_len(self, b: int, knobs: Knobs) -> int:
        pol = self.pol
        k_max = min(max(int(knobs.draft_len), 0), pol.draft_len)
        if not pol.speculation:
            return 0
        if not pol.adaptive_draft_len:
            return k_max
        k = pol.draft_len
        hist = list(self.hist[b])
        hist[self.cfg.reach[-1]] += 1
        mean = np.float32(sum(i * h for i, h in enumerate(hist))) / np.float32(sum(hist))
        reach = self.cfg.reach
        target = min(int(np.floor(mean * np.float32(1.5) + np.float32(0.5))), reach[-1])
        chosen = next((x for x, r in zip(pol.draft_buckets or (k,), reach) if r >= target), k)
        return min(chosen, k_max)

    def _evictable(self) -> int:
        a = self.alloc
        return sum(1 for i in range(self.cfg.cache.num_blocks) if a.cached[i] and a.ref[i] == 0)

    def _free_now(self) -> int:
        return len(self.alloc.free_stack) + (len(self.alloc.pool) if self.pol.spec_pool else 0)

    # ------------------------------------------------------------------------------------- transitions

    def add(self, prompts, max_new_tokens, priority=None, request_id=None) -> list[int]:
        """prompts: list of token lists (empty = padding row). Returns the slot of each (-1: none)."""
        slots = []
        empty = [b for b in range(self.cfg.cache.max_seqs) if self.status[b] == EMPTY]
        for r, prompt in enumerate(prompts):
            if not prompt or not empty:
                slots.append(-1)
                continue
            b = empty.pop(0)
            self.status[b] = WAITING
            self.tokens[b] = [int(t) for t in prompt]
            self.prompt_len[b] = len(prompt)
            self.max_new[b] = int(max_new_tokens[r])
            self.priority[b] = 0 if priority is None else int(priority[r])
            self.request_id[b] = r if request_id is None else int(request_id[r])
            self.arrival[b] = self.next_arrival
            self.next_arrival += 1
            self.swapped_len[b] = self.num_preemptions[b] = self.num_cached[b] = 0
            self.hist[b] = [0] * (self.pol.draft_len + 1)
            self.pending[b] = False
            slots.append(b)
        return slots

    def abort(self, mask) -> None:
        s = self.cfg.cache.block_size
        live = [bool(mask[b]) and self.status[b] != EMPTY for b in range(self.cfg.cache.max_seqs)]
        self.alloc.free(live)
        for b, x in enumerate(live):
            if not x:
                continue
            if self.status[b] == SWAPPED:
                self.swap_used -= cdiv(self.swapped_len[b], s)
            if self.status[b] != FINISHED:
                self.counters["aborted"] += 1
            self.status[b], self.request_id[b], self.swapped_len[b] = EMPTY, -1, 0

    def schedule(self, knobs: Knobs) -> OracleBatch:
        cfg, pol, a = self.cfg, self.pol, self.alloc
        s, bsz, big_l = cfg.cache.block_size, cfg.cache.max_seqs, cfg.max_len
        slots = range(bsz)

        # 0. Finished requests release their blocks.
        done = [self.status[b] == FINISHED for b in slots]
        a.free(done)
        for b in slots:
            if done[b]:
                self.status[b], self.request_id[b] = EMPTY, -1
        order = self._order()
        rank = {b: r for r, b in enumerate(order)}
        c = list(a.committed)
        held = [len(a.tables[b]) for b in slots]
        n = [len(self.tokens[b]) if self.status[b] != EMPTY else 0 for b in slots]
        running = [self.status[b] == RUNNING for b in slots]
        remaining = [n[b] - c[b] if running[b] else 0 for b in slots]
        chunk = [min(remaining[b], cfg.chunk) for b in slots]

        # 1. Draft lengths.
        k_max = min(max(int(knobs.draft_len), 0), pol.draft_len)
        reserve = k_max if (pol.speculation and pol.spec_in_prefill) else 0
        k_want = [0] * bsz
        # Decode rows: one token left, and the model sampled it (a row's last prompt token drafts nothing).
        decoding = [running[b] and remaining[b] == 1 and n[b] > self.prompt_len[b] for b in slots]
        for b in slots:
            if decoding[b]:
                out_room = self.max_new[b] - (n[b] - self.prompt_len[b]) - 1
                k_want[b] = max(0, min(self._draft_len(b, knobs), out_room, big_l - n[b]))
            elif running[b] and remaining[b] > 1:
                k_want[b] = max(0, min(reserve, big_l - c[b] - chunk[b]))
        rows = sum(decoding)
        k_cap = max(int(knobs.verify_budget) // max(rows, 1) - 1, 0)  # compute-aware drafting
        for b in slots:
            if decoding[b]:
                k_want[b] = min(k_want[b], k_cap)

        # 2. Token budget in priority order.
        q, d = [0] * bsz, [0] * bsz
        used = 0
        for b in order:
            left = cfg.token_budget - used
            used += chunk[b] + k_want[b]
            q[b] = min(max(left, 0), chunk[b])
            if q[b] == chunk[b] and q[b] > 0:
                d[b] = min(max(left - q[b], 0), k_want[b])

        need_q, need_d, cow = [0] * bsz, [0] * bsz, [False] * bsz
        for b in slots:
            if q[b] > 0:
                part = a.tables[b][c[b] // s] if c[b] // s < held[b] else NULL_BLOCK
                cow[b] = running[b] and c[b] % s != 0 and a.ref[part] > 1
                need_q[b] = max(cdiv(c[b] + q[b], s) - held[b], 0) + cow[b]
                need_d[b] = max(cdiv(c[b] + q[b] + d[b], s) - held[b], 0) + cow[b] - need_q[b]
        need_a = [need_q[b] + (need_d[b] if pol.drafts_preempt else 0) for b in slots]

        # 3. Preemption: the fewest victims in victim-rule order.
        avail = self._free_now() + self._evictable()
        freed = [sum(1 for blk in a.tables[b] if a.ref[blk] == 1) for b in slots]
        import jax.numpy as jnp  # the rule is a jnp function of int32 arrays; evaluate it once

        key = np.asarray(cfg.victim_rule(jnp.asarray([rank[b] for b in slots], jnp.int32),
                                         jnp.asarray(c, jnp.int32), jnp.asarray(held, jnp.int32))).tolist()
        vorder = sorted(slots, key=lambda b: (not running[b], key[b], -rank[b]))
        total, victims = sum(need_a), []
        if total > avail:
            dn = fr = 0
            for b in vorder:
                if not running[b]:
                    break
                victims.append(b)
                dn, fr = dn + need_a[b], fr + freed[b]
                if total - dn <= avail + fr:
                    break
        oom = bool(victims)
        victim = [b in victims for b in slots]
        swap = [False] * bsz
        if pol.preemption == "swap" and cfg.swap_blocks > 0:
            room, cum = cfg.swap_blocks - self.swap_used, 0
            for b in victims:
                cum += cdiv(c[b], s)
                swap[b] = c[b] > 0 and cum <= room
        swap_out_blocks = [list(a.tables[b][: cdiv(c[b], s)]) if swap[b] else [] for b in slots]
        swap_need = sum(cdiv(c[b], s) for b in slots if swap[b])
        a.free(victim)
        for b in victims:
            self.status[b] = SWAPPED if swap[b] else WAITING
            self.num_preemptions[b] += 1
            if swap[b]:
                self.swapped_len[b] = c[b]
            q[b] = d[b] = need_q[b] = need_d[b] = 0
            cow[b] = False
        keep = [running[b] and not victim[b] for b in slots]

        free_now = self._free_now()
        avail = free_now + self._evictable()
        need_total = sum(need_q)

        # 4. Opportunistic drafts within max_spec_ratio of the free blocks left.
        if not pol.drafts_preempt:
            cap = int(np.floor(np.float32(knobs.max_spec_ratio) * np.float32(max(free_now - need_total, 0))))
            cum = 0
            for b in order:
                cum += need_d[b]
                if need_d[b] != 0 and cum > cap:
                    d[b] = need_d[b] = 0
        need_total += sum(need_d)
        num_running = sum(keep)

        # 5a. Swap-in.
        swap_in, restore = [False] * bsz, [0] * bsz
        if not oom:
            blocks_cum = count = 0
            for b in order:
                if self.status[b] != SWAPPED or swap[b]:
                    continue
                blocks_cum += cdiv(self.swapped_len[b], s)
                count += 1
                if blocks_cum > avail - need_total or count > cfg.max_running - num_running:
                    break
                swap_in[b], restore[b] = True, self.swapped_len[b]
        need_total += sum(cdiv(restore[b], s) for b in slots)
        num_running += sum(swap_in)
        still_swapped = any(self.status[b] == SWAPPED and not swap_in[b] for b in slots)

        # 5b. Admission.
        admitted, hit_tokens = [False] * bsz, [0] * bsz
        cands = [b for b in order if self.status[b] == WAITING][: cfg.window]
        evictable_now = [a.cached[i] and a.ref[i] == 0 for i in range(cfg.cache.num_blocks)]
        if not oom and not still_swapped:
            budget_left = cfg.token_budget - sum(q[b] + d[b] for b in slots)
            tok_cum = blk_cum = 0
            plans = []
            for count, b in enumerate(cands, start=1):
                row = self.tokens[b]
                shared, ids = 0, []
                if pol.prefix_cache:
                    window = k_max if (pol.prefix_barrier and pol.speculation) else 0
                    shared, ids = self.index.lookup(row, n[b], window, float(knobs.max_spec_ratio))
                h = shared * s
                a_chunk = min(n[b] - h, cfg.chunk)
                a_res = (reserve if n[b] - h > 1 else 0) if pol.spec_in_prefill else 0
                a_res = max(0, min(a_res, big_l - h - a_chunk))
                left = budget_left - tok_cum
                tok_cum += a_chunk + a_res
                a_q = min(max(left, 0), a_chunk)
                a_d = min(max(left - a_q, 0), a_res) if a_q == a_chunk else 0
                a_need = cdiv(h + a_q + a_d, s) - shared
                blk_cum += a_need + sum(1 for i in ids if evictable_now[i])
                if a_q <= 0 or blk_cum > avail - need_total or count > cfg.max_running - num_running:
                    break
                plans.append((b, h, ids, a_q, a_d, a_need))
            share_ids = [[NULL_BLOCK] * cfg.cache.max_blocks_per_seq for _ in slots]
            share_tokens = [0] * bsz
            for b, h, ids, a_q, a_d, a_need in plans:
                admitted[b], hit_tokens[b] = True, h
                share_ids[b][: len(ids)] = ids
                share_tokens[b] = h
                q[b], d[b] = a_q, a_d
                need_total += a_need
            a.share(share_ids, share_tokens)
        for b in slots:
            if admitted[b] or swap_in[b]:
                self.status[b] = RUNNING

        # 6. Evict the shortfall, then allocate.
        shortfall = max(need_total - self._free_now(), 0)
        if shortfall > 0:
            evicted = a.evict_lru(shortfall, cfg.cache.usable_blocks)
            self._unpin(self.index.remove(evicted))
        ok, cow_pairs = self._allocate_two_pass([q[b] + restore[b] for b in slots], order, False)
        spec_ok = [True] * bsz
        if pol.speculation:
            spec_ok, _ = self._allocate_two_pass(d, order, True)

        for b in slots:
            if swap[b]:
                self.swapped_len[b] = c[b]
            elif swap_in[b]:
                self.swapped_len[b] = 0
            self.num_cached[b] += hit_tokens[b]
        ct = self.counters
        ct["oom_steps"] += oom
        ct["preempt_recompute"] += sum(victim[b] and not swap[b] for b in slots)
        ct["preempt_swap"] += sum(swap)
        ct["swap_ins"] += sum(swap_in)
        ct["admitted"] += sum(admitted)
        ct["prompt_tokens"] += sum(n[b] for b in slots if admitted[b])
        ct["cached_tokens"] += sum(hit_tokens)
        self.swap_used += swap_need - sum(cdiv(restore[b], s) for b in slots)

        c_now = list(a.committed)
        decode = [self.status[b] == RUNNING and n[b] - c_now[b] == 1 for b in slots]
        return OracleBatch(
            scheduled=[q[b] > 0 for b in slots],
            start=c_now,
            num_query=q,
            num_drafts=[d[b] if decode[b] else 0 for b in slots],
            num_reserved=[0 if decode[b] else d[b] for b in slots],
            samples=[q[b] > 0 and c_now[b] + q[b] == n[b] for b in slots],
            swap_out=swap,
            swap_out_blocks=swap_out_blocks,
            swap_in=swap_in,
            restore=restore,
            preempted=[victim[b] and not swap[b] for b in slots],
            admitted=admitted,
            hit_tokens=hit_tokens,
            cow_src=[p[0] for p in cow_pairs],
            cow_dst=[p[1] for p in cow_pairs],
            oom=oom,
            num_tokens=sum(q) + sum(d),
            alloc_ok=all(ok) and all(spec_ok),
        )

    def _window(self) -> int:
        s = self.cfg.cache.block_size
        return min(cdiv(1 + self.pol.draft_len, s) + 1, self.cfg.cache.max_blocks_per_seq)

    def _allocate_two_pass(self, tokens, order, speculative):
        """Rows spanning <= W columns first (window W), then the wider ones (full table), as the jitted one."""
        a, s, w = self.alloc, self.cfg.cache.block_size, self._window()
        narrow = [cdiv(a.allocated[b] + tokens[b], s) - a.allocated[b] // s <= w for b in range(len(tokens))]
        first = [t if nw else 0 for t, nw in zip(tokens, narrow)]
        wide = [0 if nw else t for t, nw in zip(tokens, narrow)]
        ok, cow = a.allocate(first, order, speculative=speculative, generation=self.step, window=w)
        if any(x > 0 for x in wide):
            ok2, cow2 = a.allocate(wide, order, speculative=speculative, generation=self.step)
            ok = [x and y for x, y in zip(ok, ok2)]
            cow = [c1 if nw else c2 for c1, c2, nw in zip(cow, cow2, narrow)]
        return ok, cow

    def _unpin(self, ids) -> None:
        self.alloc.set_cached(ids, [False] * len(ids))

    def update(self, batch: OracleBatch, accepted, next_tokens, draft_tokens, stop, knobs: Knobs) -> list[int]:
        """Returns the number of tokens appended per slot."""
        cfg, pol, a = self.cfg, self.pol, self.alloc
        s, big_l = cfg.cache.block_size, cfg.max_len
        slots = range(cfg.cache.max_seqs)
        # A row aborted since schedule is dropped: it computes, commits and indexes nothing.
        live = [self.status[b] == RUNNING for b in slots]
        batch = dataclasses.replace(
            batch, scheduled=[x and y for x, y in zip(batch.scheduled, live)],
            samples=[x and y for x, y in zip(batch.samples, live)],
            **{f: [x if y else 0 for x, y in zip(getattr(batch, f), live)]
               for f in ("num_query", "num_drafts", "restore")})
        acc = [min(max(int(accepted[b]), 0), batch.num_drafts[b]) if batch.samples[b] else 0 for b in slots]
        n = [len(self.tokens[b]) for b in slots]

        # Rows that filled a block wait to be indexed; the first R of them (slot order) are, this step.
        on_fill = pol.prefix_cache and pol.insert == "on_fill"
        filled_to = []
        for b in slots:
            if batch.scheduled[b]:
                upto = batch.start[b] + batch.num_query[b] + (batch.num_drafts[b] if on_fill else acc[b])
            else:
                upto = batch.start[b]
            filled_to.append(upto + batch.restore[b])
            self.pending[b] = self.pending[b] or filled_to[b] // s > batch.start[b] // s
        rows = [b for b in slots if self.pending[b]][: cfg.rows_indexed]
        for b in rows:
            self.pending[b] = False
        filled = None
        if on_fill:
            views = [list(self.tokens[b]) + [int(t) for t in draft_tokens[b][: batch.num_drafts[b]]] for b in rows]
            tables = [a.tables[b] + [NULL_BLOCK] * (cfg.cache.max_blocks_per_seq - len(a.tables[b])) for b in rows]
            filled = self.index.insert([v + [0] * (big_l - len(v)) for v in views], [filled_to[b] for b in rows],
                                       tables)

        commit = [(batch.num_query[b] + acc[b] if batch.scheduled[b] else 0) + batch.restore[b] for b in slots]
        fits = [len(a.tables[b]) - a.committed[b] // s <= self._window() for b in slots]
        a.commit(commit, window=self._window())
        if not all(fits):
            a.commit([0 if f else x for f, x in zip(fits, commit)])

        new = [acc[b] + 1 if batch.samples[b] else 0 for b in slots]
        finished = [False] * len(slots)
        for b in slots:
            if new[b]:
                self.tokens[b] = self.tokens[b] + [int(t) for t in draft_tokens[b][: acc[b]]] + [int(next_tokens[b])]
            n_new = n[b] + new[b]
            if self.status[b] == RUNNING and batch.samples[b]:
                finished[b] = bool(stop[b]) or n_new - self.prompt_len[b] >= self.max_new[b] or n_new >= big_l

        if filled is not None:
            stale, kept = [], []
            for b, new_ids in zip(rows, filled):
                for j, blk in new_ids:
                    (stale if (j + 1) * s > a.committed[b] else kept).append(blk)
            descendants = self.index.remove(stale)
            a.set_cached(kept, [True] * len(kept))
            self._unpin(descendants)
        elif pol.prefix_cache:
            new_ids = self.index.insert([self.tokens[b] + [0] * (big_l - len(self.tokens[b])) for b in rows],
                                        [a.committed[b] for b in rows], [a.tables[b] for b in rows])
            ids = [blk for row in new_ids for _, blk in row]
            a.set_cached(ids, [True] * len(ids))

        if pol.spec_pool:
            a.reclaim_expired(self.step, int(knobs.generation_threshold))

        verified = [batch.samples[b] and batch.num_drafts[b] > 0 for b in slots]
        for b in slots:
            if verified[b]:
                self.hist[b][acc[b]] += 1
            if finished[b]:
                self.status[b] = FINISHED
        ct = self.counters
        ct["steps"] += 1
        ct["finished"] += sum(finished)
        ct["drafted"] += sum(batch.num_drafts)
        ct["accepted"] += sum(acc)
        ct["verifications"] += sum(verified)
        ct["output_tokens"] += sum(new)
        self.step += 1
        return new
