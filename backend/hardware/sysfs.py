"""Reading the kernel's text files under /proc and /sys without trusting them.

Detection runs on machines we have never seen: containers without /sys, hypervisors that
fill /proc/cpuinfo oddly, kernels without NUMA support. Every reader here returns ``None``
(or skips a line) instead of raising, and the callers turn that into an ``unknown`` entry.
All paths are built from a root passed by the caller so that tests can use fake trees.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

KIB = 1024


def read_text(path: Path) -> str | None:
    """The file's text, or None when it is missing, unreadable or not text."""
    try:
        return path.read_text(encoding="utf-8", errors="strict")
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def read_int(path: Path) -> int | None:
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def parse_cpulist(text: str) -> tuple[int, ...]:
    """CPU numbers from the kernel's list format ``"0-3,8,10-11"``; empty text is no CPUs.

    Raises ValueError on anything else so that a corrupt file is reported, not guessed at.
    """
    cpus: list[int] = []
    text = text.strip()
    if not text:
        return ()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if dash:
            lo, hi = int(first), int(last)
            if hi < lo:
                raise ValueError(f"descending range {part!r}")
            cpus.extend(range(lo, hi + 1))
        else:
            cpus.append(int(first))
    return tuple(sorted(set(cpus)))


_KB_LINE = re.compile(r"^\s*(?P<value>\d+)\s*(?P<unit>kB)?\s*$", re.IGNORECASE)


def parse_meminfo(text: str) -> dict[str, int]:
    """``{"MemTotal": bytes, "HugePages_Total": count, ...}`` from /proc/meminfo-style text.

    Lines with a "kB" unit are converted to bytes; unitless lines (page counts) are kept as
    they are; lines that do not parse are skipped. Per-node meminfo ("Node 0 MemTotal:")
    is accepted too: the "Node N" prefix is dropped.
    """
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, colon, rest = line.partition(":")
        if not colon:
            continue
        key = re.sub(r"^Node\s+\d+\s+", "", key.strip())
        match = _KB_LINE.match(rest)
        if not key or not match:
            continue
        number = int(match["value"])
        values[key] = number * KIB if match["unit"] else number
    return values


def parse_cache_size(text: str) -> int | None:
    """Bytes from sysfs or cpuinfo cache sizes: ``"32768K"``, ``"512 KB"``, ``"1M"``."""
    match = re.match(r"^\s*(\d+)\s*([KMG]?)i?B?\s*$", text.strip(), re.IGNORECASE)
    if not match:
        return None
    scale = {"": 1, "K": KIB, "M": KIB**2, "G": KIB**3}[match[2].upper()]
    return int(match[1]) * scale


def numbered_dirs(parent: Path, prefix: str) -> list[tuple[int, Path]]:
    """``[(3, parent/"node3"), ...]`` for entries named prefix + number, sorted by number."""
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    found = []
    for name in names:
        suffix = name[len(prefix) :]
        if name.startswith(prefix) and suffix.isdigit():
            found.append((int(suffix), parent / name))
    return sorted(found)


def is_host_root(root: str | os.PathLike[str], host_path: str) -> bool:
    """True when ``root`` is the running system's own ``host_path`` (not a fake tree).

    Fallbacks that ask the running system directly (psutil, os.cpu_count, sysctl) are only
    valid when the caller is describing this machine; with a fake tree they would mix two
    machines into one profile.
    """
    try:
        return Path(root).resolve() == Path(host_path).resolve()
    except OSError:
        return False
