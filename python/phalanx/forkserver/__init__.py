"""The launcher's fork server: one Python interpreter that imported torch once forks
every rank, so that a restarted rank starts in milliseconds.

    wire.py     what both sides share: the messages, which commands can be forked
    server.py   the server process (`python -m phalanx.forkserver.server`)
    client.py   the launcher's side: `ForkServer`, and `ForkedRank` for each rank
"""

from phalanx.forkserver.client import ForkedRank, ForkServer
from phalanx.forkserver.wire import die_with_parent, runnable

__all__ = ["ForkServer", "ForkedRank", "die_with_parent", "runnable"]
