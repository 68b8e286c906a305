"""Re-planning from the user's own usage: the plan the ``frequency`` strategy makes from the
expert counts the chat recorded, next to the plan in use, to accept or not.

The comparison that matters is how many of the user's expert choices the GPU serves under
each layout: the more, the fewer bytes the CPU reads per token. The speed estimates come
from the planner; for the current layout it assumed every expert equally likely, for the
new one it used the counts.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static

from hybridmoe.backend.plan import ExpertStats, Plan
from hybridmoe.app.tui.widgets.plan_view import speed_cell


def gpu_share(plan: Plan, stats: ExpertStats) -> float | None:
    """Share of the recorded expert choices that ``plan`` puts on the GPU (None: no data)."""
    total = stats.activations
    if not total:
        return None
    on_gpu = sum(counts[e] for layer, counts in stats.layers.items() for e in plan.gpu_experts.get(layer, ())
                 if e < len(counts))
    return on_gpu / total


def _speed(plan: Plan) -> str:
    if not plan.fits:
        return "does not fit"
    if not (plan.decode_tokens_per_s_expected or plan.decode_tokens_per_s_upper_bound):
        return plan.decode_bound_by
    return speed_cell(plan) + " tokens/s"


def _share(plan: Plan, stats: ExpertStats) -> str:
    share = gpu_share(plan, stats)
    return "no data" if share is None else f"{share:.0%}"


def comparison(current: Plan, proposed: Plan, stats: ExpertStats) -> Table:
    table = Table(box=None, pad_edge=False, show_edge=False)
    table.add_column("", no_wrap=True)
    table.add_column("Now", justify="right", no_wrap=True)
    table.add_column("From your usage", justify="right", style="bold", no_wrap=True)
    total = proposed.n_routed_experts * len(proposed.moe_layers)
    rows = (
        ("Placement", current.workload.strategy, proposed.workload.strategy),
        ("Your expert choices on the GPU", _share(current, stats), _share(proposed, stats)),
        ("Routed experts on the GPU", f"{current.gpu_expert_count:,} of {total:,}",
         f"{proposed.gpu_expert_count:,} of {total:,}"),
        ("Host reads per token", f"{current.host_bytes_per_token / 1e9:,.2f} GB",
         f"{proposed.host_bytes_per_token / 1e9:,.2f} GB"),
        ("Estimated decode", _speed(current), _speed(proposed)),
    )
    for row in rows:
        table.add_row(*row)
    return table


def recorded_words(stats: ExpertStats) -> str:
    return (f"Recorded so far: {stats.tokens:,} tokens, {stats.activations:,} expert choices "
            f"in {len(stats.layers)} MoE layers (counts only, no text).")


class ReplanDialog(ModalScreen[bool]):
    """Dismisses with True when the user takes the new plan."""

    BINDINGS = [Binding("escape", "keep", "Keep the current plan")]

    def __init__(self, current: Plan, proposed: Plan, stats: ExpertStats):
        super().__init__(classes="dialog")
        self.current, self.proposed, self.stats = current, proposed, stats

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box wide"):
            yield Label("Re-plan from your usage", classes="dialog-title")
            yield Static(recorded_words(self.stats), id="replan-recorded")
            yield Static(comparison(self.current, self.proposed, self.stats), id="replan-table")
            yield Static(self._note(), id="replan-note")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Use and save", variant="primary", id="replan-use", disabled=not self.proposed.fits)
                yield Button("Keep the current plan", id="replan-keep")

    def _note(self) -> Text:
        if not self.proposed.fits:
            return Text(f"The new plan does not fit: {self.proposed.reason}", style="bold red")
        if self.proposed.main_device == "cpu":
            return Text("Every expert runs on the CPU here, so where they go changes nothing; "
                        "usage pays off on a machine with a GPU.")
        return Text("The experts you use most go to the GPU; the speed estimate of the current plan "
                    "assumes every expert is equally likely.")

    def on_mount(self) -> None:
        button = self.query_one("#replan-use" if self.proposed.fits else "#replan-keep", Button)
        button.focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "replan-use")

    def action_keep(self) -> None:
        self.dismiss(False)
