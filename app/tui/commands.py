"""The command palette's entries: every action bound to a key on the current screen, with
its key, plus the screens to go to. Built from the live bindings, so the palette and the
footer can never disagree about what exists.
"""

from __future__ import annotations

from functools import partial

from textual.app import App
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.screen import Screen


class ActionsProvider(Provider):
    def _commands(self) -> list[tuple[str, str, object]]:
        """(name, help, callback) for the bindings active on the screen the palette came from."""
        commands = []
        seen: set[str] = set()
        for active in self.screen.active_bindings.values():
            binding = active.binding
            # The App's and the screens' actions, and what a focused widget shows in the
            # footer; not a widget's own editing keys (a text field's cursor moves).
            ours = isinstance(active.node, (App, Screen))
            if not (ours or binding.show) or not binding.description or not active.enabled:
                continue
            if binding.action in seen or binding.action.startswith("command_palette"):
                continue
            seen.add(binding.action)
            name = binding.tooltip or binding.description
            commands.append((name, f"{self.app.get_key_display(binding)}  ·  {binding.description}",
                             partial(self.app.run_action, binding.action, active.node)))
        return commands

    async def discover(self) -> Hits:
        for name, help_text, callback in self._commands():
            yield DiscoveryHit(name, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, help_text, callback in self._commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), callback, text=name, help=help_text)
