"""The GGML type each tensor is stored in, for each output quantization.

The rules follow llama.cpp's (convert_hf_to_gguf.py and llama-quantize):

* norms, biases and other 1-D tensors, and the MoE router (``ffn_gate_inp``), stay F32:
  they are tiny, and llama.cpp's kernels expect them in F32;
* everything else takes the requested type; a tensor whose rows are not whole blocks of that
  type falls back to F16, as llama.cpp's converter does;
* ``q4_0``: the output head is stored Q8_0 (llama-quantize uses Q6_K there, which cannot be
  produced here; either way the head keeps more precision than the bulk);
* ``q4_k_m``: an intermediate BF16 file for llama.cpp's own quantizer, which then applies its
  Q4_K_M mix (Q6_K for half the down projections, attention V and the head);
* checkpoint weights already in compressed-tensors int4 (Kimi K2.x experts) are copied into
  Q4_0 whatever the target: it is the same 4-bit grid, so the copy is exact, and widening
  them would add bytes, not precision;
* GPT-OSS experts released in MXFP4 stay MXFP4 (GGML has the type; the blocks are repacked
  bit for bit) whatever the target, for the same reason and one more: the model was trained
  for that grid (quantization-aware), so Q8_0 or BF16 would only double or quadruple the
  bytes, and Q4_0 / Q4_K would re-quantize onto another 4-bit grid and lose precision at the
  same size. ``--quant`` then chooses the type of everything else (attention, embeddings,
  head), as llama.cpp's own converter does. A float (BF16) GPT-OSS checkpoint has no such
  grid to keep: its experts take the requested type like any other family's. Under
  ``q4_k_m`` the copies are handed to llama.cpp's quantizer as "keep this type", so they
  stay exact there too.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType, LlamaFileType

from hybridmoe.backend.convert.encode import fits
from hybridmoe.backend.convert.tensor_plan import OutTensor

Q = GGMLQuantizationType

QUANTS = ("bf16", "q8_0", "q4_0", "q4_k_m")

# general.file_type of the file this package writes itself (q4_k_m: the intermediate).
FILE_TYPES = {
    "bf16": LlamaFileType.MOSTLY_BF16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
    "q4_0": LlamaFileType.MOSTLY_Q4_0,
    "q4_k_m": LlamaFileType.MOSTLY_BF16,
}

_BULK = {"bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_k_m": Q.BF16}

# The block type whose size decides, for each quantization, which rows can take it (Q4_K_M:
# llama.cpp's K-quants, 256-weight super-blocks); other rows keep another type.
BLOCK_TYPES = {"bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_k_m": Q.Q4_K}


def is_int4_copy(t: OutTensor) -> bool:
    """Whether `t` is compressed-tensors int4 that maps onto Q4_0 blocks exactly."""
    if not t.source_format.startswith("int4_g"):
        return False
    group = int(t.source_format.removeprefix("int4_g"))
    return group % 32 == 0 and fits(Q.Q4_0, t.row)


def is_mxfp4_copy(t: OutTensor) -> bool:
    """Whether `t` is GPT-OSS MXFP4 (32-weight blocks, as GGML's MXFP4), kept as it is."""
    return t.source_format == "mxfp4" and fits(Q.MXFP4, t.row)


def exact_copy_type(t: OutTensor) -> GGMLQuantizationType | None:
    """The GGML type `t` is copied into without re-quantizing, or None if it is encoded."""
    if is_int4_copy(t):
        return Q.Q4_0
    if is_mxfp4_copy(t):
        return Q.MXFP4
    return None


def storage_type(t: OutTensor, quant: str) -> GGMLQuantizationType:
    if t.role in ("vector", "router"):
        return Q.F32
    copy = exact_copy_type(t)
    if copy is not None:
        return copy
    want = _BULK[quant]
    if quant == "q4_0" and t.role == "output":
        want = Q.Q8_0
    return want if fits(want, t.row) else Q.F16
