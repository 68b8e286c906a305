"""Model families: one folder per family, found by HF architecture / model_type or GGUF arch.

Everything hybridmoe knows about a family is in its folder, and every other package looks
the family up here (``family_by_name``, ``family_by_gguf_arch``) instead of keeping a table
of its own. A family folder ``<family>/`` holds two modules, neither importing torch or the
engine:

- ``__init__.py``: identity, config readers, tensor inventory and the layers as descriptions
  (below; so that inspecting and planning load no torch; the engine compiles the
  descriptions into its modules, ``engine/build_layers.py``);
- ``gguf.py``: the converter's writer of the family's llama.cpp keys,
  ``WRITER = ArchWriter(write, ...)`` over ``convert.gguf_keys.GGUFKeys``.

Adding a family is one new folder (plus its tests) and its name in ``FAMILIES`` below;
shared readers are in ``common``. Each folder's ``__init__`` declares (a test holds every
family to the whole list):

- identity: ``FAMILY``, ``DISPLAY_NAME``, ``HF_ARCHITECTURES``, ``MODEL_TYPES``,
  ``GGUF_ARCH`` (llama.cpp's architecture, read and written), ``GGUF_KEEPS_MTP`` (whether a
  GGUF keeps the NextN/MTP layers as extra blocks), ``ROUTER_FLOAT32`` (the engine holds the
  routers' matrices in float32 rather than the compute dtype: the planner counts them so);
- what the converter writes: ``LLAMA_PRE_TOKENIZERS`` (llama.cpp's names for the family's
  pre-tokenizer, most faithful first: several share one set of split expressions and differ
  in BOS handling and regex support), ``SPECIAL_TOKEN_ROLES`` ("eot", "eom", "bos" -> token
  texts, where the family's turns end otherwise than the converter's defaults say),
  ``RMS_EPS_DEFAULT``, ``ROPE_THETA_DEFAULT``, ``PARTIAL_ROTARY_DEFAULT`` (transformers'
  defaults where the config leaves them out: written by the converter, described to the
  engine), ``GGUF_PARTIAL_ROTARY`` (llama.cpp's graph rotates only the first
  rope.dimension_count dims of a head);
- how a GGUF names its tensors: ``GGUF_TENSOR_NAMES`` (block tensor names, after ``blk.N.``,
  whose HF name differs from the common one), ``GGUF_PERMUTES_QK`` (llama's q/k row order),
  ``GGUF_SPLITS_FUSED_EXPERTS`` (fused gate_up / down experts written as llama.cpp's per-projection
  tensors), ``GGUF_SPLITS_KV_B`` (MLA's kv_b_proj written as attn_k_b and attn_v_b),
  ``HF_NAME_ALIASES`` ((pattern, replacement) pairs: the family's own checkpoint names as the
  common ones a GGUF's tensors map to);
- and the functions

- ``spec_from_config(config, name, *, source) -> ModelSpec``
- ``config_from_gguf(metadata, *, source, tensor_shapes) -> dict`` (HF-style text config;
  a GGUF's spec is ``spec_from_config`` of it)
- ``expected_tensors(spec) -> Iterator[TensorShape]`` (the checkpoint's tensors, for sizing
  from the config alone)
- ``describe_layers(spec, loading) -> tuple[Layer, ...]`` (each decoder layer as the frozen
  description every executor compiles, ``models/layer_description``: what the engine builds
  its modules from, what ``plan`` names the decode path from before a load, and what the
  engine's built modules describe after one)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import ModuleType
from typing import Any

from hybridmoe.backend.errors import ModelError, UnsupportedModelError
from hybridmoe.backend.models.families import (
    deepseek,
    glm4_moe,
    gpt_oss,
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3_moe,
)
from hybridmoe.backend.models.spec import ModelSpec

FAMILIES: tuple[ModuleType, ...] = (deepseek, qwen3_moe, qwen2_moe, mixtral, olmoe, gpt_oss, glm4_moe)


def supported_models() -> str:
    """One line listing the supported families with their architecture names."""
    return "; ".join(
        f"{m.DISPLAY_NAME} ({', '.join(m.HF_ARCHITECTURES)}; GGUF {m.GGUF_ARCH})" for m in FAMILIES
    )


def family_by_name(family: str) -> ModuleType:
    for module in FAMILIES:
        if module.FAMILY == family:
            return module
    raise UnsupportedModelError(f"Unknown model family '{family}'.",
                                "Supported families: " + ", ".join(m.FAMILY for m in FAMILIES) + ".")


def _lookup(config: Mapping[str, Any]) -> ModuleType | None:
    archs = config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    for module in FAMILIES:
        if any(a in module.HF_ARCHITECTURES for a in archs if isinstance(a, str)):
            return module
    model_type = config.get("model_type")
    for module in FAMILIES:
        if model_type in module.MODEL_TYPES:
            return module
    return None


def family_for_config(config: Mapping[str, Any], source: str) -> ModuleType:
    if not isinstance(config, Mapping):
        raise ModelError(f"{source} does not hold a JSON object.",
                         "Restore the original config.json from the model repository.")
    module = _lookup(config)
    inner = config.get("text_config")
    if module is None and isinstance(inner, Mapping):
        # An unknown multimodal wrapper around a known language model.
        module = _lookup(inner)
    if module is None:
        archs = config.get("architectures") or []
        what = f"architecture {archs[0]!r}" if archs else "no 'architectures' entry"
        raise UnsupportedModelError(
            f"{source} describes a model with {what} (model_type {config.get('model_type')!r}), "
            "which hybridmoe does not support.",
            "Supported: " + supported_models() + ".",
        )
    return module


def family_for_gguf(metadata: Mapping[str, Any], source: str) -> ModuleType:
    arch = metadata.get("general.architecture")
    if not arch:
        raise ModelError(f"{source} has no 'general.architecture' key.",
                         "The GGUF file is damaged or was not written by llama.cpp's tools; "
                         "download it again.")
    module = family_by_gguf_arch(arch, source)
    if module is mixtral and not metadata.get(f"{arch}.expert_count"):
        raise UnsupportedModelError(
            f"{source} is a dense '{arch}' model (no {arch}.expert_count); hybridmoe runs "
            "Mixture-of-Experts models.",
            "Run dense models with llama.cpp directly, or pick an MoE model.",
        )
    return module


def family_by_gguf_arch(arch: str, source: str) -> ModuleType:
    """The family whose GGUFs have ``general.architecture`` `arch`."""
    for module in FAMILIES:
        if module.GGUF_ARCH == arch:
            return module
    raise UnsupportedModelError(
        f"{source} holds GGUF architecture {arch!r}, which hybridmoe does not support.",
        "Supported: " + supported_models() + ".",
    )


def spec_from_config(config: Mapping[str, Any], name: str, *, source: str = "config.json") -> ModelSpec:
    return family_for_config(config, source).spec_from_config(config, name, source=source)


def spec_from_gguf(metadata: Mapping[str, Any], name: str, *, source: str,
                   tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> ModelSpec:
    """The spec of a GGUF, its ``config`` translated to Hugging Face keys; ``architecture`` is
    the GGUF arch. Storage formats are filled in from the tensor types by the caller."""
    module = family_for_gguf(metadata, source)
    config = module.config_from_gguf(metadata, source=source, tensor_shapes=tensor_shapes)
    spec = module.spec_from_config(config, name, source=source)
    return replace(spec, architecture=str(metadata["general.architecture"]))
