"""Plain-text renderings of a hardware profile, a model and a plan, for the CLI.

Each number printed by `plan` carries the arithmetic that produced it and the docs/sizing.md
section it comes from, so a person can check it by hand.
"""

from __future__ import annotations

from hybridmoe.backend.hardware.profile import HardwareProfile
from hybridmoe.backend.models.inventory import TensorClass
from hybridmoe.backend.plan.estimate import ALL_REDUCE_SECONDS, tp_all_reduces
from hybridmoe.backend.plan.plan import Plan
from hybridmoe.backend.units import fmt_bytes, fmt_rate

GB = 1e9


def _kv_lines(rows: list[tuple[str, str]], indent: int = 2) -> list[str]:
    width = max((len(k) for k, _ in rows), default=0)
    return [f"{' ' * indent}{k.ljust(width)}  {v}" for k, v in rows]


def _table(header: list[str], rows: list[list[str]], indent: int = 2) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: " " * indent + "  ".join(  # noqa: E731
        str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))
    )
    return [fmt(header), *[fmt(r) for r in rows]]


# ---- doctor -------------------------------------------------------------------------------


def hardware_text(hw: HardwareProfile, extra: list[tuple[str, str]] | None = None) -> str:
    cpu, mem = hw.cpu, hw.memory
    out = [f"Hardware: {hw.name}" + (" (described)" if hw.described else "")]
    out.append("CPU")
    numa = ", ".join(
        f"node {n.id}: {len(n.cpus)} CPUs, {fmt_bytes(n.memory_total_bytes)}" for n in cpu.numa_nodes
    )
    out += _kv_lines(
        [
            ("model", cpu.model_name or "unknown"),
            ("architecture", cpu.arch or "unknown"),
            ("sockets", str(cpu.sockets or "unknown")),
            ("cores / threads", f"{cpu.physical_cores or 'unknown'} physical / {cpu.threads or 'unknown'} logical"),
            ("NUMA", numa or "unknown"),
            ("features", " ".join(cpu.features) or "none detected"),
            ("L3 cache", fmt_bytes(cpu.l3_bytes)),
        ]
    )
    out.append("Memory")
    rows = [
        ("total", fmt_bytes(mem.total_bytes)),
        ("available", fmt_bytes(mem.available_bytes)),
        ("container limit", fmt_bytes(mem.cgroup_limit_bytes) if mem.cgroup_limit_bytes else "none"),
        ("usable", fmt_bytes(mem.usable_bytes)),
    ]
    if mem.hugepages_total:
        rows.append(("huge pages", f"{mem.hugepages_total} × {fmt_bytes(mem.hugepage_size_bytes)}"))
    if mem.transparent_hugepages == "never":
        rows.append(("transparent huge pages", "never: the CPU reads its weights and KV cache in 4 KiB pages, "
                     "slower to decode (as root: echo madvise > /sys/kernel/mm/transparent_hugepage/enabled)"))
    elif mem.transparent_hugepages:
        rows.append(("transparent huge pages", f"{mem.transparent_hugepages} (the CPU's weights and KV cache use them)"))
    measured = fmt_rate(mem.bandwidth_measured_bytes_per_s)
    if mem.bandwidth_measured_bytes_per_s and mem.bandwidth_measured_note:
        measured += f" ({mem.bandwidth_measured_note})"
    rows.append(("bandwidth, measured", measured))
    theo = fmt_rate(mem.bandwidth_theoretical_bytes_per_s)
    rows.append(("bandwidth, theoretical", theo + (f" ({mem.bandwidth_note})" if mem.bandwidth_note else "")))
    out += _kv_lines(rows)
    out.append("GPUs")
    if not hw.gpus:
        out.append("  none")
    for g in hw.gpus:
        cc = ".".join(map(str, g.compute_capability)) if g.compute_capability else "unknown"
        pcie = f"PCIe gen {g.pcie_generation} x{g.pcie_width}" if g.pcie_generation else "PCIe unknown"
        line = (
            f"  {g.index}: {g.name} — {fmt_bytes(g.total_bytes)} total, {fmt_bytes(g.free_bytes)} free, "
            f"compute {cc}, {pcie}"
        )
        if g.nvlink_links:
            line += f", NVLink ×{g.nvlink_links}"
        if not g.served:
            line += " (not served by the hybrid backend)"
        out.append(line)
    if hw.disk:
        out.append("Disk")
        out += _kv_lines([(hw.disk.path, f"{fmt_bytes(hw.disk.free_bytes)} free of {fmt_bytes(hw.disk.total_bytes)}")])
    if extra:
        out.append("Software")
        out += _kv_lines(extra)
    if hw.unknown:
        out.append("Unknown")
        out += _kv_lines(sorted(hw.unknown.items()))
    return "\n".join(out)


