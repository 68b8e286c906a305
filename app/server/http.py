"""The OpenAI-compatible HTTP API over one shared session (a Starlette application).

    GET  /health                 liveness, and the queue's counts (no API key needed)
    GET  /v1/models              the one model this server runs
    POST /v1/chat/completions    chat, streamed (server-sent events) or whole
    POST /v1/completions         raw text continuation, streamed or whole

Each generation runs in a thread of its own (``_Generation``): it waits its turn in the
``SharedSession``'s queue, then hands every event to the event loop. The request side answers
from those events and watches the connection: a client that goes away (while waiting, during
the prompt, or mid-stream) sets the generation's cancel token, which the engine checks at
every token, and its place in the queue is given up.

Every failure is answered in the OpenAI error shape; nothing a client sends raises out of here.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hybridmoe.app.server.activity import Activity, Finished
from hybridmoe.app.server.openai_api import (
    ApiError,
    ChatFormat,
    CompletionFormat,
    GenerationRequest,
    chat_request,
    completion_request,
    error_body,
    parse_body,
)
from hybridmoe.app.server.shared_session import QueueFull, SharedSession
from hybridmoe.backend.errors import DamagedModelError, HybridMoeError
from hybridmoe.backend.session import Cancelled, CancelToken, Done, Event, Session

log = logging.getLogger("hybridmoe.server")


@dataclass(frozen=True)
class ServerOptions:
    model_id: str  # the name /v1/models gives and responses carry
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    max_queue: int = 8  # requests that may wait behind the running ones; more get 429
    max_tokens_limit: int = 4096  # the most a request may ask for, and what it gets when it does not say
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413


# How a generation is started on the session whose turn it is.
Produce = Callable[[Session, CancelToken], Iterator[Event]]


def create_app(shared: SharedSession, options: ServerOptions, activity: Activity) -> Starlette:
    api = _Api(shared, options, activity)
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.guarded(api.models), methods=["GET"]),
        Route("/v1/models/{model:path}", api.guarded(api.model), methods=["GET"]),
        Route("/v1/chat/completions", api.guarded(api.chat_completions), methods=["POST"]),
        Route("/v1/completions", api.guarded(api.completions), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    """Unknown paths and wrong methods, in the OpenAI shape."""
    messages = {404: f"no such endpoint: {request.url.path}",
                405: f"{request.method} is not allowed on {request.url.path}"}
    return _error(ApiError(exc.status_code, messages.get(exc.status_code, str(exc.detail)),
                           headers=dict(exc.headers or {})))


class _Api:
    def __init__(self, shared: SharedSession, options: ServerOptions, activity: Activity):
        self.shared = shared
        self.options = options
        self.activity = activity
        self.created = int(time.time())

    def guarded(self, endpoint):
        """The API key check, and every failure turned into an error response."""

        async def answer(request: Request) -> Response:
            # Generation requests are recorded, refused ones too; listing the models is not.
            record = _Record(self.activity, request.url.path) if request.method == "POST" else None
            request.state.record = record
            try:
                self._check_key(request)
                return await endpoint(request)
            except ApiError as error:
                if record is not None:
                    record.answered(error.status, error.message)
                return _error(error)
            except HybridMoeError as error:  # the model failed while answering (llama.cpp, say)
                log.warning("%s %s failed: %s", request.method, request.url.path, error)
                if record is not None:
                    record.answered(500, _said(error))
                return _error(ApiError(500, _said(error), kind="server_error"))
            except Exception:  # a bug: the client gets a 500, the log the traceback
                log.exception("internal error answering %s %s", request.method, request.url.path)
                if record is not None:
                    record.answered(500, "internal error")
                return _error(ApiError(500, "internal server error; see the server's log", kind="server_error"))

        return answer

    def _check_key(self, request: Request) -> None:
        key = self.options.api_key
        if not key:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise ApiError(401, "this server needs an API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    # ---- endpoints ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        counts = self.shared.counts()
        status = "unloaded" if self.shared.closed else "ok"
        return JSONResponse({"status": status, "model": self.options.model_id, "waiting": counts.waiting,
                             "running": counts.running, "completed": counts.completed},
                            status_code=503 if self.shared.closed else 200)

    def _model_object(self) -> dict:
        return {"id": self.options.model_id, "object": "model", "created": self.created, "owned_by": "hybridmoe"}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_object()]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model"] != self.options.model_id:
            raise ApiError(404, f"the model {request.path_params['model']!r} does not exist; this server runs "
                                f"{self.options.model_id!r}", param="model", code="model_not_found")
        return JSONResponse(self._model_object())

    async def chat_completions(self, request: Request) -> Response:
        parsed = chat_request(await self._read_json(request), self.options.max_tokens_limit)
        return await self._generate(
            request, parsed, ChatFormat(self.options.model_id),
            lambda session, cancel: session.generate(parsed.messages, parsed.sampling, cancel))

    async def completions(self, request: Request) -> Response:
        parsed = completion_request(await self._read_json(request), self.options.max_tokens_limit)
        return await self._generate(
            request, parsed, CompletionFormat(self.options.model_id),
            lambda session, cancel: session.complete(parsed.prompt, parsed.sampling, cancel))

    async def _read_json(self, request: Request) -> dict:
        limit = self.options.max_body_bytes
        too_large = ApiError(413, f"the request body is larger than this server's limit of {limit:,} bytes",
                             code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large  # refused before reading it
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:  # the body ended before its Content-Length: the client has gone
            announced = f" of {int(declared):,}" if declared.isdigit() else ""
            # Answered (to nobody, most likely) and recorded like any bad request: not an internal error.
            raise ApiError(400, f"the request body ended after {size:,}{announced} bytes: the client closed the "
                                "connection", code="incomplete_body")
        return parse_body(b"".join(chunks))

    # ---- generating ----------------------------------------------------------------------------

    async def _generate(self, request: Request, parsed: GenerationRequest, fmt, produce: Produce) -> Response:
        record: _Record = request.state.record
        cancel = CancelToken()
        record.track(cancel)
        generation = _Generation(self.shared, produce, self.options.max_queue, cancel, record.generation_ended)
        gone = asyncio.create_task(_client_gone(request))
        streaming = False
        try:
            # The first event comes after the wait in the queue and the prompt: errors up to
            # here still get a status of their own.
            try:
                first = await _unless_gone(generation.next(), gone)
            except QueueFull as full:
                raise ApiError(429, f"{full.what}; try again in {full.retry_after_s} s", kind="rate_limit_error",
                               code="rate_limit_exceeded", headers={"Retry-After": str(full.retry_after_s)})
            except Cancelled:  # not by this client, who is still there: the server stops
                raise ApiError(503, "the server is stopping", kind="server_error")
            except DamagedModelError as error:  # the model's fault, not the request's
                raise ApiError(500, _said(error), kind="server_error")
            except HybridMoeError as error:  # about this request: its prompt, or the model gone
                if self.shared.closed:
                    raise ApiError(503, "the model was unloaded; the server is stopping", kind="server_error")
                raise ApiError(400, _said(error))
            if parsed.stream:
                gone.cancel()  # from here on the streaming response notices a departure itself
                streaming = True
                return StreamingResponse(self._events(generation, first, fmt, parsed, record),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            event = first
            while not isinstance(event, Done):
                event = await _unless_gone(generation.next(), gone)
            if event.reason == "cancelled":  # not by this client, who is still there: the server stops
                raise ApiError(503, "the server is stopping", kind="server_error")
            record.answered(200, event.reason)
            return JSONResponse(fmt.response(event))
        except _ClientGone:
            record.answered(200, "cancelled")
            return Response(status_code=204)  # nobody reads it
        finally:
            if not streaming:
                gone.cancel()
                generation.cancel.cancel()  # stops a generation nobody will read; no-op when it has ended

    async def _events(self, generation: _Generation, event: Event, fmt, parsed: GenerationRequest,
                      record: _Record) -> AsyncIterator[str]:
        """The server-sent events of a streamed answer, from its first event on."""
        try:
            opening = fmt.opening_chunk()
            if opening is not None:
                yield _sse(opening)
            while not isinstance(event, Done):
                if event.text:
                    yield _sse(fmt.text_chunk(event.text))
                event = await generation.next()
            if event.reason == "cancelled":  # the client is still reading: the server is stopping
                record.answered(200, "cancelled")
                yield _sse(error_body("the server is stopping", "server_error"))
                return
            yield _sse(fmt.closing_chunk(event))
            if parsed.include_usage:
                yield _sse(fmt.usage_chunk(event.stats))
            yield "data: [DONE]\n\n"
            record.answered(200, event.reason)
        except Exception as error:  # the status line went out already: say it in the stream
            log.exception("generation failed mid-stream")
            message = _said(error) if isinstance(error, HybridMoeError) else "internal server error; see the log"
            record.answered(200, f"failed: {message}")
            yield _sse(error_body(message, "server_error"))
        finally:
            # A departed client lands here (the response's task is cancelled): stop the engine.
            generation.cancel.cancel()
            record.answered(200, "cancelled")


class _Record:
    """Reports one request to the Activity once, when both its answer is decided and its
    generation (if it got one) has ended: a request whose client left is reported with the
    tokens generated until the engine noticed."""

    def __init__(self, activity: Activity, endpoint: str):
        self.activity, self.endpoint = activity, endpoint
        self.cancel: CancelToken | None = None
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._answer: tuple[int, str] | None = None
        self._generating = False
        self._done: Done | None = None

    def track(self, cancel: CancelToken) -> None:
        """The request's generation starts: it is cancelled if the server stops."""
        self.cancel = cancel
        self._generating = True
        self.activity.begin(cancel)

    def answered(self, status: int, reason: str) -> None:
        """How the request was answered (the first call counts)."""
        with self._lock:
            if self._answer is not None:
                return
            self._answer = (status, reason)
            complete = not self._generating
        if complete:
            self._report()

    def generation_ended(self, done: Done | None) -> None:
        """Called from the generation's thread, with its last event (None: it never started)."""
        with self._lock:
            self._done, self._generating = done, False
            complete = self._answer is not None
        if complete:
            self._report()

    def _report(self) -> None:
        status, reason = self._answer
        stats = self._done.stats if self._done is not None else None
        self.activity.end(self.cancel, Finished(
            self.endpoint, status, reason,
            stats.prompt_tokens if stats else 0, stats.generated_tokens if stats else 0,
            time.monotonic() - self.started))


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class _Generation:
    """One generation in a thread of its own, its events handed over to the event loop."""

    def __init__(self, shared: SharedSession, produce: Produce, max_waiting: int, cancel: CancelToken,
                 on_end: Callable[[Done | None], None]):
        self.cancel = cancel
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        # A thread per generation rather than the loop's executor: queued generations wait in
        # their threads, and the queue's bound (plus the running ones) bounds them.
        threading.Thread(target=self._run, args=(shared, produce, max_waiting, on_end), daemon=True,
                         name="hybridmoe-api-generation").start()

    def _run(self, shared: SharedSession, produce: Produce, max_waiting: int,
             on_end: Callable[[Done | None], None]) -> None:
        done = None
        try:
            with shared.turn(self.cancel, max_waiting=max_waiting) as session:
                events = produce(session, self.cancel)
                try:
                    for event in events:
                        done = event if isinstance(event, Done) else None
                        self._hand_over(event)
                finally:
                    events.close()
        except BaseException as error:  # noqa: BLE001 - the request answers it
            self._hand_over(_Failed(error))
        finally:
            on_end(done)

    def _hand_over(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the event loop has closed: the server stopped, nobody reads on
            self.cancel.cancel()

    async def next(self) -> Event:
        item = await self._events.get()
        if isinstance(item, _Failed):
            raise item.error
        return item


class _ClientGone(Exception):
    pass


async def _client_gone(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_gone(awaitable, gone: asyncio.Task):
    """The result of ``awaitable``, or ``_ClientGone`` when the client leaves first."""
    task = asyncio.ensure_future(awaitable)
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    raise _ClientGone


def _said(error: HybridMoeError) -> str:
    """The error's message on one line: what, then what to do."""
    return f"{error.what}. {error.hint}" if error.hint else error.what


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
