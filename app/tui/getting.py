"""What to fetch for a choice: a catalogue variant, or what a person typed (a Hub repository,
``org/name:QUANT`` for one GGUF quantization, a catalogue name, or a local path).

Catalogue variants are the checkpoint or a quantization. A quantization comes from the
first GGUF repository the catalogue lists; when it lists none, the checkpoint is downloaded
and converted here, if the converter writes that quantization.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridmoe.app.tui.widgets.transfer import Job
from hybridmoe.backend.errors import UsageError
from hybridmoe.backend.units import fmt_bytes


@dataclass(frozen=True)
class Variant:
    option: str  # "checkpoint" or a quantization name
    label: str
    job: Job | None  # None: cannot be fetched from here


def job_for(entry, option: str, convert_quants: tuple[str, ...]) -> Job | None:
    """The Job that gets ``option`` of catalogue ``entry``; None when nothing can."""
    if option == "checkpoint":
        return Job(repo=entry.repo)
    if entry.gguf_repos:
        return Job(repo=entry.gguf_repos[0], quant=option)
    if option.lower() in convert_quants:
        return Job(repo=entry.repo, convert_to=option.lower())
    return None


def variants(entry, convert_quants: tuple[str, ...]) -> list[Variant]:
    """Every variant of a catalogue entry with its size and where it comes from."""
    out = []
    ck = entry.checkpoint_size()
    out.append(Variant("checkpoint",
                       f"checkpoint ({entry.spec.expert_format}), {fmt_bytes(ck.bytes)} from {entry.repo}",
                       job_for(entry, "checkpoint", convert_quants)))
    for q in entry.quants:
        size = entry.quant_size(q)
        job = job_for(entry, q.name, convert_quants)
        where = (f"from {job.repo}" + (", converted here" if job.convert_to else "")) if job else "not available here"
        out.append(Variant(q.name, f"{q.name}, {fmt_bytes(size.bytes) if size else 'size unknown'} {where}", job))
    return out


def parse_typed(text: str, catalogue, convert_quants: tuple[str, ...], fitting: dict[str, Job] | None = None) -> Job | Path:
    """A local path (returned as a Path) or the Job for what was typed. A catalogue name gets
    the variant that fits this machine (``fitting``: catalogue id -> its Job, as the list shows
    it), else the checkpoint."""
    text = text.strip()
    if not text:
        raise UsageError("Type a Hub repository (organisation/name), a catalogue name or a local path.")
    path = Path(text).expanduser()
    if path.exists():
        return path
    if text.startswith(("/", "~", ".")):
        raise UsageError(f"{text} does not exist.",
                         "Check the path, or type a Hub repository such as Qwen/Qwen3-30B-A3B.")
    repo, _, quant = text.partition(":")
    if repo.count("/") == 1 and all(repo.split("/")):
        return Job(repo=repo, quant=quant or None)
    entry = catalogue.find(text)
    if entry is not None:
        return (fitting or {}).get(entry.id) or Job(repo=entry.repo)
    raise UsageError(
        f"{text!r} is neither a local path, a Hub repository (organisation/name) nor a catalogue name.",
        "Examples: Qwen/Qwen3-30B-A3B, unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M, qwen3-30b-a3b, /data/models/my-model.",
    )
