"""A plain-Python scheduler with exactly the semantics of `skvs_jax.scheduler`, one sequence at a time.

It is the specification the jitted scheduler is tested against (block id for block id, counter for counter)
and the baseline of `skvs micro scheduler`. It composes the plain-Python allocator (`oracle.OracleAllocator`)
with an ideal prefix index (`oracle.OraclePrefixIndex`, a dict from token prefixes to block ids), and walks
sequences in priority order with ordinary loops, the way a vLLM-style scheduler is written. `schedule` and
`update` call the phases of `scheduler/schedule.py` and `scheduler/update.py` under the same names, in the same
order, so the two read side by side.

Why this module is longer than most (~650 lines): it is one class, the whole step's specification; its phase
records are small dataclasses beside it. Cutting it in two would put half of a phase's contract elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from skvs_jax.arrays import cdiv
from skvs_jax.config import NULL_BLOCK
from skvs_jax.policies import Knobs
from skvs_jax.scheduler import EMPTY, FINISHED, RUNNING, SWAPPED, WAITING
from skvs_jax.scheduler import draft_control as dc
from skvs_jax.testing.oracle import OracleAllocator, OraclePrefixIndex, leaves_first


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


# The state each phase of `schedule` hands to the next, per slot (lists indexed by slot) unless said otherwise.


@dataclasses.dataclass
class StepStart:
    """Each slot once the finished ones are gone (phase 0), as the later phases read it."""

    order: list  # the slots in priority order
    committed: list  # committed tokens (the allocator's num_committed)
    held: list  # block-table entries in use
    num_tokens: list  # the request's tokens so far (0 for an EMPTY slot)
    running: list
    remaining: list  # tokens left to compute (0 unless running)
    chunk: list  # min(remaining, prefill chunk): what the row asks of the token budget


@dataclasses.dataclass
class DraftPlan:
    """Phase 1: how many draft slots each row would like."""

    max_draft_len: int  # knobs.draft_len clamped to [0, K]
    reserve: int  # draft slots a prefilling row reserves (spec_in_prefill), else 0
    wanted: list  # decode rows: drafts; prefilling rows: reserved slots
    decoding: list  # the rows that decode (and so may draft) this step
    surv: list  # per row, survival per draft depth (zeros unless the goodput controller or priced blocks read it)


@dataclasses.dataclass
class Grant:
    """Tokens granted this step and the new blocks they need; phases 3, 4 and 5b revise it."""

    num_query: list  # tokens computed: a prefill chunk or the decode token
    num_drafts: list  # draft (or reserved) slots after them
    need_query: list  # new blocks for the query tokens (+1 for a copy-on-write)
    need_drafts: list  # further new blocks for the draft slots


@dataclasses.dataclass
class Preemption:
    """Phase 3: the victims, and which of them are swapped out (the others are recomputed)."""

    victim: list
    swap: list
    swap_out_blocks: list  # a swapped victim's committed blocks, to copy to the host tier
    drafts_paid: bool = False  # priced draft blocks: the drafts preempted, so they keep every slot

    @property
    def oom(self) -> bool:
        return any(self.victim)


@dataclasses.dataclass
class Demand:
    """What the batch claims (phases 3-6) against the blocks available once the victims' blocks are back."""

    available: int  # free + speculative-pool + evictable blocks after preemption
    blocks: int  # new blocks the batch needs so far
    rows: int  # RUNNING rows of the batch so far


@dataclasses.dataclass
class SwapIn:
    """Phase 5a: the swapped rows that come back, and the committed tokens each restores."""

    swap_in: list
    restore: list


class AdmissionPlan(NamedTuple):
    """Phase 5b: one admitted candidate's share of the step."""

    slot: int
    hit_tokens: int  # prompt tokens shared from the prefix cache (whole blocks)
    shared_ids: list  # their blocks
    num_query: int
    num_drafts: int  # reserved draft slots
    need: int  # new blocks


@dataclasses.dataclass
class Admission:
    """Phase 5b: the admitted rows, and the prompt tokens each shares from the prefix cache."""

    admitted: list
    hit_tokens: list


