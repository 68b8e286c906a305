"""Synthetic MoE layers: random stored expert weights in every format the native kernels
read, and the layer objects the engine builds from them (ExpertStore -> HostExperts). The
kernel benchmark (``hybridmoe.backend.bench.kernels``) and the native tests (tests/native) use them.

The bytes are random codes with sane scales rather than quantized real weights: every bit
of every field is exercised (all nibble values, all 6-bit K-quant scales and mins, both
signs of a q4_0 / q8_0 scale), which is what a layout test needs, and a layer of any size
is made in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hybridmoe.backend.models.layer_description import CLAMPED_SWIGLU
from hybridmoe.backend.engine.experts import ExpertActivation, ExpertStore, HostExperts
from hybridmoe.backend.formats.quant import QuantTensor, from_compressed_int4, from_gguf, from_mxfp4

# The GGUF types of the community mixes (q4_1 .. iq1_m): their scales are set by measuring the
# spread of random blocks (_unit_spread) rather than by a hand-worked divisor.
IQ_FORMATS = ("q4_1", "q5_1", "iq4_nl", "iq4_xs", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")
GGUF_FORMATS = ("q8_0", "q4_0", "q5_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "mxfp4") + IQ_FORMATS
HF_FORMATS = ("mxfp4_hf", "int4_g32")
FLOAT_FORMATS = ("bf16", "f16", "f32")
ALL_FORMATS = GGUF_FORMATS + HF_FORMATS + FLOAT_FORMATS
PREFIX = "model.layers.0.mlp"


def block_of(fmt: str) -> int:
    if fmt in GGUF_FORMATS:
        return GGML_QUANT_SIZES[GGMLQuantizationType[fmt.upper()]][0]
    return 32 if fmt in HF_FORMATS else 1


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


# Q4_1 / Q5_1: the min that centres uniform codes 0..15 / 0..31 on zero, in units of d.
_CENTRE = {"q4_1": 7.5, "q5_1": 15.5}


def _set_block_scale(data: np.ndarray, fmt: str, d: np.ndarray) -> None:
    """Write the super-block (or block) scale `d` [n] into blocks `data` [n, block bytes] of an
    IQ_FORMATS type, with Q4_1/Q5_1's min set to centre the codes."""
    h = d.astype(np.float16).view(np.uint16)
    if fmt == "iq1_m":  # d is the top nibbles of the four 16-bit scale words (bytes 48-55)
        words = data[:, 48:56].copy().view(np.uint16)
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((h >> (4 * i)) & 0xF) << 12)
        data[:, 48:56] = words.view(np.uint8)
        return
    data[:, 0:2] = h.view(np.uint8).reshape(-1, 2)
    if fmt in _CENTRE:
        data[:, 2:4] = _f16_bytes(-_CENTRE[fmt] * h.view(np.float16).astype(np.float32))


@lru_cache(maxsize=None)
def _unit_spread(fmt: str) -> float:
    """The standard deviation of the values of random `fmt` blocks whose scale d is 1 (the
    grid values times their sub-block scales), measured once on 256 blocks."""
    qtype = GGMLQuantizationType[fmt.upper()]
    block, size = GGML_QUANT_SIZES[qtype]
    data = np.random.default_rng(0).integers(0, 256, size=(256, size), dtype=np.uint8)
    _set_block_scale(data, fmt, np.ones(256, np.float32))
    return float(from_gguf(data, qtype, (256, block)).dequantize().std())


