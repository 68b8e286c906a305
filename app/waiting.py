"""What a command is waiting for, said on the terminal while it waits.

Loading PyTorch, measuring the memory bandwidth, reading a long prompt: waits of seconds that
would otherwise look like a hang. ``Waiting`` keeps one line on stderr saying what is being
done ("hybridmoe: loading PyTorch …"), replaced by the next and cleared before the result is
printed; when stderr is not a terminal (a script, a log) it says nothing.
"""

from __future__ import annotations

import sys
from typing import TextIO


class Waiting:
    def __init__(self, stream: TextIO | None = None, *, enabled: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = self.stream is not None and self.stream.isatty()
        self.enabled = enabled
        self._shown = False

    def say(self, doing: str) -> None:
        """Show ``doing`` ("loading PyTorch") in place of what was shown."""
        if self.enabled:
            self.stream.write(f"\r\033[Khybridmoe: {doing} …")
            self.stream.flush()
            self._shown = True

    def clear(self) -> None:
        if self.enabled and self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False
