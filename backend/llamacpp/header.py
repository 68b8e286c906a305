"""What a GGUF says about itself, read by ggml's own GGUF parser before llama.cpp loads it.

The backend checks the Plan against the file (the same MoE layers and expert count, override
patterns that match real tensors) before asking llama.cpp to place hundreds of gigabytes.
ggml's reader is the one llama.cpp will use, so a file it rejects is rejected for the same
reason, and it reads a 150k-token vocabulary's header in about 0.1 s (gguf-py's GGUFReader
takes tens of seconds for the same file).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.errors import ModelError
from backend.llamacpp import log
from backend.llamacpp.library import _GGUFInitParams, ggml
from backend.models.gguf_files import SPLIT_NAME, split_parts
from backend.plan.llamacpp import EXPERT_TENSORS

GGUF_MAGIC = b"GGUF"
_EXPERT_TENSOR = re.compile(rf"^blk\.(\d+)\.{EXPERT_TENSORS}\.")
_REDOWNLOAD = "The file is damaged or incomplete; download it again."


@dataclass(frozen=True)
class GGUFHeader:
    path: Path  # the file llama.cpp is given (the first part of a split set)
    files: tuple[Path, ...]
    values: dict[str, Any]  # scalar metadata (strings and numbers) of the first part
    tensor_names: tuple[str, ...]  # of every part

    @property
    def architecture(self) -> str:
        return str(self.values.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.values.get(f"{self.architecture}.{key}", default)

    @property
    def block_count(self) -> int:
        return int(self.arch_value("block_count", 0) or 0)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Blocks with routed-expert tensors, without the NextN/MTP blocks some converters keep
        at the end (llama.cpp does not run them for plain decoding, and plans leave them out)."""
        last = self.block_count - int(self.arch_value("nextn_predict_layers", 0) or 0)
        layers = {int(m.group(1)) for name in self.tensor_names if (m := _EXPERT_TENSOR.match(name))}
        return tuple(sorted(i for i in layers if not self.block_count or i < last))

    def chat_templates(self) -> dict[str, str]:
        """"default" (tokenizer.chat_template) and the named ones (tokenizer.chat_template.NAME)."""
        out = {}
        for key, value in self.values.items():
            if isinstance(value, str) and (key == "tokenizer.chat_template" or key.startswith("tokenizer.chat_template.")):
                out[key.removeprefix("tokenizer.chat_template").lstrip(".") or "default"] = value
        return out


def resolve_gguf(model_path: str | Path) -> Path:
    """The GGUF file llama.cpp should open for ``model_path``: the file itself, or the one GGUF
    model in a directory. Anything else gets a message saying what llama.cpp needs."""
    path = Path(model_path).expanduser()
    if not path.exists():
        raise ModelError(f"{path} does not exist.", "Check the path.")
    if path.is_dir():
        if (path / "config.json").is_file() and not any(path.glob("*.gguf")):
            raise ModelError(
                f"{path} is a Hugging Face checkpoint; the llama.cpp backend reads GGUF files only.",
                "Run it with `--backend engine`, or convert it to GGUF first.",
            )
        models = {}
        for f in sorted(path.glob("*.gguf")):
            if "mmproj" in f.name.lower():  # multimodal projectors are not language models
                continue
            m = SPLIT_NAME.match(f.name)
            key = m.group("stem") if m else f.stem
            if key not in models or (m and m.group("no") == "00001"):
                models[key] = f
        if len(models) != 1:
            found = ", ".join(f.name for f in models.values()) or "none"
            raise ModelError(f"{path} must hold exactly one GGUF model (found: {found}).",
                             "Give the path of the .gguf file to use.")
        path = next(iter(models.values()))
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelError(f"{path} cannot be read: {exc.strerror or exc}.", "Check that the file is readable.") from exc
    if magic != GGUF_MAGIC:
        raise ModelError(
            f"{path} is not a GGUF file (it does not start with 'GGUF'); the llama.cpp backend reads GGUF files only.",
            "Give a .gguf file, or run a Hugging Face checkpoint with `--backend engine`.",
        )
    m = SPLIT_NAME.match(path.name)
    if m and m.group("no") != "00001":  # llama.cpp finds the other parts from the first one
        path = path.with_name(f"{m.group('stem')}-00001-of-{m.group('count')}.gguf")
    return path


def read_header(model_path: str | Path) -> GGUFHeader:
    path = resolve_gguf(model_path)
    files = tuple(split_parts(path))
    values: dict[str, Any] = {}
    names: list[str] = []
    g = ggml()
    for i, part in enumerate(files):
        with log.capture() as captured:
            ctx = g.gguf_init_from_file(str(part).encode(), _GGUFInitParams(True, None))
        if not ctx:
            reason = captured.failure() or "ggml's GGUF reader refused it"
            raise ModelError(f"{part} cannot be read as GGUF: {reason}.", _REDOWNLOAD)
        try:
            if i == 0:
                for key_id in range(g.gguf_get_n_kv(ctx)):
                    value = g.gguf_value(ctx, key_id)
                    if value is not None:
                        values[g.gguf_get_key(ctx, key_id).decode("utf-8", errors="replace")] = value
            names += [g.gguf_get_tensor_name(ctx, t).decode("utf-8", errors="replace") for t in range(g.gguf_get_n_tensors(ctx))]
        finally:
            g.gguf_free(ctx)
    return GGUFHeader(path, files, values, tuple(names))
