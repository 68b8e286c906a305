"""The model service: the one loaded model the chat, the benchmark and the API server share.
Loading with progress and cancel, one model in memory at a time when switching, unloading,
sharing with the server's queue. The real engine on the tiny checkpoint for a load and an
answer; the TUI tests' fake backend (tests/tui/fakes.py) for the orderings."""

from __future__ import annotations

import threading
import time

import pytest

from hybridmoe.app.model_service import ModelService
from hybridmoe.app.server.shared_session import SharedSession
from hybridmoe.app.services import Services
from hybridmoe.backend.errors import HybridMoeError, ModelUnloadedError, PlanError
from hybridmoe.backend.hardware.overrides import apply_overrides
from hybridmoe.backend.hardware.presets import preset
from hybridmoe.backend.session import Cancelled, CancelToken, Done, Message
from hybridmoe.backend.settings import Settings
from hybridmoe.backend.units import GiB
from tests.tui.fakes import FakeBackend, FakeServices, local_model, this_machine

GREEDY_FEW = {"temperature": 0.0, "max_tokens": 4}


@pytest.fixture(autouse=True)
def data_home(tmp_path, monkeypatch):
    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.delenv("HYBRIDMOE_CONFIG", raising=False)


@pytest.fixture
def fake(tmp_path):
    services = FakeServices(tmp_path / "store")
    first = local_model(tmp_path / "models")
    second = local_model(tmp_path / "models", "olmoe-1b-7b")
    return services, str(first.path), str(second.path)


def load(models: ModelService, services, model: str, cancel: CancelToken | None = None, progress=None):
    return models.load(model, None, hardware=services.hardware, settings=Settings(),
                       on_progress=progress, cancel=cancel or CancelToken())


