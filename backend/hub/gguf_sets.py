"""GGUF file sets and their quantization names, read from file names alone.

A GGUF repository (unsloth, bartowski, ggml-org, ...) or a models folder holds one *set* per
quantization: a single ``Model-Q8_0.gguf``, or a split set ``Model-Q4_K_M-00001-of-00003.gguf``
..., often in a folder named after the quantization (``Q4_K_M/``, ``UD-Q4_K_XL/``). The
quantization is named in the file name (or, failing that, the folder): that name is what a
user types after ``--quant`` and what the listings print. The files are never opened here,
so a repository can be sized and chosen from before anything is downloaded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from hybridmoe.backend.errors import UsageError
from hybridmoe.backend.models.gguf_files import SPLIT_NAME
from hybridmoe.backend.models.model_files import is_projector
from hybridmoe.backend.units import fmt_bytes

# A quantization token: llama.cpp's types and mixes (Q4_K_M, Q8_0, IQ2_XXS, TQ1_0, BF16,
# MXFP4, ...) with unsloth's "UD-" (dynamic) prefix. It must stand alone between
# non-alphanumerics, so "Qwen3" or "A3B" never read as one; the last one in a name wins,
# because a model name comes first and the quantization last.
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q[1-8](?:_[0-9A-Z]+)*|TQ[12]_0|BF16|FP?16|FP?32|MXFP4(?:_MOE)?))(?![A-Za-z0-9])",
    re.IGNORECASE,
)


def is_gguf_name(path: str) -> bool:
    """A model GGUF in a repository's listing; multimodal projectors are GGUF files but not
    models (the rule of models.model_files.is_projector, which local files follow too)."""
    name = PurePosixPath(path).name
    return name.lower().endswith(".gguf") and not is_projector(name)


def quant_label(path: str) -> str:
    """The quantization a GGUF file's name (or its folder's) gives, e.g. ``Q4_K_M``,
    ``UD-Q4_K_XL``, ``Q4_K_M-V2`` (a variant suffix is kept so different sets keep different
    names); the bare stem when no quantization is named."""
    p = PurePosixPath(path)
    m = SPLIT_NAME.match(p.name)
    stem = m.group("stem") if m else p.name[: -len(".gguf")] if p.name.lower().endswith(".gguf") else p.stem
    for text in (stem, p.parent.name):
        found = list(_QUANT.finditer(text))
        if found:
            last = found[-1]
            rest = text[last.end():].strip("-._ ")
            return last.group(1).upper() + (f"-{rest}" if rest else "")
    return stem


@dataclass(frozen=True)
class GGUFSet:
    """One GGUF model: a single file or all parts of a split set."""

    label: str  # quantization name
    files: tuple[str, ...]  # relative (POSIX) paths, part 1 first
    size_bytes: int
    expected_parts: int  # what the split names say (1 for a single file)

    @property
    def first(self) -> str:
        return self.files[0]

    @property
    def complete(self) -> bool:
        return len(self.files) == self.expected_parts


def gguf_sets(files: Iterable[tuple[str, int | None]]) -> list[GGUFSet]:
    """Group ``(relative path, size)`` pairs into GGUF sets, sorted by quantization name."""
    groups: dict[tuple[str, str], list[tuple[int, str, int]]] = {}
    counts: dict[tuple[str, str], int] = {}
    for path, size in files:
        if not is_gguf_name(path):
            continue
        p = PurePosixPath(path)
        m = SPLIT_NAME.match(p.name)
        key = (str(p.parent), m.group("stem") if m else p.name)
        groups.setdefault(key, []).append((int(m.group("no")) if m else 1, path, size or 0))
        counts[key] = int(m.group("count")) if m else 1
    sets = []
    for key, parts in groups.items():
        parts.sort()
        sets.append(GGUFSet(
            label=quant_label(parts[0][1]),
            files=tuple(path for _, path, _ in parts),
            size_bytes=sum(size for _, _, size in parts),
            expected_parts=counts[key],
        ))
    return sorted(sets, key=lambda s: (s.label.upper(), s.first))


def describe(sets: Sequence[GGUFSet]) -> str:
    """One line per set: name, files, size (what ``--quant`` choices are printed as)."""
    width = max((len(s.label) for s in sets), default=0)
    lines = []
    for s in sets:
        parts = f"{len(s.files)} files" if len(s.files) > 1 else "1 file"
        where = f"  ({s.first})" if sum(t.label.upper() == s.label.upper() for t in sets) > 1 else ""
        lines.append(f"  {s.label.ljust(width)}  {parts:>9}  {fmt_bytes(s.size_bytes):>11}{where}")
    return "\n".join(lines)


def choose(sets: Sequence[GGUFSet], quant: str, where: str) -> GGUFSet:
    """The set ``quant`` names: a quantization name (any case), or the path of the set's
    first file when one name covers several sets. ``where`` names the repo or folder."""
    wanted = quant.strip()
    by_label = [s for s in sets if s.label.upper() == wanted.upper()]
    if len(by_label) == 1:
        return by_label[0]
    by_path = [s for s in sets if wanted.lower() in (f.lower() for f in s.files)]
    if len(by_path) == 1:
        return by_path[0]
    if len(by_label) > 1:
        raise UsageError(
            f"{where} holds {len(by_label)} GGUF sets named {by_label[0].label}:\n{describe(by_label)}",
            f"Pass --quant with the path of the one you want, e.g. --quant {by_label[0].first}",
        )
    if not sets:
        raise UsageError(f"{where} holds no GGUF files, so --quant {quant} does not apply.",
                         "Drop --quant to download the safetensors checkpoint.")
    raise UsageError(
        f"{where} has no {quant} quantization. It has:\n{describe(sets)}",
        "Pass one of these names with --quant.",
    )
