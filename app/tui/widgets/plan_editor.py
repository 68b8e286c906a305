"""The workload a plan is made for, editable, with the plan redrawn on every change.

``plan.make`` takes milliseconds, so it runs on the UI thread at each keystroke and the
numbers follow the typing; input it refuses (a context longer than the model's, a blank
field) is shown next to the fields while the last good plan stays on screen.
"""

from __future__ import annotations

from dataclasses import replace

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Input, Label, Select, Static

from hybridmoe.app.tui.widgets.plan_view import PlanView
from hybridmoe.backend.errors import HybridMoeError
from hybridmoe.backend.hardware.profile import HardwareProfile
from hybridmoe.backend.plan import Plan, Workload
from hybridmoe.backend.plan.workload import BACKENDS, KV_BYTES_PER_ELEMENT, STRATEGIES


class PlanEditor(Widget):
    DEFAULT_CSS = """
    PlanEditor { height: auto; }
    """

    class Changed(Message):
        """A new plan was made (``plan``), or the input was refused (``error``)."""

        def __init__(self, plan: Plan | None, error: str = ""):
            super().__init__()
            self.plan, self.error = plan, error

    def __init__(self, services, model, hardware: HardwareProfile, workload: Workload, *,
                 machines: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.services = services
        self.model = model  # hybridmoe.backend.models.InspectedModel
        self.this_machine = self.hardware = hardware
        # Plan for a machine to buy too (`hybridmoe plan --hardware PRESET`): the presets.
        self.machines = machines
        # A saved workload may ask for more context than this model has: start within it.
        self.workload = replace(workload, context=min(workload.context, model.spec.max_context))
        self.plan: Plan | None = None
        self.error = ""

    def compose(self) -> ComposeResult:
        wl = self.workload
        with Horizontal(id="plan-fields"):
            with Vertical(classes="field"):
                yield Label("Context")
                yield Input(str(wl.context), type="integer", id="plan-context", compact=True,
                            tooltip="Tokens per conversation")
            with Vertical(classes="field"):
                yield Label("Users")
                yield Input(str(wl.users), type="integer", id="plan-users", compact=True,
                            tooltip="Conversations served at the same time")
            with Vertical(classes="field"):
                yield Label("KV cache")
                yield Select([(k, k) for k in KV_BYTES_PER_ELEMENT], value=wl.kv_dtype, allow_blank=False, id="plan-kv",
                             compact=True)
            with Vertical(classes="field"):
                yield Label("Strategy")
                yield Select(_strategy_options(wl), value=wl.strategy, allow_blank=False,
                             id="plan-strategy", compact=True)
            with Vertical(classes="field"):
                yield Label("Backend")
                yield Select([(b, b) for b in BACKENDS], value=wl.backend, allow_blank=False, id="plan-backend",
                             compact=True)
        if self.machines:
            with Horizontal(id="plan-machine"):
                yield Label("Machine ")
                yield Select([("this machine", "")] + [(n, n) for n in self.services.preset_names()], value="",
                             allow_blank=False, id="plan-hardware", compact=True,
                             tooltip="Plan for this machine, or size one you might buy")
        yield Static("", id="plan-error")
        yield PlanView()

    def on_mount(self) -> None:
        self.replan(self.workload)

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self._edited()

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        self._edited()

    def _edited(self) -> None:
        if not self.is_mounted:  # fields announce their first value while the editor mounts
            return
        try:
            context = int(self.query_one("#plan-context", Input).value)
            users = int(self.query_one("#plan-users", Input).value)
        except ValueError:
            self._refuse("Context and conversations must be whole numbers.")
            return
        if self.machines:
            name = self.query_one("#plan-hardware", Select).value
            self.hardware = self.services.preset(name) if name else self.this_machine
        try:
            workload = replace(
                self.workload,
                context=context,
                users=users,
                kv_dtype=self.query_one("#plan-kv", Select).value,
                strategy=self.query_one("#plan-strategy", Select).value,
                backend=self.query_one("#plan-backend", Select).value,
            )
        except HybridMoeError as error:  # Workload checks its own fields
            self._refuse(str(error))
            return
        self.replan(workload)

    def use_workload(self, workload: Workload) -> None:
        """Show the fields of ``workload`` (a re-plan from usage, say) and plan for it."""
        strategy = self.query_one("#plan-strategy", Select)
        with self.prevent(Input.Changed, Select.Changed):  # one plan for all the fields, not one each
            strategy.set_options(_strategy_options(workload))
            strategy.value = workload.strategy
            self.query_one("#plan-context", Input).value = str(workload.context)
            self.query_one("#plan-users", Input).value = str(workload.users)
            self.query_one("#plan-kv", Select).value = workload.kv_dtype
            self.query_one("#plan-backend", Select).value = workload.backend
        self.replan(workload)

    def replan(self, workload: Workload) -> None:
        try:
            plan = self.services.make_plan(self.model.spec, self.model.inventory, self.hardware, workload)
        except HybridMoeError as error:
            self._refuse(str(error))
            return
        self.workload, self.plan, self.error = workload, plan, ""
        error = self.query_one("#plan-error", Static)
        error.update("")
        error.display = False
        self.query_one(PlanView).show(plan)
        self.post_message(self.Changed(plan))

    def _refuse(self, message: str) -> None:
        self.error = message
        error = self.query_one("#plan-error", Static)
        error.update(message)
        error.display = True
        self.post_message(self.Changed(None, message))


def _strategy_options(workload: Workload) -> list[tuple[str, str]]:
    """"frequency" needs a statistics file: offered only when the workload names one."""
    return [(s, s) for s in STRATEGIES if s != "frequency" or workload.stats_file]
