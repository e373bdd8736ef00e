"""The model a command serves: `--model DIR` (a Hugging Face Llama directory) and `--medusa DIR_OR_FILE` (Medusa
heads), or the shipped tiny Llama and its heads when neither is given; shared by `skvs generate` and `skvs bench`.

A Medusa checkpoint alone brings its base model when its config.json's `base_model_name_or_path` is a local
directory (`reference_models.checkpoint.medusa_base_model`). Prompts stay bytes (token = byte), so the model's
vocabulary must hold 256 tokens; a checkpoint's own tokenizer is not used. The draft length defaults to the
heads' count, and the longest sequence to the model's `max_position_embeddings`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

from reference_models import checkpoint
from reference_models.llama import Llama
from reference_models.medusa import MedusaHeads

BYTE_VOCAB = 256  # prompts are bytes


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What a command serves, and how to name it in its report."""

    model: Llama
    heads: MedusaHeads | None  # None: --model without --medusa (only non-speculating policies run)
    name: str  # "shipped tiny Llama + Medusa", or the directories

    @property
    def num_heads(self) -> int:
        return 0 if self.heads is None else self.heads.config.num_heads

    @property
    def max_positions(self) -> int:
        return self.model.config.max_position_embeddings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="a Hugging Face Llama checkpoint directory (config.json + safetensors); default: the "
                             "shipped tiny Llama, or the base model the --medusa config names")
    parser.add_argument("--medusa", metavar="DIR_OR_FILE", default=None,
                        help="Medusa heads: a directory (config.json + medusa_lm_head.safetensors) or the "
                             "safetensors file; default: the shipped heads when --model is not given either")


def load(args: argparse.Namespace) -> Loaded:
    """The model and heads `args.model` / `args.medusa` name. Raises ValueError (or OSError for a missing file)
    with a message that names the flag."""
    if args.model is None and args.medusa is None:
        model, heads = checkpoint.load_shipped()
        return Loaded(model, heads, "shipped tiny Llama + Medusa")
    heads = None
    model_dir = args.model
    if args.medusa is not None:
        heads = checkpoint.load_medusa(args.medusa)
        if model_dir is None:
            model_dir = checkpoint.medusa_base_model(args.medusa)
            if model_dir is None:
                raise ValueError(f"--medusa {args.medusa}: its config names no base model "
                                 "(base_model_name_or_path); pass --model DIR")
    if not pathlib.Path(model_dir).is_dir():
        raise ValueError(f"--model {model_dir}: not a directory")
    model = checkpoint.load_llama(model_dir)
    cfg = model.config
    if cfg.vocab_size < BYTE_VOCAB:
        raise ValueError(f"--model {model_dir}: its vocabulary has {cfg.vocab_size} tokens; prompts are bytes, "
                         f"which need {BYTE_VOCAB}")
    if heads is not None and (heads.config.hidden_size, heads.config.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
        raise ValueError(f"--medusa {args.medusa}: heads for hidden size {heads.config.hidden_size} and vocabulary "
                         f"{heads.config.vocab_size}, but the model has {cfg.hidden_size} and {cfg.vocab_size}")
    name = f"{model_dir}" + ("" if heads is None else f" + Medusa {args.medusa} ({heads.config.num_heads} heads)")
    return Loaded(model, heads, name)


def draft_len(args: argparse.Namespace, loaded: Loaded, default_without_heads: int = 4) -> int:
    """--draft-len, or by default the heads' count (every head drafts)."""
    if args.draft_len is not None:
        return args.draft_len
    return loaded.num_heads or default_without_heads


def check_speculation(policy, loaded: Loaded, flag: str = "--policy") -> None:
    """A speculating policy needs heads: say so by the flags, before an engine refuses it."""
    if policy.speculation and loaded.heads is None:
        raise ValueError(f"{flag} {policy.name} speculates, which needs Medusa heads: pass --medusa DIR_OR_FILE "
                         "(or serve vllm_default only)")
