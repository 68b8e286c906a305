"""The top line of every screen: the app's name and the screens, each with its key; the
current one highlighted, each one clickable."""

from __future__ import annotations

from textual.widgets import Static

SCREENS = (("chat", "F2", "Chat"), ("models", "F3", "Models"), ("plan", "F4", "Plan"),
           ("hardware", "F5", "Hardware"), ("setup", "F6", "Setup"))


def nav_markup(current: str) -> str:
    items = []
    for mode, key, name in SCREENS:
        label = f"[reverse bold] {name} [/]" if mode == current else f" {name} "
        items.append(f"[$text-muted]{key}[/][@click=app.switch_mode('{mode}')]{label}[/]")
    return "[bold $accent]hybridmoe[/]   " + " ".join(items)


class NavBar(Static):
    DEFAULT_CSS = """
    NavBar { dock: top; height: 1; background: $panel; padding: 0 1; }
    """

    def __init__(self, current: str):
        super().__init__(nav_markup(current))
