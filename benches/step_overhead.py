"""What phalanx adds to a training step: the same model and data on 2 replica groups,
phalanx DDP (quorum, fault-tolerant all-reduce, commit vote) against plain
torch.nn.parallel.DistributedDataParallel over gloo with no fault tolerance.

    python benches/step_overhead.py --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import free_port, lighthouse_process, mlp_and_batches, report, slowest_median

WORKER = Path(__file__).resolve()


def run_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    model, batches = mlp_and_batches(args.width, args.rank)
    if args.mode == "torch":
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2
        )
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(x, y):
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
    else:
        import phalanx

        manager = phalanx.Manager(replica_id=f"g{args.rank}", lighthouse=args.lighthouse)
        ddp = phalanx.DistributedDataParallel(model, manager)
        optimizer = phalanx.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.01))

        def step(x, y):
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()

    times = []
    for i in range(args.warmup + args.steps):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        step(x, y)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    print(json.dumps({"median_ms": statistics.median(times) * 1e3}), flush=True)
    if args.mode == "torch":
        dist.destroy_process_group()
    else:
        manager.shutdown()


def measure(mode: str, args: argparse.Namespace, lighthouse: str = "") -> float:
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                "--worker",
                mode,
                "--rank",
                str(rank),
                "--port",
                str(port),
                "--lighthouse",
                lighthouse,
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--width",
                str(args.width),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in range(2)
    ]
    return slowest_median(procs, mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--worker", choices=["torch", "phalanx"])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--lighthouse", default="")
    args = parser.parse_args()
    if args.worker:
        args.mode = args.worker
        run_worker(args)
        return

    baseline = measure("torch", args)
    with lighthouse_process("--min-replicas", "2") as (address, _):
        ours = measure("phalanx", args, address)
    params = sum(p.numel() for p in mlp_and_batches(args.width, 0)[0].parameters())
    result = {
        "bench": "step_overhead",
        "phalanx_ms": round(ours, 3),
        "baseline_ms": round(baseline, 3),
        "ratio": round(ours / baseline, 3),
    }
    report(
        f"step time, 2 groups, MLP of {params / 1e6:.1f}M parameters, median of {args.steps}",
        [
            ("torch DDP over gloo (ms)", result["baseline_ms"]),
            ("phalanx DDP (ms)", result["phalanx_ms"]),
            ("ratio", result["ratio"]),
        ],
        result,
    )


if __name__ == "__main__":
    main()
