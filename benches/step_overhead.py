"""What phalanx adds to a training step: the same model and data on N replica groups
(--groups, 2 by default), phalanx DDP (quorum, fault-tolerant all-reduce, commit vote)
against plain torch.nn.parallel.DistributedDataParallel over gloo with no fault
tolerance, on a world of N ranks.

    python benches/step_overhead.py --steps 200 --rounds 5 --groups 3

Each round runs both, one after the other; the ratio reported is the median of the
rounds' ratios, with their min and max. On a busy machine the step time swings with
the load; the CPU each rank spends per step (all its threads) is steadier, and is
what phalanx adds to a step on a machine with cores to spare for it. That CPU is also
split by thread (the main thread, gloo's, phalanx-core's: its manager server, lighthouse
client and heartbeats), so a ratio above 1 says where it comes from.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import NamedTuple

from harness import (
    add_worker_arguments,
    free_port,
    lighthouse_process,
    mlp_and_batches,
    passed_on,
    report,
    start_worker,
    timed_steps,
    worker_results,
)

WORKER = Path(__file__).resolve()


def run_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    model, batches = mlp_and_batches(args.width, args.rank)
    if args.worker == "torch":
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{args.port}",
            rank=args.rank,
            world_size=args.groups,
        )
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        import phalanx

        # Each round a job of its own on the one lighthouse: a round's groups start at
        # step 0, which in the job of the round before would be a rollback.
        manager = phalanx.Manager(
            replica_id=f"g{args.rank}",
            lighthouse=args.lighthouse,
            job=args.job,
            job_rules=f"min_replicas={args.groups}",
        )
        ddp = phalanx.DistributedDataParallel(model, manager)
        optimizer = phalanx.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.01))

    def step(x, y):
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()

    times = timed_steps(step, batches, args.warmup, args.steps)
    print(json.dumps(times._asdict()), flush=True)
    if args.worker == "torch":
        dist.destroy_process_group()
    else:
        manager.shutdown()


class Sample(NamedTuple):
    step_ms: float
    cpu_ms: float
    threads_ms: dict[str, float]


def measure(mode: str, args: argparse.Namespace, lighthouse: str = "", job: str = "") -> Sample:
    port = free_port()
    procs = [
        start_worker(
            WORKER,
            worker=mode,
            rank=rank,
            port=port,
            lighthouse=lighthouse,
            job=job,
            **passed_on(args, "steps", "warmup", "width", "groups"),
        )
        for rank in range(args.groups)
    ]
    results = worker_results(procs, mode)
    # The job's step time is its slowest rank's; CPU is what a rank spends per step.
    names = {name for r in results for name in r["threads_ms"]}
    return Sample(
        max(r["median_ms"] for r in results),
        statistics.mean(r["cpu_ms"] for r in results),
        {name: statistics.mean(r["threads_ms"].get(name, 0.0) for r in results) for name in names},
    )


def thread_rows(rounds: list[tuple[Sample, Sample]]) -> dict[str, dict[str, float]]:
    """Per thread name, the median over the rounds of a rank's CPU per step in it, for
    each side, busiest first: where the CPU ratio comes from. Threads under a
    microsecond a step on both sides are left out."""
    names = {name for round_ in rounds for side in round_ for name in side.threads_ms}
    rows = {
        name: {
            side: round(statistics.median(r[i].threads_ms.get(name, 0.0) for r in rounds), 3)
            for i, side in enumerate(("torch", "phalanx"))
        }
        for name in names
    }
    busy = {name: ms for name, ms in rows.items() if max(ms.values()) >= 0.001}
    return dict(sorted(busy.items(), key=lambda row: -max(row[1].values())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--rounds", type=int, default=5, help="torch and phalanx runs, taken in turn"
    )
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument(
        "--groups", type=int, default=2, help="replica groups (torch: ranks of one world)"
    )
    parser.add_argument("--quick", action="store_true", help="a few steps, one round")
    parser.add_argument("--job", default="", help=argparse.SUPPRESS)
    add_worker_arguments(parser)
    args = parser.parse_args()
    if args.groups < 2:
        parser.error("--groups must be 2 or more: with one group there is nothing to reduce")
    if args.quick:
        args.steps, args.warmup, args.rounds, args.width = 20, 5, 1, 256
    if args.worker:
        run_worker(args)
        return

    # Interleaved, so that a machine busy for a while weighs on both sides alike.
    rounds = []
    with lighthouse_process() as (address, _):
        for n in range(args.rounds):
            rounds.append((measure("torch", args), measure("phalanx", args, address, f"round{n}")))
    step_ratios = [ours.step_ms / base.step_ms for base, ours in rounds]
    cpu_ratios = [ours.cpu_ms / base.cpu_ms for base, ours in rounds]
    median = statistics.median
    params = sum(p.numel() for p in mlp_and_batches(args.width, 0)[0].parameters())
    result = {
        "bench": "step_overhead",
        "phalanx_ms": round(median(ours.step_ms for _, ours in rounds), 3),
        "baseline_ms": round(median(base.step_ms for base, _ in rounds), 3),
        "ratio": round(median(step_ratios), 3),
        "ratio_min": round(min(step_ratios), 3),
        "ratio_max": round(max(step_ratios), 3),
        "phalanx_cpu_ms": round(median(ours.cpu_ms for _, ours in rounds), 3),
        "baseline_cpu_ms": round(median(base.cpu_ms for base, _ in rounds), 3),
        "cpu_ratio": round(median(cpu_ratios), 3),
        "cpu_ratio_min": round(min(cpu_ratios), 3),
        "cpu_ratio_max": round(max(cpu_ratios), 3),
        "threads_cpu_ms": thread_rows(rounds),
        "rounds": args.rounds,
        "groups": args.groups,
    }
    report(
        f"step time, {args.groups} groups, MLP of {params / 1e6:.1f}M parameters, median of "
        f"{args.steps} steps; medians of {args.rounds} interleaved rounds",
        [
            ("torch DDP over gloo (ms)", result["baseline_ms"]),
            ("phalanx DDP (ms)", result["phalanx_ms"]),
            ("ratio", f"{result['ratio']} ({result['ratio_min']}–{result['ratio_max']})"),
            ("CPU per step, torch DDP (ms)", result["baseline_cpu_ms"]),
            ("CPU per step, phalanx (ms)", result["phalanx_cpu_ms"]),
            (
                "CPU ratio",
                f"{result['cpu_ratio']} ({result['cpu_ratio_min']}–{result['cpu_ratio_max']})",
            ),
            *(
                (f"  thread {name}: torch / phalanx (ms)", f"{ms['torch']} / {ms['phalanx']}")
                for name, ms in result["threads_cpu_ms"].items()
            ),
        ],
        result,
    )


if __name__ == "__main__":
    main()
