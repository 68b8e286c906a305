"""What the engine achieved on this machine, kept between runs.

The expected speed (plan.expected) reads the CPU experts at the rate the engine reaches; a
default share of the read probe stands in for it until the engine has run here. After a
benchmark (``hybridmoe bench generate`` / ``serve``) or a chat on a CPU-only plan, the rate it
read at (bytes a token read × tokens/s) and, where the run had a probe reading, that rate's
share of it are kept in ``achieved.toml`` in the data directory, the last KEPT_RUNS runs per
machine, and every later plan of this machine uses their medians (docs/sizing.md §6): the
share against the process's own probe reading (a shared machine's bandwidth moves within
minutes), else the rate.

Two compute rates are kept beside it the same way, per machine and per expert format (``RATES``):
the CPU's multiply-adds per second in a prompt (``prefill_flops_per_s``), and for the formats
whose decode the CPU's unpacking of the weights limits, not the reads (the i-quants), the expert
weights a core unpacks per second in a decode step (``expert_weights_per_s_per_core``).

A machine is known by what the plan depends on: CPU model, physical cores, sockets, RAM and
GPUs. A described machine is never this one, so nothing is recorded or looked up for it.
"""

from __future__ import annotations

import datetime
import statistics
import tomllib
from pathlib import Path

import tomli_w

from hybridmoe.backend.files import write_atomic
from hybridmoe.backend.hardware.profile import HardwareProfile
from hybridmoe.backend.settings import data_dir

FILE_NAME = "achieved.toml"
# Below this the figure is not a decode's read rate but a stalled or interrupted run.
_MIN_SENSIBLE_RATE = 1e8
# A token that reads less than this is timed by its fixed costs (launches, the token loop), not
# by its reads: a small model's rate says nothing of a large one's (a test model's read 0.4 GB/s
# where the mid-size benchmark model's read 6). The mid-size benchmark model reads 0.3 GB a token.
MIN_BYTES_PER_TOKEN = 128 * (1 << 20)
# The runs kept per machine (and per format, for the compute rates); plans take their medians.
KEPT_RUNS = 7
# The compute rates kept per machine and expert format, each under this name in the machine's entry.
RATES = ("prefill_flops_per_s", "expert_weights_per_s_per_core")


def path() -> Path:
    return data_dir() / FILE_NAME


def machine_key(profile: HardwareProfile) -> str:
    """The machine in one line: "Intel(R) Xeon(R) Processor, 2 cores, 1 socket(s), 23.5 GiB, no GPU"."""
    cpu, mem = profile.cpu, profile.memory
    gpus = ", ".join(g.name for g in profile.served_gpus) or "no GPU"
    ram = f"{mem.total_bytes / (1 << 30):.1f} GiB" if mem.total_bytes else "RAM unknown"
    return f"{cpu.model_name or 'CPU unknown'}, {cpu.physical_cores or '?'} cores, {cpu.sockets or '?'} socket(s), {ram}, {gpus}"


def _read(file: Path) -> dict:
    try:
        return tomllib.loads(file.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}  # a missing or damaged file: no figure yet (the next record writes a good one)


def _runs(entry) -> list[dict]:
    """A machine's kept runs, each with a sensible rate (and a share of the probe, or none)."""
    runs = entry.get("runs", []) if isinstance(entry, dict) else []
    out = []
    for run in runs if isinstance(runs, list) else []:
        rate, share = run.get("read_bytes_per_s") if isinstance(run, dict) else None, None
        if not isinstance(rate, (int, float)) or rate < _MIN_SENSIBLE_RATE:
            continue
        share = run.get("share_of_probe")
        out.append({**run, "share_of_probe": share if isinstance(share, (int, float)) and 0 < share <= 2 else None})
    return out


def lookup(profile: HardwareProfile) -> tuple[float, float | None, str] | None:
    """(bytes/s, its share of the probe or None, where they came from) the engine's decode read at
    on this machine: the medians of its last runs (one run on a busy machine can be far from
    another), or None."""
    if profile.described:
        return None
    runs = _runs(_read(path()).get(machine_key(profile)))
    if not runs:
        return None
    shares = [r["share_of_probe"] for r in runs if r["share_of_probe"] is not None]
    latest = runs[-1]
    where = f"{latest.get('source', 'a run')}, {latest.get('when', 'date unknown')}"
    if len(runs) > 1:
        where = f"the median of {len(runs)} runs, the latest {where}"
    return (statistics.median(r["read_bytes_per_s"] for r in runs),
            statistics.median(shares) if shares else None, where)


