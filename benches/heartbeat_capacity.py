"""How many heartbeating groups one lighthouse carries, and what a beat costs it.

    python benches/heartbeat_capacity.py --replicas 10000 --hz 10

A separate load process keeps `--replicas` heartbeat streams open, each beating
`--hz` times a second and reading its leases, each on a connection of its own as real
groups connect. Meanwhile this process measures quorum rounds of `--quorum-groups`
other groups. The load runs at the lowest CPU priority (nice 19): it stands for groups
on other hosts, whose work would not take the lighthouse's cores; at 10,000 groups it
takes 0.75 of this machine's two cores, and at the same priority as the lighthouse
and the rounds' driver it pre-empts them (quorum p99 13–19 ms beside it, 6–9 niced).
The lighthouse's CPU time (from /proc) divided by the beats it counted
(from /metrics, read before and after `--beats-window` seconds of beats alone: a read
costs the lighthouse a third of a second at 10,000 groups, so it is read rarely)
gives its cost per beat; then quorum rounds run beside the beats. Every group live at
the end and none evicted in between says it carried them all.

Each run measures the heartbeat transports in turn, each with a lighthouse of its
own: datagrams (what groups use: a framed stream, its beats as UDP datagrams beside
it), framed (every beat on the stream) and gRPC (`Lighthouse.Heartbeat` over HTTP/2,
the yardstick; `--connections` fewer than the groups multiplexes its streams on
them). The ratios are the framed stream's and gRPC's cost per beat over the
datagrams' and the framed stream's.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import urllib.request

from phalanx._core import _testing

from harness import cli_flags, cpu_seconds, lighthouse_process, percentile, report, stop

LOAD = """
import os, sys
address, replicas, hz, seconds, connections, transport, nice = sys.argv[1:]
os.nice(int(nice))  # groups on other hosts: see above
from phalanx._core import _testing
print(_testing.bench_heartbeats(address, int(replicas), float(hz), float(seconds),
                               connections=int(connections), transport=transport), flush=True)
