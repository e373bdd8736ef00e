"""What the micro-benchmarks share: the pool geometry flags of `skvs micro allocator` and `skvs micro scheduler`
(named as the glossary names the dimensions), their checks, and the median of a list of step times."""

from __future__ import annotations

import argparse
import math
import statistics


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
