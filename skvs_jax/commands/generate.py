"""`skvs generate TEXT`: stream a model's continuation of TEXT, showing which tokens were drafts.

The model: the shipped tiny Llama and its Medusa heads, or `--model DIR` / `--medusa DIR_OR_FILE`
(`commands.checkpoints`). Prompts are bytes. One sequence slot, as long as `--max-model-len` (default the model's
`max_position_embeddings`). Only the query widths the request uses are compiled (`--warmup` compiles them all
first), through the persistent compilation cache (`commands.startup`).
"""

from __future__ import annotations

import argparse
import codecs
import os
import sys

from skvs_jax import policies
from skvs_jax.commands import checkpoints, startup
from skvs_jax.config import CacheConfig
from skvs_jax.serve import engine

BLOCK_SIZE = 8


def add_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("text", help="the prompt (bytes of UTF-8 text)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--policy", default="skvs", choices=sorted(("vllm_default", "naive_spec", "skvs")))
    gen.add_argument("--draft-len", type=int, default=None, help="drafts per step (default: the Medusa heads' count)")
    gen.add_argument("--max-model-len", type=int, default=None,
                     help="longest sequence (prompt + output) in tokens (default: the model's max_position_embeddings)")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--plain", action="store_true", help="no colour: accepted drafts in [brackets]")
    checkpoints.add_arguments(gen)
    startup.add_arguments(gen, warmup=False)


def _engine(args: argparse.Namespace, prompt: list[int]) -> engine.Engine:
    loaded = checkpoints.load(args)
    policy = policies.preset(args.policy, checkpoints.draft_len(args, loaded))
    checkpoints.check_speculation(policy, loaded)
    limit = loaded.max_positions
    max_len = limit if args.max_model_len is None else args.max_model_len
    if not 1 <= max_len <= limit:
        raise ValueError(f"--max-model-len must lie in [1, {limit}] (the model's max_position_embeddings), got "
                         f"{max_len}")
    blocks = max(max_len // BLOCK_SIZE, 1)
    cache = CacheConfig(num_blocks=blocks + 1, block_size=min(BLOCK_SIZE, max_len), max_seqs=1,
                        max_blocks_per_seq=blocks)
    e = engine.Engine(loaded.model, loaded.heads, policy, cache, token_budget=256, prefill_chunk=256)
    e.add_request(prompt, engine.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    return e


def _bytes(tokens: list[int]) -> bytes:
    """Tokens as the bytes they stand for; a token past the byte range (a larger vocabulary) prints as U+FFFD."""
    return b"".join(bytes((t,)) if t < checkpoints.BYTE_VOCAB else "\ufffd".encode() for t in tokens)


def run(args: argparse.Namespace) -> int:
    """Stream the model's continuation; tokens that were accepted drafts are highlighted."""
    raw = os.fsencode(args.text)  # the argument's bytes, even where they are not valid UTF-8
    prompt = list(raw)
    if not prompt:
        print("skvs generate: the prompt is empty", file=sys.stderr)
        return 2
    try:
        e = _engine(args, prompt)
    except (ValueError, OSError) as err:
        print(f"skvs generate: {err}", file=sys.stderr)
        return 2
    if args.warmup:
        e.warmup()
    on, off = ("[", "]") if args.plain else ("\x1b[32m", "\x1b[0m")
    # One incremental decoder for the whole stream: a character whose bytes span two steps is printed whole.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    sys.stdout.write(decoder.decode(raw))
    steps = drafted = 0
    for _, tokens, _ in e.stream():
        steps += 1
        # All but the last token of a step were accepted drafts; the last is the model's own.
        head, tail = decoder.decode(_bytes(tokens[:-1])), decoder.decode(_bytes(tokens[-1:]))
        sys.stdout.write((on + head + off if head else "") + tail)
        sys.stdout.flush()
        drafted += len(tokens) - 1
    sys.stdout.write(decoder.decode(b"", final=True))
    total = len(e.requests[0].tokens)
    print(f"\n-- {total} tokens in {steps} steps ({total / max(steps, 1):.2f} tokens/step, {drafted} accepted drafts, "
          f"policy {e.policy.name})")
    return 0
