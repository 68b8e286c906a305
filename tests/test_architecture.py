"""The house rules of docs/architecture.md that code can check.

Layering ("Layering rules" in docs/architecture.md). The import graph of hybridmoe (every
module under app/ and backend/, and the native extension) has no circle, and its edges
point down this list of layers: a module imports modules of its own package or of a lower
layer, never of a higher one, and the packages of one layer do not import each other.

    app                          hybridmoe.app: CLI, headless run, API server, terminal UI
    bench                        benchmarks, driving both backends
    backends | convert           choosing a backend; safetensors -> GGUF
    engine | llamacpp            the two backends
    text | formats | hub         shared by the backends: text, weight formats; models on disk and on the Hub
    plan                         the planner
    hardware | models | session  the machine; model inspection; the Backend/Session protocol
    settings                     the settings file
    files | units                atomic writes; sizes and rates
    errors | workload_choices | _native   leaves: error classes, the workload's vocabulary, the extension

A family folder, backend/models/families/<family>/, spans layers: its `gguf` module is layered
with the converter (FAMILY_PARTS); the rest is in models, and none of it imports torch or the
engine (the engine compiles the folder's layer descriptions).

An import counts when it runs: one inside a function does (it runs on the first call), one
under ``if TYPE_CHECKING:`` does not. Importing ``a.b.c`` runs the ``__init__`` of ``a`` and
``a.b`` first, so it depends on them too (a circle through a package's ``__init__`` is a
circle), except on the packages enclosing the importing module itself: Python has started
those before the module runs.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN_IN_BACKEND = ("textual", "rich", "hybridmoe.app")
# The repository's folders are installed under the one import package `hybridmoe`: their bare
# names are not importable from an installed wheel.
BARE_NAMES = ("app", "backend", "assets")
SOURCE_FOLDERS = {"app": "hybridmoe.app", "backend": "hybridmoe.backend"}
EXTENSION = "hybridmoe._native"  # built from native/, no Python source: a leaf

_B = "hybridmoe.backend."
# From the top down; each layer's packages are independent of each other (see the docstring).
LAYERS = (
    ("hybridmoe.app",),
    (_B + "bench",),
    (_B + "backends", _B + "convert"),
    (_B + "engine", _B + "llamacpp"),
    (_B + "text", _B + "formats", _B + "hub"),
    (_B + "plan",),
    (_B + "hardware", _B + "models", _B + "session"),
    (_B + "settings",),
    (_B + "files", _B + "units"),
    (_B + "errors", _B + "workload_choices", EXTENSION),
)
# A family is one folder, backend/models/families/<family>/ (docs/architecture.md), and the
# folder spans layers: its GGUF writer `gguf.py` belongs to the converter, so it may import what
# the converter may (and the family's models-layer modules, below it); the rest of the folder
# (identity, config readers, tensor inventory, layer descriptions) is model inspection, in the
# models layer, and does not import it.
FAMILY_FOLDER = _B + "models.families"
FAMILY_PARTS = {"gguf": _B + "convert"}
# Package roots with an empty __init__: below everything, importing nothing.
EMPTY_ROOTS = ("hybridmoe.backend",)
# What the planner, model inspection, hardware detection and the hub must load without torch.
TORCH_FREE = ("hybridmoe.backend.plan", "hybridmoe.backend.models", "hybridmoe.backend.hardware",
              "hybridmoe.backend.hub")


def _is_under(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


# ---- the import graph -----------------------------------------------------------------------


def _module_files(root: Path) -> dict[str, tuple[Path, bool]]:
    """module name -> (source file, whether it is a package's __init__)"""
    modules = {}
    for folder, prefix in SOURCE_FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            modules[".".join((prefix, *(parts[:-1] if is_package else parts)))] = (path, is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _running_imports(tree: ast.AST):
    """Every import statement that can run: in functions too, not under `if TYPE_CHECKING:`."""
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend(node.orelse)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        else:
            pending.extend(ast.iter_child_nodes(node))


def _imported_modules(node, module: str, is_package: bool, known) -> list[str]:
    """The modules an import statement names (a `from` name that is a module counts as one)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    source = node.module or ""
    if node.level:
        package = (module if is_package else module.rpartition(".")[0]).split(".")
        source = ".".join([*package[: len(package) - node.level + 1], *([source] if source else [])])
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]


def _runs(imported: str, importer: str) -> list[str]:
    """`imported` and the packages Python initialises to import it from `importer`."""
    parts = imported.split(".")
    enclosing = importer.split(".")
    return [name for i in range(1, len(parts) + 1)
            if (name := ".".join(parts[:i])) == imported
            or not (parts[:i] == enclosing[:i] and i < len(enclosing))]


def import_graph(root: Path = ROOT):
    """(graph, outside): module -> {hybridmoe module it imports: (file, line)}, and
    module -> {module outside hybridmoe: (file, line)}."""
    modules = _module_files(root)
    known = set(modules) | {EXTENSION}
    graph = {name: {} for name in known}
    outside = {name: {} for name in known}
    for module, (path, is_package) in modules.items():
        where = path.relative_to(root)
        for node in _running_imports(ast.parse(path.read_text(), filename=str(path))):
            for imported in _imported_modules(node, module, is_package, known):
                for target in _runs(imported, module):
                    if target == module or target == "hybridmoe":  # hybridmoe: a namespace package
                        continue
                    edges = graph[module] if _is_under(target, ["hybridmoe"]) else outside[module]
                    if target not in edges or node.lineno < edges[target][1]:
                        edges[target] = (where, node.lineno)
    return graph, outside


def _strongly_connected(graph) -> list[set[str]]:
    """Tarjan's components of more than one module (every circle lies inside one)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def _shortest_path(graph, start: str, goal: str, within: set[str]) -> list[str]:
    paths, seen = {start: [start]}, {start}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w in within and w not in seen:
                    seen.add(w)
                    paths[w] = paths[v] + [w]
                    following.append(w)
        frontier = following
    return paths[goal]


def import_cycles(graph) -> list[str]:
    """Each circle, as a chain `a -[file:line]-> b -[...]-> a`: for every import inside a
    strongly connected component, the shortest circle through it, each circle once."""
    chains = {}
    for component in _strongly_connected(graph):
        for v in sorted(component):
            for w in sorted(set(graph[v]) & component):
                cycle = [v, *_shortest_path(graph, w, v, component)]
                start = cycle.index(min(cycle[:-1]))
                cycle = cycle[start:-1] + cycle[:start] + [cycle[start]]
                chains[tuple(cycle)] = cycle[0] + "".join(
                    f" -[{graph[a][b][0]}:{graph[a][b][1]}]-> {b}" for a, b in zip(cycle, cycle[1:]))
    return sorted(chains.values())


def _layered_as(module: str) -> str:
    """The name `module` is layered by: a family folder's part listed in FAMILY_PARTS counts
    as a module of that part's package, everything else as itself."""
    family_and_part = module.removeprefix(FAMILY_FOLDER + ".").split(".")
    if module.startswith(FAMILY_FOLDER + ".") and len(family_and_part) == 2 and family_and_part[1] in FAMILY_PARTS:
        return FAMILY_PARTS[family_and_part[1]] + "." + family_and_part[0]
    return module


def _layer_of(module: str):
    """(layer index from the top, the layer's package holding `module`), or None."""
    module = _layered_as(module)
    for i, layer in enumerate(LAYERS):
        for package in layer:
            if _is_under(module, [package]):
                return i, package
    return None


def layer_violations(graph) -> list[str]:
    """Imports that point up the layers or sideways between the packages of one layer."""
    found = []
    for module in sorted(graph):
        if module in EMPTY_ROOTS:
            found += [f"{module} imports {t}: a package root stays empty" for t in graph[module]]
            continue
        here = _layer_of(module)
        if here is None:
            found.append(f"{module} is in no layer: add its package to LAYERS")
            continue
        for target, (path, line) in sorted(graph[module].items()):
            there = _layer_of(target)
            if target in EMPTY_ROOTS or there is None or there[1] == here[1] or there[0] > here[0]:
                continue  # unlayered targets are reported as modules themselves
            way = "up" if there[0] < here[0] else "sideways"
            found.append(f"{path}:{line}: {module} imports {target} ({way}: {there[1]} is not below {here[1]})")
    return found


def _loads(module: str, statements: str, path=None) -> bool:
    """Whether running `statements` in a fresh interpreter (with `path` first on its module
    search path) loads `module`."""
    env = None
    if path is not None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])}
    check = f"{statements}\nimport sys\nprint({module!r} in sys.modules)"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "True"


