"""The Hugging Face text configuration as the engine and the converter read it (torch-free:
here in models/, so that the converter and every family's ``gguf`` module import it without
importing the engine).

The model's shape (layers, heads, sliding windows, routing) is the ``ModelSpec``'s; the engine
reads from the config dict (``ModelSpec.config``: the text part of config.json, or a GGUF's
metadata in Hugging Face keys) only what the spec does not carry, such as rotary parameters
and norm epsilons. Two vintages of that dict exist: hub checkpoints
write ``rope_theta`` / ``rope_scaling`` at the top level, transformers 5 writes a
``rope_parameters`` dict; both are read here so that model code sees one vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridmoe.backend.errors import ModelError, UnsupportedModelError


@dataclass(frozen=True)
class RopeParams:
    """RoPE settings in transformers' standardised form (``rope_parameters``)."""

    kind: str  # "default", "linear", "llama3" or "yarn"
    theta: float
    partial_rotary_factor: float
    extra: dict[str, Any]  # factor, beta_fast, mscale, original_max_position_embeddings, ...

    def get(self, key: str, default: Any = None) -> Any:
        value = self.extra.get(key)
        return default if value is None else value


class HFConfig:
    """Typed reads of a text config dict, with the family's transformers defaults."""

    def __init__(self, config: dict[str, Any], source: str = "config.json"):
        self.raw = config
        self.source = source

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        value = self.raw.get(key)
        if value is None:
            raise ModelError(f"{self.source} has no {key!r}, which this model needs")
        return value

    def n_routed_experts(self) -> int:
        """Routed experts per MoE layer. The key varies: hub Qwen3-MoE writes num_experts and
        transformers 5 writes num_local_experts for the same model; DeepSeek/GLM use
        n_routed_experts."""
        for key in ("n_routed_experts", "num_experts", "num_local_experts"):
            if self.raw.get(key) is not None:
                return int(self.raw[key])
        return 0

    @property
    def model_type(self) -> str:
        return str(self.raw.get("model_type") or "")

    def rope(self, *, default_theta: float = 10000.0, default_partial: float = 1.0) -> RopeParams:
        params = dict(self.raw.get("rope_parameters") or self.raw.get("rope_scaling") or {})
        # A per-layer-type nested dict (some newer models) is not one of ours; refuse clearly.
        if params and all(isinstance(v, dict) for v in params.values()):
            raise UnsupportedModelError(
                f"{self.source}: per-layer rope parameters are not supported by the embedded engine",
                "Run this model with `--backend llamacpp`.",
            )
        kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
        params.pop("type", None)
        theta = params.pop("rope_theta", None) or self.raw.get("rope_theta") or default_theta
        partial = params.pop("partial_rotary_factor", None)
        if partial is None:
            partial = self.raw.get("partial_rotary_factor", default_partial)
        if kind in ("llama3", "yarn") and params.get("original_max_position_embeddings") is None:
            params["original_max_position_embeddings"] = self.raw.get(
                "original_max_position_embeddings", self.raw.get("max_position_embeddings")
            )
        if kind not in ("default", "linear", "llama3", "yarn"):
            raise UnsupportedModelError(
                f"{self.source}: rope type {kind!r} is not supported by the embedded engine",
                "Run this model with `--backend llamacpp`.",
            )
        return RopeParams(kind=kind, theta=float(theta), partial_rotary_factor=float(partial), extra=params)
