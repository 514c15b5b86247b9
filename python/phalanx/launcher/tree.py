"""Every process of one life of a replica group, for the signals that must reach all
of them: chaos's SIGKILL and SIGSTOP, and the launcher's stop.

A rank may not be the only process of its group. torchrun starts each worker in a
session of its own, so neither the rank's pid nor its process group reaches them;
`sh -c 'cd D && python train.py'` leaves `python` behind when `sh` dies. A life's
processes are therefore its ranks, every process that descends from one, and every
process started with the life's mark (`LIFE_VARIABLE`) in its environment, which
every program a rank starts inherits, even once its parent is gone (an orphan).

To SIGKILL them all, the life is frozen first: each member found is stopped, and the
table read again, until a reading finds no new one; a stopped process starts no
other, so the SIGKILL that follows leaves none behind.

`members` is the rule, over a table read once (`read_table`); `signal_life` does it.

>>> parents = {10: 1, 11: 10, 12: 11, 20: 1, 30: 1}
>>> sorted(members([10], parents, marked={30}))
[10, 11, 12, 30]
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable, Mapping

#: The environment variable that marks the processes of one life of a group.
LIFE_VARIABLE = "PHALANX_GROUP_LIFE"

#: Readings of the table before a SIGKILL gives up looking for more members (each
#: reading after the first finds only what started while the last was taken).
FREEZE_READINGS = 16


def members(roots: Iterable[int], parents: Mapping[int, int], marked: Iterable[int]) -> set[int]:
    """`roots`, the `marked` processes, and every process in `parents` (pid →
    parent pid) that descends from one of them."""
    found = set(roots) | set(marked)
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def read_table(mark: str, proc: str = "/proc") -> tuple[dict[int, int], set[int]]:
    """Each process's parent, and the processes started with `LIFE_VARIABLE=mark` in
    their environment (of those this user may read; none for the mark "")."""
    parents: dict[int, int] = {}
    marked: set[int] = set()
    needle = f"{LIFE_VARIABLE}={mark}".encode()
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"{proc}/{entry}/stat", "rb") as f:
                stat = f.read()
            # The name may hold spaces and parentheses: the fields follow the last ')'.
            parents[pid] = int(stat[stat.rindex(b")") + 2 :].split()[1])
            if mark:
                with open(f"{proc}/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        marked.add(pid)
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
    return parents, marked


def signal_life(roots: Iterable[int], mark: str, signum: int) -> set[int]:
    """Sends `signum` to every process of the life (`members`); for SIGKILL, freezes
    it first (see the module docstring). Returns the processes signalled."""
    roots = list(roots)
    if not roots and not mark:
        return set()
    if signum != signal.SIGKILL:
        targets = members(roots, *read_table(mark))
        _send(targets, signum)
        return targets
    stopped: set[int] = set()
    for _ in range(FREEZE_READINGS):
        new = members(roots, *read_table(mark)) - stopped
        if not new:
            break
        _send(new, signal.SIGSTOP)
        stopped |= new
    _send(stopped, signal.SIGKILL)
    return stopped


def _send(pids: Iterable[int], signum: int) -> None:
    for pid in pids:
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
