"""`skvs generate TEXT`: stream the shipped tiny model's continuation of TEXT, showing which tokens were drafts."""

from __future__ import annotations

import argparse
import codecs
import os
import sys

from reference_models.checkpoint import load_shipped
from skvs_jax import policies
from skvs_jax.config import CacheConfig
from skvs_jax.serve import engine


def add_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("text", help="the prompt (bytes of UTF-8 text)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--policy", default="skvs", choices=sorted(("vllm_default", "naive_spec", "skvs")))
    gen.add_argument("--draft-len", type=int, default=4)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--plain", action="store_true", help="no colour: accepted drafts in [brackets]")


def run(args: argparse.Namespace) -> int:
    """Stream the model's continuation; tokens that were accepted drafts are highlighted."""
    raw = os.fsencode(args.text)  # the argument's bytes, even where they are not valid UTF-8
    prompt = list(raw)
    if not prompt:
        print("skvs generate: the prompt is empty", file=sys.stderr)
        return 2
    cache = CacheConfig(num_blocks=129, block_size=8, max_seqs=1, max_blocks_per_seq=128)
    try:
        policy = policies.preset(args.policy, args.draft_len)
        model, heads = load_shipped()
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
