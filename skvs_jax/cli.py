"""The `skvs` command line.

Subcommands grow with the project; each one lives in its own module and is imported only when used, so
`skvs --help` stays fast.

  skvs micro allocator   one batched allocator step vs the plain-Python oracle and a sequential JAX search
  skvs micro attention   paged decode attention (XLA path) vs dense attention over contiguous KV
  skvs micro scheduler   one scheduler step (schedule + update) vs the plain-Python oracle scheduler
"""

from __future__ import annotations

import argparse
import sys

import skvs_jax


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skvs", description="Speculation-aware KV scheduling in JAX.")
    parser.add_argument("--version", action="version", version=f"skvs_jax {skvs_jax.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    micro = commands.add_parser("micro", help="micro-benchmarks of single components")
    micro_commands = micro.add_subparsers(dest="target", metavar="TARGET", required=True)

    from skvs_jax import bench_allocator

    bench_allocator.add_arguments(
        micro_commands.add_parser("allocator", help="one batched allocator step vs Python oracle and sequential search")
    )
    from skvs_jax import bench_scheduler

    bench_scheduler.add_arguments(
        micro_commands.add_parser("scheduler", help="one scheduler step (schedule + update) vs the Python oracle")
    )
    attention = micro_commands.add_parser("attention", help="paged decode attention vs dense attention (XLA, CPU)")
    attention.add_argument("args", nargs=argparse.REMAINDER, help="flags passed to the attention benchmark")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        print(f"skvs_jax {skvs_jax.__version__}")
        parser.print_help()
        return 0
    if args.command == "micro" and args.target == "allocator":
        from skvs_jax import bench_allocator

        return bench_allocator.run(args)
    if args.command == "micro" and args.target == "scheduler":
        from skvs_jax import bench_scheduler

        return bench_scheduler.run(args)
    if args.command == "micro" and args.target == "attention":
        from pallas_kernels import bench_attention

        return bench_attention.main(args.args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
