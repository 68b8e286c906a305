"""Text to token ids and back through llama.cpp's own vocabulary.

The llama.cpp backend serves files the embedded engine cannot, including vocabularies it does
not rebuild (other pre-tokenizers, Unigram, WordPiece), so it tokenizes with llama.cpp itself.
Its behaviour mirrors hybridmoe.backend.text.tokenizer.Tokenizer where that is observable:

* ``encode_prompt``: special tokens written in the rendered template are parsed as such, and
  BOS is added exactly once (templates that write ``{{ bos_token }}`` themselves get no second).
* ``special_tokens``: bos/eos/unk/pad texts for the chat template, from the GGUF vocabulary.
* ``is_stop``: llama.cpp's end-of-generation set (eos, eot, eom and the end-of-turn tokens it
  recognises), the engine's ``stop_ids`` counterpart.
* ``Detokenizer``: pieces never split a UTF-8 character, control tokens are rendered as text,
  and a SentencePiece vocabulary drops the leading space of the first generated piece, as
  llama.cpp's detokenizer and the HF decoder both do. A run of SentencePiece byte tokens
  (<0xE4><0xBD><0xA0>) is decoded as a whole, and one that is not valid UTF-8 becomes one
  U+FFFD per byte: the HF ByteFallback decoder's rule, which the engine follows, so both
  backends show the same text even for the broken byte sequences a model can emit.
"""

from __future__ import annotations

import codecs
import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

from hybridmoe.backend.errors import ModelError


class Vocab:
    def __init__(self, bindings, model, metadata: Mapping[str, Any]):
        """``metadata``: the GGUF's scalar key/values (tokenizer.ggml.*)."""
        self._b = bindings
        self._metadata = metadata
        self.ptr = bindings.llama_model_get_vocab(model)
        self.n_tokens: int = bindings.llama_vocab_n_tokens(self.ptr)
        self.type: int = bindings.llama_vocab_type(self.ptr)
        bos = bindings.llama_vocab_bos(self.ptr)
        self.bos_id: int | None = bos if bos >= 0 else None
        self.add_bos = bool(bindings.llama_vocab_get_add_bos(self.ptr)) and self.bos_id is not None
        # tokenizer.ggml.add_space_prefix defaults to true for SentencePiece vocabularies.
        spm = self.type == bindings.LLAMA_VOCAB_TYPE_SPM
        self.strips_leading_space = spm and bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        self._spm = spm
        self._piece_buf = ctypes.create_string_buffer(256)
        self._longest_piece: int | None = None

    # -- text -> ids ------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` with special tokens written in it recognised, nothing added."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        for _ in range(2):
            out = (self._b.llama_token * capacity)()
            n = self._b.llama_tokenize(self.ptr, data, len(data), out, capacity, False, True)
            if n >= 0:
                return list(out[:n])
            capacity = -n  # too small: llama.cpp says how many it needs
        raise ModelError("llama.cpp could not tokenize the prompt")

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of ``text`` from its length: no token covers more bytes
        than its piece holds. BPE and SentencePiece vocabularies tokenize the text as it is; the
        others normalize it first (UGM collapses whitespace, WPM cleans), where length proves
        nothing: 0."""
        if self.type not in (self._b.LLAMA_VOCAB_TYPE_BPE, self._b.LLAMA_VOCAB_TYPE_SPM):
            return 0
        if self._longest_piece is None:  # once: a call per token
            self._longest_piece = max(1, max((len(self.piece(t)) for t in range(self.n_tokens)), default=1))
        return len(text.encode("utf-8", "surrogatepass")) // self._longest_piece

    def encode_prompt(self, text: str) -> list[int]:
        ids = self.encode(text)
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)  # type: ignore[arg-type]
        return ids

    # -- ids -> text ------------------------------------------------------------------------

    def piece(self, token: int, lstrip: int = 0) -> bytes:
        """The bytes of one token, control tokens included (a byte token is one raw byte)."""
        n = self._b.llama_token_to_piece(self.ptr, token, self._piece_buf, len(self._piece_buf), lstrip, True)
        if n < 0:
            self._piece_buf = ctypes.create_string_buffer(-n)
            n = self._b.llama_token_to_piece(self.ptr, token, self._piece_buf, len(self._piece_buf), lstrip, True)
        return self._piece_buf.raw[: max(n, 0)]

    def decode(self, ids: Sequence[int]) -> str:
        d = self.detokenizer()
        return "".join(d.feed(t) for t in ids) + d.flush()

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self)

    def text_of(self, token: int) -> str:
        """The token as the vocabulary spells it (special tokens are plain text there)."""
        raw = self._b.llama_vocab_get_text(self.ptr, token)
        return raw.decode("utf-8", errors="replace") if raw else ""

    # -- what chat templates and the generation loop need ------------------------------------

    @property
    def special_tokens(self) -> dict[str, str]:
        """The tokens the GGUF names (not llama.cpp's per-vocabulary defaults, which give a
        byte-level BPE without a BOS the GPT-2 BOS id 11), as the engine reads them."""
        out = {}
        for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
            token = self._metadata.get(f"tokenizer.ggml.{key}_token_id")
            if isinstance(token, int) and not isinstance(token, bool) and 0 <= token < self.n_tokens:
                out[name] = self.text_of(token)
        return out

    def is_stop(self, token: int) -> bool:
        return bool(self._b.llama_vocab_is_eog(self.ptr, token))

    def is_byte(self, token: int) -> bool:
        """A SentencePiece byte-fallback token (<0xNN>), which stands for one raw byte."""
        return self._spm and bool(self._b.llama_vocab_get_attr(self.ptr, token) & self._b.LLAMA_TOKEN_ATTR_BYTE)


class Detokenizer:
    """Feed generated ids one at a time; get text that never splits a character."""

    def __init__(self, vocab: Vocab):
        self._vocab = vocab
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True
        self._byte_run = bytearray()  # SentencePiece byte tokens not decoded yet

    def feed(self, token: int) -> str:
        lstrip = 1 if self._first and self._vocab.strips_leading_space else 0
        self._first = False
        piece = self._vocab.piece(token, lstrip)
        if self._vocab.is_byte(token):
            self._byte_run += piece
            return ""
        return self._end_byte_run() + self._utf8.decode(piece)

    def flush(self) -> str:
        return self._end_byte_run() + self._utf8.decode(b"", final=True)

    def _end_byte_run(self) -> str:
        run, self._byte_run = bytes(self._byte_run), bytearray()
        try:
            return run.decode("utf-8")
        except UnicodeDecodeError:
            return "\ufffd" * len(run)
