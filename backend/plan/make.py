"""plan.make(): a model, a machine and a workload in; a Plan out (docs/sizing.md, all sections).

Order of placement on each GPU (section 3): always-read weights of its layers, the KV
cache of its layers for users × context, the activation scratch, the prefill reserve, then
routed experts until the budget is spent. Everything else stays in host RAM (section 4).

Routed experts are counted in two forms: as stored (host RAM, the decode reads of CPU
experts, and the prefill reserve, which streams them as stored) and as the engine holds
them on a GPU (``budget.resident_expert_bytes``): dense in the compute dtype when every
routed expert fits that way, else weight-only int8, which fits twice as many.
"""

from __future__ import annotations

import math

from hybridmoe.backend.errors import ModelError, PlanError
from hybridmoe.backend.hardware.profile import HardwareProfile
from hybridmoe.backend.models.formats import FORMATS
from hybridmoe.backend.models.inventory import TensorClass, TensorInventory
from hybridmoe.backend.models.spec import ModelSpec
from hybridmoe.backend.plan import budget as B
from hybridmoe.backend.plan import placement
from hybridmoe.backend.plan.estimate import (
    cpu_flops,
    decode_step,
    experts_touched,
    prefill_crossover_tokens,
    prefill_stream_min_tokens,
)
from hybridmoe.backend.plan.llamacpp import translate
from hybridmoe.backend.plan.plan import DevicePlan, Plan
from hybridmoe.backend.plan.serving import recommend
from hybridmoe.backend.plan.stats import ExpertStats
from hybridmoe.backend.plan.workload import Workload

GIB = 1 << 30
# Average bits per weight of a Q4_K_M GGUF, for the "smaller quantization" hint.
Q4_K_M_BITS = FORMATS["q4_k_m"].bits_per_weight


