"""The hybridmoe terminal UI: one App, a mode (screen stack) per screen.

The App owns what the screens share: the services (the backend verbs; fakes in tests), the
model service (the loaded model, which the chat, the benchmark and the API server use), the
settings and the app state, the conversation history, the detected hardware, and which
model and plan the chat should run. Screens switch with F2–F6 (chat, models, plan,
hardware, setup); each keeps its state while another is shown. Every failure of a worker
ends in ``on_worker_failed`` here, as a dialog.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from textual.app import App, SystemCommand
from textual.binding import Binding

from hybridmoe.app.history import History
from hybridmoe.app.model_service import ModelService
from hybridmoe.app.services import Services
from hybridmoe.app.state import AppState, load_state, save_state
from hybridmoe.app.tui.api_server import ChatModelServer
from hybridmoe.app.tui.commands import ActionsProvider
from hybridmoe.app.tui.errors import report_for
from hybridmoe.app.tui.screens.benchmark import BenchmarkScreen, open_benchmark
from hybridmoe.app.tui.screens.chat import ChatScreen
from hybridmoe.app.tui.screens.dialogs import ErrorDialog
from hybridmoe.app.tui.screens.hardware import HardwareScreen
from hybridmoe.app.tui.screens.models import ModelsScreen
from hybridmoe.app.tui.screens.plan import PlanScreen
from hybridmoe.app.tui.screens.server import ServerScreen
from hybridmoe.app.tui.screens.setup import SetupScreen
from hybridmoe.app.tui.workers import ReportsWorkerErrors, WorkerFailed
from hybridmoe.backend.errors import HybridMoeError
from hybridmoe.backend.plan import Plan
from hybridmoe.backend.settings import Settings


class HybridMoeApp(ReportsWorkerErrors, App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "hybridmoe"
    MODES = {
        "setup": SetupScreen,
        "chat": ChatScreen,
        "models": ModelsScreen,
        "plan": PlanScreen,
        "hardware": HardwareScreen,
    }
    # One provider, so that the palette lists the app's actions before Textual's (it lists
    # providers' entries in the order they arrive, Textual's system commands first).
    COMMANDS = {ActionsProvider}
    # Priority: the screens are reachable whatever has focus (a TextArea binds F6 itself).
    # Not in the footer: the navigation bar at the top of every screen shows them.
    BINDINGS = [
        Binding("f2", "switch_mode('chat')", "Chat", show=False, priority=True, tooltip="Go to the chat"),
        Binding("f3", "switch_mode('models')", "Models", show=False, priority=True,
                tooltip="Models: on disk and in the catalogue"),
        Binding("f4", "switch_mode('plan')", "Plan", show=False, priority=True, tooltip="Plan: where the experts go"),
        Binding("f5", "switch_mode('hardware')", "Hardware", show=False, priority=True,
                tooltip="Hardware: what this machine has"),
        Binding("f6", "switch_mode('setup')", "Setup", show=False, priority=True, tooltip="Setup wizard"),
        Binding("f7", "api_server", "Server", show=False, priority=True,
                tooltip="API server: serve the chat's model over the OpenAI API"),
    ]

    def __init__(self, services: Services | None = None):
        super().__init__()
        self.services = services or Services()
        self.settings = Settings()
        self.state = AppState()
        self.history: History | None = None
        self.hardware = None  # HardwareProfile, once a screen has detected it
        self.model = ""  # what the chat runs: a path (or a name hybridmoe.backend.hub.catalogue.model_path knows)
        self.plan: Plan | None = None  # its plan; None: the chat makes one from the settings
        self.plan_target = ""  # the model the Plan screen shows, when not the chat's
        self.plan_target_downloaded = True  # False: a catalogue model's config.json, nothing to run yet
        self.models = ModelService(self.services)  # the loaded model, whichever screen asks
        self.api_server = ChatModelServer(self.models)  # the loaded model over the OpenAI API (F7)

    def on_mount(self) -> None:
        problems: list[HybridMoeError] = []
        loaded = self.services.read_settings()  # a broken settings file: say so, run on defaults
        self.settings = loaded.settings
        if loaded.problems:
            problems.append(HybridMoeError("\n".join(loaded.problems), loaded.hint))
        self.state = load_state(self.services.data_dir())
        try:
            self.history = History(self.services.data_dir() / "history.sqlite3")
            if self.history.damage is not None:  # set aside, a new one started: say where it went
                problems.append(self.history.damage)
        except HybridMoeError as error:
            problems.append(error)
            self.history = History(":memory:")
        self.model = self.settings.default_model
        self.plan = self._saved_plan(self.model)
        # The wizard again when there is no model yet, or it stopped in the middle of getting
        # one (a download to resume, a layout to save); otherwise the chat.
        first_run = not self.model or self.state.setup.step in ("get", "layout")
        self.switch_mode("setup" if first_run else "chat")
        for error in problems:  # on top of the first screen, once it is there
            self.call_after_refresh(self.show_error, error)

    def _saved_plan(self, model: str) -> Plan | None:
        if not model:
            return None
        path = self.services.plan_path(model)
        if not path.exists():
            return None
        try:
            return Plan.load(path)
        except HybridMoeError as error:
            self.notify(f"Ignoring the saved plan: {error.what}", severity="warning")
            return None

    # ---- what the screens share ----------------------------------------------------------------

    def update_state(self, **changes) -> None:
        self.state = replace(self.state, **changes)
        save_state(self.services.data_dir(), self.state)

    def remember_obtained(self, path: str | Path) -> None:
        self.state = self.state.with_obtained(path)
        save_state(self.services.data_dir(), self.state)

    def forget_model(self, path: str) -> None:
        """A model was deleted: drop it from the state, and as the default."""
        self.state = self.state.without_obtained(path)
        save_state(self.services.data_dir(), self.state)
        if self.settings.default_model == path:
            self.set_settings(replace(self.settings, default_model=""))
            self.model, self.plan = "", None

    def set_settings(self, settings: Settings) -> None:
        self.settings = settings
        try:
            self.services.save_settings(settings)
        except OSError as error:
            self.show_error(HybridMoeError(f"cannot save the settings: {error}", "Check the config directory."))

    def save_plan(self, model: str, plan: Plan) -> Path:
        """Keep ``plan`` for ``model``; its workload becomes the settings' default."""
        path = plan.save(self.services.plan_path(model))
        wl = plan.workload
        self.set_settings(replace(self.settings, default_model=model, context=wl.context, users=wl.users,
                                  kv_dtype=wl.kv_dtype, backend=wl.backend))
        self.model, self.plan = model, plan
        return path

    def open_chat(self, model: str, plan: Plan | None = None) -> None:
        """Make ``model`` the default and show the chat, which loads it."""
        if model != self.settings.default_model:
            self.set_settings(replace(self.settings, default_model=model))
        self.model = model
        self.plan = plan if plan is not None else self._saved_plan(model)
        self.plan_target = ""  # F4 shows the chat's model again
        if self.current_mode == "chat":  # no ScreenResume will come: ask the chat directly
            self.screen_stack[0].ensure_loaded()
        else:
            self.switch_mode("chat")

    def show_plan(self, model: str, *, downloaded: bool = True) -> None:
        """The Plan screen for ``model``: a model on disk, or (``downloaded=False``) a
        catalogue model's config.json, to see what it would need before getting it."""
        self.plan_target = "" if model == self.model else model
        self.plan_target_downloaded = downloaded
        if self.current_mode == "plan":
            self.screen_stack[0].on_screen_resume()
        else:
            self.switch_mode("plan")

    def copy_text(self, text: str, what: str) -> None:
        """OSC 52 (works over SSH in most terminals), and the system clipboard through
        pyperclip when it is installed (for terminals that ignore OSC 52)."""
        self.copy_to_clipboard(text)
        try:
            import pyperclip

            pyperclip.copy(text)
        except Exception:  # not installed, or no clipboard program on this system
            pass
        self.notify(f"Copied the {what} ({len(text):,} characters).")

    # ---- errors ----------------------------------------------------------------------------------

    def show_error(self, error: BaseException) -> None:
        report = report_for(error)
        if report.cancelled:
            self.notify(report.message, title="Cancelled")
        else:
            self.push_screen(ErrorDialog(report))

    def on_worker_failed(self, event: WorkerFailed) -> None:
        self.show_error(event.error)

    def get_system_commands(self, screen):
        # From every screen, not only the Hardware one (whose "b" key does the same).
        if not isinstance(screen, (HardwareScreen, BenchmarkScreen)):
            yield SystemCommand("Benchmark the model", "Prefill and decode tokens/s of the chat's model "
                                "(Hardware screen: b)", lambda: open_benchmark(self))
        yield from super().get_system_commands(screen)

    def action_api_server(self) -> None:
        if not isinstance(self.screen, ServerScreen):
            self.push_screen(ServerScreen(self.api_server))

    def on_unmount(self) -> None:
        self.api_server.stop()
        self.models.close()
        if self.history is not None:
            self.history.close()


def run() -> int:
    HybridMoeApp().run()
    return 0
