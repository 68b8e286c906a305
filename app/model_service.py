"""The one model the app has loaded, owned in one place that every screen asks.

The chat, the benchmark and the API server dialog share one ``ModelService`` (the App holds
it): a model loaded for the chat is the one the server serves, the benchmark unloads it
through here, and loading another model closes the current one first, so that two large
models are never held in memory at once. Loading reports its progress and a cancel as the
backend does (``Progress`` events, a ``CancelToken``, ``Cancelled``).

Blocking calls (``load``) run on worker threads; the others are quick and may be called
from any thread. Nothing here knows about Textual.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.app.server.shared_session import SharedSession
from hybridmoe.backend.errors import HybridMoeError, PlanError
from hybridmoe.backend.plan import Plan, Workload
from hybridmoe.backend.session import Cancelled, CancelToken, Progress, ProgressCallback, Session


@dataclass(frozen=True)
class LoadedModel:
    """A model in memory: what was asked for, the file and plan it was loaded with, and the
    session as the backend made it (only this one counts experts; answers go through
    ``ModelService.session``, which may be the server's shared queue around it)."""

    target: tuple  # (the model as the app named it, the plan it gave or None)
    path: Path
    plan: Plan
    session: Session

    @property
    def name(self) -> str:
        return self.plan.model or self.path.name


class ModelService:
    def __init__(self, services):
        self._services = services  # hybridmoe.app.services.Services (or the tests' fake)
        self._lock = threading.Lock()
        self._loaded: LoadedModel | None = None
        self._shared: SharedSession | None = None
        self._loading: CancelToken | None = None  # the cancel of the load in progress
        # Why the model cannot be unloaded now: each asks a user of the model ("" = free).
        self._busy: list[Callable[[], str]] = []
        self._unload_listeners: list[Callable[[str], None]] = []

    # ---- what is loaded (quick, any thread) ------------------------------------------------------

    @property
    def loaded(self) -> LoadedModel | None:
        return self._loaded

    @property
    def session(self):
        """Where answers go: the server's shared queue while it serves the model (so the chat
        waits its turn beside the requests), else the session itself; None when nothing is
        loaded."""
        with self._lock:
            if self._shared is not None:
                return self._shared
            return self._loaded.session if self._loaded is not None else None

    @property
    def loading(self) -> bool:
        return self._loading is not None

    # ---- loading and unloading -------------------------------------------------------------------

    def load(self, model: str, plan: Plan | None, *, hardware, settings, on_progress: ProgressCallback | None,
             cancel: CancelToken, on_notice: Callable[[str], None] | None = None) -> LoadedModel:
        """Load ``model`` (a path or a name ``Services.resolve_model`` knows) with ``plan``,
        or with its saved plan, or one made now from ``settings``' workload on ``hardware``
        (detected when None). Blocks; run it on a worker thread.

        The current model is closed once the new one's plan is ready (a model that cannot
        be planned leaves it loaded), before the new one loads: one model in memory at a
        time. A load still in progress is cancelled. Raises ``Cancelled`` when ``cancel`` is
        set, or when a later ``load`` or ``unload`` replaced this one before it finished."""
        with self._lock:
            if self._loading is not None:
                self._loading.cancel()
            self._loading = cancel
        services = self._services
        target = (model, plan)
        try:
            path = Path(services.resolve_model(model))
            if plan is None:
                plan = self._plan_for(path, hardware, settings, on_progress)
            with self._lock:  # a later load or unload may have come meanwhile: it decides
                if self._loading is not cancel or cancel.cancelled:
                    raise Cancelled(f"loading {path.name} was cancelled")
                current = self._take_current()
            if current is not None:
                current.close()

            def waiting(what: str) -> None:
                if on_progress is not None:
                    on_progress(Progress("wait", 0, None, message=f"waiting for {what} to end"))

            with services.model_turn("loading the model", cancel=cancel, on_wait=waiting):
                session = services.load_session(path, plan, on_progress, cancel, on_notice=on_notice)
        finally:
            with self._lock:
                if self._loading is cancel:
                    self._loading = None
        with self._lock:
            # Checked under the lock that ``unload`` and a later ``load`` cancel under: the
            # session is either kept here or closed below, never both or neither.
            replaced = cancel.cancelled
            loaded = LoadedModel(target, path, plan, session)
            if not replaced:
                self._loaded = loaded
        if replaced:
            session.close()
            raise Cancelled(f"loading {path.name} was cancelled")
        return loaded

    def _plan_for(self, path: Path, hardware, settings, on_progress: ProgressCallback | None) -> Plan:
        """The saved plan of this model, or one made now from the settings' workload."""
        services = self._services
        saved = services.plan_path(path)
        if saved.exists():
            return Plan.load(saved)
        if on_progress is not None:
            on_progress(Progress("plan", 0, None, message="planning the layout"))
        if hardware is None:
            hardware = services.detect_hardware(measure_bandwidth=False)
        inspected = services.inspect_model(path)
        workload = Workload(context=min(settings.context, inspected.spec.max_context), users=settings.users,
                            kv_dtype=settings.kv_dtype, backend=settings.backend)
        plan = services.make_plan(inspected.spec, inspected.inventory, hardware, workload)
        if not plan.fits:
            raise PlanError(f"{inspected.spec.name} does not fit this machine: {plan.reason}",
                            "Open the Plan screen (F4) to change the context or the layout, then save it.")
        return plan

    def unload(self, why: str) -> None:
        """Close the model (and cancel a load in progress) to free its memory for ``why`` (a
        few words: "for the benchmark"); those listening hear ``why``. Whoever asks checks
        ``busy()`` first when an answer in progress should keep the model."""
        with self._lock:
            if self._loading is not None:
                self._loading.cancel()
        had_model = self._close_current()
        if had_model:
            for listener in list(self._unload_listeners):
                listener(why)

    def close(self) -> None:
        """The app is quitting: close the model, cancel any load; nobody is told."""
        with self._lock:
            if self._loading is not None:
                self._loading.cancel()
        self._close_current()

    def _close_current(self) -> bool:
        with self._lock:
            current = self._take_current()
        if current is None:
            return False
        current.close()
        return True

    def _take_current(self):
        """Under the lock: forget the loaded model; returns what closes it, or None. The
        shared queue closes the session once the answers it is running have ended."""
        loaded, shared = self._loaded, self._shared
        self._loaded = self._shared = None
        if loaded is None:
            return None
        return shared if shared is not None else loaded.session

    # ---- who uses it -----------------------------------------------------------------------------

    def keep_while(self, reason: Callable[[], str]) -> None:
        """Register a user of the model: ``reason()`` says why it must stay loaded now ("the
        chat is answering: ..."), or "" when it may go."""
        self._busy.append(reason)

    def busy(self) -> str:
        """Why the model should not be unloaded now, or ""."""
        for reason in self._busy:
            said = reason()
            if said:
                return said
        return ""

    def when_unloaded(self, listener: Callable[[str], None]) -> None:
        """``listener(why)`` is called (on the unloading thread) each time ``unload`` closes
        a model."""
        self._unload_listeners.append(listener)

    # ---- serving it to other programs ------------------------------------------------------------

    def share(self, hold) -> SharedSession:
        """Put the loaded model behind a fair queue (``SharedSession``; ``hold`` as there)
        for the API server and the chat together; ``session`` is that queue from now on."""
        with self._lock:
            if self._loaded is None:
                raise HybridMoeError("no model is loaded yet",
                                     "Open the chat (F2), let the model load, then start the server.")
            if self._shared is None:
                self._shared = SharedSession(self._loaded.session, hold=hold)
            return self._shared

    def unshare(self, shared: SharedSession) -> None:
        """The server stopped: answers go straight to the session again (unless the model
        was closed or replaced meanwhile)."""
        with self._lock:
            if self._shared is shared:
                self._shared = None
