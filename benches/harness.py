"""What every benchmark shares: a lighthouse in its own process, percentiles, and the
report format (a human table, then one JSON object as the last line)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple


def cli_flags(**options: object) -> list[str]:
    """`--name value` for each option, its underscores as dashes: a command line."""
    return [
        arg
        for name, value in options.items()
        for arg in (f"--{name.replace('_', '-')}", str(value))
    ]


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a bench run as one of its own workers: which side (`--worker`), its
    rank, its rendezvous port and its lighthouse."""
    parser.add_argument("--worker", choices=["torch", "phalanx"])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--lighthouse", default="")


def start_worker(script: Path, **options: object) -> subprocess.Popen:
    """`script --option value …` in a process of its own with one torch thread; its
    stdout, piped, is what `worker_results` reads."""
    return subprocess.Popen(
        [sys.executable, str(script), *cli_flags(**options)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def passed_on(args: object, *names: str) -> dict[str, object]:
    """The options `names` of a bench's parsed `args`, for its workers' command line."""
    return {name: getattr(args, name) for name in names}


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


@contextmanager
def floor_process(groups: int) -> Iterator[str]:
    """Runs the floor server (TCP and nothing behind it: `_testing.serve_floor`) in its
    own process, with room for `groups` connections; yields its address."""
    address = f"127.0.0.1:{free_port()}"
    serve = (
        "import sys; from phalanx._core import _testing; "
        "_testing.serve_floor(sys.argv[1], int(sys.argv[2]))"
    )
    proc = subprocess.Popen([sys.executable, "-c", serve, address, str(groups)])
    try:
        wait_for_tcp(address, timeout=15.0)
        yield address
    finally:
        stop(proc)


def wait_for_tcp(address: str, timeout: float) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


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


@dataclass(frozen=True)
class Link:
    """A network namespace joined to this one by a veth pair: `here` is this end's
    device, `there` the namespace's."""

    namespace: str
    here: str
    there: str
    here_ip: str
    there_ip: str


class NoLink(OSError):
    """A capped link could not be set up: it needs root, where network namespaces are
    allowed."""


def _ip(cmd: str) -> None:
    done = subprocess.run(cmd.split(), capture_output=True, text=True)
    if done.returncode != 0:
        raise NoLink(f"'{cmd}' failed: {done.stderr.strip() or done.returncode}")


@contextmanager
def capped_links(
    tag: str, subnets: Sequence[str], tbf: str, cap_here: bool = False
) -> Iterator[list[Link]]:
    """A network namespace per subnet ("10.x.y"), each joined to this one by a veth pair
    whose namespace end sends through `tc qdisc … tbf {tbf}` (and this end too where
    `cap_here`); all removed on the way out. Raises NoLink naming the command that
    failed."""
    undo: list[list[str]] = []
    try:
        links = []
        for i, subnet in enumerate(subnets):
            ns, here, there = f"{tag}n{i}", f"{tag}a{i}", f"{tag}b{i}"
            _ip(f"ip netns add {ns}")
            undo.append(["ip", "netns", "del", ns])
            _ip(f"ip link add {here} type veth peer name {there}")
            undo.append(["ip", "link", "del", here])
            for cmd in (
                f"ip link set {there} netns {ns}",
                f"ip addr add {subnet}.1/24 dev {here}",
                f"ip link set {here} up",
                f"ip netns exec {ns} ip addr add {subnet}.2/24 dev {there}",
                f"ip netns exec {ns} ip link set {there} up",
                f"ip netns exec {ns} ip link set lo up",
                f"ip netns exec {ns} tc qdisc add dev {there} root tbf {tbf}",
                *([f"tc qdisc add dev {here} root tbf {tbf}"] if cap_here else []),
            ):
                _ip(cmd)
            links.append(Link(ns, here, there, f"{subnet}.1", f"{subnet}.2"))
        yield links
    finally:
        for argv in reversed(undo):
            subprocess.run(argv, capture_output=True)


def metric(address: str, name: str) -> float:
    """Reads one unlabelled sample from the lighthouse's /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5.0) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise KeyError(name)


def cpu_seconds(pid: int) -> float:
    """CPU time of a process's threads so far, to the nanosecond.

    /proc/PID/stat counts in clock ticks (10 ms): a lighthouse that spends 5 ms a
    second reads as 0 or 10 ms over a one-second window. The scheduler's own count per
    thread (/proc/PID/task/TID/schedstat) is exact, but forgets a thread once it
    exits; the processes measured here keep their threads (a runtime's workers and
    the beat paths), so the sum over the live ones is what they spent. Where the
    kernel keeps no such count, the ticks it is.
    """
    if not os.path.exists(f"/proc/{pid}/schedstat"):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    total_ns = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total_ns += int(f.read().split()[0])
        except FileNotFoundError:
            continue  # the thread has just exited
    return total_ns / 1e9


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


class StepTimes(NamedTuple):
    median_ms: float
    """The median timed step's wall time."""
    cpu_ms: float
    """CPU per timed step, all the process's threads together."""
    threads_ms: dict[str, float]
    """CPU per timed step by thread name ("main" for the main thread); empty where
    /proc does not tell."""


def thread_cpu() -> dict[int, tuple[str, float]]:
    """Each live thread of this process: its id, and its name and CPU seconds so far
    (/proc's schedstat, in nanoseconds); empty where /proc does not tell. A Python
    thread goes by its `threading` name ("main" for the main thread), any other by
    the name the system knows it by."""
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    python_names[threading.main_thread().native_id] = "main"
    threads = {}
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # ended since the listing, or no schedstat
            continue
        threads[tid] = (python_names.get(tid, name), ns / 1e9)
    return threads


def cpu_by_thread_name(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds each thread name spent between two `thread_cpu` readings (threads
    of one name summed; a thread that ended in between is not counted)."""
    spent: dict[str, float] = {}
    for tid, (name, seconds) in after.items():
        spent[name] = spent.get(name, 0.0) + seconds - before.get(tid, (name, 0.0))[1]
    return spent


def timed_steps(
    step: Callable[[object, object], None], batches: Sequence, warmup: int, steps: int
) -> StepTimes:
    """Runs `step(x, y)` over `batches` for `warmup` steps, then `steps` timed ones, and
    times those. `step` must end when its work did (synchronize a device in it)."""
    times = []
    for i in range(warmup + steps):
        if i == warmup:
            # /proc first, so that reading it is not counted in the steps' CPU.
            threads, cpu = thread_cpu(), time.process_time()
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        step(x, y)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu
    by_name = cpu_by_thread_name(threads, thread_cpu())
    return StepTimes(
        statistics.median(times) * 1e3,
        cpu / steps * 1e3,
        {name: seconds / steps * 1e3 for name, seconds in by_name.items()},
    )


def mlp_and_batches(width: int, seed: int):
    """The benches' model (256 -> width -> width -> 1, the same initial weights for every
    seed) and 4 batches of 64 drawn from `seed`."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
    )
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(64, 256, generator=g), torch.randn(64, 1, generator=g))] * 4
    return model, batches


def worker_results(
    procs: Sequence[subprocess.Popen], what: str, timeout: float = 600.0
) -> list[dict]:
    """Waits for worker processes that print one JSON object last and returns those;
    kills any left on the way out (or past `timeout` seconds for all of them)."""
    results = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"{what} worker failed with exit code {p.returncode}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def slowest_median(procs: Sequence[subprocess.Popen], what: str) -> float:
    """The slowest worker's `median_ms` (the job's step time); see `worker_results`."""
    return max(r["median_ms"] for r in worker_results(procs, what))
