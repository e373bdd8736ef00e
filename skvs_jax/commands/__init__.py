"""The `skvs` command line: `main` is the entry point; each command lives in the module named as one types it
(`skvs micro scheduler` in `micro_scheduler.py`) and is imported only when used, so `skvs --help` stays fast.

  skvs bench             vllm_default vs naive_spec vs skvs on one trace (the shipped tiny model, or --model-shape)
  skvs claims            every claim of the article with our figure and a verdict (docs/claims.md)
  skvs generate TEXT     stream a continuation, showing accepted drafts (--model / --medusa: your checkpoint)
  skvs serve             an OpenAI-compatible HTTP server over the model (needs the serve extra)
  skvs gpu-check         the one GPU script: kernels, their tuning sweep, serving, the step program (--cpu-smoke)
  skvs micro allocator   one batched allocator step vs the plain-Python oracle and a sequential JAX search
  skvs micro attention   paged decode attention (XLA path) vs dense attention over contiguous KV
  skvs micro compile     the model's paged forward compile time at real shapes: scanned layers vs unrolled
  skvs micro buckets     padding with draft widths chosen from the histogram vs the fixed {0, K/2, K}
  skvs micro host        the host's share of serving wall time, by policy and steps per dispatch
  skvs micro program     one step's program as a GPU runs it: heavy primitives, kernels, host round trips
  skvs micro precision   Medusa acceptance with the KV cache in float32 / bfloat16 / fp8 / int8, K = 1..4
  skvs micro scheduler   one scheduler step (schedule + update) vs the plain-Python oracle scheduler
  skvs micro simulate    simulated steps per second, and a vmapped sweep vs the same points one by one
  skvs simulate          the three policies simulated for a large model on a GPU (cost model), optionally swept

Each command's module: `bench` (with `bench_serving` and `bench_report`), `simulate`, `claims`, `generate`,
`serve`, `gpu_check`, `micro_allocator`, `micro_scheduler`, `micro_precision`, `micro_simulate`, `micro_attention`,
`micro_buckets`, `micro_host`, `micro_program`, `micro_compile`.
Beside them: `checkpoints` (--model / --medusa), `policy_flags` (the policy switches bench and simulate share),
`trace_flags` (the arrival flags they share: --burstiness, --phases, --trace), `group_report` (their per-phase and
per-class tables and the hindsight oracle), `micro_common` (the micro-benchmarks' pool flags and checks) and
`startup` (the compilation cache and the --out folder). Commands are dispatched by one table, `COMMANDS`.

generate, serve, bench and simulate keep compiled programs in a persistent XLA cache (`skvs_jax.compile_cache`:
--compile-cache DIR|off, SKVS_COMPILE_CACHE, default ~/.cache/skvs_jax/xla).
"""

from __future__ import annotations

import argparse
import importlib

import skvs_jax

# (the words one types after `skvs`, the module under skvs_jax.commands, the help line), in `skvs --help`'s order.
# Each module has `add_arguments(parser)` and `run(args) -> int`.
COMMANDS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("bench",), "bench", "vllm_default vs naive_spec vs skvs on the same trace, shipped tiny model (the main job)"),
    (("simulate",), "simulate",
     "vllm_default vs naive_spec vs skvs simulated for a large model on a GPU (cost model)"),
    (("claims",), "claims",
     "the article's claims, each with our figure and a verdict (writes docs/claims.md's report)"),
    (("generate",), "generate", "stream a continuation from the shipped tiny model, or --model / --medusa"),
    (("serve",), "serve", "an OpenAI-compatible HTTP server (completions, chat, SSE streaming, /metrics)"),
    (("micro", "allocator"), "micro_allocator", "one batched allocator step vs Python oracle and sequential search"),
    (("micro", "scheduler"), "micro_scheduler", "one scheduler step (schedule + update) vs the Python oracle"),
    (("micro", "precision"), "micro_precision", "Medusa acceptance vs KV-cache dtype (fp32/bf16/fp8/int8)"),
    (("micro", "simulate"), "micro_simulate", "simulated steps/s, and a vmapped sweep vs sequential runs"),
    (("micro", "attention"), "micro_attention", "paged decode attention vs dense attention (XLA, CPU)"),
    (("micro", "compile"), "micro_compile",
     "the model's paged forward compile time at real shapes (abstract weights): scanned vs unrolled layers"),
    (("micro", "buckets"), "micro_buckets", "padding: draft widths chosen from the histogram vs {0, K/2, K}"),
    (("micro", "host"), "micro_host", "the host's share of serving wall time, by policy and steps per dispatch"),
    (("micro", "program"), "micro_program",
     "one step's program as a GPU runs it: heavy primitives, kernels, host round trips"),
    (("gpu-check",), "gpu_check", "the one GPU script: kernels and their tuning, serving, the step program"),
)
GROUPS = {"micro": "micro-benchmarks of single components"}  # a first word with commands of its own


def _module(name: str):
    return importlib.import_module(f"skvs_jax.commands.{name}")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skvs", description="Speculation-aware KV scheduling in JAX.")
    parser.add_argument("--version", action="version", version=f"skvs_jax {skvs_jax.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups = {}
    for words, module, help_line in COMMANDS:
        if len(words) == 1:
            _module(module).add_arguments(commands.add_parser(words[0], help=help_line))
            continue
        if words[0] not in groups:
            group = commands.add_parser(words[0], help=GROUPS[words[0]])
            groups[words[0]] = group.add_subparsers(dest="target", metavar="TARGET", required=True)
        _module(module).add_arguments(groups[words[0]].add_parser(words[1], help=help_line))
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
    typed = (args.command,) + ((args.target,) if args.command in GROUPS else ())
    module = next(m for words, m, _ in COMMANDS if words == typed)  # argparse admitted only these
    return _module(module).run(args)
