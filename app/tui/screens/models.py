"""Models on this machine and in the catalogue: use one, pull, convert, delete, and the
folders searched for models (``hybridmoe models`` and ``hybridmoe pull`` in the CLI)."""

from __future__ import annotations

from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Label, Static

from hybridmoe.app.model_files import deletable
from hybridmoe.app.tui.getting import variants
from hybridmoe.app.tui.screens.dialogs import ChoiceDialog, ConfirmDialog, TextScreen
from hybridmoe.app.tui.screens.transfer import TransferScreen
from hybridmoe.app.tui.widgets.transfer import Job
from hybridmoe.app.tui.widgets.nav_bar import NavBar
from hybridmoe.app.render import expected_sources
from hybridmoe.app.tui.widgets.plan_view import speed_cell
from hybridmoe.app.tui.workers import ReportsWorkerErrors, WorkerFailed
from hybridmoe.backend.hub.local import LocalModel
from hybridmoe.backend.plan import Workload
from hybridmoe.backend.units import fmt_bytes


MODEL_NAME_CELLS = 24  # longer catalogue names end in "…" (the details, i, show them whole)


class ModelsScreen(ReportsWorkerErrors, Screen):
    # The footer shows what is done to a model, within 80 columns; the folder list's upkeep
    # (removing a folder, listing again) is in the command palette (Ctrl+P).
    BINDINGS = [
        Binding("enter", "use", "Use in chat", show=True),
        Binding("p", "pull", "Pull", tooltip="Download the selected catalogue model"),
        Binding("c", "convert", "Convert", tooltip="Convert the selected checkpoint to GGUF"),
        Binding("delete,d", "delete", "Delete", tooltip="Delete the selected model's files"),
        Binding("v", "plan", "Plan", tooltip="Plan the selected model (also one not downloaded yet)"),
        Binding("i", "inspect", "Inspect", tooltip="What the selected model is made of"),
        Binding("a", "add_folder", "Add folder", tooltip="Search a folder for models"),
        Binding("x", "remove_folder", "Remove folder", show=False, tooltip="Stop searching a folder (its models stay)"),
        Binding("r", "refresh", "Refresh", show=False, tooltip="Look for models again"),
    ]

    class Listed(Message):
        def __init__(self, local: list[LocalModel], ranked: list, catalogue, hardware):
            super().__init__()
            self.local, self.ranked, self.catalogue, self.hardware = local, ranked, catalogue, hardware

    class Inspected(Message):
        def __init__(self, title: str, text: str):
            super().__init__()
            self.title, self.text = title, text

    class Doing(Message):
        """The listing's next part, which may take seconds: said while it runs."""

        def __init__(self, text: str):
            super().__init__()
            self.text = text

    class Deleted(Message):
        def __init__(self, model: LocalModel, freed: int):
            super().__init__()
            self.model, self.freed = model, freed

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.local: list[LocalModel] = []
        self.ranked: dict[str, object] = {}
        self.catalogue = None

    def compose(self) -> ComposeResult:
        yield NavBar("models")
        with Vertical(id="models-body"):
            yield Label("On this machine", classes="section-title")
            yield DataTable(id="local-models", cursor_type="row", zebra_stripes=True)
            yield Label("Catalogue — estimated speed on this machine", classes="section-title")
            yield DataTable(id="catalogue-models", cursor_type="row", zebra_stripes=True)
            yield Static("Looking for models …", id="models-detail")
            yield Input(placeholder="A folder to search for models (Enter adds it, Esc closes)", id="add-folder")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        local = self.query_one("#local-models", DataTable)
        local.add_columns("Name", "Format", "Quant", "Size", "Source", "Note")
        catalogue = self.query_one("#catalogue-models", DataTable)
        # Narrow headers and cells: with a scroll bar the five columns fit 80 terminal columns.
        catalogue.add_columns("Model", "Fits as", "Size", "tok/s, ≤max", "Context")
        self.query_one("#add-folder").display = False
        self.action_refresh()

    # ---- listing ---------------------------------------------------------------------------------

    def action_refresh(self) -> None:
        self.query_one("#models-detail", Static).update("Looking for models on this disk …")
        self._list(self.app.hardware, self.app.settings)

    def on_models_screen_doing(self, event: Doing) -> None:
        self.query_one("#models-detail", Static).update(event.text)

    def on_worker_failed(self, event: WorkerFailed) -> None:
        # The App shows what went wrong (the message bubbles on); this line must not go on
        # saying that models are being looked for.
        if event.worker.group == "list":
            self.query_one("#models-detail", Static).update("The models could not be listed (see the message); "
                                                            "r looks again.")

    @work(thread=True, exclusive=True, exit_on_error=False, group="list")
    def _list(self, hardware, settings) -> None:
        services = self.app.services
        local = services.list_local_models()  # the default model too, wherever it is
        catalogue = services.catalogue()
        if hardware is None:
            self.post_message(self.Doing("Detecting this machine" + (
                " and measuring its memory bandwidth …" if settings.measure_bandwidth else " …")))
            hardware = services.detect_hardware(measure_bandwidth=settings.measure_bandwidth)
        self.post_message(self.Doing(f"Found {len(local)} model(s) on this disk; planning each catalogue model "
                                     "for this machine …"))
        workload = Workload(context=settings.context, users=settings.users, kv_dtype=settings.kv_dtype,
                            backend=settings.backend)
        ranked = services.rank_catalogue(hardware, workload)
        self.post_message(self.Listed(local, ranked, catalogue, hardware))

    def on_models_screen_listed(self, event: Listed) -> None:
        self.app.hardware = event.hardware
        self.local, self.catalogue = event.local, event.catalogue
        self.ranked = {r.entry.id: r for r in event.ranked}
        obtained = set(self.app.state.obtained)
        default = self.app.settings.default_model
        table = self.query_one("#local-models", DataTable)
        table.clear()
        for i, m in enumerate(self.local):
            notes = []
            if str(m.path) == default:
                notes.append("default")
            if str(m.path) in obtained:
                notes.append("got by hybridmoe")
            if m.problem:
                notes.append(m.problem)
            table.add_row(m.name, m.kind, m.quantization or "", fmt_bytes(m.size_bytes), m.source,
                          "; ".join(notes), key=str(i))
        table = self.query_one("#catalogue-models", DataTable)
        table.clear()
        # What fits first, fastest first (the ranking's order); then the rest as listed.
        fitting = [r.entry for r in event.ranked]
        for entry in fitting + [e for e in self.catalogue if e.id not in self.ranked]:
            r = self.ranked.get(entry.id)
            name = entry.name if len(entry.name) <= MODEL_NAME_CELLS else entry.name[:MODEL_NAME_CELLS - 1] + "…"
            if r is None:
                table.add_row(name, "does not fit", "", "", f"{entry.context:,}", key=entry.id)
            else:
                speed = speed_cell(r.plan)
                table.add_row(name, r.option, fmt_bytes(r.size_bytes), speed, f"{r.context:,}", key=entry.id)
        sources = expected_sources([r.plan for r in event.ranked])
        self.query_one("#models-detail", Static).update(
            f"{len(self.local)} model(s) on this machine; {len(self.ranked)} of {len(self.catalogue)} catalogue models "
            "fit. Enter uses a local model, p pulls a catalogue one, v plans and i inspects either; "
            "c converts a checkpoint to GGUF." + (f" Speeds: expected ≤ upper bound, tokens/s; expected from "
                                                  f"{'; '.join(sources)}." if sources else "")
        )

    def _selected_local(self) -> LocalModel | None:
        table = self.query_one("#local-models", DataTable)
        if not self.local or table.cursor_row is None or table.cursor_row >= len(self.local):
            return None
        return self.local[table.cursor_row]

    def _selected_entry(self):
        table = self.query_one("#catalogue-models", DataTable)
        if self.catalogue is None or not table.row_count:
            return None
        key = table.coordinate_to_cell_key((table.cursor_row, 0)).row_key.value
        return self.catalogue.find(key)

    def _focused_table(self) -> str:
        focused = self.focused
        return focused.id if isinstance(focused, DataTable) else "local-models"

    # ---- actions ---------------------------------------------------------------------------------

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if event.data_table.id == "local-models":
            self.action_use()
        else:
            self.action_pull()

    def action_use(self) -> None:
        if self._focused_table() == "catalogue-models":
            self.action_pull()
            return
        model = self._selected_local()
        if model is None:
            return
        if model.problem:
            self.notify(model.problem, title=f"{model.name} cannot be used", severity="error")
            return
        self.app.open_chat(str(model.path))

    def action_pull(self) -> None:
        entry = self._selected_entry()
        if entry is None:
            return
        self.query_one("#catalogue-models").focus()
        quants = self.app.services.convert_quants()
        choices = [v for v in variants(entry, quants) if v.job is not None]
        best = self.ranked.get(entry.id)
        if best is not None:  # the variant that fits goes first
            choices.sort(key=lambda v: v.option != best.option)
        jobs = {v.option: v.job for v in choices}
        labels = [(v.option, ("recommended: " if best is not None and v.option == best.option else "") + v.label)
                  for v in choices]
        fits = f"fits this machine as {best.option}" if best else "does not fit this machine in any variant"
        self.app.push_screen(ChoiceDialog(f"Pull {entry.name}", labels, f"{entry.name} {fits}. Download which?"),
                             lambda option: self._start(jobs[option]) if option else None)

    def _start(self, job: Job) -> None:
        self.app.push_screen(TransferScreen(job), self._transferred)

    def _transferred(self, path: Path | None) -> None:
        if path is not None:
            self.notify(f"{path} is ready. Enter uses it.", title="Model ready")
            self.action_refresh()

    def action_convert(self) -> None:
        model = self._selected_local()
        if model is None or self._focused_table() != "local-models":
            self.notify("Select a model on this machine first.", severity="warning")
            return
        if model.kind != "safetensors" or model.problem:
            self.notify("Only a complete safetensors checkpoint can be converted to GGUF.", severity="warning")
            return
        quants = self.app.services.convert_quants()
        self.app.push_screen(
            ChoiceDialog(f"Convert {model.name} to GGUF", [(q, q.upper()) for q in quants],
                         f"Written to {self.app.services.converted_dir()}."),
            lambda q: self._start(Job(model=model, convert_to=q)) if q else None,
        )

    def action_delete(self) -> None:
        model = self._selected_local()
        if model is None or self._focused_table() != "local-models":
            self.notify("Select a model on this machine first.", severity="warning")
            return
        refused = deletable(model)
        if refused:
            self.notify(refused, title="Not deleted", severity="warning")
            return
        files = "\n".join(f"  {f}" for f in model.files[:8]) + ("\n  …" if len(model.files) > 8 else "")
        if str(model.path) in self.app.state.obtained:
            message = f"Delete {model.name} ({fmt_bytes(model.size_bytes)}), downloaded by hybridmoe?\n{files}"
        else:
            message = (f"hybridmoe did not download {model.name}: you or another tool put these files here.\n"
                       f"{files}\nDelete them anyway ({fmt_bytes(model.size_bytes)})?")
        self.app.push_screen(ConfirmDialog("Delete model", message, "Delete", dangerous=True),
                             lambda yes: self._delete(model) if yes else None)

    @work(thread=True, exclusive=True, exit_on_error=False, group="delete")
    def _delete(self, model: LocalModel) -> None:
        freed = self.app.services.delete_model(model)
        self.post_message(self.Deleted(model, freed))

    def on_models_screen_deleted(self, event: Deleted) -> None:
        self.app.forget_model(str(event.model.path))
        self.notify(f"Deleted {event.model.name}; {fmt_bytes(event.freed)} freed.")
        self.action_refresh()

    def _selected_target(self) -> str | None:
        """The selected model as inspect_model takes it: a local path, or a catalogue config."""
        if self._focused_table() == "catalogue-models":
            entry = self._selected_entry()
            return str(entry.config_path) if entry else None
        model = self._selected_local()
        return str(model.path) if model else None

    def action_plan(self) -> None:
        target = self._selected_target()
        if target:
            self.app.show_plan(target, downloaded=self._focused_table() == "local-models")

    def action_inspect(self) -> None:
        target = self._selected_target()
        if target:
            self._inspect(target)

    @work(thread=True, exclusive=True, exit_on_error=False, group="inspect")
    def _inspect(self, target: str) -> None:
        from hybridmoe.app.render import model_text

        model = self.app.services.inspect_model(target)
        self.post_message(self.Inspected(model.spec.name, model_text(model)))

    def on_models_screen_inspected(self, event: Inspected) -> None:
        self.app.push_screen(TextScreen(event.title, event.text))

    def action_remove_folder(self) -> None:
        folders = self.app.services.model_dirs()
        if not folders:
            self.notify("No folders are registered (a adds one).", severity="warning")
            return
        self.app.push_screen(
            ChoiceDialog("Stop searching a folder", [(str(f), str(f)) for f in folders],
                         "The models in it are not touched."),
            lambda folder: self._remove_folder(folder) if folder else None,
        )

    def _remove_folder(self, folder: str) -> None:
        self.app.services.remove_model_dir(folder)
        self.notify(f"{folder} is no longer searched.")
        self.action_refresh()

    def action_add_folder(self) -> None:
        field = self.query_one("#add-folder", Input)
        field.display = True
        field.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        event.input.display = False
        if event.value.strip():
            self._add_folder(event.value.strip())
            event.input.value = ""

    def on_key(self, event) -> None:
        field = self.query_one("#add-folder", Input)
        if event.key == "escape" and field.display:
            field.display = False
            event.stop()

    @work(thread=True, exclusive=True, exit_on_error=False, group="add-folder")
    def _add_folder(self, folder: str) -> None:
        path = self.app.services.add_model_dir(folder)
        self.app.call_from_thread(self.notify, f"{path} is searched for models from now on.")
        self.app.call_from_thread(self.action_refresh)

