"""Text in and out: the shipped model's byte tokenizer, a checkpoint's Hugging Face tokenizer, streaming decode.

Both tokenizers satisfy one `Tokenizer` protocol, so `skvs_jax.LLM` and `skvs generate` serve either the same way:
`encode` / `decode`, the EOS and BOS ids, `apply_chat_template` (jinja2, sandboxed, as transformers renders it),
an `IncrementalDetokenizer` for streaming (vLLM's prefix / read offsets) and `exact_stop`, which says when a stop
string can be matched on token ids on the device instead of on text on the host.

`load_tokenizer(model_dir)` reads a checkpoint folder as transformers does: `tokenizer.json` (the `tokenizers`
library runs it), `tokenizer_config.json` (special tokens, add_bos_token, the chat template), and the EOS ids of
`generation_config.json` and `config.json`.
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, processors


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine's text front end needs of a tokenizer.

    vocab_size: ids it can produce (1 + the largest id, added tokens included); eos_token_ids: ids that end a
    generation (may be empty); special_ids: ids that `decode(..., skip_special_tokens=True)` leaves out.
    A chat prompt is `encode(apply_chat_template(messages), add_special_tokens=False)`: the template already holds
    BOS (HF's convention), so encoding it with special tokens would add a second one.
    """

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    chat_template: str | None
    special_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...
    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer: ...
    def exact_stop(self, stop: str) -> tuple[int, ...] | None: ...


def _check_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    out = [int(i) for i in ids]
    if out and not 0 <= min(out) <= max(out) < vocab_size:
        raise ValueError(f"ids must lie in [0, {vocab_size}), got one of {min(out)}..{max(out)}")
    return out


def _check_stop(stop: str) -> None:
    if not isinstance(stop, str) or not stop:
        raise ValueError(f"stop must be a non-empty string, got {stop!r}")


class ByteTokenizer:
    """The shipped tiny model's tokenizer: one token per UTF-8 byte (V = 256); no special tokens, EOS or template."""

    vocab_size = 256
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id = None
    chat_template = None
    special_ids: frozenset[int] = frozenset()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(_check_ids(ids, 256)).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        raise ValueError("ByteTokenizer has no chat template (the shipped model is trained on plain text): "
                         "give a prompt, not messages")

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)

    def exact_stop(self, stop: str) -> tuple[int, ...] | None:
        """The stop's UTF-8 bytes (see `HFTokenizer.exact_stop`); None for a stop holding U+FFFD, which the text
        shows for any invalid byte too."""
        _check_stop(stop)
        return None if "\ufffd" in stop else tuple(stop.encode("utf-8"))


class IncrementalDetokenizer:
    """Streaming decode as vLLM and TGI do it: each `add` re-decodes a short window of ids (from `prefix_offset`)
    and releases only the text past the window's already-released part (`read_offset`), holding it back while
    the decode ends in U+FFFD (a character whose bytes have not all arrived).

    Invariant: `text` (all released deltas) is a prefix of `tokenizer.decode(ids)`; after `flush()` it equals it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # the window starts here: context for decoders whose output depends on it
        self.read_offset = 0  # text of ids[:read_offset] has been released
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, ids: Sequence[int]) -> str:
        """Append `ids`; return the newly complete text (possibly "")."""
        self.ids.extend(int(i) for i in ids)
        return self._release(final=False)

    def flush(self) -> str:
        """The held-back rest, at the end of a sequence (an unfinished character comes out as U+FFFD)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd")):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


# ------------------------------------------------------------------------------------------------ chat templates


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    # transformers' override: jinja2's own tojson HTML-escapes <, >, & and ', which templates do not expect
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env.from_string(template)


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         **special_tokens: str | None) -> str:
    """Render an HF chat template over `messages` ([{"role": str, "content": ...}, ...]) with transformers'
    globals; `special_tokens` (bos_token=..., eos_token=...) that are None are left undefined, as in HF.
    A template's `raise_exception` or syntax error raises ValueError."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    tokens = {k: v for k, v in special_tokens.items() if v is not None}
    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **tokens)
    except jinja2.exceptions.TemplateError as err:
        raise ValueError(f"chat template: {err}") from err


# ------------------------------------------------------------------------------------- Hugging Face tokenizers


@functools.cache
def byte_level_chars() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode`, inverted: the character byte-level BPE writes for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(rest)}


def _read_json(file: pathlib.Path) -> dict | None:
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any, file: pathlib.Path, key: str) -> str | None:
    """A tokenizer_config special token: a string, or an AddedToken dict {"content": str, ...}, or null."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{file}: {key} must be a string or {{'content': string}}, got {value!r}")
    return value


