"""The chat's loaded model behind the OpenAI API, started and stopped from the TUI (F7).

While the server runs, the chat's session is a ``SharedSession`` around the model the chat
loaded, and the server answers from the same one, as many at once as the model serves (the
conversations its plan holds): a chat message sent while requests are answered runs beside
them when there is a place, else waits its turn like any request.
Stopping the server gives the chat its plain session back. When the chat loads another model
(or unloads this one), the server stops, since what it served is gone.
"""

from __future__ import annotations

from hybridmoe.app.server.activity import Finished
from hybridmoe.app.server.runner import ApiServer, check_exposure
from hybridmoe.app.server.shared_session import QueueCounts, SharedSession
from hybridmoe.backend.errors import HybridMoeError


class ChatModelServer:
    def __init__(self):
        self.server: ApiServer | None = None
        self._chat = None  # the ChatScreen whose model is served
        self._shared: SharedSession | None = None
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

    def start(self, chat, host: str, port: int, api_key: str | None) -> None:
        """Serve the model ``chat`` (the ChatScreen) has loaded; raises a HybridMoeError saying
        why not (no model yet, an answer in progress, a port in use, no key for a public host)."""
        if self.running:
            raise HybridMoeError(f"the API server is running already, at {self.url}", "Stop it first.")
        if chat is None or chat.session is None:
            raise HybridMoeError("no model is loaded yet",
                                 "Open the chat (F2), let the model load, then start the server.")
        if chat.generating:
            # Its worker holds the plain session: wrapping it now would let a request run beside it.
            raise HybridMoeError("the chat is answering",
                                 "Wait for the answer (or stop it with Esc), then start the server.")
        check_exposure(host, api_key, how_to_set_key="Enter an API key")
        from hybridmoe.app.server.http import ServerOptions  # here: the HTTP layer's imports are slow

        services = chat.app.services
        # The answers share the process's turn for model work: they run beside each other,
        # never beside a benchmark or a bandwidth measurement.
        shared = chat.session if isinstance(chat.session, SharedSession) else SharedSession(
            chat.session, hold=lambda cancel: services.model_turn("an answer", cancel=cancel, shared=True))
        server = ApiServer(shared, ServerOptions(model_id=chat.model_name or "model", api_key=api_key), host, port)
        server.start()
        chat.session = shared
        self.server, self._chat, self._shared = server, chat, shared

    def stop(self) -> None:
        if self.server is None:
            return
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        self.server.stop()
        if self._chat is not None and self._chat.session is self._shared and not self._shared.closed:
            self._chat.session = self._shared.session
        self.server = self._chat = self._shared = None

    def model_gone(self) -> bool:
        """The chat has replaced or closed the model this server serves."""
        return self.server is not None and (self._shared.closed or self._chat.session is not self._shared)

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