# ---- the rules -------------------------------------------------------------------------------


def test_nothing_imports_in_a_circle():
    cycles = import_cycles(import_graph()[0])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_imports_point_down_the_layers():
    violations = layer_violations(import_graph()[0])
    assert not violations, "see LAYERS in tests/test_architecture.py:\n" + "\n".join(violations)


def test_planner_inspection_hardware_and_hub_load_no_torch():
    assert not _loads("torch", "import " + ", ".join(TORCH_FREE))


def test_planning_a_config_loads_no_torch():
    """inspect_model on a config.json and make() on it, the whole of `hybridmoe plan`'s work."""
    config = ROOT / "assets" / "configs" / "Qwen__Qwen3-30B-A3B.json"
    assert not _loads("torch", f"""
from hybridmoe.backend.hardware import preset
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.plan import Workload, make
model = inspect_model({str(config)!r})
make(model.spec, model.inventory, preset("4x H200 NVL"), Workload())""")


# ---- each check catches a planted offender --------------------------------------------------


def _plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in SOURCE_FOLDERS:
        (root / folder).mkdir(exist_ok=True)
    return root


def test_a_circle_is_reported_as_a_chain(tmp_path):
    root = _plant(tmp_path, {
        "app/__init__.py": "",
        "app/cli.py": "def main():\n    from hybridmoe.app import headless\n",
        "app/headless.py": "\n\nfrom hybridmoe.app.cli import main\n",
    })
    assert import_cycles(import_graph(root)[0]) == [
        "hybridmoe.app.cli -[app/cli.py:2]-> hybridmoe.app.headless -[app/headless.py:3]-> hybridmoe.app.cli"]