def _config_ids(value: Any, file: pathlib.Path, key: str) -> list[int]:
    """An id field of config.json / generation_config.json: null, an int or a list of ints."""
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{file}: {key} must be an int >= 0 or a list of them, got {value!r}")
    return values


def _chat_template(config: dict, file: pathlib.Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates [{"name": ..., "template": ...}]: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{file}: chat_template must be a string or a list of {{name, template}}, got {template!r}")
    return template


class HFTokenizer:
    """A checkpoint's Hugging Face tokenizer (`tokenizer.json`, run by the `tokenizers` library) with what
    tokenizer_config.json, generation_config.json and config.json say about it. Build with `load_tokenizer`.

    Special tokens are the added tokens flagged special in tokenizer.json or in tokenizer_config's
    added_tokens_decoder. `encode` runs tokenizer.json's post-processor; when tokenizer_config sets add_bos_token
    or add_eos_token, that post-processor is replaced by one adding BOS / EOS accordingly, as transformers does.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, eos_token_ids: Sequence[int] = (),
                 bos_token: str | None = None, eos_token: str | None = None, bos_token_id: int | None = None,
                 chat_template: str | None = None, special_ids: frozenset[int] = frozenset()):
        self.backend = backend
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = 1 + max(vocab.values())
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token, self.eos_token, self.bos_token_id = bos_token, eos_token, bos_token_id
        self.chat_template = chat_template
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(special_ids) | {i for i, t in added.items() if t.special}
        self._stops: dict[str, tuple[int, ...] | None] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = _check_ids(ids, self.vocab_size)
        if skip_special_tokens:  # ourselves: special_ids also holds tokenizer_config's flags, unknown to backend
            ids = [i for i in ids if i not in self.special_ids]
        return self.backend.decode(ids, skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat prompt as text; encode it with add_special_tokens=False (it already holds BOS)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json sets no chat_template): "
                             "give a prompt, not messages")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)

    @functools.cached_property
    def token_bytes(self) -> dict[int, bytes] | None:
        """id -> the bytes its decode contributes (added tokens: their content; byte-level BPE tokens: their
        characters through `byte_level_chars`); None when that is not known for every id (another decoder, a
        character outside the byte-level alphabet, an empty token)."""
        if not isinstance(self.backend.decoder, decoders.ByteLevel):
            return None  # e.g. SentencePiece's Metaspace: its decode strips a leading space, not a concatenation
        table = {i: t.content.encode("utf-8") for i, t in self.backend.get_added_tokens_decoder().items()}
        chars = byte_level_chars()
        for token, i in self.backend.get_vocab(with_added_tokens=False).items():
            if i not in table:
                if any(c not in chars for c in token):
                    return None
                table[i] = bytes(chars[c] for c in token)
        return None if b"" in table.values() else table

    def exact_stop(self, stop: str) -> tuple[int, ...] | None:
        """The token ids that `stop` corresponds to exactly, or None (then match it on text, on the host).

        Exactly: whenever decoded output text contains `stop`, the output's ids end, at that point, with this
        sequence, so a suffix match on the emitted ids finds every occurrence that the text would, and no other.
        In BPE the same text can be spelled by several token sequences ("the" as `the`, `th e`, `t he`, and
        " the" may be one token): matching one spelling on ids would miss the others. So the stop's bytes must
        have exactly one segmentation into tokens' byte strings, and no token may cross either end of it (hold
        it as a proper part, begin inside it and run past its end, or begin before it and end inside it): then
        every occurrence begins and ends on token boundaries and is spelled by that one sequence.

        Every id counts, special tokens too (their text appears with skip_special_tokens=False). A stop equal to
        a special token's content is that one id only if no other token sequence spells it; with a full
        byte-level alphabet one always does, so None. decode skips special tokens by default, so their text
        never appears in the output text: there, the one case the id match misses is a special token emitted
        between the tokens that spell the stop (the text drops it; the ids keep it).
        None too when a token's bytes are not known (`token_bytes`) or the stop holds U+FFFD.
        """
        _check_stop(stop)
        if stop not in self._stops:
            if len(self._stops) >= 4096:  # stops come with requests: bound the cache
                self._stops.clear()
            table = self.token_bytes
            exact = None if table is None or "\ufffd" in stop else _unique_isolated_spelling(stop.encode(), table)
            self._stops[stop] = exact
        return self._stops[stop]


def _unique_isolated_spelling(stop: bytes, table: dict[int, bytes]) -> tuple[int, ...] | None:
    """The one segmentation of `stop` into table's byte strings, if it has exactly one and no token crosses its
    ends (see `HFTokenizer.exact_stop`); else None. O(V * len(stop)) once per stop string."""
    n = len(stop)
    prefixes, suffixes = {stop[:k] for k in range(1, n)}, {stop[n - j:] for j in range(1, n)}
    for t in table.values():
        m = len(t)
        if m > n and stop in t:
            return None
        if any(t[m - k:] in prefixes for k in range(1, min(m, n))):  # begins before the stop, ends inside it
            return None
        if any(t[:j] in suffixes for j in range(1, min(m, n))):  # begins inside the stop, runs past its end
            return None
    by_bytes: dict[bytes, list[int]] = {}
    for i, t in table.items():
        if t in stop:
            by_bytes.setdefault(t, []).append(i)
    # ways[e]: number of segmentations of stop[:e] (capped at 2), last[e]: the last token of one of them
    ways, last = [1] + [0] * n, [(0, 0)] * (n + 1)
    for e in range(1, n + 1):
        for s in range(e):
            ids = by_bytes.get(stop[s:e], ())
            if ways[s] and ids:
                ways[e] = min(2, ways[e] + ways[s] * len(ids))
                last[e] = (s, ids[0])
    if ways[n] != 1:
        return None
    spelling, e = [], n
    while e:
        e, i = last[e]
        spelling.append(i)
    return tuple(reversed(spelling))


def load_tokenizer(model_dir: str | pathlib.Path) -> HFTokenizer | None:
    """The tokenizer of an HF checkpoint folder, or None when it has no tokenizer.json.

    EOS ids are the union, in order, of generation_config.json's eos_token_id, config.json's (an int or a list)
    and tokenizer_config.json's eos_token; BOS is tokenizer_config's bos_token, else the configs' bos_token_id.
    A malformed file raises ValueError naming it.
    """
    model_dir = pathlib.Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model_dir {str(model_dir)!r} is not a directory")
    file = model_dir / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as err:  # the library raises a bare Exception that does not name the file
        raise ValueError(f"{file}: not a readable tokenizers file: {err}") from None
    config_file, gen_file, model_file = (model_dir / n for n in ("tokenizer_config.json", "generation_config.json",
                                                                 "config.json"))
    config, gen, model = (_read_json(f) or {} for f in (config_file, gen_file, model_file))

    def token_id(key: str) -> tuple[str | None, int | None]:
        text = _token_text(config.get(key), config_file, key)
        if text is None:
            return None, None
        if (i := backend.token_to_id(text)) is None:
            raise ValueError(f"{config_file}: {key} {text!r} is not in {file.name}'s vocabulary")
        return text, i

    bos_token, bos_id = token_id("bos_token")
    eos_token, eos_id = token_id("eos_token")
    if bos_id is None:
        bos_ids = _config_ids(gen.get("bos_token_id"), gen_file, "bos_token_id") or _config_ids(
            model.get("bos_token_id"), model_file, "bos_token_id")
        bos_id = bos_ids[0] if bos_ids else None
    eos = [*_config_ids(gen.get("eos_token_id"), gen_file, "eos_token_id"),
           *_config_ids(model.get("eos_token_id"), model_file, "eos_token_id"), *([] if eos_id is None else [eos_id])]
    flags = {}
    for key in ("add_bos_token", "add_eos_token"):
        if key in config:
            if not isinstance(config[key], bool):
                raise ValueError(f"{config_file}: {key} must be true or false, got {config[key]!r}")
            flags[key] = config[key]
    if flags:  # transformers rebuilds the post-processor from these flags when tokenizer_config sets either
        single = " ".join([f"{bos_token}:0"] * bool(flags.get("add_bos_token") and bos_token) + ["$A:0"]
                          + [f"{eos_token}:0"] * bool(flags.get("add_eos_token") and eos_token))
        specials = [(t, i) for t, i, on in ((bos_token, bos_id, flags.get("add_bos_token")),
                                            (eos_token, eos_id, flags.get("add_eos_token"))) if on and t]
        backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise ValueError(f"{config_file}: added_tokens_decoder must be an object, got {type(decoder).__name__}")
    try:
        special = frozenset(int(i) for i, t in decoder.items() if isinstance(t, dict) and t.get("special"))
    except ValueError:
        raise ValueError(f"{config_file}: added_tokens_decoder's keys must be token ids") from None
    template_file = model_dir / "chat_template.jinja"  # transformers >= 4.43 saves the template apart
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else _chat_template(
        config, config_file)
    return HFTokenizer(backend, eos_token_ids=tuple(dict.fromkeys(eos)), bos_token=bos_token, eos_token=eos_token,
                       bos_token_id=bos_id, chat_template=template, special_ids=special)
