"""How many heartbeating groups one lighthouse carries, and what a beat costs it.

    python benches/heartbeat_capacity.py --replicas 10000 --hz 10

A separate load process keeps `--replicas` heartbeat streams open, each beating
`--hz` times a second and reading its leases, each on a connection of its own as real
groups connect (`--connections` fewer shares them). Meanwhile this process measures
quorum rounds of `--quorum-groups` other groups. The lighthouse's CPU time (from /proc)
divided by the beats it counted (from /metrics) gives its cost per beat; the fewest
live groups seen during the measurement says whether it carried them all.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from phalanx._core import _testing

from harness import cli_flags, cpu_seconds, lighthouse_process, metric, percentile, report, stop

LOAD = """
import sys
from phalanx._core import _testing
address, replicas, hz, seconds, connections = sys.argv[1:]
print(_testing.bench_heartbeats(address, int(replicas), float(hz), float(seconds),
                               connections=int(connections)), flush=True)
"""


def live_during(address: str, until: float) -> int:
    """The fewest live groups the lighthouse counted, read every 0.2 s until `until`
    (once at least): the load's and, while they live, the quorum rounds' groups."""
    fewest = metric(address, "phalanx_lighthouse_live_replicas")
    while time.monotonic() < until:
        time.sleep(0.2)
        fewest = min(fewest, metric(address, "phalanx_lighthouse_live_replicas"))
    return int(fewest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=10_000)
    parser.add_argument("--hz", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--connections", type=int, default=None, help="default: one per group")
    parser.add_argument("--quorum-groups", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
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
                str(args.seconds),
                str(connections),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            # Let every stream open before measuring.
            deadline = time.monotonic() + args.seconds / 2
            while metric(address, "phalanx_lighthouse_live_replicas") < args.replicas:
                if time.monotonic() > deadline:
                    raise TimeoutError("the load did not open its streams in time")
                time.sleep(0.2)
            time.sleep(1.0)
            beats0, cpu0, t0 = (
                metric(address, "phalanx_lighthouse_heartbeats_total"),
                cpu_seconds(pid),
                time.monotonic(),
            )
            with ThreadPoolExecutor(1) as watch:
                fewest = watch.submit(live_during, address, t0 + 3.0)
                timings = _testing.bench_quorum_rounds(address, args.quorum_groups, args.rounds)
                fewest = fewest.result()
            beats1, cpu1, t1 = (
                metric(address, "phalanx_lighthouse_heartbeats_total"),
                cpu_seconds(pid),
                time.monotonic(),
            )
            load.wait(args.seconds + 30)
        finally:
            stop(load)
    beats = beats1 - beats0
    # The quorum rounds cost the lighthouse some CPU too, so this is an upper bound.
    us_per_beat = (cpu1 - cpu0) / beats * 1e6 if beats else float("nan")
    latencies = [s * 1e3 for s, _, _ in timings]
    result = {
        "bench": "heartbeat_capacity",
        "replicas": args.replicas,
        "heartbeats_per_s": round(beats / (t1 - t0)),
        "lighthouse_cpu_us_per_beat": round(us_per_beat, 2),
        "quorum_p99_ms_under_load": round(percentile(latencies, 99), 3),
        "connections": connections,
        "fewest_live_replicas": fewest,
    }
    report(
        f"heartbeat capacity: {args.replicas} groups at {args.hz:g} Hz, "
        f"{args.quorum_groups} groups in quorum rounds",
        [
            ("heartbeats / s", result["heartbeats_per_s"]),
            ("lighthouse CPU per beat (us)", result["lighthouse_cpu_us_per_beat"]),
            ("quorum p50 under load (ms)", round(percentile(latencies, 50), 3)),
            ("quorum p99 under load (ms)", result["quorum_p99_ms_under_load"]),
            ("fewest live groups while measured", fewest),
        ],
        result,
    )


if __name__ == "__main__":
    main()
