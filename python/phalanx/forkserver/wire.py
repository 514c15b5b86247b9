"""What the launcher and its fork server share: how the server finds its end of the
channel, how big a message may be, and which commands a forked rank can run.

The launcher talks to the server over a SEQPACKET socket, one JSON message each way:

    launcher → server   {"argv": [...], "env": {...}}  + the write end of a pipe
                        (the rank's stdout and stderr)
    server → launcher   {"started": pid}  or  {"exited": pid, "code": returncode}
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

#: Where the launcher passes the server its end of the socket.
FD_VARIABLE = "PHALANX_FORK_SERVER_FD"

MESSAGE_BYTES = 1 << 20
PR_SET_PDEATHSIG = 1


def runnable(argv: list[str]) -> bool:
    """Whether a forked rank can run `argv`: this interpreter, then a module or a script.

    >>> runnable([sys.executable, "-m", "phalanx.demo.train", "--lr", "0.1"])
    True
    >>> runnable([sys.executable, "-c", "print(1)"]), runnable(["./train.sh"])
    (False, False)
    """
    if len(argv) < 2 or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return False
    if argv[1] == "-m":
        return len(argv) >= 3
    return argv[1].endswith(".py")


def die_with_parent() -> None:
    """If the parent dies, so does this process (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
