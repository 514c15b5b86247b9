"""How long a quorum round takes: every group asks for the next quorum; the time from
the last request sent to the last answer received.

    python benches/quorum_latency.py --replicas 32

Steady rounds keep the same membership; change rounds have a group join, or leave
(its heartbeat stream dropped, as on a crash). The lighthouse runs in its own process;
the groups are driven from Rust, each on its own connection and asking on its
heartbeat stream as a manager server does, to keep the driver's overhead small. It is
not nil: the driver shares the machine's cores, and a request counts as sent when its
task queues the ask, before it reaches the socket, so the latency also holds the
driver's sending of the requests still queued then. Hence the lighthouse's own CPU
time per round too (averaged over every round, the connecting first one included),
which a busy machine moves less than the latency.
"""

from __future__ import annotations

import argparse

from phalanx._core import _testing

from harness import cli_flags, cpu_seconds, lighthouse_process, percentile, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--change-every", type=int, default=10)
    args = parser.parse_args()

    # Every group is in every quorum from the first round on.
    flags = cli_flags(join_timeout="1s", heartbeat_timeout="5s", min_replicas=args.replicas)
    with lighthouse_process(*flags) as (address, pid):
        cpu_before = cpu_seconds(pid)
        timings = _testing.bench_quorum_rounds(
            address, args.replicas, args.rounds, change_every=args.change_every
        )
        cpu_per_round = (cpu_seconds(pid) - cpu_before) / (len(timings) + 1)
    steady = [s * 1e3 for s, changed, _ in timings if not changed]
    change = [s * 1e3 for s, changed, _ in timings if changed]
    result = {
        "bench": "quorum_latency",
        "replicas": args.replicas,
        "steady_p50_ms": round(percentile(steady, 50), 3),
        "steady_p99_ms": round(percentile(steady, 99), 3),
        "change_p50_ms": round(percentile(change, 50), 3),
        "lighthouse_cpu_ms_per_round": round(cpu_per_round * 1e3, 3),
        "rounds": len(timings),
    }
    report(
        f"quorum round, {args.replicas} groups, {len(steady)} steady + {len(change)} change",
        [
            ("steady p50 (ms)", result["steady_p50_ms"]),
            ("steady p99 (ms)", result["steady_p99_ms"]),
            ("change p50 (ms)", result["change_p50_ms"]),
            ("change p99 (ms)", round(percentile(change, 99), 3)),
            ("lighthouse CPU per round (ms)", result["lighthouse_cpu_ms_per_round"]),
        ],
        result,
    )


if __name__ == "__main__":
    main()
