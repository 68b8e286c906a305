"""A model family is one folder of backend/models/families/, and every other package looks it
up in the registry (docs/architecture.md): no second table names the families again, and no
part of a family lives outside its folder."""

import ast
from pathlib import Path

import pytest

from hybridmoe.backend.convert import hparams
from hybridmoe.backend.errors import UnsupportedModelError
from hybridmoe.backend.models.families import FAMILIES, family_by_gguf_arch

ROOT = Path(__file__).resolve().parent.parent
FAMILY_FOLDER = Path("backend/models/families")

# What every family folder holds: identity, readers, tensors and layer descriptions; the GGUF writer.
FAMILY_FILES = ("__init__.py", "gguf.py")
# The converter's modules that once held a writer per architecture.
CONVERTER_KEYS = ("backend/convert/hparams.py", "backend/convert/gguf_keys.py")

# What every family module declares (see the registry's docstring).
FAMILY_INTERFACE = (
    "FAMILY", "DISPLAY_NAME", "HF_ARCHITECTURES", "MODEL_TYPES", "GGUF_ARCH", "GGUF_KEEPS_MTP",
    "ROUTER_FLOAT32",
    "LLAMA_PRE_TOKENIZERS", "SPECIAL_TOKEN_ROLES", "RMS_EPS_DEFAULT", "ROPE_THETA_DEFAULT",
    "PARTIAL_ROTARY_DEFAULT", "GGUF_PARTIAL_ROTARY", "GGUF_TENSOR_NAMES", "GGUF_PERMUTES_QK",
    "GGUF_SPLITS_FUSED_EXPERTS", "GGUF_SPLITS_KV_B", "HF_NAME_ALIASES",
    "spec_from_config", "config_from_gguf", "expected_tensors", "describe_layers",
)


def family_names() -> set[str]:
    """The names a per-family table would be keyed by: family names and GGUF architectures."""
    return {f.FAMILY for f in FAMILIES} | {f.GGUF_ARCH for f in FAMILIES}


def tables_naming_families(root: Path) -> list[str]:
    """`file:line` of each dict, set, tuple or list literal under root/backend and root/app,
    outside the family folder, that holds two or more family names: a per-family table."""
    names = family_names()
    found = []
    for folder in ("backend", "app"):
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root)
            if relative.is_relative_to(FAMILY_FOLDER):
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Dict):
                    items = [*node.keys, *node.values]
                elif isinstance(node, (ast.Set, ast.Tuple, ast.List)):
                    items = node.elts
                else:
                    continue
                hits = [i.value for i in items if isinstance(i, ast.Constant) and i.value in names]
                if len(hits) >= 2:
                    found.append(f"{relative}:{node.lineno} {hits}")
    return found


def test_no_table_outside_the_families_names_them():
    assert tables_naming_families(ROOT) == []


def test_the_scan_finds_a_per_family_table(tmp_path):
    module = tmp_path / "backend" / "convert" / "example.py"
    module.parent.mkdir(parents=True)
    module.write_text('EPS = {"glm4_moe": 1e-5, "gpt_oss": 1e-5}\nARCHS = ("deepseek2", "llama")\n'
                      'ONE = {"olmoe": 1}\n')
    assert tables_naming_families(tmp_path) == [
        "backend/convert/example.py:1 ['glm4_moe', 'gpt_oss']",
        "backend/convert/example.py:2 ['deepseek2', 'llama']",
    ]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.FAMILY)
def test_every_family_declares_the_whole_interface(family):
    missing = [name for name in FAMILY_INTERFACE if not hasattr(family, name)]
    assert missing == []


def test_family_names_and_gguf_architectures_are_unique():
    assert len({f.FAMILY for f in FAMILIES}) == len(FAMILIES)
    assert len({f.GGUF_ARCH for f in FAMILIES}) == len(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.FAMILY)
def test_every_family_has_a_gguf_writer(family):
    assert family in hparams.convertible_families()
    assert hparams.gguf_arch(family.FAMILY, "config.json") == family.GGUF_ARCH


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.FAMILY)
def test_a_family_is_found_by_its_gguf_architecture(family):
    assert family_by_gguf_arch(family.GGUF_ARCH, "x.gguf") is family


def test_an_unknown_gguf_architecture_is_refused_with_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="'qwen3next'") as e:
        family_by_gguf_arch("qwen3next", "x.gguf")
    assert "GLM-4.5 (Glm4MoeForCausalLM; GGUF glm4moe)" in e.value.hint


def family_parts_elsewhere(root: Path) -> list[str]:
    """Modules under root/backend and root/app, outside the family folder, named after a
    family (``backend/engine/olmoe.py``), and each family or GGUF architecture name a string
    in the converter's key writers holds (a writer registered there for one architecture)."""
    names = family_names()
    found = []
    for folder in ("backend", "app"):
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root)
            if not relative.is_relative_to(FAMILY_FOLDER) and path.stem in names:
                found.append(str(relative))
    for name in CONVERTER_KEYS:
        path = root / name
        if path.exists():
            found += [f"{name}:{node.lineno} {node.value!r}"
                      for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
                      if isinstance(node, ast.Constant) and node.value in names]
    return found


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.FAMILY)
def test_every_family_is_one_folder_with_its_writer(family):
    folder = Path(family.__file__).parent
    assert folder == ROOT / FAMILY_FOLDER / family.FAMILY
    assert [name for name in FAMILY_FILES if not (folder / name).is_file()] == []


def test_no_part_of_a_family_lives_outside_its_folder():
    assert family_parts_elsewhere(ROOT) == []


def test_the_scan_finds_a_family_part_outside_its_folder(tmp_path):
    for name, text in {
        "backend/engine/olmoe.py": "",
        "backend/models/families/olmoe/gguf.py": "",
        "backend/convert/hparams.py": '"""Writes glm4moe keys too."""\n@_writes("deepseek2")\ndef w(): pass\n',
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert family_parts_elsewhere(tmp_path) == [
        "backend/engine/olmoe.py",
        "backend/convert/hparams.py:2 'deepseek2'",
    ]
