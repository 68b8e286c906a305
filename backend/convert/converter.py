"""``to_gguf``: a Hugging Face safetensors checkpoint as one GGUF file for llama.cpp and the
embedded engine.

The steps, each in its own module: inspect the checkpoint (``hybridmoe.backend.models``: config,
family, damaged shards), plan the GGUF tensors (``tensor_plan``), choose each one's type
(``tensor_types``), translate the config and the tokenizer into metadata (``hparams``,
``vocab``), check the free disk space, then stream every tensor through its encoder
(``encode``) into the file (``gguf_file``). Q4_K_M goes through a BF16 intermediate and
llama.cpp's quantizer (``kquants``). ``stored_types`` then says what the file holds.

The output never replaces a file the conversion reads (whatever ``overwrite`` says: hours of
download would be lost), nor any other existing file unless ``overwrite``. Partial files
that a killed conversion of the same output left are removed before writing.

Checkpoint tensors are read through the engine's ``WeightSource`` (fp8 blocks and int4 packs
arrive as ``QuantTensor``). A fresh source is opened for each layer, so that the file mappings
of finished layers are released and the process's resident memory stays at about one layer's
pages plus the piece being encoded, not the whole checkpoint.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from hybridmoe.backend.convert import kquants
from hybridmoe.backend.convert.encode import encode, int4_to_q4_0, mxfp4_to_gguf, tensor_bytes
from hybridmoe.backend.convert.gguf_file import TensorSlot, check_free_space, padded_size, write_gguf
from hybridmoe.backend.convert.hparams import gguf_arch, write_hparams
from hybridmoe.backend.convert.tensor_plan import OutTensor, Piece, mtp_layers, plan_tensors
from hybridmoe.backend.convert.tensor_types import BLOCK_TYPES, FILE_TYPES, QUANTS, exact_copy_type, storage_type
from hybridmoe.backend.convert.vocab import vocab_from_hf
from hybridmoe.backend.formats.quant import QuantTensor
from hybridmoe.backend.formats.weights import SafetensorsWeights, WeightSource, text_model_weights
from hybridmoe.backend.errors import ModelError, UsageError
from hybridmoe.backend.files import partial_path, sweep_stale_partials, write_error
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.models.gguf_reader import open_gguf_file
from hybridmoe.backend.session import CancelToken, ProgressCallback

log = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType

# Encoder threads: the numpy encoders release the GIL, so pieces encode in parallel.
WORKERS = os.cpu_count() or 1


def default_output_path(model_dir: str | Path, quant: str, name: str | None = None) -> Path:
    """``<folder>-<QUANT>.gguf`` next to the model folder; for a Hugging Face cache snapshot
    (whose parent is the cache's internals) ``<org>--<model>-<QUANT>.gguf`` in the current
    directory."""
    model_dir = Path(model_dir).expanduser().resolve()
    if model_dir.parent.name == "snapshots":
        stem = (name or model_dir.parent.parent.name.removeprefix("models--")).replace("/", "--")
        return Path.cwd() / f"{stem}-{quant.upper()}.gguf"
    return model_dir.parent / f"{model_dir.name}-{quant.upper()}.gguf"


def to_gguf(model_dir: str | Path, out_path: str | Path, quant: str = "q8_0",
            on_progress: ProgressCallback | None = None, cancel: CancelToken | None = None,
            overwrite: bool = False) -> Path:
    """Convert the safetensors checkpoint in `model_dir` to the GGUF file `out_path`.

    `quant`: "bf16", "q8_0", "q4_0" or "q4_k_m". Progress events carry bytes written of the
    estimated total (stage "convert"; "quantize" for the second pass of q4_k_m). Raises
    ModelError / UnsupportedModelError for checkpoints that cannot be converted, Cancelled when
    `cancel` fires, HybridMoeError for a full disk, UsageError when `out_path` exists (unless
    `overwrite`) or is a file of the checkpoint (always); no partial file is left in any case.
    """
    quant = str(quant).lower()
    if quant not in QUANTS:
        raise UsageError(f"Unknown quantization {quant!r}.", "Choose one of: " + ", ".join(QUANTS) + ".")
    model_dir = Path(model_dir).expanduser()
    out_path = Path(out_path).expanduser()
    if not out_path.parent.is_dir():
        raise UsageError(f"The output folder {out_path.parent} does not exist.", "Create it, or choose another --out.")

    inspected = inspect_model(model_dir)
    spec = inspected.spec
    source_name = str(model_dir / "config.json")
    arch = gguf_arch(spec.family, source_name)
    if inspected.kind != "safetensors":
        what = "only a config.json" if inspected.kind == "config" else "a GGUF model already"
        raise ModelError(
            f"{model_dir} is not a Hugging Face safetensors checkpoint: it holds {what}.",
            "Give the folder holding config.json and the *.safetensors shards (download them first).",
        )
    _check_output(out_path, model_dir, overwrite)
    config = spec.config

    weights = text_model_weights(SafetensorsWeights(model_dir))
    n_mtp = mtp_layers(weights, arch, config, spec.num_layers, location=str(model_dir))
    plan = plan_tensors(weights, arch, config, spec.num_layers, location=str(model_dir), n_mtp=n_mtp)
    del weights
    embd = next((t for t in plan if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelError(f"{model_dir} has no token embedding (model.embed_tokens.weight).",
                         "The checkpoint is incomplete; download it again.")
    vocab = vocab_from_hf(model_dir, spec.family, vocab_size=embd.shape[0])
    if len(vocab.tokens) != embd.shape[0]:
        raise ModelError(
            f"{model_dir}: the tokenizer has {len(vocab.tokens)} tokens but the embedding has "
            f"{embd.shape[0]} rows.",
            "The tokenizer files do not belong to this checkpoint; download them again.",
        )

    types = {t.name: storage_type(t, quant) for t in plan}
    sweep_stale_partials(out_path)  # before the free-space check: they may be what fills the disk
    sources = _LayerSources(model_dir)
    pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="convert")
    slots = [_slot(t, types[t.name], sources, pool) for t in plan]
    size = padded_size(slots)

    def metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_name(spec.name)
        writer.add_file_type(FILE_TYPES[quant])
        if any(q not in (Q.F32, Q.F16, Q.BF16) for q in types.values()):
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        write_hparams(writer, spec.family, config, spec.num_layers, source_name, n_mtp=n_mtp)
        vocab.write(writer)

    try:
        if quant == "q4_k_m":
            return _via_llama_quantizer(out_path, arch, metadata, slots, plan, types, on_progress, cancel)
        check_free_space(out_path.parent, size, f"{out_path.name} ({quant.upper()})")
        log.info("converting %s to %s (%d tensors, %d bytes)", model_dir, out_path, len(slots), size)
        return write_gguf(out_path, arch, metadata, slots, on_progress=on_progress, cancel=cancel)
    finally:
        pool.shutdown(cancel_futures=True)


def _via_llama_quantizer(out_path: Path, arch: str, metadata, slots: list[TensorSlot], plan: list[OutTensor],
                         types: dict[str, Q], on_progress: ProgressCallback | None,
                         cancel: CancelToken | None) -> Path:
    """Q4_K_M: a BF16 intermediate next to the target, then llama.cpp's quantizer; both
    files are checked for room up front and the intermediate is always removed. Tensors
    copied exactly from the checkpoint (int4 -> Q4_0, MXFP4) are named to the quantizer as
    already in their final type, so that it keeps them rather than re-quantizing them."""
    final = _q4_k_m_estimate(plan, types)
    check_free_space(out_path.parent, padded_size(slots) + final,
                     f"{out_path.name} (Q4_K_M, with its BF16 intermediate)")
    intermediate = partial_path(out_path.with_name(f"{out_path.name}.bf16"))
    tmp = partial_path(out_path)
    try:
        write_gguf(intermediate, arch, metadata, slots, on_progress=on_progress, cancel=cancel)
        keep = {t.name: types[t.name] for t in plan if exact_copy_type(t) is not None}
        kquants.quantize(intermediate, tmp, "q4_k_m", expected_bytes=final, keep=keep,
                         on_progress=on_progress, cancel=cancel)
        tmp.replace(out_path)
    except OSError as exc:
        raise write_error(out_path, exc) from exc
    finally:
        intermediate.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return out_path


def _check_output(out_path: Path, model_dir: Path, overwrite: bool) -> None:
    """Refuse an `out_path` that is a folder, a file the conversion reads (under any name: a
    symlink, a hard link, a relative path), or, unless `overwrite`, any existing file."""
    if out_path.is_dir():
        raise UsageError(f"The output {out_path} is a folder.", "Give the path of the .gguf file to write with --out.")
    try:
        existing = out_path.stat()
    except FileNotFoundError:
        if out_path.is_symlink():  # a dangling link: replacing it loses the link
            existing = None
        else:
            return
    except OSError as exc:
        raise UsageError(f"The output {out_path} cannot be checked: {exc.strerror or exc}.",
                         "Choose another --out.") from exc
    if existing is not None and (existing.st_dev, existing.st_ino) in _checkpoint_files(model_dir):
        raise UsageError(
            f"The output {out_path} is a file of the checkpoint being converted ({model_dir}); "
            "writing the GGUF file there would destroy the checkpoint.",
            "Choose an output path that is not part of the checkpoint with --out (--force does not change this).",
        )
    if not overwrite:
        raise UsageError(f"The output {out_path} already exists.",
                         "Choose another path with --out, or add --force to replace it.")


def _checkpoint_files(model_dir: Path) -> set[tuple[int, int]]:
    """(device, inode) of every file in the checkpoint folder: the config, tokenizer, index
    and shards the converter reads, whatever names (symlinks into a Hugging Face cache's
    blobs, hard links) reach them."""
    return {(st.st_dev, st.st_ino) for st in _checkpoint_stats(model_dir)}


def _checkpoint_stats(model_dir: Path) -> Iterator[os.stat_result]:
    """os.stat (through symlinks) of every file of the checkpoint: the folder's, recursively."""
    paths = [model_dir] if model_dir.is_file() else (
        Path(root) / name for root, _, names in os.walk(model_dir) for name in names)
    for path in paths:
        try:
            yield path.stat()
        except OSError:
            continue  # a dangling link reads nothing


def is_current_conversion(out_path: str | Path, model_dir: str | Path) -> bool:
    """Whether `out_path` exists and was written after every file of the checkpoint in
    `model_dir` (a finished conversion is complete: it is renamed into place at the end)."""
    try:
        written = Path(out_path).stat().st_mtime
    except OSError:
        return False
    return all(written >= st.st_mtime for st in _checkpoint_stats(Path(model_dir)))


@dataclass(frozen=True)
class StoredTypes:
    """The GGML types a converted file holds, against the quantization asked for.

    ``by_type``: type name ("Q8_0", "F16", ...) -> tensor names, for every tensor.
    ``kept``: the weight matrices whose rows are not whole blocks of the requested type
    (``block`` weights), by the type they kept instead (llama.cpp's converter and quantizer
    fall back the same way); ``rows``: their row lengths. Vectors and routers are F32 and
    exact copies (int4 as Q4_0, MXFP4) keep their type by design: they are not counted there.
    """

    quant: str
    by_type: dict[str, list[str]]
    kept: dict[str, list[str]]
    block: int
    rows: tuple[int, ...]


def stored_types(path: str | Path, quant: str) -> StoredTypes:
    """Read the tensor directory of the converted `path` (no weights) and say which tensors
    took `quant` and which kept another type, and why."""
    quant = str(quant).lower()
    block = gguf.GGML_QUANT_SIZES[BLOCK_TYPES[quant]][0]
    by_type: dict[str, list[str]] = {}
    kept: dict[str, list[str]] = {}
    rows: set[int] = set()
    with open_gguf_file(path) as g:
        for t in g.tensors:
            qtype = Q(t.ggml_type)
            by_type.setdefault(qtype.name, []).append(t.name)
            copied = qtype == Q.Q4_0 and quant != "q4_0"  # Kimi's int4, copied exactly
            if len(t.ne) >= 2 and qtype not in (Q.F32, Q.MXFP4) and not copied and t.ne[0] % block:
                kept.setdefault(qtype.name, []).append(t.name)
                rows.add(int(t.ne[0]))
    return StoredTypes(quant, by_type, kept, block, tuple(sorted(rows)))


def _q4_k_m_estimate(plan: list[OutTensor], types: dict[str, Q]) -> int:
    total = 0
    for t in plan:
        if types[t.name] in (Q.F32,) or t.row % 256 or exact_copy_type(t) is not None:
            total += tensor_bytes(types[t.name], t.shape)
        else:
            total += int(t.n_weights * kquants.Q4_K_M_BITS / 8)
    return total


class _LayerSources:
    """Opens one weight source per layer (see the module doc) and hands it to the pieces of
    every tensor of that layer."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.layer: object = object()
        self.source: WeightSource | None = None

    def get(self, layer: int | None) -> WeightSource:
        if self.source is None or layer != self.layer:
            self.source = None  # drop the previous mappings first
            self.source = text_model_weights(SafetensorsWeights(self.model_dir))
            self.layer = layer
        return self.source


def _slot(t: OutTensor, qtype: Q, sources: _LayerSources, pool: ThreadPoolExecutor) -> TensorSlot:
    def pieces() -> Iterator[np.ndarray]:
        source = sources.get(t.layer)
        yield from _ordered_map(lambda piece: _encode_piece(piece, qtype, t), t.read(source), pool)

    return TensorSlot(t.name, t.shape, qtype, tensor_bytes(qtype, t.shape), pieces)


def _ordered_map(fn, items, pool: ThreadPoolExecutor) -> Iterator[np.ndarray]:
    """fn over items on the pool, results in order, at most two per worker in flight (so
    memory stays at a few pieces however large the tensor)."""
    window = 2 * WORKERS
    pending: deque[Future] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()


def _encode_piece(piece: Piece, qtype: Q, t: OutTensor) -> np.ndarray:
    if isinstance(piece, QuantTensor):
        copy = exact_copy_type(t)
        if qtype == copy == Q.Q4_0:
            return int4_to_q4_0(piece)
        if qtype == copy == Q.MXFP4:
            return mxfp4_to_gguf(piece)
        piece = piece.dequantize(torch.float32)
    return encode(piece, qtype)
