"""The first-run setup: 1 Hardware, 2 Model, 3 Get it, 4 Layout, 5 Load (then the chat).

Where it is (the step, and what it is getting) is kept in the app state after every step,
so quitting in the middle of a download and starting again comes back to step 3 with a
Resume button; the download continues from its partial files.

Step 2 opens with the cursor in the box for a path or a name (what is typed goes there), and
a download starts only once confirmed, with its size and whether it fits this machine.
"""

from __future__ import annotations

from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Button, ContentSwitcher, DataTable, Footer, Input, Label, Static

from hybridmoe.app.state import SetupProgress
from hybridmoe.app.tui.getting import job_for, parse_typed
from hybridmoe.app.tui.hardware_words import summary_lines, warnings
from hybridmoe.app.tui.screens.dialogs import ConfirmDialog
from hybridmoe.app.tui.widgets.plan_editor import PlanEditor
from hybridmoe.app.render import expected_sources
from hybridmoe.app.tui.widgets.plan_view import speed_cell
from hybridmoe.app.tui.widgets.transfer import Job, TransferPanel
from hybridmoe.app.tui.widgets.nav_bar import NavBar
from hybridmoe.app.tui.workers import ReportsWorkerErrors
from hybridmoe.backend.errors import HybridMoeError
from hybridmoe.backend.hub.local import LocalModel
from hybridmoe.backend.plan import Workload
from hybridmoe.backend.units import fmt_bytes

STEPS = (("hardware", "Hardware"), ("model", "Model"), ("get", "Get it"), ("layout", "Layout"), ("load", "Load"))


def steps_text(current: str) -> str:
    parts = []
    for i, (key, name) in enumerate(STEPS, 1):
        parts.append(f"[b reverse] {i} {name} [/]" if key == current else f" {i} {name} ")
    return " › ".join(parts)


def smallest_catalogue_bytes(catalogue) -> int | None:
    sizes = []
    for entry in catalogue:
        sizes.append(entry.checkpoint_size().bytes)
        sizes += [s.bytes for q in entry.quants if (s := entry.quant_size(q)) is not None]
    return min(sizes) if sizes else None


