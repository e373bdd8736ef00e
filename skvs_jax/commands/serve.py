"""`skvs serve`: an OpenAI-compatible HTTP server (`serve.openai_server`) over one `AsyncLLM`, run by uvicorn.

    skvs serve                                    # the shipped tiny Llama and its heads on 127.0.0.1:8000
    skvs serve --model DIR --medusa DIR --port 8080 --served-model-name llama

The model is an `LLM`: a Hugging Face Llama folder (--model), Medusa heads (--medusa; alone, the base model their
config names), or the shipped tiny model. --policy defaults to skvs when there are heads, else vllm_default.
--warmup (the default) compiles every query width before the port opens, so no request waits for a compilation.

The server's dependencies (fastapi, uvicorn, prometheus-client) are the `serve` extra: the library and the other
commands do not need them, so they are imported only when this command runs, and a missing one is a one-line
error saying what to install.
"""

from __future__ import annotations

import argparse
import sys

from skvs_jax import policies
from skvs_jax.commands import startup

INSTALL = "pip install 'skvs-jax[serve]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="a Hugging Face Llama checkpoint folder (default: the shipped tiny Llama, or the base "
                             "model the --medusa config names)")
    parser.add_argument("--medusa", metavar="DIR_OR_FILE", default=None, help="Medusa heads for --model")
    parser.add_argument("--policy", default=None, choices=sorted(policies.PRESETS),
                        help="the scheduling policy (default: skvs with heads, vllm_default without)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output in tokens (default: the model's limit, at most 2048)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="sequence slots (outputs served at once)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="the weights' dtype (auto: the checkpoint's own)")
    parser.add_argument("--served-model-name", metavar="NAME", default=None,
                        help="the name clients pass as `model` (default: --model or --medusa as given, else "
                             "skvs-tiny-llama)")
    startup.add_arguments(parser, warmup=True)


def run(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as err:
        print(f"skvs serve: {err.name or err} is not installed: {INSTALL}", file=sys.stderr)
        return 2
    from skvs_jax.serve.async_llm import AsyncLLM
    from skvs_jax.serve.llm import LLM
    from skvs_jax.serve.openai_server import build_app

    if not 0 <= args.port <= 65535:
        print(f"skvs serve: --port must lie in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    has_heads = args.medusa is not None or args.model is None
    policy = args.policy or ("skvs" if has_heads else "vllm_default")
    directory = startup.resolve(args.compile_cache)  # main() configured it; None: off
    try:
        llm = LLM(args.model, medusa=args.medusa, policy=policy, dtype=args.dtype, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, compile_cache=False if directory is None else directory)
    except (ValueError, TypeError, OSError) as err:
        print(f"skvs serve: {_as_flags(str(err))}", file=sys.stderr)
        return 2
    if args.warmup:
        llm.engine.warmup()
    name = args.served_model_name or args.model or args.medusa or "skvs-tiny-llama"
    engine = AsyncLLM(llm)
    try:
        uvicorn.run(build_app(engine, name), host=args.host, port=args.port, log_level="info")
    finally:
        engine.shutdown()
    return 0


def _as_flags(message: str) -> str:
    """An `LLM` error in the command's words: its argument names as the flags that set them."""
    for arg, flag in (("model=", "--model "), ("medusa=", "--medusa "), ("max_model_len", "--max-model-len"),
                      ("max_num_seqs", "--max-num-seqs"), ("dtype", "--dtype")):
        message = message.replace(arg, flag)
    return message
