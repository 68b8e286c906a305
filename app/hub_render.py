"""Text for `hybridmoe pull` and `hybridmoe models`: file lists, the one-line progress
display, the tables of local models and of the catalogue."""

from __future__ import annotations

import shutil
import sys
from typing import TextIO

from hybridmoe.backend.hub.download import PullPlan
from hybridmoe.backend.hub.local import LocalModel
from hybridmoe.backend.hub.meter import DownloadProgress, fmt_duration
from hybridmoe.backend.session import Progress
from hybridmoe.backend.units import fmt_bytes, fmt_rate


def _table(header: list[str], rows: list[list[str]], right: set[int] = frozenset(), indent: int = 2) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(r):
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        return (" " * indent + "  ".join(cells)).rstrip()

    return [line(header), *[line(r) for r in rows]]


# ---- pull --------------------------------------------------------------------------------------

MAX_FILE_ROWS = 14


def plan_text(plan: PullPlan) -> str:
    sel = plan.selection
    kind = f"GGUF {sel.quantization}" if sel.kind == "gguf" else "safetensors checkpoint"
    rows = []
    for f in plan.files:
        have = plan.present_by_file.get(f.path, 0)
        state = "here" if have == (f.size or 0) and have else (f"{fmt_bytes(have)} here" if have else "")
        rows.append([f.path, fmt_bytes(f.size), state])
    head = (f"{plan.repo_id} @ {plan.revision} ({plan.commit[:12]}): {kind}, {len(plan.files)} files, "
            f"{fmt_bytes(plan.total_bytes)}")
    out = [head]
    if len(rows) > MAX_FILE_ROWS:  # 163 shards of DeepSeek-V3: the first and the last few say enough
        hidden = rows[6:-4]
        hidden_bytes = sum(f.size or 0 for f in plan.files[6:-4])
        rows = [*rows[:6], [f"... {len(hidden)} more files", fmt_bytes(hidden_bytes), ""], *rows[-4:]]
    out += _table(["FILE", "SIZE", ""], rows, right={1})
    if plan.present_bytes:
        out.append(f"{fmt_bytes(plan.present_bytes)} already in {plan.cache_dir}; "
                   f"{fmt_bytes(plan.download_bytes)} to download")
    else:
        out.append(f"Downloading into {plan.cache_dir}")
    return "\n".join(out)


class ProgressLine:
    """One status line on a terminal, rewritten in place; nothing at all when the stream is
    not a terminal. (The download meter already limits how often it reports.)"""

    def __init__(self, stream: TextIO = sys.stderr):
        self.stream = stream
        self.enabled = bool(getattr(stream, "isatty", lambda: False)())
        self._shown = False

    def __call__(self, p: Progress) -> None:
        self.show(progress_text(p))

    def show(self, text: str) -> None:
        if not self.enabled:
            return
        width = shutil.get_terminal_size((100, 20)).columns - 1
        self.stream.write("\r" + text[:width].ljust(width))
        self.stream.flush()
        self._shown = True

    def done(self) -> None:
        """End the line (before anything else is printed)."""
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False


def progress_text(p: Progress) -> str:
    if not isinstance(p, DownloadProgress):
        return p.message
    pct = f"{100 * p.done / p.total:5.1f}%" if p.total else ""
    bar_width = 20
    filled = int(bar_width * p.done / p.total) if p.total else 0
    bar = "#" * filled + "-" * (bar_width - filled)
    return (f"[{bar}] {pct} {fmt_bytes(p.done)} / {fmt_bytes(p.total)}  {fmt_rate(p.rate_bytes_per_s)}  "
            f"ETA {fmt_duration(p.eta_s)}  {p.files_done}/{p.files_total} files  {p.file}")


def pulled_text(model: LocalModel) -> str:
    quant = f" {model.quantization}" if model.quantization else ""
    family = f", {model.family}" if model.family else ""
    out = [f"{model.name}: {model.kind}{quant}{family}, {fmt_bytes(model.size_bytes)}"]
    if model.note:
        out.append(f"  {model.note}")
    if model.problem:
        out.append(f"  Note: {model.problem}")
    return "\n".join(out)


# ---- models --------------------------------------------------------------------------------------


def models_text(models: list[LocalModel]) -> str:
    usable = [m for m in models if m.usable]
    broken = [m for m in models if not m.usable]
    if not models:
        return ("No models found. Download one with `hybridmoe pull REPO` (see `hybridmoe models --catalogue`),\n"
                "or register a folder that holds models with `hybridmoe models --add DIR`.")
    out = []
    if usable:
        out.append(f"Models ({len(usable)})")
        rows = [[m.name, m.kind, m.quantization or "", m.family or "", fmt_bytes(m.size_bytes), m.source, str(m.path)]
                for m in sorted(usable, key=lambda m: (m.source, m.name.lower()))]
        out += _table(["NAME", "FORMAT", "QUANT", "FAMILY", "SIZE", "SOURCE", "PATH"], rows, right={4})
    if broken:
        out.append(f"{'' if not usable else chr(10)}Not usable ({len(broken)})")
        for m in sorted(broken, key=lambda m: (m.source, m.name.lower())):
            out.append(f"  {m.name} ({m.source}, {m.path})")
            out.append(f"    {m.problem}")
    return "\n".join(out)


def catalogue_text(catalogue, ranked=None) -> str:
    out = ["Catalogue (sizes marked * are computed from the config; the others are published)"]
    rows = []
    for e in catalogue:
        ck = e.checkpoint_size()
        quants = []
        for q in e.quants:
            s = e.quant_size(q)
            if s is not None:
                quants.append(f"{q.name} {fmt_bytes(s.bytes)}{'' if s.published else '*'}")
            else:
                quants.append(q.name)
        rows.append([e.id, e.repo, e.family, f"{e.context:,}",
                     f"{fmt_bytes(ck.bytes)}{'' if ck.published else '*'} {e.spec.expert_format}", ", ".join(quants)])
    out += _table(["ID", "REPO", "FAMILY", "CONTEXT", "CHECKPOINT", "GGUF"], rows, right={3})
    if ranked is not None:
        out.append("")
        if not ranked:
            out.append("On this machine: none of them fits.")
        else:
            from hybridmoe.app.render import expected_sources

            out.append("On this machine, best variant that fits, fastest first (the plan's expected decode speed, "
                       "then its upper bound; docs/sizing.md §6):")
            rows = [[r.entry.id, r.option, fmt_bytes(r.size_bytes),
                     f"{r.tokens_per_s:,.1f} tok/s" if r.tokens_per_s else "unknown",
                     f"{r.bound_tokens_per_s:,.1f} tok/s" if r.bound_tokens_per_s else "unknown", f"{r.context:,}"]
                    for r in ranked]
            out += _table(["ID", "VARIANT", "SIZE", "EXPECTED", "AT MOST", "CONTEXT"], rows, right={2, 3, 4, 5})
            out += [f"Expected from {source}." for source in expected_sources([r.plan for r in ranked])]
    out.append("\nDownload one with `hybridmoe pull ID` (the checkpoint) or `hybridmoe pull ID --quant Q4_K_M` "
               "(a GGUF); plan one with `hybridmoe plan ID`.")
    return "\n".join(out)
