"""One replica group of world size 1, as a real process, for the tests to kill.

It hosts the group's manager server, and loops like a training loop without the
model: quorum -> (heal: jump to max_step) -> should_commit(True) -> step + 1. A call
that fails because the lighthouse is away or slow is simply retried; the process
never restarts. Prints one JSON line per event, flushed, on stdout:

    {"event": "ready", "pid": ..., "manager_address": ...}
    {"event": "step", "step": 3, "quorum_id": 2, "participants": ["a", "b"],
     "heal": false, "committed": true, "quorum_at": <unix s>, "t": <unix s>}
    {"event": "membership_lost", "quorum_id": 2, "lost": ["b"],
     "cause": "stream_broken", "t": <unix s>}
    {"event": "error", "call": "quorum", "kind": "ConnectionError", "message": ...}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import phalanx

_print_lock = threading.Lock()


def emit(**fields: object) -> None:
    with _print_lock:
        print(json.dumps(fields), flush=True)


def watch_events(client: phalanx.ManagerClient) -> None:
    """Prints membership-loss events as soon as they arrive, with their arrival time."""
    while True:
        try:
            event = client.next_event(timeout=0.2)
        except (ConnectionError, TimeoutError) as e:
            emit(event="error", call="next_event", kind=type(e).__name__, message=str(e))
            time.sleep(0.1)
            continue
        if event is not None:
            emit(
                event="membership_lost",
                quorum_id=event.quorum_id,
                lost=list(event.lost),
                cause=event.cause,
                t=time.time(),
            )


def run(args: argparse.Namespace) -> None:
    server = phalanx.ManagerServer(
        args.replica_id,
        args.lighthouse,
        heartbeat_interval=args.heartbeat_interval,
        connect_timeout=1.0,
    )
    client = phalanx.ManagerClient(server.address, connect_timeout=1.0)
    client.subscribe_events()
    threading.Thread(target=watch_events, args=(client,), daemon=True).start()
    emit(event="ready", pid=os.getpid(), manager_address=server.address)

    step = 0
    state_quorum_id = 0  # the quorum that committed `step`: with it, the state's identity
    while True:
        time.sleep(args.step_interval)
        try:
            result = client.quorum(
                phalanx.QuorumRequest(
                    group_rank=0,
                    step=step,
                    timeout=args.quorum_timeout,
                    state_quorum_id=state_quorum_id,
                )
            )
        except (ConnectionError, TimeoutError) as e:
            emit(event="error", call="quorum", step=step, kind=type(e).__name__, message=str(e))
            continue
        quorum_at = time.time()
        if result.heal:
            # Stands for loading the peers' state of max_step.
            step, state_quorum_id = result.max_step, result.max_state_quorum_id
        try:
            committed = client.should_commit(0, step, True, timeout=args.quorum_timeout).commit
        except (ConnectionError, TimeoutError) as e:
            emit(event="error", call="should_commit", kind=type(e).__name__, message=str(e))
            continue
        emit(
            event="step",
            step=step,
            quorum_id=result.quorum_id,
            participants=[m.replica_id for m in result.participants],
            replica_rank=result.replica_rank,
            heal=result.heal,
            max_step=result.max_step,
            committed=committed,
            quorum_at=quorum_at,
            t=time.time(),
        )
        if committed:
            step, state_quorum_id = step + 1, result.quorum_id


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--lighthouse", required=True, help="host:port of the lighthouse")
    parser.add_argument("--step-interval", type=float, default=0.05)
    parser.add_argument("--heartbeat-interval", type=float, default=0.05)
    parser.add_argument("--quorum-timeout", type=float, default=2.0)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