def make(spec: ModelSpec, inventory: TensorInventory, hardware: HardwareProfile, workload: Workload) -> Plan:
    return _Planner(spec, inventory, hardware, workload).plan()


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
        self.bpe = {layer: inventory.bytes_per_expert(layer) for layer in spec.moe_layers}
        # Bytes per expert on a GPU, by form; self.gbpe is the chosen form's (set in plan()).
        self.resident = {form: float(B.resident_expert_bytes(spec, form)) for form in B.RESIDENT_FORMS}
        self.gbpe = {layer: self.resident["dense"] for layer in spec.moe_layers}
        cls = inventory.bytes_by_class
        n_dense = len(spec.dense_layers) or 1
        n_moe = len(spec.moe_layers) or 1
        self.attn_l = cls.get(TensorClass.ATTENTION, 0) / spec.num_layers
        self.dense_l = cls.get(TensorClass.DENSE_FFN, 0) / n_dense
        self.moe_fixed_l = (cls.get(TensorClass.SHARED_EXPERTS, 0) + cls.get(TensorClass.ROUTER, 0)) / n_moe
        self.embedding = cls.get(TensorClass.EMBEDDING, 0)
        self.lm_head = cls.get(TensorClass.LM_HEAD, 0)
        # A tied head reads the embedding matrix in full every token.
        self.head_read = self.lm_head or (self.embedding if spec.tie_word_embeddings else 0)
        self.kv_elem = workload.kv_bytes_per_element
        self.kv_layer_token = spec.kv_bytes_per_token_per_layer(self.kv_elem)

    # ---- per-layer arithmetic ----------------------------------------------------------------

    def fixed_bytes(self, layer: int) -> float:
        """Always-read weights of one decoder layer."""
        return self.attn_l + (self.moe_fixed_l if layer in self.moe else self.dense_l)

    def kv_layer(self, layer: int, users: int) -> float:
        return users * self.spec.kv_tokens(layer, self.wl.context) * self.kv_layer_token

    # ---- the plan ------------------------------------------------------------------------------

    def plan(self) -> Plan:
        spec, wl = self.spec, self.wl
        gpus = self.hw.served_gpus if wl.strategy != "cpu-only" else ()
        if not self.hw.served_gpus:
            self.warnings.append("No GPU the hybrid backend can use: everything runs on the CPU, which is slow.")
        activations = B.activation_bytes(spec, wl.prefill_chunk)
        usable = self.hw.memory.usable_bytes
        host_reserve = B.host_reserve(usable)

        budgets = [B.gpu_budget(g, self.hw.described, activations) for g in gpus]
        runs = placement.split_layers(spec.num_layers, budgets)
        moe_by_card = [[layer for layer in run if layer in self.moe] for run in runs]
        card_classes, lefts, avail, reserves = [], [], [], []
        for c, run in enumerate(runs):
            parts = {
                "always_read": sum(self.fixed_bytes(layer) for layer in run)
                + (self.embedding if c == 0 else 0)
                + (self.lm_head if c == len(runs) - 1 else 0),
                "kv_cache": sum(self.kv_layer(layer, wl.users) for layer in run),
                # The sizing rule for described cards already covers activations (and the
                # scratch of one expert widened on the card).
                "activations": 0 if self.hw.described else activations + B.expert_scratch_bytes(spec),
            }
            lefts.append(budgets[c] - sum(parts.values()))
            card_classes.append(parts)
        form = self._resident_form(lefts, moe_by_card)
        self.gbpe = {layer: self.resident[form] for layer in spec.moe_layers}
        for c, left in enumerate(lefts):
            layer_bytes = max((B.prefill_reserve_bytes(self.E, self.bpe[layer]) for layer in moe_by_card[c]), default=0)
            all_experts = sum(self.E * self.gbpe[layer] for layer in moe_by_card[c])
            want_reserve = wl.prefill_reserve == "on" or (
                wl.prefill_reserve == "auto" and all_experts > left and layer_bytes <= left
            )
            reserves.append(int(layer_bytes) if want_reserve and layer_bytes else 0)
            avail.append(left - reserves[-1])

        if not gpus:
            gpu_experts: dict[int, tuple[int, ...]] = {layer: () for layer in spec.moe_layers}
        elif wl.strategy == "frequency":
            gpu_experts = placement.frequency(avail, moe_by_card, self.gbpe, self.stats)
        else:
            gpu_experts = placement.uniform(avail, moe_by_card, self.gbpe, self.E, self.stats)

        devices = []
        for c, g in enumerate(gpus):
            experts = sum(len(gpu_experts[layer]) * self.gbpe[layer] for layer in moe_by_card[c])
            by_class = {k: int(v) for k, v in card_classes[c].items()}
            by_class["prefill_reserve"] = reserves[c]
            by_class["routed_experts"] = int(experts)
            devices.append(
                DevicePlan(
                    name=f"cuda:{g.index} {g.name}",
                    kind="gpu",
                    budget_bytes=int(budgets[c]),
                    used_bytes=sum(by_class.values()),
                    bytes_by_class=by_class,
                    layers=runs[c],
                    bandwidth_bytes_per_s=g.memory_bandwidth_bytes_per_s,
                    torch_device=f"cuda:{g.index}",
                )
            )

        routed_total = self.inv.routed_expert_bytes
        gpu_routed = int(sum(len(ids) * self.gbpe[layer] for layer, ids in gpu_experts.items()))
        # Host RAM holds the stored form of every expert not on a GPU.
        host_routed = routed_total - int(sum(len(ids) * self.bpe[layer] for layer, ids in gpu_experts.items()))
        host_parts = {"routed_experts": host_routed}
        host_parts["kv_cache"] = 0
        if not gpus:
            host_parts["always_read"] = self.inv.always_read_bytes
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

        single = self._decode(gpus, runs, gpu_experts, users=1)
        multi = self._decode(gpus, runs, gpu_experts, users=wl.users)
        touched = experts_touched(self.E, self.k, wl.users)

        fits, reason, suggestions = self._judge(
            gpus, runs, budgets, avail, reserves, card_classes, host_parts, host_needed, usable
        )
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

        llama = translate(
            spec,
            self.inv.routed_bytes_by_layer,
            # llama.cpp needs no prefill reserve buffer (it offloads big batches by itself).
            gpu_expert_budget=sum(max(a, 0) for a in avail) + sum(reserves),
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
            experts_touched_per_layer=touched,
            decode_tokens_per_s_per_user=multi.tokens_per_s_per_user,
            decode_tokens_per_s_aggregate=(
                multi.tokens_per_s_per_user * wl.users if multi.tokens_per_s_per_user else None
            ),
            prefill_crossover_tokens=crossover,
            prefill_stream_min_tokens=stream_min,
            gpu_expert_format=B.resident_form_name(spec, form),
            gpu_bytes_per_expert=dict(self.gbpe),
            llama_cpp=llama,
            fits=fits,
            reason=reason,
            suggestions=tuple(suggestions),
            outgrown=outgrown,
            serving=serving,
            warnings=tuple(self.warnings),
        )

    def _resident_form(self, lefts, moe_by_card) -> str:
        """"dense" when every card holds all its layers' routed experts that way, else "int8"."""
        if self.wl.gpu_expert_form != "auto":
            return self.wl.gpu_expert_form
        dense = self.resident["dense"]
        fits = all(len(layers) * self.E * dense <= left for left, layers in zip(lefts, moe_by_card) if layers)
        return "dense" if fits else "int8"

    def _cpu_share(self, layer: int, gpu_ids) -> float:
        """Share of a layer's activations computed on the CPU: measured when stats exist."""
        if self.stats:
            share = self.stats.activation_share(layer, gpu_ids)
            if share is not None:
                return 1.0 - share
        return 1.0 - len(gpu_ids) / self.E

    def _decode(self, gpus, runs, gpu_experts, users: int):
        """One decode step for `users` conversations (one token each)."""
        touched = experts_touched(self.E, self.k, users)
        host = sum(touched * self._cpu_share(layer, gpu_experts[layer]) * self.bpe[layer] for layer in self.moe)
        gpu_reads = []
        if gpus:
            for c, run in enumerate(runs):
                b = sum(
                    self.fixed_bytes(layer)
                    + self.kv_layer(layer, users)
                    + (touched * (1 - self._cpu_share(layer, gpu_experts[layer])) * self.gbpe[layer] if layer in self.moe else 0)
                    for layer in run
                )
                if c == len(runs) - 1:
                    b += self.head_read
                gpu_reads.append((b, gpus[c].memory_bandwidth_bytes_per_s))
        else:
            # CPU-only: the always-read weights and the cache come from host memory too.
            host += sum(self.fixed_bytes(layer) + self.kv_layer(layer, users) for layer in range(self.spec.num_layers))
            host += self.head_read
        return decode_step(host_bytes=host, host_bandwidth=self.hw.memory.bandwidth_bytes_per_s, gpu_bytes_by_card=gpu_reads)

    def _bandwidth_source(self) -> str:
        m = self.hw.memory
        if m.bandwidth_theoretical_bytes_per_s:
            return "theoretical" + (f": {m.bandwidth_note}" if m.bandwidth_note else "")
        if m.bandwidth_measured_bytes_per_s:
            return "measured on this machine" + (f", {m.bandwidth_measured_note}" if m.bandwidth_measured_note else "")
        return "unknown"

    # ---- fit, suggestions, outgrown ------------------------------------------------------------

    def _judge(self, gpus, runs, budgets, avail, reserves, card_classes, host_parts, host_needed, usable):
        wl = self.wl
        suggestions: list[str] = []
        reasons: list[str] = []
        for c, a in enumerate(avail):
            if a < 0:
                parts = card_classes[c]
                reasons.append(
                    f"GPU {c} is short by {-a / GIB:.1f} GiB for its layers' always-read weights "
                    f"({parts['always_read'] / GIB:.1f} GiB) and KV cache ({parts['kv_cache'] / GIB:.1f} GiB)"
                    + (f" and prefill reserve ({reserves[c] / GIB:.1f} GiB)" if reserves[c] else "")
                )
                room = budgets[c] - parts["always_read"] - parts["activations"] - reserves[c]
                suggestions += self._kv_suggestions(room, runs[c])
                if reserves[c]:
                    suggestions.append("Turn the prefill reserve off (--prefill-reserve off).")
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
                suggestions.append(
                    f"A Q4_K_M quantization ({Q4_K_M_BITS:.2f} bits/weight for experts instead of {bits:g}) saves "
                    f"about {saved / GIB:.0f} GiB of host RAM and {verb}."
                )
            if not gpus:
                room = usable - (host_needed - host_parts["kv_cache"])
                suggestions += self._kv_suggestions(room, range(self.spec.num_layers))
            suggestions.append(f"Or a machine with at least {math.ceil(host_needed / GIB)} GiB of usable RAM.")
        if not reasons:
            return True, "the layout fits in GPU memory and host RAM", suggestions
        return False, "; ".join(reasons), list(dict.fromkeys(suggestions))

    def _kv_suggestions(self, room_for_kv: float, layers) -> list[str]:
        """The context length or number of conversations whose cache fits in `room_for_kv` bytes."""
        wl = self.wl
        per_user_token = sum(self.kv_layer(layer, 1) for layer in layers) / wl.context
        if room_for_kv <= 0 or not per_user_token:
            return ["The always-read weights alone do not fit: add memory, or use --strategy cpu-only."]
        out = []
        max_ctx = int(room_for_kv / (wl.users * per_user_token))
        max_users = int(room_for_kv / (wl.context * per_user_token))
        if 1 <= max_ctx < wl.context:
            out.append(f"A shorter context fits: at most {max_ctx} tokens with {wl.users} user(s) (--context {max_ctx}).")
        if 1 <= max_users < wl.users:
            out.append(f"Fewer conversations fit: at most {max_users} at {wl.context} tokens (--users {max_users}).")
        if self.kv_elem > 1.0:
            out.append("An 8-bit KV cache halves the cache (--kv-dtype fp8).")
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
