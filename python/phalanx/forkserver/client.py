"""The launcher's side of the fork server: starts the server process and asks it
for ranks; a forked rank looks to the launcher like a `subprocess.Popen`."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import BinaryIO

from phalanx.forkserver.wire import FD_VARIABLE, MESSAGE_BYTES, die_with_parent


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

    def __init__(self, environ: Mapping[str, str] | None = None, start_timeout: float = 120.0):
        """`environ` (default: this process's) is the server's environment, whose
        PYTHONPATH makes the `sys.path` of every rank it forks."""
        self.start_timeout = start_timeout
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        base = os.environ if environ is None else environ
        env = {**base, FD_VARIABLE: str(theirs.fileno()), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "phalanx.forkserver.server"],
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
