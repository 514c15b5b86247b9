"""The fork server process: one Python interpreter that imports torch and phalanx
once, then forks every rank the launcher starts. A rank, and above all a restarted
one, begins at its own `main()` in milliseconds instead of spending seconds of CPU
importing torch before it can heal.

Forking is safe here for the reason it is safe for torch's DataLoader workers: the
server has run no torch operation, initialised no accelerator and started no thread
pool; each rank does those itself, after the fork.

The messages it reads and writes: `phalanx.forkserver.wire`. `argv` is what a new
interpreter would get (`python -m module ...` or `python script.py ...`); the rank
runs it as `__main__` with `env` as its environment and exits with that program's
status, after its exit handlers and a flush of its output, but without the rest of
the interpreter's shutdown (what `multiprocessing` does for the processes it forks):
tearing down the heap inherited from the server, object by object, touches every
copy-on-write page of it and took a rank seconds of CPU after its last line.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import traceback
from typing import NoReturn

from phalanx.forkserver.wire import FD_VARIABLE, MESSAGE_BYTES, die_with_parent

#: What a phalanx rank imports before its first step; torch._dynamo is imported by
#: the first optimizer a program builds, torch.distributed.tensor by FSDP2.
WARM_IMPORTS = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.tensor",
    "phalanx.manager",
    "phalanx.recovery",
    "phalanx.ddp",
    "phalanx.optim",
    "phalanx.data",
)


def become(argv: list[str], env: dict[str, str]) -> None:
    """Runs `argv` (see `runnable`) as this process's program, with `env`."""
    os.environ.clear()
    os.environ.update(env)
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
        runpy.run_path(argv[1], run_name="__main__")


def _rank(order: dict, output: int) -> NoReturn:
    """In the forked child: the rank's own output and environment, then its program;
    exits with the status the program would have had."""
    die_with_parent()
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    try:
        become(order["argv"], order["env"])
        code = 0
    except SystemExit as e:
        code = exit_status(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:
        # As the interpreter does for an uncaught exception: the program's own hook
        # (phalanx's names the step a Manager was at, for `phalanx run`) prints it.
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_status(code: object) -> int:
    """The status of `sys.exit(code)`: an int as it is, None 0, anything else printed
    and 1.

    >>> exit_status(3), exit_status(None)
    (3, 0)
    """
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def serve(channel: socket.socket) -> None:
    """Forks a rank per order until the launcher closes the channel."""
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    # What the imports built stays put: a rank's collections then skip it, and its
    # pages stay shared with the server instead of copied on the first scan.
    gc.freeze()
    children: set[int] = set()
    selector = selectors.DefaultSelector()
    selector.register(channel, selectors.EVENT_READ)
    while True:
        if selector.select(timeout=0.05):
            message, fds, _, _ = socket.recv_fds(channel, MESSAGE_BYTES, 1)
            if not message:
                return  # the launcher is gone; the ranks die with this process
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                selector.close()
                channel.close()
                _rank(json.loads(message), fds[0])
            os.close(fds[0])
            children.add(pid)
            channel.send(json.dumps({"started": pid}).encode())
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            channel.send(json.dumps({"exited": pid, "code": code}).encode())


def main() -> None:
    die_with_parent()
    serve(socket.socket(fileno=int(os.environ.pop(FD_VARIABLE))))


if __name__ == "__main__":
    main()
