"""The width picker: which compiled query width Q each engine step runs, and which widths to compile.

An engine compiles one program per query width (`widths`): the decode widths 1 + d for each draft width d
(the state's `draft_widths`; chosen from the observed histogram under the policy's `bucket_budget`,
`scheduler.buckets`), and the prompt width for steps with prompt work. Two concerns live here, kept apart because
the host-loop work moves the first onto the device:

  the per-step pick   `pick(knobs)`: from what the previous step reported (`observe`), never from state read back
                      between steps. The prompt width while some row has prompt work; else 1 + the smallest draft
                      width holding the most drafts any live row may get (an upper bound: memory and room only
                      lower it). The bound was made with the previous step's knobs; new knobs: the widest width.
  the chooser         the histograms (`draft_hist`, `width_hist`, the chooser's `bucket_hist`), the padding a
                      decode step verifies without a draft (`account`), the re-choice of the draft widths as the
                      histogram drifts, and `warmup_order`: which widths to compile first.
"""

from __future__ import annotations

import collections

import numpy as np

from skvs_jax import scheduler as sc
from skvs_jax.policies import Policy
from skvs_jax.serve import engine_step


class WidthPicker:
    """The query widths of one engine (see the module docstring). `prompt_width`: the prefill chunk's width, at
    least 1 + K."""

    def __init__(self, policy: Policy, prompt_width: int):
        self.policy = policy
        buckets = (policy.draft_buckets or (policy.draft_len,)) if policy.speculation else (0,)
        self.decode_widths = tuple(1 + x for x in buckets)
        self.prompt_width = prompt_width
        self.widths = tuple(sorted(set(self.decode_widths) | {prompt_width}))  # every width had so far
        self.chooser = (sc.buckets.BucketChooser(policy.draft_len, policy.bucket_budget, tuple(buckets))
                        if policy.bucket_budget else None)
        self.padding = 0  # draft slots verified without a draft, over decode steps (`scheduler.buckets`)
        self.draft_hist: collections.Counter[int] = collections.Counter()  # steps by most drafts in the step
        self.width_hist: collections.Counter[int] = collections.Counter()  # steps by query width
        self.split_steps = 0  # steps that ran the split branch (counted at the prompt width in `width_hist`)
        self.prompt_work = False  # what the last step reported (or requests were just added)
        self.next_drafts, self.drafts_knobs = policy.draft_len, None  # the bound, and the knobs it was made with

    # ------------------------------------------------------------------------------------------ the pick

    def pick(self, knobs) -> tuple[int, int | None]:
        """(the next step's query width, the draft bound that picked it: None for a prompt-width step or the
        widest after the knobs changed). `scheduler.buckets.snap_up` of the bound were every width compiled is
        the bound under the current widths, even just after a re-choice."""
        if self.prompt_work:
            return self.prompt_width, None
        if knobs is not self.drafts_knobs:
            return self.decode_widths[-1], None
        bound = self.next_drafts
        return 1 + int(sc.buckets.snap_up(bound, [w - 1 for w in self.decode_widths])), bound

    def observe(self, out: engine_step.StepOut, width: int, knobs) -> int:
        """A step's outputs (numpy leaves) at `width`: what the next pick reads, and the histograms. Returns the
        width the step ran: narrower than `width` when memory kept every prompt row out (`model_step_at`); a split
        step counts at the width the host chose."""
        self.prompt_work = bool(out.prompt_work)
        self.next_drafts, self.drafts_knobs = int(out.next_want), knobs
        ran = int(out.width)
        if bool(out.split):
            ran = width
            self.split_steps += 1
        self.width_hist[ran] += 1
        self.draft_hist[int(np.max(out.num_drafts))] += 1
        return ran

    # ------------------------------------------------------------------------------------------ the chooser

    def account(self, out: engine_step.StepOut, width: int, bound: int | None) -> tuple[int, tuple[int, ...] | None]:
        """A decode-only step's padding (its rows' draft slots without a draft), into the total; with
        `bucket_budget`, its bound into the chooser. Returns (the step's padding, the re-chosen draft widths or
        None): the caller installs new widths (`set_draft_widths`) in the state too."""
        rows, drafted = int(np.sum(out.scheduled)), int(np.sum(out.num_drafts))
        pad = rows * (width - 1) - drafted if bound is not None else 0
        self.padding += pad
        if bound is None or self.chooser is None or not rows:
            return pad, None
        self.chooser.observe(bound, rows, drafted)
        return pad, self.chooser.rechoose()

    def set_draft_widths(self, widths, compiled_any: bool) -> tuple[int, ...]:
        """Validate and take new draft widths (1..W draft counts in [0, K], K among them); returns them sorted.
        compiled_any: some program ran already (else the widths had so far are a fresh choice)."""
        k, slots = self.policy.draft_len, self.policy.width_slots
        widths = tuple(sorted(set(int(w) for w in widths)))
        if not widths or widths[-1] != k or widths[0] < 0 or len(widths) > slots:
            raise ValueError(f"widths must hold 1..{slots} draft counts in [0, {k}], {k} among them, got {widths}")
        self.decode_widths = tuple(1 + w for w in widths)
        had = set(self.widths) if compiled_any else {self.prompt_width}
        self.widths = tuple(sorted(had | set(self.decode_widths)))
        if self.chooser is not None:
            self.chooser.widths = widths
        return widths

    def choose_from(self, hist: dict[int, int]) -> tuple[int, ...] | None:
        """Under `bucket_budget`, the draft widths a non-empty histogram (most drafts -> steps) chooses; else None."""
        if self.chooser is None or not any(hist.values()):
            return None
        return sc.buckets.choose_widths(sc.buckets.as_hist(hist, self.policy.draft_len), self.policy.bucket_budget,
                                        self.policy.draft_len)

    def warmup_order(self, hist: dict[int, int]) -> list[int]:
        """The widths to compile, hottest first: the prompt width (every request is prefilled with it), then the
        decode widths by the steps of `hist` (most drafts -> steps) that fall into them."""
        heat: collections.Counter[int] = collections.Counter()
        for drafts, steps in hist.items():
            heat[1 + int(sc.buckets.snap_up(drafts, [w - 1 for w in self.decode_widths]))] += steps
        decode = sorted(set(self.decode_widths) - {self.prompt_width}, key=lambda w: (-heat[w], w))
        return [self.prompt_width] + decode

    def runnable(self) -> list[int]:
        """The query widths a step can run now: the decode widths and the prompt width."""
        return sorted(set(self.decode_widths) | {self.prompt_width})

    @property
    def bucket_hist(self) -> dict[int, int]:
        """Decode rows by their step's draft bound, over decode-only steps (with `bucket_budget`; empty
        otherwise): what `warmup` of a later engine chooses its widths from."""
        if self.chooser is None:
            return {}
        return {d: w for d, w in enumerate(self.chooser.hist) if w}
