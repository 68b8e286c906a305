"""The planner counts a GGUF's bytes as stored whatever its tensor types: a file mixing the
community types (IQ1_S .. IQ3_S routed experts, Q4_1 / Q5_1 / IQ4_NL / IQ4_XS attention) and the
ternary TQ1_0 / TQ2_0, one type per tensor, changing from layer to layer. Inspection and the
plan's bytes (per expert, per class, per token) against the file's own tensor sizes."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from hybridmoe.backend.hardware.profile import CPU, HardwareProfile, Memory
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.models.formats import get_format, ggml_type_name, tensor_bytes
from hybridmoe.backend.models.inventory import TensorClass
from hybridmoe.app.render import plan_text
from hybridmoe.backend.plan import Workload, make

GIB = 1 << 30
H, INTER, E, TOP_K, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 256, 4, 2, 4, 2, 64, 96
# (gate, up, down) of each MoE layer: every GGUF type of the issue, a layer's three differing.
EXPERTS = [
    (T.IQ2_XXS, T.IQ2_XXS, T.IQ3_XXS),
    (T.IQ2_XS, T.IQ2_S, T.IQ3_S),
    (T.IQ1_S, T.IQ1_M, T.IQ2_XXS),
    (T.TQ1_0, T.TQ2_0, T.IQ4_XS),
    (T.Q4_1, T.Q5_1, T.IQ4_NL),
]
LAYERS = len(EXPERTS)
# q, k, v, o per layer (the last layer's v ternary: a type the CPU kernels do not read).
ATTENTION = [
    (T.Q4_1, T.Q5_1, T.IQ4_NL, T.IQ4_XS),
    (T.IQ3_S, T.IQ3_XXS, T.Q8_0, T.IQ2_S),
    (T.Q4_K, T.Q6_K, T.Q6_K, T.Q4_K),
    (T.IQ4_XS, T.IQ4_XS, T.Q5_1, T.IQ1_M),
    (T.Q5_K, T.Q4_1, T.TQ2_0, T.Q5_0),
]
NEW_TYPES = {T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M, T.TQ1_0, T.TQ2_0}


def _stored(rng: np.random.Generator, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    """Random bytes of a `qtype` tensor of `shape` (torch order); the planner reads no data."""
    block, size = GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block * size), dtype=np.uint8)


def write_mixed_gguf(path: Path) -> dict[str, tuple[T, int, tuple[int, ...]]]:
    """A tiny qwen3moe GGUF in the types above; returns name -> (type, bytes, shape)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_name("tiny-mixed")
    w.add_block_count(LAYERS)
    w.add_context_length(4096)
    w.add_embedding_length(H)
    w.add_feed_forward_length(3 * H)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(TOP_K)
    w.add_expert_feed_forward_length(INTER)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_IQ2_XXS)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{k}" for k in range(VOCAB)])
    written: dict[str, tuple[T, int, tuple[int, ...]]] = {}

    def add(name: str, qtype: T, shape: tuple[int, ...]) -> None:
        if qtype == T.F32:
            data = rng.standard_normal(shape).astype(np.float32)
            w.add_tensor(name, data)
        else:
            data = _stored(rng, qtype, shape)
            w.add_tensor(name, data, raw_dtype=qtype)
        written[name] = (qtype, data.nbytes, shape)

    add("token_embd.weight", T.Q4_K, (VOCAB, H))
    add("output_norm.weight", T.F32, (H,))
    add("output.weight", T.Q6_K, (VOCAB, H))
    qd, kvd = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for b in range(LAYERS):
        p = f"blk.{b}"
        add(f"{p}.attn_norm.weight", T.F32, (H,))
        add(f"{p}.ffn_norm.weight", T.F32, (H,))
        add(f"{p}.attn_q_norm.weight", T.F32, (HEAD_DIM,))
        add(f"{p}.attn_k_norm.weight", T.F32, (HEAD_DIM,))
        q, k, v, o = ATTENTION[b]
        add(f"{p}.attn_q.weight", q, (qd, H))
        add(f"{p}.attn_k.weight", k, (kvd, H))
        add(f"{p}.attn_v.weight", v, (kvd, H))
        add(f"{p}.attn_output.weight", o, (H, qd))
        add(f"{p}.ffn_gate_inp.weight", T.F32, (E, H))
        gate, up, down = EXPERTS[b]
        add(f"{p}.ffn_gate_exps.weight", gate, (E, INTER, H))
        add(f"{p}.ffn_up_exps.weight", up, (E, INTER, H))
        add(f"{p}.ffn_down_exps.weight", down, (E, H, INTER))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "tiny-mixed.gguf"
    return path, write_mixed_gguf(path)


def _cpu_box() -> HardwareProfile:
    return HardwareProfile(
        cpu=CPU(model_name="test", arch="x86_64", sockets=1, physical_cores=8, threads=16,
                features=("avx2", "fma")),
        memory=Memory(total_bytes=64 * GIB, available_bytes=64 * GIB, bandwidth_theoretical_bytes_per_s=100e9),
        gpus=(), described=True, name="test box")


