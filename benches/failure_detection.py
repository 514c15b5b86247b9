"""How fast the survivors learn that a group died: from SIGKILL (crash) or SIGSTOP
(hang) of one group's process until every surviving group's manager has been told by
the lighthouse's push, or has received a quorum without the victim.

    python benches/failure_detection.py --trials 3

Three groups step every 100 ms. The lighthouse runs with a 60 s join timeout to show
that crash detection does not depend on it; hang detection is bounded by the
heartbeat timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness import lighthouse_process, report, stop

HERE = Path(__file__).parent


class Group:
    """A replica group process whose JSON event lines are read into a queue."""

    def __init__(self, replica_id: str, lighthouse: str) -> None:
        self.replica_id = replica_id
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "replica_group.py"),
                "--replica-id",
                replica_id,
                "--lighthouse",
                lighthouse,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.events: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.events.put(json.loads(line))

    def wait_for(self, accept, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.replica_id}: nothing matching within {timeout} s")
            event = self.events.get(timeout=left)
            if accept(event):
                return event


def wait_until_all_in_quorum(groups: list[Group], timeout: float = 30.0) -> None:
    ids = sorted(g.replica_id for g in groups)
    for g in groups:
        g.wait_for(lambda e: e["kind"] == "quorum" and sorted(e["participants"]) == ids, timeout)


def told(group: Group, victim: str, since: float, timeout: float) -> float:
    """When `group` first learned that `victim` is gone, in seconds after `since`."""

    def learned(e: dict) -> bool:
        if e["t"] < since:
            return False
        if e["kind"] == "lost":
            return victim in e["lost"]
        return e["kind"] == "quorum" and victim not in e["participants"]

    return group.wait_for(learned, timeout)["t"] - since


def trial(lighthouse: str, how: signal.Signals, n: int, timeout: float) -> float:
    groups = [Group(f"{how.name.lower()}-{n}-{i}", lighthouse) for i in range(3)]
    try:
        wait_until_all_in_quorum(groups)
        time.sleep(0.5)
        victim, survivors = groups[0], groups[1:]
        t0 = time.time()
        os.kill(victim.proc.pid, how)
        return max(told(s, victim.replica_id, t0, timeout) for s in survivors)
    finally:
        for g in groups:
            stop(g.proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--join-timeout", type=float, default=60.0)
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0)
    args = parser.parse_args()

    flags = (
        "--join-timeout",
        f"{args.join_timeout}s",
        "--heartbeat-timeout",
        f"{args.heartbeat_timeout}s",
    )
    with lighthouse_process(*flags) as (address, _):
        bound = args.heartbeat_timeout + 10
        crash = [trial(address, signal.SIGKILL, n, bound) for n in range(args.trials)]
        hang = [trial(address, signal.SIGSTOP, n, bound) for n in range(args.trials)]
    result = {
        "bench": "failure_detection",
        "crash_detect_s": round(statistics.median(crash), 4),
        "hang_detect_s": round(statistics.median(hang), 4),
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "join_timeout_s": args.join_timeout,
    }
    report(
        f"failure detection, 3 groups stepping every 100 ms, {args.trials} trials each",
        [
            ("crash: median (s)", result["crash_detect_s"]),
            ("crash: max (s)", round(max(crash), 4)),
            ("hang: median (s)", result["hang_detect_s"]),
            ("hang: max (s)", round(max(hang), 4)),
            ("heartbeat timeout (s)", args.heartbeat_timeout),
            ("join timeout (s)", args.join_timeout),
        ],
        result,
    )


if __name__ == "__main__":
    main()
