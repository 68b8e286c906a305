"""plan.make(): a model, a machine and a workload in; a Plan out (docs/sizing.md, all sections).

Order of placement on each GPU (section 3): always-read weights of its layers, the KV
cache of its layers for users × context, the activation scratch, the prefill reserve, then
routed experts until the budget is spent. Everything else stays in host RAM (section 4).

Routed experts are counted in two forms: as stored (host RAM, the decode reads of CPU
experts, and the prefill reserve, which streams them as stored) and as the engine holds
them on a GPU (``budget.resident_expert_bytes``): dense in the compute dtype when every
routed expert fits that way; else, for a GGUF whose expert types the GPU kernels read, the
file's blocks (``budget.stored_expert_bytes``, per layer); else, for experts stored in a 4-bit
format, those 4-bit codes with their group scales (as many bytes as stored); else weight-only
int8, which fits twice as many as dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from hybridmoe.backend.errors import ModelError, PlanError
from hybridmoe.backend.hardware import achieved
from hybridmoe.backend.hardware.cpu_kernels import native_kernels_missing
from hybridmoe.backend.hardware.profile import HardwareProfile
from hybridmoe.backend.models.formats import FORMATS, int4_resident_layout
from hybridmoe.backend.models.inventory import TensorClass, TensorInventory
from hybridmoe.backend.models.slow_paths import SLOW_PATH_SLOWDOWN, cpu_slow_path
from hybridmoe.backend.models.spec import ModelSpec
from hybridmoe.backend.models.tensors import inventory_from_config
from hybridmoe.backend.plan import budget as B
from hybridmoe.backend.plan import placement
from hybridmoe.backend.plan.estimate import (
    DecodeEstimate,
    cpu_flops,
    decode_step,
    experts_touched,
    prefill_crossover_tokens,
    prefill_stream_min_tokens,
    tp_all_reduces,
)
from hybridmoe.backend.plan.expected import (
    unpack_limited,
    expected_decode,
    expected_prefill,
    expert_unpack_rate,
    host_read_rate,
)
from hybridmoe.backend.plan.llamacpp import translate
from hybridmoe.backend.plan.plan import DevicePlan, Plan
from hybridmoe.backend.plan.serving import recommend
from hybridmoe.backend.plan.stats import ExpertStats
from hybridmoe.backend.plan.workload import Workload

GIB = 1 << 30
KV_BLOCK_TOKENS = 64  # positions per KV cache block (engine/kv_cache.py; spec.kv_tokens rounds to them)
# Average bits per weight of a Q4_K_M GGUF, for the "smaller quantization" hint.
Q4_K_M_BITS = FORMATS["q4_k_m"].bits_per_weight


def make(spec: ModelSpec, inventory: TensorInventory, hardware: HardwareProfile, workload: Workload) -> Plan:
    plan = _Planner(spec, inventory, hardware, workload).plan()
    if workload.backend == "auto" and not plan.fits and inventory.source == "gguf" and plan.main_device == "cuda":
        # The engine widens a quantized file's always-read weights on the GPUs; llama.cpp keeps
        # them as the file stores them, so a layout the engine cannot fit may fit there.
        llama = _Planner(spec, inventory, hardware, replace(workload, backend="llamacpp")).plan()
        if llama.fits:
            return replace(llama, engine_misfit=plan.reason, warnings=llama.warnings + (
                f"The embedded engine's layout does not fit ({plan.reason}): this plan is for llama.cpp, which keeps "
                "the always-read weights on the GPUs as the file stores them (--backend engine plans for the engine).",))
    if workload.backend == "engine" and not plan.fits and inventory.source == "gguf":
        llama = _Planner(spec, inventory, hardware, replace(workload, backend="llamacpp")).plan()
        if llama.fits:
            advice = (f"llama.cpp's layout fits ({llama.llama_cpp['command']}): --backend llamacpp.",)
            plan = replace(plan, suggestions=tuple(s for s in plan.suggestions if "--backend llamacpp" not in s) + advice)
    return plan


# The GPU layouts each backend runs: the engine both (its pipeline stages, ``tensor_parallel``),
# llama.cpp pipelines (its layer split; its row split has no hybrid expert offload).
RUNS = {"engine": ("pp", "tp"), "llamacpp": ("pp",)}


@dataclass
class _Layout:
    """How the GPUs share the model: what each card holds and what a decode step reads."""

    kind: str  # "pp" (pipeline) or "tp" (tensor parallel)
    runs: list[tuple[int, ...]]  # decoder layers each card holds (all of them, a share each, under tp)
    share: float  # share of each held layer's always-read weights (and of the head) a card holds
    kv_share: float  # share of each held layer's KV cache a card holds
    card_classes: list[dict[str, float]]
    reserves: list[int]
    avail: list[float]  # left for routed experts on each card
    form: str  # how GPU experts are held (budget.RESIDENT_FORMS)
    gbpe: dict[int, float]  # bytes per GPU expert in that form, per MoE layer
    gpu_experts: dict[int, tuple[int, ...]]
    experts_by_card: list[dict[int, tuple[int, ...]]]  # GPU experts each card holds, per MoE layer
    single: DecodeEstimate | None = None
    multi: DecodeEstimate | None = None
    # llama.cpp's layout with --n-cpu-moe given: what the experts it puts on each card need
    # beyond the card's room (0 where they fit).
    over: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class _AlwaysRead:
    """The weights every token reads, in bytes as one side holds them: per decoder layer
    (attention, and the dense MLP or the shared experts and router) and the model's embedding
    and head."""

    attention: float  # per layer
    dense_mlp: float  # per dense layer
    moe_fixed: float  # per MoE layer: shared experts and router
    moe_layers: frozenset[int]
    embedding: float
    lm_head: float
    head_read: float  # what a token reads of the head (a tied head: the embedding matrix)

    @classmethod
    def of(cls, spec: ModelSpec, inventory: TensorInventory, *, as_stored: bool = False,
           on_gpu: bool = False, numerics: B.EngineNumerics | None = None) -> _AlwaysRead:
        """As the engine holds `inventory` in host RAM with these `numerics` (`on_gpu`: on a
        GPU; or, `as_stored`, as the file stores it: llama.cpp)."""
        def held(c: TensorClass) -> int:
            if as_stored:
                return inventory.bytes_by_class.get(c, 0)
            if on_gpu:
                return inventory.gpu_held_bytes(c, B.compute_dtype_bytes(spec), B.router_element_bytes(spec))
            widened = numerics.embedding if c is TensorClass.EMBEDDING else numerics.compute
            return inventory.held_bytes(c, widened, B.router_element_bytes(spec, numerics.compute))

        lm_head, embedding = held(TensorClass.LM_HEAD), held(TensorClass.EMBEDDING)
        return cls(attention=held(TensorClass.ATTENTION) / spec.num_layers,
                   dense_mlp=held(TensorClass.DENSE_FFN) / (len(spec.dense_layers) or 1),
                   moe_fixed=(held(TensorClass.SHARED_EXPERTS) + held(TensorClass.ROUTER)) / (len(spec.moe_layers) or 1),
                   moe_layers=frozenset(spec.moe_layers), embedding=embedding, lm_head=lm_head,
                   head_read=lm_head or (embedding if spec.tie_word_embeddings else 0))

    def layer(self, layer: int) -> float:
        return self.attention + (self.moe_fixed if layer in self.moe_layers else self.dense_mlp)

    def on_card(self, kind: str, runs: list[tuple[int, ...]], c: int) -> float:
        """What card `c` holds of them, its share aside: its layers' (every layer under tensor
        parallelism), and the embedding on the first card and the head on the last."""
        always = sum(self.layer(layer) for layer in runs[c])
        if kind == "tp":
            return always + self.embedding + self.lm_head
        return always + (self.embedding if c == 0 else 0) + (self.lm_head if c == len(runs) - 1 else 0)

    def whole(self, num_layers: int) -> float:
        return self.embedding + self.lm_head + sum(self.layer(layer) for layer in range(num_layers))


def held_on_gpu(spec: ModelSpec) -> TensorInventory:
    """Every tensor in the engine's compute dtype: its weights' elements at that width (a GPU
    holds a GGUF's block matrices as stored, every other always-read tensor so: that is
    TensorInventory.gpu_held_bytes; the routed experts' forms there are budget.RESIDENT_FORMS)."""
    dtype = "fp32" if B.compute_dtype_bytes(spec) == 4 else "bf16"
    return inventory_from_config(spec, expert_format=dtype, other_format=dtype)


class _Planner:
    def __init__(self, spec, inventory, hardware, workload):
        self.spec: ModelSpec = spec
        self.inv: TensorInventory = inventory
        self.hw: HardwareProfile = hardware
        self.wl: Workload = workload
        self.warnings: list[str] = []
        if workload.context > spec.max_context:
            raise PlanError(
                f"context {workload.context} is longer than {spec.name} supports ({spec.max_context} tokens)",
                f"Pass --context {spec.max_context} or less.",
            )
        self.stats = ExpertStats.load(workload.stats_file) if workload.stats_file else None
        if self.stats and self.stats.n_experts != spec.n_routed_experts:
            raise ModelError(
                f"statistics file {workload.stats_file} counts {self.stats.n_experts} experts per layer, "
                f"{spec.name} has {spec.n_routed_experts}",
                "Record statistics with this model.",
            )
        self.E, self.k = spec.n_routed_experts, spec.experts_per_token
        self.moe = set(spec.moe_layers)
        # A plan for llama.cpp is sized as llama.cpp holds the model: every tensor as stored,
        # experts a whole layer at a time, its compute buffers, no prefill reserve (§5).
        self.llama = workload.backend == "llamacpp"
        self.bpe = {layer: inventory.bytes_per_expert(layer) for layer in spec.moe_layers}
        # A CPU expert as host RAM holds it and a token reads it: the engine's copy (a Q4_K
        # expert's row-interleaved layout takes 148 bytes for the file's 144); llama.cpp's
        # repacked layout is the file's size.
        self.host_bpe = (self.bpe if workload.backend == "llamacpp" else
                         {layer: inventory.host_bytes_per_expert(layer) for layer in spec.moe_layers})
        # Bytes per expert on a GPU, by form (a layout picks one: _Layout.gbpe).
        self.int4 = int4_resident_layout(spec.expert_format) is not None
        if workload.gpu_expert_form == "int4" and not self.int4:
            raise PlanError(
                f"--gpu-experts int4 needs routed experts stored in a 4-bit format; {spec.name}'s are {spec.expert_format}",
                "Use --gpu-experts auto (or int8), or a 4-bit file (int4, Q4_0, Q4_K, IQ4, MXFP4 experts).",
            )
        self.resident = {form: float(B.resident_expert_bytes(spec, form))
                         for form in B.RESIDENT_FORMS if form not in ("int4", "stored") or (form == "int4" and self.int4)}
        # A GGUF's experts as the file stores them, where the GPU kernels read their types:
        # per layer (a mix gives some layers' downs more bits).
        self.stored_gbpe = B.stored_expert_bytes(spec, inventory)
        if workload.gpu_expert_form == "stored" and self.stored_gbpe is None:
            raise PlanError(
                f"--gpu-experts stored needs routed experts in GGUF block types the GPU kernels read; "
                f"{spec.name}'s are {spec.expert_format}",
                "Use --gpu-experts auto (or int8, int4), or a GGUF file.",
            )
        # The always-read weights as each side holds them: host RAM in the stored form (the
        # CPU kernels read it as stored, Q4_K in a layout 2.8 % larger; the embedding and MLA's
        # kv_b stored whole widened, the routers as routed); a GPU, for the engine, the
        # matrices in a GGUF block type as stored (projections, the embedding, MLA's kv_b:
        # engine/stored_linear.py, engine/stored_latent.py) and the rest in the compute dtype
        # (norms, float and fp8 matrices: the inventory's gpu_widened); llama.cpp keeps all of
        # them as the file stores them.
        self.stored = _AlwaysRead.of(spec, inventory, as_stored=True)
        # The GPUs the backend can drive (llama.cpp drives AMD cards too, its ROCm and Vulkan
        # builds; the engine CUDA's alone) and those this workload uses.
        self.usable_gpus = hardware.llamacpp_gpus if self.llama else hardware.served_gpus
        self.gpus = () if workload.strategy == "cpu-only" else self.usable_gpus
        # The engine's element sizes: a GGUF computed on the CPU alone is float32 with a
        # float16 cache, anything else in its compute dtype (engine/model.py).
        self.numerics = B.engine_numerics(spec, inventory.source, not self.gpus)
        self.host = (self.stored if workload.backend == "llamacpp"
                     else _AlwaysRead.of(spec, inventory, numerics=self.numerics))
        # llama.cpp's cache takes the workload's type; the engine's is its own (numerics),
        # whatever --kv-dtype says (below: a warning where they differ).
        self.kv_elem = workload.kv_bytes_per_element if self.llama else self.numerics.kv
        self.kv_layer_token = spec.kv_bytes_per_token_per_layer(self.kv_elem)
        # Routed experts the engine's CPU would dequantize with PyTorch on every call
        # (models.slow_paths), counted in the estimate where the plan leaves them on the CPU. A
        # described machine runs the kernels the package builds; this one may lack them.
        self.slow = None if workload.backend == "llamacpp" else cpu_slow_path(
            inventory, None if hardware.described else native_kernels_missing())

    @cached_property
    def gpu(self) -> _AlwaysRead:
        """The always-read weights as a card holds them (see above); sized from the config's
        shapes (~10 ms for Kimi K2), so only for plans that place anything on a GPU."""
        if self.wl.backend == "llamacpp":
            # llama.cpp keeps the token embedding (its input layer, row lookups) in host memory.
            return replace(self.stored, embedding=0.0)
        return _AlwaysRead.of(self.spec, self.inv, on_gpu=True)

    # ---- per-layer arithmetic ----------------------------------------------------------------

    def kv_layer(self, layer: int, users: int) -> float:
        return users * self.spec.kv_tokens(layer, self.wl.context) * self.kv_layer_token

    # ---- the plan ------------------------------------------------------------------------------

    def plan(self) -> Plan:
        spec, wl = self.spec, self.wl
        usable_gpus, gpus = self.usable_gpus, self.gpus
        if not usable_gpus:
            self.warnings.append("No GPU the hybrid backend can use: everything runs on the CPU, which is slow.")
        others = [g.name for g in self.hw.llamacpp_gpus if g not in usable_gpus]
        if others and wl.strategy != "cpu-only":
            self.warnings.append(f"{', '.join(others)}: the embedded engine's GPU path is CUDA's; llama.cpp's ROCm or "
                                 "Vulkan build uses it (--backend llamacpp).")
        activations = B.activation_bytes(spec, wl.prefill_chunk)
        usable = self.hw.memory.usable_bytes
        host_reserve = B.host_reserve(usable)

        if self.llama:
            budgets = [B.llamacpp_gpu_budget(g, self.hw.described, layout_given=wl.n_cpu_moe is not None) for g in gpus]
        else:
            budgets = [B.gpu_budget(g, self.hw.described, activations) for g in gpus]
        layouts = {"pp": self._layout("pp", gpus, budgets, activations)}
        if len(gpus) > 1:
            layouts["tp"] = self._layout("tp", gpus, budgets, activations)
        for lay in layouts.values():
            lay.single = self._decode(gpus, lay, users=1)
            lay.multi = self._decode(gpus, lay, users=wl.users)
        lay = layouts[self._choose(layouts)]
        runs, reserves, card_classes, gpu_experts = lay.runs, lay.reserves, lay.card_classes, lay.gpu_experts

        devices = []
        for c, g in enumerate(gpus):
            experts = sum(len(ids) * lay.gbpe[layer] for layer, ids in lay.experts_by_card[c].items())
            # Rounded, not cut: the per-layer shares summed back may land a hair below a whole byte.
            by_class = {k: round(v) for k, v in card_classes[c].items()}
            by_class["prefill_reserve"] = reserves[c]
            by_class["routed_experts"] = int(experts)
            devices.append(
                DevicePlan(
                    # (llama.cpp names an AMD card ROCm0 or Vulkan0, after the build that drives it.)
                    name=f"{'cuda' if g.vendor == 'nvidia' else 'gpu'}:{g.index} {g.name}",
                    kind="gpu",
                    budget_bytes=int(budgets[c]),
                    used_bytes=sum(by_class.values()),
                    bytes_by_class=by_class,
                    layers=runs[c],
                    bandwidth_bytes_per_s=g.memory_bandwidth_bytes_per_s,
                    torch_device=f"cuda:{g.index}",
                    # A pipeline's cards hold all GPU experts of their layers (Plan.gpu_experts).
                    experts=lay.experts_by_card[c] if lay.kind == "tp" else {},
                )
            )

        routed_total = self.inv.routed_expert_bytes
        gpu_routed = int(sum(len(ids) * lay.gbpe[layer] for layer, ids in gpu_experts.items()))
        # Host RAM holds every expert not on a GPU, as the CPU side copies it (host_bpe).
        host_routed = int(sum((self.E - len(gpu_experts[layer])) * self.host_bpe[layer] for layer in spec.moe_layers))
        host_parts = {"routed_experts": host_routed}
        engine_slow_path = None
        if self.slow and any(len(gpu_experts[layer]) < self.E for layer in self.slow.bytes_by_layer):
            engine_slow_path = self.slow.describe()
            self.warnings.append(engine_slow_path + (
                ". `--backend auto` runs this model on llama.cpp (when it is installed), which reads them in place."
                if wl.backend == "auto" else "."))
        host_parts["kv_cache"] = 0
        if gpus and self.llama:
            host_parts["always_read"] = int(self.stored.embedding)  # llama.cpp's input layer
        if not gpus:
            host_parts["always_read"] = int(self.host.whole(spec.num_layers))
            host_parts["kv_cache"] = int(sum(self.kv_layer(layer, wl.users) for layer in range(spec.num_layers)))
            host_parts["activations"] = activations
        host_needed = int(sum(host_parts.values()) + host_reserve)
        devices.append(
            DevicePlan(
                name="cpu (host RAM)",
                kind="cpu",
                budget_bytes=int(usable - host_reserve) if usable is not None else 0,
                used_bytes=int(sum(host_parts.values())),
                bytes_by_class={k: int(v) for k, v in host_parts.items()},
                bandwidth_bytes_per_s=self.hw.memory.bandwidth_bytes_per_s,
                torch_device="cpu",
            )
        )

        single, multi = lay.single, lay.multi
        touched = experts_touched(self.E, self.k, wl.users)

        fits, reason, suggestions = self._judge(gpus, lay, budgets, host_parts, host_needed, usable)
        outgrown = self._outgrown(fits, reason, multi.tokens_per_s_per_user, single.tokens_per_s_per_user)
        serving = None
        if outgrown:
            weights = self.inv.total_bytes - self.inv.bytes_by_class.get(TensorClass.OTHER, 0)
            kv_total = spec.kv_bytes(wl.context, self.kv_elem) * wl.users
            serving = recommend(spec.name, weights, kv_total, spec.attention == "mla", wl.context, wl.users)

        threads = self.hw.cpu.physical_cores
        numa = len(self.hw.cpu.numa_nodes) or 1
        if numa > 1:
            self.warnings.append(
                f"{numa} NUMA nodes: CPU experts are split across nodes, each node's threads reading local memory."
            )
        engine_kv = self.numerics.kv_name
        # (Warned where the bytes differ: a float16 cache for a bf16 one is the memory asked for.)
        if not self.llama and wl.kv_bytes_per_element != self.kv_elem:
            self.warnings.append(
                f"The embedded engine keeps its KV cache in {engine_kv} ({self.kv_elem:g} bytes an element), "
                f"not {wl.kv_dtype}, and this plan counts it so; --kv-dtype {wl.kv_dtype} is for llama.cpp "
                "(--backend llamacpp).")
        features = self.hw.cpu.features
        if self.hw.cpu.arch in (None, "x86_64") and features and "avx2" not in features:
            self.warnings.append("This CPU has no AVX2: the CPU expert kernels fall back to a slow portable path.")
        bw_source = self._bandwidth_source()
        pcie = next((g.pcie_bandwidth_bytes_per_s for g in gpus if g.pcie_bandwidth_bytes_per_s), None)
        crossover = prefill_crossover_tokens(self.inv.expert_bits_per_weight, cpu_flops(threads, features), pcie)
        # Streaming needs the reserve on the GPUs it runs on; without one prefill stays on the CPU.
        stream_min = prefill_stream_min_tokens(crossover, self.E, self.k) if any(reserves) else None
        if stream_min is not None and stream_min > wl.prefill_chunk:
            # The engine decides per forward call, and the session feeds prompts in chunks.
            self.warnings.append(
                f"Streamed prefill pays from {stream_min} tokens per forward call, more than the "
                f"{wl.prefill_chunk}-token prefill chunk: prompts will not stream unless the chunk is "
                f"at least {stream_min} tokens."
            )

        expected = self._expected(gpus, lay, reserves, stream_min, pcie)
        precision_notes = self._precision_notes(lay) if gpus else ()
        llama = translate(
            spec,
            self.inv.routed_bytes_by_layer,
            # A plan for llama.cpp is its layout already: its GPU layers as placed above.
            gpu_layers=[layer for layer, ids in gpu_experts.items() if ids] if self.llama and gpus else None,
            # llama.cpp splits layers (the room a pipeline's cards have) and needs no prefill
            # reserve buffer (it offloads big batches by itself).
            gpu_expert_budget=sum(max(a, 0) for a in layouts["pp"].avail) + sum(layouts["pp"].reserves),
            gpu_budgets=budgets,
            threads=threads,
            context=wl.context,
            users=wl.users,
            kv_dtype=wl.kv_dtype,
        )
        return Plan(
            model=spec.name,
            family=spec.family,
            expert_format=self.inv.expert_format,
            hardware=self.hw.name,
            described_hardware=self.hw.described,
            workload=wl,
            devices=tuple(devices),
            gpu_experts=gpu_experts,
            n_routed_experts=self.E,
            experts_per_token=self.k,
            moe_layers=tuple(spec.moe_layers),
            bytes_per_expert=self.bpe,
            main_device="cuda" if gpus else "cpu",
            threads=threads,
            numa_nodes=numa,
            kv_bytes_per_token=spec.kv_bytes_per_token(self.kv_elem),
            kv_cache_dtype=wl.kv_dtype if self.llama else self.numerics.kv_name,
            kv_bytes_per_conversation=spec.kv_bytes(wl.context, self.kv_elem),
            routed_expert_bytes_total=routed_total,
            gpu_routed_expert_bytes=gpu_routed,
            host_routed_expert_bytes=host_routed,
            host_ram_needed_bytes=host_needed,
            host_ram_usable_bytes=usable,
            host_bandwidth_bytes_per_s=self.hw.memory.bandwidth_bytes_per_s,
            host_bandwidth_source=bw_source,
            host_bytes_per_token=single.host_bytes_per_step,
            gpu_bytes_per_token=single.gpu_bytes_per_step,
            decode_tokens_per_s_upper_bound=single.tokens_per_s_per_user,
            decode_bound_by=single.bound_by,
            decode_bound_by_per_user=multi.bound_by,
            **expected,
            precision_notes=precision_notes,
            gpu_always_read_forms=self._gpu_forms() if gpus and not self.llama else (),
            experts_touched_per_layer=touched,
            decode_tokens_per_s_per_user=multi.tokens_per_s_per_user,
            decode_tokens_per_s_aggregate=(
                multi.tokens_per_s_per_user * wl.users if multi.tokens_per_s_per_user else None
            ),
            prefill_crossover_tokens=crossover,
            prefill_stream_min_tokens=stream_min,
            gpu_expert_format=B.resident_form_name(spec, lay.form),
            gpu_bytes_per_expert=dict(lay.gbpe),
            parallel=lay.kind,
            layouts={kind: self._summary(other) for kind, other in layouts.items()} if gpus else {},
            llama_cpp=llama,
            engine_slow_path=engine_slow_path,
            fits=fits,
            reason=reason,
            suggestions=tuple(suggestions),
            outgrown=outgrown,
            serving=serving,
            warnings=tuple(self.warnings),
        )

    def _expected(self, gpus, lay: _Layout, reserves, stream_min, pcie) -> dict[str, Any]:
        """The expected decode (one conversation and the workload's) and prefill speeds of this
        layout, and how each was obtained (plan.expected, docs/sizing.md §6)."""
        spec, wl, hw = self.spec, self.wl, self.hw
        backend = "llamacpp" if wl.backend == "llamacpp" else "engine"
        mem = hw.memory
        rate = host_read_rate(backend, theoretical=mem.bandwidth_theoretical_bytes_per_s,
                              measured=mem.bandwidth_measured_bytes_per_s,
                              sockets=hw.cpu.sockets, achieved=achieved.lookup(hw))
        flops = cpu_flops(hw.cpu.physical_cores, hw.cpu.features)
        bytes_per_weight = self.inv.expert_bits_per_weight / 8 or 1.0
        cpu_layers = sum(1 for layer in spec.moe_layers if len(lay.gpu_experts[layer]) < self.E)
        fmt = self.inv.expert_format
        # The engine's kernels' unpacking of an i-quant (llama.cpp's own rate is not measured).
        unpacking = expert_unpack_rate(
            fmt, cores=hw.cpu.physical_cores, features=hw.cpu.features,
            measured=achieved.lookup_rate(hw, "expert_weights_per_s_per_core", fmt) if unpack_limited(fmt) else None,
        ) if backend == "engine" else None
        common = dict(backend=backend, rate=rate, bound_host_bandwidth=mem.bandwidth_bytes_per_s,
                      cpu_flops_per_s=flops, cpu_moe_layers=cpu_layers, has_gpu=bool(gpus),
                      expert_unpack=unpacking, expert_bytes_per_weight=bytes_per_weight)
        # The weights the CPU multiplies for a token: the CPU experts it reaches, and CPU-only the
        # always-read weights too (their elements: every class counted in the compute dtype).
        cpu_share = sum(self._cpu_share(layer, lay.gpu_experts[layer]) for layer in spec.moe_layers)
        expert_weights = self.k * spec.params_per_expert * cpu_share
        always_weights = 0.0
        if not gpus:
            dtype = B.compute_dtype_bytes(spec)
            held = held_on_gpu(spec)
            always_weights = sum(held.bytes_by_class.get(c, 0) for c in (
                TensorClass.ATTENTION, TensorClass.DENSE_FFN, TensorClass.SHARED_EXPERTS, TensorClass.LM_HEAD)) / dtype
        # Decode: each conversation's token multiplies them (not the bytes read at the experts'
        # bits a weight, which counted a bf16 attention's bytes as 8x its weights at 2 bits).
        host_weights = expert_weights + always_weights
        one = expected_decode(lay.single, host_weights=host_weights, users=1, **common)
        many = expected_decode(lay.multi, host_weights=host_weights, users=wl.users, **common)
        chunk = min(wl.prefill_chunk, wl.context)
        streams = stream_min is not None and stream_min <= chunk and any(reserves)
        streamed = sum((self.E - len(lay.gpu_experts[layer])) * self.bpe[layer] for layer in spec.moe_layers)
        # The engine's prompt rate measured here: this format's runs, else any format's (the
        # figure says which), before the stated model.
        measured = (achieved.lookup_rate(hw, "prefill_flops_per_s", fmt, any_format=True)
                    if backend == "engine" else None)
        prefill = expected_prefill(tokens=chunk, cpu_expert_weights=expert_weights, cpu_always_weights=always_weights,
                                   cpu_flops_per_s=flops, streamed_bytes=streamed if streams else None,
                                   pcie_bytes_per_s=pcie, measured=measured, expert_format=fmt)
        cpu_flops_per_token = 2 * (expert_weights + always_weights)
        return {
            "decode_tokens_per_s_expected": one.tokens_per_s,
            "decode_expected_how": one.how,
            "decode_expected_source": one.source,
            "decode_tokens_per_s_per_user_expected": many.tokens_per_s,
            "decode_tokens_per_s_aggregate_expected": many.tokens_per_s * wl.users if many.tokens_per_s else None,
            "decode_expected_how_per_user": many.how,
            "prefill_tokens_per_s_expected": prefill.tokens_per_s,
            "prefill_expected_how": prefill.how,
            "prefill_cpu_flops_per_token": cpu_flops_per_token if cpu_flops_per_token and not streams else None,
        }

    # Stored formats wider than 8 bits a weight: experts held as int8 (or int4) on a GPU lose precision.
    WIDE_FORMATS = {"bf16": "bf16", "fp16": "fp16", "f16": "fp16", "f32": "fp32", "fp32": "fp32"}

    def _gpu_forms(self) -> tuple[dict[str, Any], ...]:
        """The always-read weights as the engine holds them on the GPUs, by class and storage
        type (the whole model's; a card holds its layers' share): as stored or in the compute
        dtype, with the bytes that takes (what the devices' always-read figures add up)."""
        dtype_bytes = B.compute_dtype_bytes(self.spec)
        dtype = "f32" if dtype_bytes == 4 else "bf16"
        out = []
        for cls in (TensorClass.ATTENTION, TensorClass.DENSE_FFN, TensorClass.SHARED_EXPERTS, TensorClass.EMBEDDING,
                    TensorClass.LM_HEAD):
            for f in sorted(self.inv.gpu_forms.get(cls, ()), key=lambda f: (f.widened, -f.bytes)):
                out.append({"class": cls.value, "stored": f.stored, "held": dtype if f.widened else "as stored",
                            "tensors": f.tensors, "bytes": f.held_bytes(dtype_bytes), "example": f.example})
        router = self.inv.types_by_class.get(TensorClass.ROUTER, {})
        if router:
            out.append({"class": TensorClass.ROUTER.value, "stored": "+".join(sorted(router)),
                        "held": "as routed", "tensors": sum(u.tensors for u in router.values()),
                        "bytes": self.inv.gpu_held_bytes(TensorClass.ROUTER, dtype_bytes, B.router_element_bytes(self.spec)),
                        "example": min(router.values(), key=lambda u: u.example).example})
        return tuple(out)

    def _precision_notes(self, lay: _Layout) -> tuple[str, ...]:
        """What the plan holds at a lower precision than the file stores it, one sentence each."""
        stored = self.WIDE_FORMATS.get(self.inv.expert_format)
        if stored is None or lay.form not in ("int8", "int4") or not any(lay.gpu_experts.values()):
            return ()
        why = ("asked for (--gpu-experts)" if self.wl.gpu_expert_form != "auto"
               else f"all {self.E} experts of every layer do not fit on the GPUs in {stored}")
        return (f"the GPU experts are stored in {stored} and held as weight-only {lay.form} (one scale per output row): "
                f"{why}. Their outputs differ from {stored}'s by the rounding; --gpu-experts dense keeps {stored}, "
                "with fewer experts on the GPUs.",)

    def _resident_form(self, lefts, moe_by_card, per_card: int) -> str:
        """"dense" when every card holds its `per_card` routed experts of each of its layers that
        way, else "stored" for a GGUF whose expert types the GPU kernels read (the file's bytes and
        values), else "int4" for experts stored in a 4-bit format, else "int8"."""
        if self.wl.gpu_expert_form != "auto":
            return self.wl.gpu_expert_form
        dense = self.resident["dense"]
        fits = all(len(layers) * per_card * dense <= left for left, layers in zip(lefts, moe_by_card) if layers)
        return "dense" if fits else "stored" if self.stored_gbpe else "int4" if self.int4 else "int8"

    def _cpu_share(self, layer: int, gpu_ids) -> float:
        """Share of a layer's activations computed on the CPU: measured when stats exist."""
        if self.stats:
            share = self.stats.activation_share(layer, gpu_ids)
            if share is not None:
                return 1.0 - share
        return 1.0 - len(gpu_ids) / self.E

    def _decode(self, gpus, lay: _Layout, users: int):
        """One decode step for `users` conversations (one token each) in layout `lay`."""
        touched = experts_touched(self.E, self.k, users)
        gpu_experts = lay.gpu_experts
        host = sum(touched * self._cpu_share(layer, gpu_experts[layer]) * self.host_bpe[layer] for layer in self.moe)
        slow = sum(touched * self._cpu_share(layer, gpu_experts[layer]) * self.slow.bytes_by_layer.get(layer, 0) / self.E
                   for layer in self.moe) if self.slow else 0.0
        on_slow_path = {"host_slow_bytes": slow, "slowdown": SLOW_PATH_SLOWDOWN}
        experts = host
        gpu_reads = []
        if gpus:
            for c, run in enumerate(lay.runs):
                b = 0.0
                for layer in run:
                    b += lay.share * self.gpu.layer(layer) + lay.kv_share * self.kv_layer(layer, users)
                    held = len(lay.experts_by_card[c].get(layer, ()))
                    if held:  # this card's part of the GPU experts the step touches
                        gpu_share = 1 - self._cpu_share(layer, gpu_experts[layer])
                        b += touched * gpu_share * held / len(gpu_experts[layer]) * lay.gbpe[layer]
                if lay.kind == "tp" or c == len(lay.runs) - 1:
                    b += lay.share * self.gpu.head_read
                gpu_reads.append((b, gpus[c].memory_bandwidth_bytes_per_s))
        else:
            # CPU-only: the always-read weights and the cache come from host memory too.
            host += sum(self.host.layer(layer) + self.kv_layer(layer, users) for layer in range(self.spec.num_layers))
            host += self.host.head_read
        if lay.kind == "tp":
            return decode_step(host_bytes=host, host_bandwidth=self.hw.memory.bandwidth_bytes_per_s,
                               gpu_bytes_by_card=gpu_reads, cards_in_parallel=True,
                               all_reduces=tp_all_reduces(self.spec.num_layers), host_expert_bytes=experts, **on_slow_path)
        return decode_step(host_bytes=host, host_bandwidth=self.hw.memory.bandwidth_bytes_per_s, gpu_bytes_by_card=gpu_reads,
                           host_expert_bytes=experts, **on_slow_path)

    def _layout(self, kind: str, gpus, budgets, activations) -> _Layout:
        """Weights, caches, reserves and routed experts of each card for a pipeline ("pp": each
        card holds whole layers, a run of them) or tensor parallelism ("tp": every card holds
        a share of every layer: its heads, its slice of the dense and shared MLPs and of the
        head; the MLA latent cache, which every head reads, whole)."""
        spec, wl, n = self.spec, self.wl, len(gpus)
        if kind == "pp":
            runs, share, kv_share = placement.split_layers(spec.num_layers, budgets), 1.0, 1.0
        else:
            runs, share = [tuple(range(spec.num_layers))] * n, 1.0 / n
            kv_share = 1.0 if spec.attention == "mla" else math.ceil(spec.num_kv_heads / n) / spec.num_kv_heads
        moe_by_card = [[layer for layer in run if layer in self.moe] for run in runs]
        card_classes, lefts = [], []
        for c, run in enumerate(runs):
            parts = {
                "always_read": share * self.gpu.on_card(kind, runs, c),
                "kv_cache": kv_share * sum(self.kv_layer(layer, wl.users) for layer in run),
                # The sizing rule for described cards already covers activations (and the
                # scratch of one expert widened on the card); llama.cpp's budget counts its
                # compute buffers as such.
                "activations": (self._llamacpp_compute_buffer() if self.llama
                                else 0 if self.hw.described else activations + B.expert_scratch_bytes(spec)),
            }
            lefts.append(budgets[c] - sum(parts.values()))
            card_classes.append(parts)
        # Under tensor parallelism a card holds its share of each layer's experts.
        per_card = self.E if kind == "pp" else math.ceil(self.E / n)
        if self.llama and kind == "pp" and gpus:
            return self._llamacpp_layout(runs, card_classes, lefts, moe_by_card)
        form = self._resident_form(lefts, moe_by_card, per_card)
        gbpe = dict(self.stored_gbpe) if form == "stored" else {layer: self.resident[form] for layer in spec.moe_layers}
        reserves, avail = [], []
        for c, left in enumerate(lefts):
            layer_bytes = max((B.prefill_reserve_bytes(self.E, self.bpe[layer]) for layer in moe_by_card[c]), default=0)
            if kind == "tp" and c > 0:
                layer_bytes = 0  # the first card runs the CPU experts, so it alone streams them
            all_experts = sum(per_card * gbpe[layer] for layer in moe_by_card[c])
            want_reserve = wl.prefill_reserve == "on" or (
                wl.prefill_reserve == "auto" and all_experts > left and layer_bytes <= left
            )
            reserves.append(int(layer_bytes) if want_reserve and layer_bytes else 0)
            avail.append(left - reserves[-1])

        if not gpus:
            gpu_experts: dict[int, tuple[int, ...]] = {layer: () for layer in spec.moe_layers}
        elif kind == "tp":
            # The cards are one pool: each layer's experts are dealt out to them afterwards.
            pool = [sum(max(a, 0) for a in avail)]
            if wl.strategy == "frequency":
                gpu_experts = placement.frequency(pool, [spec.moe_layers], gbpe, self.stats)
            else:  # the same number in every layer: what the cards hold of it together
                per_layer = sum(gbpe.values())
                n_each = sum(math.floor(max(a, 0) / per_layer) for a in avail) if per_layer else 0
                gpu_experts = placement.top(spec.moe_layers, min(self.E, n_each), self.E, self.stats)
        elif wl.strategy == "frequency":
            gpu_experts = placement.frequency(avail, moe_by_card, gbpe, self.stats)
        else:
            gpu_experts = placement.uniform(avail, moe_by_card, gbpe, self.E, self.stats)
        if kind == "tp":
            experts_by_card = placement.deal(gpu_experts, [max(a, 0) for a in avail], gbpe)
        else:
            experts_by_card = [{layer: gpu_experts[layer] for layer in layers} for layers in moe_by_card]
        return _Layout(kind, runs, share, kv_share, card_classes, reserves, avail, form, gbpe, gpu_experts,
                       experts_by_card)

    def _llamacpp_compute_buffer(self) -> int:
        """A card's compute buffer in llama.cpp at the plan's micro-batch (budget.llamacpp_compute_buffer)."""
        n_ubatch = 2048  # the plan's -ub with a GPU (llamacpp.translate)
        largest_tensor = max((self.bpe[layer] * self.E / 3 for layer in self.spec.moe_layers), default=0.0)
        return B.llamacpp_compute_buffer(self.spec, n_ubatch, largest_tensor)

    def _llamacpp_layout(self, runs, card_classes, lefts, moe_by_card) -> _Layout:
        """llama.cpp's pipeline: each card its run of layers (-ts in proportion to the budgets),
        every tensor as stored, and the routed experts of whole layers: blocks 0..N-1 on the CPU
        (--n-cpu-moe N), the smallest N whose GPU layers' experts fit on their cards, or the
        workload's N (then `over` says what each card lacks for them)."""
        E, bpe = self.E, self.bpe

        def need(n_cpu_moe: int) -> list[float]:
            return [sum(E * bpe[layer] for layer in layers if layer >= n_cpu_moe) for layers in moe_by_card]

        last = max(self.spec.moe_layers, default=-1) + 1
        n_cpu_moe = self.wl.n_cpu_moe
        if n_cpu_moe is None:
            n_cpu_moe = next((n for n in range(last + 1)
                              if all(x <= max(left, 0) for x, left in zip(need(n), lefts))), last)
        on_gpu = need(n_cpu_moe)
        over = [max(0.0, x - max(left, 0)) for x, left in zip(on_gpu, lefts)]
        gpu_experts = {layer: tuple(range(E)) if layer >= n_cpu_moe else () for layer in self.spec.moe_layers}
        experts_by_card = [{layer: gpu_experts[layer] for layer in layers} for layers in moe_by_card]
        return _Layout("pp", runs, 1.0, 1.0, card_classes, [0] * len(runs), list(lefts), "stored",
                       dict(bpe), gpu_experts, experts_by_card, over=over)

    def _summary(self, lay: _Layout) -> dict[str, Any]:
        counts = [len(ids) for ids in lay.gpu_experts.values()]
        return {
            "fits": all(a >= 0 for a in lay.avail) and not any(lay.over),
            "runnable": lay.kind in self._runnable(),
            "gpu_expert_format": B.resident_form_name(self.spec, lay.form),
            "gpu_experts_per_layer": min(counts, default=0),
            "host_bytes_per_token": lay.single.host_bytes_per_step,
            "gpu_bytes_per_token": lay.single.gpu_bytes_per_step,
            "decode_tokens_per_s_upper_bound": lay.single.tokens_per_s_per_user,
            "decode_bound_by": lay.single.bound_by,
            "decode_tokens_per_s_per_user": lay.multi.tokens_per_s_per_user,
        }

    def _runnable(self) -> tuple[str, ...]:
        """The layouts the plan's backend runs (the engine's, unless the plan is for llama.cpp)."""
        return RUNS["llamacpp" if self.wl.backend == "llamacpp" else "engine"]

    def _choose(self, layouts: dict[str, _Layout]) -> str:
        """The layout asked for, or (auto) among those the backend runs, the one that fits with
        the higher decode speed for the workload's conversations together (a pipeline on a tie:
        it moves less between cards)."""
        asked = self.wl.parallel
        if asked == "tp" and "tp" not in layouts:
            self.warnings.append("Tensor parallelism needs two or more GPUs: the plan is a single-card layout.")
        elif asked == "tp" and "tp" not in self._runnable():
            self.warnings.append("llama.cpp does not run tensor parallelism with expert offload: "
                                 "this plan is for the embedded engine (--backend engine).")
        if asked != "auto":
            return asked if asked in layouts else "pp"

        def rank(kind):
            lay = layouts[kind]
            return (all(a >= 0 for a in lay.avail), lay.multi.tokens_per_s_per_user or 0.0, kind == "pp")

        return max((kind for kind in layouts if kind in self._runnable()), key=rank)

    def _bandwidth_source(self) -> str:
        m = self.hw.memory
        if m.bandwidth_theoretical_bytes_per_s:
            return "theoretical" + (f": {m.bandwidth_note}" if m.bandwidth_note else "")
        if m.bandwidth_measured_bytes_per_s:
            return "measured on this machine" + (f", {m.bandwidth_measured_note}" if m.bandwidth_measured_note else "")
        return "unknown"

    # ---- fit, suggestions, outgrown ------------------------------------------------------------

    def _judge(self, gpus, lay: _Layout, budgets, host_parts, host_needed, usable):
        suggestions: list[str] = []
        reasons: list[str] = []
        reserves = lay.reserves
        for c, a in enumerate(lay.avail):
            if a < 0:
                parts = lay.card_classes[c]
                reasons.append(
                    f"GPU {c} is short by {-a / GIB:.1f} GiB for its layers' always-read weights "
                    f"({parts['always_read'] / GIB:.1f} GiB) and KV cache ({parts['kv_cache'] / GIB:.1f} GiB)"
                    + (f" and prefill reserve ({reserves[c] / GIB:.1f} GiB)" if reserves[c] else "")
                )
                room = budgets[c] - parts["always_read"] - parts["activations"] - reserves[c]
                suggestions += self._kv_suggestions(room, lay.runs[c], lay.kv_share)
                stored = lay.share * self.stored.on_card(lay.kind, lay.runs, c)
                if stored < parts["always_read"] and lay.kind in RUNS["llamacpp"]:
                    suggestions.append(
                        f"llama.cpp keeps these weights as the file stores them ({stored / GIB:.1f} GiB on GPU {c} "
                        f"where the engine widens them to {parts['always_read'] / GIB:.1f} GiB): --backend llamacpp.")
                if reserves[c]:
                    suggestions.append("Turn the prefill reserve off (--prefill-reserve off).")
        for c, over in enumerate(lay.over):
            if over > 0 and lay.avail[c] >= 0:
                gpu_layers = sorted(layer for layer in lay.experts_by_card[c] if lay.experts_by_card[c][layer])
                reasons.append(f"GPU {c} is short by {over / GIB:.1f} GiB for the experts of blocks "
                               f"{gpu_layers[0]}..{gpu_layers[-1]} (--n-cpu-moe {self.wl.n_cpu_moe})")
                fitting = self._llamacpp_fitting_n_cpu_moe(lay)
                if fitting is not None:
                    suggestions.append(f"Keep more blocks' experts on the CPU: --n-cpu-moe {fitting} fits.")
        if usable is None:
            self.warnings.append("Host RAM size unknown: the host side of the plan is not checked.")
        elif host_needed > usable:
            reasons.append(
                f"host RAM is short by {(host_needed - usable) / GIB:.1f} GiB: the plan needs "
                f"{host_needed / GIB:.1f} GiB (incl. {B.host_reserve(usable) / GIB:.1f} GiB reserve), "
                f"{usable / GIB:.1f} GiB is usable"
            )
            bits = self.inv.expert_bits_per_weight
            if bits > Q4_K_M_BITS + 0.1:
                saved = host_parts["routed_experts"] * (1 - Q4_K_M_BITS / bits)
                verb = "would fit" if host_needed - saved <= usable else "would still not fit"
                if verb != "would fit" and not gpus:  # the cache is in host RAM too: a shorter one may do
                    context = self._max_context(usable - (host_needed - saved - host_parts["kv_cache"]),
                                                range(self.spec.num_layers))
                    if context:
                        verb = f"would fit with a context of at most {context} tokens (--context {context})"
                suggestions.append(
                    f"A Q4_K_M quantization ({Q4_K_M_BITS:.2f} bits/weight for experts instead of {bits:g}) saves "
                    f"about {saved / GIB:.0f} GiB of host RAM and {verb}."
                )
            if not gpus:
                room = usable - (host_needed - host_parts["kv_cache"])
                if room > 0:
                    suggestions += self._kv_suggestions(room, range(self.spec.num_layers))
                else:
                    # Not the cache: the weights alone are more than the host holds.
                    suggestions.append(
                        f"The weights alone need {(host_needed - host_parts['kv_cache']) / GIB:.1f} GiB of the "
                        f"{usable / GIB:.1f} GiB usable, even without a KV cache: a smaller quantization or more RAM.")
            suggestions.append(f"Or a machine with at least {math.ceil(host_needed / GIB)} GiB of usable RAM.")
        if not reasons:
            return True, "the layout fits in GPU memory and host RAM" if gpus else "the layout fits in host RAM", suggestions
        return False, "; ".join(reasons), list(dict.fromkeys(suggestions))

    def _llamacpp_fitting_n_cpu_moe(self, lay: _Layout) -> int | None:
        """The smallest --n-cpu-moe whose GPU layers' experts fit on their cards (llama.cpp's layout)."""
        E, last = self.E, max(self.spec.moe_layers, default=-1) + 1
        for n in range(last + 1):
            if all(sum(E * self.bpe[layer] for layer in layers if layer >= n) <= max(lay.avail[c], 0)
                   for c, layers in enumerate(lay.experts_by_card)):
                return n
        return None

    def _max_context(self, room_for_kv: float, layers, kv_share: float = 1.0) -> int | None:
        """The longest context, in whole KV blocks, whose cache for the workload's users fits in
        `room_for_kv` bytes; None when not even one block does."""
        per_user_token = kv_share * sum(self.kv_layer(layer, 1) for layer in layers) / self.wl.context
        if room_for_kv <= 0 or not per_user_token:
            return None
        context = int(room_for_kv / (self.wl.users * per_user_token))
        context -= context % KV_BLOCK_TOKENS
        return context if context >= KV_BLOCK_TOKENS else None

    def _kv_suggestions(self, room_for_kv: float, layers, kv_share: float = 1.0) -> list[str]:
        """The context length or number of conversations whose cache fits in `room_for_kv` bytes
        (of which a card holds `kv_share` of each of `layers`)."""
        wl = self.wl
        per_user_token = kv_share * sum(self.kv_layer(layer, 1) for layer in layers) / wl.context
        if room_for_kv <= 0 or not per_user_token:
            # Only a card can be short of room for its always-read weights: host RAM then
            # holds them with --strategy cpu-only (never suggested where it is in force).
            if not self.gpus:
                return ["The always-read weights alone do not fit: a smaller quantization or more memory."]
            return ["The always-read weights alone do not fit on the GPU: add GPU memory, or keep every weight in "
                    "host RAM (--strategy cpu-only)."]
        out = []
        max_ctx = int(room_for_kv / (wl.users * per_user_token))
        # The cache is handed out in whole blocks (docs/sizing.md §2): a context that fits is whole blocks.
        max_ctx -= max_ctx % KV_BLOCK_TOKENS
        max_users = int(room_for_kv / (wl.context * per_user_token))
        if 1 <= max_ctx < wl.context:
            out.append(f"A shorter context fits: at most {max_ctx} tokens with {wl.users} user(s) (--context {max_ctx}).")
        if 1 <= max_users < wl.users:
            out.append(f"Fewer conversations fit: at most {max_users} at {wl.context} tokens (--users {max_users}).")
        if self.kv_elem > 1.0:
            out.append("An 8-bit KV cache halves the cache (--kv-dtype fp8)." if self.llama else
                       "llama.cpp's 8-bit KV cache halves the cache (--backend llamacpp --kv-dtype fp8).")
        return out

    def _outgrown(self, fits, reason, per_user, single) -> bool:
        """One workstation is not enough when users × context or the wanted speed do not fit."""
        wl = self.wl
        kv_bound = not fits and "KV cache" in reason and wl.users > 1
        slow = wl.users > 1 and per_user is not None and per_user < wl.target_tokens_per_s
        if slow:
            self.warnings.append(
                f"With {wl.users} users each gets at most {per_user:.1f} tokens/s "
                f"(target {wl.target_tokens_per_s:g}): the workload has outgrown one workstation."
            )
        return kv_bound or slow
