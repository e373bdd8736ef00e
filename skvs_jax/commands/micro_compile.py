"""`skvs micro compile`: how long the model's paged forward takes to compile at real model shapes, with the layers
run by a `lax.scan` (the model's program) against the same stacked weights unrolled layer by layer.

Nothing is materialised: the parameters and the KV cache are `jax.ShapeDtypeStruct`s (`nnx.eval_shape`), and the
forward is timed through `jit(...).lower(...)` (tracing and lowering) and `.compile()` (XLA). An 8B model in
float32 would not fit this machine's memory; abstract parameters need none. The forward is the part of the
engine's step program whose size grows with depth; the scheduler and sampling around it do not.

Prints one row per (shape, layers, program, Q): the lower and compile seconds, and for each unrolled row the
ratio of its total to the scanned one's.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from skvs_jax import model_shapes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b",
                   help=f"comma-separated NAME or NAME:LAYERS of {sorted(model_shapes.SHAPES)}")
    p.add_argument("--widths", default="1,5", help="query tokens per sequence Q (1: decode; K + 1: verification)")
    p.add_argument("--programs", default="scan,unrolled", help="comma-separated of scan, unrolled")
    p.add_argument("--batch", type=int, default=8, help="sequences B")
    p.add_argument("--blocks", type=int, default=256, help="KV blocks N")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block S")
    p.add_argument("--max-blocks-per-seq", type=int, default=64, help="block-table width M")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="weights and KV dtype")
    p.add_argument("--impl", default="auto", help="kernels: auto (Pallas on a GPU, the XLA path elsewhere), xla")


def abstract_model(shape: str, num_layers: int | None, dtype) -> tuple:
    """(graphdef, abstract state, LlamaConfig) of a named shape: ShapeDtypeStructs, no memory."""
    from reference_models.llama import Llama, LlamaConfig

    config = LlamaConfig.from_hf_dict(model_shapes.hf_config(shape, num_layers))
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, state = nnx.split(model)
    return graphdef, state, config


def compile_seconds(graphdef, state, config, *, width: int, scan: bool, batch: int, blocks: int, block_size: int,
                    max_blocks: int, dtype, impl: str) -> tuple[float, float]:
    """(lower seconds, compile seconds) of the paged forward over Q = width tokens per row."""
    from reference_models.llama import KVCache

    def forward(st, tokens, positions, cache, tables, ctx, qlens):
        return nnx.merge(graphdef, st).forward_paged(tokens, positions, cache, tables, ctx, qlens, impl=impl,
                                                     scan=scan)

    i32 = jnp.int32
    sds = jax.ShapeDtypeStruct
    cache = jax.eval_shape(lambda: KVCache.zeros(config, blocks, block_size, dtype))
    args = (state, sds((batch, width), i32), sds((batch, width), i32), cache, sds((batch, max_blocks), i32),
            sds((batch,), i32), sds((batch,), i32))
    t0 = time.perf_counter()
    lowered = jax.jit(forward, donate_argnums=(3,)).lower(*args)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def run(args: argparse.Namespace) -> int:
    for name, value in (("--batch", args.batch), ("--blocks", args.blocks), ("--block-size", args.block_size),
                        ("--max-blocks-per-seq", args.max_blocks_per_seq)):
        if value < 1:
            raise SystemExit(f"skvs micro compile: {name} must be >= 1, got {value}")
    try:
        shapes = [model_shapes.parse(s) for s in args.shapes.split(",") if s]
        widths = [int(w) for w in args.widths.split(",") if w]
    except ValueError as err:
        raise SystemExit(f"skvs micro compile: {err}") from None
    programs = [p for p in args.programs.split(",") if p]
    if any(p not in ("scan", "unrolled") for p in programs) or not programs:
        raise SystemExit(f"skvs micro compile: --programs must list scan and/or unrolled, got {args.programs!r}")
    if any(w < 1 for w in widths) or not widths:
        raise SystemExit(f"skvs micro compile: --widths must be ints >= 1, got {args.widths!r}")
    dtype = jnp.dtype(args.dtype)
    print(f"paged forward compile time, abstract parameters; jax {jax.__version__} on {jax.devices()[0].device_kind}; "
          f"B={args.batch} N={args.blocks} S={args.block_size} M={args.max_blocks_per_seq} {args.dtype} "
          f"impl={args.impl}")
    print(f"{'shape':<16}{'layers':>7}{'params':>8}{'program':>10}{'Q':>4}{'lower s':>9}{'compile s':>11}"
          f"{'total s':>9}{'/ scan':>8}")
    for shape, layers in shapes:
        graphdef, state, config = abstract_model(shape, layers, dtype)
        billions = config.num_params / 1e9
        for width in widths:
            totals = {}
            for program in programs:
                lower_s, comp_s = compile_seconds(
                    graphdef, state, config, width=width, scan=program == "scan", batch=args.batch,
                    blocks=args.blocks, block_size=args.block_size, max_blocks=args.max_blocks_per_seq, dtype=dtype,
                    impl=args.impl)
                totals[program] = lower_s + comp_s
                ratio = f"{totals[program] / totals['scan']:.2f}x" if "scan" in totals and program != "scan" else ""
                print(f"{shape:<16}{config.num_layers:>7}{billions:>7.2f}B{program:>10}{width:>4}{lower_s:>9.2f}"
                      f"{comp_s:>11.2f}{lower_s + comp_s:>9.2f}{ratio:>8}", flush=True)
    return 0
