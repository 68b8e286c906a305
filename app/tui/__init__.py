"""The Textual terminal UI: `hybridmoe` with no arguments. See app/tui/app.py."""


def run() -> int:
    from hybridmoe.app.tui.app import run as run_app

    return run_app()
