"""Holds idle TCP connections against listeners, as a flood from the network would:
`idle_flood.py COUNT HOST:PORT...` opens COUNT connections to each address, sends
nothing, prints {"event": "holding", ...} and keeps them until killed (at most
HOLD_S)."""

from __future__ import annotations

import json
import resource
import selectors
import socket
import sys
import time

BATCH = 500
HOLD_S = 300


def raise_fd_limit(wanted: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(wanted, soft), max(wanted, hard)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def flood(address: str, count: int, held: list[socket.socket]) -> int:
    """Opens `count` connections to `address`; how many were established."""
    host, _, port = address.rpartition(":")
    established = 0
    for start in range(0, count, BATCH):
        pending = selectors.DefaultSelector()
        for _ in range(min(BATCH, count - start)):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            s.connect_ex((host, int(port)))
            held.append(s)
            pending.register(s, selectors.EVENT_WRITE)
        while pending.get_map():
            ready = pending.select(timeout=3.0)
            if not ready:
                break  # the rest wait in a full backlog: held all the same
            for key, _ in ready:
                pending.unregister(key.fileobj)
                established += key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        pending.close()
    return established


def main() -> None:
    count, addresses = int(sys.argv[1]), sys.argv[2:]
    limit = raise_fd_limit(count * len(addresses) + 64)
    per_address = min(count, (limit - 64) // len(addresses))
    held: list[socket.socket] = []
    established = {a: flood(a, per_address, held) for a in addresses}
    print(json.dumps({"event": "holding", "per_address": per_address, "established": established}))
    sys.stdout.flush()
    time.sleep(HOLD_S)


if __name__ == "__main__":
    main()