def test_a_circle_through_a_package_init_is_a_circle(tmp_path):
    root = _plant(tmp_path, {
        "backend/__init__.py": "",
        "backend/hub/__init__.py": "from hybridmoe.backend.hub.download import pull\n",
        "backend/hub/download.py": "from hybridmoe.backend.models import inspect_model\ndef pull(): pass\n",
        "backend/models/__init__.py": "from hybridmoe.backend.models.inspect import inspect_model\n",
        "backend/models/inspect.py": "from hybridmoe.backend.hub.local import LocalModel\n",
        "backend/hub/local.py": "LocalModel = object\n",
    })
    # models.inspect reaches hub.local through hub/__init__, which imports hub.download, which
    # imports models: a circle although no module names the one that names it.
    assert import_cycles(import_graph(root)[0]) == [
        "hybridmoe.backend.hub -[backend/hub/__init__.py:1]-> hybridmoe.backend.hub.download"
        " -[backend/hub/download.py:1]-> hybridmoe.backend.models"
        " -[backend/models/__init__.py:1]-> hybridmoe.backend.models.inspect"
        " -[backend/models/inspect.py:1]-> hybridmoe.backend.hub"]


def test_a_name_taken_from_the_own_package_init_is_a_circle(tmp_path):
    root = _plant(tmp_path, {
        "backend/hub/__init__.py": "from hybridmoe.backend.hub.download import pull\n",
        "backend/hub/download.py": "from hybridmoe.backend.hub import cache\nfrom hybridmoe.backend.hub import Catalogue\n",
        "backend/hub/cache.py": "",
    })
    graph = import_graph(root)[0]
    # `cache` is a module: Python imports it without waiting for hub/__init__; `Catalogue` is a
    # name hub/__init__ may not have bound yet.
    assert set(graph["hybridmoe.backend.hub.download"]) == {"hybridmoe.backend.hub.cache", "hybridmoe.backend.hub"}
    assert import_cycles(graph) == [
        "hybridmoe.backend.hub -[backend/hub/__init__.py:1]-> hybridmoe.backend.hub.download"
        " -[backend/hub/download.py:2]-> hybridmoe.backend.hub"]