def random_matrix(rng: np.random.Generator, fmt: str, shape: tuple[int, ...], scale: float = 0.05) -> Any:
    """A stored [..., rows, K] tensor of `fmt` (QuantTensor, or a torch tensor for floats)
    whose values have a standard deviation of about `scale` (the block scales are divided
    by the spread of the codes they multiply)."""
    *lead, rows, K = shape
    if fmt in FLOAT_FORMATS:
        dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[fmt]
        w = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) * scale
        return w.to(dtype)
    if fmt == "int4_g32":
        packed = rng.integers(0, 2**32, size=(*lead, rows, K // 8), dtype=np.uint64).astype(np.uint32).view(np.int32)
        scales = rng.uniform(0.3, 1.7, size=(*lead, rows, K // 32)) * (scale / 4.6) * np.where(
            rng.random((*lead, rows, K // 32)) < 0.5, -1, 1)
        return from_compressed_int4(torch.from_numpy(packed), torch.from_numpy(scales.astype(np.float32)).to(torch.bfloat16),
                                    (*lead, rows, K))
    if fmt == "mxfp4_hf":
        blocks = rng.integers(0, 256, size=(*lead, rows, K // 32, 16), dtype=np.uint8)
        scales = rng.integers(118, 124, size=(*lead, rows, K // 32), dtype=np.uint8)  # 2^-10 .. 2^-5
        return from_mxfp4(torch.from_numpy(blocks), torch.from_numpy(scales))
    qtype = GGMLQuantizationType[fmt.upper()]
    block, size = GGML_QUANT_SIZES[qtype]
    nb = math.prod(shape) // block
    data = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)

    def scales(n: int, signed: bool) -> np.ndarray:
        s = rng.uniform(0.3, 1.7, size=n) * scale
        return s * np.where(rng.random(n) < 0.5, -1, 1) if signed else s

    # Divisors: the spread of what each scale multiplies (uniform codes; 6-bit sub-block
    # scales average 32; q6_k's int8 scales about 73).
    if fmt in ("q8_0", "q4_0", "q5_0"):
        data[:, 0:2] = _f16_bytes(scales(nb, True) / {"q8_0": 73, "q4_0": 4.6, "q5_0": 9.2}[fmt])
    elif fmt in ("q4_k", "q5_k"):
        spread = 36.5 * (4.6 if fmt == "q4_k" else 9.2)  # rms of 6-bit scales times the codes' spread
        d = scales(nb, False) / spread
        # Each sub-block's min equal to its scale and dmin = d x the codes' mean (7.5 / 15.5),
        # so every sub-block is centred on zero as a quantizer's output is: random mins would
        # shift whole rows by about their spread, and a model built of such rows attends and
        # routes near-argmax (a chaotic model, no test of accuracy). The 12 scale bytes:
        # mins 0-3 in bytes 4-7 (= scales 0-3, bytes 0-3), scales/mins 4-7 the low/high
        # nibbles of bytes 8-11, their top bits in those of bytes 0-3 / 4-7.
        data[:, 0:2] = _f16_bytes(d)
        data[:, 2:4] = _f16_bytes(d * (7.5 if fmt == "q4_k" else 15.5))
        data[:, 8:12] = data[:, 4:8]
        data[:, 12:16] = (data[:, 12:16] & 0x0F) * 0x11
    elif fmt == "q6_k":
        data[:, 208:210] = _f16_bytes(scales(nb, False) / (73 * 18))
    elif fmt == "q3_k":  # 6-bit scales less 32 (about 16 in size) times codes -4..3
        data[:, 108:110] = _f16_bytes(scales(nb, False) / (16 * 2.3))
    elif fmt == "q2_k":  # 4-bit scales (rms 8.8) times codes 0..3, centred as q4_k's above
        d = scales(nb, False) / (8.8 * 1.12)
        data[:, 80:82] = _f16_bytes(d)
        data[:, 82:84] = _f16_bytes(d * 1.5)
        data[:, 0:16] = (data[:, 0:16] & 0x0F) * 0x11  # each sub-block's min nibble = its scale's
    elif fmt == "mxfp4":
        data[:, 0] = rng.integers(118, 124, size=nb)
    elif fmt in IQ_FORMATS:  # d over the measured spread of what it multiplies; iq4_nl's d signed
        _set_block_scale(data, fmt, scales(nb, fmt == "iq4_nl") / _unit_spread(fmt))
    return from_gguf(data.reshape(*lead, rows, K // block * size), qtype, shape)


class DictWeights:
    """A WeightSource over a dict (HF names -> stored objects)."""

    def __init__(self, tensors: dict[str, Any]):
        self.tensors = tensors

    def get(self, name: str) -> Any:
        return self.tensors[name]

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def __contains__(self, name: object) -> bool:
        return name in self.tensors


def make_host_experts(
    rng: np.random.Generator,
    fmt: str,
    E: int,
    H: int,
    I: int,
    cpu_ids: Collection[int],
    *,
    down_fmt: str | None = None,
    layout: str = "fused",
    act: str = "silu",
    biases: bool = False,
    limit: float = 7.0,
    merged: dict[str, Any] | None = None,
) -> HostExperts:
    """One layer's routed experts stored as `fmt` (down as `down_fmt`), the ones in `cpu_ids`
    left in host memory. layout "fused": merged gate_up [E, 2I, H] (GPT-OSS: interleaved
    rows) and down [E, H, I]; "per_expert": one tensor per expert and projection, views of
    merged gate / up [E, I, H] and down [E, H, I] tensors (GGUF's ffn_*_exps). Pass an
    empty dict as `merged` to get those merged tensors back (the benchmark hands them to
    kt-kernel)."""
    down_fmt = down_fmt or fmt
    gpt_oss = act == "gpt_oss"
    tensors: dict[str, Any] = {}
    down = random_matrix(rng, down_fmt, (E, H, I))
    if merged is not None:
        merged["down"] = down
    if layout == "fused":
        tensors[f"{PREFIX}.experts.gate_up_proj"] = random_matrix(rng, fmt, (E, 2 * I, H))
        tensors[f"{PREFIX}.experts.down_proj"] = down
        if gpt_oss:  # the fused GPT-OSS layout always has biases
            tensors[f"{PREFIX}.experts.gate_up_proj_bias"] = torch.from_numpy(rng.standard_normal((E, 2 * I)).astype(np.float32))
            tensors[f"{PREFIX}.experts.down_proj_bias"] = torch.from_numpy(rng.standard_normal((E, H)).astype(np.float32))
    else:
        gate = random_matrix(rng, fmt, (E, I, H))
        up = random_matrix(rng, fmt, (E, I, H))
        if merged is not None:
            merged.update(gate=gate, up=up)
        for e in range(E):
            p = f"{PREFIX}.experts.{e}"
            for name, w, rows in (("gate_proj", gate, I), ("up_proj", up, I), ("down_proj", down, H)):
                tensors[f"{p}.{name}.weight"] = w[e]
                if biases:
                    tensors[f"{p}.{name}.bias"] = torch.from_numpy(rng.standard_normal(rows).astype(np.float32))
    store = ExpertStore(DictWeights(tensors), PREFIX, E, H, I, fused_xw_with_biases=gpt_oss)
    activation = ExpertActivation(CLAMPED_SWIGLU, limit=limit, interleaved=True) if gpt_oss else ExpertActivation(act)
    return HostExperts(store, cpu_ids, torch.float32, activation)


def random_routing(rng: np.random.Generator, T: int, E: int, k: int, pad: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] (distinct experts per token; a fraction `pad` replaced by -1) and
    positive topk_weights [T, k]."""
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int64)
    if pad:
        ids[rng.random((T, k)) < pad] = -1
    w = rng.random((T, k)).astype(np.float32) + 0.1
    return torch.from_numpy(ids), torch.from_numpy(w / w.sum(1, keepdims=True))


def stored_nbytes(w: Any) -> int:
    return w.nbytes if isinstance(w, QuantTensor) else w.numel() * w.element_size()