@dataclasses.dataclass
class Allocation:
    """Phase 6: whether every allocation was granted, and the copy-on-writes to do first."""

    ok: bool
    cow_src: list
    cow_dst: list


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
        k = self.pol.draft_len
        self.draft_tried, self.draft_passed = [[0] * k for _ in range(b)], [[0] * k for _ in range(b)]
        self.pop_tried, self.pop_passed = [0] * k, [0] * k
        self.lag, self.elapsed, self.undrafted = [0] * b, [0] * b, [0] * b
        self.priced = [0, 0]
        buckets = self.pol.draft_buckets or (k,)
        self.draft_widths = list(buckets) + [buckets[-1]] * (self.pol.width_slots - len(buckets))
        self.pending = [False] * b
        self.cache_salt = [0] * b
        self.tpot_target = [0] * b  # microseconds per output token, 0 = none
        self.step = 0
        self.next_arrival = 0
        self.swap_used = 0
        names = ("steps", "oom_steps", "preempt_recompute", "preempt_swap", "swap_ins", "admitted", "finished",
                 "aborted", "prompt_tokens", "cached_tokens", "drafted", "accepted", "verifications", "output_tokens",
                 "draft_blocks", "oom_steps_drafts", "preempt_drafts", "first_prompt_tokens", "first_cached_tokens")
        self.counters = dict.fromkeys(names, 0)

    # ------------------------------------------------------------------------------------------ helpers

    def _order(self) -> list[int]:
        return sorted(range(self.cfg.cache.max_seqs), key=lambda b: (self.priority[b], self.arrival[b], b))

    def _draft_len(self, b: int, knobs: Knobs) -> int:
        pol = self.pol
        k_max = min(max(int(knobs.draft_len), 0), pol.draft_len)
        if not pol.speculation:
            return 0
        if not pol.adaptive_draft_len or pol.goodput_control:
            return k_max
        k, reach = pol.draft_len, self.cfg.reach_of
        hist = list(self.hist[b])
        hist[reach[k]] += 1
        mean = np.float32(sum(i * h for i, h in enumerate(hist))) / np.float32(sum(hist))
        target = min(int(np.floor(mean * np.float32(1.5) + np.float32(0.5))), reach[k])
        # The smallest draft width (data: `draft_widths`) reaching the target; the largest if none does.
        chosen = min((w for w in self.draft_widths if reach[w] >= target), default=max(self.draft_widths))
        return min(chosen, k_max)

    def _evictable(self) -> int:
        a = self.alloc
        return sum(1 for i in range(self.cfg.cache.num_blocks) if a.cached[i] and a.ref[i] == 0)

    def _free_now(self) -> int:
        return len(self.alloc.free_stack) + (len(self.alloc.pool) if self.pol.spec_pool else 0)

    # ------------------------------------------------------------------------------------- transitions

    def add(self, prompts, max_new_tokens, priority=None, request_id=None, cache_salt=None,
            tpot_target=None) -> list[int]:
        """prompts: list of token lists (empty = padding row); cache_salt, tpot_target: an int per row (default 0).
        Returns the
        slot of each (-1: none)."""
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
            self.draft_tried[b], self.draft_passed[b] = [0] * self.pol.draft_len, [0] * self.pol.draft_len
            self.lag[b] = self.elapsed[b] = self.undrafted[b] = 0
            self.pending[b] = False
            self.cache_salt[b] = 0 if cache_salt is None else int(cache_salt[r])
            self.tpot_target[b] = 0 if tpot_target is None else max(int(tpot_target[r]), 0)
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

    def schedule(self, knobs: Knobs, step_cost=None) -> OracleBatch:
        """`scheduler.schedule_unchecked`, phase by phase (the numbers are the steps of its module docstring).
        step_cost: a `scheduler.StepCost` (None: every step costs the same), read by the goodput controller."""
        start = self.release_finished()  # 0
        drafts = self.plan_drafts(start, knobs, step_cost)  # 1
        grant = self.budget_tokens(start, drafts)  # 2
        pre, demand = self.preempt(start, grant, drafts, step_cost)  # 3
        self.grant_opportunistic_drafts(start, grant, demand, knobs, pre)  # 4
        self.counters["draft_blocks"] += sum(grant.need_drafts)
        back = self.swap_in(start, pre, demand)  # 5a
        adm = self.admit(start, drafts, grant, demand, knobs, oom=pre.oom)  # 5b
        alloc = self.evict_and_allocate(start, grant, back, demand)  # 6
        batch = self.make_batch(start, grant, pre, back, adm, alloc)
        self.price_step(batch, step_cost)  # 7
        return batch

    # ------------------------------------------------------------------------------------ schedule phases

    def release_finished(self) -> StepStart:
        """0. FINISHED slots free their blocks and become EMPTY; returns every slot as the step starts."""
        a, slots = self.alloc, range(self.cfg.cache.max_seqs)
        done = [self.status[b] == FINISHED for b in slots]
        a.free(done)
        for b in slots:
            if done[b]:
                self.status[b], self.request_id[b] = EMPTY, -1
        committed = list(a.committed)
        num_tokens = [len(self.tokens[b]) if self.status[b] != EMPTY else 0 for b in slots]
        running = [self.status[b] == RUNNING for b in slots]
        remaining = [num_tokens[b] - committed[b] if running[b] else 0 for b in slots]
        return StepStart(order=self._order(), committed=committed, held=[len(a.tables[b]) for b in slots],
                         num_tokens=num_tokens, running=running, remaining=remaining,
                         chunk=[min(x, self.cfg.chunk) for x in remaining])

    def plan_drafts(self, start: StepStart, knobs: Knobs, step_cost=None) -> DraftPlan:
        """1. Decode rows (one sampled token left) want drafts, bounded by their output room, the table and the
        verify budget; prefilling rows reserve draft slots when spec_in_prefill."""
        pol, max_len, slots = self.pol, self.cfg.max_len, range(self.cfg.cache.max_seqs)
        k_max = min(max(int(knobs.draft_len), 0), pol.draft_len)
        reserve = k_max if (pol.speculation and pol.spec_in_prefill) else 0
        num_tokens, committed = start.num_tokens, start.committed
        wanted = [0] * len(slots)
        # Decode rows: one token left, and the model sampled it (a row's last prompt token drafts nothing).
        decoding = [start.running[b] and start.remaining[b] == 1 and num_tokens[b] > self.prompt_len[b] for b in slots]
        for b in slots:
            if decoding[b]:
                out_room = self.max_new[b] - (num_tokens[b] - self.prompt_len[b]) - 1
                wanted[b] = max(0, min(self._draft_len(b, knobs), out_room, max_len - num_tokens[b]))
            elif start.running[b] and start.remaining[b] > 1:
                wanted[b] = max(0, min(reserve, max_len - committed[b] - start.chunk[b]))
        k_cap = max(int(knobs.verify_budget) // max(sum(decoding), 1) - 1, 0)  # compute-aware drafting
        for b in slots:
            if decoding[b]:
                wanted[b] = min(wanted[b], k_cap)
        surv = self._survival() if pol.goodput_control or pol.priced_drafts else [[0] * pol.draft_len for _ in slots]
        if pol.goodput_control:
            chosen = self.goodput_plan(start, surv, [wanted[b] if decoding[b] else 0 for b in slots], decoding,
                                       step_cost)
            wanted = [chosen[b] if decoding[b] else wanted[b] for b in slots]
        return DraftPlan(max_draft_len=k_max, reserve=reserve, wanted=wanted, decoding=decoding, surv=surv)

    def _survival(self, optimism: int = 0) -> list[list[int]]:
        """Per row and draft depth, the chance the draft is accepted: per-depth estimates with the population's
        prior, multiplied down the depths, in fixed point; with `optimism` extra passes per depth (a behind
        row's bound: dc.OPTIMISM_W)."""
        k, one = self.pol.draft_len, dc.ONE
        pop = [(p * one + dc.POP_PRIOR_W * dc.POP_PRIOR) // (t + dc.POP_PRIOR_W)
               for t, p in zip(self.pop_tried, self.pop_passed)]
        surv = []
        for b in range(self.cfg.cache.max_seqs):
            s_b, row = one, []
            for d in range(k):
                alpha = ((self.draft_passed[b][d] + optimism) * one + dc.REQ_PRIOR_W * pop[d]) // (
                    self.draft_tried[b][d] + dc.REQ_PRIOR_W + optimism)
                s_b = s_b * alpha // one
                row.append(s_b)
            surv.append(row)
        return surv

    @staticmethod
    def _cost_terms(step_cost, token_budget: int) -> tuple:
        """(token_us, row_us, ctx_ns, head_us, width_us or None, (compute_us, mem_us, overlap) or None)."""
        if step_cost is None:
            return [1] * (token_budget + 1), 0, 0, 0, None, None
        width = None if step_cost.width_us is None else np.asarray(step_cost.width_us).tolist()
        roof = None if step_cost.compute_us is None else (np.asarray(step_cost.compute_us).tolist(),
                                                          int(step_cost.mem_us), int(step_cost.overlap))
        return (np.asarray(step_cost.token_us).tolist(), int(step_cost.row_us), int(step_cost.ctx_ns),
                int(step_cost.head_us), width, roof)

    @staticmethod
    def _step_time(terms, tokens: int, rows: int, ctx: int, drafts: int, widest: int = 0) -> int:
        """The step's time; with a width table, `widest` is its widest row's tokens (large for a prompt step);
        with a roofline's terms the context's read overlaps the compute."""
        token_us, row_us, ctx_ns, head_us, width_us, roof = terms
        i = min(max(tokens, 0), len(token_us) - 1)
        t = token_us[i] + row_us * rows + (head_us if drafts > 0 else 0)
        if roof is None:
            t += ctx_ns * ctx // 1000
        else:
            c, m = roof[0][i], roof[1] + ctx_ns * ctx // 1000
            t += c + m - roof[2] * min(c, m) // 1024
        return t if width_us is None else t + width_us[min(max(widest, 0), len(width_us) - 1)]

    def _prompt_work(self, start: StepStart) -> bool:
        """Some row waits or has prompt left: a padded engine runs this step at its widest width."""
        return any(s == WAITING for s in self.status) or any(
            start.running[b] and start.remaining[b] > 1 for b in range(self.cfg.cache.max_seqs))

    def goodput_plan(self, start: StepStart, surv: list, cap: list, decoding: list, step_cost) -> list[int]:
        """1'. The goodput controller (`scheduler.draft_control`), one (row, depth) and one threshold at a time:
        the threshold of the grid that maximises (sampling rows * ONE + sum of the selected survivals) / step
        time, first maximum. A row drafts to the depths its slots reach whose survival clears the threshold, in
        the fewest slots reaching them (a chain: one slot a depth). A decoding row that is behind (its lag over
        1 / LAG_SLACK of its decode time) or due a probe (undrafted PROBE_AFTER drafting steps in a row) drafts
        at least its first depth under every threshold but "none"; a choice is allowed only if, for each behind
        row with a cap, the step's time * ONE <= its time without drafts * (ONE + that row's expected gain)."""
        slots, k, one = range(self.cfg.cache.max_seqs), self.pol.draft_len, dc.ONE
        running = start.running
        base = min(sum(start.chunk), self.cfg.token_budget)
        rows = sum(running)
        ctx = sum(start.committed[b] for b in slots if running[b])
        sampling = sum(1 for b in slots if running[b] and start.chunk[b] > 0
                       and start.committed[b] + start.chunk[b] == start.num_tokens[b])
        terms = self._cost_terms(step_cost, self.cfg.token_budget)
        width_us = terms[4]
        wide = self._prompt_work(start)
        thresholds = [one + 1] + [one * j // dc.LEVELS for j in range(dc.LEVELS, 0, -1)]
        # A cap shared by every row; a padded engine caps rows at a program's width.
        caps = self.draft_widths if width_us is not None else list(range(k + 1))

        reach = self.cfg.reach_of  # per slot count, the depth it reaches (a chain: the count)

        hope = self._survival(dc.OPTIMISM_W)
        pop, s_pop = [], one  # the population's survival: its estimates multiplied down
        for t, p in zip(self.pop_tried, self.pop_passed):
            s_pop = s_pop * ((p * one + dc.POP_PRIOR_W * dc.POP_PRIOR) // (t + dc.POP_PRIOR_W)) // one
            pop.append(s_pop)
        probe = [decoding[b] and self.undrafted[b] >= dc.PROBE_AFTER for b in slots]
        # over its TPOT target: decode steps slower per token than asked (every output but the first is theirs)
        over = [self.pol.tpot_targets and self.tpot_target[b] > 0
                and self.elapsed[b] // max(len(self.tokens[b]) - self.prompt_len[b] - 1, 1) > self.tpot_target[b]
                for b in slots]
        if self.pol.tail_peers is not None:  # more than tail_peers / 1024 slower per token than the decoding peers
            dec = [len(self.tokens[b]) - self.prompt_len[b] - 1 for b in slots]
            on = [decoding[b] and dec[b] > 0 for b in slots]
            tpot = [min(self.elapsed[b] // max(dec[b], 1), (2**31 - 1) // len(on)) for b in slots]
            mean = sum(tpot[b] for b in slots if on[b]) // max(sum(on), 1)
            margin = (mean // 1024) * self.pol.tail_peers + (mean % 1024) * self.pol.tail_peers // 1024
            over = [over[b] or (on[b] and tpot[b] > mean + margin) for b in slots]
        behind = [decoding[b] and (self.lag[b] > self.elapsed[b] // dc.LAG_SLACK or over[b]) and not probe[b]
                  and dc.PROTECT_WITHIN * surv[b][0] >= pop[0] for b in slots]
        forced = [behind[b] or probe[b] for b in slots]
        key = [[max(surv[b][d], hope[b][d]) if behind[b] else surv[b][d] for d in range(k)] for b in slots]

        def depths(thr, c):  # per row, the depths drafted: those its slots reach whose survival clears thr
            return [sum(1 for d in range(reach[min(cap[b], k, c)])
                        if key[b][d] >= thr or (d == 0 and forced[b] and thr <= one)) for b in slots]

        def fewest_slots(r):
            return min(n for n in range(k + 1) if reach[n] >= r)

        best, best_rate = [fewest_slots(r) for r in depths(thresholds[0], k)], None
        widest0 = 0
        if width_us is not None:
            widest0 = len(width_us) - 1 if wide else max(
                [start.chunk[b] for b in slots if running[b] and start.chunk[b] > 0], default=0)
        t0 = max(self._step_time(terms, base, rows, ctx, 0, widest0), 1)
        for thr in thresholds:
            for c in caps:
                deep = depths(thr, c)
                chosen = [fewest_slots(r) for r in deep]
                n = sum(chosen)
                gain = sum(surv[b][d] for b in slots for d in range(deep[b]))
                widest = 0
                if width_us is not None:
                    widest = len(width_us) - 1 if wide else max(
                        [start.chunk[b] + chosen[b] for b in slots if running[b] and start.chunk[b] > 0], default=0)
                t = max(self._step_time(terms, base + n, rows, ctx, n, widest), 1)
                rate = np.float32(sampling * one + gain) / np.float32(t)
                for b in slots:
                    if self.pol.tail_guard is not None and behind[b] and cap[b] > 0:
                        row_gain = sum(hope[b][d] for d in range(deep[b]))
                        if not (np.float32(t) * np.float32(one * 1024) <= np.float32(t0) * np.float32(one + row_gain)
                                * np.float32(1024 + self.pol.tail_guard)):
                            rate = np.float32(-1.0)
                if best_rate is None or rate > best_rate:
                    best, best_rate = chosen, rate
        return best

    def budget_tokens(self, start: StepStart, drafts: DraftPlan) -> Grant:
        """2. The token budget in priority order: each running row's chunk first, then its draft slots; and the
        new blocks each row needs for them (a copy-on-write of a shared partial block counts one)."""
        a, s, bsz = self.alloc, self.cfg.cache.block_size, self.cfg.cache.max_seqs
        committed, held, chunk, wanted = start.committed, start.held, start.chunk, drafts.wanted
        q, k = [0] * bsz, [0] * bsz
        used = 0
        for b in start.order:
            left = self.cfg.token_budget - used
            used += chunk[b] + wanted[b]
            q[b] = min(max(left, 0), chunk[b])
            if q[b] == chunk[b] and q[b] > 0:
                k[b] = min(max(left - q[b], 0), wanted[b])
        need_q, need_k = [0] * bsz, [0] * bsz
        for b in range(bsz):
            if q[b] > 0:
                part = a.tables[b][committed[b] // s] if committed[b] // s < held[b] else NULL_BLOCK
                cow = start.running[b] and committed[b] % s != 0 and a.ref[part] > 1
                need_q[b] = max(cdiv(committed[b] + q[b], s) - held[b], 0) + cow
                need_k[b] = max(cdiv(committed[b] + q[b] + k[b], s) - held[b], 0) + cow - need_q[b]
        return Grant(num_query=q, num_drafts=k, need_query=need_q, need_drafts=need_k)

    def preempt(self, start: StepStart, grant: Grant, drafts: DraftPlan, step_cost=None
                ) -> tuple[Preemption, Demand]:
        """3. If the mandatory blocks (drafts' too when drafts_preempt, or when priced draft blocks pay for it)
        exceed free + pool + evictable, preempt the fewest running rows in victim-rule order that make them fit:
        swap a victim out while the host tier has room (policy "swap"), else recompute it. Victims free their
        blocks and lose their grant. Returns the victims and the demand left: the kept rows' query blocks against
        what is now available."""
        a, s, slots = self.alloc, self.cfg.cache.block_size, range(self.cfg.cache.max_seqs)
        committed = start.committed
        mandatory = [grant.need_query[b] + (grant.need_drafts[b] if self.pol.drafts_preempt else 0) for b in slots]
        avail = self._free_now() + self._evictable()  # before the victims give their blocks back
        victims = self._victims(start, mandatory)
        by_drafts = self.pol.drafts_preempt and bool(victims) and sum(grant.need_query) <= avail
        drafts_victims = len(victims) if by_drafts else 0
        paid = False
        if self.pol.priced_drafts:
            all_victims = self._victims(start, [grant.need_query[b] + grant.need_drafts[b] for b in slots])
            paid = self.price_draft_preemption(start, grant, drafts, victims, all_victims, step_cost)
            if paid:
                by_drafts, drafts_victims, victims = True, len(all_victims) - len(victims), all_victims
        victim = [b in victims for b in slots]
        swap = self._swapped(victims, committed)
        swap_out_blocks = [list(a.tables[b][: cdiv(committed[b], s)]) if swap[b] else [] for b in slots]
        a.free(victim)
        for b in victims:
            self.status[b] = SWAPPED if swap[b] else WAITING
            self.num_preemptions[b] += 1
            if swap[b]:
                self.swapped_len[b] = committed[b]
            grant.num_query[b] = grant.num_drafts[b] = grant.need_query[b] = grant.need_drafts[b] = 0
        self.swap_used += sum(cdiv(committed[b], s) for b in slots if swap[b])
        ct = self.counters
        ct["oom_steps"] += bool(victims)
        ct["preempt_recompute"] += sum(victim[b] and not swap[b] for b in slots)
        ct["preempt_swap"] += sum(swap)
        ct["oom_steps_drafts"] += by_drafts
        ct["preempt_drafts"] += drafts_victims
        kept = [start.running[b] and not victim[b] for b in slots]
        demand = Demand(available=self._free_now() + self._evictable(), blocks=sum(grant.need_query), rows=sum(kept))
        return Preemption(victim=victim, swap=swap, swap_out_blocks=swap_out_blocks, drafts_paid=paid), demand

    def price_draft_preemption(self, start: StepStart, grant: Grant, drafts: DraftPlan, keep_victims: list,
                               all_victims: list, step_cost) -> bool:
        """3'. Priced draft blocks: whether the drafts should preempt the rows of all_victims beyond keep_victims.
        Not preempting for them, the kept rows' drafts take blocks in priority order while they fit in what is
        available once keep_victims are gone; preempting, every kept row keeps its drafts, the extra victims'
        output is lost and their recompute time is added. The side with more expected tokens per microsecond wins
        (float32 cross products, as `draft_control.preemption_pays`)."""
        a, slots, one = self.alloc, range(self.cfg.cache.max_seqs), dc.ONE
        extra = [b for b in all_victims if b not in keep_victims]
        if not extra:
            return False
        committed, running = start.committed, start.running
        freed = [sum(1 for blk in a.tables[b] if a.ref[blk] == 1) for b in slots]
        avail1 = self._free_now() + self._evictable() + sum(freed[b] for b in keep_victims)
        kept1 = [running[b] and b not in keep_victims for b in slots]
        kept2 = [running[b] and b not in all_victims for b in slots]
        room1 = avail1 - sum(grant.need_query[b] for b in slots if kept1[b])
        fit1, cum = [False] * len(slots), 0
        for b in start.order:
            cum += grant.need_drafts[b] if kept1[b] else 0
            fit1[b] = grant.need_drafts[b] == 0 or cum <= room1
        terms = self._cost_terms(step_cost, self.cfg.token_budget)
        wide = self._prompt_work(start)

        def side(kept, granted):
            tokens = time_tokens = rows = ctx = n = widest = 0
            for b in slots:
                if not kept[b]:
                    continue
                k = grant.num_drafts[b] if granted[b] else 0
                dd = k if drafts.decoding[b] and drafts.wanted[b] > 0 else 0
                samples = grant.num_query[b] > 0 and committed[b] + grant.num_query[b] == start.num_tokens[b]
                tokens += one * samples + sum(drafts.surv[b][:self.cfg.reach_of[dd]])
                time_tokens, rows, ctx, n = time_tokens + grant.num_query[b] + k, rows + 1, ctx + committed[b], n + dd
                if grant.num_query[b] > 0:
                    widest = max(widest, grant.num_query[b] + k)
            if terms[4] is not None and wide:
                widest = len(terms[4]) - 1
            return tokens, self._step_time(terms, time_tokens, rows, ctx, n, widest)

        tokens1, time1 = side(kept1, [kept1[b] and fit1[b] for b in slots])
        tokens2, time2 = side(kept2, kept2)
        t_max = len(terms[0]) - 1
        per_token_ns = (terms[0][t_max] - terms[0][0]) * 1000 // max(t_max, 1)
        if terms[5] is not None:
            per_token_ns += (terms[5][0][t_max] - terms[5][0][0]) * 1000 // max(t_max, 1)
        s = self.cfg.cache.block_size  # what a re-admission would not find in the prefix index
        lost = sum(max(committed[b] - s * sum(1 for blk in a.tables[b] if a.cached[blk]), 0) for b in extra)
        recompute = lost * per_token_ns // 1000
        if terms[4] is not None:  # every max_width recomputed tokens begun: one step in the widest program
            w_max = max(len(terms[4]) - 1, 1)
            recompute += -(-lost // w_max) * (terms[4][-1] - terms[4][0])
        lhs = np.float32(tokens2) * np.float32(max(time1, 1))
        rhs = np.float32(tokens1) * np.float32(max(time2, 1) + recompute)
        margin = 0 if step_cost is None or step_cost.margin is None else int(step_cost.margin)
        return bool(lhs * np.float32(1024) > rhs * np.float32(1024 + margin))

    def _victims(self, start: StepStart, mandatory: list) -> list[int]:
        """The fewest running rows, in victim-rule order, whose preemption makes the mandatory blocks fit."""
        a, cfg, slots = self.alloc, self.cfg, range(self.cfg.cache.max_seqs)
        rank = {b: r for r, b in enumerate(start.order)}
        running, committed, held = start.running, start.committed, start.held
        avail = self._free_now() + self._evictable()
        freed = [sum(1 for blk in a.tables[b] if a.ref[blk] == 1) for b in slots]  # blocks a victim gives back
        import jax.numpy as jnp  # the rule is a jnp function of int32 arrays; evaluate it once

        key = np.asarray(cfg.victim_rule(jnp.asarray([rank[b] for b in slots], jnp.int32),
                                         jnp.asarray(committed, jnp.int32), jnp.asarray(held, jnp.int32))).tolist()
        vorder = sorted(slots, key=lambda b: (not running[b], key[b], -rank[b]))
        total, victims = sum(mandatory), []
        if total > avail:
            dropped = returned = 0
            for b in vorder:
                if not running[b]:
                    break
                victims.append(b)
                dropped, returned = dropped + mandatory[b], returned + freed[b]
                if total - dropped <= avail + returned:
                    break
        return victims

    def _swapped(self, victims: list, committed: list) -> list[bool]:
        """Per slot: a victim swapped out (policy "swap", in victim order while the host tier has room)."""
        cfg, s = self.cfg, self.cfg.cache.block_size
        swap = [False] * cfg.cache.max_seqs
        if self.pol.preemption == "swap" and cfg.swap_blocks > 0:
            room, cum = cfg.swap_blocks - self.swap_used, 0
            for b in victims:
                cum += cdiv(committed[b], s)
                swap[b] = committed[b] > 0 and cum <= room
        return swap

    def grant_opportunistic_drafts(self, start: StepStart, grant: Grant, demand: Demand, knobs: Knobs,
                                   pre: Preemption) -> None:
        """4. When not drafts_preempt, drafts keep their slots in priority order while their new blocks fit in
        floor(max_spec_ratio * free blocks left); the others lose them. Priced draft blocks: every slot when the
        drafts preempted, else while they fit in the blocks left, evictable ones included. The drafts' blocks
        join the demand."""
        if self.pol.priced_drafts:
            cum = 0
            for b in start.order:
                cum += grant.need_drafts[b]
                if not pre.drafts_paid and grant.need_drafts[b] != 0 and cum > demand.available - demand.blocks:
                    grant.num_drafts[b] = grant.need_drafts[b] = 0
        elif not self.pol.drafts_preempt:
            free_left = max(self._free_now() - demand.blocks, 0)
            cap = int(np.floor(np.float32(knobs.max_spec_ratio) * np.float32(free_left)))
            cum = 0
            for b in start.order:
                cum += grant.need_drafts[b]
                if grant.need_drafts[b] != 0 and cum > cap:
                    grant.num_drafts[b] = grant.need_drafts[b] = 0
        demand.blocks += sum(grant.need_drafts)

    def swap_in(self, start: StepStart, pre: Preemption, demand: Demand) -> SwapIn:
        """5a. When nobody was preempted, SWAPPED rows come back (RUNNING) in priority order while their blocks
        and batch rows fit, stopping at the first that does not; their blocks join the demand."""
        s, cfg, bsz = self.cfg.cache.block_size, self.cfg, self.cfg.cache.max_seqs
        swap_in, restore = [False] * bsz, [0] * bsz
        if not pre.oom:
            blocks_cum = count = 0
            for b in start.order:
                if self.status[b] != SWAPPED or pre.swap[b]:
                    continue
                blocks_cum += cdiv(self.swapped_len[b], s)
                count += 1
                if blocks_cum > demand.available - demand.blocks or count > cfg.max_running - demand.rows:
                    break
                swap_in[b], restore[b] = True, self.swapped_len[b]
        demand.blocks += sum(cdiv(x, s) for x in restore)
        demand.rows += sum(swap_in)
        for b in range(bsz):
            if swap_in[b]:
                self.status[b], self.swapped_len[b] = RUNNING, 0
        self.swap_used -= sum(cdiv(x, s) for x in restore)
        self.counters["swap_ins"] += sum(swap_in)
        return SwapIn(swap_in=swap_in, restore=restore)

    def admit(self, start: StepStart, drafts: DraftPlan, grant: Grant, demand: Demand, knobs: Knobs, *,
              oom: bool) -> Admission:
        """5b. When nobody was preempted and none is left swapped: the first A WAITING rows in priority order,
        each with its prefix-cache hit shared by reference and a chunk (and reserve) of the token budget left,
        are admitted (RUNNING) until the first whose blocks or batch row do not fit."""
        cfg, bsz = self.cfg, self.cfg.cache.max_seqs
        admitted, hit_tokens = [False] * bsz, [0] * bsz
        still_swapped = any(x == SWAPPED for x in self.status)
        if not oom and not still_swapped:
            plans = self._admission_plans(start, drafts, grant, demand, knobs)
            share_ids = [[NULL_BLOCK] * cfg.cache.max_blocks_per_seq for _ in range(bsz)]
            for p in plans:
                admitted[p.slot], hit_tokens[p.slot] = True, p.hit_tokens
                share_ids[p.slot][: len(p.shared_ids)] = p.shared_ids
                grant.num_query[p.slot], grant.num_drafts[p.slot] = p.num_query, p.num_drafts
                demand.blocks += p.need
            self.alloc.share(share_ids, hit_tokens)
        for b in range(bsz):
            if admitted[b]:
                self.status[b] = RUNNING
            self.num_cached[b] += hit_tokens[b]
        ct = self.counters
        ct["admitted"] += sum(admitted)
        ct["prompt_tokens"] += sum(start.num_tokens[b] for b in range(bsz) if admitted[b])
        ct["cached_tokens"] += sum(hit_tokens)
        first = [admitted[b] and self.num_preemptions[b] == 0 for b in range(bsz)]  # never admitted before
        ct["first_prompt_tokens"] += sum(start.num_tokens[b] for b in range(bsz) if first[b])
        ct["first_cached_tokens"] += sum(hit_tokens[b] for b in range(bsz) if first[b])
        return Admission(admitted=admitted, hit_tokens=hit_tokens)

    def _admission_plans(self, start: StepStart, drafts: DraftPlan, grant: Grant, demand: Demand,
                         knobs: Knobs) -> list[AdmissionPlan]:
        """The admitted candidates in priority order: the leading ones whose tokens get a chunk of the budget
        left and whose new blocks (and the idle cached blocks their hits stop being evictable, each counted at
        the first candidate that shares it) and batch rows fit."""
        cfg, pol, a, s = self.cfg, self.pol, self.alloc, self.cfg.cache.block_size
        num_tokens = start.num_tokens
        cands = [b for b in start.order if self.status[b] == WAITING][: cfg.admit_rows]
        evictable_now = [a.cached[i] and a.ref[i] == 0 for i in range(cfg.cache.num_blocks)]
        budget_left = cfg.token_budget - sum(grant.num_query) - sum(grant.num_drafts)
        tok_cum = blk_cum = 0
        held = set()  # idle cached blocks an earlier candidate's hit already takes: charged once
        plans = []
        for count, b in enumerate(cands, start=1):
            shared, ids = 0, []
            if pol.prefix_cache:
                window = drafts.max_draft_len if (pol.prefix_barrier and pol.speculation) else 0
                shared, ids = self.index.lookup(self.tokens[b], num_tokens[b], window, float(knobs.max_spec_ratio),
                                                self.cache_salt[b])
                if pol.spec_hit_trim and pol.speculation:  # the hit loses ceil(K / S) blocks (vLLM's EAGLE path)
                    shared = max(shared - -(-drafts.max_draft_len // s), 0)
                    ids = ids[:shared]
            hit = shared * s
            chunk = min(num_tokens[b] - hit, cfg.chunk)
            reserve = (drafts.reserve if num_tokens[b] - hit > 1 else 0) if pol.spec_in_prefill else 0
            reserve = max(0, min(reserve, cfg.max_len - hit - chunk))
            left = budget_left - tok_cum
            tok_cum += chunk + reserve
            query = min(max(left, 0), chunk)
            reserved = min(max(left - query, 0), reserve) if query == chunk else 0
            need = cdiv(hit + query + reserved, s) - shared
            blk_cum += need + sum(1 for i in ids if evictable_now[i] and i not in held)
            held.update(ids)
            if query <= 0 or blk_cum > demand.available - demand.blocks or count > cfg.max_running - demand.rows:
                break
            plans.append(AdmissionPlan(b, hit, ids, query, reserved, need))
        return plans

    def evict_and_allocate(self, start: StepStart, grant: Grant, back: SwapIn, demand: Demand) -> Allocation:
        """6. Evict the shortfall from the cached blocks, leaves first and least recently used first, and drop
        their index entries (unpinning any entries' descendants); then allocate query + restored tokens, then
        draft slots, in priority order (`allocate_step`)."""
        a, cfg = self.alloc, self.cfg
        shortfall = max(demand.blocks - self._free_now(), 0)
        if shortfall > 0:
            evicted = a.evict(leaves_first(a, self.index)[:shortfall])
            self._unpin(self.index.remove(evicted))
        tokens = [q + r for q, r in zip(grant.num_query, back.restore)]
        spec_ok = [True] * cfg.cache.max_seqs
        if self.pol.speculation:  # slots and drafts in one transition, the drafts in the W window
            ok, cow_pairs, spec_ok = a.allocate_step(tokens, grant.num_drafts, self.step, start.order,
                                                     window=self._window())
        else:
            ok, cow_pairs = a.allocate(tokens, start.order, speculative=False, generation=self.step)
        return Allocation(ok=all(ok) and all(spec_ok), cow_src=[p[0] for p in cow_pairs],
                          cow_dst=[p[1] for p in cow_pairs])

    def make_batch(self, start: StepStart, grant: Grant, pre: Preemption, back: SwapIn, adm: Admission,
                   alloc: Allocation) -> OracleBatch:
        """The step's batch; a RUNNING row with one token left to compute is decoding, its slots are drafts."""
        q, k, num_tokens, slots = grant.num_query, grant.num_drafts, start.num_tokens, range(self.cfg.cache.max_seqs)
        c_now = list(self.alloc.committed)
        decode = [self.status[b] == RUNNING and num_tokens[b] - c_now[b] == 1 for b in slots]
        return OracleBatch(
            scheduled=[q[b] > 0 for b in slots],
            start=c_now,
            num_query=q,
            num_drafts=[k[b] if decode[b] else 0 for b in slots],
            num_reserved=[0 if decode[b] else k[b] for b in slots],
            samples=[q[b] > 0 and c_now[b] + q[b] == num_tokens[b] for b in slots],
            swap_out=pre.swap,
            swap_out_blocks=pre.swap_out_blocks,
            swap_in=back.swap_in,
            restore=back.restore,
            preempted=[pre.victim[b] and not pre.swap[b] for b in slots],
            admitted=adm.admitted,
            hit_tokens=adm.hit_tokens,
            cow_src=alloc.cow_src,
            cow_dst=alloc.cow_dst,
            oom=pre.oom,
            num_tokens=sum(q) + sum(k),
            alloc_ok=alloc.ok,
        )

    def price_step(self, batch: OracleBatch, step_cost) -> None:
        """7. Under goodput control, the step's time with and without its drafts, for `update`'s lag."""
        if not self.pol.goodput_control:
            return
        terms = self._cost_terms(step_cost, self.cfg.token_budget)
        slots = range(self.cfg.cache.max_seqs)
        on = batch.scheduled
        rows = sum(on)
        ctx = sum(batch.start[b] for b in slots if on[b])
        drafts = sum(batch.num_drafts)
        widest = widest0 = 0
        if terms[4] is not None:
            if any(on[b] and batch.num_query[b] > 1 for b in slots):
                widest = widest0 = len(terms[4]) - 1
            else:
                widest = max([batch.num_query[b] + batch.num_drafts[b] for b in slots if on[b]], default=0)
                widest0 = max([batch.num_query[b] for b in slots if on[b]], default=0)
        t = self._step_time(terms, batch.num_tokens, rows, ctx, drafts, widest)
        t0 = self._step_time(terms, batch.num_tokens - drafts, rows, ctx, 0, widest0)
        self.priced = [max(t, 1), max(t0, 1)]

    # ----------------------------------------------------------------------------------- allocator helpers

    def _window(self) -> int:
        s = self.cfg.cache.block_size
        return min(cdiv(1 + self.pol.draft_len, s) + 1, self.cfg.cache.max_blocks_per_seq)

    def _unpin(self, ids) -> None:
        self.alloc.set_cached(ids, [False] * len(ids))

    def update(self, batch: OracleBatch, accepted, next_tokens, draft_tokens, stop, knobs: Knobs) -> list[int]:
        """`scheduler.update_unchecked`, phase by phase. Returns the number of tokens appended per slot."""
        batch = self.drop_aborted(batch)
        acc = [min(max(int(accepted[b]), 0), batch.num_drafts[b]) if batch.samples[b] else 0
               for b in range(self.cfg.cache.max_seqs)]  # accepted drafts per slot
        rows, filled_to = self.select_filled_rows(batch, acc)
        on_fill = self.index_on_fill(batch, rows, filled_to, draft_tokens)
        self.commit(batch, acc)
        new = self.append_tokens(batch, acc, next_tokens, draft_tokens)
        finished = self.finish(batch, new, stop)
        self.index_filled_blocks(rows, on_fill)
        self.reclaim(knobs)
        self.count(batch, acc, new, finished)
        return new

    # -------------------------------------------------------------------------------------- update phases

    def drop_aborted(self, batch: OracleBatch) -> OracleBatch:
        """A row aborted since schedule (no longer RUNNING) is dropped: it computes, commits and indexes nothing."""
        live = [x == RUNNING for x in self.status]
        return dataclasses.replace(
            batch, scheduled=[x and y for x, y in zip(batch.scheduled, live)],
            samples=[x and y for x, y in zip(batch.samples, live)],
            **{f: [x if y else 0 for x, y in zip(getattr(batch, f), live)]
               for f in ("num_query", "num_drafts", "restore")})

    def select_filled_rows(self, batch: OracleBatch, acc: list) -> tuple[list[int], list[int]]:
        """Running rows that filled a block (drafts included when indexing on fill) wait to be indexed (a row that
        has left the batch waits no more: its blocks are gone); returns the first R
        of them in slot order, indexed this step, and per slot the tokens its table is filled to."""
        s, on_fill = self.cfg.cache.block_size, self.pol.prefix_cache and self.pol.insert == "on_fill"
        filled_to = []
        for b in range(self.cfg.cache.max_seqs):
            if batch.scheduled[b]:
                upto = batch.start[b] + batch.num_query[b] + (batch.num_drafts[b] if on_fill else acc[b])
            else:
                upto = batch.start[b]
            filled_to.append(upto + batch.restore[b])
            self.pending[b] = (self.pending[b] or filled_to[b] // s > batch.start[b] // s) and self.status[b] == RUNNING
        rows = [b for b in range(self.cfg.cache.max_seqs) if self.pending[b]][: self.cfg.rows_indexed]
        for b in rows:
            self.pending[b] = False
        return rows, filled_to

    def index_on_fill(self, batch: OracleBatch, rows: list, filled_to: list, draft_tokens) -> list | None:
        """With insert "on_fill" (the naive integration), index the rows' whole blocks before verification, drafts
        included; returns each row's newly indexed (column, block id) pairs, for the roll back. Else None."""
        if not (self.pol.prefix_cache and self.pol.insert == "on_fill"):
            return None
        a, m, max_len = self.alloc, self.cfg.cache.max_blocks_per_seq, self.cfg.max_len
        views = [list(self.tokens[b]) + [int(t) for t in draft_tokens[b][: batch.num_drafts[b]]] for b in rows]
        tables = [a.tables[b] + [NULL_BLOCK] * (m - len(a.tables[b])) for b in rows]
        return self.index.insert([v + [0] * (max_len - len(v)) for v in views], [filled_to[b] for b in rows], tables,
                                 [self.cache_salt[b] for b in rows])

    def commit(self, batch: OracleBatch, acc: list) -> None:
        """Commit the computed tokens and the accepted drafts (and restored tokens); roll back the rest. Rows
        within the window first, then the wider ones, as the jitted two-pass commit."""
        a, s, w = self.alloc, self.cfg.cache.block_size, self._window()
        slots = range(self.cfg.cache.max_seqs)
        commit = [(batch.num_query[b] + acc[b] if batch.scheduled[b] else 0) + batch.restore[b] for b in slots]
        fits = [len(a.tables[b]) - a.committed[b] // s <= w for b in slots]
        a.commit(commit, window=w)
        if not all(fits):
            a.commit([0 if f else x for f, x in zip(fits, commit)])

    def append_tokens(self, batch: OracleBatch, acc: list, next_tokens, draft_tokens) -> list[int]:
        """A sampling row appends its accepted drafts, then the target's token; returns the count per slot."""
        new = [acc[b] + 1 if batch.samples[b] else 0 for b in range(self.cfg.cache.max_seqs)]
        for b, x in enumerate(new):
            if x:
                self.tokens[b] = self.tokens[b] + [int(t) for t in draft_tokens[b][: acc[b]]] + [int(next_tokens[b])]
        return new

    def finish(self, batch: OracleBatch, new: list, stop) -> list[bool]:
        """A RUNNING row that sampled finishes (FINISHED) on its stop flag, at max_new_tokens or a full table."""
        max_len, finished = self.cfg.max_len, [False] * self.cfg.cache.max_seqs
        for b in range(self.cfg.cache.max_seqs):
            length = len(self.tokens[b])  # includes the new[b] tokens just appended
            if self.status[b] == RUNNING and batch.samples[b]:
                finished[b] = bool(stop[b]) or length - self.prompt_len[b] >= self.max_new[b] or length >= max_len
        for b, x in enumerate(finished):
            if x:
                self.status[b] = FINISHED
        return finished

    def index_filled_blocks(self, rows: list, on_fill: list | None) -> None:
        """Indexed on fill: drop the entries whose block now holds a rejected draft (and their descendants, which
        are unpinned) and pin the others. Else index the rows' whole committed blocks and pin them."""
        a, s, max_len = self.alloc, self.cfg.cache.block_size, self.cfg.max_len
        if on_fill is not None:
            stale, kept = [], []
            for b, new_ids in zip(rows, on_fill):
                for j, blk in new_ids:
                    (stale if (j + 1) * s > a.committed[b] else kept).append(blk)
            descendants = self.index.remove(stale)
            a.set_cached(kept, [True] * len(kept))
            self._unpin(descendants)
        elif self.pol.prefix_cache:
            new_ids = self.index.insert([self.tokens[b] + [0] * (max_len - len(self.tokens[b])) for b in rows],
                                        [a.committed[b] for b in rows], [a.tables[b] for b in rows],
                                        [self.cache_salt[b] for b in rows])
            ids = [blk for row in new_ids for _, blk in row]
            a.set_cached(ids, [True] * len(ids))

    def reclaim(self, knobs: Knobs) -> None:
        """With a speculative pool, its blocks older than generation_threshold steps go back to the free stack."""
        if self.pol.spec_pool:
            self.alloc.reclaim_expired(self.step, int(knobs.generation_threshold))

    def count(self, batch: OracleBatch, acc: list, new: list, finished: list) -> None:
        """The acceptance histogram of each verified row, the step's counters, and the step number."""
        verified = [x and k > 0 for x, k in zip(batch.samples, batch.num_drafts)]
        for b, x in enumerate(verified):
            if x:
                self.hist[b][acc[b]] += 1
                for d in range(min(acc[b] + 1, self.cfg.reach_of[batch.num_drafts[b]])):  # the depths reached
                    self.draft_tried[b][d] += 1
                    self.pop_tried[d] += 1
                for d in range(acc[b]):
                    self.draft_passed[b][d] += 1
                    self.pop_passed[d] += 1
        if self.pol.goodput_control:  # lag and probes: a row decoded when it sampled a token after its first
            t, t0 = self.priced
            drafting = any(x > 0 for x in batch.num_drafts)
            for b in range(self.cfg.cache.max_seqs):
                if batch.samples[b] and batch.start[b] >= self.prompt_len[b]:
                    waits = drafting or self.lag[b] > self.elapsed[b] // dc.LAG_SLACK
                    self.undrafted[b] = 0 if batch.num_drafts[b] > 0 else self.undrafted[b] + waits
                    self.lag[b] = min(max(self.lag[b] + t - t0 * (1 + acc[b]), -dc.LAG_CAP), dc.LAG_CAP)
                    self.elapsed[b] = min(self.elapsed[b] + t, dc.LAG_CAP)
        for d in range(self.pol.draft_len):
            if self.pop_tried[d] >= dc.POP_HALVE_AT:
                self.pop_tried[d] //= 2
                self.pop_passed[d] //= 2
        ct = self.counters
        ct["steps"] += 1
        ct["finished"] += sum(finished)
        ct["drafted"] += sum(batch.num_drafts)
        ct["accepted"] += sum(acc)
        ct["verifications"] += sum(verified)
        ct["output_tokens"] += sum(new)
        self.step += 1
