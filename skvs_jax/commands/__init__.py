"""The `skvs` command line: `main` is the entry point; each command lives in the module named as one types it
(`skvs micro scheduler` in `micro_scheduler.py`) and is imported only when used, so `skvs --help` stays fast.

  skvs bench             vllm_default vs naive_spec vs skvs on one trace with the shipped tiny model
  skvs claims            every claim of the article with our figure and a verdict (docs/claims.md)
  skvs generate TEXT     stream a continuation, showing accepted drafts (--model / --medusa: your checkpoint)
  skvs micro allocator   one batched allocator step vs the plain-Python oracle and a sequential JAX search
  skvs micro attention   paged decode attention (XLA path) vs dense attention over contiguous KV
  skvs micro buckets     padding with draft widths chosen from the histogram vs the fixed {0, K/2, K}
  skvs micro precision   Medusa acceptance with the KV cache in float32 / bfloat16 / fp8 / int8, K = 1..4
  skvs micro scheduler   one scheduler step (schedule + update) vs the plain-Python oracle scheduler
  skvs micro simulate    simulated steps per second, and a vmapped sweep vs the same points one by one
  skvs simulate          the three policies simulated for a large model on a GPU (cost model), optionally swept

generate, bench and simulate keep compiled programs in a persistent XLA cache (`commands.startup`:
--compile-cache DIR|off, SKVS_COMPILE_CACHE, default ~/.cache/skvs_jax/xla).
"""

from __future__ import annotations

import argparse

import skvs_jax


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skvs", description="Speculation-aware KV scheduling in JAX.")
    parser.add_argument("--version", action="version", version=f"skvs_jax {skvs_jax.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    from skvs_jax.commands import bench

    bench.add_arguments(commands.add_parser(
        "bench", help="vllm_default vs naive_spec vs skvs on the same trace, shipped tiny model (the main job)"))
    from skvs_jax.commands import simulate as sim_command

    sim_command.add_arguments(commands.add_parser(
        "simulate", help="vllm_default vs naive_spec vs skvs simulated for a large model on a GPU (cost model)"))
    from skvs_jax.commands import claims

    claims.add_arguments(commands.add_parser(
        "claims", help="the article's claims, each with our figure and a verdict (writes docs/claims.md's report)"))
    from skvs_jax.commands import generate

    generate.add_arguments(commands.add_parser(
        "generate", help="stream a continuation from the shipped tiny model, or --model / --medusa"))

    micro = commands.add_parser("micro", help="micro-benchmarks of single components")
    micro_commands = micro.add_subparsers(dest="target", metavar="TARGET", required=True)

    from skvs_jax.commands import micro_allocator

    micro_allocator.add_arguments(
        micro_commands.add_parser("allocator", help="one batched allocator step vs Python oracle and sequential search")
    )
    from skvs_jax.commands import micro_scheduler

    micro_scheduler.add_arguments(
        micro_commands.add_parser("scheduler", help="one scheduler step (schedule + update) vs the Python oracle")
    )
    from skvs_jax.commands import micro_precision

    micro_precision.add_arguments(
        micro_commands.add_parser("precision", help="Medusa acceptance vs KV-cache dtype (fp32/bf16/fp8/int8)")
    )
    from skvs_jax.commands import micro_simulate

    micro_simulate.add_arguments(
        micro_commands.add_parser("simulate", help="simulated steps/s, and a vmapped sweep vs sequential runs"))
    from skvs_jax.commands import micro_attention

    micro_attention.add_arguments(
        micro_commands.add_parser("attention", help="paged decode attention vs dense attention (XLA, CPU)"))
    from skvs_jax.commands import micro_buckets

    micro_buckets.add_arguments(
        micro_commands.add_parser("buckets", help="padding: draft widths chosen from the histogram vs {0, K/2, K}"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        print(f"skvs_jax {skvs_jax.__version__}")
        parser.print_help()
        return 0
    if hasattr(args, "compile_cache"):  # before anything compiles (commands.startup)
        from skvs_jax.commands import startup

        try:
            startup.configure(args.compile_cache)
        except ValueError as err:
            parser.error(str(err))
    if args.command == "bench":
        from skvs_jax.commands import bench

        return bench.run(args)
    if args.command == "claims":
        from skvs_jax.commands import claims

        return claims.run(args)
    if args.command == "generate":
        from skvs_jax.commands import generate

        return generate.run(args)
    if args.command == "simulate":
        from skvs_jax.commands import simulate as sim_command

        return sim_command.run(args)
    if args.command == "micro" and args.target == "allocator":
        from skvs_jax.commands import micro_allocator

        return micro_allocator.run(args)
    if args.command == "micro" and args.target == "scheduler":
        from skvs_jax.commands import micro_scheduler

        return micro_scheduler.run(args)
    if args.command == "micro" and args.target == "precision":
        from skvs_jax.commands import micro_precision

        return micro_precision.run(args)
    if args.command == "micro" and args.target == "simulate":
        from skvs_jax.commands import micro_simulate

        return micro_simulate.run(args)
    if args.command == "micro" and args.target == "attention":
        from skvs_jax.commands import micro_attention

        return micro_attention.run(args)
    if args.command == "micro" and args.target == "buckets":
        from skvs_jax.commands import micro_buckets

        return micro_buckets.run(args)
    parser.error(f"unknown command {args.command!r}")
    return 2

