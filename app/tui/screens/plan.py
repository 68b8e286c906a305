"""The plan of a model: the layout picture, the workload (and the machine) to edit, Save.

The model is the chat's, unless the Models screen asked for another (a catalogue model
not downloaded yet, to see what it would need). Saving the plan of a model that can run
here, for this machine, keeps it for the chat (which reloads with it) and makes its
workload the settings' default; a plan for a model without weights, or for another machine,
is exported to a file instead, as `hybridmoe plan --save` does.

Ctrl+R re-plans from the user's usage: the expert counts the chat records (when its
settings say so) go to the ``frequency`` strategy, and the new plan is shown next to the
current one before it is saved.
"""

from __future__ import annotations

import re
from dataclasses import replace

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Static

from hybridmoe.app.tui.screens.replan import ReplanDialog
from hybridmoe.app.tui.widgets.nav_bar import NavBar
from hybridmoe.app.tui.widgets.plan_editor import PlanEditor
from hybridmoe.app.tui.workers import ReportsWorkerErrors
from hybridmoe.backend.errors import UsageError
from hybridmoe.backend.plan import ExpertStats, Plan, Workload


def workload_from(app) -> Workload:
    """The plan's workload when there is one, else the settings'."""
    if app.plan is not None:
        return app.plan.workload
    s = app.settings
    return Workload(context=s.context, users=s.users, kv_dtype=s.kv_dtype, backend=s.backend)


