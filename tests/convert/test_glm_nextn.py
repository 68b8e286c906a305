"""GLM-4.5's NextN (multi-token-prediction) layer: kept in the GGUF as llama.cpp's converter
keeps it (one more block, its extra tensors under blk.N.nextn.*, ``nextn_predict_layers``),
which llama.cpp loads and skips when generating, as does the engine.

The published GLM-4.5 checkpoints hold that layer as ``model.layers.<num_hidden_layers>``;
transformers' save_pretrained drops it, so it is added here with the published names: a
decoder layer like the others plus the merge projection ``eh_proj`` [hidden, 2 * hidden], its
two input norms, and the layer's own embedding and head with their norm.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridmoe.backend.errors import ModelError
from tests.convert.conftest import llama_logits, needs_llama_cpp, open_llama

PROMPT = [5, 17, 42, 99, 120, 7, 3, 200, 61, 33]


def _with_nextn_layer(source, directory, drop: str | None = None):
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    n, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    g = torch.Generator().manual_seed(7)
    nextn = {}
    for name, t in tensors.items():
        m = re.fullmatch(rf"model\.layers\.{n - 1}\.(.+)", name)
        if m:
            nextn[f"model.layers.{n}.{m.group(1)}"] = (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype)
    extras = {"eh_proj.weight": (hidden, 2 * hidden), "enorm.weight": (hidden,), "hnorm.weight": (hidden,),
              "shared_head.norm.weight": (hidden,), "embed_tokens.weight": (vocab, hidden),
              "shared_head.head.weight": (vocab, hidden)}
    for suffix, shape in extras.items():
        nextn[f"model.layers.{n}.{suffix}"] = torch.randn(shape, generator=g).to(torch.bfloat16)
    if drop is not None:
        del nextn[f"model.layers.{n}.{drop}"]
    shutil.copytree(source, directory)
    save_file({**tensors, **nextn}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def with_nextn(checkpoints, tmp_path_factory):
    return _with_nextn_layer(checkpoints("glm4_moe").path, tmp_path_factory.mktemp("glm_nextn") / "ck")


@needs_llama_cpp
def test_nextn_layer_is_kept_and_skipped(with_nextn, converted, tmp_path):
    from gguf import GGUFReader

    from hybridmoe.backend.convert import to_gguf
    from hybridmoe.backend.engine.model import build_model
    from hybridmoe.backend.formats.weights import open_weights
    from hybridmoe.backend.models import inspect_model

    path = to_gguf(with_nextn, tmp_path / "glm.gguf", "bf16")
    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    assert int(reader.fields["glm4moe.block_count"].contents()) == 4
    assert int(reader.fields["glm4moe.nextn_predict_layers"].contents()) == 1
    for suffix in ("eh_proj", "enorm", "hnorm", "shared_head_norm", "embed_tokens", "shared_head_head"):
        assert f"blk.3.nextn.{suffix}.weight" in names
    assert {"blk.3.attn_q.weight", "blk.3.ffn_gate_exps.weight", "blk.3.exp_probs_b.bias"} <= names

    without = converted("glm4_moe", "bf16")  # the same model, converted without the layer
    results = []
    for p in (path, without):
        llm = open_llama(p)
        try:
            results.append(llama_logits(llm, PROMPT))
        finally:
            llm.close()
    # llama.cpp loads the NextN block and leaves it out of the graph: the very same logits.
    assert torch.equal(results[0], results[1])

    spec = inspect_model(path).spec
    assert (spec.num_layers, spec.n_mtp_layers) == (3, 1)
    ids = torch.tensor(PROMPT)
    ours = [build_model(inspect_model(p).spec.config, open_weights(p), max_context=64, dtype=torch.float32)(ids, 0)
            for p in (path, without)]
    assert torch.equal(ours[0], ours[1])


def test_incomplete_nextn_layer_is_named(checkpoints, tmp_path):
    from hybridmoe.backend.convert import to_gguf

    broken = _with_nextn_layer(checkpoints("glm4_moe").path, tmp_path / "ck", drop="self_attn.k_proj.weight")
    with pytest.raises(ModelError, match=r"NextN layer 3 is incomplete \(no model\.layers\.3\.self_attn\.k_proj"):
        to_gguf(broken, tmp_path / "out.gguf", "q8_0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
