"""Text to token ids and back, for the embedded engine.

``load_tokenizer(path)`` reads the vocabulary from where the model keeps it:

* a Hugging Face model directory: ``tokenizer.json`` through the ``tokenizers`` library, or
  ``tiktoken.model`` (Kimi K2 and its relatives ship no tokenizer.json, only a tiktoken rank
  file and remote code we never run); special tokens and chat templates from
  ``tokenizer_config.json``, ``chat_template.jinja``, ``additional_chat_templates/`` and
  ``chat_template.json`` (the order transformers reads them in); end-of-sequence ids from
  ``generation_config.json``, where ``eos_token_id`` may be a list.
* a GGUF file: the vocabulary in its metadata (``tokenizer.ggml.*``) rebuilt as an equivalent
  ``tokenizers.Tokenizer``: byte-level BPE with the GGUF's merges and the pre-tokenizer its
  ``tokenizer.ggml.pre`` names ("gpt2" models), or SentencePiece-style BPE with byte fallback
  ("llama" models). The regexes are the ones the original tokenizer.json files use; llama.cpp
  carries hand-adapted copies of the same expressions (see ``BPE_PRE_TOKENIZERS``).

The result is one ``Tokenizer`` whatever the source, plus ``IncrementalDetokenizer`` for
streaming text out one token at a time.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from hybridmoe.backend.errors import ModelError, UnsupportedModelError
from hybridmoe.backend.models.model_files import is_gguf_file, resolve_model_files

# A GGUF's key/values come from the project's one GGUF reader; ``read_gguf_metadata`` is the
# name this module has always offered for it.
from hybridmoe.backend.models.gguf_reader import read_metadata as read_gguf_metadata

# Token types stored in tokenizer.ggml.token_type (llama.cpp's llama_token_type).
GGUF_NORMAL, GGUF_UNKNOWN, GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_UNUSED, GGUF_BYTE = 1, 2, 3, 4, 5, 6

# Tokens that end a turn although the model's config may not list them as eos: the texts
# llama.cpp matches (llama-vocab.cpp, special_eog_ids) that chat models use. Only added
# tokens are matched, never plain vocabulary entries (Qwen's vocabulary has an ordinary "</s>").
_END_OF_TURN_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",
        "<end_of_turn>", "<|endoftext|>", "<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
        "<｜end▁of▁sentence｜>",
    }
)

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class Tokenizer:
    """One vocabulary, whatever file it came from.

    ``encode`` always recognises added and special tokens written out in the text (as the
    ``tokenizers`` library and llama.cpp with ``parse_special`` do), because rendered chat
    templates carry them as text. ``decode`` is the library's decode; for streaming use
    ``detokenizer()``.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        source: str,
        bos_id: int | None,
        eos_ids: Iterable[int],
        add_bos: bool,
        add_eos: bool = False,
        extra_stop_ids: Iterable[int] = (),
        special_tokens: Mapping[str, str] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        chat_template_origins: Mapping[str, str] | None = None,
        vocab_size: int | None = None,
    ):
        self.backend = backend
        self.source = source
        added = backend.get_added_tokens_decoder()
        # One past the largest id (a GGUF knows it exactly; ids can have unused gaps).
        if vocab_size is None:
            vocab_size = max([backend.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added)])
        self.vocab_size: int = vocab_size
        self.added_tokens: dict[str, int] = {t.content: i for i, t in added.items()}
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.bos_id = bos_id
        self.add_bos = bool(add_bos and bos_id is not None)
        eos_list = [i for i in eos_ids if i is not None]
        self.eos_id: int | None = eos_list[0] if eos_list else None  # the one to append, if any
        self.eos_ids: frozenset[int] = frozenset(eos_list)
        self.add_eos = bool(add_eos and self.eos_ids)
        self.stop_ids: frozenset[int] = _stop_ids(self.eos_ids, extra_stop_ids, self.added_tokens)
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self.chat_template_origins: dict[str, str] = dict(chat_template_origins or {})
        # Byte-fallback tokens (<0xE4>) decode differently depending on their neighbours (a
        # run of them forms one UTF-8 sequence), so the streaming detokenizer needs to know them.
        self.byte_fallback_ids: frozenset[int] = frozenset()
        if getattr(backend.model, "byte_fallback", False):
            ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
            self.byte_fallback_ids = frozenset(i for i in ids if i is not None)

    # -- text <-> ids -----------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of ``text``; with ``add_special`` the model's BOS (and EOS, for the rare
        model that wants one) as its tokenizer config asks."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special:
            if self.add_bos:
                ids.insert(0, self.bos_id)  # type: ignore[arg-type]
            if self.add_eos:
                ids.append(self.eos_id)  # type: ignore[arg-type]
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a rendered chat prompt: BOS exactly once.

        Many chat templates write ``{{ bos_token }}`` themselves (DeepSeek, Mixtral) and
        transformers then encodes without special tokens; others leave BOS to the tokenizer.
        Adding it only when the model wants one and the text did not bring it covers both.
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)  # type: ignore[arg-type]
        return ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of ``text``, from its length alone: no token covers more
        bytes than its spelling takes (a byte-level letter stands for one byte, SentencePiece's
        ▁ for one space), and the normalizers that keep every character shrink a text at most
        from 4 bytes a character to 1. 0 when a normalizer may drop characters (collapsing
        whitespace, say), where length proves nothing."""
        per_token = self._max_bytes_per_token
        return len(text.encode("utf-8", "surrogatepass")) // per_token if per_token else 0

    @cached_property
    def _max_bytes_per_token(self) -> int | None:
        normalizer = json.loads(self.backend.to_str()).get("normalizer")
        shrink = _normalizer_shrink(normalizer)
        if shrink is None:
            return None
        longest = max(len(t.encode("utf-8", "surrogatepass")) for t in self.backend.get_vocab(with_added_tokens=True))
        return max(1, longest) * shrink

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The token as the vocabulary spells it (byte-level or SentencePiece form)."""
        return self.backend.id_to_token(token_id)

    def detokenizer(self, skip_special: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special=skip_special)

    # -- what chat templates need ------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template (None when the model has none)."""
        return self.chat_templates.get("default")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_ids={sorted(self.eos_ids)}, stop_ids={sorted(self.stop_ids)})"
        )


