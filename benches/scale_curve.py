"""How the lighthouse's costs grow with the job: a sweep over the number of groups.

    python benches/scale_curve.py --sizes 8,64,512,4096,10000

For each size N, a lighthouse of its own process and N groups driven from Rust, each
on a connection and a heartbeat stream of its own, asking for their quorums on it as
manager servers do:

- quorum rounds, steady (the same members) and with a change (a group joins, or
  crashes: its stream dropped), from the last request sent to the last answer;
- a crash: one more group joins the quorum and its stream is dropped; the time until
  every one of the N others was told on its stream (`MembershipLost`), per trial;
- the lighthouse's CPU per second of the rounds, and its resident memory at the end;
- the floor under both: the same N connections to a server in a process of its own
  with nothing behind them but TCP (`_testing.serve_floor`): each sends a small message
  and once all have, each gets one back (a round), or one more connection drops and
  every other gets one message (a loss told). No lighthouse moves fewer bytes through
  fewer sockets, so the lighthouse's time over the floor's says what it adds, and the
  floor's own growth from the first size what this machine adds whatever serves it.

Goal: detection and a change's round within 2× of their 8-group values up to 10,000
groups, and a steady round p99 ≤ 10 ms at 10,000. The driver shares the machine's
cores with the lighthouse, so the largest sizes measure both; the lighthouse's own
CPU time says what is its, the floor what any server's would be.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from phalanx._core import _testing

from harness import (
    cli_flags,
    cpu_seconds,
    floor_process,
    lighthouse_process,
    percentile,
    report,
)


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid`, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def rounds_for(groups: int) -> int:
    """Enough rounds for a p99 at small sizes, few enough at 10,000 groups."""
    return max(30, min(300, 30_000 // groups))


def measure(groups: int, trials: int, transport: str) -> dict[str, float]:
    # Every group in every quorum from the first round on. The driven groups beat only
    # when they ask, and 10,000 take a while to connect: a long heartbeat timeout keeps
    # the first ones live meanwhile (a crash is told when its stream drops, not by it).
    silent = {"heartbeat_timeout": "120s", "rollback_after": "120s"}
    # A join timeout far above a round: with thousands of groups on the driver's two
    # cores, one group can ask more than a second after the others, and a quorum
    # issued without it (the extra group makes up the count) leaves it asking alone
    # for a round the others never come to.
    flags = cli_flags(join_timeout="30s", min_replicas=groups, **silent)
    with lighthouse_process(*flags, "--max-groups", str(groups + 64)) as (address, pid):
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        timings = _testing.bench_quorum_rounds(
            address, groups, rounds_for(groups), change_every=5, timeout=120.0, transport=transport
        )
        cpu_per_s = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
        rss = rss_mib(pid)
    # The crashed group is in each trial's quorum: the quorum waits for it.
    flags = cli_flags(join_timeout="1s", min_replicas=groups + 1, **silent)
    with lighthouse_process(*flags, "--max-groups", str(groups + 64)) as (address, _):
        try:
            told = _testing.bench_crash_told(
                address, groups, trials, timeout=120.0, transport=transport
            )
            failed = None
        except (ConnectionError, TimeoutError, ValueError) as e:
            # Said in the report, with the rounds measured: the curve goes on.
            told, failed = [float("nan")], f"{type(e).__name__}: {e}"
    with floor_process(groups + 8) as floor:
        floor_rounds = [
            s * 1e3
            for s in _testing.bench_floor_rounds(floor, groups, rounds_for(groups), timeout=120.0)
        ]
        floor_told = _testing.bench_floor_told(floor, groups, trials, timeout=120.0)
    steady = [s * 1e3 for s, changed, _ in timings if not changed]
    change = [s * 1e3 for s, changed, _ in timings if changed]
    return {
        "groups": groups,
        "steady_p50_ms": round(percentile(steady, 50), 3),
        "steady_p99_ms": round(percentile(steady, 99), 3),
        "change_p50_ms": round(percentile(change, 50), 3),
        "crash_told_ms": round(statistics.median(told) * 1e3, 3),
        "crash_told_max_ms": round(max(told) * 1e3, 3),
        "crash_failed": failed,
        "lighthouse_cpu_per_s": round(cpu_per_s, 3),
        "lighthouse_rss_mib": round(rss, 1),
        "rounds": len(timings),
        "floor_steady_p50_ms": round(percentile(floor_rounds, 50), 3),
        "floor_steady_p99_ms": round(percentile(floor_rounds, 99), 3),
        "floor_told_ms": round(statistics.median(floor_told) * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,64,512,4096,10000")
    parser.add_argument("--trials", type=int, default=3, help="crashes per size")
    parser.add_argument("--quick", action="store_true", help="8 and 16 groups: a smoke run")
    parser.add_argument(
        "--transport",
        choices=["framed", "grpc"],
        default="framed",
        help="the groups' heartbeat streams (gRPC: HTTP/2, the older transport)",
    )
    args = parser.parse_args()
    sizes = [8, 16] if args.quick else [int(n) for n in args.sizes.split(",")]
    if not sizes or min(sizes) < 1:
        parser.error(f"--sizes {args.sizes!r}: give group counts, e.g. 8,64,512")

    rows = [measure(n, args.trials, args.transport) for n in sizes]
    base = rows[0]

    def ratio(row: dict[str, float], key: str) -> float:
        return round(row[key] / base[key], 2) if base[key] else float("nan")

    for row in rows:
        row["crash_told_ratio"] = ratio(row, "crash_told_ms")
        row["change_ratio"] = ratio(row, "change_p50_ms")
        row["floor_round_ratio"] = ratio(row, "floor_steady_p50_ms")
        row["floor_told_ratio"] = ratio(row, "floor_told_ms")
        row["steady_to_floor"] = round(row["steady_p50_ms"] / row["floor_steady_p50_ms"], 2)
        row["change_to_floor"] = round(row["change_p50_ms"] / row["floor_steady_p50_ms"], 2)
        row["told_to_floor"] = round(row["crash_told_ms"] / row["floor_told_ms"], 2)
    lines = []
    for row in rows:
        lines.append(
            (
                f"{row['groups']} groups",
                f"steady {row['steady_p50_ms']:.2f}/{row['steady_p99_ms']:.2f} ms, "
                f"change {row['change_p50_ms']:.2f} ms ({row['change_ratio']}x), "
                f"crash told {row['crash_told_ms']:.1f} ms ({row['crash_told_ratio']}x), "
                f"CPU {row['lighthouse_cpu_per_s']:.2f}/s, RSS {row['lighthouse_rss_mib']:.0f} MiB",
            )
        )
        lines.append(
            (
                "  the floor",
                f"round {row['floor_steady_p50_ms']:.2f}/{row['floor_steady_p99_ms']:.2f} ms "
                f"({row['floor_round_ratio']}x), told {row['floor_told_ms']:.1f} ms "
                f"({row['floor_told_ratio']}x); lighthouse over it: steady "
                f"{row['steady_to_floor']}x, change {row['change_to_floor']}x, "
                f"told {row['told_to_floor']}x",
            )
        )
    report(
        f"scale curve ({args.transport}): {', '.join(map(str, sizes))} groups, "
        f"ratios to {base['groups']}",
        lines,
        {"bench": "scale_curve", "transport": args.transport, "sizes": rows},
    )


if __name__ == "__main__":
    main()
