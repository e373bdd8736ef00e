"""Text in and out (`serve.tokenizer`) on the byte tokenizer and on a real byte-level BPE
(`testing.text_checkpoint`): round trips, special ids from the checkpoint's files, chat templates, streaming
decode, and stop strings matched exactly on token ids."""

import json
import random
import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from reference_models import checkpoint
from skvs_jax.serve.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, byte_level_chars, load_tokenizer
from skvs_jax.testing import text_checkpoint
from skvs_jax.testing.text_checkpoint import BOS, END_OF_TEXT, EOT

TEXTS = ["Hello, world.", "", "  two  spaces\n\ttab", "wörld 😀 日本語 é", "a<|eot_id|>b"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return text_checkpoint.make_checkpoint(tmp_path_factory.mktemp("text_ckpt"))


@pytest.fixture(scope="module")
def bpe(ckpt):
    return load_tokenizer(ckpt)


@pytest.fixture(scope="module")
def tokenizers(bpe):
    return {"byte": ByteTokenizer(), "bpe": bpe}


def _json_copy(ckpt, tmp_path, **files):
    """The checkpoint's tokenizer files in tmp_path, with `files` ({name: dict, or str text, or None to drop})."""
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        shutil.copy(ckpt / name, tmp_path / name)
    for name, content in files.items():
        file = tmp_path / name.replace("__", ".")
        if content is None:
            file.unlink()
        else:
            file.write_text(content if isinstance(content, str) else json.dumps(content))
    return tmp_path


# --------------------------------------------------------------------------------------------- encode / decode


def test_both_satisfy_the_protocol(tokenizers):
    assert all(isinstance(t, Tokenizer) for t in tokenizers.values())


@pytest.mark.parametrize("text", TEXTS)
def test_round_trips(tokenizers, text):
    byte, bpe = tokenizers["byte"], tokenizers["bpe"]
    assert byte.encode(text) == list(text.encode("utf-8")) and byte.decode(byte.encode(text)) == text
    ids = bpe.encode(text)
    assert ids[0] == bpe.bos_token_id == bpe.backend.token_to_id(BOS)
    assert bpe.encode(text, add_special_tokens=False) == ids[1:]
    assert bpe.decode(ids) == text.replace(EOT, "")  # specials skipped by default
    assert bpe.decode(ids, skip_special_tokens=False) == BOS + text
    assert len(bpe.encode("wörld 😀 日本語", add_special_tokens=False)) > 3  # multi-byte characters span tokens


def test_vocabulary_and_bad_ids(tokenizers):
    bpe = tokenizers["bpe"]
    assert bpe.vocab_size == 384 and bpe.special_ids == {0, 1, 2}
    assert tokenizers["byte"].decode([0xE2, 0x82]) == "\ufffd"
    for tok in tokenizers.values():
        with pytest.raises(ValueError, match="ids must lie in"):
            tok.decode([tok.vocab_size])
        with pytest.raises(TypeError, match="text must be a str"):
            tok.encode(b"bytes")


def test_same_ids_as_transformers(ckpt, bpe):
    transformers = pytest.importorskip("transformers")
    by_file = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ckpt / "tokenizer.json"))
    by_folder = transformers.PreTrainedTokenizerFast.from_pretrained(str(ckpt))
    for text in TEXTS:
        assert bpe.encode(text) == by_file(text)["input_ids"] == by_folder(text)["input_ids"]
    messages = [{"role": "user", "content": "Hi"}]
    assert by_folder.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        bpe.apply_chat_template(messages)


# ------------------------------------------------------------------------------------------- the checkpoint files


def test_special_ids_from_the_three_files(ckpt, tmp_path):
    end, eot = 1, 2
    assert load_tokenizer(ckpt).eos_token_ids == (end, eot)  # generation_config [1, 2], config 1, eos_token 2
    folder = _json_copy(ckpt, tmp_path, generation_config__json=None, config__json={"eos_token_id": [7, end]})
    tok = load_tokenizer(folder)
    assert tok.eos_token_ids == (7, end, eot) and tok.bos_token_id == 0
    folder = _json_copy(ckpt, tmp_path, generation_config__json={"eos_token_id": 9, "bos_token_id": 5},
                        config__json=None,
                        tokenizer_config__json={"eos_token": {"content": END_OF_TEXT, "special": True}})
    tok = load_tokenizer(folder)
    assert tok.eos_token_ids == (9, end) and tok.bos_token_id == 5 and tok.chat_template is None
    assert tok.encode("a") == [0, tok.encode("a", add_special_tokens=False)[0]]  # the post-processor's BOS
    folder = _json_copy(ckpt, tmp_path, tokenizer_config__json={"bos_token": BOS, "add_bos_token": False,
                                                                "added_tokens_decoder": {"70": {"special": True}}})
    tok = load_tokenizer(folder)
    assert tok.encode("a") == tok.encode("a", add_special_tokens=False)  # transformers' rule: the flag wins
    assert 70 in tok.special_ids and tok.decode([70, 71]) == tok.decode([71])


