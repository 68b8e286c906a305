"""Errors a user can cause, each carrying what went wrong and what to do about it.

The CLI prints ``str(error)`` and exits with ``error.exit_code``; the TUI shows the same
text in a dialog. Anything that is not a ``HybridMoeError`` is a bug and is reported as such.
"""

from __future__ import annotations


class HybridMoeError(Exception):
    """A failure the user can act on. ``what`` names the problem, ``hint`` the way out."""

    exit_code = 1

    def __init__(self, what: str, hint: str | None = None):
        super().__init__(what)
        self.what = what
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.what}\n  {self.hint}" if self.hint else self.what


class UsageError(HybridMoeError):
    """The command line or a description file is malformed (exit code 2)."""

    exit_code = 2


class ModelError(HybridMoeError):
    """A model path, config or weight file cannot be used."""


class ModelUnloadedError(ModelError):
    """Work asked of a model whose session was closed (or was closing while it ran)."""

    def __init__(self):
        super().__init__("the model was unloaded", "Load it again.")


class PromptTooLongError(ModelError):
    """The prompt does not fit the context (``at_least``: the count is a lower bound, from the
    text's length). A chat can leave out its oldest turns and try again."""

    def __init__(self, what: str, hint: str, *, prompt_tokens: int, context: int, at_least: bool = False):
        super().__init__(what, hint)
        self.prompt_tokens, self.context, self.at_least = prompt_tokens, context, at_least


class DamagedModelError(ModelError):
    """The model's weights compute nonsense (NaN or infinite logits): its file is damaged.
    Not the request's fault, so the API server answers it as a server error."""


class UnsupportedModelError(ModelError):
    """The model is readable but of an architecture or format we do not serve."""


class HardwareDescriptionError(UsageError):
    """A described (not detected) machine makes no sense."""


class PlanError(HybridMoeError):
    """A workload that cannot be planned at all (as opposed to a plan that does not fit)."""