def _stop_ids(eos_ids: frozenset[int], extra: Iterable[int], added: Mapping[str, int]) -> frozenset[int]:
    stop = set(eos_ids) | {i for i in extra if i is not None}
    stop |= {i for text, i in added.items() if text in _END_OF_TURN_TEXTS}
    # gpt-oss (harmony) ends every message with <|end|> but the reply goes on (analysis, then
    # final channel); generation ends at <|return|> or <|call|>. llama.cpp drops <|end|> from
    # its end-of-generation set in exactly this case, and so do we.
    if "<|return|>" in added and "<|call|>" in added and "<|end|>" in added:
        stop.discard(added["<|end|>"])
    return frozenset(stop)


# =============================================================================================
# Streaming: ids in, text pieces out
# =============================================================================================


# Normalizers that keep every character: each maps a character to at least one byte, and a
# character takes at most 4 bytes, so they shrink a text by at most 4 times (Unicode forms,
# lowercasing, prefixing).
_KEEPING_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend"})


def _normalizer_shrink(spec: Mapping[str, Any] | None) -> int | None:
    """How many times a tokenizer.json normalizer can shrink a text's bytes (1: none), or None
    when it may drop characters (stripping, precompiled SentencePiece maps, cleaning)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        shrinks = [_normalizer_shrink(n) for n in spec.get("normalizers", [])]
        return None if None in shrinks else max(shrinks, default=1)
    if kind in _KEEPING_NORMALIZERS:
        return 4
    pattern = (spec.get("pattern") or {}).get("String") if kind == "Replace" else None
    if pattern and spec.get("content"):  # each match of a fixed text becomes at least one byte
        return len(pattern.encode("utf-8"))
    return None


class IncrementalDetokenizer:
    """Feed token ids one at a time; get text pieces that never split a character.

    The pieces concatenate to exactly ``tokenizer.decode(all ids)`` once ``flush()`` has been
    called, for any ids (only more than ``MAX_HELD_TOKENS`` tokens in a row of undecodable
    byte-level text are let through early). Technique (as in text-generation-inference and vLLM): decode a short window of
    recent tokens twice, without and with the new token, and emit only the new suffix; hold
    back while the window's text ends in U+FFFD (a character whose bytes have not all arrived,
    e.g. an emoji split over byte tokens) or ends on a byte-fallback token (a run of those is
    decoded as a whole). Windows keep the cost per token constant and give decoders that
    look at neighbours (SentencePiece's leading-space strip) the same context both times.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # ids before this were emitted
        self._emitted: list[str] = []

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    # An unfinished UTF-8 character is at most 3 bytes, so real text never ends in U+FFFD for
    # this many tokens; only a model emitting invalid bytes does, and then we stop waiting
    # (bounding the window, hence the cost per token) at the price of exactness for that garbage.
    MAX_HELD_TOKENS = 32

    def feed(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        if self._ids[-1] in self._tokenizer.byte_fallback_ids:
            # A byte run is decoded as a whole (one invalid byte turns all of it into U+FFFD),
            # so wait for its end; nothing is decoded meanwhile, so waiting costs nothing.
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        new_text = decode(self._ids[self._prefix_offset :], self._skip_special)
        if len(new_text) <= len(prefix_text) or not new_text.startswith(prefix_text):
            return ""
        if new_text.endswith("\ufffd") and len(self._ids) - self._read_offset <= self.MAX_HELD_TOKENS:
            return ""
        piece = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._emitted.append(piece)
        return piece

    def flush(self) -> str:
        """The text still held back (an unfinished character stays as U+FFFD, as in decode)."""
        full = self._tokenizer.decode(self._ids, self._skip_special)
        emitted = self.text
        if full.startswith(emitted):
            rest = full[len(emitted) :]
        else:  # a decoder that rewrites earlier text; emit what the window says is new
            prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
            rest = self._tokenizer.decode(self._ids[self._prefix_offset :], self._skip_special)[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        if rest:
            self._emitted.append(rest)
        return rest


# =============================================================================================
# Loading
# =============================================================================================


def load_tokenizer(model_path: str | Path, *, gguf_metadata: Mapping[str, Any] | None = None) -> Tokenizer:
    """The tokenizer of a model: a Hugging Face folder's tokenizer files when it has them, else
    the vocabulary of the GGUF model ``resolve_model_files`` chooses for the path (the first
    part of a split set, never a projector: the file the weights come from). ``gguf_metadata``
    is that GGUF's key/values when the caller has the file open already (the engine takes
    them from its weights' mapping rather than parse the header again)."""
    path = Path(model_path).expanduser()
    if path.is_dir():
        if (path / "tokenizer.json").is_file() or (path / "tiktoken.model").is_file():
            return _load_hf(path)
        if not any(path.glob("*.gguf")):
            raise _no_tokenizer(path)
    elif path.is_file() and path.suffix.lower() != ".gguf" and not is_gguf_file(path):
        raise ModelError(f"{path} is neither a GGUF file nor a model directory", "Pass the model's directory or its .gguf file.")
    found = resolve_model_files(path)
    if found.kind != "gguf":  # safetensors without tokenizer files, or only a projector GGUF
        raise _no_tokenizer(path)
    return _load_gguf(found.path, gguf_metadata)


def _no_tokenizer(folder: Path) -> ModelError:
    return ModelError(f"{folder} holds no tokenizer (no tokenizer.json, tiktoken.model or .gguf model file)",
                      "Download the tokenizer files with the model, or point at the model's GGUF file.")


# -- Hugging Face directories -----------------------------------------------------------------


def _load_hf(directory: Path) -> Tokenizer:
    config = _read_json(directory / "tokenizer_config.json")
    generation = _read_json(directory / "generation_config.json")
    model_config = _read_json(directory / "config.json")
    special_map = _read_json(directory / "special_tokens_map.json")

    if (directory / "tokenizer.json").is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as exc:  # the library raises plain Exception on malformed files
            raise ModelError(f"{directory / 'tokenizer.json'} cannot be read: {exc}", "The file is damaged or incomplete; download it again.") from exc
    else:
        backend = _tiktoken_backend(directory / "tiktoken.model", config)

    # Only what the tokenizer config names: these are the strings templates see, and
    # transformers passes exactly these (Qwen has bos_token null although its
    # generation_config has a bos_token_id).
    special_tokens: dict[str, str] = {}
    for name in _SPECIAL_TOKEN_NAMES:
        value = _token_content(config.get(name)) or _token_content(special_map.get(name))
        if value is not None:
            special_tokens[name] = value

    def token_id(name: str) -> int | None:
        text = special_tokens.get(name)
        return backend.token_to_id(text) if text is not None else None

    bos_id = token_id("bos_token")
    if bos_id is None:
        bos_id = _first_int(generation.get("bos_token_id", model_config.get("bos_token_id")))
    # The tokenizer's eos first (it is the one to append), then what generation stops at.
    eos_ids = [i for i in [token_id("eos_token"), *_int_list(generation.get("eos_token_id"))] if i is not None]
    if not eos_ids:
        eos_ids = _int_list(model_config.get("eos_token_id"))

    add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
    if not isinstance(add_bos, bool) or not isinstance(add_eos, bool):
        # No explicit setting: the tokenizer.json post-processor is what transformers obeys.
        probe = backend.encode("a", add_special_tokens=True).ids
        if not isinstance(add_bos, bool):
            add_bos = bos_id is not None and probe[:1] == [bos_id]
        if not isinstance(add_eos, bool):
            add_eos = bool(probe) and probe[-1] in eos_ids and len(probe) > 1

    templates, origins = _hf_chat_templates(directory, config)
    return Tokenizer(
        backend,
        source=str(directory),
        bos_id=bos_id,
        eos_ids=eos_ids,
        add_bos=add_bos,
        add_eos=add_eos,
        special_tokens=special_tokens,
        chat_templates=templates,
        chat_template_origins=origins,
    )


def _hf_chat_templates(directory: Path, config: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """Chat templates by name ("default", "tool_use", ...) and where each came from.

    Precedence as in transformers: chat_template.jinja and additional_chat_templates/*.jinja
    over tokenizer_config.json's chat_template (a string, or a list of {name, template}),
    then the legacy processor file chat_template.json.
    """
    templates: dict[str, str] = {}
    origins: dict[str, str] = {}

    def add(name: str, text: Any, origin: str) -> None:
        if isinstance(text, str) and text.strip():
            templates[name] = text
            origins[name] = origin

    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        add("default", _read_text(jinja), str(jinja))
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            add(file.name.removesuffix(".jinja"), _read_text(file), str(file))
    if not templates:
        config_file = str(directory / "tokenizer_config.json")
        value = config.get("chat_template")
        if isinstance(value, str):
            add("default", value, config_file)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, Mapping) and isinstance(item.get("name"), str):
                    add(item["name"], item.get("template"), f"{config_file} ({item['name']})")
    if not templates:
        legacy = directory / "chat_template.json"
        value = _read_json(legacy).get("chat_template")
        add("default", value, str(legacy))
    return templates, origins


def _tiktoken_backend(path: Path, config: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """A ``tokenizers.Tokenizer`` equivalent to a tiktoken rank file (Kimi K2's tokenizer).

    tiktoken merges, within each pre-token, the adjacent pair whose concatenation has the
    lowest rank. A BPE whose merges are every (left, right) split of each token, ordered by the
    token's rank, does the same (transformers' TikTokenConverter builds it this way), and
    ``ignore_merges`` matches tiktoken's shortcut of taking a whole pre-token that is itself
    in the vocabulary. The split pattern is Kimi's (tokenization_kimi.py): the only family we
    serve that ships a rank file instead of tokenizer.json.
    """
    ranks: dict[bytes, int] = {}
    line_no = 0
    try:
        for line_no, line in enumerate(path.read_bytes().splitlines(), 1):
            if not line.strip():
                continue
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    except (ValueError, OSError) as exc:
        raise ModelError(f"{path} cannot be read as a tiktoken rank file (line {line_no}): {exc}", "Download the tokenizer files again.") from exc

    to_text = _bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(to_text[x] for x in b)

    vocab = {text(b): r for b, r in ranks.items()}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=[(text(m[3]), text(m[4])) for m in merges], ignore_merges=True)
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(_KIMI_K2), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()

    # Special tokens sit after the ranks; Kimi names some in added_tokens_decoder and reserves
    # the rest of its 256 slots as <|reserved_token_N|> (tokenization_kimi.py).
    n_base = max(ranks.values()) + 1 if ranks else 0
    named = {int(i): _token_content(v) for i, v in (config.get("added_tokens_decoder") or {}).items()}
    n_special = max([n_base + 256 - 1, *named]) + 1 - n_base
    specials = [named.get(i) or f"<|reserved_token_{i}|>" for i in range(n_base, n_base + n_special)]
    added_meta = config.get("added_tokens_decoder") or {}
    backend.add_tokens(
        [
            AddedToken(content, special=bool((added_meta.get(str(i)) or {}).get("special", True)), normalized=False)
            for i, content in zip(range(n_base, n_base + n_special), specials)
        ]
    )
    if n_special and backend.token_to_id(specials[0]) != n_base:  # ranks with gaps would shift them
        raise ModelError(f"{path}: the ranks are not contiguous, so the special token ids cannot be placed", "The rank file is damaged.")
    return backend


# -- GGUF files -------------------------------------------------------------------------------


def _load_gguf(path: Path, metadata: Mapping[str, Any] | None = None) -> Tokenizer:
    meta = read_gguf_metadata(path) if metadata is None else metadata
    if "tokenizer.ggml.model" not in meta:
        raise ModelError(f"{path} holds no tokenizer (tokenizer.ggml.model is missing)", "Use a GGUF converted with its vocabulary.")

    kind = meta["tokenizer.ggml.model"]
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ModelError(f"{path} has an empty tokenizer.ggml.tokens list", "The GGUF is damaged or incomplete.")
    types = list(meta.get("tokenizer.ggml.token_type") or [GGUF_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ModelError(f"{path}: {len(types)} token types for {len(tokens)} tokens", "The GGUF is damaged or incomplete.")
    pre = str(meta.get("tokenizer.ggml.pre") or "default")

    if kind == "gpt2":
        merges = list(meta.get("tokenizer.ggml.merges") or [])
        backend, defaults = _gguf_byte_level_bpe(path, tokens, types, merges, pre)
    elif kind == "llama":
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        backend = _gguf_sentencepiece_bpe(tokens, types, scores, add_space_prefix)
        defaults = {"add_bos": True}
    else:
        raise UnsupportedModelError(
            f"{path}: the embedded engine cannot read tokenizers of type {kind!r} (tokenizer.ggml.model)",
            "Run this model with the llama.cpp backend.",
        )

    def meta_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        return int(value) if isinstance(value, int) and 0 <= value < len(tokens) else None

    bos_id = None if defaults.get("no_bos") else meta_id("bos")
    eos_id = meta_id("eos")
    special_tokens = {}
    for name, key in (("bos_token", bos_id), ("eos_token", eos_id), ("unk_token", meta_id("unknown")), ("pad_token", meta_id("padding"))):
        if key is not None:
            special_tokens[name] = tokens[key]

    templates: dict[str, str] = {}
    origins: dict[str, str] = {}
    if isinstance(meta.get("tokenizer.chat_template"), str):
        templates["default"] = meta["tokenizer.chat_template"]
        origins["default"] = f"{path} (tokenizer.chat_template)"
    for key, value in meta.items():
        if key.startswith("tokenizer.chat_template.") and isinstance(value, str):
            name = key.removeprefix("tokenizer.chat_template.")
            templates[name] = value
            origins[name] = f"{path} ({key})"

    return Tokenizer(
        backend,
        source=str(path),
        bos_id=bos_id,
        eos_ids=[eos_id] if eos_id is not None else [],
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", defaults.get("add_bos", False))),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        extra_stop_ids=[meta_id("eot"), meta_id("eom")],
        special_tokens=special_tokens,
        chat_templates=templates,
        chat_template_origins=origins,
        vocab_size=len(tokens),
    )


@dataclass(frozen=True)
class _PreTokenizer:
    regexes: tuple[str, ...]  # applied in turn, each splitting the pieces of the one before
    ignore_merges: bool = False  # a pre-token found whole in the vocabulary is one token
    add_bos: bool = False  # llama.cpp's default when the GGUF does not say
    no_bos: bool = False  # the family has a BOS token but never uses it (GLM-4)


# The split expressions of each pre-tokenizer, as the model's original tokenizer.json writes
# them; llama.cpp's llama-vocab.cpp holds the same list (some rewritten for its regex engine,
# e.g. case-insensitive groups spelled out). Names map as in llama.cpp's load_vocab.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenization_kimi.py; `&&` is character-class intersection, which Oniguruma supports.
_KIMI_K2 = (
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Non-ASCII ranges are written as escapes: several bounds are characters that Unicode
# normalisation would silently replace (e.g. U+1FDB, U+212A), which empties the range.
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_DEEPSEEK_LLM = (
    "[\r\n]",
    (
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
        "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
        "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
        "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
        "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
        "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
        "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
        "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
        "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
        "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
    ),
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
)
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2_SPLIT, "[0-9][0-9][0-9]")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", "[0-9][0-9][0-9]")

BPE_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {}
for _names, _pre in (
    (("default",), _PreTokenizer(_DEFAULT)),
    (("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"), _PreTokenizer((GPT2_SPLIT,))),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"), _PreTokenizer((r"\p{N}", GPT2_SPLIT))),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"), _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    (("falcon",), _PreTokenizer(_FALCON)),
    (("dbrx", "smaug-bpe"), _PreTokenizer((_LLAMA3,))),
    (("chatglm-bpe",), _PreTokenizer((_LLAMA3,), no_bos=True)),
    (("glm4", "glm5"), _PreTokenizer((_LLAMA3,), ignore_merges=True, no_bos=True)),
    (("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan", "megrez", "grok-2", "solar-open"), _PreTokenizer((_QWEN2,))),
    (("qwen35",), _PreTokenizer((_QWEN35,))),
    (("deepseek-llm",), _PreTokenizer(_DEEPSEEK_LLM)),
    (("deepseek-coder",), _PreTokenizer(_DEEPSEEK_CODER)),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm"), _PreTokenizer(_DEEPSEEK_V3)),
    (("gpt-4o", "llama4", "minimax-m2"), _PreTokenizer((_GPT4O,))),
    (("tekken",), _PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)),
    (("kimi-k2",), _PreTokenizer((_KIMI_K2,))),
):
    for _name in _names:
        BPE_PRE_TOKENIZERS[_name] = _pre

SUPPORTED_GGUF_PRE_TOKENIZERS = frozenset(BPE_PRE_TOKENIZERS)


def _gguf_byte_level_bpe(
    path: Path, tokens: list[str], types: list[int], merges: list[str], pre: str
) -> tuple[tokenizers.Tokenizer, dict[str, bool]]:
    spec = BPE_PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise UnsupportedModelError(
            f"{path}: the embedded engine does not know the pre-tokenizer {pre!r} (tokenizer.ggml.pre)",
            "Run this model with the llama.cpp backend, or use its Hugging Face directory.",
        )
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a duplicate spelling keeps its first id, as llama.cpp's map does
    pairs = []
    for merge in merges:
        # Split at the first space after the first character, as llama.cpp does, so that a
        # left part that is itself a space survives.
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ModelError(f"{path}: malformed merge {merge!r} in tokenizer.ggml.merges", "The GGUF is damaged.")
        pairs.append((merge[:cut], merge[cut + 1 :]))
    try:
        model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=spec.ignore_merges)
    except Exception as exc:
        raise ModelError(f"{path}: the vocabulary and merges do not fit together: {exc}", "The GGUF is damaged.") from exc
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    _add_gguf_added_tokens(backend, tokens, types)
    return backend, {"add_bos": spec.add_bos, "no_bos": spec.no_bos}


def _gguf_sentencepiece_bpe(tokens: list[str], types: list[int], scores: list[float], add_space_prefix: bool) -> tokenizers.Tokenizer:
    """SentencePiece BPE ("llama" vocabularies: Mixtral, Llama 2) as a tokenizers BPE.

    SentencePiece merges the adjacent pair whose concatenation is the highest-scoring piece;
    merges listing every split of every normal piece, ordered by that piece's score, do the
    same (transformers' SentencePieceExtractor). Spaces become U+2581 and, with
    add_space_prefix, every text run starts with one (llama.cpp adds it after each special
    token too, like the Prepend normalizer applied per segment). Unknown characters fall back
    to <0xNN> byte tokens.
    """
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    candidates = []
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind not in (GGUF_NORMAL, GGUF_USER_DEFINED) or len(token) < 2 or vocab[token] != i:
            continue
        local = []
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                local.append((vocab[left], vocab[right], left, right))
        local.sort()
        score = float(scores[i]) if i < len(scores) else 0.0
        candidates.extend((-score, i, n, left, right) for n, (_, _, left, right) in enumerate(local))
    candidates.sort()
    unk = next((t for t, k in zip(tokens, types) if k == GGUF_UNKNOWN), None)
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(c[3], c[4]) for c in candidates],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=any(k == GGUF_BYTE for k in types),
        )
    )
    steps = [normalizers.Replace(" ", "▁")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(dec)
    _add_gguf_added_tokens(backend, tokens, types)
    return backend


def _add_gguf_added_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control, unknown and user-defined tokens are matched in text before BPE (llama.cpp's
    special-token partition); GGUF stores them as plain text, not in byte-level form."""
    added = [
        AddedToken(token, special=kind != GGUF_USER_DEFINED, normalized=False)
        for token, kind in zip(tokens, types)
        if kind in (GGUF_CONTROL, GGUF_UNKNOWN, GGUF_USER_DEFINED) and token
    ]
    if added:
        backend.add_tokens(added)


# -- small helpers ----------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table: printable bytes stand for themselves, the others are
    shifted past U+0100, so every byte string is a printable string (space is 'Ġ')."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path} cannot be read: {exc}", "The file is damaged or incomplete; download it again.") from exc
    return data if isinstance(data, dict) else {}


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path} cannot be read: {exc}", "The file is damaged or incomplete; download it again.") from exc


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _int_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _first_int(value: Any) -> int | None:
    values = _int_list(value)
    return values[0] if values else None
