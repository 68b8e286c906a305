"""Expert placement in llama.cpp's terms: the Plan's layout as tensor buffer-type overrides.

llama.cpp places routed experts a whole layer at a time. `--n-cpu-moe N` adds one override per
block 0..N-1, pattern ``blk\\.i\\.ffn_(up|down|gate|gate_up)_(ch|)exps``, buffer type CPU;
`-ot PATTERN=TYPE` adds any pattern. Both end up in ``llama_model_params.tensor_buft_overrides``,
a NULL-terminated array of {pattern, buffer type} that llama.cpp consults per tensor (first
match wins; ``std::regex_search``) while ``n_gpu_layers`` places everything else.
``Llama(...)`` has no argument for it, which is why this backend drives the low-level API.

The Plan carries the translation (backend/plan/llamacpp.py): ``override_tensor`` patterns and
``n_cpu_moe``; both are honoured, as llama-server honours both options together. Before the
load, every explicit pattern must match a tensor of the file and name a buffer type this
build has; after it, llama.cpp's own log says where each tensor went (``PlacementReport``).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridmoe.backend.errors import UsageError
from hybridmoe.backend.llamacpp.header import GGUFHeader
from hybridmoe.backend.llamacpp.log import Capture
from hybridmoe.backend.plan.llamacpp import expert_override_pattern
from hybridmoe.backend.plan.plan import Plan

_REPLAN = "Make a plan for this model and machine: `hybridmoe plan MODEL --backend llamacpp --save FILE`."


@dataclass(frozen=True)
class Override:
    pattern: str
    buffer_type: str  # "CPU", or a device buffer type such as "CUDA0"


class _BuftOverride(ctypes.Structure):
    # struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


class OverrideArray:
    """The NULL-terminated C array llama.cpp reads, owning the pattern strings it points to.
    llama.cpp keeps the pointer in the model's parameters, so the session holds this for the
    model's lifetime."""

    def __init__(self, overrides: Sequence[Override], buffer_types: Mapping[str, int]):
        self.overrides = tuple(overrides)
        self._patterns = [o.pattern.encode() for o in self.overrides]
        self._array = (_BuftOverride * (len(self.overrides) + 1))()
        for i, (o, pattern) in enumerate(zip(self.overrides, self._patterns, strict=True)):
            self._array[i].pattern = pattern
            self._array[i].buft = buffer_types[o.buffer_type]
        # the last element stays zeroed: {NULL, NULL} ends the list

    @property
    def pointer(self) -> int | None:
        return ctypes.addressof(self._array) if self.overrides else None


def check_plan(plan: Plan, header: GGUFHeader) -> None:
    """The plan must describe this file's model (as EngineBackend requires of its plans)."""
    layers = header.moe_layers
    experts = header.arch_value("expert_count")
    if tuple(plan.moe_layers) != layers or (experts is not None and plan.n_routed_experts != int(experts)):
        raise UsageError(
            f"the plan was made for {plan.model} (MoE layers {_span(plan.moe_layers)}, {plan.n_routed_experts} experts), "
            f"but {header.path.name} has MoE layers {_span(layers)} and {experts} experts",
            _REPLAN,
        )
    trained = header.arch_value("context_length")
    if trained and plan.workload.context > int(trained):
        raise UsageError(f"the plan's context ({plan.workload.context}) exceeds {header.path.name}'s {int(trained)} tokens",
                         _REPLAN)


def overrides_from_plan(settings: Mapping[str, Any], header: GGUFHeader, buffer_types: Mapping[str, int]) -> list[Override]:
    """The overrides a Plan's llama.cpp settings ask for, checked against the file and build.

    Explicit ``override_tensor`` entries ("PATTERN=TYPE") come first, then ``n_cpu_moe``'s
    blocks as one CPU pattern over the MoE layers below N (dense leading blocks count in N, as
    in llama.cpp, and have no experts to move).
    """
    out: list[Override] = []
    for entry in settings.get("override_tensor") or ():
        pattern, sep, buft = str(entry).rpartition("=")
        if not sep or not pattern or not buft:
            raise UsageError(f"tensor override {entry!r} in the plan is not of the form PATTERN=BUFFER_TYPE", _REPLAN)
        out.append(Override(pattern, _buffer_type_name(buft, buffer_types, entry)))
    n_cpu_moe = int(settings.get("n_cpu_moe") or 0)
    if n_cpu_moe:
        layers = [i for i in header.moe_layers if i < n_cpu_moe]
        if layers:
            pattern, _, _ = expert_override_pattern(layers).rpartition("=")
            out.append(Override(pattern, "CPU"))
    for o in out:
        try:
            regex = re.compile(o.pattern)
        except re.error as exc:
            raise UsageError(f"tensor override pattern {o.pattern!r} in the plan is not a valid regular expression: {exc}",
                             _REPLAN) from exc
        if not any(regex.search(name) for name in header.tensor_names):
            raise UsageError(
                f"tensor override pattern {o.pattern!r} matches no tensor of {header.path.name} "
                f"({header.architecture}, {header.block_count} blocks): the plan was made for another model",
                _REPLAN,
            )
    return out


def _buffer_type_name(name: str, buffer_types: Mapping[str, int], entry: str) -> str:
    if name in buffer_types:
        return name
    folded = {k.casefold(): k for k in buffer_types}
    if name.casefold() in folded:
        return folded[name.casefold()]
    raise UsageError(
        f"tensor override {entry!r} in the plan places tensors on {name!r}, which this llama.cpp build does not have "
        f"(it has: {', '.join(buffer_types)})",
        "Use a llama-cpp-python built for that device (see the README, \"llama.cpp backend\"), or make a plan for this machine.",
    )


@dataclass(frozen=True)
class PlacementReport:
    """Where llama.cpp says it put things, read from its load log."""

    overridden: dict[str, str]  # tensor -> buffer type, for tensors an override placed
    layer_devices: dict[int, str]  # block -> device of its non-overridden weights
    moe_layers: tuple[int, ...]

    @classmethod
    def from_log(cls, captured: Capture, header: GGUFHeader) -> PlacementReport:
        return cls(captured.overridden_tensors(), captured.layer_devices(), header.moe_layers)

    def expert_device(self, layer: int) -> str:
        """The buffer type or device holding the routed experts of block ``layer``."""
        for name, buft in self.overridden.items():
            if name.startswith(f"blk.{layer}.") and "_exps" in name:
                return buft
        return self.layer_devices.get(layer, "CPU")

    def cpu_expert_layers(self) -> tuple[int, ...]:
        return tuple(i for i in self.moe_layers if _is_host(self.expert_device(i)))

    def main_device_share(self) -> float:
        """Share of routed-expert activations computed off the CPU. Exact for llama.cpp's
        layout, not an estimate: each token activates the same number of experts in every MoE
        layer, and a layer's experts all live in one place."""
        if not self.moe_layers:
            return 0.0
        return 1.0 - len(self.cpu_expert_layers()) / len(self.moe_layers)


def _is_host(device: str) -> bool:
    # "CPU", "CPU_Mapped", "CPU_REPACK", "CUDA_Host" (pinned host memory) all live in host RAM.
    return device.upper().startswith("CPU") or device.endswith("_Host")


def _span(layers: Sequence[int]) -> str:
    layers = list(layers)
    if not layers:
        return "none"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
    return ",".join(map(str, layers))