def test_imports_in_functions_count_and_type_checking_ones_do_not(tmp_path):
    root = _plant(tmp_path, {
        "backend/engine/experts.py": "from typing import TYPE_CHECKING\n"
                                     "if TYPE_CHECKING:\n    from hybridmoe.backend.engine.moe import Layer\n"
                                     "else:\n    from hybridmoe.backend.engine import layers\n"
                                     "def f():\n    from . import native\n    import torch\n",
        "backend/engine/moe.py": "", "backend/engine/layers.py": "", "backend/engine/native.py": "",
    })
    graph, outside = import_graph(root)
    assert set(graph["hybridmoe.backend.engine.experts"]) == {"hybridmoe.backend.engine.layers",
                                                              "hybridmoe.backend.engine.native"}
    assert set(outside["hybridmoe.backend.engine.experts"]) == {"typing", "torch"}


def test_an_upward_or_sideways_import_breaks_the_layers(tmp_path):
    root = _plant(tmp_path, {
        "backend/__init__.py": "",
        "backend/errors.py": "def f():\n    from hybridmoe.backend.plan import make\n",
        "backend/plan/__init__.py": "from hybridmoe.backend.errors import f\n",
        "backend/engine/session.py": "import hybridmoe.backend.llamacpp.vocab\n",
        "backend/llamacpp/vocab.py": "",
        "backend/oddity.py": "",
    })
    assert layer_violations(import_graph(root)[0]) == [
        "backend/engine/session.py:1: hybridmoe.backend.engine.session imports hybridmoe.backend.llamacpp"
        " (sideways: hybridmoe.backend.llamacpp is not below hybridmoe.backend.engine)",
        "backend/engine/session.py:1: hybridmoe.backend.engine.session imports hybridmoe.backend.llamacpp.vocab"
        " (sideways: hybridmoe.backend.llamacpp is not below hybridmoe.backend.engine)",
        "backend/errors.py:2: hybridmoe.backend.errors imports hybridmoe.backend.plan"
        " (up: hybridmoe.backend.plan is not below hybridmoe.backend.errors)",
        "hybridmoe.backend.oddity is in no layer: add its package to LAYERS",
    ]


def test_a_family_folder_spans_the_models_and_convert_layers(tmp_path):
    families = "backend/models/families/"
    root = _plant(tmp_path, {
        families + "__init__.py": "from hybridmoe.backend.models.families import olmoe\n",
        families + "olmoe/__init__.py": "from hybridmoe.backend.models.families.olmoe import gguf\n",
        families + "olmoe/gguf.py": "from hybridmoe.backend.convert.gguf_keys import GGUFKeys\n"
                                    "from hybridmoe.backend.models.hf_config import HFConfig\n",
        "backend/models/hf_config.py": "",
        "backend/convert/gguf_keys.py": "from hybridmoe.backend.models.families import olmoe\n",
    })
    # gguf.py imports its own layer and below; the folder's models-layer __init__ importing the
    # family's GGUF writer is an import up the layers.
    assert layer_violations(import_graph(root)[0]) == [
        "backend/models/families/olmoe/__init__.py:1: hybridmoe.backend.models.families.olmoe imports"
        " hybridmoe.backend.models.families.olmoe.gguf (up: hybridmoe.backend.convert is not below"
        " hybridmoe.backend.models)",
    ]


def test_the_torch_check_sees_torch_loaded(tmp_path):
    # A stand-in torch (loading the real one takes seconds) imported by a planted module.
    _plant(tmp_path, {"torch/__init__.py": "", "planted_planner.py": "import torch\n"})
    assert _loads("torch", "import planted_planner", path=tmp_path)
    assert not _loads("torch", "import json", path=tmp_path)


# ---- the older, file-level rules -----------------------------------------------------------


def test_backend_imports_no_ui_and_no_app_module():
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROOT / "backend").rglob("*.py"))
        for line, name in _imports(path)
        if _is_under(name, FORBIDDEN_IN_BACKEND)
    ]
    assert not offenders, "backend/ is a headless library:\n" + "\n".join(offenders)


