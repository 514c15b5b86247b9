"""A group that crashes the same way after every start is named, not only restarted.

A rank whose training loop raises prints its traceback and, where it hosts a Manager,
one line of phalanx's own that names the step (`marker`). `phalanx run` reads every
line of its ranks (`CrashReader`): what a life of a group died of is the last such
line, else the last line of its last traceback. `CrashLoop.of` finds the same crash
`CRASH_LOOP_AFTER` lives in a row. Pure: the launcher brings the lines and the exits.

>>> reader = CrashReader()
>>> for line in ["Traceback (most recent call last):", '  File "t.py", line 3, in <module>',
...              "RuntimeError: a variable was modified by an inplace operation"]:
...     reader.feed(line)
>>> reader.crash
Crash(kind='RuntimeError', message='a variable was modified by an inplace operation', step=None)
>>> reader.feed(marker("g0", 0, 47, "RuntimeError", "one of the variables ..."))
>>> print(reader.crash)
RuntimeError: one of the variables ... (at step 47)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

#: Lives in a row that died of the same exception (type and message) before the
#: launcher calls it a crash loop.
CRASH_LOOP_AFTER = 3

#: The longest message kept of a crash (its first line).
MESSAGE_CHARS = 300

_MARKER = re.compile(
    r"^phalanx: replica group '(?P<group>[^']*)' rank (?P<rank>\d+) crashed at step "
    r"(?P<step>\d+): (?P<kind>[\w.]+): (?P<message>.*)$"
)
_EXCEPTION = re.compile(r"^(?P<kind>[A-Za-z_][\w.]*)(: (?P<message>.*))?$")


@dataclass(frozen=True)
class Crash:
    """What one life of a group died of: the exception's type and message, and the
    step it was at, when a Manager said so."""

    kind: str
    message: str
    step: int | None = None

    def same(self, other: Crash | None) -> bool:
        """The same exception: type and message (the step may differ)."""
        return other is not None and (self.kind, self.message) == (other.kind, other.message)

    def __str__(self) -> str:
        at = "" if self.step is None else f" (at step {self.step})"
        return f"{self.kind}: {self.message}{at}"


def marker(replica_id: str, group_rank: int, step: int, kind: str, message: str) -> str:
    """The line a rank prints when an exception ends its training loop."""
    first = (message.strip().splitlines() or [""])[0][:MESSAGE_CHARS]
    who = f"replica group {replica_id!r} rank {group_rank}"
    return f"phalanx: {who} crashed at step {step}: {kind}: {first}"


class CrashReader:
    """Reads a life's output, line by line, for what it died of."""

    def __init__(self) -> None:
        self.crash: Crash | None = None
        self._in_traceback = False
        self._marked = False

    def feed(self, line: str) -> None:
        line = line.rstrip("\r\n")
        if (m := _MARKER.match(line)) is not None:
            self.crash = Crash(m["kind"], m["message"], int(m["step"]))
            self._marked, self._in_traceback = True, False
            return
        if line.startswith("Traceback (most recent call last):"):
            self._in_traceback = True
            return
        if not self._in_traceback or line.startswith((" ", "\t")):
            return
        # The first line after the frames names the exception.
        self._in_traceback = False
        if (m := _EXCEPTION.match(line)) is not None and not self._marked:
            self.crash = Crash(m["kind"], (m["message"] or "")[:MESSAGE_CHARS])


@dataclass(frozen=True)
class CrashLoop:
    """A group's last lives all died of one exception."""

    crash: Crash
    lives: int

    @classmethod
    def of(cls, crashes: Sequence[Crash | None]) -> CrashLoop | None:
        """The crash loop that `crashes` (a group's failed lives since it last
        committed, oldest first) ends in, if any.

        >>> boom = Crash("RuntimeError", "boom", 3)
        >>> CrashLoop.of([boom] * 3)
        CrashLoop(crash=Crash(kind='RuntimeError', message='boom', step=3), lives=3)
        >>> CrashLoop.of([boom, None, boom, boom]) is None
        True
        """
        if not crashes or crashes[-1] is None:
            return None
        last = crashes[-1]
        lives = 0
        for crash in reversed(crashes):
            if not last.same(crash):
                break
            lives += 1
        return cls(last, lives) if lives >= CRASH_LOOP_AFTER else None

    def __str__(self) -> str:
        return f"crash loop: {self.lives} lives in a row ended by {self.crash}"