@pytest.mark.parametrize("name, content, match", [
    ("tokenizer_config.json", "{", "tokenizer_config.json: not valid JSON"),
    ("tokenizer_config.json", "[1]", "tokenizer_config.json: expected a JSON object"),
    ("tokenizer_config.json", {"eos_token": 3}, "tokenizer_config.json: eos_token must be"),
    ("tokenizer_config.json", {"eos_token": "<nope>"}, "tokenizer_config.json: eos_token '<nope>' is not in"),
    ("tokenizer_config.json", {"add_bos_token": "yes"}, "tokenizer_config.json: add_bos_token must be"),
    ("tokenizer_config.json", {"chat_template": 3}, "tokenizer_config.json: chat_template must be"),
    ("generation_config.json", {"eos_token_id": "2"}, "generation_config.json: eos_token_id must be"),
    ("config.json", {"eos_token_id": [1, True]}, "config.json: eos_token_id must be"),
    ("tokenizer.json", "{}", "tokenizer.json: not a readable tokenizers file"),
])
def test_a_malformed_file_is_named(ckpt, tmp_path, name, content, match):
    folder = _json_copy(ckpt, tmp_path, **{name.replace(".", "__"): content})
    with pytest.raises(ValueError, match=match):
        load_tokenizer(folder)


def test_no_tokenizer_file(ckpt, tmp_path):
    assert load_tokenizer(tmp_path) is None
    with pytest.raises(ValueError, match="is not a directory"):
        load_tokenizer(tmp_path / "missing")


def test_the_checkpoint(ckpt, tmp_path):
    assert checkpoint.medusa_base_model(ckpt / "medusa") == ckpt.resolve()
    model, heads = checkpoint.load_llama(ckpt), checkpoint.load_medusa(ckpt / "medusa")
    assert model.config.vocab_size == heads.config.vocab_size == 384 and heads.config.num_heads == 2
    assert json.loads((ckpt / "config.json").read_text())["eos_token_id"] == 1
    again = text_checkpoint.make_checkpoint(tmp_path)  # same seed: same files
    for name in ("tokenizer.json", "model.safetensors", "medusa/medusa_lm_head.safetensors"):
        assert (again / name).read_bytes() == (ckpt / name).read_bytes(), name


# ------------------------------------------------------------------------------------------------ chat templates


def test_chat_template(bpe):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi \n"}]
    want = f"{BOS}### system\n\nBe brief.{EOT}### user\n\nHi{EOT}"
    assert bpe.apply_chat_template(messages) == want + "### assistant\n\n"
    assert bpe.apply_chat_template(messages, add_generation_prompt=False) == want
    with pytest.raises(ValueError, match="chat template: unknown role tool"):
        bpe.apply_chat_template([{"role": "tool", "content": "x"}])


def test_named_templates_and_globals(ckpt, tmp_path):
    default = ("{{ eos_token }}{{ messages | tojson }}\n    {% if strftime_now('%Y') %}\n"
               "{{ add_generation_prompt }}{% endif %}")
    templates = [{"name": "tool_use", "template": "no"}, {"name": "default", "template": default}]
    tok = load_tokenizer(_json_copy(ckpt, tmp_path, tokenizer_config__json={"eos_token": EOT,
                                                                             "chat_template": templates}))
    # jinja2's own tojson would escape "<"; lstrip_blocks / trim_blocks drop the spaces before and the newline after
    # a block tag
    assert tok.apply_chat_template([{"role": "user", "content": "<é>"}]) == \
        EOT + '[{"role": "user", "content": "<é>"}]\nTrue'


def test_a_missing_template_is_an_error(ckpt, tmp_path):
    tok = load_tokenizer(_json_copy(ckpt, tmp_path, tokenizer_config__json={}))
    for t in (tok, ByteTokenizer()):
        with pytest.raises(ValueError, match="no chat template"):
            t.apply_chat_template([{"role": "user", "content": "Hi"}])


# ------------------------------------------------------------------------------------------------ streaming decode


@pytest.mark.parametrize("which", ["byte", "bpe"])
@given(data=st.data())
def test_streamed_text_is_the_decode(tokenizers, which, data):
    """Deltas concatenate to `decode(all ids)`; the text so far is always a prefix of it (no partial character),
    however the ids are cut into steps, also through multi-byte characters."""
    tok = tokenizers[which]
    ids = data.draw(st.one_of(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40),
                              st.text(max_size=12).map(lambda s: tok.encode(s, add_special_tokens=False))))
    skip = data.draw(st.booleans())
    final = tok.decode(ids, skip_special_tokens=skip)
    stream, deltas, start = tok.detokenizer(skip), [], 0
    while start < len(ids):
        step = data.draw(st.integers(1, 4))
        deltas.append(stream.add(ids[start:start + step]))
        start += step
        assert final.startswith(stream.text)
    deltas.append(stream.flush())
    assert "".join(deltas) == stream.text == final


