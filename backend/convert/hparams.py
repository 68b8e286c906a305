"""A Hugging Face text config as llama.cpp's ``{arch}.*`` metadata keys.

This is the inverse of the families' ``config_from_gguf`` (``hybridmoe.backend.models.families``):
what those read, this writes, under the key names llama.cpp's model loaders look up. The
keys every architecture shares are written by ``gguf_keys``; the rest by the family's own
writer, ``models/families/<family>/gguf.py``. A config that llama.cpp's graph for the
architecture cannot represent (a routing variant it hard-codes differently, dense layers
where it expects experts, sliding windows it does not implement) is refused there, before
anything is written, rather than converted into a file that loads and then computes
something else.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import gguf

from hybridmoe.backend.convert.gguf_keys import USE_GGUF, ArchWriter, GGUFKeys
from hybridmoe.backend.errors import UnsupportedModelError
from hybridmoe.backend.models.families import FAMILIES
from hybridmoe.backend.models.hf_config import HFConfig


def _writer_module(family: ModuleType) -> str:
    # Imported by name, not at the top: a family's writer imports gguf_keys from this
    # package, and the registry knows nothing of writers.
    return f"{family.__name__}.gguf"


def convertible_families() -> tuple[ModuleType, ...]:
    """The registry's families whose folder holds a GGUF writer."""
    return tuple(f for f in FAMILIES if importlib.util.find_spec(_writer_module(f)) is not None)


def _family(name: str, source: str) -> ModuleType:
    for family in convertible_families():
        if family.FAMILY == name:
            return family
    raise UnsupportedModelError(
        f"{source}: converting {name} checkpoints to GGUF is not supported yet "
        f"(supported: {', '.join(sorted(f.FAMILY for f in convertible_families()))}).",
        USE_GGUF,
    )


def gguf_arch(family: str, source: str) -> str:
    return _family(family, source).GGUF_ARCH


def write_hparams(writer: gguf.GGUFWriter, family: str, config: Mapping[str, Any], n_layers: int,
                  source: str, n_mtp: int = 0) -> None:
    """Write the architecture keys of `config` (a text config) for `family`; `n_mtp` NextN
    layers kept after the `n_layers` decoder layers count as blocks too (glm4moe)."""
    cfg = HFConfig(dict(config), source)
    fam = _family(family, source)
    arch: ArchWriter = importlib.import_module(_writer_module(fam)).WRITER
    keys = GGUFKeys(writer, cfg, source, fam, n_mtp)
    keys.common(n_layers + n_mtp, head_count_kv=1 if arch.one_kv_head else None)
    arch.write(keys, cfg)
