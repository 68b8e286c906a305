"""docs/sizing.md's table of published runs against the plan's expected figure (#47): every
printed figure is the plan's arithmetic today, and the validation's claims hold."""

import importlib.util
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _published_runs():
    spec = importlib.util.spec_from_file_location("published_runs", ROOT / "benchmarks" / "published_runs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_docs_table_is_what_the_plan_computes():
    runs = _published_runs()
    table = runs.table(runs.rows())
    # A change to the planner's arithmetic changes the table: `python benchmarks/published_runs.py`
    # prints the new one for docs/sizing.md.
    assert table in (ROOT / "docs" / "sizing.md").read_text()


def test_expected_is_within_the_target_of_measured_and_layouts_that_ran_fit():
    runs = _published_runs()
    rows = runs.rows()
    described = tomllib.loads(runs.RUNS.read_text())["run"]
    assert len(rows) == len(described) >= 9
    assert sum(r.close for r in rows) >= 7
    # Every run's source is a public address, and every layout that ran fits.
    for row in rows:
        assert row.source.startswith("https://")
        assert row.fits, row.machine
    # The expected figure is never above the bound.
    assert all(r.expected <= r.bound for r in rows)
