"""The house rules of docs/architecture.md that code can check."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN_IN_BACKEND = ("textual", "rich", "hybridmoe.app")
# The repository's folders are installed under the one import package `hybridmoe`: their bare
# names are not importable from an installed wheel.
BARE_NAMES = ("app", "backend", "assets")


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
    """Docs and comments point at docs/, never at design files outside the repository."""
    needles = ("SIZING.md", "DESIGN.md", "../shared", "/work/shared")
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