# ---- inspect ------------------------------------------------------------------------------


def model_text(model) -> str:
    spec, inv = model.spec, model.inventory
    attn = (
        f"MLA, latent {spec.kv_lora_rank} + rope {spec.qk_rope_head_dim}"
        if spec.attention == "mla"
        else f"GQA, {spec.num_attention_heads} heads / {spec.num_kv_heads} KV heads × {spec.head_dim}"
    )
    if spec.sliding_window and spec.sliding_layers:
        attn += f"; {len(spec.sliding_layers)} sliding-window layers ({spec.sliding_window} tokens)"
    out = [f"Model: {spec.name} ({spec.family}, {spec.architecture}) from {model.kind} {model.path}"]
    out += _kv_lines(
        [
            ("layers", f"{spec.num_layers} ({len(spec.dense_layers)} dense, {spec.n_moe_layers} MoE)"
             + (f", plus {spec.n_mtp_layers} MTP" if spec.n_mtp_layers else "")),
            ("hidden / vocab", f"{spec.hidden_size} / {spec.vocab_size}"),
            ("attention", attn),
            ("experts", f"{spec.n_routed_experts} routed, top-{spec.experts_per_token}, "
             f"intermediate {spec.moe_intermediate_size}"
             + (f"; {spec.n_shared_experts} shared ({spec.shared_intermediate_size})" if spec.n_shared_experts else "")),
            ("context", f"{spec.max_context} tokens"),
            ("formats", f"experts {_stored_as(inv, (TensorClass.ROUTED_EXPERTS,), inv.expert_format)} "
             f"({inv.expert_bits_per_weight:g} bits/weight), rest {_stored_as(inv, _REST, spec.other_format)}"),
            ("KV per token", f"{fmt_bytes(spec.kv_bytes_per_token())} (bf16)"),
        ]
    )
    out.append(f"Tensor inventory ({inv.source})")
    rows = [[c.value, fmt_bytes(inv.bytes_by_class.get(c, 0)), f"{inv.bytes_by_class.get(c, 0) / GB:,.2f} GB"]
            for c in TensorClass]
    rows.append(["total", fmt_bytes(inv.total_bytes), f"{inv.total_bytes / GB:,.2f} GB"])
    out += _table(["class", "GiB", "GB"], rows)
    if spec.moe_layers:
        layer = spec.moe_layers[0]
        out.append(
            f"  per expert: 3 × {spec.hidden_size} × {spec.moe_intermediate_size} = {spec.params_per_expert:,} weights, "
            f"{inv.bytes_per_expert(layer) / 1e6:,.2f} MB"
        )
    out += _type_lines(inv)
    for note in inv.notes:
        out.append(f"  note: {note}")
    return "\n".join(out)


_REST = (TensorClass.ATTENTION, TensorClass.DENSE_FFN, TensorClass.SHARED_EXPERTS)


def _stored_as(inv, classes: tuple[TensorClass, ...], named: str) -> str:
    """The types the tensors of `classes` are stored in, most bytes first ("iq3_xxs+iq2_xxs"
    for a dynamic mix, whose file type names one type only), else the format the model names."""
    used: dict[str, int] = {}
    for c in classes:
        for name, use in (inv.types_by_class or {}).get(c, {}).items():
            if name not in ("f32", "f16", "bf16") or len(inv.types_by_class[c]) == 1:
                used[name] = used.get(name, 0) + use.bytes
    return "+".join(sorted(used, key=lambda n: -used[n])) if len(used) > 1 else named


def _type_lines(inv) -> list[str]:
    """The storage types of the model: tensors and bytes of each, then which types each class
    holds (a community "dynamic" GGUF changes types from tensor to tensor and layer to layer)."""
    if not inv.types_by_class:
        return []
    out = ["Tensor types (as stored)"]
    out += _table(["type", "tensors", "GiB", "GB"],
                  [[name, f"{use.tensors:,}", fmt_bytes(use.bytes), f"{use.bytes / GB:,.2f} GB"]
                   for name, use in inv.types.items()])
    out.append("Types by class")
    out += _kv_lines([
        (c.value, ", ".join(f"{name} ({use.tensors})" for name, use in
                            sorted(inv.types_by_class[c].items(), key=lambda kv: -kv[1].bytes)))
        for c in TensorClass if inv.types_by_class.get(c)
    ])
    return out


