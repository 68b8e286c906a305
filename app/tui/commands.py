"""The command palette's entries: every action bound to a key on the current screen, with
its key, plus the screens to go to. Built from the live bindings, so the palette and the
footer can never disagree about what exists. The app's own come first (the screen's, then the
App's), Textual's generic ones (focus, theme, screenshot, quit) after them.
"""

from __future__ import annotations

from functools import partial

from textual.app import App
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.screen import Screen


# The actions Textual's App and Screen bind by themselves (focus moves, quit, ...).
_TEXTUALS = frozenset(b.action if isinstance(b, Binding) else b[1] for b in (*App.BINDINGS, *Screen.BINDINGS))


class ActionsProvider(Provider):
    def _commands(self) -> list[tuple[str, str, object]]:
        """(name, help, callback): the bindings active on the screen the palette came from
        (the screen's, then the App's), the App's system commands (its own, then Textual's),
        then what Textual binds everywhere; each once."""
        ours, textuals, seen = [], [], set()
        for active in sorted(self.screen.active_bindings.values(), key=lambda a: not isinstance(a.node, Screen)):
            binding = active.binding
            # The App's and the screens' actions, and what a focused widget shows in the
            # footer; not a widget's own editing keys (a text field's cursor moves).
            on_app_or_screen = isinstance(active.node, (App, Screen))
            if not (on_app_or_screen or binding.show) or not binding.description or not active.enabled:
                continue
            if binding.action in seen or binding.action.startswith("command_palette"):
                continue
            seen.add(binding.action)
            name = binding.tooltip or binding.description
            (textuals if binding.action in _TEXTUALS else ours).append(
                (name, f"{self.app.get_key_display(binding)}  ·  {binding.description}",
                 partial(self.app.run_action, binding.action, active.node)))
        system = [(name, help_text, callback)
                  for name, help_text, callback, discover in self.app.get_system_commands(self.screen)
                  if discover and not (name == "Quit" and "quit" in seen)]
        return ours + system + textuals

    async def discover(self) -> Hits:
        for name, help_text, callback in self._commands():
            yield DiscoveryHit(name, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, help_text, callback in self._commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), callback, text=name, help=help_text)
