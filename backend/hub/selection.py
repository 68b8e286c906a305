"""Which files of a model repository to download (or to expect in a cached snapshot).

A checkpoint repository holds more than the engine reads: an ``original/`` copy in another
layout, ``*.bin``/``*.pth`` pickles (never loaded: docs/architecture.md, Conventions), ``consolidated``
duplicates of the shards, other formats, remote code. We take the config, the tokenizer and
chat-template files, and the safetensors shards with their index, all at the top level.

A GGUF repository holds one set per quantization; exactly one is taken (``--quant``).

The same rules run on the Hub's file listing before a download and on a snapshot's files
when offline, so both agree on what a complete model is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from hybridmoe.backend.errors import ModelError, UsageError
from hybridmoe.backend.hub import gguf_sets

# Read by hybridmoe.backend.models (config), hybridmoe.backend.text.tokenizer (tokenizer, chat template, eos
# ids) and the GGUF converter (tokenizer.model, vocab.json + merges.txt for BPE models).
CHECKPOINT_FILES = frozenset({
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
})
# The only subfolder the engine reads (named chat templates, as transformers stores them).
CHAT_TEMPLATE_DIR = "additional_chat_templates"


@dataclass(frozen=True)
class RepoFile:
    """A file of a repository: its path in the repo and what the Hub says it is."""

    path: str  # POSIX path relative to the repo root
    size: int | None
    sha256: str | None = None  # LFS files: the content's sha256
    blob_id: str | None = None  # the git blob id (for non-LFS files, a hash of the content)

    @property
    def is_lfs(self) -> bool:
        return self.sha256 is not None


@dataclass(frozen=True)
class Selection:
    kind: str  # "safetensors" or "gguf", as InspectedModel.kind
    files: tuple[RepoFile, ...]
    quantization: str | None = None  # the GGUF set's name
    weights_path: str = ""  # what inspect_model takes, relative to the snapshot ("" = the snapshot itself)
    expected_parts: int = 1  # GGUF: parts the split names announce

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)


def _is_checkpoint_file(path: str) -> bool:
    p = PurePosixPath(path)
    if len(p.parts) == 2 and p.parts[0] == CHAT_TEMPLATE_DIR:
        return p.suffix == ".jinja"
    if len(p.parts) != 1:  # original/, metal/, onnx/, ...
        return False
    name = p.name
    if name.startswith("consolidated"):  # Mistral's single-file duplicate of the shards
        return False
    return name in CHECKPOINT_FILES or name.endswith((".safetensors", ".safetensors.index.json"))


def is_safetensors_checkpoint(paths: Sequence[str]) -> bool:
    names = set(paths)
    return "config.json" in names and any(_is_checkpoint_file(p) and p.endswith(".safetensors") for p in names)


def select(files: Sequence[RepoFile], quant: str | None, where: str) -> Selection:
    """The files to take from ``files`` (a repo listing or a snapshot's contents).

    Without ``quant``: the safetensors checkpoint if there is one, else the repo's only GGUF
    set; a repo with several GGUF sets asks for ``--quant`` (UsageError listing them).
    """
    paths = [f.path for f in files]
    sets = gguf_sets.gguf_sets((f.path, f.size) for f in files)
    if quant is None and is_safetensors_checkpoint(paths):
        chosen = tuple(f for f in files if _is_checkpoint_file(f.path))
        return Selection("safetensors", tuple(sorted(chosen, key=lambda f: f.path)))
    if quant is None:
        if not sets:
            raise ModelError(
                f"{where} holds neither a safetensors checkpoint (config.json + *.safetensors) nor GGUF files.",
                "Pick a repository with the model's weights in one of these formats.",
            )
        if len(sets) > 1:
            raise UsageError(
                f"{where} holds GGUF files in {len(sets)} quantizations:\n{gguf_sets.describe(sets)}",
                "Choose one with --quant, e.g. --quant " + _suggest(sets),
            )
        chosen_set = sets[0]
    else:
        if not sets and is_safetensors_checkpoint(paths):
            raise UsageError(
                f"{where} is a safetensors checkpoint without GGUF files; --quant {quant} does not apply.",
                "Drop --quant to download the checkpoint, or pull a GGUF repository of this model "
                "(see `hybridmoe models --catalogue`).",
            )
        chosen_set = gguf_sets.choose(sets, quant, where)
    by_path = {f.path: f for f in files}
    return Selection(
        "gguf",
        tuple(by_path[p] for p in chosen_set.files),
        quantization=chosen_set.label,
        weights_path=chosen_set.first,
        expected_parts=chosen_set.expected_parts,
    )


def _suggest(sets: Sequence[gguf_sets.GGUFSet]) -> str:
    """Q4_K_M when there is one (the usual size/quality balance), else the first set."""
    for s in sets:
        if s.label.upper() == "Q4_K_M":
            return s.label
    return sets[0].label
