"""The house rules of DESIGN.md that code can check."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN_IN_BACKEND = ("textual", "app", "rich")


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
        if name.split(".")[0] in FORBIDDEN_IN_BACKEND
    ]
    assert not offenders, "backend/ is a headless library:\n" + "\n".join(offenders)


def test_the_rule_catches_an_offender(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom textual.app import App\nimport app.cli\n")
    names = [name for _, name in _imports(bad)]
    assert [n for n in names if n.split(".")[0] in FORBIDDEN_IN_BACKEND] == ["textual.app", "app.cli"]


def test_nothing_from_a_model_repo_executes():
    """No pickle loading and no remote code anywhere in the project."""
    offenders = []
    for path in sorted([*(ROOT / "backend").rglob("*.py"), *(ROOT / "app").rglob("*.py")]):
        text = path.read_text()
        for needle in ("trust_remote_code=True", "pickle.load", "torch.load("):
            if needle in text:
                offenders.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not offenders, offenders