"""


#: How long the load may take to open its streams, on top of its `--seconds` of beats:
#: niced, it gets little CPU on a busy machine, and a run measures only once every
#: stream is open.
OPEN_WITHIN_S = 60.0


def scrape(address: str) -> dict[str, float]:
    """One read of /metrics (megabytes at 10,000 groups, a third of a second of the
    lighthouse's CPU, so read rarely): live groups, beats and evictions so far, and
    when, the middle of the read."""
    began = time.monotonic()
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30.0) as r:
        text = r.read().decode()
    counts = {"at": (began + time.monotonic()) / 2, "evictions": 0.0}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == "phalanx_lighthouse_live_replicas":
            counts["live"] = float(value)
        elif name == "phalanx_lighthouse_heartbeats_total":
            counts["beats"] = float(value)
        elif name == "phalanx_lighthouse_datagram_beats_total":
            counts["datagram_beats"] = float(value)
        elif name == "phalanx_lighthouse_datagram_leases_total":
            counts["datagram_leases"] = float(value)
        elif name.startswith("phalanx_lighthouse_evictions_total{"):
            counts["evictions"] += float(value)
    return counts


def measure(args: argparse.Namespace, transport: str) -> dict[str, float]:
    """One transport's run on a lighthouse of its own."""
    connections = args.connections or args.replicas
    flags = cli_flags(join_timeout="1s", heartbeat_timeout="5s")
    with lighthouse_process(*flags) as (address, pid):
        load = subprocess.Popen(
            [
                sys.executable,
                "-c",
                LOAD,
                address,
                str(args.replicas),
                str(args.hz),
                str(args.seconds + OPEN_WITHIN_S),
                str(connections),
                transport,
                str(args.nice),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            # Let every stream open before measuring.
            deadline = time.monotonic() + OPEN_WITHIN_S
            while scrape(address).get("live", 0) < args.replicas:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {transport} load did not open its streams in time")
                time.sleep(1.0)
            time.sleep(1.0)
            # The beats alone, then quorum rounds beside them.
            before, cpu0, t0 = scrape(address), cpu_seconds(pid), time.monotonic()
            time.sleep(args.beats_window)
            cpu1, t1, beaten = cpu_seconds(pid), time.monotonic(), scrape(address)
            timings = _testing.bench_quorum_rounds(
                address, args.quorum_groups, args.rounds, transport=transport
            )
            after = scrape(address)
        finally:
            stop(load)
    beats_per_s = (beaten["beats"] - before["beats"]) / (beaten["at"] - before["at"])
    cpu_per_s = (cpu1 - cpu0) / (t1 - t0)
    # Losses are counted over the beats alone; the rounds' own groups leave when they
    # are done, so afterwards it is the live count that says none of the load was lost.
    evicted = beaten["evictions"] - before["evictions"]
    latencies = [s * 1e3 for s, _, _ in timings]
    beats = beaten["beats"] - before["beats"]

    def counted(name: str) -> float:
        return beaten.get(name, 0.0) - before.get(name, 0.0)

    return {
        "datagram_share": counted("datagram_beats") / beats if beats else 0.0,
        "datagram_leases_per_beat": counted("datagram_leases") / beats if beats else 0.0,
        "heartbeats_per_s": beats_per_s,
        "us_per_beat": cpu_per_s / beats_per_s * 1e6 if beats_per_s else float("nan"),
        "quorum_p50_ms": percentile(latencies, 50),
        "quorum_p99_ms": percentile(latencies, 99),
        # Every group was live throughout: all of them at the end, none lost between.
        "all_live_throughout": min(beaten["live"], after["live"]) >= args.replicas and evicted == 0,
        "evicted_while_measured": evicted,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=10_000)
    parser.add_argument("--hz", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument(
        "--connections", type=int, default=None, help="gRPC's connections; default: one per group"
    )
    parser.add_argument("--quorum-groups", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument(
        "--beats-window", type=float, default=4.0, help="seconds of beats alone measured"
    )
    parser.add_argument("--runs", type=int, default=1, help="runs of the transports, interleaved")
    parser.add_argument(
        "--transports", default="datagrams,framed,grpc", help="comma-separated, of these"
    )
    parser.add_argument(
        "--nice", type=int, default=19, help="the load's niceness (19: see the module's docs)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="200 groups for a few seconds: a smoke run, its load not niced (on a busy "
        "machine a niced load can starve past the heartbeat timeout)",
    )
    args = parser.parse_args()
    if args.quick:
        args.replicas, args.seconds, args.rounds, args.beats_window = 200, 8.0, 30, 1.0
        args.nice = 0
    transports = args.transports.split(",")
    if not transports or not set(transports) <= {"datagrams", "framed", "grpc"}:
        parser.error(
            f"--transports {args.transports!r}: give some of datagrams, framed, grpc, "
            "comma-separated"
        )

    runs: dict[str, list[dict[str, float]]] = {t: [] for t in transports}
    failed: dict[str, str] = {}
    for _ in range(args.runs):
        for transport in transports:
            try:
                runs[transport].append(measure(args, transport))
            except TimeoutError as e:
                failed[transport] = str(e)

    def median(transport: str, key: str) -> float:
        values = [run[key] for run in runs[transport]]
        return statistics.median(values) if values else float("nan")

    result: dict[str, object] = {
        "bench": "heartbeat_capacity",
        "replicas": args.replicas,
        "hz": args.hz,
        "runs": args.runs,
    }
    rows = []
    for t in transports:
        if not runs[t]:
            result[t] = {"failed": failed[t]}
            rows.append((f"{t}: failed", failed[t]))
            continue
        us = [run["us_per_beat"] for run in runs[t]]
        result[t] = {
            "heartbeats_per_s": round(median(t, "heartbeats_per_s")),
            "lighthouse_cpu_us_per_beat": round(median(t, "us_per_beat"), 2),
            "us_per_beat_min_max": [round(min(us), 2), round(max(us), 2)],
            "quorum_p50_ms_under_load": round(median(t, "quorum_p50_ms"), 3),
            "quorum_p99_ms_under_load": round(median(t, "quorum_p99_ms"), 3),
            "all_live_throughout": all(run["all_live_throughout"] for run in runs[t]),
            "beats_as_datagrams": round(median(t, "datagram_share"), 3),
            "leases_as_datagrams_per_beat": round(median(t, "datagram_leases_per_beat"), 3),
            "evicted_while_measured": int(sum(run["evicted_while_measured"] for run in runs[t])),
            "runs_failed": args.runs - len(runs[t]),
        }
        rows += [
            (f"{t}: heartbeats / s", result[t]["heartbeats_per_s"]),
            (f"{t}: lighthouse CPU per beat (us)", result[t]["lighthouse_cpu_us_per_beat"]),
            (f"{t}: quorum p50 under load (ms)", result[t]["quorum_p50_ms_under_load"]),
            (f"{t}: quorum p99 under load (ms)", result[t]["quorum_p99_ms_under_load"]),
            (f"{t}: every group live throughout", result[t]["all_live_throughout"]),
        ]
        if t == "datagrams":
            rows.append((f"{t}: share of beats as datagrams", result[t]["beats_as_datagrams"]))
            leases = result[t]["leases_as_datagrams_per_beat"]
            rows.append((f"{t}: leases sent as datagrams per beat", leases))
    if runs.get("datagrams") and runs.get("framed"):
        ratio = median("framed", "us_per_beat") / median("datagrams", "us_per_beat")
        result["framed_over_datagrams_cpu_per_beat"] = round(ratio, 2)
        rows.append(("framed's CPU per beat / datagrams'", ratio))
    if runs.get("framed") and runs.get("grpc"):
        ratio = median("grpc", "us_per_beat") / median("framed", "us_per_beat")
        result["grpc_over_framed_cpu_per_beat"] = round(ratio, 2)
        rows.append(("gRPC's CPU per beat / framed's", result["grpc_over_framed_cpu_per_beat"]))
    report(
        f"heartbeat capacity: {args.replicas} groups at {args.hz:g} Hz, "
        f"{args.quorum_groups} groups in quorum rounds, {args.runs} run(s)",
        rows,
        result,
    )


if __name__ == "__main__":
    main()
