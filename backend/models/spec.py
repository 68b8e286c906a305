"""What a model is, independent of where it was read from (config.json or GGUF metadata).

``ModelSpec`` holds the shape facts the planner and the engine need. ``config`` keeps the
model's text configuration in Hugging Face form (for a GGUF, translated from its metadata
keys by the family module), so the engine reads one vocabulary whatever the source.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Positions a sliding-window layer's cache keeps beyond its window, so that a conversation can
# be rewound that far (regenerating an answer) without a new prefill. The engine allocates
# them and the planner counts them (docs/sizing.md §2).
SLIDING_REWIND_TOKENS = 1024
# The engine's KV cache is handed out in blocks of this many positions, so a conversation
# takes memory as it grows and conversations can share the blocks of a common prefix. The
# planner counts whole blocks, as the engine allocates them.
KV_BLOCK_TOKENS = 64


@dataclass(frozen=True)
class Routing:
    """How a MoE layer's router chooses its experts and weighs them, as transformers does.

    scoring: "softmax" over all experts, "sigmoid" per expert, or "topk_softmax" (softmax
        over the top k logits only: GPT-OSS).
    method: "greedy" (top k of all experts), "group_limited_greedy" (DeepSeek-V2: only the
        topk_group groups with the best single expert are eligible) or "noaux_tc"
        (DeepSeek-V3, GLM-4.5: a per-expert correction bias enters the choice, groups score
        their two best experts).
    normalize: the chosen weights are renormalised to sum to one.
    scaling: routed_scaling_factor, multiplied into the weights.
    """

    scoring: str = "softmax"
    method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    normalize: bool = False
    scaling: float = 1.0


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "deepseek", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "glm4_moe"
    architecture: str  # HF architectures[0] (e.g. "DeepseekV3ForCausalLM") or GGUF general.architecture
    hidden_size: int
    num_layers: int  # decoder layers used for text generation (MTP/NextN layers excluded)
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    attention: str  # "mla" or "gqa"
    max_context: int
    moe_layers: tuple[int, ...]  # indices of layers with routed experts
    dense_layers: tuple[int, ...]  # indices of layers with a plain MLP
    n_routed_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    shared_intermediate_size: int = 0  # total width of the shared-expert MLP (all shared experts)
    dense_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    # MLA (DeepSeek-V2/V3, Kimi K2): the compressed cache holds kv_lora_rank + qk_rope_head_dim.
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    # Sliding-window attention: layers listed here keep at most `sliding_window` tokens.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    routing: Routing = Routing()
    n_mtp_layers: int = 0  # multi-token-prediction / NextN layers (not loaded for chat)
    has_vision: bool = False
    vision_params: int = 0  # estimated weights of the vision tower + projector (from vision_config)
    # Storage format names (see hybridmoe.backend.models.formats) as the checkpoint holds them.
    expert_format: str = "bf16"
    other_format: str = "bf16"
    torch_dtype: str = "bfloat16"
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def params_per_expert(self) -> int:
        """Weights in one routed expert: gate, up and down projections."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layers)

    def kv_bytes_per_token(self, bytes_per_element: float = 2.0) -> float:
        """KV cache bytes one token occupies across all layers (docs/sizing.md §2).

        Sliding-window layers are included here; ``kv_bytes(context)`` caps them.
        """
        return self.kv_bytes_per_token_per_layer(bytes_per_element) * self.num_layers

    def kv_bytes_per_token_per_layer(self, bytes_per_element: float = 2.0) -> float:
        if self.attention == "mla":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * bytes_per_element
        return 2 * self.num_kv_heads * self.head_dim * bytes_per_element

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None when it attends to the whole context."""
        return self.sliding_window if self.sliding_window and layer in self.sliding_layers else None

    def kv_tokens(self, layer: int, context: int, rewind: int = SLIDING_REWIND_TOKENS) -> int:
        """Token slots `layer`'s cache may hold for one conversation of `context` tokens, in
        whole blocks of KV_BLOCK_TOKENS: all of them, or for a sliding-window layer what one
        call can need at once: the window before its first new token (which its queries read)
        and the last window + `rewind` positions (which the conversation keeps), each run
        starting and ending anywhere inside a block."""
        blocks = -(-context // KV_BLOCK_TOKENS)
        window = self.window_of(layer)
        if window is not None:
            reads = -(-(window - 1) // KV_BLOCK_TOKENS) + 1
            keeps = -(-(window + rewind) // KV_BLOCK_TOKENS) + 1
            blocks = min(blocks, reads + keeps)
        return blocks * KV_BLOCK_TOKENS

    def kv_bytes(self, context: int, bytes_per_element: float = 2.0) -> float:
        """KV cache bytes for one conversation of `context` tokens."""
        per_layer = self.kv_bytes_per_token_per_layer(bytes_per_element)
        return per_layer * sum(self.kv_tokens(i, context) for i in range(self.num_layers))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("config")
        return d
