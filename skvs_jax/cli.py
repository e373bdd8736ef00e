"""The `skvs` command line.

Subcommands grow with the project; each one lives in its own module and is imported only when used, so
`skvs --help` stays fast.

  skvs bench             vllm_default vs naive_spec vs skvs on one trace with the shipped tiny model
  skvs generate TEXT     stream a continuation, showing accepted drafts
  skvs micro allocator   one batched allocator step vs the plain-Python oracle and a sequential JAX search
  skvs micro attention   paged decode attention (XLA path) vs dense attention over contiguous KV
  skvs micro precision   Medusa acceptance with the KV cache in float32 / bfloat16 / fp8 / int8, K = 1..4
  skvs micro scheduler   one scheduler step (schedule + update) vs the plain-Python oracle scheduler
  skvs micro simulate    simulated steps per second, and a vmapped sweep vs the same points one by one
  skvs simulate          the three policies simulated for a large model on a GPU (cost model), optionally swept
"""

from __future__ import annotations

import argparse
import codecs
import os
import sys

import skvs_jax


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skvs", description="Speculation-aware KV scheduling in JAX.")
    parser.add_argument("--version", action="version", version=f"skvs_jax {skvs_jax.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    from skvs_jax import bench

    bench.add_arguments(commands.add_parser(
        "bench", help="vllm_default vs naive_spec vs skvs on the same trace, shipped tiny model (the main job)"))
    from skvs_jax.sim import command as sim_command

    sim_command.add_arguments(commands.add_parser(
        "simulate", help="vllm_default vs naive_spec vs skvs simulated for a large model on a GPU (cost model)"))
    gen = commands.add_parser("generate", help="stream a continuation from the shipped tiny model")
    gen.add_argument("text", help="the prompt (bytes of UTF-8 text)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--policy", default="skvs", choices=sorted(("vllm_default", "naive_spec", "skvs")))
    gen.add_argument("--draft-len", type=int, default=4)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--plain", action="store_true", help="no colour: accepted drafts in [brackets]")

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
    from skvs_jax import bench_precision

    bench_precision.add_arguments(
        micro_commands.add_parser("precision", help="Medusa acceptance vs KV-cache dtype (fp32/bf16/fp8/int8)")
    )
    from skvs_jax import bench_simulate

    bench_simulate.add_arguments(
        micro_commands.add_parser("simulate", help="simulated steps/s, and a vmapped sweep vs sequential runs"))
    from pallas_kernels import bench_attention

    bench_attention.add_arguments(
        micro_commands.add_parser("attention", help="paged decode attention vs dense attention (XLA, CPU)"))
    return parser


def _generate(args: argparse.Namespace) -> int:
    """Stream the model's continuation; tokens that were accepted drafts are highlighted."""
    from skvs_jax import bench, engine, policies
    from skvs_jax.config import CacheConfig

    raw = os.fsencode(args.text)  # the argument's bytes, even where they are not valid UTF-8
    prompt = list(raw)
    if not prompt:
        print("skvs generate: the prompt is empty", file=sys.stderr)
        return 2
    cache = CacheConfig(num_blocks=129, block_size=8, max_seqs=1, max_blocks_per_seq=128)
    try:
        policy = policies.preset(args.policy, args.draft_len)
        model, heads = bench.load_shipped()
        e = engine.Engine(model, heads, policy, cache, token_budget=256, prefill_chunk=256)
        e.add_request(prompt, engine.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    except ValueError as err:
        print(f"skvs generate: {err}", file=sys.stderr)
        return 2
    on, off = ("[", "]") if args.plain else ("\x1b[32m", "\x1b[0m")
    # One incremental decoder for the whole stream: a character whose bytes span two steps is printed whole.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    sys.stdout.write(decoder.decode(raw))
    steps = drafted = 0
    for _, tokens, _ in e.stream():
        steps += 1
        # All but the last token of a step were accepted drafts; the last is the model's own.
        head, tail = decoder.decode(bytes(tokens[:-1])), decoder.decode(bytes(tokens[-1:]))
        sys.stdout.write((on + head + off if head else "") + tail)
        sys.stdout.flush()
        drafted += len(tokens) - 1
    sys.stdout.write(decoder.decode(b"", final=True))
    total = len(e.requests[0].tokens)
    print(f"\n-- {total} tokens in {steps} steps ({total / max(steps, 1):.2f} tokens/step, {drafted} accepted drafts, "
          f"policy {policy.name})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        print(f"skvs_jax {skvs_jax.__version__}")
        parser.print_help()
        return 0
    if args.command == "bench":
        from skvs_jax import bench

        return bench.run(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "simulate":
        from skvs_jax.sim import command as sim_command

        return sim_command.run(args)
    if args.command == "micro" and args.target == "allocator":
        from skvs_jax import bench_allocator

        return bench_allocator.run(args)
    if args.command == "micro" and args.target == "scheduler":
        from skvs_jax import bench_scheduler

        return bench_scheduler.run(args)
    if args.command == "micro" and args.target == "precision":
        from skvs_jax import bench_precision

        return bench_precision.run(args)
    if args.command == "micro" and args.target == "simulate":
        from skvs_jax import bench_simulate

        return bench_simulate.run(args)
    if args.command == "micro" and args.target == "attention":
        from pallas_kernels import bench_attention

        return bench_attention.run(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
