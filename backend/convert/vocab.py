"""A Hugging Face tokenizer as GGUF metadata (``tokenizer.ggml.*``, ``tokenizer.chat_template``).

The vocabulary is read by the engine's own loader (``hybridmoe.backend.text.tokenizer``), which
already understands tokenizer.json, Kimi's tiktoken rank file, the special tokens spread over
tokenizer_config.json / generation_config.json and the chat template files. From that one
object this module writes what llama.cpp's vocabulary loader reads:

* byte-level BPE (Qwen, DeepSeek, Kimi, GLM, GPT-OSS, Llama 3): model ``gpt2``, tokens in
  their byte-level spelling (added tokens as plain text), merges, and ``tokenizer.ggml.pre``,
  the name under which llama.cpp keeps the pre-tokenizer's split expressions. llama.cpp's
  own converter recognises a tokenizer by hashing its output on a test string; here the
  tokenizer's split expressions are compared with the table the engine keeps of what each
  name means, so any tokenizer using a known expression is recognised, and an unknown one
  is refused rather than tokenized wrongly.
* SentencePiece-style BPE with byte fallback (Mixtral, Llama 2): model ``llama``, tokens with
  scores (minus the id: SentencePiece orders pieces by score, and the engine's GGUF reader
  turns scores back into merges in that order) and types (unknown, control, byte, normal).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from hybridmoe.backend.text import tokenizer as engine_tokenizer
from hybridmoe.backend.errors import UnsupportedModelError
from hybridmoe.backend.models.families import family_by_name

T = gguf.TokenType

# End-of-turn tokens (llama.cpp matches these texts itself; naming the one a model uses
# lets every reader stop there without guessing). A family whose turns end otherwise says so
# in its SPECIAL_TOKEN_ROLES (hybridmoe.backend.models.families).
_EOT_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|return|>", "<|end_of_turn|>", "<end_of_turn>")


@dataclass
class GGUFVocab:
    """Everything the ``tokenizer.*`` keys hold, ready to be written."""

    model: str  # "gpt2" or "llama"
    pre: str
    tokens: list[str]
    types: list[int]
    merges: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    special_ids: dict[str, int] = field(default_factory=dict)  # bos, eos, eot, eom, pad, unk
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool | None = None
    chat_templates: dict[str, str] = field(default_factory=dict)

    def write(self, writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        if self.scores:
            writer.add_token_scores(self.scores)
        if self.merges:
            writer.add_token_merges(self.merges)
        setters = {
            "bos": writer.add_bos_token_id,
            "eos": writer.add_eos_token_id,
            "eot": writer.add_eot_token_id,
            "eom": writer.add_eom_token_id,
            "pad": writer.add_pad_token_id,
            "unk": writer.add_unk_token_id,
        }
        for key, token_id in self.special_ids.items():
            setters[key](token_id)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        if self.chat_templates:
            # The default goes to tokenizer.chat_template, others (tool_use, ...) to
            # tokenizer.chat_template.<name>, listed in tokenizer.chat_templates.
            writer.add_chat_template([{"name": k, "template": v} for k, v in self.chat_templates.items()])


def vocab_from_hf(directory: Path, family: str, vocab_size: int) -> GGUFVocab:
    """The GGUF vocabulary of the HF model in `directory`; `vocab_size` is the embedding's
    row count, which the token list is padded to (llama.cpp sizes the vocabulary from it)."""
    tok = engine_tokenizer.load_tokenizer(directory)
    backend = tok.backend
    data = json.loads(backend.to_str())
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise UnsupportedModelError(
            f"{directory}: tokenizer model {model.get('type')!r} cannot be converted to GGUF; "
            "hybridmoe converts BPE vocabularies (byte-level or SentencePiece-style).",
            "Use a GGUF published for this model.",
        )
    added = backend.get_added_tokens_decoder()
    size = max(vocab_size, tok.vocab_size)
    sentencepiece = bool(model.get("byte_fallback")) or _uses_metaspace(data)

    tokens: list[str] = []
    types: list[int] = []
    for i in range(size):
        text = backend.id_to_token(i)
        if text is None:
            # Unused ids between the vocabulary and the embedding's padded size.
            tokens.append(f"[PAD{i}]")
            types.append(T.UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(T.CONTROL if added[i].special else T.USER_DEFINED)
        elif sentencepiece and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            tokens.append(text)
            types.append(T.BYTE)
        elif sentencepiece and text == model.get("unk_token"):
            tokens.append(text)
            types.append(T.UNKNOWN)
        else:
            tokens.append(text)
            types.append(T.NORMAL)

    special_ids: dict[str, int] = {}
    family_specials = family_by_name(family).SPECIAL_TOKEN_ROLES
    if tok.bos_id is not None:
        special_ids["bos"] = tok.bos_id
    if tok.eos_id is not None:
        special_ids["eos"] = tok.eos_id
    for key, default in (("eot", _EOT_TEXTS), ("eom", ()), ("bos", ())):
        if key in special_ids:
            continue
        for text in family_specials.get(key, default):
            token_id = tok.added_tokens.get(text)
            if token_id is not None:
                special_ids[key] = token_id
                break
    pad = _config_token_id(directory, "pad_token", backend)
    if pad is not None:
        special_ids["pad"] = pad

    vocab = GGUFVocab(
        model="llama" if sentencepiece else "gpt2",
        pre="default",
        tokens=tokens,
        types=types,
        special_ids=special_ids,
        add_bos=tok.add_bos,
        add_eos=tok.add_eos,
        chat_templates=dict(tok.chat_templates),
    )
    if sentencepiece:
        vocab.scores = [-float(i) if t == T.NORMAL else 0.0 for i, t in enumerate(types)]
        vocab.add_space_prefix = _adds_space_prefix(data)
        unk = model.get("unk_token")
        if unk is not None and backend.token_to_id(unk) is not None:
            vocab.special_ids["unk"] = backend.token_to_id(unk)
    else:
        vocab.merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
        vocab.pre = _pre_name(data, family, directory)
    return vocab


def _config_token_id(directory: Path, key: str, backend: Any) -> int | None:
    path = directory / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return None  # the engine's loader has already read (and vouched for) this file
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return backend.token_to_id(value) if isinstance(value, str) else None


def _walk(node: Any) -> list[dict]:
    """A normalizer / pre-tokenizer JSON node and everything nested in Sequences."""
    if not isinstance(node, dict):
        return []
    inner = node.get("pretokenizers") or node.get("normalizers") or []
    out = [node]
    for child in inner:
        out.extend(_walk(child))
    return out


def _uses_metaspace(data: dict) -> bool:
    nodes = _walk(data.get("pre_tokenizer")) + _walk(data.get("normalizer"))
    return any(n.get("type") == "Metaspace" or (n.get("type") == "Replace" and n.get("content") == "▁") for n in nodes)


def _adds_space_prefix(data: dict) -> bool:
    for n in _walk(data.get("normalizer")):
        if n.get("type") == "Prepend" and n.get("prepend") == "▁":
            return True
    for n in _walk(data.get("pre_tokenizer")):
        if n.get("type") == "Metaspace":
            return n.get("prepend_scheme", "always") != "never" and n.get("add_prefix_space", True)
    return False


def _split_expressions(data: dict) -> tuple[str, ...] | None:
    """The pre-tokenizer's split expressions in order, or None for a shape we do not read."""
    regexes: list[str] = []
    for n in _walk(data.get("pre_tokenizer")):
        kind = n.get("type")
        if kind == "Split":
            pattern = n.get("pattern") or {}
            if "Regex" not in pattern:
                return None
            regexes.append(pattern["Regex"])
        elif kind == "ByteLevel":
            if n.get("use_regex", True):
                regexes.append(engine_tokenizer.GPT2_SPLIT)
        elif kind == "Digits":
            regexes.append(r"\p{N}" if n.get("individual_digits") else r"\p{N}+")
        elif kind != "Sequence":
            return None
    return tuple(regexes)


def _pre_name(data: dict, family: str, directory: Path) -> str:
    regexes = _split_expressions(data)
    # One table of what each llama.cpp pre-tokenizer name means, shared with the engine's
    # GGUF tokenizer reader, so that the two directions cannot drift apart.
    table = engine_tokenizer.BPE_PRE_TOKENIZERS
    ignore_merges = bool((data.get("model") or {}).get("ignore_merges"))
    candidates = [name for name, pre in table.items() if regexes is not None and pre.regexes == regexes]
    if not candidates:
        shown = " | ".join(regexes) if regexes else json.dumps(data.get("pre_tokenizer"))[:200]
        raise UnsupportedModelError(
            f"{directory / 'tokenizer.json'}: the pre-tokenizer ({shown}) is not one llama.cpp knows "
            "by name, so a GGUF of this model would tokenize text differently.",
            "Use a GGUF published for this model.",
        )
    # Of the names sharing these expressions, the one the family's models are known under.
    for name in family_by_name(family).LLAMA_PRE_TOKENIZERS:
        if name in candidates:
            return name
    # Otherwise the name whose whole-word shortcut (ignore_merges) matches the tokenizer's.
    same = [n for n in candidates if table[n].ignore_merges == ignore_merges]
    return (same or candidates)[0]
