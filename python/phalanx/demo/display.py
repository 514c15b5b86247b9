"""The demo's live progress: one status line redrawn in place on a terminal, with
events printed above it; plain lines (a status line every few seconds) otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, stream: TextIO | None = None, every: float = 5.0):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        #: Seconds between status lines when the output is not a terminal.
        self.every = every if not self.tty else 0.1
        self._last = 0.0
        self._status = ""

    def event(self, text: str) -> None:
        """A line that stays: a failure, a restart, a recovery."""
        if self.tty:
            self.stream.write(f"\r\033[K{text}\n{self._status}")
        else:
            self.stream.write(f"{text}\n")
        self.stream.flush()

    def status(self, text: str, force: bool = False) -> None:
        """The current state; shown at most every `every` seconds unless forced."""
        self._status = text
        now = time.monotonic()
        if not force and now - self._last < self.every:
            return
        self._last = now
        if self.tty:
            self.stream.write(f"\r\033[K{text}")
        else:
            self.stream.write(f"{text}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._status:
            self.stream.write("\n")
            self.stream.flush()
