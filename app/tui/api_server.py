"""The app's loaded model behind the OpenAI API, started and stopped from the TUI (F7).

While the server runs, the model service's session (what the chat answers with) is a
``SharedSession`` around the loaded model, and the server answers from the same one, as many at once as the model serves (the
conversations its plan holds): a chat message sent while requests are answered runs beside
them when there is a place, else waits its turn like any request.
Stopping the server gives the chat its plain session back. When another model is loaded
(or this one unloaded), the server stops, since what it served is gone.
"""

from __future__ import annotations

from hybridmoe.app.model_service import ModelService
from hybridmoe.app.server.activity import Finished
from hybridmoe.app.server.runner import ApiServer, check_exposure
from hybridmoe.app.server.shared_session import QueueCounts, SharedSession
from hybridmoe.backend.errors import HybridMoeError


class ChatModelServer:
    def __init__(self, models: ModelService):
        self.server: ApiServer | None = None
        self._models = models
        self._shared: SharedSession | None = None
        models.keep_while(lambda: "the API server is serving this model: stop it first (F7)" if self.running else "")
        self.watchdog = None  # the TUI's timer that calls model_gone; stopped with the server

    @property
    def running(self) -> bool:
        return self.server is not None and self.server.running

    @property
    def url(self) -> str:
        return f"{self.server.url}/v1" if self.server is not None else ""

    @property
    def model(self) -> str:
        return self.server.options.model_id if self.server is not None else ""

    def start(self, services, host: str, port: int, api_key: str | None) -> None:
        """Serve the loaded model; raises a HybridMoeError saying why not (no model yet, an
        answer in progress, a port in use, no key for a public host). ``services``: the
        App's, whose turn for model work the answers share."""
        if self.running:
            raise HybridMoeError(f"the API server is running already, at {self.url}", "Stop it first.")
        loaded = self._models.loaded
        if loaded is None:
            raise HybridMoeError("no model is loaded yet",
                                 "Open the chat (F2), let the model load, then start the server.")
        busy = self._models.busy()
        if busy:
            # An answer's worker holds the plain session: wrapping it now would let a request run beside it.
            raise HybridMoeError(busy, "Then start the server.")
        check_exposure(host, api_key, how_to_set_key="Enter an API key")
        from hybridmoe.app.server.http import ServerOptions  # here: the HTTP layer's imports are slow

        # The answers share the process's turn for model work: they run beside each other,
        # never beside a benchmark or a bandwidth measurement.
        shared = self._models.share(
            hold=lambda cancel: services.model_turn("an answer", cancel=cancel, shared=True))
        server = ApiServer(shared, ServerOptions(model_id=loaded.name or "model", api_key=api_key), host, port)
        try:
            server.start()
        except BaseException:
            self._models.unshare(shared)
            raise
        self.server, self._shared = server, shared

    def stop(self) -> None:
        if self.server is None:
            return
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        self.server.stop()
        self._models.unshare(self._shared)
        self.server = self._shared = None

    def model_gone(self) -> bool:
        """The model this server serves was replaced or closed."""
        return self.server is not None and (self._shared.closed or self._models.session is not self._shared)

    def counts(self) -> QueueCounts | None:
        return self._shared.counts() if self._shared is not None else None

    @property
    def parallel(self) -> int:
        """How many requests are answered at once."""
        return self._shared.parallel if self._shared is not None else 0

    def recent(self, n: int) -> list[Finished]:
        return self.server.activity.recent(n) if self.server is not None else []

    @property
    def in_progress(self) -> int:
        return self.server.activity.in_progress if self.server is not None else 0
