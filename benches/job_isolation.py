"""Whether one job's flood slows another job on the same lighthouse.

    python benches/job_isolation.py --rate 10000 --runs 5

One lighthouse, in its own process, serves jobs `a` and `b`. Job b's groups (driven
from Rust, each on its own connection and heartbeat stream, as in quorum_latency.py)
run quorum rounds; each run measures them three ways, one after the other:

- alone (the baseline);
- while job a floods the lighthouse with `--rate` requests a second (status calls
  and garbage quorum requests in turn, over 16 connections of its own);
- while the same flood comes as job b's own (what isolation is measured against:
  the job's own lock and deadlines are then in the flood's way);
- while the same flood goes to another lighthouse process (what the flood costs the
  machine alone: its generator and a lighthouse busy with it take the same cores,
  but none of b's lighthouse).

Reported: job b's quorum p50/p99 in each, and the ratio of its p99 under a's flood
to its baseline (median, min and max over the runs). Goal: within 2×. The flood,
the driver and the lighthouse share the machine's cores, so some slowing is the
cores' and not the lighthouse's: the flood elsewhere says how much, the flood of b's
own how much is the job's.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from phalanx._core import _testing

from harness import cli_flags, cpu_seconds, lighthouse_process, percentile, report

#: How long a flood runs before job b's rounds start, so that they meet it at full rate.
WARMUP_S = 0.5


def rounds_ms(address: str, groups: int, rounds: int) -> list[float]:
    """Job b's steady quorum rounds, in ms."""
    timings = _testing.bench_quorum_rounds(address, groups, rounds, job="b")
    return [s * 1e3 for s, changed, _ in timings if not changed]


def under_flood(
    address: str, job: str, rate: float, seconds: float, groups: int, rounds: int
) -> tuple[list[float], float, float, bool]:
    """Job b's rounds while `job` floods: (rounds in ms, requests sent a second,
    answered a second, whether the flood lasted past the last round)."""
    flood: dict[str, tuple[int, int]] = {}

    def run() -> None:
        flood["done"] = _testing.bench_flood(address, job, rate, seconds)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(WARMUP_S)
    started = time.monotonic()
    timings = rounds_ms(address, groups, rounds)
    covered = time.monotonic() - started + WARMUP_S < seconds
    thread.join()
    sent, answered = flood["done"]
    return timings, sent / seconds, answered / seconds, covered


def under_flood_elsewhere(
    address: str, other: str, rate: float, seconds: float, groups: int, rounds: int
) -> list[float]:
    """Job b's rounds at `address` while job a floods the lighthouse at `other`."""
    thread = threading.Thread(target=_testing.bench_flood, args=(other, "a", rate, seconds))
    thread.start()
    time.sleep(WARMUP_S)
    timings = rounds_ms(address, groups, rounds)
    thread.join()
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=10_000.0, help="flood requests a second")
    parser.add_argument("--groups", type=int, default=8, help="job b's groups")
    parser.add_argument("--rounds", type=int, default=400, help="job b's rounds per measure")
    parser.add_argument("--flood-seconds", type=float, default=4.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a short run, for the tests")
    args = parser.parse_args()
    if args.quick:
        args.rate, args.rounds, args.flood_seconds, args.runs = 2000.0, 60, 2.0, 1

    flags = cli_flags(join_timeout="1s", heartbeat_timeout="5s")
    runs = []
    with lighthouse_process(*flags) as (address, pid), lighthouse_process(*flags) as (elsewhere, _):
        for _ in range(args.runs):
            cpu = cpu_seconds(pid)
            alone = rounds_ms(address, args.groups, args.rounds)
            flood_args = (args.rate, args.flood_seconds, args.groups, args.rounds)
            other, sent, answered, covered = under_flood(address, "a", *flood_args)
            own, _, _, own_covered = under_flood(address, "b", *flood_args)
            beside = under_flood_elsewhere(address, elsewhere, *flood_args)
            runs.append(
                {
                    "alone_p50_ms": percentile(alone, 50),
                    "alone_p99_ms": percentile(alone, 99),
                    "other_flood_p50_ms": percentile(other, 50),
                    "other_flood_p99_ms": percentile(other, 99),
                    "own_flood_p99_ms": percentile(own, 99),
                    "flood_elsewhere_p99_ms": percentile(beside, 99),
                    "flood_sent_per_s": sent,
                    "flood_answered_per_s": answered,
                    "rounds_within_flood": covered and own_covered,
                    "lighthouse_cpu_s": cpu_seconds(pid) - cpu,
                }
            )

    def spread(key: str) -> dict[str, float]:
        values = [r[key] for r in runs]
        return {
            "median": round(statistics.median(values), 3),
            "min": round(min(values), 3),
            "max": round(max(values), 3),
        }

    for r in runs:
        r["ratio_p99_other_flood"] = r["other_flood_p99_ms"] / r["alone_p99_ms"]
        r["ratio_p99_own_flood"] = r["own_flood_p99_ms"] / r["alone_p99_ms"]
        r["ratio_p99_flood_elsewhere"] = r["flood_elsewhere_p99_ms"] / r["alone_p99_ms"]
    result = {
        "bench": "job_isolation",
        "rate": args.rate,
        "groups": args.groups,
        "runs": len(runs),
        "ratio_p99_other_flood": spread("ratio_p99_other_flood"),
        "ratio_p99_own_flood": spread("ratio_p99_own_flood"),
        "ratio_p99_flood_elsewhere": spread("ratio_p99_flood_elsewhere"),
        "alone_p99_ms": spread("alone_p99_ms"),
        "other_flood_p99_ms": spread("other_flood_p99_ms"),
        "flood_sent_per_s": spread("flood_sent_per_s"),
        "flood_answered_per_s": spread("flood_answered_per_s"),
        "rounds_within_flood": all(r["rounds_within_flood"] for r in runs),
    }
    m = {key: result[key]["median"] for key in result if isinstance(result[key], dict)}
    report(
        f"job b's quorum rounds ({args.groups} groups) beside a flood of "
        f"{args.rate:g} requests/s, {len(runs)} runs (medians)",
        [
            ("b alone p99 (ms)", m["alone_p99_ms"]),
            ("b, a flooding: p99 (ms)", m["other_flood_p99_ms"]),
            ("ratio to alone, a flooding", m["ratio_p99_other_flood"]),
            ("ratio to alone, b flooding itself", m["ratio_p99_own_flood"]),
            ("ratio to alone, a flooding another lighthouse", m["ratio_p99_flood_elsewhere"]),
            (
                "flood sent / answered per s",
                f"{m['flood_sent_per_s']:.0f} / {m['flood_answered_per_s']:.0f}",
            ),
            ("rounds all within the flood", result["rounds_within_flood"]),
        ],
        result,
    )


if __name__ == "__main__":
    main()
