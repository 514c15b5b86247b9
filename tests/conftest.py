"""Fixtures shared by the binding tests: free ports, an in-process lighthouse, and
real child processes (replica groups, a lighthouse) whose output lines are read with
a deadline and which are always reaped, even when a test fails half-way."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import phalanx

TESTS = Path(__file__).resolve().parent
#: The processes the tests start (training ranks, state sources, probes). Tests also
#: import their helpers (a model, a state digest), so the folder is on the path.
PROCS = TESTS / "procs"
sys.path.insert(0, str(PROCS))
GROUP_PROCESS = PROCS / "group_process.py"

# Short enough that a failure is seen in well under a second, long enough for 2 cores.
JOIN_TIMEOUT = 0.2
HEARTBEAT_TIMEOUT = 1.0
HEARTBEAT_INTERVAL = 0.05
STEP_INTERVAL = 0.05


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(phalanx._core, "_testing"):
        raise pytest.UsageError(
            "phalanx._core was built without the cargo feature `testing`, whose private "
            "_testing module the tests use (a wheel leaves it out): install with "
            'pip install -e ".[test]" -C maturin.build-args="--features python,testing"'
        )


def free_port() -> int:
    """A loopback port that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    """The environment for child processes: unbuffered, and free of any PHALANX_*
    setting of the machine running the tests (the CLI reads those as defaults)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def lighthouse_argv(bind: str, *flags: str) -> list[str]:
    """The command line of `phalanx lighthouse` listening on `bind`."""
    return [sys.executable, "-m", "phalanx", "lighthouse", "--bind", bind, *flags]


@contextlib.contextmanager
def phalanx_run(
    *args: str, env: dict[str, str] | None = None, **popen
) -> Iterator[subprocess.Popen]:
    """`python -m phalanx run *args` from the repository root, its output read as text,
    with `env` added to `child_env()`; killed at the end of the block if it still runs,
    and always reaped."""
    with subprocess.Popen(
        [sys.executable, "-m", "phalanx", "run", *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**child_env(), **(env or {})},
        cwd=TESTS.parent,
        **popen,
    ) as proc:
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()


def run_demo(out: Path, *options: str, timeout: float = 110) -> subprocess.CompletedProcess:
    """`python -m phalanx demo --out OUT *options` from the repository root, to its end;
    its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "phalanx", "demo", "--out", str(out), *options],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        cwd=TESTS.parent,
    )


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A file system of `size` (tmpfs) mounted at `where` for the block: a disk that
    fills up. Needs root (CI runs as root); skips with that reason otherwise."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root); not run as root here")
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def http_get(
    url: str, token: str | None = None, timeout: float = 5.0, accept: str | None = None
) -> tuple[int, str]:
    """GET `url`; returns (status, body) for any status, 401 included."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if accept:
        headers["Accept"] = accept
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> object:
    """Polls `condition` until it is truthy; fails the test with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) process `pid` has used so far; Linux only."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Child:
    """A child process whose stdout lines are collected by a reader thread.

    Lines that parse as JSON objects are kept as dicts, others as {"text": line}.
    Every wait is bounded; `close()` reaps the process whatever state it is in.
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**child_env(), **(env or {})},
            cwd=TESTS.parent,
        )
        self.pid = self.proc.pid
        self.stopped = False
        self.lines: list[dict] = []
        self.stderr: list[str] = []
        self._new: queue.Queue[dict] = queue.Queue()
        self._readers = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_stdout(self) -> None:
        for raw in self.proc.stdout:
            raw = raw.rstrip("\n")
            try:
                line = json.loads(raw)
            except ValueError:
                line = None
            if not isinstance(line, dict):
                line = {"text": raw}
            line["read_at"] = time.time()
            self.lines.append(line)
            self._new.put(line)

    def _read_stderr(self) -> None:
        for raw in self.proc.stderr:
            self.stderr.append(raw.rstrip("\n"))

    def expect(self, predicate: Callable[[dict], bool], timeout: float, what: str) -> dict:
        """The next line (not seen by an earlier `expect`) that satisfies `predicate`."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"{self.name}: no line within {timeout} s: {what}\n{self.describe()}")
            try:
                line = self._new.get(timeout=min(left, 0.1))
            except queue.Empty:
                if self.proc.poll() is not None and self._new.empty():
                    self._readers[0].join(timeout=1.0)
                    if self._new.empty():
                        pytest.fail(
                            f"{self.name} exited ({self.proc.returncode}) while waiting for: "
                            f"{what}\n{self.describe()}"
                        )
                continue
            if predicate(line):
                return line

    def signal(self, signum: int) -> None:
        """Sends `signum` to this child (and only to it)."""
        os.kill(self.pid, signum)
        if signum == signal.SIGSTOP:
            self.stopped = True
        elif signum == signal.SIGCONT:
            self.stopped = False

    def wait(self, timeout: float) -> int:
        """Waits for the exit, then for the last output lines to be read."""
        code = self.proc.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=5)
        return code

    def describe(self, last: int = 15) -> str:
        out = "\n".join(json.dumps(line) for line in self.lines[-last:])
        err = "\n".join(self.stderr[-last:])
        return f"--- {self.name} stdout (last {last}) ---\n{out}\n--- stderr ---\n{err}"

    def close(self) -> None:
        if self.proc.poll() is None:
            if self.stopped:
                os.kill(self.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)
        for reader in self._readers:
            reader.join(timeout=5)
        self.proc.stdout.close()
        self.proc.stderr.close()


