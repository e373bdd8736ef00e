"""`skvs generate TEXT`: stream a model's continuation of TEXT, showing which tokens were drafts.

The model: the shipped tiny Llama and its Medusa heads, or `--model DIR` / `--medusa DIR_OR_FILE`
(`commands.checkpoints`). Text goes through the checkpoint's own tokenizer (tokenizer.json beside the weights,
`serve.tokenizer`; `--chat` renders TEXT as one user message through its chat template) and its EOS ends the
output; a checkpoint without a tokenizer, like the shipped model, takes bytes (TEXT's raw bytes, even where they
are not UTF-8). One sequence slot, as long as `--max-model-len` (default the model's `max_position_embeddings`).
Only the query widths the request uses are compiled (`--warmup` compiles them all first), through the persistent
compilation cache (`skvs_jax.compile_cache`). Colour marks accepted drafts on a terminal; `--plain` (the default
into a pipe) marks them with [brackets].
"""

from __future__ import annotations

import argparse
import os
import sys

from reference_models import checkpoint
from skvs_jax import policies
from skvs_jax.commands import checkpoints, startup
from skvs_jax.config import CacheConfig
from skvs_jax.serve import engine
from skvs_jax.serve.tokenizer import ByteTokenizer, load_tokenizer

BLOCK_SIZE = 8
GENERATE_POLICIES = ("vllm_default", "naive_spec", "skvs")


def _one_policy(value: str) -> str:
    """--policy / --policies: one name (bench and simulate take several; one request is served by one)."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if len(names) != 1:
        raise argparse.ArgumentTypeError(f"skvs generate serves one policy, got {value!r}")
    return names[0]


def add_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("text", help="the prompt (bytes of UTF-8 text)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--policy", "--policies", dest="policy", default="skvs", type=_one_policy,
                     choices=sorted(GENERATE_POLICIES),
                     help="the one policy that serves the request (--policies, as bench and simulate spell it, "
                          "takes one name here)")
    gen.add_argument("--draft-len", type=int, default=None, help="drafts per step (default: the Medusa heads' count)")
    gen.add_argument("--max-model-len", type=int, default=None,
                     help="longest sequence (prompt + output) in tokens (default: the model's max_position_embeddings)")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true",
                     help="TEXT is a user message, rendered by the checkpoint's chat template")
    gen.add_argument("--ignore-eos", action="store_true", help="the model's EOS does not end the output")
    gen.add_argument("--plain", action="store_true",
                     help="no colour: accepted drafts in [brackets] (the default when stdout is not a terminal)")
    checkpoints.add_arguments(gen)
    startup.add_arguments(gen, warmup=False)


def _tokenizer(args: argparse.Namespace, loaded: checkpoints.Loaded):
    """The checkpoint's tokenizer (tokenizer.json in the model's folder), else bytes (which needs 256 tokens)."""
    folder = args.model
    if folder is None and args.medusa is not None:
        folder = checkpoint.medusa_base_model(args.medusa)
    tok = load_tokenizer(folder) if folder is not None else None
    if tok is None:
        vocab = loaded.model.config.vocab_size
        if vocab < ByteTokenizer.vocab_size:
            raise ValueError(f"--model {folder}: no tokenizer.json, and its {vocab}-token vocabulary cannot hold "
                             "bytes")
        tok = ByteTokenizer()
    return tok


def _prompt(args: argparse.Namespace, tok) -> tuple[list[int], str]:
    """(prompt ids, the text to echo). Bytes: TEXT's raw bytes (a non-UTF-8 argument's too)."""
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.text}])
        return tok.encode(text, add_special_tokens=False), args.text + "\n"
    if isinstance(tok, ByteTokenizer):
        raw = os.fsencode(args.text)
        return list(raw), raw.decode("utf-8", errors="replace")
    return tok.encode(args.text), args.text


def _engine(args: argparse.Namespace) -> tuple[engine.Engine, str]:
    loaded = checkpoints.load(args)
    tok = _tokenizer(args, loaded)
    prompt, echo = _prompt(args, tok)
    if not prompt:
        raise ValueError("the prompt is empty")
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
    e = engine.Engine(loaded.model, loaded.heads, policy, cache, token_budget=256, prefill_chunk=256, tokenizer=tok)
    e.add_request(prompt, engine.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                                ignore_eos=args.ignore_eos))
    return e, echo


def run(args: argparse.Namespace) -> int:
    """Stream the model's continuation; tokens that were accepted drafts are highlighted."""
    if not args.text:
        print("skvs generate: the prompt is empty", file=sys.stderr)
        return 2
    try:
        e, echo = _engine(args)
    except (ValueError, OSError) as err:
        print(f"skvs generate: {err}", file=sys.stderr)
        return 2
    if args.warmup:
        e.warmup()
    plain = args.plain or not sys.stdout.isatty()
    on, off = ("[", "]") if plain else ("\x1b[32m", "\x1b[0m")
    # One incremental detokenizer for the whole output: a character whose bytes span two steps is printed whole.
    text = e.table.tokenizer.detokenizer()
    sys.stdout.write(echo)
    steps = drafted = 0
    for _, tokens, _ in e.stream():
        steps += 1
        # All but the last token of a step were accepted drafts; the last is the model's own.
        head, tail = text.add(tokens[:-1]), text.add(tokens[-1:])
        sys.stdout.write((on + head + off if head else "") + tail)
        sys.stdout.flush()
        drafted += len(tokens) - 1
    sys.stdout.write(text.flush())
    log = e.requests[0]
    total = len(log.tokens)
    print(f"\n-- {total} tokens in {steps} steps ({total / max(steps, 1):.2f} tokens/step, {drafted} accepted drafts, "
          f"policy {e.policy.name}, finished: {log.finish_reason})")
    return 0
