"""The plan's expected decode speed against published runs of llama.cpp and KTransformers.

Reads docs/published_runs.toml, plans each run for the machine, model, quantization and layout
it names, and prints the Markdown table of docs/sizing.md §6 ("Against published runs"): the
measured figure, the plan's expected figure and bound, their ratio, and whether the plan says
the layout fits. tests/plan/test_published_runs.py holds the table in the docs to this.

    python benchmarks/published_runs.py
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.backend.hardware import describe
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.plan import Workload, make

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "published_runs.toml"
CONFIGS = ROOT / "assets" / "configs"
# What "close" means in the validation: the expected figure within this factor of the measured one.
WITHIN = 1.5


@dataclass(frozen=True)
class Row:
    engine: str
    machine: str
    model: str
    quant: str
    measured: float
    expected: float | None
    bound: float | None
    n_cpu_moe: int | None  # llama.cpp's layout as planned (the run's, where it gave one)
    fits: bool
    source: str
    note: str = ""

    @property
    def ratio(self) -> float | None:
        """Expected over measured."""
        return self.expected / self.measured if self.expected else None

    @property
    def close(self) -> bool:
        return self.ratio is not None and 1 / WITHIN <= self.ratio <= WITHIN


def plan_run(run: dict):
    """The plan for one published run."""
    model = inspect_model(CONFIGS / run["model"], expert_format=run["format"], other_format=run.get("other_format"))
    workload = Workload(context=run["context"], backend=run["backend"], strategy=run.get("strategy", "uniform"),
                        n_cpu_moe=run.get("n_cpu_moe"))
    return make(model.spec, model.inventory, describe(name=run["machine"], **run["hardware"]), workload)


def rows() -> list[Row]:
    out = []
    for run in tomllib.loads(RUNS.read_text())["run"]:
        plan = plan_run(run)
        llama = run["backend"] == "llamacpp" and plan.main_device == "cuda"
        out.append(Row(run["engine"], run["machine"], run["model"].removesuffix(".json").split("__")[1], run["quant"],
                       run["measured"], plan.decode_tokens_per_s_expected, plan.decode_tokens_per_s_upper_bound,
                       plan.llama_cpp["n_cpu_moe"] if llama else None, plan.fits, run["source"],
                       run.get("note", "")))
    return out


def table(rows_: list[Row]) -> str:
    lines = ["| engine | machine | model | quant | measured tok/s | expected | ratio | bound | layout | fits | note | source |",
             "|---|---|---|---|---:|---:|---:|---:|---|---|---|---|"]
    for r in rows_:
        layout = f"--n-cpu-moe {r.n_cpu_moe}" if r.n_cpu_moe is not None else "CPU experts"
        lines.append(f"| {r.engine} | {r.machine} | {r.model} | {r.quant} | {r.measured:g} | {r.expected:.1f} | "
                     f"{r.ratio:.2f} | {r.bound:.1f} | {layout} | {'yes' if r.fits else 'no'} | {r.note} | <{r.source}> |")
    close = sum(r.close for r in rows_)
    lines.append("")
    lines.append(f"Expected within {WITHIN}x of measured: {close} of {len(rows_)} runs.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(rows()))
