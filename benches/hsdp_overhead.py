"""What phalanx adds to an HSDP step: the same model and data on 2 replica groups of
2 ranks, phalanx HSDP (FSDP2 inside a group; quorum, fault-tolerant all-reduce of the
gradient shards across groups, commit vote) against plain FSDP2 HSDP over a 2-D device
mesh (replicate x shard) with no fault tolerance, all over gloo.

    python benches/hsdp_overhead.py --steps 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from harness import (
    add_worker_arguments,
    free_port,
    lighthouse_process,
    passed_on,
    report,
    slowest_median,
    start_worker,
)

WORKER = Path(__file__).resolve()
GROUPS, RANKS = 2, 2


def model_and_data(group: int, rank: int, width: int, depth: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]
    model = nn.Sequential(nn.Linear(256, width), *layers, nn.Linear(width, 1))
    g = torch.Generator().manual_seed(group * RANKS + rank)
    batches = [(torch.randn(64, 256, generator=g), torch.randn(64, 1, generator=g))] * 4
    return model, batches


def run_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    model, batches = model_and_data(args.group, args.rank, args.width, args.depth)
    units = list(model)[1:-1]
    if args.worker == "torch":
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{args.port}",
            rank=args.group * RANKS + args.rank,
            world_size=GROUPS * RANKS,
        )
        mesh = init_device_mesh("cpu", (GROUPS, RANKS), mesh_dim_names=("replicate", "shard"))
        for unit in units:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        import phalanx

        manager = phalanx.Manager(
            replica_id=f"g{args.group}",
            lighthouse=args.lighthouse,
            group_rank=args.rank,
            group_world_size=RANKS,
            store_addr="127.0.0.1",
            store_port=args.port,
        )
        model = phalanx.fully_shard_hsdp(model, manager, units=units)
        optimizer = phalanx.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.01))

    times = []
    for i in range(args.warmup + args.steps):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    print(json.dumps({"median_ms": statistics.median(times) * 1e3}), flush=True)
    if args.worker == "phalanx":
        manager.shutdown()
    dist.destroy_process_group()


def measure(mode: str, args: argparse.Namespace, lighthouse: str = "") -> float:
    """The slowest rank's median step time."""
    ports = [free_port() for _ in range(GROUPS)]
    procs = []
    for group in range(GROUPS):
        for rank in range(RANKS):
            # One rendezvous for the whole torch job; one store per group for phalanx.
            port = ports[0] if mode == "torch" else ports[group]
            worker = start_worker(
                WORKER,
                worker=mode,
                group=group,
                rank=rank,
                port=port,
                lighthouse=lighthouse,
                **passed_on(args, "steps", "warmup", "width", "depth"),
            )
            procs.append(worker)
    return slowest_median(procs, mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--group", type=int, default=0)
    add_worker_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return

    baseline = measure("torch", args)
    with lighthouse_process("--min-replicas", str(GROUPS)) as (address, _):
        ours = measure("phalanx", args, address)
    model = model_and_data(0, 0, args.width, args.depth)[0]
    params = sum(p.numel() for p in model.parameters())
    result = {
        "bench": "hsdp_overhead",
        "phalanx_ms": round(ours, 3),
        "baseline_ms": round(baseline, 3),
        "ratio": round(ours / baseline, 3),
    }
    report(
        f"HSDP step time, {GROUPS} groups x {RANKS} ranks, MLP of {params / 1e6:.1f}M "
        f"parameters in {args.depth + 1} FSDP units, median of {args.steps}",
        [
            ("FSDP2 HSDP, 2-D mesh over gloo (ms)", result["baseline_ms"]),
            ("phalanx HSDP (ms)", result["phalanx_ms"]),
            ("ratio", result["ratio"]),
        ],
        result,
    )


if __name__ == "__main__":
    main()
