"""The launcher's fork server: one Python interpreter that imports torch and phalanx
once, then forks every rank the launcher starts. A rank, and above all a restarted
one, begins at its own `main()` in milliseconds instead of spending seconds of CPU
importing torch before it can heal.

Forking is safe here for the reason it is safe for torch's DataLoader workers: the
server has run no torch operation, initialised no accelerator and started no thread
pool; each rank does those itself, after the fork.

The launcher talks to the server over a SEQPACKET socket, one JSON message each way:

    launcher → server   {"argv": [...], "env": {...}}  + the write end of a pipe
                        (the rank's stdout and stderr)
    server → launcher   {"started": pid}  or  {"exited": pid, "code": returncode}

`argv` is what a new interpreter would get (`python -m module ...` or `python
script.py ...`); the rank runs it as `__main__` with `env` as its environment and
exits as that program would, through the interpreter's normal shutdown.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import time
from typing import BinaryIO

#: Where the launcher passes the server its end of the socket.
FD_VARIABLE = "PHALANX_FORK_SERVER_FD"

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


def _rank(order: dict, output: int) -> None:
    """In the forked child: the rank's own output and environment, then its program.
    Returns only by raising (SystemExit included), so the interpreter exits as the
    program would have."""
    die_with_parent()
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    become(order["argv"], order["env"])
    sys.exit(0)


def serve(channel: socket.socket) -> None:
    """Forks a rank per order until the launcher closes the channel."""
    for name in WARM_IMPORTS:
        importlib.import_module(name)
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


# -- the launcher's side ---------------------------------------------------------------


class ForkedRank:
    """A rank the server forked, with the part of `subprocess.Popen`'s interface the
    launcher uses. Its exit code comes from the server, which is its parent."""

    def __init__(self, server: ForkServer, pid: int, stdout: BinaryIO):
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._server = server

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
            self._server.pump(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """Starts the server process (it imports in the background) and asks it for ranks."""

    def __init__(self, start_timeout: float = 120.0):
        self.start_timeout = start_timeout
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, FD_VARIABLE: str(theirs.fileno()), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "phalanx.forkserver"],
            env=env,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
        theirs.close()
        self.channel = ours
        self._exits: dict[int, int] = {}
        #: The server closed its end (it exited): nothing more will come.
        self._gone = False

    def start(self, argv: list[str], env: dict[str, str]) -> ForkedRank:
        """Forks a rank running `argv`; raises ConnectionError if the server is gone."""
        read, write = os.pipe()
        try:
            order = json.dumps({"argv": argv, "env": env}).encode()
            socket.send_fds(self.channel, [order], [write])
        except OSError as e:
            os.close(read)
            raise ConnectionError(f"the fork server is gone: {e}") from e
        finally:
            os.close(write)
        deadline = time.monotonic() + self.start_timeout
        while (pid := self._receive(deadline - time.monotonic())) is None:
            if time.monotonic() >= deadline or self.process.poll() is not None:
                os.close(read)
                raise ConnectionError("the fork server did not start the rank")
        return ForkedRank(self, pid, os.fdopen(read, "rb", buffering=0))

    def pump(self, timeout: float = 0.0) -> None:
        """Takes in the server's reports of ranks that exited."""
        while self._receive(timeout) is not None or self._readable(0.0):
            timeout = 0.0

    def exit_code(self, pid: int) -> int | None:
        self.pump()
        if pid not in self._exits and self.process.poll() is not None:
            return -signal.SIGKILL  # its ranks died with it
        return self._exits.get(pid)

    def close(self) -> None:
        self.channel.close()
        self.process.kill()
        self.process.wait()

    def _readable(self, timeout: float) -> bool:
        if self._gone:
            return False
        ready, _, _ = select.select([self.channel], [], [], max(0.0, timeout))
        return bool(ready)

    def _receive(self, timeout: float) -> int | None:
        """One message: the pid of a started rank, or None (an exit, or nothing)."""
        if not self._readable(timeout):
            return None
        try:
            message = self.channel.recv(MESSAGE_BYTES)
        except OSError:
            return None
        if not message:
            self._gone = True  # end of stream: a closed socket stays readable forever
            return None
        report = json.loads(message)
        if "exited" in report:
            self._exits[report["exited"]] = report["code"]
            return None
        return report["started"]
