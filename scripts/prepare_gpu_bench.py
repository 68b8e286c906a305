#!/usr/bin/env python
"""Prepare what scripts/gpu_bench.sh needs on a GPU machine that reaches no package registry.

    python scripts/prepare_gpu_bench.py [--dest .gpu_bench] [--cache DIR]

Run here (with PyPI reachable); then hand the folder to the device run with the run tool's
``carry`` (it is ignored by git: 76 MB of sdist and build trees do not belong in history, and
what travels is re-made from PyPI by this script in about a minute). It writes DEST:

- ``llama.cpp/``: the llama.cpp source the installed llama-cpp-python vendors (its sdist of the
  same version, from PyPI), cut down to what libllama and libggml with the CPU and CUDA
  backends need: the top CMake files, ``cmake/``, ``include/``, ``src/``, what of ``vendor/``
  CMake reads unconditionally, and ``ggml/`` with only its CPU and CUDA backends. No common/, tools/, tests/, examples/, models/, docs/ (the sdist's 176 MB).
- ``python/llama_cpp/``: llama-cpp-python's own Python package (ctypes bindings) without
  its compiled libraries; ``LLAMA_CPP_LIB_PATH`` points it at the CUDA build
  (llama_cpp/llama_cpp.py reads it to find libllama.so; backend/llamacpp/library.py loads
  libggml and libggml-base from the same folder).
- ``wheels/<name>/``: wheels of the pure-Python (or abi3) packages the benchmark imports that
  the device may lack, each unpacked into its own folder; gpu_bench.sh puts a folder on
  PYTHONPATH only when the device's Python cannot import that package already (its own
  copies win). ``nanobind`` among them builds the native extension there.
- ``MANIFEST.json``: versions and sizes.

Prints the size of each part; the whole must stay well under the run tool's 64 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Paths of the llama.cpp tree (relative to vendor/llama.cpp) that the library build reads.
# ggml/src's other backends are left out: ggml_add_backend() only enters a backend's folder
# when its GGML_<NAME> option is on, and gpu_bench.sh turns on CUDA alone.
# Of vendor/, which CMake enters unconditionally: the hash library it compiles, and only the
# CMakeLists.txt of the header-only ones (their targets must exist; libllama includes none of
# their headers: the CPU build's dependency log here names no vendor/ file).
KEEP = ("CMakeLists.txt", "LICENSE", "cmake/", "include/", "src/", "vendor/CMakeLists.txt", "vendor/hash/",
        "vendor/miniaudio/CMakeLists.txt", "vendor/nlohmann/CMakeLists.txt", "vendor/sheredom/CMakeLists.txt",
        "vendor/stb/CMakeLists.txt", "ggml/CMakeLists.txt", "ggml/cmake/", "ggml/include/", "ggml/src/ggml-cpu/",
        "ggml/src/ggml-cuda/")
# Loose files directly in ggml/src (ggml.c, gguf.cpp, ggml-backend.cpp, CMakeLists.txt, ...).
KEEP_FILES_IN = ("ggml/src/",)

# (import name, distribution) of what the benchmark imports beyond PyTorch, NumPy and Jinja2
# (which PyTorch's own install brings; NumPy as the earlier GPU runs found it there). The versions are this machine's, so the device runs
# what the tests here ran.
PACKAGES = (("nanobind", "nanobind"), ("gguf", "gguf"), ("yaml", "PyYAML"), ("tqdm", "tqdm"),
            ("platformdirs", "platformdirs"), ("tomli_w", "tomli-w"), ("diskcache", "diskcache"),
            ("psutil", "psutil"), ("safetensors", "safetensors"), ("tokenizers", "tokenizers"),
            ("typing_extensions", "typing_extensions"), ("pynvml", "nvidia-ml-py"),
            # The GGUF maker trains its tokenizer with the converter tests' helpers (tests/convert/conftest.py).
            ("pytest", "pytest"), ("pluggy", "pluggy"), ("iniconfig", "iniconfig"), ("packaging", "packaging"))


def keep(member: str) -> bool:
    """Whether a path inside vendor/llama.cpp belongs to the trimmed tree."""
    if any(member == k or (k.endswith("/") and member.startswith(k)) for k in KEEP):
        return True
    return any(member.startswith(d) and "/" not in member[len(d):] for d in KEEP_FILES_IN)


def download_sdist(dist_version: str, cache: Path) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{dist_version}.tar.gz"
    if not (cache / name).exists():
        # --no-build-isolation: pip only needs the archive, not a build environment for its metadata.
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "--no-build-isolation", f"llama-cpp-python=={dist_version}", "-d", str(cache)], check=True)
    return cache / name


def extract(sdist: Path, dest: Path) -> dict[str, int]:
    """The trimmed llama.cpp tree and the llama_cpp package from the sdist into dest."""
    sizes = {"llama.cpp": 0, "python/llama_cpp": 0}
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            if not m.isfile():
                continue
            top, _, rest = m.name.partition("/")
            if rest.startswith("vendor/llama.cpp/"):
                inner = rest[len("vendor/llama.cpp/"):]
                if not keep(inner):
                    continue
                target, part = dest / "llama.cpp" / inner, "llama.cpp"
            elif rest.startswith("llama_cpp/") and "/lib/" not in rest:
                target, part = dest / "python" / rest, "python/llama_cpp"
            else:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(m) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            target.chmod(m.mode & 0o755 | 0o644)
            # The archive's times, not now: a build tree made from an earlier extraction of the
            # same sources stays up to date (ninja compares times).
            os.utime(target, (m.mtime, m.mtime))
            sizes[part] += m.size
    return sizes


def wheels(dest: Path, cache: Path) -> dict[str, dict]:
    """Each package's wheel (this machine's version) unpacked into dest/wheels/<import name>."""
    out = {}
    for module, dist in PACKAGES:
        try:
            v = version(dist)
        except PackageNotFoundError:
            raise SystemExit(f"{dist} is not installed here: install the project's dependencies first") from None
        got = cache / "wheels" / f"{dist}-{v}"
        if not got.exists() or not any(got.glob("*.whl")):
            got.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                            f"{dist}=={v}", "-d", str(got)], check=True)
        (wheel,) = got.glob("*.whl")
        tags = wheel.name.removesuffix(".whl").split("-")[-3:]
        if tags[1] not in ("none", "abi3"):
            # PyYAML has no abi3 wheel: its pure-Python package works without the C extension
            # (yaml/__init__.py falls back when _yaml is missing), so only that is unpacked.
            if module != "yaml":
                raise SystemExit(f"{wheel.name} is built for one Python version only; the device's may differ")
        target = dest / "wheels" / module
        size = 0
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                if module == "yaml" and tags[1] not in ("none", "abi3") and info.filename.startswith("_yaml"):
                    continue
                if module == "yaml" and tags[1] not in ("none", "abi3") and info.filename.endswith(".so"):
                    continue
                z.extract(info, target)
                size += info.file_size
        out[module] = {"distribution": dist, "version": v, "wheel": wheel.name, "bytes": size}
    return out


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, default=ROOT / ".gpu_bench")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "hybridmoe" / "gpu-bench",
                   help="where the sdist and wheels are downloaded to (not carried)")
    args = p.parse_args(argv)
    try:
        llama_version = version("llama-cpp-python")
    except PackageNotFoundError:
        raise SystemExit("llama-cpp-python is not installed here: its version says which llama.cpp to carry") from None
    for part in ("llama.cpp", "python", "wheels"):
        shutil.rmtree(args.dest / part, ignore_errors=True)
    args.dest.mkdir(parents=True, exist_ok=True)
    sdist = download_sdist(llama_version, args.cache)
    extract(sdist, args.dest)
    packages = wheels(args.dest, args.cache)
    manifest = {"llama_cpp_python": llama_version, "sdist": sdist.name, "packages": packages,
                "bytes": {"llama.cpp": tree_bytes(args.dest / "llama.cpp"), "python": tree_bytes(args.dest / "python"),
                          "wheels": tree_bytes(args.dest / "wheels")}}
    manifest["bytes"]["total"] = sum(manifest["bytes"].values())
    (args.dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    mib = 1 << 20
    for part, n in manifest["bytes"].items():
        print(f"{part:10} {n / mib:6.1f} MiB")
    cu = len(list((args.dest / "llama.cpp/ggml/src/ggml-cuda").rglob("*.cu")))
    print(f"llama-cpp-python {llama_version}: {args.dest} ({cu} .cu files in ggml-cuda)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
