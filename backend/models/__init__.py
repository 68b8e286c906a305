"""Model inspection: config.json / GGUF metadata -> ModelSpec, tensor files -> TensorInventory."""

from hybridmoe.backend.models.inspect import InspectedModel, inspect_model, inspected
from hybridmoe.backend.models.inventory import TensorClass, TensorInventory
from hybridmoe.backend.models.spec import ModelSpec

__all__ = ["InspectedModel", "ModelSpec", "TensorClass", "TensorInventory", "inspect_model", "inspected"]
