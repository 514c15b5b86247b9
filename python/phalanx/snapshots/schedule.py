"""When a snapshot is due, and which replica group writes it. Pure.

A snapshot interval is a number of committed steps or a duration. Either way the job
is cut into slots (slot k: the steps `k * N` to `(k + 1) * N - 1`, or the k-th
interval of wall-clock time), and the snapshot of slot k is written by one group of
the commit quorum, the k-th in turn: the work rotates over the groups, so a single
slow disk holds back one snapshot in n, never the job.

>>> every = Every.parse("100")
>>> every.slot(step=300, now=0.0), every.slot(step=301, now=0.0)
(3, None)
>>> writer(3, ["g0", "g1"]), writer(4, ["g0", "g1"])
('g1', 'g0')
>>> Every.parse("90s").slot(step=7, now=185.0)
2
>>> Every.parse("5m").seconds, Every.parse("1.5h").seconds
(300.0, 5400.0)
>>> Every.parse("0")
Traceback (most recent call last):
...
ValueError: snapshot_every='0': write a positive number of steps (e.g. 500) or a duration ...
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Every:
    """A snapshot interval: `steps` committed steps, or `seconds` of wall-clock time."""

    steps: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, value: int | str | timedelta) -> Every:
        """An interval from a count of steps (`500`, `"500"`) or a duration
        (`"90s"`, `"10m"`, `"1h"`, a `timedelta`); ValueError naming the fix."""
        if isinstance(value, timedelta):
            seconds = value.total_seconds()
            if seconds > 0:
                return cls(seconds=seconds)
        elif isinstance(value, int) and not isinstance(value, bool):
            if value > 0:
                return cls(steps=value)
        elif isinstance(value, str):
            text = value.strip().lower()
            if text.isdigit() and int(text) > 0:
                return cls(steps=int(text))
            match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smh])", text)
            if match and 0 < float(match.group(1)) < math.inf:
                return cls(seconds=float(match.group(1)) * _UNITS[match.group(2)])
        raise ValueError(
            f"snapshot_every={value!r}: write a positive number of steps (e.g. 500) or a "
            "duration (e.g. 90s, 10m, 1h)"
        )

    def slot(self, step: int, now: float) -> int | None:
        """The slot whose snapshot the state of committed step `step` may be, at
        wall-clock time `now`: by steps, only the slot's first step; by time, any
        step (the caller takes the first of each slot)."""
        if self.steps is not None:
            return step // self.steps if step > 0 and step % self.steps == 0 else None
        assert self.seconds is not None
        return int(now // self.seconds)

    def __str__(self) -> str:
        return f"{self.steps} steps" if self.steps is not None else f"{self.seconds:g} s"


def writer(slot: int, groups: Sequence[str]) -> str:
    """The group that writes the snapshot of `slot`, of the commit quorum's `groups`
    (every group sees them in the same order)."""
    return groups[slot % len(groups)]