def in_thread(work):
    """Run ``work`` on a thread; the result holds what it returned or raised."""
    result = {}

    def run():
        try:
            result["value"] = work()
        except BaseException as error:  # noqa: BLE001 - handed to the test to assert on
            result["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def wait_for(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# ---- the real engine --------------------------------------------------------------------------


def test_the_tiny_model_loads_answers_and_unloads(tiny_chat_model):
    services = Services()
    models = ModelService(services)
    heard = []
    settings = Settings(context=256)
    loaded = models.load(str(tiny_chat_model), None, hardware=None, settings=settings,
                         on_progress=heard.append, cancel=CancelToken())
    assert models.loaded is loaded and models.session is loaded.session
    assert loaded.session.backend == "engine" and loaded.plan.workload.context == 256
    assert loaded.path == tiny_chat_model and loaded.target == (str(tiny_chat_model), None)
    assert any(p.stage == "plan" for p in heard) and any(p.stage == "load" for p in heard)

    from hybridmoe.backend.text.sampling import SamplingParams

    events = list(models.session.generate([Message("user", "Hello!")], SamplingParams(**GREEDY_FEW)))
    assert isinstance(events[-1], Done) and events[-1].stats.generated_tokens >= 1

    unloaded = []
    models.when_unloaded(unloaded.append)
    models.unload("for the benchmark")
    assert models.loaded is None and models.session is None and unloaded == ["for the benchmark"]
    with pytest.raises(ModelUnloadedError):
        list(loaded.session.generate([Message("user", "Again")], SamplingParams(**GREEDY_FEW)))


# ---- switching, unloading, cancelling ----------------------------------------------------------


def test_switching_models_closes_the_old_one_before_the_new_one_loads(fake):
    services, first, second = fake
    models = ModelService(services)
    one = load(models, services, first)
    closed_when_loading = []
    real_load = services.backend.load

    def watched(model_path, plan, on_progress=None, cancel=None):
        closed_when_loading.append(one.session.closed)
        return real_load(model_path, plan, on_progress, cancel)

    services.backend.load = watched
    two = load(models, services, second)
    assert closed_when_loading == [True]  # never two models in memory
    assert models.loaded is two and models.session is two.session and not two.session.closed
    assert two.plan.model != one.plan.model


def test_a_model_that_cannot_be_planned_leaves_the_loaded_one(fake):
    services, first, second = fake
    models = ModelService(services)
    one = load(models, services, first)
    services.hardware = this_machine(apply_overrides(preset("cpu-only"), ram=4 * GiB))
    with pytest.raises(PlanError, match="does not fit"):
        load(models, services, second)
    assert models.loaded is one and not one.session.closed


def test_cancel_during_a_load(fake):
    services, first, _ = fake
    services.backend = FakeBackend(hold_load=True)
    models = ModelService(services)
    cancel, heard = CancelToken(), []
    thread, result = in_thread(lambda: load(models, services, first, cancel, heard.append))
    wait_for(lambda: any(p.stage == "load" for p in heard), "the first layer")
    assert models.loading and models.loaded is None
    cancel.cancel()
    thread.join(20)
    assert isinstance(result.get("error"), Cancelled)
    assert models.loaded is None and not models.loading
    with services.model_turn("a probe", wait=False) as busy:
        assert busy == ""  # the cancelled load let go of the turn


def test_unloading_cancels_a_load_in_progress(fake):
    services, first, _ = fake
    services.backend = FakeBackend(hold_load=True)
    models = ModelService(services)
    heard = []
    thread, result = in_thread(lambda: load(models, services, first, progress=heard.append))
    wait_for(lambda: heard, "the load to start")
    models.unload("for the benchmark")
    thread.join(20)
    assert isinstance(result.get("error"), Cancelled) and models.loaded is None


def test_a_load_finished_after_it_was_replaced_is_closed_not_kept(fake):
    """The backend's load may return just after an unload cancelled it: the session it made
    is closed there and then, never left loaded beside nobody's knowledge."""
    services, first, _ = fake
    models = ModelService(services)
    entered, release, made = threading.Event(), threading.Event(), []
    real_load = services.backend.load

    def deaf_load(model_path, plan, on_progress=None, cancel=None):  # does not look at its cancel
        entered.set()
        release.wait(20)
        session = real_load(model_path, plan)
        made.append(session)
        return session

    services.backend.load = deaf_load
    thread, result = in_thread(lambda: load(models, services, first))
    assert entered.wait(20)
    models.unload("for the benchmark")
    release.set()
    thread.join(20)
    assert isinstance(result.get("error"), Cancelled)
    assert made and made[0].closed and models.loaded is None


def test_a_later_load_replaces_one_in_progress(fake):
    services, first, second = fake
    models = ModelService(services)
    real_load, started = services.backend.load, threading.Event()

    def first_held(model_path, plan, on_progress=None, cancel=None):
        if not started.is_set():  # the first load: until it is cancelled
            started.set()
            while not cancel.cancelled:
                time.sleep(0.01)
        return real_load(model_path, plan, on_progress, cancel)

    services.backend.load = first_held
    thread, result = in_thread(lambda: load(models, services, first))
    assert started.wait(20)
    two = load(models, services, second)
    thread.join(20)
    assert isinstance(result.get("error"), Cancelled)
    assert models.loaded is two and [s.closed for s in services.backend.sessions] == [False]


# ---- who uses it -------------------------------------------------------------------------------


def test_every_user_sees_the_same_session_and_the_servers_queue_while_it_serves(fake):
    services, first, second = fake
    models = ModelService(services)
    loaded = load(models, services, first)
    chat_sees, server_sees = models.session, models.session
    assert chat_sees is server_sees is loaded.session

    shared = models.share(hold=None)
    assert isinstance(shared, SharedSession) and shared.session is loaded.session
    assert models.session is shared and models.share(hold=None) is shared  # one queue, however many ask
    models.unshare(shared)
    assert models.session is loaded.session and not loaded.session.closed

    shared = models.share(hold=None)
    load(models, services, second)  # another model: the queue and its session close with the old one
    assert shared.closed and loaded.session.closed and models.session is not shared
    models.unshare(shared)  # the server stopping afterwards changes nothing
    assert models.session is models.loaded.session


def test_sharing_needs_a_model():
    models = ModelService(Services())
    with pytest.raises(HybridMoeError, match="no model is loaded yet"):
        models.share(hold=None)


def test_a_user_keeps_the_model_loaded_while_it_needs_it(fake):
    services, first, _ = fake
    models = ModelService(services)
    answering = [False]
    models.keep_while(lambda: "the chat is answering" if answering[0] else "")
    models.keep_while(lambda: "")
    assert models.busy() == ""
    answering[0] = True
    assert models.busy() == "the chat is answering"
    unloaded = []
    models.when_unloaded(unloaded.append)
    models.unload("nothing loaded")
    assert unloaded == []  # nothing was closed: nobody is told
    load(models, services, first)
    models.close()  # quitting: closed, but not said
    assert models.loaded is None and services.backend.sessions[0].closed and unloaded == []