# ---- plan ---------------------------------------------------------------------------------


def _experts_per_layer(plan: Plan) -> str:
    counts = [len(plan.gpu_experts.get(layer, ())) for layer in plan.moe_layers]
    if not counts:
        return "no MoE layers"
    whole = [layer for layer in plan.moe_layers if plan.gpu_experts.get(layer)]
    if plan.workload.backend == "llamacpp" and whole:  # llama.cpp: whole layers (--n-cpu-moe)
        return (f"all {plan.n_routed_experts} experts of {len(whole)} of the {len(counts)} MoE layers "
                f"(blocks {whole[0]}..{whole[-1]})")
    if min(counts) == max(counts):
        return f"{counts[0]} of {plan.n_routed_experts} in each of {len(counts)} MoE layers"
    return f"{min(counts)}–{max(counts)} of {plan.n_routed_experts} per MoE layer ({sum(counts)} in all)"


def _gpu_form(plan: Plan) -> str:
    """", held as int4 (24.77 MB each)": how a GPU holds its experts, when it holds any (held
    as stored, a mix's layers differ: "24.77–28.56 MB each")."""
    if not plan.gpu_expert_count or not plan.gpu_bytes_per_expert:
        return ""
    sizes = [plan.gpu_bytes_per_expert[layer] for layer, ids in plan.gpu_experts.items() if ids]
    low, high = min(sizes), max(sizes)
    each = f"{low / 1e6:,.2f}" + (f"–{high / 1e6:,.2f}" if f"{high / 1e6:,.2f}" != f"{low / 1e6:,.2f}" else "")
    return f", held as {plan.gpu_expert_format} ({each} MB each)"


LAYOUT_NAMES = {"pp": "pipeline (pp)", "tp": "tensor parallel (tp)"}


def _expected_and_bound(expected: float | None, bound: float | None) -> str:
    """"expected 16.7 tokens/s, at most 25.6": the plan's two figures in the order it gives them."""
    if bound is None:
        return "unknown"
    return (f"expected {expected:,.1f} tokens/s, " if expected else "") + f"at most {bound:,.1f} tokens/s"


def expected_sources(plans) -> list[str]:
    """Where the expected figures of `plans` came from (``decode_expected_source``), each once, in
    order: what a table of them says beneath it (the catalogue, the wizard)."""
    return list(dict.fromkeys(p.decode_expected_source for p in plans if p is not None and p.decode_expected_source))


def speed_words(plan: Plan) -> str:
    """The plan's decode speed in one phrase, as every screen says it: the expected figure
    first, the bound second (docs/sizing.md §6)."""
    return _expected_and_bound(plan.decode_tokens_per_s_expected, plan.decode_tokens_per_s_upper_bound)


def _layouts(plan: Plan) -> list[str]:
    """Both ways of sharing the GPUs side by side, and which one the plan is."""
    users = plan.workload.users
    head = ["layout", "GPU experts/layer", "host GB/token", "GPU GB/token", "1 conversation", f"{users} together"]
    head = head if users > 1 else head[:-1]
    rows = []
    for kind, lay in plan.layouts.items():
        one, per_user = lay["decode_tokens_per_s_upper_bound"], lay["decode_tokens_per_s_per_user"]
        rows.append([
            LAYOUT_NAMES[kind] + (" *" if kind == plan.parallel else "") + ("" if lay["fits"] else " (does not fit)")
            + ("" if lay["runnable"] else " (not on llama.cpp)"),
            f"{lay['gpu_experts_per_layer']} {lay['gpu_expert_format']}",
            f"{lay['host_bytes_per_token'] / GB:,.2f}",
            f"{lay['gpu_bytes_per_token'] / GB:,.2f}" + (" per card" if kind == "tp" else ""),
            f"{one:,.1f} tok/s" if one else "unknown",
            f"{per_user * users:,.1f} tok/s" if per_user else "unknown",
        ][: len(head)])
    why = ("asked for (--parallel)" if plan.workload.parallel != "auto"
           else "the faster for this workload (--parallel auto)")
    return [f"GPU layouts (docs/sizing.md §5; * = this plan, {why})", *_table(head, rows)]


