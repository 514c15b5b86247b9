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


def environment(executable: str) -> str:
    """The environment (`sys.prefix`) that the interpreter at `executable`, run by that
    path, starts in, as Python finds it: a virtual environment's folder when its
    `pyvenv.cfg` is beside the path or one folder up, else the folder the interpreter
    the path resolves to is installed under. Two venvs' `python` resolve to the same
    interpreter, and start in different environments.

    >>> os.path.realpath(environment(sys.executable)) == os.path.realpath(sys.prefix)
    True
    """
    here = os.path.dirname(os.path.abspath(executable))
    for folder in (here, os.path.dirname(here)):
        if os.path.isfile(os.path.join(folder, "pyvenv.cfg")):
            return folder
    return os.path.dirname(os.path.dirname(os.path.realpath(executable)))


def ours(executable: str) -> bool:
    """Whether `executable` is this interpreter started in this environment: what a
    rank forked from this process runs as."""
    return os.path.realpath(executable) == os.path.realpath(sys.executable) and (
        os.path.realpath(environment(executable)) == os.path.realpath(sys.prefix)
    )


def runnable(argv: list[str]) -> bool:
    """Whether a forked rank can run `argv`: this interpreter in this environment, then
    a module or a script.

    >>> runnable([sys.executable, "-m", "phalanx.demo.train", "--lr", "0.1"])
    True
    >>> runnable([sys.executable, "-c", "print(1)"]), runnable(["./train.sh"])
    (False, False)
    """
    if len(argv) < 2 or not ours(argv[0]):
        return False
    if argv[1] == "-m":
        return len(argv) >= 3
    return argv[1].endswith(".py")


def die_with_parent() -> None:
    """If the parent dies, so does this process (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