def record(profile: HardwareProfile, *, bytes_per_token: float, tokens_per_s: float, source: str,
           probe_bytes_per_s: float | None = None) -> Path | None:
    """Keep the engine's measured decode read rate (`bytes_per_token` × `tokens_per_s`) for this
    machine, and its share of `probe_bytes_per_s` (the read probe taken with the run) when
    given; the last KEPT_RUNS runs are kept. Returns the file written, or None when nothing was (a
    described machine, a model too small for its reads to time its tokens, a figure that cannot
    be a decode's, or a data directory that cannot be written: the figure is a help, never worth
    failing a benchmark or a chat over)."""
    read_bytes_per_s = bytes_per_token * tokens_per_s
    if profile.described or bytes_per_token < MIN_BYTES_PER_TOKEN or read_bytes_per_s < _MIN_SENSIBLE_RATE:
        return None
    file = path()
    entries = _read(file)
    key = machine_key(profile)
    run = {
        "read_bytes_per_s": float(read_bytes_per_s),
        **({"share_of_probe": read_bytes_per_s / probe_bytes_per_s} if probe_bytes_per_s else {}),
        "source": source,
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    entry = entries.get(key) if isinstance(entries.get(key), dict) else {}
    kept = [{k: v for k, v in r.items() if v is not None} for r in _runs(entry)]
    entries[key] = {**entry, "runs": (kept + [run])[-KEPT_RUNS:]}  # the compute rates kept as they were
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        return write_atomic(file, tomli_w.dumps(entries))
    except OSError:
        return None


def record_rate(profile: HardwareProfile, kind: str, *, expert_format: str, value: float, source: str) -> Path | None:
    """Keep a compute rate (`kind`, one of RATES) the engine reached on this machine with experts
    in `expert_format`; the last KEPT_RUNS per format are kept. Returns the file written, or None
    when nothing was (a described machine, a figure that is not a rate, a data directory that
    cannot be written: like ``record``, never worth failing a benchmark or a chat over)."""
    if kind not in RATES:
        raise ValueError(f"unknown rate {kind!r}")
    if profile.described or not value > 0 or not expert_format:
        return None
    file = path()
    entries = _read(file)
    key = machine_key(profile)
    entry = entries.get(key) if isinstance(entries.get(key), dict) else {}
    kept = _rate_runs(entry, kind)
    run = {"format": expert_format, "value": float(value), "source": source,
           "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    same = [r for r in kept if r["format"] == expert_format]
    others = [r for r in kept if r["format"] != expert_format]
    entries[key] = {**entry, kind: others + (same + [run])[-KEPT_RUNS:]}
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        return write_atomic(file, tomli_w.dumps(entries))
    except OSError:
        return None


def _rate_runs(entry, kind: str) -> list[dict]:
    runs = entry.get(kind, []) if isinstance(entry, dict) else []
    return [r for r in (runs if isinstance(runs, list) else [])
            if isinstance(r, dict) and isinstance(r.get("format"), str)
            and isinstance(r.get("value"), (int, float)) and r["value"] > 0]


def lookup_rate(profile: HardwareProfile, kind: str, expert_format: str, *,
                any_format: bool = False) -> tuple[float, str, str] | None:
    """(the median of the rate `kind` over the kept runs of `expert_format` on this machine,
    where it came from, the format measured), or None. With ``any_format``, where this format was
    never measured here, the median over the runs of every format measured on this machine."""
    if profile.described:
        return None
    runs = _rate_runs(_read(path()).get(machine_key(profile)), kind)
    same = [r for r in runs if r["format"] == expert_format]
    chosen = same or (runs if any_format else [])
    if not chosen:
        return None
    latest = chosen[-1]
    formats = sorted({r["format"] for r in chosen})
    where = f"{latest.get('source', 'a run')}, {latest.get('when', 'date unknown')}"
    if len(chosen) > 1:
        where = f"the median of {len(chosen)} runs, the latest {where}"
    return statistics.median(r["value"] for r in chosen), where, ", ".join(formats)