class PlanScreen(ReportsWorkerErrors, Screen):
    # Ctrl+E and Ctrl+D take precedence over the workload fields, which bind them to "end"
    # and "delete" (End and Delete still do those): else the screen's keys would vanish from
    # the footer, and stop working, whenever a field has the focus.
    BINDINGS = [
        Binding("ctrl+s", "save", "Save", tooltip="Save the plan (for the chat, or to a file)"),
        Binding("ctrl+e", "export", "Export", priority=True, tooltip="Export the plan to a TOML file"),
        Binding("ctrl+d", "detect", "Measure", priority=True,
                tooltip="Detect this machine again, with its memory bandwidth"),
        Binding("ctrl+r", "replan_from_usage", "Re-plan",
                tooltip="Re-plan from my usage: the experts the chat used most go to the GPU"),
    ]

    class Ready(Message):
        def __init__(self, model_text: str, path, model, hardware):
            super().__init__()
            self.model_text, self.path, self.model, self.hardware = model_text, path, model, hardware

    class Waiting(Message):
        """The bandwidth measurement waits for model work (an answer, a load) to end."""

        def __init__(self, what: str):
            super().__init__()
            self.what = what

    class Replanned(Message):
        def __init__(self, current: Plan, proposed: Plan, stats: ExpertStats):
            super().__init__()
            self.current, self.proposed, self.stats = current, proposed, stats

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.shown_for: str | None = None
        self.path = None
        self.model = None

    def compose(self) -> ComposeResult:
        yield NavBar("plan")
        with VerticalScroll(id="plan-body"):
            yield Static("", id="plan-intro", markup=False)
        yield Footer(compact=True)

    @property
    def target(self) -> str:
        return self.app.plan_target or self.app.model

    def on_screen_resume(self) -> None:
        if self.target != self.shown_for:
            self._prepare(measure=False)

    def _prepare(self, *, measure: bool) -> None:
        intro = self.query_one("#plan-intro", Static)
        self.shown_for = self.target
        if not self.target:
            intro.update("No model chosen yet: F6 runs the setup, F3 picks a model.")
            return
        intro.update(f"Measuring the host memory bandwidth (best of three probes), then planning {self.target} …"
                     if measure or (self.app.hardware is None and self.app.settings.measure_bandwidth)
                     else f"Planning {self.target} …")
        self._inspect(self.target, None if measure else self.app.hardware, self.app.settings, measure)

    @work(thread=True, exclusive=True, exit_on_error=False, group="plan")
    def _inspect(self, model_text: str, hardware, settings, measure: bool) -> None:
        services = self.app.services
        path = services.resolve_model(model_text)
        model = services.inspect_model(path)
        if hardware is None:
            # Asked for (Ctrl+D), the measurement waits for model work (an answer) to end;
            # on the way, it is skipped while the model is busy.
            hardware = services.detect_hardware(
                measure_bandwidth=measure or settings.measure_bandwidth, wait=measure,
                on_wait=lambda what: self.post_message(self.Waiting(what)))
        self.post_message(self.Ready(model_text, path, model, hardware))

    def on_plan_screen_waiting(self, event: Waiting) -> None:
        self.query_one("#plan-intro", Static).update(
            f"Planning {self.target} once {event.what} has ended: the memory bandwidth is measured then, "
            "not beside it …")

    async def on_plan_screen_ready(self, event: Ready) -> None:
        self.app.hardware = event.hardware
        self.path, self.model = event.path, event.model
        await self.query(PlanEditor).remove()
        what = event.model.kind if self.app.plan_target_downloaded else "from the catalogue, not downloaded"
        self.query_one("#plan-intro", Static).update(
            f"{event.model.spec.name} ({event.model.spec.family}, {what}). "
            "Edit the workload or the machine and the numbers follow; Ctrl+S saves the plan."
        )
        workload = workload_from(self.app) if event.model_text == self.app.model else Workload(
            context=self.app.settings.context, users=self.app.settings.users)
        editor = PlanEditor(self.app.services, event.model, event.hardware, workload, machines=True,
                            id="plan-editor")
        await self.query_one("#plan-body").mount(editor)

    def _editor_plan(self) -> Plan | None:
        editors = self.query(PlanEditor)
        editor = editors.first() if editors else None
        if editor is None or editor.plan is None:
            self.notify("There is no plan yet.", severity="warning")
            return None
        if editor.error:
            self.notify(f"Not saved: {editor.error}", severity="error")
            return None
        return editor.plan

    def action_save(self) -> None:
        plan = self._editor_plan()
        if plan is None:
            return
        if plan.described_hardware or not (self.app.plan_target_downloaded or not self.app.plan_target):
            self.action_export()  # another machine's plan, or a model not downloaded: a file
            return
        where = self.app.save_plan(str(self.path), plan)
        self.app.plan_target = ""
        self.notify(f"Saved to {where}. The chat loads the model with it.", title="Plan saved")

    def action_export(self) -> None:
        plan = self._editor_plan()
        if plan is None:
            return
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{plan.model}-{plan.hardware}").strip("_")
        where = plan.save(self.app.services.data_dir() / "plans" / "exported" / f"{name}.toml")
        self.notify(f"Written to {where} (`hybridmoe run --plan FILE` uses it).", title="Plan exported")

    def action_detect(self) -> None:
        self._prepare(measure=True)

    # ---- re-planning from the recorded usage -----------------------------------------------------

    def action_replan_from_usage(self) -> None:
        editors = self.query(PlanEditor)
        editor = editors.first() if editors else None
        if editor is None or editor.plan is None or self.path is None:
            self.notify("There is no plan yet.", severity="warning")
            return
        if self.app.plan_target and not self.app.plan_target_downloaded:
            self.notify("This model has not run here: there is no usage of it to plan from.", severity="warning")
            return
        self._replan(editor.model, editor.hardware, editor.workload, editor.plan, self.path)

    @work(thread=True, exclusive=True, exit_on_error=False, group="replan")
    def _replan(self, model, hardware, workload: Workload, current: Plan, model_path) -> None:
        services = self.app.services
        stats_path = services.expert_stats_path(model_path)
        if not stats_path.exists():
            raise UsageError(
                f"no expert usage of {model.spec.name} is recorded yet",
                "In the chat (F2), open the settings (Ctrl+S), tick \"Record which experts the model uses\", "
                "chat for a while, then come back here.",
            )
        stats = ExpertStats.load(stats_path)
        proposed = services.make_plan(model.spec, model.inventory, hardware,
                                      replace(workload, strategy="frequency", stats_file=str(stats_path)))
        self.post_message(self.Replanned(current, proposed, stats))

    def on_plan_screen_replanned(self, event: Replanned) -> None:
        def answered(use: bool | None) -> None:
            if not use:
                return
            editors = self.query(PlanEditor)
            if not editors:
                return
            editors.first().use_workload(event.proposed.workload)
            self.action_save()

        self.app.push_screen(ReplanDialog(event.current, event.proposed, event.stats), answered)