class SetupScreen(ReportsWorkerErrors, Screen):
    BINDINGS = [Binding("ctrl+b", "back", "Back"), Binding("ctrl+s", "save", "Save and load")]

    class HardwareReady(Message):
        def __init__(self, hardware):
            super().__init__()
            self.hardware = hardware

    class ChoicesReady(Message):
        def __init__(self, ranked: list, local: list[tuple[LocalModel, object]], catalogue, smallest: int | None):
            super().__init__()
            self.ranked, self.local, self.catalogue, self.smallest = ranked, local, catalogue, smallest

    class ModelInspected(Message):
        def __init__(self, path: Path, model):
            super().__init__()
            self.path, self.model = path, model

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.step = "hardware"
        self.hardware = None
        self.catalogue = None
        self.rows: dict[str, Job | Path] = {}
        self.sizes: dict[str, int] = {}  # row key -> bytes to download
        self.fitting: dict[str, tuple[Job, int]] = {}  # catalogue id -> the variant that fits, its bytes
        self.model_path: Path | None = None
        self.job: Job | None = None
        self.inspected: SetupScreen.ModelInspected | None = None

    def compose(self) -> ComposeResult:
        yield NavBar("setup")
        yield Static(steps_text("hardware"), id="setup-steps")
        with ContentSwitcher(initial="step-hardware", id="setup-content"):
            with VerticalScroll(id="step-hardware"):
                yield Label("What this machine has", classes="section-title")
                yield Static("Detecting the hardware …", id="setup-hardware", markup=False)
                yield Static("", id="setup-warnings", classes="warnings", markup=False)
                with Horizontal(classes="buttons"):
                    yield Button("Next: choose a model", variant="primary", id="hardware-next", disabled=True)
            with Vertical(id="step-model"):
                yield Label("Choose a model — fastest on this machine first", classes="section-title")
                yield DataTable(id="setup-choices", cursor_type="row", zebra_stripes=True)
                yield Static("Ranking the catalogue for this machine …", id="setup-choices-note", markup=False)
                yield Input(placeholder="…or a Hub repo (org/name[:QUANT]), a catalogue name or a local path",
                            id="setup-typed")
                with Horizontal(classes="buttons"):
                    yield Button("Back", id="model-back")
                    yield Button("Use the selected model", variant="primary", id="model-next")
            with VerticalScroll(id="step-get"):
                yield Label("Getting the model", classes="section-title")
                yield Static("", id="setup-get-note", markup=False)
                yield Vertical(id="setup-transfer")
                with Horizontal(classes="buttons"):
                    yield Button("Back", id="get-back")
            with VerticalScroll(id="step-layout"):
                yield Label("Layout: where the experts go", classes="section-title")
                yield Static("Reading the model …", id="setup-layout-note", markup=False)
                yield Vertical(id="setup-plan")
                with Horizontal(classes="buttons"):
                    yield Button("Back", id="layout-back")
                    yield Button("Save and load", variant="primary", id="layout-save", disabled=True)
            with Vertical(id="step-load"):
                yield Label("Loading", classes="section-title")
                yield Static("The chat loads the model and shows its progress (F2).", id="setup-load-note",
                             markup=False)
                with Horizontal(classes="buttons"):
                    yield Button("Choose another model", id="load-again")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        table = self.query_one("#setup-choices", DataTable)
        table.add_columns("Model", "Variant", "Size", "tok/s, ≤max", "Where")
        self._detect(self.app.settings.measure_bandwidth, self.app.settings)
        setup = self.app.state.setup
        if setup.step == "get" and setup.repo:  # interrupted download: offer to resume it
            self._show_get(Job(repo=setup.repo, quant=setup.quant or None, convert_to=setup.convert_to), start=False)
        elif setup.step in ("layout", "load") and setup.model_path:
            self._show_layout(Path(setup.model_path))
        elif setup.step == "model":
            self._go("model")
        else:
            self._go("hardware")

    def on_screen_resume(self) -> None:
        # The wizard was finished (its last page only pointed to the chat): coming back (F6)
        # starts it again at step 1, not at that page.
        if self.step == "load":
            self._go("hardware", remember=False)  # a look at the wizard is not a setup in progress
            self.query_one("#hardware-next", Button).focus()

    def _go(self, step: str, *, remember: bool = True) -> None:
        self.step = step
        self.refresh_bindings()
        self.query_one("#setup-steps", Static).update(steps_text(step))
        self.query_one(ContentSwitcher).current = f"step-{step}"
        if not remember:
            return
        setup = self.app.state.setup
        self.app.update_state(setup=SetupProgress(
            step=step, repo=self.job.repo if self.job else setup.repo,
            quant=(self.job.quant or "") if self.job else setup.quant,
            convert_to=self.job.convert_to if self.job else setup.convert_to,
            model_path=str(self.model_path) if self.model_path else setup.model_path,
        ))
        if step == "model":  # typing goes to the box; ↑/Tab reach the list
            self.query_one("#setup-typed", Input).focus()

    # ---- 1 hardware, and the choices that follow from it -----------------------------------------

    @work(thread=True, exclusive=True, exit_on_error=False, group="detect")
    def _detect(self, measure_bandwidth: bool, settings) -> None:
        services = self.app.services
        hardware = services.detect_hardware(measure_bandwidth=measure_bandwidth)
        self.post_message(self.HardwareReady(hardware))
        catalogue = services.catalogue()
        workload = Workload(context=settings.context, users=settings.users, kv_dtype=settings.kv_dtype,
                            backend=settings.backend)
        ranked = services.rank_catalogue(hardware, workload)
        local = []
        for m in services.list_local_models():
            if not m.usable:
                continue
            try:  # the same estimate as for the catalogue, from the model's own headers
                inspected = services.inspect_model(m.path)
                wl = Workload(context=min(settings.context, inspected.spec.max_context), users=settings.users,
                              kv_dtype=settings.kv_dtype, backend=settings.backend)
                plan = services.make_plan(inspected.spec, inspected.inventory, hardware, wl)
            except HybridMoeError:
                plan = None
            local.append((m, plan))
        self.post_message(self.ChoicesReady(ranked, local, catalogue, smallest_catalogue_bytes(catalogue)))

    async def on_setup_screen_hardware_ready(self, event: HardwareReady) -> None:
        self.hardware = self.app.hardware = event.hardware
        self.query_one("#setup-hardware", Static).update("\n".join(summary_lines(event.hardware)))
        self._show_warnings(warnings(event.hardware))
        if self.inspected is not None and not self.query(PlanEditor):
            await self._show_plan(self.inspected)
        next_button = self.query_one("#hardware-next", Button)
        next_button.disabled = False
        if self.step == "hardware":
            next_button.focus()

    def _show_warnings(self, notes: list[str]) -> None:
        box = self.query_one("#setup-warnings", Static)
        box.update("\n".join(f"! {w}" for w in notes))
        box.display = bool(notes)

    def on_setup_screen_choices_ready(self, event: ChoicesReady) -> None:
        self.catalogue = event.catalogue
        self._show_warnings(warnings(self.hardware, event.smallest))
        table = self.query_one("#setup-choices", DataTable)
        table.clear()
        self.rows.clear()
        self.sizes.clear()
        self.fitting.clear()
        quants = self.app.services.convert_quants()
        for r in event.ranked:
            job = job_for(r.entry, r.option, quants)
            if job is None:
                continue
            key = f"catalogue:{r.entry.id}"
            self.rows[key] = job
            self.sizes[key] = r.size_bytes
            self.fitting[r.entry.id] = (job, r.size_bytes)
            table.add_row(r.entry.name, r.option, fmt_bytes(r.size_bytes), _speed(r.plan),
                          "Hub" + (", converted here" if job.convert_to else ""), key=key)
        for i, (m, plan) in enumerate(event.local):
            key = f"local:{i}"
            self.rows[key] = Path(m.path)
            table.add_row(m.name, m.quantization or m.kind, fmt_bytes(m.size_bytes), _speed(plan) if plan else "?",
                          "on disk", key=key)
        fits = len(event.ranked)
        sources = expected_sources([r.plan for r in event.ranked] + [plan for _, plan in event.local])
        self.query_one("#setup-choices-note", Static).update(
            f"{fits} catalogue model(s) fit this machine; {len(event.local)} usable model(s) on disk. "
            "Speeds are tokens/s, the plan's expected decode ≤ its upper bound"
            + (f"; expected from {'; '.join(sources)}." if sources else ".") if self.rows else
            "Nothing in the catalogue fits this machine and no model is on disk: "
            "type a smaller model's repository below."
        )

    # ---- 2 model ---------------------------------------------------------------------------------

    def on_button_pressed(self, event: Button.Pressed) -> None:
        button = event.button.id
        if button == "hardware-next":
            self._go("model")
        elif button == "model-next":
            self._choose_selected()
        elif button == "load-again":
            self._go("model")
        elif button in ("model-back", "get-back", "layout-back"):
            self.action_back()
        elif button == "layout-save":
            self._save_and_load()
        else:
            return
        event.stop()

    def action_back(self) -> None:
        previous = {"model": "hardware", "get": "model", "layout": "model"}.get(self.step)
        if self.step == "get" and self.query(TransferPanel) and self.query_one(TransferPanel).running:
            self.notify("Cancel the download first.", severity="warning")
            return
        if previous:
            self._go(previous)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self._choose(self.rows.get(event.row_key.value), self.sizes.get(event.row_key.value))

    def _choose_selected(self) -> None:
        typed = self.query_one("#setup-typed", Input).value.strip()
        if typed:
            self._choose_typed(typed)
            return
        table = self.query_one("#setup-choices", DataTable)
        if not table.row_count:
            self.notify("Nothing to choose yet.", severity="warning")
            return
        key = table.coordinate_to_cell_key((table.cursor_row, 0)).row_key.value
        self._choose(self.rows.get(key), self.sizes.get(key))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.input.id == "setup-typed" and event.value.strip():
            self._choose_typed(event.value.strip())

    def _choose_typed(self, text: str) -> None:
        catalogue = self.catalogue or self.app.services.catalogue()
        try:
            choice = parse_typed(text, catalogue, self.app.services.convert_quants(),
                                 {i: job for i, (job, _) in self.fitting.items()})
        except HybridMoeError as error:
            self.app.show_error(error)
            return
        entry = catalogue.find(text) if isinstance(choice, Job) else None
        if entry is None:
            self._choose(choice)
        elif entry.id in self.fitting:
            self._choose(choice, self.fitting[entry.id][1])
        else:  # the list leaves it out: nothing of it fits
            self._choose(choice, entry.checkpoint_size().bytes, fits=False)

    def _choose(self, choice: Job | Path | None, size: int | None = None, *, fits: bool | None = True) -> None:
        if isinstance(choice, Path):
            self._show_layout(choice)
        elif isinstance(choice, Job):
            self._confirm_download(choice, size, fits)

    def _confirm_download(self, job: Job, size: int | None, fits: bool | None) -> None:
        """Ask before a download starts: it may be tens of gigabytes."""
        what = f"{job.label()}" + (f", {fmt_bytes(size)}" if size else "")
        if fits is False:
            verdict = "No variant of this model fits this machine: it would not load here."
        elif size is None:
            verdict = "Its size is known once the Hub lists its files (shown before the first byte)."
        else:
            verdict = "It fits this machine."
        where = " It is converted here afterwards." if job.convert_to else ""
        self.app.push_screen(
            ConfirmDialog("Download the model?", f"{what}\n{verdict}{where}\nDownloads resume where they stop.",
                          "Download", dangerous=fits is False),
            lambda yes: self._show_get(job, start=True) if yes else None)

    # ---- 3 get it --------------------------------------------------------------------------------

    def _show_get(self, job: Job, *, start: bool) -> None:
        self.job = job
        holder = self.query_one("#setup-transfer", Vertical)
        holder.remove_children()
        holder.mount(TransferPanel(job, autostart=start, resuming=not start))
        self.query_one("#setup-get-note", Static).update(
            "Downloads resume where they stopped: cancelling, or quitting the app, loses nothing." if start else
            f"The download of {job.label()} stopped before it finished. Resume continues it."
        )
        self._go("get")

    def on_transfer_panel_finished(self, event: TransferPanel.Finished) -> None:
        event.stop()
        for path in event.obtained:
            self.app.remember_obtained(path)
        self._show_layout(event.path)

    # ---- 4 layout --------------------------------------------------------------------------------

    def _show_layout(self, path: Path) -> None:
        self.model_path = path
        self.inspected = None
        self.query_one("#setup-layout-note", Static).update(f"Reading {path} …")
        self.query_one("#layout-save", Button).disabled = True
        self.query_one("#setup-plan", Vertical).remove_children()
        self._go("layout")
        self._inspect(path)

    @work(thread=True, exclusive=True, exit_on_error=False, group="inspect")
    def _inspect(self, path: Path) -> None:
        self.post_message(self.ModelInspected(path, self.app.services.inspect_model(path)))

    async def on_setup_screen_model_inspected(self, event: ModelInspected) -> None:
        self.inspected = event
        if self.hardware is not None:  # else the detection, still running, shows it when done
            await self._show_plan(event)

    async def _show_plan(self, event: ModelInspected) -> None:
        s = self.app.settings
        workload = Workload(context=s.context, users=s.users, kv_dtype=s.kv_dtype, backend=s.backend)
        self.query_one("#setup-layout-note", Static).update(
            f"{event.model.spec.name}: change the context, conversations or strategy and watch the numbers. "
            "Save and load keeps this plan and opens the chat."
        )
        holder = self.query_one("#setup-plan", Vertical)
        await holder.remove_children()
        await holder.mount(PlanEditor(self.app.services, event.model, self.hardware, workload, id="setup-editor"))

    def on_plan_editor_changed(self, event: PlanEditor.Changed) -> None:
        self.query_one("#layout-save", Button).disabled = event.plan is None

    # ---- 5 load ----------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "save":
            return self.step == "layout"
        if action == "back":
            return self.step in ("model", "get", "layout")
        return True

    def action_save(self) -> None:
        if not self.query_one("#layout-save", Button).disabled:
            self._save_and_load()

    def _save_and_load(self) -> None:
        editor = self.query_one(PlanEditor)
        if editor.plan is None or editor.error:
            self.notify(editor.error or "No plan yet.", severity="error")
            return
        if not editor.plan.fits:
            self.notify("This layout does not fit: change the context or conversations first.", severity="error")
            return
        self._go("load")
        self.app.save_plan(str(self.model_path), editor.plan)
        self.app.update_state(setup=SetupProgress())  # done: the next start opens the chat
        self.app.open_chat(str(self.model_path), editor.plan)


def _speed(plan) -> str:
    return speed_cell(plan)
