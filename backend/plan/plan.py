"""The Plan: where every tensor class and every routed expert goes, and what that buys.

A Plan is data. It is made by ``hybridmoe.backend.plan.make``, shown to the user, saved as TOML or
JSON, loaded again, edited, and obeyed by both backends. All sizes are bytes, all speeds
are per second; the printed form converts.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import tomli_w

from hybridmoe.backend.errors import UsageError
from hybridmoe.backend.files import write_atomic
from hybridmoe.backend.plan.workload import Workload

PLAN_FORMAT = "hybridmoe-plan/1"


@dataclass(frozen=True)
class DevicePlan:
    name: str  # "cuda:0 NVIDIA H200 NVL" or "cpu"
    kind: str  # "gpu" or "cpu"
    budget_bytes: int  # what may be placed here (after reserves)
    used_bytes: int
    bytes_by_class: dict[str, int]  # tensor class -> bytes, plus "kv_cache", "prefill_reserve", "activations"
    layers: tuple[int, ...] = ()  # decoder layers whose always-read weights live here (GPUs)
    bandwidth_bytes_per_s: float | None = None
    torch_device: str | None = None  # what the engine builds on: "cuda:0", "cpu"
    # Tensor parallelism: this card's share of each MoE layer's GPU experts (a pipeline's
    # cards hold all GPU experts of their layers: Plan.gpu_experts).
    experts: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def engine_device(self) -> str:
        """The torch device string (plans saved before ``torch_device`` existed: from the name)."""
        return self.torch_device or self.name.split()[0]

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes


@dataclass(frozen=True)
class Plan:
    model: str
    family: str
    expert_format: str
    hardware: str
    described_hardware: bool
    workload: Workload
    devices: tuple[DevicePlan, ...]
    # Routed experts on a GPU, per MoE layer; every other routed expert is CPU-resident.
    gpu_experts: dict[int, tuple[int, ...]]
    n_routed_experts: int
    experts_per_token: int
    moe_layers: tuple[int, ...]
    bytes_per_expert: dict[int, float]
    main_device: str  # "cuda" or "cpu"
    threads: int | None
    numa_nodes: int
    kv_bytes_per_token: float
    kv_bytes_per_conversation: float
    routed_expert_bytes_total: int
    gpu_routed_expert_bytes: int
    host_routed_expert_bytes: int
    host_ram_needed_bytes: int
    host_ram_usable_bytes: int | None
    host_bandwidth_bytes_per_s: float | None
    host_bandwidth_source: str
    host_bytes_per_token: float
    gpu_bytes_per_token: float
    decode_tokens_per_s_upper_bound: float | None
    decode_bound_by: str
    # Several users: experts touched per layer (union formula), per-user bound, all users together.
    experts_touched_per_layer: float
    decode_tokens_per_s_per_user: float | None
    decode_tokens_per_s_aggregate: float | None
    prefill_crossover_tokens: float | None
    llama_cpp: dict[str, Any]
    fits: bool
    reason: str
    suggestions: tuple[str, ...] = ()
    outgrown: bool = False
    serving: dict[str, Any] | None = None
    warnings: tuple[str, ...] = ()
    # Why the embedded engine's own layout does not fit, where that made `--backend auto` plan
    # for llama.cpp (plan.make): a session must then not hand this plan to the engine.
    engine_misfit: str | None = None
    # Routed experts the engine would compute on a slow path on this plan's CPU (PyTorch
    # dequantizing them on every call: models.slow_paths), in one sentence; None when none
    # are. The estimate counts them; `--backend auto` then prefers llama.cpp (backends.py).
    engine_slow_path: str | None = None
    format: str = field(default=PLAN_FORMAT)
    # How routed experts are held on the GPUs ("bf16"/"f32": dense in the compute dtype,
    # "int8": weight-only with per-row scales, "int4": the stored 4-bit codes, "stored": a GGUF's
    # blocks; a llama.cpp plan's are "stored" too) and the bytes each then takes there, per MoE
    # layer: what the GPU budgets above count (bytes_per_expert is the stored form, which
    # host RAM and the prefill reserve count).
    gpu_expert_format: str = "bf16"
    # The KV cache's element type as the plan's backend keeps it: llama.cpp the workload's
    # --kv-dtype, the engine its own (budget.engine_numerics: fp16 on a CPU-only GGUF run). ""
    # in plans saved before it was recorded: the workload's then.
    kv_cache_dtype: str = ""
    gpu_bytes_per_expert: dict[int, float] = field(default_factory=dict)
    # Prompt tokens per forward call from which the engine streams CPU experts to the GPU
    # for prefill (from prefill_crossover_tokens; None: no prefill reserve, no streaming).
    prefill_stream_min_tokens: int | None = None
    # What bounds the per-conversation speed when the workload's conversations decode together.
    decode_bound_by_per_user: str = ""
    # How the GPUs share the model: "pp" (a pipeline of whole layers) or "tp" (tensor parallel:
    # every card a share of every layer; devices' layers then list all of them). `layouts`
    # summarises each layout the planner weighed (the figures above are the chosen one's).
    parallel: str = "pp"
    layouts: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The speeds to expect (plan.expected, docs/sizing.md §6): the bound's bytes at the rates
    # the plan's backend reaches, with the CPU's compute, NUMA and the GPU-CPU hand-offs; each
    # with how it was obtained. None where a rate is unknown.
    decode_tokens_per_s_expected: float | None = None
    decode_expected_how: str = ""
    # Where the expected decode figure's rates came from, in a few words: what the wizard, the
    # catalogue and `run` say beside the figure (the Plan screen says all of `..._how`).
    decode_expected_source: str = ""
    decode_tokens_per_s_per_user_expected: float | None = None
    decode_tokens_per_s_aggregate_expected: float | None = None
    decode_expected_how_per_user: str = ""
    prefill_tokens_per_s_expected: float | None = None
    prefill_expected_how: str = ""
    # The CPU's multiply-adds per prompt token under this layout (the CPU experts a token
    # reaches, CPU-only the always-read weights too; two flops a weight), what a measured prompt
    # rate is divided into to keep the engine's prompt rate for this machine (hardware.achieved).
    # None when the chunk streams its experts to the GPU or the CPU computes nothing.
    prefill_cpu_flops_per_token: float | None = None
    # Where the plan holds weights at another precision than the file's (bf16 GPU experts
    # narrowed to int8, say), one sentence each: said in the printed plan and the TUI.
    precision_notes: tuple[str, ...] = ()
    # The engine's always-read weights on the GPUs by class and storage type (plan.make's
    # _gpu_forms): {"class", "stored" (type), "held" ("as stored", the compute dtype, or "as
    # routed"), "tensors", "bytes" (on the cards, the whole model's), "example"}. Empty for a
    # plan without GPUs or for llama.cpp (which holds every tensor as stored).
    gpu_always_read_forms: tuple[dict[str, Any], ...] = ()

    @property
    def gpu_expert_count(self) -> int:
        return sum(len(v) for v in self.gpu_experts.values())

    def placement(self) -> dict[int, frozenset[int]]:
        """Main-device experts per MoE layer, as the engine consumes them."""
        return {layer: frozenset(ids) for layer, ids in self.gpu_experts.items()}

    def pipeline(self) -> list[tuple[str, tuple[int, ...]]]:
        """(torch device, decoder layers) of each GPU in layer order: the engine's stages
        (none under tensor parallelism, where every card takes part in every layer)."""
        if self.parallel == "tp":
            return []
        return [(d.engine_device, tuple(d.layers)) for d in self.devices if d.kind == "gpu" and d.layers]

    @property
    def kv_cache_bytes(self) -> int:
        """The KV cache of all ``workload.users`` conversations at the full context, over
        every device that holds a part: what the engine's cache may grow to."""
        return sum(d.bytes_by_class.get("kv_cache", 0) for d in self.devices)

    @property
    def resident_form(self) -> str:
        """The engine's name for gpu_expert_format: "int8", "int4", "stored" or "dense"."""
        return self.gpu_expert_format if self.gpu_expert_format in ("int8", "int4", "stored") else "dense"

    # ---- serialisation -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["workload"] = self.workload.to_dict()
        d["gpu_experts"] = {str(k): list(v) for k, v in sorted(self.gpu_experts.items())}
        d["gpu_experts_per_layer"] = {str(k): len(v) for k, v in sorted(self.gpu_experts.items())}
        d["kv_cache_bytes"] = self.kv_cache_bytes
        d["bytes_per_expert"] = {str(k): v for k, v in sorted(self.bytes_per_expert.items())}
        d["gpu_bytes_per_expert"] = {str(k): v for k, v in sorted(self.gpu_bytes_per_expert.items())}
        for dev, dd in zip(self.devices, d["devices"]):
            dd["free_bytes"] = dev.free_bytes
            dd["experts"] = {str(k): list(v) for k, v in sorted(dev.experts.items())}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if d.get("format") != PLAN_FORMAT:
            raise UsageError(f"not a hybridmoe plan (format {d.get('format')!r}, expected {PLAN_FORMAT!r})")
        dev_names = {f.name for f in fields(DevicePlan)}
        # TOML has no null, so unset optional fields are absent: they come back as None.
        kw = {f.name: d.get(f.name) for f in fields(cls) if f.name in d or f.default is MISSING}
        kw["workload"] = Workload.from_dict(d["workload"])
        kw["devices"] = tuple(
            DevicePlan(
                **{k: dd.get(k) for k in dev_names if k not in ("layers", "experts")},
                layers=tuple(dd.get("layers", ())),
                experts={int(k): tuple(int(e) for e in v) for k, v in dd.get("experts", {}).items()},
            )
            for dd in d["devices"]
        )
        kw["gpu_experts"] = {int(k): tuple(int(e) for e in v) for k, v in d["gpu_experts"].items()}
        kw["bytes_per_expert"] = {int(k): float(v) for k, v in d["bytes_per_expert"].items()}
        kw["gpu_bytes_per_expert"] = {int(k): float(v) for k, v in d.get("gpu_bytes_per_expert", {}).items()}
        for name in ("moe_layers", "suggestions", "warnings", "precision_notes", "gpu_always_read_forms"):
            kw[name] = tuple(d.get(name, ()))
        return cls(**kw)

    def save(self, path: str | os.PathLike) -> Path:
        """Write as TOML (``.toml``) or JSON (``.json``), atomically."""
        path = Path(path)
        check_plan_path(path)
        if path.suffix == ".toml":
            text = tomli_w.dumps(_drop_none(self.to_dict()))
        else:
            text = json.dumps(self.to_dict(), indent=1)
        return write_atomic(path, text)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise UsageError(f"cannot read plan {path}: {e.strerror}", "Make one with `hybridmoe plan MODEL --save FILE`.")
        try:
            d = tomllib.loads(raw.decode()) if path.suffix == ".toml" else json.loads(raw)
        except (UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"plan {path} is not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: {e}")
        try:
            return cls.from_dict(d)
        except (KeyError, TypeError, ValueError) as e:
            raise UsageError(f"plan {path} is incomplete or malformed ({e})", "Make it again with `hybridmoe plan`.")


def check_plan_path(path: str | os.PathLike) -> None:
    """Refuse a file name a plan cannot be saved as: the suffix says the format (a .yaml
    holding JSON would mislead every reader of it)."""
    if Path(path).suffix not in (".toml", ".json"):
        raise UsageError(f"cannot save a plan as {path}: the name must end in .toml or .json",
                         f"Give a name such as {Path(path).with_suffix('.toml').name}.")


def _drop_none(value):
    """TOML has no null: leave unset fields out (from_dict restores their defaults)."""
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_drop_none(v) for v in value]
    return value
