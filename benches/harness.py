"""What every benchmark shares: a lighthouse in its own process, percentiles, and the
report format (a human table, then one JSON object as the last line)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def lighthouse_process(*flags: str, port: int | None = None) -> Iterator[tuple[str, int]]:
    """Runs `phalanx lighthouse` in its own process; yields (address, pid)."""
    port = port or free_port()
    address = f"127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "lighthouse", "--bind", address, *flags],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for_http(f"http://{address}/status", timeout=15.0)
        yield address, proc.pid
    finally:
        stop(proc)


def wait_for_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def stop(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """Ends a process this benchmark started, continuing it first if it was stopped."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace)


def metric(address: str, name: str) -> float:
    """Reads one unlabelled sample from the lighthouse's /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5.0) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise KeyError(name)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def report(title: str, rows: Sequence[tuple[str, object]], result: dict) -> None:
    width = max(len(name) for name, _ in rows)
    print(title)
    print("-" * len(title))
    for name, value in rows:
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{name:<{width}}  {shown}")
    print(json.dumps(result), flush=True)