def _gpu_always_read_lines(plan: Plan) -> list[str]:
    """The engine's always-read weights on the GPUs, class by class, in the form each storage
    type is held there (as stored, or widened to the compute dtype); nothing where every one is
    held as the file stores it in the compute dtype already (a bf16 checkpoint)."""
    forms = plan.gpu_always_read_forms
    if not any(f["held"] == "as stored" or f["held"] not in ("as routed", f["stored"]) for f in forms):
        return []
    by_class: dict[str, list[str]] = {}
    for f in forms:
        same = f["held"] in ("as stored", "as routed", f["stored"])
        form = f["stored"] if same else f"{f['stored']}→{f['held']}"
        count = f"{f['tensors']} tensor{'s' if f['tensors'] != 1 else ''}"
        by_class.setdefault(f["class"], []).append(f"{form} {fmt_bytes(f['bytes'])} ({count}, e.g. {f['example']})")
    out = ["  always-read weights on the GPUs (whole model; → widened to the compute dtype, else as the file stores them):"]
    out += [f"    {name.replace('_', ' ')}: " + "; ".join(parts) for name, parts in by_class.items()]
    return out


def plan_text(plan: Plan) -> str:
    wl = plan.workload
    out = [
        f"Plan: {plan.model} ({plan.family}, experts {plan.expert_format}) on {plan.hardware}"
        + (" (described)" if plan.described_hardware else ""),
        f"Workload: {wl.context} tokens × {wl.users} conversation(s), KV {plan.kv_cache_dtype or wl.kv_dtype}, "
        f"strategy {wl.strategy}, prefill reserve {wl.prefill_reserve}",
        "",
    ]
    bpe_values = sorted(set(round(v) for v in plan.bytes_per_expert.values()))
    bpe = plan.bytes_per_expert[plan.moe_layers[0]] if plan.moe_layers else 0
    out.append("Routed experts (docs/sizing.md §1)")
    out += _kv_lines(
        [
            ("per expert", f"{bpe / 1e6:,.2f} MB" + (" (varies by layer)" if len(bpe_values) > 1 else "")),
            ("all", f"{len(plan.moe_layers)} layers × {plan.n_routed_experts} × per expert = "
             f"{plan.routed_expert_bytes_total / GB:,.1f} GB ({fmt_bytes(plan.routed_expert_bytes_total)})"),
            ("on GPUs", f"{_experts_per_layer(plan)}{_gpu_form(plan)}: {plan.gpu_routed_expert_bytes / GB:,.1f} GB"),
            ("in host RAM", f"{plan.host_routed_expert_bytes / GB:,.1f} GB"),
        ]
    )
    out.append("KV cache (docs/sizing.md §2)")
    out += _kv_lines(
        [
            ("per token", f"{plan.kv_bytes_per_token:,.0f} B ({fmt_bytes(plan.kv_bytes_per_token)})"),
            ("per conversation", f"{wl.context} tokens → {fmt_bytes(plan.kv_bytes_per_conversation)}"),
        ]
    )
    one_copy = wl.users * plan.kv_bytes_per_conversation
    copies = ""
    if plan.kv_cache_bytes > 1.01 * one_copy:  # tensor parallel MLA: every card the whole latent cache
        copies = f", on every card: {fmt_bytes(plan.kv_cache_bytes)} in all"
    out.append(f"Conversations at once: {wl.users} (KV cache: {wl.users} × {wl.context:,} tokens, "
               f"{fmt_bytes(one_copy)}{copies}); more wait their turn")
    out.append("Devices (docs/sizing.md §3, §4)")
    cls_order = ["always_read", "kv_cache", "activations", "prefill_reserve", "routed_experts"]
    rows = []
    for d in plan.devices:
        rows.append(
            [d.name, fmt_bytes(d.budget_bytes)]
            + [fmt_bytes(d.bytes_by_class[c]) if c in d.bytes_by_class else "-" for c in cls_order]
            + [fmt_bytes(d.used_bytes), fmt_bytes(d.free_bytes)]
        )
    out += _table(["device", "budget", "always-read", "KV", "activations", "reserve", "experts", "used", "free"], rows)
    out.append(
        f"  host RAM: needs {fmt_bytes(plan.host_ram_needed_bytes)} incl. reserve, "
        f"usable {fmt_bytes(plan.host_ram_usable_bytes)}"
    )
    out += _gpu_always_read_lines(plan)
    out.append("Decode speed, one conversation (docs/sizing.md §6: expected, then the upper bound)")
    rows = [
        ("expected", f"{plan.decode_tokens_per_s_expected:,.1f} tokens/s" if plan.decode_tokens_per_s_expected
         else plan.decode_expected_how or "unknown (a plan saved before expected figures)"),
    ]
    if plan.decode_tokens_per_s_expected:
        rows.append(("  how", plan.decode_expected_how))
    rows += [
        ("host reads / token", f"{plan.host_bytes_per_token / GB:,.3f} GB at {fmt_rate(plan.host_bandwidth_bytes_per_s)} "
         f"({plan.host_bandwidth_source})"),
        ("GPU reads / token", f"{plan.gpu_bytes_per_token / GB:,.3f} GB "
         + ("per card, all cards at once " if plan.parallel == "tp" else "")
         + "(always-read weights, GPU experts, KV cache at the full context)"
         + (f", then {tp_all_reduces(len(plan.devices[0].layers))} all-reduces of "
            f"{ALL_REDUCE_SECONDS * 1e6:g} us" if plan.parallel == "tp" else "")),
    ]
    if plan.decode_tokens_per_s_upper_bound:
        rows.append(("bound", f"at most {plan.decode_tokens_per_s_upper_bound:,.1f} tokens/s, set by {plan.decode_bound_by} "
                              "(every byte at the bandwidth above, the GPU and the CPU overlapping)"))
    else:
        rows.append(("bound", plan.decode_bound_by))
    out += _kv_lines(rows)
    if wl.users > 1:
        out.append(f"Decode speed, {wl.users} conversations together (docs/sizing.md §6)")
        per_user = plan.decode_tokens_per_s_per_user
        out += _kv_lines(
            [
                ("experts touched / layer", f"{plan.n_routed_experts} × (1 − (({plan.n_routed_experts} − "
                 f"{plan.experts_per_token}) / {plan.n_routed_experts})^{wl.users}) = {plan.experts_touched_per_layer:,.1f}"),
                ("per conversation", _expected_and_bound(plan.decode_tokens_per_s_per_user_expected, per_user)
                 + (f", the bound set by {plan.decode_bound_by_per_user}" if per_user and plan.decode_bound_by_per_user
                    else "")),
                ("all together", _expected_and_bound(plan.decode_tokens_per_s_aggregate_expected,
                                                     plan.decode_tokens_per_s_aggregate)),
                ("  how", plan.decode_expected_how_per_user or "unknown"),
            ]
        )
    if plan.prefill_tokens_per_s_expected:
        out.append(f"Prefill, expected: {plan.prefill_tokens_per_s_expected:,.0f} tokens/s ({plan.prefill_expected_how})")
    if plan.prefill_crossover_tokens:
        out.append(
            f"Prefill: streaming an expert to the GPU beats computing it on the CPU above "
            f"{plan.prefill_crossover_tokens:,.0f} tokens routed to it (docs/sizing.md §6, assumed 2.5 GHz CPU clock)"
        )
    if len(plan.layouts) > 1:
        out += _layouts(plan)
    lc = plan.llama_cpp
    out.append("llama.cpp: this plan's layout (docs/sizing.md §5)" if plan.workload.backend == "llamacpp"
               else "llama.cpp equivalent (docs/sizing.md §5: whole layers only)")
    out += _kv_lines(
        [
            ("experts on CPU", f"blocks 0..{lc['n_cpu_moe'] - 1}" if lc["n_cpu_moe"] else "none"),
            ("command", lc["command"]),
        ]
        + [("-ot", p) for p in lc["override_tensor"]]
    )
    for note in plan.precision_notes:
        out.append(f"Precision: {note}")
    out.append("")
    out.append(f"Fits: {'yes' if plan.fits else 'NO'} — {plan.reason}")
    for s in plan.suggestions:
        out.append(f"  - {s}")
    for w in plan.warnings:
        out.append(f"Warning: {w}")
    if plan.serving:
        out.append("One workstation is not enough for this workload (docs/sizing.md §7). A serving deployment that carries it:")
        out.append(f"  {plan.serving['summary']}")
        for key in ("vllm", "sglang"):
            if key in plan.serving:
                out.append(f"  {key}: {plan.serving[key]}")
    return "\n".join(out)
