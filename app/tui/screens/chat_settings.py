"""The chat's settings: the system prompt, sampling (checked by SamplingParams itself),
what a conversation longer than the context does, and whether the chat records which
experts the model uses, for re-planning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Static, TextArea

from hybridmoe.backend.errors import HybridMoeError

# (field, label, Input type); empty max_tokens / seed mean "until the model stops" / "random".
FIELDS = (
    ("temperature", "Temperature (0 = greedy)", "number"),
    ("top_p", "Top-p (1 = off)", "number"),
    ("top_k", "Top-k (0 = off)", "integer"),
    ("min_p", "Min-p (0 = off)", "number"),
    ("repetition_penalty", "Repetition penalty (1 = off)", "number"),
    ("max_tokens", "Max tokens (empty: until it stops)", "integer"),
    ("seed", "Seed (empty: random)", "integer"),
)
INTEGER_FIELDS = {name for name, _, kind in FIELDS if kind == "integer"}

# What recording usage means, where the switch is: it must be clear that no text is kept.
RECORD_USAGE_HELP = (
    "Counts only: how often the model chose each of its experts, added up per model. No prompt, "
    "answer or other text is kept. The Plan screen (F4, Ctrl+R) uses the counts to put the experts "
    "you use most on the GPU. Embedded engine only (llama.cpp does not report its experts)."
)


@dataclass(frozen=True)
class ChatSettings:
    system_prompt: str
    sampling: dict[str, Any]
    record_usage: bool
    drop_oldest_turns: bool = True


def sampling_params(values: dict[str, Any]):
    """hybridmoe.backend.text.sampling.SamplingParams from stored settings; raises UsageError for
    values it refuses. Imported here, not at the top: the module imports torch (seconds),
    which the app loads with the model, not at start."""
    from hybridmoe.backend.text.sampling import SamplingParams

    known = {name for name, _, _ in FIELDS}
    return SamplingParams(**{k: v for k, v in values.items() if k in known and v is not None})


class ChatSettingsScreen(ModalScreen[ChatSettings | None]):
    """Dismisses with the new ChatSettings, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, system_prompt: str, sampling: dict[str, Any], record_usage: bool = False,
                 drop_oldest_turns: bool = True):
        super().__init__(classes="dialog")
        self.system_prompt = system_prompt
        self.sampling = sampling
        self.record_usage = record_usage
        self.drop_oldest_turns = drop_oldest_turns

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box wide"):
            yield Label("Chat settings", classes="dialog-title")
            # The fields scroll, the buttons stay: at 80x24 the whole form is taller than the screen.
            with VerticalScroll(id="settings-body"):
                yield Label("System prompt (this conversation and new ones)")
                yield TextArea(self.system_prompt, id="system-prompt", soft_wrap=True, compact=True)
                with Grid(id="sampling-grid"):
                    for name, label, kind in FIELDS:
                        value = self.sampling.get(name)
                        yield Label(label)
                        yield Input("" if value is None else str(value), type=kind, id=f"sampling-{name}",
                                    compact=True)
                yield Checkbox("When the conversation is full, leave out its oldest turns (the system prompt "
                               "stays)", self.drop_oldest_turns, id="drop-oldest", compact=True)
                yield Checkbox("Record which experts the model uses (for re-planning)", self.record_usage,
                               id="record-usage", compact=True)
                yield Static(RECORD_USAGE_HELP, id="record-usage-help")
            yield Static("", id="settings-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", variant="primary", id="save", compact=True)
                yield Button("Cancel", id="cancel", compact=True)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_save(self) -> None:
        values: dict[str, Any] = {}
        for name, _, _ in FIELDS:
            text = self.query_one(f"#sampling-{name}", Input).value.strip()
            if not text:
                values[name] = None
                continue
            try:
                values[name] = int(text) if name in INTEGER_FIELDS else float(text)
            except ValueError:
                self._refuse(f"{name.replace('_', ' ')}: {text!r} is not a number")
                return
        for required in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if values[required] is None:
                self._refuse(f"{required.replace('_', ' ')} needs a value")
                return
        try:
            sampling_params(values)
        except HybridMoeError as error:
            self._refuse(error.what)
            return
        self.dismiss(ChatSettings(self.query_one("#system-prompt", TextArea).text, values,
                                  self.query_one("#record-usage", Checkbox).value,
                                  self.query_one("#drop-oldest", Checkbox).value))

    def _refuse(self, message: str) -> None:
        self.query_one("#settings-error", Static).update(message)
