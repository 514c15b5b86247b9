"""What the phases of benches/gpu_check.py share: a phase's outcome (`Phase`, or
`PhaseFailed` with the reason for the table), the `--time-limit` each takes its time
from (`Deadline`, `reserve`), the check's own worker processes (`spawn`, `read_json`,
`end`), NCCL's settings for ranks sharing one GPU, and the figures' spread."""

from __future__ import annotations

import argparse
import json
import os
import selectors
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The check's script: its workers are the script again, run with `--worker`.
SCRIPT = Path(__file__).resolve().with_name("gpu_check.py")

GROUPS = 3

#: Seconds a phase may take besides its own work: processes starting (torch, a CUDA
#: context, NCCL) and stopping.
STARTUP_S = 90.0


def nccl_environ(index: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """What rank `index` of a job sharing one GPU sets before NCCL starts: a host id of
    its own, and NCCL's socket transport on loopback (the ranks are one host's; another
    network would be a detour, InfiniBand loopback one more thing to fail). A value
    already in `environ` (default: this process's) is kept, but not NCCL_HOSTID.

    >>> nccl_environ(2, {})["NCCL_HOSTID"], nccl_environ(2, {"NCCL_NET": "IB"})["NCCL_NET"]
    ('phalanx-gpu-check-2', 'IB')
    """
    environ = os.environ if environ is None else environ
    chosen = {
        "NCCL_NET": "Socket",
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_IB_DISABLE": "1",
        "NCCL_DEBUG": "WARN",
    }
    chosen = {k: environ.get(k, v) for k, v in chosen.items()}
    return {**chosen, "NCCL_HOSTID": f"phalanx-gpu-check-{index}"}


class PhaseFailed(Exception):
    """A phase could not finish; its message says why, for the table."""


@dataclass
class Phase:
    name: str
    ok: bool
    seconds: float
    rows: list[tuple[str, object]] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None


class Deadline:
    """The check's `--time-limit`: each phase takes what it needs of what is left."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def need(self, seconds: float, what: str) -> float:
        """`seconds`, or PhaseFailed when fewer are left."""
        if self.left() < seconds:
            raise PhaseFailed(
                f"{what} needs about {seconds:.0f} s and {self.left():.0f} s of --time-limit "
                "are left; give a larger --time-limit or fewer --phases"
            )
        return seconds


def reserve(args: argparse.Namespace, before: str) -> float:
    """Seconds kept for the phases after `before`."""
    later = args.phases[args.phases.index(before) + 1 :]
    need = {"heal": STARTUP_S / 3 + 20 * args.heal_repeat, "step": 80.0 * args.rounds}
    return sum(need.get(p, 0.0) for p in later)


def tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f"({path} could not be read)"
    return "\n    ".join(["", *text]) if text else "(nothing written)"


def spawn(role: str, log: Path, *flags: str) -> subprocess.Popen:
    """This script as one of its own workers; stderr to `log`, for a failure's reason."""
    with open(log, "ab") as err:
        return subprocess.Popen(
            [sys.executable, str(SCRIPT), "--worker", role, *flags],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )


def read_json(proc: subprocess.Popen, timeout: float, what: str, log: Path) -> dict:
    """The next JSON line `proc` prints, within `timeout` seconds."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        if not ready:
            raise PhaseFailed(f"{what} said nothing within {timeout:.0f} s; its log:{tail(log)}")
        proc.wait(5)
        raise PhaseFailed(f"{what} exited with {proc.returncode}; its log:{tail(log)}")
    return json.loads(line)


def end(procs: Sequence[subprocess.Popen]) -> None:
    """Ends worker processes this check started: their stdin closed, then killed."""
    for p in procs:
        if p.stdin and not p.stdin.closed:
            p.stdin.close()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def spread(values: Sequence[float], digits: int = 3) -> dict[str, float | None]:
    """Median, min and max (None for none)."""
    if not values:
        return {"median": None, "min": None, "max": None}
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def shown(s: dict[str, float | None], unit: str = "") -> str:
    if s["median"] is None:
        return "—"
    return f"{s['median']}{unit} ({s['min']}–{s['max']})"