# -- groups as threads of this process ------------------------------------------------


def in_groups(
    fn: Callable[[str, threading.Barrier], object], names: tuple[str, ...] = ("a", "b")
) -> list:
    """Runs `fn(replica_id, barrier)` for each group at once, each on its own thread;
    `barrier` is for `leave_together`."""
    barrier = threading.Barrier(len(names))
    with ThreadPoolExecutor(len(names)) as pool:
        futures = [pool.submit(fn, name, barrier) for name in names]
        return [f.result(timeout=90) for f in futures]


def leave_together(manager: phalanx.Manager, barrier: threading.Barrier) -> None:
    """Shuts `manager` down once every group is done: a group that leaves while a
    peer still votes on the last sync makes the peer discard it (its death, as far
    as the lighthouse can tell)."""
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait(timeout=30)
    manager.shutdown()


def manager_for(
    lighthouse: phalanx.LighthouseServer, name: str, timeout: float = 10.0, **kw
) -> phalanx.Manager:
    return phalanx.Manager(replica_id=name, lighthouse=lighthouse.address, timeout=timeout, **kw)


@pytest.fixture
def lighthouse2():
    """A lighthouse that waits for two groups, so that every quorum holds both."""
    with phalanx.LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout=JOIN_TIMEOUT, heartbeat_timeout=2.0
    ) as server:
        yield server


@pytest.fixture
def spawn() -> Iterator[Callable[..., Child]]:
    """Starts child processes; every one is killed and reaped when the test ends."""
    children: list[Child] = []

    def start(name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        child = Child(name, argv, env)
        children.append(child)
        return child

    try:
        yield start
    finally:
        for child in children:
            child.close()


@pytest.fixture
def start_group(spawn: Callable[..., Child]) -> Callable[..., Child]:
    """Starts tests/procs/group_process.py: one replica group (W=1) stepping in a loop."""

    def start(replica_id: str, lighthouse_address: str, *extra: str) -> Child:
        argv = [
            sys.executable,
            str(GROUP_PROCESS),
            "--replica-id",
            replica_id,
            "--lighthouse",
            lighthouse_address,
            "--step-interval",
            str(STEP_INTERVAL),
            "--heartbeat-interval",
            str(HEARTBEAT_INTERVAL),
            *extra,
        ]
        return spawn(replica_id, argv)

    return start


@pytest.fixture
def start_lighthouse_cli(spawn: Callable[..., Child]) -> Callable[..., tuple[Child, str]]:
    """Starts `python -m phalanx lighthouse`; returns the child and the address it printed."""

    def start(
        bind: str = "127.0.0.1:0", *extra: str, env: dict[str, str] | None = None
    ) -> tuple[Child, str]:
        argv = lighthouse_argv(bind, "--join-timeout", f"{JOIN_TIMEOUT}s")
        argv += ["--heartbeat-timeout", f"{HEARTBEAT_TIMEOUT}s", *extra]
        child = spawn(f"lighthouse({bind})", argv, env)
        line = child.expect(
            lambda line: "listening on" in line.get("text", ""), 10.0, "the listening line"
        )
        address = line["text"].split("listening on ", 1)[1].split(";", 1)[0]
        return child, address

    return start


@pytest.fixture
def lighthouse() -> Iterator[phalanx.LighthouseServer]:
    """A lighthouse served from the test process, with short timeouts."""
    with phalanx.LighthouseServer(
        bind="127.0.0.1:0",
        join_timeout=JOIN_TIMEOUT,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
    ) as server:
        yield server


def is_step(line: dict, participants: list[str] | None = None) -> bool:
    """A committed step line, with exactly `participants` when given."""
    return (
        line.get("event") == "step"
        and line["committed"]
        and (participants is None or line["participants"] == participants)
    )


def commit_after(
    children: list[Child],
    since: float,
    what: str,
    timeout: float = 30,
    *,
    margin: float = 0.5,
    participants: int | None = None,
) -> None:
    """Waits for each child to log a committed step more than `margin` seconds past
    `since` (a kill's time), in a quorum of `participants` groups when given: the
    survivors train on."""

    def commits(line: dict) -> bool:
        return (
            bool(line.get("committed"))
            and line["t"] > since + margin
            and participants in (None, line["participants"])
        )

    for child in children:
        child.expect(commits, timeout, what)


class Proxy:
    """A TCP relay on loopback in front of `target` ("host:port"), whose connections a
    test can cut at once (both ends see the connection close) while new ones go
    through as before: a network blip, not a dead server."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self._target, timeout=5.0)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open += [client, upstream]
                self.connections += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> int:
        """Closes every connection open now; returns how many there were."""
        with self._lock:
            cut, self._open = self._open, []
        for s in cut:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        return len(cut) // 2

    def close(self) -> None:
        self._listener.close()
        self.cut()


@pytest.fixture
def proxy() -> Iterator[Callable[[str], Proxy]]:
    """Starts relays (see `Proxy`); all are closed when the test ends."""
    proxies: list[Proxy] = []

    def start(target: str) -> Proxy:
        proxies.append(Proxy(target))
        return proxies[-1]

    try:
        yield start
    finally:
        for p in proxies:
            p.close()


def write_token_file(path: Path, text: str, mode: int = 0o600) -> Path:
    """A job token file holding `text`, with `mode`."""
    path.write_text(text)
    path.chmod(mode)
    return path
