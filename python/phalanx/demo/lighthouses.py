"""The demo's set of lighthouses (`phalanx demo --lighthouses 3`): served in this
process, one of them serving at a time, and the serving one stopped on a schedule
(`--kill-lighthouse-every`) and started again on its address a few seconds later, so
that the job fails over to another and back."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

from phalanx import _core

#: How long a stopped lighthouse stays down before it is started again.
DOWN_FOR = 5.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LighthouseSet:
    """`count` lighthouses on loopback; `addresses` is the list the groups take.

    >>> with LighthouseSet(3, token=None) as lighthouses:
    ...     len(lighthouses.addresses.split(","))
    3
    """

    def __init__(self, count: int, token: str | None, **options: float) -> None:
        self.token = token
        self.options = options
        self._peers = [f"127.0.0.1:{_free_port()}" for _ in range(count)]
        self.addresses = ",".join(self._peers)
        self._state = Path(tempfile.mkdtemp(prefix="phalanx-demo-lighthouses-"))
        self._servers: list[_core.LighthouseServer | None] = [self._start(i) for i in range(count)]
        self._stop = threading.Event()
        self._killer: threading.Thread | None = None

    def _start(self, i: int) -> _core.LighthouseServer:
        return _core.LighthouseServer(
            bind=self._peers[i],
            token=self.token,
            peers=self._peers,
            id=i + 1,
            state_file=str(self._state / f"lighthouse-{i + 1}.raft"),
            **self.options,
        )

    def serving(self) -> int | None:
        """The index of the lighthouse that serves now, if one does."""
        for i, address in enumerate(self._peers):
            if self._servers[i] is None:
                continue
            request = urllib.request.Request(f"http://{address}/status")
            if self.token:
                request.add_header("Authorization", f"Bearer {self.token}")
            try:
                with urllib.request.urlopen(request, timeout=1.0) as response:
                    view = json.load(response).get("lighthouses") or {}
            except OSError:
                continue
            if view.get("serving"):
                return i
        return None

    def kill_every(self, every: float, say: Callable[[str], None]) -> None:
        """Stops the serving lighthouse every `every` seconds, and starts it again
        `DOWN_FOR` seconds later on its address."""

        def run() -> None:
            while not self._stop.wait(every):
                i = self.serving()
                server = self._servers[i] if i is not None else None
                if server is None:
                    say("no lighthouse serves now; none stopped")
                    continue
                self._servers[i] = None
                server.shutdown()
                say(f"stopped the serving lighthouse {i + 1} at {self._peers[i]}")
                if self._stop.wait(DOWN_FOR):
                    return
                self._servers[i] = self._start(i)
                say(f"started lighthouse {i + 1} again at {self._peers[i]}")

        self._killer = threading.Thread(target=run, name="lighthouse-killer", daemon=True)
        self._killer.start()

    def close(self) -> None:
        self._stop.set()
        if self._killer is not None:
            self._killer.join(timeout=DOWN_FOR + 5)
        for server in self._servers:
            if server is not None:
                server.shutdown()
        shutil.rmtree(self._state, ignore_errors=True)

    def __enter__(self) -> LighthouseSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
