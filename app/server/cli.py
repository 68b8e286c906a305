"""`hybridmoe serve`: the loaded model behind an OpenAI-compatible API until Ctrl-C.

The address is checked and the port bound before the model loads (minutes, for a large one),
so a port in use or a public address without an API key fails at once. Loading shows the same
progress as `hybridmoe run`; then one line per request goes to stderr. It answers up to
``--parallel`` requests at once: by default as many as the plan's KV cache holds conversations
(a plan made here is made for ``--parallel`` of them). Ctrl-C (or SIGTERM)
cancels the generations in progress, lets their responses end, and exits 0: stopping is the
normal end of a server, not a failure. A second Ctrl-C exits at once (130).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from hybridmoe.app.arguments import non_negative_int, positive_int
from hybridmoe.app.server.runner import DEFAULT_HOST, DEFAULT_PORT
from hybridmoe.backend.errors import UsageError

API_KEY_VARIABLE = "HYBRIDMOE_API_KEY"


def model_id(model_argument: str, path: Path) -> str:
    """The name clients see: a catalogue name as given, else the file or directory name."""
    if not Path(model_argument).expanduser().exists():
        return model_argument
    return path.name.removesuffix(".gguf")


def cmd_serve(args) -> int:
    from hybridmoe.app.headless import _BackendChoice, _StderrProgress, load_plan, user_chat_template
    from hybridmoe.app.server.runner import bind_socket, check_exposure
    from hybridmoe.backend.hub.catalogue import runnable_path
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.session import CancelToken

    api_key = args.api_key or os.environ.get(API_KEY_VARIABLE) or None
    check_exposure(args.host, api_key, how_to_set_key=f"Pass --api-key KEY or set {API_KEY_VARIABLE}")
    path = runnable_path(args.model)  # a path, a name `hybridmoe models` lists, a catalogue name on disk
    model = inspect_model(path)
    plan = load_plan(args, model, users=args.parallel or 1)
    check_parallel(args.parallel, plan, args.model, args.backend)
    chat_template = user_chat_template(args.chat_template)
    sock = bind_socket(args.host, args.port)
    try:
        return _load_and_serve(args, model, model_id(args.model, Path(path)), plan, api_key, sock,
                               _StderrProgress(sys.stderr.isatty()), _BackendChoice(args), CancelToken(), chat_template)
    finally:
        sock.close()  # closed by the server once it runs; here when loading failed


def _load_and_serve(args, model, name, plan, api_key, sock, progress, backend_choice, cancel, chat_template) -> int:
    from hybridmoe.app.server.http import ServerOptions
    from hybridmoe.app.server.runner import ApiServer
    from hybridmoe.app.server.shared_session import SharedSession
    from hybridmoe.backend.backends import load_session

    stop = threading.Event()

    def on_signal(signum, frame):
        if stop.is_set() or cancel.cancelled:  # the second one: stop now
            raise KeyboardInterrupt
        cancel.cancel()  # a load in progress stops
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        session = load_session(args.backend, model, plan, progress, cancel, on_fallback=backend_choice.fell_back,
                               on_choice=backend_choice.chosen, chat_template=chat_template)  # None: the model's own
        progress.done()
        backend_choice.warn_slow_path(plan)
        try:
            check_parallel_of_session(args.parallel, session)
        except UsageError:
            session.close()
            raise
        shared = SharedSession(session, parallel=args.parallel)
        options = ServerOptions(model_id=name, api_key=api_key, max_queue=args.max_queue,
                                max_tokens_limit=args.max_tokens_limit)
        server = ApiServer(shared, options, args.host, args.port, sock=sock,
                           on_finished=lambda record: print(record.line(), file=sys.stderr, flush=True))
        try:
            server.start()
            key_note = "; clients must send 'Authorization: Bearer <key>'" if api_key else ""
            print(f"Serving {name} at {server.url}/v1 (OpenAI API), {_at_once(shared.parallel)}{key_note}. "
                  "Ctrl-C stops.",
                  file=sys.stderr, flush=True)
            while not stop.wait(0.5):
                if not server.running:  # the server thread died: a bug, reported as such
                    raise RuntimeError("the API server stopped unexpectedly")
            print("hybridmoe: stopping the server ...", file=sys.stderr, flush=True)
        finally:
            server.stop()
            shared.close()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"hybridmoe: server stopped after {server.activity.finished_count} requests", file=sys.stderr)
    return 0


def check_parallel(parallel: int | None, plan, model_argument: str, backend: str) -> None:
    """--parallel against what the plan (and a backend asked for) can serve, before loading."""
    if parallel is None:
        return
    users = plan.workload.users
    if parallel > users:
        raise UsageError(
            f"the plan's KV cache holds {_conversations(users)}; --parallel {parallel} needs a plan for {parallel}",
            f"Make one with `hybridmoe plan {model_argument} --users {parallel} --context {plan.workload.context} "
            f"--save FILE` and serve it with --plan FILE, or ask for --parallel {users} or fewer.")
    if parallel > 1 and backend == "llamacpp":
        raise _backend_limit("llama.cpp", 1, parallel)


def check_parallel_of_session(parallel: int | None, session) -> None:
    """--parallel against what the loaded session runs at once: llama.cpp, which `auto`
    falls back to for a model the engine cannot serve, runs one generation at a time."""
    most = session.max_parallel
    if parallel is not None and parallel > most:
        backend = "llama.cpp, which serves this model," if session.backend == "llamacpp" else "the loaded model"
        raise _backend_limit(backend, most, parallel)


def _backend_limit(backend: str, most: int, parallel: int) -> UsageError:
    return UsageError(f"{backend} answers {_at_once(most)} here; --parallel {parallel} needs the embedded engine",
                      "Leave out --parallel (requests then wait their turn), or serve with --backend engine.")


def _conversations(n: int) -> str:
    return "1 conversation" if n == 1 else f"{n} conversations"


def _at_once(n: int) -> str:
    return "one request at a time" if n == 1 else f"up to {n} requests at once"


def _port(text: str) -> int:
    port = non_negative_int(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0 to 65535)")
    return port


def add_parser(sub) -> None:
    from hybridmoe.app.headless import CHAT_TEMPLATE_HELP, DEFAULT_CONTEXT
    from hybridmoe.backend.plan.workload import BACKENDS

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (Ctrl-C stops)")
    p.add_argument("-m", "--model", required=True,
                   help="a model directory, a .gguf file, or a local model's name as `hybridmoe models` lists it")
    p.add_argument("--plan", help="a saved plan (hybridmoe plan --save FILE); default: plan for this machine now")
    p.add_argument("--context", type=positive_int,
                   help=f"context length when no --plan is given (default {DEFAULT_CONTEXT}, or the model's maximum "
                        "when that is less)")
    p.add_argument("--backend", choices=list(BACKENDS), default="auto",
                   help="auto (default): the embedded engine, or llama.cpp when the engine cannot serve the model")
    p.add_argument("--chat-template", metavar="FILE", help=CHAT_TEMPLATE_HELP)
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default {DEFAULT_HOST}: this machine only); "
                   "any other needs an API key")
    p.add_argument("--port", type=_port, default=DEFAULT_PORT,
                   help=f"TCP port (default {DEFAULT_PORT}; 0: any free port)")
    p.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_VARIABLE}, "
                   "which other users cannot see in the process list)")
    p.add_argument("--parallel", type=positive_int, metavar="N",
                   help="requests answered at once (default: as many conversations as the plan's KV cache holds; "
                   "without --plan, the plan made now holds N)")
    p.add_argument("--max-queue", type=non_negative_int, default=8,
                   help="requests that may wait while others are answered; more are refused with 429 (default 8)")
    p.add_argument("--max-tokens-limit", type=positive_int, default=4096,
                   help="the most tokens a request may ask for, and what it gets when it asks for none "
                   "(default 4096)")
    p.set_defaults(func=cmd_serve)
