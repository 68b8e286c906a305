"""Every benchmark test keeps to directories of its own: a benchmark records the engine's read
rate for this machine in the data directory (hardware.achieved), and a tiny model's must never
reach the user's."""

import pytest


@pytest.fixture(autouse=True)
def _own_data_dirs(tmp_path, monkeypatch):
    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