def test_the_rule_catches_an_offender(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom textual.app import App\nimport hybridmoe.app.cli\n")
    names = [name for _, name in _imports(bad)]
    assert [n for n in names if _is_under(n, FORBIDDEN_IN_BACKEND)] == ["textual.app", "hybridmoe.app.cli"]


def test_everything_imports_the_one_package():
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for folder in ("app", "backend", "tests", "scripts", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, name in _imports(path)
        if _is_under(name, BARE_NAMES)
    ]
    assert not offenders, "import hybridmoe.app / hybridmoe.backend:\n" + "\n".join(offenders)


def test_nothing_from_a_model_repo_executes():
    """No pickle loading and no remote code anywhere in the project."""
    offenders = []
    for path in sorted([*(ROOT / "backend").rglob("*.py"), *(ROOT / "app").rglob("*.py")]):
        text = path.read_text()
        for needle in ("trust_remote_code=True", "pickle.load", "torch.load("):
            if needle in text:
                offenders.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not offenders, offenders


def test_the_repository_cites_only_itself():
    """Docs and comments point at docs/, never at design files outside the repository; code
    and tests read no file beside the checkout (a clean clone elsewhere has none)."""
    needles = ("SIZING.md", "DESIGN.md", "../shared", "/work/shared", '"shared" / "configs"')
    offenders = [
        f"{path.relative_to(ROOT)}: {needle}"
        for folder in ("app", "backend", "tests", "scripts", "benchmarks", "native", "packaging", "docs", "assets")
        for path in sorted((ROOT / folder).rglob("*"))
        if path.is_file() and path.suffix in (".py", ".md", ".toml", ".cpp", ".h", ".sh", ".txt", ".tcss")
        and path.name != "test_architecture.py"
        for needle in needles
        if needle in path.read_text(errors="replace")
    ] + [f"README.md: {n}" for n in needles if n in (ROOT / "README.md").read_text()]
    assert not offenders, offenders


# What a session can do is stated by it (backend/session.py's Session: backend, max_parallel,
# counts_experts, decode_path); the app reads those and never asks which module or class a
# session comes from, nor whether it has some method.
_SESSION_PROBES = ("__module__", "hasattr(session", "hasattr(event.session", "getattr(session",
                   "getattr(event.session", "getattr(self.session", "hasattr(self.session")


def _session_probes(root: Path) -> list[str]:
    return [f"{path.relative_to(root)}:{n}: {line.strip()}"
            for path in sorted(root.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if any(probe in line for probe in _SESSION_PROBES)]


def test_the_app_reads_what_a_session_states_and_never_probes_it():
    offenders = _session_probes(ROOT / "app")
    assert not offenders, "read the Session's stated capabilities instead:\n" + "\n".join(offenders)


def test_the_probe_rule_catches_an_offender(tmp_path):
    _plant(tmp_path, {"app/x.py": "ok = session.counts_experts\n"
                                  "if hasattr(session, 'save_expert_stats'):\n    pass\n"
                                  "llama = type(session).__module__.startswith('hybridmoe.backend.llamacpp')\n"})
    assert [line.split(": ", 1)[0] for line in _session_probes(tmp_path / "app")] == ["x.py:2", "x.py:4"]


# The engine asks a layer what it is (what its class declares: a projection's runs_native, an
# attention block's latent, an expert group's stacked; a block's describe()), and keeps what it
# builds (Build.moe_blocks); it never asks isinstance() of one of its own classes.
def _class_checks(folder: Path) -> list[str]:
    trees = {path: ast.parse(path.read_text()) for path in sorted(folder.glob("*.py"))}
    own = {node.name for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    offenders = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                names = {getattr(k, "id", None) or getattr(k, "attr", None) for k in kinds}
                if names & own:
                    offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return offenders


def test_the_engine_reads_what_a_layer_states_and_never_its_class():
    offenders = _class_checks(ROOT / "backend" / "engine")
    assert not offenders, "ask what the module declares instead:\n" + "\n".join(offenders)


def test_the_class_rule_catches_an_offender(tmp_path):
    _plant(tmp_path, {"backend/engine/a.py": "class MoE:\n    pass\n",
                      "backend/engine/b.py": "ok = isinstance(x, torch.Tensor)\nbad = isinstance(m, (int, a.MoE))\n"})
    assert [line.split(": ", 1)[0] for line in _class_checks(tmp_path / "backend" / "engine")] == ["b.py:2"]


# ---- a family's facts stay in its folder --------------------------------------------------------

# A family's names (its id, GGUF architecture, Hugging Face architectures and model types) as a
# whole string literal outside backend/models/families/ is code deciding by family: what differs
# belongs in the folder (a GGUF_* flag, a description, a builder). The ones below remain, each
# for its reason; the list is exact, so a new one fails and a removed one must leave it too.
FAMILY_FACTS_OUTSIDE = {
    # the extension's own name for GPT-OSS's clamped SwiGLU, at its binding
    ("backend/engine/native_experts.py", "gpt_oss"),
    # bench kernels' name for synthetic experts in GPT-OSS's fused, biased layout
    ("backend/bench/synthetic_experts.py", "gpt_oss"),
    # "llama" as GGUF's tokenizer model name (SentencePiece), not the architecture
    ("backend/convert/vocab.py", "llama"),
    ("backend/text/tokenizer.py", "llama"),
    # debt: GPT-OSS's expert biases in the planner's resident-expert bytes
    ("backend/plan/budget.py", "gpt_oss"),
}


def _family_names() -> set[str]:
    from hybridmoe.backend.models.families import FAMILIES

    names: set[str] = set()
    for family in FAMILIES:
        names |= {family.FAMILY, family.GGUF_ARCH, *family.HF_ARCHITECTURES, *family.MODEL_TYPES}
    return names


def family_facts_outside(root: Path, names: set[str]) -> set[tuple[str, str]]:
    found = set()
    for folder in SOURCE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            where = path.relative_to(root).as_posix()
            if where.startswith("backend/models/families/"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                    found.add((where, node.value))
    return found


def test_a_familys_facts_stay_in_its_folder():
    assert family_facts_outside(ROOT, _family_names()) == FAMILY_FACTS_OUTSIDE


def test_the_family_rule_catches_an_offender(tmp_path):
    root = _plant(tmp_path, {"backend/convert/x.py": 'split = arch == "deepseek2"\n# deepseek2 in a comment\n',
                             "backend/models/families/deepseek/__init__.py": 'GGUF_ARCH = "deepseek2"\n'})
    assert family_facts_outside(root, {"deepseek2"}) == {("backend/convert/x.py", "deepseek2")}


# A family folder states its layers as data (``describe_layers``) and the engine compiles them
# (engine/build_layers.py): no module in the folder imports torch or the engine, not even in a
# function.
FAMILY_FOLDER_IMPORTS_NOT = ("torch", _B + "engine")


def family_folder_torch_imports(root: Path) -> list[str]:
    found = []
    for path in sorted((root / "backend" / "models" / "families").rglob("*.py")):
        for node in _running_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:  # `from a import b` names a and, b being a module perhaps, a.b
                names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
            hits = [name for name in names if _is_under(name, FAMILY_FOLDER_IMPORTS_NOT)]
            if hits:
                found.append(f"{path.relative_to(root).as_posix()}:{node.lineno} imports {hits[0]}")
    return found


def test_a_family_folder_imports_neither_torch_nor_the_engine():
    assert family_folder_torch_imports(ROOT) == []


def test_the_torch_free_family_rule_catches_an_offender(tmp_path):
    families = "backend/models/families/"
    root = _plant(tmp_path, {families + "olmoe/__init__.py": "def build():\n    import torch.nn\n",
                             families + "olmoe/gguf.py": "from hybridmoe.backend import engine\n",
                             families + "common.py": "from hybridmoe.backend.models import spec\n"})
    assert family_folder_torch_imports(root) == [
        "backend/models/families/olmoe/__init__.py:2 imports torch.nn",
        "backend/models/families/olmoe/gguf.py:1 imports hybridmoe.backend.engine",
    ]
