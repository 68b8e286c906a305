"""Model inspection: config.json / GGUF metadata -> ModelSpec, tensor files -> TensorInventory."""

from backend.models.inspect import InspectedModel, inspect_model
from backend.models.inventory import TensorClass, TensorInventory
from backend.models.spec import ModelSpec

__all__ = ["InspectedModel", "ModelSpec", "TensorClass", "TensorInventory", "inspect_model"]