@given(ids=st.lists(st.integers(0, 383), max_size=30))
def test_token_bytes_concatenate_to_the_decode(bpe, ids):
    """What exact_stop reasons on: decoded text is the lossy UTF-8 decode of the tokens' bytes, concatenated."""
    joined = b"".join(bpe.token_bytes[i] for i in ids).decode("utf-8", errors="replace")
    assert bpe.decode(ids, skip_special_tokens=False) == joined
    assert set(byte_level_chars()) == set(pre_tokenizers.ByteLevel.alphabet())


# ----------------------------------------------------------------------------------------------------- exact stops


def test_exact_stop_of_bytes():
    byte = ByteTokenizer()
    assert byte.exact_stop("é!") == (0xC3, 0xA9, 0x21)
    assert byte.exact_stop("a\ufffd") is None  # the text shows U+FFFD for any invalid byte too
    with pytest.raises(ValueError, match="stop must be a non-empty string"):
        byte.exact_stop("")


def test_a_stop_spelled_two_ways_is_not_exact(bpe):
    one_way = bpe.encode("the", add_special_tokens=False)
    other = [bpe.backend.token_to_id(c) for c in "the"]
    assert one_way != other and bpe.decode(one_way) == bpe.decode(other) == "the"
    assert bpe.exact_stop("the") is None and bpe.exact_stop(" ") is None


def test_a_special_tokens_stop(bpe):
    assert bpe.exact_stop(EOT) is None  # the full byte alphabet spells "<|eot_id|>" too
    backend = Backend(models.BPE())
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    backend.train_from_iterator(["hello world"] * 4, trainers.BpeTrainer(vocab_size=20, special_tokens=[EOT],
                                                                         show_progress=False))
    small = HFTokenizer(backend)
    assert small.exact_stop(EOT) == (backend.token_to_id(EOT),)  # nothing else spells it: no "<" in the vocab
    backend.decoder = decoders.Metaspace()
    assert HFTokenizer(backend).exact_stop("o") is None  # bytes of tokens unknown: None is always safe


def _occurrences(text, stop):
    return sum(text.startswith(stop, i) for i in range(len(text)))


@pytest.mark.parametrize("stop", ["\n", "\n\n", ".", "::", "é"])
@pytest.mark.parametrize("with_specials", [False, True])
def test_exact_stops_never_miss(bpe, stop, with_specials):
    """Brute force: in random id sequences built from the tokens near the stop, the text gains an occurrence of
    the stop exactly at the steps where the ids end with its exact sequence. Special tokens only where decode
    keeps their text (between a stop's tokens, a skipped one hides the join from the ids: documented)."""
    seq = bpe.exact_stop(stop)
    assert seq is not None
    near = [i for i, b in bpe.token_bytes.items() if set(b) & set(stop.encode())
            and (with_specials or i not in bpe.special_ids)]
    ordinary = [i for i in range(bpe.vocab_size) if with_specials or i not in bpe.special_ids]
    rng = random.Random(0)
    pool = near + rng.sample(ordinary, len(near))
    hits = 0
    for _ in range(150):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 10))]
        where = rng.randint(0, len(ids))
        ids[where:where] = seq if rng.random() < 0.5 else []
        before = 0
        for n in range(1, len(ids) + 1):
            now = _occurrences(bpe.decode(ids[:n], skip_special_tokens=not with_specials), stop)
            ends_with = tuple(ids[max(0, n - len(seq)):n]) == seq
            assert now - before == ends_with, (ids[:n], seq)
            hits, before = hits + ends_with, now
    assert hits > 50


def test_the_shipped_models_tokenizer_json_is_the_byte_tokenizer(tmp_path):
    """`text_checkpoint.shipped_checkpoint`'s tokenizer.json encodes and decodes as `ByteTokenizer` (ids = bytes),
    through our loader and through transformers, so HF tools count the shipped model's tokens exactly."""
    folder = text_checkpoint.shipped_checkpoint(tmp_path / "shipped")
    tok, ref = load_tokenizer(folder), ByteTokenizer()
    for text in ["Return the number of ", "héllo wörld ✓\n\n  x", "".join(map(chr, range(1, 600, 7)))]:
        assert tok.encode(text) == ref.encode(text) and tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 256 and tok.eos_token_ids == () and tok.exact_stop("\n\n") == (10, 10)
    transformers = pytest.importorskip("transformers")
    assert transformers.AutoTokenizer.from_pretrained(str(folder))("héllo ✓")["input_ids"] == ref.encode("héllo ✓")
