"""One replica group for the benchmarks: a manager server and one rank stepping at a
fixed pace. Prints one JSON line per event, stamped with wall-clock time:

    {"t": …, "kind": "quorum", "quorum_id": …, "participants": […]}
    {"t": …, "kind": "lost", "lost": […], "cause": …}

With `--stall-timeout`, the rank reports its progress as a Manager does
(`phalanx.progress`), and `phalanx run`'s thread-hang chaos (`phalanx.watchdog`) blocks
its stepping thread on SIGURG for `$PHALANX_CHAOS_HANG_THREAD_FOR` seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time

from phalanx import ManagerClient, ManagerServer, QuorumRequest
from phalanx.progress import Progress
from phalanx.watchdog import install_chaos

#: The stepping loop and the membership watcher both print; one line at a time, or
#: their lines interleave and the reader gets neither.
_stdout = threading.Lock()


def emit(kind: str, **fields: object) -> None:
    line = json.dumps({"t": time.time(), "kind": kind, **fields})
    with _stdout:
        print(line, flush=True)


def watch_membership(client: ManagerClient) -> None:
    while True:
        event = client.next_event(timeout=1.0)
        if event is not None:
            emit("lost", lost=event.lost, cause=event.cause, quorum_id=event.quorum_id)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--step-interval", type=float, default=0.1)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--stall-timeout", type=float, default=0.0)
    args = parser.parse_args()

    server = ManagerServer(args.replica_id, args.lighthouse, heartbeat_interval=0.1)
    client = ManagerClient(server.address)
    client.subscribe_events()
    threading.Thread(target=watch_membership, args=(client,), daemon=True).start()
    progress = None
    if args.stall_timeout > 0:
        progress = Progress(client.report_progress, group_rank=0, stall_timeout=args.stall_timeout)
        install_chaos(progress)
        progress.start()

    def waiting(what: str):
        if progress is None:
            return contextlib.nullcontext()
        return progress.waiting(what, args.timeout)

    step = 0
    while True:
        if progress is not None:
            progress.step_began(step)
        try:
            with waiting("the quorum"):
                q = client.quorum(QuorumRequest(group_rank=0, step=step, timeout=args.timeout))
        except (ConnectionError, TimeoutError) as e:
            emit("error", error=str(e))
            time.sleep(0.1)
            continue
        emit("quorum", quorum_id=q.quorum_id, participants=[m.replica_id for m in q.participants])
        with waiting("the vote"):
            decision = client.should_commit(0, step, True, timeout=args.timeout)
        if decision:
            step += 1
        time.sleep(args.step_interval)


if __name__ == "__main__":
    main()
