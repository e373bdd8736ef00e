"""A small Hugging Face-style checkpoint with a real byte-level BPE tokenizer, made here (nothing downloaded).

For the tests and docs of text serving (`skvs_jax.LLM`, `skvs generate`): the shipped model reads bytes, so it
never exercises a real tokenizer's BOS, EOS ids, chat template, multi-byte tokens or stop strings spelled several
ways. The weights are random, so the text is gibberish, but the token-level behaviour is real.

Layout of `make_checkpoint(directory)`:
  tokenizer.json           a byte-level BPE trained on the shipped corpus; its post-processor prepends BOS
  tokenizer_config.json    bos_token, eos_token "<|eot_id|>", add_bos_token, a small Llama-3-like chat template
  generation_config.json   eos_token_id [<|end_of_text|>, <|eot_id|>]
  config.json, model.safetensors   a random tiny Llama over that vocabulary (`reference_models.checkpoint`)
  medusa/                  random Medusa heads whose base_model_name_or_path resolves to `directory`
"""

from __future__ import annotations

import json
import pathlib

import jax
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from reference_models import checkpoint, corpus
from reference_models.llama import Llama, LlamaConfig
from reference_models.medusa import MedusaConfig, MedusaHeads

BOS, END_OF_TEXT, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
TRAINING_DOCUMENTS = 300  # of the shipped corpus: enough for a few hundred merges, trained in well under a second

# Llama 3's shape (BOS, a header per message, <|eot_id|> after each, the assistant's header to generate after),
# with plain-text headers: this vocabulary has no header tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '### ' + message['role'] + '\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant\\n\\n' }}{% endif %}"
)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` ids (the three special tokens first: ids 0, 1, 2), prepending BOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[BOS, END_OF_TEXT, EOT], show_progress=False)
    tok.train_from_iterator(corpus.load_documents()[:TRAINING_DOCUMENTS], trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
                                                       special_tokens=[(BOS, bos)])
    return tok


def _random_heads(hidden_size: int, vocab_size: int, num_heads: int, seed: int) -> MedusaHeads:
    heads = MedusaHeads(MedusaConfig(hidden_size=hidden_size, vocab_size=vocab_size, num_heads=num_heads))
    shapes = checkpoint.param_dict(heads)
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    checkpoint.assign_params(heads, {name: 0.02 * jax.random.normal(k, v.shape) for k, (name, v) in
                                     zip(keys, sorted(shapes.items()))}, source="random Medusa heads")
    return heads


def _update_json(file: pathlib.Path, **fields) -> None:
    file.write_text(json.dumps(json.loads(file.read_text()) | fields, indent=2) + "\n")


def make_checkpoint(directory: str | pathlib.Path, *, vocab_size: int = 384, seed: int = 0,
                    num_heads: int = 2) -> pathlib.Path:
    """Write the checkpoint into `directory` (created if needed) and return it; the same seed gives the same
    tokenizer and weights. `vocab_size` must exceed 259 (256 bytes and 3 special tokens), num_heads >= 1."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 260:
        raise ValueError(f"vocab_size must be an int >= 260 (256 bytes, 3 special tokens, a merge), got {vocab_size!r}")
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size)
    tok.save(str(directory / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in (BOS, END_OF_TEXT, EOT)}
    tokenizer_config = {"bos_token": BOS, "eos_token": EOT, "add_bos_token": True, "add_eos_token": False,
                        "chat_template": CHAT_TEMPLATE, "model_max_length": 512,
                        "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    generation = {"bos_token_id": ids[BOS], "eos_token_id": [ids[END_OF_TEXT], ids[EOT]]}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    config = LlamaConfig(vocab_size=tok.get_vocab_size(with_added_tokens=True), hidden_size=64,
                         intermediate_size=176, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=512)
    model = Llama(config, rngs=nnx.Rngs(seed))
    checkpoint.save_llama(model, directory)
    # LlamaConfig has no token ids; transformers (and load_tokenizer) read them from config.json
    _update_json(directory / "config.json", bos_token_id=ids[BOS], eos_token_id=ids[END_OF_TEXT])
    heads = _random_heads(config.hidden_size, config.vocab_size, num_heads, seed + 1)
    # medusa_base_model tries a relative name against the working directory first: an absolute path cannot
    # resolve to some other folder that happens to hold a config.json
    checkpoint.save_medusa(heads, directory / "medusa", base_model=str(directory.resolve()))
    return directory


def byte_tokenizer() -> Tokenizer:
    """A tokenizer.json for the shipped byte-level model: id = byte value (no merges, no special tokens), so HF
    tools (transformers' AutoTokenizer, a load generator) count and encode exactly what `ByteTokenizer` does."""
    from skvs_jax.serve.tokenizer import byte_level_chars

    vocab = {char: byte for char, byte in byte_level_chars().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def shipped_checkpoint(directory: str | pathlib.Path) -> pathlib.Path:
    """The shipped tiny Llama and its Medusa heads (in `directory/medusa`) saved as a Hugging Face folder with
    `byte_tokenizer()`'s tokenizer.json: the shipped model for tools that need a tokenizer file (`skvs serve
    --model DIR` under a load generator)."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model, heads = checkpoint.load_shipped()
    checkpoint.save_llama(model, directory)
    checkpoint.save_medusa(heads, directory / "medusa", base_model=str(directory.resolve()))
    byte_tokenizer().save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
              "model_max_length": model.config.max_position_embeddings}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
