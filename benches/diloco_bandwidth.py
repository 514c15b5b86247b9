"""What DiLoCo saves on the wire: 2 replica groups train the same MLP for the same
number of inner steps with phalanx DDP (an all-reduce of the gradients every step),
DiLoCo (of the pseudo-gradient every H steps) and DiLoCo with int8 codes.

    python benches/diloco_bandwidth.py --sync-every 8
    python benches/diloco_bandwidth.py --sync-every 8 --link-mbit 100   # as root

Bytes are the tensor bytes each group hands to `Manager.allreduce` during the
measured inner steps, per inner step. With `--link-mbit` (default 100; 0 skips it)
group b also runs in its own network namespace behind a veth link capped by tc in
both directions, and the wall time of the same inner steps is compared with DDP's
over that link; the link's own byte counters give the bytes on the wire. Where
namespaces cannot be made, `wall_ratio_on_slow_link` is null and the reason shown.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from harness import Link, capped_links, free_port, mlp_and_batches, report, stop, wait_for_http

WORKER = Path(__file__).resolve()
MODES = ("ddp", "diloco", "diloco-int8")


def run_worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    import phalanx

    torch.set_num_threads(1)
    model, batches = mlp_and_batches(args.width, hash(args.replica_id) % 1000)
    manager = phalanx.Manager(replica_id=args.replica_id, lighthouse=args.lighthouse)
    handed = [0]
    allreduce = manager.allreduce

    def counting(tensor, *rest, **kw):
        handed[0] += tensor.numel() * tensor.element_size()
        return allreduce(tensor, *rest, **kw)

    manager.allreduce = counting
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.worker == "ddp":
        net = phalanx.DistributedDataParallel(model, manager)
        optimizer = phalanx.Optimizer(manager, inner)
        optimizer.zero_grad()  # a first step, not measured: the groups meet in it
        nn.functional.mse_loss(net(batches[0][0]), batches[0][1]).backward()
        optimizer.step()
    else:
        net = model
        optimizer = phalanx.DiLoCo(
            manager,
            model,
            inner,
            sync_every=args.sync_every,
            quantize="int8" if args.worker == "diloco-int8" else None,
        )
    handed[0] = 0
    committed = 0
    started = time.perf_counter()
    for step in range(args.steps):
        x, y = batches[step % len(batches)]
        optimizer.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        outcome = optimizer.step()
        committed += bool(outcome) if args.worker == "ddp" else bool(outcome and outcome.committed)
    seconds = time.perf_counter() - started
    print(json.dumps({"bytes": handed[0], "seconds": seconds, "committed": committed}), flush=True)
    # Stay until the driver has every result (a group that leaves fails its peer's last
    # vote); the peer's leaving is expected from here on.
    sys.stdin.read()
    logging.getLogger("phalanx").setLevel(logging.ERROR)
    manager.shutdown()


def measure(mode: str, args: argparse.Namespace, lighthouse: str, link: Link | None = None) -> dict:
    """Runs the 2 groups of `mode`; returns the slower group's result."""
    procs = []
    for name in ("a", "b"):
        prefix: list[str] = []
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if link is not None:
            ip, dev = (link.here_ip, link.here) if name == "a" else (link.there_ip, link.there)
            env.update(MASTER_ADDR=ip, PHALANX_ADVERTISE_HOST=ip, GLOO_SOCKET_IFNAME=dev)
            if name == "b":
                prefix = ["ip", "netns", "exec", link.namespace]
        argv = [sys.executable, str(WORKER), "--worker", mode, "--replica-id", name]
        argv += ["--lighthouse", lighthouse, "--steps", str(args.steps)]
        argv += ["--sync-every", str(args.sync_every), "--width", str(args.width)]
        procs.append(
            subprocess.Popen(
                [*prefix, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
            )
        )
    results = []
    try:
        for p in procs:
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"a {mode} worker failed (exit code {p.wait(60)})")
            results.append(json.loads(line))
    finally:
        for p in procs:
            p.stdin.close()
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                stop(p)
    if any(r["committed"] == 0 for r in results):
        raise SystemExit(f"{mode}: a group committed nothing: {results}")
    return max(results, key=lambda r: r["seconds"])


