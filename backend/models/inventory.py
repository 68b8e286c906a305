"""How many bytes a model holds of each tensor class (docs/sizing.md §1).

Built from real tensor lists (safetensors headers, GGUF tensor infos) when files are on
disk, or computed from the config for a chosen storage format when they are not; the
builders live in ``hybridmoe.backend.models.tensors``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass(frozen=True)
class TypeUse:
    """The tensors of one storage type (within a class): how many, their bytes, and the first
    of them in file order (what a message names)."""

    tensors: int
    bytes: int
    example: str

    def plus(self, tensors: int, nbytes: int) -> TypeUse:
        return TypeUse(self.tensors + tensors, self.bytes + nbytes, self.example)

    def to_dict(self) -> dict[str, Any]:
        return {"tensors": self.tensors, "bytes": self.bytes, "example": self.example}


@dataclass(frozen=True)
class GpuForm:
    """The always-read tensors of one class and storage type as the engine holds them on a GPU:
    as stored (a GGUF block type its kernels read), or `widened` to its compute dtype; how many,
    their stored bytes and elements, and the first of them (what the plan names)."""

    stored: str  # storage type, lower-case (q4_k, bf16, ...)
    widened: bool
    tensors: int
    bytes: int
    elements: int
    example: str

    def plus(self, tensors: int, nbytes: int, elements: int) -> GpuForm:
        return GpuForm(self.stored, self.widened, self.tensors + tensors, self.bytes + nbytes,
                       self.elements + elements, self.example)

    def held_bytes(self, element_bytes: int) -> int:
        """Bytes on the card, the widened ones at `element_bytes` an element (the compute dtype's)."""
        return self.elements * element_bytes if self.widened else self.bytes


class TensorClass(str, Enum):
    EMBEDDING = "embedding"
    ATTENTION = "attention"  # q/k/v/o, MLA projections, all norms
    DENSE_FFN = "dense_ffn"  # MLPs of dense layers
    SHARED_EXPERTS = "shared_experts"  # incl. Qwen2-MoE shared_expert_gate
    ROUTER = "router"  # gate.weight, e_score_correction_bias, router biases
    ROUTED_EXPERTS = "routed_experts"
    LM_HEAD = "lm_head"
    OTHER = "other"  # vision tower, MTP/NextN layers: not loaded for text chat


# Classes every decoded token reads in full: they go to the GPU first (docs/sizing.md §3).
ALWAYS_READ = (
    TensorClass.EMBEDDING,
    TensorClass.ATTENTION,
    TensorClass.DENSE_FFN,
    TensorClass.SHARED_EXPERTS,
    TensorClass.ROUTER,
    TensorClass.LM_HEAD,
)


@dataclass(frozen=True)
class TensorInventory:
    bytes_by_class: dict[TensorClass, int]
    # Routed-expert bytes of each MoE layer, keyed by layer index.
    routed_bytes_by_layer: dict[int, int]
    n_routed_experts: int
    source: str  # "safetensors", "gguf" or "config"
    expert_format: str  # storage format name of routed experts
    expert_bits_per_weight: float  # average, scales included
    files: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    # The routers' matrices (their vectors aside): elements and stored bytes. The engine holds a
    # router in its compute dtype whatever the file stores (GGUF files keep them in F32).
    router_matrix_params: int = 0
    router_matrix_bytes: int = 0
    # Always-read tensors the engine holds in its compute dtype on the CPU whatever the file
    # stores (the embedding table; MLA's kv_b stored whole, which latent attention reads whole
    # every token; vectors; matrices in a format the CPU kernels do not read): class -> (their stored
    # bytes, their elements).
    widened: dict[TensorClass, tuple[int, int]] = field(default_factory=dict)
    # The same on a GPU, where the engine holds the projections stored in a GGUF block type its
    # kernels read as stored (engine/stored_linear.py) and every other always-read tensor in its
    # compute dtype; and per class, type by type, which is which (what `plan` shows).
    gpu_widened: dict[TensorClass, tuple[int, int]] = field(default_factory=dict)
    gpu_forms: dict[TensorClass, tuple[GpuForm, ...]] = field(default_factory=dict)
    # The routers' score-correction biases (held in float32) and their other vectors (GPT-OSS'
    # biases, held like the matrices on a GPU): stored bytes and elements.
    router_float32_vectors: tuple[int, int] = (0, 0)
    router_vectors: tuple[int, int] = (0, 0)
    # What the engine's CPU copies of the weights take beyond the file's bytes (Q4_K matrices
    # in the kernels' row-interleaved layout, scales unpacked: 148 bytes a row and super-block
    # instead of 144), per class and, for the routed experts, per MoE layer.
    copy_extra: dict[TensorClass, int] = field(default_factory=dict)
    copy_extra_by_layer: dict[int, int] = field(default_factory=dict)
    # The storage types each class holds, as the files store them (GGUF types such as q4_k or
    # iq2_xxs, safetensors dtypes such as BF16): community "dynamic" GGUFs change types from
    # tensor to tensor and layer to layer, so one expert_format does not describe them.
    types_by_class: dict[TensorClass, dict[str, TypeUse]] = field(default_factory=dict)
    # The routed experts by the format the engine's CPU side reads them in (a GGUF type; for
    # a safetensors checkpoint its expert format, e.g. fp8_block, whose parts are stored in
    # several dtypes): in all, and per MoE layer in bytes (models.slow_paths reads these).
    routed_formats: dict[str, TypeUse] = field(default_factory=dict)
    routed_format_bytes_by_layer: dict[int, dict[str, int]] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_class.values())

    @property
    def routed_expert_bytes(self) -> int:
        return self.bytes_by_class.get(TensorClass.ROUTED_EXPERTS, 0)

    @property
    def always_read_bytes(self) -> int:
        return sum(self.bytes_by_class.get(c, 0) for c in ALWAYS_READ)

    def router_bytes_held(self, element_bytes: int) -> int:
        """The router class with its matrices at `element_bytes` an element (the compute dtype's):
        what a decoded token reads of it."""
        return (self.bytes_by_class.get(TensorClass.ROUTER, 0) - self.router_matrix_bytes
                + self.router_matrix_params * element_bytes)

    def held_bytes(self, cls: TensorClass, element_bytes: int, router_element_bytes: int) -> int:
        """What the engine holds of `cls` where it keeps the stored form (host RAM): as stored,
        but the widened tensors at `element_bytes` an element (the compute dtype's) and the
        routers' matrices at `router_element_bytes`."""
        if cls is TensorClass.ROUTER:
            return self.router_bytes_held(router_element_bytes)
        stored, elements = self.widened.get(cls, (0, 0))
        return self.bytes_by_class.get(cls, 0) - stored + elements * element_bytes + self.copy_extra.get(cls, 0)

    def gpu_held_bytes(self, cls: TensorClass, element_bytes: int, router_element_bytes: int) -> int:
        """What the engine holds of `cls` on a GPU: the widened tensors (``gpu_widened``) at
        `element_bytes` an element, the routers' matrices and vectors at `router_element_bytes`
        but their score-correction biases in float32, the rest as stored."""
        if cls is TensorClass.ROUTER:
            (f32_stored, f32_elements), (stored, elements) = self.router_float32_vectors, self.router_vectors
            return (self.router_bytes_held(router_element_bytes) - f32_stored + 4 * f32_elements
                    - stored + elements * router_element_bytes)
        stored, elements = self.gpu_widened.get(cls, (0, 0))
        return self.bytes_by_class.get(cls, 0) - stored + elements * element_bytes

    def host_bytes_per_expert(self, layer: int) -> float:
        """One routed expert of `layer` as the engine's CPU side holds and reads it."""
        return (self.routed_bytes_by_layer[layer] + self.copy_extra_by_layer.get(layer, 0)) / self.n_routed_experts

    def bytes_per_expert(self, layer: int) -> float:
        return self.routed_bytes_by_layer[layer] / self.n_routed_experts

    @property
    def types(self) -> dict[str, TypeUse]:
        """Every storage type of the model, the classes together, the most bytes first."""
        total: dict[str, TypeUse] = {}
        for uses in self.types_by_class.values():
            for name, use in uses.items():
                total[name] = total[name].plus(use.tensors, use.bytes) if name in total else use
        return dict(sorted(total.items(), key=lambda kv: (-kv[1].bytes, kv[0])))

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "expert_format": self.expert_format,
            "expert_bits_per_weight": self.expert_bits_per_weight,
            "total_bytes": self.total_bytes,
            "bytes_by_class": {c.value: b for c, b in self.bytes_by_class.items()},
            "routed_bytes_by_layer": {str(k): v for k, v in sorted(self.routed_bytes_by_layer.items())},
            "types": {name: use.to_dict() for name, use in self.types.items()},
            "types_by_class": {c.value: {name: use.to_dict() for name, use in sorted(uses.items(), key=lambda kv: -kv[1].bytes)}
                               for c, uses in self.types_by_class.items() if uses},
            "files": list(self.files),
            "notes": list(self.notes),
        }
