"""The API server on a socket: uvicorn in a background thread, started and stopped the same
way by `hybridmoe serve`, the TUI and the tests.

The socket is bound here rather than by uvicorn, so that a port in use or a wrong address
is a clear error at once (uvicorn would log it and exit the process), and so that the CLI
can bind before the minutes a large model takes to load. Uvicorn's own signal handling is
not used (it only works on the main thread and re-raises the signal after shutdown):
whoever owns the server calls ``stop``.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hybridmoe.app.server.activity import Activity, Finished
from hybridmoe.app.server.shared_session import SharedSession
from hybridmoe.backend.errors import HybridMoeError, UsageError

if TYPE_CHECKING:  # the HTTP layer imports starlette and torch: loaded when a server starts
    from hybridmoe.app.server.http import ServerOptions

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# How long stopping waits for open responses to end once their generations are cancelled.
_GRACEFUL_S = 5


def is_loopback(host: str) -> bool:
    """True when only this machine can reach ``host`` (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to an address others reach
        return False


# One label of a host name (RFC 1123, with the underscores some machine names have): letters,
# digits and inner hyphens, at most 63.
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def check_host(host: str) -> None:
    """``host`` is an IP address or a host name this machine can resolve; a UsageError saying
    which it is not, before anything else is said about it."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    # The last label is never all digits (RFC 3696): "300.1.2.3" is a mistyped address, not a name.
    if (not host or len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels)
            or labels[-1].isdigit()):
        raise UsageError(f"not an IP address or host name: {host!r}",
                         f"Use an address of this machine, such as {DEFAULT_HOST} (this machine only) or 0.0.0.0 "
                         "(every network), or its host name.")
    _address_info(host, None)


def _address_info(host: str, port: int | None) -> tuple:
    """(family, type, proto, canonname, address) of the first address to listen on."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        where = host if port is None else f"{host}:{port}"
        raise UsageError(f"cannot listen on {where}: the host is unknown ({error.strerror})",
                         f"Use an address of this machine, such as {DEFAULT_HOST} or 0.0.0.0.")


def check_exposure(host: str, api_key: str | None, *, how_to_set_key: str) -> None:
    """Other machines may only reach the server with an API key. ``how_to_set_key`` says it
    in the caller's terms (a command-line option, a field of a form). A host that is no
    address at all is refused as such first."""
    check_host(host)
    if not is_loopback(host) and not api_key:
        raise UsageError(
            f"the host {host} lets other machines reach the server, but no API key is set",
            f"{how_to_set_key} (clients then send 'Authorization: Bearer KEY'), or listen on {DEFAULT_HOST} only.",
        )


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (port 0: any free port)."""
    where = f"{host}:{port}"
    family, kind, proto, _, address = _address_info(host, port)
    sock = socket.socket(family, kind, proto)
    try:
        # A server restarted at once may bind again while the old connections linger.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise HybridMoeError(f"cannot listen on {where}: the port is in use",
                                 "Stop the program using it, or choose another port with --port.")
        if error.errno == errno.EACCES:
            raise HybridMoeError(f"cannot listen on {where}: permission denied",
                                 f"Ports below 1024 need administrator rights; use --port {DEFAULT_PORT}.")
        if error.errno == errno.EADDRNOTAVAIL:
            raise UsageError(f"cannot listen on {where}: the address is not one of this machine's",
                             f"Use an address of this machine, such as {DEFAULT_HOST} or 0.0.0.0.")
        raise HybridMoeError(f"cannot listen on {where}: {error.strerror}")
    return sock


class ApiServer:
    """The OpenAI-compatible API for ``shared``, served from a background thread."""

    def __init__(self, shared: SharedSession, options: ServerOptions, host: str = DEFAULT_HOST,
                 port: int = DEFAULT_PORT, *, on_finished: Callable[[Finished], None] | None = None,
                 sock: socket.socket | None = None):
        self.shared = shared
        self.options = options
        self.host = host
        self.activity = Activity(on_finished)
        self._sock = sock
        self.port = sock.getsockname()[1] if sock is not None else port
        self._server = None
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    @property
    def url(self) -> str:
        """The base URL clients use (OpenAI clients add /v1)."""
        host = DEFAULT_HOST if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 10.0) -> None:
        import uvicorn

        from hybridmoe.app.server.http import create_app

        if self._sock is None:
            self._sock = bind_socket(self.host, self.port)
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(
            create_app(self.shared, self.options, self.activity),
            lifespan="off",
            log_config=None,  # no logging setup of uvicorn's: the TUI owns the terminal
            log_level="warning",
            access_log=False,  # the Activity records requests
            timeout_graceful_shutdown=_GRACEFUL_S,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, args=(self._server, self._sock), daemon=True,
                                        name="hybridmoe-api-server")
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise HybridMoeError(f"the API server did not start on {self.host}:{self.port}: {self._failure}")
            time.sleep(0.01)

    def _serve(self, server, sock: socket.socket) -> None:
        try:
            asyncio.run(server.serve(sockets=[sock]))
        except BaseException as error:  # noqa: BLE001 - reported by start() or seen as not running
            self._failure = error
        finally:
            sock.close()

    def stop(self, timeout: float = _GRACEFUL_S + 5) -> None:
        """Cancel the generations in progress, finish their responses, close the socket."""
        self.activity.cancel_all()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True
                self._thread.join(2)
        elif self._sock is not None:
            self._sock.close()
