"""`hybridmoe inspect` shows a GGUF's storage types: tensors and bytes of each type, and which
types each class holds, on a file whose types change from layer to layer as the community
"dynamic" mixes do (written by gguf-py's quantizers)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests.models.conftest import write_qwen3moe_gguf

# The mix: routed experts in another type each layer (and down unlike gate/up in layer 1),
# layer 0's attention in Q8_0; the rest as the tiny file stores it (F16 attention, embedding
# and head; F32 norms and router; Q8_0 gate/up and Q4_0 down experts).
RETYPED = {
    "blk.0.attn_q.weight": T.Q8_0,
    "blk.0.attn_output.weight": T.Q8_0,
    "blk.1.ffn_gate_exps.weight": T.Q4_1,
    "blk.1.ffn_up_exps.weight": T.Q4_1,
    "blk.1.ffn_down_exps.weight": T.Q5_0,
    "blk.2.ffn_gate_exps.weight": T.Q5_1,
    "blk.2.ffn_up_exps.weight": T.Q5_1,
    "blk.2.ffn_down_exps.weight": T.Q5_1,
}


def requantized(src: Path, dst: Path, types: dict[str, T]) -> Path:
    """`src` with the tensors named in `types` dequantized and quantized again to their type."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # torch order
        if t.name in types:
            values = dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
            writer.add_tensor(t.name, quantize(values, types[t.name]), raw_dtype=types[t.name])
        elif t.tensor_type in (T.F32, T.F16):
            writer.add_tensor(t.name, np.asarray(t.data).reshape(shape))
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mixed")
    return requantized(write_qwen3moe_gguf(root / "tiny.gguf")[0], root / "tiny-mixed.gguf", RETYPED)


def stored_types(path: Path) -> dict[str, tuple[int, int]]:
    """type name -> (tensors, bytes), as gguf-py's own reader sees the file."""
    from gguf import GGUFReader

    out: dict[str, tuple[int, int]] = {}
    for t in GGUFReader(path).tensors:
        n, b = out.get(t.tensor_type.name.lower(), (0, 0))
        out[t.tensor_type.name.lower()] = (n + 1, b + int(t.n_bytes))
    return out


def test_inspect_json_gives_each_type_and_the_types_of_each_class(mixed_gguf, capsys):
    from hybridmoe.app.cli import main

    assert main(["inspect", str(mixed_gguf), "--json"]) == 0
    inventory = json.loads(capsys.readouterr().out)["inventory"]
    types = {name: (use["tensors"], use["bytes"]) for name, use in inventory["types"].items()}
    assert types == stored_types(mixed_gguf)
    assert set(types) == {"f16", "f32", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"}
    assert list(inventory["types"]) == sorted(types, key=lambda k: (-types[k][1], k))  # the most bytes first
    by_class = {c: {name: use["tensors"] for name, use in uses.items()} for c, uses in inventory["types_by_class"].items()}
    assert by_class["routed_experts"] == {"q8_0": 2, "q4_0": 1, "q4_1": 2, "q5_0": 1, "q5_1": 3}
    assert by_class["attention"] == {"q8_0": 2, "f16": 10, "f32": 13}
    assert by_class["embedding"] == {"f16": 1} and by_class["lm_head"] == {"f16": 1} and by_class["router"] == {"f32": 3}
    for cls, uses in inventory["types_by_class"].items():  # a class's types add up to the class
        assert sum(use["bytes"] for use in uses.values()) == inventory["bytes_by_class"][cls]
    assert inventory["types_by_class"]["routed_experts"]["q4_1"]["example"] == "blk.1.ffn_gate_exps.weight"


def test_inspect_text_prints_the_type_table_and_the_types_of_each_class(mixed_gguf, capsys):
    from hybridmoe.app.cli import main
    from hybridmoe.backend.units import fmt_bytes

    assert main(["inspect", str(mixed_gguf)]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("Tensor types (as stored)")
    table = {line.split()[0]: line.split()[1:] for line in lines[start + 2:lines.index("Types by class")]}
    for name, (tensors, nbytes) in stored_types(mixed_gguf).items():
        assert table[name][0] == str(tensors) and " ".join(table[name][1:3]) == fmt_bytes(nbytes)
    routed = next(line for line in lines if line.strip().startswith("routed_experts ") and "(" in line)
    # Most bytes first: Q5_1 (all of layer 2: 3 x 6 KiB), Q8_0 (layer 0's gate/up: 2 x 8.5 KiB), Q4_1, Q5_0, Q4_0.
    assert routed.split(None, 1)[1] == "q5_1 (3), q8_0 (2), q4_1 (2), q5_0 (1), q4_0 (1)"


def test_types_of_a_config_inventory_follow_the_mix_recipe():
    """Planning before a download: the Q4_K_M recipe's types per class, from the config."""
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.models.inventory import TensorClass

    root = Path(__file__).resolve().parents[2]
    inv = inspect_model(root / "assets/configs/Qwen__Qwen3-30B-A3B.json", expert_format="q4_k_m").inventory
    routed = inv.types_by_class[TensorClass.ROUTED_EXPERTS]
    assert set(routed) == {"q4_k", "q6_k"}  # ffn_down in Q6_K in half the layers
    assert sum(u.bytes for u in routed.values()) == inv.routed_expert_bytes
    assert set(inv.routed_formats) == {"q4_k", "q6_k"}
    assert sum(sum(layer.values()) for layer in inv.routed_format_bytes_by_layer.values()) == inv.routed_expert_bytes
