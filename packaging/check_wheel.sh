#!/usr/bin/env bash
# Build the wheel and the sdist, install the wheel into a fresh virtual environment, and run
# the installed command there: what `pipx install` / `uv tool install` users get.
#
#   packaging/check_wheel.sh [WORKDIR]
#
# The runtime venv reuses the heavy dependencies already installed for this Python (torch,
# llama-cpp-python, ...) instead of downloading them again (torch from PyPI would be the
# multi-GB CUDA build): a .pth file puts the base interpreter's site-packages on its path.
# Not --system-site-packages: that would also run the .pth hooks there, and an editable
# install of hybridmoe (`pip install -e .`) would then shadow the wheel being checked. The
# build itself runs isolated, as pip and pipx run it: scikit-build-core and nanobind come from
# PyPI, the native kernels are compiled with the system's C++ compiler and CMake.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-$(mktemp -d -t hybridmoe-wheel-XXXXXX)}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$WORK"
echo "== building in $WORK"

"$PYTHON" -m venv "$WORK/build-env"
"$WORK/build-env/bin/python" -m pip install --quiet --upgrade pip build
"$WORK/build-env/bin/python" -m build --sdist --wheel --outdir "$WORK/dist" "$ROOT"
ls -l "$WORK/dist"

WHEEL="$(ls "$WORK"/dist/hybridmoe-*.whl | head -n1)"
SDIST="$(ls "$WORK"/dist/hybridmoe-*.tar.gz | head -n1)"

echo "== checking the contents"
"$WORK/build-env/bin/python" - "$WHEEL" "$SDIST" <<'PY'
import sys, tarfile, zipfile
wheel, sdist = sys.argv[1], sys.argv[2]
names = zipfile.ZipFile(wheel).namelist()
needed = ["hybridmoe/app/cli.py", "hybridmoe/app/tui/app.tcss", "hybridmoe/backend/session.py",
          "hybridmoe/assets/catalogue.toml"]
missing = [n for n in needed if n not in names]
assert not missing, f"the wheel lacks {missing}"
assert any(n.startswith("hybridmoe/_native") for n in names), "the wheel lacks the native kernels"
top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
assert top == {"hybridmoe"}, f"the wheel installs more than one top-level name: {sorted(top)}"
assert not any(n.startswith("tests/") for n in names), "the wheel ships the tests"
with tarfile.open(sdist) as t:
    members = t.getnames()
for n in ("pyproject.toml", "native/CMakeLists.txt", "app/tui/app.tcss", "README.md"):
    assert any(m.endswith("/" + n) for m in members), f"the sdist lacks {n}"
print(f"wheel: {len(names)} files; sdist: {len(members)} files")
PY

echo "== installing the wheel into a fresh venv"
"$PYTHON" -m venv "$WORK/venv"
BASE_SITE="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
VENV_SITE="$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$BASE_SITE" > "$VENV_SITE/zz-base-site-packages.pth"  # after the venv's own packages
"$WORK/venv/bin/python" -m pip install --quiet "$WHEEL"
# The installed copy, not the source tree: run from elsewhere, check where it comes from.
cd "$WORK"
"$WORK/venv/bin/python" -c "
import hybridmoe.app as app, hybridmoe._native as native
print('app from', app.__file__); print('native kernels from', native.__file__)
assert app.__file__.startswith('$WORK/venv') and native.__file__.startswith('$WORK/venv'), 'not the installed wheel'"

echo "== hybridmoe --version"
"$WORK/venv/bin/hybridmoe" --version
echo "== hybridmoe doctor --no-bandwidth"
"$WORK/venv/bin/hybridmoe" doctor --no-bandwidth
echo "== the installed copy finds its model catalogue"
"$WORK/venv/bin/python" -c "
from hybridmoe.backend.hub import catalogue
where, n = catalogue.assets_dir(), len(catalogue.load().entries)
assert str(where).startswith('$WORK/venv') and n, (where, n)
print('ok:', n, 'models in', where)"
echo "== the terminal UI's stylesheet is where Textual looks for it"
"$WORK/venv/bin/python" -c "
from pathlib import Path
import hybridmoe.app.tui.app as m
assert (Path(m.__file__).parent / m.HybridMoeApp.CSS_PATH).is_file()
print('ok:', Path(m.__file__).parent / m.HybridMoeApp.CSS_PATH)"
echo "== OK: $WHEEL"
