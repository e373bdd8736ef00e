"""What the micro-benchmarks share: the pool geometry flags of `skvs micro allocator` and `skvs micro scheduler`
(named as the glossary names the dimensions), their checks, the median of a list of step times, and the
scheduler benchmarks' requests and per-step draws (`skvs micro scheduler`, `skvs micro program`)."""

from __future__ import annotations

import argparse
import math
import statistics

import numpy as np


def add_pool_arguments(parser: argparse.ArgumentParser, *, seqs_help: str, max_blocks_per_seq: int) -> None:
    """--seqs (B), --blocks (N), --block-size (S), --max-blocks-per-seq (M), --draft-len (K), --accept-prob."""
    parser.add_argument("--seqs", type=int, default=256, help=seqs_help)
    parser.add_argument("--blocks", type=int, default=65_536, help="blocks in the pool (N)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (S)")
    parser.add_argument("--max-blocks-per-seq", type=int, default=max_blocks_per_seq, help="block-table width (M)")
    parser.add_argument("--draft-len", type=int, default=4, help="draft tokens per sequence per step (K)")
    parser.add_argument("--accept-prob", type=float, default=0.7, help="per-draft acceptance probability")


def median_us(times: list[float]) -> float:
    """The median of step times in seconds, in microseconds."""
    return statistics.median(times) * 1e6


def check_minimums(args: argparse.Namespace, command: str, minimums: tuple[tuple[str, int], ...]) -> None:
    """`SystemExit("skvs <command>: --flag must be >= low, got x")` for the first int flag below its minimum; then
    --accept-prob (`add_pool_arguments`), a probability: in [0, 1]."""
    for flag, low in minimums:
        if getattr(args, flag) < low:
            raise SystemExit(f"skvs {command}: --{flag.replace('_', '-')} must be >= {low}, got {getattr(args, flag)}")
    p = getattr(args, "accept_prob", 0.0)
    if not (math.isfinite(p) and 0 <= p <= 1):
        raise SystemExit(f"skvs {command}: --accept-prob must lie in [0, 1], got {p}")


def decode_requests(rng: np.random.Generator, b: int, prompt_len: int, max_len: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """b requests for a scheduler benchmark: prompts of prompt_len / 2 .. 3 prompt_len / 2 tokens (at most
    max_len / 2), half of them sharing a system prompt of prompt_len / 4 tokens, each decoding for longer than a run.
    Returns (prompts int32[b, width], lens int32[b], max_new int32[b])."""
    lens = np.clip(rng.integers(prompt_len // 2, 3 * prompt_len // 2, b), 2, max_len // 2).astype(np.int32)
    prompts = rng.integers(0, 256, (b, int(lens.max()))).astype(np.int32)
    system = rng.integers(0, 256, prompt_len // 4)
    shared = rng.random(b) < 0.5
    prompts[shared, : system.size] = system
    return prompts, lens, np.full(b, max_len - int(lens.max()), np.int32)


def step_draws(seed: int, t: int, b: int, k: int, accept_prob: float, lead: tuple[int, ...] = ()
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draw t of a seeded stream of what the model would return, per row: (accepted int32[*lead, b], the length of
    a prefix of k drafts each accepted with accept_prob; next tokens int32[*lead, b]; drafts int32[*lead, b,
    max(k, 1)]). lead: leading steps (a `lax.scan`'s)."""
    r = np.random.default_rng((seed, t))
    kk = max(k, 1)
    acc = np.sum(np.cumprod(r.random((*lead, b, kk)) < accept_prob, axis=-1), axis=-1).astype(np.int32)
    return acc, r.integers(0, 256, (*lead, b)).astype(np.int32), r.integers(0, 256, (*lead, b, kk)).astype(np.int32)
