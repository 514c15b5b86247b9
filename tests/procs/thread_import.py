"""Imports phalanx first in a thread that then ends, and calls into it from another:
as a data loader's thread, a notebook's executor or a server's handler would. Each
thread serves a lighthouse and asks it for its status (the core's runtime, sockets
and allocations in both). Exits 0 and prints "ok" when both threads got through."""

from __future__ import annotations

import threading


def serve_and_ask() -> None:
    import phalanx

    with phalanx.LighthouseServer(bind="127.0.0.1:0") as lighthouse:
        assert phalanx.LighthouseClient(lighthouse.address).status().quorums_issued == 0


for _ in range(2):
    thread = threading.Thread(target=serve_and_ask)
    thread.start()
    thread.join()
print("ok")
