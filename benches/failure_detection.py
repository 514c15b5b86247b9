"""How fast the survivors learn that a group died: from SIGKILL (crash) or SIGSTOP
(hang) of one group's process, or from blocking its training thread while the process
lives (thread hang: `phalanx run --chaos hang-thread-every`), until every surviving
group's manager has been told by the lighthouse's push, or has received a quorum
without the victim.

    python benches/failure_detection.py --trials 3

Three groups step every 100 ms. The lighthouse runs with a 60 s join timeout to show
that crash detection does not depend on it; hang detection is bounded by the
heartbeat timeout, thread-hang detection by the stall timeout (goal: within it + 0.2 s).
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

from phalanx.watchdog import CHAOS_ENV, CHAOS_SIGNAL

from harness import cli_flags, lighthouse_process, report, stop

HERE = Path(__file__).parent


class Group:
    """A replica group process whose JSON event lines are read into a queue; a line
    that is not JSON is counted in `skipped_lines` and left out."""

    def __init__(self, replica_id: str, lighthouse: str, stall_timeout: float = 0.0) -> None:
        self.replica_id = replica_id
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "replica_group.py"),
                "--replica-id",
                replica_id,
                "--lighthouse",
                lighthouse,
                "--stall-timeout",
                str(stall_timeout),
            ],
            stdout=subprocess.PIPE,
            text=True,
            # Blocked for longer than the trial: the eviction ends it (or the trial).
            env={**os.environ, CHAOS_ENV: "600"},
        )
        self.events: queue.Queue[dict] = queue.Queue()
        self.skipped_lines = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                self.skipped_lines += 1
                print(
                    f"{self.replica_id}: skipped a line that is not JSON: {line!r}", file=sys.stderr
                )

    def wait_for(self, accept, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"{self.replica_id}: nothing matching within {timeout} s"
                ) from None
            if accept(event):
                return event

    def stop(self) -> None:
        """Ends the process and waits for the reader to reach the end of its output,
        so that `skipped_lines` is final."""
        stop(self.proc)
        self._reader.join(timeout=10.0)


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


def trial(
    lighthouse: str, how: signal.Signals, n: int, timeout: float, stall_timeout: float = 0.0
) -> tuple[float, int]:
    """Seconds until the last survivor learned of the victim, and the lines of the
    groups' output that were skipped. `CHAOS_SIGNAL` blocks the victim's stepping
    thread (its groups report progress, with `stall_timeout`)."""
    name = "thread" if how == CHAOS_SIGNAL else how.name.lower()
    groups = [Group(f"{name}-{n}-{i}", lighthouse, stall_timeout) for i in range(3)]
    try:
        wait_until_all_in_quorum(groups)
        time.sleep(0.5)
        victim, survivors = groups[0], groups[1:]
        t0 = time.time()
        os.kill(victim.proc.pid, how)
        detected = max(told(s, victim.replica_id, t0, timeout) for s in survivors)
    finally:
        for g in groups:
            g.stop()
    return detected, sum(g.skipped_lines for g in groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--join-timeout", type=float, default=60.0)
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0)
    parser.add_argument("--stall-timeout", type=float, default=3.0)
    args = parser.parse_args()

    flags = cli_flags(
        join_timeout=f"{args.join_timeout}s", heartbeat_timeout=f"{args.heartbeat_timeout}s"
    )
    with lighthouse_process(*flags) as (address, _):
        bound = args.heartbeat_timeout + 10
        crash = [trial(address, signal.SIGKILL, n, bound) for n in range(args.trials)]
        hang = [trial(address, signal.SIGSTOP, n, bound) for n in range(args.trials)]
        thread = [
            trial(address, CHAOS_SIGNAL, n, args.stall_timeout + 10, args.stall_timeout)
            for n in range(args.trials)
        ]
    crash_s = [round(seconds, 4) for seconds, _ in crash]
    hang_s = [round(seconds, 4) for seconds, _ in hang]
    thread_s = [round(seconds, 4) for seconds, _ in thread]
    result = {
        "bench": "failure_detection",
        "crash_detect_s": round(statistics.median(crash_s), 4),
        "hang_detect_s": round(statistics.median(hang_s), 4),
        "crash_trials_s": crash_s,
        "hang_trials_s": hang_s,
        "thread_hang_detect_s": round(statistics.median(thread_s), 4),
        "thread_hang_trials_s": thread_s,
        "thread_hang_over_stall_timeout_max_s": round(max(thread_s) - args.stall_timeout, 4),
        "skipped_lines": sum(skipped for _, skipped in crash + hang + thread),
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "stall_timeout_s": args.stall_timeout,
        "join_timeout_s": args.join_timeout,
    }
    report(
        f"failure detection, 3 groups stepping every 100 ms, {args.trials} trials each",
        [
            ("crash: trials (s)", ", ".join(f"{s:.3f}" for s in crash_s)),
            ("crash: median (s)", result["crash_detect_s"]),
            ("crash: max (s)", max(crash_s)),
            ("hang: trials (s)", ", ".join(f"{s:.3f}" for s in hang_s)),
            ("hang: median (s)", result["hang_detect_s"]),
            ("hang: max (s)", max(hang_s)),
            ("thread hang: trials (s)", ", ".join(f"{s:.3f}" for s in thread_s)),
            ("thread hang: median (s)", result["thread_hang_detect_s"]),
            (
                "thread hang: max over the stall timeout (s)",
                result["thread_hang_over_stall_timeout_max_s"],
            ),
            ("output lines skipped (not JSON)", result["skipped_lines"]),
            ("heartbeat timeout (s)", args.heartbeat_timeout),
            ("stall timeout (s)", args.stall_timeout),
            ("join timeout (s)", args.join_timeout),
        ],
        result,
    )


if __name__ == "__main__":
    main()
