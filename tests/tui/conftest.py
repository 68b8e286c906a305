"""Terminal UI tests: every test gets config, data, state and cache directories of its own
and no network; the App gets fake services (tests/tui/fakes.py)."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from hybridmoe.backend.settings import Settings
from tests.tui.fakes import FakeServices, local_model


@pytest.fixture(scope="session")
def tiny_model(tiny_chat_model):
    """A tiny real Qwen3-MoE checkpoint with a byte-level BPE tokenizer and a chat template
    (tests/conftest.py builds it once per session, for every package that runs it)."""
    return tiny_chat_model


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HYBRIDMOE_CONFIG", raising=False)
    return tmp_path


@pytest.fixture
def services(tmp_path):
    return FakeServices(tmp_path / "store")


@pytest.fixture
def configured(services, tmp_path):
    """Past the first run: a model on disk is the default, so the app opens the chat."""
    model = local_model(tmp_path / "models")
    services.local.append(model)
    Settings(default_model=str(model.path), measure_bandwidth=False).save()
    return services


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run ``async def`` tests (Pilot needs an event loop) without an asyncio plugin."""
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        asyncio.run(pyfuncitem.obj(**args))
        return True
    return None
