"""What a quorum change spends meeting its peers: the time to build a gloo process group
of N ranks (one process each, as in a job) through torch's TCPStore, which phalanx
used before, and through phalanx's own store, served by a manager server behind the
job token. The rebuild runs on every quorum change, so the second must be no slower.

Each trial builds one group of each kind under a fresh prefix, from a common start
(a barrier) to the last rank's first all-reduce done; reports the median, min and
max over the trials.

    python benches/rendezvous.py [--sizes 2 4 8] [--trials 10]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from datetime import timedelta

from harness import free_port, report

TOKEN = "bench-token"
HOST = "127.0.0.1"


def build_over_tcpstore(address: str, prefix: str, rank: int, size: int, timeout: timedelta):
    """The process group as phalanx built it before: a TCPStore client per rebuild."""
    import torch.distributed as dist

    from phalanx.process_group import gloo_group

    host, _, port = address.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    return gloo_group(dist.PrefixStore(prefix, store), rank, size, timeout, HOST), store


def build_over_phalanx(address: str, prefix: str, rank: int, size: int, timeout: timedelta):
    """The process group as phalanx builds it now (`process_group._connect`)."""
    from phalanx.process_group import Membership, _connect

    return _connect(Membership(address, prefix, rank, size), "gloo", timeout, HOST, TOKEN)


BUILDERS = {"tcpstore": build_over_tcpstore, "phalanx": build_over_phalanx}


def worker(rank: int, tasks, results, barriers) -> None:
    """Builds the groups it is told to, timing each from the barrier to its first
    all-reduce done; None ends it."""
    import torch

    timeout = timedelta(seconds=30)
    while (task := tasks.get()) is not None:
        kind, address, prefix, size = task
        barriers[size].wait()
        started = time.monotonic()
        group, store = BUILDERS[kind](address, prefix, rank, size, timeout)
        group.allreduce([torch.ones(1)]).wait()
        results.put((started, time.monotonic()))
        del group, store


def summary(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    most = max(args.sizes)

    # The ranks are forked before this process starts anything of phalanx's: the
    # threads of its runtime would not survive a fork.
    ctx = mp.get_context("fork")
    queues = [ctx.Queue() for _ in range(most)]
    results = ctx.Queue()
    barriers = {size: ctx.Barrier(size) for size in args.sizes}
    procs = [
        ctx.Process(target=worker, args=(rank, queues[rank], results, barriers), daemon=True)
        for rank in range(most)
    ]
    for proc in procs:
        proc.start()

    import torch.distributed as dist

    from phalanx import _core

    port = free_port()
    tcpstore = dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False)
    addresses = {"tcpstore": f"{HOST}:{port}"}
    lighthouse = _core.LighthouseServer(bind=f"{HOST}:0", token=TOKEN)
    manager = _core.ManagerServer("bench", lighthouse.address, bind=f"{HOST}:0", token=TOKEN)
    addresses["phalanx"] = manager.address

    def build(kind: str, size: int, trial: int) -> float:
        for rank in range(size):
            queues[rank].put((kind, addresses[kind], f"{kind}/n{size}/t{trial}", size))
        spans = [results.get(timeout=120) for _ in range(size)]
        return max(end for _, end in spans) - min(start for start, _ in spans)

    times: dict[str, dict[int, list[float]]] = {kind: {} for kind in BUILDERS}
    try:
        for size in args.sizes:
            build("tcpstore", size, -1)  # warm-up: first connections, first gloo use
            build("phalanx", size, -1)
            for trial in range(args.trials):
                # Alternating, so that a slow moment of the machine hits both alike.
                for kind in BUILDERS:
                    times[kind].setdefault(size, []).append(build(kind, size, trial))
    finally:
        for q in queues:
            q.put(None)
        for proc in procs:
            proc.join(10)
        manager.shutdown()
        lighthouse.shutdown()
        del tcpstore

    result = {
        "bench": "rendezvous",
        "trials": args.trials,
        "sizes": {
            str(size): {kind: summary(times[kind][size]) for kind in BUILDERS}
            for size in args.sizes
        },
    }
    rows = []
    for size in args.sizes:
        for kind in BUILDERS:
            s = result["sizes"][str(size)][kind]
            rows.append(
                (
                    f"{size} ranks, {kind} (ms median [min, max])",
                    f"{s['median_ms']:.1f} [{s['min_ms']:.1f}, {s['max_ms']:.1f}]",
                )
            )
    report("gloo group build: TCPStore vs phalanx store", rows, result)


if __name__ == "__main__":
    main()
