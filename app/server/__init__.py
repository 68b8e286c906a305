"""The OpenAI-compatible API server (`hybridmoe serve`, and F7 in the TUI).

    shared_session  one loaded session, many users: a fair bounded queue of turns
    openai_api      the wire format: request bodies in, responses and stream chunks out
    http            the Starlette application: endpoints, API key, streaming, disconnects
    activity        the requests in progress and the last ones finished
    runner          uvicorn on a socket in a background thread; address checks
    cli             the `serve` subcommand
"""