@contextmanager
def lighthouse_at(host: str):
    address = f"{host}:{free_port()}"
    # --insecure: the link is a private veth pair between this host's namespaces.
    lighthouse = ["phalanx", "lighthouse", "--bind", address, "--min-replicas", "2", "--insecure"]
    proc = subprocess.Popen(
        [sys.executable, "-m", *lighthouse],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for_http(f"http://{address}/status", timeout=15.0)
        yield address
    finally:
        stop(proc)


def link_bytes(dev: str) -> int:
    """Bytes sent plus received on `dev` so far (both directions of the link)."""
    stats = Path("/sys/class/net") / dev / "statistics"
    return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())


def on_slow_link(args: argparse.Namespace) -> tuple[dict | None, str]:
    """Wall time and wire bytes of each mode over the capped link, or why not."""
    if not args.link_mbit:
        return None, "skipped (--link-mbit 0)"
    try:
        # Group b in a namespace of its own, on a link capped both ways.
        subnet = f"10.{210 + os.getpid() % 40}.{os.getpid() % 250}"
        tbf = f"rate {args.link_mbit}mbit burst 64kb latency 400ms"
        with (
            capped_links(f"phd{os.getpid() % 100000}", [subnet], tbf, cap_here=True) as [link],
            lighthouse_at(link.here_ip) as lighthouse,
        ):
            out = {}
            for mode in MODES:
                before = link_bytes(link.here)
                result = measure(mode, args, lighthouse, link)
                result["wire_bytes"] = link_bytes(link.here) - before
                out[mode] = result
            return out, ""
    except OSError as e:
        return None, f"no network namespaces here ({e}); run as root on Linux"


def drive(args: argparse.Namespace) -> None:
    with lighthouse_at("127.0.0.1") as lighthouse:
        loopback = {mode: measure(mode, args, lighthouse) for mode in MODES}
    slow, why_not = on_slow_link(args)
    per_step = {mode: r["bytes"] / args.steps for mode, r in loopback.items()}
    reduction = per_step["ddp"] / per_step["diloco"]
    reduction_int8 = per_step["ddp"] / per_step["diloco-int8"]
    wall_ratio = None if slow is None else slow["diloco"]["seconds"] / slow["ddp"]["seconds"]
    params = sum(p.numel() for p in mlp_and_batches(args.width, 0)[0].parameters())
    H = args.sync_every
    rows = [
        ("model", f"MLP of {params / 1e6:.2f}M parameters, {args.steps} inner steps, 2 groups"),
        *[(f"bytes per inner step, {mode}", round(per_step[mode])) for mode in MODES],
        (f"reduction, DiLoCo (target {0.9 * H:.1f})", reduction),
        (f"reduction, DiLoCo int8 (target {3.6 * H:.1f})", reduction_int8),
        *[(f"wall on loopback, {mode} (s)", r["seconds"]) for mode, r in loopback.items()],
    ]
    if slow is None:
        rows.append(("slow link", why_not))
    else:
        rows += [
            (f"wall on {args.link_mbit:g} Mbit/s, {m} (s)", r["seconds"]) for m, r in slow.items()
        ]
        rows += [
            (f"wire bytes per inner step, {m}", round(r["wire_bytes"] / args.steps))
            for m, r in slow.items()
        ]
        rows.append(("wall ratio DiLoCo / DDP on the slow link", wall_ratio))
        rows.append(
            (
                "wall ratio DiLoCo int8 / DDP",
                slow["diloco-int8"]["seconds"] / slow["ddp"]["seconds"],
            )
        )
    result = {
        "bench": "diloco",
        "sync_every": H,
        "bytes_per_step_ddp": round(per_step["ddp"]),
        "bytes_per_step_diloco": round(per_step["diloco"]),
        "reduction": round(reduction, 3),
        "wall_ratio_on_slow_link": None if wall_ratio is None else round(wall_ratio, 3),
        "bytes_per_step_diloco_int8": round(per_step["diloco-int8"]),
        "reduction_int8": round(reduction_int8, 3),
        "link_mbit": args.link_mbit if slow is not None else None,
    }
    report(f"DiLoCo bandwidth, sync every {H} inner steps", rows, result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32, help="inner steps measured")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--link-mbit", type=float, default=100.0)
    parser.add_argument("--worker", choices=MODES)
    parser.add_argument("--replica-id", default="")
    parser.add_argument("--lighthouse", default="")
    args = parser.parse_args()
    if args.steps % args.sync_every:
        parser.error("--steps must be a multiple of --sync-every, so that every round is synced")
    if args.worker:
        run_worker(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
