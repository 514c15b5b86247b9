"""Heal throughput: S MB of model-like state (a few hundred tensors of mixed sizes)
healed from K source processes into a freshly started receiver process, against a
plain gloo transfer of the same tensors in place and raw loopback TCP, measured in the
same run.

    python benches/recovery.py --size-mb 1024 --sources 1

Each source process builds the same state and serves it (phalanx.recovery.StateHost).
Each receiver is a new process holding its own tensors of the same shapes, as a
training process does; it times `heal()` from its start until every tensor is loaded
in place and every chunk verified, and records its peak memory above what it held
before. Bit-identity is checked afterwards (untimed) against the sources' digest.
Right after each heal come two yardsticks. First torch alone: a fresh gloo sender and
a fresh gloo receiver process, each holding the same tensors (the receiver's allocated
and touched, as the heal's are), build a gloo group of two and move every tensor with
`isend`/`irecv` straight into the receiver's tensors; only that transfer is timed, not
the group's rendezvous. `ratio_to_gloo_inplace` is the median over the runs of heal
throughput / gloo throughput (goal: 1.0 or more with one source). Then plain TCP
between two sockets moves the same number of bytes (the best of 2 and of as many
connections as the heal uses): `ratio_to_raw`. Each ratio pairs runs made one right
after the other, so that drifting load on a shared machine hits both sides alike (min
and max are reported too). `gb_per_s` is the median heal, `gloo_inplace_gb_per_s` and
`raw_tcp_gb_per_s` the median yardsticks.

    python benches/recovery.py --size-mb 256 --sources 3 --link-mbit 2000   # as root

puts each source in its own network namespace behind a veth link capped by tc, and
compares the heal from K sources with the heal from one ("recovery_links").
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from phalanx._core import _testing
from phalanx.recovery import StateHost, heal

from harness import Link, NoLink, capped_links, free_port, report

QUORUM_ID = 1
STEP = 100
LAYERS = 24


def model_like_shapes(size_mb: float) -> list[tuple[int, ...]]:
    """A transformer-shaped mix: per layer 4 projection matrices, 2 MLP matrices,
    biases and norms (12 tensors), then an embedding that brings the total to size."""
    target = int(size_mb * 2**20) // 4  # float32 elements
    d = 64
    while LAYERS * 12 * (d + 64) ** 2 < target * 0.8:
        d += 64
    shapes: list[tuple[int, ...]] = []
    for _ in range(LAYERS):
        shapes += [(d, d)] * 4 + [(d,)] * 4  # q, k, v, out; their biases
        shapes += [(4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # MLP up, down
        shapes += [(d,), (d,), (d,), (d,)]  # two norms: weight, bias
    used = sum(torch.Size(s).numel() for s in shapes)
    shapes.append((max(1, (target - used) // d), d))  # embedding
    return shapes


def build_state(shapes: list[tuple[int, ...]], fill: bool) -> dict[str, torch.Tensor]:
    """The tensors, touched. Sources fill them from a random block (fast, the same in
    every source); receivers hold other values, as a stale or fresh rank does."""
    block = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    state = {}
    for i, shape in enumerate(shapes):
        t = torch.empty(shape)
        flat = t.view(-1)
        if fill:
            for start in range(0, flat.numel(), block.numel()):
                n = min(block.numel(), flat.numel() - start)
                flat[start : start + n].copy_(block[:n]).add_(i)
        else:
            flat.fill_(-1.0)
        state[f"layer.{i}"] = t
    return state


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in state.values():
        n = t.numel() * t.element_size()
        h.update(memoryview((ctypes.c_char * n).from_address(t.data_ptr())))
    return h.hexdigest()


def rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_source(args: argparse.Namespace) -> None:
    state = build_state(model_like_shapes(args.size_mb), fill=True)
    host = StateHost(bind=args.bind)
    host.open(STEP, QUORUM_ID, {"model": state})
    print(json.dumps({"address": host.address, "digest": digest(state)}), flush=True)
    sys.stdin.read()  # serve until the driver closes our stdin
    host.shutdown()


def run_receiver(args: argparse.Namespace) -> None:
    state = build_state(model_like_shapes(args.size_mb), fill=False)
    before_kb = rss_kb("VmRSS")
    exact_peak = reset_peak_rss()
    stats = []
    started = time.perf_counter()
    healed = heal(
        args.addresses.split(","),
        STEP,
        QUORUM_ID,
        {"model": state},
        timeout=300.0,
        connections_per_source=args.connections_per_source,
        report=stats.append,
    )
    seconds = time.perf_counter() - started
    peak_kb = rss_kb("VmHWM") if exact_peak else rss_kb("VmRSS")
    in_place = sum(healed["model"][k] is state[k] for k in state)
    result = {
        "seconds": seconds,
        "bytes": stats[0].bytes,
        "tensors": len(state),
        "in_place": in_place,
        "fetch_seconds": stats[0].seconds,
        "refetches": stats[0].refetches,
        "peak_extra_rss_mb": max(0, peak_kb - before_kb) / 1024,
        "digest": digest(healed["model"]),
    }
    print(json.dumps(result), flush=True)


def run_gloo(args: argparse.Namespace) -> None:
    """One end of the gloo yardstick: the same tensors sent with torch.distributed's
    point-to-point calls over a gloo group of two, rank 1 receiving straight into its
    own (allocated, touched) tensors. Only the transfer is timed, from a barrier that
    both ends pass once the group is built until the last tensor has arrived."""
    import torch.distributed as dist

    sending = args.role == "gloo-sender"
    state = build_state(model_like_shapes(args.size_mb), fill=sending)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.gloo_port}",
        rank=0 if sending else 1,
        world_size=2,
    )
    try:
        dist.barrier()
        started = time.perf_counter()
        if sending:
            works = [dist.isend(t, dst=1) for t in state.values()]
        else:
            works = [dist.irecv(t, src=0) for t in state.values()]
        for work in works:
            work.wait()
        seconds = time.perf_counter() - started
    finally:
        dist.destroy_process_group()
    if not sending:
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        print(json.dumps({"seconds": seconds, "bytes": nbytes, "digest": digest(state)}))


def gloo_once(args: argparse.Namespace, digest: str) -> float:
    """Seconds of one gloo transfer of the state into a fresh receiver process."""
    port = str(free_port())
    ends = [spawn(role, args, "--gloo-port", port) for role in ("gloo-sender", "gloo-receiver")]
    outs = [end.communicate(timeout=600)[0] for end in ends]
    if any(end.returncode != 0 for end in ends):
        raise SystemExit(f"the gloo yardstick failed ({[end.returncode for end in ends]})")
    run = json.loads(outs[1].strip().splitlines()[-1])
    if run["digest"] != digest:
        raise SystemExit("the gloo yardstick delivered other bytes than the sources hold")
    return run["seconds"]


def spawn(role: str, args: argparse.Namespace, *extra: str, prefix=()) -> subprocess.Popen:
    argv = [sys.executable, __file__, "--role", role, "--size-mb", str(args.size_mb), *extra]
    return subprocess.Popen(
        [*prefix, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent,
    )


@contextmanager
def serving(args: argparse.Namespace, count: int, links: list[Link] | None = None):
    """Starts `count` source processes (each in its own network namespace behind a
    capped link when `links` is given); yields (addresses, digest); stops them."""
    sources = []
    try:
        for i in range(count):
            if links:
                prefix = ("ip", "netns", "exec", links[i].namespace)
                bind = f"{links[i].there_ip}:0"
                sources.append(spawn("source", args, "--bind", bind, prefix=prefix))
            else:
                sources.append(spawn("source", args))
        served = [json.loads(p.stdout.readline()) for p in sources]
        if len({s["digest"] for s in served}) != 1:
            raise SystemExit("the sources built different states")
        yield [s["address"] for s in served], served[0]["digest"]
    finally:
        for p in sources:
            p.stdin.close()
            p.wait(timeout=30)


def heal_once(args: argparse.Namespace, addresses: list[str], digest: str) -> dict:
    """Heals into one fresh receiver process; checks its result."""
    receiver = spawn(
        "receiver",
        args,
        "--addresses",
        ",".join(addresses),
        "--connections-per-source",
        str(args.connections_per_source),
    )
    out, _ = receiver.communicate(timeout=600)
    if receiver.returncode != 0:
        raise SystemExit(f"the receiver failed ({receiver.returncode})")
    run = json.loads(out.strip().splitlines()[-1])
    if run["digest"] != digest:
        raise SystemExit("the healed state differs from the sources'")
    return run


def heal_runs(args: argparse.Namespace, addresses: list[str], digest: str) -> list[dict]:
    """Heals into `args.repeat` fresh receiver processes."""
    return [heal_once(args, addresses, digest) for _ in range(args.repeat)]


def raw_seconds(nbytes: int, connection_counts: list[int]) -> float:
    """Plain TCP moving `nbytes`: the best of one try with each connection count."""
    return min(_testing.bench_raw_tcp(nbytes, n) for n in connection_counts)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}, {max(values):.3f})"


def drive(args: argparse.Namespace) -> None:
    """Each heal is followed at once by its two yardsticks, plain gloo in place and
    raw TCP, so that all three see the same machine (on a shared machine the load
    drifts between runs); the ratio of each pair is what the median, min and max are
    taken over."""
    if args.link_mbit:
        return drive_links(args)
    connections = args.sources * args.connections_per_source
    counts = sorted({2, connections})
    runs = []
    with serving(args, args.sources) as (addresses, digest):
        for _ in range(args.repeat):
            run = heal_once(args, addresses, digest)
            run["gloo_seconds"] = gloo_once(args, digest)
            run["raw_seconds"] = raw_seconds(run["bytes"], counts)
            run["ratio"] = run["raw_seconds"] / run["seconds"]
            run["gloo_ratio"] = run["gloo_seconds"] / run["seconds"]
            runs.append(run)
    nbytes = runs[0]["bytes"]
    ratios = [r["ratio"] for r in runs]
    gloo_ratios = [r["gloo_ratio"] for r in runs]
    median_gloo = nbytes / statistics.median(r["gloo_seconds"] for r in runs) / 1e9
    median_seconds = statistics.median(r["seconds"] for r in runs)
    median_raw = nbytes / statistics.median(r["raw_seconds"] for r in runs) / 1e9
    best = min(runs, key=lambda r: r["seconds"])
    rows = [
        ("state", f"{nbytes / 2**20:.0f} MiB in {best['tensors']} tensors"),
        ("sources x connections", f"{args.sources} x {args.connections_per_source}"),
        ("heal runs (s)", ", ".join(f"{r['seconds']:.3f}" for r in runs)),
        ("gloo in place runs (s)", ", ".join(f"{r['gloo_seconds']:.3f}" for r in runs)),
        ("raw TCP runs (s)", ", ".join(f"{r['raw_seconds']:.3f}" for r in runs)),
        (
            "heal median / best GB/s",
            f"{nbytes / median_seconds / 1e9:.2f} / {nbytes / best['seconds'] / 1e9:.2f}",
        ),
        ("gloo in place median GB/s (1 connection)", median_gloo),
        (f"raw TCP median GB/s ({' or '.join(map(str, counts))} connections)", median_raw),
        ("of which the byte transfer, best run (s)", f"{best['fetch_seconds']:.3f}"),
        ("tensors filled in place", f"{best['in_place']} of {best['tensors']}"),
        ("chunks fetched again", sum(r["refetches"] for r in runs)),
        ("peak extra RSS (MB)", max(r["peak_extra_rss_mb"] for r in runs)),
        ("ratio to gloo in place, per run", ", ".join(f"{x:.2f}" for x in gloo_ratios)),
        ("ratio to gloo in place, median (min, max)", spread(gloo_ratios)),
        ("ratio to raw, per run", ", ".join(f"{x:.2f}" for x in ratios)),
        ("ratio to raw, median (min, max)", spread(ratios)),
    ]
    report(
        "recovery: heal into a fresh process",
        rows,
        {
            "bench": "recovery",
            "state_mb": args.size_mb,
            "sources": args.sources,
            "runs": len(runs),
            "seconds": round(median_seconds, 4),
            "gb_per_s": round(nbytes / median_seconds / 1e9, 3),
            "best_gb_per_s": round(nbytes / best["seconds"] / 1e9, 3),
            "gloo_inplace_gb_per_s": round(median_gloo, 3),
            "ratio_to_gloo_inplace": round(statistics.median(gloo_ratios), 3),
            "ratio_to_gloo_inplace_min": round(min(gloo_ratios), 3),
            "ratio_to_gloo_inplace_max": round(max(gloo_ratios), 3),
            "raw_tcp_gb_per_s": round(median_raw, 3),
            "ratio_to_raw": round(statistics.median(ratios), 3),
            "ratio_to_raw_min": round(min(ratios), 3),
            "ratio_to_raw_max": round(max(ratios), 3),
            "peak_extra_rss_mb": round(max(r["peak_extra_rss_mb"] for r in runs), 1),
        },
    )


def tcp_ceiling(mtu: int = 1500) -> float:
    """The share of a capped link's rate that is TCP payload: the cap counts every
    packet's Ethernet header (14 bytes) besides its IP, TCP and timestamp headers
    (52), so of a 1,500-byte MTU's 1,514 bytes on the link 1,448 are data.

    >>> round(tcp_ceiling(), 4)
    0.9564
    """
    return (mtu - 52) / (mtu + 14)


def drive_links(args: argparse.Namespace) -> None:
    """K sources behind K capped links against one source behind one: the heal should
    add up the links (goal: at least 0.95 of K links, and of the most TCP can carry over
    them, `tcp_ceiling`)."""
    # A link per source, as if each sat on its own network port; its sending end capped.
    subnets = [f"10.{200 + i}.{os.getpid() % 250}" for i in range(args.sources)]
    tbf = f"rate {args.link_mbit}mbit burst 1mb latency 50ms"
    try:
        with (
            capped_links(f"phx{os.getpid() % 100000}", subnets, tbf) as links,
            serving(args, args.sources, links) as (addresses, digest),
        ):
            counts = sorted({1, args.sources})
            by_count = {k: heal_runs(args, addresses[:k], digest) for k in counts}
    except NoLink as e:
        raise SystemExit(
            f"cannot set up capped links: {e}; run as root where network namespaces are allowed"
        ) from None
    nbytes = by_count[1][0]["bytes"]
    gbps = {k: nbytes / min(r["seconds"] for r in runs) / 1e9 for k, runs in by_count.items()}
    speedup = gbps[args.sources] / gbps[1]
    of_links = gbps[args.sources] / (args.sources * args.link_mbit / 8e3)
    ceiling = tcp_ceiling()
    rows = [
        ("state", f"{nbytes / 2**20:.0f} MiB"),
        ("link cap per source (Mbit/s)", args.link_mbit),
        *[(f"{k} source(s) GB/s", v) for k, v in gbps.items()],
        (f"speedup of {args.sources} sources", speedup),
        (f"ratio to {args.sources} links", of_links),
        (f"ratio to what TCP carries over them ({ceiling:.3f} of a link)", of_links / ceiling),
    ]
    report(
        "recovery: K sources over capped links",
        rows,
        {
            "bench": "recovery_links",
            "state_mb": args.size_mb,
            "sources": args.sources,
            "link_mbit": args.link_mbit,
            "one_source_gb_per_s": round(gbps[1], 3),
            "gb_per_s": round(gbps[args.sources], 3),
            "speedup": round(speedup, 3),
            "ratio_to_links": round(of_links, 3),
            "ratio_to_tcp_ceiling": round(of_links / ceiling, 3),
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--sources", type=int, default=1)
    parser.add_argument("--connections-per-source", type=int, default=2)
    parser.add_argument(
        "--repeat", type=int, default=5, help="fresh receivers; the median ratio is reported"
    )
    parser.add_argument(
        "--role",
        choices=["driver", "source", "receiver", "gloo-sender", "gloo-receiver"],
        default="driver",
    )
    parser.add_argument(
        "--link-mbit",
        type=float,
        default=None,
        help="put each source behind its own veth link capped at this rate (needs root)",
    )
    parser.add_argument("--addresses", default="")
    parser.add_argument("--bind", default="127.0.0.1:0")
    parser.add_argument("--gloo-port", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="a small state and 2 runs: that it still runs"
    )
    args = parser.parse_args()
    if args.quick:
        args.size_mb, args.repeat = min(args.size_mb, 16), min(args.repeat, 2)
    roles = {"driver": drive, "source": run_source, "receiver": run_receiver}
    roles |= {"gloo-sender": run_gloo, "gloo-receiver": run_gloo}
    roles[args.role](args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
