"""The arrival flags `skvs bench` and `skvs simulate` share: `--burstiness`, `--phases` and `--trace FILE`.

One definition, so that the two commands read a trace the same way: Gamma gaps of shape `--burstiness`
(`workloads.arrival_gaps`, None = Poisson), the phases of a phased workload (`workloads.phased`), or a JSONL file
of requests at their own arrival times (`workloads.read_requests`), which replaces both.
"""

from __future__ import annotations

import argparse
import math

DEFAULT_PHASES = "96x1,256x12,96x1"


def add_arguments(parser: argparse.ArgumentParser, *, verb: str, rate_flag: str) -> None:
    """verb: what the command does with a trace ("serve", "simulate"); rate_flag: its rate flag, for the help."""
    parser.add_argument("--burstiness", type=float, default=None,
                        help=f"arrival gaps Gamma-distributed with this shape and mean 1 / {rate_flag} (vLLM's "
                             "benchmark: 1 = Poisson, the default; < 1 burstier, > 1 more even)")
    parser.add_argument("--phases", default=None, metavar="COUNTxMULTIPLE,...",
                        help=f"a phased workload (workloads.phased; sets --workload phased): COUNT requests (in "
                             f"proportion to --requests) arriving at MULTIPLE x {rate_flag}, phase after phase; the "
                             f"report adds TPOT P50/P99 per phase (default with --workload phased: {DEFAULT_PHASES})")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help=f"{verb} the requests of a JSONL file instead of --workload, one a line: {{\"prompt\": "
                             "TEXT (its UTF-8 bytes count as tokens) or \"prompt_len\": N, \"output_len\": N, "
                             f"\"arrival_s\": T}} (workloads.read_requests); its arrival times replace {rate_flag}, "
                             "--burstiness and --phases")


def parse_phases(spec: str) -> list[list]:
    """--phases COUNTxMULTIPLE,... as `workloads.phased`'s phases: [[count, multiple], ...]."""
    try:
        pairs = [part.split("x") for part in spec.split(",") if part.strip()]
        return [[int(n), float(m)] for n, m in pairs]
    except ValueError:
        raise ValueError(f"--phases must be COUNTxMULTIPLE,... (e.g. {DEFAULT_PHASES}), got {spec!r}") from None


def check(args: argparse.Namespace, command: str) -> None:
    """The checks both commands make, raising SystemExit naming the flag: --burstiness finite and > 0; --phases
    well formed and only with --workload phased (which it sets); --trace without --burstiness or --phases."""
    burstiness = getattr(args, "burstiness", None)
    if burstiness is not None and not (math.isfinite(burstiness) and burstiness > 0):
        raise SystemExit(f"{command}: --burstiness must be a finite number > 0, got {burstiness}")
    phased = getattr(args, "phases", None)
    if getattr(args, "trace", None) is not None:
        for flag, given in (("--burstiness", burstiness is not None), ("--phases", phased is not None)):
            if given:
                raise SystemExit(f"{command}: --trace gives every request its arrival time: leave out {flag}")
    if phased is not None:
        if args.workload not in (None, "phased"):
            raise SystemExit(f"{command}: --phases sets a phased workload, not --workload {args.workload}")
        args.workload = "phased"
        try:
            parse_phases(phased)
        except ValueError as err:
            raise SystemExit(f"{command}: {err}") from None


def burstiness(args: argparse.Namespace) -> float:
    """--burstiness as `workloads`' argument (None: 1.0, Poisson)."""
    value = getattr(args, "burstiness", None)
    return 1.0 if value is None else value


def phases(args: argparse.Namespace) -> dict:
    """{"phases": ...} for a phased workload given --phases, else {} (the workload's default phases)."""
    return {"phases": parse_phases(args.phases)} if getattr(args, "phases", None) is not None else {}