def _is_expert(name: str) -> bool:
    return "_exps." in name


def test_every_type_has_its_exact_size(mixed):
    _, written = mixed
    assert NEW_TYPES <= {qtype for qtype, _, _ in written.values()}
    for name, (qtype, nbytes, shape) in written.items():
        fmt = get_format(ggml_type_name(qtype))
        assert fmt.name == qtype.name.lower() and fmt.ggml_type == qtype
        block, size = GGML_QUANT_SIZES[qtype]
        assert fmt.bits_per_weight == 8 * size / block
        assert tensor_bytes(fmt, shape) == nbytes, name


def test_inspection_counts_every_tensor_as_stored(mixed):
    path, written = mixed
    inspected = inspect_model(path)
    inv = inspected.inventory
    assert inv.total_bytes == sum(nbytes for _, nbytes, _ in written.values())
    assert inv.bytes_by_class.get(TensorClass.OTHER, 0) == 0
    routed = {b: sum(nbytes for name, (_, nbytes, _) in written.items()
                     if name.startswith(f"blk.{b}.") and _is_expert(name))
              for b in range(LAYERS)}
    assert inv.routed_bytes_by_layer == routed
    assert inv.routed_expert_bytes == sum(routed.values())
    assert inv.bytes_by_class[TensorClass.EMBEDDING] == written["token_embd.weight"][1]
    assert inv.bytes_by_class[TensorClass.LM_HEAD] == written["output.weight"][1]
    assert inspected.spec.expert_format == "iq2_xxs"  # the experts differ: the file's own type
    # Each expert's bytes as stored, and the average bits per weight they make.
    params = 3 * H * INTER * E * LAYERS
    assert inv.expert_bits_per_weight == pytest.approx(8 * inv.routed_expert_bytes / params)
    for b in range(LAYERS):
        assert inv.bytes_per_expert(b) == routed[b] / E


def test_a_cpu_only_llama_cpp_plan_counts_the_stored_bytes(mixed):
    """llama.cpp holds and reads every tensor as the file stores it: the plan's host bytes are
    the file's, and a token reads k experts a layer, every other tensor but the embedding (the
    head is not tied) and the cache."""
    path, written = mixed
    inspected = inspect_model(path)
    inv = inspected.inventory
    plan = make(inspected.spec, inv, _cpu_box(), Workload(context=256, strategy="cpu-only", backend="llamacpp"))
    host = plan.devices[-1].bytes_by_class
    routed = sum(nbytes for name, (_, nbytes, _) in written.items() if _is_expert(name))
    assert plan.routed_expert_bytes_total == routed == host["routed_experts"] == plan.host_routed_expert_bytes
    assert plan.bytes_per_expert == {b: inv.routed_bytes_by_layer[b] / E for b in range(LAYERS)}
    rest = sum(nbytes for name, (_, nbytes, _) in written.items() if not _is_expert(name))
    assert host["always_read"] == rest
    per_token = (TOP_K * routed / E + rest - written["token_embd.weight"][1]) + plan.kv_cache_bytes
    assert plan.host_bytes_per_token == pytest.approx(per_token)
    assert plan.kv_cache_dtype == "bf16"  # the workload's --kv-dtype, which llama.cpp takes


def test_the_engine_reads_the_new_types_as_stored(mixed):
    """The engine's CPU side holds the routed experts of every type as stored, and reads each
    projection of a type its kernels read as stored; of the attention's matrices it widens only
    the ternary one (and the vectors: norms)."""
    path, written = mixed
    inspected = inspect_model(path)
    inv = inspected.inventory
    plan = make(inspected.spec, inv, _cpu_box(), Workload(context=256, strategy="cpu-only", backend="engine"))
    routed = sum(nbytes for name, (_, nbytes, _) in written.items() if _is_expert(name))
    assert plan.host_routed_expert_bytes == routed == plan.devices[-1].bytes_by_class["routed_experts"]
    # Its own cache, float16 on the CPU alone (model._cache_dtype), is what the plan names and counts.
    assert plan.kv_cache_dtype == "fp16"
    assert plan.kv_bytes_per_token == inspected.spec.kv_bytes_per_token(2)
    assert "KV fp16" in plan_text(plan)
    assert all(inv.host_bytes_per_expert(b) == inv.bytes_per_expert(b) for b in range(LAYERS))
    # The norms (classed with the attention) and the ternary attn_v.
    widened = [name for name, (qtype, _, shape) in written.items()
               if len(shape) < 2 or (".attn_" in name and qtype in (T.TQ1_0, T.TQ2_0))]
    assert len(widened) == 1 + 4 * LAYERS + 1
    stored, count = inv.widened[TensorClass.ATTENTION]
    assert stored == sum(written[name][1] for name in widened)
    assert count == sum(int(np.prod(written[name][2])) for name in widened)
